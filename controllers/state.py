"""The daemon's state and the life of an operation: submit -> (scheduler) -> complete -> ack.

``DaemonState`` holds the layout, the host pool group, the scheduler, the client registry, the
row tracker and the metrics. Handlers validate a command against it through named checks
(``check_owned``, ``check_space``, ``load_events_for``, ...) and then call ``start(client, op)``,
which either runs a small CPU-mode op inline (its ack goes into the reply; its metrics are
recorded by ``after_reply`` once the reply is sent) or marks the op's host rows in flight and
submits it. ``collect()`` (server thread) finishes every op the scheduler completed: unmarks
its rows, carries out frees that were waiting for them, records metrics, and queues the ack in
``outbox``, which the server sends. Freeing and reaping go through here so that rows in flight
are never released early (``free_rows``, ``release_client``).

Reaping, ``unregister`` and ``reset`` never wait on the loop (``reap``, ``release_client``):
the client's rows are marked pending at once and given back by the ``Releaser``
(``release.py``) once the operations it had in flight ended, in turns bounded by time; a reap
also retires the client at once (identity refused ``busy``) and cancels its CPU copies, and a
reap or an ``unregister`` hands its device mappings to the ``Unmapper`` (unmapped on a
background thread) once those operations ended. While rows are left the state is not
``idle()`` and ``wake`` (set by the daemon) keeps the loop turning. The server times its steps
in ``watch`` (``loop_watch.py``).
Single-threaded: only the server thread calls in here (the ``Unmapper`` thread only drops
references it was handed).
"""
from __future__ import annotations

import itertools
import logging
import secrets
import time
from typing import Any, Callable

import numpy as np
import torch

from hicache.host_pools.errors import PoolError, PoolExhausted
from hicache.host_pools.group import HostPoolGroup
from hicache.kernels.dispatch import kernel_variants
from hicache.kernels.sharing import gpu_sharing
from hicache.kernels.tables import LayerTable
from hicache.core.layout import Layout, LayoutError, PoolSpec
from hicache.core.fd_handout import FdHandout
from hicache.core.protocol import ProtocolError
from hicache.controllers.metrics import Metrics

from .background import Unmapper
from .host_access import (WRITES, begin_writes, end_fill, end_writes, host_table, torn_by,
                          written_rows)
from .registry import ClientState, Registry, public_label

OWNER_LOOP_MAX = 32  # rows checked one by one (owner_of); above, one vectorised pass
from .l3_store import count_hits
from .loop_watch import LoopWatch
from .release import Releaser
from .row_tracker import RowTracker, rows_np
from .sparse import refresh_gauges as refresh_sparse_gauges
from .ops import Operation
from .scheduler import Scheduler

log = logging.getLogger("hicache.daemon")
OP_ID_BITS = 44  # random base of a run's op ids (far below 2**53: exact in any JSON reader)


L3_DEADLINE_GRACE_S = 0.05  # past a read's deadline before it is acked without its call


def l3_ack(op_id: int, kind: str, job: Any, t_end: float,
           fields: dict[str, Any]) -> dict[str, Any]:
    """The ack of an L3 job (docs/protocol.md, "acks"): ``kind``, and ``fields`` (``l3``: the
    job's result; ``error``: status error, and why; a ``kv_clear``'s ``kv``)."""
    ns = int((t_end - job.t_submit) * 1e9)
    return {"op": op_id, "kind": kind, "status": "error" if "error" in fields else "ok",
            "bytes": job.nbytes if not job.acked else 0, "ns": ns, "exec_ns": ns,
            "path": "mooncake", "pools": {}, **fields}


def _l3_ack(op_id: int, job: Any, t_end: float, result: dict[str, Any]) -> dict[str, Any]:
    return l3_ack(op_id, f"l3_{job.kind}", job, t_end, {"l3": result})


def _client_tag(job: Any) -> tuple[int, Any, Any] | None:
    """``(op id, client, host rows)`` of a client's L3 job in ``l3_ops``; None for the key
    store's own jobs (tagged ``kv_l3._Tag``), which belong to no client and get no ack."""
    return job.tag if isinstance(job.tag, tuple) else None


