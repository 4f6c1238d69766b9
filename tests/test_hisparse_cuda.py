"""The HiSparse swap-in kernel on a GPU: every scenario of ``hisparse_cases`` with all its byte
checks (pinned host region, device hot buffers), random runs in lockstep with the torch
reference, and one decode step captured in a CUDA graph and replayed on new top-k ids. Skips
without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from hisparse_cases import CASES, World, lockstep_case, run_case  # noqa: E402

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]


@pytest.mark.parametrize("case", CASES)
def test_scenario(case):
    run_case(case, "triton", "cuda")


@pytest.mark.parametrize("seed", range(3))
def test_lockstep_with_reference(seed):
    lockstep_case(seed, "triton", "cuda", steps=8)


def test_flash_shapes_one_step():
    """Top-k 512, 1024 + 1 slots, 4 requests (one short): the real launch shape."""
    w = World("triton", "cuda", L=2, R=4, B=4, K=512, S=1024, max_tokens=8192, host_rows=600)
    for r, n in ((0, 8000), (1, 3000), (2, 700), (3, 5000)):
        w.admit(r, n)
    for step in range(3):
        rows = [0, 1, 2, 3] if step != 1 else [3, -1, 0, 1]
        topk = torch.stack([w.topk(r, recent=64) if r >= 0 else torch.full((512,), -1)
                            for r in rows])
        for layer in range(2):
            w.step(layer, rows, topk)


def test_cuda_graph_replay():
    """Capture one step (every layer) and replay it on new ids written into the captured input:
    the replays must equal an eager reference run step for step."""
    a, b = World("triton", "cuda", seed=7), World("reference", "cpu", seed=7)
    for w in (a, b):
        for r, n in ((0, 200), (1, 20), (2, 90)):
            w.admit(r, n)
    rows = [2, 0, -1, 1]
    req = torch.tensor(rows, device="cuda")
    static = torch.full((a.L, 4, a.K), -1, dtype=torch.int64, device="cuda")
    steps = [torch.stack([torch.stack([a.topk(r, recent=4) if r >= 0 else
                                       torch.full((a.K,), -1) for r in rows])
                          for _ in range(a.L)]) for _ in range(5)]
    static.copy_(steps[0])
    for l in range(a.L):  # warm-up (compiles) outside the capture, checked
        a.step(l, rows, steps[0][l])
        b.step(l, rows, steps[0][l])
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g, stream=side):
        outs = [a.hb.swap_in(l, req, static[l], check=False) for l in range(a.L)]
    torch.cuda.synchronize()
    for ids in steps[1:]:
        static.copy_(ids)
        g.replay()
        torch.cuda.synchronize()
        for l in range(a.L):
            before = (a.hb.slot_tok[l].cpu(), a.hb.order[l].cpu())
            a.verify(l, rows, ids[l], outs[l].cpu(), before)
            ob = b.step(l, rows, ids[l])
            assert torch.equal(outs[l].cpu(), ob)
        assert torch.equal(a.hb.slot_tok.cpu(), b.hb.slot_tok)
        assert torch.equal(a.hb.order.cpu(), b.hb.order)
        assert torch.equal(a.hb.stats.cpu(), b.hb.stats)


def test_daemon_region_pinned_and_swapped_in_from_the_engines_mapping():
    """A client's sparse region (``controllers.sparse_regions.SparseRegions.bind``, page-locked
    with the daemon's registrar) mapped a second time the way the engine does (``SparseShm.open`` +
    ``cudaHostRegister``); the kernel reads the engine's mapping: bytes written through the
    daemon's mapping arrive at every top-k location."""
    from hicache.controllers.sparse_regions import SparseRegions
    from hicache.core.fd_handout import FdHandout
    from hicache.core.layout import build_layout, preset
    from hicache.core.sparse_shm import SparseShm
    from hicache.engine.hot_buffer import HotBuffer
    from hicache.host_pools.cuda_host import CudaHostRegistrar

    lay = build_layout(preset("dsv4-flash"))
    dev = torch.cuda.current_device()
    regions = SparseRegions(lay, 8, "/dev/shm", CudaHostRegistrar(dev), 1)
    handout = FdHandout.create()
    try:
        region = regions.bind("engine")
        g = torch.Generator().manual_seed(5)
        for t in region.shm.layers:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        eng = SparseShm.open(regions.hand_out("engine", handout))
        rc = torch.cuda.cudart().cudaHostRegister(eng.base_ptr, eng.nbytes, 0)
        assert int(rc) == 0
        try:
            spec = lay.pool("c4_kv")
            hb = HotBuffer(eng.layers[:2], fmt=spec, topk=64, slots=128, max_requests=1,
                           max_batch=1, max_tokens=8 * 64, device="cuda", impl="triton")
            pages = [7, 2, 5, 0, 1, 3, 4, 6]
            hb.admit(0, 8 * 64, pages)
            ids = torch.randperm(8 * 64 - 1, generator=g)[:64]
            for layer in range(2):
                out = hb.swap_in(layer, torch.tensor([0], device="cuda"),
                                 ids[None].cuda()).cpu()
                d, h = hb.dev.layers[layer].cpu(), region.shm.layers[layer]
                for t, loc in zip(ids.tolist(), out[0].tolist()):
                    hr, hs, dr, ds = pages[t // 64], t % 64, loc // 64, loc % 64
                    assert torch.equal(d[dr, ds * 576:(ds + 1) * 576], h[hr, hs * 576:(hs + 1) * 576])
                    assert torch.equal(d[dr, 36864 + ds * 8: 36872 + ds * 8],
                                       h[hr, 36864 + hs * 8: 36872 + hs * 8])
        finally:
            torch.cuda.synchronize()
            torch.cuda.cudart().cudaHostUnregister(eng.base_ptr)
    finally:
        regions.close()
        handout.close()


def test_cached_launches_match_the_reference_across_specializations():
    """The launch path that skips Triton's binder after the first call of a specialization
    (``kernels.hisparse.SwapInLaunch``): int64 and int32 top-k, a row-strided and 16-B
    misaligned top-k view, and changing batch sizes, each step in lockstep with the torch
    reference and checked byte for byte."""
    a, b = World("triton", "cuda", seed=11), World("reference", "cpu", seed=11)
    for w in (a, b):
        for r, n in ((0, 40), (1, 31), (2, 200), (4, 33)):
            w.admit(r, n)
    forms = ["int64", "int32", "strided", "int64", "int32", "strided", "int64"]
    for step, form in enumerate(forms):
        rows = [[2, 0, 4, 1], [1, -1, 2], [4, 2]][step % 3]
        ids = torch.stack([a.topk(r, recent=5) if r >= 0 else torch.full((a.K,), -1)
                           for r in rows])
        b.g.set_state(a.g.get_state())
        if form == "int32":
            dev_ids = ids.to(torch.int32).cuda()
        elif form == "strided":  # rows K + 3 apart, starting one element in: misaligned
            wide = torch.full((len(rows), a.K + 3), -7, dtype=torch.int64, device="cuda")
            wide[:, 1:1 + a.K] = ids.cuda()
            dev_ids = wide[:, 1:1 + a.K]
            assert dev_ids.data_ptr() % 16 != 0 and dev_ids.stride(0) == a.K + 3
        else:
            dev_ids = ids.cuda()
        req = torch.tensor(rows, device="cuda")
        for layer in range(a.L):
            before = (a.hb.slot_tok[layer].cpu().clone(), a.hb.order[layer].cpu().clone())
            oa = a.hb.swap_in(layer, req, dev_ids).cpu().clone()
            a.verify(layer, rows, ids, oa, before)
            ob = b.step(layer, rows, ids)
            assert torch.equal(oa, ob), f"step {step} ({form}) layer {layer}: locations differ"
        assert torch.equal(a.hb.slot_tok.cpu(), b.hb.slot_tok)
        assert torch.equal(a.hb.order.cpu(), b.hb.order)
        assert torch.equal(a.hb.stats.cpu(), b.hb.stats)
        for x, y in zip(a.hb.dev.layers, b.hb.dev.layers):
            assert torch.equal(x.cpu(), y), f"step {step}: device bytes differ"
    for ln in a.hb.launches:  # one JIT launch per specialization, the rest went direct
        assert ln.specializations == 3, ln.specializations
        assert len(ln._runners) >= 3
