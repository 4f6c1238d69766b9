"""What a copy's first use costs through the daemon (GPU): each backup and load size timed the
first time the daemon sees it and again, with Triton's cache dir cold or warm, and whether a
first use waits for the engine's own GPU work.

    python scripts/first_use_cost.py [--pages 1,2,3,16,17,64] [--triton-cache DIR] [--json]

Per phase a fresh ``hicache serve`` daemon (DSV4-Flash, one stage) and one engine client:

* ``cold``: ``TRITON_CACHE_DIR`` an empty folder: every kernel variant the daemon needs compiles;
* ``warm``: the same folder again (a restarted daemon on a host that served before);
* ``fenced``: the warm folder, each copy (first use and again) sent while the engine's stream
  runs a ``--fence-ms`` sleep kernel (the daemon's copies do not wait for it: no
  ``wait_event``; without MPS they share the GPU's time slices with it).

Each size: a ``backup_new`` of ``n`` pages (page and SWA spaces) timed to its ack, then the load
of those rows back to other device rows timed to its ack, then both again (``again``);
``backup_daemon`` is the backup's ack's own time (the daemon's, from submit to done).
A second client heartbeats every 2 ms meanwhile: its slowest round trip per phase says whether
a first use held the daemon's loop. ``kernels_ready``: the daemon's own start-up line on its
copy kernels' warm-up (seconds and launches). Prints one line per size and phase, or one JSON
object.
"""
from __future__ import annotations

import argparse
import json
import shutil
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import numpy as np  # noqa: E402
import torch  # noqa: E402

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402

SPACES = ("page", "swa_page")
PHASES = ("cold", "warm", "fenced")


def _beats(d: DaemonProcess, stop: threading.Event, out: list[float]) -> None:
    c = d.client(timeout=30.0, channel=False)
    try:
        while not stop.is_set():
            t0 = time.perf_counter()
            c.heartbeat()
            out.append(time.perf_counter() - t0)
            time.sleep(0.002)
    finally:
        c.close()


def _sleep_cycles(ms: float) -> int:
    clock = torch.cuda.get_device_properties(0).clock_rate if hasattr(
        torch.cuda.get_device_properties(0), "clock_rate") else 1_980_000
    return int(ms * clock)  # clock_rate is in kHz: cycles per ms


def _ready_line(d: DaemonProcess) -> str | None:
    """The daemon's start-up line on its copy kernels' warm-up (``copy kernels ready in S s``):
    what a start costs with this phase's Triton cache."""
    text = d.log_path.read_text(errors="replace") if d.log_path is not None else ""
    lines = [ln for ln in text.splitlines() if "copy kernels ready in" in ln]
    return lines[-1].split("copy kernels ", 1)[1] if lines else None


