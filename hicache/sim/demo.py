"""``hicache demo``: a daemon and a simulated DSV4 worker replaying a multi-turn workload.

Starts ``hicache serve`` in a subprocess (CPU mode without a GPU) on a private ipc socket with
a metrics port, runs ``hicache.sim.simulator.Worker`` against it over a workload (the built-in
multi-turn generator, or ``--trace FILE`` in the Mooncake format), verifies every byte read
from the cache, and reports hits by tier against a device-only replay, bytes moved, GB/s and
latencies. ``--json`` prints one JSON object on stdout; progress goes to stderr. Exit status 0
when every checked byte matched, 1 otherwise, 2 for a usage error.

SWA mode ``auto``: paged for the built-in workload (each radix page then carries an SWA page
row, 1.6 MiB per page on dsv4-tiny, and both are backed up and loaded), ring for traces (a
page carries only its full-token row, 138 KiB; SWA and compression states live per request
slot). A Mooncake trace references ~240k pages: in paged mode that is ~0.4 TB of copies and a
host tier larger than this machine's memory.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import socket
import subprocess
import sys
import time
from typing import Any

from hicache.core.errors import UsageError
from hicache.core.resume import DEFAULT_PAGES_PER_CKPT, MIRRORS
from hicache.core.sizes import checkpoint_host_bytes
from hicache.sim.sizing import host_tier_rows, planned_device_pages
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.radix import POLICIES

GENERATOR_DEFAULTS = {"requests": 400, "device_pages": 128, "host_ratio": 8, "pages_per_ckpt": 8}
TRACE_DEFAULTS = {"device_pages": 1024, "host_ratio": 16,
                  "pages_per_ckpt": DEFAULT_PAGES_PER_CKPT}
READY_TIMEOUT_S = 180.0
REQ_SLOTS = 4  # the simulated worker's request slots (its daemon keeps host rows for them)
MAX_HOST_RATIO = 1024  # host pages per device page: beyond it a typo, not a tier
MAX_HOST_PAGES = 1 << 24  # 16.8M pages (a dry replay keeps a handle each): beyond, a typo


def add_arguments(p: argparse.ArgumentParser) -> None:
    w = p.add_argument_group("workload")
    w.add_argument("--trace", metavar="FILE",
                   help="replay a Mooncake-format trace (JSONL: timestamp, input_length, "
                        "output_length, hash_ids of 512-token blocks) instead of the built-in "
                        "multi-turn generator")
    w.add_argument("--requests", type=int, metavar="N",
                   help=f"requests to run (default {GENERATOR_DEFAULTS['requests']} generated; "
                        "a trace: all of it)")
    w.add_argument("--seed", type=int, default=0, help="generator and page-content seed")
    m = p.add_argument_group("simulated worker")
    m.add_argument("--preset", default="dsv4-tiny", help="model preset (default dsv4-tiny)")
    m.add_argument("--swa-mode", choices=("auto", "paged", "ring"), default="auto",
                   help="SWA pool mode (default auto: paged for the generator, ring for traces)")
    m.add_argument("--device-pages", type=int, metavar="N",
                   help=f"device page rows (default {GENERATOR_DEFAULTS['device_pages']}; "
                        f"{TRACE_DEFAULTS['device_pages']} with a trace)")
    m.add_argument("--kv-mem", metavar="SIZE",
                   help="size the device tier like a server: KV memory per GPU (e.g. 100GiB), "
                        "through the capacity planner (instead of --device-pages)")
    hg = m.add_mutually_exclusive_group()
    hg.add_argument("--host-mem", metavar="SIZE",
                    help="size the host tier in bytes (e.g. 64GiB): page rows, and with "
                         "checkpoints one checkpoint row per --pages-per-checkpoint pages")
    hg.add_argument("--host-pages", type=int, metavar="N", help="host pages of the tier")
    hg.add_argument("--host-ratio", type=float, metavar="R",
                    help=f"host pages = R x device pages (default "
                         f"{GENERATOR_DEFAULTS['host_ratio']}; {TRACE_DEFAULTS['host_ratio']} "
                         "with a trace); 1 or less needs --force")
    m.add_argument("--force", action="store_true",
                   help="accept --host-ratio 1 or less (a host tier no larger than the device), "
                        "as serve's --force")
    m.add_argument("--mirror", choices=MIRRORS, default=None,
                   help="checkpoints (default): pages carry compressed rows, SWA tail + states "
                        "only at resume checkpoints; full: every pool of every page (paged SWA)")
    m.add_argument("--checkpoint-every", type=int, default=0, metavar="N",
                   help="also checkpoint every N pages a request writes (paged SWA; 0 = off)")
    m.add_argument("--checkpoint-branch", action=argparse.BooleanOptionalAction, default=True,
                   help="also checkpoint the deepest cached page a request had to recompute "
                        "(paged SWA; default on)")
    m.add_argument("--pages-per-checkpoint", type=int, metavar="K",
                   help=f"host tier split: one checkpoint row per K page rows (default "
                        f"{GENERATOR_DEFAULTS['pages_per_ckpt']} for the generator's short "
                        f"sessions, {TRACE_DEFAULTS['pages_per_ckpt']} with a trace)")
    m.add_argument("--boundary-snapshots", action=argparse.BooleanOptionalAction, default=True,
                   help="ring SWA: a request that goes on past its last full page (a prompt "
                        "ending mid-page, decode) stops there and has its slot backed up as "
                        "that page's checkpoint (default on; off: such a request makes none)")
    m.add_argument("--state-slots", choices=("ring", "overlap"), default="ring",
                   help="what a checkpoint keeps of the C4 compress states: the whole ring row "
                        "(default) or the overlap slots only (byte model: --dry and sweeps)")
    m.add_argument("--write-policy", dest="policy", choices=POLICIES, default="write_through",
                   help="write policy of the radix tree (default write_through; serve's "
                        "--write-policy)")
    m.add_argument("--policy", dest="policy", choices=POLICIES, help=argparse.SUPPRESS)
    m.add_argument("--device", default="auto", help="auto (cuda:0 when there is a GPU), cpu, "
                                                    "or cuda:N")
    m.add_argument("--preempt-every", type=int, default=10, metavar="N",
                   help="swap a request's slot state out and back every N requests (0 = off)")
    m.add_argument("--no-verify-hits", action="store_true",
                   help="verify loaded pages only, not device hits")
    m.add_argument("--l3", choices=("off", "mooncake"), default="off",
                   help="mooncake: two instances sharing an L3 tier on a local Mooncake Store, "
                        "beside the same two without it (see hicache.sim.demo_l3)")
    m.add_argument("--l3-routing", choices=("conversation", "alternate"),
                   default="conversation",
                   help="--l3: which instance runs a request: conversation (default; every turn "
                        "of a conversation on one instance) or alternate (request by request)")
    m.add_argument("--l3-conversations", type=int, default=0, metavar="N",
                   help="--l3: replay only the first N conversations with two turns or more "
                        "(every turn of each, in workload order; 0 = the whole workload)")
    d = p.add_argument_group("dry replay and sweeps")
    d.add_argument("--dry", action="store_true",
                   help="replay the tree, tiers and byte accounting only: no pools, no daemon, "
                        "no copies (nothing is verified)")
    d.add_argument("--sweep-host", metavar="SIZES",
                   help="dry replays for each host size (e.g. 32GiB,64GiB,128GiB): device-only, "
                        "full mirror and checkpoints")
    d.add_argument("--plot", metavar="FILE.png",
                   help="with --sweep-host: draw prefill tokens saved against host memory "
                        "(needs matplotlib: pip install 'hicache[plot]')")
    h = p.add_argument_group("HiSparse (no daemon: sparse C4 host region + device hot buffers)")
    h.add_argument("--hisparse", action="store_true",
                   help="decode long requests with HiSparse swap-ins and verify every top-k "
                        "location (hicache.sim.hisparse_demo)")
    h.add_argument("--hisparse-impl", choices=("auto", "triton", "reference"), default="auto",
                   help="auto: the kernel on a GPU, the torch reference on CPU; triton on CPU "
                        "runs the kernel under TRITON_INTERPRET=1")
    h.add_argument("--hisparse-steps", type=int, default=24, help="decode steps (default 24)")
    h.add_argument("--hisparse-topk", type=int, default=32,
                   help="top-k per layer, capped by the model's (default 32: small shapes)")
    h.add_argument("--overlap", type=float, default=0.8,
                   help="fraction of a step's top-k kept from the previous step (default 0.8)")
    o = p.add_argument_group("output")
    o.add_argument("--json", action="store_true", help="print one JSON object on stdout")
    o.add_argument("--metrics-port", type=int, default=0,
                   help="daemon /metrics port (default: a free port)")
    o.add_argument("--demo-metrics-port", type=int, default=0,
                   help="the worker's hicache_demo_* /metrics port (default: a free port)")
    o.add_argument("--progress-seconds", type=float, default=5.0,
                   help="seconds between progress lines on stderr (0 = none)")


def _run_hisparse(args: argparse.Namespace) -> int:
    if args.trace:
        raise UsageError("--hisparse runs its own top-k traces; --trace does not apply")
    from hicache.sim.hisparse_demo import human, run_hisparse

    summary = run_hisparse(args)
    print(json.dumps(summary) if args.json else human(summary), flush=True)
    return 0 if summary["verified"] else 1


# ------------------------------------------------------------------------------ helpers
def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _how_ended(rc: int | None) -> str:
    """A daemon's end as a shell says it: ``killed by SIGKILL`` for Python's -9, else the
    exit status (None: still running when it was left)."""
    import signal

    if rc is None:
        return "still running"
    if rc < 0:
        try:
            return f"killed by {signal.Signals(-rc).name}"
        except ValueError:
            return f"killed by signal {-rc}"
    return f"exit status {rc}"


def _err(msg: str) -> None:
    print(f"[demo] {msg}", file=sys.stderr, flush=True)


def _gib(n: float) -> str:
    return f"{n / 2**30:.2f} GiB"


def _resolve(args: argparse.Namespace) -> tuple[list, Any, str]:
    """Workload, worker config and a one-line description; UsageError on bad flags."""
    from hicache.core.layout import PRESETS
    from hicache.sim.simulator import WorkerConfig
    from hicache.sim.workload import multi_turn, read_trace

    if args.preset not in PRESETS:
        raise UsageError(f"unknown preset {args.preset!r}; choose one of {sorted(PRESETS)}")
    if args.requests is not None and args.requests <= 0:
        raise UsageError(f"--requests must be positive, got {args.requests}")
    defaults = TRACE_DEFAULTS if args.trace else GENERATOR_DEFAULTS
    if args.trace:
        reqs = read_trace(args.trace, limit=args.requests)
        what = f"trace {args.trace} ({len(reqs)} requests)"
    else:
        reqs = multi_turn(args.requests or GENERATOR_DEFAULTS["requests"], seed=args.seed)
        what = f"built-in multi-turn workload ({len(reqs)} requests, seed {args.seed})"
    if not 0 <= args.progress_seconds < float("inf"):
        raise UsageError(f"--progress-seconds must be 0 (none) or a positive number of seconds, "
                         f"got {args.progress_seconds}")
    swa = args.swa_mode if args.swa_mode != "auto" else ("ring" if args.trace else "paged")
    if args.kv_mem is not None:
        if args.device_pages is not None:
            raise UsageError("give --kv-mem or --device-pages, not both")
        device_pages = planned_device_pages(args.preset, args.kv_mem, swa)
    else:
        device_pages = defaults["device_pages"] if args.device_pages is None \
            else args.device_pages
    if device_pages <= 0:
        raise UsageError(f"--device-pages must be positive, got {device_pages}")
    need = max(r.total_pages for r in reqs)
    if need > device_pages:
        big = max(reqs, key=lambda r: r.total_pages)
        raise UsageError(f"request {big.rid} needs {need} device page rows "
                         f"({big.input_tokens} + {big.output_tokens} tokens) but --device-pages "
                         f"is {device_pages}; raise --device-pages")
    if args.mirror is None:
        args.mirror = "checkpoints"
    if args.pages_per_checkpoint is None:
        args.pages_per_checkpoint = defaults["pages_per_ckpt"]
    if args.pages_per_checkpoint < 1:
        raise UsageError(f"--pages-per-checkpoint must be >= 1, got {args.pages_per_checkpoint}")
    host_ckpts = None
    if args.host_mem is not None:
        host_pages, host_ckpts = host_tier_rows(args.preset, args.host_mem, swa, args.mirror,
                                                args.pages_per_checkpoint, REQ_SLOTS,
                                                device_pages)
    elif args.host_pages is not None:
        host_pages = args.host_pages
    else:
        ratio = args.host_ratio if args.host_ratio is not None else defaults["host_ratio"]
        if not 0 < ratio <= MAX_HOST_RATIO:  # (NaN and infinity too)
            raise UsageError(f"--host-ratio must be in (0, {MAX_HOST_RATIO}], got {ratio}")
        host_pages = int(device_pages * ratio)
        if ratio <= 1 and not args.force:  # as `hicache serve` refuses it
            raise UsageError(f"--host-ratio {ratio:g}: the host tier ({host_pages} pages) is no "
                             f"larger than the device ({device_pages} pages), so it holds "
                             f"little the device does not; give a ratio above 1, or --force")
    if host_pages <= 0:
        raise UsageError(f"the host tier needs at least one page, got {host_pages}")
    if host_pages > MAX_HOST_PAGES:
        raise UsageError(f"the host tier of {host_pages:,} pages is over the demo's "
                         f"{MAX_HOST_PAGES:,}")
    if args.mirror == "full" and not args.dry and not args.sweep_host \
            and int(REQ_SLOTS * full_mirror_ratio(host_pages, device_pages)) < 1:
        raise UsageError(f"a full mirror's daemon keeps host rows in the device pools' "
                         f"proportions: {host_pages} host pages for {device_pages} device pages "
                         f"leave it no request-slot row; give at least "
                         f"{-(-device_pages // REQ_SLOTS)} (--host-pages, --host-mem or "
                         f"--host-ratio)")
    if args.mirror == "checkpoints" and host_ckpts is None:
        host_ckpts = max(1, host_pages // args.pages_per_checkpoint)
    device = args.device
    if args.dry or args.sweep_host:  # nothing runs on a device: no torch import either
        device = "cpu" if device == "auto" else device
    if device == "auto":
        import torch

        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif not re.fullmatch(r"cpu|cuda:\d+", device):
        raise UsageError(f"--device must be auto, cpu or cuda:N, got {device!r}")
    for flag, port in (("--metrics-port", args.metrics_port),
                       ("--demo-metrics-port", args.demo_metrics_port)):
        if not 0 <= port <= 65535:
            raise UsageError(f"{flag} must be 0..65535, got {port}")
    if args.preempt_every < 0:
        raise UsageError("--preempt-every must be >= 0")
    cfg = WorkerConfig(preset=args.preset, swa_mode=swa, device_pages=device_pages,
                       host_pages=host_pages, req_slots=REQ_SLOTS, policy=args.policy,
                       seed=args.seed,
                       device=device, verify_hits=not args.no_verify_hits,
                       preempt_every=args.preempt_every, mirror=args.mirror,
                       checkpoint_every=args.checkpoint_every,
                       checkpoint_branch=args.checkpoint_branch,
                       host_ckpts=host_ckpts if args.mirror == "checkpoints" else None,
                       state_slots=args.state_slots,
                       boundary_snapshots=args.boundary_snapshots)
    cfg.check()
    why = cfg.resume().copyable
    if why and not (args.dry or args.sweep_host):
        raise UsageError(f"--state-slots {args.state_slots}: {why}; use it with --dry")
    return reqs, cfg, what


def full_mirror_ratio(host_pages: int, device_pages: int) -> float:
    """A full mirror's daemon: host rows in the device rows' proportions, this ratio, so that
    floor(device pages x ratio) == ``host_pages`` (and a space of n rows gets floor(n x ratio))."""
    return (host_pages + 0.5) / device_pages


def _daemon(cfg: Any, metrics_port: int | None, extra: tuple[str, ...] = (),
            env: Any = None) -> DaemonProcess:
    """``hicache serve`` for ``cfg`` on a private socket (not started yet), given the worker's
    device rows. Full mirror: host rows in the device rows' proportions, host / device pages
    (``--host-ratio``). Checkpoints: the daemon splits its host memory for that mirror itself
    (``--host-split checkpoints``), given the fewest bytes whose split holds the tree's page
    and checkpoint rows (``sizes.checkpoint_host_bytes``: the same sizing the daemon runs, so
    its rows hold the tree's) and the tree's pages per checkpoint row."""
    rows = cfg.device_rows()
    if cfg.mirror == "full":
        host: tuple[str, ...] = ("--host-ratio",
                                 repr(full_mirror_ratio(cfg.host_pages, cfg.device_pages)))
    else:
        k = max(1, cfg.host_pages // max(1, cfg.ckpt_rows))
        nbytes = checkpoint_host_bytes(cfg.layout(), rows, cfg.host_pages, cfg.ckpt_rows, k)
        host = ("--host-mem", str(nbytes), "--host-split", "checkpoints",
                "--pages-per-checkpoint", str(k))
        if cfg.host_pages <= cfg.device_pages and "--force" not in extra:
            # a tier of checkpoints keeps what the device drops even when it holds fewer
            # pages; a ratio of 1 or less was refused without --force already
            host += ("--force",)
    return DaemonProcess(device=cfg.device, preset=cfg.preset, device_rows=rows,
                         host=host, heartbeat_timeout=60,
                         metrics_port=metrics_port,
                         extra=("--swa-mode", cfg.swa_mode, "--allow-shutdown") + extra,
                         env=env, new_session=True, ready_timeout=READY_TIMEOUT_S)


def _close_daemon(daemon: DaemonProcess, client: Any = None) -> tuple[int | None, str]:
    """Ask the daemon to shut down through ``client`` if there is one (``_daemon`` starts it
    with ``--allow-shutdown``), then signals.
    Returns its exit status and the tail of its output (read before its directory goes)."""
    if daemon.alive() and client is not None:
        try:
            # gone before its reply was read (the reply goes with the connection, unread):
            # its exit status says whether it took the command
            took = None if "gone" in client.shutdown(timeout=5.0) else True
        except Exception as e:  # noqa: BLE001 - refused or unanswered: signals at once
            _err(f"the daemon did not take shutdown ({e}); stopping it with SIGTERM")
            took = False
        if took is not False:  # it is stopping: its own clean-up, then its exit
            try:
                assert daemon.proc is not None
                daemon.proc.wait(30)
            except subprocess.TimeoutExpired:
                pass
            if took is None and daemon.proc.returncode != 0:
                _err("the daemon went during shutdown, exit status "
                     f"{daemon.proc.returncode}, not that of a shutdown (0)")
    if daemon.alive():
        daemon.stop(timeout=30)
    tail = daemon.output(1500)
    return daemon.close(), tail


class Progress:
    def __init__(self, total: int, every_s: float) -> None:
        self.total, self.every, self.t0 = total, every_s, time.monotonic()
        self.next = self.t0 + every_s
        self.lost = 0  # host tier losses said so far

    def __call__(self, worker: Any, done: int) -> None:
        tree = getattr(worker, "tree", None)
        lost = tree.stats.host_offline if tree is not None else 0
        if lost > self.lost:  # said when it happens, not only in the summary at the end
            self.lost = lost
            _err(f"host tier lost at request {done} (the daemon went away or no longer knows "
                 f"this worker): replaying on, host hits recomputed")
        if self.every <= 0:
            return
        now = time.monotonic()
        if now < self.next and done != self.total:
            return
        self.next = now + self.every
        r = worker.result
        tot = max(1, r.input_tokens)
        hs = getattr(worker.hooks, "stats", None)
        moved = (f"  backed up {_gib(hs.bytes['backup'])}, loaded {_gib(hs.bytes['load'])}"
                 if hs else "")
        _err(f"{done}/{self.total} requests  hits: device {100 * r.device_hit_tokens / tot:.1f}% "
             f"host {100 * r.host_hit_tokens / tot:.1f}% (device-only "
             f"{100 * r.device_only_hit_tokens / tot:.1f}%){moved}  {now - self.t0:.0f} s")


def _human(s: dict[str, Any], what: str) -> str:
    tot = max(1, s["input_tokens"])

    def pct(n: int) -> str:
        return f"{n:>14,} tokens ({100 * n / tot:5.1f}%)"

    c, ck = s["config"], s["checkpoints"]
    dry = s.get("dry", False)
    where = "dry replay (no pools, no daemon, no copies)" if dry else f"on {c['device']}"
    lines = [
        f"hicache demo: {what}",
        f"  worker: {c['preset']} swa={c['swa_mode']} {where}, {c['device_pages']:,} device "
        f"pages, {c['host_pages']:,} host pages, policy {c['policy']}, mirror {s['mirror']}",
        f"  requests:              {s['requests']:,} ({s['input_tokens']:,} input tokens) "
        f"in {s['seconds']:.1f} s",
        f"  prefix hit on device:  {pct(s['device_hit_tokens'])}",
        f"  prefix hit on host:    {pct(s['host_hit_tokens'])}",
        f"  missed (computed):     {pct(s['miss_tokens'])}",
        f"    of which unresumable {pct(s['unresumable_tokens'])} (cached past the deepest "
        "checkpoint)",
        f"  device-only replay:    {pct(s['device_only_hit_tokens'])} hit",
        f"  prefill tokens saved:  {s['prefill_tokens_saved']:,} by the host tier "
        f"(resumable hits {s['resumable_hit_tokens']:,})",
        f"  host tier:             {s['host_pages']:,} pages, {ck['on_host']:,} checkpoints, "
        f"{_gib(s['host_bytes'])}; {s['host_bytes_per_cached_token'] or 0:,.0f} B per cached "
        "token",
        f"  checkpoints:           {ck['made']:,} made, {ck['backed_up']:,} backed up, "
        f"{ck['loaded']:,} loaded, {ck['dropped']:,} dropped",
        f"  backed up:             {_gib(s['bytes_backed_up'])} in {s['backup_ops']:,} ops "
        f"({s['pages_backed_up']:,} pages)",
        f"  loaded:                {_gib(s['bytes_loaded'])} in {s['load_ops']:,} ops "
        f"({s['pages_loaded']:,} pages)",
    ]
    if dry:
        lines.append("  verified:              n/a (dry replay: nothing moved)")
        return "\n".join(lines)
    for at, kind in ((-2, "backup"), (-1, "load")):  # (no op: no rate or latency to give)
        lines[at] += (f", {s[f'{kind}_gbps']:.2f} GB/s copy, latency p50 "
                      f"{s[f'{kind}_latency_ms_p50']:.2f} ms p99 "
                      f"{s[f'{kind}_latency_ms_p99']:.2f} ms" if s[f"{kind}_ops"] else "")
    lines.append(f"  request-state swaps:   {s['state_swaps']:,}")
    if s["host_tier_lost"]:
        lines.append(f"  host tier lost:        {s['host_tier_lost']} time(s); fell back to "
                     "recompute")
    if not s.get("daemon_ok", True):
        lines.append(f"  daemon:                FAILED ({_how_ended(s.get('daemon_exit'))}, "
                     f"host tier lost {s['host_tier_lost']} time(s))")
    verdict = "true" if s["verified"] else "FALSE"
    unchecked = "" if s["config"].get("verify_hits", True) else \
        "; device hits not checked (--no-verify-hits): they count as resumable unverified"
    lines.append(f"  verified:              {verdict} ({_gib(s['verified_bytes'])} checked, "
                 f"{s['mismatched_bytes']:,} bytes differ{unchecked})")
    if s["first_mismatch"]:
        lines.append(f"  first mismatch:        {s['first_mismatch']}")
    return "\n".join(lines)


# ------------------------------------------------------------------------------ entry point
HISPARSE_ONLY = ("hisparse_impl", "hisparse_steps", "hisparse_topk", "overlap")
# what the HiSparse demo reads besides those (``hisparse_demo``): the rest does not apply to it
HISPARSE_READS = HISPARSE_ONLY + ("hisparse", "preset", "device", "seed", "requests", "json",
                                  "trace")
NO_DAEMON = ("metrics_port", "demo_metrics_port")  # a dry replay or a sweep starts none


def _options_that_apply(args: argparse.Namespace) -> None:
    """Refuse (one line) every option set away from its default that this run would ignore."""
    p = argparse.ArgumentParser(add_help=False)
    add_arguments(p)
    default = vars(p.parse_args([]))
    given = [k for k, v in vars(args).items() if k in default and v != default[k]]

    def refuse(names: Any, why: str) -> None:
        bad = [k for k in given if k in names]
        if bad:
            flags = ", ".join("--" + k.replace("_", "-") for k in bad)
            raise UsageError(f"{flags}: {why}")

    if args.hisparse:
        refuse([k for k in default if k not in HISPARSE_READS],
               "does not apply to --hisparse (its own requests, no daemon, no radix tier)")
        return
    refuse(HISPARSE_ONLY, "applies to --hisparse only")
    if args.l3 == "mooncake":
        refuse(("dry", "sweep_host", "plot") + NO_DAEMON,
               "does not apply to --l3 mooncake (a live run of its own daemons, on private ports)")
    if args.dry or args.sweep_host:
        refuse(NO_DAEMON, "--dry and --sweep-host start no daemon: no /metrics to serve")
        refuse(("preempt_every", "no_verify_hits"),
               "--dry and --sweep-host move and verify nothing")
        if args.device not in ("auto", "cpu"):
            raise UsageError(f"--device {args.device}: --dry and --sweep-host run on no device")
    if args.sweep_host:
        refuse(("host_mem", "host_pages", "host_ratio", "mirror"),
               "--sweep-host sizes its own host tiers, both mirrors")
    if args.mirror == "full":
        refuse(("pages_per_checkpoint", "checkpoint_every"),
               "a full mirror keeps no checkpoints (it applies to --mirror checkpoints)")


def run(args: argparse.Namespace) -> int:
    _options_that_apply(args)
    if args.hisparse:
        return _run_hisparse(args)
    if args.plot and not args.sweep_host:
        raise UsageError("--plot draws a host-memory sweep: give --sweep-host too")
    if args.l3 == "off" and (args.l3_conversations or args.l3_routing != "conversation"):
        raise UsageError("--l3-routing and --l3-conversations apply to --l3 mooncake only")
    reqs, cfg, what = _resolve(args)
    if args.l3 == "mooncake":
        from hicache.sim.demo_l3 import run_l3

        return run_l3(args, reqs, cfg, what, _daemon)
    if args.sweep_host:
        from hicache.sim.sweep import run_sweep

        return run_sweep(args, reqs, cfg, what)
    if args.dry:
        from hicache.sim.dry import DryReplay

        replay = DryReplay(cfg)
        _err(f"dry replay of {what}")
        replay.run(reqs, Progress(len(reqs), args.progress_seconds))
        summary = replay.summary()
        summary["workload"] = what
        print(json.dumps(summary) if args.json else _human(summary, what), flush=True)
        return 0
    from hicache.engine.client import Client
    from hicache.sim.simulator import DemoMetrics, Worker

    if cfg.device == "cpu" and (os.cpu_count() or 1) <= 4:
        import torch

        torch.set_num_threads(1)  # leave the daemon's copy thread a core of its own
    metrics_port = args.metrics_port or _free_port()
    demo_metrics = DemoMetrics()
    try:  # before the daemon starts: a busy port is one line, with nothing to stop
        demo_port = demo_metrics.serve_http(args.demo_metrics_port or _free_port())
    except OSError as e:
        raise UsageError(f"--demo-metrics-port {args.demo_metrics_port}: cannot listen on "
                         f"127.0.0.1:{args.demo_metrics_port}: {e.strerror or e}") from None
    # --force: host rows no larger than the device's (``_daemon`` adds it for checkpoints)
    daemon = _daemon(cfg, metrics_port, ("--force",) if args.force else ())
    client = None
    worker = None
    try:
        _err(f"starting daemon ({cfg.preset}, swa={cfg.swa_mode}, {cfg.device}, "
             f"{cfg.device_pages} device pages, {cfg.host_pages} host pages) on {daemon.address}")
        try:
            daemon.start()
        except RuntimeError as e:
            raise UsageError(str(e)) from None
        _err(f"daemon metrics: http://127.0.0.1:{metrics_port}/metrics   worker metrics: "
             f"http://127.0.0.1:{demo_port}/metrics")
        client = Client(daemon.address, timeout=cfg.timeout, name="hicache-demo")
        worker = Worker(cfg, client, demo_metrics)
        _err(f"replaying {what}")
        worker.run(reqs, Progress(len(reqs), args.progress_seconds))
        summary = worker.summary()
        summary["workload"] = what
        summary["daemon_metrics_url"] = f"http://127.0.0.1:{metrics_port}/metrics"
        summary["worker_metrics_url"] = f"http://127.0.0.1:{demo_port}/metrics"
    finally:
        if worker is not None:
            worker.close()
        rc, tail = _close_daemon(daemon, client)
        if client is not None:
            client.close()
    if rc not in (0, None):
        _err(f"daemon {_how_ended(rc)}; its last output:\n{tail}")
    # a run whose daemon died or went away counts as failed, though every byte it did check
    # was right: the host tier stopped serving (the tree recomputed meanwhile)
    summary["daemon_exit"] = rc
    summary["daemon_ok"] = DaemonProcess.clean_exit(rc) and not summary["host_tier_lost"]
    if args.json:
        print(json.dumps(summary), flush=True)
    else:
        print(_human(summary, what), flush=True)
    return 0 if summary["verified"] and summary["daemon_ok"] else 1
