"""``hicache bench e2e``: what an engine sees of a LOAD and a BACKUP through the daemon.

This process is the engine: it owns DSV4 device pools (CUDA tensors shared by IPC; shared
memory in CPU mode), starts a real ``hicache serve`` for the same GPU, registers, churns the
daemon's host allocator (``churn``: with ``--host-fill full``, the default, the pool is filled,
churned full, evicting to admit, then random blocks are freed until the largest size's room is
free, so the timed runs take their host rows out of the holes evictions left, as in a full
server's pool; the JSON's ``host_held`` says how much stayed held, and each size's
``host_mean_run`` the mean run of its timed backups' host rows; ``light`` is the churn before
the fifty-third session, which left the pool nearly empty and every timed load one run), then
per prefix size (device rows scattered at random, or as ``--device-order`` says,
``bench.device_order``; the summary's ``device_mean_run`` is the mean run of a load's
destination rows). With ``--fence`` (GPU) every LOAD and BACKUP waits for an event the engine
records on its stream first, as the SGLang adapter's commands do (``bench.fence``); without
it the engine's writes are done (a host synchronize) before it sends. ``--layer-wait`` picks
how the engine waits for a load's layer (GPU): ``host`` (the default, the client's default)
polls the layer's interprocess event on the host until it completes, holding the engine's
thread; ``stream`` (the client's ``spin_us = 0``) puts a wait on the engine's stream once the
daemon said the layer was issued, and returns (an engine that must not hold its thread, as
SGLang's forward waits on its stream):

* BACKUP: command -> ack (engine clock), GB/s;
* LOAD: command -> first and -> last stage layer ready, both from CUDA events recorded on the
  engine's stream right after its per-layer waits on the daemon's events (CPU mode: the ack);
  command -> ack; GB/s; every loaded byte verified once per size, and (GPU) in one more,
  untimed load each stage layer's bytes compared at that layer's ready event; command -> reply
  (``load_reply_ms``: layer 0 is issued before the reply);
* the daemon's own mean handling time of this size's LOAD and BACKUP commands, request to reply
  (``load_handler_ms``, ``backup_handler_ms``: from its ``stats`` before and after
  ``HANDLER_RUNS`` extra solo runs that follow the timed ones, ``bench.daemon_times``), beside
  the engine's mean ack of those same commands (``load_handler_ack_ms``,
  ``backup_handler_ack_ms``), so the ack's time splits into the daemon's handling and the rest
  (the trip there and back, and the copies' wait); and the mean
  time its issuer thread spent issuing the later layers after each reply (``load_issue_ms``,
  GPU: host time the link may wait for), and its CPU time in it (``load_issue_cpu_ms``: the
  rest it waited for a core or the GIL);
* a heartbeat sent right after a load's reply, while those layers are being issued: its round
  trip (``load_cmd_ms``, column ``cmd ms``): how long the engine's next command waits behind a
  load;
* the same load issued in-process by the kernels alone (``dispatch.copy_by_layer`` into a
  pinned pool of this process, same rows): what an in-engine copy costs, so the daemon's
  overhead shows as a ratio; in the size's verified run its bytes are checked too;
* the engine's own smallest GPU step (one ``add_`` and a host wait, on its stream) in a loop,
  idle and while a LOAD or a BACKUP of the size runs (``engine_wait``: p50 / p99 / max ms per
  kind, ``e2e_engine``): without MPS an engine kernel may wait for the daemon's time slice;
* a load while backups of the same size stream (``BUSY_BACKUPS``, 2, sent back to back
  before it: a single one ended before the load's tail at 2k and 8k): its last layer against
  the solo load's (``busy_vs_solo``) and its second layer (``busy_second_ms``, column ``busy
  2nd``), and whether a backup still ran when that load's last layer was ready
  (``busy_covered``: the share of runs; ``busy_backup_end_ms``, from the first backup's
  command to the last one's completion). While the
  daemon's kernels run, the GPU time-slices between its context and the engine's (no MPS):
  the engine's events run at slice boundaries, so ``busy 2nd`` reads in steps of ~1.05 ms
  (an H200, docs/perf.md, twentieth session). The start is recorded before the first backup
  is sent, on the idle stream, less the host time until the load's command (``busy_start``):
  a start recorded after it ran up to a slice late, a large share of a short load. The
  verified run checks the busy load's bytes too, into rows given fresh bytes first;
* (GPU) the same load once more in each run, sent after nothing was sent for the daemon's
  busy-poll window and 20 ms (``idle_first_ms``, ``idle_last_ms``, ``idle_reply_ms``: its
  command -> reply; columns ``idle 1st``, ``idle last``, ``idle reply``): the other loads are
  timed back to back, inside that window, where the daemon's loop never sleeps; an engine's
  first load after a quiet spell wakes it.

``--mirror`` picks the host-tier layouts loaded from: ``full`` (every pool of every page: the
JSON's ``sizes``) and ``checkpoints`` (compressed pages plus one checkpoint, what a resume
needs: ``checkpoints``, measured by ``e2e_checkpoint``); both by default.

Each figure is the median of ``--runs`` runs, after one untimed round of the same size (the
daemon's handling times are means: a cold first round once read 20-140 ms); ratios divide by the
contiguous pinned-copy limit measured in the same run (best of 5 trials per direction, at the
start and again at the end: the better of the two, as a limit read low flatters every ratio;
the JSON keeps both readings; ``--gpus`` runs read it at the start only, one GPU at a time).
Each size's verified run gives its rows bytes seeded afresh (a seed per size once left an
untimed round's bytes where the timed backup wrote them). The
report names the busy-poll windows in force (``daemon_spin_us`` from the daemon's ``stats``,
``client_reply_spin_us``: the defaults, 50,000 and 2,000 µs on a GPU) and whether the engine's
requests went through a shared-memory channel (``channel``: ``--channel auto``, the client's
default, uses one where the daemon grants it, as on a GPU; ``off`` keeps every request on ZMQ,
for a like-for-like comparison; ``channel_refused`` says why none was granted). ``--plot`` draws the
ratios (needs matplotlib; refused with a message without it).
"""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import torch

