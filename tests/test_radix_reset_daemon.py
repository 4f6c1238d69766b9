"""``RadixTree.reset_host_tier`` against a live CPU daemon, after a load whose ack came too
late (``CopyOutcomeUnknown``): the tree goes device-only and holds the load's device rows.

* Through hooks over another client, the reset asks the client that sent the load whether it
  may still copy (the daemon keeps acks and in-flight counts per client: the new client knows
  nothing of it), and hands the rows back only once it cannot.
* On the same, still live registration the daemon still holds every host row the tree forgot,
  so the reset is refused until the client frees them (``client.reset()``); after it, every
  host row the tree believes free can be allocated: none leaked.
"""
from __future__ import annotations

import time

import pytest

from hicache.core.layout import build_layout, preset
from hicache.engine.device_pools import DevicePools
from hicache.engine.hooks import ClientHooks
from hicache.engine.radix import RadixTree

N = 48  # pages: a CPU copy of their rows takes milliseconds, past the 20 ms ack wait below
ROWS = {"page": 64, "swa_page": 64, "req_slot": 4}
SPACES = ["page", "swa_page"]


def _late_load(d) -> tuple:
    """A client, pools and a tree whose load of ``N`` host pages outlived its ack wait."""
    pools = DevicePools(build_layout(preset("dsv4-flash")), ROWS)
    a = d.client(name="A")
    a.register(pools)
    hooks = ClientHooks(a, SPACES, timeout=30)
    tree = RadixTree(64, hooks, policy="write_through")
    keys = list(range(N))
    p = tree.prepare(keys)
    tree.release(p, keys, tree.alloc_device(N))
    tree.drain()
    assert tree.evict_device(N) == N and tree.match(keys) == (0, N)
    hooks.timeout = 0.0005  # the load's ack comes after this: its outcome is unknown
    p = tree.prepare(keys)
    hooks.timeout = 30
    assert p.pages == 0 and not tree.host_online and len(tree.held_device_rows) == N
    return a, pools, hooks, tree


def _wait_reset(tree: RadixTree, *hooks) -> None:
    deadline = time.monotonic() + 30
    while not tree.reset_host_tier(*hooks):
        assert time.monotonic() < deadline, "the late load never ended"
        time.sleep(0.01)


@pytest.fixture
def daemon(daemon_factory):
    return daemon_factory(device_rows="page=64,swa_page=64,req_slot=4",
                          host=("--host-ratio", "1.5"), heartbeat_timeout=60)


def test_a_reset_through_another_client_asks_the_client_that_sent_the_load(daemon):
    a, pa, ha, tree = _late_load(daemon)
    old = list(tree.unknown_loads)
    pb = DevicePools(build_layout(preset("dsv4-flash")), ROWS)
    b = daemon.client(name="B")
    try:
        b.register(pb)
        hb = ClientHooks(b, SPACES, timeout=30)
        held = list(tree.held_device_rows)
        while not tree.reset_host_tier(hb):
            assert tree.held_device_rows == held and not tree.host_online  # nothing changed
            time.sleep(0.001)
        # the rows came back only once the client that sent the load says it cannot copy
        assert not ha.copies_running(old)
        assert tree.hooks is hb and tree.host_online and tree.held_device_rows == []
        tree.check()
    finally:
        for c, p in ((b, pb), (a, pa)):
            c.unregister(timeout=30)
            c.close()
            p.close()


def test_a_reset_on_the_live_registration_waits_for_the_forgotten_rows(daemon):
    a, pools, hooks, tree = _late_load(daemon)
    try:
        rows = a.registered["host_rows"]["page"]
        deadline = time.monotonic() + 30
        while hooks.copies_running(tree.unknown_loads):
            assert time.monotonic() < deadline
            time.sleep(0.01)
        before = a.stats()["host"]["spaces"]["page"]["used"]
        assert before >= N  # the pages the tree forgot are still this client's
        with pytest.raises(ValueError, match="still holds the host rows the tree forgot"):
            tree.reset_host_tier()
        assert not tree.host_online and len(tree.held_device_rows) == N  # nothing changed
        r = a.reset(timeout=30)
        _wait_reset(tree)
        assert tree.host_online and tree.held_device_rows == []
        # a reset whose rows were still pending (an op's completion not yet collected when it
        # came) gives them back in later loop turns, and says so (``deferred``): wait for them
        # as the protocol tells a client to (a fast CI run once allocated before the last came)
        while r["deferred"] and any(a.stats()["pending_free"].values()):
            assert time.monotonic() < deadline, "the reset's rows never came back"
            time.sleep(0.01)
        got = hooks.host_alloc(rows - tree.host_pages)  # every row the tree believes free
        assert len(got) == rows
        hooks.host_free(got)
        tree.check()
    finally:
        a.unregister(timeout=30)
        a.close()
        pools.close()
