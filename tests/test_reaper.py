"""The reaper runs off the loop (issue 17, item 5): a client killed with 1 GB of backups in
flight is reaped while other clients keep their latency; its rows and mappings go when its
copies end. CPU mode, shared-memory device pools, a real daemon and a SIGKILLed client.

The latency figure compares, within one run, a bystander's ``heartbeat`` p99 just before the
doomed client starts (idle) with its p99 from the kill until the dead client's last row is back
(its copies draining, the reap, the unmapping, the slice-by-slice release). On a shared 2-core
machine a neighbour's burst can spoil one window, so a run gets up to ``ATTEMPTS`` kills, each
with its own idle window just before it; it passes on the first within 2x (every attempt is
printed, the numbers go to docs/reliability.md)."""
from __future__ import annotations

import glob
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

from hicache.engine.client import Client
from hicache.fuzz.runner import DaemonRunner, private_address

ROOT = Path(__file__).resolve().parents[1]
DEV_PAGE = 2048  # dsv4-tiny page rows of 141 KiB: 4 backups of 2048 rows = 1.16 GB
BACKUPS = 4
ATTEMPTS = 3

DOOMED = f"""
import sys, time
from hicache.core.layout import build_layout, preset
from hicache.engine.client import Client
from hicache.engine.device_pools import DevicePools
lay = build_layout(preset("dsv4-tiny"))
pools = DevicePools(lay, {{"page": {DEV_PAGE}, "swa_page": 4, "req_slot": 4}})
c = Client(sys.argv[1], timeout=60, name="doomed")
c.register(pools)
rows = c.alloc({{"page": {DEV_PAGE * BACKUPS}}})["page"]
dev = list(range({DEV_PAGE}))
for k in range({BACKUPS}):
    c.backup({{"page": (dev, rows[k * {DEV_PAGE}:(k + 1) * {DEV_PAGE}])}})
print("sent", flush=True)
time.sleep(600)
"""


def _p99(xs: list[float]) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, int(0.99 * len(s)))]


def _beat(c: Client, until: float, out: list[float]) -> None:
    while time.monotonic() < until:
        t = time.perf_counter()
        c.heartbeat()
        out.append(time.perf_counter() - t)
        time.sleep(0.001)


def _reap_once(c: Client, addr: str) -> dict:
    """Idle window, then a doomed client with 1.16 GB in flight killed; latencies until its
    rows are back."""
    idle: list[float] = []
    _beat(c, time.monotonic() + 1.5, idle)
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    child = subprocess.Popen([sys.executable, "-c", DOOMED, addr], env=env, cwd=str(ROOT),
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    try:
        deadline = time.monotonic() + 120
        line = ""
        while time.monotonic() < deadline and not line:
            c.heartbeat()  # stay alive meanwhile
            line = child.stdout.readline() if child.poll() is None else "dead"
        assert line.startswith("sent"), (line, child.stderr.read()[-2000:])
        in_flight = c.stats()["in_flight"]
        child.kill()
        t_kill = time.monotonic()
        busy: list[float] = []
        reaped_with_ops = False
        while time.monotonic() - t_kill < 60:
            _beat(c, time.monotonic() + 0.1, busy)
            s = c.stats()
            reaped_with_ops |= s["clients"] == 1 and s["in_flight"] > 0
            if s["host"]["spaces"]["page"]["used"] == 0 and s["in_flight"] == 0:
                break
        took = time.monotonic() - t_kill
    finally:
        if child.poll() is None:
            child.kill()
        child.wait()
        # a SIGKILLed engine cannot unlink its shm "device" file: remove the one it made
        for f in glob.glob(f"/dev/shm/hicache-dev-{child.pid}-*"):
            os.unlink(f)
    return {"in_flight": in_flight, "reaped_with_ops": reaped_with_ops, "took": took,
            "idle": _p99(idle), "busy": _p99(busy), "max": max(busy), "n": len(busy),
            "stats": c.stats()}


def test_reaping_a_client_with_1gb_in_flight_keeps_others_served():
    addr, d = private_address("hcrp-")
    r = DaemonRunner(addr, device_rows=f"page={DEV_PAGE * BACKUPS // 2},swa_page=4,req_slot=4",
                     heartbeat_timeout=0.5, log_path=os.path.join(d, "daemon.log"))
    r.start()
    runs = []
    try:
        with Client(addr, timeout=10, name="bystander") as c:
            for _ in range(ATTEMPTS):
                x = _reap_once(c, addr)
                runs.append(x)
                print(f"in flight at kill {x['in_flight']}; reaped with ops in flight "
                      f"{x['reaped_with_ops']}; rows back after {x['took']:.2f} s; heartbeat "
                      f"p99 idle {x['idle'] * 1e3:.2f} ms, while reaping {x['busy'] * 1e3:.2f} "
                      f"ms ({x['busy'] / x['idle']:.2f}x) over {x['n']} calls (max "
                      f"{x['max'] * 1e3:.1f} ms)")
                s = x["stats"]
                assert x["in_flight"] >= 1 and x["reaped_with_ops"]
                assert s["host"]["spaces"]["page"]["used"] == 0 and s["clients"] == 1
                assert not any(s["pending_free"].values())
                # the loop never waited for the drain: no call took anywhere near the copy time
                assert x["max"] < 0.5 * x["took"], (x["max"], x["took"])
                if x["busy"] <= 2 * x["idle"]:
                    break
            inv = c.call("stats", {"check": True})[0]["invariants"]
        log = r.output()
        assert "operations still running" in log and "host rows freed" in log
        assert inv == "ok", inv
        assert runs[-1]["busy"] <= 2 * runs[-1]["idle"], [(x["idle"], x["busy"]) for x in runs]
    finally:
        r.stop()
        shutil.rmtree(d, ignore_errors=True)
