"""`hicache bench transfer`: GPU<->host copy paths, ours and the peer's, on the same host rows,
against the PCIe limit measured in the same run.

On a GPU, in one process:

* the limit: contiguous pinned copies of up to 2 GiB, H2D, D2H and both at once on two streams,
  each the best of ``--limit-trials`` (>= 5) trials, interleaved;
* every case x host-row pattern x implementation x direction x CTA budget on DSV4-sized data
  (61 layers; 512 C4 page rows of 37,440 B; 256 SWA page rows of 149,760 B; 32,768 C4 tokens
  of the fp8 MLA format; C4 compress-state rows of 65,536 B; 32,768 584-B contiguous tokens,
  the closest the peer has to a token copy);
* backup (D2H) and swap-in (H2D) at once, on two streams from two issuing threads.

Each row names its host-row pattern (``transfer_rows``): ``random`` or ``runs`` (rows from a
churned run-forming allocator, ``--runs``). Ours runs ``auto`` first, the path the daemon takes
(the copy engines for rows of 32 KiB and up, else the staged DMA path on long runs or the
zero-copy kernel; the row says which, ``path_used``), then the paths that apply to the pattern
(zero-copy; on ``runs`` the staged DMA path). The peer (SGLang's transfer kernel, loaded from
``--peer-lib`` when present, named from the library: ``kernels/peer_sglang.py``) runs on
exactly the same device and host rows of each pattern. A case's one-direction rows are the
backup half of its "both" rows: the swap-in half is drawn right after them from the same
allocator state, so the rows compared have the same runs.
Device rows are always random. Each row: GB/s of useful bytes (mean over ``--reps`` calls) and
the ratio to the limit of its direction. Every row is verified after its timed calls: both
buffers get fresh random bytes first, and afterwards every byte of both must equal that state
with exactly the row's copies applied. On CPU the command times the torch reference path on
small data, with the same patterns and the same check, and says so.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import threading
import time
from dataclasses import dataclass
from typing import Any, Callable, Optional

from hicache.bench.transfer_rows import (DEFAULT_RUNS, PATTERNS, Write, check, host_rows,
                                         mean_run, parse_runs)
from hicache.bench.transfer_support import (C4_ROW, STATE_ROW, SWA_ROW, TOKEN584, _pinned,
                                            _triton_version, _unpin, cpu_bench, plot, print_table)
from hicache.core.plotting import check_plot
from hicache.bench.flags import parse_list, say
from hicache.core.errors import UsageError

BUDGETS = (1, 2, 4, 8, 16, 0)  # 0 = all SMs
QUICK_BUDGETS = (1, 4, 0)
MIN_TRIALS = 5
PEER = "peer"


DEFAULT_PEER_LIB = os.path.join(".peer", "common_ops.abi3.so")


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true",
                   help="print the results as JSON on stdout (the table goes to stderr)")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s per CTA budget (needs matplotlib)")
    p.add_argument("--layers", type=int, default=61, help="layers per pool (default 61, DSV4-Pro)")
    p.add_argument("--quick", action="store_true", help="budgets 1, 4, all; no SWA or state-row cases; 2 repeats")
    p.add_argument("--peer-lib", metavar="PATH", default=DEFAULT_PEER_LIB,
                   help="SGLang common_ops.abi3.so to run beside ours (default .peer/...)")
    p.add_argument("--ctas", metavar="LIST", help="CTA budgets, comma separated (0 = all SMs)")
    p.add_argument("--reps", type=int, default=0, help="timed repeats per row (default 3, quick 2)")
    p.add_argument("--limit-trials", type=int, default=MIN_TRIALS,
                   help=f"trials of each limit, the best is kept (default and minimum {MIN_TRIALS})")
    p.add_argument("--runs", metavar="SPEC", default=DEFAULT_RUNS,
                   help="host rows of the 'runs' pattern: alloc:R (requests of R rows from the "
                        "host-pool allocator after churn; default alloc:32) or fixed:N (runs of "
                        "N consecutive rows)")
    p.add_argument("--tune", action="store_true", help="also sweep kernel launch shapes")


def budgets(args: argparse.Namespace) -> list[int]:
    if args.ctas:
        return parse_list(args.ctas, "--ctas", int, lambda c: c >= 0,
                          "integers >= 0 (0 = all SMs)")
    return list(QUICK_BUDGETS if args.quick else BUDGETS)


def check_args(args: argparse.Namespace) -> None:
    """Every argument error, as one UsageError line, before anything is allocated."""
    if args.layers < 1:
        raise UsageError(f"--layers must be positive, got {args.layers}")
    if args.reps < 0:
        raise UsageError(f"--reps must not be negative, got {args.reps}")
    if args.limit_trials < MIN_TRIALS:
        raise UsageError(f"--limit-trials must be at least {MIN_TRIALS} (the limit is the best of "
                         f"that many trials), got {args.limit_trials}")
    parse_runs(args.runs)
    budgets(args)
    check_plot(args.plot)


def run(args: argparse.Namespace) -> int:
    check_args(args)
    import torch

    if torch.cuda.is_available():
        result = _GpuBench(args, budgets(args)).run()
    else:
        gpu_only = [f for f, on in (("--tune", args.tune), ("--ctas", args.ctas),
                                    ("--quick", args.quick),
                                    ("--peer-lib", args.peer_lib != DEFAULT_PEER_LIB),
                                    ("--limit-trials", args.limit_trials != MIN_TRIALS)) if on]
        if gpu_only:  # the CPU path times the torch reference only: no kernels, no peer
            raise UsageError(f"{', '.join(gpu_only)} appl{'y' if len(gpu_only) > 1 else 'ies'} "
                             f"on a GPU; this machine has no CUDA "
                             f"device (the CPU run times the torch reference path)")
        result = cpu_bench(args)
    if args.plot:
        result["plot"] = plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    print_table(result, sys.stderr if args.json else sys.stdout)
    return 0 if all(r.get("correct") is True for r in result["rows"] + result["tune"]) else 1


@dataclass(frozen=True)
class Case:
    """One data shape; ``fmt`` makes it a token copy (our split format: no peer equivalent)."""

    name: str
    row_bytes: int
    n: int
    fmt: Any = None
    patterns: tuple[str, ...] = PATTERNS
    both: bool = False  # also backup + swap-in at once
    quick: bool = True  # part of --quick


def cases() -> list[Case]:
    from hicache.kernels.tables import TokenFormat

    return [Case("c4 page rows", C4_ROW, 512, both=True),
            Case("swa page rows", SWA_ROW, 256, quick=False),
            Case("c4 state rows 64 KiB", STATE_ROW, 512, quick=False),
            Case("c4 tokens (576+8 B split)", C4_ROW, 32768, fmt=TokenFormat.mla(64),
                 patterns=("random",), both=True),
            Case("tokens 584 B contiguous", TOKEN584, 32768, patterns=("random",))]


def impls(case: Case, pattern: str, both: bool, peer: bool) -> list[str]:
    """Ours as the daemon runs it (``auto``), then our paths for the pattern (staged DMA on
    runs, and zero-copy beside it for one direction), then the peer on the same rows (row
    copies only)."""
    ours = ["staged"] if pattern == "runs" and both else \
        ["staged", "zero_copy"] if pattern == "runs" else ["zero_copy"]
    return ["auto"] + ours + ([PEER] if peer and case.fmt is None else [])


def case_rows(case: Case, pattern: str, seed: int, units: int,
              runs: Any) -> dict[bool, tuple[Any, Any]]:
    """{both: (device rows, host rows)} of one case and pattern, from one draw: the
    one-direction rows (False) are the first ``case.n`` of the "both" rows (True), whose
    second half is the swap-in's, allocated next in the same full pool
    (``host_rows(..., parts=2)``). (Drawn apart, the "both" rows came from a pool the churn had
    left half empty: runs of 93 rows against 21.)"""
    import torch

    parts = 2 if case.both else 1
    g = torch.Generator().manual_seed(100 + seed)
    dev_all = torch.randperm(units, generator=g)[:case.n * parts]
    host_all = host_rows(pattern, units, case.n, seed, runs, parts)
    out = {False: (dev_all[: case.n], host_all[: case.n])}
    if case.both:
        out[True] = (dev_all, host_all)
    return out


@dataclass
class Job:
    """One copy: tables, CPU indices (ours: as from the control plane), the same indices on
    the GPU (the peer's), and the stream it runs on."""

    src: Any
    dst: Any
    s_idx: Any
    d_idx: Any
    s_gpu: Any
    d_gpu: Any
    stream: Any
    case: Case

    def write(self) -> Write:
        return Write("dev" if self.src.is_cuda else "host", "host" if self.src.is_cuda else "dev",
                     self.s_idx, self.d_idx, self.case.row_bytes, self.case.fmt)


# ----------------------------------------------------------------------------- GPU
class _GpuBench:
    def __init__(self, args: argparse.Namespace, budgets: list[int]) -> None:
        import torch

        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.sms = torch.cuda.get_device_properties(self.dev).multi_processor_count
        self.budgets = [b if b else self.sms for b in budgets]
        self.reps = args.reps or (2 if args.quick else 3)
        self.L = args.layers
        self.runs = parse_runs(args.runs)
        self.rows: list[dict[str, Any]] = []
        self.tune: list[dict[str, Any]] = []
        self.limits: dict[str, float] = {}
        self.trials: dict[str, list[float]] = {}
        self.notes: list[str] = []
        self.peer: Optional[Callable] = None
        self.peer_name = ""
        self._tables: dict[tuple[bool, int], Any] = {}

    # ---- memory
    def _setup(self) -> None:
        torch = self.torch
        self.per_layer = 512 * SWA_ROW  # 76.7 MB per layer: 2048 C4 rows, 512 SWA rows
        total = self.L * self.per_layer
        t0 = time.perf_counter()
        self.dev_arena = torch.empty(total, dtype=torch.uint8, device=self.dev)
        self.host_arena, self.pin_how = _pinned(total)
        # the state both arenas had before a row's copies (on the GPU, for the check)
        self.before = {s: torch.empty(total, dtype=torch.uint8, device=self.dev)
                       for s in ("dev", "host")}
        self.scratch = torch.empty(self.per_layer, dtype=torch.uint8, device=self.dev)
        self._fresh()
        say(f"setup: {self.L} layers x {self.per_layer / 1e6:.1f} MB on "
             f"{torch.cuda.get_device_name(self.dev)} and pinned host ({self.pin_how}) "
             f"in {time.perf_counter() - t0:.1f} s")

    def _layers(self, flat) -> list:
        return list(flat.view(self.L, self.per_layer).unbind(0))

    def _fresh(self) -> None:
        """Fresh random bytes in both arenas, kept in ``before``: a copy that did not happen,
        or wrote anything else, cannot pass ``_verify``."""
        self.before["dev"].random_(0, 256)
        self.before["host"].random_(0, 256)
        self.dev_arena.copy_(self.before["dev"])
        self.host_arena.copy_(self.before["host"])
        self.torch.cuda.synchronize()

    def _verify(self, writes: list[Write]) -> Optional[str]:
        self.torch.cuda.synchronize()
        now = {"dev": self._layers(self.dev_arena), "host": self._layers(self.host_arena)}

        def after(side: str, l: int) -> Any:
            return now[side][l] if side == "dev" else self.scratch.copy_(now[side][l])

        before = {s: self._layers(t) for s, t in self.before.items()}
        return check(before, after, writes)

    def _table(self, host: bool, rb: int) -> Any:
        from hicache.kernels.tables import LayerTable

        key = (host, rb)
        if key not in self._tables:
            rows = self.per_layer // rb
            flat = (self.host_arena if host else self.dev_arena).view(self.L, self.per_layer)
            self._tables[key] = LayerTable([flat[l, : rows * rb].view(rows, rb)
                                            for l in range(self.L)], "host" if host else "device")
        return self._tables[key]

    # ---- timing
    def _time(self, fn: Callable[[], None], streams: list, reps: int, warm: bool = True) -> float:
        """GPU seconds per call (events around ``reps`` calls); host issue time per call is
        left in ``self.last_issue``."""
        torch = self.torch
        cur = torch.cuda.current_stream(self.dev)
        if warm:
            fn()  # compiles, allocates staging
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        for s in streams:
            s.wait_stream(cur)
        t0 = time.perf_counter()
        for _ in range(reps):
            fn()
        self.last_issue = (time.perf_counter() - t0) / reps
        for s in streams:
            cur.wait_stream(s)
        end.record(cur)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / reps

    def _limits(self) -> None:
        torch = self.torch
        n = min(self.L * self.per_layer, 2 << 30)
        h, d = self.host_arena[:n], self.dev_arena[:n]
        s1, s2 = torch.cuda.Stream(self.dev), torch.cuda.Stream(self.dev)
        half = n // 2

        def on(s: Any, dst: Any, src: Any) -> None:
            with torch.cuda.stream(s):
                dst.copy_(src, non_blocking=True)

        fns = {"h2d": (lambda: on(s1, d, h), [s1]), "d2h": (lambda: on(s1, h, d), [s1]),
               "both": (lambda: (on(s1, h[:half], d[:half]), on(s2, d[half:], h[half:])), [s1, s2])}
        for fn, streams in fns.values():
            fn()
        self.trials = {k: [] for k in fns}
        for _ in range(self.args.limit_trials):  # interleaved, so drift hits every direction
            for k, (fn, streams) in fns.items():
                self.trials[k].append(round(n / self._time(fn, streams, 1, warm=False) / 1e9, 2))
        self.limits = {k: max(v) for k, v in self.trials.items()}
        self.limit_bytes = n
        say(f"limit (contiguous pinned copy of {n / 1e9:.2f} GB, best of {self.args.limit_trials}):"
             + "".join(f"  {k} {v:.1f} (trials {self.trials[k]})" for k, v in self.limits.items()))

    # ---- rows
    def _mover(self, job: Job, impl: str) -> Callable[[int], Optional[str]]:
        torch = self.torch
        from hicache.kernels import dispatch

        case = job.case
        if impl == PEER:
            def move(c: int) -> Optional[str]:
                with torch.cuda.stream(job.stream):
                    self.peer(job.src.table(self.dev), job.dst.table(self.dev), job.s_gpu,
                              job.d_gpu, case.row_bytes, self.L, c)
                return None
        elif case.fmt is not None:
            def move(c: int) -> Optional[str]:
                return dispatch.copy_tokens(job.src, job.dst, job.s_idx, job.d_idx, case.fmt,
                                            ctas=c, impl=impl, stream=job.stream)
        else:
            def move(c: int) -> Optional[str]:
                return dispatch.copy_rows(job.src, job.dst, job.s_idx, job.d_idx, ctas=c,
                                          impl=impl, stream=job.stream)
        return move

    def measure(self, meta: dict[str, Any], moves: list[Callable[[int], Optional[str]]], streams: list,
                writes: list[Write], nbytes: int, ctas: int) -> dict[str, Any]:
        """Fresh bytes, time ``moves`` (one, or two from two threads at once), then verify."""
        def fn() -> None:
            if len(moves) == 1:
                return moves[0](ctas)
            err: list[BaseException] = []

            def worker() -> None:  # the swap-in worker of a transfer engine
                try:
                    moves[1](ctas)
                except BaseException as e:  # surfaced below, not lost in the thread
                    err.append(e)

            t = threading.Thread(target=worker)
            t.start()
            moves[0](ctas)
            t.join()
            if err:
                raise err[0]

        used = sorted({str(m(ctas)) for m in moves})  # compile and allocate outside the threads
        if meta["impl"] == "auto":
            meta = {**meta, "path_used": ",".join(used)}
        self._fresh()
        secs = self._time(fn, streams, self.reps, warm=False)
        bad = self._verify(writes)
        return self._record(meta, ctas, nbytes, secs, bad)

    def _record(self, meta: dict[str, Any], ctas: int, nbytes: int, secs: float,
                bad: Optional[str]) -> dict:
        gbps = nbytes / secs / 1e9
        limit = self.limits[meta["direction"]]
        row = {**meta, "ctas": ctas, "gbps": round(gbps, 2), "ratio_to_limit": round(gbps / limit, 3),
               "bytes": nbytes, "ms": round(secs * 1e3, 3),
               "issue_ms": round(self.last_issue * 1e3, 3), "correct": bad is None}
        if bad is not None:
            row["mismatch"] = bad
        say(f"{meta['case']:<26} {meta.get('pattern', '-'):<6} {meta['impl']:<13} "
             f"{meta['direction']:<4} ctas={ctas:>4}  {gbps:6.1f} GB/s  {gbps / limit:5.3f} x limit"
             f"  {'ok' if bad is None else 'WRONG: ' + bad}")
        return row

    def _case(self, case: Case) -> None:
        """Every pattern x implementation x direction x budget of one case, then (if
        ``case.both``) backup + swap-in at once; the rows of one pattern share their indices."""
        torch = self.torch
        dev_t, host_t = self._table(False, case.row_bytes), self._table(True, case.row_bytes)
        units = dev_t.rows * (case.fmt.tokens_per_page if case.fmt else 1)
        per = case.fmt.token_bytes if case.fmt else case.row_bytes
        streams = [torch.cuda.Stream(self.dev), torch.cuda.Stream(self.dev)]
        for seed, pattern in enumerate(case.patterns):
            drawn = case_rows(case, pattern, seed, units, self.runs)
            for both, (dev_idx, host_idx) in drawn.items():
                if both:  # backup: first half; swap-in: second half (disjoint rows both sides)
                    pairs = [(dev_t, host_t, dev_idx[: case.n], host_idx[: case.n]),
                             (host_t, dev_t, host_idx[case.n:], dev_idx[case.n:])]
                    plan = [("both", pairs)]
                else:
                    plan = [("d2h", [(dev_t, host_t, dev_idx, host_idx)]),
                            ("h2d", [(host_t, dev_t, host_idx, dev_idx)])]
                run_len = round(mean_run(host_idx[: case.n], host_idx[case.n:]) if both
                                else mean_run(host_idx), 2)
                for impl in impls(case, pattern, both, self.peer is not None):
                    for direction, pp in plan:
                        jobs = [Job(s, d, si.contiguous(), di.contiguous(), si.to(self.dev),
                                    di.to(self.dev), streams[k], case)
                                for k, (s, d, si, di) in enumerate(pp)]
                        meta = {"case": case.name, "pattern": pattern, "mean_run_rows": run_len,
                                "path": "tokens" if case.fmt else "rows", "direction": direction,
                                "impl": self.peer_name if impl == PEER else impl}
                        moves = [self._mover(j, impl) for j in jobs]
                        for ctas in self.budgets:
                            self.rows.append(self._guarded(
                                meta, lambda: self.measure(meta, moves, streams[: len(jobs)],
                                                           [j.write() for j in jobs],
                                                           len(dev_idx) * self.L * per, ctas),
                                ctas))

    def _guarded(self, meta: dict[str, Any], fn: Callable[[], dict], ctas: int) -> dict:
        """A row that raised is reported as a failed row (of its CTA budget); the rest still
        run."""
        import traceback

        try:
            return fn()
        except Exception as e:
            traceback.print_exc()
            return {**meta, "ctas": ctas, "gbps": 0.0, "ratio_to_limit": None, "correct": False,
                    "error": f"{type(e).__name__}: {e}"}

    def run(self) -> dict[str, Any]:
        torch = self.torch
        from hicache.kernels import peer_sglang

        t0 = time.perf_counter()
        self._setup()
        self._limits()
        self.peer, msg, self.peer_name = peer_sglang.load(self.args.peer_lib)
        say(msg)
        self.notes.append(msg)
        self.notes.append(f"'runs' host rows: {self.runs} (transfer_rows.parse_runs); device rows "
                          f"random; limits: best of {self.args.limit_trials} trials; rows: mean "
                          f"of {self.reps} calls; every row verified after its timed calls")
        for case in cases():
            if case.quick or not self.args.quick:
                self._case(case)
        if self.args.tune:
            from hicache.bench.transfer_tune import tune

            tune(self)
        _unpin(self.host_arena)
        return {
            "machine": {"gpu": torch.cuda.get_device_name(self.dev), "sms": self.sms,
                        "torch": torch.__version__, "triton": _triton_version(),
                        "python": sys.version.split()[0], "pinned_host": self.pin_how},
            "layers": self.L, "reps": self.reps, "budgets": self.budgets, "runs": str(self.runs),
            "limits_gbps": {k: round(v, 2) for k, v in self.limits.items()},
            "limit_trials_gbps": self.trials, "limit_bytes": self.limit_bytes,
            "rows": self.rows, "tune": self.tune, "notes": self.notes,
            "seconds": round(time.perf_counter() - t0, 1),
        }
