"""``HostPoolGroup``: every host pool of one stage in one arena, allocated all-or-nothing.

Contract:

* ``HostPoolGroup(layout, rows, arena=None, *, device_index=None, arena_options=None,
  allocator_factory=RowAllocator)``: one ``PagedHostPool`` per ``layout.pools`` entry at the offsets
  of ``sizing.plan_regions`` (layer-major, regions 4 KiB-aligned), one ``RowAllocator`` per used
  index space. Without ``arena`` it maps its own of exactly ``sizing.arena_bytes`` (registered
  for ``device_index``, chunk cuts at region starts) and closes it in ``close()``.
* ``alloc(counts, owner) -> {space: int64 tensor}``: every space or none. Capacity is checked
  for all spaces first; if an allocator still fails midway, the spaces already taken are given
  back, leaving every free list exactly as before. The owner ``(client_id, request)`` is
  recorded inside the same call (seed 004: bookkeeping lives in the allocation).
* ``free(rows_by_space, owner)``: validated for every space, then applied: all or nothing.
* ``free_owner(client_id, request=None) -> int``: rows freed over all spaces (a client that
  unregisters). ``free_client_rows(client_id, rows_by_space) -> int``: the given rows, each held
  by some request of ``client_id``, all or nothing (a reaped client's rows, slice by slice).
* Written state, per pool and row (a row is readable only once its owner wrote it):
  ``UNWRITTEN`` (fresh or freed: may hold a previous owner's bytes), ``STALE`` (a whole-row
  write into it was accepted: a previous owner's bytes stay until it lands), ``CLEAN`` (a
  partial write into it was accepted and zeroed it first: zeros or the owner's bytes only),
  ``WRITTEN`` (a write into it completed: readable). ``begin_write(pool, rows, zero)`` (at a
  write's acceptance; ``zero=True`` for a partial write, a token backup: UNWRITTEN rows are
  zeroed and become CLEAN, but for rows another write is landing in (``landing``), which
  become STALE; else they become STALE), ``end_write(pool, rows, ok, partial)`` (at
  its completion: a whole-row write's rows become WRITTEN; a partial write's only where they
  are CLEAN, never where a previous owner's bytes may remain, STALE or UNWRITTEN again after
  a failed write; a failed write's rows not yet WRITTEN go back to UNWRITTEN),
  ``unwritten(pool, rows)`` (the rows a load must not read; ``first_unwritten`` the
  first of them, or None: a load's check, a few rows read one by one). Every release of a row
  (free, free_owner, deferred frees) returns it to UNWRITTEN inside the allocator's release;
  with ``zero_on_free=True`` its bytes are zeroed there too.
* ``pool(name)``, ``buffer_infos()`` (per pool, per layer ``(ptr, nbytes, item_bytes)``),
  ``usage()`` (with each space's free-run figures), ``check_invariants()``, ``close()`` /
  context manager.

Thread-safe: one lock serializes every call. ``allocator_factory(num_rows, space)`` is the
seam tests use to inject a failing allocator.
"""
from __future__ import annotations

import threading
from typing import Any, Callable, Collection, Mapping

import numpy as np
import torch

from hicache.core.layout import Layout

from .allocator import Owner, RowAllocator, RowsLike, check_owner
from .arena import PinnedArena
from .errors import InvariantError, PoolError, PoolExhausted
from .paged_pool import BufferInfo, PagedHostPool
from hicache.core.sizes import arena_bytes, check_rows, plan_regions, used_spaces

UNWRITTEN, CLEAN, WRITTEN, STALE = 0, 1, 2, 3  # written state of a pool row (module docstring)
FEW_ROWS = 8  # begin_write / end_write of at most this many rows index them one by one
SCALAR_ROWS = 64  # first_unwritten of at most this many rows reads them one by one


