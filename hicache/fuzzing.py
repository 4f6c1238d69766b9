"""Reliability tooling shared by ``hicache bench fuzz`` / ``bench soak`` and the reliability tests.

* ``DaemonRunner(address, ...)`` — a CPU-mode ``hicache serve`` subprocess on a fixed address
  that can be killed (SIGKILL) and started again on the same address.
* ``ShmBuffers(layout, rows)`` — a worker's "device" pools in one 0600 shared-memory file, the
  wire handles ``register`` takes, and numpy views; no torch, so a client process starts in a
  fraction of a second (crash and soak clients are many short-lived processes).
* ``Pattern`` — row content derived from a 64-bit salt (client, row, version): fill rows of every
  layer of a pool, count the rows that differ.
* ``RawPeer`` — a DEALER that sends arbitrary frames and reads the next reply (no validation on
  our side, so hostile messages reach the daemon as they are).
* ``Hostile`` — the generator of malformed and hostile messages, one ``Case`` (or a short
  sequence with set-up steps) at a time, each with the error codes it must get.
* ``run_fuzz(address, messages, seed)`` — victim, attacker and strangers against a live daemon,
  then the checks: every message answered with an error, the daemon alive, host row accounting
  exact, allocator invariants, the victim's rows unchanged byte for byte.
* ``daemon_check(client)`` — the invariant checks through ``stats`` (what any test can ask).

Nothing here is imported by the daemon; everything talks to it through the wire protocol.
"""
from __future__ import annotations

import json
import mmap
import os
import random
import secrets
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterable, Mapping, Sequence

import numpy as np
import zmq

from hicache import protocol as P
from hicache.daemon_process import DaemonProcess
from hicache.layout import Layout, build_layout, preset

ROOT = Path(__file__).resolve().parents[1]
ALIGN = 4096
_M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- daemon process
class DaemonRunner(DaemonProcess):
    """``hicache serve --device cpu`` on ``address`` (log level warning, run from the checkout);
    ``start()`` waits until it answers. The shared ``DaemonProcess`` with this module's defaults."""

    def __init__(self, address: str, *, preset_name: str = "dsv4-tiny",
                 device_rows: str = "page=16,swa_page=8,req_slot=4",
                 host: Sequence[str] = ("--host-ratio", "2"), heartbeat_timeout: float = 10.0,
                 extra: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None, socket_flag: bool = True,
                 client_kw: Mapping[str, Any] | None = None) -> None:
        """``socket_flag=False``: no ``--socket`` (the daemon picks its default, which must be
        ``address``). ``client_kw``: extra ``Client`` arguments of the readiness probe (keys)."""
        super().__init__(address, device="cpu", preset=preset_name, device_rows=device_rows,
                         host=host, heartbeat_timeout=heartbeat_timeout, log_level="warning",
                         extra=extra, env=env, log_path=log_path, socket_flag=socket_flag,
                         cwd=ROOT, ready_timeout=90.0, probe_kw=client_kw)


def private_address(prefix: str = "hcr-") -> tuple[str, str]:
    """(ipc address, its directory): a fresh 0700 directory under /tmp (ipc paths are short)."""
    import tempfile

    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o700)
    return f"ipc://{d}/d.sock", d


# ----------------------------------------------------------------------------- shm "device" pools
def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _space_rows(layout: Layout, rows: Mapping[str, int]) -> dict[str, int]:
    return {s: n for s, n in rows.items() if layout.space_pools(s)}


