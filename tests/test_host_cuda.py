"""PinnedArena and HostPoolGroup on a real GPU: registration, rollback through the driver,
kernels (torch and Triton) reading and writing the arena through its device pointer, DMA
across registration chunks, and clean unregistration. Skipped without CUDA."""
from __future__ import annotations

import pytest
import torch

from hicache.host_pools.arena import PinnedArena
from hicache.host_pools.errors import ArenaError
from hicache.host_pools.group import HostPoolGroup
from hicache.core.layout import build_layout, preset

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
]
MiB = 1 << 20
DEV = 0

try:
    import triton
    import triton.language as tl

    @triton.jit
    def _copy_and_bump(host_addr, out, n, BLOCK: tl.constexpr):
        src = host_addr.to(tl.pointer_type(tl.uint8))  # a raw host (UVA) address
        offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
        m = offs < n
        x = tl.load(src + offs, mask=m)
        tl.store(out + offs, x, mask=m)
        tl.store(src + offs, x + 1, mask=m)
except ImportError:  # pragma: no cover
    triton = None


class _DeviceView:
    """Hands a raw device address to torch (``__cuda_array_interface__``), zero-copy."""

    def __init__(self, ptr: int, n: int) -> None:
        self.__cuda_array_interface__ = {"shape": (n,), "typestr": "|u1", "data": (ptr, False),
                                         "version": 3, "strides": None}


@pytest.fixture
def cudart_calls(monkeypatch):
    """Wrap torch's cudaHostRegister/Unregister to record calls and their return codes."""
    rt = torch.cuda.cudart()
    real_reg, real_unreg = rt.cudaHostRegister, rt.cudaHostUnregister
    log: dict[str, list] = {"reg": [], "unreg": [], "fail_at": None}

    def reg(ptr, n, flags):
        if log["fail_at"] is not None and len(log["reg"]) == log["fail_at"]:
            p0, n0 = log["reg"][0]
            return real_reg(p0, n0, flags)  # registering chunk 0 again: a real driver error
        rc = real_reg(ptr, n, flags)
        if int(rc) == 0:
            log["reg"].append((ptr, n))
        return rc

    def unreg(ptr):
        rc = real_unreg(ptr)
        log["unreg"].append((ptr, int(rc)))
        return rc

    monkeypatch.setattr(rt, "cudaHostRegister", reg)
    monkeypatch.setattr(rt, "cudaHostUnregister", unreg)
    return log


def test_register_and_clean_unregister(cudart_calls):
    a = PinnedArena(8 * MiB + 123, DEV, chunk_bytes=3 * MiB)
    st = a.stats
    assert st["registered"] and st["chunks"] == 3 == len(cudart_calls["reg"])
    assert st["pinned_bytes"] == st["mapped_bytes"] and st["pinned_bytes"] - a.nbytes < 4096
    assert a.tensor(0, 16).is_pinned() and a.tensor(a.nbytes - 16, 16).is_pinned()
    if st["can_use_host_pointer"]:
        assert st["device_ptr_is_host_ptr"] and a.device_ptr == a.ptr
    a.close()
    a.close()
    assert sorted(p for p, _ in cudart_calls["unreg"]) == sorted(p for p, _ in cudart_calls["reg"])
    assert all(rc == 0 for _, rc in cudart_calls["unreg"])


def test_failed_chunk_rolls_back_everything(cudart_calls):
    cudart_calls["fail_at"] = 1
    with pytest.raises(ArenaError) as e:
        PinnedArena(8 * MiB, DEV, chunk_bytes=2 * MiB)
    msg = str(e.value)
    assert "chunk 2/4" in msg and "rolled back 1 registered chunk(s)" in msg and "error" in msg
    assert [p for p, _ in cudart_calls["unreg"]] == [cudart_calls["reg"][0][0]]
    assert all(rc == 0 for _, rc in cudart_calls["unreg"])
    # the failed call's error does not surface at the next kernel launch
    assert torch.ones(4, device=f"cuda:{DEV}").sum().item() == 4
    torch.cuda.synchronize()


def test_torch_kernels_read_and_write_host_arena():
    n = 1 * MiB + 7
    with PinnedArena(2 * MiB, DEV) as a:
        host = a.tensor(4096, n)
        pattern = (torch.arange(n) % 251).to(torch.uint8)
        host.copy_(pattern)
        dev_view = torch.as_tensor(_DeviceView(a.device_address(4096), n), device=f"cuda:{DEV}")
        assert dev_view.is_cuda and dev_view.data_ptr() == a.device_address(4096)
        copy = dev_view.clone()  # a kernel reading host memory
        dev_view.add_(1)  # a kernel writing host memory
        torch.cuda.synchronize()
        assert torch.equal(copy.cpu(), pattern)
        assert torch.equal(host, pattern + 1)
        d = torch.empty(n, dtype=torch.uint8, device=f"cuda:{DEV}")
        d.copy_(host, non_blocking=True)  # DMA from the registered range
        torch.cuda.synchronize()
        assert torch.equal(d.cpu(), pattern + 1)
        del dev_view


@pytest.mark.skipif(triton is None, reason="needs triton")
def test_triton_kernel_through_host_pointer():
    n = 300_000
    with PinnedArena(MiB, DEV) as a:
        host = a.tensor(0, n)
        pattern = (torch.arange(n) % 13).to(torch.uint8)
        host.copy_(pattern)
        out = torch.zeros(n, dtype=torch.uint8, device=f"cuda:{DEV}")
        _copy_and_bump[(triton.cdiv(n, 1024),)](a.device_ptr, out, n, BLOCK=1024)
        torch.cuda.synchronize()
        assert torch.equal(out.cpu(), pattern)
        assert torch.equal(host, pattern + 1)


def test_group_rows_copy_across_registration_chunks():
    lay = build_layout(preset("dsv4-tiny"))
    rows = {"page": 16, "swa_page": 6, "req_slot": 4}
    with HostPoolGroup(lay, rows, device_index=DEV, arena_options={"chunk_bytes": 2 * MiB}) as g:
        assert g.arena.stats["chunks"] > 2
        for name, pool in g.pools.items():
            for layer in pool.layers:
                assert layer.is_pinned()
                layer.copy_(torch.randint(0, 256, layer.shape, dtype=torch.uint8))
                d = layer.to(f"cuda:{DEV}", non_blocking=True)
                back = torch.empty_like(layer).pin_memory()
                back.copy_(d, non_blocking=True)
                torch.cuda.synchronize()
                assert torch.equal(back, layer), name
        infos = g.buffer_infos()
        assert sum(len(v) for v in infos.values()) == sum(
            p.num_layers for p in lay.pools.values())
