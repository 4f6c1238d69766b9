"""CPU tests of the copy paths: the torch reference against a naive byte-offset oracle, the
dispatcher, and every index check. The helpers here are shared with the interpreter and CUDA
test modules (``make_case``, ``expected_after``, ``INDEX_SETS``)."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels import dispatch
from hicache.kernels.reference import copy_rows_ref, copy_tokens_ref
from hicache.kernels.tables import LayerTable, TokenFormat, TransferError

FORMATS = {
    "swa_mla_256": TokenFormat.mla(256),
    "c4_mla_64": TokenFormat.mla(64),
    "c128_mla_2": TokenFormat.mla(2),
    "indexer_fp8_64": TokenFormat.packed(64, 128, 4),
    "indexer_fp4_64": TokenFormat.packed(64, 64, 4),
}
ROW_SIZES = [37_440, 149_760, 65_536, 16_384, 6_144, 1_728, 584, 100]


def layers(n_layers: int, rows: int, row_bytes: int, seed: int, device="cpu", pin=False):
    g = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_layers):
        t = torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
        if pin:
            t = t.pin_memory()
        out.append(t.to(device))
    return out


def index_sets(units: int, P: int, seed: int) -> dict[str, list[int]]:
    """Named duplicate-free index sets over ``units`` slots with ``P`` slots per page."""
    g = torch.Generator().manual_seed(seed)
    n_rand = min(units, 3 * P + 5, 40)
    return {
        "one": [units // 2],
        "last_of_page": [P - 1, units - 1] if units > P else [units - 1],
        "crossing_pages": list(range(max(0, P - 2), min(units, P + 2))) if units > P else [0, units - 1],
        "random": torch.randperm(units, generator=g)[:n_rand].tolist(),
    }


def pair_sets(src_units: int, dst_units: int, P: int, seed: int) -> dict[str, tuple]:
    """Source and destination index lists of equal length for every named set."""
    s = index_sets(src_units, P, seed)
    d = index_sets(dst_units, P, seed + 1)
    out = {}
    for k in s:
        n = min(len(s[k]), len(d[k]))
        # the destination uses the other side's pattern reversed: slots move, not just copy
        out[k] = (torch.tensor(s[k][:n], dtype=torch.int64),
                  torch.tensor(d[k][::-1][:n], dtype=torch.int64))
    return out


def expected_rows(src, dst_before, s_idx, d_idx):
    """Naive oracle: a loop over indices, one row at a time."""
    exp = [d.detach().cpu().clone() for d in dst_before]
    for l, s in enumerate(src):
        s = s.cpu()
        for a, b in zip(s_idx.tolist(), d_idx.tolist()):
            exp[l][b] = s[a]
    return exp


def expected_tokens(src, dst_before, s_tok, d_tok, fmt: TokenFormat):
    """Naive oracle: explicit byte offsets of each token's value and scale."""
    P, vb, sb, off = fmt.tokens_per_page, fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
    exp = [d.detach().cpu().clone() for d in dst_before]
    for l, s in enumerate(src):
        s = s.cpu()
        for a, b in zip(s_tok.tolist(), d_tok.tolist()):
            sp, ss, dp, ds = a // P, a % P, b // P, b % P
            exp[l][dp, ds * vb:(ds + 1) * vb] = s[sp, ss * vb:(ss + 1) * vb]
            exp[l][dp, off + ds * sb: off + (ds + 1) * sb] = s[sp, off + ss * sb: off + (ss + 1) * sb]
    return exp


def assert_same(got, exp, what=""):
    for l, (g, e) in enumerate(zip(got, exp)):
        g = g.cpu()
        if not torch.equal(g, e):
            diff = (g != e).nonzero()
            raise AssertionError(f"{what} layer {l}: {diff.shape[0]} bytes differ, first at "
                                 f"{diff[0].tolist()}")


# ----------------------------------------------------------------------------- reference
@pytest.mark.parametrize("row_bytes", [37_440, 6_144, 584, 100])
def test_rows_reference_matches_oracle(row_bytes):
    src = layers(3, 9, row_bytes, 1)
    dst = layers(3, 7, row_bytes, 2)
    src0 = [t.clone() for t in src]
    for name, (si, di) in pair_sets(9, 7, 1, 3).items():
        before = [t.clone() for t in dst]
        copy_rows_ref(src, dst, si, di)
        assert_same(dst, expected_rows(src, before, si, di), name)
    assert_same(src, src0, "source changed")


