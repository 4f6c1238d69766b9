"""What ``bench transfer`` needs beside its GPU cases: pinned buffers (exact-size registered
memory, torch's allocator as the fallback), Triton's version, the DSV4 row sizes,
the staged shapes ``--tune`` sweeps, the CPU run (the torch reference path on small data, when
there is no GPU, with the GPU run's row patterns and byte check), the markdown table (one line
per case x pattern x impl x direction, a column per CTA budget) and the GB/s-per-budget plot.
"""
from __future__ import annotations

from hicache.core.plotting import pyplot
from hicache.bench.flags import say

import argparse
import sys
import time
from typing import Any

from hicache.kernels.tables import TokenFormat

# row sizes of the DSV4 cases: C4 page row (MLA format, 64 tokens), SWA page row, C4
# compress-state row, one 584-B contiguous token (value + scale)
C4_ROW, SWA_ROW, STATE_ROW, TOKEN584 = 37_440, 149_760, 65_536, 584


def staged_variants() -> list:
    """The staged-path shapes ``--tune`` sweeps (keywords: the config gained fields)."""
    from hicache.kernels.rows import RowsConfig
    from hicache.kernels.staged import StagedConfig

    wide, narrow = RowsConfig(2048, 64, 32), RowsConfig(2048, 16, 16)
    return [StagedConfig(chunk_bytes=mb << 20, buffers=b, dma_streams=d, rows=r)
            for mb, b, d, r in ((32, 3, 3, wide), (32, 3, 1, wide), (32, 2, 2, wide),
                                (32, 3, 3, narrow), (16, 3, 3, wide), (64, 3, 3, wide))]


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        return "missing"


def _pinned(nbytes: int) -> tuple[Any, str]:
    """Pinned host bytes: registered torch CPU memory (exact size), else torch's pinned allocator."""
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8)
    t.zero_()  # first touch before registering
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(rc) == 0:
        t._hicache_registered = True
        return t, "cudaHostRegister"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "torch pin_memory"


def _unpin(t: Any) -> None:
    import torch

    if getattr(t, "_hicache_registered", False):
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        t._hicache_registered = False


# ----------------------------------------------------------------------------- CPU
def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    """The torch reference path, host to host, on small data: each case and pattern of the GPU
    run that it can stand for, with the same row patterns and the same byte check."""
    import torch

    from hicache.bench.transfer_rows import Write, check, host_rows, mean_run, parse_runs
    from hicache.kernels import dispatch
    from hicache.kernels.tables import LayerTable

    L, reps, spec = min(args.layers, 4), args.reps or 3, parse_runs(args.runs)
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    note = "no CUDA device: timed the torch reference path on small data; GPU figures need a GPU"
    say(note)

    def layers(n_rows: int, rb: int) -> list:
        return [torch.randint(0, 256, (n_rows, rb), dtype=torch.uint8, generator=g)
                for _ in range(L)]

    cases = [("c4 page rows", "rows", C4_ROW, 256, 64, None, ("random", "runs")),
             ("c4 tokens (576+8 B split)", "tokens", C4_ROW, 256, 4096, TokenFormat.mla(64),
              ("random",))]
    for case, path, rb, pool, n, fmt, patterns in cases:
        units = pool * (fmt.tokens_per_page if fmt else 1)
        for seed, pattern in enumerate(patterns):
            sides = {"src": layers(pool, rb), "dst": layers(pool, rb)}
            before = {k: [t.clone().view(-1) for t in v] for k, v in sides.items()}
            si = torch.randperm(units, generator=g)[:n]
            di = host_rows(pattern, units, n, seed, spec)
            src, dst = LayerTable(sides["src"]), LayerTable(sides["dst"])
            call = (lambda: dispatch.copy_tokens(src, dst, si, di, fmt, impl="reference")) if fmt \
                else (lambda: dispatch.copy_rows(src, dst, si, di, impl="reference"))
            call()
            t0 = time.perf_counter()
            for _ in range(reps):
                call()
            secs = (time.perf_counter() - t0) / reps
            bad = check(before, lambda side, l: sides[side][l].view(-1),
                        [Write("src", "dst", si, di, rb, fmt)])
            nbytes = n * L * (fmt.token_bytes if fmt else rb)
            gbps = nbytes / secs / 1e9
            say(f"{case:<26} {pattern:<6} reference  host->host  {gbps:6.2f} GB/s  "
                 f"{'ok' if bad is None else 'WRONG: ' + bad}")
            row = {"case": case, "pattern": pattern, "mean_run_rows": round(mean_run(di), 2),
                   "path": path, "direction": "h2h", "ctas": None, "impl": "reference",
                   "gbps": round(gbps, 3), "ratio_to_limit": None, "bytes": nbytes,
                   "ms": round(secs * 1e3, 3), "correct": bad is None}
            if bad is not None:
                row["mismatch"] = bad
            rows.append(row)
    return {"machine": {"gpu": None, "torch": torch.__version__, "python": sys.version.split()[0]},
            "layers": L, "reps": reps, "runs": str(spec), "limits_gbps": {}, "rows": rows,
            "tune": [], "notes": [note]}


