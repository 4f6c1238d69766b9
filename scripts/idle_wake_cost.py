"""What a quiet spell costs the next command: a daemon round trip and a bare GPU copy, hot and
after sleeping.

A measurement, not part of the product: ``python scripts/idle_wake_cost.py [--device cuda:0]
[--trials 25] [--json]``. It starts a ``hicache serve`` (DSV4-Flash, the device rows
``bench e2e`` gives 2k tokens) with its default busy-poll window (``spin_us``: 50 ms on a GPU,
0 on CPU), registers this process's device pools as an engine does, and times a
``heartbeat`` (the smallest command: no copy) from send to reply:

- ``hot``: back to back (300 after 50 untimed);
- ``after_<s>``: each after this process slept ``s`` seconds (``--trials`` each) for
  s = 0.01 (inside a GPU daemon's busy-poll window: only this process slept), 0.07 and 0.2
  (past it: the daemon's loop sleeps in its poll too and the command must wake it).

It does so through the client's shared-memory channel where the daemon grants one (GPU mode),
then through the ZMQ socket alone. On a GPU it also times a 1 MiB pinned host-to-device copy
and its stream's synchronize in this process, hot and after the same sleeps: what the GPU and
its driver add after a quiet spell, with no daemon involved. Prints the p50 / min / max in
microseconds of each, per path. ``bench e2e``'s idle load (``idle_first_ms``,
``idle_reply_ms``) is the same effect on a whole LOAD; docs/perf.md, "Sixtieth session".
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any, Callable

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

import torch  # noqa: E402

from hicache.bench.e2e import _rows_for  # noqa: E402
from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402

SLEEPS = (0.01, 0.07, 0.2)
HOT = 300
WARM = 50


def _stats(xs: list[float]) -> dict[str, float]:
    return {"p50_us": round(statistics.median(xs) * 1e6, 1), "min_us": round(min(xs) * 1e6, 1),
            "max_us": round(max(xs) * 1e6, 1)}


def hot_and_idle(one: Callable[[], float], trials: int) -> dict[str, dict[str, float]]:
    """``one()`` (seconds it took) back to back, then after each of ``SLEEPS``."""
    for _ in range(WARM):
        one()
    runs = {"hot": [one() for _ in range(HOT)]}
    for s in SLEEPS:
        xs = []
        for _ in range(trials):
            time.sleep(s)
            xs.append(one())
        runs[f"after_{s}"] = xs
    return {k: _stats(v) for k, v in runs.items()}


def heartbeats(d: DaemonProcess, pools: DevicePools, cuda: bool, channel: bool | None,
               trials: int) -> tuple[str, dict[str, Any]]:
    """A registered client's heartbeat round trips (``channel`` None: the client's default,
    False: the socket alone); the path's name and its figures."""
    c = d.client(timeout=30.0, channel=channel)
    try:
        c.register(pools, events=1 if cuda else 0)

        def one() -> float:
            t = time.perf_counter()
            c.heartbeat()
            return time.perf_counter() - t
        res: dict[str, Any] = hot_and_idle(one, trials)
        res["spin_us"] = c.stats().get("spin_us")
        name = "channel" if c.uses_channel else "socket"
        c.unregister()
    finally:
        c.close()
    return name, res


def gpu_copy(dev: str, trials: int) -> dict[str, dict[str, float]]:
    """A 1 MiB pinned host-to-device copy and its stream's synchronize, in this process."""
    h = torch.empty(1 << 20, dtype=torch.uint8).pin_memory()
    g = torch.empty(1 << 20, dtype=torch.uint8, device=dev)
    st = torch.cuda.Stream(device=dev)

    def one() -> float:
        t = time.perf_counter()
        with torch.cuda.stream(st):
            g.copy_(h, non_blocking=True)
        st.synchronize()
        return time.perf_counter() - t
    return hot_and_idle(one, trials)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--device", default="cuda:0" if torch.cuda.is_available() else "cpu")
    p.add_argument("--trials", type=int, default=25, help="commands timed after each sleep")
    args = p.parse_args(argv)
    if args.trials < 1:
        p.error(f"--trials must be at least 1, not {args.trials}")
    cuda = args.device.startswith("cuda")
    if cuda and not torch.cuda.is_available():
        p.error(f"--device {args.device}: this machine has no CUDA device")
    layout = build_layout(preset("dsv4-flash"))
    rows = _rows_for(layout, ["2k"])
    flag = ",".join(f"{k}={v}" for k, v in rows.items())
    out: dict[str, Any] = {"device": args.device, "trials": args.trials}
    with DaemonProcess(device=args.device, preset="dsv4-flash", device_rows=flag,
                       ready_timeout=300, host=("--host-ratio", "2")) as d, \
            DevicePools(layout, rows, device=args.device) as pools:
        for channel in ((None, False) if cuda else (False,)):  # CPU mode grants no channel
            print(f"[idle-wake] heartbeats, channel={channel}", file=sys.stderr, flush=True)
            name, res = heartbeats(d, pools, cuda, channel, args.trials)
            out[f"heartbeat_{name}"] = res
    if cuda:
        print("[idle-wake] a bare 1 MiB copy", file=sys.stderr, flush=True)
        out["gpu_copy_1MiB"] = gpu_copy(args.device, args.trials)
    print(json.dumps(out, indent=1))
    return 0


if __name__ == "__main__":
    try:
        sys.exit(main())
    except KeyboardInterrupt:  # the daemon and the pools are closed on the way out
        print("[idle-wake] interrupted", file=sys.stderr)
        sys.exit(130)
