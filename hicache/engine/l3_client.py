"""Engine side of the L3 tier's commands, as ``Client`` methods (``L3Commands`` is a mixin of
``hicache.engine.client.Client``): ``l3_query(keys) -> objects held`` (``l3_present`` -> 1/0
per key), ``l3_prefetch(keys, rows) -> Ack`` (leading objects read and verified into host rows
this client owns), ``l3_put(keys, rows) -> Op`` (background write, existing keys skipped).
Each is one command whose result comes in its op's ack. The reply is bounded by the call's
timeout; the ack is waited for until a second past the command's deadline (the daemon answers
a store that hangs at that deadline), or for the timeout when that is longer.

Every call takes the object kind: ``mirror="full"`` (default: a page with every pool of every
page space) or ``"checkpoints"`` (a page's ``page`` rows), and ``ckpt=True`` (checkpoints
mirror: the resume checkpoints of those page keys, one row each of the checkpoint space).
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from hicache.core.protocol import DEFAULT_DEADLINE_MS, as_index

from .acks import Ack, Op


def _kind(mirror: str, ckpt: bool) -> dict[str, Any]:
    out: dict[str, Any] = {} if mirror == "full" else {"mirror": mirror}
    return {**out, "ckpt": True} if ckpt else out


def _deadline(ms: int | None) -> dict[str, Any]:
    return {} if ms is None else {"deadline_ms": int(ms)}


class L3Commands:
    _session: str | None  # (``Client``'s) the daemon's session of this client's registration

    def _l3_rows(self, rows: Mapping[str, Any]) -> tuple[dict[str, int], list[Any]]:
        names = list(rows)
        return {s: i for i, s in enumerate(names)}, [as_index(rows[s]) for s in names]

    def l3_query(self, keys: Sequence[str], timeout: float | None = None, *,
                 mirror: str = "full", ckpt: bool = False,
                 deadline_ms: int | None = None) -> int:
        """How many leading objects of the key chain ``keys`` the L3 store holds (0 while it
        is offline, or when the store did not answer by ``deadline_ms``: the daemon's default
        5,000). The ack is waited for past that deadline (``AckTimeout`` only if it does not
        come a second after it, or after ``timeout`` when that is longer)."""
        fields = {"keys": list(keys), **_kind(mirror, ckpt), **_deadline(deadline_ms)}
        h, _ = self.call("l3_query", fields, timeout=timeout)
        a = self.wait_ack(int(h["op"]), timeout=self._deadline_wait(deadline_ms, timeout))
        return int((a.l3 or {}).get("hits", 0))

    def l3_present(self, keys: Sequence[str], timeout: float | None = None, *,
                   mirror: str = "checkpoints", ckpt: bool = True,
                   deadline_ms: int | None = None) -> list[int]:
        """1/0 per key: does the store hold that object (all 0 while it is offline, or past
        ``deadline_ms``)."""
        fields = {"keys": list(keys), "each": True, **_kind(mirror, ckpt),
                  **_deadline(deadline_ms)}
        h, _ = self.call("l3_query", fields, timeout=timeout)
        a = self.wait_ack(int(h["op"]), timeout=self._deadline_wait(deadline_ms, timeout))
        got = list((a.l3 or {}).get("present", []))
        return got if len(got) == len(keys) else [0] * len(keys)

    def l3_prefetch(self, keys: Sequence[str], rows: Mapping[str, Any], *,
                    deadline_ms: int = DEFAULT_DEADLINE_MS, timeout: float | None = None,
                    mirror: str = "full", ckpt: bool = False) -> Ack:
        """Read objects ``keys`` into host rows ``rows`` ({space: ids}, one per key, owned by
        this client). The ack's ``l3["hits"]``: leading objects read and verified; the rest of
        the rows hold nothing usable."""
        r, frames = self._l3_rows(rows)
        fields = {"keys": list(keys), "rows": r, "deadline_ms": int(deadline_ms),
                  **_kind(mirror, ckpt)}
        h, _ = self.call("l3_prefetch", fields, frames, timeout=timeout)
        return self.wait_ack(int(h["op"]), timeout=self._deadline_wait(deadline_ms, timeout))

    def l3_put(self, keys: Sequence[str], rows: Mapping[str, Any],
               timeout: float | None = None, *, mirror: str = "full",
               ckpt: bool = False) -> Op:
        """Write the objects in host rows ``rows`` to L3 under ``keys`` in the background
        (existing keys are skipped); ``wait_ack`` gives ``l3["written"]`` / ``["skipped"]``
        and ``["misses"]``: the ack's status is ``ok`` whenever the job ran, also when no key
        was written (docs/protocol.md), so the result is ``l3``.
        Free the rows when you like: the daemon defers the free until the write read them."""
        r, frames = self._l3_rows(rows)
        fields = {"keys": list(keys), "rows": r, **_kind(mirror, ckpt)}
        h, _ = self.call("l3_put", fields, frames, timeout=timeout)
        return Op(int(h["op"]), "l3_put", session=self._session)
