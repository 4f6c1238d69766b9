"""What a Prometheus scrape costs the daemon (docs/metrics.md, "What a scrape costs").

Three measures, CPU mode, printed as one JSON object:
- ``format_ms``: the catalog's text (``Metrics.exposition``) and the ``stats`` view
  (``Metrics.snapshot``) of a dsv4-flash daemon's series, best and median of 20;
- ``backup_us``: one client's one-row backups (send -> ack) against a real ``hicache serve``,
  alone and while another process scrapes /metrics every ``--period`` s: p50, p99, p99.9, max;
- ``late_ticks``: in one process, the endpoint and a thread that sleeps 100 us at a time (a
  stand-in for the daemon's loop waiting for the interpreter), while another process scrapes
  300 times, and the same with that process's connections refused (its own load, no scrape):
  how many wake-ups came more than 1 and 2 ms late.

Usage: ``python scripts/scrape_cost.py [--ops 20000] [--period 0.1]``.
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache.controllers.metrics import Metrics  # noqa: E402
from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.client import Client  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402

POOLS = ("swa_kv", "c4_kv", "c4_indexer", "c128_kv", "c4_state", "c4_indexer_state",
         "c128_state")


def _scraper(url: str, n: int, period: float) -> subprocess.Popen:
    code = (f"import time, urllib.request\nfor _ in range({n}):\n"
            f"    try: urllib.request.urlopen({url!r}, timeout=10).read()\n"
            f"    except OSError: pass\n    time.sleep({period})\n")
    return subprocess.Popen([sys.executable, "-c", code])


def _quantiles(xs: list[float], scale: float) -> dict[str, float]:
    xs = sorted(xs)
    at = lambda p: round(xs[min(len(xs) - 1, int(p * len(xs)))] * scale, 1)  # noqa: E731
    return {"p50": at(0.5), "p99": at(0.99), "p999": at(0.999), "max": round(xs[-1] * scale, 1)}


def _busy_metrics() -> Metrics:
    m = Metrics()
    m.declare_pools(POOLS)
    for i in range(3000):
        m.command(("alloc", "load", "backup", "free", "heartbeat")[i % 5], i % 9 != 0,
                  (i % 13) * 1e-4, "bad_rows")
    return m


def format_ms() -> dict[str, dict[str, float]]:
    m = _busy_metrics()

    def times(f: Callable[[], Any]) -> dict[str, float]:
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            f()
            ts.append(time.perf_counter() - t)
        ts.sort()
        return {"best": round(ts[0] * 1e3, 3), "median": round(ts[10] * 1e3, 3)}

    return {"exposition": times(m.exposition), "snapshot": times(m.snapshot)}


def backup_us(ops: int, period: float) -> dict[str, dict[str, float]]:
    out = {}
    with tempfile.TemporaryDirectory() as tmp:
        port = _free_port()
        d = DaemonProcess(device="cpu", preset="dsv4-flash", device_rows="page=64,swa_page=32,"
                          "req_slot=8", host=("--host-ratio", "2"), metrics_port=port,
                          log_path=str(Path(tmp) / "daemon.log"), cwd=ROOT).start()
        try:
            pools = DevicePools(build_layout(preset("dsv4-flash")),
                                {"page": 8, "swa_page": 4, "req_slot": 4})
            with pools, Client(d.address, timeout=10.0, name="scrape-cost", channel=False) as c:
                c.register(pools)
                items = {"c128_kv": ([3], c.alloc({"page": 1})["page"])}
                for _ in range(500):
                    c.wait_ack(c.backup(items))
                for mode in ("alone", "scraped"):
                    scr = _scraper(f"http://127.0.0.1:{port}/metrics", 10**6, period) \
                        if mode == "scraped" else None
                    lat = []
                    try:
                        for _ in range(ops):
                            t = time.perf_counter()
                            c.wait_ack(c.backup(items))
                            lat.append(time.perf_counter() - t)
                    finally:
                        if scr is not None:
                            scr.kill()
                            scr.wait()
                    out[mode] = _quantiles(lat, 1e6)
                c.unregister()
        finally:
            d.close()
    return out


def late_ticks() -> dict[str, dict[str, int]]:
    m = _busy_metrics()
    port = m.serve_http(0)
    out = {}
    try:
        for mode, target in (("scraped", port), ("refused", _free_port())):
            late: list[float] = []
            stop = threading.Event()

            def tick() -> None:
                while not stop.is_set():
                    t = time.perf_counter()
                    time.sleep(1e-4)
                    late.append(time.perf_counter() - t - 1e-4)

            th = threading.Thread(target=tick)
            th.start()
            _scraper(f"http://127.0.0.1:{target}/metrics", 300, 0.01).wait()
            stop.set()
            th.join()
            out[mode] = {"ticks": len(late), "over_1ms": sum(x > 1e-3 for x in late),
                         "over_2ms": sum(x > 2e-3 for x in late),
                         "max_us": round(max(late) * 1e6)}
    finally:
        m.close()
    return out


def _free_port() -> int:
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--ops", type=int, default=20000, help="timed backups per run")
    ap.add_argument("--period", type=float, default=0.1, help="seconds between scrapes")
    a = ap.parse_args()
    print(json.dumps({"format_ms": format_ms(), "backup_us": backup_us(a.ops, a.period),
                      "late_ticks": late_ticks()}))


if __name__ == "__main__":
    main()