from hicache.bench.daemon_times import daemon_times, mean_ms
from hicache.bench.flags import parse_list
from hicache.core.plotting import check_plot, pyplot
from hicache.core.config import check_device
from hicache.core.errors import UsageError
from hicache.core.layout import Layout, build_layout, preset
from hicache.core.sizes import arena_bytes, format_bytes, host_rows, used_spaces
from hicache.engine.client import Client
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.device_pools import DevicePools
from hicache.host_pools.memory import available_bytes, default_reserve
from hicache.host_pools.group import HostPoolGroup
from hicache.kernels.tables import LayerTable
from hicache.bench.device_order import PATTERNS, device_order
from hicache.bench.transfer_rows import mean_run
from hicache.bench.e2e_checkpoint import one_size_ckpt
from hicache.bench.e2e_engine import KINDS, new_waits, probe_rounds
from hicache.bench.fence import Fenced
from hicache.kernels.sharing import gpu_sharing
from hicache.bench.e2e_measure import (BUSY_BACKUPS, FIGURES, IDLE_MARGIN_S, INPROC_CTAS,
                                       busy_start, idle_load, inproc_into, layer_compare,
                                       layers_checked_load,
                                       load_into, load_while_busy, scramble, stream_backups,
                                       summarize, untouched)

PAGE_TOKENS = 256
HANDLER_RUNS = 2  # solo runs per size for the daemon's handling times (after the timed runs)
SIZES = {"2k": 2048, "8k": 8192, "32k": 32768, "128k": 131072}
HOST_RATIO = 2.0  # the daemon's host rows : the engine's device rows
MIRRORS = ("full", "checkpoints")
HOST_FILLS = ("full", "light")
BLOCK_ROWS = 32  # the churn's blocks: 1..BLOCK_ROWS rows each


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--device", default="cuda:0", help="cuda:N, or cpu for a functional run")
    p.add_argument("--preset", default="dsv4-flash")
    p.add_argument("--sizes", default="2k,8k,32k,128k", help=f"prefix sizes of {list(SIZES)}")
    p.add_argument("--mirror", default="full,checkpoints",
                   help="host-tier layouts to load from: full (every pool of every page) and/or "
                        "checkpoints (compressed pages + one checkpoint) [both]")
    p.add_argument("--runs", type=int, default=5, help="timed runs per size (median)")
    p.add_argument("--churn", type=int, default=2000, help="mixed alloc/free ops before timing")
    p.add_argument("--host-fill", choices=HOST_FILLS, default="full",
                   help="the daemon's host pool during the timed runs: full (filled by the "
                        "churn to all but the largest size's room, as a running server's; the "
                        "default) or light (the churn holds at most 64 blocks, then frees half "
                        "of them: a nearly empty pool, the bench before the fifty-third "
                        "session)")
    p.add_argument("--fence", action="store_true",
                   help="GPU: every LOAD and BACKUP waits for an event the engine records on "
                        "its stream first (wait_event), as the SGLang adapter's commands do")
    p.add_argument("--layer-wait", choices=("host", "stream"), default="host",
                   help="GPU: the engine waits for a load's layer by polling its event on the "
                        "host (host, the client's default) or with a wait on its stream once "
                        "the layer is issued (stream: the engine's thread is not held)")
    p.add_argument("--device-order", choices=PATTERNS, default="random",
                   help="the engine's device rows: scattered at random (the default), as "
                        "SGLang's unsorted free list hands them out after churn, or "
                        "consecutive (a sorted free list with room: the best case)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--plot", metavar="FILE.png", help="draw the ratios (needs matplotlib)")
    p.add_argument("--pp-size", type=int, default=1, help="pipeline stages of the model")
    p.add_argument("--pp-rank", type=int, default=0, help="the stage this run's daemon serves")
    p.add_argument("--gpus", type=int, default=1,
                   help="N > 1: one engine + daemon per GPU (cuda:0..N-1), each a PP=N stage, "
                        "all loading at once; reports each GPU's figures")
    p.add_argument("--channel", choices=("auto", "off"), default="auto",
                   help="the engine's requests through a shared-memory channel where the "
                        "daemon grants one (auto, the client's default) or over ZMQ only")
    p.add_argument("--barrier", help=argparse.SUPPRESS)  # --gpus children: a shared folder


