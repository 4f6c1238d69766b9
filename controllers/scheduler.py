"""The scheduler: runs validated operations and hands completed ones back to the server.

Verbs: ``run_inline(op) -> bool`` (CPU: ran now, before the reply), ``submit(op)``,
``take_completed()`` (server thread: operations finished since the last call), ``idle()``,
``close()``. A completion wakes the server through ``wake()`` (a pipe), never through the
socket. How bytes move is ``copy_plan``'s business.

CPU mode (shared-memory "device" pools): an operation of at most ``inline_max_bytes`` runs
inline on the server thread when nothing is queued, so its ack rides in the reply; anything
else goes to one worker thread, FIFO, which merges consecutive queued operations of the same
kind and buffers into one copy per pool when their destinations do not overlap.

GPU mode: every operation is enqueued from the server thread before its reply. Backups and
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
from typing import Callable

import torch

from hicache.kernels.dispatch import warm_up

from .copy_plan import disjoint, issue_gpu, merge, merge_key, run_clear, run_cpu_item
from .ops import Operation

log = logging.getLogger("hicache.scheduler")


class Scheduler:
    """See the module docstring."""

    def __init__(self, device: torch.device, wake: Callable[[], None], *,
                 inline_max_bytes: int = 256 << 10, ctas: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.inline_max_bytes = inline_max_bytes
        self.ctas = ctas
        self._wake = wake
        self._done: list[Operation] = []
        self._done_lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken back (server thread only)
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._queues: dict[str, queue.SimpleQueue] = {}
        self.merged_ops = 0
        if self.cuda:
            warm_up(device)  # the first load must not wait for Triton's compiler
            self.streams = {k: torch.cuda.Stream(device) for k in ("backup", "load")}
            self._last: dict[str, Operation | None] = {"backup": None, "load": None}
            for k in ("backup", "load"):
                self._start(k, self._gpu_completer)
        else:
            self.streams = {}
            self._start("cpu", self._cpu_worker)

    def _start(self, name: str, target: Callable[[queue.SimpleQueue], None]) -> None:
        q: queue.SimpleQueue = queue.SimpleQueue()
        self._queues[name] = q
        th = threading.Thread(target=target, args=(q,), name=f"hicache-{name}", daemon=True)
        th.start()
        self._threads.append(th)

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
        try:
            self._launch_gpu(op)
        except Exception as e:  # noqa: BLE001 - failed before the GPU saw it: report it
            op.ok, op.error = False, f"launch failed: {type(e).__name__}: {e}"
            op.t_start = op.t_end = time.perf_counter()
            self._finish([op])
            return
        self._queues[op.stream].put(op)

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
        if self.cuda and self._last.get(op.stream) is op:
            self._last[op.stream] = None

    def close(self, timeout: float = 30.0) -> bool:
        """Stop taking work, let queued work finish; True when everything finished in time."""
        if self._closed:
            return True
        self._closed = True
        if self.cuda:
            self._last = {"backup": None, "load": None}
        for q in self._queues.values():
            q.put(None)
        deadline = time.monotonic() + timeout
        for th in self._threads:
            th.join(max(0.0, deadline - time.monotonic()))
        return not any(th.is_alive() for th in self._threads)

    # ------------------------------------------------------------------ completion
    def _finish(self, ops: list[Operation]) -> None:
        with self._done_lock:
            self._done.extend(ops)
        self._wake()

    # ------------------------------------------------------------------ CPU mode
    def _run_cpu(self, ops: list[Operation]) -> None:
        if len(ops) == 1 and len(ops[0].items) == 1 and ops[0].clear is None:  # the common case
            op = ops[0]
            op.t_start = time.perf_counter()
            try:
                op.path = run_cpu_item(op.items[0])
            except Exception as e:  # noqa: BLE001 - report through the ack
                log.error("operation %s failed: %s", op.op_id, e)
                op.ok, op.error = False, f"{type(e).__name__}: {e}"
            op.t_end = time.perf_counter()
            if not op.inline:
                self._finish(ops)
            return
        t0 = time.perf_counter()
        for op in ops:
            op.t_start = t0
        try:
            if len(ops) > 1:
                items = merge(ops)
                paths = {run_cpu_item(it) for it in items}
                if not items:  # unsafe to merge: run one by one
                    for op in ops:
                        self._run_cpu([op])
                    return
                self.merged_ops += len(ops) - 1
            else:
                op = ops[0]
                paths = {run_cpu_item(it) for it in op.items}
                if op.clear is not None:
                    run_clear(op.clear)
                    paths.add("clear")
            path = "+".join(sorted(paths))
            for op in ops:
                op.path = path
        except Exception as e:  # noqa: BLE001 - report through the ack
            log.error("operation %s failed: %s", [op.op_id for op in ops], e)
            for op in ops:
                op.ok, op.error = False, f"{type(e).__name__}: {e}"
        t1 = time.perf_counter()
        for op in ops:
            op.t_end = t1
        if not ops[0].inline:
            self._finish(ops)

    def _cpu_worker(self, q: queue.SimpleQueue) -> None:
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
    def _launch_gpu(self, op: Operation) -> None:
        stream = self.streams[op.stream]
        op.t_start = time.perf_counter()
        with torch.cuda.stream(stream):
            if op.wait_event is not None:
                stream.wait_event(op.wait_event)
            for other in op.after:
                if other.done_event is not None:
                    stream.wait_event(other.done_event)
            op.path = issue_gpu(op, stream, self.ctas, self.device)
            op.done_event = torch.cuda.Event()
            op.done_event.record(stream)
        self._last[op.stream] = op

    def _gpu_completer(self, q: queue.SimpleQueue) -> None:
        while True:
            op = q.get()
            if op is None:
                return
            try:
                op.done_event.synchronize()
            except Exception as e:  # noqa: BLE001 - a CUDA error: report it on the ack
                op.ok, op.error = False, f"{type(e).__name__}: {e}"
            op.t_end = time.perf_counter()
            self._finish([op])
            op = None  # hold no op while idle (see _cpu_worker)