def phase(name: str, cache: str, pages: list[int], fence_ms: float) -> dict[str, Any]:
    layout = build_layout(preset("dsv4-flash"), 1, 0)
    most = max(pages)
    rows = {"page": 2 * most + 8, "swa_page": 2 * most + 8, "req_slot": 8}
    flag = ",".join(f"{k}={v}" for k, v in rows.items())
    res: dict[str, Any] = {"phase": name, "sizes": {}}
    with DaemonProcess(device="cuda:0", device_rows=flag, host=("--host-ratio", "2"),
                       ready_timeout=300, env={"TRITON_CACHE_DIR": cache}) as d, \
            DevicePools(layout, rows, device="cuda:0") as pools:
        res["kernels_ready"] = _ready_line(d)
        c = d.client(timeout=120.0, channel=False)
        c.register(pools, events=1)
        res["variants_after_register"] = c.stats().get("kernel_variants")
        beats: list[float] = []
        stop = threading.Event()
        th = threading.Thread(target=_beats, args=(d, stop, beats), daemon=True)
        th.start()
        time.sleep(0.2)
        rng = np.random.default_rng(0)
        for n in pages:
            perm = rng.permutation(rows["page"])
            src = {sp: perm[:n].tolist() for sp in SPACES}
            dst = {sp: perm[n:2 * n].tolist() for sp in SPACES}
            times: dict[str, list[float]] = {"backup": [], "backup_daemon": [], "load": []}
            for k in range(2):
                torch.cuda.synchronize()
                if name == "fenced":  # the engine's GPU busy, the first use and again
                    torch.cuda._sleep(_sleep_cycles(fence_ms))
                t0 = time.perf_counter()
                op = c.backup_new(src)
                ack = c.wait_ack(op, timeout=120)
                times["backup"].append(time.perf_counter() - t0)
                times["backup_daemon"].append(ack.seconds)  # the daemon's op, submit to done
                items = {sp: (op.rows[sp], dst[sp]) for sp in op.rows}
                if name == "fenced":
                    torch.cuda._sleep(_sleep_cycles(fence_ms))
                t0 = time.perf_counter()
                lop = c.load(items)
                c.wait_ack(lop, timeout=120)
                times["load"].append(time.perf_counter() - t0)
                torch.cuda.synchronize()
                c.free(op.rows)
            res["sizes"][n] = {f"{kind}_{w}_ms": round(1e3 * times[kind][i], 3)
                               for kind in times for i, w in enumerate(("first", "again"))}
        stop.set()
        th.join(5)
        res["heartbeat_max_ms"] = round(1e3 * max(beats), 3) if beats else None
        res["heartbeat_p50_ms"] = round(1e3 * float(np.median(beats)), 3) if beats else None
        res["variants_at_end"] = c.stats().get("kernel_variants")
        res["triton_cache_entries"] = sum(1 for _ in Path(cache).iterdir())
        c.unregister()
        c.close()
    return res


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pages", default="1,2,3,5,16,17,32,64")
    p.add_argument("--triton-cache", default=None, help="cache folder (default: a new one)")
    p.add_argument("--fence-ms", type=float, default=100.0)
    p.add_argument("--phases", default="cold,warm,fenced")
    p.add_argument("--json", action="store_true")
    a = p.parse_args()
    phases = a.phases.split(",")
    try:
        pages = [int(x) for x in a.pages.split(",")]
    except ValueError:
        pages = []
    why = ("needs a CUDA GPU" if not torch.cuda.is_available() else
           f"--pages {a.pages!r}: give positive page counts, comma-separated"
           if not pages or min(pages) < 1 else
           f"--phases {a.phases!r}: each of {', '.join(PHASES)}"
           if not set(phases) <= set(PHASES) else
           f"--phases cold needs an empty cache folder; {a.triton_cache} holds files"
           if "cold" in phases and a.triton_cache and any(Path(a.triton_cache).iterdir())
           else None)
    if why:
        print(f"first_use_cost.py: error: {why}", file=sys.stderr)
        return 2
    torch.cuda.set_device(0)
    torch.cuda._sleep(1000)  # the sleep kernel's own first use, before any phase
    torch.cuda.synchronize()
    cache = a.triton_cache or tempfile.mkdtemp(prefix="hc-triton-")
    out = []
    try:
        for name in phases:
            out.append(phase(name, cache, pages, a.fence_ms))
            _print(out[-1], a.json)
    finally:
        if not a.triton_cache:  # ours: removed
            shutil.rmtree(cache, ignore_errors=True)
    if a.json:
        print(json.dumps(out))
    return 0


def _print(r: dict[str, Any], as_json: bool) -> None:
    """One phase's lines (none with ``--json``: the whole report is printed at the end)."""
    if as_json:
        return
    name = r["phase"]
    print(f"[{name}] heartbeat p50 {r['heartbeat_p50_ms']} ms, max {r['heartbeat_max_ms']} ms; "
          f"triton cache entries {r['triton_cache_entries']}; variants after register "
          f"{r['variants_after_register']}, at the end {r['variants_at_end']}; start-up: "
          f"copy kernels {r['kernels_ready']}", flush=True)
    for n, v in r["sizes"].items():
        print(f"[{name}] {n:>3} pages: " + ", ".join(f"{k} {x}" for k, x in v.items()),
              flush=True)


if __name__ == "__main__":
    raise SystemExit(main())
