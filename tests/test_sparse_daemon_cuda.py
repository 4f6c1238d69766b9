"""HiSparse end to end on a GPU, over ZMQ: a ``hicache serve --device cuda:0 --sparse-rows 8``
subprocess, and this test process as the engine with real CUDA pools shared through CUDA IPC.

The engine backs two C4 pages up into the host tier, then overwrites its device rows; it
admits a sparse request whose first two pages are those host-tier prefix hits and whose other
two come from device rows (the daemon's GPU copy into its pinned region), and extends it with
decode tokens backed up from device token locations. It maps and registers the region itself
and runs the swap-in kernel on it for every C4 layer: each top-k location must hold the bytes
each token was backed up from (the hits' old bytes, not the device's new ones). Skipped without
CUDA. GPU command: ``python3 -m pytest -q -m cuda tests/test_sparse_daemon_cuda.py``.
"""
from __future__ import annotations

from typing import Any

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402
from hicache.engine.hot_buffer import HotBuffer  # noqa: E402

ROWS = {"page": 16, "swa_page": 4, "req_slot": 4}
FLASH = build_layout(preset("dsv4-flash"))
DEV = torch.device("cuda:0")
P, VB, SOFF = 64, 576, 36_864


def _token(row: torch.Tensor, s: int) -> torch.Tensor:
    return torch.cat([row[s * VB:(s + 1) * VB], row[SOFF + s * 8: SOFF + s * 8 + 8]])


def _gpu_daemon(tmp_path: Any) -> tuple[Any, DevicePools]:
    """A GPU daemon with an 8-row sparse region, and the engine's device pools on that GPU."""
    from conftest import start_daemon

    d = start_daemon(tmp_path, device="cuda:0", device_rows="page=16,swa_page=4,req_slot=4",
                     extra=("--sparse-rows", "8", "--min-sparse-prompt-len", "256"),
                     metrics=False, ready_timeout=120, heartbeat_timeout=120.0)
    torch.cuda.set_device(DEV)
    return d, DevicePools(FLASH, ROWS, device=DEV)


