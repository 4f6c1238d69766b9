"""The daemon's malloc policy: large temporaries go back to the OS when freed.

glibc raises its mmap threshold each time a mapped block is freed (up to 32 MiB), after which
blocks of that size come from the heap and stay resident once freed. A daemon that runs for
weeks and sometimes allocates tens of MiB for a copy (CPU mode) then shows RSS steps of that
size that never come back, which hides real leaks in the RSS figures (the soak's < 1 % check
saw +25 MiB steps come and go on a 1.9 GiB daemon).

A fixed mmap threshold also turns off glibc's dynamic trim threshold, which then stays at its
128 KiB default: every command that freed a block between 128 KiB and the mmap threshold at the
top of the heap gave those pages back, and the next command faulted them in again. On the H200
host a 128k-token load's 3.8 MB temporary cost 965 page faults per command that way, about
20,000 per ``bench e2e`` run in all (docs/perf.md, thirty-second session). So the trim threshold
is fixed too, at ``TRIM_THRESHOLD``: up to that much free heap stays resident between commands.

Contract: ``fix_mmap_threshold(nbytes=MMAP_THRESHOLD, trim=TRIM_THRESHOLD) -> str`` sets glibc's
``M_MMAP_THRESHOLD`` to a fixed ``nbytes`` (which also turns the dynamic adjustment off), so
every block of that size or more is mapped on its own and unmapped when freed, and
``M_TRIM_THRESHOLD`` to ``trim``, so freed heap below that much at the top is kept. Returns a
line saying what was done (``hicache serve`` prints it after its start-up summary); on a C
library without ``mallopt`` (or one that refuses it) nothing changes and the line says so. The
pool itself is mapped by the arena, never by malloc.
"""
from __future__ import annotations

import ctypes

M_TRIM_THRESHOLD, M_MMAP_THRESHOLD = -1, -3  # glibc's mallopt parameter numbers
MMAP_THRESHOLD = 4 << 20  # blocks of 4 MiB or more: mapped alone, unmapped when freed
# free heap kept at its top between commands (glibc's own pairing for a 4 MiB threshold would be
# 8 MiB); a 128k-token load's temporaries below the mmap threshold fit in it, so they do not
# fault in afresh on every command
TRIM_THRESHOLD = 16 << 20


def fix_mmap_threshold(nbytes: int = MMAP_THRESHOLD, trim: int = TRIM_THRESHOLD) -> str:
    """See the module docstring."""
    try:
        mallopt = ctypes.CDLL(None).mallopt
    except (OSError, AttributeError):
        return "malloc: no mallopt in this C library; its defaults stay"
    mallopt.argtypes, mallopt.restype = [ctypes.c_int, ctypes.c_int], ctypes.c_int
    if mallopt(M_MMAP_THRESHOLD, nbytes) != 1:
        return "malloc: mallopt(M_MMAP_THRESHOLD) was refused; the defaults stay"
    if mallopt(M_TRIM_THRESHOLD, trim) != 1:
        return (f"malloc: blocks of {nbytes >> 20} MiB or more are unmapped when freed; "
                f"mallopt(M_TRIM_THRESHOLD) was refused, so freed heap over 128 KiB goes back "
                f"at once")
    return (f"malloc: blocks of {nbytes >> 20} MiB or more are unmapped when freed; up to "
            f"{trim >> 20} MiB of freed heap stays for the next command")
