"""The tier hooks: how a radix tree asks a host tier to allocate, back up, load and free pages.

Contract. A tree (``hicache.engine.radix.RadixTree``, or an engine's own radix cache) never talks to
the daemon directly; it calls one object with these verbs, one radix page per element:

* ``host_alloc(n) -> list[handle]`` — ``n`` host page handles, all or none. A handle is opaque
  to the tree (for ``ClientHooks`` it is one host row per index space the page uses).
* ``host_free(handles)`` — give host pages back.
* ``backup(device_rows, handles) -> ticket`` — start copying device page rows to host pages.
* ``load(handles, device_rows) -> ticket`` — start copying host pages into device page rows.
* ``wait(ticket)`` — block until that transfer finished (bounded by the hooks' timeout);
  ``done(ticket) -> bool`` asks without blocking.

Failures the tree understands (and nothing else):

* ``HostExhausted`` — the host pool has no room: the tree drops the page instead of failing.
* ``HostUnavailable`` — the daemon cannot be reached or lost our state: the tree treats its
  host tier as empty and recomputes (never retries forever, never hangs).
* ``TransferFailed`` — one transfer failed; its pages' host copies are not trusted.

``ClientHooks`` implements the verbs on ``hicache.engine.client.Client``: one host handle is a tuple
of host rows, one per index space a radix page uses (``page``, plus ``swa_page`` in paged SWA
mode), allocated together; a backup or load is one command with one item per space.
"""
from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

from hicache.core.errors import HicacheError
from hicache.engine.acks import AckTimeout, CommandRefused, DaemonUnreachable
from hicache.engine.acks import TransferFailed as ClientTransferFailed


class HostTierError(HicacheError):
    """Base of the failures a tier hook reports to the tree."""


class HostExhausted(HostTierError):
    """The host pool has no free page for this allocation or backup."""


class HostUnavailable(HostTierError):
    """The host tier is gone (daemon unreachable, restarted or reaped us)."""


class TransferFailed(HostTierError):
    """A backup or load did not complete; the pages involved hold no trusted copy."""


class TierHooks(Protocol):
    """The verbs a radix tree calls on its host tier (see the module docstring)."""

    def host_alloc(self, n: int) -> list[Any]: ...

    def host_free(self, handles: Sequence[Any]) -> None: ...

    def backup(self, device_rows: Sequence[int], handles: Sequence[Any]) -> Any: ...

    def load(self, handles: Sequence[Any], device_rows: Sequence[int]) -> Any: ...

    def wait(self, ticket: Any) -> None: ...

    def done(self, ticket: Any) -> bool: ...


# ---------------------------------------------------------------------------- client adapter
@dataclass
class Ticket:
    """One backup or load in flight: the client's op, when it was sent, and (once known) its ack."""

    op: Any
    kind: str
    pages: int
    t_sent: float
    ack: Any = None
    t_done: float | None = None


@dataclass
class HookStats:
    """What the adapter saw, per direction: ops, pages, bytes, copy execution seconds (ops the
    daemon merged into one copy counted once) and latencies (daemon-side, accept to completion)."""

    ops: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    pages: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    exec_seconds: dict[str, float] = field(default_factory=lambda: {"backup": 0.0, "load": 0.0})
    latencies: dict[str, list[float]] = field(default_factory=lambda: {"backup": [], "load": []})


