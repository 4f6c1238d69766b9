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
  ``batch_get_into`` in batches of 128, same pages; and, as a second reference, the same
  objects cut into the daemon's buffers (``batch_put_from_multi_buffers`` /
  ``batch_get_into_multi_buffers``, the daemon's calls without the daemon). It first writes the whole storage segment
  once (untimed), so neither side pays the segment's first touch.

Trials alternate between the sides (Mooncake trial t, then the daemon's trial t), so both see
the same machine; each side reports the best of ``--trials`` and every trial's figure; the
ratios divide the daemon's best by Mooncake's best.
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
    p.add_argument("--trials", type=int, default=5,
                   help="trials per side, the sides' order flipped each trial; best reported "
                        "(default 5; fewer is labelled: not a headline figure)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    p.add_argument("--raw", help=argparse.SUPPRESS)  # internal: the bare Mooncake side


def _obj_bytes(preset_name: str) -> int:
    from hicache.controllers.l3_format import HEADER_BYTES, PAGE_SPACES
    from hicache.core.layout import build_layout, preset

    lay = build_layout(preset(preset_name))
    return HEADER_BYTES + sum(lay.row_bytes(s) for s in PAGE_SPACES if lay.space_pools(s))


def _piece_sizes(preset_name: str) -> list[int]:
    """Buffers of one object as the daemon sends them: header, then every pool and layer."""
    from hicache.controllers.l3_format import HEADER_BYTES, PAGE_SPACES
    from hicache.core.layout import build_layout, preset

    lay = build_layout(preset(preset_name))
    return [HEADER_BYTES] + [p.page_bytes for s in PAGE_SPACES for p in lay.space_pools(s)
                             for _ in range(p.num_layers)]


def _raw(spec: dict[str, Any]) -> None:
    """Mooncake alone (its own process): ``batch_put_from`` / ``batch_get_into`` on one
    registered buffer. Prints ``ready``, then for each line ``trial T`` on stdin one JSON line
    ``{"put": GB/s, "get": GB/s}``."""
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
    print("ready", flush=True)
    for line in sys.stdin:
        t = int(line.split()[1])
        keys = [f"raw-{os.getpid()}-{t}-{i}" for i in range(n)]
        out = {}
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
            out[op] = n * size / (time.perf_counter() - t0) / 1e9
        s.batch_remove(keys, True)
        # the same objects cut into the daemon's buffers (header, pool x layer), same calls
        pieces = spec["pieces"]
        step = max(1, min(128, 1024 // len(pieces)))
        bufs = []
        for i in range(n):
            a = ptrs[i]
            bufs.append([a + o for o in np.cumsum([0] + pieces[:-1]).tolist()])
        for op in ("put", "get"):
            t0 = time.perf_counter()
            for b in range(0, n, step):
                k, p = keys[b:b + step], bufs[b:b + step]
                if op == "put":
                    r = s.batch_put_from_multi_buffers(k, p, [pieces] * len(k))
                    bad = [x for x in r if x != 0]
                else:
                    r = s.batch_get_into_multi_buffers(k, p, [pieces] * len(k), False)
                    bad = [x for x in r if x != size]
                if bad:
                    raise RuntimeError(f"multi-buffer {op} failed: {bad[:4]}")
            out[op + "_multi"] = n * size / (time.perf_counter() - t0) / 1e9
        s.batch_remove(keys, True)
        print(json.dumps(out), flush=True)
    s.close()


class _DaemonSide:
    """A daemon with L3 and a registered client whose random pages sit in ``pages`` host rows."""

    def __init__(self, args: argparse.Namespace, store: Any, tmp: str) -> None:
        import torch

        from hicache.core.layout import build_layout, preset
        from hicache.engine.daemon_process import DaemonProcess
        from hicache.engine.device_pools import DevicePools
        from hicache.engine.l3_master import loopback_env

        n = self.n = args.pages
        lay = build_layout(preset(args.preset))
        rows = {"page": n, "swa_page": n, "req_slot": 1}
        self.obj = _obj_bytes(args.preset)
        self.d = DaemonProcess(preset=args.preset, device_rows=rows, host=("--host-ratio", "2"),
                               extra=("--l3", "mooncake", "--l3-master", store.master_addr,
                                      "--l3-metadata", store.metadata_url,
                                      "--l3-scope", f"hicache-bench/{args.preset}"),
                               env=loopback_env(), log_path=os.path.join(tmp, "daemon.log"))
        self.pools = DevicePools(lay, rows)
        self.c: Any = None
        self.d.start()
        self.g = torch.Generator().manual_seed(0)
        self._fresh_device_bytes()
        c = self.c = self.d.client(timeout=120)
        c.register(self.pools)
        deadline = time.monotonic() + 30
        while not c.stats()["l3"]["online"]:
            if time.monotonic() > deadline:
                raise RuntimeError("the daemon's L3 client did not come online")
            time.sleep(0.1)
        spaces = self.spaces = [s for s in ("page", "swa_page") if lay.space_pools(s)]
        self.src = c.alloc({s: n for s in spaces})
        self.dst = c.alloc({s: n for s in spaces})
        c.wait_ack(c.backup({s: (list(range(n)), self.src[s]) for s in spaces}), timeout=120)

    def _fresh_device_bytes(self) -> None:
        import torch

        for layers in self.pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=self.g))

    def trial(self, t: int) -> dict[str, float]:
        c, n = self.c, self.n
        # the prefetch's rows get other bytes first: the daemon's checksum of what it read
        # then passes only if the read landed (from the second trial on they held the source)
        self._fresh_device_bytes()
        c.wait_ack(c.backup({s: (list(range(n)), self.dst[s]) for s in self.spaces}),
                   timeout=120)
        keys = [f"bench-{os.getpid()}-{t}-{i}" for i in range(n)]
        t0 = time.perf_counter()
        a = c.wait_ack(c.l3_put(keys, self.src), timeout=300)
        put = time.perf_counter() - t0
        if a.l3["written"] != n:
            raise RuntimeError(f"daemon put wrote {a.l3}: {self.d.output(1500)}")
        t0 = time.perf_counter()
        a = c.l3_prefetch(keys, self.dst, deadline_ms=60_000, timeout=300)
        get = time.perf_counter() - t0
        if a.l3["hits"] != n:
            raise RuntimeError(f"daemon prefetch got {a.l3}: {self.d.output(1500)}")
        return {"put": n * self.obj / put / 1e9, "get": n * self.obj / get / 1e9}

    def close(self) -> None:
        if self.c is not None:
            self.c.close()
        self.d.close()
        self.pools.close()


def run(args: argparse.Namespace) -> int:
    if args.raw:
        _raw(json.loads(args.raw))
        return 0
    from hicache.engine.l3_master import LocalStore, loopback_env, mooncake_dir

    if mooncake_dir() is None:
        raise UsageError("bench l3 needs the Mooncake client: pip install 'hicache[l3]' "
                         "(and the system libibverbs1)")
    if args.pages <= 0 or args.trials <= 0:
        raise UsageError("--pages and --trials must be positive")
    obj = _obj_bytes(args.preset)
    seg = max(512 << 20, obj * args.pages * (2 * args.trials + 1))  # nothing evicted
    ours: dict[str, list[float]] = {"put": [], "get": []}
    theirs: dict[str, list[float]] = {"put": [], "get": [], "put_multi": [], "get_multi": []}
    with tempfile.TemporaryDirectory(prefix="hc-bench-l3-") as tmp:
        with LocalStore(segment=str(seg), log_dir=os.path.join(tmp, "store")) as store:
            spec = {"master": store.master_addr, "metadata": store.metadata_url,
                    "pages": args.pages, "obj_bytes": obj,
                    "pieces": _piece_sizes(args.preset),
                    "warm_objects": int(seg * 0.85) // obj}
            raw = subprocess.Popen([sys.executable, "-m", "hicache.cli", "bench", "l3", "--raw",
                                    json.dumps(spec)], stdin=subprocess.PIPE,
                                   stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                                   env={**os.environ, **loopback_env()})
            side: _DaemonSide | None = None
            try:
                assert raw.stdin is not None and raw.stdout is not None
                if raw.stdout.readline().strip() != "ready":
                    raise RuntimeError("the bare Mooncake side did not start")
                side = _DaemonSide(args, store, tmp)
                for t in range(args.trials):  # alternate, the order flipped each trial:
                    if t % 2:  # both sides see the same machine, neither always first
                        o = side.trial(t)
                    raw.stdin.write(f"trial {t}\n")
                    raw.stdin.flush()
                    line = raw.stdout.readline()
                    if not line:
                        raise RuntimeError("the bare Mooncake side failed")
                    r = json.loads(line)
                    if not t % 2:
                        o = side.trial(t)
                    for k in theirs:
                        theirs[k].append(r[k])
                    for k in ours:
                        ours[k].append(o[k])
            finally:
                if side is not None:
                    side.close()
                if raw.stdin is not None:
                    raw.stdin.close()
                try:
                    raw.wait(30)
                except subprocess.TimeoutExpired:
                    raw.kill()
                    raw.wait(10)
    best_o = {k: max(v) for k, v in ours.items()}
    best_t = {k: max(v) for k, v in theirs.items()}
    out = {"preset": args.preset, "pages": args.pages, "object_bytes": obj,
           "trials": args.trials, "headline": args.trials >= 5, "transport": "tcp loopback",
           "daemon_gbps": {k: round(v, 3) for k, v in best_o.items()},
           "mooncake_gbps": {k: round(v, 3) for k, v in best_t.items()},
           "ratio": {k: round(best_o[k] / best_t[k], 3) for k in ("put", "get")},
           # the daemon against the very calls it makes (same buffers per object): its overhead
           "ratio_same_calls": {k: round(best_o[k] / best_t[k + "_multi"], 3)
                                for k in ("put", "get")},
           "trials_gbps": {"daemon": {k: [round(x, 3) for x in v] for k, v in ours.items()},
                           "mooncake": {k: [round(x, 3) for x in v] for k, v in theirs.items()}}}
    if args.json:
        print(json.dumps(out))
    else:
        print(f"L3 bench: {args.pages} pages of {obj / 1e6:.2f} MB ({args.preset}), best of "
              f"{args.trials}, loopback TCP"
              + (" (fewer than 5 trials: not a headline figure)" if args.trials < 5 else ""))
        for k in ("put", "get"):
            print(f"  {k}: daemon {best_o[k]:.2f} GB/s, Mooncake batch_{k}_"
                  f"{'from' if k == 'put' else 'into'} {best_t[k]:.2f} GB/s (ratio "
                  f"{out['ratio'][k]}), same calls with the daemon's buffers "
                  f"{best_t[k + '_multi']:.2f} GB/s (ratio {out['ratio_same_calls'][k]})")
    return 0
