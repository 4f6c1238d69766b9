"""`hicache bench hisparse`: the HiSparse swap-in per decode step, against the H2D limit measured
in the same run.

Shapes default to DSV4-Flash: 21 C4 layers, top-k 512, a hot buffer of 1024 slots + 1 reserved
per request and layer, 128k-token requests (32,768 C4 tokens, host pages drawn at random from a
pinned pool of ``--host-rows`` C4 page rows per layer). For each batch size x ``overlap`` (top-k
traces of ``hicache.sim.topk_trace``): warm-up steps fill the buffers, then each timed step runs
21 swap-in launches (eager, ``check=False``) and the same step replays as one CUDA graph.

Per row: step time (eager and graph), tokens and bytes swapped in, the link time of those bytes at
the measured limit (contiguous pinned H2D copy, best of 5), ratio = link time / step time, CTAs
per launch (one per batch row), host issue time per layer (and through Triton's JIT on every
launch, for contrast), the fixed costs of a step (graph of padding rows only; graph of the same
ids again, all hits), and the target
``step <= 1.25 x link time + 60 us`` (graph replay). Every row is verified after its last step:
each top-k token's device location holds its host bytes, every layer. Beside it: device bytes per
request with the full C4 KV on the device vs the hot buffers.

``--configs 32x8,64x8,...`` repeats each row per swap-in launch shape (tokens per copy loop
iteration x warps). ``--read-sweep`` adds ``token_read_sweep``: isolated C4-token reads (the
copy's read pattern, no mapping), random and sequential, by CTA count (``hisparse_limits``;
refused without CUDA). Without CUDA the command runs the torch reference on small shapes (no
ratio, no graph), so the code path is exercised on CPU.
"""
from __future__ import annotations

from hicache.core.plotting import check_plot, pyplot
from hicache.bench.flags import parse_list, say

import argparse
import json
import statistics
import sys
import time
from typing import Any

from hicache.core.errors import UsageError

TARGET_FACTOR, TARGET_FIXED_US = 1.25, 60.0


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print the results as JSON on stdout")
    p.add_argument("--plot", metavar="FILE.png", help="plot step time per batch (needs matplotlib)")
    p.add_argument("--batches", default="1,8,32,64", help="batch sizes (default 1,8,32,64)")
    p.add_argument("--overlaps", default="0.5,0.8,0.95", help="top-k overlaps (default 0.5,0.8,0.95)")
    p.add_argument("--layers", type=int, default=21, help="C4 layers (default 21, DSV4-Flash)")
    p.add_argument("--topk", type=int, default=512, help="top-k per layer (default 512)")
    p.add_argument("--slots", type=int, default=0, help="hot-buffer slots (default 2 x topk)")
    p.add_argument("--tokens", type=int, default=131072, help="full tokens per request (default 128k)")
    p.add_argument("--host-rows", type=int, default=4096, help="host C4 page rows per layer")
    p.add_argument("--warmup", type=int, default=6, help="warm-up steps per row (default 6)")
    p.add_argument("--steps", type=int, default=4, help="timed steps per row, eager and graph")
    p.add_argument("--read-sweep", action="store_true",
                   help="also time isolated C4-token reads, random and sequential, at 4 / 16 / "
                        "32 / 64 CTAs and every SM (what bounds the copy's rate)")
    p.add_argument("--configs", default="32x8",
                   help="swap-in launch shapes TOKENSxWARPS to compare (tokens copied per loop "
                        "iteration of a program x num_warps; default 32x8)")


def _configs(s: str) -> list[tuple[int, int]]:
    out = []
    for part in (x.strip() for x in s.split(",") if x.strip()):
        t, _, w = part.partition("x")
        if not (t.isdigit() and w.isdigit()) or int(t) & (int(t) - 1) or int(w) & (int(w) - 1) \
                or not int(t) or not int(w):
            raise UsageError(f"--configs wants TOKENSxWARPS with powers of two, got {part!r}")
        out.append((int(t), int(w)))
    if not out:
        raise UsageError("--configs is empty")
    return out


