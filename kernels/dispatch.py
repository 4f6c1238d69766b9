"""The one entry point of the copy paths: check a request, then pick a path and launch it.

* ``copy_rows(src, dst, src_idx, dst_idx)`` — whole rows (KV page rows, state rows) of every
  layer: batched copy-engine DMA (``copy_engine``) for rows of ``copy_engine.MIN_BYTES`` or
  more, ``copy_engine.MIN_ROWS`` or more at a time, between the GPU and pinned host memory
  with CPU indices (one copy per block of rows consecutive on both sides, ``row_offsets``);
  else, host to device, the staged path (one DMA per run + few-CTA scatter) when the host
  side comes in long runs of consecutive rows and its indices are on the CPU;
  else the zero-copy kernel. Device to host, ``auto`` never stages: the kernel's posted writes
  into pinned memory beat the gather + DMA on every row size measured (H200, 128 consecutive
  host rows: 37-KiB rows 43.8 against 36.1 GB/s, 32-KiB rows 46.4 against 41.6).
* ``copy_tokens(src, dst, src_tok, dst_tok, fmt)`` — token-granular copy for a ``TokenFormat``;
  a request that is whole pages (CPU token ids ``k*P .. k*P+P-1`` in order on both sides) goes
  to ``copy_rows`` instead when the format has no padding (``fmt.covers_row``): a token copy
  moves values and scales only, never the padding bytes of a row.
* ``KernelBatch`` — given to ``copy_rows`` / ``copy_tokens`` (``batch=``), their kernel copies
  wait in it and ``flush()`` uploads all their CPU ids in one pinned block and one copy, then
  launches them (the daemon's backups: one upload for all pools, not one per pool).
* ``copy_by_layer`` / ``issue_by_layer`` / ``layer_parts`` / ``warm_up`` (``by_layer``, re-exported
  here) — rows and tokens of many buffers, layer by layer, layer 0 first, copy-engine batches
  beside one segment launch per launch group; the daemon's loads.
* ``warm_up_copies(pairs, device)`` — the row and token kernel variants that copies between
  given tables take, compiled and loaded before the first copy needs them (the daemon, at
  start and at ``register``).

Buffers are ``LayerTable`` s (preferred: their pointer tables are cached) or lists of per-layer
``[rows, row_bytes]`` uint8 tensors. Index tensors are 1-D int64, on the CPU or on the kernel's
GPU. Every check (lengths, dtype, device, bounds, row sizes, layer shapes) raises
``TransferError`` before anything is launched; bounds of GPU-resident indices cost one sync.
Duplicate destination indices are not rejected: which source wins is unspecified.

``impl``: ``"auto"``, ``"zero_copy"`` (Triton, reads/writes pinned host memory directly),
``"staged"`` (device↔host rows only), ``"dma"`` (batched copy-engine copies of big rows; refused
with the reason where it cannot run), ``"reference"`` (torch; the CPU path), ``"triton"`` (an
alias of zero_copy, also valid on CPU under ``TRITON_INTERPRET=1``). ``ctas`` is the SM budget
(persistent grid). ``stream``: a ``torch.cuda.Stream`` to run on (default: the current one).
Each call returns the name of the path it used.
"""
from __future__ import annotations

from typing import Callable, Iterable, Optional

import numpy as np
import torch

from . import copy_engine
from .by_layer import (DEFAULT_CTAS, copy_by_layer, issue_by_layer, layer_groups, layer_parts,
                       warm_up)
from .checks import _check_ctas, _check_pair, _dma_direction, _pinned
from .copy_engine import DmaPlan
from .reference import copy_rows_ref, copy_tokens_ref
from .rows import ROWS_KERNEL, launch_rows, pads_badly, rows_config
from .segments import SEG_KERNEL, SegmentPart, row_offsets
from .staged import copy_rows_staged, plan_runs
from .streams import on_stream
from .tables import Buffer, LayerTable, TokenFormat, TransferError, as_table
from .tokens import TOKENS_KERNEL, launch_tokens, tokens_config

