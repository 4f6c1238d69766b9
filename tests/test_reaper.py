"""The reaper runs off the loop (issue 17, item 5): a client killed with 1 GB of backups in
flight is reaped while other clients keep their latency; its rows and mappings go when its
copies end. CPU mode, shared-memory device pools, a real daemon and a SIGKILLed client."""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

from hicache.engine.client import Client
from hicache.fuzz.runner import DaemonRunner, private_address

ROOT = Path(__file__).resolve().parents[1]
DEV_PAGE = 2048  # dsv4-tiny page rows of 141 KiB: 4 backups of 2048 rows = 1.16 GB
BACKUPS = 4

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


def test_reaping_a_client_with_1gb_in_flight_keeps_others_served():
    addr, d = private_address("hcrp-")
    r = DaemonRunner(addr, device_rows=f"page={DEV_PAGE * BACKUPS // 2},swa_page=4,req_slot=4",
                     heartbeat_timeout=0.5, log_path=os.path.join(d, "daemon.log"))
    r.start()
    child = None
    try:
        with Client(addr, timeout=10, name="bystander") as c:
            idle: list[float] = []
            _beat(c, time.monotonic() + 2.0, idle)
            env = dict(os.environ, PYTHONPATH=str(ROOT))
            child = subprocess.Popen([sys.executable, "-c", DOOMED, addr], env=env, cwd=str(ROOT),
                                     stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
            s = c.stats()
        p_idle, p_busy = _p99(idle), _p99(busy)
        print(f"in flight at kill {in_flight}; reaped with ops in flight {reaped_with_ops}; "
              f"rows back after {took:.2f} s; heartbeat p99 idle {p_idle * 1e3:.2f} ms, "
              f"while reaping {p_busy * 1e3:.2f} ms over {len(busy)} calls "
              f"(max {max(busy) * 1e3:.1f} ms)")
        assert in_flight >= 1 and reaped_with_ops
        assert s["host"]["spaces"]["page"]["used"] == 0 and s["clients"] == 1
        assert "operations still running" in r.output()
        # the loop never waited for the drain: no call took anywhere near the copy time
        assert max(busy) < 0.5 * took, (max(busy), took)
        # 2x on a quiet machine (docs/reliability.md); a shared 2-core runner gets slack: the copy
        # thread competes for the same cores
        assert p_busy <= max(3 * p_idle, p_idle + 0.020), (p_idle, p_busy)
    finally:
        if child is not None and child.poll() is None:
            child.kill()
        r.stop()
        shutil.rmtree(d, ignore_errors=True)
