"""`hicache bench transfer`: GPU<->host copy paths against the PCIe limit measured in the same run.

On a GPU, in one process: the contiguous pinned copy limit (H2D, D2H, both at once on two
streams); then every path x direction x CTA budget on DSV4-sized data (61 layers; 512 random C4
page rows of 37,440 B; 256 random SWA page rows of 149,760 B; 32,768 random C4 tokens of the
fp8 MLA format; C4 compress-state rows of 65,536 B); then backup + swap-in at once on two
streams; and the same cases with SGLang's transfer kernel when its library loads (rows, and
584-B contiguous tokens, the closest it has to a token copy). Each row: GB/s of useful bytes and
the ratio to the limit of its direction. Every case is checked once against the source bytes.

Host rows come two ways: ``random`` (any free row, the general case: zero-copy kernel) and
``runs`` (consecutive host rows, as an allocator handing out runs gives: staged path, DMA on the
copy engines). On CPU the command times the torch reference path on small data.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from typing import Any, Callable, Optional

from hicache.bench.transfer_support import (_pinned, _triton_version, _unpin, cpu_bench,
                                            peer_name, plot, print_table, staged_variants)
from hicache.core.errors import UsageError

BUDGETS = (1, 2, 4, 8, 16, 0)  # 0 = all SMs
C4_ROW, SWA_ROW, STATE_ROW, TOKEN584 = 37_440, 149_760, 65_536, 584


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--plot", metavar="FILE.png", help="plot GB/s per CTA budget (needs matplotlib)")
    p.add_argument("--layers", type=int, default=61, help="layers per pool (default 61, DSV4-Pro)")
    p.add_argument("--quick", action="store_true", help="fewer budgets and cases, fewer repeats")
    p.add_argument("--peer-lib", metavar="PATH", default=os.path.join(".peer", "common_ops.abi3.so"),
                   help="SGLang common_ops.abi3.so to run beside ours (default .peer/...)")
    p.add_argument("--ctas", metavar="LIST", help="CTA budgets, comma separated (0 = all SMs)")
    p.add_argument("--reps", type=int, default=0, help="timed repeats per case (default 3, quick 2)")
    p.add_argument("--tune", action="store_true", help="also sweep kernel launch shapes")


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def _budgets(args: argparse.Namespace) -> list[int]:
    if args.ctas:
        try:
            out = [int(x) for x in args.ctas.split(",") if x.strip()]
        except ValueError:
            raise UsageError(f"--ctas wants comma separated integers, got {args.ctas!r}")
        if not out or any(c < 0 for c in out):
            raise UsageError(f"--ctas wants integers >= 0 (0 = all SMs), got {args.ctas!r}")
        return out
    return [1, 4, 0] if args.quick else list(BUDGETS)


def run(args: argparse.Namespace) -> int:
    if args.layers < 1:
        raise UsageError(f"--layers must be positive, got {args.layers}")
    if args.reps < 0:
        raise UsageError(f"--reps must not be negative, got {args.reps}")
    import torch

    budgets = _budgets(args)
    if torch.cuda.is_available():
        result = _GpuBench(args, budgets).run()
    else:
        result = cpu_bench(args)
    if args.plot:
        result["plot"] = plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        print_table(result)
    return 0 if all(r.get("correct", True) is not False for r in result["rows"]) else 1


# ----------------------------------------------------------------------------- GPU
class _GpuBench:
    def __init__(self, args: argparse.Namespace, budgets: list[int]):
        import torch

        self.torch = torch
        self.args = args
        self.dev = torch.device("cuda", torch.cuda.current_device())
        self.sms = torch.cuda.get_device_properties(self.dev).multi_processor_count
        self.budgets = [b if b else self.sms for b in budgets]
        self.reps = args.reps or (2 if args.quick else 3)
        self.L = args.layers
        self.rows: list[dict[str, Any]] = []
        self.tune: list[dict[str, Any]] = []
        self.limits: dict[str, float] = {}
        self.notes: list[str] = []

    # ---- memory
    def _setup(self) -> None:
        torch = self.torch
        self.per_layer = 512 * SWA_ROW  # 76.7 MB per layer: 2048 C4 rows, 512 SWA rows
        total = self.L * self.per_layer
        t0 = time.perf_counter()
        self.dev_arena = torch.randint(0, 256, (total,), dtype=torch.uint8, device=self.dev)
        self.host_arena, how = _pinned(total)
        self.scratch = torch.empty(self.per_layer, dtype=torch.uint8, device=self.dev)
        self.host_arena.copy_(self.dev_arena)  # host starts with random bytes too
        self.dev_arena.random_(0, 256)
        torch.cuda.synchronize()
        _log(f"setup: {self.L} layers x {self.per_layer / 1e6:.1f} MB on {torch.cuda.get_device_name(self.dev)}"
             f" and pinned host ({how}) in {time.perf_counter() - t0:.1f} s")
        self.pin_how = how

    def _views(self, arena, row_bytes: int):
        from hicache.kernels.tables import LayerTable

        rows = self.per_layer // row_bytes
        flat = arena.view(self.L, self.per_layer)
        return LayerTable([flat[l, : rows * row_bytes].view(rows, row_bytes) for l in range(self.L)],
                          "device" if arena.is_cuda else "host")

    # ---- timing
    def _time(self, fn: Callable[[], None], streams: list) -> float:
        """GPU seconds per call (events around ``reps`` calls); host issue time per call is
        left in ``self.last_issue``."""
        torch = self.torch
        cur = torch.cuda.current_stream(self.dev)
        fn()  # warm-up (compiles, allocates staging)
        torch.cuda.synchronize()
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record(cur)
        for s in streams:
            s.wait_stream(cur)
        t0 = time.perf_counter()
        for _ in range(self.reps):
            fn()
        self.last_issue = (time.perf_counter() - t0) / self.reps
        for s in streams:
            cur.wait_stream(s)
        end.record(cur)
        end.synchronize()
        return start.elapsed_time(end) / 1e3 / self.reps

    def _limits(self) -> None:
        torch = self.torch
        n = min(self.L * self.per_layer, 2 << 30)
        h, d = self.host_arena[:n], self.dev_arena[:n]
        s1, s2 = torch.cuda.Stream(self.dev), torch.cuda.Stream(self.dev)

        def h2d():
            with torch.cuda.stream(s1):
                d.copy_(h, non_blocking=True)

        def d2h():
            with torch.cuda.stream(s1):
                h.copy_(d, non_blocking=True)

        half = n // 2

        def both():
            with torch.cuda.stream(s1):
                h[:half].copy_(d[:half], non_blocking=True)
            with torch.cuda.stream(s2):
                d[half:].copy_(h[half:], non_blocking=True)

        self.limits["h2d"] = n / self._time(h2d, [s1]) / 1e9
        self.limits["d2h"] = n / self._time(d2h, [s1]) / 1e9
        self.limits["both"] = n / self._time(both, [s1, s2]) / 1e9
        _log(f"limit (contiguous pinned copy, {n / 1e9:.2f} GB): H2D {self.limits['h2d']:.1f}  "
             f"D2H {self.limits['d2h']:.1f}  both {self.limits['both']:.1f} GB/s")

    # ---- cases
    def _indices(self, rows: int, n: int, host_runs: bool, seed: int):
        torch = self.torch
        g = torch.Generator().manual_seed(seed)
        dev_idx = torch.randperm(rows, generator=g)[:n]
        if host_runs:
            start = int(torch.randint(0, rows - n + 1, (1,), generator=g))
            host_idx = torch.arange(start, start + n, dtype=torch.int64)
        else:
            host_idx = torch.randperm(rows, generator=g)[:n]
        return dev_idx, host_idx

    def _poison(self, table) -> None:
        """Fresh random bytes in a destination so a copy that did not happen cannot pass."""
        torch = self.torch
        if table.is_cuda:
            self.dev_arena.random_(0, 256)
        else:
            self.scratch.random_(0, 256)
            flat = self.host_arena.view(self.L, self.per_layer)
            for l in range(self.L):
                flat[l].copy_(self.scratch, non_blocking=True)
        torch.cuda.synchronize()

    def _verify(self, src, dst, s_idx, d_idx, fmt=None) -> bool:
        torch = self.torch
        from hicache.kernels.reference import _token_views

        torch.cuda.synchronize()
        si, di = s_idx.to(self.dev), d_idx.to(self.dev)
        for l in range(self.L):
            s = src.layers[l].to(self.dev, non_blocking=True)
            d = dst.layers[l].to(self.dev, non_blocking=True)
            if fmt is None:
                ok = torch.equal(s.index_select(0, si), d.index_select(0, di))
            else:
                P = fmt.tokens_per_page
                sv, ss = _token_views(s, fmt)
                dv, ds = _token_views(d, fmt)
                ok = torch.equal(sv[si // P, si % P], dv[di // P, di % P]) and \
                    torch.equal(ss[si // P, si % P], ds[di // P, di % P])
            if not ok:
                return False
        return True

    def _record(self, case: str, path: str, direction: str, ctas: Optional[int], impl: str,
                nbytes: int, secs: float, correct: Optional[bool], **extra: Any) -> dict:
        gbps = nbytes / secs / 1e9
        limit = self.limits[direction]
        row = {"case": case, "path": path, "direction": direction, "ctas": ctas, "impl": impl,
               "gbps": round(gbps, 2), "ratio_to_limit": round(gbps / limit, 3),
               "bytes": nbytes, "ms": round(secs * 1e3, 3),
               "issue_ms": round(getattr(self, "last_issue", 0.0) * 1e3, 3), "correct": correct,
               **extra}
        _log(f"{case:<28} {impl:<26} {direction:<4} ctas={ctas!s:>4}  {gbps:6.1f} GB/s  "
             f"{gbps / limit:5.3f} x limit  {'' if correct is None else ('ok' if correct else 'WRONG')}")
        return row

    def _case(self, case: str, path: str, row_bytes: int, n: int, host_runs: bool, impl: str,
              fmt=None, peer: Optional[Callable] = None, seed: int = 0) -> None:
        """One data case in both directions over every budget."""
        torch = self.torch
        from hicache.kernels import dispatch

        dev_t, host_t = self._views(self.dev_arena, row_bytes), self._views(self.host_arena, row_bytes)
        units = dev_t.rows * (fmt.tokens_per_page if fmt else 1)
        dev_idx, host_idx = self._indices(units, n, host_runs, seed)
        dev_idx_d = dev_idx.to(self.dev)
        host_idx_d = host_idx.to(self.dev)
        per = (fmt.token_bytes if fmt else row_bytes)
        nbytes = n * self.L * per
        stream = torch.cuda.Stream(self.dev)
        for direction in ("d2h", "h2d"):
            src, dst = (dev_t, host_t) if direction == "d2h" else (host_t, dev_t)
            s_idx, d_idx = (dev_idx, host_idx) if direction == "d2h" else (host_idx, dev_idx)
            s_dev, d_dev = (dev_idx_d, host_idx_d) if direction == "d2h" else (host_idx_d, dev_idx_d)
            # indices arrive on the CPU (as from the control plane): dispatch uploads the
            # device side's through pinned memory, the staged path plans DMAs from the host's
            s_arg, d_arg = s_idx, d_idx
            checked: Optional[bool] = None
            for ctas in self.budgets:
                if peer is not None:
                    def fn(c=ctas):
                        with torch.cuda.stream(stream):
                            peer(src.table(self.dev), dst.table(self.dev), s_dev, d_dev,
                                 row_bytes, self.L, c)
                elif fmt is not None:
                    def fn(c=ctas):
                        dispatch.copy_tokens(src, dst, s_arg, d_arg, fmt, ctas=c, impl=impl,
                                             stream=stream)
                else:
                    def fn(c=ctas):
                        dispatch.copy_rows(src, dst, s_arg, d_arg, ctas=c, impl=impl, stream=stream)
                if checked is None:
                    self._poison(dst)
                    fn()
                    checked = self._verify(src, dst, s_idx, d_idx, fmt)
                secs = self._time(fn, [stream])
                name = peer_name() if peer is not None else impl
                self.rows.append(self._record(case, path, direction, ctas, name, nbytes, secs,
                                              checked, host_rows="runs" if host_runs else "random"))

    def _both(self, case: str, row_bytes: int, n: int, host_runs: bool, impl: str,
              fmt=None, peer: Optional[Callable] = None) -> None:
        """Backup (D2H) and swap-in (H2D) at once on two streams, disjoint rows."""
        torch = self.torch
        from hicache.kernels import dispatch

        dev_t, host_t = self._views(self.dev_arena, row_bytes), self._views(self.host_arena, row_bytes)
        units = dev_t.rows * (fmt.tokens_per_page if fmt else 1)
        half = units // 2
        a_dev, a_host = self._indices(half, n, host_runs, 1)  # backup: lower half
        b_dev, b_host = self._indices(half, n, host_runs, 2)  # swap-in: upper half
        b_dev, b_host = b_dev + half, b_host + half
        sa, sb = torch.cuda.Stream(self.dev), torch.cuda.Stream(self.dev)
        per = (fmt.token_bytes if fmt else row_bytes)
        nbytes = 2 * n * self.L * per
        A = [a_dev, a_host]  # CPU indices, as in _case
        B = [b_host, b_dev]
        Ad, Bd = [x.to(self.dev) for x in A], [x.to(self.dev) for x in B]
        import threading

        def mover(src, dst, idx, idx_d, stream):
            def move(c):
                if peer is not None:
                    with torch.cuda.stream(stream):
                        peer(src.table(self.dev), dst.table(self.dev), idx_d[0], idx_d[1],
                             row_bytes, self.L, c)
                elif fmt is not None:
                    dispatch.copy_tokens(src, dst, idx[0], idx[1], fmt, ctas=c, impl=impl,
                                         stream=stream)
                else:
                    dispatch.copy_rows(src, dst, idx[0], idx[1], ctas=c, impl=impl, stream=stream)
            return move

        backup = mover(dev_t, host_t, A, Ad, sa)
        swap_in = mover(host_t, dev_t, B, Bd, sb)
        for ctas in self.budgets:
            def fn(c=ctas):
                # one issuing thread per direction, as a transfer engine with a backup and a
                # swap-in worker would run them
                err: list[BaseException] = []

                def worker():
                    try:
                        swap_in(c)
                    except BaseException as e:  # surfaced below, not lost in the thread
                        err.append(e)

                t = threading.Thread(target=worker)
                t.start()
                backup(c)
                t.join()
                if err:
                    raise err[0]

            backup(ctas)  # compile and allocate outside the threads
            swap_in(ctas)
            torch.cuda.synchronize()
            secs = self._time(fn, [sa, sb])
            name = peer_name() if peer is not None else impl
            self.rows.append(self._record(case, "both", "both", ctas, name, nbytes, secs, None,
                                          host_rows="runs" if host_runs else "random",
                                          note="per-direction paths verified above"))

    def _tune(self) -> None:
        """Sweep launch shapes: the token kernel and the staged path (buffers, gather shape).
        (Row zero-copy shapes were swept before: every shape with >= 32 KiB in flight per CTA
        sits on the same plateau at 4 CTAs.)"""
        torch = self.torch
        from hicache.kernels import staged as S, tokens as T
        from hicache.kernels.tables import TokenFormat

        stream = torch.cuda.Stream(self.dev)
        dev_t, host_t = self._views(self.dev_arena, C4_ROW), self._views(self.host_arena, C4_ROW)
        fmt = TokenFormat.mla(64)
        t_dev, t_host = self._indices(dev_t.rows * 64, 32768, False, 3)
        td, th = t_dev.to(self.dev), t_host.to(self.dev)
        nbytes = 32768 * self.L * fmt.token_bytes
        for direction in ("d2h", "h2d"):
            src, dst = (dev_t, host_t) if direction == "d2h" else (host_t, dev_t)
            si, dd = (td, th) if direction == "d2h" else (th, td)
            for cfg in (T.TokensConfig(128, 16), T.TokensConfig(128, 32), T.TokensConfig(256, 32),
                        T.TokensConfig(64, 32)):
                for ctas in (2, 4, 8):
                    def fn(c=ctas, cfg=cfg):
                        with torch.cuda.stream(stream):
                            T.launch_tokens(src.table(self.dev), dst.table(self.dev), si, dd, fmt,
                                            num_layers=self.L, src_stride=C4_ROW,
                                            dst_stride=C4_ROW, align=16, ctas=c, cfg=cfg)
                    secs = self._time(fn, [stream])
                    self.tune.append(self._record("tune tokens c4", "tokens", direction, ctas,
                                                  f"zc T{cfg.tokens} w{cfg.num_warps}", nbytes, secs, None))
        variants = staged_variants()
        for row_bytes, n in ((C4_ROW, 512), (SWA_ROW, 256)):
            dev_t, host_t = self._views(self.dev_arena, row_bytes), self._views(self.host_arena, row_bytes)
            dev_idx, host_idx = self._indices(dev_t.rows, n, True, 0)
            di = dev_idx.to(self.dev)
            runs = S.plan_runs(host_idx)
            nbytes = n * self.L * row_bytes
            for direction in ("d2h", "h2d"):
                src, dst = (dev_t, host_t) if direction == "d2h" else (host_t, dev_t)
                si, dd = (di, host_idx) if direction == "d2h" else (host_idx, di)
                for cfg in variants:
                    for ctas in (2, 4):
                        def fn(c=ctas, cfg=cfg):
                            with torch.cuda.stream(stream):
                                S.copy_rows_staged(src, dst, si, dd, host_idx, runs, ctas=c, cfg=cfg)
                        secs = self._time(fn, [stream])
                        r = cfg.rows
                        self.tune.append(self._record(
                            f"tune staged {row_bytes}", "rows", direction, ctas,
                            f"staged {cfg.chunk_bytes >> 20}MBx{cfg.buffers} dma{cfg.dma_streams} "
                            f"g{r.pieces}w{r.num_warps}",
                            nbytes, secs, None))

    def run(self) -> dict[str, Any]:
        torch = self.torch
        from hicache.kernels import peer_sglang
        from hicache.kernels.tables import TokenFormat

        t0 = time.perf_counter()
        self._setup()
        self._limits()
        peer, msg = peer_sglang.load(self.args.peer_lib)
        _log(msg)
        self.notes.append(msg)
        c4 = TokenFormat.mla(64)
        quick = self.args.quick
        self._guarded(self._main_cases, c4, quick, peer)
        if self.args.tune:
            self._guarded(self._tune)
        _unpin(self.host_arena)
        return {
            "machine": {"gpu": torch.cuda.get_device_name(self.dev), "sms": self.sms,
                        "torch": torch.__version__, "triton": _triton_version(),
                        "python": sys.version.split()[0], "pinned_host": self.pin_how},
            "layers": self.L, "reps": self.reps, "budgets": self.budgets,
            "limits_gbps": {k: round(v, 2) for k, v in self.limits.items()},
            "rows": self.rows, "tune": self.tune, "notes": self.notes,
            "seconds": round(time.perf_counter() - t0, 1),
        }

    def _guarded(self, fn: Callable, *a: Any) -> None:
        """Run a group of cases; an exception is reported as a failed row, the rest still run."""
        import traceback

        try:
            fn(*a)
        except Exception as e:
            traceback.print_exc()
            self.rows.append({"case": getattr(fn, "__name__", "?"), "path": "error",
                              "direction": "-", "ctas": None, "impl": "-", "gbps": 0.0,
                              "ratio_to_limit": None, "correct": False,
                              "error": f"{type(e).__name__}: {e}"})

    def _main_cases(self, c4, quick: bool, peer) -> None:
        g = self._guarded
        g(lambda: self._case("c4 page rows", "rows", C4_ROW, 512, False, "zero_copy"))
        g(lambda: self._case("c4 page rows", "rows", C4_ROW, 512, True, "staged"))
        if not quick:
            g(lambda: self._case("swa page rows", "rows", SWA_ROW, 256, False, "zero_copy"))
            g(lambda: self._case("swa page rows", "rows", SWA_ROW, 256, True, "staged"))
        g(lambda: self._case("c4 tokens (576+8 B split)", "tokens", C4_ROW, 32768, False, "zero_copy", fmt=c4))
        g(lambda: self._case("tokens 584 B contiguous", "rows", TOKEN584, 32768, False, "zero_copy"))
        if not quick:
            g(lambda: self._case("c4 state rows 64 KiB", "rows", STATE_ROW, 512, False, "zero_copy"))
            g(lambda: self._case("c4 state rows 64 KiB", "rows", STATE_ROW, 512, True, "staged"))
        g(lambda: self._both("c4 page rows", C4_ROW, 512, True, "staged"))
        g(lambda: self._both("c4 page rows", C4_ROW, 512, False, "zero_copy"))
        g(lambda: self._both("c4 tokens (576+8 B split)", C4_ROW, 32768, False, "zero_copy", fmt=c4))
        if peer is not None:
            g(lambda: self._case("c4 page rows", "rows", C4_ROW, 512, False, "peer", peer=peer))
            if not quick:
                g(lambda: self._case("swa page rows", "rows", SWA_ROW, 256, False, "peer", peer=peer))
            g(lambda: self._case("tokens 584 B contiguous", "rows", TOKEN584, 32768, False, "peer", peer=peer))
            g(lambda: self._both("c4 page rows", C4_ROW, 512, False, "peer", peer=peer))