def run(args: argparse.Namespace) -> int:
    batches = parse_list(args.batches, "--batches", int, lambda v: v > 0, "positive integers")
    overlaps = parse_list(args.overlaps, "--overlaps", float, lambda v: 0 <= v <= 1,
                          "numbers in [0, 1]")
    args.config_list = _configs(args.configs)
    for name in ("layers", "topk", "tokens", "host_rows", "steps"):
        if getattr(args, name) <= 0:
            raise UsageError(f"--{name.replace('_', '-')} must be positive")
    if args.warmup < 0 or args.slots < 0:
        raise UsageError("--warmup and --slots must not be negative")
    if args.tokens < 4:
        raise UsageError(f"--tokens must be at least 4 (one C4 token), got {args.tokens}")
    if 0 < args.slots < args.topk:
        raise UsageError(f"--slots ({args.slots}) must be at least --topk ({args.topk}): a "
                         f"request's top-k tokens must fit in its device slots")
    check_plot(args.plot)
    import torch

    if args.read_sweep and not torch.cuda.is_available():
        raise UsageError("--read-sweep times GPU reads of pinned host memory; it needs a CUDA "
                         "device")
    result = _Bench(args, batches, overlaps, torch.cuda.is_available()).run()
    if args.plot:
        result["plot"] = _plot(result, args.plot)
    if args.json:
        print(json.dumps(result, indent=1))
    else:
        _print(result)
    return 0 if all(r["verified"] for r in result["rows"]) else 1