__all__ = ["copy_rows", "copy_tokens", "KernelBatch", "copy_by_layer", "issue_by_layer",
           "layer_parts", "layer_groups", "warm_up", "warm_up_copies", "kernel_variants",
           "LayerTable", "TokenFormat", "TransferError", "DEFAULT_CTAS", "IMPLS"]
IMPLS = ("auto", "zero_copy", "triton", "staged", "dma", "reference")
# staged pays off when host runs are at least this many bytes long on average
STAGED_MIN_RUN_BYTES = 2 << 20
# token copies between device and host at least this long are issued in host-address order
SORT_MIN_TOKENS = 1024
# devices whose host-order sort ``warm_up_copies`` has run in this process (its kernels load
# once per device and process: a second warm-up would only sort again)
_SORT_WARMED: set[torch.device] = set()


def _check_index(name: str, idx: object, n: Optional[int]) -> torch.Tensor:
    if not isinstance(idx, torch.Tensor):
        raise TransferError(f"{name}: expected a torch.Tensor of int64, got {type(idx).__name__}")
    if idx.dtype != torch.int64:
        raise TransferError(f"{name}: expected dtype torch.int64, got {idx.dtype}")
    if idx.dim() != 1:
        raise TransferError(f"{name}: expected a 1-D tensor, got shape {tuple(idx.shape)}")
    if n is not None and idx.numel() != n:
        raise TransferError(f"{name} has {idx.numel()} entries, the source list has {n}")
    return idx.contiguous()  # the kernels read the ids as packed int64 (a view: its copy)


def _kernel_device(src: LayerTable, dst: LayerTable, impl: str) -> Optional[torch.device]:
    """The GPU a kernel runs on; None for CPU-only buffers (reference or interpreter)."""
    dev = src.device if src.is_cuda else (dst.device if dst.is_cuda else None)
    if dev is not None and impl != "reference":
        for t in (src, dst):
            if not t.is_cuda and not _pinned(t):
                raise TransferError(f"{t.name} is host memory the GPU cannot address (not "
                                    f"pinned/registered): register it, or use impl='reference'")
    return dev


def _check_bounds(pairs: list[tuple[str, torch.Tensor, int]]) -> None:
    """0 <= idx < limit for each (name, idx, limit): host indices through numpy (a few µs),
    GPU-resident ones with one host sync for all of them."""
    pairs = [p for p in pairs if p[1].numel()]
    on_gpu = [p for p in pairs if p[1].is_cuda]
    stats = [(int(a.min()), int(a.max())) for a in (i.numpy() for _, i, _ in pairs
                                                     if not i.is_cuda)]
    if on_gpu:
        stats += torch.stack([torch.stack([i.min(), i.max()]) for _, i, _ in on_gpu]).tolist()
    for (name, _, limit), (lo, hi) in zip([p for p in pairs if not p[1].is_cuda] + on_gpu,
                                          stats):
        if lo < 0 or hi >= limit:
            bad = lo if lo < 0 else hi
            raise TransferError(f"{name}: index {bad} out of range [0, {limit})")


def _to(idx: torch.Tensor, device: Optional[torch.device]) -> torch.Tensor:
    """Indices on the kernel's device, copied on the current stream without blocking the
    host: a copy from pageable memory would first wait for the whole stream to drain, so CPU
    indices go through pinned memory (torch's pinned cache keeps it until the copy is done)."""
    if device is None or idx.device == device:
        return idx
    if idx.is_cuda:
        raise TransferError(f"index tensor on {idx.device}, kernel runs on {device}")
    if not idx.is_pinned():
        idx = idx.pin_memory()
    return idx.to(device, non_blocking=True)


def _to_both(a: torch.Tensor, b: torch.Tensor, device: Optional[torch.device]
             ) -> tuple[torch.Tensor, torch.Tensor]:
    """Two CPU index lists of one length on the kernel's device through one pinned block and one
    copy on the current stream (``_to`` twice is twice its host calls: a pinned block, a fill
    and a copy each). Others go as ``_to`` takes them."""
    if device is None or a.is_cuda or b.is_cuda or a.numel() != b.numel():
        return _to(a, device), _to(b, device)
    d = _to_all([a, b], device)
    return d[0], d[1]


