"""Client library of the hicache daemon: typed methods over the wire protocol, with timeouts.

``Client(address, timeout=5.0)`` opens one DEALER socket and no thread: every call sends one
request and polls for its reply (acks pushed meanwhile are kept); registered with CUDA pools it
busy-polls up to ``REPLY_SPIN_US_GPU`` before it sleeps in ``poll`` (``reply_spin_us``). A
daemon that does not answer within the timeout raises ``DaemonUnreachable`` (never a hang;
``NoReply`` when the request went out, so the daemon may have taken it); one that answered
this client before and is gone (an ``ipc://`` socket that refuses connections or is no more)
raises ``DaemonGone`` at once, and ``GoneMidCall`` (both of those) within ``GONE_CHECK_S`` when
it went while a call waited for its reply; a
refused command raises ``CommandRefused`` with the daemon's error code and message. A timeout
is a finite number of seconds above 0 (``wait_ack`` and ``wait_layer`` take 0 too: only look);
anything else is a ``ValueError`` before a request goes out. A bad address or CURVE key file is
a ``ValueError`` from ``Client(...)``, which then holds no socket.

Transfers return an ``Op``; ``wait_ack(op, timeout)`` returns its ``Ack`` (pushed by the daemon,
or fetched with ``poll_acks`` if a push went missing). On GPU, ``wait_layer(op, layer, stream)``
returns once one layer of a load is copied (it polls that layer's interprocess event; with
``client.spin_us`` set it puts a stream wait after that long instead); in CPU mode it waits
for the whole op's ack. Any call counts as a heartbeat; an idle engine calls
``maybe_heartbeat()`` from its loop (it sends only when a third of the daemon's timeout passed).

Imports are light: zmq and the protocol; torch only for GPU events.
"""
from __future__ import annotations

import itertools
import os
import secrets
import socket
import time
from collections import OrderedDict
from typing import Any, Iterable, Mapping, Sequence

import zmq

from hicache.core import protocol as P
from hicache.core.channel import ClientEnd, supported
from hicache.core.fd_handout import send_fds
from hicache.engine.completion import WAIT_SPIN_US, Completion, check_timeout
from hicache.engine.kv_client import KVStoreCommands
from hicache.engine.l3_client import L3Commands
from hicache.engine.sparse_client import SparseCommands

from .acks import (Ack, AckLost, AckTimeout, ClientClosed, CommandRefused, DaemonGone,
                   DaemonUnreachable, GoneMidCall, NoReply, Op, TransferFailed)

__all__ = ["Client", "Op", "Ack", "AckLost", "AckTimeout", "ClientClosed", "CommandRefused",
           "DaemonGone", "DaemonUnreachable", "GoneMidCall", "NoReply", "TransferFailed",
           "Items"]

_NOBLOCK = int(zmq.NOBLOCK)
# while a call waits for its reply, whether its daemon is gone is asked this often (``ipc://``,
# once a daemon answered, and only while ZMQ holds no live connection to it): a daemon killed
# mid-call held the caller its whole timeout (30 s in the demo, for every call in flight)
GONE_CHECK_S = 0.5
# while a call waits for a reply to a request it sent through the channel, whether the daemon
# dropped the channel with that request unread is asked this often (``Client._reply_to``)
CHANNEL_CHECK_S = 0.05
# how long a refusal read from the channel's slot waits for its ZMQ copy (``_zmq_copy``)
ZMQ_COPY_WAIT_S = 1.0
_MORE = int(zmq.SNDMORE) | _NOBLOCK
_POLLIN = int(zmq.POLLIN)
_POLLOUT = int(zmq.POLLOUT)


# a GPU engine's calls busy-poll this long for their reply before sleeping (see __init__)
REPLY_SPIN_US_GPU = 2000.0

Items = Mapping[str, tuple]  # pool or space -> (src ids, dst ids[, "token"])
_SPACES = frozenset(("page", "swa_page", "req_slot"))  # item keys that name an index space


def default_address(config_file: str | None = None) -> str:
    """The daemon address an engine uses when given none: ``config.served_address``
    (``HICACHE_SOCKET``, else the default socket of ``HICACHE_DEVICE``, over the ``socket`` /
    ``device`` of the settings file ``HICACHE_CONFIG_FILE`` names), as ``hicache serve``
    picks it."""
    from hicache.core.config import served_address

    return served_address(config_file)


_as_ids = P.as_index
_LOOPBACK = ("tcp://127.", "tcp://localhost:", "tcp://[::1]:")


