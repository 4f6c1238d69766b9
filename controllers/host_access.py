"""Who may read which host rows, and the addresses kernels use for them.

A host row is readable by its owner only once a backup of that owner into it has completed
(``HostPoolGroup``'s written state, per pool and row): a freshly allocated or freed row may
still hold a previous owner's KV, so loads and swap-ins of it are refused ``not_written``.
The daemon calls, for every operation:

* ``check_readable(group, pool, rows, what)`` — in the handler of a load / swap-in, after the
  ownership check: raises ``ProtocolError("not_written")`` naming the first unwritten row.
* ``begin_writes(group, op, landing)`` — when a backup / swap-out is accepted (before it
  runs): its UNWRITTEN rows become STALE; rows a token-granular item writes only part of are
  zeroed first and become CLEAN, unless another write into the same pool's row is in flight
  (``landing``: an earlier write failed and made the row UNWRITTEN while a later one may be
  landing): those become STALE, never zeroed under that write.
* ``end_writes(group, op)`` — when it completed (before its rows can be released): WRITTEN if
  it succeeded (a token item's rows only where CLEAN: never a row whose other bytes may be a
  previous owner's, e.g. a whole-row write into it failed or is still in flight), else back
  to UNWRITTEN, rows a completed backup had written included (a failed write may have
  replaced some of their bytes: a launch that failed after its first pools, a cancelled CPU
  copy; a load of them would mix two prefixes).
* ``torn_by(op, writes)`` — when an op that read host rows ends (a load, a swap-in, a sparse
  copy of host hits), given the writes that were in flight into its rows when it was accepted
  (it was ordered after them): the failed one that left a row it read with some bytes of
  each prefix, and no whole-row write after it; the daemon then fails the op.
* ``begin_fill`` / ``end_fill`` — the same for an L3 prefetch: only the leading pages it read
  and verified become WRITTEN, every other row it was to fill UNWRITTEN (written before or
  not). An L3 put reads rows, so ``check_readable`` applies to it.

``host_table(pool)`` builds the pointer table of one host pool with the arena's *device*
addresses wherever they differ from the host addresses (``cuMemHostGetDevicePointer``), so
kernels never dereference a host pointer the GPU cannot use.
"""
from __future__ import annotations

from typing import Any, Callable

import numpy as np

from hicache.core.id_sets import sorted_unique
from hicache.core.protocol import ProtocolError
from hicache.host_pools.group import FEW_ROWS, HostPoolGroup
from hicache.host_pools.paged_pool import PagedHostPool
from hicache.kernels.tables import LayerTable

WRITES = ("backup", "swap_out")  # operation kinds that write host rows
HOST = "host:"  # the name of every host pool's table starts so (``host_table``)


def check_readable(group: HostPoolGroup, pool: str, rows: Any, what: str) -> None:
    """Refuse (``not_written``) unless every row of ``pool`` in ``rows`` was written."""
    bad = group.first_unwritten(pool, rows)
    if bad is not None:
        raise ProtocolError("not_written", f"{what}: host row {bad} of pool {pool} "
                                           f"holds nothing you backed up (no backup into it "
                                           f"has completed since it was allocated)")


def written_rows(it: Any) -> Any:
    """Host rows an item of a writing op writes (a list when it names only a few rows)."""
    ids = it.dst_ids
    if it.fmt is not None:  # token-granular: the pages of its tokens
        return sorted_unique(_rows_of(it, ids))
    return ids.list() if ids.n <= FEW_ROWS else ids.np()


def _rows_of(it: Any, ids: Any) -> Any:
    """The host rows ``ids`` of item ``it`` name (a token item's: its tokens' pages, repeated)."""
    return ids.np() // it.fmt.tokens_per_page if it.fmt is not None else ids.np()


def torn_by(op: Any, writes: list[Any]) -> Any:
    """The write among ``writes`` that left a host row ``op`` read torn, else None.
    ``writes``: those in flight into ``op``'s host rows when it was accepted (it ran after
    them, so all have ended by its end, ``ok`` final). A row is torn in a pool when the last of
    them that wrote that pool's row failed (a launch that failed after its first pools, a
    cancelled CPU copy: some bytes of each prefix), unless a whole-row write of that pool's row
    succeeded after it; a row whose failed write came first and was written whole again is
    not."""
    if all(w.ok for w in writes):
        return None
    order = sorted(writes, key=lambda w: w.op_id)
    for it in op.items:
        if not it.src.name.startswith(HOST):
            continue
        rows = _rows_of(it, it.src_ids)
        torn: dict[int, Any] = {}  # row -> the failed write that last touched it
        for w in order:
            for wi in w.items:
                if wi.pool != it.pool:  # (a write's items all write host rows)
                    continue
                hit = np.intersect1d(rows, _rows_of(wi, wi.dst_ids)).tolist()
                if not w.ok:
                    torn.update(dict.fromkeys(hit, w))
                elif wi.fmt is None:
                    for r in hit:
                        torn.pop(r, None)
        if torn:
            return next(iter(torn.values()))
    return None


Landing = Callable[[str, str, Any], "set[int] | None"]  # (pool, space, rows) -> rows written


def begin_writes(group: HostPoolGroup, op: Any, landing: Landing | None = None) -> None:
    """``landing(pool, space, rows)``: the rows among ``rows`` that another write in flight
    writes into that pool (``DaemonState.landing``): a token item never zeroes one
    (``HostPoolGroup.begin_write``)."""
    if op.kind in WRITES:
        for it in op.items:  # a token item writes part of a row: zero it first if unwritten
            partial, rows = it.fmt is not None, written_rows(it)
            busy = landing(it.pool, group.pools[it.pool].spec.index, rows) \
                if partial and landing is not None else None
            group.begin_write(it.pool, rows, partial, busy)


def end_writes(group: HostPoolGroup, op: Any) -> None:
    if op.kind in WRITES:
        for it in op.items:
            group.end_write(it.pool, written_rows(it), op.ok, it.fmt is not None,
                            overwritten=not op.ok)


def begin_fill(group: HostPoolGroup, pools: dict[str, list[str]], host: Any,
               partial: Any = frozenset(), landing: Landing | None = None) -> None:
    """An L3 prefetch into ``host`` [(space, rows, writes)] was accepted: the pools
    ``pools[space]`` are being written there (those in ``partial`` only in part: their rows are
    zeroed first if unwritten, as for a token-granular backup)."""
    for space, rows, _ in host:
        for pool in pools[space]:
            zero = pool in partial
            group.begin_write(pool, rows, zero, landing(pool, space, rows)
                              if zero and landing is not None else None)


def end_fill(group: HostPoolGroup, pools: dict[str, list[str]], host: Any, pages: int,
             partial: Any = frozenset()) -> None:
    """It ended: the first ``pages`` rows were read and verified (WRITTEN; in ``partial``
    pools only where still zeroed, as for a token backup); the rest hold nothing usable (back
    to UNWRITTEN, even rows a backup had written: the store's read may have overwritten
    them with bytes that failed their checks)."""
    for space, rows, _ in host:
        for pool in pools[space]:
            group.end_write(pool, rows[:pages], True, pool in partial)
            group.end_write(pool, rows[pages:], False, overwritten=True)


def host_table(pool: PagedHostPool) -> LayerTable:
    """The pool's layers with the device addresses the GPU must use (host ones under UVA)."""
    dev = pool.device_ptrs()
    name = f"{HOST}{pool.name}"
    if dev == pool.layer_ptrs():
        return LayerTable(pool.layers, name)
    return LayerTable(pool.layers, name, device_ptrs=dev)
