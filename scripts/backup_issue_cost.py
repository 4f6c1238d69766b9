"""What a backup's issue costs the thread that issues it (GPU): the host time of one backup of
every DSV4-Flash pool, device rows to pinned host rows, through ``dispatch.copy_rows`` /
``copy_tokens`` as the daemon's ``issue_gpu`` calls them (token pools by token, whole pages).

    PYTHONPATH=. python scripts/backup_issue_cost.py [--pages 1,8,32] [--reps 30] [--queued 24]
        [--path rows|batch|by_layer[,...]]

* Per size: host time of the issue (the GPU idle before each), the first one (first uses; with
  several ``--path`` values only the first path's first issue is cold) and
  the median and slowest of the rest, in µs; ``done_us``: the median time from the issue's
  start to the GPU's end of the copies, and ``gbps``, the bytes moved over it (a token pool's
  tokens' values and scales, not its rows' padding).
* ``--path``: ``batch`` (the default) issues pool by pool into one ``dispatch.KernelBatch`` (one
  id upload for the kernel copies: what the daemon's ``issue_gpu`` does); ``rows`` pool by pool,
  each copy uploading its own ids (the daemon before the sixty-ninth session); ``by_layer`` the
  same copies issued as a load's are (``dispatch.issue_by_layer``, all pools in one plan: layer
  0, then the other layers as one launch group). Several, comma-separated, alternate backup by
  backup in one process (the order turned each time), one line per size and path: an A/B that
  the host's drift from run to run (700 to 1,250 µs for one backup in the sixty-seventh
  session) does not blur.
* ``queued`` (the first ``--path``): that many one-page backups issued back to back behind a
  200 ms sleep on the same stream, so their index uploads' staging buffers stay busy: host time
  per backup (median, slowest) and in all, then how long the GPU took to finish after the last
  issue.
* ``--profile 1,512`` (the first ``--path``): per size, ``cProfile`` over 10 backups of it
  (after the timed ones), the 15 functions of most own time: calls and own µs per backup
  (where an issue's host time goes).

Runs in process, without a daemon: it measures the copy path's issue alone, so two trees can be
compared with ``PYTHONPATH`` (run it from this tree on another's ``hicache``). One JSON object
per line on stdout.
"""
from __future__ import annotations

import argparse
import cProfile
import json
import pstats
import statistics
import sys
import time
from pathlib import Path

try:
    import hicache  # noqa: F401 - the tree PYTHONPATH names, when it names one
except ImportError:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.kernels import dispatch  # noqa: E402
from hicache.kernels.tables import LayerTable, TokenFormat  # noqa: E402

Pool = tuple[str, LayerTable, LayerTable, "TokenFormat | None", list[int]]


def _pools(rows: int, device: torch.device) -> list[Pool]:
    out: list[Pool] = []
    for name, spec in build_layout(preset("dsv4-flash")).pools.items():
        n = len(spec.layers)
        dev = LayerTable([torch.randint(0, 255, (rows, spec.page_bytes), dtype=torch.uint8,
                                        device=device) for _ in range(n)], "device:" + name)
        host = LayerTable([torch.zeros(rows, spec.page_bytes, dtype=torch.uint8).pin_memory()
                           for _ in range(n)], "host:" + name)
        out.append((name, dev, host, TokenFormat.from_spec(spec) if spec.token_granular
                    else None, list(spec.layers)))
    return out


def _ids(n: int, rows: int, fmt: TokenFormat | None, g: torch.Generator
         ) -> tuple[torch.Tensor, torch.Tensor]:
    perm = torch.randperm(rows, generator=g)
    a, b = perm[:n], perm[n:2 * n]
    if fmt is None:
        return a.clone(), b.clone()
    per = torch.arange(fmt.tokens_per_page)
    return ((a[:, None] * fmt.tokens_per_page + per).flatten(),
            (b[:, None] * fmt.tokens_per_page + per).flatten())


def _page_bytes(dev: LayerTable, fmt: TokenFormat | None) -> int:
    """Bytes one page of a pool moves: its row, or for a token pool its tokens' values and
    scales (a token copy moves no padding)."""
    return dev.row_bytes if fmt is None else fmt.tokens_per_page * fmt.token_bytes


PATHS = ("rows", "batch", "by_layer")


def _issue(pools: list[Pool], ids: list, stream: torch.cuda.Stream, path: str = "batch") -> float:
    t0 = time.perf_counter()
    if path == "by_layer":
        memo: dict = {}
        parts = [p for (_, dev, host, fmt, layers), (a, b) in zip(pools, ids)
                 for p in dispatch.layer_parts(dev, host, a.numpy(), b.numpy(), fmt, layers, memo)]
        order = sorted({g for *_, layers in pools for g in layers})
        for _ in dispatch.issue_by_layer(parts, order, device=stream.device, stream=stream,
                                         fine=False):
            pass
        return time.perf_counter() - t0
    batch = dispatch.KernelBatch() if path == "batch" else None
    for (_, dev, host, fmt, _layers), (a, b) in zip(pools, ids):
        if fmt is None:
            dispatch.copy_rows(dev, host, a, b, stream=stream, batch=batch)
        else:
            dispatch.copy_tokens(dev, host, a, b, fmt, stream=stream, batch=batch)
    if batch is not None:
        batch.flush()
    return time.perf_counter() - t0


