"""The scheduler: runs validated operations and hands completed ones back to the server.

Verbs: ``run_inline(op) -> bool`` (CPU: ran now, before the reply), ``submit(op)``,
``defer_issue(op)`` (GPU load, after its reply), ``take_issued()`` and ``take_completed()``
(server thread: loads issued further or fully, and operations finished, since the last call),
``idle()``,
``close()``. A completion wakes the server through ``wake()`` (a pipe), never through the
socket.

How bytes move: CPU mode — a few ids per pool go id by id (``kernels.cpu_copy``), larger copies
through ``kernels.dispatch``'s reference path. GPU mode — a load or swap-in goes
layer by layer through ``dispatch.issue_by_layer`` (``issue_layers``: one launch covers every
pool of its layers, layer 0 first) and records layer ``i``'s interprocess event right after
the launch holding layer ``i``. ``submit`` issues layer 0's launch only; the server answers
the engine, then ``defer_issue`` hands the op to the issuer thread, which issues the other layers
while the server reads the next commands (``take_issued`` gives the server the ops whose layers
are all issued, for their "issued" notices, and, for a load of ``PROGRESS_BYTES`` or more,
those whose issue went on by a launch group at least ``PROGRESS_S`` after the last word to
their client, for a notice of how many layers are issued: an engine then waits for a layer,
not for the whole load's issue; a smaller load's later layers go as one launch group, since
its client hears of them only when all are issued). A
backup or swap-out (``issue_gpu``) goes pool by pool through ``dispatch.copy_rows`` /
``copy_tokens`` (copy-engine batches for 16 or more rows of 32 KiB or more; else the zero-copy
kernel, whose writes into pinned memory beat a staged gather + DMA even on long host runs).
Which kernel and path: ``kernels.dispatch``. The kernels' SM budget is ``CTAS``, and
``BUSY_LOAD_CTAS`` for a load or swap-in issued while a backup or swap-out is in flight (its
reads from host memory wait longer then; see the constants).

CPU mode (shared-memory "device" pools): an operation of at most ``inline_max_bytes`` runs
inline on the server thread when nothing is queued, so its ack rides in the reply; anything
else goes to one worker thread, FIFO, which merges consecutive queued operations of the same
kind and buffers into one copy per pool when their destinations do not overlap. The worker
copies ``CHUNK_BYTES`` (all layers of an item) at a time: the temporaries stay a few MiB (one
copy of whole-GB items allocated, faulted in and unmapped a temporary per layer, twice as slow,
and its free ran with the GIL held), and between chunks the worker looks whether its operations
were cancelled. ``cancel(op_ids)`` (server thread; the reaper does it for a dead client, whose
bytes nobody waits for) makes queued ones fail at once and a running one at its next chunk,
each acked ``ok: false`` with ``cancelled``; a merged run stops only when all its operations
were cancelled. The op still completes through ``take_completed``, so its rows are released only
after the worker stopped writing them. GPU copies are not cancelled (the DMA is enqueued).

GPU mode: every operation's first copies are enqueued from the server thread before its reply;
a load's later layers go out from the issuer thread, and a backup or swap-out of
``DEFER_BACKUP_BYTES`` or more (with any backup-stream op sent while one is held) goes whole to
the backup issuer thread, so the server answers it and the next commands at once. Stream order
stays command order: before the server thread enqueues anything on the load stream, or an op
that must wait for an op whose copies are still being issued (its completion event does not
exist yet), it waits until the issuer threads concerned hold nothing (``_wait_issues``); a
backup with no such dependency goes out at once on its own stream. Backups and
swap-outs run on the backup stream, which first waits on the engine's interprocess event named
by the command; loads, swap-ins and clears run on the load stream. One completion thread per
stream waits on each operation's completion event, in stream order. The GPU path does not merge.

Ordering (docs/protocol.md): a load of host rows with a backup still in flight waits for that
backup (CPU: FIFO; GPU: the load stream waits on the backup's completion event), and the other
way round. Frees of host rows in flight are deferred by the state until the op completes.
"""
from __future__ import annotations

