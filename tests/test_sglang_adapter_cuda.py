"""The SGLang adapter's GPU path, on a GPU, against a ``hicache serve --device cuda:0``.

SGLang's CUDA build is not on the lent GPU machine (``scripts/gpu_sglang.sh`` says what it
needs), so SGLang's classes do not run here; ``tests/sglang/check_dsv4_l2.py`` runs them on CPU.
What runs here is every line of the adapter that only a GPU reaches, called as SGLang 0.5.23's
HiCache controller calls it:

* ``DaemonLink.share``: SGLang-shaped device tensors (one allocation per pool and layer, fp8
  KV and fp32 compress states viewed as byte rows, a space whose pools differ in row count so
  only the common prefix is shared) exported to the daemon as CUDA IPC handles, two
  interprocess events registered;
* ``backup_from_device_all_layer`` from SGLang's write stream, which waits for the forward that
  wrote the KV (here behind a long GPU sleep): the adapter records its backup event on that
  stream, so the daemon copies the new bytes, not the ones the rows held before;
* ``load_to_device_per_layer`` from SGLang's load stream, layer by layer in the stage's order,
  the stream waiting (SGLang's load fence) for a forward still writing the destination rows:
  the copy waits for the fence; each call returns only once its layer is copied (read at once
  from another stream), and the last layer's ack is checked;
* one daemon ``backup`` / ``load`` of every pool per SGLang submission (the adapter's
  ``submission``, as the assembler patch installs it), one per pool outside a submission;
* every loaded byte equals what was backed up, and no device row outside the load's
  destination changed; ``close`` unregisters the worker;
* a load as ``start_loading`` submits it (``defer``), behind a load fence once the daemon's
  load kernels are warm: the submission returns while the fence still holds; the forward's
  ``wait_until(t)`` returns only once stage layer ``t`` is copied in every pool (read at once
  from another stream), the ack checked at the last; SGLang's completion event, recorded
  after the submission behind the adapter's wait for the last layer, completes, and once it
  has (before any forward wait, in one round) every layer is in.

Skipped without CUDA.
"""
from __future__ import annotations

import time
from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from conftest import load_fill_kernel, start_daemon  # noqa: E402
from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.client import Client  # noqa: E402
from hicache.engine.sglang.link import DaemonLink  # noqa: E402
from hicache.engine.sglang.stage_map import SGLANG_POOLS, StageBuffers  # noqa: E402
from sglang_gpu_shapes import (LayerCounter, Pool, backup_all, commands_sent,  # noqa: E402
                               load_layer_by_layer, sglang_stage, tokens)

DEV = torch.device("cuda:0")
LAYOUT = build_layout(preset("dsv4-tiny"), swa_mode="paged", c128_state="offline", mtp=False)
ROWS = {"page": 12, "swa_page": 9, "req_slot": 7}
EXTRA_ROWS = {"c128_kv": 5}  # SGLang sizes each buffer of a space apart: only 12 are shared
PAGE = LAYOUT.model.page_size
SLEEP = 1_000_000_000  # GPU cycles the forward sleeps before it writes (~0.5 s on an H100)


def _tok(rows: list[int], device: Any = "cpu") -> torch.Tensor:
    return tokens(rows, PAGE, device)


@pytest.fixture
def adapter(tmp_path: Any):
    d = start_daemon(tmp_path, device="cuda:0", preset="dsv4-tiny", metrics=False,
                     device_rows=",".join(f"{k}={v}" for k, v in ROWS.items()),
                     extra=("--no-mtp", "--c128-state", "offline"), ready_timeout=120)
    torch.cuda.set_device(DEV)
    stage = sglang_stage(LAYOUT, ROWS, EXTRA_ROWS, DEV)
    client = Client(d.address, timeout=5.0, name="sglang-gpu")  # the adapter's
    try:
        link = DaemonLink.share(stage, client, None)
    except BaseException:
        client.close()
        d.stop()
        raise
    yield d, link, stage
    link.close()
    d.stop()