@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_tokens_reference_matches_oracle(fmt_name):
    fmt = FORMATS[fmt_name]
    P = fmt.tokens_per_page
    src = layers(2, 4, fmt.page_bytes, 4)
    dst = layers(2, 3, fmt.page_bytes, 5)
    src0 = [t.clone() for t in src]
    for name, (si, di) in pair_sets(4 * P, 3 * P, P, 6).items():
        before = [t.clone() for t in dst]
        copy_tokens_ref(src, dst, si, di, fmt)
        assert_same(dst, expected_tokens(src, before, si, di, fmt), name)
    assert_same(src, src0, "source changed")


def _odd(ts: list[torch.Tensor], how: str) -> list[torch.Tensor]:
    """The same bytes in buffers the flat word path cannot take: rows inside wider rows (not
    contiguous), or storage that starts one byte in (no word view)."""
    out = []
    for t in ts:
        rows, rb = t.shape
        if how == "strided":
            wide = torch.zeros(rows, rb + 64, dtype=torch.uint8)
            v = wide[:, 8:8 + rb]
        else:
            v = torch.zeros(rows * rb + 1, dtype=torch.uint8)[1:].view(rows, rb)
        v.copy_(t)
        out.append(v)
    return out


@pytest.mark.parametrize("how", ["strided", "byte_offset"])
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_tokens_reference_matches_oracle_on_buffers_without_flat_words(fmt_name, how):
    """Non-contiguous rows and storage one byte off a word take ``_copy_tokens_views`` (and the
    byte-wise fallback): values and scales both, every token, each side alone and both."""
    fmt = FORMATS[fmt_name]
    P = fmt.tokens_per_page
    for odd_src, odd_dst in ((True, False), (False, True), (True, True)):
        src = layers(2, 4, fmt.page_bytes, 4)
        dst = layers(2, 3, fmt.page_bytes, 5)
        src = _odd(src, how) if odd_src else src
        dst = _odd(dst, how) if odd_dst else dst
        src0 = [t.clone() for t in src]
        for name, (si, di) in pair_sets(4 * P, 3 * P, P, 6).items():
            before = [t.clone() for t in dst]
            copy_tokens_ref(src, dst, si, di, fmt)
            assert_same(dst, expected_tokens(src, before, si, di, fmt),
                        f"{name} ({how}, odd src {odd_src}, odd dst {odd_dst})")
        assert_same(src, src0, "source changed")


def test_token_format_presets():
    assert TokenFormat.mla(256).page_bytes == 149_760 and TokenFormat.mla(256).scale_offset == 147_456
    assert TokenFormat.mla(64).page_bytes == 37_440 and TokenFormat.mla(64).scale_offset == 36_864
    assert TokenFormat.mla(2).page_bytes == 1_728 and TokenFormat.mla(2).scale_offset == 1_152
    assert TokenFormat.packed(64, 128, 4).page_bytes == 8_448
    assert TokenFormat.packed(64, 64, 4).page_bytes == 4_352
    with pytest.raises(TransferError, match="overlap"):
        TokenFormat(64, 576, 8, 100, 37_440)
    with pytest.raises(TransferError, match="page_bytes"):
        TokenFormat(64, 576, 8, 36_864, 37_000)


# ----------------------------------------------------------------------------- dispatch (CPU)
def test_dispatch_cpu_uses_reference_for_rows_and_tokens():
    fmt = FORMATS["c4_mla_64"]
    src, dst = layers(2, 4, fmt.page_bytes, 7), layers(2, 4, fmt.page_bytes, 8)
    before = [t.clone() for t in dst]
    si, di = torch.tensor([3, 70, 130]), torch.tensor([255, 0, 64])
    assert dispatch.copy_tokens(src, dst, si, di, fmt) == "tokens_reference"
    assert_same(dst, expected_tokens(src, before, si, di, fmt))
    before = [t.clone() for t in dst]
    assert dispatch.copy_rows(LayerTable(src), LayerTable(dst), torch.tensor([1, 2]),
                              torch.tensor([3, 0])) == "rows_reference"
    assert_same(dst, expected_rows(src, before, torch.tensor([1, 2]), torch.tensor([3, 0])))


def test_dispatch_sends_whole_pages_to_rows():
    fmt = TokenFormat.packed(2, 128, 4)  # no padding: whole pages are whole rows
    assert fmt.covers_row
    src, dst = layers(2, 5, fmt.page_bytes, 9), layers(2, 5, fmt.page_bytes, 10)
    before = [t.clone() for t in dst]
    si, di = torch.tensor([4, 5, 0, 1]), torch.tensor([2, 3, 8, 9])  # pages 2,0 -> 1,4
    assert dispatch.copy_tokens(src, dst, si, di, fmt) == "rows_reference"
    assert_same(dst, expected_rows(src, before, torch.tensor([2, 0]), torch.tensor([1, 4])))
    # same tokens out of slot order are not whole pages
    before = [t.clone() for t in dst]
    si2, di2 = torch.tensor([5, 4]), torch.tensor([2, 3])
    assert dispatch.copy_tokens(src, dst, si2, di2, fmt) == "tokens_reference"
    assert_same(dst, expected_tokens(src, before, si2, di2, fmt))


