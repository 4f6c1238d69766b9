"""Writing a command's output when its reader may go away (``hicache plan | head``).

Contract: ``broken_pipe()`` points stdout at /dev/null (so the interpreter's final flush does
not fail again) and returns 141, the exit status SIGPIPE's default action gives, for the
caller to exit with; ``print_all(text)`` prints ``text`` and returns 0, or, when the reader
went away first, ``broken_pipe()``'s 141, never a traceback.
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