class _Bench:
    def __init__(self, args: argparse.Namespace, batches: list[int], overlaps: list[float],
                 cuda: bool) -> None:
        import torch

        from hicache.kernels.tables import TokenFormat

        self.torch, self.args, self.cuda = torch, args, cuda
        self.batches, self.overlaps = batches, overlaps
        self.fmt = TokenFormat.mla(64)
        self.L, self.K = args.layers, args.topk
        self.S = args.slots or 2 * args.topk
        self.n = args.tokens // 4  # C4 tokens per request
        self.host_rows = args.host_rows
        self.notes: list[str] = []
        if not cuda:  # small shapes through the torch reference
            self.L, self.K, self.S = min(self.L, 2), min(self.K, 32), min(self.S, 64)
            self.n, self.host_rows = min(self.n, 2048), min(self.host_rows, 64)
            self.batches = [min(b, 4) for b in batches][:2]
            self.notes.append("no CUDA device: torch reference on small shapes; no ratio, no "
                              "graph; GPU figures need a GPU")
        self.dev = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    # ---------------------------------------------------------------- set-up
    def _host(self) -> Any:
        from hicache.bench.transfer import _pinned
        from hicache.kernels.tables import LayerTable

        torch, pb = self.torch, self.fmt.page_bytes
        per = self.host_rows * pb
        if self.cuda:
            arena, how = _pinned(self.L * per)
            gen = torch.empty(per, dtype=torch.uint8, device=self.dev)
            for l in range(self.L):
                gen.random_(0, 256)
                arena[l * per:(l + 1) * per].copy_(gen)
            torch.cuda.synchronize()
        else:
            arena, how = torch.randint(0, 256, (self.L * per,), dtype=torch.uint8), "cpu"
        self.pin_how, self._arena = how, arena
        return LayerTable([arena[l * per:(l + 1) * per].view(self.host_rows, pb)
                           for l in range(self.L)], "sparse host")

    # ---------------------------------------------------------------- one row
    def _row(self, B: int, overlap: float, config: tuple[int, int]) -> dict[str, Any]:
        torch = self.torch
        from hicache.engine.hot_buffer import HotBuffer
        from hicache.kernels.hisparse import SwapInConfig
        from hicache.sim.topk_trace import TopkTraceConfig, batch_traces

        impl = "triton" if self.cuda else "reference"
        hb = HotBuffer(self.host, fmt=self.fmt, topk=self.K, slots=self.S, max_requests=B,
                       max_batch=B, max_tokens=self.n, device=self.dev, impl=impl,
                       cfg=SwapInConfig(tokens=config[0], num_warps=config[1]))
        g = torch.Generator().manual_seed(B)
        pages = -(-self.n // 64)
        for r in range(B):
            hb.admit(r, self.n, torch.randint(self.host_rows, (pages,), generator=g).tolist())
        warm, steps = self.args.warmup, self.args.steps
        n_graph = steps if self.cuda else 0
        cfg = TopkTraceConfig(topk=self.K, overlap=overlap,
                              recent_window=min(1024, self.n))
        t0 = time.perf_counter()
        trace = batch_traces(cfg, [self.n] * B, self.L, warm + steps + n_graph, seed=B)
        gen_s = time.perf_counter() - t0
        topk = trace.to(self.dev)
        # the engine holds each layer's top-k as a tensor: views made outside the timed issue
        views = [[topk[s, l] for l in range(self.L)] for s in range(topk.shape[0])]
        req = torch.arange(B, dtype=torch.int64, device=self.dev)
        for s in range(warm):
            for l in range(self.L):
                hb.swap_in(l, req, views[s][l], check=False)
        self._sync()

        def step(s: int) -> None:
            for l in range(self.L):
                hb.swap_in(l, req, views[s][l], check=False)

        eager, issue, copied = [], [], []
        for s in range(warm, warm + steps):
            before = int(hb.stats[:, 1].sum())
            secs, iss = self._timed(lambda s=s: step(s))
            eager.append(secs)
            issue.append(iss / self.L)
            copied.append(int(hb.stats[:, 1].sum()) - before)
        issue_jit = None
        if hb.launches:  # the same step issued through Triton's JIT every launch, for contrast
            for ln in hb.launches:
                ln.cached = False
            _, iss = self._timed(lambda: step(warm + steps - 1))
            issue_jit = iss / self.L
            for ln in hb.launches:
                ln.cached = True
        graph, gcopied, gissue, capture_s = [], [], [], None
        floor_us = nomiss_us = None
        stray = 0
        if self.cuda:
            static = topk[warm + steps].clone()
            t0 = time.perf_counter()
            graph_obj = self._capture(hb, req, static)
            capture_s = time.perf_counter() - t0
            for s in range(warm + steps, warm + steps + n_graph):
                static.copy_(topk[s])
                before = int(hb.stats[:, 1].sum())
                secs, iss = self._timed(graph_obj.replay)
                graph.append(secs)
                gissue.append(iss / self.L)
                gcopied.append(int(hb.stats[:, 1].sum()) - before)
            floor_us, nomiss_us, stray = self._fixed_costs(hb, req, static, graph_obj)
        last = topk[warm + steps + n_graph - 1]
        verified = self._verify(hb, last, B) and stray == 0  # all-hit replays copy nothing
        tb = self.fmt.token_bytes
        timed = graph if graph else eager
        tok = gcopied if graph else copied
        link = [c * tb / (self.limit * 1e9) for c in tok] if self.limit else []
        row = {
            "batch": B, "overlap": overlap, "ctas": B, "layers": self.L,
            "step_us_eager": round(statistics.median(eager) * 1e6, 1),
            "step_us_graph": round(statistics.median(graph) * 1e6, 1) if graph else None,
            "graph_capture_s": None if capture_s is None else round(capture_s, 3),
            "issue_us_per_layer": round(statistics.median(issue) * 1e6, 2),
            "issue_us_per_layer_graph": round(statistics.median(gissue) * 1e6, 2) if gissue else None,
            "issue_us_per_layer_jit": None if issue_jit is None else round(issue_jit * 1e6, 2),
            "config": f"{config[0]}x{config[1]}",
            "padding_step_us_graph": floor_us, "all_hit_step_us_graph": nomiss_us,
            "tokens_per_step": round(statistics.mean(tok)),
            "bytes_per_step": round(statistics.mean(tok) * tb),
            "hit_rate": round(1 - statistics.mean(tok) / (B * self.L * self.K), 4),
            "trace_gen_s": round(gen_s, 2), "verified": verified,
        }
        if link:
            link_us = sum(link) / len(link) * 1e6
            step_us = sum(timed) / len(timed) * 1e6
            target = TARGET_FACTOR * link_us + TARGET_FIXED_US
            row.update(link_us=round(link_us, 1), step_us_mean=round(step_us, 1),
                       ratio_to_limit=round(link_us / step_us, 3),
                       ratio_to_token_limit=round(link_us * self.limit / self.token_limit
                                                  / step_us, 3),
                       target_us=round(target, 1), meets_target=step_us <= target)
        say(f"batch {B:3d} overlap {overlap:.2f} config {row['config']}: eager "
             f"{row['step_us_eager']:8.1f} us  graph {row['step_us_graph']} us (padding only "
             f"{floor_us}, all hits {nomiss_us})  {row['tokens_per_step']} tokens/step  "
             f"link {row.get('link_us')} us  ratio {row.get('ratio_to_limit')}  issue "
             f"{row['issue_us_per_layer']} us/layer (JIT every launch {row['issue_us_per_layer_jit']})"
             f"  {'verified' if verified else 'WRONG'}")
        return row

    def _sync(self) -> None:
        if self.cuda:
            self.torch.cuda.synchronize()

    def _timed(self, fn: Any) -> tuple[float, float]:
        """(device seconds of one call, host seconds to issue it)."""
        torch = self.torch
        if not self.cuda:
            t0 = time.perf_counter()
            fn()
            dt = time.perf_counter() - t0
            return dt, dt
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda.synchronize()
        a.record()
        t0 = time.perf_counter()
        fn()
        issue = time.perf_counter() - t0
        b.record()
        b.synchronize()
        return a.elapsed_time(b) / 1e3, issue

    def _fixed_costs(self, hb: Any, req: Any, static: Any,
                     graph_obj: Any) -> tuple[float, float, int]:
        """The step's fixed costs, from graphs (median of 5): every row padding (launches and
        the programs' exit: the floor), and the last step's ids again (every id a hit: the
        mapping phase without copies); and the tokens those replays copied (must be 0)."""
        torch = self.torch
        pad = torch.full_like(req, -1)
        g_pad = self._capture(hb, pad, static)
        floor = statistics.median(self._timed(g_pad.replay)[0] for _ in range(5))
        hits = []
        before = int(hb.stats[:, 1].sum())
        for _ in range(5):
            hits.append(self._timed(graph_obj.replay)[0])
        return (round(floor * 1e6, 1), round(statistics.median(hits) * 1e6, 1),
                int(hb.stats[:, 1].sum()) - before)

    def _capture(self, hb: Any, req: Any, static: Any) -> Any:
        torch = self.torch
        side = torch.cuda.Stream(self.dev)
        side.wait_stream(torch.cuda.current_stream())
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=side):
            for l in range(self.L):
                hb.swap_in(l, req, static[l], check=False)
        torch.cuda.synchronize()
        return graph

    def _verify(self, hb: Any, topk: Any, B: int) -> bool:
        """Every valid id of the last step: device bytes at its location == its host bytes."""
        torch = self.torch
        from hicache.kernels.reference import _token_views

        P = 64
        hp = hb.host_pages[:B].cpu()
        for l in range(self.L):
            ids = topk[l].cpu()
            out = hb.out[l, :B].cpu()
            ok = (ids >= 0) & (ids < self.n)
            if not torch.equal(out < 0, ~ok):
                return False
            rows = torch.arange(B)[:, None].expand_as(ids)[ok]
            t = ids[ok]
            htok = hp[rows, t // P] * P + t % P
            hv, hs = _token_views(hb.host.layers[l], self.fmt)
            dv, ds = _token_views(hb.dev.layers[l], self.fmt)
            loc = out[ok].to(self.dev)
            if not (torch.equal(hv[htok // P, htok % P], dv[loc // P, loc % P].cpu())
                    and torch.equal(hs[htok // P, htok % P], ds[loc // P, loc % P].cpu())):
                return False
        return True

    # ---------------------------------------------------------------- all rows
    def run(self) -> dict[str, Any]:
        torch = self.torch
        self.host = self._host()
        self.limit = self.token_limit = 0.0
        probes = sweep = None
        if self.cuda:
            from hicache.bench import hisparse_limits as lim

            self.limit = lim.contiguous_h2d(self._arena, self.dev)
            self.token_limit = lim.random_tokens_h2d(self._arena, self.L, self.host_rows,
                                                     self.fmt, self.dev)
            probes = lim.layout_probes(self._arena, self.L, self.host_rows, self.dev)
            say(f"random tokens by host layout: {probes}")
            if self.args.read_sweep:
                sweep = lim.read_sweep(self._arena, self.L, self.host_rows, self.dev)
                say(f"token reads by pattern and CTAs (GB/s): {sweep}")
        if self.cuda:
            say(f"H2D limit (contiguous pinned copy, best of 5): {self.limit:.1f} GB/s; "
                 f"random single tokens (copy_tokens, all SMs): {self.token_limit:.1f} GB/s")
        rows = [self._row(B, ov, cf) for B in self.batches for ov in self.overlaps
                for cf in self.args.config_list]
        pb, P, tb = self.fmt.page_bytes, 64, self.fmt.token_bytes
        full = -(-self.n // P) * pb * self.L
        hot = (self.S + 1) * tb * self.L
        return {
            "machine": {"gpu": torch.cuda.get_device_name(self.dev) if self.cuda else None,
                        "torch": torch.__version__, "python": sys.version.split()[0],
                        "triton": _triton_version(), "host_memory": self.pin_how},
            "shape": {"layers": self.L, "topk": self.K, "slots": self.S, "reserved": 1,
                      "c4_tokens_per_request": self.n, "token_bytes": tb,
                      "host_rows_per_layer": self.host_rows},
            "limit_h2d_gbps": round(self.limit, 2) if self.cuda else None,
            "random_token_h2d_gbps": round(self.token_limit, 2) if self.cuda else None,
            "random_token_h2d_by_layout": probes,
            "token_read_sweep": sweep,
            "target": f"graph step <= {TARGET_FACTOR} x link time + {TARGET_FIXED_US} us; "
                      f"host issue <= 20 us per layer",
            "device_bytes_per_request": {"full_c4_on_device": full, "hot_buffer": hot,
                                         "ratio": round(full / hot, 1)},
            "rows": rows, "notes": self.notes,
        }


def _triton_version() -> str:
    import triton
    return triton.__version__


def _print(result: dict[str, Any]) -> None:
    if result["limit_h2d_gbps"]:
        print(f"H2D limit: {result['limit_h2d_gbps']} GB/s   target: {result['target']}")
    # medians of the steps, then the mean step the ratio and the target use (mean link us /
    # mean step us: the bytes of every step over the time of every step)
    print(f"{'batch':>5} {'overlap':>7} {'config':>6} {'ctas':>4} {'eager us':>9} {'graph us':>9} "
          f"{'tokens':>7} {'MB':>7} {'mean us':>8} {'link us':>8} {'ratio':>6} {'issue us/l':>10} "
          "target  check")
    for r in result["rows"]:
        print(f"{r['batch']:>5} {r['overlap']:>7.2f} {r['config']:>6} {r['ctas']:>4} "
              f"{r['step_us_eager']:>9.1f} "
              f"{r['step_us_graph']!s:>9} {r['tokens_per_step']:>7} "
              f"{r['bytes_per_step'] / 1e6:>7.2f} {r.get('step_us_mean', '-')!s:>8} "
              f"{r.get('link_us', '-')!s:>8} "
              f"{r.get('ratio_to_limit', '-')!s:>6} {r['issue_us_per_layer']:>10} "
              f"{str(r.get('meets_target', '-')):<7} {'verified' if r['verified'] else 'WRONG'}")
    if result.get("token_read_sweep"):
        print("C4 token reads, GB/s by CTAs: " + "; ".join(
            f"{p}: " + ", ".join(f"{r['ctas']} {r['gbps']}" for r in result["token_read_sweep"]
                                 if r["pattern"] == p) for p in ("random", "sequential")))
    d = result["device_bytes_per_request"]
    print(f"device bytes per request: full C4 on device {d['full_c4_on_device'] / 1e6:.1f} MB, "
          f"hot buffers {d['hot_buffer'] / 1e6:.1f} MB ({d['ratio']}x less)")
    for n in result["notes"]:
        print(f"note: {n}")


def _plot(result: dict[str, Any], path: str) -> str:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(8, 5))
    for ov in sorted({r["overlap"] for r in result["rows"]}):
        rs = [r for r in result["rows"] if r["overlap"] == ov]
        ax.plot([r["batch"] for r in rs], [r["step_us_graph"] or r["step_us_eager"] for r in rs],
                marker="o", label=f"step, overlap {ov}")
        if all("link_us" in r for r in rs):
            ax.plot([r["batch"] for r in rs], [r["link_us"] for r in rs], ls="--",
                    label=f"link time, overlap {ov}")
    ax.set_xlabel("batch")
    ax.set_ylabel("us per decode step (all C4 layers)")
    ax.legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    return path
