"""``bench transfer --tune``: the launch-shape sweeps the kernels' defaults were picked from, on
the bench's GPU arenas and with its timing and byte check (every sweep row is verified too).

* the token kernel: four ``TokensConfig`` shapes x CTAs 2, 4, 8, C4 tokens, random host tokens;
* the staged path: ``staged_variants()`` x CTAs 2, 4 on C4 and SWA page rows whose host rows are
  one consecutive run (the staged path's best case).

(Row zero-copy shapes were swept before: every shape with >= 32 KiB in flight per CTA sits on
the same plateau at 4 CTAs.)
"""
from __future__ import annotations

from typing import Any

from hicache.bench.transfer_rows import RunsSpec, Write, host_rows, mean_run
from hicache.bench.transfer_support import C4_ROW, SWA_ROW, staged_variants


def tune(bench: Any) -> None:
    """Append the sweep rows to ``bench.tune`` (``bench``: transfer's ``_GpuBench``)."""
    import torch

    from hicache.kernels import staged as S, tokens as T
    from hicache.kernels.tables import TokenFormat

    dev, L = bench.dev, bench.L
    stream = torch.cuda.Stream(dev)
    fmt = TokenFormat.mla(64)
    dev_t, host_t = bench._table(False, C4_ROW), bench._table(True, C4_ROW)
    units, n = dev_t.rows * 64, 32768
    t_dev = torch.randperm(units, generator=torch.Generator().manual_seed(3))[:n]
    t_host = host_rows("random", units, n, 3, RunsSpec("fixed", 1))
    td, th = t_dev.to(dev), t_host.to(dev)
    for direction in ("d2h", "h2d"):
        d2h = direction == "d2h"
        src, dst = (dev_t, host_t) if d2h else (host_t, dev_t)
        si, dd = (td, th) if d2h else (th, td)
        w = Write("dev" if d2h else "host", "host" if d2h else "dev", si, dd, C4_ROW, fmt)
        for cfg in (T.TokensConfig(128, 16), T.TokensConfig(128, 32), T.TokensConfig(256, 32),
                    T.TokensConfig(64, 32)):
            def move_tokens(c: int, cfg: Any = cfg, src: Any = src, dst: Any = dst,
                            si: Any = si, dd: Any = dd) -> None:
                with torch.cuda.stream(stream):
                    T.launch_tokens(src.table(dev), dst.table(dev), si, dd, fmt, num_layers=L,
                                    src_stride=C4_ROW, dst_stride=C4_ROW, align=16, ctas=c,
                                    cfg=cfg)
            meta = {"case": "tune tokens c4", "pattern": "random", "mean_run_rows": 1.0,
                    "path": "tokens", "direction": direction,
                    "impl": f"zc T{cfg.tokens} w{cfg.num_warps}"}
            for ctas in (2, 4, 8):
                bench.tune.append(bench._guarded(meta, lambda: bench.measure(
                    meta, [move_tokens], [stream], [w], n * L * fmt.token_bytes, ctas)))
    for row_bytes, n in ((C4_ROW, 512), (SWA_ROW, 256)):
        dev_t, host_t = bench._table(False, row_bytes), bench._table(True, row_bytes)
        dev_idx = torch.randperm(dev_t.rows, generator=torch.Generator().manual_seed(4))[:n]
        host_idx = host_rows("runs", host_t.rows, n, 4, RunsSpec("fixed", n))
        di, runs = dev_idx.to(dev), S.plan_runs(host_idx)
        for direction in ("d2h", "h2d"):
            d2h = direction == "d2h"
            src, dst = (dev_t, host_t) if d2h else (host_t, dev_t)
            si, dd = (di, host_idx) if d2h else (host_idx, di)
            w = Write("dev" if d2h else "host", "host" if d2h else "dev", si, dd, row_bytes)
            for cfg in staged_variants():
                def move_staged(c: int, cfg: Any = cfg, src: Any = src, dst: Any = dst,
                                si: Any = si, dd: Any = dd) -> None:
                    with torch.cuda.stream(stream):
                        S.copy_rows_staged(src, dst, si, dd, host_idx, runs, ctas=c, cfg=cfg)
                r = cfg.rows
                meta = {"case": f"tune staged {row_bytes}", "pattern": "runs",
                        "mean_run_rows": mean_run(host_idx), "path": "rows",
                        "direction": direction,
                        "impl": f"staged {cfg.chunk_bytes >> 20}MBx{cfg.buffers} "
                                f"dma{cfg.dma_streams} g{r.pieces}w{r.num_warps}"}
                for ctas in (2, 4):
                    bench.tune.append(bench._guarded(meta, lambda: bench.measure(
                        meta, [move_staged], [stream], [w], n * L * row_bytes, ctas)))