def _rows_of(stage: StageBuffers, name: str, idx: list[int]) -> list[torch.Tensor]:
    i = torch.tensor(idx, device=DEV)
    return [t.index_select(0, i).clone() for t in stage.layers[name]]


def _load_and_check(pools: dict[str, Pool], stage: StageBuffers, ids: dict, dst: dict,
                    want: dict, stream: Any, grouped: bool = True) -> None:
    """SGLang's loop (``load_layer_by_layer``); each call has returned only once its layer is
    copied, so a read from another stream right after it must see the backed-up bytes.
    ``grouped``: one daemon load for the submission (as installed), else one per pool."""
    reader = torch.cuda.Stream(DEV)
    dst_dev = {s: torch.tensor(r, device=DEV) for s, r in dst.items()}

    def check(name: str, li: int) -> None:
        with torch.cuda.stream(reader):
            got = stage.layers[name][li].index_select(0, dst_dev[pools[name].space])
        reader.synchronize()
        assert torch.equal(got, want[name][li]), (name, li)

    layers = sorted({g for p in pools.values() for g in LAYOUT.pools[p.ours].layers})
    assert layers == sorted(next(iter(pools.values())).link.client.stage_layers)
    link = next(iter(pools.values())).link
    with commands_sent(link, "load") as loads:
        calls = load_layer_by_layer(pools, ids, stream, check, grouped)
    assert calls == sum(LAYOUT.pools[n].num_layers for n in pools)
    assert loads == ([sorted(pools)] if grouped else [[n] for n in _by_first_layer(pools)])
    assert all(not p._loads for p in pools.values())  # every load's ack taken at its last layer


def _by_first_layer(pools: dict[str, Pool]) -> list[str]:
    """The pools in the order SGLang's loop first calls them (one load each, ungrouped)."""
    return sorted(pools, key=lambda n: (LAYOUT.pools[n].layers[0], list(pools).index(n)))


