"""Batched copy-engine DMA: many (destination, source, size) copies per CUDA driver call.

Whole page rows of the big pools (DSV4-Flash: the 146-KiB SWA rows, the 128-KiB C4 state rows)
move at the link through the GPU's copy engines when they go in batches: on an H200,
``cuMemcpyBatchAsync`` with 256 copies per call moved random 128-150 KiB rows host→device at
0.985 of a contiguous pinned copy for 0.44 µs of host time per row, where one ``cuMemcpyAsync``
per row reached 0.45-0.52 and the zero-copy SM kernels top out near 0.91. Small rows pay
less: 37-KiB rows reached 0.84 alone, 8-KiB rows 0.35 (the SM kernels do better there). So
callers send rows of at least ``MIN_BYTES`` (32 KiB: DSV4's 37-KiB C4 rows included) here
(backups: ``MIN_ROWS`` or more at a time) and the rest to the kernels (``dispatch``). The C4
rows come here, although the kernels move them a little faster alone, because a kernel of the
daemon holds the engine's kernels back for up to a GPU time slice (no MPS) and slows a load
that runs while a backup streams; the copy engines do neither (docs/perf.md, twenty-third
session).
Two other ways lose (H200, twenty-fourth session): ``cuMemcpy3DBatchAsync`` ops covering a row
of several layers (2-3 µs of host time per op, and the copy engines run them at 0.19-0.57 of the
link), and several host threads issuing parts of a batch (the driver serializes them).

Contract:

* ``status()``: ``None`` when this process can issue batched DMA (a CUDA driver of 12.8 or
  later exporting ``cuMemcpyBatchAsync``), else the reason it cannot. Probed once.
* ``configure(mode)``: ``"auto"`` (the default: used when ``status()`` is None), ``"on"``
  (refused with ``status()``'s reason when it is not available), ``"off"``. ``enabled()``
  says whether callers should use it.
* ``DmaPlan.build(parts, layer_order)``: the copies of ``dispatch`` parts marked ``dma``,
  grouped by the position of their layer in ``layer_order`` (``plan.layers[i] = (lo, hi)``),
  as host arrays of addresses and sizes; ``DmaPlan.rows(...)`` the same for one buffer pair.
* ``plan.direction(to_device, device)`` sets the copies' location hints; then
  ``issue(plan, lo, hi, stream)`` enqueues copies ``[lo, hi)`` on ``stream`` (a raw
  ``cudaStream_t``): a first call of ``HEAD_COPIES`` copies, then calls of ``PER_CALL``, or
  with ``ramp`` (copies the link would otherwise wait for) calls ``GROWTH`` times larger each
  up to ``PER_CALL``. The copies of one call run in any
  order among themselves; the batch as a whole runs in stream order (after earlier work on the
  stream, before later work). A driver error raises ``TransferError`` naming the result code.
  Any thread may issue: one with no current CUDA context gets the stream's made current.
* ``issue_current(plan, lo, hi, device)`` does the same on ``device``'s current stream. The
  driver refuses batches on the legacy default stream, so there the batch runs on a side
  stream fenced on both ends (it starts after the work queued before it, and work queued
  after it waits for it): the same ordering.
* Nothing is validated here: ids, bounds and buffer kinds are checked by ``dispatch``.
"""
from __future__ import annotations

import ctypes
from typing import Optional, Sequence

import numpy as np
import torch

from .streams import current_stream
from .tables import TransferError

