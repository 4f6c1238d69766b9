"""``bench e2e --fence``: the engine's commands as an engine with a copy fence sends them.

An engine that writes and reads its device rows on its own streams orders the daemon's copies
after its own work with an interprocess event: before each LOAD and BACKUP it records the event
it registered on its current stream and names it in the command (``wait_event``), and the
daemon's copy stream waits for it (the SGLang adapter does this for every GPU command: its load
fence and its backups' view of what the forward wrote). ``Fenced(client)`` stands in for the
engine's ``Client``: ``load``, ``backup`` and ``backup_new`` record event 0 of the
registration (``Client.backup_events``) on the current stream first and pass
``wait_event=0``; every other attribute is the client's own. Without ``--fence`` the bench's
engine has finished its writes (a host synchronize) before it sends, so no wait is named.
"""
from __future__ import annotations

from typing import Any

import torch

from hicache.engine.client import Client, Op


class Fenced:
    """See the module docstring."""

    def __init__(self, client: Client) -> None:
        if not client.backup_events:
            raise ValueError("--fence needs a GPU registration with an interprocess event "
                             "(register with events >= 1)")
        self._c = client

    def __getattr__(self, name: str) -> Any:
        return getattr(self._c, name)

    def _fence(self) -> int:
        self._c.backup_events[0].record(torch.cuda.current_stream())
        return 0

    def load(self, items: Any, **kw: Any) -> Op:
        return self._c.load(items, wait_event=self._fence(), **kw)

    def backup(self, items: Any, **kw: Any) -> Op:
        return self._c.backup(items, wait_event=self._fence(), **kw)

    def backup_new(self, items: Any, **kw: Any) -> Op:
        return self._c.backup_new(items, wait_event=self._fence(), **kw)
