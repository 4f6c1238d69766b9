"""Exhaustion: a full host pool refuses with a clear reason counted in metrics, the radix tree
drops pages instead of failing requests, and pinning more than the machine has fails at start-up."""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache.bench.soak import RadixWorker
from hicache.engine.client import Client, CommandRefused
from hicache.fuzz.runner import DaemonRunner, ShmBuffers, daemon_check, metric_total, private_address
from hicache.core.layout import build_layout, preset

ROOT = Path(__file__).resolve().parents[1]
TINY_DEVICE = "page=8,swa_page=8,req_slot=4"  # x --host-ratio 0.25: host rows 2, 2 and 1


@pytest.fixture(scope="module")
def tiny():
    addr, d = private_address("hce-")
    r = DaemonRunner(addr, device_rows=TINY_DEVICE, host=("--host-ratio", "0.25", "--force"),
                     heartbeat_timeout=30.0, log_path=os.path.join(d, "daemon.log"))
    r.start()
    yield r
    r.stop()
    shutil.rmtree(d, ignore_errors=True)


def _errors(c: Client, kind: str) -> float:
    return metric_total(c.stats(), "hicache_errors_total", kind=kind)


def test_full_pool_refuses_alloc_with_reason_counted(tiny):
    with Client(tiny.address, timeout=10, name="greedy") as c:
        rows = c.alloc({"page": 2})  # the whole space
        before = _errors(c, "no_space")
        with pytest.raises(CommandRefused) as e:
            c.alloc({"page": 1})
        assert e.value.code == "no_space"
        assert "1 rows asked" in e.value.message and "0 of 2 free" in e.value.message
        with pytest.raises(CommandRefused) as e2:  # all or nothing across spaces
            c.alloc({"swa_page": 1, "page": 1})
        assert e2.value.code == "no_space"
        st = c.stats()
        assert metric_total(st, "hicache_errors_total", kind="no_space") == before + 2
        assert metric_total(st, "hicache_commands_total", command="alloc", status="error") >= 2
        assert st["host"]["spaces"]["swa_page"]["used"] == 0  # the failed pair took nothing
        c.free(rows)
        assert daemon_check(c, {"page": 0, "swa_page": 0, "req_slot": 0})["ok"]


def test_full_request_slots_refuse_swap_out(tiny):
    lay = build_layout(preset("dsv4-tiny"))
    with ShmBuffers(lay, {"page": 8, "swa_page": 8, "req_slot": 4}, tag="swap") as b, \
            Client(tiny.address, timeout=10, name="swapper") as c:
        c.register(**b.register_fields(), fds=b.fds())
        first = c.swap_out(0, request="r0")
        c.wait_ack(first)
        before = _errors(c, "no_space")
        with pytest.raises(CommandRefused) as e:
            c.swap_out(1, request="r1")  # the one req_slot host row is taken
        assert e.value.code == "no_space" and "req_slot" in e.value.message
        assert _errors(c, "no_space") == before + 1
        c.unregister()


def test_radix_tree_drops_pages_when_the_host_pool_is_full(tiny):
    lay = build_layout(preset("dsv4-tiny"))
    w = RadixWorker(tiny.address, lay, call_timeout=10.0, seed=3, pages=8)
    try:
        w.register()
        before = _errors(w.client, "no_space")
        for i in range(6):  # 4 new pages each; the host pool holds 2 per space
            p = w.request([("req", i, j) for j in range(4)])
            assert p.pages == 0
            w.tree.drain()
        w.tree.check()
        s = w.tree.stats
        assert s.backup_dropped_pages > 0  # dropped, never raised
        assert s.host_offline == 0 and s.transfer_failures == 0
        assert _errors(w.client, "no_space") > before
        chk = daemon_check(w.client)
        assert chk["ok"], chk["problems"]
        assert chk["spaces"]["page"]["used"] <= 2
        assert w.corrupted == 0
        w.client.unregister()
    finally:
        w.close()


def test_overcommitted_host_memory_fails_at_startup_with_one_line():
    addr, d = private_address("hce-")
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    t = time.monotonic()
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu",
                        "--preset", "dsv4-tiny", "--device-rows", TINY_DEVICE,
                        "--host-mem", "10TiB", "--socket", addr],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    took = time.monotonic() - t
    assert p.returncode != 0
    lines = [x for x in p.stderr.splitlines() if x.strip()]
    assert len(lines) == 1, p.stderr
    assert "available" in lines[0] and "10.00 TiB" in lines[0], lines[0]
    assert took < 60
    assert os.listdir(d) == []  # no socket was bound
    shutil.rmtree(d)