# rows at least this large go to the copy engines. 64 KiB until the twenty-third session; 32
# KiB sends DSV4's C4 rows too (H200, no MPS, 2 runs against 2): the engine's longest step
# during a checkpoints load 1.2 ms instead of 2.4 (p99 0.5-0.9 instead of 0.8-2.4), a
# checkpoints load of 128k while a backup streams 0.93-1.00 of its solo rate instead of 0.75-0.80
MIN_BYTES = 32 << 10
# ... when a backup's buffer pair has at least this many rows to move (``dispatch``): below it
# the driver's per-copy host time (0.4-2 µs a row) costs more than the kernel loses. Loads
# (``by_layer``) send every big row: they issue a step's copy-engine copies before planning
# the rest, so that host time overlaps copies already running
MIN_ROWS = 16
PER_CALL = 256  # copies per driver call (one call of thousands ran at 0.87-0.93 of the link)
# copies in the first driver call of an ``issue``: a call of 128 SWA rows took 0.21 ms of host
# time on an H200 host (layer 0 was ready 0.22 ms after it returned, sooner than its 0.35 ms at
# the link, so its copies began during the call); a short first call starts the link at once,
# and the rest are queued while it moves
HEAD_COPIES = 8
# ``issue(..., ramp=True)`` (the link idle: a load's layer 0): each later call has up to this
# many times the copies of the one before (at most ``PER_CALL``), so one call queues its copies
# while the previous call's move. After a head of 8 rows (1.2 MB, 22 µs of an H200's link) one
# call of the other 120 took 0.18-0.21 ms of host time while the link idled: layer 0 of a
# 32k-token load was ready 0.49 ms after its first call, for 0.36 ms of link. For copies
# queued behind others (the link busy) the ramp only adds calls: a whole load that ramped every
# issue took 2-3% longer at 32k tokens (docs/perf.md, twentieth session)
GROWTH = 2
MODES = ("auto", "on", "off")
_SRC_ORDER_STREAM = 1  # CU_MEMCPY_SRC_ACCESS_ORDER_STREAM
_LOC_DEVICE, _LOC_HOST = 1, 2  # CUmemLocationType


class _Loc(ctypes.Structure):
    _fields_ = [("type", ctypes.c_int), ("id", ctypes.c_int)]


class _Attrs(ctypes.Structure):  # CUmemcpyAttributes
    _fields_ = [("srcAccessOrder", ctypes.c_int), ("srcLocHint", _Loc), ("dstLocHint", _Loc),
                ("flags", ctypes.c_uint)]


class _Driver:
    """The driver entry point, its calling convention, and the one attribute every copy uses."""

    def __init__(self) -> None:
        self.fn: Optional[ctypes._CFuncPtr] = None
        self.v2 = False
        self.reason: Optional[str] = None
        try:
            if not torch.cuda.is_available():
                self.reason = "no CUDA device in this process"
                return
            lib = ctypes.CDLL("libcuda.so.1")
        except OSError as e:
            self.reason = f"the CUDA driver library could not be loaded ({e})"
            return
        ver = ctypes.c_int(0)
        lib.cuDriverGetVersion(ctypes.byref(ver))
        if ver.value < 12080:
            self.reason = f"the CUDA driver is {ver.value // 1000}.{ver.value % 1000 // 10}; " \
                          f"batched DMA needs 12.8 or later"
            return
        P, SZ, VP = ctypes.POINTER, ctypes.c_size_t, ctypes.c_void_p
        # the address arrays go as plain addresses (``issue`` passes ints: no slice or ctypes
        # pointer object per call)
        head = [VP, VP, VP, SZ, P(_Attrs), P(SZ), SZ]
        if hasattr(lib, "cuMemcpyBatchAsync_v2"):  # CUDA 13 drivers: no failure index
            self.fn, self.v2 = lib.cuMemcpyBatchAsync_v2, True
            self.fn.argtypes = head + [ctypes.c_void_p]
        elif hasattr(lib, "cuMemcpyBatchAsync"):
            self.fn = lib.cuMemcpyBatchAsync
            self.fn.argtypes = head + [P(SZ), ctypes.c_void_p]
        else:
            self.reason = "the CUDA driver exports no cuMemcpyBatchAsync"
            return
        self.fn.restype = ctypes.c_int
        self.attr_idx = (SZ * 1)(0)
        self.fail = SZ(0)
        self.ctx_get, self.ctx_set = lib.cuCtxGetCurrent, lib.cuCtxSetCurrent
        self.stream_ctx = lib.cuStreamGetCtx
        self.ctx_get.argtypes = [P(VP)]
        self.ctx_set.argtypes = [VP]
        self.stream_ctx.argtypes = [VP, P(VP)]

    def ensure_context(self, stream: int) -> None:
        """Make ``stream``'s context current on this thread when it has none. The driver call
        needs one, and a thread that made no CUDA runtime call yet (a fresh worker thread,
        even one that made a torch stream) has none: the batch then failed with CUresult 1."""
        cur = ctypes.c_void_p()
        if self.ctx_get(ctypes.byref(cur)) == 0 and cur.value:
            return
        ctx = ctypes.c_void_p()
        rc = self.stream_ctx(ctypes.c_void_p(stream), ctypes.byref(ctx))
        if rc == 0:
            rc = self.ctx_set(ctx)
        if rc != 0:
            raise TransferError(f"no CUDA context on this thread and the stream's could not be "
                                f"made current (CUresult {rc})")


