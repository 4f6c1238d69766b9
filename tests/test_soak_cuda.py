"""``bench soak --mix all --device cuda:0``: the daemon and the clients' device pools on the GPU
(CUDA IPC), every unit and size, every loaded byte checked (a short run; the lead's H200 runs
the 8 x 50,000 figure with the same command).

The bench runs as a subprocess whose ``PYTHONPATH`` keeps the caller's entries after this
checkout (on the GPU machine pyzmq is only reachable through one), and with a timeout well
under the device's per-call limit; any failure shows the bench's stderr (progress, the daemon
log's tail, the one-line reason)."""
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
TIMEOUT_S = 300


def bench_env() -> dict[str, str]:
    """The environment with this checkout first on PYTHONPATH, the caller's entries kept."""
    path = os.pathsep.join(p for p in (str(ROOT), os.environ.get("PYTHONPATH")) if p)
    return dict(os.environ, PYTHONPATH=path, PYTHONUNBUFFERED="1")


def test_soak_mix_all_on_the_gpu():
    cmd = [sys.executable, "-m", "hicache.cli", "bench", "soak", "--clients", "2", "--ops",
           "300", "--mix", "all", "--device", "cuda:0", "--json"]
    try:
        p = subprocess.run(cmd, cwd=str(ROOT), env=bench_env(), capture_output=True, text=True,
                           timeout=TIMEOUT_S)
    except subprocess.TimeoutExpired as e:
        err = e.stderr.decode(errors="replace") if isinstance(e.stderr, bytes) else e.stderr
        pytest.fail(f"bench soak ran past {TIMEOUT_S} s; its stderr:\n{(err or '')[-6000:]}")
    err = p.stderr[-6000:]
    assert p.stdout.strip(), f"exit status {p.returncode}, nothing on stdout; stderr:\n{err}"
    rep = json.loads(p.stdout)
    assert "error" not in rep, (rep["error"], err)
    # a 600-op run is all warm-up: its RSS figure (part of the exit status) is not judged here
    assert rep["device"] == "cuda:0" and rep["ops"] == 600, (rep, err)
    assert rep["lost_acks"] == 0 and rep["failed_ops"] == 0 and rep["refused"] == 0, (rep, err)
    assert rep["corrupted_pages"] == 0 and rep["verified_bytes"] > 0, (rep["problems"], err)
    assert rep["daemon_tracebacks"] == 0, err
    print("soak rate:", json.dumps({k: rep.get(k) for k in (
        "ops_per_s", "seconds", "client_setup_s", "client_seconds", "verified_bytes")}))


def test_every_wrong_byte_is_reported_on_the_gpu(tmp_path: Path) -> None:
    """The CPU test's fault injection (``test_soak_mix``) against a CUDA daemon and CUDA pools:
    the device-side checks count each flipped byte as one corrupted unit."""
    from conftest import start_daemon
    from hicache.bench.soak import MIX_DAEMON_ROWS
    from test_soak_mix import run_with_wrong_bytes

    d = start_daemon(tmp_path, device="cuda:0", preset="dsv4-tiny", device_rows=MIX_DAEMON_ROWS,
                     host=("--host-ratio", "4"), heartbeat_timeout=30.0, metrics=False,
                     ready_timeout=180.0)
    try:
        run_with_wrong_bytes(d.address, "cuda:0")
    finally:
        d.stop()
    assert "Traceback" not in d.output()
