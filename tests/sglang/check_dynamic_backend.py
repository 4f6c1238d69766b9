"""SGLang 0.5.23 loads hicache's ``dynamic`` storage backend itself; pages survive a restart.

Runs inside the sglang environment (``tests/test_sglang_adapter.py`` launches it), on CPU. An
"engine" is SGLang's own DSV4 stack built by ``UnifiedRadixCache.init_hicache`` with
``hicache_storage_backend="dynamic"`` and our extra config: SGLang's stock host pools in memfds
(its shm allocator), SGLang's ``HybridCacheController`` creating ``HicacheStorage`` through
its ``StorageBackendFactory`` and registering every pool. One real ``hicache serve`` outlives
the engines. The page moves are the calls SGLang's storage threads make (``batch_set_v1`` on
the KV anchor, ``batch_set_v2`` with one ``PoolTransfer`` per DSV4 pool, then ``batch_exists``
/ ``batch_exists_v2`` / ``batch_get_v1`` / ``batch_get_v2`` after the restart); every byte of
every pool and layer is compared. With ``HICACHE_TEST_L3`` (set by ``test_sglang_adapter`` when
the main environment has Mooncake: the store's addresses and that environment's Python, which
runs the daemon) the daemon itself is killed and restarted between the engines, with L3 behind
the key store: every page comes back from Mooncake Store.

CPU shims (test only): ``_cuda_host_register`` is a no-op (there is no pinned memory without
CUDA) and the parallel ranks are stated (no process groups are built). With
``HICACHE_SGLANG_TEST_DEVICE=cuda:N`` the device pools and the daemon are on that GPU and SGLang
pins its memfd host pools itself.
"""
from __future__ import annotations

import json
import os
import time
from contextlib import ExitStack
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator
from unittest import mock

import pytest
import torch

import dsv4_fixture as F
from conftest import ROOT, start_daemon
from hicache.engine import l3_master
from hicache.engine.client import Client
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.sglang.storage import HicacheStorage, StorageRefused

from sglang.srt.mem_cache.hicache_storage import HiCacheStorageConfig, PoolHitPolicy, PoolTransfer
from sglang.srt.mem_cache.storage.backend_factory import StorageBackendFactory
from sglang.srt.mem_cache.utils import get_hash_str
from sglang.srt.runtime_context import get_parallel
from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

KV_DERIVED = ("deepseek_v4_c4", "deepseek_v4_c4_indexer", "deepseek_v4_c128")  # anchor indices
SWA_INDEXED = ("swa", "deepseek_v4_c4_state", "deepseek_v4_c4_indexer_state")
# cpu (CI) or cuda:N (the GPU machine: scripts/gpu_sglang.sh): SGLang's device pools, pinned
# host pools and the daemon on that device
DEVICE = os.environ.get("HICACHE_SGLANG_TEST_DEVICE", "cpu")
L3 = json.loads(os.environ.get("HICACHE_TEST_L3") or "null")  # {master, metadata, python}
EXTRA = {"backend_name": "hicache", "module_path": "hicache.engine.sglang.storage",
         "class_name": "HicacheStorage", "interface_v1": 1, "allocator": "shm"}


def _daemon(tmp: Path) -> Any:
    return start_daemon(tmp, device=DEVICE, preset="dsv4-tiny", device_rows=F.DEVICE_ROWS, metrics=False,
                        extra=("--no-mtp", "--c128-state", "offline"))


