"""Byte-range segments: every buffer of one stage layer (or of a whole operation) in one launch.

A *segment* copies ``n`` ranges of ``nbytes`` bytes: range ``k`` goes from
``src_base + src_off[k]`` to ``dst_base + dst_off[k]``. A page row is one range (offset
``row * stride``), and a run of rows consecutive on both sides one per block of 2^k rows of
the run (``row_offsets``, where both buffers store rows back to back); a DSV4 token is two
(its 576-B value and its 8-B scale), and a run of tokens consecutive on both sides is two per
block of the run (``token_offsets``). A per-layer load is
the segments of every pool of that layer, in one launch per word width: segments whose ranges
allow 16-byte accesses never share a launch with narrower ones (a launch moves every segment
in its narrowest width, and 8-byte words halved a checkpoint load's rate on an H200).

Contract:

* ``SegmentPlan.build(parts, layer_order)`` (host, numpy): ``parts`` are ``SegmentPart`` s, one
  per (buffer pair, id list): per-layer base addresses of both sides, the global layer id of each
  of those layers, and the byte offsets of the ranges (``row_offsets`` / ``token_offsets`` make
  them). Segments are grouped by the position of their layer in ``layer_order``; a layer of a
  part that ``layer_order`` does not list is refused. Segments are ordered by width class
  (16-byte, then narrower), then layer position: ``plan.spans(a, b)`` are the non-empty
  ``(lo, hi)`` segment ranges, one per class, of layer positions ``[a, b)``.
* ``plan.to(device)`` uploads the descriptor table and offsets in one copy on the current
  stream (through the calling thread's pinned staging buffer, ``uploads``: the host is not
  blocked).
* ``launch_segments(dev_plan, lo, hi, ctas)`` copies segments ``[lo, hi)`` on the current
  stream (on a GPU through ``launch_cache``: the compiled kernel launched directly after its
  first launch per specialization) with a persistent grid of ``ctas`` CTAs (under interpreters without runtime loop
  bounds: a 2-D grid of one program per segment and iteration). Nothing is checked here: callers validate ids (``dispatch``).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch
import triton
import triton.language as tl

from hicache.core.id_sets import is_run

from .grid import runtime_loops
from .launch_cache import CachedKernel
from .tables import LayerTable, TokenFormat, _pow2_align
from .uploads import upload

CH = 2048  # bytes per piece
CHK: tl.constexpr = tl.constexpr(CH)  # the same, for the kernels
G = 32  # pieces per loop iteration per CTA (64 KiB in flight)
NUM_WARPS = 32
DESC_COLS = 8  # src_base, dst_base, nbytes, off_start, n, align, piece prefix, spare
# align: the widest power of two <= 16 dividing both bases and every offset and the range size;
# a launch moves its segments in words of the smallest align among them (16: two 8-byte words
# per access; 4: the DSV4 indexer's 4-byte scales)


@dataclass(frozen=True)
class SegmentPart:
    """One buffer pair and its ranges: ``src_ptrs[l]`` / ``dst_ptrs[l]`` are layer ``l``'s bases,
    ``layers[l]`` its global layer id; ``ranges`` is a list of (nbytes, src_off, dst_off)."""

    src_ptrs: Sequence[int]
    dst_ptrs: Sequence[int]
    layers: Sequence[int]
    ranges: Sequence[tuple[int, np.ndarray, np.ndarray]]
    # "h2d" / "d2h": ranges between host and device big enough for the copy engines (whole
    # rows, or blocks of several rows or many tokens)
    dma: str = ""


Range = tuple[int, np.ndarray, np.ndarray]  # (bytes, source offsets, destination offsets)


def row_offsets(src: LayerTable, dst: LayerTable, src_ids: np.ndarray, dst_ids: np.ndarray,
                big: int = 0, blocks: Optional[Blocks] = None) -> tuple[list[Range], list[Range]]:
    """Whole rows, as ``(ranges of blocks of big bytes or more, the other ranges)`` (``big`` 0:
    all in the second list). Rows listed one after another on both sides move as one block
    when both buffers store their rows back to back (stride == row bytes): each such run is
    cut into blocks of 2^k rows (its length's binary digits), one range per block size, so a
    run of 8 pages is one copy per layer, not 8 (a copy engine's copy costs the driver about
    0.5 µs of host time whatever its size). Rows in no run: one range of ``row_bytes`` per
    id pair. ``blocks``: ``row_blocks(src_ids, dst_ids)`` when the caller has it (the pools of
    one index space share their ids)."""
    rb = src.row_bytes
    if src.stride != rb or dst.stride != rb:
        blocks = ALL_SINGLE
    elif blocks is None:
        blocks = _block_starts(src_ids, dst_ids)
    out: tuple[list[Range], list[Range]] = ([], [])
    for k, i in blocks:
        out[0 if big and rb << k >= big else 1].append(
            (rb << k, src_ids[i] * src.stride, dst_ids[i] * dst.stride))
    return out


Blocks = Sequence[tuple[int, "np.ndarray | slice"]]  # (k, first id of each block of 2^k ids)
ALL_SINGLE: Blocks = ((0, slice(None)),)  # no two ids in a row


def row_blocks(src_ids: np.ndarray, dst_ids: np.ndarray) -> Blocks:
    """The blocks ``row_offsets`` cuts rows ``src_ids`` -> ``dst_ids`` into (computed once per
    id pair by callers with several buffer pairs on the same ids)."""
    return _block_starts(src_ids, dst_ids)


def token_offsets(src: LayerTable, dst: LayerTable, src_tok: np.ndarray, dst_tok: np.ndarray,
                  fmt: TokenFormat, big: int = 0) -> tuple[list[Range], list[Range]]:
    """Tokens of ``fmt``: value ranges and, when the format has one, scale ranges, as
    ``(ranges of blocks whose values hold >= big bytes, the other ranges)`` (``big`` 0: all in
    the second list). Tokens listed one after another on both sides within one page (a
    checkpoint's SWA tail, a partial page) move as one block: each such run is cut into
    blocks of 2^k tokens (its length's binary digits), and every block size gets one value
    and one scale range list. So a run of 128 tokens is two ranges, not 256, and its 8-byte
    scales move as one 1-KiB range (16-byte aligned when both runs start on an even slot)."""
    vb, sb, so = fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
    out: tuple[list[Range], list[Range]] = ([], [])
    for k, s_row, d_row, ss, ds in _token_blocks(src, dst, src_tok, dst_tok,
                                                 fmt.tokens_per_page):
        to = out[0 if big and vb << k >= big else 1]
        to.append((vb << k, _offsets(s_row + ss * vb), _offsets(d_row + ds * vb)))
        if sb:
            to.append((sb << k, _offsets(s_row + so + ss * sb), _offsets(d_row + so + ds * sb)))
    return out


def _offsets(x: np.ndarray | int) -> np.ndarray:
    """A range's offsets as an int64 array (one block of a run comes as a Python int)."""
    return x if type(x) is np.ndarray else np.array([x], dtype=np.int64)


Block = tuple[int, np.ndarray | int, np.ndarray | int, np.ndarray | int, np.ndarray | int]


def _token_blocks(src: LayerTable, dst: LayerTable, src_tok: np.ndarray, dst_tok: np.ndarray,
                  P: int) -> list[Block]:
    """[(k, source row offsets, destination row offsets, source slots, destination slots) of
    the first token of every block of 2^k tokens]: runs of tokens consecutive on both sides
    and inside one page on both sides, each cut largest block first (numpy arrays; Python
    ints when the lists are one run)."""
    n = int(src_tok.size)
    run = _one_run(src_tok, dst_tok, P) if n > 1 else None
    if run is not None:  # a checkpoint's tail: Python ints, not ~40 numpy calls on 128 ids
        s0, d0 = run
        out, i = [], 0
        for k in range(n.bit_length() - 1, -1, -1):
            if n >> k & 1:
                s, d = s0 + i, d0 + i
                out.append((k, s // P * src.stride, d // P * dst.stride, s % P, d % P))
                i += 1 << k
        return out
    sp, ss = np.divmod(src_tok, P)
    dp, ds = np.divmod(dst_tok, P)
    return [(k, sp[i] * src.stride, dp[i] * dst.stride, ss[i], ds[i])
            for k, i in _block_starts(src_tok, dst_tok, ss, ds)]


def _one_run(src_tok: np.ndarray, dst_tok: np.ndarray, P: int) -> tuple[int, int] | None:
    """(first source token, first destination token) when both lists are one run of
    consecutive tokens inside one page; else None."""
    s0, d0 = int(src_tok[0]), int(dst_tok[0])
    if s0 // P != int(src_tok[-1]) // P or d0 // P != int(dst_tok[-1]) // P or \
            not is_run(src_tok) or not is_run(dst_tok):
        return None
    return s0, d0


def _block_starts(src_ids: np.ndarray, dst_ids: np.ndarray, ss: np.ndarray | None = None,
                  ds: np.ndarray | None = None) -> Blocks:
    """[(k, index of the first id of every block of 2^k ids)]: runs of ids consecutive on both
    sides (and, with slots ``ss`` / ``ds``, inside one page on both sides: a slot 0 starts a
    new run), each cut largest block first; ``ALL_SINGLE`` (every id, as a slice) when no two
    ids are in a row (see ``_token_blocks`` and ``row_offsets``)."""
    n = int(src_ids.size)
    if n < 2:
        return ALL_SINGLE
    brk = (np.diff(src_ids) != 1) | (np.diff(dst_ids) != 1)
    if ss is not None and ds is not None:
        brk |= (ss[1:] == 0) | (ds[1:] == 0)
    starts = np.flatnonzero(brk) + 1
    if starts.size == n - 1:  # no two ids in a row: one range per id
        return ALL_SINGLE
    starts = np.concatenate(([0], starts))
    lens = np.diff(np.append(starts, n))
    bits = int(np.bitwise_or.reduce(lens))
    out: list[tuple[int, np.ndarray | slice]] = []
    for k in range(bits.bit_length() - 1, -1, -1):
        if bits >> k & 1:  # the block of bit k starts after the blocks of the higher bits
            has = (lens >> k) & 1 == 1
            out.append((k, starts[has] + (lens[has] >> (k + 1) << (k + 1))))
    return out


class SegmentPlan:
    """Descriptor table + offsets of one operation (see the module docstring)."""

    def __init__(self, desc: np.ndarray, src_off: np.ndarray, dst_off: np.ndarray,
                 bounds: list[int], nbytes: int) -> None:
        self.desc, self.src_off, self.dst_off = desc, src_off, dst_off
        # segments of width class c (0: 16-byte, 1: narrower) and layer position i are
        # bounds[c * L + i] .. bounds[c * L + i + 1], L = len(bounds) // 2
        self.bounds = bounds
        self.nbytes = nbytes
        self.dev: Optional[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = None
        # launch arithmetic as Python ints: piece prefix of every segment plus the total, and
        # each segment's alignment (the hot path reads these, not the numpy table)
        self.prefix: list[int] = [0]
        self.aligns: list[int] = []
        if len(desc):  # (a load's layer 0 of SWA rows has no segments: nothing to work out)
            last = desc[-1]
            end = int(last[6] + last[4] * ((last[2] + CH - 1) // CH))
            self.prefix = desc[:, 6].tolist() + [end]
            self.aligns = desc[:, 5].tolist()

    @classmethod
    def build(cls, parts: Sequence[SegmentPart], layer_order: Sequence[int]) -> "SegmentPlan":
        pos = {g: i for i, g in enumerate(layer_order)}
        offs_s: list[np.ndarray] = []
        offs_d: list[np.ndarray] = []
        # per segment (one per layer of a part's range): layer position, both bases; per block
        # (one per range of a part, repeated over its layers): nbytes, off, n, align
        L = len(layer_order)
        lpos: list[int] = []  # class * L + layer position
        sbase: list[int] = []
        dbase: list[int] = []
        block: list[tuple[int, int, int, int]] = []
        counts: list[int] = []
        start = 0
        for part in parts:
            try:
                lp = [pos[g] for g in part.layers]
            except KeyError as e:
                raise ValueError(f"layer {e.args[0]} is not in this stage's layer order") from None
            bases = 0
            for x in part.src_ptrs:
                bases |= x
            for x in part.dst_ptrs:
                bases |= x
            for rb, so, do in part.ranges:
                n = int(so.size)
                if n == 0:
                    continue
                so = np.asarray(so, dtype=np.int64)
                do = np.asarray(do, dtype=np.int64)
                offs_s.append(so)
                offs_d.append(do)
                # offsets are multiples of this (ids * stride, or slot * size + offset)
                al = _pow2_align(rb, bases, int(np.bitwise_or.reduce(so | do)))
                if al < 4:
                    raise ValueError(f"a range of {rb} B at these offsets/addresses is not "
                                     f"4-byte aligned; segments move 4- or 8-byte words")
                lpos += lp if al >= 16 else [L + i for i in lp]
                sbase += part.src_ptrs
                dbase += part.dst_ptrs
                block.append((rb, start, n, al))
                counts.append(len(lp))
                start += n
        empty = np.zeros(0, dtype=np.int64)
        if not block:
            return cls(np.zeros((0, DESC_COLS), dtype=np.int64), empty, empty,
                       [0] * (2 * L + 1), 0)
        lpa = np.array(lpos, dtype=np.int64)
        order = np.argsort(lpa, kind="stable")
        desc = np.zeros((len(lpa), DESC_COLS), dtype=np.int64)
        desc[:, 0] = np.array(sbase, dtype=np.int64)[order]
        desc[:, 1] = np.array(dbase, dtype=np.int64)[order]
        desc[:, 2:6] = np.repeat(np.array(block, dtype=np.int64), counts, axis=0)[order]
        pieces = desc[:, 4] * ((desc[:, 2] + CH - 1) // CH)
        desc[:, 6] = np.cumsum(pieces) - pieces  # pieces before each segment, over the plan
        bounds = np.searchsorted(lpa[order], np.arange(2 * L + 1)).tolist()
        return cls(desc, np.concatenate(offs_s), np.concatenate(offs_d), bounds,
                   int((desc[:, 2] * desc[:, 4]).sum()))

    def spans(self, a: int, b: int) -> list[tuple[int, int]]:
        """Non-empty segment ranges of layer positions ``[a, b)``, one per width class."""
        L, bd = len(self.bounds) // 2, self.bounds
        return [(bd[c + a], bd[c + b]) for c in (0, L) if bd[c + b] > bd[c + a]]

    def to(self, device: torch.device) -> "SegmentPlan":
        """Upload once (one non-blocking copy on the current stream, ``uploads.upload``)."""
        if self.dev is None:
            # each of the three starts 16-byte aligned (desc rows are 8 words): Triton
            # specializes the kernel on that, so an odd src_off count would make a variant
            # the warm-up never compiled (docs/perf.md, sixty-second session)
            nd, ns = self.desc.size, self.src_off.size
            pad = [np.zeros(1, dtype=np.int64)] if ns % 2 else []
            t = upload([self.desc.ravel(), self.src_off, *pad, self.dst_off], device)
            self.dev = (t[:nd], t[nd:nd + ns], t[nd + ns + len(pad):])
        return self

    def align(self, lo: int, hi: int) -> int:
        return min(self.aligns[lo:hi], default=16)

    def pieces(self, lo: int, hi: int) -> int:
        if hi <= lo:
            return 0
        return self.prefix[hi] - self.prefix[lo]


@triton.jit
def _seg_step(it, desc, soff, doff, sgi, WORD: tl.constexpr, VEC: tl.constexpr,
              G: tl.constexpr):
    """Move pieces it*G .. it*G+G-1 of segment ``sgi``: each up to CHK bytes of one range, in
    ``WORD``-byte words (``VEC`` words per access). The segment's fields are scalars; only the
    range offsets are gathered per piece."""
    CHE: tl.constexpr = CHK // WORD
    row = desc + sgi * 8
    sb = tl.load(row)
    db = tl.load(row + 1)
    rb = tl.load(row + 2)
    off0 = tl.load(row + 3)
    n = tl.load(row + 4)
    ppr = (rb + CHK - 1) // CHK
    cols = tl.arange(0, CHE)
    p = tl.arange(0, G).to(tl.int64) + it * G
    live = p < n * ppr
    r = p // ppr
    c = p - r * ppr
    s = tl.load(soff + off0 + r, mask=live, other=0)
    d = tl.load(doff + off0 + r, mask=live, other=0)
    if WORD == 8:
        ty = tl.int64
    else:
        ty = tl.int32
    s_ptr = (sb + s + c * CHK).to(tl.pointer_type(ty))
    d_ptr = (db + d + c * CHK).to(tl.pointer_type(ty))
    # words left in this range's piece; every range is a multiple of WORD * VEC bytes, so masks
    # are constant over VEC words and accesses stay WORD * VEC bytes wide
    lim = tl.multiple_of((rb - c * CHK) // WORD, VEC)
    if VEC > 1:
        s_ptr = tl.multiple_of(s_ptr, WORD * VEC)
        d_ptr = tl.multiple_of(d_ptr, WORD * VEC)
    m = live[:, None] & (cols[None, :] < lim[:, None])
    v = tl.load(s_ptr[:, None] + cols[None, :], mask=m)
    tl.store(d_ptr[:, None] + cols[None, :], v, mask=m)


@triton.jit(do_not_specialize=["seg_lo", "seg_hi"])
def _seg_kernel(desc, soff, doff, seg_lo, seg_hi, WORD: tl.constexpr, VEC: tl.constexpr,
                G: tl.constexpr, PERSISTENT: tl.constexpr):
    """Persistent: every CTA walks the segments in order and takes every num_programs-th
    iteration of each (no search, no barrier between segments). Otherwise one program per
    (segment, iteration) of a 2-D grid (interpreters without runtime loop bounds)."""
    pid = tl.program_id(0)
    if PERSISTENT:
        nprog = tl.num_programs(0)
        for sgi in range(seg_lo, seg_hi):
            row = desc + sgi * 8
            pieces = tl.load(row + 4) * ((tl.load(row + 2) + CHK - 1) // CHK)
            for it in range(pid, tl.cdiv(pieces, G), nprog):
                _seg_step(it, desc, soff, doff, sgi, WORD, VEC, G)
    else:
        _seg_step(tl.program_id(1), desc, soff, doff, seg_lo + pid, WORD, VEC, G)


SEG_KERNEL = CachedKernel(_seg_kernel)


def launch_segments(plan: SegmentPlan, lo: int, hi: int, ctas: int) -> None:
    """Copy segments ``[lo, hi)`` of an uploaded plan on the current stream."""
    total = plan.pieces(lo, hi)
    if total == 0:
        return
    assert plan.dev is not None, "upload the plan first (plan.to(device))"
    desc, soff, doff = plan.dev
    # the widest words every segment of the launch allows: 16-byte vectors, 8- or 4-byte words
    al = plan.align(lo, hi)
    word, vec = (8, 2) if al >= 16 else (min(al, 8), 1)
    if runtime_loops():
        grid: tuple[int, ...] = (max(1, min(int(ctas), triton.cdiv(total, G))),)
        persistent = True
    else:
        most = max(plan.prefix[k + 1] - plan.prefix[k] for k in range(lo, hi))
        grid, persistent = (hi - lo, triton.cdiv(most, G)), False
    args = {"desc": desc, "soff": soff, "doff": doff, "seg_lo": lo, "seg_hi": hi, "WORD": word,
            "VEC": vec, "G": G, "PERSISTENT": persistent}
    SEG_KERNEL.launch(grid, args, {"num_warps": NUM_WARPS}, desc.is_cuda)
