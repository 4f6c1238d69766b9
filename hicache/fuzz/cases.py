"""The vocabulary of the hostile-message generator: ``Case`` (one message and the error codes
it must get), ``Deferred`` (a case built from an earlier step's reply), ``World`` (what the
generator knows about rows and owners), and ``MessageBuilder`` — the state and helpers every
kind of hostile message is built with (request ids, headers, the attacker's rows, well-formed
fields of each command). Pure data and encoding: nothing here sends anything.
"""
from __future__ import annotations

import json
import random
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np

from hicache.core import protocol as P
from hicache.core.layout import Layout


@dataclass
class Case:
    """One message to send. ``expect``: error codes it must get (empty set = any error);
    ``setup``: a set-up step that must succeed; ``on_ok(header)`` records what a set-up step
    returned (rows allocated ...)."""

    name: str
    peer: str
    frames: list[bytes]
    expect: frozenset[str] = frozenset()
    setup: bool = False
    on_ok: Callable[[dict[str, Any]], None] | None = None
    rid: Any = None  # the id the reply carries (None when the header has none)


@dataclass
class World:
    """What the generator knows: the layout, row counts and who holds which host rows."""

    layout: Layout
    host_rows: dict[str, int]
    dev_rows: dict[str, int]  # the attacker's (and victim's) device rows per space
    victim: dict[str, list[int]]
    attacker: dict[str, list[int]]
    attacker_fields: dict[str, Any]  # its register fields (for near-miss registrations)
    spare: dict[str, list[int]] = field(default_factory=dict)  # attacker rows in a sequence
    sparse: dict[str, Any] | None = None  # the victim's sparse request (sparse_attacks), if any
    anon_token: int | None = None  # the stranger's intake: its pools, handed in, never registered

    def free_rows(self, space: str) -> list[int]:
        taken = set(self.victim.get(space, ())) | set(self.attacker.get(space, ()))
        taken |= set(self.spare.get(space, ()))
        return [r for r in range(self.host_rows[space]) if r not in taken]


def _json(obj: Any) -> bytes:
    return json.dumps(obj, separators=(",", ":")).encode()


def _ids(xs: Sequence[int]) -> bytes:
    return np.asarray(xs, dtype="<i8").tobytes()


E = frozenset
BAD_ROWS, NOT_OWNER, BAD_FIELD, BAD_FRAME = E({"bad_rows"}), E({"not_owner"}), E({"bad_field"}), \
    E({"bad_frame"})
NOT_REG = E({"not_registered"})
INT64_MAX, INT64_MIN = (1 << 63) - 1, -(1 << 63)


@dataclass
class Deferred(Case):
    """A case whose frames depend on an earlier step's reply; ``build()`` makes the real one."""

    build: Callable[[], Case] | None = None

    def resolve(self) -> Case:
        assert self.build is not None
        c = self.build()
        c.setup = self.setup
        if self.on_ok is not None:
            c.on_ok = self.on_ok
        return c


class MessageBuilder:
    """State and helpers of the generator: the world, the rng, spaces and pools, request ids,
    ``msg`` (a header plus frames as a ``Case``), ``transfer`` (a backup / load case) and
    ``valid`` (fields and frames of a well-formed command of the attacker)."""

    def __init__(self, world: World, rng: random.Random) -> None:
        self.w = world
        self.rng = rng
        self.spaces = sorted(world.host_rows)
        self.pools = sorted(world.layout.pools)
        self.token_pools = [p for p, s in world.layout.pools.items() if s.token_granular]
        self.row_pools = [p for p, s in world.layout.pools.items() if not s.token_granular]
        self._id = 1 << 50

    # ------------------------------------------------------------------ helpers
    def rid(self) -> int:
        self._id += 1
        return self._id

    def msg(self, name: str, peer: str, cmd: str, fields: dict[str, Any] | None,
            frames: Sequence[bytes] = (), expect: frozenset[str] = E(), **kw: Any) -> Case:
        rid = self.rid()
        h = {"v": 1, "cmd": cmd, "id": rid}
        h.update(fields or {})
        head = _json(h)
        if len(head) > P.MAX_HEADER_BYTES:
            rid = None  # the daemon does not parse a header that large: the reply has no id
        return Case(name, peer, [head, *frames], expect, rid=rid, **kw)

    def space(self) -> str:
        return self.rng.choice(self.spaces)

    def own(self, space: str, n: int = 1) -> list[int]:
        rows = self.w.attacker[space]
        return self.rng.sample(rows, min(n, len(rows)))

    def dev(self, space: str, n: int = 1) -> list[int]:
        return self.rng.sample(range(self.w.dev_rows[space]), min(n, self.w.dev_rows[space]))

    def transfer(self, name: str, cmd: str, space: str, dev: list[int], host: list[int],
                 expect: frozenset[str], peer: str = "attacker", item: dict | None = None,
                 frames: list[bytes] | None = None) -> Case:
        src, dst = (dev, host) if cmd == "backup" else (host, dev)
        it = {"space": space, "src": 0, "dst": 1} if item is None else item
        fr = [_ids(src), _ids(dst)] if frames is None else frames
        return self.msg(name, peer, cmd, {"items": [it]}, fr, expect)

    def cmd2(self) -> str:
        return self.rng.choice(("backup", "load"))

    def valid(self, cmd: str, peer_rows: bool = True) -> tuple[dict[str, Any], list[bytes]]:
        """Fields and frames of a well-formed command of the attacker."""
        s = "page" if "page" in self.spaces else self.spaces[0]
        if cmd in ("backup", "load"):
            d, hst = self.dev(s), self.own(s)
            src, dst = (d, hst) if cmd == "backup" else (hst, d)
            return {"items": [{"space": s, "src": 0, "dst": 1}]}, [_ids(src), _ids(dst)]
        if cmd == "free":
            return {"rows": {s: 0}}, [_ids(self.own(s))]
        if cmd == "alloc":
            return {"counts": {s: 1}}, []
        if cmd == "swap_out":
            return {"slot": 0}, []
        if cmd == "swap_in":
            return {"host_row": self.own("req_slot")[0] if "req_slot" in self.spaces else 0,
                    "slot": 0}, []
        if cmd == "clear_slot":
            return {"slots": [0]}, []
        if cmd == "poll_acks":
            return {"max": 8}, []
        if cmd == "register":
            return dict(self.w.attacker_fields), []
        if cmd == "hand_in":
            return {"count": 1}, []
        return {}, []
