"""Clients of one daemon: who they are, when they were last heard, their worker and their acks.

A client is one ZMQ routing identity (the DEALER's ``ROUTING_ID``); its id string
(``client_id``) owns host rows. ``client_id`` is one-to-one: a printable ASCII identity not
starting with ``~`` is its own id, any other is ``~`` and its hex digits. So two identities
never share an owner, and no identity gets an id starting with a zero byte, which the daemon's
own owners use (the key store's ``\x00kvstore``).
``touch(ident, now)`` finds or adds it (beyond ``max_clients`` it forgets the least recently
seen peer that holds nothing, ``is_probe``, else refuses); ``silent(now, timeout)``
lists clients whose last message is older than ``timeout`` (the reaper's candidates). Acks are
kept per client, newest ``retention`` only, until ``poll_acks`` takes them.

A reaped client is *retiring* (``retire``): it no longer counts as connected and gets no acks,
but its rows and device mappings stay until its last operation ends; then its mappings close
and its rows are given back in time-bounded turns (``release.Releaser``), and only when the
last row is back is it ``remove``d. Meanwhile its identity is refused (``busy``), so a
reconnecting peer can neither use nor lose what the old one held. Afterwards the identity is a
new client, which keeps why the old one was reaped (``ClientState.reaped``, the last
``REAPED_KEEP`` identities remembered) until it registers again: the heartbeat reply names it,
and the server adds it to every refusal, so a client that went silent learns why its rows are
gone instead of reading "not allocated". Under CURVE a client is bound
to the name of the key that created it (``touch``): another key presenting its routing
identity is refused. A client's shared-memory command channel (``open_channel``) is listed in
``channels`` (the server scans them) and closed, its memfd with it, when the client retires or
is removed. So is its intake (``open_intake``: the descriptors it hands in for its next
``register``, ``Intake``), which also closes once the registration that used it succeeded.
A routing identity is a client's only credential without CURVE: no reply names another
client's id (``public_label`` is what ``stats`` shows). Single-threaded: only the server
thread calls in here.
"""
from __future__ import annotations

import hashlib
import logging
import os
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from hicache.core.protocol import ProtocolError

from .device_buffers import DeviceBuffers

log = logging.getLogger("hicache.daemon")

REAPED_KEEP = 1024  # reaped identities whose reason is kept for their next connection
_PLAIN = frozenset(range(0x20, 0x7F))  # printable ASCII bytes


def public_label(cid: str) -> str:
    """What ``stats`` shows of client ``cid`` to any peer: its id but for the random tail
    (``Client``'s ``name-host-pid-<random>``), and a short digest of the whole id. Without
    CURVE a routing identity is the client's only credential, so no reply names another
    client's id (``stats`` listed them, and a peer that used a dead engine's id took over its
    rows, acks, channel and sparse region until the reap)."""
    head = cid.rsplit("-", 1)[0] if "-" in cid else ""
    return f"{head[:64]}#{hashlib.blake2b(cid.encode(), digest_size=4).hexdigest()}"


def client_id(ident: bytes) -> str:
    """The owner id of routing identity ``ident`` (see the module docstring): one-to-one, and
    never starting with a zero byte."""
    if ident and ident[0] != 0x7E and _PLAIN.issuperset(ident):
        return ident.decode("ascii")
    return "~" + ident.hex()


class Intake:
    """Descriptors one client hands in on the daemon's descriptor socket (``hand_in``): the
    token it presents, the hand-out that expects it, and what came (taken once, then held
    here until ``close``, so a refused ``register`` can be retried with the same ones)."""

    def __init__(self, token: int, handout: Any, count: int) -> None:
        self.token, self._handout, self.count = token, handout, count
        self._fds: list[int] | None = None

    def received(self) -> list[int] | None:
        """The descriptors handed in (still this intake's), or None while none came."""
        if self._fds is None:
            self._fds = self._handout.take(self.token)
        return self._fds

    def close(self) -> None:
        """Withdraw the intake and close what it received."""
        self._handout.withdraw(self.token)
        fds, self._fds = self._fds or [], None
        for fd in fds:
            try:
                os.close(fd)
            except OSError:
                pass