_driver: Optional[_Driver] = None
_mode = "auto"


def _probe() -> _Driver:
    global _driver
    if _driver is None:
        _driver = _Driver()
    return _driver


def status() -> Optional[str]:
    """None when batched DMA can be issued here, else why not."""
    return _probe().reason


def configure(mode: str) -> None:
    """Set the process-wide policy (see the module docstring)."""
    global _mode
    if mode not in MODES:
        raise TransferError(f"copy engine mode {mode!r} is not one of {MODES}")
    if mode == "on" and status() is not None:
        raise TransferError(f"copy engine mode 'on' cannot hold: {status()}")
    _mode = mode


def enabled() -> bool:
    return _mode != "off" and status() is None


_ATTRS: dict[tuple[bool, int], _Attrs] = {}  # DmaPlan.direction's structs


class DmaPlan:
    """Host arrays of one operation's copy-engine copies, grouped by layer position."""

    def __init__(self, dst: np.ndarray, src: np.ndarray, size: np.ndarray,
                 layers: list[tuple[int, int]]) -> None:
        self.dst, self.src, self.size = dst, src, size
        self.layers = layers
        self.attrs: Optional[_Attrs] = None

    def addresses(self) -> tuple[int, int, int]:
        """Addresses of the destination, source and size arrays (contiguous 8-byte words)."""
        for a in (self.dst, self.src, self.size):
            if a.dtype.itemsize != 8 or not a.flags.c_contiguous:
                raise TransferError("a DmaPlan's arrays must be contiguous 8-byte words")
        return self.dst.ctypes.data, self.src.ctypes.data, self.size.ctypes.data

    def direction(self, to_device: bool, device: int) -> "DmaPlan":
        """Location hints of the copies (host→device when ``to_device``) on GPU ``device`` (one
        read-only attribute struct per direction and device, made once)."""
        key = (to_device, device)
        attrs = _ATTRS.get(key)
        if attrs is None:
            host, dev = _Loc(_LOC_HOST, 0), _Loc(_LOC_DEVICE, device)
            attrs = _ATTRS[key] = _Attrs(_SRC_ORDER_STREAM, host if to_device else dev,
                                         dev if to_device else host, 0)
        self.attrs = attrs
        return self

    @classmethod
    def build(cls, parts: Sequence, layer_order: Sequence[int]) -> "DmaPlan":
        """``parts``: ``SegmentPart`` s marked for the copy engines (whole rows, or blocks of
        tokens: one copy per range per layer); every copy of layer ``layer_order[i]`` lands in
        ``layers[i]``."""
        if len(parts) == 1 and len(parts[0].layers) == 1:
            # one layer (a load's layer 0: DSV4-Flash's SWA rows, one range, or a checkpoint's
            # SWA tail, a value and a scale range): ~5-8 numpy calls where the general path
            # makes ~20 (each ~5 µs in a daemon's cold host path)
            p = parts[0]
            rs = p.ranges
            if len(rs) == 1:
                rb, so, do = rs[0]
                size = np.full(so.size, rb, dtype=np.uint64)
            else:
                so, do = np.concatenate([r[1] for r in rs]), np.concatenate([r[2] for r in rs])
                size = np.repeat(np.array([r[0] for r in rs], dtype=np.uint64),
                                 [r[1].size for r in rs])
            i, n = list(layer_order).index(p.layers[0]), int(so.size)
            return cls(do.astype(np.uint64) + np.uint64(p.dst_ptrs[0]),
                       so.astype(np.uint64) + np.uint64(p.src_ptrs[0]), size,
                       [(0, 0)] * i + [(0, n)] + [(n, n)] * (len(layer_order) - i - 1))
        pos = {g: i for i, g in enumerate(layer_order)}
        blocks: list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = []
        for part in parts:
            lpos = np.array([pos[g] for g in part.layers], dtype=np.int64)
            sb = np.asarray(part.src_ptrs, dtype=np.uint64)[:, None]
            db = np.asarray(part.dst_ptrs, dtype=np.uint64)[:, None]
            for rb, so, do in part.ranges:
                if so.size == 0:
                    continue
                sp, dp = sb + so.astype(np.uint64), db + do.astype(np.uint64)
                blocks.append((np.repeat(lpos, so.size), dp.ravel(), sp.ravel(),
                               np.full(sp.size, rb, dtype=np.uint64)))
        if not blocks:
            e = np.zeros(0, dtype=np.uint64)
            return cls(e, e, e, [(0, 0)] * len(layer_order))
        if len(blocks) == 1:  # one range: no reordering when its layers are in order
            lp, dp, sp, sz = blocks[0]
            if bool((lp[1:] >= lp[:-1]).all()):  # layers in order (a load's lead)
                bounds = np.searchsorted(lp, np.arange(len(layer_order) + 1)).tolist()
                return cls(dp, sp, sz, list(zip(bounds[:-1], bounds[1:])))
        lp = np.concatenate([b[0] for b in blocks])
        order = np.argsort(lp, kind="stable")
        bounds = np.searchsorted(lp[order], np.arange(len(layer_order) + 1))
        take = [np.ascontiguousarray(np.concatenate([b[k] for b in blocks])[order])
                for k in (1, 2, 3)]
        return cls(*take, [(int(bounds[i]), int(bounds[i + 1])) for i in range(len(layer_order))])

    @classmethod
    def rows(cls, src_ptrs: Sequence[int], dst_ptrs: Sequence[int], row_bytes: int,
             src_off: np.ndarray, dst_off: np.ndarray) -> "DmaPlan":
        """Every layer of one buffer pair as one group (a backup's rows)."""
        sp = np.asarray(src_ptrs, dtype=np.uint64)[:, None] + src_off.astype(np.uint64)
        dp = np.asarray(dst_ptrs, dtype=np.uint64)[:, None] + dst_off.astype(np.uint64)
        n = sp.size
        return cls(np.ascontiguousarray(dp.ravel()), np.ascontiguousarray(sp.ravel()),
                   np.full(n, row_bytes, dtype=np.uint64), [(0, n)])


