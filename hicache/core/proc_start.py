"""When a process started, as the kernel counts it: to tell one process from another.

Contract: ``process_start(pid)`` is the start time of live process ``pid`` in clock ticks
after boot (field 22 of ``/proc/<pid>/stat``), or None when no such process is visible here or
it has exited (a zombie). The figure is the kernel's, so it is the same from every pid
namespace: a process that reports its own (``own_start()``) can be found by another that sees
it under some pid, and a pid that names an unrelated process here (another namespace's number,
or a pid reused after the first process exited) shows a different start.
"""
from __future__ import annotations

import functools
import os


def process_start(pid: int | None) -> int | None:
    """Start time (clock ticks after boot) of live process ``pid``; None when there is no such
    process here (or it is a zombie)."""
    if not pid:
        return None
    try:
        with open(f"/proc/{int(pid)}/stat", "rb") as f:
            fields = f.read().rsplit(b")", 1)[1].split()
    except (OSError, IndexError, ValueError):
        return None
    if fields[0] in (b"Z", b"X"):  # exited, not yet reaped by its parent
        return None
    return int(fields[19])


@functools.lru_cache(maxsize=1)
def _start_of(pid: int) -> int | None:
    return process_start(pid)


def own_start() -> int | None:
    """This process's start time (read once per pid: a forked child reads its own)."""
    return _start_of(os.getpid())
