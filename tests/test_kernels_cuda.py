"""The copy paths on a GPU, byte for byte: every path and direction, every destination byte
(slots and everything around them) and the untouched source. Skips without CUDA."""
from __future__ import annotations

import os
import sys

import pytest
import torch

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels_ref import (FORMATS, assert_same, expected_rows, expected_tokens,  # noqa: E402
                              layers, pair_sets)

pytestmark = [pytest.mark.cuda,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

DIRS = {"d2h": ("cuda", "cpu"), "h2d": ("cpu", "cuda"), "d2d": ("cuda", "cuda")}


def _bufs(where: str, n_layers: int, rows: int, row_bytes: int, seed: int):
    if where == "cuda":
        return layers(n_layers, rows, row_bytes, seed, device="cuda")
    return layers(n_layers, rows, row_bytes, seed, pin=True)


@pytest.mark.parametrize("impl", ["zero_copy", "staged", "dma", "auto"])
@pytest.mark.parametrize("direction", sorted(DIRS))
@pytest.mark.parametrize("row_bytes", [37_440, 149_760, 65_536, 16_384, 6_144, 1_728, 584])
def test_rows(impl, direction, row_bytes):
    from hicache.kernels import copy_engine, dispatch

    if impl == "staged" and direction == "d2d":
        pytest.skip("staged is device<->host only")
    big = direction != "d2d" and row_bytes >= copy_engine.MIN_BYTES and copy_engine.enabled()
    if impl == "dma" and not big:
        src = _bufs(DIRS[direction][0], 2, 4, row_bytes, 1)
        dst = _bufs(DIRS[direction][1], 2, 4, row_bytes, 2)
        with pytest.raises(dispatch.TransferError, match="impl='dma' cannot run: "):
            dispatch.copy_rows(src, dst, torch.tensor([0]), torch.tensor([1]), impl="dma")
        return
    s_where, d_where = DIRS[direction]
    src, dst = _bufs(s_where, 3, 12, row_bytes, 1), _bufs(d_where, 3, 10, row_bytes, 2)
    src0 = [t.cpu().clone() for t in src]
    sets = pair_sets(12, 10, 1, 3)
    sets["runs"] = (torch.tensor([0, 1, 2, 7, 8, 11]), torch.tensor([4, 5, 6, 7, 0, 1]))
    for k, (si, di) in sets.items():
        before = [t.cpu().clone() for t in dst]
        # host-side indices stay on the CPU (staged plans its DMAs from them); device-side
        # indices go in as CUDA tensors on d2h, as CPU tensors elsewhere
        # (the copy engines take CPU indices only: dma gets them on the CPU)
        si_arg = si.cuda() if direction == "d2h" and impl != "dma" else si
        path = dispatch.copy_rows(src, dst, si_arg, di, ctas=2, impl=impl)
        torch.cuda.synchronize()
        want = {"staged": "rows_staged", "dma": "rows_dma"}.get(impl, "rows_zero_copy")
        if impl == "auto" and big and not si_arg.is_cuda and si.numel() >= copy_engine.MIN_ROWS:
            want = "rows_dma"
        assert path == want
        assert_same(dst, expected_rows(src0, before, si, di), f"{k} via {path}")
    assert_same(src, src0, "source changed")


@pytest.mark.parametrize("direction", sorted(DIRS))
@pytest.mark.parametrize("fmt_name", sorted(FORMATS))
def test_tokens(direction, fmt_name):
    from hicache.kernels import dispatch

    fmt = FORMATS[fmt_name]
    P = fmt.tokens_per_page
    s_where, d_where = DIRS[direction]
    src, dst = _bufs(s_where, 3, 5, fmt.page_bytes, 4), _bufs(d_where, 3, 4, fmt.page_bytes, 5)
    src0 = [t.cpu().clone() for t in src]
    for ctas in (1, 4):
        for k, (si, di) in pair_sets(5 * P, 4 * P, P, 6 + ctas).items():
            before = [t.cpu().clone() for t in dst]
            path = dispatch.copy_tokens(src, dst, si.cuda(), di.cuda(), fmt, ctas=ctas,
                                        impl="zero_copy")
            torch.cuda.synchronize()
            assert path == "tokens_zero_copy"
            assert_same(dst, expected_tokens(src0, before, si, di, fmt), f"{k} ctas={ctas}")
    assert_same(src, src0, "source changed")


def test_whole_pages_use_the_row_path_on_gpu():
    from hicache.kernels import dispatch

    fmt = FORMATS["indexer_fp8_64"]  # no padding: whole pages are whole rows
    src, dst = _bufs("cuda", 2, 4, fmt.page_bytes, 1), _bufs("cpu", 2, 4, fmt.page_bytes, 2)
    before = [t.clone() for t in dst]
    si = torch.cat([torch.arange(128, 192), torch.arange(0, 64)])
    di = torch.cat([torch.arange(0, 64), torch.arange(192, 256)])
    path = dispatch.copy_tokens(src, dst, si, di, fmt)
    torch.cuda.synchronize()
    assert path.startswith("rows_")
    assert_same(dst, expected_rows(src, before, torch.tensor([2, 0]), torch.tensor([0, 3])))
    # a padded format (MLA pages): the same request moves tokens only, the padding stays
    fmt = FORMATS["c4_mla_64"]
    src, dst = _bufs("cuda", 2, 4, fmt.page_bytes, 3), _bufs("cpu", 2, 4, fmt.page_bytes, 4)
    before = [t.clone() for t in dst]
    path = dispatch.copy_tokens(src, dst, si, di, fmt)
    torch.cuda.synchronize()
    assert path.startswith("tokens_")
    assert_same(dst, expected_tokens(src, before, si, di, fmt))


def test_auto_stages_long_host_runs_host_to_device_only():
    """``auto`` with host rows in long runs (2 MiB and more on average): staged host to device,
    the zero-copy kernel device to host (its writes into pinned memory measured faster)."""
    from hicache.kernels import dispatch

    n, rb = 128, 28_672  # 3.7 MB of consecutive host rows; below the copy engines' row size
    from hicache.kernels import copy_engine
    assert rb < copy_engine.MIN_BYTES
    for direction in ("h2d", "d2h"):
        s_where, d_where = DIRS[direction]
        src, dst = _bufs(s_where, 2, n + 8, rb, 1), _bufs(d_where, 2, n + 8, rb, 2)
        src0, before = [t.cpu().clone() for t in src], [t.cpu().clone() for t in dst]
        host = torch.arange(4, 4 + n)
        dev = torch.randperm(n + 8)[:n]
        si, di = (host, dev) if direction == "h2d" else (dev, host)
        path = dispatch.copy_rows(src, dst, si, di, ctas=2)
        torch.cuda.synchronize()
        assert path == ("rows_staged" if direction == "h2d" else "rows_zero_copy"), direction
        assert_same(dst, expected_rows(src0, before, si, di), f"{direction} via {path}")


def test_staged_chunks_and_runs_across_chunk_boundaries():
    """Tiny staging chunks: many chunks on both side streams, runs split by chunk edges."""
    from hicache.kernels import staged
    from hicache.kernels.tables import LayerTable

    rb = 6_144
    for direction in ("d2h", "h2d"):
        dev = LayerTable(_bufs("cuda", 5, 40, rb, 7))
        host = LayerTable(_bufs("cpu", 5, 40, rb, 8))
        src, dst = (dev, host) if direction == "d2h" else (host, dev)
        src0 = [t.cpu().clone() for t in src.layers]
        before = [t.cpu().clone() for t in dst.layers]
        g = torch.Generator().manual_seed(9)
        dev_idx = torch.randperm(40, generator=g)[:23]
        host_idx = torch.cat([torch.arange(3, 10), torch.tensor([20]), torch.arange(25, 40)])
        runs = staged.plan_runs(host_idx)
        assert runs.tolist() == [0, 7, 8]
        cfg = staged.StagedConfig(chunk_bytes=5 * rb)  # 5 rows per chunk, one layer each
        s_idx, d_idx = (dev_idx, host_idx) if direction == "d2h" else (host_idx, dev_idx)
        staged.copy_rows_staged(src, dst, s_idx.cuda() if direction == "d2h" else s_idx,
                                d_idx.cuda() if direction == "h2d" else d_idx,
                                host_idx, runs, ctas=1, cfg=cfg)
        torch.cuda.synchronize()
        assert_same(dst.layers, expected_rows(src0, before, s_idx, d_idx), direction)
        assert_same(src.layers, src0, "source changed")


def test_caller_stream_is_used():
    from hicache.kernels import dispatch
    from hicache.kernels.tables import LayerTable, upload_tables

    src, dst = _bufs("cuda", 2, 64, 37_440, 1), _bufs("cpu", 2, 64, 37_440, 2)
    before = [t.clone() for t in dst]
    si, di = torch.randperm(64)[:40].cuda(), torch.arange(10, 50)
    s = torch.cuda.Stream()
    for impl in ("zero_copy", "staged"):  # compile and allocate staging first
        dispatch.copy_rows(src, [t.clone().pin_memory() for t in dst], si, di, ctas=4,
                           impl=impl, stream=s)
    # everything but the copies' own issue happens before the sleep: a device or pinned
    # allocation, or a pointer table's upload, after it could wait for the device (a freed
    # block, a full cache) and so let the sleep end before the check below
    src_t, dst_t = LayerTable(src, "src"), LayerTable(dst, "dst")
    upload_tables([src_t, dst_t], si.device)
    s.synchronize()
    gate = torch.cuda.Event()
    with torch.cuda.stream(s):
        torch.cuda._sleep(1_000_000_000)  # keep the caller's stream busy (~0.5 s)
        gate.record(s)
    for impl in ("zero_copy", "staged"):
        dispatch.copy_rows(src_t, dst_t, si, di, ctas=4, impl=impl, stream=s)
    # nothing ran ahead of the sleeping stream; afterwards every byte is in place
    assert not gate.query()
    assert_same(dst, before, "copied before the caller's stream got there")
    s.synchronize()
    assert gate.query()
    assert_same(dst, expected_rows(src, before, si.cpu(), di))


def test_dsv4_sized_rows_and_tokens_against_reference():
    """61 layers of C4 page rows and tokens, zero-copy and staged, vs the torch reference."""
    from hicache.kernels import dispatch
    from hicache.kernels.reference import copy_rows_ref, copy_tokens_ref

    fmt = FORMATS["c4_mla_64"]
    dev = _bufs("cuda", 61, 192, fmt.page_bytes, 1)
    host = [torch.zeros(192, fmt.page_bytes, dtype=torch.uint8).pin_memory() for _ in range(61)]
    ref = [torch.zeros(192, fmt.page_bytes, dtype=torch.uint8) for _ in range(61)]
    g = torch.Generator().manual_seed(0)
    si, di = torch.randperm(192, generator=g)[:150], torch.randperm(192, generator=g)[:150]
    dispatch.copy_rows(dev, host, si.cuda(), di.cuda(), impl="zero_copy")
    copy_rows_ref(dev, ref, si, di)
    torch.cuda.synchronize()
    assert_same(host, ref, "rows zero-copy d2h")
    back = [torch.zeros_like(t) for t in dev]
    dispatch.copy_rows(host, back, torch.arange(30, 180), si, impl="staged")
    ref_back = [torch.zeros_like(t) for t in dev]
    copy_rows_ref(host, ref_back, torch.arange(30, 180), si)
    torch.cuda.synchronize()
    assert_same(back, [t.cpu() for t in ref_back], "rows staged h2d")
    ts, td = torch.randperm(192 * 64, generator=g)[:5000], torch.randperm(192 * 64, generator=g)[:5000]
    dispatch.copy_tokens(dev, host, ts.cuda(), td.cuda(), fmt, impl="zero_copy")
    copy_tokens_ref(dev, ref, ts, td, fmt)
    torch.cuda.synchronize()
    assert_same(host, ref, "tokens d2h")
    dispatch.copy_tokens(host, back, td.cuda(), ts.cuda(), fmt, impl="zero_copy")
    copy_tokens_ref(host, ref_back, td, ts, fmt)
    torch.cuda.synchronize()
    assert_same(back, [t.cpu() for t in ref_back], "tokens h2d")


def test_unpinned_host_memory_is_refused():
    from hicache.kernels import dispatch
    from hicache.kernels.tables import TransferError

    src = _bufs("cuda", 2, 4, 64, 1)
    dst = layers(2, 4, 64, 2)  # plain pageable memory
    with pytest.raises(TransferError, match="not pinned"):
        dispatch.copy_rows(src, dst, torch.tensor([0]), torch.tensor([0]))


def test_cuda_index_on_wrong_device_or_bounds():
    from hicache.kernels import dispatch
    from hicache.kernels.tables import TransferError

    src, dst = _bufs("cuda", 2, 4, 64, 1), _bufs("cpu", 2, 4, 64, 2)
    before = [t.clone() for t in dst]
    with pytest.raises(TransferError, match=r"index 4 out of range"):
        dispatch.copy_rows(src, dst, torch.tensor([4]).cuda(), torch.tensor([0]).cuda())
    assert_same(dst, before)


def test_a_fresh_thread_issues_copy_engine_batches():
    """A thread that made no CUDA runtime call has no current context; its batch failed with
    CUresult 1 (``bench transfer``'s backup + swap-in rows on the copy engines did). Now the
    stream's context is made current first, and both directions at once from two threads
    move every byte."""
    import threading

    from hicache.kernels import copy_engine, dispatch

    if not copy_engine.enabled():
        pytest.skip(f"copy engines unavailable: {copy_engine.status()}")
    rb, n = 37_440, 48
    dev, host = _bufs("cuda", 2, 64, rb, 21), _bufs("cpu", 2, 64, rb, 22)
    dev0, host0 = [t.cpu().clone() for t in dev], [t.cpu().clone() for t in host]
    g = torch.Generator().manual_seed(9)
    rows = torch.randperm(64, generator=g)
    out_d, out_h = rows[:n // 2], rows[n // 2:n]  # disjoint: backup reads, swap-in writes
    got: dict = {}

    def run(name, src, dst, si, di):
        try:
            s = torch.cuda.Stream(torch.device("cuda", 0))
            got[name] = dispatch.copy_rows(src, dst, si, di, impl="dma", stream=s)
            s.synchronize()
        except Exception as e:  # surfaced by the assert below
            got[name] = e

    ts = [threading.Thread(target=run, args=("backup", dev, host, out_d, out_d)),
          threading.Thread(target=run, args=("swap_in", host, dev, out_h, out_h))]
    for t in ts:
        t.start()
    for t in ts:
        t.join()
    assert got == {"backup": "rows_dma", "swap_in": "rows_dma"}, got
    assert_same(host, expected_rows(dev0, host0, out_d, out_d), "backup")
    assert_same(dev, expected_rows(host0, dev0, out_h, out_h), "swap-in")


@pytest.mark.parametrize("direction", ["h2d", "d2h"])
def test_auto_takes_the_copy_engines_for_many_big_rows(direction):
    """``auto`` sends whole rows of ``MIN_BYTES`` or more to the copy engines once a call has
    ``MIN_ROWS`` of them (CPU indices), and keeps fewer on the kernel; bytes exact either way."""
    from hicache.kernels import copy_engine, dispatch

    if not copy_engine.enabled():
        pytest.skip(f"copy engines unavailable: {copy_engine.status()}")
    s_where, d_where = DIRS[direction]
    rb = 149_760
    src, dst = _bufs(s_where, 3, 40, rb, 11), _bufs(d_where, 3, 40, rb, 12)
    src0 = [t.cpu().clone() for t in src]
    g = torch.Generator().manual_seed(5)
    for n, want in ((copy_engine.MIN_ROWS, "rows_dma"), (copy_engine.MIN_ROWS - 1, "rows_zero_copy")):
        si, di = torch.randperm(40, generator=g)[:n], torch.randperm(40, generator=g)[:n]
        before = [t.cpu().clone() for t in dst]
        assert dispatch.copy_rows(src, dst, si, di, ctas=2) == want
        torch.cuda.synchronize()
        assert_same(dst, expected_rows(src0, before, si, di), f"{n} rows via {want}")
    assert_same(src, src0, "source changed")


def test_stream_helpers_switch_only_when_needed():
    """``streams.on_stream`` makes a stream current and gives the previous one back, does
    nothing when it is current already; ``current_stream`` names torch's current stream."""
    from hicache.kernels.streams import current_stream, on_stream

    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream(dev)
    before = torch.cuda.current_stream(dev)
    assert current_stream(dev).cuda_stream == before.cuda_stream
    with on_stream(s, dev):
        assert torch.cuda.current_stream(dev).cuda_stream == s.cuda_stream
        assert current_stream(dev).cuda_stream == s.cuda_stream
        assert current_stream(dev) is current_stream(dev)  # one object per raw stream
        with on_stream(s, dev):  # current already: nothing to switch or to give back
            assert torch.cuda.current_stream(dev).cuda_stream == s.cuda_stream
        assert torch.cuda.current_stream(dev).cuda_stream == s.cuda_stream
    assert torch.cuda.current_stream(dev).cuda_stream == before.cuda_stream
    with on_stream(s, None):  # "not on a GPU": nothing happens
        assert torch.cuda.current_stream(dev).cuda_stream == before.cuda_stream


def test_a_failed_issue_on_the_default_stream_still_fences_the_side_stream(monkeypatch):
    """On the legacy default stream the batches run on a side stream. When an issue fails
    partway, what it queued before the error still comes before later work on the default
    stream (an event recorded after the failure waits for the side stream's work)."""
    from hicache.kernels import copy_engine
    from hicache.kernels.tables import TransferError
    dev = torch.device("cuda", torch.cuda.current_device())

    def fails_after_queueing(plan, lo, hi, stream, ramp=False):
        with torch.cuda.stream(torch.cuda.ExternalStream(stream, device=dev)):
            torch.cuda._sleep(int(2e8))  # GPU work the failed issue left queued (~0.1 s)
        raise TransferError("injected: the driver refused the second batch")

    monkeypatch.setattr(copy_engine, "issue", fails_after_queueing)
    torch.cuda.synchronize(dev)
    default = torch.cuda.default_stream(dev)
    assert default.cuda_stream == 0
    with torch.cuda.stream(default):
        with pytest.raises(TransferError, match="injected"):
            copy_engine.issue_current(object(), 0, 1, dev)
        after = torch.cuda.Event()
        after.record()
    assert not after.query(), "the default stream did not wait for the side stream"
    after.synchronize()


def test_both_index_lists_go_up_together_each_16_byte_aligned():
    """``_to_both``: one pinned block and one copy for a copy's two CPU index lists; the second
    starts 16 bytes aligned whatever the length (an odd length would otherwise give the
    kernels' launches an alignment they were not compiled for: a compile on the loop)."""
    from hicache.kernels import dispatch
    from hicache.kernels.rows import ROWS_KERNEL
    from hicache.kernels.tokens import TOKENS_KERNEL

    dev = torch.device("cuda")
    for n in (1, 2, 3, 1000, 1001):
        a = torch.arange(n, dtype=torch.int64)
        b = torch.arange(n, dtype=torch.int64) * 7 + 3
        s, d = dispatch._to_both(a, b, dev)
        torch.cuda.synchronize()
        assert s.is_cuda and d.is_cuda and s.is_contiguous() and d.is_contiguous()
        assert s.data_ptr() % 16 == 0 and d.data_ptr() % 16 == 0, n
        assert torch.equal(s.cpu(), a) and torch.equal(d.cpu(), b)
    src, dst = _bufs("cpu", 2, 8, 1_728, 1), _bufs("cuda", 2, 8, 1_728, 2)
    src0 = [t.clone() for t in src]
    before = [t.cpu().clone() for t in dst]
    dispatch.copy_rows(src, dst, torch.tensor([0, 1]), torch.tensor([2, 3]))
    jit = ROWS_KERNEL.jit_launches + TOKENS_KERNEL.jit_launches
    si, di = torch.tensor([5, 6, 7]), torch.tensor([0, 4, 7])
    before = expected_rows(src0, before, torch.tensor([0, 1]), torch.tensor([2, 3]))
    assert dispatch.copy_rows(src, dst, si, di) == "rows_zero_copy"
    torch.cuda.synchronize()
    assert ROWS_KERNEL.jit_launches + TOKENS_KERNEL.jit_launches == jit
    assert_same(dst, expected_rows(src0, before, si, di))


def test_a_kernel_batch_uploads_once_and_copies_every_byte(monkeypatch):
    """``KernelBatch``: the kernel copies of a batch (rows of several sizes, tokens short and
    long enough to be sorted into host order, both directions) launch only at ``flush``, after
    one upload of all their ids; a copy-engine copy given the batch runs at once; every byte is
    the oracle's. A second flush and a copy for another stream are refused, the batch's queue
    unchanged."""
    from hicache.kernels import copy_engine, dispatch
    from hicache.kernels.tables import TransferError

    uploads: list[int] = []
    real = dispatch._to_all

    def counted(lists, device):
        uploads.append(len(lists))
        return real(lists, device)

    monkeypatch.setattr(dispatch, "_to_all", counted)
    side = torch.cuda.Stream()
    g = torch.Generator().manual_seed(7)
    jobs = []  # (src, dst, src ids, dst ids, fmt or None, expected, what)
    for k, (where, rb, n) in enumerate((("d2h", 1_728, 1), ("h2d", 584, 3), ("d2h", 6_144, 5),
                                        ("h2d", 16_384, 2))):
        src = _bufs(DIRS[where][0], 2, 12, rb, 10 + k)
        dst = _bufs(DIRS[where][1], 2, 12, rb, 20 + k)
        perm = torch.randperm(12, generator=g)
        si, di = perm[:n].clone(), perm[n:2 * n].clone()
        jobs.append((src, dst, si, di, None, expected_rows(src, dst, si, di), f"rows {rb} {where}"))
    for k, (name, where, n) in enumerate((("c4_mla_64", "d2h", 7),
                                          ("indexer_fp8_64", "h2d", 1_100))):
        fmt = FORMATS[name]
        units = 40 * fmt.tokens_per_page
        src = _bufs(DIRS[where][0], 2, 40, fmt.page_bytes, 30 + k)
        dst = _bufs(DIRS[where][1], 2, 40, fmt.page_bytes, 40 + k)
        perm = torch.randperm(units, generator=g)
        si, di = perm[:n].clone(), perm[n:2 * n].clone()
        jobs.append((src, dst, si, di, fmt, expected_tokens(src, dst, si, di, fmt),
                     f"tokens {name} {where}"))
    torch.cuda.synchronize()
    batch = dispatch.KernelBatch()
    for src, dst, si, di, fmt, _, _ in jobs:
        if fmt is None:
            assert dispatch.copy_rows(src, dst, si, di, stream=side, batch=batch) == \
                "rows_zero_copy"
        else:
            assert dispatch.copy_tokens(src, dst, si, di, fmt, stream=side, batch=batch) == \
                "tokens_zero_copy"
    big = copy_engine.enabled()
    if big:  # the copy engines take their rows at once, batch or not
        src = _bufs("cuda", 2, 40, 37_440, 50)
        dst = _bufs("cpu", 2, 40, 37_440, 51)
        si, di = torch.arange(copy_engine.MIN_ROWS), torch.arange(copy_engine.MIN_ROWS) + 20
        want_dma = expected_rows(src, dst, si, di)
        assert dispatch.copy_rows(src, dst, si, di, stream=side, batch=batch) == "rows_dma"
        side.synchronize()
        assert_same(dst, want_dma, "dma in a batch")
    torch.cuda.synchronize()
    assert uploads == [], "a batched copy uploaded its ids before the flush"
    src, dst, si, di, fmt, _, what = jobs[0]
    assert_same(dst, [t.cpu() for t in _bufs(DIRS["d2h"][1], 2, 12, 1_728, 20)],
                f"{what} before the flush")
    with pytest.raises(TransferError, match="one stream of one device"):
        dispatch.copy_rows(src, dst, si, di, stream=torch.cuda.Stream(), batch=batch)
    assert batch.flush() == len(jobs)
    side.synchronize()
    assert uploads == [2 * len(jobs)], uploads
    for src, dst, si, di, fmt, want, what in jobs:
        assert_same(dst, want, what)
    with pytest.raises(TransferError, match="flushed already"):
        batch.flush()
    with pytest.raises(TransferError, match="flushed already"):
        dispatch.copy_rows(*jobs[0][:4], stream=side, batch=batch)
    assert dispatch.KernelBatch().flush() == 0