def test_sparse_region_over_zmq_prefix_hits_backups_and_swap_in(tmp_path):
    d, pools = _gpu_daemon(tmp_path)
    c = None
    try:
        g = torch.Generator(device=DEV).manual_seed(4)
        c4 = pools.layers["c4_kv"]
        for t in c4:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEV, generator=g))
        c = d.client(timeout=60)
        c.register(pools, events=2)
        torch.cuda.synchronize()
        # host tier: device rows 1 and 4 backed up, then overwritten on the device
        host = c.alloc({"page": 2}, request="prefix")["page"]
        assert c.wait_ack(c.backup({"c4_kv": ([1, 4], host)}), timeout=120).ok
        old = [t[[1, 4]].cpu() for t in c4]
        for t in c4:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEV, generator=g))
        torch.cuda.synchronize()
        new = [t.cpu() for t in c4]
        shm = c.map_sparse_region(DEV)  # the engine's own mapping, registered for the GPU
        # 1024 tokens = 256 C4 tokens = 4 pages: 2 prefix hits + device rows 6 and 3
        rows = c.sparse_admit("long", 1024, host_rows=host, device_rows=[6, 3])
        # decode: C4 tokens 256..276 from device token locations (a fifth page)
        dev_tok = [9 * P + 5 + 2 * i for i in range(21)]
        rows = c.sparse_extend("long", 277 * 4, device_tokens=dev_tok, first=256)
        assert len(rows) == 5

        def want(layer: int, t: int) -> torch.Tensor:
            p, s = divmod(t, P)
            if p < 2:
                return _token(old[layer][p], s)
            if p < 4:
                return _token(new[layer][(6, 3)[p - 2]], s)
            dr, ds = divmod(dev_tok[t - 256], P)
            return _token(new[layer][dr], ds)

        for layer, h in enumerate(shm.layers):  # the region as the engine maps it
            for t in (0, 63, 64, 127, 128, 191, 255, 256, 276):
                assert torch.equal(_token(h[rows[t // P]], t % P), want(layer, t)), (layer, t)
        n = 277
        hb = HotBuffer(shm.layers, fmt=FLASH.pool("c4_kv"), topk=64, slots=128, max_requests=2,
                       max_batch=2, max_tokens=n, device=DEV, impl="triton")
        hb.admit(1, n, rows)
        gen = torch.Generator().manual_seed(1)
        req = torch.tensor([-1, 1], device=DEV)
        for step in range(2):
            ids = torch.randperm(n, generator=gen)[:64]
            ids[0] = n - 1  # the newest token: the reserved slot
            topk = torch.stack([torch.full((64,), -1), ids]).to(DEV)
            for layer in range(len(shm.layers)):
                out = hb.swap_in(layer, req, topk).cpu()
                assert (out[0] == -1).all()
                dev = hb.dev.layers[layer].cpu()
                for t, loc in zip(ids.tolist(), out[1].tolist()):
                    assert torch.equal(_token(dev[loc // P], loc % P), want(layer, t)), \
                        (step, layer, t)
        lookups = sum(x[0] for x in hb.hits())
        copied = sum(x[1] for x in hb.hits())
        assert lookups == 2 * 64 * len(shm.layers) and 0 < copied <= lookups
        c.sparse_report(lookups, copied)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(shm.base_ptr)
        assert c.sparse_free("long") == 5
        c.free({"page": host}, request="prefix")
    finally:
        if c is not None:
            c.close()
        d.stop()
        pools.close()


def test_a_failed_pin_leaves_no_cuda_error_for_the_engines_next_launch():
    """``SparseShm.pin`` whose ``cudaHostRegister`` fails (here: the range is registered
    already) raises, and clears the runtime's last error: the engine's next, unrelated launch
    runs (from a review helper: on the code before it raised "part or all of the requested
    memory range is already mapped")."""
    from hicache.core.sparse_shm import SparseShm

    dev = torch.device("cuda:0")
    torch.ones(1, device=dev)
    shm = SparseShm.create(2, 4, 4096)
    rt = torch.cuda.cudart()
    assert int(rt.cudaHostRegister(shm.base_ptr, shm.nbytes, 0)) == 0
    try:
        with pytest.raises(RuntimeError, match="cudaHostRegister"):
            shm.pin(dev)
        y = torch.ones(4, device=dev) * 2
        torch.cuda.synchronize()
        assert y.sum().item() == 8
    finally:
        rt.cudaHostUnregister(shm.base_ptr)
        shm.close()


def test_prefix_hits_with_a_backup_into_them_in_flight_are_refused_busy(tmp_path):
    """On a GPU daemon ``sparse_admit`` copies its prefix hits host to host when it handles the
    command, which no stream wait orders after a backup into those rows still in flight: it is
    refused ``busy`` until that backup's ack, changing nothing (from a review helper: on the code
    before it admitted, copying what the rows held before the backup landed)."""
    from hicache.engine.client import CommandRefused

    d, pools = _gpu_daemon(tmp_path)
    c = None
    try:
        c = d.client(timeout=60)
        c.register(pools, events=2)
        host = c.alloc({"page": 2}, request="prefix")["page"]
        assert c.wait_ack(c.backup({"c4_kv": ([1, 4], host)}), timeout=120).ok
        shm = c.map_sparse_region(DEV)  # kept: dropping it would unmap a pinned region
        engine = torch.cuda.Stream(DEV)
        with torch.cuda.stream(engine):  # the engine writes its KV, then records the event
            torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time
            c.backup_events[1].record(engine)
        op = c.backup({"c4_kv": ([2, 5], host)}, wait_event=1)  # in flight behind the sleep
        with pytest.raises(CommandRefused) as e:
            c.sparse_admit("long", 1024, host_rows=host, device_rows=[6, 3])
        assert e.value.code == "busy" and "still in flight" in str(e.value)
        assert c.wait_ack(op, timeout=120).ok
        rows = c.sparse_admit("long", 1024, host_rows=host, device_rows=[6, 3])  # now it runs
        assert len(rows) == 4
        assert c.sparse_free("long") == 4
        c.free({"page": host}, request="prefix")
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(shm.base_ptr)  # as the test above does
    finally:
        if c is not None:
            c.close()
        d.stop()
        pools.close()