def _to_all(lists: list[torch.Tensor], device: torch.device) -> list[torch.Tensor]:
    """CPU int64 index lists on ``device`` through one block (pinned for a GPU) and one copy on
    the current stream. Each list starts 16 bytes aligned, as a list of its own does (a launch
    specializes on its ids' alignment)."""
    starts, m = [], 0
    for t in lists:
        starts.append(m)
        n = t.numel()
        m += n + (n & 1)
    block = torch.empty(max(m, 2), dtype=torch.int64, pin_memory=device.type == "cuda")
    v = block.numpy()
    for t, at in zip(lists, starts):
        v[at:at + t.numel()] = t.numpy()
    d = block.to(device, non_blocking=True)
    return [d[at:at + t.numel()] for t, at in zip(lists, starts)]


Launch = Callable[[torch.Tensor, torch.Tensor], None]


class KernelBatch:
    """Kernel copies whose CPU ids reach the GPU in one pinned block and one copy, where each
    copy alone makes its own (``_to_both``: about 22 µs of host time each on an H100, seven a
    DSV4-Flash backup; docs/perf.md, sixty-seventh session).

    ``copy_rows`` / ``copy_tokens`` given ``batch=`` check their request and pick its path at
    once, as without it; the copy-engine, staged and reference paths run at once too, and only
    a kernel copy with both id lists on the CPU is queued here. ``flush()`` uploads the queued
    ids and launches the queued copies, in the order they came, on the one stream and device
    they share (a copy for another stream or device is refused with ``TransferError``), and
    returns how many it launched. Nothing is launched before ``flush``, so a caller flushes
    before anything that must follow the copies on the stream; a batch is flushed once."""

    def __init__(self) -> None:
        self._queued: list[tuple[Launch, torch.Tensor, torch.Tensor]] = []
        self._where: Optional[tuple[object, torch.device]] = None
        self.flushed = False

    def add(self, a: torch.Tensor, b: torch.Tensor, stream: Optional["torch.cuda.Stream"],
            device: torch.device, launch: Launch) -> None:
        """Queue ``launch(a_on_device, b_on_device)``: CPU ids ``a`` and ``b``, for ``device``
        on ``stream`` (None: the stream current at ``flush``)."""
        if self.flushed:
            raise TransferError("this KernelBatch was flushed already: a batch is flushed once")
        where = (stream, device)
        if self._where is None:
            self._where = where
        elif self._where != where:
            raise TransferError(f"one KernelBatch runs on one stream of one device: this copy is "
                                f"for {device} on {stream}, the batch's for "
                                f"{self._where[1]} on {self._where[0]}")
        self._queued.append((launch, a, b))

    def flush(self) -> int:
        """Upload the queued ids (one block, one copy) and launch the queued copies."""
        if self.flushed:
            raise TransferError("this KernelBatch was flushed already: a batch is flushed once")
        self.flushed = True
        if self._where is None:
            return 0
        stream, device = self._where
        with on_stream(stream, device):
            ids = _to_all([t for _, a, b in self._queued for t in (a, b)], device)
            for k, (launch, _, _) in enumerate(self._queued):
                launch(ids[2 * k], ids[2 * k + 1])
        return len(self._queued)


def _kernel_copy(a: torch.Tensor, b: torch.Tensor, device: Optional[torch.device],
                 stream: Optional["torch.cuda.Stream"], batch: Optional[KernelBatch],
                 launch: Launch) -> None:
    """``launch`` the kernel copy of CPU or device ids ``a`` -> ``b`` (``device`` None: the
    interpreter on the CPU): queued in ``batch`` when there is one, the kernel runs on a GPU
    and both lists are on the CPU, else now on ``stream``, its ids uploaded alone."""
    if batch is not None and device is not None and not a.is_cuda and not b.is_cuda:
        batch.add(a, b, stream, device, launch)
        return
    with on_stream(stream, device):
        launch(*_to_both(a, b, device))


