"""Sustained mixed load from several client processes, every load checked (a short run; the
8 x 50,000 figure comes from ``hicache bench soak``)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

from hicache.bench.soak import SOAK_DAEMON_ROWS, run_soak
from hicache.fuzz.runner import DaemonRunner, daemon_check, private_address

ROOT = Path(__file__).resolve().parents[1]


def test_short_soak_no_lost_acks_no_corruption():
    addr, d = private_address("hcs-")
    r = DaemonRunner(addr, device_rows=SOAK_DAEMON_ROWS, host=("--host-ratio", "4"),
                     heartbeat_timeout=30.0, log_path=os.path.join(d, "daemon.log"))
    r.start()
    try:
        rep = run_soak(addr, 3, 500, seed=4, window=4, quota=40, rss=r.rss)
        from hicache.engine.client import Client

        with Client(addr, timeout=10) as c:  # every client unregistered: nothing left in use
            chk = daemon_check(c, {"page": 0, "swa_page": 0, "req_slot": 0})
    finally:
        r.stop()
        out = r.output()
        shutil.rmtree(d, ignore_errors=True)
    assert rep["clients_missing"] == 0 and rep["ops"] == 1500, rep["problems"]
    assert rep["lost_acks"] == 0 and rep["failed_ops"] == 0, rep["problems"]
    assert rep["corrupted_pages"] == 0 and rep["refused"] == 0, rep["problems"]
    assert rep["loads"] > 100 and rep["backups"] > 100 and rep["frees"] > 10
    assert rep["verified_pages"] >= rep["loads"]
    assert rep["rss_growth_pct"] is not None
    assert chk["ok"], chk["problems"]
    assert "Traceback" not in out


def test_bench_soak_cli_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "soak", "--clients", "2",
                        "--ops", "150", "--unit", "c128_kv", "--json"], cwd=str(ROOT), env=env,
                       capture_output=True, text=True, timeout=180)
    rep = json.loads(p.stdout)
    for k in ("clients", "ops", "lost_acks", "corrupted_pages", "rss_growth_pct", "ops_per_s",
              "seconds"):
        assert k in rep, k
    assert rep["clients"] == 2 and rep["ops"] == 300
    assert rep["lost_acks"] == 0 and rep["corrupted_pages"] == 0, rep["problems"]
    # the daemon's own count of what it handled matches what the clients sent
    hm = rep["daemon_handler_ms"]
    assert hm["backup"][0] == rep["backups"] and hm["load"][0] == rep["loads"], hm
    assert hm["alloc"][0] == rep["allocs"] and hm["free"][0] == rep["frees"], hm
    assert all(ms > 0 for _, ms in hm.values()), hm
    # a 300-op run is all warm-up, so its RSS figure (and the exit status) is not judged here


def test_short_soak_mix_all_every_unit_every_byte():
    """--mix all: page and SWA rows from 1 row to 512 pages, tokens, request-state swaps."""
    from hicache.bench.soak import MIX_DAEMON_ROWS

    addr, d = private_address("hcs-")
    r = DaemonRunner(addr, device_rows=MIX_DAEMON_ROWS, host=("--host-ratio", "4"),
                     heartbeat_timeout=30.0, log_path=os.path.join(d, "daemon.log"))
    r.start()
    try:
        rep = run_soak(addr, 2, 250, seed=9, window=4, rss=r.rss, mix="all")
    finally:
        r.stop()
        out = r.output()
        shutil.rmtree(d, ignore_errors=True)
    assert rep["clients_missing"] == 0 and rep["ops"] == 500, rep["problems"]
    assert rep["lost_acks"] == 0 and rep["failed_ops"] == 0, rep["problems"]
    assert rep["corrupted_pages"] == 0 and rep["refused"] == 0, rep["problems"]
    assert rep["loads"] > 50 and rep["backups"] > 50 and rep["swaps"] > 10
    assert rep["verified_bytes"] > 0
    assert "Traceback" not in out


def test_bench_soak_whose_daemon_refuses_its_device_is_a_usage_error():
    """A daemon that refuses the settings the bench gave it (here: a CUDA daemon without a GPU)
    is the bench's usage error: its one line, exit 2, nothing on stdout. (It used to be a
    failure of the run: exit 1 and an error object. Failures of the run itself still are.)"""
    import torch

    if torch.cuda.is_available():
        import pytest

        pytest.skip("needs a machine without CUDA (the daemon must fail to start)")
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "soak", "--clients", "1",
                        "--ops", "10", "--mix", "all", "--device", "cuda:0", "--json"],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, (p.returncode, p.stderr[-2000:])
    assert p.stdout == "" and "Traceback" not in p.stderr
    assert p.stderr.strip().splitlines()[-1] == ("hicache bench soak: error: the daemon refused "
                                                 "to start: --device cuda:0: CUDA is not "
                                                 "available"), p.stderr[-2000:]
