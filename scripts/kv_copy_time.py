"""How long a key-store ``kv_put`` / ``kv_get`` holds the daemon's loop (docs/reliability.md,
section 7; docs/perf.md, forty-seventh session).

A CPU-mode ``hicache serve`` (dsv4-tiny) and this process as the engine: its SWA host pool in
memfds, one per layer (SGLang's layer_first layout), ``--pages`` distinct pages of random
bytes. Each round puts ``--pages`` new keys and gets them back, timed from the engine's side
(send -> reply; the copy runs on the daemon's server thread, so this is how long the loop reads
no other command); the bytes got back are compared with the bytes put. The heartbeat timeout is
600 s (filling the pool with random bytes takes seconds). Prints one JSON object:
bytes per call, and the median seconds and GB/s of the put and of the get.

Usage: ``python scripts/kv_copy_time.py [--pages 1500] [--rounds 3]``.
"""
from __future__ import annotations

import argparse
import json
import mmap
import os
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from hicache.core.layout import Layout  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402

NS = "dsv4-tiny/pp0of1"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--pages", type=int, default=1500, help="keys (pages) per call")
    ap.add_argument("--rounds", type=int, default=3, help="put + get rounds (median reported)")
    a = ap.parse_args()
    with DaemonProcess(preset="dsv4-tiny", device_rows=f"page=4,swa_page={a.pages},req_slot=4",
                       host=("--host-ratio", "1.25"), metrics_port=0, heartbeat_timeout=600,
                       extra=("--no-mtp", "--c128-state", "offline")) as d, d.client() as c:
        sw = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["swa_kv"]
        size = a.pages * sw.page_bytes
        fds, maps = [], []
        for _ in range(sw.num_layers):
            fd = os.memfd_create("kv-copy-time", os.MFD_CLOEXEC)
            os.ftruncate(fd, size)
            os.posix_fallocate(fd, 0, size)
            fds.append(fd)
            maps.append(mmap.mmap(fd, size))
        layers = [torch.frombuffer(m, dtype=torch.uint8).view(a.pages, sw.page_bytes)
                  for m in maps]
        c.kv_attach_proven("swa", NS, pages=a.pages, pool="swa_kv", page_bytes=sw.page_bytes,
                           layers=[{"fd": fd, "offset": 0, "stride": sw.page_bytes}
                                   for fd in fds])
        pages = list(range(a.pages))
        puts, gets = [], []
        for r in range(a.rounds):
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
            want = [t.clone() for t in layers]
            keys = [f"r{r}-{i}" for i in range(a.pages)]
            t0 = time.perf_counter()
            assert all(c.kv_put("swa", keys, pages, timeout=300)), "a key was not stored"
            puts.append(time.perf_counter() - t0)
            for t in layers:
                t.zero_()
            t0 = time.perf_counter()
            assert all(c.kv_get("swa", keys, pages, timeout=300)), "a key was not found"
            gets.append(time.perf_counter() - t0)
            assert all(torch.equal(x, y) for x, y in zip(layers, want)), "bytes differ"
            print(f"[kv_copy_time] round {r + 1}/{a.rounds}: put {puts[-1]:.3f} s, "
                  f"get {gets[-1]:.3f} s", file=sys.stderr)
        c.kv_detach()
        layers.clear()
        for m in maps:
            m.close()
        for fd in fds:
            os.close(fd)
    nbytes = a.pages * sw.page_bytes * sw.num_layers
    put, get = statistics.median(puts), statistics.median(gets)
    print(json.dumps({"pages": a.pages, "layers": sw.num_layers, "page_bytes": sw.page_bytes,
                      "bytes_per_call": nbytes, "put_s": round(put, 4),
                      "put_gb_s": round(nbytes / put / 1e9, 2), "get_s": round(get, 4),
                      "get_gb_s": round(nbytes / get / 1e9, 2), "verified": True}))


if __name__ == "__main__":
    main()