class HostPoolGroup:
    """The host tier of one pipeline stage: pools, allocators and their owners."""

    def __init__(
        self, layout: Layout, rows: Mapping[str, int], arena: PinnedArena | None = None, *,
        device_index: int | None = None, arena_options: Mapping[str, Any] | None = None,
        allocator_factory: Callable[[int, str], RowAllocator] = RowAllocator,
        zero_on_free: bool = False,
    ) -> None:
        self.layout = layout
        self.rows = check_rows(layout, rows)
        self.spaces = used_spaces(layout)
        regions = plan_regions(layout, self.rows)
        need = arena_bytes(layout, self.rows)
        self._owns_arena = arena is None
        if arena is None:
            arena = PinnedArena(need, device_index, cut_hints=[r.offset for r in regions],
                                **dict(arena_options or {}))
        elif arena.closed or arena.nbytes < need:
            raise PoolError(f"the arena ({'closed' if arena.closed else arena.nbytes} bytes) "
                            f"cannot hold this stage's pools: {need} bytes needed")
        self.arena = arena
        self.arena_bytes = need
        try:
            starts = {r.pool: r.offset for r in regions if r.layer == 0}
            self.pools: dict[str, PagedHostPool] = {
                name: PagedHostPool(spec, self.rows[spec.index], arena, starts[name])
                for name, spec in layout.pools.items()
            }
            self.allocators: dict[str, RowAllocator] = {
                s: allocator_factory(self.rows[s], s) for s in self.spaces
            }
        except BaseException:
            self.close()
            raise
        self.zero_on_free = zero_on_free
        self.written = {name: np.zeros(p.num_rows, np.uint8) for name, p in self.pools.items()}
        # the same bytes, for reading / setting a few rows one by one (a numpy scalar
        # assignment costs ~3k instructions, a memoryview item ~100)
        self._written_mv = {name: memoryview(a) for name, a in self.written.items()}
        # numpy views of every layer, for zeroing rows (torch's index_fill_ took ~100 µs a
        # layer for a few rows on a 16-core host, numpy's row assignment a few µs)
        self._np_layers = {name: [t.numpy() for t in p.layers] for name, p in self.pools.items()}
        self._space_pools = {s: [n for n, p in self.pools.items() if p.spec.index == s]
                             for s in self.spaces}
        for s, a in self.allocators.items():
            a.on_release = self._releaser(s)
        self._lock = threading.Lock()
        self._zeroed = False  # free_client_rows(zeroed=True) under way: zero_on_free is done

    # ------------------------------------------------------------------ written state
    def _releaser(self, space: str) -> Callable[[np.ndarray], None]:
        def released(rows: np.ndarray) -> None:
            for name in self._space_pools[space]:
                self.written[name][rows] = UNWRITTEN
                if self.zero_on_free and not self._zeroed:
                    self._zero(name, rows)
        return released

    def zero_space_rows(self, space: str, rows: np.ndarray) -> None:
        """Zero ``rows`` in every pool of ``space`` (any thread: the caller makes sure nothing
        else touches those rows meanwhile, e.g. rows held for a release)."""
        for name in self._space_pools[space]:
            self._zero(name, rows)

    def _zero(self, pool: str, rows: np.ndarray) -> None:
        for a in self._np_layers[pool]:
            a[rows] = 0

    def begin_write(self, pool: str, rows: Any, zero: bool,
                    landing: Collection[int] | None = None) -> int:
        """A write into ``rows`` of ``pool`` was accepted: UNWRITTEN rows are zeroed and become
        CLEAN when ``zero`` (a partial write), else they become STALE. ``landing``: rows of
        this pool another write in flight writes into; a partial write never zeroes one (that
        write may be landing: an earlier write into the row failed and made it UNWRITTEN)
        but marks it STALE, so it becomes readable only when a whole-row write into it
        completes. Returns the rows zeroed."""
        with self._lock:
            if len(rows) <= FEW_ROWS:  # a few rows (a list or an array): scalar reads, no fancy ops
                w = self._written_mv[pool]
                fresh = [r for r in rows if w[r] == UNWRITTEN]
                if not fresh:
                    return 0
                if not zero:
                    for r in fresh:
                        w[r] = STALE
                    return 0
                if landing:
                    for r in fresh:
                        if r in landing:
                            w[r] = STALE
                    fresh = [r for r in fresh if r not in landing]
                    if not fresh:
                        return 0
                self._zero(pool, np.array(fresh, dtype=np.int64))
                for r in fresh:
                    w[r] = CLEAN
                return len(fresh)
            w = self.written[pool]
            rows = np.asarray(rows, dtype=np.int64)
            fresh = rows[w[rows] == UNWRITTEN]
            if not zero:
                w[fresh] = STALE
                return 0
            if landing and fresh.size:
                hit = np.isin(fresh, np.fromiter(landing, np.int64, len(landing)))
                w[fresh[hit]] = STALE
                fresh = fresh[~hit]
            if fresh.size:
                self._zero(pool, fresh)
                w[fresh] = CLEAN
            return int(fresh.size)

    def end_write(self, pool: str, rows: Any, ok: bool, partial: bool = False,
                  overwritten: bool = False) -> None:
        """A write into ``rows`` completed. Succeeded: a whole-row write's rows are WRITTEN, a
        partial write's only where CLEAN (a row STALE or UNWRITTEN may still hold a previous
        owner's bytes beside the ones it wrote). Failed: rows not yet WRITTEN go back to
        UNWRITTEN (a partial copy may have left old bytes); with ``overwritten`` (the failed
        write may have replaced bytes a completed backup put there: an L3 read that failed its
        checks) every row does."""
        if not ok and overwritten:
            with self._lock:
                self.written[pool][np.asarray(rows, dtype=np.int64)] = UNWRITTEN
            return
        with self._lock:
            if ok and not partial and len(rows) <= FEW_ROWS:
                mv = self._written_mv[pool]
                for r in rows:
                    mv[r] = WRITTEN
                return
            w = self.written[pool]
            if ok and not partial:
                w[rows] = WRITTEN
                return
            rows = np.asarray(rows, dtype=np.int64)
            if ok:
                w[rows[w[rows] == CLEAN]] = WRITTEN
            else:
                w[rows[w[rows] != WRITTEN]] = UNWRITTEN

    def unwritten(self, pool: str, rows: np.ndarray) -> np.ndarray:
        """The rows of ``pool`` among ``rows`` that no completed backup wrote."""
        return rows[self.written[pool][rows] != WRITTEN]

    def first_unwritten(self, pool: str, rows: Any) -> int | None:
        """The first row of ``pool`` among ``rows`` (a list or an int64 array) that no completed
        backup wrote, or None (a load's check: a few rows are read one by one)."""
        if len(rows) <= SCALAR_ROWS:
            w = self._written_mv[pool]
            for r in rows if type(rows) is list else rows.tolist():
                if w[r] != WRITTEN:
                    return r
            return None
        bad = self.unwritten(pool, np.asarray(rows, dtype=np.int64))
        return int(bad[0]) if bad.size else None

    # ------------------------------------------------------------------ allocation
    def _check_counts(self, counts: Mapping[str, int]) -> dict[str, int]:
        if not isinstance(counts, Mapping):
            raise PoolError(f"counts must map index space -> rows, got {type(counts).__name__}")
        unknown = sorted(set(counts) - set(self.spaces))
        if unknown:
            raise PoolError(f"no pool of this stage uses spaces {unknown}; "
                            f"spaces are {self.spaces}")
        for s, n in counts.items():
            self.allocators[s].check_alloc(n)
        return {s: int(counts[s]) for s in self.spaces if s in counts}

    def alloc(self, counts: Mapping[str, int], owner: Owner) -> dict[str, torch.Tensor]:
        """Rows in every asked space, owned by ``owner``, or an exception and no change."""
        owner = check_owner(owner)
        with self._lock:
            want = self._check_counts(counts)
            taken: dict[str, torch.Tensor] = {}
            try:
                for s, n in want.items():
                    taken[s] = self.allocators[s].alloc(n, owner)
            except BaseException:
                for s in reversed(list(taken)):  # undo in reverse: free lists end up identical
                    self.allocators[s].free(taken[s], owner)
                raise
            return taken

    def free(self, rows_by_space: Mapping[str, RowsLike], owner: Owner) -> int:
        """Free rows in several spaces, all or none. Returns the number of rows freed."""
        owner = check_owner(owner)
        if not isinstance(rows_by_space, Mapping):
            raise PoolError("rows must map index space -> rows")
        with self._lock:
            unknown = sorted(set(rows_by_space) - set(self.spaces))
            if unknown:
                raise PoolError(f"no pool of this stage uses spaces {unknown}")
            checked = {s: self.allocators[s].check_free(r, owner)
                       for s, r in rows_by_space.items()}
            for s, arr in checked.items():
                self.allocators[s]._release(arr)
            return sum(int(a.size) for a in checked.values())

    def free_owner(self, client_id: str, request: str | None = None) -> int:
        """Free everything ``client_id`` holds (one request, or all when ``request`` is None)."""
        with self._lock:
            return sum(a.free_owner(client_id, request) for a in self.allocators.values())

    def free_client_rows(self, client_id: str, rows_by_space: Mapping[str, RowsLike],
                         zeroed: bool = False) -> int:
        """Free rows of ``client_id`` (any of its requests) in several spaces, all or none;
        ``zeroed``: the caller already zeroed them (``zero_space_rows``), zero_on_free skips."""
        with self._lock:
            unknown = sorted(set(rows_by_space) - set(self.spaces))
            if unknown:
                raise PoolError(f"no pool of this stage uses spaces {unknown}")
            checked = {s: self.allocators[s].check_client_rows(client_id, r)
                       for s, r in rows_by_space.items()}  # every space before releasing any
            self._zeroed = zeroed
            try:
                for s, arr in checked.items():
                    self.allocators[s]._release(arr)
            finally:
                self._zeroed = False
            return sum(int(a.size) for a in checked.values())

    def rows_of(self, client_id: str, request: str | None = None) -> dict[str, torch.Tensor]:
        with self._lock:
            return {s: a.rows_of(client_id, request) for s, a in self.allocators.items()}

    # ------------------------------------------------------------------ inspection
    def pool(self, name: str) -> PagedHostPool:
        try:
            return self.pools[name]
        except KeyError:
            raise PoolError(f"no host pool {name!r}; pools are {sorted(self.pools)}") from None

    def buffer_infos(self) -> dict[str, list[BufferInfo]]:
        """Per pool, per local layer: ``(host ptr, nbytes, item_bytes)``."""
        return {name: p.buffer_infos() for name, p in self.pools.items()}

    def usage(self) -> dict[str, Any]:
        with self._lock:
            spaces = {s: a.stats() for s, a in self.allocators.items()}
            pools = {}
            for name, p in self.pools.items():
                used = spaces[p.spec.index]["used"]
                per_row = p.spec.page_bytes * p.spec.num_layers
                pools[name] = {"space": p.spec.index, "layers": p.spec.num_layers,
                               "rows": p.num_rows, "used_rows": used,
                               "bytes": p.data_bytes, "used_bytes": used * per_row}
            return {"arena_bytes": self.arena_bytes, "spaces": spaces, "pools": pools}

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` on inconsistent bookkeeping, ``PoolError`` on bad views."""
        with self._lock:
            for a in self.allocators.values():
                a.check_invariants()
            for name, p in self.pools.items():
                free = self.allocators[p.spec.index]._owner == -1
                if (self.written[name][free] != UNWRITTEN).any():
                    raise InvariantError(f"pool {name}: a free row is still marked written")
            for name, p in self.pools.items():
                want = (p.num_rows, p.spec.page_bytes)
                if len(p.layers) != p.spec.num_layers or any(
                        tuple(t.shape) != want for t in p.layers):
                    raise PoolError(f"pool {name}: layer views do not match its spec")

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Drop the views; close the arena if this group mapped it. Idempotent."""
        self.pools = {}
        if self._owns_arena and getattr(self, "arena", None) is not None:
            self.arena.close()

    def __enter__(self) -> "HostPoolGroup":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


__all__ = ["CLEAN", "HostPoolGroup", "PoolError", "PoolExhausted", "STALE", "UNWRITTEN",
           "WRITTEN"]
