"""The CUDA runtime's sticky "last error", reset after a failed call that the caller handles.

A failed ``cudaHostRegister`` / ``cudaHostUnregister`` (through torch's cudart) leaves the
runtime's last error set; torch checks it after its next kernel launch and reports it there, as
a failure of code that did nothing wrong. Whoever makes such a call and handles its failure
clears the error right after.

Contract: ``clear_runtime_error()`` calls ``cudaGetLastError`` of every ``libcudart`` mapped in
this process (torch's own among them); best effort: when none can be called nothing happens
(logged at debug level). No CUDA context is created.
"""
from __future__ import annotations

import ctypes
import logging

log = logging.getLogger("hicache.cuda")


def clear_runtime_error() -> None:
    """See the module docstring."""
    try:
        with open("/proc/self/maps", encoding="ascii", errors="replace") as f:
            paths = {ln.split()[-1] for ln in f if "libcudart" in ln}
        for path in paths:
            ctypes.CDLL(path).cudaGetLastError()
    except (OSError, AttributeError, IndexError) as e:  # pragma: no cover - best effort
        log.debug("could not clear the CUDA runtime error: %s", e)
