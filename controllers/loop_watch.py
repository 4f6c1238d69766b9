"""How long the server loop's single steps take, and what the longest one was doing.

The server thread calls ``mark = begin()`` before and ``step(what, mark)`` after each piece of
work it does between two polls (one command, finishing the operations that completed, one
release turn, housekeeping); ``what`` names it (a command name, ``finish``, ``release``,
``housekeeping``). The watch keeps
the longest step since ``restart()`` (wall time, and the CPU time the server thread spent in it:
a long step with little CPU waited for a core or the GIL) and how many steps it saw.
``DaemonState`` restarts it when a client's rows start going back in the background (a reap, an
``unregister`` or ``reset`` with copies in flight) and reports it when the last of them is back:
one log line per release and the gauge ``release_loop_step_seconds``, so a long step while
reaping is visible without tracing. The thread's CPU clock is read only between ``restart()``
and ``settle()`` (the release calls both), so outside a release a step costs two
``perf_counter`` reads.
Single-threaded: only the server thread calls in here.
"""
from __future__ import annotations

import time


Mark = tuple[float, float]


class LoopWatch:
    __slots__ = ("longest", "cpu", "what", "steps", "cpu_clock")

    def __init__(self) -> None:
        self.restart()
        self.cpu_clock = False  # read the thread's CPU clock only while a release is watched

    def begin(self) -> Mark:
        """``(wall, thread CPU)`` now; the CPU clock (a system call) is read only after a
        ``restart()``, until ``settle()``: outside a release the CPU split is never reported."""
        return time.perf_counter(), time.thread_time() if self.cpu_clock else -1.0

    def step(self, what: str, mark: Mark) -> float:
        """A step that began at ``mark`` (``begin()``) ended now; returns its seconds."""
        dt = time.perf_counter() - mark[0]
        self.steps += 1
        if dt > self.longest:
            self.longest, self.what = dt, what
            self.cpu = time.thread_time() - mark[1] if mark[1] >= 0 else 0.0
        return dt

    def restart(self) -> None:
        self.longest, self.cpu, self.what, self.steps = 0.0, 0.0, "", 0
        self.cpu_clock = True

    def settle(self) -> None:
        """The watched release is over: stop reading the CPU clock (the figures stay)."""
        self.cpu_clock = False

    def describe(self) -> str:
        return f"longest loop step {self.longest * 1e3:.2f} ms ({self.what or 'none'}, " \
               f"{self.cpu * 1e3:.2f} ms of it on the CPU) of {self.steps}"