def parse_sizes(text: str) -> list[str]:
    return parse_list(text, "--sizes", str, SIZES.__contains__,
                      f"sizes from {', '.join(SIZES)}")


def parse_mirrors(text: str) -> list[str]:
    return parse_list(text, "--mirror", str, MIRRORS.__contains__,
                      f"mirrors from {', '.join(MIRRORS)}")


def check_args(args: argparse.Namespace) -> None:
    parse_mirrors(args.mirror)
    if args.runs < 1:
        raise UsageError("--runs must be at least 1")
    if args.churn < 0:
        raise UsageError("--churn must not be negative")
    if args.pp_size < 1:
        raise UsageError(f"--pp-size must be positive, got {args.pp_size}")
    if not 0 <= args.pp_rank < args.pp_size:
        raise UsageError(f"--pp-rank {args.pp_rank} is outside 0..{args.pp_size - 1}")
    if args.gpus < 1:
        raise UsageError("--gpus must be at least 1")
    if args.fence and not str(args.device).startswith("cuda"):
        raise UsageError("--fence applies to GPU runs: CPU mode has no interprocess events "
                         "for a command to wait for")
    if args.layer_wait != "host" and not str(args.device).startswith("cuda"):
        raise UsageError("--layer-wait stream applies to GPU runs: CPU mode has no per-layer "
                         "events (a load's layers are ready with its ack)")
    if args.gpus > 1 and (not torch.cuda.is_available()
                          or torch.cuda.device_count() < args.gpus):
        raise UsageError(f"--gpus {args.gpus} needs {args.gpus} CUDA GPUs; this machine has "
                         f"{torch.cuda.device_count() if torch.cuda.is_available() else 0}")
    if args.gpus > 1 and (args.pp_size != 1 or args.plot):
        raise UsageError("--gpus sets the stages itself (PP = N) and draws no plot")
    check_device(args.device)  # the daemon's own check: cuda needs its index
    if args.device.startswith("cuda") and not torch.cuda.is_available():
        raise UsageError("bench e2e on cuda needs a CUDA GPU; use --device cpu for a "
                         "functional run without one")
    check_plot(args.plot)


def _rows_for(layout: Layout, sizes: list[str]) -> dict[str, int]:
    """The engine's device rows for a run of ``sizes``: room for a prefix of the largest size
    twice over (its backup's source and its load's destination), and a few request slots."""
    pages = max(SIZES[s] for s in sizes) // PAGE_TOKENS
    return {"page": 2 * pages + 8, "swa_page": 2 * pages + 8, "req_slot": 8}


def check_cpu_memory(layout: Layout, sizes: list[str]) -> None:
    """CPU mode: the engine's "device" pools are host memory beside the daemon's pool (at
    ``HOST_RATIO`` times their rows); refuse sizes whose two together do not fit in the memory
    available, less the daemon's reserve, naming what would fit (without this check the run
    pages for minutes, then reports a daemon it cannot reach)."""
    def need(upto: list[str]) -> int:
        dev = _rows_for(layout, upto)
        used = {s: n for s, n in dev.items() if s in used_spaces(layout)}
        return arena_bytes(layout, used) + arena_bytes(layout, host_rows(layout, used,
                                                                         ratio=HOST_RATIO))
    avail, what = available_bytes()
    room = avail - default_reserve(psutil.virtual_memory().total)
    if need(sizes) <= room:
        return
    fits = [s for s in SIZES if need([s]) <= room]
    raise UsageError(f"bench e2e --device cpu --sizes {','.join(sizes)} needs "
                     f"{format_bytes(need(sizes))} of host memory (the engine's pools and the "
                     f"daemon's pool at {HOST_RATIO:g}x their rows) and {format_bytes(avail)} "
                     f"{what} ({format_bytes(max(room, 0))} after the daemon's reserve); "
                     + (f"--sizes {','.join(fits)} fits" if fits else "no size fits"))


