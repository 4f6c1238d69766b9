"""Byte-exact checkpoint copies through a live daemon: one BACKUP / LOAD carries compressed page
rows plus a checkpoint (SWA tail tokens and C4 / C4-indexer state rows), restored into a
``swa_page`` row (paged SWA) or into a request slot's rings at positions ``pos % window`` (ring
SWA). Every byte of every device pool is compared with what the copy must produce: the moved
bytes match, and nothing else changed (the SWA head tokens and the C128 state included).
"""
from __future__ import annotations

import pytest
import torch

from hicache.sim.simulator import Worker, WorkerConfig

KEY = 4242


def _devices() -> list:
    cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
    return ["cpu", pytest.param("cuda:0", marks=[pytest.mark.cuda, cuda])]


def _daemon(factory, device: str, swa: str):
    rows = "page=16,swa_page=16,req_slot=4" if swa == "paged" else "page=16,req_slot=4"
    return factory(device=device, preset="dsv4-tiny", device_rows=rows,
                   host=("--host-ratio", "4"), extra=("--swa-mode", swa))


def _snapshot(w: Worker) -> dict[str, list[torch.Tensor]]:
    return {name: [b.clone() for b in bufs] for name, bufs in w.pools.layers.items()}


def _expect_row(w: Worker, want: dict, pool: str, row: int, key: int) -> None:
    for layer, buf in enumerate(want[pool]):
        w.content.fill(pool, layer, buf, torch.tensor([row]), torch.tensor([key]))


def _expect_tail(w: Worker, want: dict, row: int, key: int, depth: int) -> None:
    src, dst = w._tail(depth)
    for layer, buf in enumerate(want["swa_kv"]):
        w.content.fill_tokens("swa_kv", layer, buf, torch.tensor([row]), torch.tensor([key]),
                              src, dst)


def _assert_same(w: Worker, want: dict) -> None:
    if w.cuda:
        torch.cuda.synchronize()
    for name, bufs in w.pools.layers.items():
        for layer, buf in enumerate(bufs):
            diff = int((buf != want[name][layer]).sum().item())
            assert diff == 0, f"pool {name} layer {layer}: {diff} bytes differ"


def _scramble(w: Worker, pool: str, row: int) -> None:
    g = torch.Generator().manual_seed(row)
    for buf in w.pools.layers[pool]:
        noise = torch.randint(0, 256, (buf.shape[1],), dtype=torch.uint8, generator=g)
        buf[row].copy_(noise.to(buf.device))
    if w.cuda:
        torch.cuda.synchronize()  # the daemon's copies run on its own streams


@pytest.mark.parametrize("device", _devices())
def test_paged_checkpoint_restores_tail_and_states_into_a_swa_page_row(daemon_factory, device):
    d = _daemon(daemon_factory, device, "paged")
    with d.client(timeout=30) as c:
        w = Worker(WorkerConfig(device=device, device_pages=16, host_pages=8), c)
        try:
            h, r = w.hooks, w.resume
            assert h is not None
            w._write(None, [KEY], [3])  # prefill: every pool of both page spaces
            pages, ck = h.host_alloc(1), h.host_alloc(1, kind="ckpt")
            h.wait(h.backup([3], pages, ckpts=[(3, ck[0], 1)]))
            for name in w.pools.layers:
                if name != "c128_state":
                    _scramble(w, name, 5)
            want = _snapshot(w)
            h.wait(h.load(pages, [5], ckpts=[(5, ck[0], 1)]))
            for spec in w.layout.space_pools("page") + list(r.state_pools):
                _expect_row(w, want, spec.name, 5, KEY)
            _expect_tail(w, want, 5, KEY, 1)  # tokens 128..255; tokens 0..127 keep their bytes
            _assert_same(w, want)
            moved = r.page_bytes + r.checkpoint_bytes
            assert h.stats.bytes["load"] == moved and h.stats.ops["load"] == 1
            assert h.stats.ckpts == {"backup": 1, "load": 1}
        finally:
            w.close()


