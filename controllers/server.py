"""The daemon's ZMQ loop: ROUTER socket in, handler table, replies and pushed acks out.

One thread owns the socket. Each turn: take the requests waiting off it (up to ``BATCH``), then
handle them (decode -> handler -> reply), deliver the acks of operations the engine completed
(the engine wakes the loop through a pipe), and at most every ``HOUSEKEEPING_S`` (a quarter of
the heartbeat timeout when that is shorter) reap clients silent for longer than the heartbeat
timeout, up to the last time the loop had read every request that waited (``catch_up``: a loop
that stood still reaps nobody for it; nor does time the process stood still, seen in a poll
back late, ``_came_back``, or awake, ``_off_cpu``; each pass scans the channels before it
reaps), bind an ipc socket file removed meanwhile again (while the daemon holds the socket's
lock), and refresh the gauges. Local clients may also send through a shared-memory channel
(``hicache.core.channel``): the loop scans the channels wherever it polls the socket, and a
sleeping loop also wakes on their wake-up socket; a channel request is handled exactly like a
socket one, its reply written to the channel's slot and sent over the socket too. While the
engine is idle the loop waits on the socket (and that wake-up socket) alone. With ``spin_us`` >
0 it busy-polls that long after the last request before blocking again: CPU traded for the
wake-up latency of the next request (worth it on a dedicated core, a loss on an oversubscribed
one), except while the scheduler's issuer thread issues a load's later layers: then the loop
blocks on the socket and the wake-up pipe, so the GIL stays with the issuer until a request or
a completion comes. Under CURVE each client key has a name (its file in the clients directory)
and a client is bound to the key that first spoke for it (``Registry.touch``). Nothing per
command is logged (the hot path stays lean); failures are counted in metrics, and internal
errors are logged with their traceback.
"""
from __future__ import annotations

import logging
import os
import time
from collections import deque
from pathlib import Path
from typing import Any, Callable

import zmq

from hicache.core import protocol as P
from hicache.core.errors import UsageError

from .handlers import HANDLERS, error_code
from .registry import ClientState
from .catch_up import CatchUp
from .state import DaemonState

log = logging.getLogger("hicache.server")
HOUSEKEEPING_S = 0.5
BATCH = 32  # requests handled per wake-up before completions and housekeeping get a turn
# bytes of requests taken off the socket before any is handled: past this no more are taken
# (held in the daemon beside what libzmq queues, RCVHWM per peer)
TAKE_BYTES = P.MAX_MESSAGE_BYTES
# a command that held the loop longer than this (a long inline copy) counts its client's
# silence from its reply, not from its arrival (the client could send nothing meanwhile), and
# so does a client answered just before it (its reply may have left the process only after);
# a sleeping poll back this much past its timeout means the process stood still (stopped,
# starved): that time counts toward no client's silence (``Registry.stood_still``)
STALL_S = 0.25
POLL_MS = 100  # a sleeping poll's timeout
# ZMQ drops (and disconnects) a peer sending a frame above this; frames between the protocol's
# caps and this limit get a protocol error reply instead (a visible refusal, not a hang).
# libzmq's MAXMSGSIZE bounds each frame, not the multipart message (libzmq holds a message's
# frames until its last one arrives: docs/reliability.md, section 7); the frame count and the
# message total are checked by ``recv_request`` as frames are taken off the socket, before any
# decode.
TRANSPORT_MAX_FRAME = 2 * max(P.MAX_HEADER_BYTES, P.MAX_INDEX_BYTES)
# complete messages queued per peer before libzmq stops reading that peer's connection
TRANSPORT_RCVHWM = 8
# how long closing the socket at shutdown may wait for queued replies and acks to go out
CLOSE_LINGER_MS = 1000
# what a stopping daemon still answers: ``shutdown`` itself, and ``poll_acks`` (a query: an
# engine waiting on its last acks gets them in the reply, which a channel's slot keeps, where
# pushes unread when the socket closes are lost: docs/reliability.md, section 7)
ANSWERED_WHILE_STOPPING = frozenset(("shutdown", "poll_acks"))
_KEEP = 2 + P.MAX_INDEX_FRAMES  # identity, header, index frames
_COPY_MAX = 64 << 10  # index frames up to this size are taken as bytes (cheaper than a Frame)
_NOBLOCK = int(zmq.NOBLOCK)
_MORE = int(zmq.SNDMORE) | _NOBLOCK
_POLLIN = int(zmq.POLLIN)
_EVENTS = int(zmq.EVENTS)


