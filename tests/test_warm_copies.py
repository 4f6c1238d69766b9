"""CPU checks of what keeps a copy from compiling on its first use (the GPU side is
``tests/test_warm_copies_cuda.py``):

* the row and token kernels take every length and stride at run time (Triton would otherwise
  make a variant per length class: ``== 1``, ``% 16``, other), and every copy length launches
  the same compile-time arguments (the vector counts among them);
* a segment plan's three device arrays each start 16-byte aligned whatever its offset count
  (Triton specializes the segment kernel on it: an odd count made a variant no warm-up had);
* the daemon's warm-up refuses a CPU daemon, which launches no kernel, in one line;
* ``hicache stats``' summary shows a GPU daemon's variant counts;
* ``upload_tables`` makes each missing pointer table once (the daemon makes its tables before a
  copy needs them).
"""
from __future__ import annotations

import os
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from hicache.kernels import rows, tokens
from hicache.kernels.launch_cache import CachedKernel
from hicache.kernels.segments import SegmentPart, SegmentPlan
from hicache.kernels.tables import LayerTable, TokenFormat, upload_tables

@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1",
                    reason="the interpreter has no JIT specialization to check")
@pytest.mark.parametrize("kernel, lengths", [
    (rows._rows_kernel, ("n", "total_pieces", "src_stride", "dst_stride")),
    (tokens._tokens_kernel, ("n", "total", "src_stride", "dst_stride")),
])
def test_the_row_and_token_kernels_take_lengths_at_run_time(kernel, lengths) -> None:
    taken = {p.name for p in kernel.params if p.do_not_specialize}
    assert taken == set(lengths), taken


class _Recorder:
    """Stands in for a kernel's ``CachedKernel``: each launch records the key that picks its
    compiled kernel (every constexpr, the options, and what Triton specializes the run-time
    arguments on) and launches nothing."""

    def __init__(self, real: CachedKernel) -> None:
        self.real, self.keys = real, []

    def launch(self, grid: tuple, args: dict, options: dict, cached: bool) -> None:
        self.keys.append(self.real.key(args, options))


@pytest.mark.parametrize("direction", [(True, False), (False, True)])
def test_every_copy_length_launches_the_same_compiled_kernel(monkeypatch, direction) -> None:
    """``G`` and ``T`` (the vector counts) and every other constexpr of a row or token launch
    depend on the shape and direction only, not on how many rows or tokens a copy moves, and no
    length changes what Triton specializes on: a short copy takes the kernel a long one (and
    the warm-up's one-id launch) compiled."""
    rec_rows, rec_tokens = _Recorder(rows.ROWS_KERNEL), _Recorder(tokens.TOKENS_KERNEL)
    monkeypatch.setattr(rows, "ROWS_KERNEL", rec_rows)
    monkeypatch.setattr(tokens, "TOKENS_KERNEL", rec_tokens)
    fmt = TokenFormat(64, 576, 8, 64 * 576, 64 * 584)
    tab = torch.zeros(2, dtype=torch.int64)
    for n in (1, 2, 3, 15, 16, 17, 33, 1000, 4096):
        ids = torch.arange(n, dtype=torch.int64)
        rows.launch_rows(tab, tab, ids, ids, num_layers=3, row_bytes=18432, src_stride=18432,
                         dst_stride=18432, align=16, ctas=8, cfg=rows.rows_config(*direction))
        tokens.launch_tokens(tab, tab, ids, ids, fmt, num_layers=3, src_stride=fmt.page_bytes,
                             dst_stride=fmt.page_bytes, align=16, ctas=8,
                             cfg=tokens.tokens_config(*direction))
    for rec in (rec_rows, rec_tokens):
        assert len(rec.keys) == 9
        assert all(k == rec.keys[0] for k in rec.keys), rec.keys


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


def test_upload_tables_makes_each_missing_table_once() -> None:
    """``upload_tables``: every table not made yet for the device, once (a table named twice
    counts once); ``table()`` then returns the one made, holding the layers' addresses."""
    a = LayerTable([torch.zeros(4, 8, dtype=torch.uint8) for _ in range(3)], "a")
    b = LayerTable([torch.zeros(2, 16, dtype=torch.uint8)], "b")
    cpu = torch.device("cpu")
    assert upload_tables([a, b, a], cpu) == 2
    made = a.table(cpu)
    assert upload_tables([a, b], cpu) == 0
    assert a.table(cpu) is made and made.tolist() == a.ptrs
    assert b.table(cpu).tolist() == b.ptrs
