"""``hicache demo --hisparse`` end to end on CPU: the torch reference and the Triton kernel
under the interpreter, every top-k location verified."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _demo(*args: str) -> subprocess.CompletedProcess:
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    env.pop("TRITON_INTERPRET", None)
    return subprocess.run([sys.executable, "-m", "hicache.cli", "demo", "--hisparse", "--device",
                           "cpu", "--json", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=240)


@pytest.mark.parametrize("impl, steps", [("reference", "12"), ("triton", "4")])
def test_hisparse_demo_verified(impl, steps):
    p = _demo("--hisparse-impl", impl, "--hisparse-steps", steps)
    assert p.returncode == 0, p.stderr[-3000:]
    s = json.loads(p.stdout)
    assert s["verified"] and s["impl"] == impl
    assert s["checked_locations"] == s["lookups"] > 0
    assert 0 < s["tokens_swapped_in"] < s["lookups"]
    assert s["bytes_swapped_in"] == 584 * s["tokens_swapped_in"]
    assert s["sparse_requests_at_end"] >= 1


def test_hisparse_demo_refuses_a_trace():
    p = _demo("--trace", "x.jsonl")
    assert p.returncode == 2 and "--trace does not apply" in p.stderr


def test_hisparse_demo_refuses_a_topk_below_two():
    p = _demo("--hisparse-topk", "1")
    assert p.returncode == 2 and "--hisparse-topk must be at least 2" in p.stderr, p.stderr
    assert "Traceback" not in p.stderr