def _local(address: str) -> bool:
    """Whether ``address`` names a daemon on this host (where a channel can be mapped)."""
    return address.startswith("ipc://") or address.startswith(_LOOPBACK)


def _tcp_refused(address: str) -> str | None:
    """Why nothing serves loopback ``address``: its port refuses connections (a loopback
    refusal is immediate); None when it accepts, or the probe cannot tell within 0.2 s."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=0.2):
            return None
    except ConnectionRefusedError:
        return f"nothing listens on port {port}: no daemon runs there"
    except (OSError, ValueError):
        return None


def gone_reason(address: str) -> str | None:
    """Why the daemon at ``address`` is certainly not there now, for a client with no live
    connection to it: an ``ipc://`` socket file that refuses connections (its daemon died, or
    closed it after its loop ended), or no socket file (it stopped, or never started). None
    otherwise: it is busy (a full backlog), or the address is tcp and not loopback (not
    probed). A loopback tcp address is probed too: a refused connection (nothing listens on
    that port) is a daemon gone. A ``Client`` asks only once a daemon answered it (a new one
    waits for a daemon that may be starting over a crashed one's socket); ``hicache stats``
    asks first."""
    if address.startswith(_LOOPBACK):
        return _tcp_refused(address)
    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    path = "\0" + path[1:] if path.startswith("@") else path  # an abstract socket
    try:
        probe = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    except OSError:  # (no descriptor left): nothing certain
        return None
    with probe:
        probe.setblocking(False)  # a full backlog is EAGAIN, never a wait
        try:
            probe.connect(path)
        except ConnectionRefusedError:
            return "its socket refuses connections: the daemon that made it is gone"
        except FileNotFoundError:
            return "there is no socket file: no daemon runs there"
        except OSError:
            return None
    return None


def recv_message(sock: zmq.Socket) -> list[bytes]:
    """One message waiting on ``sock`` (NOBLOCK; ``zmq.Again`` when none), its frames as bytes.
    Frames come as ``zmq.Frame``: ``Frame.more`` is read in C, where ``recv_multipart`` asks
    ``sock.get(RCVMORE)`` (a Python enum lookup) per frame. (``hicache bench control``'s echo
    client receives with it too.)"""
    recv = sock.recv
    f = recv(_NOBLOCK, copy=False)
    out = [f.bytes]
    while f.more:
        f = recv(_NOBLOCK, copy=False)
        out.append(f.bytes)
    return out


def curve_keys(server_key_file: str, secret_key_file: str) -> tuple[bytes, bytes, bytes]:
    """(the daemon's public key, this client's public and secret keys) from their files;
    ``ValueError`` naming a file that cannot be read or holds no key."""
    from zmq import auth as zmq_auth

    try:
        server_public, _ = zmq_auth.load_certificate(server_key_file)
        public, secret = zmq_auth.load_certificate(secret_key_file)
    except (OSError, ValueError) as e:
        raise ValueError(f"CURVE key file: {e}") from None
    if not secret:
        raise ValueError(f"CURVE key file: {secret_key_file} holds no secret key")
    return server_public, public, secret


def _connect(s: zmq.Socket, client_id: str, address: str, curve_server_key: str | None,
             curve_secret_key: str | None) -> None:
    """Set up the client's DEALER ``s`` and connect it: ``ValueError`` for an address ZMQ
    refuses or a key file that cannot be used (saying which), before anything is sent."""
    s.setsockopt(zmq.ROUTING_ID, client_id.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)  # no queueing towards a daemon that is not there
    s.setsockopt(zmq.SNDHWM, 100_000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    if curve_server_key is not None and curve_secret_key is not None:
        s.curve_serverkey, s.curve_publickey, s.curve_secretkey = \
            curve_keys(curve_server_key, curve_secret_key)
    try:
        s.connect(address)
    except zmq.ZMQError as e:
        raise ValueError(f"cannot connect to {address!r}: {e}") from None


class Client(Completion, SparseCommands, L3Commands, KVStoreCommands):
    def __init__(self, address: str | None = None, timeout: float = 5.0,
                 name: str | None = None, *, curve_server_key: str | None = None,
                 curve_secret_key: str | None = None,
                 reply_spin_us: float | None = None, channel: bool | None = None) -> None:
        """``curve_server_key``: the daemon's public key file; ``curve_secret_key``: this
        client's secret key file (``zmq.auth`` certificate format). Both or neither.
        ``reply_spin_us``: how long a call busy-polls for its reply (and a wait for an ack or a
        notice for its next message) before it sleeps in ``poll``; None: ``REPLY_SPIN_US_GPU``
        once registered with CUDA pools (the engine's thread waits for the reply anyway, and
        sleeping threads on both ends cost a LOAD's reply 0.05-0.65 ms on an H200 host),
        else 0. ``channel``: send requests through a shared-memory channel
        (``hicache.core.channel``; ``register`` opens it): True asks for it (a refusal raises),
        False never, None (default) when the daemon is on this host (an ``ipc://`` address or
        a loopback one without CURVE) and grants it (why it did not: ``channel_refused``)."""
        if reply_spin_us is not None and not 0 <= reply_spin_us <= 1e6:
            raise ValueError(f"reply_spin_us must be 0..1000000, got {reply_spin_us}")
        self.address = address or default_address()
        self.timeout = check_timeout(timeout)
        tag = (name or "client").replace("/", "_")[:48]
        # the random tail is what makes the id a credential (without CURVE, the only one)
        self.client_id = f"{tag}-{socket.gethostname()[:32]}-{os.getpid()}-" \
                         f"{secrets.token_hex(16)}"
        # host-row epoch: +1 at every register, unregister and reset that succeeded (each one
        # leaves this client no host row it held before: freed, or a new daemon's registration)
        self.row_epoch = 0
        self._ctx = zmq.Context.instance()
        if (curve_server_key is None) != (curve_secret_key is None):
            raise ValueError("CURVE needs both curve_server_key and curve_secret_key")
        self._sock = self._ctx.socket(zmq.DEALER)
        s = self._sock
        try:
            _connect(s, self.client_id, self.address, curve_server_key, curve_secret_key)
        except BaseException:
            s.close(0)  # nothing of a client that could not be made stays open
            raise
        self._want_channel = channel if channel is not None else \
            (None if curve_server_key is None and _local(self.address) else False)
        self._chan: ClientEnd | None = None
        self._chan_seq = 0  # the request a call waits for through the channel (0: none)
        self._slot_reply = False  # the reply ``_reply_to`` read came from the channel's slot
        self.channel_refused: str | None = None
        self._pollin = [(s, _POLLIN)]
        self._ids = itertools.count(1)
        self._acks: OrderedDict[int, Ack] = OrderedDict()
        self._taken: OrderedDict[int, None] = OrderedDict()
        # GPU loads' "issued" pushes: layers issued so far (None: all of them)
        self._issued: OrderedDict[int, int | None] = OrderedDict()
        self._failing: OrderedDict[int, None] = OrderedDict()  # loads a notice said failed
        self._session: str | None = None  # the daemon's session of this registration
        # the session each op id was issued in (the newest ACK_KEEP): ``wait_ack`` of a bare id
        self._op_sessions: OrderedDict[int, str | None] = OrderedDict()
        self.spin_us = WAIT_SPIN_US  # wait_layer: host spin before a stream wait
        self._spin_set = reply_spin_us  # None: chosen at register (GPU or not)
        self._reply_spin = (reply_spin_us or 0.0) * 1e-6
        self._last_send = 0.0
        self.sent = 0  # requests sent: round trips (a bench counts them per operation)
        self.answered = False  # a daemon at the address answered a call (a refusal too)
        self.heartbeat_interval = 3.0
        self.registered: dict[str, Any] | None = None
        self.stage_layers: list[int] = []
        self._layer_pos: dict[int, int] = {}
        self._load_events: list[list[Any]] = []
        self.backup_events: list[Any] = []  # GPU: engine-side IPC events for backup waits
        self._device: Any = None

    # ------------------------------------------------------------------ plumbing
    def close(self) -> None:
        self._close_channel()
        if not self._sock.closed:
            self._sock.close(0)

    @property
    def uses_channel(self) -> bool:
        """Whether requests go through a shared-memory channel now."""
        return self._chan is not None

    def channel(self, timeout: float | None = None) -> bool:
        """Ask the daemon for a shared-memory channel and map it (``register`` does, see
        ``__init__``'s ``channel``). True when mapped; False when refused or unmappable, with
        the reason in ``channel_refused`` (raises ``CommandRefused`` for ``channel=True``)."""
        if self._chan is not None:
            return True
        why = supported()
        if why is None:
            try:
                h, _ = self.call("channel", {"optional": True} if not self._want_channel
                                 else None, timeout=timeout)
            except CommandRefused as e:
                why = e.message
            else:
                why = h.get("declined")
            if why is None:
                try:
                    self._chan = ClientEnd.open(h)
                except (OSError, ValueError, KeyError) as e:
                    why = f"cannot map the daemon's channel: {e}"
                else:
                    self.channel_refused = None
                    return True
        if self._want_channel:
            raise CommandRefused("channel", "unsupported", why)
        self.channel_refused = why
        return False

    def _close_channel(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None

    def __enter__(self) -> "Client":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    @property
    def reply_spin_us(self) -> float:
        """How long a call busy-polls for its reply now (µs; see ``__init__``)."""
        return self._reply_spin * 1e6

    def _recv(self, wait_ms: int) -> tuple[dict[str, Any], list[Any]] | None:
        """The next message within ``wait_ms``: busy-polled for up to the reply spin, then a
        sleeping ``poll`` for the rest. While a call waits for a reply through the channel
        (``_chan_seq``), the channel's reply slot is read too (before each sleep as well)."""
        s, poll, pollin = self._sock, zmq.zmq_poll, self._pollin
        if s.closed:  # (``drain``, ``wait_ack``: a raw ZMQError before)
            raise ClientClosed("this Client is closed")
        spin = min(self._reply_spin, wait_ms * 1e-3)
        ready = False
        chan, seq = self._chan, self._chan_seq
        if seq:
            got = self._chan_reply(chan, seq)  # type: ignore[arg-type]
            if got is not None:
                return got
        if spin > 0:
            end = time.perf_counter() + spin
            if seq:
                while not (ready := bool(poll(pollin, 0))) and time.perf_counter() < end:
                    got = self._chan_reply(chan, seq)  # type: ignore[arg-type]
                    if got is not None:
                        return got
            else:
                while not (ready := bool(poll(pollin, 0))) and time.perf_counter() < end:
                    pass
            wait_ms = max(0, wait_ms - int(spin * 1e3))
        if not ready and not poll(pollin, wait_ms if wait_ms > 0 else 0):
            return None
        try:
            return P.decode_reply(recv_message(s))
        except zmq.Again:
            return None

    def _chan_reply(self, chan: ClientEnd, seq: int) -> tuple[dict[str, Any], list[Any]] | None:
        """The reply to ``seq`` from the channel's slot, or None (not there yet; or there only
        as a note that it went over ZMQ alone, which ``call`` then waits for)."""
        frames = chan.chan.reply(seq, P.MAX_INDEX_FRAMES + 1)
        if frames is None:
            return None
        if isinstance(frames, str):  # too big for the slot (or garbled): the ZMQ copy is read
            self._chan_seq = 0
            return None
        self._slot_reply = True
        return P.decode_reply(frames)

    def _send(self, frames: list[bytes]) -> None:
        """One message, NOBLOCK, frame by frame with int flags (``send_multipart`` costs ~2 us
        more); a DEALER refuses a message at its first frame (``zmq.Again``), never midway."""
        send, last = self._sock.send, len(frames) - 1
        for i, f in enumerate(frames):
            send(f, _MORE if i < last else _NOBLOCK)

    def call(self, cmd: str, fields: dict[str, Any] | None = None, arrays: Iterable[Any] = (),
             timeout: float | None = None) -> tuple[dict[str, Any], list[Any]]:
        """Send one command, return (reply header, reply index arrays). Raw access; prefer the
        typed methods."""
        timeout = self.timeout if timeout is None else check_timeout(timeout)
        s = self._sock
        if s.closed:  # (a raw ZMQError, ENOTSOCK, before)
            raise ClientClosed(f"{cmd}: this Client is closed")
        rid = next(self._ids)
        frames = P.encode_request(cmd, rid, fields, arrays)
        deadline = time.monotonic() + timeout
        chan = self._chan
        if chan is not None and chan.chan.peer_closed():  # unregistered or reaped: back to ZMQ
            self._close_channel()
            chan = None
        try:
            sent = chan is not None and chan.send(rid, frames)
        except ConnectionError as e:
            # the daemon that granted the channel is gone, its loop first (it closes the
            # wake-up socket after its loop ended): no one read the request. A daemon that
            # listens at the address now (a restart) and that ZMQ is connected to gets it
            # instead; with none, unreachable at once rather than after the timeout.
            self._close_channel()
            if not zmq.zmq_poll([(s, _POLLOUT)], 0):
                why = f"{e} and no daemon is connected there now"
                raise DaemonGone(f"{cmd}: the hicache daemon at {self.address} is gone "
                                 f"({why})", why) from None
            sent = False
        if sent:
            self._chan_seq = rid
        else:
            self._send_zmq(cmd, frames, timeout)
        now = self._last_send = time.monotonic()
        self.sent += 1
        self._slot_reply = False
        try:
            return self._reply_to(cmd, rid, frames, deadline, now, timeout)
        except CommandRefused:  # answered: the slot is free again
            raise
        except BaseException:  # no reply read (a timeout, an interrupt): the daemon may still
            if self._chan_seq:  # read that slot, so it is never written again
                self._close_channel()
            raise
        finally:
            self._chan_seq = 0

    def _send_zmq(self, cmd: str, frames: list[bytes], timeout: float) -> None:
        """Send ``frames`` over ZMQ; a daemon that is gone or unreachable within ``timeout``
        raises (``DaemonGone``, ``DaemonUnreachable``) instead."""
        s = self._sock
        try:
            self._send(frames)
        except zmq.Again:  # IMMEDIATE: no live connection to the daemon (yet)
            # a daemon that answered this client is gone: said at once, not after the timeout
            why = self._gone()
            if why is not None:
                raise DaemonGone(f"{cmd}: the hicache daemon at {self.address} is gone "
                                 f"({why})", why) from None
            if not zmq.zmq_poll([(s, _POLLOUT)], max(1, int(timeout * 1000))):
                raise DaemonUnreachable(f"{cmd}: cannot reach the hicache daemon at "
                                        f"{self.address} within {timeout:g} s") from None
            try:
                self._send(frames)
            except zmq.Again:
                raise DaemonUnreachable(f"{cmd}: the connection to {self.address} is gone "
                                        f"or full") from None

    def _gone(self) -> str | None:
        """Why the daemon that answered this client is gone (``gone_reason``), asked only while
        ZMQ holds no live connection to it (IMMEDIATE: no POLLOUT then; a socket file removed or
        replaced under a live daemon is not a daemon gone); None otherwise."""
        if not self.answered or zmq.zmq_poll([(self._sock, _POLLOUT)], 0):
            return None
        return gone_reason(self.address)

    def _reply_to(self, cmd: str, rid: int, frames: list[bytes], deadline: float, now: float,
                  timeout: float) -> tuple[dict[str, Any], list[Any]]:
        """Wait for the reply to request ``rid`` (keeping the pushes that come meanwhile, and
        dropping a late reply to an earlier call, but for the acks it carries). Every
        ``GONE_CHECK_S`` without it, a daemon that answered this client before and is gone now
        (``gone_reason``) ends the wait: ``GoneMidCall``. A request sent through the channel
        that the daemon dropped unread (a reap, or its stop, in the loop turn before it would
        have read it; checked every ``CHANNEL_CHECK_S``) did not run: its ``frames`` go again
        over ZMQ, where the daemon answers it as any request of this client now."""
        while True:
            left = deadline - now
            tick = CHANNEL_CHECK_S if self._chan_seq else GONE_CHECK_S
            got = self._recv(max(1, int(min(left, tick) * 1000))) if left > 0 else None
            if got is None:
                now = time.monotonic()
                if self._chan_seq and self._chan is not None and self._chan.chan.unread(rid):
                    self._chan_seq = 0
                    self._close_channel()
                    self._send_zmq(cmd, frames, max(0.001, deadline - now))
                    self.sent += 1
                    continue
                if now >= deadline:
                    raise NoReply(f"{cmd}: no reply from the hicache daemon at "
                                  f"{self.address} within {timeout:g} s")
                why = self._gone()
                if why is None:
                    continue
                got = self._recv(0)  # what it sent before it went (its last reply) comes first
                if got is None:
                    raise GoneMidCall(f"{cmd}: the hicache daemon at {self.address} went while "
                                      f"this call waited for its reply ({why}); whether it ran "
                                      f"the command is unknown", why)
            h, arr = got
            if h.get("id") != rid:  # a push (it has no id), or a late reply to a call that
                self._pushed(h)  # timed out: dropped, but for the acks it carries
                now = time.monotonic()
                continue
            self.answered = True
            if not h.get("ok"):
                if self._slot_reply:
                    self._zmq_copy(rid, deadline)
                err = h.get("error") or {}
                raise CommandRefused(cmd, str(err.get("code", "unknown")),
                                     str(err.get("message", "")))
            if "ack" in h:
                self._keep_ack(h["ack"])
            if "op" in h:  # an op issued: by this registration (``wait_ack`` of a bare id)
                self._issued_by(h["op"])
            return h, arr

    def _zmq_copy(self, rid: int, deadline: float) -> None:
        """After a refusal read from the channel's slot: read the socket up to the ZMQ copy of
        that reply (the daemon sends every reply over ZMQ too, after what it pushed before),
        keeping the pushes on the way, so that what the daemon pushed before refusing is in
        (a stopping daemon pushes its last acks, then refuses the waiting ``poll_acks``; the
        slot's refusal overtook them, and ``wait_ack`` read a completed op as refused).
        Bounded by ``deadline`` and ``ZMQ_COPY_WAIT_S`` (a copy its queue had no room for
        never comes)."""
        self._chan_seq = 0  # the socket alone from here
        end = min(deadline, time.monotonic() + ZMQ_COPY_WAIT_S)
        while (left := end - time.monotonic()) > 0:
            got = self._recv(max(1, int(left * 1000)))
            if got is None or got[0].get("id") == rid:
                return
            self._pushed(got[0])

    # ------------------------------------------------------------------ liveness
    def heartbeat(self, full: bool = False, timeout: float | None = None) -> dict[str, Any]:
        """Tell the daemon we are alive; ``full`` adds its layout, host rows and stage layers."""
        h, _ = self.call("heartbeat", {"full": True} if full else None, timeout=timeout)
        self._heartbeat_from(h)
        return h

    def _heartbeat_from(self, h: dict[str, Any]) -> None:
        """``maybe_heartbeat``'s interval: a third of the daemon's heartbeat timeout."""
        self.heartbeat_interval = max(0.1, float(h.get("heartbeat_timeout", 9.0)) / 3)

    def maybe_heartbeat(self, timeout: float | None = None) -> dict[str, Any] | None:
        """Heartbeat only if nothing was sent for ``heartbeat_interval``: the reply when sent
        (``registered``, ``reaped``: whether the daemon still holds this client's worker, and
        why not), else None."""
        if time.monotonic() - self._last_send < self.heartbeat_interval:
            return None
        return self.heartbeat(timeout=timeout)

    # ------------------------------------------------------------------ registration
    def register(self, pools: Any = None, *, layout: Mapping[str, Any] | None = None,
                 device_rows: Mapping[str, int] | None = None,
                 buffers: Mapping[str, list] | None = None, mode: str | None = None,
                 tp_rank: int = 0, events: int | Sequence[Any] = 0,
                 name: str | None = None, fds: Sequence[int] = (),
                 timeout: float | None = None) -> dict[str, Any]:
        """Register a worker's device pools: a ``DevicePools`` or the raw fields. ``events`` (GPU):
        a count of interprocess events to create (``self.backup_events``) or events/handles.
        ``fds`` (CPU): the sealed memfds the buffers' handles name by place (``"fd": i``),
        handed in on the daemon's descriptor socket first (``hand_in``); they stay open here."""
        if pools is not None:
            layout = pools.layout.to_dict()
            device_rows = dict(pools.rows)
            buffers = pools.handles()
            mode = pools.mode
            fds = pools.fds()
            self._device = pools.device
        if layout is None or device_rows is None or buffers is None or mode is None:
            raise ValueError("register needs pools, or layout, device_rows, buffers and mode")
        handles: list[str] = []
        if events:
            if mode != "cuda":
                raise ValueError("events are CUDA interprocess events; CPU mode has none")
            from hicache.core.ipc import encode_b64, make_ipc_events

            if isinstance(events, int):
                self.backup_events, handles = make_ipc_events(events, self._device or "cuda")
            else:
                self.backup_events = [e for e in events if not isinstance(e, str)]
                handles = [e if isinstance(e, str) else encode_b64(e.ipc_handle()) for e in events]
        fields = {"layout": dict(layout), "device_rows": dict(device_rows),
                  "buffers": dict(buffers), "mode": mode, "tp_rank": tp_rank, "name": name}
        if handles:
            fields["events"] = handles
        if self._chan is not None and not self._chan.usable():  # reaped, or the daemon was
            self._close_channel()  # restarted: a new registration asks for a new channel
        if self._want_channel is not False and self._chan is None:
            self.channel(timeout)  # first: a refused channel=True registers nothing
        if fds:
            fields["fd_token"] = self.hand_in(fds, timeout)
        h, _ = self.call("register", fields, timeout=timeout)
        self.registered = h
        self._session = h.get("session")
        if "heartbeat_timeout" in h:  # ``maybe_heartbeat`` keeps this registration alive
            self._heartbeat_from(h)
        self.row_epoch += 1
        self.stage_layers = list(h.get("stage_layers", []))
        self._layer_pos = {g: i for i, g in enumerate(self.stage_layers)}
        if self._spin_set is None:
            self._reply_spin = REPLY_SPIN_US_GPU * 1e-6 if mode == "cuda" else 0.0
        if mode == "cuda" and h.get("load_events"):
            import base64

            import torch

            dev = torch.device(self._device or "cuda")
            self._load_events = [[torch.cuda.Event.from_ipc_handle(dev, base64.b64decode(x))
                                  for x in s] for s in h["load_events"]]
        return h

    def hand_in(self, fds: Sequence[int], timeout: float | None = None) -> int:
        """Hand ``fds`` (a CPU worker's sealed pool memfds; they stay open here) to the daemon
        on its descriptor socket for this client's next ``register``; the token that names
        them there (``register``'s ``fd_token``). ``register`` with ``fds`` does this. A
        daemon gone between the reply and the hand-in is ``DaemonGone``, as for any call."""
        got, _ = self.call("hand_in", {"count": len(fds)}, timeout=timeout)
        try:
            send_fds(str(got["fd_socket"]), int(got["fd_token"]), list(fds), "device pools")
        except OSError as e:
            why = gone_reason(self.address)
            if why is None:
                raise
            raise DaemonGone(f"hand_in: the hicache daemon at {self.address} is gone ({why}; "
                             f"the descriptors could not be handed in: {e})", why) from None
        return int(got["fd_token"])

    def unregister(self, timeout: float | None = None) -> dict[str, Any]:
        """Free this client's rows and close its device mappings; the daemon forgets the
        client, its channel included (``register`` asks for a new one)."""
        h, _ = self.call("unregister", timeout=timeout)
        self.row_epoch += 1
        self._close_channel()
        self.registered = None
        self._session = None
        self._load_events = []
        return h

    # ------------------------------------------------------------------ host rows
    def alloc(self, counts: Mapping[str, int], request: str | None = None,
              timeout: float | None = None) -> dict[str, list[int]]:
        h, arr = self.call("alloc", {"counts": dict(counts), "request": request}, timeout=timeout)
        return {s: list(arr[i]) for s, i in h["rows"].items()}

    def free(self, rows: Mapping[str, Any], request: str | None = None,
             timeout: float | None = None) -> dict[str, Any]:
        spaces = list(rows)
        h, _ = self.call("free", {"rows": {s: i for i, s in enumerate(spaces)},
                                  "request": request},
                         [_as_ids(rows[s]) for s in spaces], timeout=timeout)
        return h

    def reset(self, timeout: float | None = None) -> dict[str, Any]:
        """Free every host row of this client (and its sparse requests), each once the
        operations using it ended (``docs/protocol.md``)."""
        h = self.call("reset", timeout=timeout)[0]
        self.row_epoch += 1
        return h

    # ------------------------------------------------------------------ transfers
    @staticmethod
    def _items(items: Items) -> tuple[list[dict[str, Any]], list[Any]]:
        """Header items and index frames of a backup / load; an id list given twice (the same
        object) goes in one frame."""
        frames: list[Any] = []
        seen: dict[int, int] = {}
        out = []
        for key, spec in items.items():
            idx = []
            for x in (spec[0], spec[1]):
                f = seen.get(id(x))
                if f is None:
                    f = seen[id(x)] = len(frames)
                    frames.append(_as_ids(x))
                idx.append(f)
            it: dict[str, Any] = {"space" if key in _SPACES else "pool": key,
                                  "src": idx[0], "dst": idx[1]}
            if len(spec) > 2 and spec[2] != "row":
                it["unit"] = spec[2]
            out.append(it)
        return out, frames

    def _op(self, kind: str, h: Mapping[str, Any], arrays: Sequence[Any] = ()) -> Op:
        ack = None
        if "ack" in h:  # inline: the ack is the caller's now (``op.ack``), never handed out
            ack = self._acks.pop(h["op"], None)  # again (the ZMQ copy of a reply read from
            self._took(int(h["op"]))  # the channel's slot carries it too)
        rows = {s: list(arrays[i]) for s, i in h["rows"].items()} if "rows" in h else None
        return Op(int(h["op"]), kind, ack, h.get("event_set"), h.get("host_row"), rows,
                  issued=h.get("issued"), failed=bool(h.get("failed")), session=self._session)

    def backup(self, items: Items, *, wait_event: int | None = None,
               timeout: float | None = None) -> Op:
        """Device rows -> host rows. ``items``: {pool or space: (device ids, host ids[, unit])};
        unit "token" copies token ids of token-format pools. ``wait_event`` (GPU): index of the
        backup event the engine recorded after writing the KV."""
        return self._copy("backup", items, wait_event, timeout)

    def backup_new(self, items: Mapping[str, Any], *, request: str | None = None,
                   wait_event: int | None = None, timeout: float | None = None) -> Op:
        """Device rows -> host rows the daemon allocates for ``(this client, request)``, in one
        round trip. ``items``: {pool or space: device ids} (whole rows); items of one space
        share one set of new rows. ``op.rows`` = {space: host rows, in the order of the ids}."""
        its: list[dict[str, Any]] = []
        frames: list[Any] = []
        for key, ids in items.items():
            its.append({"space" if key in _SPACES else "pool": key,
                        "src": len(frames)})
            frames.append(_as_ids(ids))
        fields: dict[str, Any] = {"items": its, "alloc": True, "request": request}
        if wait_event is not None:
            fields["wait_event"] = wait_event
        h, arr = self.call("backup", fields, frames, timeout=timeout)
        return self._op("backup", h, arr)

    def load(self, items: Items, *, wait_event: int | None = None,
             timeout: float | None = None) -> Op:
        """Host rows -> device rows. ``items``: {pool or space: (host ids, device ids[, unit])}.
        ``wait_event`` (GPU): index of an event of ``backup_events`` the engine recorded on its
        stream: the copy starts only after it (e.g. after work still writing those rows)."""
        return self._copy("load", items, wait_event, timeout)

    def _copy(self, cmd: str, items: Items, wait_event: int | None,
              timeout: float | None) -> Op:
        """One BACKUP or LOAD (``cmd``) of ``items`` between rows the caller names."""
        its, frames = self._items(items)
        fields: dict[str, Any] = {"items": its}
        if wait_event is not None:
            fields["wait_event"] = wait_event
        return self._op(cmd, self.call(cmd, fields, frames, timeout=timeout)[0])

    def swap_out(self, slot: int, *, request: str | None = None, host_row: int | None = None,
                 wait_event: int | None = None, timeout: float | None = None) -> Op:
        """Copy request slot ``slot`` of every req_slot pool to a host row (allocated for
        ``request`` unless ``host_row`` is given); ``op.host_row`` names it."""
        f: dict[str, Any] = {"slot": slot, "request": request}
        if host_row is not None:
            f["host_row"] = host_row
        if wait_event is not None:
            f["wait_event"] = wait_event
        return self._op("swap_out", self.call("swap_out", f, timeout=timeout)[0])

    def swap_in(self, host_row: int, slot: int, *, release: bool = True,
                request: str | None = None, timeout: float | None = None) -> Op:
        """Copy a swapped-out request back into ``slot`` (any slot); ``release`` frees the host
        row once the copy has read it."""
        f = {"host_row": host_row, "slot": slot, "release": release, "request": request}
        return self._op("swap_in", self.call("swap_in", f, timeout=timeout)[0])

    def clear_slot(self, slots: Sequence[int], *, draft: Mapping[str, Any] | None = None,
                   timeout: float | None = None) -> Op:
        """Zero every req_slot pool row of ``slots`` (a fresh request), or with ``draft``
        (``seq_lens``, ``accept_lens``, ``num_draft``) void unaccepted MTP draft positions."""
        f: dict[str, Any] = {"slots": [int(s) for s in slots]}
        if draft is not None:
            f["draft"] = {k: (list(v) if isinstance(v, (list, tuple)) else v)
                          for k, v in draft.items()}
        return self._op("clear_slot", self.call("clear_slot", f, timeout=timeout)[0])

    # ------------------------------------------------------------------ inspection / control
    def stats(self, timeout: float | None = None) -> dict[str, Any]:
        return self.call("stats", timeout=timeout)[0]

    def buffer_infos(self, timeout: float | None = None) -> dict[str, list[tuple[int, int, int]]]:
        h, _ = self.call("buffer_infos", timeout=timeout)
        return {k: [tuple(x) for x in v] for k, v in h["pools"].items()}

    def shutdown(self, timeout: float | None = None) -> dict[str, Any]:
        """Stop the daemon (one started with ``--allow-shutdown``; any other refuses:
        ``CommandRefused``). Returns its reply, ``{"stopping": True}``, or, when the daemon
        went before that reply was read, ``{"stopping": True, "gone": why}``: this socket
        drops what it had not read when the connection goes (``ZMQ_IMMEDIATE``;
        docs/reliability.md, section 7), so a reply that arrived as the daemon exited can be
        lost, and a daemon gone is what was asked for ("gone" does not prove that this
        command stopped it: its exit status does). Unreachable or silent daemons raise as any
        call does."""
        try:
            return self.call("shutdown", timeout=timeout)[0]
        except GoneMidCall as e:
            return {"stopping": True, "gone": e.why}
