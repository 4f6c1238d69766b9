"""CPU checks of what keeps a copy from compiling on its first use (the GPU side is
``tests/test_warm_copies_cuda.py``):

* the row and token kernels take every length and stride at run time (Triton would otherwise
  make a variant per length class: ``== 1``, ``% 16``, other), and a short copy launches the
  same vector count as a long one;
* a segment plan's three device arrays each start 16-byte aligned whatever its offset count
  (Triton specializes the segment kernel on it: an odd count made a variant no warm-up had);
* the daemon's warm-up refuses a CPU daemon, which launches no kernel, in one line;
* ``hicache stats``' summary shows a GPU daemon's variant counts.
"""
from __future__ import annotations

import inspect
import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.kernels import rows, tokens
from hicache.kernels.segments import SegmentPart, SegmentPlan
from hicache.kernels.tables import LayerTable

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter has no JIT specialization to check")
@pytest.mark.parametrize("kernel, lengths", [
    (rows._rows_kernel, ("n", "total_pieces", "src_stride", "dst_stride")),
    (tokens._tokens_kernel, ("n", "total", "src_stride", "dst_stride")),
])
def test_the_row_and_token_kernels_take_lengths_at_run_time(kernel, lengths) -> None:
    taken = {p.name for p in kernel.params if p.do_not_specialize}
    assert taken == set(lengths), taken


def test_a_short_copy_launches_the_long_ones_vector_count() -> None:
    """``G`` and ``T`` (constexprs) no longer follow a short copy's length: the source reads
    them from the configs only."""
    assert "cfg.pieces" in inspect.getsource(rows.launch_rows)
    assert "next_power_of_2(total)" not in inspect.getsource(rows.launch_rows)
    assert "next_power_of_2(total)" not in inspect.getsource(tokens.launch_tokens)


@pytest.mark.parametrize("count", [1, 2, 3, 8])
def test_a_segment_plans_arrays_start_16_byte_aligned(count: int) -> None:
    a = LayerTable([torch.zeros(16, 64, dtype=torch.uint8)])
    b = LayerTable([torch.zeros(16, 64, dtype=torch.uint8)])
    so = np.arange(count, dtype=np.int64) * 64
    do = so[::-1].copy()
    plan = SegmentPlan.build([SegmentPart(a.ptrs, b.ptrs, [0], [(64, so, do)])], [0])
    assert plan.src_off.size % 2 == count % 2  # an odd count is what used to misalign
    desc, soff, doff = plan.to(torch.device("cpu")).dev
    for t in (desc, soff, doff):
        assert t.data_ptr() % 16 == 0
    assert np.array_equal(desc.numpy(), plan.desc.ravel())
    assert np.array_equal(soff.numpy(), plan.src_off)
    assert np.array_equal(doff.numpy(), plan.dst_off)


def test_the_warm_up_refuses_a_cpu_daemon() -> None:
    from hicache.controllers.warm_copies import warm_pools

    with pytest.raises(ValueError, match="a cpu daemon launches no copy kernel"):
        warm_pools(SimpleNamespace(device=torch.device("cpu")))


def test_the_stats_summary_shows_a_gpu_daemons_variants() -> None:
    from hicache.cli.stats import summary

    s = {"device": "cuda:0", "kernel_variants": {"rows": 7, "tokens": 7, "segments": 3}}
    assert "  copy kernel variants loaded: rows 7, tokens 7, segments 3" in \
        summary(s).splitlines()
