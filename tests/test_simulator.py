"""The simulated worker and the client hooks, against a live CPU-mode daemon (conftest fixture)."""
from __future__ import annotations

import os
import signal
import time

import pytest
import torch

from hicache.engine.hooks import ClientHooks, HostExhausted, HostUnavailable
from hicache.core.layout import build_layout, preset
from hicache.sim.page_content import PageContent
from hicache.engine.radix import PAGE_TOKENS, RadixTree
from hicache.sim.simulator import DemoMetrics, Worker, WorkerConfig
from hicache.sim.workload import Request, multi_turn

TINY_ROWS = "page=16,swa_page=16,req_slot=4"


def tiny_daemon(factory, rows=TINY_ROWS, ratio="4", swa="paged"):
    return factory(preset="dsv4-tiny", device_rows=rows, host=("--host-ratio", ratio, "--force"),
                   extra=("--swa-mode", swa))


def test_page_content_catches_any_wrong_byte():
    layout = build_layout(preset("dsv4-tiny"))
    pc = PageContent(layout, seed=1)
    spec = layout.pool("c4_kv")
    buf = torch.zeros(8, spec.page_bytes, dtype=torch.uint8)
    rows, ids = torch.tensor([1, 5, 6]), torch.tensor([10, 11, 12])
    pc.fill("c4_kv", 0, buf, rows, ids)
    assert pc.mismatches("c4_kv", 0, buf, rows, ids) == 0
    assert pc.mismatches("c4_kv", 1, buf, rows, ids) > 0  # another layer's content differs
    assert pc.mismatches("c4_kv", 0, buf, rows, torch.tensor([10, 12, 11])) > 0  # swapped pages
    buf[5, spec.scale_offset + 3] ^= 0x40
    assert pc.mismatches("c4_kv", 0, buf, rows, ids) == 1
    assert PageContent(layout, seed=1).mismatches("c4_kv", 0, buf, rows[:1], ids[:1]) == 0


def test_device_only_worker_accounts_every_token():
    cfg = WorkerConfig(device_pages=64, host_pages=0)
    w = Worker(cfg)  # no daemon: device tier only
    try:
        reqs = multi_turn(40, seed=1)
        r = w.run(reqs)
        assert r.requests == 40
        assert r.device_hit_tokens + r.host_hit_tokens + r.miss_tokens == r.input_tokens
        assert r.host_hit_tokens == 0 and r.device_hit_tokens == r.device_only_hit_tokens > 0
        assert w.summary()["verified"] and r.verified_bytes > 0
    finally:
        w.close()


@pytest.mark.parametrize("mirror", ["full", "checkpoints"])
def test_worker_against_daemon_loads_and_verifies(daemon_factory, mirror):
    d = tiny_daemon(daemon_factory)
    with d.client(timeout=20) as c:
        cfg = WorkerConfig(device_pages=16, host_pages=64, preempt_every=5, mirror=mirror)
        metrics = DemoMetrics()
        w = Worker(cfg, c, metrics)
        try:
            reqs = multi_turn(40, seed=2, system_pages=(2, 4), user_pages=(1, 2),
                              answer_pages=(1, 1), max_pages=14, active_sessions=6)
            r = w.run(reqs)
            s = w.summary()
        finally:
            w.close()
    assert s["verified"], s["first_mismatch"]
    assert s["host_hit_tokens"] > 0 and s["pages_loaded"] > 0
    assert s["device_hit_tokens"] + s["host_hit_tokens"] > s["device_only_hit_tokens"]
    ck = s["checkpoints"]
    if mirror == "full":
        assert s["bytes_loaded"] == s["pages_loaded"] * s["page_bytes"]
        assert s["bytes_backed_up"] == s["pages_backed_up"] * s["page_bytes"]
    else:  # compressed rows per page plus SWA tail and states per checkpoint, in one command
        assert ck["loaded"] > 0 and ck["backed_up"] > 0
        assert s["bytes_loaded"] == (s["pages_loaded"] * s["host_page_bytes"]
                                     + ck["loaded"] * s["checkpoint_bytes"])
        assert s["bytes_backed_up"] == (s["pages_backed_up"] * s["host_page_bytes"]
                                        + ck["backed_up"] * s["checkpoint_bytes"])
        assert s["load_ops"] <= s["tree"]["host_hit_pages"] + ck["loaded"]
    assert s["state_swaps"] == 8 and s["state_swap_failures"] == 0
    assert r.verified_bytes >= s["bytes_loaded"]
    # the dashboard's verification counters hold every check the summary does, the state
    # swaps' too (they used to miss them: a corrupt swap never showed there)
    m = metrics.registry.get_sample_value
    assert m("hicache_demo_verified_bytes_total") == r.verified_bytes
    assert m("hicache_demo_mismatched_bytes_total") == r.mismatched_bytes == 0
    w.tree.check()


