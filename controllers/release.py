"""A client's host rows given back without a long step on the server loop: reap, unregister, reset.

``Releaser.start(c, why, ops, worker, cancel)`` takes a snapshot of the rows client ``c`` holds
now (rows already pending a ``free`` keep that free) and, for a reap or an ``unregister``, its
worker (device mappings). At once:

* the rows are marked pending (``RowTracker.hold``): no new operation may use them and no
  ``free`` may name them (``busy``); ``stats`` counts them in ``pending_free``; they stay owned
  by ``c``, so nobody else can allocate them before they are given back;
* its sparse-region requests are detached (a later command naming one is refused as unknown);
* the copies ``cancel`` (a reap: all of them, nobody waits for a dead client's bytes) are
  cancelled at their next chunk (``Scheduler.cancel``, CPU mode).

It then waits until the operations ``ops`` (those of ``c`` in flight when asked) have ended
(looked at again only after some operation ended: ``dirty``, set by the state):
only then may the rows and mappings go, so no copy ever writes a row that was given back. Then
the worker is handed to the unmapper (unmapped on its own thread), the sparse rows are freed,
and the rows go back in turns bounded by time: each loop turn (``step``) frees slices of
``SLICE_ROWS`` rows (fewer with zero-on-free: ``SLICE_BYTES`` to zero) until ``BUDGET_S`` has
passed, at least one slice. ``start`` runs one turn itself, so a client with nothing in flight
and a few hundred rows is done before the reply. When its last row is back a reaped client is
forgotten (``Registry.remove``). While any release is under way the loop watch records the
longest loop step; when the last one ends it is logged and published as the gauge
``release_loop_step_seconds``.
Single-threaded: only the server thread calls in here.
"""
from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hicache.host_pools.errors import PoolError
from hicache.host_pools.group import HostPoolGroup

from .loop_watch import LoopWatch
from .registry import ClientState, RegisteredWorker, Registry
from .row_tracker import RowTracker

log = logging.getLogger("hicache.daemon")

BUDGET_S = 150e-6  # release work per loop turn (at least one slice)
SLICE_ROWS = 256  # rows freed per slice (~20-60 us here)
SLICE_BYTES = 1 << 20  # with zero_on_free: bytes zeroed per slice (~100 us here)


@dataclass(eq=False)
class Release:
    c: ClientState
    why: str  # "reaped ..." | "unregister" | "reset"
    rows: dict[str, np.ndarray]  # left to give back, per space
    ops: set[int]  # operations in flight when asked: the rows and mappings wait for them
    worker: RegisteredWorker | None  # mappings to close once ``ops`` ended
    sparse: list[int]  # rows of the sparse region, freed once ``ops`` ended
    total: int
    t0: float = field(default_factory=time.monotonic)
    ready: bool = False
    freed: int = 0