def _resolve(impl: str, device: Optional[torch.device]) -> str:
    if impl not in IMPLS:
        raise TransferError(f"impl {impl!r} is not one of {IMPLS}")
    if impl == "triton":
        impl = "zero_copy"
    if impl == "auto":
        return "zero_copy" if device is not None else "reference"
    return impl


def _staged_ok(src: LayerTable, dst: LayerTable, host_idx: torch.Tensor) -> Optional[torch.Tensor]:
    """Run starts when the staged path applies and pays off (host to device only), else
    None."""
    if src.is_cuda or not dst.is_cuda or host_idx.is_cuda or host_idx.numel() == 0:
        return None
    if not src.contiguous_rows():
        return None
    runs = plan_runs(host_idx)
    if host_idx.numel() * src.row_bytes < STAGED_MIN_RUN_BYTES * runs.numel():
        return None
    return runs


def _staged_required(src: LayerTable, dst: LayerTable, host_idx: torch.Tensor) -> torch.Tensor:

    if src.is_cuda == dst.is_cuda:
        raise TransferError("staged path needs one device and one host buffer")
    if host_idx.is_cuda:
        raise TransferError("staged path needs the host-side indices on the CPU")
    if not (dst if src.is_cuda else src).contiguous_rows():
        raise TransferError("staged path needs host rows packed back to back")
    return plan_runs(host_idx)


def copy_rows(src: Buffer, dst: Buffer, src_idx: torch.Tensor, dst_idx: torch.Tensor, *,
              ctas: int = DEFAULT_CTAS, impl: str = "auto",
              stream: Optional["torch.cuda.Stream"] = None,
              batch: Optional[KernelBatch] = None) -> str:
    """dst[l][dst_idx[i]] = src[l][src_idx[i]] for every layer l; returns the path used. With
    ``batch``, a kernel copy is queued there (``KernelBatch``)."""
    src, dst = as_table(src, "source"), as_table(dst, "destination")
    _check_pair(src, dst)
    src_idx = _check_index("src_idx", src_idx, None)
    dst_idx = _check_index("dst_idx", dst_idx, src_idx.numel())
    ctas = _check_ctas(ctas)
    device = _kernel_device(src, dst, impl)
    path = _resolve(impl, device)
    _check_bounds([("src_idx", src_idx, src.rows), ("dst_idx", dst_idx, dst.rows)])
    if src_idx.numel() == 0:
        return "rows_" + path
    if _use_dma(src, dst, src_idx, dst_idx, path, impl, device):
        assert device is not None
        plan = _rows_plan(src, dst, src_idx.numpy(), dst_idx.numpy()).direction(
            dst.is_cuda, device.index or 0)
        with on_stream(stream, device):
            copy_engine.issue_current(plan, 0, len(plan.dst), device)
        return "rows_dma"
    runs = None
    if path in ("zero_copy", "staged") and device is not None:
        host_idx = dst_idx if src.is_cuda else src_idx
        if path == "staged":
            runs = _staged_required(src, dst, host_idx)
        elif impl == "auto":
            runs = _staged_ok(src, dst, host_idx)
            path = "zero_copy" if runs is None else "staged"
    elif path == "staged":
        raise TransferError("staged path needs a GPU: one device and one host buffer")
    if path == "reference":  # on ``stream`` too, after the caller's waits there
        with on_stream(stream):
            copy_rows_ref(src.layers, dst.layers, src_idx, dst_idx)
        return "rows_" + path
    kdev = device if device is not None else torch.device("cpu")
    if path == "staged":
        with on_stream(stream, device):
            # only the device side's indices go to the GPU; the host side's plan the DMAs
            if src.is_cuda:
                copy_rows_staged(src, dst, _to(src_idx, device), dst_idx, dst_idx, runs, ctas=ctas)
            else:
                copy_rows_staged(src, dst, src_idx, _to(dst_idx, device), src_idx, runs, ctas=ctas)
    else:
        _kernel_copy(src_idx, dst_idx, device, stream, batch,
                     lambda s, d: launch_row_copy(src, dst, s, d, kdev, ctas))
    return "rows_" + path


