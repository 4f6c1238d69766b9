"""Whether Triton kernels may run a persistent grid here (loops with runtime bounds).

``runtime_loops() -> bool``: always True on a GPU. Under ``TRITON_INTERPRET=1`` some
Triton/NumPy pairs cannot loop with runtime bounds; then launchers run one step per program
(same step code, no CTA budget). Probed once per process.
"""
from __future__ import annotations

import functools
import os

import torch
import triton
import triton.language as tl


@functools.lru_cache(maxsize=None)
def runtime_loops() -> bool:
    """Whether kernels may loop with runtime bounds (the persistent grid). Always on a GPU;
    under TRITON_INTERPRET some Triton/NumPy pairs (3.6 with NumPy 2.x) cannot, and then the
    launchers fall back to one step per program (same step code, no CTA budget)."""
    if os.environ.get("TRITON_INTERPRET", "0") in ("", "0"):
        return True
    try:
        out = torch.zeros(4, dtype=torch.int32)
        _probe_loop[(2,)](out, 4)
        return out.tolist() == [1, 1, 1, 1]
    except Exception:
        return False


@triton.jit
def _probe_loop(out, n):
    for i in range(tl.program_id(0), n, tl.num_programs(0)):
        tl.store(out + i, 1)
