"""Fault injection for tests: ``hicache serve`` whose ack pushes are all lost (as when a
client's queue is full): each ack is only retained for ``poll_acks``, marked not pushed.
Run as ``python tests/lossy_daemon.py serve ...`` (``lossy`` below builds the process)."""
from __future__ import annotations

import os
import sys
from typing import Any

from hicache.controllers import server


def _deliver(self: Any, c: Any, ack: dict[str, Any]) -> None:
    reg = self.state.registry
    if reg.clients.get(c.ident) is c:
        reg.retain(c, ack["op"], ack, False)


def lossy(**kw: Any) -> Any:
    """A ``DaemonProcess`` (not started) that runs this file instead of ``hicache.cli``."""
    from hicache.engine.daemon_process import DaemonProcess

    d = DaemonProcess(**kw)
    assert d.cmd[1:3] == ["-m", "hicache.cli"], d.cmd
    d.cmd[1:3] = [os.path.abspath(__file__)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d.env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, d.env.get("PYTHONPATH")]))
    return d


if __name__ == "__main__":
    server.Server._deliver = _deliver
    from hicache.cli import main

    sys.exit(main())