def _rows_plan(src: LayerTable, dst: LayerTable, s: np.ndarray, d: np.ndarray) -> DmaPlan:
    """The copy-engine copies of whole rows ``s`` -> ``d`` of every layer: one per row, or one
    per block of rows consecutive on both sides (``row_offsets``)."""
    _, ranges = row_offsets(src, dst, s, d)
    if len(ranges) == 1 and ranges[0][0] == src.row_bytes:  # no two rows in a row
        return DmaPlan.rows(src.ptrs, dst.ptrs, src.row_bytes, ranges[0][1], ranges[0][2])
    layers = list(range(src.num_layers))
    return DmaPlan.build([SegmentPart(src.ptrs, dst.ptrs, layers, ranges)], layers)


def _use_dma(src: LayerTable, dst: LayerTable, src_idx: torch.Tensor, dst_idx: torch.Tensor,
             path: str, impl: str, device: Optional[torch.device]) -> bool:
    """Whether ``copy_rows`` goes to the copy engines: always for ``impl="dma"`` (refused with
    the reason when it cannot), by default (``auto``) for rows that qualify."""
    if path not in ("dma", "zero_copy"):
        return False
    why = None
    if device is None:
        why = "it needs a GPU"
    elif not copy_engine.enabled():
        why = copy_engine.status() or "the copy engine is switched off (copy_engine = off)"
    elif not _dma_direction(src, dst):
        why = (f"it moves whole rows of {copy_engine.MIN_BYTES} B or more between device "
               f"memory and pinned host memory at its own address")
    elif src_idx.is_cuda or dst_idx.is_cuda:
        why = "it needs both index lists on the CPU"
    if path == "dma" and why is not None:
        raise TransferError(f"impl='dma' cannot run: {why}")
    return why is None and (impl == "dma" or (impl == "auto"
                                              and src_idx.numel() >= copy_engine.MIN_ROWS))


def launch_row_copy(src: LayerTable, dst: LayerTable, s_idx: torch.Tensor, d_idx: torch.Tensor,
                    kdev: torch.device, ctas: int) -> None:
    """The zero-copy row kernel for every layer of ``src``/``dst`` (indices already on
    ``kdev``); rows that pad badly to a power of two go through the token kernel instead."""
    cfg = rows_config(src.is_cuda, dst.is_cuda)
    align = min(src.align, dst.align)
    rb = src.row_bytes
    if pads_badly(rb, cfg):
        launch_tokens(src.table(kdev), dst.table(kdev), s_idx, d_idx, TokenFormat(1, rb, 0, rb, rb),
                      num_layers=src.num_layers, src_stride=src.stride, dst_stride=dst.stride,
                      align=align, ctas=ctas, cfg=tokens_config(src.is_cuda, dst.is_cuda))
        return
    launch_rows(src.table(kdev), dst.table(kdev), s_idx, d_idx, num_layers=src.num_layers,
                row_bytes=rb, src_stride=src.stride, dst_stride=dst.stride, align=align,
                ctas=ctas, cfg=cfg)


