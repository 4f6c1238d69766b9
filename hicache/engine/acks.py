"""What the daemon's client returns and raises: ``Op`` (a submitted operation), ``Ack`` (its
completion report), and the client's exceptions (``DaemonUnreachable`` and its ``NoReply``,
``DaemonGone`` and ``GoneMidCall`` (both of those), ``CommandRefused``, ``TransferFailed``,
``AckTimeout`` and its ``AckLost``, ``ClientClosed``). Plain data: no socket, no torch.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Mapping

from hicache.core.errors import HicacheError


class DaemonUnreachable(HicacheError, TimeoutError):
    """The daemon did not answer within the timeout (not running, stuck, or wrong address)."""


class NoReply(DaemonUnreachable):
    """The request went out and no reply came within the timeout: the daemon may have taken
    it (and may still be running what it asked for), or may never have seen it. A caller
    whose command moves bytes into memory it will reuse must treat the outcome as unknown."""


class DaemonGone(DaemonUnreachable):
    """The daemon at the address is certainly not there now: said at once, not after the
    timeout; ``why`` says how the client knows (its socket refuses connections, or is gone)."""

    def __init__(self, message: str, why: str) -> None:
        super().__init__(message)
        self.why = why


class GoneMidCall(DaemonGone, NoReply):
    """The daemon went while a call waited for its reply: gone, as ``DaemonGone`` says, and the
    command's outcome unknown, as ``NoReply`` says (it may have run, in part: a load may have
    written some of its device rows)."""


class ClientClosed(HicacheError, ValueError):
    """This ``Client`` was closed (``close()``): it sends and reads nothing more; make a new
    one. (A ``ValueError`` too, as any operation on a closed object.)"""


class CommandRefused(HicacheError):
    """The daemon refused a command; nothing changed on its side."""

    def __init__(self, command: str, code: str, message: str) -> None:
        super().__init__(f"{command} refused ({code}): {message}")
        self.command = command
        self.code = code
        self.message = message


class TransferFailed(HicacheError):
    """An operation completed with status error (the ack says why)."""

    def __init__(self, ack: "Ack") -> None:
        err = ack.error or {}
        super().__init__(f"op {ack.op} ({ack.kind}) failed: {err.get('message', 'unknown')}")
        self.ack = ack


class AckTimeout(HicacheError, TimeoutError):
    """The daemon answers, but the operation did not complete within the timeout."""


class AckLost(AckTimeout):
    """The daemon answers, but no longer holds the registration that issued the operation (it
    restarted, or reaped this client): the ack will never come, said at the first poll rather
    than at the timeout. What the operation copied before is unknown, as for a timeout."""


@dataclass
class Ack:
    op: int
    kind: str
    status: str
    pools: dict[str, dict[str, Any]]
    bytes: int
    seconds: float
    exec_seconds: float
    path: str
    error: dict[str, str] | None = None
    l3: dict[str, Any] | None = None  # L3 jobs: hits / misses, or written / skipped
    kv: dict[str, Any] | None = None  # kv_clear with L3: dropped

    @property
    def ok(self) -> bool:
        return self.status == "ok"

    @classmethod
    def from_wire(cls, h: Mapping[str, Any]) -> "Ack":
        pools = {p: {"rows": v[0], "bytes": v[1], "seconds": v[2] * 1e-9}
                 for p, v in h.get("pools", {}).items()}
        return cls(int(h["op"]), str(h.get("kind", "")), str(h.get("status", "error")), pools,
                   int(h.get("bytes", 0)), h.get("ns", 0) * 1e-9, h.get("exec_ns", 0) * 1e-9,
                   str(h.get("path", "")), h.get("error"), h.get("l3"), h.get("kv"))


@dataclass
class Op:
    """A submitted operation: its id, its ack when it completed before the reply, and (GPU
    loads) the set of per-layer events it records."""

    op_id: int
    kind: str
    ack: Ack | None = None
    event_set: int | None = None
    host_row: int | None = None
    rows: dict[str, list[int]] | None = None  # backup with alloc: the host rows it allocated
    extra: dict[str, Any] = field(default_factory=dict)
    # GPU load: stage layers whose events were recorded when the reply left (None: all)
    issued: int | None = None
    failed: bool = False  # GPU load: the reply or a notice said its issue failed
    session: str | None = None  # the daemon's session of the registration that issued it
