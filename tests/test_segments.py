"""``kernels.segments`` host side: token runs cut into blocks, and launches split by word width.

* ``token_offsets`` moves tokens listed one after another on both sides (inside one page) as
  blocks of 2^k tokens: property-tested that the ranges, applied as plain byte copies, give
  exactly the per-token copy (every value and scale byte, nothing else), and that blocks
  never cross a page or a break in either side's run.
* ``row_offsets`` moves rows listed one after another on both sides as blocks of 2^k rows when
  both buffers store rows back to back, and one range per row otherwise: property-tested the
  same way (every row once, nothing else), and that a run of 2^k rows is one range entry.
* ``SegmentPlan.spans``: each span holds segments of one width class only, and the spans of
  layers ``[a, b)`` hold exactly the segments of those layers.
"""
from __future__ import annotations

import numpy as np
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.kernels import segments as S
from hicache.kernels.segments import (SegmentPart, SegmentPlan, _block_starts, row_offsets,
                                      token_offsets)
from hicache.kernels.tables import LayerTable, TokenFormat

FMT = TokenFormat(8, 576, 8, 8 * 576, 8 * 576 + 64)  # DSV4's value / 8-B scale, small pages
ROWS = 6  # pages per side


def _draw_runs(draw: st.DrawFn, n_ids: int, runs: int, longest: int
               ) -> tuple[np.ndarray, np.ndarray]:
    """Up to ``runs`` runs of 1..``longest`` ids, consecutive on both sides, ids in
    ``[0, n_ids)``, destinations distinct (a run that would reuse one is left out)."""
    s: list[int] = []
    d: list[int] = []
    used: set[int] = set()
    for _ in range(draw(st.integers(1, runs))):
        m = draw(st.integers(1, longest))
        a = draw(st.integers(0, n_ids - m))
        b = draw(st.integers(0, n_ids - m))
        run = [b + i for i in range(m)]
        if used.intersection(run):
            continue
        used.update(run)
        s += [a + i for i in range(m)]
        d += run
    return np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)


