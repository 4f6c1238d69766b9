"""Byte-range segments: every buffer of one stage layer (or of a whole operation) in one launch.

A *segment* copies ``n`` ranges of ``nbytes`` bytes: range ``k`` goes from
``src_base + src_off[k]`` to ``dst_base + dst_off[k]``. A page row is one range (offset
``row * stride``); a DSV4 token is two (its 576-B value and its 8-B scale). A per-layer load is
the segments of every pool of that layer, so one launch serves the layer whatever its pools.

Contract:

* ``SegmentPlan.build(parts, layer_order)`` (host, numpy): ``parts`` are ``SegmentPart`` s, one
  per (buffer pair, id list): per-layer base addresses of both sides, the global layer id of each
  of those layers, and the byte offsets of the ranges (``row_offsets`` / ``token_offsets`` make
  them). Segments are grouped by the position of their layer in ``layer_order``; a layer of a
  part that ``layer_order`` does not list is refused. ``plan.layers[i] = (lo, hi)`` are the
  segments of ``layer_order[i]``.
* ``plan.to(device)`` uploads the descriptor table and offsets in one copy on the current
  stream (through pinned memory: the host is not blocked).
* ``launch_segments(dev_plan, lo, hi, ctas)`` copies segments ``[lo, hi)`` on the current
  stream with a persistent grid of ``ctas`` CTAs (one step per program under interpreters
  without runtime loop bounds). Nothing is checked here: callers validate ids (``dispatch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from .grid import runtime_loops
from .tables import LayerTable, TokenFormat, _pow2_align

CH = 2048  # bytes per piece
G = 32  # pieces per loop iteration per CTA (64 KiB in flight)
NUM_WARPS = 32
DESC_COLS = 8  # src_base, dst_base, nbytes, off_start, n, align, piece prefix, spare


@dataclass(frozen=True)
class SegmentPart:
    """One buffer pair and its ranges: ``src_ptrs[l]`` / ``dst_ptrs[l]`` are layer ``l``'s bases,
    ``layers[l]`` its global layer id; ``ranges`` is a list of (nbytes, src_off, dst_off)."""

    src_ptrs: Sequence[int]
    dst_ptrs: Sequence[int]
    layers: Sequence[int]
    ranges: Sequence[tuple[int, np.ndarray, np.ndarray]]


def row_offsets(src: LayerTable, dst: LayerTable, src_ids: np.ndarray,
                dst_ids: np.ndarray) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Whole rows: one range of ``row_bytes`` per id pair."""
    return [(src.row_bytes, src_ids * src.stride, dst_ids * dst.stride)]


def token_offsets(src: LayerTable, dst: LayerTable, src_tok: np.ndarray, dst_tok: np.ndarray,
                  fmt: TokenFormat) -> list[tuple[int, np.ndarray, np.ndarray]]:
    """Tokens of ``fmt``: the value range and, when the format has one, the scale range."""
    P, vb, sb, so = fmt.tokens_per_page, fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
    sp, ss = np.divmod(src_tok, P)
    dp, ds = np.divmod(dst_tok, P)
    out = [(vb, sp * src.stride + ss * vb, dp * dst.stride + ds * vb)]
    if sb:
        out.append((sb, sp * src.stride + so + ss * sb, dp * dst.stride + so + ds * sb))
    return out