@contextmanager
def engine(address: str, namespace: str = "dsv4-tiny-test",
           **more: Any) -> Iterator[tuple[Any, dict]]:
    """SGLang's DSV4 stack with our backend, attached by SGLang; detached on exit."""
    extra = json.dumps({**EXTRA, "hicache_socket": address, "hicache_namespace": namespace,
                        **more})

    def server_args() -> ServerArgs:
        sa = ServerArgs(model_path="dummy", page_size=F.PAGE, hicache_io_backend="direct",
                        hicache_write_policy="write_through", hicache_mem_layout="layer_first",
                        hicache_storage_backend="dynamic",
                        hicache_storage_backend_extra_config=extra)
        set_global_server_args_for_scheduler(sa)
        return sa

    with ExitStack() as stack:
        stack.enter_context(mock.patch.object(F, "server_args", server_args))
        if DEVICE == "cpu":  # no pinned memory without CUDA
            stack.enter_context(mock.patch(
                "sglang.srt.mem_cache.pool_host.common._cuda_host_register", lambda *a, **k: None))
        stack.enter_context(get_parallel().override(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1))
        cache, _, _, _ = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
    cc = cache.cache_controller
    try:
        assert cc.enable_storage and isinstance(cc.storage_backend, HicacheStorage)
        pools = {str(e.name): e.host_pool for e in cc.mem_pool_host.entries}
        assert sorted(cc.storage_backend.pools) == sorted(pools)  # SGLang registered them all
        yield cc.storage_backend, pools
    finally:
        cc.detach_storage_backend()  # SGLang's detach: stops its threads, closes the backend


def _alloc(pool: Any, pages: int, skip: int) -> torch.Tensor:
    """``pages`` whole pages of host indices, after ``skip`` pages taken (so offsets differ)."""
    if skip:
        pool.alloc(skip * F.PAGE)
    return pool.alloc(pages * F.PAGE)


