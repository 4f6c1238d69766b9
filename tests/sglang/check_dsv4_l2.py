"""SGLang 0.5.23's own UnifiedRadixCache + DSV4 HiCache stack, with the daemon as its L2 (CPU).

Runs inside the sglang environment (``tests/test_sglang_adapter.py`` launches it). Per test:
a real ``hicache serve`` (CPU, dsv4-tiny, --no-mtp, --c128-state offline) per PP stage,
``hicache.engine.sglang.install``, SGLang's DSV4 device pool, allocator and radix tree, then
insert -> backup (SGLang's write path) -> device eviction (SGLang's evict) -> load-back
(SGLang's load path, per layer) and a byte comparison of every DSV4 pool: each loaded device row
equals the row written before the backup, and every other device row is untouched.
"""
from __future__ import annotations

import contextlib
import os
import unittest
from pathlib import Path
from typing import Any, Iterator

import pytest
import torch

import dsv4_fixture as F
from conftest import start_daemon
from sglang_gpu_shapes import commands_sent
from hicache.engine import sglang as hs
from hicache.engine.sglang.version import UnsupportedSglang, check_sglang_version

from sglang.srt.mem_cache.base_prefix_cache import EvictParams
from sglang.srt.mem_cache.unified_cache.components.base import ComponentType as CT
from sglang.test.kits.unified_radix_cache.config import CacheConfig
from sglang.test.kits.unified_radix_cache.fixtures import (match_prefix, node_device_value,
                                                           node_host_value)
from sglang.test.kits.unified_radix_cache.mixins import UnifiedRadixCacheFixtures

# cpu (CI) or cuda:N (the GPU machine: scripts/gpu_sglang.sh); the daemon serves the same device
DEVICE = os.environ.get("HICACHE_SGLANG_TEST_DEVICE", "cpu")
PAGE_POOLS = ("c4_kv", "c4_indexer", "c128_kv")
SWA_POOLS = ("swa_kv", "c4_state", "c4_indexer_state")


class Kit(UnifiedRadixCacheFixtures, unittest.TestCase):
    """SGLang's shipped test steps (insert, backup, load-back) on our DSV4 stack."""

    cfg = CacheConfig(page_size=F.PAGE, components=(CT.FULL, CT.SWA), sliding_window_size=128,
                      num_layers=len(F.RATIOS), full_attention_layer_ids=())


