"""``hicache bench l3``: L3 put/get GB/s of 256-token pages through the daemon, beside
Mooncake's own best API in the same run (loopback TCP, CPU).

One run starts a local Mooncake Store (``mooncake_master`` + a storage member, loopback only),
then:

* **daemon**: a ``hicache serve --l3 mooncake`` subprocess and a registered client whose device
  pools hold random bytes, backed up to ``--pages`` host rows; ``l3_put`` of all of them (new
  keys each trial; timed from the command to its ack) and ``l3_prefetch`` back into other rows
  (timed the same way; every page is verified by the daemon's checksum).
* **mooncake**: a bare Mooncake client in its own process (``--raw``), one registered buffer
  holding the same number of objects of the same size (header + page), ``batch_put_from`` /
  ``batch_get_into`` in batches of 128, same pages, same trials.

Each side reports the best of ``--trials``; the ratios divide the daemon's figure by Mooncake's.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import time
from typing import Any

from hicache.core.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--preset", default="dsv4-flash", help="model layout (default dsv4-flash)")
    p.add_argument("--pages", type=int, default=32, help="pages per trial (default 32)")
    p.add_argument("--trials", type=int, default=3, help="trials per side; best reported")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--raw", help=argparse.SUPPRESS)  # internal: the bare Mooncake side


def _obj_bytes(preset_name: str) -> int:
    from hicache.controllers.l3_format import HEADER_BYTES, PAGE_SPACES
    from hicache.core.layout import build_layout, preset

    lay = build_layout(preset(preset_name))
    return HEADER_BYTES + sum(lay.row_bytes(s) for s in PAGE_SPACES if lay.space_pools(s))


def _raw(spec: dict[str, Any]) -> dict[str, Any]:
    """Mooncake alone: batch_put_from / batch_get_into on one registered buffer."""
    import numpy as np
    from mooncake.store import MooncakeDistributedStore

    s = MooncakeDistributedStore()
    if s.setup("127.0.0.1", spec["metadata"], 0, 16 << 20, "tcp", "", spec["master"]) != 0:
        raise RuntimeError("Mooncake setup failed")
    n, size = spec["pages"], spec["obj_bytes"]
    buf = np.random.default_rng(0).integers(0, 256, n * size, dtype=np.uint8)
    if s.register_buffer(buf.ctypes.data, buf.nbytes) != 0:
        raise RuntimeError("register_buffer failed")
    ptrs = [buf.ctypes.data + i * size for i in range(n)]
    # untimed: write the whole storage segment once, so neither side pays its first touch
    warm = [f"warm-{os.getpid()}-{i}" for i in range(spec["warm_objects"])]
    for b in range(0, len(warm), n):
        k = warm[b:b + n]
        s.batch_put_from(k, ptrs[:len(k)], [size] * len(k))
    s.batch_remove(warm, True)
    best: dict[str, float] = {"put": 0.0, "get": 0.0}
    for t in range(spec["trials"]):
        keys = [f"raw-{os.getpid()}-{t}-{i}" for i in range(n)]
        for op in ("put", "get"):
            t0 = time.perf_counter()
            for b in range(0, n, 128):
                k, p = keys[b:b + 128], ptrs[b:b + 128]
                if op == "put":
                    r = s.batch_put_from(k, p, [size] * len(k))
                    bad = [x for x in r if x != 0]
                else:
                    r = s.batch_get_into(k, p, [size] * len(k))
                    bad = [x for x in r if x != size]
                if bad:
                    raise RuntimeError(f"{op} failed: {bad[:4]}")
            best[op] = max(best[op], n * size / (time.perf_counter() - t0) / 1e9)
        s.batch_remove(keys, True)
    s.close()
    return best


def _daemon_side(args: argparse.Namespace, store: Any, tmp: str) -> dict[str, float]:
    import torch

    from hicache.core.layout import build_layout, preset
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.engine.device_pools import DevicePools
    from hicache.engine.l3_master import loopback_env

    n = args.pages
    lay = build_layout(preset(args.preset))
    rows = {"page": n, "swa_page": n, "req_slot": 1}
    d = DaemonProcess(preset=args.preset, device_rows=rows, host=("--host-ratio", "2"),
                      extra=("--l3", "mooncake", "--l3-master", store.master_addr,
                             "--l3-metadata", store.metadata_url),
                      env=loopback_env(), log_path=os.path.join(tmp, "daemon.log"))
    pools = DevicePools(lay, rows)
    best = {"put": 0.0, "get": 0.0}
    try:
        d.start()
        g = torch.Generator().manual_seed(0)
        for layers in pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        c = d.client(timeout=120)
        c.register(pools)
        deadline = time.monotonic() + 30
        while not c.stats()["l3"]["online"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon's L3 client did not come online")
            time.sleep(0.1)
        spaces = [s for s in ("page", "swa_page") if lay.space_pools(s)]
        src = c.alloc({s: n for s in spaces})
        dst = c.alloc({s: n for s in spaces})
        c.wait_ack(c.backup({s: (list(range(n)), src[s]) for s in spaces}), timeout=120)
        obj = _obj_bytes(args.preset)
        for t in range(args.trials):
            keys = [f"bench-{os.getpid()}-{t}-{i}" for i in range(n)]
            t0 = time.perf_counter()
            a = c.wait_ack(c.l3_put(keys, src), timeout=300)
            dt = time.perf_counter() - t0
            if a.l3["written"] != n:
                raise RuntimeError(f"daemon put wrote {a.l3}: {d.output(1500)}")
            best["put"] = max(best["put"], n * obj / dt / 1e9)
            t0 = time.perf_counter()
            a = c.l3_prefetch(keys, dst, deadline_ms=60_000, timeout=300)
            dt = time.perf_counter() - t0
            if a.l3["hits"] != n:
                raise RuntimeError(f"daemon prefetch got {a.l3}: {d.output(1500)}")
            best["get"] = max(best["get"], n * obj / dt / 1e9)
        c.unregister()
        c.close()
    finally:
        d.close()
        pools.close()
    return best


def run(args: argparse.Namespace) -> int:
    if args.raw:
        print(json.dumps(_raw(json.loads(args.raw))))
        return 0
    from hicache.engine.l3_master import LocalStore, loopback_env, mooncake_dir

    if mooncake_dir() is None:
        raise UsageError("bench l3 needs the Mooncake client: pip install 'hicache[l3]' "
                         "(and the system libibverbs1)")
    if args.pages <= 0 or args.trials <= 0:
        raise UsageError("--pages and --trials must be positive")
    obj = _obj_bytes(args.preset)
    seg = max(512 << 20, obj * args.pages * (2 * args.trials + 1))  # nothing evicted
    with tempfile.TemporaryDirectory(prefix="hc-bench-l3-") as tmp:
        with LocalStore(segment=str(seg), log_dir=os.path.join(tmp, "store")) as store:
            spec = {"master": store.master_addr, "metadata": store.metadata_url,
                    "pages": args.pages, "obj_bytes": obj, "trials": args.trials,
                    "warm_objects": int(seg * 0.85) // obj}
            r = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "l3", "--raw",
                                json.dumps(spec)], capture_output=True, text=True,
                               env={**os.environ, **loopback_env()}, timeout=600)
            if r.returncode:
                raise RuntimeError(f"bare Mooncake side failed: {r.stderr[-600:]}")
            raw = json.loads(r.stdout.strip().splitlines()[-1])
            ours = _daemon_side(args, store, tmp)
    out = {"preset": args.preset, "pages": args.pages, "object_bytes": obj,
           "trials": args.trials, "transport": "tcp loopback",
           "daemon_gbps": {k: round(v, 3) for k, v in ours.items()},
           "mooncake_gbps": {k: round(v, 3) for k, v in raw.items()},
           "ratio": {k: round(ours[k] / raw[k], 3) if raw[k] else None for k in ("put", "get")}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"L3 bench: {args.pages} pages of {obj / 1e6:.2f} MB ({args.preset}), best of "
              f"{args.trials}, loopback TCP")
        for k in ("put", "get"):
            print(f"  {k}: daemon {ours[k]:.2f} GB/s, Mooncake batch_{k}_"
                  f"{'from' if k == 'put' else 'into'} {raw[k]:.2f} GB/s, ratio "
                  f"{out['ratio'][k]}")
    return 0