@pytest.mark.parametrize("device", _devices())
def test_ring_checkpoint_restores_into_the_request_slot_rings(daemon_factory, device):
    d = _daemon(daemon_factory, device, "ring")
    with d.client(timeout=30) as c:
        w = Worker(WorkerConfig(device=device, swa_mode="ring", device_pages=16, host_pages=8),
                   c)
        try:
            h, r = w.hooks, w.resume
            assert h is not None and r.checkpoint_space == "req_slot"
            depth = 3
            w._write(None, [KEY], [2])  # the boundary page's compressed rows
            for name in ("swa_kv", "c4_state", "c4_indexer_state", "c128_state"):
                _scramble(w, name, 1)
            want = _snapshot(w)  # slot 1's rings: the checkpoint of page KEY at depth 3
            _expect_tail(w, want, 1, KEY, depth)
            for spec in r.state_pools:
                _expect_row(w, want, spec.name, 1, KEY)
            for name, bufs in want.items():
                for layer, buf in enumerate(bufs):
                    w.pools.layers[name][layer].copy_(buf)
            w._written()  # GPU: the backup event the daemon's BACKUP waits on
            pages, ck = h.host_alloc(1), h.host_alloc(1, kind="ckpt")
            h.wait(h.backup([2], pages, ckpts=[(1, ck[0], depth)]))
            for name in w.pools.layers:
                _scramble(w, name, 3 if name in ("swa_kv", "c4_state", "c4_indexer_state",
                                                 "c128_state") else 9)
            want = _snapshot(w)
            h.wait(h.load(pages, [9], ckpts=[(3, ck[0], depth)]))  # into slot 3
            for spec in w.layout.space_pools("page"):
                _expect_row(w, want, spec.name, 9, KEY)
            for spec in r.state_pools:
                _expect_row(w, want, spec.name, 3, KEY)
            _expect_tail(w, want, 3, KEY, depth)  # ring positions (pos % 128): 0..127
            _assert_same(w, want)  # the rest of the ring row and the C128 state untouched
            assert h.stats.bytes["load"] == r.page_bytes + r.checkpoint_bytes
        finally:
            w.close()


def test_full_mirror_in_ring_mode_is_refused():
    from hicache.core.errors import UsageError

    with pytest.raises(UsageError, match="paged SWA"):
        WorkerConfig(swa_mode="ring", mirror="full").check()
    with pytest.raises(UsageError, match="checkpoint-every"):
        WorkerConfig(swa_mode="ring", checkpoint_every=4).check()


@pytest.mark.parametrize("swa", ["paged", "ring"])
def test_dry_and_verified_replays_agree_on_hits(daemon_factory, swa):
    from hicache.sim.dry import DryReplay
    from hicache.sim.workload import multi_turn

    # lockstep: backups complete before the next request, as in the dry replay (otherwise the
    # hits depend on how fast the daemon's copies finish on a loaded machine)
    cfg = WorkerConfig(swa_mode=swa, device_pages=20, host_pages=40, host_ckpts=16,
                       checkpoint_every=4 if swa == "paged" else 0, lockstep=True)
    rows = "page=40,swa_page=16,req_slot=4" if swa == "paged" else "page=40,req_slot=20"
    d = daemon_factory(preset="dsv4-tiny", device_rows=rows,
                       host=("--host-ratio", "1", "--force"),
                       extra=("--swa-mode", swa))
    reqs = multi_turn(50, seed=3, system_pages=(2, 6), user_pages=(1, 2), answer_pages=(1, 1),
                      max_pages=16, active_sessions=8)
    with d.client(timeout=30) as c:
        w = Worker(cfg, c)
        try:
            w.run(reqs)
            verified = w.summary()
        finally:
            w.close()
    dry = DryReplay(cfg)
    dry.run(reqs)
    s = dry.summary()
    assert verified["verified"], verified["first_mismatch"]
    keys = ("device_hit_tokens", "host_hit_tokens", "miss_tokens", "unresumable_tokens",
            "device_only_hit_tokens", "pages_loaded", "pages_backed_up", "bytes_loaded",
            "bytes_backed_up", "checkpoints")
    assert {k: s[k] for k in keys} == {k: verified[k] for k in keys}
    assert s["host_hit_tokens"] > 0 and s["checkpoints"]["loaded"] > 0
    assert verified["verified_bytes"] >= verified["bytes_loaded"]