def _rows(v: torch.Tensor | None) -> list[int]:
    return [] if v is None else (v.reshape(-1, F.PAGE)[:, 0] // F.PAGE).tolist()


def _fill(link: Any, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for ts in link.stage.layers.values():
        for t in ts:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def _daemon(tmp: Path, pp_size: int, rank: int, heartbeat_timeout: float = 10.0) -> Any:
    return start_daemon(tmp, device=DEVICE, preset="dsv4-tiny", device_rows=F.DEVICE_ROWS,
                        metrics=False, heartbeat_timeout=heartbeat_timeout,
                        extra=("--no-mtp", "--c128-state", "offline", "--pp-size", str(pp_size),
                               "--pp-rank", str(rank)))


@contextlib.contextmanager
def _installed(tmp: Path, heartbeat_timeout: float = 10.0,
               **install: Any) -> Iterator[tuple[Any, Any]]:
    """A one-stage daemon and the adapter installed against it: (daemon, installation);
    both undone at the end."""
    d = _daemon(tmp, 1, 0, heartbeat_timeout)
    inst = None
    try:
        inst = hs.install("dsv4-tiny", address=d.address, **install)
        yield d, inst
    finally:
        if inst is not None:
            inst.uninstall()
        d.close()


def _round_trip(kit: Kit, link: Any, cache: Any, alloc: Any, r2t: Any, seed: int) -> int:
    """insert -> backup -> evict -> load back -> bytes; returns the SWA pages verified."""
    seq = kit._make_seq(1 + seed * 10_000, 3)
    kit._insert(cache, alloc, r2t, seq)
    chain = kit._path_chain(cache, match_prefix(cache, seq).last_device_node)
    full_old = [r for n in chain for r in _rows(node_device_value(cache, n, CT.FULL))]
    swa_old = [r for n in chain for r in _rows(node_device_value(cache, n, CT.SWA))]
    assert len(full_old) == 3 and len(swa_old) == 3
    _fill(link, seed)
    before = {p: [t.clone() for t in ts] for p, ts in link.stage.layers.items()}

    with commands_sent(link, "backup") as backups:
        kit._backup_tree(cache)  # SGLang's write path -> our pools -> daemon backup
    # each of SGLang's submissions went to the daemon as one backup of every pool
    assert backups and all(b == sorted(PAGE_POOLS + SWA_POOLS) for b in backups), backups
    for n in chain:
        assert node_host_value(cache, n, CT.FULL) is not None

    got = cache.evict(EvictParams(num_tokens=3 * F.PAGE, swa_num_tokens=3 * F.PAGE))
    assert got.num_tokens_evicted == 3 * F.PAGE
    assert all(node_device_value(cache, n, CT.FULL) is None for n in chain)
    for ts in link.stage.layers.values():  # what the device had is gone
        for t in ts:
            t.zero_()

    kit._insert(cache, alloc, r2t, kit._make_seq(900_000 + seed, 3))  # takes the freed pages
    m = match_prefix(cache, seq)
    assert m.host_hit_length == 3 * F.PAGE
    with commands_sent(link, "load") as loads:
        kit._load_back_node(cache, chain[-1])  # SGLang's load path, per layer
    # SGLang's one submission went to the daemon as one load of every pool
    assert loads == [sorted(PAGE_POOLS + SWA_POOLS)], loads
    full_new = [r for n in chain for r in _rows(node_device_value(cache, n, CT.FULL))]
    swa_new = {i: r for i, n in enumerate(chain)
               for r in _rows(node_device_value(cache, n, CT.SWA))}
    assert len(full_new) == 3 and set(full_new).isdisjoint(full_old), (full_old, full_new)
    loaded_swa = [(swa_old[i], r) for i, r in swa_new.items()] if len(swa_new) == len(chain) \
        else [(swa_old[-1], _rows(node_device_value(cache, chain[-1], CT.SWA))[-1])]
    assert loaded_swa, "SGLang loaded no SWA page"

    for pool, pairs in [(p, list(zip(full_old, full_new))) for p in PAGE_POOLS] + \
                       [(p, loaded_swa) for p in SWA_POOLS]:
        for layer, t in enumerate(link.stage.layers[pool]):
            touched = set()
            for old, new in pairs:
                assert torch.equal(t[new], before[pool][layer][old]), \
                    f"{pool} layer {layer}: device row {new} != row {old} before backup"
                touched.add(new)
            rest = [r for r in range(t.shape[0]) if r not in touched]
            assert int(t[rest].count_nonzero()) == 0, f"{pool} layer {layer}: other rows changed"
    c128_state = link.stage.layers["c128_state"]
    assert all(int(t.count_nonzero()) == 0 for t in c128_state)  # SGLang never moves it
    return len(loaded_swa)


def test_single_stage_round_trip(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.engine.sglang import assembler_patch

    submitted: list[tuple[str, bool]] = []  # (kind, defer) of each submission SGLang made
    real = assembler_patch.submission

    def recorded(link: Any, kind: str, transfers: Any, defer: bool = False) -> Any:
        submitted.append((kind, defer))
        return real(link, kind, transfers, defer)

    monkeypatch.setattr(assembler_patch, "submission", recorded)
    d = _daemon(tmp_path, 1, 0)
    inst = None
    try:
        inst = hs.install("dsv4-tiny", address=d.address, forward_waits=True)
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        link = inst.links[0]
        # the controller's layer counter (what SGLang's forward waits on) waits for the link's
        # deferred GPU loads (``layer_waits``)
        counter = cache.cache_controller.layer_done_counter
        assert link.layer_waits.counter is counter
        assert getattr(counter.wait_until, "__hicache__", False)
        assert kv.layer_transfer_counter is counter
        assert sorted(link.stage.layers) == sorted(link.layout.pools)
        for e in cache.cache_controller.mem_pool_host.entries:  # no host bytes in SGLang
            assert e.host_pool.kv_buffer is None, e.name
        # SGLang's token-granular backup (its HiSparse coordinator's) is refused in one line,
        # before anything is sent (it used to reach SGLang's copy over host pointers of None)
        paged = [e.host_pool for e in cache.cache_controller.mem_pool_host.entries
                 if type(e.host_pool).__name__ == "DaemonPagedHostPool"]
        assert len(paged) == 4  # SWA, C4, C4 indexer, C128
        with commands_sent(link, "backup") as sent:
            for pool in paged:
                with pytest.raises(ValueError, match=r"whole pages only \(token-granular"):
                    pool.backup_tokens_from_device_all_layer(torch.arange(3), torch.arange(3))
        assert sent == []
        assert _round_trip(Kit(), link, cache, alloc, r2t, seed=1) >= 1
        # SGLang's ``start_loading`` passes ``on_layer_done``: its load is the one the forward
        # may wait for (on CPU its ack came with the reply, so nothing is kept; the deferred
        # path itself runs in the CUDA test, with a stand-in of this counter)
        assert ("loads", True) in submitted, submitted
        assert link.layer_waits.pending() == {}
        # SGLang's flush_cache resets the tree and clears its host pools: the tree forgot every
        # host node, so the daemon rows behind them go back (they used to stay allocated:
        # every flush shrank the host tier for good)
        assert link.free_rows("page") < link.capacity("page")
        cache.reset()
        assert link.free_rows("page") == link.capacity("page")
        assert link.free_rows("swa_page") == link.capacity("swa_page")
        with link.lock:  # the link's heartbeat thread shares the client
            spaces = link.client.stats()["host"]["spaces"]
        assert spaces["page"]["used"] == spaces["swa_page"]["used"] == 0, spaces
    finally:
        if inst is not None:
            inst.uninstall()
        d.close()


def test_forward_waits_is_refused_on_a_pd_decode_server(tmp_path: Path,
                                                        monkeypatch: pytest.MonkeyPatch) -> None:
    """A PD decode server reads its local restores from the load's completion event, with no
    forward wait to check the ack: ``forward_waits`` is refused there in one line, before the
    worker registers; without it the same server builds."""
    from types import SimpleNamespace

    import sglang.srt.runtime_context as rc

    monkeypatch.setattr(rc, "get_disagg", lambda: SimpleNamespace(disaggregation_mode="decode"))
    d = _daemon(tmp_path, 1, 0)
    try:
        for waits in (True, False):
            inst = hs.install("dsv4-tiny", address=d.address, forward_waits=waits)
            try:
                if waits:
                    with pytest.raises(ValueError, match="forward_waits does not apply to a PD "
                                                         "decode server") as e:
                        F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
                    assert "\n" not in str(e.value) and inst.links == []
                    with d.client() as probe:  # nothing registered with the daemon
                        assert int(probe.stats().get("workers", 0)) == 0
                else:
                    F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
                    assert len(inst.links) == 1 and inst.links[0].layer_waits.counter is None
            finally:
                inst.uninstall()
    finally:
        d.close()


def test_pp_stages_round_trip(tmp_path: Path) -> None:
    """Two PP stages, one daemon each; each stage's pools map to its own local layer ids."""
    ds: list[Any] = []
    inst = None
    try:
        for r in range(2):
            ds.append(_daemon(tmp_path, 2, r))
        inst = hs.install("dsv4-tiny", address=lambda r: ds[r].address, pp_size=2)
        for r, (s, e) in enumerate(((0, 3), (3, 6))):
            cache, alloc, r2t, kv = F.build_dsv4_cache(s, e, DEVICE)
            link = inst.links[r]
            assert (link.layout.stage.start, link.layout.stage.end) == (s, e)
            # without ``forward_waits`` (the default) SGLang's layer counter is its own
            assert link.layer_waits.counter is None
            assert not getattr(cache.cache_controller.layer_done_counter.wait_until,
                               "__hicache__", False)
            fam = link.layout.stage.families
            assert fam["c4"] == tuple(g for g in range(s, e) if F.RATIOS[g] == 4)
            assert _round_trip(Kit(), link, cache, alloc, r2t, seed=2 + r) >= 1
    finally:
        if inst is not None:
            inst.uninstall()
        for d in ds:
            d.close()


def test_the_default_stage_split_is_sglangs(monkeypatch: pytest.MonkeyPatch) -> None:
    """A daemon's default stages (``--pp-size`` / ``--pp-rank``, no ``--stage-bounds``) are the
    ones SGLang runs: with 43 or 61 layers our split gave the extra layers to the first stages
    and SGLang to the last, so ``install`` refused every PP worker of DSV4-Flash and -Pro.
    ``install`` itself takes SGLang's split, a partition in the environment included."""
    from hicache.core.layout import stage_bounds
    from hicache.engine.sglang.assembler_patch import sglang_stages

    monkeypatch.delenv("SGLANG_PP_LAYER_PARTITION", raising=False)
    for n in (6, 7, 43, 61):
        for pp in range(1, 5):
            assert stage_bounds(n, pp) == sglang_stages(n, pp), (n, pp)
    monkeypatch.setenv("SGLANG_PP_LAYER_PARTITION", "22,21")
    assert sglang_stages(43, 2) == [(0, 22), (22, 43)]


def test_sglangs_shutdown_unregisters_the_worker(tmp_path: Path) -> None:
    """SGLang's shutdown (``release_host_resources``: each host pool's ``destroy``) did
    nothing: the worker stayed registered until the daemon reaped it as dead. Now it
    unregisters at once, and a second ``destroy`` (every pool shares the link) does nothing."""
    with _installed(tmp_path) as (d, inst):
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        link = inst.links[0]
        with d.client(name="watch") as w:
            assert w.stats()["workers"] == 1
            cache.release_host_resources()
            assert link.closed
            assert w.stats()["workers"] == 0
            cache.release_host_resources()  # once more: nothing to undo, nothing raised
            assert "reaped" not in d.output()


def test_sglangs_shutdown_goes_on_when_the_daemon_is_gone(tmp_path: Path,
                                                          caplog: pytest.LogCaptureFixture) -> None:
    """A daemon stopped before SGLang is a normal order: the unregister of SGLang's shutdown
    raised ``DaemonGone`` out of ``release_host_resources``, which cut SGLang's own clean-up.
    Now it is one warning and the shutdown goes on."""
    import logging
    import time

    with _installed(tmp_path) as (d, inst):
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        d.kill()
        t0 = time.monotonic()
        with caplog.at_level(logging.WARNING, logger="hicache.sglang"):
            cache.release_host_resources()
        assert time.monotonic() - t0 < 5
        assert inst.links[0].closed
        assert any("unregistering at shutdown failed" in r.getMessage() for r in caplog.records)


def test_a_second_worker_on_one_daemon_is_refused(tmp_path: Path) -> None:
    """TP ranks sharing one daemon (a socket template without ``{gpu}``) were both registered,
    and each one's ``available_size`` counted its own rows only, so SGLang skipped write-throughs
    on one rank (forty-sixth session's review). The second is refused, and leaves nothing."""
    with _installed(tmp_path) as (d, inst):
        F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        with pytest.raises(ValueError, match="needs a daemon of its own"):
            F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        with d.client(name="watch") as w:
            assert w.stats()["workers"] == 1 and len(inst.links) == 1


def test_a_hung_daemon_holds_neither_available_size_nor_the_shutdown(tmp_path: Path) -> None:
    """A heartbeat in flight to a daemon that stopped answering held the link's lock for the
    whole call timeout (5 s by default; 2.5 s here): SGLang's ``available_size``, which needs
    no daemon, waited behind it, and its shutdown took the timeout plus the unregister's 2 s
    (6.5 s). Now a heartbeat waits at most 1 s and the rows held have a lock of their own."""
    import os
    import signal
    import time

    with _installed(tmp_path, heartbeat_timeout=5.0, timeout=2.5) as (d, inst):
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        link = inst.links[0]
        os.kill(d.pid, signal.SIGSTOP)
        try:
            c, sent = link.client, link.client.sent
            deadline = time.monotonic() + 15
            while c.sent == sent and time.monotonic() < deadline:
                time.sleep(0.02)  # the heartbeat thread sends one, which waits for its reply
            assert c.sent > sent
            time.sleep(0.1)
            t0 = time.monotonic()
            assert link.free_rows("page") == link.capacity("page")
            assert time.monotonic() - t0 < 0.3
            t0 = time.monotonic()
            cache.release_host_resources()
            assert time.monotonic() - t0 < 4.0 and link.closed
        finally:
            os.kill(d.pid, signal.SIGCONT)


def test_a_storage_backend_is_refused_when_the_daemon_holds_the_host_tier(tmp_path: Path) -> None:
    """``--hicache-storage-backend`` beside the host-pool adapter started, and every storage
    backup then failed in SGLang's background thread (the host bytes are in the daemon). Now
    building the stack refuses it in one line, and nothing stays registered."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as A

    with _installed(tmp_path) as (d, inst):
        with pytest.raises(ValueError, match="--hicache-storage-backend file cannot read"):
            A.build_deepseek_v4_hicache_stack(params=None, kvcache=None, load_cache_event=None,
                                              storage_backend="file")
        assert inst.links == []


def test_a_storage_backend_attached_at_runtime_is_refused_too(tmp_path: Path) -> None:
    """SGLang's runtime attach (``/attach_hicache_storage_backend``) bypassed the build-time
    refusal: a backend other than ours attached, and its pages read the anchor pool's empty
    pages (an SGLang review). The built controller now refuses it: SGLang's attach answers
    with the adapter's line and enables nothing."""
    with _installed(tmp_path) as (d, inst):
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        ok, msg = cache.attach_storage_backend(storage_backend="file")
        assert not ok and "keeps the host tier in its daemon: storage backend file cannot " \
            "read its bytes" in msg, msg
        assert not cache.enable_storage
        assert inst.links[0].free_rows("page") == inst.links[0].capacity("page")


def test_a_daemon_that_lost_the_worker_is_logged_once(tmp_path: Path,
                                                      caplog: pytest.LogCaptureFixture) -> None:
    """The link's heartbeats ignored a reply saying the daemon no longer held the worker (a
    restarted daemon, a reap), so nothing said why SGLang's next host-tier call failed. Now
    one error line says so, and what to do. (Closing the link afterwards is not refused: its
    unregister's ``not_registered`` leaves nothing to undo.)"""
    import logging
    import time

    with _installed(tmp_path, heartbeat_timeout=3.0, timeout=1.0) as (d, inst):
        F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        link = inst.links[0]
        with caplog.at_level(logging.ERROR, logger="hicache.sglang"):
            with link.lock:
                link.client.unregister()  # what a restarted daemon's heartbeat reply says
            deadline = time.monotonic() + 3 * link.client.heartbeat_interval + 5
            while link.lost is None and time.monotonic() < deadline:
                time.sleep(0.05)
            time.sleep(2 * link.client.heartbeat_interval)
        assert link.lost is not None and "no longer holds this worker" in link.lost
        lines = [r.getMessage() for r in caplog.records if "host tier is gone" in r.getMessage()]
        assert len(lines) == 1, lines
        assert "Restart the SGLang server" in lines[0]


def test_a_heartbeat_error_of_any_type_is_a_warning_and_the_beats_go_on(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    """A heartbeat that fails with an error other than ``HicacheError`` (a reply this client
    cannot read, say) ended the heartbeat thread silently, and the daemon then reaped a live
    worker. Now it is one warning, the beats go on, and the recovery is logged."""
    import logging
    import time

    with _installed(tmp_path, heartbeat_timeout=3.0, timeout=1.0) as (d, inst):
        F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        link = inst.links[0]
        real = link.client.maybe_heartbeat
        calls = []

        def broken(*a: object, **kw: object) -> object:
            calls.append(1)
            raise ValueError("a reply this client cannot read")

        with caplog.at_level(logging.INFO, logger="hicache.sglang"):
            with link.lock:  # the silence the broken beats make starts now, not up to a
                link.client.heartbeat()  # beat interval earlier (3 s timeout: the slack)
            link.client.maybe_heartbeat = broken
            deadline = time.monotonic() + 10
            while len(calls) < 3 and time.monotonic() < deadline:
                time.sleep(0.02)
            assert len(calls) >= 3 and link.beats.thread.is_alive()
            assert isinstance(link.beats.error, ValueError)
            link.client.maybe_heartbeat = real
            deadline = time.monotonic() + 10
            while link.beats.error is not None and time.monotonic() < deadline:
                time.sleep(0.02)
        assert link.beats.error is None and link.lost is None
        msgs = [r.getMessage() for r in caplog.records]
        assert sum("a heartbeat to the daemon at" in m and "failed" in m for m in msgs) == 1, msgs
        assert any("answers heartbeats again" in m for m in msgs), msgs


def test_install_refuses_a_stage_the_daemon_does_not_serve(tmp_path: Path) -> None:
    d = _daemon(tmp_path, 2, 0)  # serves stage 0 of 2; the worker is the whole model
    inst = None
    try:
        inst = hs.install("dsv4-tiny", address=d.address)
        with pytest.raises(Exception, match="layout"):
            F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
    finally:
        if inst is not None:
            inst.uninstall()
        d.close()


def test_version_gate() -> None:
    assert check_sglang_version() == "0.5.23"
    with pytest.raises(UnsupportedSglang, match=r"supports sglang==0\.5\.23 only; found sglang 0\.5\.22"):
        check_sglang_version("0.5.22")


def test_layout_that_differs_from_sglang_is_refused_before_registration(tmp_path: Path) -> None:
    from hicache.core.layout import preset
    from hicache.engine.sglang.stage_map import LayoutMismatch

    d = _daemon(tmp_path, 1, 0)
    inst = None
    try:
        inst = hs.install(preset("dsv4-tiny").with_options(index_head_dim=64), address=d.address)
        with pytest.raises(LayoutMismatch, match=r"SGLang .*hicache"):
            F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        with d.client() as c:
            assert c.stats()["workers"] == 0  # nothing registered
        assert inst.links == []
    finally:
        if inst is not None:
            inst.uninstall()
        d.close()


def test_plugin_installs_from_the_environment(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from hicache.engine.sglang import plugin
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as A

    original = A.build_deepseek_v4_hicache_stack
    monkeypatch.delenv(plugin.ENV_MODEL, raising=False)
    assert plugin.load() is None and A.build_deepseek_v4_hicache_stack is original
    d = _daemon(tmp_path, 1, 0, heartbeat_timeout=90)  # (twice the 42 s call timeout below)
    monkeypatch.setenv(plugin.ENV_MODEL, "dsv4-tiny")
    monkeypatch.setenv(plugin.ENV_SOCKET, d.address)
    inst = None
    try:
        inst = plugin.load()
        cache, alloc, r2t, kv = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        pools = {str(e.name.value): type(e.host_pool).__name__
                 for e in cache.cache_controller.mem_pool_host.entries}
        assert pools == {"kv": "DaemonAnchorPool", "swa": "DaemonPagedHostPool",
                         "deepseek_v4_c4": "DaemonPagedHostPool",
                         "deepseek_v4_c4_indexer": "DaemonPagedHostPool",
                         "deepseek_v4_c128": "DaemonPagedHostPool",
                         "deepseek_v4_c4_state": "DaemonStateHostPool",
                         "deepseek_v4_c4_indexer_state": "DaemonStateHostPool"}
        assert len(inst.links) == 1
        assert all(link.client.timeout == 5.0 for link in inst.links)
        assert inst.links[0].layer_waits.counter is None  # (HICACHE_SGLANG_FORWARD_WAITS 0)
    finally:
        if inst is not None:
            inst.uninstall()
    # HICACHE_SGLANG_FORWARD_WAITS: 0 or 1, anything else refused in one line
    monkeypatch.setenv(plugin.ENV_FORWARD_WAITS, "yes")
    with pytest.raises(plugin.PluginFailed, match="HICACHE_SGLANG_FORWARD_WAITS must be 0 or 1"):
        plugin.load()
    assert A.build_deepseek_v4_hicache_stack is original
    monkeypatch.setenv(plugin.ENV_FORWARD_WAITS, "1")
    # HICACHE_SGLANG_TIMEOUT: the daemon calls' (and the copies' host waits') timeout
    monkeypatch.setenv(plugin.ENV_TIMEOUT, "abc")
    with pytest.raises(plugin.PluginFailed, match="HICACHE_SGLANG_TIMEOUT must be seconds"):
        plugin.load()
    monkeypatch.setenv(plugin.ENV_TIMEOUT, "0")
    with pytest.raises(plugin.PluginFailed, match="0.1..3600"):
        plugin.load()
    assert A.build_deepseek_v4_hicache_stack is original  # a refusal installs nothing
    monkeypatch.setenv(plugin.ENV_TIMEOUT, "42")
    inst = None
    try:
        inst = plugin.load()
        cache = F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)[0]
        assert [link.client.timeout for link in inst.links] == [42.0]
        assert inst.links[0].layer_waits.counter is cache.cache_controller.layer_done_counter
    finally:
        if inst is not None:
            inst.uninstall()
        d.close()
    assert A.build_deepseek_v4_hicache_stack is original


def test_a_plugin_that_cannot_install_stops_the_scheduler_through_sglangs_loader(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang's ``load_plugins`` logs and goes on past any ``Exception`` a plugin raises: the
    scheduler would run on SGLang's own host pools while hicache was asked for. A failed
    install is a ``SystemExit`` (``PluginFailed``), which that loader does not catch."""
    from hicache.engine.sglang import plugin
    from sglang.srt import plugins as sgl_plugins
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as A

    original = A.build_deepseek_v4_hicache_stack
    monkeypatch.setenv(plugin.ENV_MODEL, "dsv4-flsh")  # a mistyped preset
    monkeypatch.setattr(sgl_plugins, "_plugins_loaded", False)
    monkeypatch.setattr(sgl_plugins, "load_plugins_by_group",  # our entry point, as installed
                        lambda *a, **kw: {"hicache": (plugin.load, "hicache")})
    with pytest.raises(plugin.PluginFailed, match="dsv4-flsh"):
        sgl_plugins.load_plugins()
    assert A.build_deepseek_v4_hicache_stack is original


def test_a_call_timeout_past_the_daemons_heartbeat_timeout_is_refused(tmp_path: Path) -> None:
    """A host wait holds the link's lock, so the heartbeat thread sends nothing meanwhile: a
    call timeout near the daemon's heartbeat timeout let a long load get the worker reaped
    mid-load. Now one over half of it is refused when the stack is built, before anything is
    registered."""
    with _installed(tmp_path, timeout=6) as (d, inst):  # the daemon's heartbeat timeout: 10 s
        with pytest.raises(ValueError, match=r"call timeout \(6 s.*over half the daemon's "
                                             r"heartbeat timeout \(10 s\).*--heartbeat-timeout 12"):
            F.build_dsv4_cache(0, len(F.RATIOS), DEVICE)
        assert inst.links == []
        with d.client(name="watch") as w:
            assert w.stats()["workers"] == 0