class SegmentPlan:
    """Descriptor table + offsets of one operation (see the module docstring)."""

    def __init__(self, desc: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray,
                 layers: list[tuple[int, int]], nbytes: int) -> None:
        self.desc, self.src_off, self.dst_off = desc, src_off, dst_off
        self.layers = layers
        self.nbytes = nbytes
        self.dev: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None

    @classmethod
    def build(cls, parts: Sequence[SegmentPart], layer_order: Sequence[int]) -> "SegmentPlan":
        pos = {g: i for i, g in enumerate(layer_order)}
        offs_s: list[np.ndarray] = []
        offs_d: list[np.ndarray] = []
        per_layer: list[list[tuple[int, ...]]] = [[] for _ in layer_order]
        start = 0
        nbytes = 0
        for part in parts:
            for rb, so, do in part.ranges:
                n = int(so.size)
                if n == 0:
                    continue
                offs_s.append(np.asarray(so, dtype=np.int64))
                offs_d.append(np.asarray(do, dtype=np.int64))
                # offsets are multiples of this (ids * stride, or slot * size + offset)
                a_off = _pow2_align(rb, int(np.bitwise_or.reduce(so)), int(np.bitwise_or.reduce(do)))
                for sp, dp, g in zip(part.src_ptrs, part.dst_ptrs, part.layers):
                    if g not in pos:
                        raise ValueError(f"layer {g} is not in this stage's layer order")
                    per_layer[pos[g]].append((sp, dp, rb, start, n, min(a_off, _pow2_align(sp, dp))))
                    nbytes += rb * n
                start += n
        rows: list[tuple[int, ...]] = []
        layers: list[tuple[int, int]] = []
        pre = 0  # pieces before each segment, over the whole plan (any [lo, hi) is one launch)
        for segs in per_layer:
            lo = len(rows)
            for sp, dp, rb, off, n, al in segs:
                rows.append((sp, dp, rb, off, n, al, pre, 0))
                pre += n * triton.cdiv(rb, CH)
            layers.append((lo, len(rows)))
        desc = np.array(rows, dtype=np.int64).reshape(-1, DESC_COLS)
        empty = np.zeros(0, dtype=np.int64)
        return cls(desc, np.concatenate(offs_s) if offs_s else empty,
                   np.concatenate(offs_d) if offs_d else empty, layers, nbytes)

    def to(self, device: torch.device) -> "SegmentPlan":
        """Upload once (one pinned buffer, one non-blocking copy on the current stream)."""
        if self.dev is None:
            flat = np.concatenate([self.desc.ravel(), self.src_off, self.dst_off])
            host = torch.from_numpy(flat)
            if device.type == "cuda":
                pinned = torch.empty(host.numel(), dtype=torch.int64, pin_memory=True)
                pinned.copy_(host)
                t = pinned.to(device, non_blocking=True)
            else:
                t = host
            nd, ns = self.desc.size, self.src_off.size
            self.dev = (t[:nd], t[nd:nd + ns], t[nd + ns:])
        return self

    def pieces(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        last = self.desc[hi - 1]
        first_pre = int(self.desc[lo, 6])
        return int(last[6]) - first_pre + int(last[4]) * triton.cdiv(int(last[2]), CH)

    def align(self, lo: int, hi: int) -> int:
        return int(self.desc[lo:hi, 5].min()) if hi > lo else 16


@triton.jit
def _seg_step(it, desc, soff, doff, seg_lo, nseg, base_pre, total,
              CH: tl.constexpr, G: tl.constexpr, LOG: tl.constexpr, ALIGN: tl.constexpr):
    cols = tl.arange(0, CH)
    p = tl.arange(0, G).to(tl.int64) + it * G + base_pre
    live = p < total + base_pre
    lo = tl.zeros([G], dtype=tl.int64)
    hi = tl.zeros([G], dtype=tl.int64) + nseg
    for _ in tl.static_range(LOG):  # last segment whose piece prefix <= p (binary search)
        mid = (lo + hi) // 2
        right = tl.load(desc + (seg_lo + mid) * 8 + 6, mask=live, other=0) <= p
        lo = tl.where(right, mid, lo)
        hi = tl.where(right, hi, mid)
    row = desc + (seg_lo + lo) * 8
    sb = tl.load(row, mask=live, other=0)
    db = tl.load(row + 1, mask=live, other=0)
    rb = tl.load(row + 2, mask=live, other=1)
    off0 = tl.load(row + 3, mask=live, other=0)
    pre = tl.load(row + 6, mask=live, other=0)
    q = p - pre
    ppr = (rb + CH - 1) // CH
    r = q // ppr
    c = q - r * ppr
    s = tl.load(soff + off0 + r, mask=live, other=0)
    d = tl.load(doff + off0 + r, mask=live, other=0)
    s_ptr = (sb + s + c * CH).to(tl.pointer_type(tl.uint8))
    d_ptr = (db + d + c * CH).to(tl.pointer_type(tl.uint8))
    if ALIGN > 1:
        s_ptr = tl.multiple_of(s_ptr, ALIGN)
        d_ptr = tl.multiple_of(d_ptr, ALIGN)
    lim = rb - c * CH
    m = live[:, None] & (cols[None, :] < lim[:, None])
    v = tl.load(s_ptr[:, None] + cols[None, :], mask=m)
    tl.store(d_ptr[:, None] + cols[None, :], v, mask=m)


@triton.jit
def _seg_kernel(desc, soff, doff, seg_lo, nseg, base_pre, total, CH: tl.constexpr,
                G: tl.constexpr, LOG: tl.constexpr, ALIGN: tl.constexpr,
                PERSISTENT: tl.constexpr):
    pid = tl.program_id(0)
    if PERSISTENT:
        for it in range(pid, tl.cdiv(total, G), tl.num_programs(0)):
            _seg_step(it, desc, soff, doff, seg_lo, nseg, base_pre, total, CH, G, LOG, ALIGN)
    else:
        _seg_step(pid, desc, soff, doff, seg_lo, nseg, base_pre, total, CH, G, LOG, ALIGN)


def launch_segments(plan: SegmentPlan, lo: int, hi: int, ctas: int) -> None:
    """Copy segments ``[lo, hi)`` of an uploaded plan on the current stream."""
    total = plan.pieces(lo, hi)
    if total == 0:
        return
    assert plan.dev is not None, "upload the plan first (plan.to(device))"
    desc, soff, doff = plan.dev
    nseg = hi - lo
    log = max(1, (nseg - 1).bit_length())
    persistent = runtime_loops()
    steps = triton.cdiv(total, G)
    grid = (max(1, min(int(ctas), steps)) if persistent else steps,)
    _seg_kernel[grid](desc, soff, doff, lo, nseg, int(plan.desc[lo, 6]), total, CH=CH, G=G,
                      LOG=log, ALIGN=min(16, plan.align(lo, hi)), PERSISTENT=persistent,
                      num_warps=NUM_WARPS)
