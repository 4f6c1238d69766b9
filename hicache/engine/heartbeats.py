"""A heartbeat thread for a client that an engine calls only when it moves KV.

The daemon reaps a client silent for longer than its heartbeat timeout (10 s by default), and an
idle engine sends nothing: ``Heartbeats(client, lock, on_reply)`` starts a daemon thread that
wakes every quarter of the client's heartbeat interval (a third of the daemon's timeout:
``Client.maybe_heartbeat``), takes ``lock`` and sends a heartbeat when nothing else was sent for
that interval, waiting at most ``BEAT_S`` for its reply. The ``Client`` is not thread-safe:
every other use of it must hold ``lock`` too. ``on_reply(reply)`` sees every answered heartbeat
(run under ``lock``). A heartbeat that fails (any error: a daemon busy for a while, or upgraded
under the client, may answer what this client cannot read) is kept in ``error`` and logged as a
warning once, until one is answered again (logged at info). ``stop()`` ends the thread; a
heartbeat in flight ends within ``BEAT_S``, one waiting for ``lock`` sends nothing once it gets
it. A client closed without ``stop()`` ends the thread too. ``who`` names the client in the log
lines, which go to ``logger`` (the caller's; this module's own by default).
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from hicache.engine.client import Client, ClientClosed

log = logging.getLogger("hicache.heartbeats")
BEAT_S = 1.0  # the longest a heartbeat waits for its reply (it holds the lock meanwhile)


class Heartbeats:
    """See the module docstring."""

    def __init__(self, client: Client, lock: Any,
                 on_reply: Callable[[dict[str, Any]], None] | None = None,
                 who: str = "hicache", logger: logging.Logger | None = None) -> None:
        self.client, self.lock, self.on_reply, self.who = client, lock, on_reply, who
        self.log = logger or log
        self.error: Exception | None = None
        self._stop = threading.Event()
        self.thread = threading.Thread(target=self._run, name="hicache-heartbeat", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        c = self.client
        while not self._stop.wait(max(0.05, c.heartbeat_interval / 4)):
            try:
                with self.lock:
                    if self._stop.is_set():
                        return
                    h = c.maybe_heartbeat(timeout=min(c.timeout, BEAT_S))
                    if h is not None and self.on_reply is not None:
                        self.on_reply(h)
            except ClientClosed:  # closed without ``stop()``: nothing left to keep alive
                return
            except Exception as e:  # noqa: BLE001 - a daemon busy for a while: a warning, once
                if self.error is None:
                    self.log.warning("%s: a heartbeat to the daemon at %s failed: %s (the "
                                     "next call meets the same daemon)", self.who, c.address, e)
                self.error = e
                continue
            if h is not None and self.error is not None:
                self.log.info("%s: the daemon at %s answers heartbeats again", self.who,
                              c.address)
                self.error = None

    def stop(self) -> None:
        """End the thread (waits at most ``BEAT_S`` and a half for a heartbeat in flight)."""
        self._stop.set()
        if self.thread is not threading.current_thread():
            self.thread.join(BEAT_S + 0.5)