def test_sglangs_streams_backup_and_load_layer_by_layer_through_the_adapter(adapter) -> None:
    """Device ids are on the host in steps 1 and 2, as SGLang's ``direct`` io backend hands
    them over even for CUDA pools. Step 3 gives CUDA ids (its ``kernel`` backend's): the
    adapter turns them into page rows with a copy that syncs the calling stream, so with them
    the forward would be over before the adapter recorded its event, and steps 1 and 2 would
    not show that the event's wait holds."""
    d, link, stage = adapter
    c = link.client
    assert len(c.backup_events) == 2 and c._device == DEV
    pools = {ours: Pool(link, sgl) for sgl, ours in SGLANG_POOLS.items()}
    assert set(pools) == set(LAYOUT.pools) - {"c128_state"}  # SGLang never offloads it
    src = {"page": [1, 3, 5, 11], "swa_page": [0, 2, 4, 8]}
    dst = {"page": [0, 2, 9, 10], "swa_page": [1, 3, 6, 7]}
    dst2 = {"page": [4, 6, 7, 8], "swa_page": [5]}
    host = {s: link.alloc(s, 4) for s in src}
    assert all(h is not None and len(h) == 4 for h in host.values())
    fwd, write, load = (torch.cuda.Stream(DEV) for _ in range(3))
    # ids made here, before the sleeps: a pageable copy to the device syncs its stream first,
    # which would end a sleep before the adapter records its event (the wait left unproven)
    src_dev, dst_dev = ({s: torch.tensor(r, device=DEV) for s, r in ids.items()}
                        for ids in (src, dst))
    torch.cuda.synchronize()
    # 0) warm-up: the daemon's first GPU copies take up to a second (measured on an H100), and
    #    a kernel's first launch waits for the GPU to go idle (``load_fill_kernel``): either
    #    would end a sleep below before its wait is put to the test. So one page each way
    #    first, and the forward's fill kernel once
    load_fill_kernel(DEV)
    warm = {s: link.alloc(s, 1) for s in src}
    first = {s: r[:1] for s, r in src.items()}
    was = {name: _rows_of(stage, name, first[p.space]) for name, p in pools.items()}
    # (each pool on its own here: the path of transfers that cannot go as one command)
    with commands_sent(link, "backup") as backups:
        backup_all(pools, {s: (_tok(warm[s]), _tok(first[s])) for s in src}, grouped=False)
    assert backups == [[n] for n in pools]
    _load_and_check(pools, stage, {s: (_tok(warm[s]), _tok(dst[s][:1])) for s in dst},
                    {s: r[:1] for s, r in dst.items()}, was, load, grouped=False)
    for s, rows in warm.items():
        link.free(s, rows)
    torch.cuda.synchronize()

    # 1) the forward writes new KV into the source rows behind a long GPU sleep; SGLang's write
    #    stream waits for it, and the adapter's backups go from that stream
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(SLEEP)
        for name, p in pools.items():
            i = src_dev[p.space]
            for li, t in enumerate(stage.layers[name]):
                t.index_fill_(0, i, (li * 13 + len(name)) % 251 + 1)
    write.wait_stream(fwd)
    assert not fwd.query(), "the forward ended before the backups were sent: no wait tested"
    with torch.cuda.stream(write), commands_sent(link, "backup") as backups:
        backup_all(pools, {s: (_tok(host[s]), _tok(src[s])) for s in src})
    assert backups == [sorted(pools)]  # SGLang's one submission: one backup of every pool
    torch.cuda.synchronize()
    want = {name: _rows_of(stage, name, src[p.space]) for name, p in pools.items()}
    for name in pools:  # the fill reached the rows, so the loads below can tell them apart
        assert all(bool((w == (li * 13 + len(name)) % 251 + 1).all())
                   for li, w in enumerate(want[name])), name

    # 2) a forward still writes the destination rows (pages freed under overlap scheduling);
    #    SGLang's load stream waits for it (its load fence) and the adapter loads from there
    before = {name: [t.clone() for t in stage.layers[name]] for name in LAYOUT.pools}
    torch.cuda.synchronize()  # (taken before the forward below writes)
    with torch.cuda.stream(fwd):
        torch.cuda._sleep(SLEEP)
        for name, p in pools.items():
            i = dst_dev[p.space]
            for t in stage.layers[name]:
                t.index_fill_(0, i, 0xEE)
    load.wait_stream(fwd)
    assert not fwd.query(), "the forward ended before the loads were sent: no fence tested"
    _load_and_check(pools, stage, {s: (_tok(host[s]), _tok(dst[s])) for s in dst},
                    dst, want, load)
    # 3) SGLang's CUDA device ids (a single SWA page: the first of the backed-up ones)
    ids = {s: (_tok(host[s][: len(dst2[s])]), _tok(dst2[s], DEV)) for s in dst2}
    _load_and_check(pools, stage, ids, dst2,
                    {name: [w[: len(dst2[p.space])] for w in want[name]]
                     for name, p in pools.items()}, load)
    torch.cuda.synchronize()
    # the loads stayed behind the forward's writes (the fence): the destinations still hold
    # what was loaded, not the forward's 0xEE
    for name, p in pools.items():
        for li, t in enumerate(stage.layers[name]):
            assert torch.equal(t.index_select(0, dst_dev[p.space]), want[name][li]), (name, li)

    # 4) nothing else changed: every row outside each space's destinations is as before
    for name, spec in LAYOUT.pools.items():
        moved = set(dst.get(spec.index, [])) | set(dst2.get(spec.index, []))
        keep = [r for r in range(ROWS[spec.index] + EXTRA_ROWS.get(name, 0)) if r not in moved]
        k = torch.tensor(keep, device=DEV)
        for li, t in enumerate(stage.layers[name]):
            assert torch.equal(t.index_select(0, k), before[name][li].index_select(0, k)), \
                (name, li)
    for s, rows in host.items():
        link.free(s, rows)
    assert all(link.free_rows(s) == link.capacity(s) for s in host)