@dataclass(eq=False)
class RegisteredWorker:
    """A registered worker's device side: buffers, events and load-event sets."""

    name: str | None
    tp_rank: int
    device_rows: dict[str, int]
    buffers: DeviceBuffers
    tables: dict[str, Any]  # pool -> LayerTable of device buffers
    events: list[Any] = field(default_factory=list)  # engine's IPC events (backup waits)
    load_events: list[list[Any]] = field(default_factory=list)  # [set][stage layer] IPC events
    next_set: int = 0

    def next_load_events(self) -> tuple[int, list[Any]]:
        """The next per-layer event set, round robin: (set index, one event per stage layer)."""
        s = self.next_set
        self.next_set = (s + 1) % len(self.load_events)
        return s, self.load_events[s]

    def close(self, handoff: Callable[[list[Any]], None] | None = None) -> None:
        """Drop the device side; with ``handoff`` everything (tables, tensors, events and the
        mappings under them) goes to it, so nothing is freed on the caller's thread."""
        views = [self.tables, self.events, self.load_events, self.buffers.layers]
        self.tables, self.events, self.load_events = {}, [], []
        if handoff is None:
            self.buffers.close()
        else:
            self.buffers.close(lambda keep: handoff(views + list(keep)))


@dataclass(eq=False)
class ClientState:
    cid: str
    ident: bytes
    last_seen: float
    worker: RegisteredWorker | None = None
    answered: float = 0.0  # when its last reply was handed to ZMQ (monotonic; ``stood_still``)
    acks: "OrderedDict[int, tuple[dict[str, Any], bool]]" = field(default_factory=OrderedDict)
    in_flight: int = 0  # operations of this client not yet completed
    l3_reads: int = 0  # of them: L3 queries and prefetches
    key: str | None = None  # CURVE: the name of the key this client is bound to
    kv: Any = None  # kv_regions.ClientPools: engine host pools attached for the key store
    reaped: str | None = None  # why an earlier client of this identity was reaped, until register
    channel: Any = None  # hicache.core.channel.Channel: its shared-memory command channel
    intake: "Intake | None" = None  # descriptors it hands in for its next register (hand_in)
    # names this state in ``register`` and ``poll_acks`` replies: a client that polls for an
    # op and reads another session knows the state that held the op is gone (a restart, a reap)
    session: str = field(default_factory=lambda: secrets.token_hex(8))

    def in_session(self) -> bool:
        """It holds something besides host and sparse rows: a worker, key-store pools, a
        channel, an intake (descriptors handed in), or operations (copies, L3 jobs) not yet
        completed."""
        return self.worker is not None or self.kv is not None or self.channel is not None \
            or self.intake is not None or self.in_flight > 0