class ClientHooks:
    """``TierHooks`` over a registered ``hicache.engine.client.Client`` (see the module docstring).

    ``spaces``: the index spaces one radix page uses, e.g. ``("page", "swa_page")``; device row
    ``r`` of a page is row ``r`` in every one of them. ``wait_event`` (GPU): index of the
    backup event the engine records after writing KV; the daemon's backup waits on it.
    ``on_ack(kind, ack)`` is called for every completed transfer (metrics).
    """

    def __init__(self, client: Any, spaces: Sequence[str], *, timeout: float | None = None,
                 wait_event: int | None = None,
                 on_ack: Callable[[str, Any], None] | None = None) -> None:
        if not spaces:
            raise ValueError("a radix page must use at least one index space")
        self.client = client
        self.spaces = tuple(spaces)
        self.timeout = timeout
        self.wait_event = wait_event
        self.on_ack = on_ack
        self.stats = HookStats()
        self._last_exec: dict[str, float] = {}

    # errors: translate the client's exceptions into the three the tree understands
    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:

        try:
            return fn(*args, **kw)
        except DaemonUnreachable as e:
            raise HostUnavailable(str(e)) from e
        except AckTimeout as e:  # the daemon answers but a copy never completes: do not trust it
            raise HostUnavailable(str(e)) from e
        except ClientTransferFailed as e:
            raise TransferFailed(str(e)) from e
        except CommandRefused as e:
            if e.code == "no_space":
                raise HostExhausted(e.message) from e
            if e.code in ("not_registered", "not_owner", "shutting_down"):
                raise HostUnavailable(str(e)) from e  # restarted, reaped or stopping: state lost
            raise TransferFailed(str(e)) from e

    def host_alloc(self, n: int) -> list[Any]:
        rows = self._call(self.client.alloc, {s: n for s in self.spaces}, timeout=self.timeout)
        return list(zip(*(rows[s] for s in self.spaces)))

    def host_free(self, handles: Sequence[Any]) -> None:
        if handles:
            self._call(self.client.free, {s: [h[i] for h in handles]
                                          for i, s in enumerate(self.spaces)},
                       timeout=self.timeout)

    def backup(self, device_rows: Sequence[int], handles: Sequence[Any]) -> Ticket:
        items = {s: (list(device_rows), [h[i] for h in handles])
                 for i, s in enumerate(self.spaces)}
        t = time.perf_counter()
        op = self._call(self.client.backup, items, wait_event=self.wait_event,
                        timeout=self.timeout)
        return Ticket(op, "backup", len(device_rows), t)

    def load(self, handles: Sequence[Any], device_rows: Sequence[int]) -> Ticket:
        items = {s: ([h[i] for h in handles], list(device_rows))
                 for i, s in enumerate(self.spaces)}
        t = time.perf_counter()
        op = self._call(self.client.load, items, timeout=self.timeout)
        return Ticket(op, "load", len(device_rows), t)

    def _complete(self, ticket: Ticket, ack: Any) -> None:
        ticket.ack, ticket.t_done = ack, time.perf_counter()
        if not ack.ok:
            return
        k, st = ticket.kind, self.stats
        st.ops[k] += 1
        st.pages[k] += ticket.pages
        st.bytes[k] += int(ack.bytes)
        ex = float(ack.exec_seconds)
        if ex != self._last_exec.get(k):  # ops the daemon merged into one copy share its time
            st.exec_seconds[k] += ex
        self._last_exec[k] = ex
        st.latencies[k].append(float(ack.seconds))
        if self.on_ack is not None:
            self.on_ack(k, ack)

    def wait(self, ticket: Ticket) -> None:
        if ticket.ack is None:
            ack = self._call(self.client.wait_ack, ticket.op, self.timeout, check=False)
            self._complete(ticket, ack)
        if not ticket.ack.ok:
            err = ticket.ack.error or {}
            raise TransferFailed(f"{ticket.kind} op {ticket.ack.op} failed: "
                                 f"{err.get('message', 'unknown')}")

    def done(self, ticket: Ticket) -> bool:
        """Non-blocking: reads acks that already arrived, never waits for one."""

        if ticket.ack is not None:
            return True
        if ticket.op.ack is None:
            self._call(self.client.drain)
            try:
                ack = self.client.wait_ack(ticket.op, timeout=0.0, check=False)
            except AckTimeout:
                return False
        else:
            ack = ticket.op.ack
        self._complete(ticket, ack)
        return True