def pinned_limit(device: torch.device, nbytes: int = 1 << 30, trials: int = 5) -> dict[str, float]:
    """Best of ``trials`` contiguous pinned copies per direction, GB/s (1e9 B/s)."""
    host = torch.empty(nbytes, dtype=torch.uint8, pin_memory=True)
    dev = torch.empty(nbytes, dtype=torch.uint8, device=device)
    out = {}
    for name, (a, b) in {"h2d": (dev, host), "d2h": (host, dev)}.items():
        best = 0.0
        for _ in range(trials):
            s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            s.record()
            a.copy_(b, non_blocking=True)
            e.record()
            e.synchronize()
            best = max(best, nbytes / (s.elapsed_time(e) * 1e-3) / 1e9)
        out[name] = best
    del host, dev
    return out


def churn(c: Client, spaces: dict[str, int], ops: int, rng: np.random.Generator,
          room: int | None = None) -> dict[str, float]:
    """Mixed allocs (1..``BLOCK_ROWS`` rows in every space of ``spaces``, fewer in a pool
    that holds few more than ``room``) and frees; returns
    the share of each space's host rows left held (the timed runs never free them).
    ``room`` None (``--host-fill light``): at most 64 blocks held, about half of them freed at
    the end (the pool stays nearly empty, its free rows in a few long runs). ``room`` (rows):
    the pool is filled with blocks until the next would not fit, then each op frees a random
    block and allocates until the next would not fit again (a full cache that evicts to
    admit), and last random blocks are freed until ``room`` rows of each space are free: the
    timed runs get their rows out of the holes evictions left, as in a full server's pool."""
    held: list[dict[str, list[int]]] = []
    total = {s: int(c.registered["host_rows"][s]) for s in spaces}
    if room is None:
        for _ in range(ops):
            if held and (rng.random() < 0.5 or len(held) > 64):
                c.free(held.pop(int(rng.integers(len(held)))))
            else:
                n = int(rng.integers(1, BLOCK_ROWS + 1))
                try:
                    held.append(c.alloc({s: n for s in spaces}))
                except Exception:  # noqa: BLE001 - full: free instead
                    if held:
                        c.free(held.pop(0))
        for h in held[::2]:
            c.free(h)
        kept = held[1::2]
    else:
        free = min(total.values())
        # blocks small enough that several fit beside the room (a small pool's churn would
        # otherwise hold one block or none)
        most = min(BLOCK_ROWS, max(1, (free - room) // 8))

        def evict() -> None:
            nonlocal free
            h = held.pop(int(rng.integers(len(held))))
            c.free(h)
            free += len(next(iter(h.values())))

        def admit() -> None:
            nonlocal free
            while (n := int(rng.integers(1, most + 1))) <= free:
                held.append(c.alloc({s: n for s in spaces}))
                free -= n
        admit()
        for _ in range(ops):
            if held:
                evict()
            admit()
        while free < room and held:
            evict()
        kept = held
    used = {s: sum(len(h[s]) for h in kept) for s in spaces}
    return {s: used[s] / total[s] for s in spaces}


def run(args: argparse.Namespace) -> int:
    check_args(args)
    sizes = parse_sizes(args.sizes)
    if args.gpus > 1:
        return run_gpus(args)
    dev = torch.device(args.device)
    cuda = dev.type == "cuda"
    if cuda:
        torch.cuda.set_device(dev)  # Triton launches on the current device
    layout = build_layout(preset(args.preset), args.pp_size, args.pp_rank)
    if not cuda:
        check_cpu_memory(layout, sizes)
    dev_rows = _rows_for(layout, sizes)
    spaces = {s: n for s, n in dev_rows.items() if s in ("page", "swa_page")}
    rng = np.random.default_rng(0)
    limit: dict[str, Any] = {"h2d": None, "d2h": None}
    for k in range(args.pp_size if args.barrier else 1):  # --gpus: one GPU's limit at a time
        if cuda and k == (args.pp_rank if args.barrier else 0):
            limit = pinned_limit(dev)
        if args.barrier:
            barrier(args.barrier, f"limit{k}", args.pp_size, args.pp_rank)
    say = (lambda *a: None) if args.json else (lambda *a: print(*a, file=sys.stderr, flush=True))
    say(f"[e2e] pinned-copy limit (GB/s): {limit}")
    rows_flag = ",".join(f"{k}={v}" for k, v in dev_rows.items())
    with DaemonProcess(device=args.device, preset=args.preset, device_rows=rows_flag,
                       host=("--host-ratio", f"{HOST_RATIO:g}"), ready_timeout=300,
                       extra=("--pp-size", str(args.pp_size),
                              "--pp-rank", str(args.pp_rank))) as d, \
            DevicePools(layout, dev_rows, device=args.device) as pools:
        for layers in pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=t.device))
        c = d.client(timeout=60.0, channel=None if args.channel == "auto" else False)
        c.register(pools, events=1 if cuda else 0)
        if args.layer_wait == "stream":
            c.spin_us = 0.0  # wait_layer: a stream wait once the layer is issued
        say(f"[e2e] registered; churning the host allocator ({args.churn} ops, host pool "
            f"{args.host_fill})")
        # the largest size's room: its backup's rows and the busy backups' beside them
        room = None if args.host_fill == "light" else \
            (1 + BUSY_BACKUPS) * max(SIZES[s] for s in sizes) // PAGE_TOKENS + 8
        fill = churn(c, spaces, args.churn, rng, room)
        sender = Fenced(c) if args.fence else c  # what sends the loads and backups
        # the in-process copy's pinned pool has the daemon's host rows (churn spreads them)
        local = _local(layout, c.registered["host_rows"], pools, dev) if cuda else None
        result = {"device": args.device, "preset": args.preset, "limit_gbps": limit,
                  "device_order": args.device_order, "host_fill": args.host_fill,
                  "host_held": fill, "fence": args.fence, "layer_wait": args.layer_wait,
                  "pp_size": args.pp_size, "pp_rank": args.pp_rank,
                  "ctas": INPROC_CTAS, "runs": args.runs,
                  "daemon_spin_us": c.stats().get("spin_us"),
                  "client_reply_spin_us": c.reply_spin_us, "channel": c.uses_channel,
                  "channel_refused": c.channel_refused,
                  # MPS or time slices: this process's (the engine's) and the daemon's
                  "gpu_sharing": {"engine": gpu_sharing(dev.index if cuda else None)[0],
                                  "daemon": c.stats().get("gpu_sharing")}}
        # an idle load per timed run (GPU): sent once the daemon's loop sleeps again
        idle_s = (result["daemon_spin_us"] or 0) * 1e-6 + IDLE_MARGIN_S if cuda else 0.0
        mirrors = parse_mirrors(args.mirror)
        for mirror in mirrors:
            key = "sizes" if mirror == "full" else "checkpoints"
            measure = one_size if mirror == "full" else one_size_ckpt
            result[key] = {}
            for s in sizes:
                if args.barrier:  # --gpus: every GPU starts this size together
                    barrier(args.barrier, f"{mirror}-{s}", args.pp_size, args.pp_rank)
                n = SIZES[s] // PAGE_TOKENS
                # one untimed round first: a size's first load and backup pay one-time costs
                # (first touches, driver and launch caches) that the medians would hide but
                # the daemon's mean handling times would not
                measure(sender, pools, layout, n, 1, rng, local, limit, cuda, dev, probe=False,
                        order=args.device_order)
                result[key][s] = measure(sender, pools, layout, n, args.runs, rng, local, limit,
                                         cuda, dev, order=args.device_order, idle_s=idle_s)
                # the daemon's handling times: extra solo runs (no load beside a backup, no
                # probe) between two stats readings; none taken during the timed runs, where a
                # stats call before a load slowed its first layer (H200, twenty-ninth session)
                before = daemon_times(c.stats()["metrics"])
                extra = measure(sender, pools, layout, n, HANDLER_RUNS, rng, None, limit, cuda,
                                dev, probe=False, busy=False, order=args.device_order)["runs"]
                after = daemon_times(c.stats()["metrics"])
                result[key][s]["summary"].update(
                    {f"{cmd}_handler_ms": mean_ms(before, after, cmd)
                     for cmd in ("load", "backup")},
                    # the engine's acks of the same commands: handler < ack, run for run
                    **{f"{cmd}_handler_ack_ms": 1e3 * sum(extra[f"{cmd}_ack"])
                       / len(extra[f"{cmd}_ack"]) for cmd in ("load", "backup")},
                    load_issue_ms=mean_ms(before, after, "load_issue"),
                    load_issue_cpu_ms=mean_ms(before, after, "load_issue_cpu"),
                    # the daemon commands those means are over: the solo runs' own, one each
                    handler_commands={cmd: after.get(cmd, (0, 0.0))[0] - before.get(
                        cmd, (0, 0.0))[0] for cmd in ("load", "backup")})
                say(f"[e2e] {mirror} {s}: " + json.dumps(result[key][s]["summary"]))
        c.unregister()
        c.close()
        if local is not None:
            local[0].close()
    if cuda and not args.barrier:  # the limit again at the end: the ratios divide by the best
        _rescale(result, limit, pinned_limit(dev))
    if args.plot:
        _plot(result, args.plot)
    if args.json:
        print(json.dumps(result))
    else:
        _table(result)
    return 0