@pytest.mark.parametrize("fmt_name", ["c128_mla_2", "c4_mla_64"])
def test_whole_pages_of_a_padded_format_leave_the_padding(fmt_name):
    """A token copy moves values and scales only: whole pages of a padded format (the MLA
    pages of DSV4) keep the destination's padding bytes (a GPU soak caught rows copied whole)."""
    fmt = FORMATS[fmt_name]
    assert not fmt.covers_row
    P = fmt.tokens_per_page
    src, dst = layers(2, 5, fmt.page_bytes, 11), layers(2, 5, fmt.page_bytes, 12)
    before = [t.clone() for t in dst]
    si = torch.cat([torch.arange(2 * P, 3 * P), torch.arange(0, P)])
    di = torch.cat([torch.arange(P, 2 * P), torch.arange(4 * P, 5 * P)])
    assert dispatch.copy_tokens(src, dst, si, di, fmt) == "tokens_reference"
    want = expected_tokens(src, before, si, di, fmt)
    assert_same(dst, want)
    pad = fmt.scale_offset + P * fmt.scale_bytes
    for d, b in zip(dst, before):
        assert torch.equal(d[:, pad:], b[:, pad:])


def test_token_format_covers_row():
    assert TokenFormat.packed(64, 128, 4).covers_row
    assert not TokenFormat.mla(64).covers_row  # 64 x 584 B padded to 37,440
    assert TokenFormat(2, 64, 0, 128, 128).covers_row
    assert not TokenFormat(2, 64, 0, 128, 192).covers_row


def test_dispatch_empty_request_is_a_no_op():
    src, dst = layers(2, 3, 64, 1), layers(2, 3, 64, 2)
    before = [t.clone() for t in dst]
    e = torch.zeros(0, dtype=torch.int64)
    assert dispatch.copy_rows(src, dst, e, e) == "rows_reference"
    assert_same(dst, before)


# ----------------------------------------------------------------------------- index checks
def _bufs(rows=4, row_bytes=64, n_layers=2):
    return layers(n_layers, rows, row_bytes, 1), layers(n_layers, rows, row_bytes, 2)


BAD_ROWS = [
    ("lengths", dict(src_idx=torch.tensor([0, 1]), dst_idx=torch.tensor([0])), "has 1 entries"),
    ("dtype", dict(src_idx=torch.tensor([0], dtype=torch.int32), dst_idx=torch.tensor([0])), "int64"),
    ("not a tensor", dict(src_idx=[0], dst_idx=torch.tensor([0])), "torch.Tensor"),
    ("2-D", dict(src_idx=torch.zeros(1, 1, dtype=torch.int64), dst_idx=torch.tensor([0])), "1-D"),
    ("src high", dict(src_idx=torch.tensor([4]), dst_idx=torch.tensor([0])), r"index 4 out of range \[0, 4\)"),
    ("dst negative", dict(src_idx=torch.tensor([0]), dst_idx=torch.tensor([-1])), "index -1 out of range"),
    ("ctas", dict(src_idx=torch.tensor([0]), dst_idx=torch.tensor([0]), ctas=0), "ctas"),
    ("impl", dict(src_idx=torch.tensor([0]), dst_idx=torch.tensor([0]), impl="magic"), "impl"),
    ("staged on cpu", dict(src_idx=torch.tensor([0]), dst_idx=torch.tensor([0]), impl="staged"), "GPU"),
]


@pytest.mark.parametrize("name,kw,msg", BAD_ROWS, ids=[b[0] for b in BAD_ROWS])
def test_row_index_checks(name, kw, msg):
    src, dst = _bufs()
    before = [t.clone() for t in dst]
    with pytest.raises(TransferError, match=msg):
        dispatch.copy_rows(src, dst, **kw)
    assert_same(dst, before, "nothing may change on a refused request")


