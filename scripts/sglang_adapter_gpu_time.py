"""The SGLang adapter's GPU load as SGLang's HiCache calls it, timed from the engine's side.

A ``hicache serve --device cuda:0`` (DSV4-Flash, the adapter's layout: paged SWA, offline C128
state, no MTP) and this process as the SGLang worker: SGLang-shaped device pools
(``tests/sglang_gpu_shapes.py``) shared through ``DaemonLink.share``, the adapter's host pools,
and SGLang 0.5.23's ``submit_host_to_device`` loop (every stage layer, each pool that has it;
each call returns once its layer is copied). For each size, ``--pages`` pages of every pool
(the full mirror's bytes) from host rows the daemon allocated to scattered device rows:

* ``adapter``: the loop inside the adapter's ``submission`` (as the assembler patch installs
  it: one daemon ``load`` of every pool), median of ``--runs``: ms to the stage's first layer
  loaded in every pool, ms to the last, GB/s and the ratio to the limit;
* ``per_pool``: the same loop without ``submission`` (one daemon ``load`` per pool, each
  submitted at the pool's first layer: the adapter before the fifty-first session);
* ``one_op``: the same rows as one daemon ``load`` of every pool sent by the client itself
  (per-layer events, host-polled as the adapter polls): the adapter's floor;
* ``deferred``: the loop as SGLang's ``start_loading`` submits it (the adapter's calls do not
  wait: the link's ``layer_waits``), then the forward's ``wait_until`` for every stage layer
  in order (a ``LayerCounter`` stand-in): ms to layer 0 and to the last layer (its ack
  checked), and ``submit_ms``, how long the submission took, after which the forward can start
  launching (the blocking adapter's submission lasts to its last layer);
* ``with_forward``: the load and then a stand-in forward (``--forward-us`` of GPU work per stage
  layer, ``torch.cuda._sleep``) on the calling thread's stream, ms until that forward is done:
  ``blocking`` (the adapter's calls wait, then the forward is launched) against ``deferred``
  (each layer's work launched once ``wait_until`` returns for it): what overlapping the load
  with the forward gives an engine;
* ``limit``: a contiguous pinned host-to-device copy of the same bytes, best of 5, same run.

Every loaded byte is compared with its source once per size. Prints one JSON object; progress
goes to stderr. Usage: ``python scripts/sglang_adapter_gpu_time.py [--pages 8,32,128]
[--runs 5]`` on a GPU machine.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
import time
from pathlib import Path
from typing import Any

import torch

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.client import Client  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402
from hicache.engine.sglang.link import DaemonLink  # noqa: E402
from hicache.engine.sglang.stage_map import SGLANG_POOLS  # noqa: E402
from sglang_gpu_shapes import (LayerCounter, Pool, backup_all,  # noqa: E402
                               load_layer_by_layer, sglang_stage, tokens)

DEV = torch.device("cuda:0")
LAYOUT = build_layout(preset("dsv4-flash"), swa_mode="paged", c128_state="offline", mtp=False)
PAGE = LAYOUT.model.page_size


def _say(msg: str) -> None:
    print(f"[sglang-gpu] {msg}", file=sys.stderr, flush=True)


def _limit(nbytes: int) -> float:
    """GB/s of a contiguous pinned host-to-device copy of ``nbytes``, best of 5."""
    src = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dst = torch.empty(nbytes, dtype=torch.uint8, device=DEV)
    best = float("inf")
    for _ in range(6):  # (the first warms up)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        dst.copy_(src, non_blocking=True)
        torch.cuda.synchronize()
        best = min(best, time.perf_counter() - t0)
    return nbytes / best / 1e9


def _zero(layers: dict[str, list[torch.Tensor]], pools: dict[str, Pool],
          dst: dict[str, list[int]]) -> None:
    """Zero the destination rows of every pool (so the load's bytes are told apart)."""
    for name, p in pools.items():
        di = torch.tensor(dst[p.space], device=DEV)
        for t in layers[name]:
            t.index_fill_(0, di, 0)
    torch.cuda.synchronize()


def _verify(layers: dict[str, list[torch.Tensor]], pools: dict[str, Pool],
            src: dict[str, list[int]], dst: dict[str, list[int]], what: str) -> None:
    """Every loaded byte equals its source row's (the rows backed up)."""
    torch.cuda.synchronize()
    for name, p in pools.items():
        si = torch.tensor(src[p.space], device=DEV)
        di = torch.tensor(dst[p.space], device=DEV)
        for li, t in enumerate(layers[name]):
            if not torch.equal(t.index_select(0, si), t.index_select(0, di)):
                raise SystemExit(f"sglang_adapter_gpu_time: {name} layer {li}: loaded bytes "
                                 f"differ from the source rows ({what})")


def _timed(fn: Any) -> tuple[float, float]:
    """(ms to the first layer, ms to the end) of one run of ``fn(mark)``."""
    t0 = time.perf_counter()
    marks: list[float] = []
    fn(lambda: marks.append(time.perf_counter()))
    end = time.perf_counter()
    if not marks:
        raise RuntimeError("the first layer was never marked")
    return (marks[0] - t0) * 1e3, (end - t0) * 1e3


def _cycles_per_us() -> float:
    """GPU clock cycles per microsecond (``torch.cuda._sleep`` counts cycles), timed here."""
    torch.cuda._sleep(1_000_000)  # (warm-up)
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    a.record()
    torch.cuda._sleep(50_000_000)
    b.record()
    b.synchronize()
    return 50_000_000 / (a.elapsed_time(b) * 1e3)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--pages", default="8,32,128", help="pages per load (default 8,32,128)")
    ap.add_argument("--runs", type=int, default=5, help="timed runs per size (default 5)")
    ap.add_argument("--forward-us", type=float, default=200.0,
                    help="the stand-in forward's GPU time per stage layer (default 200)")
    a = ap.parse_args()
    if not a.forward_us > 0:
        print(f"sglang_adapter_gpu_time: --forward-us must be > 0, got {a.forward_us}",
              file=sys.stderr)
        return 2
    sizes = [int(x) for x in a.pages.split(",")]
    if not torch.cuda.is_available():
        print("sglang_adapter_gpu_time: needs a CUDA GPU", file=sys.stderr)
        return 2
    most = max(sizes)
    rows = {"page": 2 * most, "swa_page": 2 * most, "req_slot": 4}
    _say(f"starting the daemon ({rows})")
    d = DaemonProcess(device="cuda:0", preset="dsv4-flash", host=("--host-ratio", "2"),
                      device_rows=",".join(f"{k}={v}" for k, v in rows.items()),
                      extra=("--no-mtp", "--c128-state", "offline"), log_level="warning",
                      ready_timeout=300).start()
    link = None
    try:
        torch.cuda.set_device(DEV)
        stage = sglang_stage(LAYOUT, rows, {}, DEV)
        link = DaemonLink.share(stage, Client(d.address, timeout=5.0, name="sglang-gpu"), None)
        c = link.client
        pools = {ours: Pool(link, sgl) for sgl, ours in SGLANG_POOLS.items()}
        first_g = min(g for p in pools.values() for g in LAYOUT.pools[p.ours].layers)
        in_first = sum(first_g in LAYOUT.pools[n].layers for n in pools)
        load = torch.cuda.Stream(DEV)
        counter = LayerCounter()
        link.layer_waits.attach(counter)
        cycles = int(a.forward_us * _cycles_per_us())
        gen = torch.Generator().manual_seed(1)
        out: dict[str, Any] = {"device": torch.cuda.get_device_name(DEV), "runs": a.runs,
                               "sizes": []}
        for n in sizes:
            host = {s: link.alloc(s, n) for s in ("page", "swa_page")}
            perm = {s: torch.randperm(rows[s], generator=gen).tolist() for s in host}
            src = {s: perm[s][:n] for s in host}  # scattered, as an allocator leaves them
            dst = {s: perm[s][n: 2 * n] for s in host}
            backup_all(pools, {s: (tokens(host[s], PAGE), tokens(src[s], PAGE)) for s in host})
            nbytes = sum(n * LAYOUT.pools[name].page_bytes * LAYOUT.pools[name].num_layers
                         for name in pools)
            ids = {s: (tokens(host[s], PAGE), tokens(dst[s], PAGE)) for s in host}

            def adapter(mark: Any, grouped: bool = True) -> None:
                seen = [0]

                def after(name: str, li: int) -> None:
                    if LAYOUT.pools[name].layers[li] == first_g:
                        seen[0] += 1
                        if seen[0] == in_first:
                            mark()
                load_layer_by_layer(pools, ids, load, after, grouped)

            def per_pool(mark: Any) -> None:
                adapter(mark, grouped=False)

            def one_op(mark: Any) -> None:
                op = c.load({name: (host[p.space], dst[p.space]) for name, p in pools.items()})
                for g in c.stage_layers:
                    c.wait_layer(op, g)
                    if g == first_g:
                        mark()
                c.wait_ack(op, check=True)  # (TransferFailed if it failed)

            submitted: list[float] = []

            def submit_deferred() -> None:
                counter.update_producer()  # (``start_loading``, before it submits)
                t0 = time.perf_counter()
                load_layer_by_layer(pools, ids, load, defer=True)
                submitted.append((time.perf_counter() - t0) * 1e3)
                counter.consumer_index = counter.producer_index  # the batch's forward

            def deferred(mark: Any) -> None:
                submit_deferred()
                for t in range(len(c.stage_layers)):
                    counter.wait_until(t)
                    if t == 0:
                        mark()

            def with_forward(defer: bool) -> float:
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                if defer:
                    submit_deferred()
                else:
                    load_layer_by_layer(pools, ids, load)
                for t in range(len(c.stage_layers)):
                    if defer:
                        counter.wait_until(t)
                    torch.cuda._sleep(cycles)  # layer t's attention and the rest
                torch.cuda.current_stream().synchronize()
                return (time.perf_counter() - t0) * 1e3

            res: dict[str, Any] = {"pages": n, "bytes": nbytes}
            for name, fn in (("adapter", adapter), ("per_pool", per_pool), ("one_op", one_op),
                             ("deferred", deferred)):
                _zero(stage.layers, pools, dst)
                submitted.clear()
                runs = [_timed(fn) for _ in range(a.runs + 1)][1:]  # (one warm-up)
                _verify(stage.layers, pools, src, dst, f"{name}, {n} pages")
                last = statistics.median(r[1] for r in runs)
                res[name] = {"first_layer_ms": round(statistics.median(r[0] for r in runs), 3),
                             "last_layer_ms": round(last, 3),
                             "GBps": round(nbytes / last / 1e6, 2)}
                if submitted:
                    res[name]["submit_ms"] = round(statistics.median(submitted[1:]), 3)
            fwd: dict[str, Any] = {"forward_ms": round(
                a.forward_us * len(c.stage_layers) / 1e3, 3)}
            for name, defer in (("blocking", False), ("deferred", True)):
                _zero(stage.layers, pools, dst)
                runs = [with_forward(defer) for _ in range(a.runs + 1)][1:]
                _verify(stage.layers, pools, src, dst, f"{name} with a forward, {n} pages")
                fwd[f"{name}_ms"] = round(statistics.median(runs), 3)
            res["with_forward"] = fwd
            res["verified"] = True
            res["limit_GBps"] = round(_limit(nbytes), 2)
            for name in ("adapter", "per_pool", "one_op", "deferred"):
                res[name]["ratio"] = round(res[name]["GBps"] / res["limit_GBps"], 3)
            _say(f"{n} pages ({nbytes / 1e6:.0f} MB): adapter {res['adapter']}, per pool "
                 f"{res['per_pool']}, one op {res['one_op']}, deferred {res['deferred']}, "
                 f"with a forward {fwd}, limit {res['limit_GBps']} GB/s")
            out["sizes"].append(res)
            for s, r in host.items():
                link.free(s, r)
        print(json.dumps(out))
        return 0
    finally:
        if link is not None:
            link.close()
        d.stop()


if __name__ == "__main__":
    sys.exit(main())
