"""``hicache bench hisparse`` on CPU: the reference path on small shapes, verified, and refused
arguments (the GPU figures come from the H200 run in docs/hisparse.md)."""
from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _bench(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT), CUDA_VISIBLE_DEVICES="")
    return subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "hisparse", *args],
                          cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=180)


def test_cpu_run_is_verified_and_says_what_it_is():
    p = _bench("--batches", "2", "--overlaps", "0.5,0.95", "--steps", "1", "--warmup", "1",
               "--configs", "32x8", "--json")
    assert p.returncode == 0, p.stderr[-2000:]
    d = json.loads(p.stdout)
    assert [r["overlap"] for r in d["rows"]] == [0.5, 0.95]
    assert all(r["config"] == "32x8" and r["issue_us_per_layer_jit"] is None for r in d["rows"])
    assert all(r["verified"] and r["ctas"] == 2 and r["tokens_per_step"] > 0 for r in d["rows"])
    assert d["rows"][0]["tokens_per_step"] > d["rows"][1]["tokens_per_step"]
    assert d["limit_h2d_gbps"] is None and "no CUDA device" in d["notes"][0]
    full, hot = d["device_bytes_per_request"]["full_c4_on_device"], d["device_bytes_per_request"]["hot_buffer"]
    assert full > hot > 0


@pytest.mark.parametrize("args, msg", [(("--overlaps", "1.5"), "in [0, 1]"),
                                       (("--batches", "0"), "positive"),
                                       (("--steps", "0"), "--steps must be positive"),
                                       (("--configs", "32x6"), "powers of two"),
                                       (("--configs", "fast"), "TOKENSxWARPS"),
                                       (("--read-sweep",), "needs a CUDA device"),
                                       (("--tokens", "3"), "--tokens must be at least 4"),
                                       (("--slots", "4", "--topk", "8"),
                                        "--slots (4) must be at least --topk (8)")])
def test_bad_arguments(args, msg):
    p = _bench(*args)
    assert p.returncode == 2 and msg in p.stderr, p.stderr


def test_the_token_read_probe_checks_every_device_byte():
    """``hisparse_limits._check`` (run after each timed GPU probe) passes the reference copy
    of the tokens into zeroed rows, and refuses one flipped byte, in a copied token or not."""
    import torch

    from hicache.bench.hisparse_limits import _check
    from hicache.kernels.reference import copy_tokens_ref
    from hicache.kernels.tables import LayerTable, TokenFormat

    fmt = TokenFormat.mla(64)
    g = torch.Generator().manual_seed(0)
    host = LayerTable([torch.randint(0, 256, (8, fmt.page_bytes), dtype=torch.uint8, generator=g)
                       for _ in range(2)], "host")
    dev = LayerTable([torch.zeros(4, fmt.page_bytes, dtype=torch.uint8) for _ in range(2)],
                     "device")
    src, dst = torch.randperm(512, generator=g)[:128], torch.randperm(256, generator=g)[:128]
    copy_tokens_ref(host.layers, dev.layers, src, dst, fmt)
    _check(host, dev, src, dst, fmt)
    for row, byte in ((int(dst[0]) // 64, (int(dst[0]) % 64) * 576), (3, fmt.page_bytes - 1)):
        dev.layers[1][row, byte] ^= 1
        with pytest.raises(RuntimeError, match="layer 1"):
            _check(host, dev, src, dst, fmt)
        dev.layers[1][row, byte] ^= 1
    _check(host, dev, src, dst, fmt)


@pytest.mark.skipif(importlib.util.find_spec("matplotlib") is not None,
                    reason="matplotlib is installed: --plot applies")
def test_plot_without_matplotlib_is_refused_before_the_run():
    p = _bench("--plot", "x.png", "--batches", "2")
    assert p.returncode == 2 and "--plot needs matplotlib" in p.stderr, p.stderr
    assert "batch" not in p.stderr  # refused before any row ran