import logging
import queue
import threading
import time
from typing import Any, Callable, Iterator

import torch

import numpy as np

from hicache.core.id_sets import has_duplicates
from hicache.kernels.cpu_copy import clear_slots, copy_few
from hicache.kernels.dispatch import (KernelBatch, copy_rows, copy_tokens, issue_by_layer,
                                      layer_parts, warm_up)
from hicache.kernels.streams import on_stream

from .background import cpu_copy_thread
from .ops import ClearSpec, Ids, Item, Operation

log = logging.getLogger("hicache.scheduler")


# ----------------------------------------------------------------------------- how bytes move
SMALL_IDS = 64  # up to this many ids per pool, CPU copies go id by id (numpy / memmove)
CHUNK_BYTES = 32 << 20  # a larger CPU copy goes this many bytes (all layers) at a time
# a load of at least PROGRESS_BYTES reports its issue's progress (an "issued" notice naming the
# layers issued) after a launch group that ends at least PROGRESS_S after the reply or the last
# such notice. Each notice takes the server thread (and the GIL) from the issuer for a while; a
# smaller load's whole issue takes ~2 ms (H200 host, 2k tokens of DSV4-Flash's full mirror:
# 88 MB), and notices brought its second layer nothing (its last layer follows 0.1-0.4 ms
# later); a 128k load's issue takes 26-40 ms
PROGRESS_BYTES = 256 << 20
PROGRESS_S = 0.5e-3
# a backup or swap-out of at least DEFER_BACKUP_BYTES is issued by the backup issuer thread, not
# the server thread: a big backup's copies are one copy-engine copy per scattered device row,
# and issuing a 128k-token full-mirror backup of DSV4-Flash (5.65 GB) took the server thread
# 66 ms, 32k 7.5 ms, 2k 1.4 ms (H100 host, sixty-fourth session), the loop serving nobody
# meanwhile. Below it the handoff (a thread wake-up) would cost about what the issue does.
DEFER_BACKUP_BYTES = 256 << 20
# SM budget of the daemon's kernels (the copy engines take no SMs): CTAS, and BUSY_LOAD_CTAS for
# a load or swap-in issued while a backup or swap-out is in flight. An SM kernel's H2D copy
# reads host memory over PCIe, so its rate is bound by the reads it has in flight, and a copy
# streaming the other way lengthens each read: a checkpoints-mirror load of 128k (then all its
# rows, under 64 KiB, on the SM kernels) kept a median 0.77 of its solo rate with 4 CTAs while a
# backup streamed, 0.81 with 8 (13 runs each, H200, 20th and 21st sessions); alone, 8 CTAs
# gained it nothing and left 32k loads of that mirror no faster. Since the 23rd session its C4
# rows (37 KiB, most of its bytes) go to the copy engines (``copy_engine.MIN_BYTES``). Without
# MPS the engine's and the daemon's kernels take turns on the GPU, so more CTAs also mean
# shorter turns for the daemon.
CTAS = 4
BUSY_LOAD_CTAS = 8


class Cancelled(Exception):
    """The operation was cancelled (its client was reaped) before or while it ran."""


