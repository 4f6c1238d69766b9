"""Transfer engine: runs validated operations (backup, load, swap_out, swap_in, clear_slot) and
hands completed ones back to the server thread, which sends their acks.

Verbs: ``run_inline(op) -> bool`` (CPU: ran now, before the reply), ``submit(op)``,
``take_completed()`` (server thread: finished ops since the last call), ``idle()``,
``close()``. A completion is signalled through ``wake()`` (the server polls a pipe), never by
touching the ZMQ socket.

CPU mode (shared-memory "device" pools): a tiny operation (at most ``inline_max_bytes``) runs
inline on the server thread when the engine is idle, so its ack rides in the reply; anything
else goes to one worker thread, FIFO, which merges consecutive queued operations of the same
kind and buffers into one copy per pool (when their destinations do not overlap). Copies of at
most ``SMALL_IDS`` ids per pool go id by id through a strided numpy view of all layers (path
``numpy``, ~2 us per id; ``memmove`` per layer when layers are not equally spaced) instead of
~10 us per layer per torch op; larger ones use ``kernels.dispatch`` (the torch reference path,
which releases the GIL).

GPU mode: every operation is enqueued from the server thread before its reply. Backups and
swap-outs run on the backup stream, which first waits on the engine's interprocess event named
by the command; loads, swap-ins and clears run on the load stream. A load copies layer by layer
in stage order (one kernel per pool per layer, indices moved to the GPU once) and records the
per-layer interprocess event of layer ``i`` right after layer ``i``'s copies, so the engine's
layer ``i`` waits for layer ``i`` only. Per (pool, layer) a load is one ``cudaMemcpyAsync``
per run of consecutive rows when there are few runs (copy engines, no SM), else the kernels'
``launch_rows`` / ``launch_tokens`` for that layer (validation was done by the handler). CPU
mode has no events: a layer wait is a wait for the whole op. Other copies go through ``kernels.dispatch`` (all
layers of a pool in one launch, staged or zero-copy by its choice). One completion thread per
stream waits on each op's completion event, in stream order. The GPU path does not merge.

Ordering (documented in docs/protocol.md): a load of host rows with a backup still in flight
waits for that backup (CPU: FIFO; GPU: the load stream waits on the backup's completion event),
and symmetrically a backup into host rows still being loaded from waits for the load. Frees of
host rows in flight are deferred by the server until the op completes (``RowTracker``).
"""
from __future__ import annotations

import ctypes
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from hicache.kernels.dispatch import copy_rows, copy_tokens
from hicache.kernels.tables import LayerTable, TokenFormat

log = logging.getLogger("hicache.engine")

SMALL_IDS = 64  # up to this many ids per pool, CPU copies go id by id (numpy / memmove)
_memmove = ctypes.memmove


class Ids:
    """One validated index frame: int64 ids with cached list / numpy / torch forms."""

    __slots__ = ("mv", "n", "_list", "_np", "_t", "_dev")

    def __init__(self, mv: Any) -> None:
        self.mv = mv
        self.n = len(mv)
        self._list: list[int] | None = None
        self._np: np.ndarray | None = None
        self._t: torch.Tensor | None = None
        self._dev: torch.Tensor | None = None

    @classmethod
    def of(cls, values: Sequence[int] | np.ndarray) -> "Ids":
        a = np.ascontiguousarray(values, dtype=np.int64)
        ids = cls(memoryview(a).cast("B").cast("q"))
        ids._np = a
        return ids

    def list(self) -> list[int]:
        if self._list is None:
            self._list = self.mv.tolist()
        return self._list

    def np(self) -> np.ndarray:
        if self._np is None:
            self._np = np.frombuffer(self.mv, dtype=np.int64)
        return self._np

    def torch(self) -> torch.Tensor:
        if self._t is None:
            self._t = torch.from_numpy(np.array(self.np(), dtype=np.int64))  # writable copy
        return self._t

    def on(self, device: torch.device) -> torch.Tensor:
        if device.type != "cuda":
            return self.torch()
        if self._dev is None:
            self._dev = self.torch().pin_memory().to(device, non_blocking=True)
        return self._dev