def _mid_page_requests(n: int) -> list[Request]:
    """Trace-like turns: 3 conversations over a 2-page system prompt, each turn's prompt the
    last one plus a page, ending 40 tokens into a page and decoding 12 (the slot ends past
    the last full page, as almost every request of a Mooncake trace does)."""
    out: list[Request] = []
    for turn in range(n // 3):
        for conv in range(3):
            pages = (0, 1) + tuple(100 * (conv + 1) + k for k in range(turn + 1))
            out.append(Request(len(out), 0.0, len(pages) * PAGE_TOKENS + 40, 12, pages, pages))
    return out


@pytest.mark.parametrize("mode", ["snapshot", "none", "told_at_boundary"])
def test_ring_checkpoints_of_requests_that_end_mid_page(daemon_factory, monkeypatch, mode):
    """Ring SWA: a slot past its last full page is not that page's checkpoint. With a boundary
    snapshot the hits resume and verify; without one none is made (recomputed, not wrong); a
    release told the slot stood at the boundary (what the tree assumed before) backs up the
    request's own state, and the verification rejects those hits."""
    if mode == "told_at_boundary":
        real = RadixTree.release

        def told(self, prefix, keys, rows, slot=None, slot_tokens=None, snapshot=None):
            return real(self, prefix, keys, rows, slot, len(keys) * PAGE_TOKENS, snapshot)
        monkeypatch.setattr(RadixTree, "release", told)
    d = tiny_daemon(daemon_factory, rows="page=16,req_slot=4", swa="ring")
    with d.client(timeout=20) as c:
        cfg = WorkerConfig(swa_mode="ring", device_pages=8, host_pages=64, policy="write_back",
                           boundary_snapshots=mode == "snapshot")
        w = Worker(cfg, c)
        try:
            r = w.run(_mid_page_requests(12))
            s = w.summary()
        finally:
            w.close()
    ck = s["checkpoints"]
    if mode == "snapshot":
        assert s["verified"], s["first_mismatch"]
        assert s["host_hit_tokens"] > 0 and ck["loaded"] > 0 and r.rejected_hit_tokens == 0
        assert w.tree.stats.checkpoints_skipped == 0
    elif mode == "none":
        assert s["verified"] and r.rejected_hit_tokens == 0
        assert s["host_hit_tokens"] == 0 and ck["backed_up"] == 0
        assert w.tree.stats.checkpoints_skipped == 12
    else:
        assert not s["verified"] and r.rejected_hit_tokens > 0 and r.mismatched_bytes > 0
    w.tree.check()


def test_client_hooks_round_trip_and_exhaustion(daemon_factory):
    d = tiny_daemon(daemon_factory, ratio="0.5")  # 8 host pages per space
    layout = build_layout(preset("dsv4-tiny"))
    from hicache.engine.device_pools import DevicePools

    pools = DevicePools(layout, {"page": 16, "swa_page": 16, "req_slot": 4})
    pc = PageContent(layout)
    try:
        with d.client(timeout=20) as c:
            c.register(pools)
            hooks = ClientHooks(c, ["page", "swa_page"])
            handles = hooks.host_alloc(3)
            assert len(handles) == 3 and all(len(h) == 2 for h in handles)
            src, ids = torch.tensor([0, 1, 2]), torch.tensor([7, 8, 9])
            for spec in layout.space_pools("page") + layout.space_pools("swa_page"):
                for layer, buf in enumerate(pools.layers[spec.name]):
                    pc.fill(spec.name, layer, buf, src, ids)
            hooks.wait(hooks.backup([0, 1, 2], handles))
            t = hooks.load(handles, [10, 11, 12])
            hooks.wait(t)
            assert hooks.done(t)
            for spec in layout.space_pools("page") + layout.space_pools("swa_page"):
                for layer, buf in enumerate(pools.layers[spec.name]):
                    assert pc.mismatches(spec.name, layer, buf, torch.tensor([10, 11, 12]),
                                         ids) == 0
            with pytest.raises(HostExhausted):
                hooks.host_alloc(6)  # 8 - 3 left: all or nothing
            hooks.host_free(handles)
            assert len(hooks.host_alloc(8)) == 8
            assert hooks.stats.bytes["load"] == 3 * (layout.row_bytes("page")
                                                     + layout.row_bytes("swa_page"))
    finally:
        pools.close()


def test_dead_daemon_falls_back_to_recompute_without_hanging(daemon_factory):
    d = tiny_daemon(daemon_factory)
    reqs = multi_turn(30, seed=4, system_pages=(2, 3), user_pages=(1, 2), answer_pages=(1, 1),
                      max_pages=12, active_sessions=6)
    with d.client(timeout=1.0) as c:
        cfg = WorkerConfig(device_pages=16, host_pages=64, timeout=1.0)
        w = Worker(cfg, c)
        try:
            w.run(reqs[:15])
            assert w.tree.host_pages > 0
            d.stop(signal.SIGKILL)
            t0 = time.monotonic()
            w.run(reqs[15:])  # the tree notices within one timeout and recomputes
            assert time.monotonic() - t0 < 15
            s = w.summary()
        finally:
            w.close()
    assert s["host_tier_lost"] == 1 and s["requests"] == 30
    assert w.tree.host_pages == 0 and not w.tree.host_online
    assert s["verified"]
    w.tree.check()


def test_tree_drops_pages_when_daemon_pool_is_smaller_than_told(daemon_factory):
    d = tiny_daemon(daemon_factory, ratio="0.25")  # 4 host pages, the tree believes 64
    layout = build_layout(preset("dsv4-tiny"))
    from hicache.engine.device_pools import DevicePools

    pools = DevicePools(layout, {"page": 16, "swa_page": 16, "req_slot": 4})
    try:
        with d.client(timeout=20) as c:
            c.register(pools)
            tree = RadixTree(16, ClientHooks(c, ["page", "swa_page"]), policy="write_back",
                             host_capacity=64)
            for name in "abcd":  # each evicts the previous request's 6 pages
                keys = [f"{name}{i}" for i in range(6)]
                p = tree.prepare(keys)
                rows = tree.alloc_device(6 - p.pages)
                tree.release(p, keys, rows)
                tree.check()
            assert tree.stats.backup_dropped_pages > 0  # refused, dropped: no request failed
            assert tree.host_online and tree.host_pages <= 4
    finally:
        pools.close()


def test_hooks_report_unreachable_daemon():
    from hicache.engine.client import Client

    with Client("ipc:///tmp/hicache-test-nobody-here.sock", timeout=0.3) as c:
        hooks = ClientHooks(c, ["page"])
        t0 = time.monotonic()
        with pytest.raises(HostUnavailable):
            hooks.host_alloc(1)
        assert time.monotonic() - t0 < 3


def test_hook_latencies_keep_only_the_newest():
    """A long-running engine's ``HookStats`` stays flat: each direction keeps the newest
    ``LATENCY_SAMPLES`` latencies (it used to keep every one)."""
    from hicache.engine.hooks import LATENCY_SAMPLES, HookStats
    from hicache.core.percentiles import percentile

    st = HookStats()
    for i in range(LATENCY_SAMPLES + 10):
        st.latencies["load"].append(float(i))
    assert len(st.latencies["load"]) == LATENCY_SAMPLES and st.latencies["load"][0] == 10.0
    assert percentile(st.latencies["load"], 1.0) == LATENCY_SAMPLES + 9


def test_l3_writes_whose_pushed_acks_were_lost_are_asked_for_then_given_up():
    """``l3_settle(0)`` reads only pushed acks; once ``L3_POLL_AT`` writes wait it asks the
    daemon for theirs (a lost push is found), and past ``L3_PUTS_MAX`` it stops waiting for
    the oldest (counted ``unsettled``) instead of keeping them forever."""
    from types import SimpleNamespace

    from hicache.engine import hooks as H
    from hicache.engine.acks import AckTimeout

    class LostPushes:
        """Even op ids: acks whose push was lost (the daemon holds them); ``poll_acks`` hands
        them over and keeps none for ``wait_ack``, as ``Completion.poll_acks`` does."""

        def __init__(self) -> None:
            self.polled: list[int] = []

        def drain(self) -> int:
            return 0

        def poll_acks(self, ops, max=1024):
            assert len(ops) <= max == H.POLL_MAX
            self.polled.append(len(ops))
            return [SimpleNamespace(op=o, l3={"written": 1}, bytes=10) for o in ops if o % 2 == 0]

        def wait_ack(self, op, timeout=None, check=True):
            raise AckTimeout("not yet")

    c = LostPushes()
    h = H.ClientHooks(c, ["page"], l3=True)
    h._l3_puts = [SimpleNamespace(op_id=i) for i in range(H.L3_POLL_AT - 1)]
    assert h.l3_settle(0.0) == H.L3_POLL_AT - 1 and c.polled == []  # below: pushes only
    h._l3_puts.append(SimpleNamespace(op_id=H.L3_POLL_AT - 1))
    left = h.l3_settle(0.0)
    assert c.polled == [H.L3_POLL_AT] and left == H.L3_POLL_AT // 2
    assert h.l3_stats["written"] == H.L3_POLL_AT // 2  # the polled acks settled their puts
    assert h.l3_settle(0.0) == left and len(c.polled) == 1  # not again within L3_POLL_S
    h._l3_next_poll = 0.0
    h._l3_puts = [SimpleNamespace(op_id=2 * i + 1) for i in range(H.L3_PUTS_MAX + 5)]
    assert h.l3_settle(0.0) == H.L3_PUTS_MAX and h.l3_stats["unsettled"] == 5
    assert c.polled[1:] == [H.POLL_MAX] * 4 + [H.L3_PUTS_MAX + 5 - 4 * H.POLL_MAX]


def test_l3_errors_are_counted_by_the_daemons_reason():
    """An L3 ack's misses other than a plain miss (and, for a prefetch, a read past its
    deadline) count as errors, in all and by reason (``l3_error_kinds``): a slow store's
    ``stalled`` / ``busy`` told from a failing one's ``transfer`` / ``corrupt``."""
    from types import SimpleNamespace

    from hicache.engine import hooks as H

    class Acks:
        def drain(self) -> int:
            return 0

        def wait_ack(self, op, timeout=None, check=True):
            return SimpleNamespace(op=op.op_id, bytes=0, l3={
                "written": 1, "misses": {"miss": 4, "stalled": 2, "transfer": 1}})

        def l3_prefetch(self, keys, handles, **kw):
            return SimpleNamespace(bytes=8, l3={"hits": 1, "misses": {
                "miss": 3, "deadline": 5, "busy": 2, "stalled": 1, "corrupt": 0}})

    h = H.ClientHooks(Acks(), ["page"], l3=True)
    h._l3_puts = [SimpleNamespace(op_id=1), SimpleNamespace(op_id=3)]
    assert h.l3_settle(1.0) == 0
    assert h.l3_stats["errors"] == 6 and h.l3_error_kinds == {"stalled": 4, "transfer": 2}
    assert h.l3_prefetch([(1, 2)], [[7]]) == 1
    assert h.l3_stats["errors"] == 9
    assert h.l3_error_kinds == {"stalled": 5, "transfer": 2, "busy": 2}


def _one_session(turns: int) -> list[Request]:
    """One session, turn after turn: each resumes at the page the turn before ended on."""
    out, hist, key = [], [0, 1], 2
    for rid in range(turns):
        pages = hist + [key]
        ans = [key + 1]
        key += 2
        out.append(Request(2 * rid, rid, len(pages) * PAGE_TOKENS, PAGE_TOKENS, tuple(pages),
                           tuple(pages + ans), 0))
        hist = pages + ans
    return out


@pytest.mark.parametrize("misdirected", [False, True])
def test_a_ring_checkpoint_that_never_reached_its_slot_fails_verification(
        daemon_factory, monkeypatch, misdirected):
    """Ring SWA: a request resumes in the slot its session's previous turn used, which still
    holds the checkpoint of the very page it resumes from. A checkpoint load that lands
    elsewhere (here: in the other slot) must not verify (found by a review helper: it did,
    and the hits counted as resumable); loads that land where they should verify."""
    if misdirected:
        real = ClientHooks.load

        def load(self, handles, device_rows, ckpts=()):
            return real(self, handles, device_rows, [(1 - s, h, d) for s, h, d in ckpts])
        monkeypatch.setattr(ClientHooks, "load", load)
    d = daemon_factory(preset="dsv4-tiny", device_rows="page=64,req_slot=17",
                       host=("--host-ratio", "1", "--force"), extra=("--swa-mode", "ring"))
    cfg = WorkerConfig(swa_mode="ring", device_pages=24, host_pages=64, host_ckpts=16,
                       req_slots=2, lockstep=True)  # even request ids: every turn in slot 0
    with d.client(timeout=30) as c:
        w = Worker(cfg, c)
        try:
            w.run(_one_session(6))
            s = w.summary()
        finally:
            w.close()
    assert s["checkpoints"]["loaded"] > 0
    if misdirected:
        assert s["mismatched_bytes"] > 0 and s["resumable_hit_tokens"] == 0, s
    else:
        assert s["verified"] and s["mismatched_bytes"] == 0 and s["resumable_hit_tokens"] > 0


@pytest.mark.parametrize("preset_name,swa,mirror", [("dsv4-flash", "ring", "checkpoints"),
                                                    ("dsv4-tiny", "ring", "checkpoints"),
                                                    ("dsv4-flash", "paged", "checkpoints"),
                                                    ("dsv4-tiny", "paged", "full")])
def test_the_demo_daemon_pins_no_more_than_host_mem(preset_name, swa, mirror):
    """``hicache demo --host-mem``: the tier split leaves room for the request-slot rows its
    daemon keeps for state swaps (they used to come on top: +39 MB at 8 GiB, Flash ring), so
    the daemon's arena is within the budget but for alignment."""
    from hicache.core.config import load_config, sizing
    from hicache.core.sizes import arena_bytes
    from hicache.sim import demo
    from hicache.sim.replay import WorkerConfig
    from hicache.sim.sizing import host_tier_rows

    host, device_pages = 8 * 2**30, 64
    pages, ck = host_tier_rows(preset_name, str(host), swa, mirror, 32, demo.REQ_SLOTS,
                               device_pages)
    cfg = WorkerConfig(preset=preset_name, swa_mode=swa, device_pages=device_pages,
                       host_pages=pages, host_ckpts=ck, mirror=mirror, req_slots=demo.REQ_SLOTS)
    cmd = demo._daemon(cfg, None).cmd
    flags = {"preset": preset_name, "swa_mode": swa, "force": True,
             "device_rows": cmd[cmd.index("--device-rows") + 1]}
    # full: host rows in the device rows' proportions; checkpoints: the daemon's own split
    for flag in ("--host-ratio", "--host-mem", "--host-split", "--pages-per-checkpoint"):
        if flag in cmd:
            flags[flag[2:].replace("-", "_")] = cmd[cmd.index(flag) + 1]
    assert ("host_split" in flags) == (mirror == "checkpoints")
    s = sizing(load_config(flags, env={}))
    regions = sum(p.num_layers for p in s.layout.pools.values())
    arena = arena_bytes(s.layout, s.host_rows)
    assert host - 64 * 2**20 < arena <= host + regions * 4096, (arena, s.host_rows)
    assert s.host_rows["page"] == pages


def _made_workers(monkeypatch) -> list:
    """The demo's simulated workers, each as it is made."""
    from hicache.sim import simulator

    made: list = []
    real = simulator.Worker.__init__

    def init(self, *a, **k):
        real(self, *a, **k)
        made.append(self)

    monkeypatch.setattr(simulator.Worker, "__init__", init)
    return made


def test_a_paged_checkpoint_load_never_finds_its_bytes_in_place(monkeypatch):
    """Paged SWA with checkpoints: before a checkpoint load, the destination row's SWA tail and
    states must not already hold that checkpoint, or the check after the load passes with
    nothing copied (a review found one such load in the default demo's 218, and 5 in 842 of a
    longer write-back run: the node's own row, or a reused row whose SWA no later load wrote).
    The worker now fills them with content of no page first; each load is checked here at the
    client, after that and before the daemon copies."""
    import argparse

    from hicache.engine.client import Client
    from hicache.sim import demo

    workers = _made_workers(monkeypatch)
    real_load = Client.load
    seen = {"ckpts": 0, "in_place": 0}

    def load(self, items, **kw):
        w = workers[-1]
        r = w.resume
        by_handle = {n.ckpt_host: n for n in w.tree.nodes() if n.ckpt_host is not None}
        if r.state_pools and r.state_pools[0].name in items:
            src, dst = items[r.state_pools[0].name][:2]  # (host rows, device rows) of each
            for h, row in zip(src, dst):
                node = by_handle[h]
                seen["ckpts"] += 1
                ids, rows = torch.tensor([node.key]), torch.tensor([row])
                bad = sum(w.content.mismatches(p.name, layer, buf, rows, ids)
                          for p in r.state_pools
                          for layer, buf in enumerate(w.pools.layers[p.name]))
                if r.swa_pool is not None:
                    bad += sum(w.content.token_mismatches(r.swa_pool.name, layer, buf, rows, ids,
                                                          *w._tail(node.depth))
                               for layer, buf in enumerate(w.pools.layers[r.swa_pool.name]))
                seen["in_place"] += bad == 0
        return real_load(self, items, **kw)

    monkeypatch.setattr(Client, "load", load)
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.run(p.parse_args(["--progress-seconds", "0"])) == 0
    assert workers[-1].cfg.swa_mode == "paged" and workers[-1].ckpt
    assert seen["ckpts"] > 100 and seen["in_place"] == 0, seen


def _branching_trace(seed: int, convs: int = 40, turns: int = 5) -> list[dict]:
    """Multi-turn conversations (60% on a shared 3-page system prompt) growing 1-3 pages a
    turn, interleaved at random: device rows are freed unwritten and handed out again."""
    import random

    rng = random.Random(seed)
    nxt = [100]

    def new(n: int) -> list[int]:
        nxt[0] += n
        return list(range(nxt[0] - n, nxt[0]))

    state = [([0, 1, 2] if rng.random() < 0.6 else []) + new(rng.randint(1, 3))
             for _ in range(convs)]
    order = [c for c in range(convs) for _ in range(turns)]
    rng.shuffle(order)
    out = []
    for t, c in enumerate(order):
        state[c] = state[c] + new(rng.randint(1, 3))
        out.append({"timestamp": 100 * t, "input_length": 512 * len(state[c]) - rng.randint(0, 200),
                    "output_length": rng.randint(50, 300), "hash_ids": state[c]})
    return out


@pytest.mark.parametrize("mirror", [["checkpoints"], ["full", "--swa-mode", "paged"]])
def test_a_page_load_never_finds_its_bytes_in_place(monkeypatch, tmp_path, mirror):
    """A page row freed unwritten keeps an evicted page's bytes and the free list hands it
    out again, so a load into it would verify with nothing copied (a review found 6 of 2,133
    loaded pages in such rows on a trace). The worker now fills every load's page rows with
    content of no page first, in every pool and layer the load writes, and in both mirrors
    (a full mirror's loads carry no checkpoints); each pool and layer of each load is checked
    here, after that and before its copy."""
    import argparse
    import json as _json

    from hicache.engine.hooks import ClientHooks
    from hicache.sim import demo

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(_json.dumps(r) + "\n" for r in _branching_trace(3)))
    workers = _made_workers(monkeypatch)
    real_copy = ClientHooks._copy
    seen = {"checks": 0, "in_place": 0}

    def copy(self, to_host, device_rows, handles, ckpts):
        w = workers[-1] if workers else None
        if not to_host and device_rows and w is not None:
            key_of = {id(n.host): n.key for n in w.tree.nodes() if n.host is not None}
            pools = [p for s in self.spaces for p in w.layout.space_pools(s)]
            for h, row in zip(handles, device_rows):
                ids, rows = torch.tensor([key_of[id(h)]]), torch.tensor([row])
                for p in pools:  # (one pool or layer left in place is a copy unchecked)
                    for layer, buf in enumerate(w.pools.layers[p.name]):
                        seen["checks"] += 1
                        seen["in_place"] += w.content.mismatches(p.name, layer, buf, rows,
                                                                 ids) == 0
        return real_copy(self, to_host, device_rows, handles, ckpts)

    monkeypatch.setattr(ClientHooks, "_copy", copy)
    p = argparse.ArgumentParser()
    demo.add_arguments(p)
    assert demo.run(p.parse_args(["--trace", str(trace), "--device-pages", "64",
                                  "--progress-seconds", "0", "--mirror"] + mirror)) == 0
    assert workers[-1].cfg.mirror == mirror[0]
    assert seen["checks"] > 500 and seen["in_place"] == 0, seen