def _rescale(result: dict[str, Any], start: dict[str, float], end: dict[str, float]) -> None:
    """The limit measured at the start and at the end of the run: every ratio divides by the
    better of the two per direction (a limit read low flatters every ratio of its run)."""
    best = {k: max(start[k], end[k]) for k in start}
    result.update(limit_gbps=best, limit_gbps_start=start, limit_gbps_end=end)
    for key in ("sizes", "checkpoints"):
        for r in result.get(key, {}).values():
            m = r["summary"]
            m["load_ratio"] = m["load_gbps"] / best["h2d"]
            m["backup_ratio"] = m["backup_gbps"] / best["d2h"]


def barrier(folder: str, name: str, parties: int, rank: int, timeout: float = 900.0) -> None:
    """Wait until all ``parties`` processes reached ``name`` (a file each in ``folder``)."""
    Path(folder, f"{name}.{rank}").touch()
    deadline = time.monotonic() + timeout
    while sum(Path(folder, f"{name}.{r}").exists() for r in range(parties)) < parties:
        if time.monotonic() > deadline:
            raise RuntimeError(f"bench e2e: the other GPUs' runs did not reach {name} in "
                               f"{timeout:g} s")
        time.sleep(0.01)


def run_gpus(args: argparse.Namespace) -> int:
    """One child run per GPU (its own engine process and daemon, a PP=N stage), the sizes
    started together; prints each GPU's table (or one JSON object)."""
    n = args.gpus
    with tempfile.TemporaryDirectory(prefix="hc-e2e-") as folder:
        procs = []
        for r in range(n):
            cmd = [sys.executable, "-m", "hicache.cli", "bench", "e2e", "--json",
                   "--device", f"cuda:{r}", "--preset", args.preset, "--sizes", args.sizes,
                   "--runs", str(args.runs), "--churn", str(args.churn), "--mirror", args.mirror,
                   "--pp-size", str(n), "--pp-rank", str(r), "--channel", args.channel,
                   "--device-order", args.device_order, "--host-fill", args.host_fill,
                   "--layer-wait", args.layer_wait,
                   "--barrier", folder] + (["--fence"] if args.fence else [])
            procs.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, text=True))
        while any(p.poll() is None for p in procs):  # one failed: the others would wait
            if any(p.poll() not in (None, 0) for p in procs):
                for p in procs:
                    if p.poll() is None:
                        p.terminate()
            time.sleep(0.2)
        outs = [p.communicate()[0] for p in procs]
    bad = [r for r, p in enumerate(procs) if p.returncode != 0]
    if bad:
        print(f"bench e2e --gpus {n}: the run on cuda:{bad[0]} failed (exit "
              f"{procs[bad[0]].returncode}); its messages are above", file=sys.stderr)
        return 1
    results = [json.loads(o) for o in outs]
    if args.json:
        print(json.dumps({"gpus": n, "per_gpu": results}))
    else:
        for res in results:
            _table(res)
    return 0