class ShmBuffers:
    """Every pool of ``layout`` in one 0600 file under ``shm_dir``: per pool, its layers one
    after another (4 KiB-aligned), so ``view(pool)`` is one ``[layers, rows, row_bytes]`` array.
    ``handles()`` is the ``buffers`` field of ``register``. ``close()`` unlinks the file."""

    def __init__(self, layout: Layout, rows: Mapping[str, int], shm_dir: str = "/dev/shm",
                 tag: str = "rel") -> None:
        self.layout = layout
        self.rows = {p.index: int(rows[p.index]) for p in layout.pools.values()}
        plan, end = {}, 0
        for name, spec in layout.pools.items():
            n = self.rows[spec.index]
            stride = _align(n * spec.page_bytes)
            plan[name] = (end, stride, n, spec.page_bytes, spec.num_layers)
            end += stride * spec.num_layers
        self.path = os.path.join(shm_dir, f"hicache-dev-{os.getpid()}-{tag}-"
                                          f"{secrets.token_hex(4)}")
        fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(end, ALIGN))
            self._mm: mmap.mmap | None = mmap.mmap(fd, max(end, ALIGN))
        except BaseException:
            os.close(fd)
            os.unlink(self.path)
            raise
        os.close(fd)
        self.plan = plan
        self._views: dict[str, np.ndarray] = {}
        for name, (off, stride, n, rb, layers) in plan.items():
            self._views[name] = np.ndarray((layers, n, rb), dtype=np.uint8, buffer=self._mm,
                                           offset=off, strides=(stride, rb, 1))

    def view(self, pool: str) -> np.ndarray:
        return self._views[pool]

    def handles(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for name, (off, stride, n, rb, layers) in self.plan.items():
            out[name] = [{"kind": "shm", "path": self.path, "offset": off + i * stride,
                          "rows": n, "row_bytes": rb} for i in range(layers)]
        return out

    def register_fields(self) -> dict[str, Any]:
        return {"layout": self.layout.to_dict(), "device_rows": dict(self.rows),
                "buffers": self.handles(), "mode": "cpu"}

    def close(self) -> None:
        self._views = {}
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the unmap waits for it
                pass
            self._mm = None
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    def __enter__(self) -> "ShmBuffers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- row content
def mix64(*parts: int) -> int:
    """A well-mixed 64-bit word of ``parts`` (splitmix64 finaliser over a running hash)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _M64
        x ^= x >> 29
    return x


class Pattern:
    """Row content ``base[pool][layer] XOR salt``: ``base`` is a seeded random row of uint64 per
    pool and layer (a row of another pool or layer does not match), ``salt`` one word per
    (client, row, version) (a stale or foreign row does not match). Rows must be multiples of
    8 bytes (every DSV4 pool row is)."""

    def __init__(self, layout: Layout, pools: Iterable[str], seed: int = 0) -> None:
        self.pools = list(pools)
        self.base: dict[str, np.ndarray] = {}
        for i, name in enumerate(self.pools):
            spec = layout.pool(name)
            if spec.page_bytes % 8:
                raise ValueError(f"pool {name}: rows of {spec.page_bytes} bytes are not words")
            g = np.random.default_rng([seed, i])
            self.base[name] = g.integers(0, 1 << 63, size=(spec.num_layers, spec.page_bytes // 8),
                                         dtype=np.uint64)

    @staticmethod
    def _words(view: np.ndarray) -> np.ndarray:
        return view.view(np.uint64)

    def fill(self, bufs: ShmBuffers, rows: Sequence[int], salts: Sequence[int]) -> None:
        s = np.asarray(salts, dtype=np.uint64)
        for name in self.pools:
            w = self._words(bufs.view(name))
            b = self.base[name]
            for j, r in enumerate(rows):
                w[:, r, :] = b ^ s[j]

    def scribble(self, bufs: ShmBuffers, rows: Sequence[int], salt: int) -> None:
        """Overwrite ``rows`` with content no valid row has (before a load into them)."""
        for name in self.pools:
            w = self._words(bufs.view(name))
            for r in rows:
                w[:, r, :] = np.uint64(salt)

    def bad_rows(self, bufs: ShmBuffers, rows: Sequence[int], salts: Sequence[int]) -> list[int]:
        """Positions ``j`` whose row ``rows[j]`` does not hold the content of ``salts[j]``."""
        s = np.asarray(salts, dtype=np.uint64)
        bad: set[int] = set()
        for name in self.pools:
            w = self._words(bufs.view(name))
            b = self.base[name]
            for j, r in enumerate(rows):
                if j not in bad and not np.array_equal(w[:, r, :], b ^ s[j]):
                    bad.add(j)
        return sorted(bad)


# ----------------------------------------------------------------------------- raw peer
class RawPeer:
    """One DEALER identity that sends frames as given and reads replies (acks are kept aside)."""

    def __init__(self, address: str, name: str, ctx: zmq.Context | None = None) -> None:
        self.address = address
        self.ident = f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
        self._ctx = ctx or zmq.Context.instance()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, self.ident.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.connect(address)
        self.sock = s
        self._ids = 1 << 40  # far from anything a Client would use
        self.acks = 0

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def send(self, frames: Sequence[bytes]) -> None:
        self.sock.send_multipart(list(frames), copy=True)

    def reply(self, timeout: float, want_id: Any = "any") -> dict[str, Any] | None:
        """The next reply header (skipping acks, and replies whose id is not ``want_id`` when it
        is given), or None when nothing came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart()
            h, arrays = P.decode_reply(frames)
            if h.get("k") == "ack":
                self.acks += 1
                continue
            if want_id != "any" and h.get("id") not in (want_id, None):
                continue  # a late reply to something that timed out
            h["_arrays"] = [list(a) for a in arrays]
            return h

    def call(self, cmd: str, fields: dict[str, Any] | None = None, arrays: Iterable[Any] = (),
             timeout: float = 10.0) -> dict[str, Any]:
        """A well-formed command; raises RuntimeError unless it got an ok reply."""
        rid = self.next_id()
        self.send(P.encode_request(cmd, rid, fields, arrays))
        h = self.reply(timeout, rid)
        if h is None:
            raise RuntimeError(f"{cmd}: no reply within {timeout} s")
        if not h.get("ok"):
            raise RuntimeError(f"{cmd} refused: {h.get('error')}")
        return h

    def close(self) -> None:
        self.sock.close(0)


# ----------------------------------------------------------------------------- invariants
def daemon_check(client: Any, expect_used: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Invariant checks through ``stats``: per space used + free = rows and (when given) used =
    ``expect_used``; nothing pending a free; ``stats`` with ``check`` runs the pool group's
    ``check_invariants`` (free and owned rows partition each space, owner counts exact) when
    the daemon offers it. Returns {"ok": bool, "problems": [...], "spaces": ..., "deep": ...}."""
    from hicache.client import CommandRefused

    problems: list[str] = []
    deep: Any = "unavailable"
    try:
        h, _ = client.call("stats", {"check": True})
        deep = h.get("invariants", "unavailable")
        if deep not in ("ok", "unavailable"):
            problems.append(f"check_invariants: {deep}")
    except CommandRefused as e:
        if e.code != "bad_field":  # an older daemon without the check field
            raise
        h, _ = client.call("stats")
    spaces = h["host"]["spaces"]
    for s, st in spaces.items():
        if st["used"] + st["free"] != st["rows"]:
            problems.append(f"space {s}: used {st['used']} + free {st['free']} != {st['rows']}")
        if expect_used is not None and st["used"] != expect_used.get(s, 0):
            problems.append(f"space {s}: {st['used']} rows used, expected "
                            f"{expect_used.get(s, 0)}")
    for s, n in h.get("pending_free", {}).items():
        if n:
            problems.append(f"space {s}: {n} rows still pending a free")
    return {"ok": not problems, "problems": problems, "deep": deep,
            "spaces": {s: {k: st[k] for k in ("rows", "used", "free")} for s, st in spaces.items()},
            "workers": h.get("workers"), "clients": h.get("clients"), "stats": h}


def metric_total(stats: Mapping[str, Any], sample: str, **labels: str) -> float:
    """Sum of a metric sample in a ``stats`` reply, over entries matching ``labels``."""
    total = 0.0
    for e in stats.get("metrics", {}).get(sample, []):
        if all(e["labels"].get(k) == v for k, v in labels.items()):
            total += e["value"] or 0.0
    return total


# ----------------------------------------------------------------------------- hostile messages
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


class Hostile:
    """Malformed and hostile messages (see ``KINDS``). ``next()`` returns a list of cases: one
    hostile message, or a few set-up steps and then the hostile one (double free, use after
    free). Peers: ``attacker`` (registered, holds rows), ``anon`` (never registers), ``ghost``
    (registered once, then unregistered)."""

    def __init__(self, world: World, rng: random.Random,
                 kinds: Sequence[str] | None = None) -> None:
        """``kinds``: draw only these (equal weights); default every kind of ``KINDS``."""
        self.w = world
        self.rng = rng
        self.spaces = sorted(world.host_rows)
        self.pools = sorted(world.layout.pools)
        self.token_pools = [p for p, s in world.layout.pools.items() if s.token_granular]
        self.row_pools = [p for p, s in world.layout.pools.items() if not s.token_granular]
        self._id = 1 << 50
        table = self.KINDS if kinds is None else [(n, 1.0) for n in kinds]
        self._fns = [getattr(self, "k_" + n) for n, _ in table]
        self._weights = [w for _, w in table]

    # name, weight
    KINDS = (
        ("random_bytes", 6), ("not_object", 2), ("bad_utf8", 1), ("deep_json", 1),
        ("bad_version", 2), ("bad_id", 2), ("unknown_command", 2), ("unknown_field", 2),
        ("missing_field", 2), ("wrong_type", 8), ("ragged_frame", 2), ("missing_frame", 3),
        ("extra_frames", 3), ("too_many_frames", 1), ("long_list", 1), ("oversize_header", 0.05),
        ("huge_count", 3), ("negative_count", 2), ("unknown_space", 2), ("bad_request_id", 2),
        ("negative_ids", 4), ("out_of_range_ids", 5), ("duplicate_ids", 4), ("length_mismatch", 4),
        ("unknown_pool", 3), ("bad_item", 4), ("token_misuse", 3), ("foreign_rows", 6),
        ("free_rows_of_nobody", 3), ("double_free", 2), ("use_after_free", 2),
        ("mixed_ownership", 3), ("bad_slot", 3), ("bad_host_row", 3), ("bad_draft", 2),
        ("bad_poll", 2), ("register_again", 1), ("bad_register", 5), ("before_register", 5),
        ("after_unregister", 4),
    )

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
        return {}, []

    # ------------------------------------------------------------------ frame and header level
    def k_random_bytes(self) -> list[Case]:
        r = self.rng
        n = r.choice((0, 1, 3, 8, 17, 64, 300))
        frames = [r.randbytes(n)] + [r.randbytes(r.choice((0, 5, 8, 16))) for _ in
                                     range(r.choice((0, 0, 1, 3)))]
        return [Case("random_bytes", r.choice(("attacker", "anon")), frames,
                     E({"bad_header", "bad_frame", "bad_version"}))]

    def k_not_object(self) -> list[Case]:
        body = self.rng.choice([b"[1,2,3]", b'"heartbeat"', b"42", b"null", b"true", b"[]",
                                b'[{"v":1,"cmd":"stats","id":1}]', b"1e999"])
        return [Case("not_object", "attacker", [body], E({"bad_header"}))]

    def k_bad_utf8(self) -> list[Case]:
        body = self.rng.choice([b'{"v":1,"cmd":"st\xffats","id":1}', b"\xfe\xff{}", b"\xc3("])
        return [Case("bad_utf8", "anon", [body], E({"bad_header"}))]

    def k_deep_json(self) -> list[Case]:
        r = self.rng
        if r.random() < 0.5:
            depth = r.choice((5_000, 100_000))
            body = b"[" * depth + b"]" * depth
            return [Case("deep_json", "anon", [body], E({"bad_header"}))]
        nest: Any = 1
        for _ in range(r.choice((12, 40, 200))):
            nest = {"a": nest}
        cmd = r.choice(("register", "clear_slot"))
        f, fr = self.valid(cmd)
        if cmd == "register":
            f["layout"] = dict(f["layout"], extra=nest)
        else:
            f["draft"] = {"seq_lens": nest}
        return [self.msg("deep_json", "anon" if cmd == "register" else "attacker", cmd, f, fr,
                         E({"bad_header"}))]

    def k_bad_version(self) -> list[Case]:
        v = self.rng.choice(["missing", 0, 2, 99, "1", None, [1], {"v": 1}, -1])
        h: dict[str, Any] = {"cmd": "stats", "id": self.rid()}
        if v != "missing":
            h["v"] = v
        return [Case("bad_version", self.rng.choice(("attacker", "anon")), [_json(h)],
                     E({"bad_version"}), rid=h["id"])]

    def k_bad_id(self) -> list[Case]:
        v = self.rng.choice(["missing", "7", 1.5, None, True, [1], {"x": 1}])
        h: dict[str, Any] = {"v": 1, "cmd": "heartbeat"}
        if v != "missing":
            h["id"] = v
        return [Case("bad_id", "attacker", [_json(h)], E({"bad_header"}))]

    def k_unknown_command(self) -> list[Case]:
        c = self.rng.choice(["nope", "", "HEARTBEAT", "__class__", "eval", "x" * 5000, 7, None,
                             ["stats"], {"cmd": "stats"}, True])
        return [self.msg("unknown_command", "attacker", "stats", {"cmd": c}, (),
                         E({"unknown_command"}))]

    def k_unknown_field(self) -> list[Case]:
        cmd = self.rng.choice(P.COMMANDS)
        if cmd == "shutdown":
            cmd = "stats"
        f, fr = self.valid(cmd)
        f[self.rng.choice(["bogus", "__proto__", "ID", "k", "ok", "error"])] = 1
        return [self.msg("unknown_field", "attacker", cmd, f, fr, BAD_FIELD)]

    def k_missing_field(self) -> list[Case]:
        options = [(c, k) for c, sch in P.SCHEMAS.items() for k, (_, req) in sch.items() if req]
        cmd, k = self.rng.choice(options)
        f, fr = self.valid(cmd)
        f.pop(k, None)
        return [self.msg("missing_field", "attacker", cmd, f, fr if cmd != "free" else [],
                         E({"bad_field"}))]

    _WRONG = {
        "int": ["3", 1.5, True, None, [], {}], "frame": ["0", 0.0, False, None],
        "bool": [1, "true", None, [], 0.0], "str": [1, None, [], {}, True],
        "dict": [[], 1, "x", None], "list": [{}, 1, "x", None],
        "opt_str": [1, [], {}, True], "opt_int": ["1", 1.5, True, [], {}],
        "str_int_map": [[], 1, {"page": -1}, {"page": "1"}, {"page": 1.5}, {"page": True},
                        {"page": None}],
        "int_list": [{}, "0", [1.5], ["0"], [True], [None]],
        "opt_int_list": [{}, "0", [1.5], [True]],
        "str_list": [{}, "x", [1], [None]],
    }

    def k_wrong_type(self) -> list[Case]:
        options = [(c, k, kind) for c, sch in P.SCHEMAS.items() for k, (kind, _) in sch.items()]
        cmd, k, kind = self.rng.choice(options)
        f, fr = self.valid(cmd)
        f[k] = self.rng.choice(self._WRONG[kind])
        peer = "anon" if cmd == "register" else "attacker"
        return [self.msg("wrong_type", peer, cmd, f, fr, BAD_FIELD)]

    def k_ragged_frame(self) -> list[Case]:
        cmd = self.rng.choice(("backup", "load", "free", "stats"))
        f, fr = self.valid(cmd)
        fr = list(fr) or [b""]
        i = self.rng.randrange(len(fr))
        fr[i] = fr[i] + self.rng.randbytes(self.rng.choice((1, 3, 7)))
        return [self.msg("ragged_frame", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_missing_frame(self) -> list[Case]:
        r = self.rng
        cmd = r.choice(("backup", "load", "free"))
        f, fr = self.valid(cmd)
        if cmd == "free":
            s = next(iter(f["rows"]))
            f["rows"][s] = r.choice((1, 2, 63, 10**9))
            return [self.msg("missing_frame", "attacker", cmd, f, fr, BAD_FRAME)]
        k = r.choice(("src", "dst"))
        f["items"][0][k] = r.choice((2, 3, 64, -1, 10**12))
        if r.random() < 0.4:
            fr = fr[:1]  # truncated: one of the two frames never came
            f["items"][0][k] = 1
        return [self.msg("missing_frame", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_extra_frames(self) -> list[Case]:
        r = self.rng
        cmd = r.choice(("heartbeat", "stats", "poll_acks", "alloc", "backup", "load", "free",
                        "buffer_infos", "clear_slot"))
        f, fr = self.valid(cmd)
        fr = list(fr) + [_ids([r.randrange(4)] * r.choice((1, 2))) for _ in range(r.choice((1, 2, 5)))]
        return [self.msg("extra_frames", "attacker", cmd, f, fr, BAD_FRAME)]

    def k_too_many_frames(self) -> list[Case]:
        n = P.MAX_INDEX_FRAMES + self.rng.choice((1, 2, 50))
        return [self.msg("too_many_frames", "attacker", "stats", {}, [_ids([0])] * n, BAD_FRAME)]

    def k_long_list(self) -> list[Case]:
        n = P.MAX_LIST_LEN + self.rng.choice((1, 100))
        if self.rng.random() < 0.5:
            return [self.msg("long_list", "attacker", "poll_acks", {"ops": list(range(n))}, (),
                             BAD_FIELD)]
        return [self.msg("long_list", "attacker", "clear_slot", {"slots": [0] * n}, (),
                         BAD_FIELD)]

    def k_oversize_header(self) -> list[Case]:
        pad = "x" * (P.MAX_HEADER_BYTES + 16)
        return [self.msg("oversize_header", "attacker", "stats", {"pad": pad}, (), BAD_FRAME)]

    # ------------------------------------------------------------------ host rows: alloc / free
    def k_huge_count(self) -> list[Case]:
        s = self.space()
        n = self.rng.choice((self.w.host_rows[s] + 1, 10**6, 2**31, 2**63, 2**64 + 5, 10**100))
        return [self.msg("huge_count", self.rng.choice(("attacker", "anon")), "alloc",
                         {"counts": {s: n}}, (), E({"no_space"}))]

    def k_negative_count(self) -> list[Case]:
        s = self.space()
        return [self.msg("negative_count", "attacker", "alloc",
                         {"counts": {s: self.rng.choice((-1, -(2**63), -10**30))}}, (),
                         BAD_FIELD)]

    def k_unknown_space(self) -> list[Case]:
        name = self.rng.choice(("nope", "", "PAGE", "page ", "swa_kv", "../page", "\u00e9"))
        if self.rng.random() < 0.5:
            return [self.msg("unknown_space", "attacker", "alloc", {"counts": {name: 1}}, (),
                             BAD_FIELD)]
        return [self.msg("unknown_space", "attacker", "free", {"rows": {name: 0}},
                         [_ids([0])], BAD_FIELD)]

    def k_bad_request_id(self) -> list[Case]:
        req = self.rng.choice(("", "r" * (P.MAX_NAME_LEN + 1)))
        cmd = self.rng.choice(("alloc", "free", "swap_out"))
        f, fr = self.valid(cmd)
        f["request"] = req
        return [self.msg("bad_request_id", "attacker", cmd, f, fr, BAD_FIELD)]

    # ------------------------------------------------------------------ transfers
    def k_negative_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        neg = [self.rng.choice((-1, -2, INT64_MIN, -(10**12)))]
        if self.rng.random() < 0.5:
            return [self.transfer("negative_ids", cmd, s, neg, self.own(s), BAD_ROWS)]
        return [self.transfer("negative_ids", cmd, s, self.dev(s), neg, BAD_ROWS)]

    def k_out_of_range_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if self.rng.random() < 0.5:
            bad = [self.rng.choice((self.w.dev_rows[s], self.w.dev_rows[s] + 7, INT64_MAX))]
            return [self.transfer("out_of_range_ids", cmd, s, bad, self.own(s), BAD_ROWS)]
        bad = [self.rng.choice((self.w.host_rows[s], self.w.host_rows[s] * 3, INT64_MAX))]
        return [self.transfer("out_of_range_ids", cmd, s, self.dev(s), bad, BAD_ROWS)]

    def k_duplicate_ids(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if len(self.w.attacker[s]) < 1 or self.w.dev_rows[s] < 2:
            return self.k_negative_ids()
        if cmd == "backup":  # the same host row twice as a destination
            h = self.own(s)[0]
            return [self.transfer("duplicate_ids", cmd, s, self.dev(s, 2), [h, h], BAD_ROWS)]
        d = self.dev(s)[0]
        hs = self.own(s, 2)
        if len(hs) < 2:
            hs = hs * 2
        return [self.transfer("duplicate_ids", cmd, s, [d, d], hs, BAD_ROWS)]

    def k_length_mismatch(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        if self.rng.random() < 0.3:
            return [self.transfer("length_mismatch", cmd, s, [], [], BAD_ROWS)]
        d = self.dev(s, 2)
        h = self.own(s, 1)
        if self.rng.random() < 0.5:
            d, h = d[:1], self.own(s, 2)
            if len(h) < 2:
                h = h + [h[0]]
        if len(d) == len(h):
            d = d + d[:1]
        return [self.transfer("length_mismatch", cmd, s, d, h, BAD_ROWS)]

    def k_unknown_pool(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        r = self.rng
        name = r.choice(("nope", "", "SWA_KV", "c4_kv\x00", "page", "../../etc/passwd", "x" * 300))
        item = {"pool": name, "src": 0, "dst": 1} if r.random() < 0.6 else \
            {"space": name if name != "page" else "nope", "src": 0, "dst": 1}
        return [self.transfer("unknown_pool", cmd, s, self.dev(s), self.own(s), BAD_FIELD,
                              item=item)]

    def k_bad_item(self) -> list[Case]:
        s, cmd = self.space(), self.cmd2()
        r = self.rng
        choice = r.randrange(6)
        if choice == 0:
            items: Any = []
        elif choice == 1:
            items = [{"space": s, "src": 0, "dst": 1}] * (P.MAX_ITEMS + 1)
        elif choice == 2:
            items = [r.choice((1, "x", None, [0, 1]))]
        elif choice == 3:
            items = [{"space": s, "pool": self.pools[0], "src": 0, "dst": 1}]
        elif choice == 4:
            items = [{"src": 0, "dst": 1}]
        else:
            items = [{"space": s, "src": 0, "dst": 1, r.choice(("unit", "bogus")): "byte"}]
        d, h = self.dev(s), self.own(s)
        src, dst = (d, h) if cmd == "backup" else (h, d)
        return [self.msg("bad_item", "attacker", cmd, {"items": items}, [_ids(src), _ids(dst)],
                         BAD_FIELD)]

    def k_token_misuse(self) -> list[Case]:
        cmd = self.cmd2()
        r = self.rng
        if self.row_pools and r.random() < 0.5:  # token unit on a pool with no token format
            pool = r.choice(self.row_pools)
            s = self.w.layout.pool(pool).index
            item = {"pool": pool, "src": 0, "dst": 1, "unit": "token"}
            return [self.transfer("token_misuse", cmd, s, self.dev(s), self.own(s), BAD_FIELD,
                                  item=item)]
        pool = r.choice(self.token_pools)
        spec = self.w.layout.pool(pool)
        s, tp = spec.index, spec.tokens_per_page
        item = {"pool": pool, "src": 0, "dst": 1, "unit": "token"}
        if r.random() < 0.5:  # a token id past the device rows
            dev = [self.w.dev_rows[s] * tp + r.choice((0, 1, 10**6))]
            return [self.transfer("token_misuse", cmd, s, dev, [self.own(s)[0] * tp], BAD_ROWS,
                                  item=item)]
        free = self.w.free_rows(s)
        if not free:
            return self.k_negative_ids()
        host = [r.choice(free) * tp + r.randrange(tp)]  # a token in a row nobody holds
        return [self.transfer("token_misuse", cmd, s, [0], host, NOT_OWNER, item=item)]

    def k_foreign_rows(self) -> list[Case]:
        """The victim's host rows: back up into them, load from them, free them, swap them."""
        r = self.rng
        s = r.choice([x for x in self.spaces if self.w.victim.get(x)])
        v = r.sample(self.w.victim[s], min(len(self.w.victim[s]), r.choice((1, 2, 3))))
        what = r.randrange(4)
        peer = r.choice(("attacker", "attacker", "anon"))
        if what < 2:
            cmd = "backup" if what == 0 else "load"
            exp = NOT_OWNER if peer == "attacker" else NOT_REG
            return [self.transfer("foreign_rows", cmd, s, self.dev(s, len(v)), v, exp, peer=peer)]
        if what == 2:
            return [self.msg("foreign_rows", peer, "free", {"rows": {s: 0}}, [_ids(v)], NOT_OWNER)]
        if "req_slot" in self.spaces and self.w.victim.get("req_slot"):
            row = r.choice(self.w.victim["req_slot"])
            cmd = r.choice(("swap_in", "swap_out"))
            f = {"host_row": row, "slot": 0}
            return [self.msg("foreign_rows", "attacker", cmd, f, (), NOT_OWNER)]
        return [self.msg("foreign_rows", peer, "free", {"rows": {s: 0}}, [_ids(v)], NOT_OWNER)]

    def k_free_rows_of_nobody(self) -> list[Case]:
        s = self.space()
        free = self.w.free_rows(s)
        if not free:
            return self.k_foreign_rows()
        rows = self.rng.sample(free, min(len(free), self.w.dev_rows[s],
                                         self.rng.choice((1, 2, 5))))
        if self.rng.random() < 0.5:
            return [self.msg("free_rows_of_nobody", "attacker", "free", {"rows": {s: 0}},
                             [_ids(rows)], NOT_OWNER)]
        return [self.transfer("free_rows_of_nobody", self.cmd2(), s, self.dev(s, len(rows)),
                              rows, NOT_OWNER)]

    def k_double_free(self) -> list[Case]:
        s = "page" if "page" in self.spaces else self.space()
        return self._spare_sequence("double_free", s, lambda rows: self.msg(
            "double_free", "attacker", "free", {"rows": {s: 0}}, [_ids(rows)], NOT_OWNER))

    def k_use_after_free(self) -> list[Case]:
        s = self.space()
        cmd = self.cmd2()
        return self._spare_sequence("use_after_free", s, lambda rows: self.transfer(
            "use_after_free", cmd, s, self.dev(s), rows, NOT_OWNER))

    def _spare_sequence(self, name: str, s: str, build: Callable[[list[int]], Case]) -> list[Case]:
        """alloc one row (set-up), free it (set-up), then ``build(rows)`` (hostile)."""
        state: dict[str, list[int]] = {}

        def took(h: dict[str, Any]) -> None:
            state["rows"] = list(h["_arrays"][h["rows"][s]])
            self.w.spare[s] = list(state["rows"])

        def gone(h: dict[str, Any]) -> None:
            self.w.spare[s] = []

        alloc = self.msg(name, "attacker", "alloc", {"counts": {s: 1}}, (), setup=True, on_ok=took)
        free = Deferred(name, "attacker", [], setup=True, on_ok=gone)
        free.build = lambda: self.msg(name, "attacker", "free", {"rows": {s: 0}},
                                      [_ids(state["rows"])], setup=True, on_ok=gone)
        hostile = Deferred(name, "attacker", [])
        hostile.build = lambda: build(state["rows"])
        return [alloc, free, hostile]

    def k_mixed_ownership(self) -> list[Case]:
        """Own rows plus one foreign (or free) row: all or nothing, so nothing may change."""
        r = self.rng
        s = r.choice([x for x in self.spaces if self.w.victim.get(x) and len(self.w.attacker[x]) >= 1])
        mine = self.own(s, 2)
        other = [r.choice(self.w.victim[s])]
        rows = mine + other
        r.shuffle(rows)
        if r.random() < 0.5:
            return [self.msg("mixed_ownership", "attacker", "free", {"rows": {s: 0}},
                             [_ids(rows)], NOT_OWNER)]
        return [self.transfer("mixed_ownership", self.cmd2(), s, self.dev(s, len(rows)), rows,
                              NOT_OWNER)]

    # ------------------------------------------------------------------ request state
    def k_bad_slot(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_negative_ids()
        r = self.rng
        n = self.w.dev_rows["req_slot"]
        bad = r.choice((-1, n, n + 5, INT64_MAX, INT64_MIN))
        which = r.randrange(4)
        if which == 0:
            return [self.msg("bad_slot", "attacker", "swap_out", {"slot": bad}, (), BAD_ROWS)]
        if which == 1:
            return [self.msg("bad_slot", "attacker", "swap_in",
                             {"slot": bad, "host_row": self.own("req_slot")[0]}, (), BAD_ROWS)]
        if which == 2:
            return [self.msg("bad_slot", "attacker", "clear_slot", {"slots": [0, bad]}, (),
                             BAD_ROWS)]
        slots = r.choice(([0, 0], [1, 2, 1], []))
        return [self.msg("bad_slot", "attacker", "clear_slot", {"slots": slots}, (),
                         BAD_FIELD if not slots else BAD_ROWS)]

    def k_bad_host_row(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_out_of_range_ids()
        r = self.rng
        n = self.w.host_rows["req_slot"]
        cmd = r.choice(("swap_in", "swap_out"))
        if r.random() < 0.5:
            row, exp = r.choice((-1, n, INT64_MAX, INT64_MIN)), BAD_ROWS
        else:
            free = self.w.free_rows("req_slot")
            if not free:
                return self.k_out_of_range_ids()
            row, exp = r.choice(free), NOT_OWNER
        f: dict[str, Any] = {"host_row": row, "slot": 0}
        if cmd == "swap_in" and r.random() < 0.3 and exp == BAD_ROWS:
            f["release"] = True
        return [self.msg("bad_host_row", "attacker", cmd, f, (), exp)]

    def k_bad_draft(self) -> list[Case]:
        if "req_slot" not in self.spaces:
            return self.k_bad_item()
        r = self.rng
        drafts = [{"seq_lens": [1], "accept_lens": [0], "num_draft": 0},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": 65},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": "3"},
                  {"seq_lens": [1, 2], "accept_lens": [0], "num_draft": 3},
                  {"seq_lens": [-1], "accept_lens": [0], "num_draft": 3},
                  {"seq_lens": [1], "accept_lens": [4], "num_draft": 3},
                  {"seq_lens": [1], "accept_lens": [0], "num_draft": 3, "evil": 1},
                  {"seq_lens": "1", "accept_lens": [0], "num_draft": 3},
                  {"accept_lens": [0], "num_draft": 3}]
        return [self.msg("bad_draft", "attacker", "clear_slot",
                         {"slots": [0], "draft": r.choice(drafts)}, (), BAD_FIELD)]

    def k_bad_poll(self) -> list[Case]:
        f = self.rng.choice(({"max": 0}, {"max": -1}, {"max": 4097}, {"max": 10**20},
                             {"ops": ["1"]}, {"ops": [1.0]}))
        return [self.msg("bad_poll", "attacker", "poll_acks", f, (), BAD_FIELD)]

    # ------------------------------------------------------------------ registration
    def k_register_again(self) -> list[Case]:
        f, _ = self.valid("register")
        return [self.msg("register_again", "attacker", "register", f, (),
                         E({"already_registered"}))]

    def k_bad_register(self) -> list[Case]:
        """A stranger's registration with one thing wrong; it must stay unregistered."""
        r = self.rng
        f = json.loads(json.dumps(self.w.attacker_fields))
        pools = sorted(f["buffers"])
        which = r.randrange(16)
        exp: frozenset[str]
        if which == 0:
            f["layout"]["model"]["num_layers"] += 1
            exp = E({"layout_mismatch"})
        elif which == 1:
            f["layout"]["stage"]["pp_rank"] = r.choice(("abc", [0], None, -1, 10**9))
            exp = E({"layout_mismatch"})
        elif which == 2:
            f["layout"] = r.choice(({}, {"model": []}, {"model": {}, "stage": {}},
                                    {"model": f["layout"]["model"], "stage": "x"}))
            exp = E({"layout_mismatch"})
        elif which == 3:
            f["mode"] = r.choice(("gpu", "", "CPU", "x" * 40))
            exp = BAD_FIELD
        elif which == 4:
            f["mode"] = "cuda"
            exp = E({"unsupported", "bad_handle"})
        elif which == 5:
            s = r.choice(sorted(f["device_rows"]))
            if r.random() < 0.5:
                del f["device_rows"][s]
            else:
                f["device_rows"][s] = 0
            exp = E({"bad_field"})
        elif which == 6:
            f["device_rows"]["bogus"] = 4
            exp = E({"bad_field"})
        elif which == 7:
            p = r.choice(pools)
            f["buffers"][p][0]["path"] = r.choice(("/etc/passwd", "/dev/shm/../../etc/passwd",
                                                   "/proc/self/mem", "/dev/shm/nope-" +
                                                   secrets.token_hex(4), "", 7, None,
                                                   "/dev/shm/x\x00y"))
            exp = E({"bad_handle"})
        elif which == 8:
            p = r.choice(pools)
            f["buffers"][p][-1]["offset"] = r.choice((10**12, -4096, "0", 2**63))
            exp = E({"bad_handle"})
        elif which == 9:
            p = r.choice(pools)
            f["buffers"][p][0]["rows"] += r.choice((1, -1, 10**9))
            exp = E({"bad_handle"})
        elif which == 10:
            p = r.choice(pools)
            f["buffers"][p][0]["row_bytes"] = r.choice((8, 0, 10**9))
            exp = E({"bad_handle"})
        elif which == 11:
            p = r.choice(pools)
            if r.random() < 0.5:
                del f["buffers"][p]
            else:
                f["buffers"][p] = f["buffers"][p][:-1]
            exp = E({"layout_mismatch"})
        elif which == 12:
            p = r.choice(pools)
            f["buffers"][p][0] = r.choice((None, 1, "x", []))
            exp = E({"bad_handle"})
        elif which == 13:
            p = r.choice(pools)
            f["buffers"][p][0]["kind"] = r.choice(("cuda_ipc", "file", None))
            exp = E({"bad_handle"})
        elif which == 14:
            f["events"] = ["AAAA"]
            exp = BAD_FIELD
        else:
            f["tp_rank"] = -1
            exp = BAD_FIELD
        return [self.msg("bad_register", "anon", "register", f, (), exp)]

    def k_before_register(self) -> list[Case]:
        return [self._unregistered("before_register", "anon")]

    def k_after_unregister(self) -> list[Case]:
        return [self._unregistered("after_unregister", "ghost")]

    def _unregistered(self, name: str, peer: str) -> Case:
        cmd = self.rng.choice(("backup", "load", "swap_out", "swap_in", "clear_slot",
                               "unregister"))
        f, fr = self.valid(cmd)
        return self.msg(name, peer, cmd, f, fr, NOT_REG)

    # ------------------------------------------------------------------ drawing
    def next(self) -> list[Case]:
        fn = self.rng.choices(self._fns, self._weights)[0]
        return fn()


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


# ----------------------------------------------------------------------------- the victim
class Victim:
    """A registered client whose host rows hold known content: it allocates ``rows[s]`` host rows
    in every space, fills its device rows ``0..n-1`` with ``Pattern`` content and backs them
    up. ``verify()`` overwrites those device rows, loads the host rows back and returns how
    many rows differ (0 = the daemon kept them byte for byte). ``heartbeat()`` as needed."""

    def __init__(self, address: str, layout: Layout, dev_rows: Mapping[str, int], *,
                 seed: int = 0, share: int = 3, timeout: float = 10.0,
                 name: str = "victim") -> None:
        from hicache.client import Client

        self.layout = layout
        self.dev_rows = _space_rows(layout, dev_rows)
        self.bufs = ShmBuffers(layout, self.dev_rows, tag=name)
        self.client = Client(address, timeout=timeout, name=name)
        try:
            self.client.register(**self.bufs.register_fields())
            self.host_rows = {s: int(n) for s, n in self.client.registered["host_rows"].items()}
            self.count = {s: max(1, min(self.dev_rows[s], self.host_rows[s] // share))
                          for s in self.dev_rows}
            got = self.client.alloc(self.count)
            self.rows = {s: [int(x) for x in r] for s, r in got.items()}
            self.patterns = {s: Pattern(self.layout, [p.name for p in layout.space_pools(s)],
                                        seed) for s in self.dev_rows}
            self.salts = {s: [mix64(seed, 7, i, len(s)) for i in range(self.count[s])]
                          for s in self.dev_rows}
            for s in self.dev_rows:
                d = list(range(self.count[s]))
                self.patterns[s].fill(self.bufs, d, self.salts[s])
                self.client.wait_ack(self.client.backup({s: (d, self.rows[s])}))
        except BaseException:
            self.close()
            raise

    def heartbeat(self) -> None:
        self.client.heartbeat()

    def verify(self) -> int:
        bad = 0
        for s in self.dev_rows:
            d = list(range(self.count[s]))
            self.patterns[s].scribble(self.bufs, d, 0x5A5A5A5A5A5A5A5A)
            self.client.wait_ack(self.client.load({s: (self.rows[s], d)}))
            bad += len(self.patterns[s].bad_rows(self.bufs, d, self.salts[s]))
        return bad

    def close(self) -> None:
        self.client.close()
        self.bufs.close()


# ----------------------------------------------------------------------------- the fuzz run
def run_fuzz(address: str, messages: int, *, seed: int = 0, layout: Layout | None = None,
             dev_rows: Mapping[str, int] | None = None, reply_timeout: float = 5.0,
             time_limit: float | None = None, daemon_pid: int | None = None,
             kinds: Sequence[str] | None = None,
             progress: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Send ``messages`` hostile messages to the daemon at ``address`` and check it afterwards.

    A *victim* registers, allocates host rows in every space, fills its device rows with known
    content and backs them up; an *attacker* registers and holds a few rows; a *ghost*
    registers and unregisters; an *anon* peer never registers. The attacker, ghost and anon
    then send the messages ``Hostile`` draws (set-up steps of sequences are extra and must
    succeed). Afterwards: the daemon answers, every space's used + free = rows and used =
    what the victim and attacker hold, the allocator invariants hold, the daemon counted every
    refusal in its errors metric, and the victim's rows load back byte for byte; finally
    everyone unregisters and no host row stays used. Returns the report (``ok`` sums it up).
    """
    layout = layout or build_layout(preset("dsv4-tiny"))
    dev_rows = _space_rows(layout, dev_rows or {"page": 8, "swa_page": 4, "req_slot": 4})
    rng = random.Random(seed)
    t_start = time.monotonic()
    abufs = ShmBuffers(layout, dev_rows, tag="attacker")
    gbufs = ShmBuffers(layout, dev_rows, tag="ghost")
    peers: dict[str, RawPeer] = {}
    report: dict[str, Any] = {"bench": "fuzz", "seed": seed, "address": address}
    vic: Victim | None = None
    try:
        # ---- the victim: rows with known content in every space
        vic = Victim(address, layout, dev_rows, seed=seed, timeout=max(10.0, reply_timeout),
                     name="fuzz-victim")
        victim, host_rows, vcount, vrows = vic.client, vic.host_rows, vic.count, vic.rows
        # ---- the attacker (registered, holds rows), the ghost (unregistered), a stranger
        for name in ("attacker", "ghost", "anon"):
            peers[name] = RawPeer(address, "fuzz-" + name)
        att = peers["attacker"]
        att.call("register", abufs.register_fields())
        arows_h = att.call("alloc", {"counts": {s: min(3, host_rows[s] - vcount[s] - 1)
                                                for s in dev_rows}})
        arows = {s: [int(x) for x in arows_h["_arrays"][i]] for s, i in arows_h["rows"].items()}
        peers["ghost"].call("register", gbufs.register_fields())
        peers["ghost"].call("unregister")
        world = World(layout, host_rows, dict(dev_rows), vrows, arows, abufs.register_fields())
        gen = Hostile(world, rng, kinds)
        before = victim.stats()
        err_before = metric_total(before, "hicache_errors_total")

        # ---- the hostile messages
        counts = {"messages": 0, "setup_messages": 0, "error_replies": 0, "ok_replies": 0,
                  "unanswered": 0, "internal_errors": 0, "unexpected_codes": 0,
                  "setup_failures": 0}
        codes: dict[str, int] = {}
        kinds: dict[str, int] = {}
        examples: list[dict[str, Any]] = []
        next_beat = time.monotonic() + 0.5
        stopped_early = False

        seen: dict[tuple[str, str], int] = {}

        def note(kind: str, case: Case, h: dict[str, Any] | None) -> None:
            k = (kind, case.name)
            seen[k] = seen.get(k, 0) + 1
            if len(examples) < 40 and seen[k] <= 2:
                examples.append({"problem": kind, "case": case.name, "peer": case.peer,
                                 "expected": sorted(case.expect),
                                 "reply": None if h is None else
                                 {k: v for k, v in h.items() if k != "_arrays"}})

        while counts["messages"] < messages:
            now = time.monotonic()
            if time_limit is not None and now - t_start > time_limit:
                stopped_early = True
                break
            if now >= next_beat:  # keep the victim and attacker alive (reaper)
                victim.heartbeat()
                att.call("heartbeat")
                counts["setup_messages"] += 1
                next_beat = now + 0.5
            for case in gen.next():
                if isinstance(case, Deferred):
                    case = case.resolve()
                peer = peers[case.peer]
                peer.send(case.frames)
                h = peer.reply(reply_timeout, case.rid if case.rid is not None else "any")
                if case.setup:
                    counts["setup_messages"] += 1
                    if h is None or not h.get("ok"):
                        counts["setup_failures"] += 1
                        counts["unanswered"] += h is None
                        note("setup step failed", case, h)
                        break
                    if case.on_ok is not None:
                        case.on_ok(h)
                    continue
                counts["messages"] += 1
                kinds[case.name] = kinds.get(case.name, 0) + 1
                if h is None:
                    counts["unanswered"] += 1
                    note("no reply", case, h)
                elif h.get("ok"):
                    counts["ok_replies"] += 1
                    note("hostile message accepted", case, h)
                else:
                    code = str((h.get("error") or {}).get("code"))
                    counts["error_replies"] += 1
                    codes[code] = codes.get(code, 0) + 1
                    if code == "internal":
                        counts["internal_errors"] += 1
                        note("internal error", case, h)
                    elif case.expect and code not in case.expect:
                        counts["unexpected_codes"] += 1
                        note("unexpected error code", case, h)
                if progress is not None and counts["messages"] % 1000 == 0:
                    progress(counts["messages"], counts)
        fuzz_seconds = time.monotonic() - t_start

        # ---- afterwards: alive, accounting, invariants, metrics, the victim's bytes
        alive = True
        try:
            victim.heartbeat()
        except Exception:  # noqa: BLE001 - any failure means not alive
            alive = False
        if daemon_pid is not None:
            try:
                os.kill(daemon_pid, 0)
            except OSError:
                alive = False
        expect_used = {s: vcount[s] + len(arows.get(s, ())) + len(world.spare.get(s, ()))
                       for s in dev_rows}
        check: dict[str, Any] = {"ok": False, "problems": ["daemon not alive"]}
        corrupted = -1
        err_delta = -1.0
        if alive:
            check = daemon_check(victim, expect_used)
            err_delta = metric_total(check.pop("stats"), "hicache_errors_total") - err_before
            if check["deep"] == "unavailable":
                err_delta -= 1  # daemon_check's own stats {"check": true} was refused
            corrupted = vic.verify()
            att.call("unregister")
            victim.unregister()
            after = daemon_check(victim, {s: 0 for s in dev_rows})
            leaked = sum(v["used"] for v in after["spaces"].values())
        else:
            leaked = -1
        report.update(counts)
        report.update({
            "daemon_alive": alive, "invariants_ok": bool(check["ok"]),
            "invariant_problems": check.get("problems", []),
            "deep_check": check.get("deep", "unavailable"),
            "victim_rows_checked": sum(vcount.values()), "victim_rows_corrupted": corrupted,
            "leaked_rows": leaked, "metrics_errors_delta": err_delta,
            "metrics_match": err_delta == counts["error_replies"],
            "codes": dict(sorted(codes.items())), "kinds": dict(sorted(kinds.items())),
            "stopped_early": stopped_early,
            "seconds": round(time.monotonic() - t_start, 2),
            "fuzz_seconds": round(fuzz_seconds, 2),
            "messages_per_s": round(counts["messages"] / max(fuzz_seconds, 1e-9), 1),
            "examples": examples,
        })
        report["ok"] = bool(
            alive and check["ok"] and corrupted == 0 and leaked == 0
            and counts["unanswered"] == 0 and counts["ok_replies"] == 0
            and counts["internal_errors"] == 0 and counts["setup_failures"] == 0
            and counts["messages"] >= messages)
        return report
    finally:
        for p in peers.values():
            p.close()
        if vic is not None:
            vic.close()
        for b in (abufs, gbufs):
            b.close()
