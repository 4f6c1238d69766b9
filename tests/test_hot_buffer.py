"""HiSparse hot buffer on CPU through the torch reference: every scenario of ``hisparse_cases``
with all its byte checks, and every input check (one clear error, nothing changed)."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from hisparse_cases import CASES, World, run_case  # noqa: E402

from hicache.engine.hot_buffer import HotBufferError  # noqa: E402


@pytest.mark.parametrize("case", CASES)
def test_reference_scenario(case):
    run_case(case, "reference")


def test_lru_evicts_oldest_first():
    w = World("reference", K=4, S=8, L=1)
    w.admit(0, 100)
    w.step(0, [0], torch.tensor([[1, 2, 3, 4]]))
    w.step(0, [0], torch.tensor([[5, 6, 7, 8]]))
    w.step(0, [0], torch.tensor([[1, 2, 9, 10]]))   # 1, 2 hit; 9, 10 take the two oldest
    toks = w.hb.slot_tok[0, 0].tolist()
    assert sorted(t for t in toks if t >= 0) == [1, 2, 5, 6, 7, 8, 9, 10]
    # LRU order now: 3/4's old slots gone; untouched 5..8, then hits 1, 2, then 9, 10
    held = [toks[s] for s in w.hb.order[0, 0].tolist()]
    assert held == [5, 6, 7, 8, 1, 2, 9, 10]


@pytest.mark.parametrize("grow_to", [5, 8, 9, 12])
def test_a_step_of_several_tokens_in_the_fast_path_serves_the_requests_own_bytes(grow_to):
    """Slot = token id while a request fits (the fast path); only the newest token is written
    by the engine. A step that added several tokens (MTP) left the ones before the newest in
    slots holding the previous request's bytes (found by a review helper); ``extend`` loads
    them from the host now, also when the step takes the request past the fast path."""
    w = World("reference", K=4, S=8, L=1, R=2, B=2)
    w.admit(0, 8)  # request A fills request slot 0's slots with its tokens
    w.release(0)
    w._free_rows.reverse()  # B's tokens live in other host rows than A's
    w.admit(0, 2)  # request B in the same request slot: tokens 0, 1
    w.grow(0, grow_to)  # several C4 tokens in one step; the engine writes the newest
    ids = [0, 1, 2, 3] if grow_to <= 8 else [2, 4, 6, 7]
    out = w.hb.swap_in(0, torch.tensor([0]), torch.tensor([ids]))
    for i, t in enumerate(ids):
        got = w.dev_bytes(w.hb.dev.layers[0], int(out[0, i]))
        assert torch.equal(got, w.token_bytes(0, w.host_tok(0, t))), f"token {t}"


def _hb():
    w = World("reference")
    w.admit(0, 100)
    return w, w.hb


@pytest.mark.parametrize("bad, msg", [
    (lambda hb: hb.swap_in(5, torch.tensor([0]), torch.zeros(1, 16, dtype=torch.int64)), "layer 5"),
    (lambda hb: hb.swap_in(0, torch.tensor([1]), torch.zeros(1, 16, dtype=torch.int64)), "request slot 1"),
    (lambda hb: hb.swap_in(0, torch.tensor([0, 0]), torch.zeros(2, 16, dtype=torch.int64)), "twice"),
    (lambda hb: hb.swap_in(0, torch.tensor([-2]), torch.zeros(1, 16, dtype=torch.int64)), "request slot -2"),
    (lambda hb: hb.swap_in(0, torch.tensor([0]), torch.zeros(1, 8, dtype=torch.int64)), "topk must be"),
    (lambda hb: hb.swap_in(0, torch.tensor([0.0]), torch.zeros(1, 16, dtype=torch.int64)), "int64"),
    # a strided view: the kernel reads element b at data + b, not the view's element b
    (lambda hb: hb.swap_in(0, torch.tensor([0, 1, -1, 2])[::2],
                           torch.zeros(2, 16, dtype=torch.int64)), "contiguous"),
    (lambda hb: hb.swap_in(0, torch.zeros(5, dtype=torch.int64) - 1, torch.zeros(5, 16)), "batch of 5"),
    (lambda hb: hb.admit(0, 10, [1]), "already admitted"),
    (lambda hb: hb.admit(1, 100, [1]), "need 2 host pages"),
    (lambda hb: hb.admit(1, 10, [99]), "host page 99"),
    (lambda hb: hb.admit(1, 301, [1] * 5), "length 301"),
    (lambda hb: hb.admit(7, 10, [1]), "request slot 7"),
    (lambda hb: hb.extend(0, 50, [1, 2]), "lengths only grow"),
    (lambda hb: hb.extend(1, 50, [1]), "not admitted"),
    (lambda hb: hb.release(2), "not admitted"),
])
def test_bad_input_is_refused_and_changes_nothing(bad, msg):
    w, hb = _hb()
    snap = [t.clone() for t in (hb.slot_tok, hb.order, hb.lens, hb.host_pages, hb.stats)]
    with pytest.raises(HotBufferError, match=msg):
        bad(hb)
    after = (hb.slot_tok, hb.order, hb.lens, hb.host_pages, hb.stats)
    assert all(torch.equal(a, b) for a, b in zip(snap, after))


def test_construction_checks():
    from hicache.engine.hot_buffer import HotBuffer
    w = World("reference")
    with pytest.raises(HotBufferError, match="at least topk"):
        HotBuffer(w.hb.host, fmt=w.hb.fmt, topk=16, slots=8, max_requests=1, max_batch=1,
                  max_tokens=10)
    with pytest.raises(HotBufferError, match="impl"):
        HotBuffer(w.hb.host, fmt=w.hb.fmt, topk=16, max_requests=1, max_batch=1,
                  max_tokens=10, impl="magic")