BAD_BUFFERS = [
    ("layer count", lambda: (layers(2, 4, 64, 1), layers(3, 4, 64, 2)), "layers"),
    ("row size", lambda: (layers(2, 4, 64, 1), layers(2, 4, 32, 2)), "rows are 64 B"),
    ("layer shapes differ", lambda: (layers(1, 4, 64, 1) + layers(1, 5, 64, 1), layers(2, 4, 64, 2)), "differs"),
    ("dtype", lambda: ([torch.zeros(4, 16, dtype=torch.int32)] * 2, layers(2, 4, 64, 2)), "uint8"),
    ("1-D layer", lambda: ([torch.zeros(64, dtype=torch.uint8)] * 2, layers(2, 4, 64, 2)), "2-D"),
    ("no layers", lambda: ([], []), "no layers"),
    ("strided bytes", lambda: ([torch.zeros(4, 128, dtype=torch.uint8)[:, ::2]] * 2, layers(2, 4, 64, 2)), "dense"),
]


@pytest.mark.parametrize("name,make,msg", BAD_BUFFERS, ids=[b[0] for b in BAD_BUFFERS])
def test_buffer_checks(name, make, msg):
    src, dst = make()
    with pytest.raises(TransferError, match=msg):
        dispatch.copy_rows(src, dst, torch.tensor([0]), torch.tensor([0]))


def test_token_index_checks():
    fmt = FORMATS["c128_mla_2"]
    src, dst = layers(2, 3, fmt.page_bytes, 1), layers(2, 3, fmt.page_bytes, 2)
    before = [t.clone() for t in dst]
    with pytest.raises(TransferError, match=r"index 6 out of range \[0, 6\)"):
        dispatch.copy_tokens(src, dst, torch.tensor([6]), torch.tensor([0]), fmt)
    with pytest.raises(TransferError, match="has 2 entries"):
        dispatch.copy_tokens(src, dst, torch.tensor([1]), torch.tensor([0, 1]), fmt)
    with pytest.raises(TransferError, match="int64"):
        dispatch.copy_tokens(src, dst, torch.tensor([1.0]), torch.tensor([0]), fmt)
    with pytest.raises(TransferError, match="TokenFormat"):
        dispatch.copy_tokens(src, dst, torch.tensor([1]), torch.tensor([0]), (2, 576, 8))
    with pytest.raises(TransferError, match="token format pages are 37440"):
        dispatch.copy_tokens(src, dst, torch.tensor([1]), torch.tensor([0]), FORMATS["c4_mla_64"])
    with pytest.raises(TransferError, match="whole rows only"):
        dispatch.copy_tokens(src, dst, torch.tensor([1]), torch.tensor([0]), fmt, impl="staged")
    assert_same(dst, before)


def test_transfer_error_is_a_value_error():
    assert issubclass(TransferError, ValueError)


def test_layer_table_caches_pointer_table():
    t = LayerTable(layers(3, 2, 32, 0))
    a = t.table(torch.device("cpu"))
    assert a is t.table(torch.device("cpu"))
    assert a.tolist() == [x.data_ptr() for x in t.layers]
    assert t.contiguous_rows() and t.rows == 2 and t.row_bytes == 32


def test_tune_staged_variants_are_well_formed():
    """The staged shapes ``bench transfer --tune`` sweeps (GPU only) are built by keyword: each
    field holds the type it names, so a config that gains a field cannot shift the others."""
    from hicache.bench.transfer_support import staged_variants
    from hicache.kernels.rows import RowsConfig
    from hicache.kernels.staged import StagedConfig

    vs = staged_variants()
    assert StagedConfig() in vs and len(set(vs)) == len(vs)
    for v in vs:
        assert isinstance(v.rows, RowsConfig)
        assert all(type(x) is int and x > 0 for x in (v.chunk_bytes, v.buffers, v.dma_streams))


def test_cpu_copy_few_refuses_ids_out_of_range_like_every_path():
    """The CPU path for a few ids (``cpu_copy.copy_few``) checks its ids as ``copy_rows`` does:
    a negative id used to wrap to the last row, an id past the end to copy outside the buffer."""
    import torch

    from hicache.kernels.cpu_copy import copy_few
    from hicache.kernels.tables import LayerTable, TokenFormat, TransferError

    src = LayerTable([torch.arange(8, dtype=torch.uint8).repeat_interleave(16).view(8, 16).clone()
                      for _ in range(2)])
    dst = LayerTable([torch.zeros(8, 16, dtype=torch.uint8) for _ in range(2)])
    fmt = TokenFormat(2, 8, 0, 16, 16)
    for s, d, f in (([-1], [0], None), ([8], [0], None), ([0], [8], None), ([0], [16], fmt)):
        with pytest.raises(TransferError, match="out of range"):
            copy_few(src, dst, s, d, f)
        assert all(int(t.count_nonzero()) == 0 for t in dst.layers)
    assert copy_few(src, dst, [3], [1], None) in ("numpy", "memmove")
    for d, sl in zip(dst.layers, src.layers):  # row 3 into row 1 of every layer, nothing else
        want = torch.zeros(8, 16, dtype=torch.uint8)
        want[1] = sl[3]
        assert torch.equal(d, want)