def _local(layout: Layout, rows: dict[str, int], pools: DevicePools, dev: torch.device) -> Any:
    """An in-process pinned pool of the same layout (the in-engine copy's host side)."""
    g = HostPoolGroup(layout, rows, device_index=dev.index)
    tabs = {n: (LayerTable(pools.layers[n]), LayerTable(g.pool(n).layers)) for n in layout.pools}
    return g, tabs


def one_size(c: Client, pools: DevicePools, layout: Layout, n: int, runs: int,
             rng: np.random.Generator, local: Any, limit: dict[str, float], cuda: bool,
             dev: torch.device, probe: bool = True, busy: bool = True,
             order: str = "random", idle_s: float = 0.0) -> dict[str, Any]:
    spaces = ("page", "swa_page")
    nbytes = sum(p.page_bytes * p.num_layers * n for p in layout.pools.values()
                 if p.index in spaces)
    stream = torch.cuda.current_stream(dev) if cuda else None
    out: dict[str, list[float]] = {k: [] for k in FIGURES}
    waits = new_waits()
    verified = False
    dev_runs: list[float] = []
    host_runs: list[float] = []  # the mean run of each timed backup's host rows
    for r in range(runs):
        total = pools.rows["page"]
        perm = device_order(order, total, rng)
        src = {sp: perm[:n].tolist() for sp in spaces}  # as the engine's allocator hands out
        dev_runs.append(mean_run(torch.from_numpy(perm[n:2 * n])))
        dst = {sp: perm[n:2 * n].tolist() for sp in spaces}
        check = again = None
        if not verified:  # this run's loads are compared byte for byte, right after each
            names = [m for m, spec in layout.pools.items() if spec.index in spaces]
            # bytes of this call's own (a seed per size left an untimed round's bytes in the
            # host rows a timed backup then got again: a backup that wrote nothing would pass)
            seed = int(rng.integers(1 << 30))
            scramble(pools, {m: src[layout.pools[m].index] + dst[layout.pools[m].index]
                             for m in names}, seed=seed)

            def again() -> None:  # the busy load's destination: fresh bytes again
                scramble(pools, {m: dst[layout.pools[m].index] for m in names}, seed=seed + 1)

            rest = untouched(pools, {m: dst[layout.pools[m].index] for m in names})

            def check() -> None:
                if cuda:
                    torch.cuda.synchronize(dev)
                for name in names:
                    sp = layout.pools[name].index
                    s_i = torch.tensor(src[sp], device=pools.layers[name][0].device)
                    d_i = torch.tensor(dst[sp], device=pools.layers[name][0].device)
                    for t in pools.layers[name]:
                        # CPU mode compares GBs for seconds: stay alive (a reap frees rows)
                        c.maybe_heartbeat()
                        if not torch.equal(t.index_select(0, s_i), t.index_select(0, d_i)):
                            raise RuntimeError(f"load of {n} pages: pool {name} differs")
                rest()
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = time.perf_counter()
        op = c.backup_new(src)
        c.wait_ack(op, timeout=120)
        out["backup_ack"].append(time.perf_counter() - t0)
        host = op.rows
        host_runs.append(mean_run(torch.tensor(host["page"])))
        items = {sp: (host[sp], dst[sp]) for sp in host}
        load_into(out, c, items, stream, cuda, check, busy)
        if cuda and check is not None and again is not None:  # each layer at its event
            again()
            layers_checked_load(c, items, stream, layer_compare(
                pools, layout, {m: (src[layout.pools[m].index], dst[layout.pools[m].index],
                                    None) for m in names}, dev))
            check()
        verified = True
        if cuda and idle_s:  # the same load once the daemon's loop slept
            idle_load(out, c, items, stream, cuda, idle_s)
        if local is not None:
            inproc_into(out, local, layout, items, dev,
                        None if check is None else ({sp: (src[sp], host[sp]) for sp in host},
                                                    again, check))
        if cuda and busy:  # a load while backups of the same size stream
            other = src  # the load's sources, read by both at every size (the checkpoints
            # mirror's choice; half the load's destination was read below the largest size)
            if again is not None:
                again()
            begun = busy_start(stream, dev)
            sent = stream_backups(lambda: c.backup_new(other))
            load_while_busy(out, c, items, stream, cuda, begun, sent)
            if check is not None:
                check()
            for bop, _ in sent:
                c.free(bop.rows)
            if probe and r == runs - 1:  # after the timed runs: the engine's own steps
                probe_rounds(waits, c, stream, dev, lambda: c.load(items),
                             lambda: c.backup_new(src), lambda op: c.free(op.rows))
        c.free(host)
    summary = summarize(out, n, nbytes, limit, cuda, verified, waits if cuda else None)
    summary["summary"]["device_mean_run"] = float(np.mean(dev_runs))  # the loads' destinations
    summary["summary"]["host_mean_run"] = float(np.mean(host_runs))  # their sources
    return summary


