"""The Triton kernels on CPU under the Triton interpreter, byte for byte against the oracle.

``TRITON_INTERPRET=1`` must be set before triton is imported, and the rest of the suite may
already have imported it, so the cases run in one child process (this file run as a script);
the parent test collects its per-case verdicts. Cases are small: the interpreter is slow.
"""
from __future__ import annotations

import os
import sys

import pytest

import interp_harness

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

ROW_CASES = [37_440, 149_760, 65_536, 6_144, 1_728, 584, 100]
TOKEN_CASES = ["swa_mla_256", "c4_mla_64", "c128_mla_2", "indexer_fp8_64", "indexer_fp4_64"]
CASES = ([f"rows_{rb}" for rb in ROW_CASES] + [f"tokens_{f}" for f in TOKEN_CASES]
         + [f"tokens_line_aligned_{side}_{f}" for side in (1, 2)
            for f in ("c4_mla_64", "swa_mla_256")]
         + ["tokens_whole_pages_go_to_rows", "rows_unaligned_view", "strided_ids",
            "kernel_batch"])


def _run_case(name: str) -> None:
    import torch

    from hicache.kernels import dispatch
    from test_kernels_ref import (FORMATS, assert_same, expected_rows, expected_tokens, layers,
                                  pair_sets)

    if name.startswith("rows_") and name[5:].isdigit():
        rb = int(name[5:])
        src, dst = layers(2, 9, rb, 1), layers(2, 7, rb, 2)
        src0 = [t.clone() for t in src]
        for ctas in (1, 3):
            for k, (si, di) in pair_sets(9, 7, 1, 3 + ctas).items():
                before = [t.clone() for t in dst]
                assert dispatch.copy_rows(src, dst, si, di, ctas=ctas, impl="triton") == "rows_zero_copy"
                assert_same(dst, expected_rows(src, before, si, di), f"{k} ctas={ctas}")
        assert_same(src, src0, "source changed")
    elif name.startswith("tokens_") and name[7:] in FORMATS:
        fmt = FORMATS[name[7:]]
        P = fmt.tokens_per_page
        src, dst = layers(2, 4, fmt.page_bytes, 4), layers(2, 3, fmt.page_bytes, 5)
        src0 = [t.clone() for t in src]
        for ctas in (1, 2):
            for k, (si, di) in pair_sets(4 * P, 3 * P, P, 6 + ctas).items():
                before = [t.clone() for t in dst]
                assert dispatch.copy_tokens(src, dst, si, di, fmt, ctas=ctas,
                                            impl="triton") == "tokens_zero_copy"
                assert_same(dst, expected_tokens(src, before, si, di, fmt), f"{k} ctas={ctas}")
        assert_same(src, src0, "source changed")
    elif name.startswith("tokens_line_aligned_"):
        # the GPU launch shapes move the 64-B tail first where that aligns the head to the
        # host side's 128-B lines; CPU dispatch never picks them, so launch them directly
        from hicache.kernels.tables import LayerTable
        from hicache.kernels.tokens import TokensConfig, launch_tokens

        side, fname = int(name.split("_")[3]), name.split("_", 4)[4]
        fmt = FORMATS[fname]
        P = fmt.tokens_per_page
        src, dst = layers(2, 4, fmt.page_bytes, 9), layers(2, 3, fmt.page_bytes, 10)
        src0 = [t.clone() for t in src]
        s_t, d_t = LayerTable(src, "source"), LayerTable(dst, "destination")
        cpu = torch.device("cpu")
        for k, (si, di) in pair_sets(4 * P, 3 * P, P, 11).items():
            before = [t.clone() for t in dst]
            launch_tokens(s_t.table(cpu), d_t.table(cpu), si, di, fmt, num_layers=2,
                          src_stride=s_t.stride, dst_stride=d_t.stride,
                          align=min(s_t.align, d_t.align), ctas=2,
                          cfg=TokensConfig(tokens=16, num_warps=4, align_side=side))
            assert_same(dst, expected_tokens(src, before, si, di, fmt), f"{k} side={side}")
        assert_same(src, src0, "source changed")
    elif name == "tokens_whole_pages_go_to_rows":
        fmt = FORMATS["indexer_fp8_64"]  # no padding (a padded format moves tokens only)
        src, dst = layers(2, 3, fmt.page_bytes, 7), layers(2, 3, fmt.page_bytes, 8)
        before = [t.clone() for t in dst]
        si = torch.arange(64, 128, dtype=torch.int64)
        di = torch.arange(128, 192, dtype=torch.int64)
        # auto on CPU picks the reference; the kernel is forced through copy_rows
        assert dispatch.copy_tokens(src, dst, si, di, fmt) == "rows_reference"
        dst2 = [t.clone() for t in before]
        dispatch.copy_rows(src, dst2, torch.tensor([1]), torch.tensor([2]), impl="triton")
        assert_same(dst2, [t.cpu() for t in dst])
    elif name == "rows_unaligned_view":
        # layers at odd byte offsets with a row stride wider than the row: no alignment hints
        base_s = torch.randint(0, 256, (2, 8 * 104 + 3), dtype=torch.uint8)
        base_d = torch.randint(0, 256, (2, 6 * 104 + 5), dtype=torch.uint8)
        src = [base_s[l, 3:].view(8, 104)[:, :100] for l in range(2)]
        dst = [base_d[l, 5:].view(6, 104)[:, :100] for l in range(2)]
        full_before = base_d.clone()
        si, di = torch.tensor([7, 0, 3]), torch.tensor([0, 5, 2])
        exp = expected_rows(src, dst, si, di)
        dispatch.copy_rows(src, dst, si, di, impl="triton", ctas=2)
        assert_same(dst, exp)
        # the 4 bytes between rows and the prefix are untouched
        mask = torch.ones_like(base_d, dtype=torch.bool)
        for l in range(2):
            for r in di.tolist():
                mask[l, 5 + r * 104: 5 + r * 104 + 100] = False
        assert torch.equal(base_d[mask], full_before[mask])
    elif name == "strided_ids":
        # id tensors that are views with a stride: the kernels read packed int64 ids, so
        # dispatch hands them a packed copy (they used to read the raw storage: rows [1, 7, 2]
        # for the ids [1, 2, 3], and any row at all past the bounds check)
        src, dst = layers(2, 8, 64, 12), layers(2, 8, 64, 13)
        si = torch.tensor([1, 7, 2, 7, 3, 7], dtype=torch.int64)[::2]
        di = torch.tensor([4, 9, 5, 9, 6, 9], dtype=torch.int64)[::2]
        before = [t.clone() for t in dst]
        dispatch.copy_rows(src, dst, si, di, impl="triton")
        assert_same(dst, expected_rows(src, before, si.clone(), di.clone()))
        fmt = FORMATS["c4_mla_64"]
        src, dst = layers(2, 2, fmt.page_bytes, 14), layers(2, 2, fmt.page_bytes, 15)
        st = torch.tensor([3, 100, 70, 100], dtype=torch.int64)[::2]
        dt = torch.tensor([5, 1, 66, 1], dtype=torch.int64)[::2]
        before = [t.clone() for t in dst]
        dispatch.copy_tokens(src, dst, st, dt, fmt, impl="triton")
        assert_same(dst, expected_tokens(src, before, st.clone(), dt.clone(), fmt))
    elif name == "kernel_batch":
        # a KernelBatch as a GPU daemon's backup fills it, the kernel's device made the CPU
        # (on a GPU the block is pinned and the copy asynchronous: tests/test_kernels_cuda.py)
        real, dispatch._kernel_device = dispatch._kernel_device, lambda *_: torch.device("cpu")
        try:
            _kernel_batch()
        finally:
            dispatch._kernel_device = real
    else:
        raise KeyError(name)