def test_a_load_the_forward_waits_for_is_copied_at_each_of_its_waits(adapter) -> None:
    d, link, stage = adapter
    c = link.client
    pools = {ours: Pool(link, sgl) for sgl, ours in SGLANG_POOLS.items()}
    src = {"page": [1, 3, 5, 11], "swa_page": [0, 2, 4, 8]}
    dst = {"page": [0, 2, 9, 10], "swa_page": [1, 3, 6, 7]}
    host = {s: link.alloc(s, 4) for s in src}
    fwd, load, reader = (torch.cuda.Stream(DEV) for _ in range(3))
    dst_dev = {s: torch.tensor(r, device=DEV) for s, r in dst.items()}
    load_fill_kernel(DEV)  # (see the test above: a first launch would end the sleep early)
    backup_all(pools, {s: (_tok(host[s]), _tok(src[s])) for s in src})
    torch.cuda.synchronize()
    want = {name: _rows_of(stage, name, src[p.space]) for name, p in pools.items()}
    counter = LayerCounter()
    link.layer_waits.attach(counter)

    def check_layer(g: int, what: Any) -> None:
        """Global layer ``g`` of every pool that has it, read from another stream, is what
        was backed up."""
        with torch.cuda.stream(reader):
            got = {name: stage.layers[name][LAYOUT.pools[name].layers.index(g)]
                   .index_select(0, dst_dev[p.space])
                   for name, p in pools.items() if g in LAYOUT.pools[name].layers}
        reader.synchronize()
        for name, rows in got.items():
            assert torch.equal(rows, want[name][LAYOUT.pools[name].layers.index(g)]), \
                (what, name, g)

    # round 0 has no fence: it warms the daemon's load kernels up (a kernel's first launch
    # waits for the GPU to go idle, which a fence would hold back); rounds 1 and 2 come behind
    # a forward still writing (the load fence), and their submissions return while it holds:
    # the thread waits for the daemon to issue the last layer, not for any copy
    for rnd in range(3):  # (each round reuses the link's events and the counter)
        for name, p in pools.items():  # destinations cleared, so a layer not loaded shows
            for t in stage.layers[name]:
                t.index_fill_(0, dst_dev[p.space], 0)
        if rnd:
            with torch.cuda.stream(fwd):  # the previous forward, still writing
                torch.cuda._sleep(SLEEP)
            load.wait_stream(fwd)
        counter.update_producer()
        with commands_sent(link, "load") as loads:
            load_layer_by_layer(pools, {s: (_tok(host[s]), _tok(dst[s])) for s in dst}, load,
                                defer=True)
        finish = torch.cuda.Event()
        finish.record(load)  # SGLang's completion event of the submission
        if rnd:
            assert not fwd.query(), f"round {rnd}: the submission waited out the load fence"
        assert loads == [sorted(pools)]
        assert list(link.layer_waits.pending()) == [counter.producer_index]
        if rnd == 2:  # SGLang's completion event, before any forward wait: every layer is in
            # once it completes (what SGLang's radix cache and allocator read it for)
            finish.synchronize()
            for g in c.stage_layers:
                check_layer(g, "completion event")
        counter.consumer_index = counter.producer_index  # the batch's forward
        for t, g in enumerate(c.stage_layers):
            counter.wait_until(t)
            check_layer(g, f"round {rnd}, at its wait")
        assert link.layer_waits.pending() == {}  # its ack taken and checked at the last layer
        deadline = time.monotonic() + 10
        while not finish.query():
            assert time.monotonic() < deadline, "SGLang's completion event never completed"
            time.sleep(0.001)
    for s, rows in host.items():
        link.free(s, rows)


def test_close_unregisters_the_gpu_worker(adapter) -> None:
    d, link, _ = adapter
    other = d.client(timeout=30)
    try:
        assert other.stats()["workers"] == 1
        link.close()
        assert other.stats()["workers"] == 0
    finally:
        other.close()