def router_socket(ctx: zmq.Context) -> zmq.Socket:
    """The daemon's ROUTER socket with its options (``hicache bench control``'s echo uses the
    same, so the baseline pays what the daemon's transport pays)."""
    s = ctx.socket(zmq.ROUTER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a failed send raises instead of vanishing
    s.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_FRAME)
    s.setsockopt(zmq.SNDHWM, 10_000)
    s.setsockopt(zmq.RCVHWM, TRANSPORT_RCVHWM)
    return s


def recv_request(sock: zmq.Socket, curve: bool = False
                 ) -> tuple[list[bytes], str | None, str | None]:
    """One message off a ROUTER socket, frame by frame: at most the identity, a header and
    ``MAX_INDEX_FRAMES`` index frames, ``MAX_MESSAGE_BYTES`` in all, are kept (as bytes; an
    index frame over ``_COPY_MAX`` as its ``zmq.Frame``, whose buffer is read in place); the
    rest is taken off the socket and dropped at once. Returns (frames, why the message is
    refused or None, the sender's CURVE key name when ``curve``, else None). Raises
    ``zmq.Again`` when no message waits. (``hicache bench control``'s echo receives with it
    too.) Frames come as ``zmq.Frame``: ``Frame.more`` is read in C, where
    ``sock.get(RCVMORE)`` makes a Python enum lookup per frame."""
    recv = sock.recv
    f = recv(_NOBLOCK, copy=False)
    frames = [f.bytes]
    n = total = 0
    over = False
    user = None
    while f.more:
        f = recv(_NOBLOCK, copy=False)
        if n == 0 and curve:  # the key's name, set by our ZAP handler: who sent this
            user = f.get("User-Id")
        n += 1
        total += len(f)
        if not over and (n > _KEEP - 1 or total > P.MAX_MESSAGE_BYTES):
            over = True
        if not over:  # the header as bytes; a large index frame stays zero-copy
            frames.append(f.bytes if n == 1 or len(f) <= _COPY_MAX else f)
    if not over:
        return frames, None, user
    if n > _KEEP - 1:
        return frames[:2], f"{n - 1} index frames; at most {P.MAX_INDEX_FRAMES}", user
    return frames[:2], f"message of {total} bytes exceeds {P.MAX_MESSAGE_BYTES}", user


def key_names(directory: str) -> dict[bytes, str]:
    """CURVE client identities of the daemon's config: each public key file ``NAME.key`` in the
    clients directory makes its key (z85, as ``zmq.auth`` loads it) act as client ``NAME``."""
    import zmq.auth

    out: dict[bytes, str] = {}
    for path in sorted(Path(directory).glob("*.key")):
        public, _ = zmq.auth.load_certificate(str(path))
        out[public] = path.stem
    return out


def _named_authenticator(ctx: zmq.Context, clients: str) -> Any:
    """A ZAP handler (thread) that admits the listed keys and names each message's sender
    (``User-Id``) by its key's file name."""
    from zmq.auth.thread import ThreadAuthenticator
    from zmq.utils import z85

    names = key_names(clients)

    class Named(ThreadAuthenticator):
        def curve_user_id(self, client_public_key: bytes) -> str:
            key = z85.encode(client_public_key) if len(client_public_key) == 32 \
                else client_public_key
            return names.get(key, "")

    return Named(ctx)


