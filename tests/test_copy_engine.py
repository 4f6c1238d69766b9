"""``kernels.copy_engine`` on the CPU: the plan arithmetic (addresses, sizes, layer grouping),
the policy switch, and the refusals of ``impl="dma"`` and ``--copy-engine on`` where the copy
engines cannot run. The copies themselves run in tests/test_kernels_cuda.py and
tests/test_copy_by_layer.py on a GPU."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.core.config import ServeConfig, validate
from hicache.core.errors import UsageError
from hicache.kernels import copy_engine, dispatch
from hicache.kernels.copy_engine import DmaPlan
from hicache.kernels.segments import SegmentPart
from hicache.kernels.tables import LayerTable, TransferError


def test_plan_groups_copies_by_layer_position_with_exact_addresses():
    a = SegmentPart([1000, 2000], [5000, 6000], [7, 3],
                    [(100, np.array([0, 300]), np.array([400, 0]))], "h2d")
    b = SegmentPart([9000], [8000], [3], [(50, np.array([10]), np.array([20]))], "h2d")
    plan = DmaPlan.build([a, b], [3, 7])
    # layer 3 (position 0): a's second layer (2000/6000) then b; layer 7: a's first layer
    assert plan.layers == [(0, 3), (3, 5)]
    assert plan.src.tolist() == [2000, 2300, 9010, 1000, 1300]
    assert plan.dst.tolist() == [6400, 6000, 8020, 5400, 5000]
    assert plan.size.tolist() == [100, 100, 50, 100, 100]
    assert int(plan.size.sum()) == 450
    assert all(x.dtype == np.uint64 and x.flags.c_contiguous for x in (plan.src, plan.dst, plan.size))


def test_rows_plan_covers_every_layer_in_one_group():
    plan = DmaPlan.rows([100, 200], [1000, 2000], 8, np.array([0, 16]), np.array([32, 8]))
    assert plan.layers == [(0, 4)]
    assert plan.src.tolist() == [100, 116, 200, 216]
    assert plan.dst.tolist() == [1032, 1008, 2032, 2008]


def test_issue_without_direction_or_driver_is_refused():
    plan = DmaPlan.rows([100], [1000], 8, np.array([0]), np.array([0]))
    with pytest.raises(TransferError):
        copy_engine.issue(plan, 0, 1, 0)  # no direction set (and on CPU: no driver)


def test_plan_of_a_part_with_several_ranges_makes_one_copy_per_range_per_layer():
    """A token block on the copy engines: its value range and its scale range, each layer."""
    part = SegmentPart([1000, 2000], [5000, 6000], [4, 9],
                       [(576, np.array([0]), np.array([1152])), (8, np.array([900]), np.array([916]))],
                       "h2d")
    plan = DmaPlan.build([part], [9, 4])
    assert plan.layers == [(0, 2), (2, 4)]
    assert plan.src.tolist() == [2000, 2900, 1000, 1900]
    assert plan.dst.tolist() == [7152, 6916, 6152, 5916]
    assert plan.size.tolist() == [576, 8, 576, 8]


@pytest.mark.parametrize("layer", [0, 2, 4])
def test_plan_of_one_range_of_one_layer_matches_the_general_grouping(layer):
    """One part, one range, one layer (a load's layer 0 of SWA rows) takes a shortcut; its plan
    is the one the general path makes for the same copies (checked against the same range
    over that layer and one other, which takes the general path)."""
    order = [4, 0, 2]
    part = SegmentPart([1000], [5000], [layer], [(64, np.array([0, 640, 128]),
                                                   np.array([192, 0, 64]))], "h2d")
    fast = DmaPlan.build([part], order)
    pos = order.index(layer)
    assert fast.layers == [(0, 0)] * pos + [(0, 3)] + [(3, 3)] * (len(order) - pos - 1)
    assert fast.src.tolist() == [1000, 1640, 1128]
    assert fast.dst.tolist() == [5192, 5000, 5064]
    assert fast.size.tolist() == [64, 64, 64]
    two = SegmentPart([1000, 3000], [5000, 7000], [layer, order[pos - 1]],
                      [(64, np.array([0, 640, 128]), np.array([192, 0, 64]))], "h2d")
    general = DmaPlan.build([two], order)
    a, b = general.layers[pos]
    assert general.src[a:b].tolist() == fast.src.tolist()
    assert general.dst[a:b].tolist() == fast.dst.tolist()
    assert all(x.dtype == np.uint64 and x.flags.c_contiguous
               for x in (fast.src, fast.dst, fast.size))
    assert fast.addresses() == (fast.dst.ctypes.data, fast.src.ctypes.data, fast.size.ctypes.data)


@pytest.mark.parametrize("layer", [0, 2, 4])
def test_plan_of_several_ranges_of_one_layer_matches_the_general_grouping(layer):
    """One part, one layer, several ranges (a load's layer 0 of a checkpoint's SWA tail: a
    value and a scale range; an empty range among them) takes the shortcut too; its copies
    are the ones, in the order, that the general path makes over that layer and one other."""
    order = [4, 0, 2]
    ranges = [(73728, np.array([0, 300_000]), np.array([150_000, 0])),
              (8, np.zeros(0, dtype=np.int64), np.zeros(0, dtype=np.int64)),
              (1024, np.array([147_456]), np.array([297_456]))]
    fast = DmaPlan.build([SegmentPart([1000], [5000], [layer], ranges, "h2d")], order)
    pos = order.index(layer)
    assert fast.layers == [(0, 0)] * pos + [(0, 3)] + [(3, 3)] * (len(order) - pos - 1)
    assert fast.src.tolist() == [1000, 301_000, 148_456]
    assert fast.dst.tolist() == [155_000, 5000, 302_456]
    assert fast.size.tolist() == [73728, 73728, 1024]
    two = SegmentPart([1000, 3000], [5000, 7000], [layer, order[pos - 1]], ranges, "h2d")
    general = DmaPlan.build([two], order)
    a, b = general.layers[pos]
    for x, y in ((general.src, fast.src), (general.dst, fast.dst), (general.size, fast.size)):
        assert x[a:b].tolist() == y.tolist()
    assert all(x.dtype == np.uint64 and x.flags.c_contiguous
               for x in (fast.src, fast.dst, fast.size))


@pytest.mark.parametrize("layers", [[4, 0, 2], [0, 2], [4, 2], [2, 0, 4]])
def test_plan_of_one_range_over_layers_matches_the_general_grouping(layers):
    """One part, one range, several layers (the lead of a load's next layers): in layer order
    it takes the shortcut, out of order the general path; either way the plan equals the one
    the general path makes for the same copies split over one part per layer."""
    order = [4, 0, 2]
    so, do = np.array([0, 640, 128]), np.array([192, 0, 64])
    src = [1000 + 10000 * g for g in layers]
    dst = [5000 + 10000 * g for g in layers]
    one = DmaPlan.build([SegmentPart(src, dst, layers, [(64, so, do)], "h2d")], order)
    split = DmaPlan.build([SegmentPart([s], [d], [g], [(64, so, do)], "h2d")
                           for s, d, g in zip(src, dst, layers)], order)
    assert one.layers == split.layers
    for a, b in ((one.src, split.src), (one.dst, split.dst), (one.size, split.size)):
        assert a.tolist() == b.tolist() and a.dtype == np.uint64 and a.flags.c_contiguous
    for i, g in enumerate(order):
        a, b = one.layers[i]
        assert b - a == (3 if g in layers else 0)
        assert one.src[a:b].tolist() == ([1000 + 10000 * g + x for x in so.tolist()]
                                         if g in layers else [])


def test_plan_addresses_refuse_arrays_the_driver_cannot_read():
    plan = DmaPlan.rows([100], [1000], 8, np.array([0, 16, 32, 48]), np.array([0, 8, 16, 24]))
    plan.src = plan.src[::2]  # a strided view
    with pytest.raises(TransferError, match="contiguous 8-byte words"):
        plan.addresses()


class _RecordingDriver:
    """Stands in for the driver entry point: records each call's copies (no GPU here)."""

    def __init__(self) -> None:
        self.reason, self.v2, self.attr_idx = None, True, object()
        self.calls: list[tuple[int, int, int, int]] = []

    def fn(self, dst: int, src: int, size: int, n: int, attrs: object, idx: object, k: int,
           stream: object) -> int:
        self.calls.append((dst, src, size, n))
        return 0

    def ensure_context(self, stream: int) -> None:
        pass


def test_issue_makes_the_streams_context_current_on_a_thread_without_one():
    """A thread with no current CUDA context (one that made no runtime call yet) gets the
    stream's context before the batch; one that has a context is left alone; a stream whose
    context cannot be had is refused by name (it failed as CUresult 1 at the batch)."""
    import ctypes

    drv = copy_engine._Driver.__new__(copy_engine._Driver)
    state = {"current": 0, "set": []}

    def ctx_get(out):
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = state["current"] or None
        return 0

    def stream_ctx(stream, out):
        if stream.value == 99:
            return 400
        ctypes.cast(out, ctypes.POINTER(ctypes.c_void_p))[0] = 0x5000 + stream.value
        return 0

    def ctx_set(ctx):
        state["set"].append(ctx.value if isinstance(ctx, ctypes.c_void_p) else ctx)
        return 0

    drv.ctx_get, drv.stream_ctx, drv.ctx_set = ctx_get, stream_ctx, ctx_set
    drv.ensure_context(7)
    assert state["set"] == [0x5007]
    state["current"] = 0x1234
    drv.ensure_context(8)
    assert state["set"] == [0x5007]  # a context was current: untouched
    state["current"] = 0
    with pytest.raises(TransferError, match="no CUDA context on this thread.*CUresult 400"):
        drv.ensure_context(99)


@pytest.mark.parametrize("ramp", [False, True])
@pytest.mark.parametrize("lo,hi", [(0, 3), (0, 8), (0, 9), (0, 128), (5, 5 + 1300)])
def test_issue_calls_the_driver_short_first_then_more(monkeypatch, lo, hi, ramp):
    """``HEAD_COPIES`` in the first driver call, then ``PER_CALL`` per call, or with ``ramp``
    ``GROWTH`` times more per call up to ``PER_CALL`` (the last call takes what is left);
    every call at the addresses of its first copy, all copies once."""
    n = 1400
    plan = DmaPlan.rows([0], [1 << 20], 64, np.arange(n) * 64, np.arange(n) * 64)
    plan.direction(True, 0)
    drv = _RecordingDriver()
    monkeypatch.setattr(copy_engine, "_probe", lambda: drv)
    copy_engine.issue(plan, lo, hi, 0, ramp)
    sizes = [c[3] for c in drv.calls]
    want, k, left = [], copy_engine.HEAD_COPIES, hi - lo
    while left:
        want.append(min(k, left))
        left -= want[-1]
        k = min(copy_engine.PER_CALL, k * copy_engine.GROWTH) if ramp else copy_engine.PER_CALL
    assert sizes == want and sum(sizes) == hi - lo
    if hi - lo == 128:
        assert sizes == ([8, 16, 32, 64, 8] if ramp else [8, 120])
    assert max(sizes) <= copy_engine.PER_CALL
    dst, src, size = plan.addresses()
    at = lo
    for d, s_, z, k in drv.calls:  # each call starts at the next uncopied copy
        assert (d, s_, z) == (dst + 8 * at, src + 8 * at, size + 8 * at)
        at += k


def test_issue_names_the_copies_of_a_failed_driver_call(monkeypatch):
    plan = DmaPlan.rows([0], [1 << 20], 64, np.arange(20) * 64, np.arange(20) * 64)
    plan.direction(True, 0)
    drv = _RecordingDriver()
    record = drv.fn

    def second_call_fails(*args: object) -> int:
        record(*args)  # type: ignore[arg-type]
        return 0 if len(drv.calls) == 1 else 700

    drv.fn = second_call_fails  # type: ignore[method-assign]
    monkeypatch.setattr(copy_engine, "_probe", lambda: drv)
    with pytest.raises(TransferError, match=r"CUresult 700 on copies 8\.\.19 of 20"):
        copy_engine.issue(plan, 0, 20, 0)
    assert len(drv.calls) == 2  # nothing issued after the failed call


def test_policy_modes():
    with pytest.raises(TransferError, match="not one of"):
        copy_engine.configure("sometimes")
    copy_engine.configure("off")
    try:
        assert not copy_engine.enabled()
    finally:
        copy_engine.configure("auto")
    if copy_engine.status() is not None:  # CPU machines: 'on' names why it cannot hold
        with pytest.raises(TransferError, match="cannot hold: "):
            copy_engine.configure("on")
        assert not copy_engine.enabled()


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks the CPU-only refusals")
def test_cpu_buffers_never_take_the_copy_engines():
    a = LayerTable([torch.zeros(4, 1 << 17, dtype=torch.uint8)] * 2)
    b = LayerTable([torch.zeros(4, 1 << 17, dtype=torch.uint8)] * 2)
    parts = dispatch.layer_parts(a, b, np.array([1]), np.array([2]), None, [0, 1])
    assert [p.dma for p in parts] == [""]
    with pytest.raises(TransferError, match=r"impl='dma' cannot run: it needs a GPU"):
        dispatch.copy_rows(a, b, torch.tensor([1]), torch.tensor([2]), impl="dma")
    assert not torch.count_nonzero(b.layers[0])  # nothing moved
    with pytest.raises(TransferError, match="whole rows only"):
        dispatch.copy_tokens(a, b, torch.tensor([1]), torch.tensor([2]),
                             dispatch.TokenFormat(1, 1 << 16, 0, 1 << 16, 1 << 17), impl="dma")


def test_serve_refuses_copy_engine_on_in_cpu_mode():
    with pytest.raises(UsageError, match="--copy-engine on: the copy engines are a GPU's"):
        validate(ServeConfig(preset="dsv4-tiny", device="cpu", copy_engine="on"))
    with pytest.raises(UsageError, match="--copy_engine must be one of|--copy-engine must be one of"):
        validate(ServeConfig(preset="dsv4-tiny", device="cpu", copy_engine="maybe"))