def _table(result: dict[str, Any]) -> None:
    lim = result["limit_gbps"]
    stage = f", PP stage {result['pp_rank']} of {result['pp_size']}" if result["pp_size"] > 1 else ""
    chan = "yes" if result["channel"] else f"no ({result['channel_refused']})"
    sharing = result.get("gpu_sharing", {})
    print(f"bench e2e on {result['device']} ({result['preset']}{stage}, in-process copy "
          f"{result['ctas']} CTAs, "
          f"median of {result['runs']}; device rows {result.get('device_order', 'random')}); "
          f"pinned-copy limit GB/s: {lim}; busy-poll: daemon "
          f"{result['daemon_spin_us']:g} us, client {result['client_reply_spin_us']:g} us; "
          f"channel: {chan}; GPU sharing: engine {sharing.get('engine')}, daemon "
          f"{sharing.get('daemon')}; host pool {result.get('host_fill')} ("
          + ", ".join(f"{sp} {v:.0%} held" for sp, v in result.get("host_held", {}).items())
          + f"); fence: {'yes' if result.get('fence') else 'no'}; layer wait: "
            f"{result.get('layer_wait', 'host')}"
          + (f"; limit start {result['limit_gbps_start']}, end {result['limit_gbps_end']}"
             if "limit_gbps_end" in result else ""))
    print(f"{'mirror':>11} {'size':>5} {'MB':>7} {'first ms':>9} {'second ms':>9} "
          f"{'2nd max':>8} {'last ms':>8} "
          f"{'load GB/s':>9} "
          f"{'ratio':>6} {'backup GB/s':>11} {'ratio':>6} {'vs inproc':>9} {'busy':>6} "
          f"{'busy 2nd':>8} {'covered':>7} "
          f"{'reply ms':>8} {'daemon ms':>9} {'issue ms':>8} {'cmd ms':>7} {'host run':>8} "
          f"{'idle 1st':>8} {'idle last':>9} {'idle reply':>10}")
    f = (lambda x: "n/a" if x is None else f"{x:.3f}")
    for mirror, key in (("full", "sizes"), ("checkpoints", "checkpoints")):
        for s, r in result.get(key, {}).items():
            m = r["summary"]
            print(f"{mirror:>11} {s:>5} {m['bytes'] / 1e6:7.0f} {m['load_first_ms']:9.2f} "
                  f"{m['load_second_ms']:9.2f} {m['load_second_max_ms']:8.2f} "
                  f"{m['load_last_ms']:8.2f} {m['load_gbps']:9.1f} "
                  f"{f(m['load_ratio']):>6} "
                  f"{m['backup_gbps']:11.1f} {f(m['backup_ratio']):>6} "
                  f"{f(m['daemon_vs_inproc']):>9} {f(m['busy_vs_solo']):>6} "
                  f"{f(m['busy_second_ms']):>8} {f(m.get('busy_covered')):>7} "
                  f"{f(m['load_reply_ms']):>8} {f(m.get('load_handler_ms')):>9} "
                  f"{f(m.get('load_issue_ms')):>8} {f(m.get('load_cmd_ms')):>7} "
                  f"{m.get('host_mean_run', 0):8.1f} {f(m.get('idle_first_ms')):>8} "
                  f"{f(m.get('idle_last_ms')):>9} {f(m.get('idle_reply_ms')):>10}")
    _engine_table(result)
    if any(r["summary"]["busy_second_ms"] is not None
           for key in ("sizes", "checkpoints") for r in result.get(key, {}).values()):
        print("busy 2nd: GPU events of the engine's stream, which run at the GPU's time-slice "
              "boundaries (~1 ms) while the daemon's kernels run: steps, not the command's "
              "time (docs/perf.md); covered: the share of busy runs whose backup was still "
              "running when the load's last layer was ready; idle 1st / last / reply: ms to the "
              "first and last layer and to the reply of a load sent once the daemon's loop "
              "slept past its busy-poll window")