@dataclass(eq=False)
class Item:
    """Copy ``src_ids`` of every layer of ``src`` to ``dst_ids`` of ``dst`` (one pool)."""

    pool: str
    src: LayerTable
    dst: LayerTable
    src_ids: Ids
    dst_ids: Ids
    fmt: TokenFormat | None  # token-granular when set
    layers: tuple[int, ...]  # global layer id of each buffer layer
    nbytes: int

    @property
    def n(self) -> int:
        return self.src_ids.n


@dataclass(eq=False)
class ClearTarget:
    """One req_slot pool to clear: its device layers, ring entries per row, fp32 state?"""

    pool: str
    table: LayerTable
    ring: int
    fp32: bool


@dataclass(eq=False)
class ClearSpec:
    targets: list[ClearTarget]
    slots: list[int]
    draft: list[tuple[int, list[int]]] | None = None  # (slot, positions to void, mod ring)


@dataclass(eq=False)
class Op:
    op_id: int
    client: str
    kind: str  # backup | load | swap_out | swap_in | clear_slot
    items: list[Item] = field(default_factory=list)
    host: list[tuple[str, np.ndarray, bool]] = field(default_factory=list)  # (space, rows, writes)
    clear: ClearSpec | None = None
    wait_event: Any = None  # GPU: engine's interprocess event (backup)
    layer_events: list[Any] | None = None  # GPU load: one interprocess event per stage layer
    stage_layers: tuple[int, ...] = ()
    after: list["Op"] = field(default_factory=list)  # GPU: other-stream ops to wait for
    nbytes: int = 0
    t_submit: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0
    ok: bool = True
    error: str | None = None
    path: str = ""
    done_event: Any = None
    inline: bool = False
    _per_pool: dict[str, tuple[int, int]] | None = None

    @property
    def stream(self) -> str:
        return "backup" if self.kind in ("backup", "swap_out") else "load"

    def per_pool(self) -> dict[str, tuple[int, int]]:
        """{pool: (rows or tokens, bytes)} (computed once)."""
        out = self._per_pool
        if out is None:
            out = {}
            for it in self.items:
                r, b = out.get(it.pool, (0, 0))
                out[it.pool] = (r + it.n, b + it.nbytes)
            self._per_pool = out
        return out


# ----------------------------------------------------------------------------- CPU copies
def _np3(table: LayerTable) -> np.ndarray | None:
    """A numpy ``[layers, rows, row_bytes]`` view of a CPU buffer whose layers are equally
    spaced in memory (host pools and ``DevicePools`` are), cached on the table; else None."""
    v = getattr(table, "_hicache_np3", False)
    if v is not False:
        return v
    v = None
    p = table.ptrs
    if not table.is_cuda:
        step = p[1] - p[0] if len(p) > 1 else 0
        if step >= 0 and all(p[i + 1] - p[i] == step for i in range(len(p) - 1)):
            span = (len(p) - 1) * step + (table.rows - 1) * table.stride + table.row_bytes
            raw = np.frombuffer((ctypes.c_uint8 * span).from_address(p[0]), dtype=np.uint8)
            v = as_strided(raw, shape=(len(p), table.rows, table.row_bytes),
                           strides=(step, table.stride, 1))
    table._hicache_np3 = v  # type: ignore[attr-defined]
    return v