def _kernel_batch() -> None:
    """Rows of three sizes and tokens of two formats queued in one ``KernelBatch``: nothing
    written before ``flush``, a copy for another stream refused, every byte the oracle's after
    it, a second flush refused."""
    import torch

    from hicache.kernels import dispatch
    from hicache.kernels.tables import TransferError
    from test_kernels_ref import FORMATS, assert_same, expected_rows, expected_tokens, layers

    jobs, batch = [], dispatch.KernelBatch()
    for k, (rb, n) in enumerate(((1_728, 3), (584, 1), (100, 4))):
        src, dst = layers(2, 9, rb, 20 + k), layers(2, 9, rb, 30 + k)
        si, di = torch.randperm(9)[:n], torch.randperm(9)[:n]
        jobs.append((dst, expected_rows(src, dst, si, di), f"rows {rb}"))
        assert dispatch.copy_rows(src, dst, si, di, batch=batch) == "rows_zero_copy"
    for k, (fname, n) in enumerate((("c4_mla_64", 5), ("indexer_fp8_64", 2))):
        fmt = FORMATS[fname]
        src, dst = layers(2, 3, fmt.page_bytes, 40 + k), layers(2, 3, fmt.page_bytes, 50 + k)
        si = torch.randperm(3 * fmt.tokens_per_page)[:n]
        di = torch.randperm(3 * fmt.tokens_per_page)[:n]
        jobs.append((dst, expected_tokens(src, dst, si, di, fmt), f"tokens {fname}"))
        assert dispatch.copy_tokens(src, dst, si, di, fmt, batch=batch) == "tokens_zero_copy"
    for (dst, _, what), want in zip(jobs, [layers(2, 9, 1_728, 30), layers(2, 9, 584, 31)]):
        assert_same(dst, want, f"{what}: written before the flush")
    try:
        batch.add(si, di, "another stream", torch.device("cpu"), lambda s, d: None)
        raise AssertionError("a copy for another stream joined the batch")
    except TransferError as e:
        assert "one stream of one device" in str(e), e
    assert batch.flush() == len(jobs)
    for dst, want, what in jobs:
        assert_same(dst, want, what)
    try:
        batch.flush()
        raise AssertionError("a second flush ran")
    except TransferError as e:
        assert "flushed already" in str(e), e


@pytest.fixture(scope="module")
def verdicts() -> dict:
    return interp_harness.verdicts(__file__)


@pytest.mark.parametrize("case", CASES)
def test_interpreter_kernel_matches_oracle(verdicts, case):
    d = verdicts.get(case)
    assert d is not None, f"no verdict for {case} (child crashed?)"
    assert d["ok"], d.get("err")


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(interp_harness.child(CASES, _run_case))
