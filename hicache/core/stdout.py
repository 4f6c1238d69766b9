"""Writing a command's output when its reader may go away (``hicache plan | head``).

Contract: ``broken_pipe()`` points stdout at /dev/null (so the interpreter's final flush does
not fail again) and returns 141, the exit status SIGPIPE's default action gives, for the
caller to exit with; ``print_all(text)`` prints ``text`` and returns 0, or, when the reader
went away first, ``broken_pipe()``'s 141, never a traceback. ``open_std_fds()`` (a command's
first step) opens /dev/null on any of descriptors 0-2 a supervisor left closed, and gives
Python a ``sys.stdin`` / ``sys.stdout`` / ``sys.stderr`` for each it set to None: else every
exit path ended in a traceback, and the next file the process opened (the daemon's lock
file) became its stdout, where a native library's prints would land.
"""
from __future__ import annotations

import os
import sys


def broken_pipe() -> int:
    try:
        devnull = os.open(os.devnull, os.O_WRONLY)
        os.dup2(devnull, sys.stdout.fileno())
    except (OSError, ValueError):
        pass
    return 141


def print_all(text: str) -> int:
    try:
        print(text, flush=True)
    except BrokenPipeError:
        return broken_pipe()
    return 0


def open_std_fds() -> None:
    for fd, name, mode in ((0, "stdin", "r"), (1, "stdout", "w"), (2, "stderr", "w")):
        try:
            os.fstat(fd)
        except OSError:  # closed: /dev/null takes its place (the lowest free descriptor)
            got = os.open(os.devnull, os.O_RDWR)
            if got != fd:
                os.dup2(got, fd)
                os.close(got)
        if getattr(sys, name) is None:
            setattr(sys, name, open(fd, mode, buffering=1 if mode == "w" else -1,
                                    closefd=False))
