"""The daemon's malloc policy: large temporaries go back to the OS when freed.

glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which
blocks of that size come from the heap and stay resident once freed. A daemon that runs for
weeks and sometimes allocates tens of MiB for a copy (CPU mode) then shows RSS steps of that
size that never come back, which hides real leaks in the RSS figures (the soak's < 1 % check
saw +25 MiB steps come and go on a 1.9 GiB daemon).

Contract: ``fix_mmap_threshold(nbytes=MMAP_THRESHOLD) -> str`` sets glibc's
``M_MMAP_THRESHOLD`` to a fixed ``nbytes`` (which also turns the dynamic adjustment off), so
every block of that size or more is mapped on its own and unmapped when freed. Returns a line
saying what was done (``hicache serve`` prints it after its start-up summary); on a C library
without ``mallopt`` (or one that refuses it) nothing changes and the line says so. The pool
itself is mapped by the arena, never by malloc.
"""
from __future__ import annotations

import ctypes

M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number
MMAP_THRESHOLD = 4 << 20  # blocks of 4 MiB or more: mapped alone, unmapped when freed


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD) -> str:
    """See the module docstring."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc: no mallopt in this C library; its defaults stay"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        return "malloc: mallopt(M_MMAP_THRESHOLD) was refused; the defaults stay"
    return f"malloc: blocks of {nbytes >> 20} MiB or more are unmapped when freed"
