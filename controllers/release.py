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
the worker is handed to the unmapper (unmapped on its own thread), the sparse rows are freed
(a ``reset``) or the client's sparse region, taken from it at the start, is closed (unregister,
reap), and the rows go back in turns bounded by time: each loop turn (``step``) frees slices of
``SLICE_ROWS`` rows until ``BUDGET_S`` has passed, at least one slice. With zero-on-free the
rows are first zeroed on a background thread (``background.Jobs``; ``ZERO_BYTES`` at a time,
each chunk handed back to the loop, which frees it without zeroing again): the rows are held
and owned by the client meanwhile, so nothing else touches them. Only a release of at most
``ZERO_INLINE`` bytes is zeroed by the loop (one slice, ~0.1 ms). ``start`` runs one turn
itself, so a client with nothing in flight and a few hundred rows is done before the reply.
When its last row is back a reaped client is forgotten (``Registry.remove``), and so is an
unregistered one that had copies in flight (it stayed known meanwhile, so their acks reached
it), unless it registered again or allocated rows (host rows, or sparse-region rows: a client
still known can be reaped, which gives them back). While any release is under way the loop
watch records the longest loop step; when the last one ends it is logged and published as the
gauge ``release_loop_step_seconds``.
Single-threaded: only the server thread calls in here.
"""
from __future__ import annotations

import logging
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hicache.host_pools.errors import PoolError
from hicache.host_pools.group import HostPoolGroup

from .background import Jobs
from .loop_watch import LoopWatch
from .registry import ClientState, RegisteredWorker, Registry
from .row_tracker import RowTracker

log = logging.getLogger("hicache.daemon")

BUDGET_S = 150e-6  # release work per loop turn (at least one slice)
SLICE_ROWS = 256  # rows freed per slice (~20-100 us here)
ZERO_BYTES = 8 << 20  # with zero_on_free: bytes zeroed per chunk on the background thread
ZERO_INLINE = 1 << 20  # with zero_on_free: a release of at most this many bytes zeroes inline


@dataclass(eq=False)
class Release:
    c: ClientState
    why: str  # "reaped ..." | "unregister" | "reset"
    rows: dict[str, np.ndarray]  # left to give back, per space
    ops: set[int]  # operations in flight when asked: the rows and mappings wait for them
    worker: RegisteredWorker | None  # mappings to close once ``ops`` ended
    sparse: list[int]  # rows of the sparse region, freed once ``ops`` ended (a reset)
    region: Any  # the client's sparse region, closed once ``ops`` ended (unregister, reap);
    # a reset: the region ``sparse`` are rows of (the client may hold another by then)
    total: int
    forget: bool  # drop the client from the registry when done
    # the operations in flight when asked (``ops`` loses those that ended): a swap_in with
    # ``release`` among them had its row's free pending, so this release left that row to it
    started_with: frozenset[int] = frozenset()
    t0: float = field(default_factory=time.monotonic)
    ready: bool = False
    freed: int = 0
    zeroed: deque = field(default_factory=deque)  # (space, rows, zeroed?) back from the zero thread
    zeroing: bool = False  # rows handed to the zero thread and not all zeroed yet


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
        self.row_bytes = {s: max(1, sum(p.spec.page_bytes * p.spec.num_layers
                                        for p in group.pools.values() if p.spec.index == s))
                          for s in group.allocators}
        self.jobs = Jobs("hicache-zero") if group.zero_on_free else None
        # a stop gave up waiting for copies: memory they may touch is never unmapped
        self.abandoned = False

    def cids(self) -> set[str]:
        return {r.c.cid for r in self.pending}

    def left_to_free(self, op_id: int) -> bool:
        """Whether a pending release started while operation ``op_id`` was in flight: the row
        a swap_in with ``release`` frees was then pending its free, so the release left it to
        that free, which must stand (the release will not give it back)."""
        return any(op_id in r.started_with for r in self.pending)

    def start(self, c: ClientState, why: str, ops: list[int], worker: RegisteredWorker | None,
              cancel: list[int], forget: bool) -> tuple[int, bool]:
        """Begin giving back every row ``c`` holds (see the module docstring); ``forget``: drop
        ``c`` from the registry when done (a reap: always; an ``unregister``: unless it
        registered again or holds rows by then). Returns (rows freed before returning, whether
        anything is still to go)."""
        rows: dict[str, np.ndarray] = {}
        for s, t in self.group.rows_of(c.cid).items():
            a = t.numpy()
            if a.size:
                a = a[~self.tracker.freeing[s][a]]  # already pending a free: that free stands
            if a.size:
                self.tracker.hold(s, a)
                rows[s] = a
        sparse: list[int] = []
        sp, region = self.sparse(), None
        if sp is not None:
            for key in [k for k, e in sp.requests.items() if e.cid == c.cid]:
                sparse.extend(sp.requests.pop(key).rows)
            if why != "reset":  # taken away now: a later bind gets a new file, never this one
                region, sparse = sp.detach(c.cid), []
            elif sparse:
                region = sp.of(c.cid)  # its rows go back to this region, whatever comes next
        if cancel:
            self.cancel(cancel)
        if not self.pending:
            self.watch.restart()
        rel = Release(c, why, rows, set(ops), worker, sparse, region,
                      sum(int(a.size) for a in rows.values()), forget, frozenset(ops))
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
        finished = []
        for rel in [r for r in self.pending if r.ready]:
            while rel.rows or rel.zeroed:
                n += self._slice(rel)
                if time.perf_counter() >= deadline:
                    break
            # ``zeroing`` read first: the zero thread hands its last chunk back, then clears it
            zeroing = rel.zeroing
            if not (rel.rows or rel.zeroed or zeroing):
                finished.append(rel)
            if time.perf_counter() >= deadline:
                break
        if n or any(r.ready for r in self.pending):  # (before ``_done`` reports the steps:
            self.watch.step("release", mark)  # the one that freed the last rows counts too)
        for rel in finished:
            self._done(rel)
        if any(r.ready and (r.rows or r.zeroed) for r in self.pending):
            self.wake()  # (the zero thread wakes the loop when it handed a chunk back)
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
        if sp is not None and rel.region is not None:
            if rel.why == "reset":  # the region stays (if still bound), its rows go back
                try:
                    rel.region.alloc.free_client_rows(rel.c.cid,
                                                      np.asarray(rel.sparse, np.int64))
                except PoolError as e:  # not expected: never let it reach the loop
                    log.error("reset of client %s: sparse rows: %s", rel.c.cid, e)
            elif not self.abandoned:  # unregister or reap: the copies into it ended (else
                sp.close_region(rel.region)  # one may still run: left mapped until exit)
            rel.region = None
        rel.sparse = []
        rel.ready = True
        if self.jobs is not None and \
                sum(a.size * self.row_bytes[s] for s, a in rel.rows.items()) > ZERO_INLINE:
            # zero-on-free of more than a slice's worth: zeroed off the loop first
            todo, rel.rows, rel.zeroing = list(rel.rows.items()), {}, True
            self.jobs.run(lambda: self._zero(rel, todo))
        return True

    def _zero(self, rel: Release, todo: list[tuple[str, np.ndarray]]) -> None:
        """Zero thread: zero ``todo`` a chunk at a time, handing each chunk back to the loop
        (marked zeroed). Should zeroing fail, the chunks left go back unmarked: the loop's free
        zeroes them itself (never a row freed unzeroed, never one dropped)."""
        chunks = [(s, arr[a:a + k]) for s, arr in todo
                  for k in (max(1, ZERO_BYTES // self.row_bytes[s]),)
                  for a in range(0, arr.size, k)]
        done = 0
        try:
            for s, part in chunks:
                self.group.zero_space_rows(s, part)
                rel.zeroed.append((s, part, True))
                done += 1
                self.wake()
        except Exception:  # noqa: BLE001 - logged; the loop frees (and zeroes) the rest
            log.exception("release of client %s: zeroing off the loop failed; the loop zeroes "
                          "the %d chunks left as it frees them", rel.c.cid, len(chunks) - done)
        finally:
            for s, part in chunks[done:]:
                rel.zeroed.append((s, part, False))
            rel.zeroing = False
            self.wake()

    def _slice(self, rel: Release) -> int:
        """Free one slice: up to ``SLICE_ROWS`` rows of one space (zeroed chunks, or rows)."""
        if not rel.rows:
            s, part, zeroed = rel.zeroed.popleft()
            parts = [part]
            while rel.zeroed and rel.zeroed[0][0] == s and rel.zeroed[0][2] == zeroed and \
                    sum(p.size for p in parts) + rel.zeroed[0][1].size <= SLICE_ROWS:
                parts.append(rel.zeroed.popleft()[1])
            part = np.concatenate(parts) if len(parts) > 1 else part
        else:
            zeroed = False
            s, arr = next(iter(rel.rows.items()))
            part = arr[:SLICE_ROWS]
            if arr.size > SLICE_ROWS:
                rel.rows[s] = arr[SLICE_ROWS:]
            else:
                del rel.rows[s]
        cid = rel.c.cid
        try:
            n = self.group.free_client_rows(cid, {s: part}, zeroed=zeroed)
        except PoolError as e:  # not expected: some row went elsewhere; free what it holds
            log.error("release of client %s, space %s: %s", cid, s, e)
            mine = part[np.isin(part, self.group.allocators[s].rows_of(cid).numpy())]
            n = self.group.free_client_rows(cid, {s: mine}, zeroed=zeroed)
        self.tracker.unhold(s, part)
        rel.freed += n
        return n

    def _drop_region(self, cid: str) -> None:
        sp = self.sparse()
        if sp is not None:
            sp.drop(cid)

    def _sparse_rows(self, cid: str) -> int:
        """Rows of the sparse region ``cid`` holds now (one it bound after registering again
        while an ``unregister`` waited: it stays known, so a reap can still give them back)."""
        sp = self.sparse()
        return 0 if sp is None else sp.rows_held(cid)

    def _done(self, rel: Release) -> None:
        self.pending.remove(rel)
        took = time.monotonic() - rel.t0
        c = rel.c
        if rel.why.startswith("reaped"):
            self._drop_region(c.cid)
            self.registry.remove(c, rel.why)  # forgotten: its identity may connect afresh
            log.warning("client %s: %d host rows freed, device mappings closed, %.2f s after "
                        "the reap; %s", rel.c.cid, rel.total, took, self.watch.describe())
        elif rel.forget and not c.in_session() and self.registry.clients.get(c.ident) is c and \
                not any(t.numel() for t in self.group.rows_of(c.cid).values()) and \
                not self._sparse_rows(c.cid):
            self._drop_region(c.cid)  # one it bound meanwhile, empty: it goes with the client
            self.registry.remove(c)  # unregistered, its operations ended: forgotten now
        if not rel.why.startswith("reaped") and took > 0.01:
            log.info("client %s %s: its %d host rows are back after %.2f s; %s", rel.c.cid,
                     rel.why, rel.total, took, self.watch.describe())
        if not self.pending:
            self.gauge(self.watch.longest)
            self.watch.settle()
