"""docs/integration.md's runnable example: an engine registers buffers it allocated itself,
backs a page up and loads it back, every byte checked (CPU here; the CUDA variant on a GPU)."""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "register_engine_buffers.py"


def _run(device: str) -> None:
    p = subprocess.run([sys.executable, str(EXAMPLE), "--device", device], cwd=str(ROOT),
                       capture_output=True, text=True, timeout=180)
    assert p.returncode == 0 and "verified" in p.stdout, (p.stdout, p.stderr[-3000:])
    assert "Traceback" not in p.stderr


def test_engine_owned_buffers_cpu():
    _run("cpu")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_engine_owned_buffers_cuda():
    _run("cuda:0")
