"""``bench soak --mix all --device cuda:0``: the daemon and the clients' device pools on the GPU
(CUDA IPC), every unit and size, every loaded byte checked (a short run; the lead's H200 runs
the 8 x 50,000 figure with the same command)."""
from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

ROOT = Path(__file__).resolve().parents[1]


def test_soak_mix_all_on_the_gpu():
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(
        p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p))  # keep a carried pyzmq
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "soak", "--clients", "2",
                        "--ops", "300", "--mix", "all", "--device", "cuda:0", "--json"],
                       cwd=str(ROOT), env=env, capture_output=True, text=True, timeout=600)
    assert p.stdout.strip(), f"no report (exit {p.returncode}): {p.stderr[-3000:]}"
    rep = json.loads(p.stdout)
    assert rep["device"] == "cuda:0" and rep["ops"] == 600, (rep, p.stderr[-3000:])
    assert rep["lost_acks"] == 0 and rep["failed_ops"] == 0 and rep["refused"] == 0, rep
    assert rep["corrupted_pages"] == 0 and rep["verified_bytes"] > 0, rep["problems"]
    assert rep["daemon_tracebacks"] == 0