def _whole_pages(tok: torch.Tensor, P: int) -> Optional[torch.Tensor]:
    """Page ids when CPU token ids are whole pages in slot order, else None (numpy: a few µs,
    where the same test in torch ops on the CPU took tens)."""
    if tok.is_cuda or tok.numel() % P:
        return None
    pages = tok.numpy().reshape(-1, P)
    first = pages[:, 0]
    if (first % P).any() or not (pages == first[:, None] + np.arange(P)).all():
        return None
    return torch.from_numpy(first // P)


def _host_order(s_tok: torch.Tensor, d_tok: torch.Tensor, src: LayerTable,
                dst: LayerTable) -> tuple[torch.Tensor, torch.Tensor]:
    """Token pairs reordered by their host-side id (one device argsort), so that neighbouring
    CTAs touch neighbouring host pages: on an H200 this lifted random 32k-token H2D copies from
    0.82 to 0.86 of the link at 4 CTAs (D2H unchanged). Short lists and device-to-device copies
    keep their order (the sort would cost more than it saves)."""
    if s_tok.numel() < SORT_MIN_TOKENS or src.is_cuda == dst.is_cuda:
        return s_tok, d_tok
    order = torch.argsort(d_tok if src.is_cuda else s_tok)
    return s_tok[order], d_tok[order]


def copy_tokens(src: Buffer, dst: Buffer, src_tok: torch.Tensor, dst_tok: torch.Tensor,
                fmt: TokenFormat, *, ctas: int = DEFAULT_CTAS, impl: str = "auto",
                stream: Optional["torch.cuda.Stream"] = None,
                batch: Optional[KernelBatch] = None) -> str:
    """Copy token ``src_tok[i]`` (value and scale) to token ``dst_tok[i]`` in every layer. With
    ``batch``, a kernel copy is queued there (``KernelBatch``)."""
    if not isinstance(fmt, TokenFormat):
        raise TransferError(f"fmt: expected a TokenFormat, got {type(fmt).__name__}")
    src, dst = as_table(src, "source"), as_table(dst, "destination")
    _check_pair(src, dst)
    if src.row_bytes != fmt.page_bytes:
        raise TransferError(f"rows are {src.row_bytes} B, token format pages are "
                            f"{fmt.page_bytes} B")
    src_tok = _check_index("src_tok", src_tok, None)
    dst_tok = _check_index("dst_tok", dst_tok, src_tok.numel())
    ctas = _check_ctas(ctas)
    device = _kernel_device(src, dst, impl)
    path = _resolve(impl, device)
    if path in ("staged", "dma"):
        raise TransferError(f"the {path} path copies whole rows only; token copies are zero_copy")
    P = fmt.tokens_per_page
    _check_bounds([("src_tok", src_tok, src.rows * P), ("dst_tok", dst_tok, dst.rows * P)])
    if src_tok.numel() == 0:
        return "tokens_" + path
    if impl == "auto" and fmt.covers_row:
        sp, dp = _whole_pages(src_tok, P), _whole_pages(dst_tok, P)
        if sp is not None and dp is not None:
            return copy_rows(src, dst, sp, dp, ctas=ctas, impl=impl, stream=stream,
                             batch=batch)
    if path == "reference":  # on ``stream`` too, after the caller's waits there
        with on_stream(stream):
            copy_tokens_ref(src.layers, dst.layers, src_tok, dst_tok, fmt)
        return "tokens_" + path
    kdev = device if device is not None else torch.device("cpu")
    _kernel_copy(src_tok, dst_tok, device, stream, batch, lambda s, d: launch_token_copy(
        src, dst, *_host_order(s, d, src, dst), fmt, kdev, ctas))
    return "tokens_" + path


def launch_token_copy(src: LayerTable, dst: LayerTable, s_tok: torch.Tensor, d_tok: torch.Tensor,
                      fmt: TokenFormat, kdev: torch.device, ctas: int) -> None:
    """The token kernel for every layer of ``src``/``dst`` (token ids already on ``kdev``)."""
    launch_tokens(src.table(kdev), dst.table(kdev), s_tok, d_tok, fmt,
                  num_layers=src.num_layers, src_stride=src.stride, dst_stride=dst.stride,
                  align=min(src.align, dst.align), ctas=ctas,
                  cfg=tokens_config(src.is_cuda, dst.is_cuda))


def kernel_variants() -> dict[str, int]:
    """Variants held in Triton's in-memory caches (all devices) per copy kernel: ``rows``,
    ``tokens``, ``segments``. After a warm-up this grows only where a copy compiled on its
    first use (the daemon's ``stats``; 0 each under the interpreter, which compiles nothing)."""
    def held(fn: object) -> int:
        return sum(len(v[0]) for v in getattr(fn, "device_caches", {}).values())
    return {"rows": held(ROWS_KERNEL.fn), "tokens": held(TOKENS_KERNEL.fn),
            "segments": held(SEG_KERNEL.fn)}


class _Scratch:
    """Stands in for a ``LayerTable`` in a warm-up launch: what a launch specializes on (row
    size, stride, alignment, which side is the GPU's own memory) is the real table's; its one
    layer is a scratch buffer on the GPU, so the launch touches no pool."""

    def __init__(self, like: LayerTable, device: torch.device) -> None:
        self.name, self.is_cuda, self.num_layers = like.name, like.is_cuda, 1
        self.row_bytes, self.stride, self.align = like.row_bytes, like.stride, like.align
        self.buf = torch.zeros(like.row_bytes, dtype=torch.uint8, device=device)
        self._table = torch.tensor([self.buf.data_ptr()], dtype=torch.int64, device=device)

    def table(self, device: torch.device) -> torch.Tensor:
        return self._table


Pair = tuple[LayerTable, LayerTable, Optional[TokenFormat]]


def warm_up_copies(pairs: Iterable[Pair], device: torch.device,
                   stream: Optional["torch.cuda.Stream"] = None) -> int:
    """Compile and load on ``device`` the kernel variants that copies between each ``(src, dst,
    fmt)`` pair launch (the row kernel of ``copy_rows``, or the token kernel where its rows pad
    badly; the token kernel of ``copy_tokens`` too when ``fmt`` is given), launching each once
    on scratch buffers, on ``stream`` (default: a stream of its own, which waits for no other
    stream), and waits for them there: no pool byte is touched. A stream the copies will run on
    has its own first uses warmed too (its index upload: a pinned block and a device block of
    the caching allocator, which keeps blocks per stream). A variant already loaded costs one
    launch. Where a pair copies tokens between the GPU and the host, the host-order sort of
    long token copies (``_host_order``: a device argsort and two gathers) runs too, once per
    device and process (``_SORT_WARMED``; the daemon warms twice at start and twice at each
    ``register``): its first use loads its kernels, 55-88 ms of host time in a fresh process
    (H100, sixty-seventh session; 0.7 ms once warmed). Returns the kernel launches made (the
    sort not counted).

    Without it a copy's first use of a variant compiles it (0.1-0.8 s on an H100 with Triton's
    cache empty, 3-13 ms from its disk cache) on the thread that issues the copy, holding the
    GIL, so a daemon's loop stood still that long (docs/perf.md, sixty-second session). The row
    and token kernels take the copy's length at run time (``do_not_specialize``), so a pair
    has one variant per kernel, whatever its copies' lengths."""
    done: set[tuple] = set()
    launches = 0
    if stream is None:
        stream = torch.cuda.Stream(device)
    with torch.cuda.device(device), torch.cuda.stream(stream):
        # as a copy's CPU ids go (one pinned block, copied on the stream): that path's first
        # use too
        idx, _ = _to_both(torch.zeros(1, dtype=torch.int64), torch.zeros(1, dtype=torch.int64),
                          device)
        here = torch.device("cuda", torch.cuda.current_device())  # ``cuda`` named with its index
        for src, dst, fmt in pairs:
            key = (src.row_bytes, src.stride, dst.stride, src.align, dst.align, src.is_cuda,
                   dst.is_cuda, fmt)
            if key in done:
                continue
            done.add(key)
            s, d = _Scratch(src, device), _Scratch(dst, device)
            launch_row_copy(s, d, idx, idx, device, DEFAULT_CTAS)  # type: ignore[arg-type]
            launches += 1
            if fmt is not None:
                launch_token_copy(s, d, idx, idx, fmt, device,  # type: ignore[arg-type]
                                  DEFAULT_CTAS)
                launches += 1
                if here not in _SORT_WARMED and src.is_cuda != dst.is_cuda:
                    many = torch.zeros(SORT_MIN_TOKENS, dtype=torch.int64, device=device)
                    _host_order(many, many, s, d)  # type: ignore[arg-type]  # long copies sort
                    _SORT_WARMED.add(here)
    stream.synchronize()
    return launches
