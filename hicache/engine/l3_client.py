"""Engine side of the L3 tier's commands, as ``Client`` methods (``L3Commands`` is a mixin of
``hicache.engine.client.Client``): ``l3_query(keys) -> pages held``, ``l3_prefetch(keys, rows)
-> Ack`` (leading pages read and verified into host rows this client owns), ``l3_put(keys, rows)
-> Op`` (background write, existing keys skipped). Each is one command whose result comes in
its op's ack; every wait is bounded by the call's timeout.
"""
from __future__ import annotations

from typing import Any, Mapping, Sequence

from hicache.core.protocol import as_index

from .acks import Ack, Op


class L3Commands:
    def _l3_rows(self, rows: Mapping[str, Any]) -> tuple[dict[str, int], list[Any]]:
        names = list(rows)
        return {s: i for i, s in enumerate(names)}, [as_index(rows[s]) for s in names]

    def l3_query(self, keys: Sequence[str], timeout: float | None = None) -> int:
        """How many leading pages of the key chain ``keys`` the L3 store holds (0 while it is
        offline). Bounded by ``timeout`` (``AckTimeout`` past it)."""
        h, _ = self.call("l3_query", {"keys": list(keys)}, timeout=timeout)
        a = self.wait_ack(int(h["op"]), timeout=timeout)
        return int((a.l3 or {}).get("hits", 0))

    def l3_prefetch(self, keys: Sequence[str], rows: Mapping[str, Any], *,
                    deadline_ms: int = 5000, timeout: float | None = None) -> Ack:
        """Read pages ``keys`` into host rows ``rows`` ({space: ids}, one per key, owned by
        this client). The ack's ``l3["hits"]``: leading pages read and verified; the rest of
        the rows hold nothing usable."""
        r, frames = self._l3_rows(rows)
        fields = {"keys": list(keys), "rows": r, "deadline_ms": int(deadline_ms)}
        h, _ = self.call("l3_prefetch", fields, frames, timeout=timeout)
        return self.wait_ack(int(h["op"]), timeout=timeout)

    def l3_put(self, keys: Sequence[str], rows: Mapping[str, Any],
               timeout: float | None = None) -> Op:
        """Write the pages in host rows ``rows`` to L3 under ``keys`` in the background
        (existing keys are skipped); ``wait_ack`` gives ``l3["written"]`` / ``["skipped"]``.
        Free the rows when you like: the daemon defers the free until the write read them."""
        r, frames = self._l3_rows(rows)
        h, _ = self.call("l3_put", {"keys": list(keys), "rows": r}, frames, timeout=timeout)
        return Op(int(h["op"]), "l3_put")