class Releaser:
    def __init__(self, group: HostPoolGroup, tracker: RowTracker, registry: Registry,
                 cancel: Callable[[list[int]], int], live: Callable[[int], bool],
                 sparse: Callable[[], Any], watch: LoopWatch,
                 gauge: Callable[[float], None]) -> None:
        """``cancel(op_ids)``: the scheduler's; ``live(op_id)``: an operation still in flight;
        ``sparse()``: the sparse region or None; ``gauge(s)``: publishes the longest step."""
        self.group, self.tracker, self.registry = group, tracker, registry
        self.cancel, self.live, self.sparse, self.watch = cancel, live, sparse, watch
        self.gauge = gauge
        self.wake: Callable[[], None] = lambda: None  # the daemon sets the server's wake-up
        self.pending: list[Release] = []
        self.dirty = False  # an operation ended since the last look at the waiting releases
        self.slice_rows = {s: self._slice_rows(s) for s in group.allocators}

    def _slice_rows(self, space: str) -> int:
        if not self.group.zero_on_free:
            return SLICE_ROWS
        row = sum(p.spec.page_bytes * p.spec.num_layers for p in self.group.pools.values()
                  if p.spec.index == space)
        return max(1, min(SLICE_ROWS, SLICE_BYTES // max(1, row)))

    def cids(self) -> set[str]:
        return {r.c.cid for r in self.pending}

    def start(self, c: ClientState, why: str, ops: list[int], worker: RegisteredWorker | None,
              cancel: list[int]) -> tuple[int, bool]:
        """Begin giving back every row ``c`` holds (see the module docstring). Returns (rows
        freed before returning, whether anything is still to go)."""
        rows: dict[str, np.ndarray] = {}
        for s, t in self.group.rows_of(c.cid).items():
            a = t.numpy()
            if a.size:
                a = a[~self.tracker.freeing[s][a]]  # already pending a free: that free stands
            if a.size:
                self.tracker.hold(s, a)
                rows[s] = a
        sparse: list[int] = []
        sp = self.sparse()
        if sp is not None:
            for name in [r for r, e in sp.requests.items() if e.cid == c.cid]:
                sparse.extend(sp.requests.pop(name).rows)
        if cancel:
            self.cancel(cancel)
        if not self.pending:
            self.watch.restart()
        rel = Release(c, why, rows, set(ops), worker, sparse,
                      sum(int(a.size) for a in rows.values()))
        self.pending.append(rel)
        self.dirty = True
        self.step()
        return rel.freed, rel in self.pending

    def step(self) -> int:
        """One loop turn of release work, bounded by ``BUDGET_S`` (at least one slice); wakes
        the loop again while rows of a ready release are left. Returns the rows freed."""
        mark = self.watch.begin()
        deadline = mark[0] + BUDGET_S
        n = 0
        if self.dirty:  # some operation ended: which waiting releases may go now
            self.dirty = False
            for rel in self.pending:
                if not rel.ready:
                    self._ready(rel)
        for rel in [r for r in self.pending if r.ready]:
            while rel.rows:
                n += self._slice(rel)
                if time.perf_counter() >= deadline:
                    break
            if not rel.rows:
                self._done(rel)
            if time.perf_counter() >= deadline:
                break
        if n or any(r.ready for r in self.pending):
            self.watch.step("release", mark)
        if any(r.ready for r in self.pending):
            self.wake()
        return n

    def _ready(self, rel: Release) -> bool:
        """True once every operation of ``rel.ops`` ended; then its mappings and sparse rows
        go (``rel`` becomes ready)."""
        if rel.ops:
            rel.ops = {i for i in rel.ops if self.live(i)}
            if rel.ops:
                return False
        if rel.worker is not None:
            rel.worker.close(self.registry.handoff)  # unmapped on the unmapper's thread
            rel.worker = None
        sp = self.sparse()
        if sp is not None:
            if rel.sparse:
                sp.alloc.free_client_rows(rel.c.cid, np.asarray(rel.sparse, np.int64))
            if rel.why.startswith("reaped"):
                sp.alloc.free_owner(rel.c.cid)  # nobody acts for a reaped client any more
        rel.sparse = []
        rel.ready = True
        return True

    def _slice(self, rel: Release) -> int:
        s, arr = next(iter(rel.rows.items()))
        k = self.slice_rows[s]
        part = arr[:k]
        cid = rel.c.cid
        try:
            n = self.group.free_client_rows(cid, {s: part})
        except PoolError as e:  # not expected: some row went elsewhere; free what it holds
            log.error("release of client %s, space %s: %s", cid, s, e)
            mine = part[np.isin(part, self.group.allocators[s].rows_of(cid).numpy())]
            n = self.group.free_client_rows(cid, {s: mine})
        self.tracker.unhold(s, part)
        if arr.size > k:
            rel.rows[s] = arr[k:]
        else:
            del rel.rows[s]
        rel.freed += n
        return n

    def _done(self, rel: Release) -> None:
        self.pending.remove(rel)
        took = time.monotonic() - rel.t0
        if rel.why.startswith("reaped"):
            self.registry.remove(rel.c)  # forgotten: its identity may connect afresh
            log.warning("client %s: %d host rows freed, device mappings closed, %.2f s after "
                        "the reap; %s", rel.c.cid, rel.total, took, self.watch.describe())
        elif took > 0.01:
            log.info("client %s %s: its %d host rows are back after %.2f s; %s", rel.c.cid,
                     rel.why, rel.total, took, self.watch.describe())
        if not self.pending:
            self.gauge(self.watch.longest)