def _profile(pools: list[Pool], n: int, rows: int, g: torch.Generator,
             stream: torch.cuda.Stream, path: str, reps: int = 10, top: int = 15) -> None:
    """Print where the host time of ``reps`` backups of ``n`` pages goes: one JSON line per
    function of the ``top`` by own time, per backup."""
    prof = cProfile.Profile()
    for _ in range(reps):
        ids = [_ids(n, rows, fmt, g) for _n, _d, _h, fmt, _l in pools]
        torch.cuda.synchronize()
        prof.enable()
        _issue(pools, ids, stream, path)
        prof.disable()
    torch.cuda.synchronize()
    stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
    rows_out = sorted(stats.items(), key=lambda kv: -kv[1][2])[:top]
    for (file, line, fn), (_cc, nc, tt, ct, _callers) in rows_out:
        print(json.dumps({"profile_pages": n, "fn": f"{Path(file).name}:{line}:{fn}",
                          "calls": round(nc / reps, 1), "own_us": round(tt / reps * 1e6),
                          "cum_us": round(ct / reps * 1e6)}), flush=True)


def _sleep_cycles(ms: float, device: torch.device) -> int:
    props = torch.cuda.get_device_properties(device)
    return int(ms * getattr(props, "clock_rate", 1_980_000))  # kHz: cycles per ms


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pages", default="1,8,32", help="backup sizes in pages")
    p.add_argument("--reps", type=int, default=30, help="backups per size")
    p.add_argument("--queued", type=int, default=24, help="one-page backups behind a sleep")
    p.add_argument("--profile", default="", help="sizes in pages to profile (cProfile)")
    p.add_argument("--path", default="batch",
                   help="rows, batch or by_layer, or several comma-separated (alternated)")
    a = p.parse_args(argv)
    paths = a.path.split(",")
    for path in paths:
        if path not in PATHS:
            p.error(f"--path: {path!r} is not one of {', '.join(PATHS)}")
    if not torch.cuda.is_available():
        print("backup_issue_cost: needs a CUDA GPU", file=sys.stderr)
        return 2
    device = torch.device("cuda:0")
    torch.cuda.set_device(device)
    pages = [int(x) for x in a.pages.split(",")]
    profiled = [int(x) for x in a.profile.split(",") if x]
    rows = 2 * max(pages + profiled) + 8
    pools = _pools(rows, device)
    stream = torch.cuda.Stream(device)
    g = torch.Generator().manual_seed(1)
    for n in pages:
        times: dict[str, list[float]] = {path: [] for path in paths}
        done: dict[str, list[float]] = {path: [] for path in paths}
        for rep in range(a.reps):
            for path in (paths if rep % 2 == 0 else paths[::-1]):
                ids = [_ids(n, rows, fmt, g) for _n, _d, _h, fmt, _l in pools]
                torch.cuda.synchronize()
                t0 = time.perf_counter()
                times[path].append(_issue(pools, ids, stream, path))
                stream.synchronize()
                done[path].append(time.perf_counter() - t0)
        nbytes = n * sum(_page_bytes(dev, fmt) * dev.num_layers for _, dev, _h, fmt, _l in pools)
        for path in paths:
            rest, done_rest = times[path][1:] or times[path], done[path][1:] or done[path]
            print(json.dumps({"pages": n, "path": path, "first_us": round(times[path][0] * 1e6),
                              "median_us": round(statistics.median(rest) * 1e6),
                              "max_us": round(max(rest) * 1e6),
                              "done_us": round(statistics.median(done_rest) * 1e6),
                              "gbps": round(nbytes / statistics.median(done_rest) / 1e9, 2)}),
                  flush=True)
    if a.queued:
        torch.cuda.synchronize()
        with torch.cuda.stream(stream):
            torch.cuda._sleep(_sleep_cycles(200, device))
        times = [_issue(pools, [_ids(1, rows, fmt, g) for _n, _d, _h, fmt, _l in pools], stream,
                        paths[0]) for _ in range(a.queued)]
        t0 = time.perf_counter()
        torch.cuda.synchronize()
        print(json.dumps({"queued": a.queued, "median_us": round(statistics.median(times) * 1e6),
                          "max_us": round(max(times) * 1e6),
                          "sum_ms": round(sum(times) * 1e3, 2),
                          "gpu_after_ms": round((time.perf_counter() - t0) * 1e3, 1)}),
              flush=True)
    for n in profiled:
        _profile(pools, n, rows, g, stream, paths[0])
    return 0


if __name__ == "__main__":
    sys.exit(main())