class DaemonState:
    def __init__(self, layout: Layout, group: HostPoolGroup, scheduler: Scheduler,
                 registry: Registry, metrics: Metrics, device: torch.device, *,
                 heartbeat_timeout: float, load_event_sets: int,
                 shm_dirs: tuple[str, ...]) -> None:
        self.layout = layout
        self.group = group
        self.scheduler = scheduler
        self.registry = registry
        self.metrics = metrics
        self.device = device
        self.heartbeat_timeout = heartbeat_timeout
        self.load_event_sets = load_event_sets
        self.shm_dirs = shm_dirs
        self.curve_keys: dict[str, str] = {}  # CURVE: key name -> public key (z85)
        self.address = ""  # the daemon's socket address (set by ``Daemon``)
        # what this daemon serves, for ``stats`` (set by ``Daemon``: model, stage, pid, ...)
        self.identity: dict[str, Any] = {}
        self.host_rows = dict(group.rows)
        self.tracker = RowTracker(self.host_rows)
        # client L3 jobs' rows alone: copies (not scheduler ops) a backup or load must not race
        self.l3_rows = RowTracker(self.host_rows)
        self.l3_reads = 0  # client L3 queries and prefetches in flight (l3_handlers bounds them)
        self.host_tables: dict[str, LayerTable] = {name: host_table(p)
                                                   for name, p in group.pools.items()}
        self.stage_layers = layout.stage.layers("swa")  # every layer of the stage, in order
        # per pool or space name: what a backup / load item of it needs (copy_commands._plans)
        self.item_plans: dict[tuple[str, str], tuple] = {}
        # op ids start at a random base each run: a client that re-registers with a restarted
        # daemon never takes an ack the old daemon pushed for the same id as its new op's
        self._op_ids = itertools.count(1 + secrets.randbits(OP_ID_BITS))
        self.ops: dict[int, tuple[Operation, ClientState]] = {}
        self.stopping = False
        self.stopped_by: str | None = None  # what stopped it from inside (the shutdown command)
        self.spin_us = 0.0  # the server loop's busy-poll window (the daemon sets it; in stats)
        self.allow_shutdown = False  # the ``shutdown`` command is accepted (``--allow-shutdown``)
        self.wake_socket: Any = None  # core.channel.WakeSocket, made by the first channel command
        self._handout: FdHandout | None = None  # made by the first descriptor it hands out
        self.sparse: Any = None  # controllers.sparse_regions.SparseRegions with --sparse-rows
        # work that waits until the reply is sent, (op, its client; None: it ran inline): the
        # in-flight bookkeeping of submitted ops and the launch groups after layer 0 of GPU
        # loads (handed to the issuer: ``scheduler.defer_issue``); accounting of inline ops
        self.post: list[tuple[Operation, ClientState | None]] = []
        # "issued" pushes: (client, op id, layers issued; None: all of them)
        self.notices: list[tuple[ClientState, int, int | None, bool]] = []  # (.., failed)
        self.outbox: list[tuple[ClientState, dict[str, Any]]] = []  # acks for the server to send
        self.l3: Any = None  # controllers.l3_store.MooncakeL3 when serving with --l3
        self.l3_ns = ""  # the namespace of this stage's L3 objects
        self.l3_ops: dict[int, Any] = {}  # op id -> L3 job in flight
        self.kv_store: Any = None  # controllers.kv_store.KeyStore, made by the first kv_* command
        self.unmapper = Unmapper()
        registry.handoff = self.unmapper.hand
        registry.is_probe = self.is_probe
        self.watch = LoopWatch()  # the server times its steps here (loop_watch.py)
        self.releaser = Releaser(group, self.tracker, registry, scheduler.cancel, self._live,
                                 lambda: self.sparse, self.watch,
                                 lambda s: metrics.set("release_loop_step_seconds", s))

    def handout(self) -> FdHandout:
        """The socket a client takes its channel's and sparse region's descriptors from
        (``core.fd_handout``: an abstract Unix socket), made at its first use; an ``OSError``
        when it cannot be made."""
        if self._handout is None:
            self._handout = FdHandout.create()
        return self._handout

    def close_handout(self) -> None:
        if self._handout is not None:
            self._handout.close()
            self._handout = None

    @property
    def wake(self) -> Callable[[], None]:
        """The server's wake-up (the daemon sets it): keeps the loop turning while rows of a
        release are left to give back."""
        return self.releaser.wake

    @wake.setter
    def wake(self, fn: Callable[[], None]) -> None:
        self.releaser.wake = fn

    @property
    def cuda(self) -> bool:
        return self.scheduler.cuda

    def next_op_id(self) -> int:
        return next(self._op_ids)

    # ------------------------------------------------------------------ named checks
    def tenant(self, c: ClientState) -> str | None:
        """The client's CURVE key as L3 names it (its public key, z85: the same key on every
        daemon whatever its file is called there, and two keys never one); None without
        CURVE, where every client of the daemon shares."""
        if c.key is None:
            return None
        return self.curve_keys.get(c.key) or c.key

    def check_space(self, space: str) -> str:
        if space not in self.host_rows:
            raise ProtocolError("bad_field", f"unknown index space {space[:64]!r}; this stage "
                                             f"uses {sorted(self.host_rows)}")
        return space

    def pool_spec(self, name: str) -> PoolSpec:
        try:
            return self.layout.pool(name)
        except LayoutError as e:
            raise ProtocolError("bad_field", str(e)[:300]) from None

    def check_owned(self, cid: str, space: str, rows: Any, what: str) -> None:
        """Every row (a list or an int64 array) allocated to client ``cid`` (any request) and
        not pending free; ``not_owner`` / ``busy`` otherwise."""
        alloc = self.group.allocators[space]
        if len(rows) <= OWNER_LOOP_MAX:
            for r in rows if type(rows) is list else list(rows):
                o = alloc.owner_of(r)
                if o is None or o[0] != cid:
                    raise ProtocolError("not_owner", f"{what}: host row {r} of space {space} is "
                                        f"{'not allocated' if o is None else 'not yours'}")
        else:
            rows = np.asarray(rows, dtype=np.int64)
            foreign = alloc.foreign_rows(cid, rows)
            if foreign.size:
                raise ProtocolError("not_owner", f"{what}: host row {int(foreign[0])} of space "
                                                 f"{space} is not allocated to this client")
        if self.tracker.busy(space, rows):
            raise ProtocolError("busy", f"{what}: host rows of space {space} are being freed")

    def check_l3_clash(self, space: str, rows: Any, writes: bool, what: str) -> None:
        """Refuse (``busy``) a copy that would race a client L3 job in flight on ``rows``: a
        write into rows an L3 put reads or a prefetch writes, or a read of rows a prefetch
        writes. (L3 jobs run on their own threads, not the scheduler's streams, so nothing
        would order the two.) Free when no L3 job is in flight."""
        if not self.l3_ops:
            return
        t, r = self.l3_rows, rows_np(rows)
        job = "prefetch" if t.writers[space][r].any() else \
            "put" if writes and t.readers[space][r].any() else None
        if job is not None:
            raise ProtocolError("busy", f"{what}: host rows of space {space} are in an L3 {job} "
                                        f"in flight; send it after that op's ack")

    def owner_of(self, space: str, row: int) -> tuple[str, str | None] | None:
        return self.group.allocators[space].owner_of(row)

    def alloc_evicts(self, counts: dict[str, int]) -> bool:
        """Whether ``alloc_rows(counts, ...)`` would have the key store evict entries (some
        space has fewer free rows than asked): a caller that may still refuse the command
        checks everything before it allocates, as eviction cannot be undone."""
        if self.kv_store is None:
            return False
        return any(n > self.group.allocators[self.check_space(s)].free_rows
                   for s, n in counts.items())

    def alloc_rows(self, counts: dict[str, int], owner: tuple[str, str | None]) -> dict[str, Any]:
        """Rows in every space of ``counts`` for ``owner``, all or none (``no_space``)."""
        for space in counts:
            self.check_space(space)
        try:
            return self.group.alloc(counts, owner)
        except PoolExhausted:  # the key store gives rows back (LRU) when that is enough
            if self.kv_store is None or not self.kv_store.make_room_for(counts):
                raise
            return self.group.alloc(counts, owner)

    def check_free(self, rows: dict[str, np.ndarray], owner: tuple[str, str | None]
                   ) -> dict[str, np.ndarray]:
        """Rows of every space that ``owner`` may free now (none pending already)."""
        out = {}
        for space, r in rows.items():
            out[space] = self.group.allocators[self.check_space(space)].check_free(r, owner)
            if out[space].size and self.tracker.busy(space, out[space]):
                raise ProtocolError("busy", f"free: rows of space {space} already have a free "
                                            f"pending")
        return out

    def free_after_use(self, rows: dict[str, np.ndarray], owner: tuple[str, str | None]) -> None:
        """Free ``rows`` once the operations using them (the next one included) completed."""
        self.tracker.defer(rows, owner)

    # ------------------------------------------------------------------ operations
    def start(self, c: ClientState, op: Operation) -> dict[str, Any] | None:
        """Run or submit ``op``. Returns its ack when it ran inline (CPU mode, small, engine
        idle: nothing else can touch its rows meanwhile, so no in-flight bookkeeping; metrics
        are recorded after the reply went out), else None (the ack is pushed later). A
        submitted op's in-flight bookkeeping (its host rows in the row tracker, the client's
        count, the op table, the gauge) is done by ``after_reply``, which the server calls
        right after the reply goes out and before it reads another command or takes a
        completion: a GPU load's layer 0 and its reply do not wait for it. Until then the row
        tracker does not list its rows, so ``release_ready`` frees nothing meanwhile."""
        begin_writes(self.group, op, self.landing)  # (its own rows are not in flight yet)
        if self.scheduler.run_inline(op):
            end_writes(self.group, op)
            self.keep_on_failure(op)
            self.post.append((op, None))
            return op.ack()
        reads = any(not w for _, _, w in op.host)  # host rows it reads (a load, a swap-in...)
        if (reads or self.scheduler.cuda) and self.tracker.hazard(op.host):
            if reads:
                op.behind = self._writes_into(op.host)
            if self.scheduler.cuda:
                other = self.scheduler.last_op("load" if op.stream == "backup" else "backup")
                if other is not None:
                    op.after.append(other)
        self.scheduler.submit(op)
        self.post.append((op, c))
        return None

    def after_reply(self) -> None:
        """Work deferred until the reply is sent: the in-flight bookkeeping of submitted ops,
        then a GPU load's launches after layer 0 go to the issuer thread (``collect`` sends the
        "issued" notice once they are out); metrics and frees of inline ops."""
        post, self.post = self.post, []
        for op, c in post:  # first: the rows of every submitted op count as in use
            if c is not None:
                self.tracker.begin(op.host)
                c.in_flight += 1
                self.ops[op.op_id] = (op, c)
                self.metrics.in_flight(op.kind, 1)
                if op.rest is not None:
                    self.scheduler.defer_issue(op)
        for op, c in post:
            if c is None:
                self._account(op)
        if self.tracker.deferred:
            self.release_ready()

    def _finish(self, op: Operation) -> None:
        """Bookkeeping of one completed asynchronous op; its ack goes to the outbox. An op
        finished already (failed by ``fail_pending`` at a stop, then completed by its thread)
        is not finished twice."""
        entry = self.ops.pop(op.op_id, None)
        if entry is None:
            return
        c = entry[1]
        if op.cancelled and self.stopping and op.error_code != "abandoned":  # (cancelled at a
            op.error = f"daemon shutting down: {op.error}"  # stop, past the drain timeout)
        if op.ok and op.behind:  # it read rows a write it ran after was replacing
            bad = torn_by(op, op.behind)
            if bad is not None:
                op.ok = False
                op.error = (f"host rows it read were being overwritten by operation "
                            f"{bad.op_id} ({bad.kind}), which failed: what it copied may mix "
                            f"two prefixes")
        op.behind = []
        self.scheduler.forget(op)
        end_writes(self.group, op)  # before its rows can be released (deferred frees below)
        self.tracker.end(op.host)
        self.keep_on_failure(op)
        c.in_flight -= 1
        self.releaser.dirty = True
        self.metrics.in_flight(op.kind, -1)
        if self.tracker.deferred:
            self.release_ready()
        self._account(op)
        self.outbox.append((c, op.ack()))

    def _writes_into(self, host: list[tuple[str, Any, bool]]) -> list[Operation]:
        """The writes in flight into any of the rows ``host`` reads (a rare path: only for an
        op whose rows the row tracker says are being written)."""
        want = {space: rows_np(rows) for space, rows, writes in host if not writes}
        out = []
        for w, _ in self.ops.values():
            if w.kind in WRITES and any(
                    space in want and np.intersect1d(want[space], rows_np(rows)).size
                    for space, rows, _ in w.host):
                out.append(w)
        return out

    def keep_on_failure(self, op: Operation) -> None:
        """A ``swap_in`` with ``release`` whose copy failed keeps its host row: the request's
        only saved state stays where it was, the client's to retry or free (its deferred free
        is taken back). Not when a release of the client's rows (reset, unregister, reap)
        started while it was in flight: that release left the row to its pending free, which
        stands."""
        if op.release is not None and not op.ok and \
                not self.releaser.left_to_free(op.op_id):
            self.tracker.undefer(*op.release)

    def _account(self, op: Operation) -> None:
        status = "ok" if op.ok else "cancelled" if op.cancelled else "error"
        self.metrics.transfer(op.kind, status, op.t_end - op.t_submit,
                              (op.t_end - op.t_start) * op.busy_share, op.per_pool(),
                              op.path or "none")

    def fail_pending(self, why: str) -> None:
        """Shutdown: every op still in flight is finished as failed (``abandoned``: its copy
        may still run, so the engine must not reuse its device memory while this process
        lives), and every L3 job not acked yet is answered (its call may still run: the
        caller leaves the arena mapped): a client's with nothing found, read or written
        (``misses: {stopping: n}``), a key-store job that someone waits for through its
        ``expire`` hook, cancelled ``stopping`` (a ``kv_clear`` gets its error ack). Acks to
        ``outbox``."""
        for op, _ in list(self.ops.values()):  # (CPU ones were cancelled and waited for first)
            op.ok, op.error_code = False, "abandoned"
            op.error = (f"{why}: its copy had not ended and may still write its destination (a "
                        f"load's device rows) until the daemon process exits")
            op.t_end = time.perf_counter()
            self._finish(op)
        now = time.monotonic()
        for op_id, job in list(self.l3_ops.items()):
            if not job.acked:
                self._answer_early(op_id, job, now, "stopping")

    def collect(self) -> int:
        """Queue the "issued" notices of GPU loads issued further (a launch group's worth, with
        the number of layers) or wholly, then finish every
        op the scheduler (and the L3 client) completed since the last call (acks to
        ``outbox``)."""
        progress, issued = self.scheduler.take_issued()
        for op, n in progress:  # before the op's last notice and its ack
            entry = self.ops.get(op.op_id)
            if entry is not None:
                self.notices.append((entry[1], op.op_id, n, False))
        for op in issued:  # before completions: notice, then ack
            self.metrics.observe("load_issue_seconds", op.issue_s)
            self.metrics.inc("load_issue_cpu_seconds", op.issue_cpu_s)
            entry = self.ops.get(op.op_id)
            if entry is not None:
                self.notices.append((entry[1], op.op_id, None, not op.ok))
        done = self.scheduler.take_completed()
        if done:
            mark = self.watch.begin()
            for op in done:
                self._finish(op)
            self.watch.step("finish", mark)
        n = len(done)
        if self.l3_ops:
            n += self.finish_l3()
            self.expire_l3(time.monotonic())
        if self.releaser.pending:
            n += self.releaser.step()
        return n

    def idle(self) -> bool:
        """No transfer, no L3 job in flight and no released client's rows left to give back."""
        return self.scheduler.idle() and not self.l3_ops and not self.releaser.pending

    def finish_l3(self) -> int:
        """Bookkeeping and ack of every L3 job that finished (acks to ``outbox``)."""
        n = 0
        for job in self.l3.take_completed():
            if not job.acked and job.misses.get("deadline"):  # (acked: counted then)
                self.metrics.inc("l3_deadline_misses", job.misses["deadline"], job.kind)
            count_hits(self.metrics, job)
            tag = _client_tag(job)
            if tag is None:  # the key store's own job (kv_l3): no ack
                self.l3_ops.pop(job.tag.op_id, None)
                job.tag.done(job)
                n += 1
                continue
            op_id, c, host = tag
            self.l3_ops.pop(op_id, None)
            if job.kind == "prefetch":  # before the rows can be released; acked at its
                # deadline: it said 0 hits, so nothing it read late becomes readable
                end_fill(self.group, job.pools, host, 0 if job.acked else job.hits,
                         job.partial)
            self.tracker.end(host)
            self.l3_rows.end(host)
            c.in_flight -= 1
            if job.kind != "put":
                c.l3_reads -= 1
                self.l3_reads -= 1
            self.releaser.dirty = True
            if self.tracker.deferred:
                self.release_ready()
            if not job.acked:
                self.outbox.append((c, _l3_ack(op_id, job, job.t_end, job.result())))
            n += 1
        return n

    def expire_l3(self, now: float) -> None:
        """Ack every client read (query, prefetch) whose deadline passed
        ``L3_DEADLINE_GRACE_S`` ago with 0 hits (``misses: {deadline: n}``) while its store
        call still runs (a hung master holds a Mooncake call up to its RPC timeout, ~30 s; a
        hung storage node up to the transfer timeout, 60 s in Mooncake 0.3.13). A prefetch's
        rows stay in flight until the call returns (a free of them waits; a copy into them is
        refused ``busy``), and nothing it reads becomes readable nor counts as a hit; a job still
        queued is dropped unrun when a worker takes it. A key store job with an ``expire`` hook
        (its clears and its own reads) is marked the same way and its hook does the rest:
        ``expire(job, now, queued)``, ``queued`` True when no worker had taken the job (none
        ever will run it)."""
        for op_id, job in self.l3_ops.items():
            if job.kind == "put" or job.acked or now < job.deadline + L3_DEADLINE_GRACE_S:
                continue
            if self._answer_early(op_id, job, now, "deadline"):
                self.metrics.inc("l3_deadline_misses", len(job.keys) or 1, job.kind)

    def _answer_early(self, op_id: int, job: Any, now: float, why: str) -> bool:
        """Answer an L3 job whose store call may still run (``why``: ``deadline``, or
        ``stopping`` at a stop): marked acked and cancelled; a client's acked with nothing
        found, read or written (``misses: {why: n}``), a key-store job through its ``expire``
        hook. False (nothing done) for a key-store job nobody waits for (no hook)."""
        tag = _client_tag(job)
        if tag is None and job.tag.expire is None:
            return False
        job.acked = True
        queued = self.l3.cancel(job, why)
        if tag is not None:
            self.outbox.append((tag[1], _l3_ack(op_id, job, now, job.unanswered_result(why))))
        else:
            job.tag.expire(job, now, queued)
        return True

    # ------------------------------------------------------------------ freeing
    def release_ready(self) -> None:
        """Carry out the deferred frees whose rows no operation uses. Not while a submitted op
        waits for ``after_reply`` (its rows are not in the tracker yet: a free now could give
        away a row it is about to read or write); its completion releases them."""
        if any(c is not None for _, c in self.post):
            return
        for rows, owner in self.tracker.ready():
            try:
                self.group.free(rows, owner)
            except PoolError as e:  # rows already went with a reaped owner: log, keep going
                log.warning("deferred free for %s: %s", owner, e)

    def free_rows(self, rows: dict[str, np.ndarray], owner: tuple[str, str | None]) -> bool:
        """Free now, or defer when an op still uses a row. True when deferred. Rows must have
        passed ``check_free``."""
        if any(self.tracker.in_use(s, r) for s, r in rows.items()):
            self.tracker.defer(rows, owner)
            return True
        self.group.free(rows, owner)
        return False

    def _ops_of(self, c: ClientState) -> list[int]:
        """Ids of every operation (copies and L3 jobs) of ``c`` still in flight (the key
        store's own L3 jobs belong to no client: ``_client_tag``)."""
        ids = [i for i, (_, x) in self.ops.items() if x is c]
        return ids + [i for i, job in self.l3_ops.items()
                      if (t := _client_tag(job)) is not None and t[1] is c]

    def _live(self, op_id: int) -> bool:
        return op_id in self.ops or op_id in self.l3_ops

    def release_client(self, c: ClientState, why: str) -> tuple[int, bool]:
        """``unregister`` or ``reset`` of ``c`` without waiting: every row it holds now goes
        back once the operations it has in flight ended (``Releaser``). With ``unregister``
        its worker is detached now (its mappings close once those operations ended) and ``c``
        is forgotten: at once when nothing is in flight, else once they ended (meanwhile their
        acks are still delivered, so the engine knows when its device memory is no longer
        used). Returns (rows freed before the reply, whether rows are still to go back)."""
        ops = self._ops_of(c)  # before anything changes
        worker, forget = None, False
        if why == "unregister":  # its worker, key-store pools and channel go now; one it
            worker, c.worker = c.worker, None  # opens before it is forgotten keeps it known
            self.registry.close_kv(c)
            self.registry.close_channel(c)
        if why == "unregister" and not ops:
            self.registry.remove(c)
        else:
            forget = why == "unregister"
        return self.releaser.start(c, why, ops, worker, cancel=[], forget=forget)

    def landing(self, pool: str, space: str, rows: Any) -> set[int] | None:
        """The rows of ``pool`` among ``rows`` (of index space ``space``) that an operation in
        flight writes: a backup or swap-out naming the pool, or an L3 prefetch filling it.
        The row tracker's per-space counts rule most rows out first; None when none."""
        w = self.tracker.writers[space]
        if isinstance(rows, list):  # a few rows (``written_rows``)
            cand = {r for r in rows if w[r]}
        else:
            a = rows_np(rows)
            cand = set(a[w[a] > 0].tolist())
        if not cand:
            return None
        hit: set[int] = set()
        for op, _ in self.ops.values():
            if op.kind in WRITES:
                for it in op.items:
                    if it.pool == pool:
                        hit.update(cand.intersection(rows_np(written_rows(it)).tolist()))
        for job in self.l3_ops.values():
            if job.kind == "prefetch" and pool in job.pools.get(space, ()):
                hit.update(cand.intersection(d[space] for d in job.rows if space in d))
        return hit or None

    def is_probe(self, c: ClientState, ops: list[int] | None = None) -> bool:
        """A peer that never registered and holds nothing (no worker, key-store pools,
        channel, intake, sparse region, operations, rows, or an ack whose push failed, which only
        ``poll_acks`` can still give it): a ``stats`` probe, say. O(index spaces + retained
        acks): called at a reap, at ``stats``, and for every client when the table is full."""
        if c.in_session() or ops:  # (``ops``: a reap's list)
            return False
        if any(not pushed for _, pushed in c.acks.values()):
            return False
        if self.sparse is not None and self.sparse.of(c.cid) is not None:  # a sparse region
            return False
        return not any(a.holds(c.cid) for a in self.group.allocators.values())

    def forget_probe(self, c: ClientState) -> bool:
        """Forget ``c`` now when it is a probe (``is_probe``) with no reap to tell it of:
        ``stats`` does so before its report, so ``hicache stats`` neither counts itself among
        the clients nor lingers until the heartbeat timeout. True when forgotten."""
        return c.reaped is None and self.is_probe(c) and self.registry.forget(c)

    def reap(self, c: ClientState, why: str) -> bool:
        """Reap without waiting (the loop keeps serving): retire it now (identity refused
        ``busy``), cancel its CPU copies; its mappings and rows go once they ended. Returns
        False for a peer that never registered and holds nothing (a ``stats`` probe): it is
        forgotten quietly."""
        ops = self._ops_of(c)  # before anything changes
        probe = self.is_probe(c, ops)
        self.registry.retire(c)
        if probe:  # nothing to release, and no reap to remember for its identity
            log.debug("peer %s %s: it never registered and holds nothing; forgotten", c.cid, why)
            self.registry.remove(c)
            return False
        if ops:
            gb = sum(self.ops[i][0].nbytes for i in ops if i in self.ops) / 1e9
            log.warning("client %s %s: %d operations still running (%.2f GB), cancelled; its "
                        "rows and device mappings go when they end", c.cid, why, len(ops), gb)
        else:
            log.warning("client %s %s: its rows go back and its device mappings close", c.cid,
                        why)
        worker, c.worker = c.worker, None
        for i in ops:  # its queued L3 reads complete unrun: nobody waits for them (its puts
            job = self.l3_ops.get(i)  # still publish pages other instances may hit)
            if job is not None and job.kind != "put":
                job.cancelled = "cancelled"
        self.releaser.start(c, f"reaped ({why})", ops, worker,
                            cancel=[i for i in ops if i in self.ops], forget=True)
        return True

    # ------------------------------------------------------------------ reports
    def report(self, check: bool) -> dict[str, Any]:
        """The ``stats`` reply; with ``check``, the allocators' invariant check (O(rows))."""
        self.refresh_gauges()
        out = {"device": str(self.device),
               "daemon": {**self.identity,
                          "uptime_s": round(time.time() - self.identity.get("started", 0), 1)},
               "clients": len(self.registry.clients),
               "workers": self.registry.workers(), "in_flight": self.scheduler.in_flight,
               # each registered worker's device rows per index space, by client (its public
               # label: an id is a credential)
               "worker_rows": {public_label(c.cid): dict(c.worker.device_rows)
                               for c in self.registry.clients.values() if c.worker is not None},
               "merged_ops": self.scheduler.merged_ops, "spin_us": self.spin_us,
               "channels": len(self.registry.channels),
               "gpu_sharing": gpu_sharing(self.device.index if self.cuda else None)[0],
               # compiled copy kernel variants (GPU): grows after start only where a copy
               # compiled on first use (controllers/warm_copies.py)
               "kernel_variants": kernel_variants() if self.cuda else None,
               "host": self.group.usage(),
               "pending_free": {s: self.tracker.pending_rows(s) for s in self.host_rows},
               "metrics": self.metrics.snapshot()}
        if self.l3 is not None:
            out["l3"] = self.l3.summary()
        if self.kv_store is not None:
            out["kv_store"] = self.kv_store.summary()
        if check:
            try:
                self.group.check_invariants()
                # and no row outlives its client (a reaped client's rows wait only for its ops)
                known = {x.cid for x in self.registry.clients.values()}
                known.update(x.cid for x in self.registry.retiring.values())
                known.update(self.releaser.cids())
                known.update(x.cid for _, x in self.ops.values())
                if self.kv_store is not None:
                    known.add(self.kv_store.owner_id)
                allocs = list(self.group.allocators.values())
                if self.sparse is not None:  # the sparse regions' rows too
                    allocs.extend(self.sparse.allocators())
                stray = sorted({o[0] for a in allocs for o in a.owners()} - known)
                lost = sorted(set(self.sparse.regions) - known) if self.sparse else []
                out["invariants"] = "ok"
                if stray:  # (labels: an id is a credential, and any peer may ask)
                    out["invariants"] = (f"host rows owned by clients the daemon no longer "
                                         f"tracks: {[public_label(x) for x in stray[:4]]}")
                elif lost:
                    out["invariants"] = (f"sparse regions bound to clients the daemon no "
                                         f"longer tracks: {[public_label(x) for x in lost[:4]]}")
            except PoolError as e:
                out["invariants"] = f"{type(e).__name__}: {e}"
        return out

    def buffer_infos(self) -> dict[str, list[list[int]]]:
        return {k: [list(x) for x in v] for k, v in self.group.buffer_infos().items()}

    # ------------------------------------------------------------------ gauges
    def refresh_gauges(self) -> None:
        m = self.metrics
        for s, a in self.group.allocators.items():
            pend = self.tracker.pending_rows(s)
            m.set("host_rows", a.used_rows - pend, s, "used")
            m.set("host_rows", a.free_rows, s, "free")
            m.set("host_rows", pend, s, "pending_free")
        self._run_gauges()
        m.set("clients_connected", len(self.registry.clients))
        m.set("workers_registered", self.registry.workers())
        m.set("channels_open", len(self.registry.channels))
        refresh_sparse_gauges(self)

    def _run_gauges(self) -> None:
        """Free-run gauges of each index space (how consecutive new host rows will be)."""
        for s, a in self.group.allocators.items():
            st = a.stats()
            self.metrics.set("host_free_runs", st["free_runs"], s)
            self.metrics.set("host_free_run_mean_rows", st["mean_free_run"], s)
            self.metrics.set("host_fragmentation_ratio", st["fragmentation"], s)

    def stop_drain(self, timeout: float, cancel_wait: float) -> str:
        """A stop's wait for what is in flight (``wait_idle``'s answer): ``timeout`` s, then
        CPU copies still in flight are cancelled (each stops at its next chunk, or before it
        starts; acked once it stopped, so nothing writes after its ack) and waited for up to
        ``cancel_wait`` s more. What is left then is ``fail_pending``'s (``abandoned``)."""
        waited = self.wait_idle(timeout)
        if waited == "timeout" and self.scheduler.cancel(list(self.ops)):
            waited = self.wait_idle(cancel_wait)
        return waited

    def wait_idle(self, timeout: float) -> str:
        """Collect until nothing is in flight (``"idle"``), at most ``timeout`` s
        (``"timeout"``); ``"hung"`` sooner when all that is left is L3 jobs whose calls wait on
        a master or a storage node that no longer answers (``l3_hung``): they would hold a stop
        up to Mooncake's timeout. (One answer, so a caller never asks ``l3_hung`` again after a
        stall that ended meanwhile.)"""
        deadline = time.monotonic() + timeout
        while not self.idle() and time.monotonic() < deadline:
            if not self.collect():  # (what finished is taken first: acked with its results)
                if self.l3_hung():
                    return "hung"
                time.sleep(0.001)
        return "idle" if self.idle() else "timeout"

    def l3_hung(self) -> bool:
        """Only L3 jobs are in flight, and a call of theirs waits on a master or a storage node
        that no longer answers (``MooncakeL3.hung``)."""
        return self.l3 is not None and bool(self.l3_ops) and self.scheduler.idle() and \
            not self.releaser.pending and self.l3.hung()