def _small_item(it: Item) -> str:
    """A few ids: one strided numpy copy per id over all layers (``ctypes.memmove`` per layer
    and id when a buffer's layers are not equally spaced)."""
    sv, dv = _np3(it.src), _np3(it.dst)
    pairs = zip(it.src_ids.list(), it.dst_ids.list())
    f = it.fmt
    if sv is not None and dv is not None:
        if f is None:
            for a, b in pairs:
                dv[:, b, :] = sv[:, a, :]
            return "numpy"
        P, vb, sb, so = f.tokens_per_page, f.value_bytes, f.scale_bytes, f.scale_offset
        for a, b in pairs:
            ap, asl = divmod(a, P)
            bp, bsl = divmod(b, P)
            dv[:, bp, bsl * vb:(bsl + 1) * vb] = sv[:, ap, asl * vb:(asl + 1) * vb]
            if sb:
                dv[:, bp, so + bsl * sb:so + (bsl + 1) * sb] = \
                    sv[:, ap, so + asl * sb:so + (asl + 1) * sb]
        return "numpy"
    s, d = it.src, it.dst
    ss, ds = s.stride, d.stride
    pairs_l = list(pairs)
    if f is None:
        rb = s.row_bytes
        for sp, dp in zip(s.ptrs, d.ptrs):
            for a, b in pairs_l:
                _memmove(dp + b * ds, sp + a * ss, rb)
        return "memmove"
    P, vb, sb, so = f.tokens_per_page, f.value_bytes, f.scale_bytes, f.scale_offset
    offs = []
    for a, b in pairs_l:
        ap, asl = divmod(a, P)
        bp, bsl = divmod(b, P)
        offs.append((ap * ss + asl * vb, bp * ds + bsl * vb, ap * ss + so + asl * sb,
                     bp * ds + so + bsl * sb))
    for sp, dp in zip(s.ptrs, d.ptrs):
        for av, bv, asc, bsc in offs:
            _memmove(dp + bv, sp + av, vb)
            if sb:
                _memmove(dp + bsc, sp + asc, sb)
    return "memmove"


def _cpu_item(it: Item) -> str:
    if it.n <= SMALL_IDS:
        return _small_item(it)
    if it.fmt is None:
        return copy_rows(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(), impl="reference")
    return copy_tokens(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(), it.fmt,
                       impl="reference")


def _clear(spec: ClearSpec, device: torch.device) -> None:
    """Zero whole slots, or apply the MTP draft rule to ring entries of fp32 state pools."""
    slots = torch.tensor(spec.slots, dtype=torch.int64, device=device)
    for tg in spec.targets:
        for t in tg.table.layers:
            if spec.slots:
                t.index_fill_(0, slots, 0)
            if spec.draft and tg.fp32 and tg.ring > 1:
                for slot, positions in spec.draft:
                    if not positions:
                        continue
                    ring = t[slot].view(torch.float32).view(tg.ring, -1)
                    half = ring.shape[1] // 2
                    pos = torch.tensor(sorted({p % tg.ring for p in positions}),
                                       dtype=torch.int64, device=device)
                    ring[pos, :half] = 0.0
                    ring[pos, half:] = float("-inf")


def _merge_key(op: Op) -> tuple | None:
    """Ops with equal keys may merge; None: this op runs on its own."""
    if op.kind not in ("backup", "load") or op.clear is not None or \
            any(it.n > MERGE_MAX_IDS for it in op.items):
        return None
    return (op.kind, tuple((it.pool, id(it.src), id(it.dst), it.fmt is None) for it in op.items))


MERGE_MAX_IDS = 4096  # ops with more ids per item run on their own (their copy dominates anyway)


def _disjoint(dsts: list[set[int]], op: Op) -> bool:
    """True when ``op`` may join a merged run whose destinations per item are ``dsts``."""
    for d, it in zip(dsts, op.items):
        if len(d) > MERGE_MAX_IDS or not d.isdisjoint(it.dst_ids.list()):
            return False
    return True


def _merge(ops: list[Op]) -> list[Item]:
    """One item per (pool, buffers) with the ids of every op concatenated; [] if unsafe."""
    merged: list[Item] = []
    for k in range(len(ops[0].items)):
        parts = [op.items[k] for op in ops]
        dst = np.concatenate([p.dst_ids.np() for p in parts])
        if np.unique(dst).size != dst.size:
            return []  # overlapping destinations: keep the ops apart, in order
        src = np.concatenate([p.src_ids.np() for p in parts])
        p0 = parts[0]
        merged.append(Item(p0.pool, p0.src, p0.dst, Ids.of(src), Ids.of(dst), p0.fmt, p0.layers,
                           sum(p.nbytes for p in parts)))
    return merged


