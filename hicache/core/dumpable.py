"""Whether other processes of the daemon's uid may read its memory and descriptors.

A Linux process is "dumpable" by default: any process of its uid may ptrace it, read its memory
(``/proc/<pid>/mem``) and open its descriptors (``/proc/<pid>/fd/<n>``). For the daemon that
is every client's host-tier bytes and every sealed memfd it made for one client. Made
non-dumpable, only a process with ``CAP_SYS_PTRACE`` (root, as a rule) can do either; the
daemon then also writes no core file.

Contract: ``set_dumpable(on)`` sets the flag for this process (``prctl(PR_SET_DUMPABLE)``;
an ``OSError`` when the kernel refuses); ``is_dumpable()`` reads it back. Linux only (the
daemon needs memfds anyway).
"""
from __future__ import annotations

import ctypes
import os

_PR_GET_DUMPABLE, _PR_SET_DUMPABLE = 3, 4


def _prctl(*args: int) -> int:
    libc = ctypes.CDLL(None, use_errno=True)
    rc = int(libc.prctl(*(ctypes.c_ulong(a) for a in (*args, 0, 0, 0, 0)[:5])))
    if rc < 0:
        e = ctypes.get_errno()
        raise OSError(e, f"prctl({args[0]}): {os.strerror(e)}")
    return rc


def set_dumpable(on: bool) -> None:
    _prctl(_PR_SET_DUMPABLE, 1 if on else 0)


def is_dumpable() -> bool:
    return _prctl(_PR_GET_DUMPABLE) == 1
