"""Top-k trace generator: ids distinct and in range, the kept fraction, recency, short requests,
determinism, and refused knobs."""
from __future__ import annotations

import pytest
import torch

from hicache.sim.topk_trace import TopkTrace, TopkTraceConfig, batch_traces


def test_ids_distinct_in_range_and_newest_included():
    tr = TopkTrace(TopkTraceConfig(topk=64), seed=1)
    for n in (1000, 1000, 1001, 5000):
        ids = tr.step(n)
        assert ids.numel() == 64 and len(set(ids.tolist())) == 64
        assert int(ids.min()) >= 0 and int(ids.max()) < n and (n - 1) in ids.tolist()


@pytest.mark.parametrize("overlap", [0.0, 0.5, 0.8, 0.95, 1.0])
def test_overlap_is_the_kept_fraction(overlap):
    K = 100
    tr = TopkTrace(TopkTraceConfig(topk=K, overlap=overlap, recency=0.0, include_newest=False),
                   seed=2)
    prev = set(tr.step(100_000).tolist())
    for _ in range(5):
        cur = set(tr.step(100_000).tolist())
        kept = len(prev & cur)
        assert round(overlap * K) <= kept <= round(overlap * K) + 3  # + chance re-draws
        prev = cur


def test_recency_bias():
    n, W = 1_000_000, 1000
    near = TopkTrace(TopkTraceConfig(topk=200, overlap=0, recency=1.0, recent_window=W), 3)
    assert int(near.step(n).min()) >= n - W
    far = TopkTrace(TopkTraceConfig(topk=200, overlap=0, recency=0.0, include_newest=False), 3)
    assert int((far.step(n) >= n - W).sum()) < 10


def test_short_request_gets_every_token():
    ids = TopkTrace(TopkTraceConfig(topk=16), 0).step(5)
    assert ids.tolist() == [0, 1, 2, 3, 4] + [-1] * 11


def test_deterministic_and_batch_shape():
    cfg = TopkTraceConfig(topk=8)
    a = batch_traces(cfg, [100, 20], layers=2, steps=3, seed=4, grow_every=2)
    b = batch_traces(cfg, [100, 20], layers=2, steps=3, seed=4, grow_every=2)
    assert a.shape == (3, 2, 2, 8) and torch.equal(a, b)
    assert int(a[2, 0, 0].max()) == 100  # grew by one token at step 2


@pytest.mark.parametrize("kw", [dict(topk=0), dict(overlap=1.5), dict(recency=-0.1),
                                dict(recent_window=0)])
def test_bad_knobs_refused(kw):
    with pytest.raises(ValueError):
        TopkTraceConfig(**kw)