def chunk_ids(it: Item) -> int:
    """Ids per chunk of a CPU copy of ``it``: ``CHUNK_BYTES`` over all its layers, at least 1."""
    return max(1, CHUNK_BYTES * it.n // max(1, it.nbytes))


def run_cpu_item(it: Item, stop: Callable[[], bool] | None = None) -> str:
    """Copy ``it`` (CPU), a chunk at a time; ``stop()`` is asked before every chunk after the
    first: True raises ``Cancelled`` (the ids before stay copied)."""
    if it.n <= SMALL_IDS:
        return copy_few(it.src, it.dst, it.src_ids.list(), it.dst_ids.list(), it.fmt)
    src, dst, k = it.src_ids.torch(), it.dst_ids.torch(), chunk_ids(it)
    path = ""
    for a in range(0, it.n, k):
        if a and stop is not None and stop():
            raise Cancelled(f"cancelled after {a} of {it.n} ids of pool {it.pool}")
        if it.fmt is None:
            path = copy_rows(it.src, it.dst, src[a:a + k], dst[a:a + k], impl="reference")
        else:
            path = copy_tokens(it.src, it.dst, src[a:a + k], dst[a:a + k], it.fmt,
                               impl="reference")
    return path


def run_clear(spec: ClearSpec) -> None:
    for tg in spec.targets:
        clear_slots(tg.table.layers, tg.ring, tg.fp32, spec.slots, spec.draft)


def issue_gpu(op: Operation, stream: Any, ctas: int, device: torch.device) -> str:
    """Enqueue the copies of ``op`` (no per-layer events) on ``stream`` (the caller made it
    current), pool by pool (``dispatch`` picks the path: copy-engine batches for many big rows,
    else the kernels); the kernel copies' ids go up in one block (``KernelBatch``), then the
    pool-state clear, if any."""
    paths: set[str] = set()
    batch = KernelBatch()
    for it in op.items:
        if it.fmt is None:
            paths.add(copy_rows(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(),
                                ctas=ctas, stream=stream, batch=batch))
        else:
            paths.add(copy_tokens(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(),
                                  it.fmt, ctas=ctas, stream=stream, batch=batch))
    batch.flush()
    if op.clear is not None:
        run_clear(op.clear)
        paths.add("clear")
    return "+".join(sorted(paths))


def issue_layers(op: Operation, stream: Any, ctas: int, device: torch.device) -> Iterator[int]:
    """A load's copies layer by layer (``dispatch.issue_by_layer``): one launch covers every pool
    of its layers, layer 0 first; layer ``i``'s interprocess event is recorded right after its
    copies are queued (the launch holding it, or layer 1's share of the first lead; the later
    items' layers are named, so the lead knows which layers their parts may hold)."""
    events = op.layer_events
    assert events is not None
    g0 = op.stage_layers[0] if op.stage_layers else None
    first = [it for it in op.items if g0 in it.layers]  # built before layer 0's launch
    later = [it for it in op.items if g0 not in it.layers]  # built after it
    memo: dict = {}  # row blocks per id pair: the pools of one space share their ids
    return issue_by_layer(_parts(first, memo), op.stage_layers,
                          lambda i: events[i].record(stream), device=device, ctas=ctas,
                          stream=stream, more=(lambda: _parts(later, memo)) if later else None,
                          more_layers={g for it in later for g in it.layers},
                          fine=reports_progress(op))


def reports_progress(op: Operation) -> bool:
    """A load big enough for progress notices (``PROGRESS_BYTES``): its later layers go in
    launch groups of 1, 2, 4, ... layers; a smaller one's as one group, as its client hears of
    them only when all are issued."""
    return op.nbytes >= PROGRESS_BYTES


def _parts(items: list[Item], memo: dict) -> list[Any]:
    return [p for it in items for p in layer_parts(it.src, it.dst, it.src_ids.np(),
                                                   it.dst_ids.np(), it.fmt, it.layers, memo)]


def merge_key(op: Operation) -> tuple | None:
    """Operations with equal keys may merge; None: this op runs on its own."""
    if op.kind not in ("backup", "load") or op.clear is not None or \
            any(it.n > MERGE_MAX_IDS for it in op.items):
        return None
    return (op.kind, tuple((it.pool, id(it.src), id(it.dst), it.fmt is None) for it in op.items))


MERGE_MAX_IDS = 4096  # ops with more ids per item run on their own (their copy dominates anyway)


def disjoint(dsts: list[set[int]], op: Operation) -> bool:
    """True when ``op`` may join a merged run whose destinations per item are ``dsts``."""
    for d, it in zip(dsts, op.items):
        if len(d) > MERGE_MAX_IDS or not d.isdisjoint(it.dst_ids.list()):
            return False
    return True


def merge(ops: list[Operation]) -> list[Item]:
    """One item per (pool, buffers) with the ids of every op concatenated; [] if unsafe."""
    merged: list[Item] = []
    for k in range(len(ops[0].items)):
        parts = [op.items[k] for op in ops]
        dst = np.concatenate([p.dst_ids.np() for p in parts])
        if has_duplicates(dst):
            return []  # overlapping destinations: keep the ops apart, in order
        src = np.concatenate([p.src_ids.np() for p in parts])
        p0 = parts[0]
        merged.append(Item(p0.pool, p0.src, p0.dst, Ids.of(src), Ids.of(dst), p0.fmt, p0.layers,
                           sum(p.nbytes for p in parts)))
    return merged


def _failed(ops: list[Operation], e: Exception) -> None:
    """Mark ``ops`` failed with ``e`` (a cancellation is expected: not logged as an error)."""
    if not isinstance(e, Cancelled):
        log.error("operation %s failed: %s", [op.op_id for op in ops], e)
    for op in ops:
        op.ok, op.error = False, f"{type(e).__name__}: {e}"
        op.cancelled = isinstance(e, Cancelled)


# ----------------------------------------------------------------------------- the scheduler
class Scheduler:
    """See the module docstring."""

    def __init__(self, device: torch.device, wake: Callable[[], None], *,
                 inline_max_bytes: int = 256 << 10, ctas: int = CTAS,
                 busy_load_ctas: int = BUSY_LOAD_CTAS) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.inline_max_bytes = inline_max_bytes
        self.ctas = ctas
        self.busy_load_ctas = busy_load_ctas  # a load's while a backup is in flight
        self._wake = wake
        self._done: list[Operation] = []
        self._done_lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken back (server thread only)
        self._closed = False
        self._threads: dict[str, threading.Thread] = {}  # by the name of its queue
        self._queues: dict[str, queue.SimpleQueue] = {}
        self.merged_ops = 0
        self._cancelled: set[int] = set()  # op ids (server thread adds and drops; worker reads)
        # GPU loads handed to the issuer and not yet fully issued, and those whose issue ended
        # (the server takes them with ``take_issued``); both under ``_issue_cv``
        self._issue_cv = threading.Condition()
        self._issuing = {"load": 0, "backup": 0}  # ops each issuer thread holds
        self._issued: list[Operation] = []
        self._progress: list[tuple[Operation, int]] = []  # (load, layers issued) to report
        if self.cuda:
            # (fence: the engine's events a deferred backup waits for, snapshotted: _snapshot)
            self.streams = {k: torch.cuda.Stream(device) for k in ("backup", "load", "fence")}
            # the first load must not wait for Triton's compiler, nor for its stream's first
            # uses (its plan uploads' blocks): the segment kernel's variants, on that stream
            with torch.cuda.stream(self.streams["load"]):
                warm_up(device)
            self._last: dict[str, Operation | None] = {"backup": None, "load": None}
            self._start("issue", self._issuer)  # first: ``close`` stops them before the others
            self._start("issue-backup", self._backup_issuer)
            for k in ("backup", "load"):
                self._start(k, self._gpu_completer)
        else:
            self.streams = {}
            self._start("cpu", self._cpu_worker)

    def _start(self, name: str, target: Callable[[queue.SimpleQueue], None]) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._queues[name] = q
        th = threading.Thread(target=self._on_device, args=(target, q), name=f"hicache-{name}",
                              daemon=True)
        th.start()
        self._threads[name] = th

    def _on_device(self, target: Callable[[queue.SimpleQueue], None],
                   q: queue.SimpleQueue) -> None:
        """A worker thread's body: on a GPU, this daemon's device first. A thread starts on
        device 0, and its first CUDA call (an event's synchronize) would bind device 0's
        context: a daemon serving cuda:1 would hold memory on another engine's GPU."""
        if self.cuda:
            torch.cuda.set_device(self.device)
        target(q)

    # ------------------------------------------------------------------ server-thread API
    def idle(self) -> bool:
        return self._pending == 0

    @property
    def in_flight(self) -> int:
        return self._pending

    def run_inline(self, op: Operation) -> bool:
        """CPU mode: run ``op`` now on the caller's thread if it is small and nothing is queued
        (so FIFO order holds); True when it ran (``op.ok`` says how it went)."""
        if self.cuda or self._pending or op.nbytes > self.inline_max_bytes or self._closed:
            return False
        op.inline = True
        op.t_submit = op.t_submit or time.perf_counter()
        self._run_cpu([op])
        return True

    def submit(self, op: Operation) -> None:
        """Queue ``op`` (CPU worker) or enqueue it on its stream (GPU); completion comes back
        through ``take_completed``."""
        if self._closed:
            raise RuntimeError("the transfer engine is closed")
        op.t_submit = op.t_submit or time.perf_counter()
        self._pending += 1
        if not self.cuda:
            self._queues["cpu"].put(op)
            return
        if self._defers(op):  # its copies go out from the backup issuer thread
            if op.wait_event is not None:  # the engine's event as recorded now (see _snapshot)
                try:
                    op.wait_event = self._snapshot(op.wait_event)
                except Exception as e:  # noqa: BLE001 - nothing queued: failed on its ack
                    self._fail(op, e, fence=False)
                    return
            self._last[op.stream] = op  # a later op that must wait for it waits for its issue
            with self._issue_cv:
                self._issuing["backup"] += 1
            self._queues["issue-backup"].put(op)
            return
        if self._launched(op) and op.rest is None:
            self._queues[op.stream].put(op)

    def _snapshot(self, event: Any) -> Any:
        """A daemon event that completes when the engine's ``event`` as recorded now does: a
        wait enqueued later (the backup issuer's) would wait for whatever the engine recorded
        into that event meanwhile, maybe work that itself waits for this daemon's copies. The
        fence stream waits for it and records the new event (two driver calls, no host wait)."""
        fence = self.streams["fence"]
        fence.wait_event(event)
        with on_stream(fence):
            mine = torch.cuda.Event()
            mine.record(fence)
        return mine

    def _defers(self, op: Operation) -> bool:
        """GPU: ``op`` goes to the backup issuer thread: a backup-stream op of at least
        ``DEFER_BACKUP_BYTES``, or any backup-stream op while that thread holds one (so the
        stream's order stays command order)."""
        return op.stream == "backup" and op.layer_events is None and (
            op.nbytes >= DEFER_BACKUP_BYTES or self._issuing["backup"] > 0)

    def _launched(self, op: Operation, track: bool = True) -> bool:
        """``_launch_gpu(op, track)``; a launch that fails is reported on its ack. True when
        its completion thread is to take it (its completion event recorded, or its later
        layers left to the issuer); False when it was finished here (its stream waited for)."""
        try:
            self._launch_gpu(op, track)
        except Exception as e:  # noqa: BLE001 - reported on its ack
            return self._fail(op, e, track)
        return True

    def _fail(self, op: Operation, e: Exception, track: bool = True, fence: bool = True) -> bool:
        """``op`` failed at its launch (``e``; reported on its ack). With ``fence`` it may have
        queued copies already, so it completes behind them (``_fence_failed``). True when its
        completion thread is to finish it; False when it was finished here."""
        op.ok, op.error, op.rest = False, f"launch failed: {type(e).__name__}: {e}", None
        op.t_start = op.t_start or time.perf_counter()
        if fence and self._fence_failed(op, track):
            return True
        op.t_end = time.perf_counter()
        self._finish([op])
        return False

    def _fence_failed(self, op: Operation, track: bool = True) -> bool:
        """A launch that failed part-way may have queued copies already (an earlier item,
        layer 0): ``op`` completes after what its stream holds, as every op does, so its rows
        are never freed or reused under a copy. True when its completion event is recorded
        (its completion thread finishes it); else the stream was waited for here (or the
        context is broken, and nothing more runs on it)."""
        stream = self.streams[op.stream]
        try:
            with on_stream(stream):
                done = torch.cuda.Event()
                done.record(stream)
            op.done_event = done
            if track:
                self._last[op.stream] = op
            return True
        except Exception:  # noqa: BLE001 - no event: wait for the stream instead
            self._drain(op)
            return False

    def _drain(self, op: Operation) -> None:
        """``op`` has no completion event (making it failed): wait for its stream here, so it
        completes after the copies it queued, as every op does (a broken context runs
        nothing more)."""
        op.done_event = None
        try:
            self.streams[op.stream].synchronize()
        except Exception:  # noqa: BLE001
            log.exception("op %s: its stream could not be waited for", op.op_id)

    def defer_issue(self, op: Operation) -> None:
        """GPU load whose first launch group went out with ``submit``, after its reply: the
        issuer thread issues the other groups, records its completion event and hands it to its
        completion thread; the server reads the next commands meanwhile."""
        self._last[op.stream] = op  # a later op that must wait for it waits for its issue too
        with self._issue_cv:
            self._issuing["load"] += 1
        self._queues["issue"].put(op)

    def issuing(self) -> bool:
        """A load's later layers or a large backup are being issued (an issuer thread holds
        work)."""
        return self._issuing["load"] > 0 or self._issuing["backup"] > 0

    def take_issued(self) -> tuple[list[tuple[Operation, int]], list[Operation]]:
        """Server thread: since the last call, (load, layers issued) for each deferred load whose
        issue went on and is worth a notice (``PROGRESS_S``), and the deferred loads whose
        layers are all issued (``op.issue_s`` says how long that took), before their
        completions are taken. Both are taken at once, so a load's progress never comes
        after its end."""
        if not self._issued and not self._progress:
            return [], []
        with self._issue_cv:
            got = self._progress, self._issued
            self._progress, self._issued = [], []
        return got

    def _wait_issues(self, *streams: str) -> None:
        """Block until the issuer threads of ``streams`` (default: both) have issued every op
        handed to them."""
        streams = streams or ("load", "backup")
        if not any(self._issuing[k] for k in streams):
            return
        with self._issue_cv:
            while any(self._issuing[k] for k in streams):
                self._issue_cv.wait()

    def _issuer(self, q: queue.SimpleQueue) -> None:
        """The issuer thread: each deferred load's later layers, then its completion event;
        the op is listed as issued before its completion thread can finish it."""
        while True:
            op = q.get()
            if op is None:
                return
            t0 = told = time.perf_counter()
            c0 = time.thread_time()
            report = reports_progress(op)
            try:
                try:
                    for op.issued in op.rest:
                        if not report:
                            continue
                        t = time.perf_counter()
                        # the last group is told by the load's end (take_issued's second list)
                        if t - told >= PROGRESS_S and op.issued < len(op.stage_layers):
                            told = t
                            with self._issue_cv:
                                self._progress.append((op, op.issued))
                            self._wake()
                except Exception as e:  # noqa: BLE001 - the layers issued so far still complete
                    op.ok, op.error = False, f"launch failed: {type(e).__name__}: {e}"
                op.rest = None
                stream = self.streams[op.stream]
                with on_stream(stream):
                    done = torch.cuda.Event()
                    done.record(stream)
                op.done_event = done
            except Exception as e:  # noqa: BLE001 - no completion event: reported on its ack
                log.exception("load %s: its completion event failed", op.op_id)
                op.ok, op.error = False, f"completion event failed: {type(e).__name__}: {e}"
                self._drain(op)  # its layers may still copy: it completes after them
            finally:  # whatever happened, the server stops waiting and the op completes
                op.issue_s = time.perf_counter() - t0
                op.issue_cpu_s = time.thread_time() - c0
                with self._issue_cv:
                    self._issued.append(op)
                    self._issuing["load"] -= 1
                    self._issue_cv.notify_all()
                self._queues[op.stream].put(op)
                self._wake()
            op = None  # hold no op while idle (see _cpu_worker)

    def take_completed(self) -> list[Operation]:
        if not self._done:
            return []
        with self._done_lock:
            done, self._done = self._done, []
        self._pending -= len(done)
        return done

    def last_op(self, stream: str) -> Operation | None:
        return self._last.get(stream) if self.cuda else None

    def forget(self, op: Operation) -> None:
        """Server thread, after ``op`` completed: stop holding it (and its buffers) as the last
        op of its stream."""
        self._cancelled.discard(op.op_id)
        if self.cuda and self._last.get(op.stream) is op:
            self._last[op.stream] = None

    def cancel(self, op_ids: list[int]) -> int:
        """CPU mode: the operations ``op_ids`` (submitted, not yet taken back) stop at their
        next chunk, or before they start (see the module docstring). Returns how many were
        marked; 0 on GPU."""
        if self.cuda:
            return 0
        self._cancelled.update(op_ids)
        return len(op_ids)

    def _stopped(self, ops: list[Operation]) -> bool:
        c = self._cancelled
        return bool(c) and all(op.op_id in c for op in ops)

    def close(self, timeout: float = 30.0) -> bool:
        """Stop taking work, let queued work finish; True when everything finished in time."""
        if self._closed:
            return True
        self._closed = True
        if self.cuda:
            self._last = {"backup": None, "load": None}
        deadline = time.monotonic() + timeout
        for name, q in self._queues.items():  # the issuers (started first) end before the
            q.put(None)  # completers, which finish what they issued
            if name.startswith("issue"):
                self._threads[name].join(max(0.0, deadline - time.monotonic()))
        for th in self._threads.values():
            th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in self._threads.values())

    # ------------------------------------------------------------------ completion
    def _finish(self, ops: list[Operation]) -> None:
        with self._done_lock:
            self._done.extend(ops)
        self._wake()

    # ------------------------------------------------------------------ CPU mode
    def _run_cpu(self, ops: list[Operation]) -> None:
        stop = None if ops[0].inline else (lambda: self._stopped(ops))
        if len(ops) == 1 and len(ops[0].items) == 1 and ops[0].clear is None:  # the common case
            op = ops[0]
            op.t_start = time.perf_counter()
            try:
                if stop is not None and stop():
                    raise Cancelled("cancelled before it started")
                op.path = run_cpu_item(op.items[0], stop)
            except Exception as e:  # noqa: BLE001 - report through the ack
                _failed([op], e)
            op.t_end = time.perf_counter()
            if not op.inline:
                self._finish(ops)
            return
        t0 = time.perf_counter()
        for op in ops:
            op.t_start = t0
        try:
            if stop is not None and stop():
                raise Cancelled("cancelled before it started")
            if len(ops) > 1:
                items = merge(ops)
                paths = {run_cpu_item(it, stop) for it in items}
                if not items:  # unsafe to merge: run one by one
                    for op in ops:
                        self._run_cpu([op])
                    return
                self.merged_ops += len(ops) - 1
                total = sum(op.nbytes for op in ops)  # the run's time counts once in busy
                for op in ops:  # seconds: each op its share, by bytes
                    op.busy_share = op.nbytes / total if total else 1 / len(ops)
            else:
                op = ops[0]
                paths = {run_cpu_item(it, stop) for it in op.items}
                if op.clear is not None:
                    run_clear(op.clear)
                    paths.add("clear")
            path = "+".join(sorted(paths))
            for op in ops:
                op.path = path
        except Exception as e:  # noqa: BLE001 - report through the ack
            _failed(ops, e)
        t1 = time.perf_counter()
        for op in ops:
            op.t_end = t1
        if not ops[0].inline:
            self._finish(ops)

    def _cpu_worker(self, q: queue.SimpleQueue) -> None:
        cpu_copy_thread()  # copies leave a core to the server loop and yield (background.py)
        while True:
            op = q.get()
            if op is None:
                return
            self._cpu_batch(op, q)
            # hold no op while idle: its buffers would keep a gone worker's mapping alive
            op = None

    def _cpu_batch(self, op: Operation, q: queue.SimpleQueue) -> None:
        """Run ``op`` and whatever is queued behind it, merging runs of the same kind."""
        batch = [op]
        while True:  # take what is queued now and merge runs of the same kind
            try:
                nxt = q.get_nowait()
            except queue.Empty:
                break
            if nxt is None:
                q.put(None)
                break
            batch.append(nxt)
        run: list[Operation] = []
        dsts: list[set[int]] = []  # destinations per item of the current run
        for op in batch:
            key = merge_key(op)
            if run and (key is None or key != merge_key(run[0]) or not disjoint(dsts, op)):
                self._run_cpu(run)
                run, dsts = [], []
            if key is None:
                self._run_cpu([op])
                continue
            run.append(op)
            if not dsts:
                dsts = [set() for _ in op.items]
            for d, it in zip(dsts, op.items):
                d.update(it.dst_ids.list())
        if run:
            self._run_cpu(run)

    # ------------------------------------------------------------------ GPU mode
    def _launch_gpu(self, op: Operation, track: bool = True) -> None:
        """Enqueue ``op`` on its stream. A load with per-layer events issues its first launch
        group (layer 0) only and keeps the rest in ``op.rest`` for the issuer (``defer_issue``).
        ``track``: the caller is the server thread, which records ``op`` as its stream's last
        (the backup issuer's ops were recorded when they were handed to it)."""
        stream = self.streams[op.stream]
        self._wait_for_deps(op)
        op.t_start = time.perf_counter()
        # the waits name their stream: no switch of the current stream for them (a load's
        # layers enter their stream themselves)
        if op.wait_event is not None:
            stream.wait_event(op.wait_event)
        for other in op.after:
            if other.done_event is not None:
                stream.wait_event(other.done_event)
        # the waits are queued: hold the other ops no longer (each held its own ``after``, so
        # a run of backup / load hazards kept every completed op, its tables and its event)
        op.after = []
        if op.layer_events is None:
            with on_stream(stream):
                op.path = issue_gpu(op, stream, self.ctas, self.device)
                op.done_event = torch.cuda.Event()
                op.done_event.record(stream)
            if track:
                self._last[op.stream] = op
            return
        busy = self._last["backup"] is not None  # a backup not yet completed and collected
        rest = issue_layers(op, stream, self.busy_load_ctas if busy else self.ctas, self.device)
        op.issued = next(rest)  # plan, upload, layer 0's launch and event
        op.path, op.rest = "by_layer", rest

    def _wait_for_deps(self, op: Operation) -> None:
        """Before ``op`` is enqueued: stream order is command order (a load-stream op waits for
        the loads the issuer holds), and every op ``op`` waits for has its completion event (one
        that has none yet is still held by an issuer thread: wait for that thread). A
        backup-stream op waits for loads only: the backup issuer, which may be the caller,
        issues its own ops in order."""
        deps = any(o.done_event is None for o in op.after)
        if op.stream == "load":
            self._wait_issues("load", *(("backup",) if deps else ()))
        elif deps:
            self._wait_issues("load")

    def _backup_issuer(self, q: queue.SimpleQueue) -> None:
        """The backup issuer thread: the backup-stream ops ``_defers`` hands it, each issued
        whole (its waits, its copies, its completion event) in command order, then handed to
        its completion thread before it counts as issued (so the server's next op on the stream
        comes after it there too)."""
        while True:
            op = q.get()
            if op is None:
                return
            try:
                if self._launched(op, track=False):
                    self._queues[op.stream].put(op)
            finally:
                with self._issue_cv:
                    self._issuing["backup"] -= 1
                    self._issue_cv.notify_all()
            op = None  # hold no op while idle (see _cpu_worker)

    def _gpu_completer(self, q: queue.SimpleQueue) -> None:
        last = 0.0  # when the previous op of this stream completed
        while True:
            op = q.get()
            if op is None:
                return
            try:
                if op.done_event is not None:  # None: its issue failed (op.ok is False)
                    op.done_event.synchronize()
            except Exception as e:  # noqa: BLE001 - a CUDA error: report it on the ack
                op.ok, op.error = False, f"{type(e).__name__}: {e}"
            op.t_end = time.perf_counter()
            # ops of one stream run one after another: the time an op waited behind the one
            # before is queueing, not its copy (busy seconds would count it twice)
            op.t_start, last = max(op.t_start, min(last, op.t_end)), op.t_end
            self._finish([op])
            op = None  # hold no op while idle (see _cpu_worker)