def test_the_l3_demo_leaves_nothing_when_interrupted_while_an_instance_starts(monkeypatch):
    """``hicache demo --l3``: an interrupt (or a refusal) while instance B's daemon starts used
    to leave A's daemon running and both private directories behind; now every instance
    made so far is closed (a review found it with a real SIGINT)."""
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.sim import demo, demo_l3
    from hicache.sim.workload import multi_turn

    made: list[DaemonProcess] = []
    real = DaemonProcess.start

    def start(self):
        made.append(self)
        if len(made) == 2:
            raise KeyboardInterrupt  # B's start
        return real(self)

    monkeypatch.setattr(DaemonProcess, "start", start)
    cfg = WorkerConfig(device_pages=32, host_pages=128)
    reqs = multi_turn(8, seed=1)
    with pytest.raises(KeyboardInterrupt):
        demo_l3._replay(reqs, [i % 2 for i in range(len(reqs))], cfg, None, "t", 0.0,
                        demo._daemon)
    assert len(made) == 2
    for d in made:
        assert not d.alive() and not (d.dir and os.path.exists(d.dir)), d.address


@pytest.mark.parametrize("fault", [None, "no_clear", "other_slot"])
def test_a_state_swap_checks_the_cleared_slot_and_the_others(daemon_factory, monkeypatch,
                                                              fault):
    """A request-state swap is verified in its destination slot, and now also in the slot it
    left (cleared: zeros) and in every other slot (unchanged): a ``clear_slot`` that did
    nothing, or a swap that wrote one slot too many, used to verify (found by a review)."""
    from hicache.engine.client import Client

    if fault == "no_clear":
        monkeypatch.setattr(Client, "clear_slot", lambda self, slots, **kw: None)
    if fault == "other_slot":
        real = Client.swap_in

        def swap_in(self, host_row, slot, **kw):  # the state lands in the next slot too
            self.wait_ack(real(self, host_row, (slot + 1) % 4, release=False,
                               request=kw.get("request")))
            return real(self, host_row, slot, **kw)
        monkeypatch.setattr(Client, "swap_in", swap_in)
    d = tiny_daemon(daemon_factory)
    with d.client(timeout=20) as c:
        cfg = WorkerConfig(device_pages=16, host_pages=64, preempt_every=3, req_slots=4)
        w = Worker(cfg, c)
        try:
            w.run(multi_turn(12, seed=3, system_pages=(1, 2), user_pages=(1, 1),
                             answer_pages=(1, 1), max_pages=8, active_sessions=3))
            s = w.summary()
        finally:
            w.close()
    assert s["state_swaps"] > 0
    if fault is None:
        assert s["verified"] and s["mismatched_bytes"] == 0, s["first_mismatch"]
    else:
        assert not s["verified"] and "state swap" in s["first_mismatch"], s["first_mismatch"]