# ----------------------------------------------------------------------------- the engine
class TransferEngine:
    """See the module docstring."""

    def __init__(self, device: torch.device, wake: Callable[[], None], *,
                 inline_max_bytes: int = 256 << 10, ctas: int = 4) -> None:
        self.device = device
        self.cuda = device.type == "cuda"
        self.inline_max_bytes = inline_max_bytes
        self.ctas = ctas
        self._wake = wake
        self._done: list[Op] = []
        self._done_lock = threading.Lock()
        self._pending = 0  # submitted, not yet taken back (server thread only)
        self._closed = False
        self._threads: list[threading.Thread] = []
        self._queues: dict[str, queue.SimpleQueue] = {}
        self.merged_ops = 0
        if self.cuda:
            self.streams = {k: torch.cuda.Stream(device) for k in ("backup", "load")}
            self._last: dict[str, Op | None] = {"backup": None, "load": None}
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

    def run_inline(self, op: Op) -> bool:
        """CPU mode: run ``op`` now on the caller's thread if it is small and nothing is queued
        (so FIFO order holds); True when it ran (``op.ok`` says how it went)."""
        if self.cuda or self._pending or op.nbytes > self.inline_max_bytes or self._closed:
            return False
        op.inline = True
        op.t_submit = op.t_submit or time.perf_counter()
        self._run_cpu([op])
        return True

    def submit(self, op: Op) -> None:
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

    def take_completed(self) -> list[Op]:
        if not self._done:
            return []
        with self._done_lock:
            done, self._done = self._done, []
        self._pending -= len(done)
        return done

    def last_op(self, stream: str) -> Op | None:
        return self._last.get(stream) if self.cuda else None

    def forget(self, op: Op) -> None:
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
    def _finish(self, ops: list[Op]) -> None:
        with self._done_lock:
            self._done.extend(ops)
        self._wake()

    # ------------------------------------------------------------------ CPU mode
    def _run_cpu(self, ops: list[Op]) -> None:
        if len(ops) == 1 and len(ops[0].items) == 1 and ops[0].clear is None:  # the common case
            op = ops[0]
            op.t_start = time.perf_counter()
            try:
                op.path = _cpu_item(op.items[0])
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
                items = _merge(ops)
                paths = {_cpu_item(it) for it in items}
                if not items:  # unsafe to merge: run one by one
                    for op in ops:
                        self._run_cpu([op])
                    return
                self.merged_ops += len(ops) - 1
            else:
                op = ops[0]
                paths = {_cpu_item(it) for it in op.items}
                if op.clear is not None:
                    _clear(op.clear, self.device)
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

    def _cpu_batch(self, op: Op, q: queue.SimpleQueue) -> None:
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
        run: list[Op] = []
        dsts: list[set[int]] = []  # destinations per item of the current run
        for op in batch:
            key = _merge_key(op)
            if run and (key is None or key != _merge_key(run[0]) or not _disjoint(dsts, op)):
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
    def _launch_gpu(self, op: Op) -> None:
        stream = self.streams[op.stream]
        op.t_start = time.perf_counter()
        with torch.cuda.stream(stream):
            if op.wait_event is not None:
                stream.wait_event(op.wait_event)
            for other in op.after:
                if other.done_event is not None:
                    stream.wait_event(other.done_event)
            paths: set[str] = set()
            if op.layer_events is not None:
                paths.add(self._load_by_layer(op, stream))
            else:
                for it in op.items:
                    if it.fmt is None:
                        paths.add(copy_rows(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(),
                                            ctas=self.ctas, stream=stream))
                    else:
                        paths.add(copy_tokens(it.src, it.dst, it.src_ids.torch(),
                                              it.dst_ids.torch(), it.fmt, ctas=self.ctas,
                                              stream=stream))
            if op.clear is not None:
                _clear(op.clear, self.device)
                paths.add("clear")
            op.path = "+".join(sorted(paths))
            op.done_event = torch.cuda.Event()
            op.done_event.record(stream)
        self._last[op.stream] = op

    def _load_by_layer(self, op: Op, stream: Any) -> str:
        """Copies of stage layer i, then event i. Per (pool, layer): when the ids form at most
        ``RUN_COPY_MAX`` runs of consecutive rows on both sides, one ``cudaMemcpyAsync`` per run
        (copy engines, no SM, ~10 us of host time each); otherwise one row/token kernel."""
        from hicache.kernels.rows import launch_rows, rows_config
        from hicache.kernels.tokens import launch_tokens, tokens_config

        dev = self.device
        by_layer: dict[int, list[tuple[Item, int]]] = {}
        for it in op.items:
            for local, g in enumerate(it.layers):
                by_layer.setdefault(g, []).append((it, local))
        plan: dict[int, Any] = {}
        for it in op.items:
            runs = _runs(it.src_ids.np(), it.dst_ids.np()) if it.fmt is None else None
            plan[id(it)] = runs if runs is not None and len(runs) <= RUN_COPY_MAX else \
                (it.src_ids.on(dev), it.dst_ids.on(dev))
        paths = set()
        for i, g in enumerate(op.stage_layers):
            for it, local in by_layer.get(g, ()):
                p = plan[id(it)]
                if isinstance(p, list):
                    src, dst = it.src.layers[local], it.dst.layers[local]
                    for s0, d0, n in p:
                        dst[d0:d0 + n].copy_(src[s0:s0 + n], non_blocking=True)
                    paths.add("layered_memcpy")
                    continue
                s_t, d_t = _layer_table(it.src, local), _layer_table(it.dst, local)
                s_i, d_i = p
                align = min(s_t.align, d_t.align)
                if it.fmt is None:
                    launch_rows(s_t.table(dev), d_t.table(dev), s_i, d_i, num_layers=1,
                                row_bytes=s_t.row_bytes, src_stride=s_t.stride,
                                dst_stride=d_t.stride, align=align, ctas=self.ctas,
                                cfg=rows_config(s_t.is_cuda, d_t.is_cuda))
                else:
                    launch_tokens(s_t.table(dev), d_t.table(dev), s_i, d_i, it.fmt,
                                  num_layers=1, src_stride=s_t.stride, dst_stride=d_t.stride,
                                  align=align, ctas=self.ctas,
                                  cfg=tokens_config(s_t.is_cuda, d_t.is_cuda))
                paths.add("layered_zero_copy")
            op.layer_events[i].record(stream)  # type: ignore[index]
        return "+".join(sorted(paths)) or "layered_none"

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


RUN_COPY_MAX = 4  # per-layer loads: up to this many runs of consecutive rows go by memcpy


def _runs(src: np.ndarray, dst: np.ndarray) -> list[tuple[int, int, int]]:
    """(src start, dst start, length) of the runs where both sides advance by one row."""
    if src.size == 0:
        return []
    brk = np.flatnonzero((np.diff(src) != 1) | (np.diff(dst) != 1)) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [src.size]))
    if starts.size > RUN_COPY_MAX:
        return [(0, 0, 0)] * int(starts.size)  # too many: the caller takes the kernel path
    return [(int(src[a]), int(dst[a]), int(b - a)) for a, b in zip(starts, ends)]


def _layer_table(table: LayerTable, local: int) -> LayerTable:
    """Single-layer LayerTables of ``table``, built once and cached on it."""
    cache = getattr(table, "_hicache_layers", None)
    if cache is None:
        cache = [LayerTable([t], f"{table.name}[{i}]") for i, t in enumerate(table.layers)]
        table._hicache_layers = cache  # type: ignore[attr-defined]
    return cache[local]
