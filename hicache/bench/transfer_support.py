"""What ``bench transfer`` needs beside its GPU cases: pinned buffers (exact-size registered
memory, torch's allocator as the fallback), the peer's and Triton's names, the CPU run (the torch
reference path on small data, when there is no GPU), the table and the GB/s-per-budget plot.
"""
from __future__ import annotations

from hicache.bench.plotting import pyplot

import argparse
import sys
import time
from typing import Any

from hicache.kernels.tables import TokenFormat

C4_ROW = 37_440  # a C4 page row of the DSV4 MLA format (64 tokens)


def _log(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)


def staged_variants() -> list:
    """The staged-path shapes ``--tune`` sweeps (keywords: the config gained fields)."""
    from hicache.kernels.rows import RowsConfig
    from hicache.kernels.staged import StagedConfig

    wide, narrow = RowsConfig(2048, 64, 32), RowsConfig(2048, 16, 16)
    return [StagedConfig(chunk_bytes=mb << 20, buffers=b, dma_streams=d, rows=r)
            for mb, b, d, r in ((32, 3, 3, wide), (32, 3, 1, wide), (32, 2, 2, wide),
                                (32, 3, 3, narrow), (16, 3, 3, wide), (64, 3, 3, wide))]


def peer_name() -> str:
    return "sglang-0.4.6"


def _triton_version() -> str:
    try:
        import triton
        return triton.__version__
    except Exception:  # pragma: no cover - triton is a dependency
        return "missing"


def _pinned(nbytes: int):
    """Pinned host bytes: registered torch CPU memory (exact size), else torch's pinned allocator."""
    import torch

    t = torch.empty(nbytes, dtype=torch.uint8)
    t.zero_()  # first touch before registering
    rc = torch.cuda.cudart().cudaHostRegister(t.data_ptr(), nbytes, 0)
    if int(rc) == 0:
        t._hicache_registered = True
        return t, "cudaHostRegister"
    return torch.empty(nbytes, dtype=torch.uint8, pin_memory=True), "torch pin_memory"


def _unpin(t) -> None:
    import torch

    if getattr(t, "_hicache_registered", False):
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaHostUnregister(t.data_ptr())
        t._hicache_registered = False


# ----------------------------------------------------------------------------- CPU
def cpu_bench(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from hicache.kernels import dispatch
    from hicache.kernels.tables import LayerTable, TokenFormat

    L = min(args.layers, 4)
    rows: list[dict[str, Any]] = []
    g = torch.Generator().manual_seed(0)
    note = "no CUDA device: timed the torch reference path on small data; GPU figures need a GPU"
    _log(note)

    def layers(n_rows: int, rb: int) -> LayerTable:
        return LayerTable([torch.randint(0, 256, (n_rows, rb), dtype=torch.uint8, generator=g)
                           for _ in range(L)])

    cases = [("c4 page rows", "rows", C4_ROW, 256, 64, None),
             ("c4 tokens (576+8 B split)", "tokens", C4_ROW, 256, 4096, TokenFormat.mla(64))]
    for case, path, rb, pool, n, fmt in cases:
        src, dst = layers(pool, rb), layers(pool, rb)
        units = pool * (fmt.tokens_per_page if fmt else 1)
        si, di = torch.randperm(units, generator=g)[:n], torch.randperm(units, generator=g)[:n]
        call = (lambda: dispatch.copy_tokens(src, dst, si, di, fmt, impl="reference")) if fmt else \
            (lambda: dispatch.copy_rows(src, dst, si, di, impl="reference"))
        call()
        t0 = time.perf_counter()
        reps = 3
        for _ in range(reps):
            call()
        secs = (time.perf_counter() - t0) / reps
        if fmt:
            from hicache.kernels.reference import _token_views
            ok = all(torch.equal(_token_views(s, fmt)[k][si // 64, si % 64],
                                 _token_views(d, fmt)[k][di // 64, di % 64])
                     for s, d in zip(src.layers, dst.layers) for k in (0, 1))
        else:
            ok = all(torch.equal(s[si], d[di]) for s, d in zip(src.layers, dst.layers))
        nbytes = n * L * (fmt.token_bytes if fmt else rb)
        gbps = nbytes / secs / 1e9
        _log(f"{case:<28} reference  host->host  {gbps:6.2f} GB/s  {'ok' if ok else 'WRONG'}")
        rows.append({"case": case, "path": path, "direction": "h2h", "ctas": None,
                     "impl": "reference", "gbps": round(gbps, 3), "ratio_to_limit": None,
                     "bytes": nbytes, "ms": round(secs * 1e3, 3), "correct": ok})
    return {"machine": {"gpu": None, "torch": torch.__version__, "python": sys.version.split()[0]},
            "layers": L, "limits_gbps": {}, "rows": rows, "tune": [], "notes": [note]}


# ----------------------------------------------------------------------------- output
def print_table(result: dict[str, Any]) -> None:
    lim = result.get("limits_gbps") or {}
    if lim:
        print(f"limit (contiguous pinned copy): H2D {lim['h2d']:.1f}  D2H {lim['d2h']:.1f}  "
              f"both {lim['both']:.1f} GB/s")
    print(f"{'case':<28} {'host rows':<9} {'impl':<14} {'dir':<4} {'ctas':>5} {'GB/s':>7} "
          f"{'x limit':>8}  check")
    for r in result["rows"]:
        ratio = "" if r["ratio_to_limit"] is None else f"{r['ratio_to_limit']:.3f}"
        ok = {True: "ok", False: "WRONG", None: "-"}[r.get("correct")]
        print(f"{r['case']:<28} {r.get('host_rows', '-'):<9} {r['impl']:<14} {r['direction']:<4} "
              f"{r['ctas']!s:>5} {r['gbps']:7.2f} {ratio:>8}  {ok}")
    for n in result.get("notes", []):
        print(f"note: {n}")


def plot(result: dict[str, Any], path: str) -> str:
    plt = pyplot()
    if plt is None:
        msg = "matplotlib is not installed: no plot written"
        _log(msg)
        return msg
    series: dict[tuple, list[tuple[int, float]]] = {}
    for r in result["rows"]:
        if r["ctas"] is None or r["ratio_to_limit"] is None:
            continue
        key = (r["case"], r.get("host_rows", ""), r["impl"], r["direction"])
        series.setdefault(key, []).append((r["ctas"], r["ratio_to_limit"]))
    if not series:
        msg = "no GPU rows to plot (CPU run): no plot written"
        _log(msg)
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
    _log(f"plot written to {path}")
    return path
