"""How this process shares its GPU with the others on it: through MPS, or by time slices.

Contract: ``gpu_sharing(index) -> (mode, why)``: ``mode`` is ``"mps"`` when the CUDA driver says
contexts this process makes on GPU ``index`` are shared through MPS
(``CU_DEVICE_ATTRIBUTE_MPS_ENABLED``), ``"time-slices"`` when it says they are not, and
``"unknown"`` when it cannot tell (no CUDA in this process, a driver without the attribute);
``why`` is a phrase for an operator (what it means, or why it is unknown). Asked once per GPU.

Why it matters: the engine and the daemon are two processes with a CUDA context each. Without
MPS the GPU runs one context's kernels at a time, switching at time-slice ends, so while a
kernel of the daemon runs, a kernel of the engine may wait for the slice to end: on an H200 the
engine's smallest step waited up to 2.4 ms while the daemon moved KV, and at nearly every step
of a checkpoints-mirror load of 32k or more, where MPS kept it under 0.8 ms (one run 1.2 ms)
with the same transfer rates (docs/perf.md, twenty-third session). ``hicache serve`` prints
the mode at start and reports it in ``stats``; ``bench e2e`` records the engine's and the
daemon's.
"""
from __future__ import annotations

import ctypes
from typing import Optional

import torch

_MPS_ENABLED = 133  # CU_DEVICE_ATTRIBUTE_MPS_ENABLED (a driver that predates it refuses it)
_SEEN: dict[int, tuple[str, str]] = {}

WHY = {
    "mps": "MPS: the engine's and the daemon's kernels run at once",
    "time-slices": "time slices (no MPS): an engine kernel may wait up to a slice (~2.4 ms on "
                   "an H200) while a daemon kernel runs; run both under MPS "
                   "(docs/config.md, \"Sharing the GPU with the engine\")",
}


def gpu_sharing(index: Optional[int]) -> tuple[str, str]:
    if index is None or not torch.cuda.is_available():
        return "unknown", "no CUDA GPU in this process"
    got = _SEEN.get(index)
    if got is None:
        got = _SEEN[index] = _ask(index)
    return got


def _ask(index: int) -> tuple[str, str]:
    try:
        torch.cuda.init()  # the driver is initialised before it is asked
    except RuntimeError as e:
        return "unknown", f"CUDA could not be initialised ({e})"
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        return "unknown", f"the CUDA driver library could not be loaded ({e})"
    dev, value = ctypes.c_int(0), ctypes.c_int(0)
    rc = lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(index))
    if rc == 0:
        rc = lib.cuDeviceGetAttribute(ctypes.byref(value), ctypes.c_int(_MPS_ENABLED), dev)
    if rc != 0:
        return "unknown", f"the CUDA driver does not report it (CUresult {rc})"
    mode = "mps" if value.value else "time-slices"
    return mode, WHY[mode]