class Server:
    def __init__(self, state: DaemonState, address: str, spin_us: float = 0.0,
                 curve: tuple[bytes, bytes, str] | None = None) -> None:
        self.state = state
        self.address = address
        self.ctx = zmq.Context()
        self.sock = router_socket(self.ctx)
        self.auth: Any = None
        self.user: str | None = None  # CURVE: name of the key that sent the current message
        # requests taken off the socket and not handled yet: (frames, refusal, CURVE key name)
        self._taken: deque[tuple[list[Any], str | None, str | None]] = deque()
        if curve is not None:  # CURVE server; the ZAP handler admits listed client keys only
            public, secret, clients = curve
            state.curve_keys = {name: key.decode() for key, name in key_names(clients).items()}
            self.auth = _named_authenticator(self.ctx, clients)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=clients)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_server = True
        self.ipc_path: str | None = None
        self.ipc_ino = -1
        self.ipc_lost = False  # its socket file was found removed or replaced (logged once)
        # whether this daemon holds the socket's lock (taken again if its file was removed):
        # the condition for binding a removed socket file again (``_check_socket_file``)
        self.relock: Callable[[], bool] | None = None
        if address.startswith("ipc://"):
            self.ipc_path = address[len("ipc://"):]
            old = os.umask(0o177)  # the socket file is created 0600
            try:
                self._bind(address)
            finally:
                os.umask(old)
            os.chmod(self.ipc_path, 0o600)
            self.ipc_ino = os.lstat(self.ipc_path).st_ino
        else:
            self._bind(address)
        self.endpoint = self.sock.getsockopt(zmq.LAST_ENDPOINT).decode()
        self._wake_r, self._wake_w = os.pipe()
        os.set_blocking(self._wake_r, False)
        os.set_blocking(self._wake_w, False)
        self.poller = zmq.Poller()
        self.poller.register(self.sock, zmq.POLLIN)
        self.poller.register(self._wake_r, zmq.POLLIN)
        self._stop = False
        self._wake_polled = False
        self._next_house = 0.0
        # when the loop last read every request that waited (``catch_up``): what silence is
        # measured against; a saturated socket holds at most RCVHWM per peer, read round-robin
        self.catch = CatchUp(time.monotonic(),
                             (state.registry.max_clients + 64) * TRANSPORT_RCVHWM)
        # a dead client is reaped within the heartbeat timeout plus at most a quarter of it, and
        # whatever time the loop took to read what waited after it stood still (``serve``)
        self.house_s = min(HOUSEKEEPING_S, state.heartbeat_timeout / 4)
        self.spin_s = spin_us / 1e6
        # the loop's time awake since its last sleeping poll (or check): where it began, wall
        # and process CPU, and the wall time its commands took in it (``_off_cpu``)
        self._awake = (0.0, 0.0)  # (set by ``serve``)
        self._held = 0.0

    def _bind(self, address: str) -> None:
        try:
            self.sock.bind(address)
        except zmq.ZMQError as e:
            self.sock.close(0)
            if self.auth is not None:
                self.auth.stop()
            self.ctx.term()
            raise UsageError(f"cannot bind {address}: {e}") from None

    # ------------------------------------------------------------------ wake-up from the engine
    def wake(self) -> None:
        try:
            os.write(self._wake_w, b"x")
        except (BlockingIOError, OSError):
            pass  # pipe full: the loop is awake anyway

    def _drain_wake(self) -> None:
        try:
            while os.read(self._wake_r, 4096):
                pass
        except (BlockingIOError, OSError):
            pass

    def stop(self) -> None:
        self._stop = True
        self.wake()

    # ------------------------------------------------------------------ loop
    def serve(self) -> None:
        st, sock = self.state, self.sock
        sched = st.scheduler
        items, zmq_poll = [(sock, _POLLIN)], zmq.zmq_poll
        chans = st.registry.channels  # clients' shared-memory channels (scanned in place)
        spin = self.spin_s
        last = 0.0
        # silence is counted up to the last time the loop had read every request waiting
        # (``catch``), not up to now: after a stall (a long inline copy, the process
        # stopped) requests wait unread, and their senders are not silent
        catch = self.catch
        self._awake, self._held = (time.monotonic(), time.process_time()), 0.0
        while not self._stop and not st.stopping:
            now = time.monotonic()
            if now >= self._next_house:
                self._next_house = now + self.house_s
                # before the reap. A stall past STALL_S outlasts any busy-poll window (100 ms
                # at most), so a sleeping poll, checked before it, follows it; this check
                # covers a stop that lands just before a spin turn notes its traffic (the loop
                # may then spin on, with no sleeping poll). Untested: no fault places it there
                self._off_cpu()
                mark = st.watch.begin()
                self._housekeeping(now)
                st.watch.step("housekeeping", mark)
            # no busy-poll while the issuer thread issues a load's later layers: the spin would
            # take the GIL from it (each handover waits out the switch interval)
            if spin and time.perf_counter() - last < spin and not sched.issuing():
                # busy-poll a short while after traffic: no sleep / wake-up between requests.
                # Each turn takes the socket's requests, then the channels', then completions:
                # a peer that keeps the socket busy starves neither the channels nor the acks
                got = bool(zmq_poll(items, 0))
                if got:
                    self._request()
                else:  # (a channel's request waiting then is read before the next reap)
                    catch.empty(now)
                if chans and self._channels():
                    got = True
                if got:
                    last = time.perf_counter()
                if not st.idle():
                    st.collect()
                self.send_acks()
                continue
            wake = self._wake_sock()
            if st.idle():  # nothing can complete: wait on the socket (and the wake socket) alone
                asleep = self._off_cpu()
                ready = zmq_poll(items if wake is None else [items[0], (wake.fd, _POLLIN)],
                                 POLL_MS)
                self._came_back(asleep)
                if sock not in [r[0] for r in ready]:
                    catch.empty(now)
                if ready and self._woken(ready, wake):
                    last = time.perf_counter()
                continue
            asleep = self._off_cpu()
            events = dict(self.poller.poll(POLL_MS))
            self._came_back(asleep)
            if sock not in events:
                catch.empty(now)
            if events and self._woken(events, wake):
                last = time.perf_counter()
            if self._wake_r in events:
                self._drain_wake()
            st.collect()
            self.send_acks()

    def _came_back(self, asleep: float) -> None:
        """After a sleeping poll begun at ``asleep`` (``_off_cpu`` just before it): back more
        than ``STALL_S`` past its timeout, less the CPU the process's threads took meanwhile,
        the process stood still that long (stopped, or starved of CPU), with replies it had
        sent maybe still in its own ZMQ queue: that time counts toward no client's silence. A
        poll back late because another thread of the daemon held the GIL is no stop: that
        thread's CPU time covers it (requests that waited meanwhile are read as a catch-up)."""
        back, cpu = time.monotonic(), time.process_time()
        self._stood_still(back - asleep - POLL_MS / 1e3 - (cpu - self._awake[1]), back,
                          "in its poll")
        self._awake, self._held = (back, cpu), 0.0  # (from the poll's return)

    def _stood_still(self, secs: float, end: float, where: str) -> None:
        """Past ``STALL_S``, the ``secs`` up to ``end`` count toward no client's silence
        (``Registry.stood_still``), with one warning."""
        if secs > STALL_S:
            n = self.state.registry.stood_still(end - secs, end)
            log.warning("the loop stood still %.1f s %s (the process stopped or starved): not "
                        "counted toward the silence of %d client(s)", secs, where, n)

    def _off_cpu(self) -> float:
        """The loop's time awake since its last sleeping poll or check, less its commands' wall
        time and the CPU time of the process's threads: past ``STALL_S`` the process stood
        still between two steps or inside one that is not a command (stopped or starved while
        awake: a SIGSTOP that lands outside the poll), and that time counts toward no client's
        silence, as a stall in the poll does (``_came_back``; a command that held the loop
        credits its own clients, ``_handle``). The process's CPU, not the loop thread's: while
        another thread holds the GIL (the load issuer) the loop waits off the CPU but the
        process runs, and that is no stop. Time when no thread ran is at least the wall time
        less the process's CPU time, and the CPU its commands took is subtracted twice, so this
        undercounts, never overcounts. Called before each sleeping poll and each housekeeping
        pass (the reap); returns now."""
        now, cpu = time.monotonic(), time.process_time()
        off = (now - self._awake[0]) - self._held - (cpu - self._awake[1])
        self._awake, self._held = (now, cpu), 0.0
        self._stood_still(off, now, "between its polls")
        return now

    def _wake_sock(self) -> Any:
        """The channels' wake-up socket once the first channel made it (added to the poller)."""
        wake = self.state.wake_socket
        if wake is not None and not self._wake_polled:
            self.poller.register(wake.fd, zmq.POLLIN)
            self._wake_polled = True
        return wake

    def _woken(self, ready: Any, wake: Any) -> bool:
        """After a sleeping poll: the socket's requests, then the channels' (a wake-up says
        one may wait; each is scanned anyway, as a request can land between two polls). True
        when the socket was readable or a channel held a request."""
        socks = [r[0] for r in ready] if isinstance(ready, list) else ready
        got = self.sock in socks
        if got:
            self._request()
        if wake is not None:
            if wake.fd in socks:
                wake.drain()
            got = self._channels() or got
        return got

    def _channels(self) -> bool:
        """Handle the requests waiting in clients' channels (one per channel); True when there
        was one."""
        got = False
        for c in tuple(self.state.registry.channels):
            got = self._channel(c) or got
        return got

    def _channel(self, c: Any) -> bool:
        """Handle the request waiting in client ``c``'s channel, if one does (True). A
        malformed slot is answered like a malformed message (``bad_frame``)."""
        ch = c.channel
        if ch is None:  # closed by a request handled in this scan
            return False
        r = ch.request(_KEEP - 1)
        if r is None:
            return False
        seq, frames = r
        self.user = c.key
        if isinstance(frames, str):
            self._handle([c.ident], f"channel request: {frames}", (ch, seq))
        else:
            self._handle([c.ident, *frames], None, (ch, seq))
        return True

    def _request(self) -> None:
        """Take the requests waiting now off the socket, at most ``BATCH`` and no more once
        they hold ``TAKE_BYTES`` (the socket's ``EVENTS`` says whether another one is queued:
        no poll, no ``zmq.Again`` raised), then handle them in order, the channels scanned
        after each (a busy socket does not hold their requests back). When the socket was found
        empty, every request that waited then was read, and is handled when this returns
        (``catch``): taken first, a request a long command holds back is read before the next
        one can come (an engine's client, which sends again only after its reply, sending long
        commands back to back never keeps the loop from catching up; a peer that pipelines
        falls back to ``CatchUp``'s read count). Requests taken when a handler starts the stop
        are left in ``taken`` for ``refuse_pending``."""
        handle, events, st, taken = self._handle, self.sock.get, self.state, self._taken
        chans, clients, catch = st.registry.channels, st.registry.clients, self.catch
        empty_at = None
        if not taken:
            recv, clock, size = self._recv, time.monotonic, 0
            while len(taken) < BATCH and size <= TAKE_BYTES:
                t = clock()
                if not events(_EVENTS) & _POLLIN:
                    empty_at = t
                    break
                try:
                    m = recv()
                except zmq.Again:  # (not after POLLIN; as a poll that woke for nothing)
                    empty_at = t
                    break
                taken.append(m)
                size += sum(map(len, m[0]))
                catch.read()
        while taken:
            frames, err, user = taken.popleft()
            if user is not None:  # (what the socket said of this message's sender)
                self.user = user
            if chans and (c := clients.get(frames[0])) is not None and c.channel is not None:
                # a request its channel still holds is older (a client writes its slot only
                # while no reply is due, and goes over ZMQ after a call through it timed out):
                # it runs first, so one client's commands run in the order it sent them
                user = self.user
                self._channel(c)
                self.user = user
            handle(frames, err)
            if chans:  # a turn for each channel between two socket requests, as ZMQ's fair
                self._channels()  # queueing gives each of its peers
            if st.stopping:
                return
        if empty_at is not None:
            catch.empty(empty_at)

    def _send(self, ident: bytes, frames: list[Any]) -> bool:
        """One message to ``ident``: its frames, NOBLOCK (False: peer gone or its queue full;
        ROUTER refuses a message at its first frame, so nothing of it went out)."""
        send = self.sock.send
        try:
            send(ident, _MORE)
            last = len(frames) - 1
            for i, f in enumerate(frames):
                send(f, _MORE if i < last else _NOBLOCK)
        except zmq.ZMQError:
            return False
        return True

    def _recv(self) -> tuple[list[bytes], str | None, str | None]:
        return recv_request(self.sock, self.auth is not None)

    def _handle(self, frames: list[Any], refused: str | None = None,
                chan: tuple[Any, int] | None = None) -> None:
        """One request: decode, run its handler, reply. ``chan``: (channel, sequence) of a
        request that came through a channel: the reply goes into its slot first, then over ZMQ
        as well (the copy a client that stopped spinning sleeps on; the other one it drops)."""
        st = self.state
        mark = st.watch.begin()
        ident, body = frames[0], frames[1:]
        cmd, rid, code = "invalid", None, None
        c = None
        try:
            c = st.registry.touch(ident, time.monotonic(), self.user)
            if refused is not None:
                raise P.ProtocolError("bad_frame", refused)
            h, arrays = P.decode_request(body)
            cmd, rid = h["cmd"], h["id"]
            if st.stopping and cmd not in ANSWERED_WHILE_STOPPING:
                raise P.ProtocolError("shutting_down", "the daemon is stopping")
            fields, out = HANDLERS[cmd](st, c, h, arrays)
            reply = P.encode_reply(rid, fields, out)
        except Exception as e:  # noqa: BLE001 - every failure gets an error reply
            code = error_code(e)
            if cmd == "invalid" and isinstance(e, P.ProtocolError) and e.cmd is not None:
                cmd = e.cmd  # a known command whose fields were refused
            if rid is None and body:
                rid = P.request_id(body[0])
            if rid is None and chan is not None:  # a slot that did not parse: its sequence
                rid = chan[1]  # is the request's id (``core.channel``)
            if code is not None:  # a refusal: the command changed nothing
                why = str(e) if c is None or c.reaped is None else \
                    f"{e} (this client was {c.reaped}: its rows were freed and its device " \
                    f"mappings closed; register again)"
                reply = P.encode_error(rid, code, why)
            else:  # a daemon bug: answer, log, keep serving
                code = "internal"
                log.exception("command %s (id %s) failed", cmd, rid)
                reply = P.encode_error(rid, "internal", f"{cmd}: {type(e).__name__}: {e}"[:500])
        if chan is not None and not chan[0].closed:
            chan[0].put_reply(chan[1], reply)
        self._send(ident, reply)  # False: client gone or its queue full; the state is not lost
        took = st.watch.step(cmd, mark)
        self._held += took
        st.metrics.command(cmd, code is None, took, code)
        if c is not None:
            c.answered = time.monotonic()
        if took > STALL_S:  # its client could send nothing while it waited, nor could one
            t = time.monotonic()  # answered just before (its reply may have left only now)
            st.registry.stood_still(t - took, t, answered_since=t - took - STALL_S)
            # what waited meanwhile: none on the socket is a catch-up (what ``_request`` took off
            # it is handled before it returns, the channels by ``_housekeeping`` before a reap)
            if not self.sock.get(_EVENTS) & _POLLIN:
                self.catch.empty(t)
        if st.post:
            st.after_reply()
        if st.outbox or st.notices:
            self.send_acks()

    def send_acks(self) -> None:
        """Push the "issued" notices and the acks the state collected (completed operations)
        to their clients."""
        st = self.state
        if st.notices:
            notices, st.notices = st.notices, []
            # a send that fails (peer gone or full) loses nothing: its ack still says it is done
            for c, op_id, n, failed in notices:
                if st.registry.clients.get(c.ident) is c:  # (not to a later client of its identity)
                    self._send(c.ident, P.encode_issued(op_id, n, failed))
        if not st.outbox:
            return
        out, st.outbox = st.outbox, []
        for c, ack in out:
            self._deliver(c, ack)

    def _deliver(self, c: ClientState, ack: dict[str, Any]) -> None:
        st = self.state
        reg = st.registry
        now = reg.clients.get(c.ident)
        if now is not c:
            # an unregistered client is forgotten by the release step that ran in the same
            # ``collect`` as its last op's completion: its ack still goes to its (live)
            # identity, once, with nothing retained. A reaped one (retiring, or its reap
            # remembered for the identity) and an identity registered afresh get nothing.
            if now is None and c.ident not in reg.retiring and c.ident not in reg.reaped:
                self._send(c.ident, P.encode_ack(ack))
            return
        pushed = self._send(c.ident, P.encode_ack(ack))  # False: poll_acks still has it
        if st.registry.retain(c, ack["op"], ack, pushed):
            st.metrics.inc("acks_dropped")

    def _housekeeping(self, now: float) -> None:
        """Take the channels' requests a wake-up missed, reap the clients silent past the
        heartbeat timeout up to the last time the loop had found its socket empty, or its read
        count says it read what waited at a mark (``catch``), check the socket file is still
        ours, refresh gauges. The channels are scanned before the reap, so a channel request
        that waited when the socket was found empty was read (one per channel: a client writes
        its slot only while no reply is due) and its client is not silent; the loop marks its
        catch-ups by the socket alone."""
        st = self.state
        scan_from = time.monotonic()
        if st.wake_socket is not None:  # wake-ups sent while the loop busy-polled: drained, so
            st.wake_socket.drain()  # their requests are taken here (the next sleep would miss them)
            self._channels()
        self.catch.tick(now)
        # a catch-up noted during the scan (a long command's end) may follow a channel request
        # the scan had passed: silence counts up to the scan's start at most, when every
        # channel request waiting was read by it and every socket one by the catch-up
        for c in st.registry.silent(min(self.catch.at, scan_from), st.heartbeat_timeout):
            if st.reap(c, f"silent for {now - c.last_seen:.1f} s, over the heartbeat timeout "
                          f"of {st.heartbeat_timeout:g} s"):
                st.metrics.inc("clients_reaped")
        if self.ipc_path is not None:
            self._check_socket_file()
        st.refresh_gauges()

    def _check_socket_file(self) -> None:
        """A socket file removed while the daemon ran (a /tmp cleaner) is bound again, so new
        clients can connect (connected ones never noticed): only while this daemon holds the
        socket's lock (``relock``), so no other daemon can have taken the path. The old
        listener stays (its file is gone; libzmq listens on both). A file that replaced it
        (another process's) is left alone and logged once, until the path is ours again."""
        path = self.ipc_path or ""
        try:
            ours = os.lstat(path).st_ino == self.ipc_ino
            removed = False
        except FileNotFoundError:
            ours, removed = False, True
        except OSError:
            ours = removed = False
        if removed and self.relock is not None and self.relock() and self._bind_again():
            log.warning("the socket file %s was removed while this daemon ran (a /tmp "
                        "cleaner?): bound it again; new clients can connect", path)
            self.ipc_lost = False
            return
        if not ours and not self.ipc_lost:
            log.error("the socket file %s was %s while this daemon ran: no new client can "
                      "connect to it (connected ones still can); restart the daemon", path,
                      "removed and cannot be bound again" if removed else "replaced")
        self.ipc_lost = not ours

    def _bind_again(self) -> bool:
        """Bind the ipc address once more, the socket file then made 0600 (the umask is not
        changed at run time: it is the whole process's; until the chmod the file has the
        umask's mode, which gives no other user the write permission a connection needs
        under the usual 022, and the daemon's socket folder is 0700); False when the bind
        fails (its folder was removed too: logged by the caller)."""
        path = self.ipc_path or ""
        try:
            self.sock.bind(self.address)
        except zmq.ZMQError:
            return False
        try:
            self.ipc_ino = os.lstat(path).st_ino
            os.chmod(path, 0o600)
        except OSError as e:  # bound all the same: it serves, and is ours to remove
            log.warning("the socket file %s, bound again: %s", path, e)
        return True

    # ------------------------------------------------------------------ shutdown
    def refuse_pending(self) -> None:
        """Answer every request already waiting (state is stopping): ``shutting_down``, but
        for ``ANSWERED_WHILE_STOPPING``."""
        self._channels()
        for _ in range(10_000):
            if not self._taken and not zmq.zmq_poll([(self.sock, _POLLIN)], 0):
                return
            self._request()

    def close(self) -> None:
        try:
            self.poller.unregister(self.sock)
        except KeyError:
            pass
        # what is still queued (the reply to ``shutdown``, the last acks) goes out to peers that
        # are connected; one that is gone holds the close at most this long
        self.sock.close(CLOSE_LINGER_MS)
        reg = self.state.registry
        for c in tuple(reg.channels):
            reg.close_channel(c)
        if self.state.wake_socket is not None:
            self.state.wake_socket.close()
            self.state.wake_socket = None
        self.state.close_handout()
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.ipc_path:  # ours only: never another daemon's socket bound since
            try:
                if os.lstat(self.ipc_path).st_ino == self.ipc_ino:
                    os.unlink(self.ipc_path)
            except FileNotFoundError:
                pass
