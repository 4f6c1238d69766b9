"""``hicache demo --sweep-host 32GiB,64GiB,...``: dry replays across host sizes, and a plot.

For one workload and one device tier, ``run_sweep`` runs ``hicache.sim.dry.DryReplay``:
once device-only (no host tier; device rules of a full mirror, as engines run today, and of
checkpoints), then for every host size under each mirror, the host tier sized from the bytes
(``hicache.core.resume.ResumeModel.host_tier``). Each row reports resumable hit tokens (the
prefill tokens the cache saves), the gain over device-only, and cached tokens per host GiB.
``--plot FILE.png`` draws prefill tokens saved against host memory for device-only, full
mirror and checkpoints; it needs matplotlib (the optional extra ``hicache[plot]``) and is
refused up front, with that reason, when it is missing.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time
from typing import Any, Callable

from hicache.core.errors import UsageError
from hicache.core.planner import human_bytes, parse_size
from hicache.core.plotting import check_plot, pyplot
from hicache.sim.dry import DryReplay
from hicache.sim.replay import WorkerConfig
from hicache.sim.sizing import host_tier_rows

GIB = 2**30


def _sizes(text: str) -> list[int]:
    sizes = [parse_size(t, "--sweep-host") for t in text.split(",") if t.strip()]
    if not sizes or min(sizes) <= 0:
        raise UsageError(f"--sweep-host needs positive sizes, e.g. 32GiB,64GiB; got {text!r}")
    return sorted(set(sizes))


def _dry(cfg: WorkerConfig, reqs: list, host: bool = True) -> dict[str, Any]:
    d = DryReplay(cfg, host=host)
    d.run(reqs)
    return d.summary()


def sweep(cfg: WorkerConfig, reqs: list, sizes: list[int], pages_per_ckpt: int,
          progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Every figure of the sweep (see the module docstring), JSON-able; ``progress(line)``
    after each replay."""
    mirrors = ["full", "checkpoints"] if cfg.swa_mode == "paged" else ["checkpoints"]
    base = {m: _dry(dataclasses.replace(cfg, mirror=m, checkpoint_every=0 if m == "full"
                                        else cfg.checkpoint_every, host_ckpts=None),
                    reqs, host=False)["resumable_hit_tokens"] for m in mirrors}
    ref = base.get("full", base["checkpoints"])  # device-only as engines run it today
    rows = []
    for size in sizes:
        for m in mirrors:
            pages, ckpts = host_tier_rows(cfg.preset, f"{size}", cfg.swa_mode, m, pages_per_ckpt)
            if pages <= 0:
                rows.append({"host_mem": size, "mirror": m, "error": "no page fits"})
                continue
            c = dataclasses.replace(cfg, mirror=m, host_pages=pages, host_ckpts=ckpts,
                                    checkpoint_every=0 if m == "full" else cfg.checkpoint_every)
            s = _dry(c, reqs)
            if progress is not None:
                progress(f"{human_bytes(size)} {m}: {s['resumable_hit_tokens']:,} resumable hit "
                         f"tokens")
            rows.append({
                "host_mem": size, "mirror": m, "host_pages": pages, "host_checkpoint_rows": ckpts,
                "resumable_hit_tokens": s["resumable_hit_tokens"],
                "saved_vs_device_only": s["resumable_hit_tokens"] - ref,
                "prefill_tokens_saved": s["prefill_tokens_saved"],
                "unresumable_tokens": s["unresumable_tokens"],
                "host_cached_tokens": s["host_cached_tokens"],
                "cached_tokens_per_host_gib": round(s["host_cached_tokens"] * GIB / size),
                "host_bytes": s["host_bytes"], "bytes_loaded": s["bytes_loaded"],
                "checkpoints": s["checkpoints"], "seconds": s["seconds"],
            })
    return {"device_pages": cfg.device_pages, "preset": cfg.preset, "swa_mode": cfg.swa_mode,
            "pages_per_checkpoint": pages_per_ckpt, "device_only_hit_tokens": base,
            "input_tokens": sum(r.input_tokens for r in reqs), "rows": rows}


def plot(result: dict[str, Any], path: str, title: str) -> None:
    plt = pyplot()
    fig, ax = plt.subplots(figsize=(7, 4.2), dpi=90)
    sizes = sorted({r["host_mem"] for r in result["rows"]})
    x = [s / GIB for s in sizes]
    dev = result["device_only_hit_tokens"]
    ref = dev.get("full", dev["checkpoints"])
    ax.plot(x, [ref / 1e6] * len(x), "k--", label="device-only")
    for m, style in (("full", "o-"), ("checkpoints", "s-")):
        pts = {r["host_mem"]: r["resumable_hit_tokens"] for r in result["rows"]
               if r["mirror"] == m and "error" not in r}
        if pts:
            ax.plot([s / GIB for s in sorted(pts)], [pts[s] / 1e6 for s in sorted(pts)], style,
                    label=f"{m} mirror" if m == "full" else "checkpoints")
    ax.set_xscale("log", base=2)
    ax.set_xticks(x, [f"{v:g}" for v in x])
    ax.set_xlabel("host memory per GPU (GiB)")
    ax.set_ylabel("prefill tokens saved (M, resumable hits)")
    ax.set_title(title, fontsize=9)
    ax.grid(True, alpha=0.3)
    ax.legend()
    fig.tight_layout()
    fig.savefig(path)
    plt.close(fig)


def _table(result: dict[str, Any]) -> str:
    lines = [f"host-memory sweep: {result['preset']} swa={result['swa_mode']}, "
             f"{result['device_pages']:,} device pages, {result['input_tokens']:,} input tokens",
             "  device-only resumable hits: " + ", ".join(
                 f"{m} rules {v:,}" for m, v in result["device_only_hit_tokens"].items()),
             f"  {'host':>10} {'mirror':<12}{'pages':>9}{'ckpts':>7}{'hit tokens':>14}"
             f"{'vs device-only':>16}{'tokens/host GiB':>17}"]
    for r in result["rows"]:
        if "error" in r:
            lines.append(f"  {human_bytes(r['host_mem']):>10} {r['mirror']:<12} {r['error']}")
            continue
        lines.append(f"  {human_bytes(r['host_mem']):>10} {r['mirror']:<12}{r['host_pages']:>9,}"
                     f"{r['host_checkpoint_rows'] or 0:>7,}{r['resumable_hit_tokens']:>14,}"
                     f"{r['saved_vs_device_only']:>+16,}{r['cached_tokens_per_host_gib']:>17,}")
    return "\n".join(lines)


def run_sweep(args: argparse.Namespace, reqs: list, cfg: WorkerConfig, what: str) -> int:
    sizes = _sizes(args.sweep_host)
    check_plot(args.plot)  # refuse before the sweep runs
    print(f"[demo] sweeping {len(sizes)} host sizes over {what} (dry)", file=sys.stderr)
    t0 = time.monotonic()

    def progress(line: str) -> None:
        if args.progress_seconds:
            print(f"[demo] {line} ({time.monotonic() - t0:.0f} s)", file=sys.stderr, flush=True)

    result = sweep(cfg, reqs, sizes, args.pages_per_checkpoint, progress)
    result["workload"] = what
    if args.plot:
        name = os.path.basename(args.trace) if args.trace else "built-in workload"
        plot(result, args.plot, f"{name}: {len(reqs)} requests, {cfg.preset} {cfg.swa_mode} "
                                f"SWA, {cfg.device_pages:,} device pages")
        result["plot"] = args.plot
    print(json.dumps(result) if args.json else _table(result), flush=True)
    return 0
