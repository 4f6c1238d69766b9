"""``hicache bench e2e``: its arguments (CPU) and one functional run in CPU mode (a real daemon,
shared-memory device pools, churned host allocator, every loaded byte verified)."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from hicache.bench import e2e
from hicache.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _args(**kw):
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_sizes_and_arguments_are_checked():
    assert e2e.parse_sizes("2k, 32k") == ["2k", "32k"]
    with pytest.raises(UsageError, match="unknown size"):
        e2e.parse_sizes("3k")
    with pytest.raises(UsageError, match="--runs"):
        e2e.check_args(_args(device="cpu", runs=0))
    with pytest.raises(UsageError, match="--churn"):
        e2e.check_args(_args(device="cpu", churn=-1))
    with pytest.raises(UsageError, match="cuda:N or cpu"):
        e2e.check_args(_args(device="tpu"))
    with pytest.raises(UsageError, match="--pp-rank 2 is outside 0..1"):
        e2e.check_args(_args(device="cpu", pp_size=2, pp_rank=2))
    with pytest.raises(UsageError, match="--gpus must be at least 1"):
        e2e.check_args(_args(device="cpu", gpus=0))
    if torch.cuda.device_count() < 64:
        with pytest.raises(UsageError, match="--gpus 64 needs 64 CUDA GPUs"):
            e2e.check_args(_args(device="cuda:0", gpus=64))
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="needs a CUDA GPU"):
            e2e.check_args(_args(device="cuda:0"))


def test_functional_run_on_cpu_verifies_every_loaded_byte():
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "e2e", "--device", "cpu",
                        "--preset", "dsv4-tiny", "--sizes", "2k", "--runs", "2", "--churn",
                        "60", "--json"], capture_output=True, text=True, timeout=300, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    m = out["sizes"]["2k"]["summary"]
    assert m["verified"] is True and m["pages"] == 8 and m["bytes"] > 0
    assert m["load_gbps"] > 0 and m["backup_gbps"] > 0
    assert len(out["sizes"]["2k"]["runs"]["load_last"]) == 2