def issue(plan: DmaPlan, lo: int, hi: int, stream: int, ramp: bool = False) -> None:
    """Enqueue copies ``[lo, hi)`` of ``plan`` on the raw stream handle ``stream``: a first call
    of ``HEAD_COPIES``, then calls of ``PER_CALL`` (``ramp``: ``GROWTH`` times larger each, up
    to ``PER_CALL``)."""
    if hi <= lo:
        return
    d = _probe()
    if d.fn is None:
        raise TransferError(f"batched DMA is not available: {d.reason}")
    if plan.attrs is None:
        raise TransferError("DmaPlan.direction(...) was not set before issue")
    d.ensure_context(stream)
    s = ctypes.c_void_p(stream)
    attrs = ctypes.byref(plan.attrs)
    dst, src, size = plan.addresses()
    a, k = lo, HEAD_COPIES
    while a < hi:
        b = min(hi, a + k)
        args = (dst + 8 * a, src + 8 * a, size + 8 * a, b - a, attrs, d.attr_idx, 1)
        rc = d.fn(*args, s) if d.v2 else d.fn(*args, ctypes.byref(d.fail), s)
        if rc != 0:
            raise TransferError(f"cuMemcpyBatchAsync failed with CUresult {rc} on copies "
                                f"{a}..{b - 1} of {len(plan.dst)}")
        a, k = b, min(PER_CALL, k * GROWTH) if ramp else PER_CALL


_side: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def side_stream(device: torch.device) -> "torch.cuda.Stream":
    """The copy-engine side stream of ``device``'s current stream (made once per stream):
    ``issue_current``'s batches when that stream is the legacy default stream, which the
    driver refuses batches on."""
    cur = current_stream(device)
    key = (cur.device_index, cur.cuda_stream)
    side = _side.get(key)
    if side is None:
        side = _side[key] = torch.cuda.Stream(torch.device("cuda", cur.device_index))
    return side


def issue_current(plan: DmaPlan, lo: int, hi: int, device: torch.device,
                  ramp: bool = False) -> None:
    """``issue`` on ``device``'s current stream (see the module docstring)."""
    if hi <= lo:
        return
    cur = current_stream(device)
    if cur.cuda_stream != 0:
        issue(plan, lo, hi, cur.cuda_stream, ramp)
        return
    side = side_stream(device)
    side.wait_stream(cur)
    try:
        issue(plan, lo, hi, side.cuda_stream, ramp)
    finally:  # copies a failed issue queued before its error are fenced too
        cur.wait_stream(side)