def _page_rows(idx: torch.Tensor) -> list[int]:
    return (idx.reshape(-1, F.PAGE)[:, 0] // F.PAGE).tolist()


def _transfers(keys: list[str], kv_idx: torch.Tensor, swa_idx: torch.Tensor) -> list[PoolTransfer]:
    return [PoolTransfer(name=n, host_indices=kv_idx, keys=keys) for n in KV_DERIVED] + \
           [PoolTransfer(name=n, host_indices=swa_idx, keys=keys) for n in SWA_INDEXED]


def _fill(pools: dict, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for name in KV_DERIVED + SWA_INDEXED:
        for t in pools[name].kv_buffer:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def _keys(n: int, seed: int) -> list[str]:
    toks = list(range(seed, seed + n * F.PAGE))
    return get_hash_str(toks, None, page_size=F.PAGE)



def _put(backend: Any, pools: Any, keys: list, seed: int, kv_skip: int,
         swa_skip: int) -> dict:
    """Fill the pools, store 3 pages under ``keys`` through ``batch_set_v1`` and
    ``batch_set_v2``; returns the stored bytes per pool and layer."""
    _fill(pools, seed=seed)
    kv_idx = _alloc(pools["kv"], 3, skip=kv_skip)
    swa_idx = _alloc(pools["swa"], 3, skip=swa_skip)
    assert backend.batch_set_v1(keys, kv_idx) == [True] * 3
    assert backend.batch_set_v2(_transfers(keys, kv_idx, swa_idx)) == \
        {n: [True] * 3 for n in KV_DERIVED + SWA_INDEXED}
    rows = {n: _page_rows(kv_idx) for n in KV_DERIVED} | \
        {n: _page_rows(swa_idx) for n in SWA_INDEXED}
    return {n: [t[rows[n]].clone() for t in pools[n].kv_buffer] for n in rows}


def _get_back(backend: Any, pools: Any, keys: list, saved: dict, kv_skip: int,
              swa_skip: int) -> None:
    """The 3 pages of ``keys`` come back through ``batch_exists_v2``, ``batch_get_v1`` and
    ``batch_get_v2`` into fresh pool slots: every saved byte in place, every other row zero."""
    kv_idx = _alloc(pools["kv"], 3, skip=kv_skip)
    swa_idx = _alloc(pools["swa"], 3, skip=swa_skip)
    res = backend.batch_exists_v2(keys, _transfers(keys, kv_idx, swa_idx))
    assert res.kv_hit_pages == 3 and res.restorable_prefix_pages == [1, 2, 3]
    assert backend.batch_get_v1(keys, kv_idx) == [True] * 3
    assert backend.batch_get_v2(_transfers(keys, kv_idx, swa_idx)) == \
        {n: [True] * 3 for n in KV_DERIVED + SWA_INDEXED}
    for name in KV_DERIVED + SWA_INDEXED:
        dst = _page_rows(kv_idx if name in KV_DERIVED else swa_idx)
        for layer, t in enumerate(pools[name].kv_buffer):
            assert torch.equal(t[dst], saved[name][layer]), (name, layer)
            rest = [r for r in range(t.shape[0]) if r not in dst]
            assert int(t[rest].count_nonzero()) == 0, (name, layer)

@pytest.mark.parametrize("attach", ["handoff", "pid"])
def test_storage_backend_survives_an_engine_restart(tmp_path: Path, attach: str) -> None:
    """Either way the daemon gets the pools' files (``hicache_attach``: handed in on its
    descriptor socket, the default, or opened through ``/proc/<pid>/fd``), every byte comes
    back; the second engine attaches the other way."""
    d = _daemon(tmp_path)
    other_way = "pid" if attach == "handoff" else "handoff"
    try:
        keys = _keys(3, 1)
        with engine(d.address, hicache_attach=attach) as (backend, pools):
            assert backend.attach == attach
            for name in KV_DERIVED + SWA_INDEXED:  # SGLang's stock pools, each in memfds
                assert pools[name].allocator.fds, name
            saved = _put(backend, pools, keys, seed=7, kv_skip=1, swa_skip=2)
        # the engine is gone (its memfds with it); a new one starts against the same daemon
        with engine(d.address, hicache_attach=other_way) as (backend, pools):
            for name in KV_DERIVED + SWA_INDEXED:
                assert all(int(t.count_nonzero()) == 0 for t in pools[name].kv_buffer)
            other = _keys(1, 99_999)
            assert backend.batch_exists(keys + other) == 3 and backend.exists(keys[0])
            assert not backend.exists(other[0])
            _get_back(backend, pools, keys, saved, kv_skip=4, swa_skip=0)
        # another namespace (another model) sees none of it
        with engine(d.address, namespace="another-model") as (backend, pools):
            assert backend.batch_exists(keys) == 0
            idx = _alloc(pools["kv"], 3, skip=0)
            got = backend.batch_get_v2([PoolTransfer(name="deepseek_v4_c4", host_indices=idx,
                                                     keys=keys)])
            assert got == {"deepseek_v4_c4": [False] * 3}
            assert all(int(t.count_nonzero()) == 0 for t in pools["deepseek_v4_c4"].kv_buffer)
    finally:
        d.close()


def test_an_idle_engine_stays_attached(tmp_path: Path) -> None:
    """SGLang calls the backend only when it moves pages: an engine idle for longer than the
    daemon's heartbeat timeout used to be reaped, and its next call re-attached every pool (a
    call landing while the daemon still retired the old client was a miss). The backend's
    heartbeat thread keeps it attached: after three timeouts of silence the next calls need no
    re-attach and find the pages; ``close`` stops the thread."""
    d = start_daemon(tmp_path, device=DEVICE, preset="dsv4-tiny", device_rows=F.DEVICE_ROWS,
                     metrics=False, heartbeat_timeout=1.2,  # (0.6 s: ~0.35 s of slack)
                     extra=("--no-mtp", "--c128-state", "offline"))
    try:
        keys = _keys(3, 11)
        with engine(d.address) as (backend, pools):
            saved = _put(backend, pools, keys, seed=5, kv_skip=0, swa_skip=0)
            reattached = []
            real = backend._reattach
            backend._reattach = lambda: (reattached.append(1), real())[1]
            time.sleep(3.6)  # three heartbeat timeouts without a call
            assert backend.beats.error is None and backend.beats.thread.is_alive()
            for name in KV_DERIVED + SWA_INDEXED:  # the pages come back into zeroed pools
                for t in pools[name].kv_buffer:
                    t.zero_()
            _get_back(backend, pools, keys, saved, kv_skip=1, swa_skip=1)
            assert reattached == [], "the idle backend was reaped and re-attached"
            beats = backend.beats
        assert not beats.thread.is_alive()  # SGLang's detach closed the backend
    finally:
        d.close()


def test_a_call_without_a_reply_is_a_miss_only_after_a_fence(tmp_path: Path) -> None:
    """The daemon is stopped (SIGSTOP) under a ``batch_get_v2``: the call gets no reply. When
    the daemon answers the fence after it (it copies inline, in order, so the late get's copy is
    done by then) the call is a miss; while the fence gets no reply either, the call does not
    return (the daemon may still write those pages), until the daemon answers, or its process is
    gone. The backend works on after a stall."""
    import signal
    import threading

    d = _daemon(tmp_path)
    try:
        with engine(d.address, hicache_timeout=1.0) as (backend, pools):
            keys = _keys(3, seed=91)
            saved = _put(backend, pools, keys, seed=91, kv_skip=0, swa_skip=0)
            kv_idx = _alloc(pools["kv"], 3, skip=1)
            swa_idx = _alloc(pools["swa"], 3, skip=1)
            os.kill(d.pid, signal.SIGSTOP)
            resume = threading.Timer(1.2, os.kill, (d.pid, signal.SIGCONT))
            resume.start()
            try:
                got = backend.batch_get_v2(_transfers(keys, kv_idx, swa_idx))
            finally:
                resume.join()
            # one call per pool: the first got no reply (a miss after the fence); the daemon
            # was back for the others
            first = KV_DERIVED[0]
            assert got == {n: [n != first] * 3 for n in KV_DERIVED + SWA_INDEXED}, got
            # the late copies landed before the fence's answer: nothing can write these later
            dst = _page_rows(kv_idx)
            assert all(torch.equal(t[dst], saved["deepseek_v4_c4"][i])
                       for i, t in enumerate(pools["deepseek_v4_c4"].kv_buffer))
            # stopped for longer than a fence: the call does not return (SGLang would take any
            # exception for a miss and reuse the pages under the daemon's late copy)
            os.kill(d.pid, signal.SIGSTOP)
            out: list = []
            t = threading.Thread(target=lambda: out.append(
                backend.batch_get_v2(_transfers(keys, kv_idx, swa_idx))))
            try:
                t.start()
                t.join(3.5)  # 3 fences of 1 s went unanswered
                assert t.is_alive() and not out
            finally:
                os.kill(d.pid, signal.SIGCONT)
            t.join(30)
            assert not t.is_alive() and out and out[0][first] == [False] * 3, out
            assert backend.batch_get_v2(_transfers(keys, kv_idx, swa_idx)) == \
                {n: [True] * 3 for n in KV_DERIVED + SWA_INDEXED}
            # a daemon that is gone copies nothing later: its stalled call is a miss at once
            os.kill(d.pid, signal.SIGSTOP)
            t0 = time.monotonic()
            t = threading.Thread(target=lambda: out.append(
                backend.batch_get_v2(_transfers(keys, kv_idx, swa_idx))))
            t.start()
            time.sleep(1.5)
            os.kill(d.pid, signal.SIGKILL)
            d.proc.wait(10)
            t.join(30)
            assert not t.is_alive() and out[-1][first] == [False] * 3, out
            assert time.monotonic() - t0 < 10
    finally:
        d.close()


def test_a_clear_does_not_wait_for_a_stalled_call(tmp_path: Path) -> None:
    """SGLang calls the backend's ``clear`` on its scheduler thread; it waited for the
    backend's lock, which a call whose daemon stopped answering holds until the daemon answers
    (an SGLang review): the whole server stood still. It now waits at most the call timeout,
    then refuses in one line; once the lock is free it clears."""
    import threading

    from hicache.engine.sglang.storage import StorageRefused

    d = _daemon(tmp_path)
    try:
        with engine(d.address, hicache_timeout=1.0) as (backend, pools):
            held, done = threading.Event(), threading.Event()

            def stalled() -> None:  # as ``_fence`` holds it while the daemon is silent
                with backend.lock:
                    held.set()
                    done.wait(10)

            t = threading.Thread(target=stalled)
            t.start()
            held.wait(5)
            t0 = time.monotonic()
            try:
                with pytest.raises(StorageRefused, match="clear: another call of this backend "
                                                         "has waited over 1 s"):
                    backend.clear()
                assert 0.9 < time.monotonic() - t0 < 3
            finally:
                done.set()
                t.join()
            backend.clear()  # the lock is free: cleared
    finally:
        d.close()


def test_hit_policies_and_refusals(tmp_path: Path) -> None:
    d = _daemon(tmp_path)
    try:
        keys = _keys(4, 5)
        with engine(d.address) as (backend, pools):
            _fill(pools, seed=3)
            kv_idx = _alloc(pools["kv"], 4, skip=0)
            swa_idx = _alloc(pools["swa"], 4, skip=0)
            assert backend.batch_set_v1(keys, kv_idx) == [True] * 4
            assert backend.batch_set_v2([PoolTransfer(name="deepseek_v4_c4", host_indices=kv_idx,
                                                      keys=keys)]) == {"deepseek_v4_c4": [True] * 4}
            # SWA pages only for keys 1 and 3 (a window store, as SGLang keeps trailing pages)
            for i in (1, 3):
                one = swa_idx[i * F.PAGE:(i + 1) * F.PAGE]
                assert backend.batch_set_v2([PoolTransfer(name="swa", host_indices=one,
                                                          keys=keys[i:i + 1])]) == {"swa": [True]}
            all_pages, trailing = PoolHitPolicy.ALL_PAGES, PoolHitPolicy.TRAILING_PAGES
            c4 = PoolTransfer(name="deepseek_v4_c4", keys=keys, hit_policy=all_pages)
            trail = PoolTransfer(name="swa", keys=keys[-1:], hit_policy=trailing)
            every = PoolTransfer(name="swa", keys=keys, hit_policy=all_pages)
            r = backend.batch_exists_v2(keys, [c4, trail])
            assert (r.kv_hit_pages, r.restorable_prefix_pages) == (4, [2, 4])
            assert r.extra_pool_hit_pages == {"kv": 4, "deepseek_v4_c4": 4, "swa": 4}
            r = backend.batch_exists_v2(keys, [c4, every])
            assert (r.kv_hit_pages, r.restorable_prefix_pages) == (0, [])
            # the daemon forgets this client's pools (as after a heartbeat reap): re-attached
            assert backend.client.kv_detach() == len(pools)
            assert backend.batch_exists(keys) == 4
            with pytest.raises(StorageRefused, match="block_groups|BLOCK_GROUPS"):
                backend.batch_exists_v2(keys, [PoolTransfer(
                    name="swa", keys=keys, hit_policy=PoolHitPolicy.BLOCK_GROUPS)])
            with pytest.raises(StorageRefused, match="has no hicache pool"):
                backend.register_mem_host_pool_v2(pools["deepseek_v4_c4"], "mamba")
            with pytest.raises(StorageRefused, match="holds no bytes"):
                backend.register_mem_host_pool_v2(pools["kv"], "swa_again")
            with pytest.raises(StorageRefused, match="tensor get/set"):
                backend.get(keys[0])
            # a misaligned index batch fails the call (logged), moves nothing
            before = [t.clone() for t in pools["deepseek_v4_c4"].kv_buffer]
            assert backend.batch_get_v2([PoolTransfer(name="deepseek_v4_c4",
                                                      host_indices=kv_idx[1:F.PAGE + 1],
                                                      keys=keys[:1])]) == \
                {"deepseek_v4_c4": [False]}
            after = pools["deepseek_v4_c4"].kv_buffer
            assert all(torch.equal(a, b) for a, b in zip(before, after))
        cfg = HiCacheStorageConfig(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0,
                                   attn_cp_size=1, is_mla_model=True,
                                   enable_storage_metrics=False, is_page_first_layout=False,
                                   model_name=None)
        for bad, why in [({"interface_v1": 0}, "zero-copy only"),
                         ({"allocator": "default"}, "allocator"),
                         ({"bogus": 1}, "unknown extra config"),
                         ({"hicache_l3_wait": -1}, "hicache_l3_wait"),
                         ({"hicache_l3_wait": "5"}, "hicache_l3_wait"),
                         ({"hicache_attach": "proc"}, "hicache_attach must be one of"),
                         # a placeholder it does not fill: one line, not a bare KeyError
                         ({"hicache_socket": d.address + "{dp_rank}"},
                          r"only \{tp_rank\} and \{pp_rank\} are filled in \(KeyError")]:
            cfg.extra_config = {**EXTRA, "hicache_socket": d.address, **bad}
            with pytest.raises(StorageRefused, match=why) as e:
                StorageBackendFactory.create_backend("dynamic", cfg, None)
            assert "\n" not in str(e.value)
        # an MLA model with TP > 1: SGLang stores from TP rank 0 only and takes the least hit
        # count over the ranks, so a daemon per rank would never hit; one shared daemon is fine
        cfg.tp_size, cfg.tp_rank = 2, 1
        cfg.extra_config = {**EXTRA, "hicache_socket": d.address + "{tp_rank}"}
        with pytest.raises(StorageRefused, match="must share one daemon") as e:
            StorageBackendFactory.create_backend("dynamic", cfg, None)
        assert "\n" not in str(e.value)
        cfg.extra_config = {**EXTRA, "hicache_socket": d.address}
        StorageBackendFactory.create_backend("dynamic", cfg, None).close()
        cfg.tp_size, cfg.tp_rank = 1, 0
        # the daemon kept nothing of the refused calls: the store holds what the test put
        with Client(d.address) as c:
            st = c.call("stats", {"check": True})[0]
        assert st["invariants"] == "ok"
        assert st["kv_store"]["entries"] == {"page": 4, "swa_page": 2, "req_slot": 0}
    finally:
        d.close()


def _l3_daemon(tmp: Path) -> DaemonProcess:
    """The daemon of ``_daemon`` with ``--l3 mooncake``, run by the main environment's Python."""
    d = DaemonProcess(device=DEVICE, preset="dsv4-tiny", device_rows=F.DEVICE_ROWS,
                      host=("--host-ratio", "2"), heartbeat_timeout=10.0, metrics_port=0,
                      extra=("--no-mtp", "--c128-state", "offline", "--l3", "mooncake",
                             "--l3-master", L3["master"], "--l3-metadata", L3["metadata"],
                             "--l3-scope", "test/dsv4-tiny@1"),
                      env=l3_master.loopback_env(), log_path=str(tmp / "daemon.log"), cwd=ROOT,
                      ready_timeout=60)
    d.cmd[0] = L3["python"]
    return d.start()


def _l3_settled(address: str, timeout: float = 30.0) -> None:
    """L3 online and no write-through in flight."""
    with Client(address) as c:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            s = c.stats()
            kv = s.get("kv_store", {}).get("l3", {})
            if s["l3"]["online"] and not kv.get("pinned") and not s["l3"]["put_queue_pages"]:
                return
            time.sleep(0.05)
        raise AssertionError(f"L3 not settled: {c.stats().get('l3')}")


@pytest.mark.skipif(L3 is None, reason="HICACHE_TEST_L3 not set (test_sglang_adapter sets it)")
def test_storage_backend_survives_a_daemon_restart_through_l3(tmp_path: Path) -> None:
    d = _l3_daemon(tmp_path)
    try:
        keys = _keys(3, 4242)
        _l3_settled(d.address)
        with engine(d.address, namespace="l3-restart") as (backend, pools):
            saved = _put(backend, pools, keys, seed=23, kv_skip=2, swa_skip=1)
            _l3_settled(d.address)
        d.kill()  # the daemon crashes: its host rows are gone, the store keeps the pages
        d.start()
        _l3_settled(d.address)
        with engine(d.address, namespace="l3-restart") as (backend, pools):
            assert backend.batch_exists(keys + _keys(1, 77_777)) == 3
            _get_back(backend, pools, keys, saved, kv_skip=0, swa_skip=3)
        with Client(d.address) as c:
            st = c.call("stats", {"check": True})[0]
        assert st["invariants"] == "ok"
        hits = [x["value"] for x in st["metrics"]["hicache_l3_pages_total"]
                if x["labels"].get("result") == "prefetch_hit"]
        assert hits == [3 * (1 + len(KV_DERIVED + SWA_INDEXED))]  # every page came from L3
    finally:
        d.close()


def test_a_re_attach_after_a_daemon_restart_watches_the_new_daemon(tmp_path: Path) -> None:
    """The fence tells a stalled daemon from a gone one by its process: after a restart at
    the same address (the backend re-attaches at its next call) it must watch the new
    daemon's process, not the old one's, which is gone (a stalled call of the new daemon
    would be a miss at once, while that daemon may still copy into the pages)."""
    d = _daemon(tmp_path)
    try:
        with engine(d.address, hicache_timeout=5.0) as (backend, pools):
            first = d.pid
            assert backend.daemon_pid == first
            d.restart()
            assert d.pid != first
            _put(backend, pools, _keys(3, seed=321), seed=4, kv_skip=0, swa_skip=0)  # re-attaches
            assert backend.daemon_pid == d.pid and backend.daemon_start is not None
    finally:
        d.close()


def test_the_fence_trusts_the_daemons_pid_only_where_it_names_the_daemon(tmp_path: Path) -> None:
    """From another pid namespace the daemon's pid can name an unrelated process here: the
    fence then took the daemon for gone as soon as that process exited, and a stalled daemon's
    late copy could land in pages SGLang had reused (a review showed it with a stand-in). The
    heartbeat also gives the daemon's start time, the same from every namespace, and a pid
    whose process here started at another time is "not visible": a stalled call waits."""
    import subprocess
    import sys

    from hicache.core.proc_start import process_start

    d = _daemon(tmp_path)
    try:
        with engine(d.address, hicache_timeout=5.0) as (backend, pools):
            with backend.lock:
                hb = backend.client.heartbeat()
            assert hb["pid"] == d.pid and hb["pid_start"] == process_start(d.pid) is not None
            assert backend.daemon_start == hb["pid_start"]
            other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
            try:  # the daemon's number, as another namespace gives it, names this process here
                backend._watch({**hb, "pid": other.pid})
                assert backend.daemon_pid == other.pid and backend.daemon_start is None
            finally:
                other.kill()
                other.wait()
            backend._watch({**hb, "pid_start": None})  # a daemon that does not say: not trusted
            assert backend.daemon_start is None
            backend._watch(hb)
            assert backend.daemon_start == hb["pid_start"]
    finally:
        d.close()


def _storage_config(**kw: Any) -> HiCacheStorageConfig:
    base = dict(tp_rank=0, tp_size=1, pp_rank=0, pp_size=1, attn_cp_rank=0, attn_cp_size=1,
                is_mla_model=True, enable_storage_metrics=False, is_page_first_layout=False,
                model_name="dsv4")
    return HiCacheStorageConfig(**{**base, **kw})


def test_context_parallel_ranks_and_dcp_shards_get_namespaces_of_their_own(
        tmp_path: Path) -> None:
    """Each attention-CP rank holds a disjoint slice of every page, and each DCP shard its own
    part: SGLang's file backend keys them apart, and so must the namespace (one name for all
    would serve one rank's bytes to the others as hits). End to end: CP rank 1 reads back its
    own bytes after rank 0 stored other bytes under the same keys."""
    from hicache.engine.sglang.storage import _namespace
    from sglang.srt.mem_cache.hicache_storage import HiCacheFile

    for a, b in (((_storage_config(attn_cp_rank=0, attn_cp_size=2),
                   _storage_config(attn_cp_rank=1, attn_cp_size=2))),
                 tuple(_storage_config(tp_rank=r, tp_size=2, dcp_size=2, dcp_rank=r,
                                       logical_page_size=256) for r in (0, 1))):
        fa = HiCacheFile(a, file_path=str(tmp_path / "hf"))
        fb = HiCacheFile(b, file_path=str(tmp_path / "hf"))
        assert fa.config_suffix != fb.config_suffix  # SGLang's own keys differ
        assert _namespace(a, {}) != _namespace(b, {})
    assert _namespace(_storage_config(), {}) == "dsv4/pp0of1"  # unchanged without CP/DCP
    # DP ranks write the same pages (as SGLang's file backend keys them: no DP rank), so they
    # share a namespace, and a prefix one stored in L3 is a hit for the others
    dp = [HiCacheFile(_storage_config(dp_rank=r), file_path=str(tmp_path / "hf")) for r in (0, 1)]
    assert dp[0].config_suffix == dp[1].config_suffix
    assert _namespace(_storage_config(dp_rank=1), {}) == _namespace(_storage_config(), {})
    from hicache.engine.sglang.storage import StorageRefused
    with pytest.raises(StorageRefused, match="at most 256 printable"):  # when made: the first
        _namespace(_storage_config(), {"hicache_namespace": "m" * 250})  # attach refused it
    d = _daemon(tmp_path)
    try:
        with engine(d.address) as (_, pools):
            extra = {**EXTRA, "hicache_socket": d.address, "hicache_namespace": "cp"}
            ranks = [HicacheStorage(_storage_config(attn_cp_rank=r, attn_cp_size=2,
                                                    extra_config=extra)) for r in (0, 1)]
            try:
                for b in ranks:
                    b.register_mem_pool_host(pools["kv"])
                    b.register_mem_host_pool_v2(pools["deepseek_v4_c4"], "deepseek_v4_c4")
                keys = _keys(2, seed=555)
                idx = _alloc(pools["kv"], 2, skip=0)
                rows = _page_rows(idx)
                c4 = pools["deepseek_v4_c4"].kv_buffer
                stored = {}
                for r, b in enumerate(ranks):  # each rank's own slice, under the same keys
                    for t in c4:
                        t[rows] = 10 + r
                    stored[r] = [t[rows].clone() for t in c4]
                    got = b.batch_set_v2([PoolTransfer(name="deepseek_v4_c4", host_indices=idx,
                                                       keys=keys)])
                    assert got == {"deepseek_v4_c4": [True, True]}
                for t in c4:
                    t[rows] = 0
                got = ranks[1].batch_get_v2([PoolTransfer(name="deepseek_v4_c4",
                                                          host_indices=idx, keys=keys)])
                assert got == {"deepseek_v4_c4": [True, True]}
                assert all(torch.equal(t[rows], s) for t, s in zip(c4, stored[1]))
            finally:
                for b in ranks:
                    b.close()
    finally:
        d.close()


def test_a_fence_takes_a_pid_that_now_names_a_later_process_for_gone() -> None:
    """The daemon's pid, once watched, may name another process later (the daemon exited and
    the pid was reused): the start time differs, so at the first unanswered fence the daemon is
    gone and the call a miss. Where the pid still names the watched process the fence asks
    again until the daemon answers."""
    import subprocess
    import sys

    from hicache.core.proc_start import process_start
    from hicache.engine.client import DaemonUnreachable, NoReply

    class Silent:  # answers the fourth heartbeat (a fence that never ends would hang the test)
        def __init__(self) -> None:
            self.tries = 0

        def heartbeat(self) -> dict:
            self.tries += 1
            if self.tries < 4:
                raise DaemonUnreachable("no answer")
            return {}

    other = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(other.pid)
        assert start is not None
        for watched, tries in ((start - 1, 1), (start, 4)):  # (reused pid, the same process)
            backend = HicacheStorage.__new__(HicacheStorage)
            backend.client = Silent()
            backend.daemon_pid, backend.daemon_start = other.pid, watched
            backend._fence("get", NoReply("no reply"))
            assert backend.client.tries == tries, (watched, backend.client.tries)
    finally:
        other.kill()
        other.wait()