@st.composite
def token_lists(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of token ids made of runs (consecutive on both sides, may cross pages) and single
    tokens, destinations distinct."""
    return _draw_runs(draw, ROWS * FMT.tokens_per_page, 8, 2 * FMT.tokens_per_page)


def _apply(ranges: list, src: bytearray, dst: bytearray) -> None:
    for rb, so, do in ranges:
        for a, b in zip(so.tolist(), do.tolist()):
            dst[b:b + rb] = src[a:a + rb]


def _per_token(s: np.ndarray, d: np.ndarray, src: bytearray, dst: bytearray) -> None:
    P, vb, sb, so = FMT.tokens_per_page, FMT.value_bytes, FMT.scale_bytes, FMT.scale_offset
    pb = FMT.page_bytes
    for a, b in zip(s.tolist(), d.tolist()):
        (ap, asl), (bp, bsl) = divmod(a, P), divmod(b, P)
        dst[bp * pb + bsl * vb:bp * pb + (bsl + 1) * vb] = \
            src[ap * pb + asl * vb:ap * pb + (asl + 1) * vb]
        dst[bp * pb + so + bsl * sb:bp * pb + so + (bsl + 1) * sb] = \
            src[ap * pb + so + asl * sb:ap * pb + so + (asl + 1) * sb]


@settings(max_examples=150, deadline=None)
@given(token_lists(), st.integers(0, 2**31), st.sampled_from([0, 576, 2304]))
def test_token_blocks_copy_exactly_the_tokens(ids: tuple[np.ndarray, np.ndarray], seed: int,
                                              big: int) -> None:
    """Also with ``big``: the blocks whose values reach ``big`` bytes (and their scales) in the
    first list, every other range in the second; the two together copy every token once."""
    s, d = ids
    g = torch.Generator().manual_seed(seed)
    src_t = torch.randint(0, 256, (ROWS, FMT.page_bytes), dtype=torch.uint8, generator=g)
    dst_t = torch.randint(0, 256, (ROWS, FMT.page_bytes), dtype=torch.uint8, generator=g)
    large, small = token_offsets(LayerTable([src_t]), LayerTable([dst_t]), s, d, FMT, big)
    assert all(rb >= big if rb % FMT.value_bytes == 0 else rb * 72 >= big
               for rb, _, _ in large) and not (large and not big)
    assert all(rb < big for rb, _, _ in small if rb % FMT.value_bytes == 0) or not big
    ranges = large + small
    src = bytearray(src_t.numpy().tobytes())
    got, want = bytearray(dst_t.numpy().tobytes()), bytearray(dst_t.numpy().tobytes())
    _apply(ranges, src, got)
    _per_token(s, d, src, want)
    assert got == want
    # blocks: consecutive on both sides, inside one page on both sides, each token once
    P = FMT.tokens_per_page
    ss, ds = s % P, d % P
    seen = np.zeros(s.size, dtype=int)
    for k, starts in _block_starts(s, d, ss, ds):
        for i in np.arange(s.size)[starts].tolist():
            j = i + (1 << k)
            assert j <= s.size
            assert np.all(np.diff(s[i:j]) == 1) and np.all(np.diff(d[i:j]) == 1)
            assert s[i] // P == s[j - 1] // P and d[i] // P == d[j - 1] // P
            seen[i:j] += 1
    assert np.all(seen == 1)


@settings(max_examples=150, deadline=None)
@given(st.integers(1, FMT.tokens_per_page), st.integers(0, 2**31), st.sampled_from([0, 576, 2304]))
def test_one_run_takes_the_short_path_and_gives_the_general_paths_ranges(
        m: int, seed: int, big: int) -> None:
    """A run of tokens consecutive on both sides inside one page (a checkpoint's tail) is cut
    in Python ints; its ranges equal, in order, what the numpy path makes of the same lists;
    lists that are not one such run take the numpy path."""
    rng = np.random.default_rng(seed)
    P = FMT.tokens_per_page
    a = int(rng.integers(0, ROWS)) * P + int(rng.integers(0, P - m + 1))
    b = int(rng.integers(0, ROWS)) * P + int(rng.integers(0, P - m + 1))
    s, d = np.arange(a, a + m, dtype=np.int64), np.arange(b, b + m, dtype=np.int64)
    t = LayerTable([torch.zeros(ROWS, FMT.page_bytes, dtype=torch.uint8)])
    assert m == 1 or S._one_run(s, d, P) == (a, b)
    short = token_offsets(t, t, s, d, FMT, big)
    general = S._one_run
    try:
        S._one_run = lambda *x: None  # the numpy path on the same lists
        full = token_offsets(t, t, s, d, FMT, big)
    finally:
        S._one_run = general
    assert [[(rb, x.tolist(), y.tolist()) for rb, x, y in r] for r in short] == \
        [[(rb, x.tolist(), y.tolist()) for rb, x, y in r] for r in full]
    if m > 2:  # not a run: a gap, a page crossed, or a reversed pair
        swapped = s.copy()
        swapped[[1, 2]] = swapped[[2, 1]] if m > 3 else swapped[[1, 2]] + [1, -1]
        for bad in (np.r_[s[:-1], s[-1] + 1], np.r_[s[1:], s[0]], swapped):
            assert S._one_run(bad, d, P) is None
        assert S._one_run(s, np.r_[d[:-1], d[-1] + P], P) is None


def test_a_checkpoint_tail_is_two_ranges_of_16_byte_width() -> None:
    """128 tail tokens of a 256-token page (a checkpoint's SWA tail): one value range of 128 x
    576 B and one scale range of 1 KiB, both allowing 16-byte words."""
    fmt = TokenFormat(256, 576, 8, 256 * 576, 256 * 576 + 2048)
    a = LayerTable([torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)])
    b = LayerTable([torch.zeros(3, fmt.page_bytes, dtype=torch.uint8)])
    s = np.arange(1 * 256 + 128, 2 * 256, dtype=np.int64)
    d = np.arange(2 * 256 + 128, 3 * 256, dtype=np.int64)
    large, ranges = token_offsets(a, b, s, d, fmt)
    assert large == [] and [(rb, so.size) for rb, so, _ in ranges] == [(128 * 576, 1), (128 * 8, 1)]
    large, small = token_offsets(a, b, s, d, fmt, 64 << 10)  # a copy-engine block
    assert small == [] and [(rb, so.size) for rb, so, _ in large] == [(128 * 576, 1), (128 * 8, 1)]
    plan = SegmentPlan.build([SegmentPart(a.ptrs, b.ptrs, [0], ranges)], [0])
    assert plan.aligns == [16, 16] and plan.spans(0, 1) == [(0, 2)]


def test_spans_keep_word_widths_apart() -> None:
    """Segments of 16-byte and of narrower width in the same layers: each span one class, and
    the spans of layers [a, b) hold exactly those layers' segments."""
    layers = [0, 1, 2, 3]
    wide = LayerTable([torch.zeros(4, 64, dtype=torch.uint8) for _ in layers])
    narrow = LayerTable([torch.zeros(4, 36, dtype=torch.uint8) for _ in layers])
    ids = np.array([0, 2]), np.array([1, 3])
    parts = [SegmentPart(t.ptrs, t.ptrs, layers, [(t.row_bytes, ids[0] * t.stride,
                                                   ids[1] * t.stride)])
             for t in (narrow, wide)]
    order = [2, 0, 3, 1]
    plan = SegmentPlan.build(parts, order)
    assert len(plan.desc) == 8
    pos = {g: i for i, g in enumerate(order)}
    seg_pos = {}  # segment -> layer position, from its bases
    for k, row in enumerate(plan.desc.tolist()):
        t = wide if row[0] in wide.ptrs else narrow
        seg_pos[k] = pos[layers[t.ptrs.index(row[0])]]
    for a in range(4):
        for b in range(a + 1, 5):
            spans = plan.spans(a, b)
            covered = [k for lo, hi in spans for k in range(lo, hi)]
            assert sorted(covered) == sorted(k for k, p in seg_pos.items() if a <= p < b)
            for lo, hi in spans:
                assert len({plan.aligns[k] >= 16 for k in range(lo, hi)}) == 1
            assert len(spans) == 2
    assert SegmentPlan.build([], order).spans(0, 4) == []


@st.composite
def row_lists(draw: st.DrawFn) -> tuple[np.ndarray, np.ndarray]:
    """Pairs of row ids: runs (consecutive on both sides) and single rows, destinations
    distinct, listed in any order."""
    return _draw_runs(draw, 40, 10, 12)


@settings(max_examples=150, deadline=None)
@given(row_lists(), st.integers(0, 2**31), st.sampled_from([0, 48, 200]), st.booleans())
def test_row_blocks_copy_exactly_the_rows(ids: tuple[np.ndarray, np.ndarray], seed: int,
                                          big: int, padded: bool) -> None:
    """Rows of 24 B: blocks of 2^k rows where rows lie back to back on both sides (``padded``:
    the source's rows sit in 32-B slots, so every row is a range of its own); with ``big``,
    the ranges of ``big`` bytes or more in the first list, the others in the second."""
    s, d = ids
    rb, rows = 24, 40
    g = torch.Generator().manual_seed(seed)
    src_t = torch.randint(0, 256, (rows, 32 if padded else rb), dtype=torch.uint8, generator=g)
    src_t = src_t[:, :rb]
    dst_t = torch.randint(0, 256, (rows, rb), dtype=torch.uint8, generator=g)
    S, D = LayerTable([src_t]), LayerTable([dst_t])
    large, small = row_offsets(S, D, s, d, big)
    assert all(n >= big for n, _, _ in large) and not (large and not big)
    assert all(n < big for n, _, _ in small) or not big
    ranges = large + small
    if padded:
        assert all(n == rb for n, _, _ in ranges)
        assert sum(r[1].size for r in ranges) == s.size
    src = bytearray(src_t.contiguous().numpy().tobytes()) if not padded else None
    got = bytearray(dst_t.numpy().tobytes())
    want = bytearray(got)
    if padded:  # offsets are in the source's 32-B row slots
        full = bytearray(src_t.untyped_storage())[:rows * 32]
        _apply(ranges, full, got)
        for a, b in zip(s.tolist(), d.tolist()):
            want[b * rb:(b + 1) * rb] = full[a * 32:a * 32 + rb]
    else:
        assert src is not None
        _apply(ranges, src, got)
        for a, b in zip(s.tolist(), d.tolist()):
            want[b * rb:(b + 1) * rb] = src[a * rb:(a + 1) * rb]
        # every range entry is a whole run of 2^k rows, consecutive on both sides
        for n, so, do in ranges:
            assert n % rb == 0 and (n // rb) & (n // rb - 1) == 0
    assert got == want


def test_a_run_of_eight_rows_is_one_range_entry() -> None:
    """A request's 8 pages, consecutive on both sides: one copy of 8 rows per layer; a run of
    7: blocks of 4, 2 and 1."""
    t = LayerTable([torch.zeros(64, 16, dtype=torch.uint8)])
    u = LayerTable([torch.zeros(64, 16, dtype=torch.uint8)])
    _, r = row_offsets(t, u, np.arange(8, 16), np.arange(40, 48))
    assert [(n, so.tolist(), do.tolist()) for n, so, do in r] == [(128, [128], [640])]
    _, r = row_offsets(t, u, np.arange(0, 7), np.arange(20, 27))
    assert [(n, so.tolist(), do.tolist()) for n, so, do in r] == \
        [(64, [0], [320]), (32, [64], [384]), (16, [96], [416])]