def _engine_table(result: dict[str, Any]) -> None:
    """The engine's probe steps (GPU runs): p50 / p99 / max ms per kind of daemon work."""
    rows = [(mirror, s, r["summary"]["engine_wait"])
            for mirror, key in (("full", "sizes"), ("checkpoints", "checkpoints"))
            for s, r in result.get(key, {}).items() if r["summary"].get("engine_wait")]
    if not rows:
        return
    print("engine step (one add_ on the engine's stream, host wait), ms p50 / p99 / max: "
          "idle, then while the daemon runs a LOAD or a BACKUP of the size")
    print(f"{'mirror':>11} {'size':>5} " + " ".join(f"{k:>20}" for k in KINDS))
    for mirror, s, w in rows:
        cells = ["n/a" if w[k] is None else
                 f"{w[k]['p50_ms']:.3f}/{w[k]['p99_ms']:.3f}/{w[k]['max_ms']:.2f}" for k in KINDS]
        print(f"{mirror:>11} {s:>5} " + " ".join(f"{x:>20}" for x in cells))


def _plot(result: dict[str, Any], path: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(6, 3.5))
    for mirror, rk in (("full mirror", "sizes"), ("checkpoints", "checkpoints")):
        res = result.get(rk, {})
        sizes = list(res)
        for key, label in (("load_ratio", "LOAD (last layer ready)"), ("backup_ratio", "BACKUP")):
            ys = [res[s]["summary"][key] for s in sizes]
            if sizes and None not in ys:
                ax.plot(sizes, ys, marker="o", label=f"{label}, {mirror}")
    ax.set_ylim(0, 1.05)
    ax.set_ylabel("ratio to the pinned-copy limit")
    ax.set_xlabel("prefix tokens")
    ax.legend()
    ax.grid(alpha=0.3)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