def _spaced(n_layers: int, rows: int, row_bytes: int, seed: int, even: bool) -> list:
    """Layers cut from one buffer, each ``rows x row_bytes``, with equal gaps between them
    (``even``: one strided numpy view covers them) or gaps of different sizes (it cannot)."""
    g = torch.Generator().manual_seed(seed)
    gaps = [64] * n_layers if even else [64 * (i + 1) for i in range(n_layers)]
    buf = torch.randint(0, 256, (sum(gaps) + n_layers * rows * row_bytes,), dtype=torch.uint8,
                        generator=g)
    out, at = [], 0
    for gap in gaps:
        at += gap
        out.append(buf[at:at + rows * row_bytes].view(rows, row_bytes))
        at += rows * row_bytes
    return out


@pytest.mark.parametrize("even", [True, False])
@pytest.mark.parametrize("fmt_name", [None, *sorted(FORMATS)])
def test_cpu_copy_few_matches_the_oracle_on_both_paths(fmt_name, even):
    """``cpu_copy.copy_few`` (a few ids, the daemon's CPU path) takes its numpy path when each
    buffer's layers are equally spaced and ``ctypes.memmove`` when they are not: both copy
    exactly the rows, or the tokens' values and scales, and nothing else."""
    from hicache.kernels.cpu_copy import copy_few

    fmt = FORMATS[fmt_name] if fmt_name else None
    rb = fmt.page_bytes if fmt else 1_728
    src, dst = _spaced(3, 4, rb, 1, even), _spaced(3, 3, rb, 2, even)
    k = fmt.tokens_per_page if fmt else 1
    si, di = ([0, 4 * k - 1, k + 1, 2 * k], [3 * k - 1, 0, k + 2, k]) if fmt else \
        ([0, 3, 1], [2, 0, 1])
    before, src0 = [t.clone() for t in dst], [t.clone() for t in src]
    path = copy_few(LayerTable(src), LayerTable(dst), si, di, fmt)
    assert path == ("numpy" if even else "memmove")
    want = (expected_tokens(src, before, torch.tensor(si), torch.tensor(di), fmt) if fmt else
            expected_rows(src, before, torch.tensor(si), torch.tensor(di)))
    assert_same(dst, want, f"{fmt_name} even={even}")
    assert_same(src, src0, "source changed")


def test_whole_pages_are_told_from_token_ids():
    """``dispatch._whole_pages``: CPU token ids that are whole pages in slot order give their
    page ids (the token copy then moves rows); anything else gives None."""
    from hicache.kernels.dispatch import _whole_pages

    got = _whole_pages(torch.tensor([8, 9, 10, 11, 0, 1, 2, 3]), 4)
    assert got is not None and got.dtype == torch.int64 and got.tolist() == [2, 0]
    for bad in ([8, 9, 10], [9, 10, 11, 12], [8, 9, 11, 10], [8, 9, 10, 11, 4, 5, 6, 8],
                [8, 8, 8, 8]):
        assert _whole_pages(torch.tensor(bad), 4) is None, bad


def test_a_kernel_batch_takes_no_copy_that_runs_on_the_cpu():
    """``KernelBatch`` queues only kernel copies for a GPU: given to ``copy_rows`` /
    ``copy_tokens`` on the CPU path (the reference copy), the copy runs at once, byte for byte,
    and the flush launches nothing."""
    from hicache.kernels.dispatch import KernelBatch, copy_rows, copy_tokens

    batch = KernelBatch()
    src, dst = layers(2, 6, 1_728, 1), layers(2, 6, 1_728, 2)
    si, di = torch.tensor([4, 0]), torch.tensor([1, 5])
    want = expected_rows(src, dst, si, di)
    assert copy_rows(src, dst, si, di, batch=batch) == "rows_reference"
    assert_same(dst, want, "rows")
    fmt = FORMATS["c4_mla_64"]
    src, dst = layers(2, 2, fmt.page_bytes, 3), layers(2, 2, fmt.page_bytes, 4)
    si, di = torch.tensor([3, 70]), torch.tensor([65, 1])
    want = expected_tokens(src, dst, si, di, fmt)
    assert copy_tokens(src, dst, si, di, fmt, batch=batch) == "tokens_reference"
    assert_same(dst, want, "tokens")
    assert batch.flush() == 0
