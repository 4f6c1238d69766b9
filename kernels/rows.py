"""Zero-copy row copy: row ``src_idx[i]`` of every layer to row ``dst_idx[i]`` of that layer, all
layers of a pool in one launch, on a persistent grid of ``ctas`` CTAs.

Each layer's base address comes from an int64 pointer table (``LayerTable``); host buffers are
pinned, so the GPU reads or writes them directly over PCIe (UVA). A row is cut into pieces of
``CH`` bytes; one loop iteration of a CTA moves ``G`` consecutive pieces (layer-major, then
index, then piece), issuing all ``G * CH`` loads before the stores, so the bytes in flight per
CTA, which bound PCIe read throughput, are set by ``G * CH``.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .grid import runtime_loops
from .launch_cache import CachedKernel


@dataclass(frozen=True)
class RowsConfig:
    """Launch shape: ``pieces`` per iteration of ``piece_bytes`` each, ``num_warps`` per CTA."""

    piece_bytes: int = 2048
    pieces: int = 16
    num_warps: int = 16
    load_cache: str = ""  # Triton cache_modifier of the loads ("", ".cg", ".cv", ...)
    store_cache: str = ""  # ... and of the stores ("", ".cs", ".wt", ...)


@triton.jit
def _rows_step(it, src_tab, dst_tab, src_idx, dst_idx, n, total_pieces, src_stride, dst_stride,
               RB: tl.constexpr, PPR: tl.constexpr, CH: tl.constexpr, G: tl.constexpr,
               ALIGN: tl.constexpr, LOAD_CM: tl.constexpr, STORE_CM: tl.constexpr):
    """Move pieces it*G .. it*G+G-1 (piece = layer-major, then index, then CH-byte chunk)."""
    cols = tl.arange(0, CH)
    p = tl.arange(0, G).to(tl.int64) + it * G
    live = p < total_pieces
    chunk = p % PPR
    r = p // PPR
    layer = r // n
    i = r - layer * n
    s_row = tl.load(src_idx + i, mask=live, other=0)
    d_row = tl.load(dst_idx + i, mask=live, other=0)
    s_base = tl.load(src_tab + layer, mask=live, other=0) + s_row * src_stride + chunk * CH
    d_base = tl.load(dst_tab + layer, mask=live, other=0) + d_row * dst_stride + chunk * CH
    s_ptr = s_base.to(tl.pointer_type(tl.uint8))
    d_ptr = d_base.to(tl.pointer_type(tl.uint8))
    if ALIGN > 1:
        s_ptr = tl.multiple_of(s_ptr, ALIGN)
        d_ptr = tl.multiple_of(d_ptr, ALIGN)
    lim = RB - chunk * CH
    m = live[:, None] & (cols[None, :] < lim[:, None])
    v = tl.load(s_ptr[:, None] + cols[None, :], mask=m, cache_modifier=LOAD_CM)
    tl.store(d_ptr[:, None] + cols[None, :], v, mask=m, cache_modifier=STORE_CM)


@triton.jit(do_not_specialize=["n", "total_pieces", "src_stride", "dst_stride"])
def _rows_kernel(src_tab, dst_tab, src_idx, dst_idx, n, total_pieces, src_stride, dst_stride,
                 RB: tl.constexpr, PPR: tl.constexpr, CH: tl.constexpr, G: tl.constexpr,
                 ALIGN: tl.constexpr, LOAD_CM: tl.constexpr, STORE_CM: tl.constexpr,
                 PERSISTENT: tl.constexpr):
    pid = tl.program_id(0)
    if PERSISTENT:
        for it in range(pid, tl.cdiv(total_pieces, G), tl.num_programs(0)):
            _rows_step(it, src_tab, dst_tab, src_idx, dst_idx, n, total_pieces, src_stride,
                       dst_stride, RB, PPR, CH, G, ALIGN, LOAD_CM, STORE_CM)
    else:  # one step per program: only for interpreters without runtime loop bounds
        _rows_step(pid, src_tab, dst_tab, src_idx, dst_idx, n, total_pieces, src_stride,
                   dst_stride, RB, PPR, CH, G, ALIGN, LOAD_CM, STORE_CM)


ROWS_KERNEL = CachedKernel(_rows_kernel)  # launched without the JIT's per-call work


def pads_badly(row_bytes: int, cfg: RowsConfig = RowsConfig()) -> bool:
    """A small row that pads badly to a power of two (584 -> 1024): the token kernel moves it
    better, as a power-of-two head plus a short tail (512 + 72)."""
    return row_bytes < cfg.piece_bytes and 4 * row_bytes < 3 * triton.next_power_of_2(row_bytes)


def launch_rows(src_tab: torch.Tensor, dst_tab: torch.Tensor, src_idx: torch.Tensor,
                dst_idx: torch.Tensor, *, num_layers: int, row_bytes: int, src_stride: int,
                dst_stride: int, align: int, ctas: int, cfg: RowsConfig = RowsConfig()) -> None:
    """Launch one copy of ``len(src_idx)`` rows x ``num_layers`` layers on the current stream.

    Tables and indices must already sit on the device the kernel runs on (CPU under the
    Triton interpreter); nothing is checked here (``dispatch`` does it, and sends small rows
    that ``pads_badly`` to the token kernel).
    """
    n = int(src_idx.numel())
    if n == 0 or num_layers == 0:
        return
    ch = min(cfg.piece_bytes, triton.next_power_of_2(row_bytes))
    ppr = triton.cdiv(row_bytes, ch)
    total = num_layers * n * ppr
    g = cfg.pieces  # not cut to a short copy's size: one variant per row shape (masked tail)
    persistent = runtime_loops()
    steps = triton.cdiv(total, g)
    grid = (max(1, min(int(ctas), steps)) if persistent else steps,)
    args = {"src_tab": src_tab, "dst_tab": dst_tab, "src_idx": src_idx, "dst_idx": dst_idx,
            "n": n, "total_pieces": total, "src_stride": src_stride, "dst_stride": dst_stride,
            "RB": row_bytes, "PPR": ppr, "CH": ch, "G": g, "ALIGN": min(align, ch),
            "LOAD_CM": cfg.load_cache, "STORE_CM": cfg.store_cache, "PERSISTENT": persistent}
    ROWS_KERNEL.launch(grid, args, {"num_warps": cfg.num_warps}, src_tab.is_cuda)


# Launch shapes per direction (src on GPU, dst on GPU), chosen by `hicache bench transfer
# --tune` on an H200; anything not listed uses RowsConfig().
ROWS_CONFIGS: dict[tuple[bool, bool], RowsConfig] = {
    (True, False): RowsConfig(piece_bytes=2048, pieces=32, num_warps=32),  # device -> host
    (False, True): RowsConfig(piece_bytes=2048, pieces=32, num_warps=32),  # host -> device
}


def rows_config(src_cuda: bool, dst_cuda: bool) -> RowsConfig:
    """The launch shape for a direction."""
    return ROWS_CONFIGS.get((src_cuda, dst_cuda), RowsConfig())

