"""A client whose host rows were all freed while ``RadixTree`` stayed online, against a live
CPU daemon (forty-fifth session's review).

The engine can learn of a reap or of a daemon restart from a heartbeat, or reset the client
itself, without any tree call failing. It then registers again (docs/integration.md), and the
new registration hands out the same row ids. Before the fix the tree still believed its old
host copies: ``reset_host_tier()`` on the online tree forgot nothing, and a later host hit on
page "a" loaded page "b"'s bytes, counted as a hit. Now the tree checks the hooks'
``row_epoch`` whenever it asks whether its host tier is online, and forgets the tier once it
moved: page "a" is a miss, page "b" a verified hit, and the daemon's used rows are the tree's.
"""
from __future__ import annotations

import contextlib
import os
import signal
import time
from typing import Any, Callable, Iterator

import pytest
import torch

from hicache.core.layout import build_layout, preset
from hicache.engine.acks import CommandRefused
from hicache.engine.device_pools import DevicePools
from hicache.engine.hooks import ClientHooks
from hicache.engine.radix import RadixTree

ROWS = {"page": 8, "swa_page": 8, "req_slot": 4}
SPACES = ["page", "swa_page"]
A, B = ["a0", "a1"], ["b0", "b1"]


def _fill(pools: DevicePools, layout: Any, row: int, v: int) -> None:
    for name, layers in pools.layers.items():
        if layout.pool(name).index in SPACES:
            for t in layers:
                t[row].fill_(v)


def _serve(tree: RadixTree, pools: DevicePools, layout: Any, keys: list[str], v: int) -> None:
    """A request over ``keys`` whose new pages hold ``v``, backed up (write-through)."""
    p = tree.prepare(keys)
    rows = tree.alloc_device(len(keys) - p.pages)
    for r in rows:
        _fill(pools, layout, r, v)
    tree.release(p, keys, rows)
    tree.drain()


def _hit_bytes(tree: RadixTree, pools: DevicePools, layout: Any, keys: list[str]) -> set[int]:
    """Evicted from the device, then prepared: every byte of every loaded row of the prefix
    (each pool of the page spaces), as a set; the prefix released again."""
    tree.evict_device(tree.device_pages)
    p = tree.prepare(keys + ["next"])
    got: set[int] = set()
    for n in p.nodes:  # each row's least and greatest byte: cheap, and enough for a fill
        for name, layers in pools.layers.items():
            if layout.pool(name).index in SPACES:
                for t in layers:
                    lo, hi = torch.aminmax(t[n.device])
                    got |= {int(lo), int(hi)}
    assert p.pages == len(keys) and p.host_pages == p.pages
    tree.abort(p)
    return got


def _reaped(d: Any, c: Any, pools: DevicePools) -> None:
    """The daemon reaps the engine as silent (``reap_on_sigusr1``: its silence check finds
    every client silent once; a real 2 s heartbeat timeout also reaped the new registration
    whenever a loaded machine paused the test's later steps that long), then a heartbeat says
    why."""
    os.kill(d.pid, signal.SIGUSR1)
    deadline = time.monotonic() + 20
    while True:
        try:
            if (hb := c.heartbeat())["registered"] is False:
                break
        except CommandRefused as e:  # reaped, its rows still going back: refused a moment
            assert e.code == "busy", e
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert hb.get("reaped") and "silent" in hb["reaped"], hb
    c.register(pools)


def _restarted(d: Any, c: Any, pools: DevicePools) -> None:
    d.kill()
    d.start()
    deadline = time.monotonic() + 20
    while True:
        try:
            hb = c.heartbeat()
            break
        except Exception:  # noqa: BLE001 - the client's view of a restart: any failure
            assert time.monotonic() < deadline
            time.sleep(0.1)
    assert hb["registered"] is False
    c.register(pools)


def _reset(d: Any, c: Any, pools: DevicePools) -> None:
    c.reset(timeout=10)


@contextlib.contextmanager
def _tree_with_a(d: Any, name: str) -> Iterator[tuple[Any, DevicePools, Any, RadixTree]]:
    """A registered client over ``d``, its pools, layout and a tree that served page "a"
    (0xAA, written through); unregistered and closed at the end."""
    layout = build_layout(preset("dsv4-flash"))
    pools = DevicePools(layout, ROWS)
    c = d.client(name=name)
    try:
        c.register(pools)
        tree = RadixTree(8, ClientHooks(c, SPACES, timeout=10), policy="write_through")
        _serve(tree, pools, layout, A, 0xAA)
        yield c, pools, layout, tree
        c.unregister()
    finally:
        c.close()
        pools.close()


@pytest.mark.parametrize("what, fault", [(_reaped, "reap_on_sigusr1"), (_restarted, None),
                                         (_reset, None)],
                         ids=["reap_seen_by_heartbeat", "restart_seen_by_heartbeat",
                              "client_reset"])
def test_rows_freed_under_an_online_tree_are_forgotten_not_served(
        tmp_path: Any, daemon_factory: Callable[..., Any], what: Callable[..., None],
        fault: str | None) -> None:
    d = daemon_factory(device_rows="page=8,swa_page=8,req_slot=4", heartbeat_timeout=60.0,
                       fault=fault)
    with _tree_with_a(d, "epoch") as (c, pools, layout, tree):
        assert _hit_bytes(tree, pools, layout, A) == {0xAA}
        assert tree.evict_device(tree.device_pages) == 2 and tree.match(A + ["x"]) == (0, 2)
        what(d, c, pools)  # every host row of the client freed; no tree call failed
        # the engine does not tell the tree: it forgets its host tier at its next question
        assert tree.match(A + ["x"]) == (0, 0)
        assert not tree.host_online and tree.host_pages == 0
        assert tree.reset_host_tier() is True and tree.host_online  # no stale rows to wait for
        _serve(tree, pools, layout, B, 0xBB)  # rows of the new registration: the same ids
        assert tree.match(A + ["x"]) == (0, 0)  # "a" is gone, not served from b's rows
        assert _hit_bytes(tree, pools, layout, B) == {0xBB}
        tree.check()
        used = {k: v["used"] for k, v in c.stats()["host"]["spaces"].items()}
        assert used["page"] == tree.host_pages == 2, (used, tree.host_pages)


def test_reset_host_tier_on_an_online_tree_whose_epoch_moved_forgets_first(
        daemon_factory: Callable[..., Any]) -> None:
    """The engine registers again and calls ``reset_host_tier`` at once, as the docs say,
    before any other tree call: the reset forgets the old copies (it used to return True
    keeping them)."""
    d = daemon_factory(device_rows="page=8,swa_page=8,req_slot=4")
    with _tree_with_a(d, "epoch2") as (c, pools, layout, tree):
        offline_before = tree.stats.host_offline
        c.reset(timeout=10)
        assert tree.reset_host_tier() is True
        assert tree.host_online and tree.host_pages == 0
        assert tree.stats.host_offline == offline_before + 1
        _serve(tree, pools, layout, B, 0xBB)
        assert tree.match(A + ["x"]) == (2, 0)  # a's pages are still on the device
        assert _hit_bytes(tree, pools, layout, B) == {0xBB}
        assert tree.match(A + ["x"]) == (0, 0)