# ----------------------------------------------------------------------------- output
def table_lines(result: dict[str, Any]) -> list[str]:
    """The rows as a markdown table, one line per case x pattern x impl x direction (``auto``
    with the path it took): the ratio to the limit per CTA budget (``failed`` for a row that
    raised) and GB/s at 4 CTAs (GPU; ``-`` when that budget's row is missing or failed), or
    GB/s (CPU); "verified" is ok only when every budget's row passed its byte check (a row
    that raised counts as wrong)."""
    rows = result["rows"]
    budgets = sorted({r["ctas"] for r in rows if r.get("ctas") is not None})
    at = 4 if 4 in budgets else (budgets[-1] if budgets else None)
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        impl = f"{r['impl']} ({r['path_used']})" if r.get("path_used") else r["impl"]
        key = (r["case"], r.get("pattern", "-"), r.get("mean_run_rows", "-"), impl,
               r["direction"])
        groups.setdefault(key, []).append(r)
    head = ["case", "pattern", "mean run", "impl", "dir"] + [f"{b}" for b in budgets] + \
        [f"GB/s @{at}" if at else "GB/s", "verified"]
    out = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for key, rs in groups.items():
        by = {r["ctas"]: r for r in rs}
        cells = [str(k) for k in key]
        cells += ["" if b not in by else "failed" if "error" in by[b] else
                  f"{by[b]['ratio_to_limit']:.3f}" for b in budgets]
        pick = by.get(at) if at is not None else rs[0]
        cells.append("-" if pick is None or "error" in pick else f"{pick['gbps']:.2f}")
        wrong = sum(r.get("correct") is not True for r in rs)
        cells.append("ok" if not wrong else f"WRONG ({wrong} of {len(rs)})")
        out.append("| " + " | ".join(cells) + " |")
    return out


def print_table(result: dict[str, Any], file: Any = None) -> None:
    file = file or sys.stdout
    lim = result.get("limits_gbps") or {}
    if lim:
        trials = result.get("limit_trials_gbps") or {}
        print("limit (contiguous pinned copy, best of {} trials): ".format(
            len(next(iter(trials.values()), [])) or "?") +
            ", ".join(f"{k} {v:.1f} GB/s" for k, v in lim.items()), file=file)
    for line in table_lines(result):
        print(line, file=file)
    for r in result["rows"] + result.get("tune", []):
        if "error" in r or "mismatch" in r:
            print(f"failed: {r['case']} / {r.get('pattern', '-')} / {r['impl']} / "
                  f"{r['direction']} / ctas {r.get('ctas')}: {r.get('error') or r['mismatch']}",
                  file=file)
    for n in result.get("notes", []):
        print(f"note: {n}", file=file)


def plot(result: dict[str, Any], path: str) -> str:
    plt = pyplot()
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if r["ctas"] is None or r["ratio_to_limit"] is None:
            continue
        key = (r["case"], r.get("pattern", ""), r["impl"], r["direction"])
        series.setdefault(key, []).append((r["ctas"], r["ratio_to_limit"]))
    if not series:
        msg = "no GPU rows to plot (CPU run): no plot written"
        say(msg)
        return msg
    fig, axes = plt.subplots(1, 3, figsize=(18, 6), sharey=True)
    for ax, d in zip(axes, ("d2h", "h2d", "both")):
        for key, pts in series.items():
            if key[3] != d:
                continue
            pts.sort()
            ax.plot([p[0] for p in pts], [p[1] for p in pts], marker="o",
                    label=f"{key[0]} / {key[1]} / {key[2]}")
        ax.set_xscale("log", base=2)
        ax.axhline(1.0, color="grey", lw=0.8)
        ax.set_title(f"{d}: ratio to contiguous pinned copy")
        ax.set_xlabel("CTA budget")
        ax.legend(fontsize=6)
    axes[0].set_ylabel("GB/s / limit")
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    say(f"plot written to {path}")
    return path
