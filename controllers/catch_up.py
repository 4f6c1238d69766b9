"""When the server's loop last read every request that waited: what a client's silence is
measured against (``Registry.silent``), so a loop that stood still reaps nobody for it.

Contract (single-threaded: the server thread only):

* ``CatchUp(now, bound)``: ``at`` starts at ``now``; ``bound`` is how many reads of the socket
  surely take every message that waited at some moment (``server.read_bound``: the socket
  holds at most ``RCVHWM`` messages per peer and reads its peers round-robin).
* ``empty(t)``: the loop found its socket empty at ``t``, and every request it had taken off
  it before is handled before the next reap: ``at = t``. (A channel holds at most one
  request, and the server scans every channel before each reap: a channel request that
  waited at ``t`` was read by then, so channels do not hold a catch-up back.)
* ``read()``: one request was read from the socket.
* ``tick(now)`` (each housekeeping pass): a loop that never finds its socket empty (its
  clients keep it saturated) still catches up: once ``bound`` reads followed a mark, what
  waited at the mark was read, so ``at`` moves to the mark's time and a new mark is set at
  ``now``. A loop that reads nothing (it stood still) moves nothing.
"""
from __future__ import annotations


class CatchUp:
    def __init__(self, now: float, bound: int) -> None:
        self.at = now
        self.bound = bound
        self.reads = 0
        self._mark = (now, 0)

    def empty(self, t: float) -> None:
        if t > self.at:
            self.at = t
            self._mark = (t, self.reads)

    def read(self) -> None:
        self.reads += 1

    def tick(self, now: float) -> None:
        t, n = self._mark
        if self.reads - n >= self.bound:
            self.at = max(self.at, t)
            self._mark = (now, self.reads)