class Registry:
    def __init__(self, max_clients: int, retention: int) -> None:
        self.max_clients = max_clients
        self.retention = retention
        self.clients: dict[bytes, ClientState] = {}
        self.retiring: dict[bytes, ClientState] = {}
        self.reaped: "OrderedDict[bytes, str]" = OrderedDict()  # identity -> why (REAPED_KEEP)
        self.channels: list[ClientState] = []  # clients with a channel open (the server scans)
        self.intake_fds = 0  # descriptors all open intakes may hold (``Intake.count`` summed)
        # takes a closed worker's mappings (``background.Unmapper.hand``): unmapped off-loop
        self.handoff: Callable[[list[Any]], None] | None = None
        # whether a client holds nothing (``DaemonState.is_probe``): forgotten when full
        self.is_probe: Callable[[ClientState], bool] | None = None

    def touch(self, ident: bytes, now: float, key: str | None = None) -> ClientState:
        """The client of routing identity ``ident``; ``key``: the CURVE key name the message
        came with (None without CURVE). A client is bound to the key that created it: another
        key using its identity is refused (``not_owner``) and changes nothing."""
        c = self.clients.get(ident)
        if c is not None and c.key != key:
            raise ProtocolError("not_owner", f"client {c.cid[:64]} is bound to CURVE key "
                                             f"{c.key!r}; this message came with key {key!r}")
        if c is None:
            if ident in self.retiring:
                raise ProtocolError("busy", "this client was reaped and its operations are "
                                            "still draining; retry in a moment")
            if len(self.clients) >= self.max_clients and not self._forget_a_probe():
                raise ProtocolError("too_many_clients", f"the daemon already tracks "
                                                        f"{self.max_clients} clients")
            c = ClientState(client_id(ident), ident, now, key=key,
                            reaped=self.reaped.pop(ident, None))
            self.clients[ident] = c
        c.last_seen = now
        return c

    def _forget_a_probe(self) -> bool:
        """The table is full: forget the least recently seen peer that holds nothing
        (``is_probe``, set by the daemon's state), making room; False when there is none."""
        probes = [c for c in self.clients.values() if self.is_probe is not None
                  and self.is_probe(c)]
        if not probes:
            return False
        c = min(probes, key=lambda x: x.last_seen)
        self.forget(c)
        log.debug("client table full: forgot peer %s, which held nothing", c.cid)
        return True

    def forget(self, c: ClientState) -> bool:
        """Drop a peer that holds nothing (the caller checked) from the table: its next
        message starts a new client, as for any identity the daemon never saw. False when
        ``c`` is not the table's client of its identity."""
        if self.clients.get(c.ident) is not c:
            return False
        del self.clients[c.ident]
        return True

    def silent(self, now: float, timeout: float) -> list[ClientState]:
        return [c for c in self.clients.values() if now - c.last_seen > timeout]

    def stood_still(self, start: float, end: float, answered_since: float | None = None) -> int:
        """The server's loop stood still from ``start`` to ``end``: that time no longer counts
        toward the silence of the clients it may have kept from sending (each ``last_seen``
        moves on by it, to ``end`` at most): every client (``answered_since`` None: the process
        stopped or starved, its own replies held with it), or those answered at or after
        ``answered_since`` (one long command: its client and those whose replies went out just
        before it). A client silent on its own is still reaped, that much later. Returns how
        many were credited."""
        n = 0
        for c in self.clients.values():
            if answered_since is None or c.answered >= answered_since:
                c.last_seen = max(c.last_seen, min(end, c.last_seen + (end - start)))
                n += 1
        return n

    def retire(self, c: ClientState) -> None:
        """Stop serving ``c`` now; ``remove`` it once its in-flight operations ended."""
        if self.clients.get(c.ident) is c:
            del self.clients[c.ident]
        self.retiring[c.ident] = c
        self.close_channel(c)
        self.close_intake(c)
        c.acks.clear()

    def remove(self, c: ClientState, reaped: str | None = None) -> None:
        """Forget ``c``; ``reaped``: why it was reaped, kept for its identity's next client."""
        if reaped is not None:
            self.reaped[c.ident] = reaped
            self.reaped.move_to_end(c.ident)
            while len(self.reaped) > REAPED_KEEP:
                self.reaped.popitem(last=False)
        self.clients.pop(c.ident, None)
        if self.retiring.get(c.ident) is c:
            del self.retiring[c.ident]
        self.close_worker(c)
        self.close_kv(c)
        self.close_channel(c)
        self.close_intake(c)
        c.acks.clear()

    def open_channel(self, c: ClientState, channel: Any) -> None:
        """Give ``c`` its channel (it has none open) and list it for the server's scans."""
        c.channel = channel
        self.channels.append(c)

    def close_channel(self, c: ClientState) -> None:
        """Close ``c``'s channel, if any: marked closed, unmapped, no longer scanned."""
        if c.channel is not None:
            self.channels.remove(c)
            c.channel.close()
            c.channel = None

    def open_intake(self, c: ClientState, intake: Intake) -> None:
        """Give ``c`` its intake, closing one it had (and what that one received)."""
        self.close_intake(c)
        c.intake = intake
        self.intake_fds += intake.count

    def close_intake(self, c: ClientState) -> None:
        """Close ``c``'s intake, if any: withdrawn, and what it received closed."""
        if c.intake is not None:
            c.intake.close()
            self.intake_fds -= c.intake.count
            c.intake = None

    def close_kv(self, c: ClientState) -> None:
        """Unmap the engine host pools ``c`` attached for the key store, if any."""
        if c.kv is not None:
            c.kv.close()
            c.kv = None

    def close_worker(self, c: ClientState) -> None:
        """Close ``c``'s device mappings (through ``handoff`` when set)."""
        if c.worker is not None:
            c.worker.close(self.handoff)
            c.worker = None

    def workers(self) -> int:
        return sum(1 for c in self.clients.values() if c.worker is not None)

    def retain(self, c: ClientState, op_id: int, ack: dict[str, Any], pushed: bool) -> int:
        """Keep ``ack`` for poll_acks (newest ``retention``). Returns how many acks that had
        *not* been pushed were dropped to make room (lost acks)."""
        c.acks[op_id] = (ack, pushed)
        lost = 0
        while len(c.acks) > self.retention:
            _, (_, was_pushed) = c.acks.popitem(last=False)
            lost += not was_pushed
        return lost

    def take_acks(self, c: ClientState, ops: list[int] | None, limit: int,
                  size: Callable[[dict[str, Any]], int], budget: int) -> list[dict[str, Any]]:
        """Take (remove) up to ``limit`` retained acks of ``c``, oldest first (or those of
        ``ops``), stopping before their ``size`` passes ``budget`` (at least one is taken): the
        reply must stay under the header limit, and what it cannot carry stays retained."""
        out: list[dict[str, Any]] = []
        used = 0
        keys = list(c.acks) if ops is None else [op for op in dict.fromkeys(ops) if op in c.acks]
        for op in keys[:limit]:
            ack = c.acks[op][0]
            used += size(ack)
            if out and used > budget:
                break
            del c.acks[op]
            out.append(ack)
        return out
