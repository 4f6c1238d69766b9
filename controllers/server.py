"""The daemon's ZMQ loop: ROUTER socket in, handler table, replies and pushed acks out.

One thread owns the socket. Each turn: handle the requests waiting (decode -> handler ->
reply, up to ``BATCH``), deliver the acks of operations the engine completed (the engine wakes
the loop through a pipe), and at most every ``HOUSEKEEPING_S`` (a quarter of the heartbeat
timeout when that is shorter) reap clients silent for longer than the heartbeat timeout and
refresh the gauges. While the engine is idle the loop waits on the socket alone. With
``spin_us`` > 0 it busy-polls that long after the last request before blocking again: CPU
traded for the wake-up latency of the next request (worth it on a dedicated core, a loss on an
oversubscribed one). Nothing per command is logged (the hot path stays lean); failures are
counted in metrics, and internal errors are logged with their traceback.
"""
from __future__ import annotations

import logging
import os
import time
from typing import Any

import zmq

from hicache.core import protocol as P
from hicache.core.errors import UsageError

from .handlers import HANDLERS, error_code
from .registry import ClientState
from .state import DaemonState

log = logging.getLogger("hicache.server")
HOUSEKEEPING_S = 0.5
BATCH = 32  # requests handled per wake-up before completions and housekeeping get a turn
# ZMQ drops (and disconnects) a peer sending a frame above this; frames between the protocol's
# caps and this limit get a protocol error reply instead (a visible refusal, not a hang).
TRANSPORT_MAX_FRAME = 2 * max(P.MAX_HEADER_BYTES, P.MAX_INDEX_BYTES)
_NOBLOCK = int(zmq.NOBLOCK)
_POLLIN = int(zmq.POLLIN)


class Server:
    def __init__(self, state: DaemonState, address: str, spin_us: float = 0.0,
                 curve: tuple[bytes, bytes, str] | None = None) -> None:
        self.state = state
        self.address = address
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.sock.setsockopt(zmq.ROUTER_MANDATORY, 1)  # a failed send raises instead of vanishing
        self.sock.setsockopt(zmq.MAXMSGSIZE, TRANSPORT_MAX_FRAME)
        self.sock.setsockopt(zmq.SNDHWM, 10_000)
        self.sock.setsockopt(zmq.RCVHWM, 10_000)
        self.auth: Any = None
        if curve is not None:  # CURVE server; the ZAP handler admits listed client keys only
            from zmq.auth.thread import ThreadAuthenticator

            public, secret, clients = curve
            self.auth = ThreadAuthenticator(self.ctx)
            self.auth.start()
            self.auth.configure_curve(domain="*", location=clients)
            self.sock.curve_secretkey = secret
            self.sock.curve_publickey = public
            self.sock.curve_server = True
        self.ipc_path: str | None = None
        if address.startswith("ipc://"):
            self.ipc_path = address[len("ipc://"):]
            old = os.umask(0o177)  # the socket file is created 0600
            try:
                self._bind(address)
            finally:
                os.umask(old)
            os.chmod(self.ipc_path, 0o600)
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
        self._next_house = 0.0
        # a dead client is reaped within the heartbeat timeout plus at most a quarter of it
        self.house_s = min(HOUSEKEEPING_S, state.heartbeat_timeout / 4)
        self.spin_s = spin_us / 1e6

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
        st, sock, eng = self.state, self.sock, self.state.scheduler
        items, zmq_poll = [(sock, _POLLIN)], zmq.zmq_poll
        spin = self.spin_s
        last = 0.0
        while not self._stop and not st.stopping:
            now = time.monotonic()
            if now >= self._next_house:
                self._next_house = now + self.house_s
                self._housekeeping(now)
            if spin and time.perf_counter() - last < spin:
                # busy-poll a short while after traffic: no sleep / wake-up between requests
                if zmq_poll(items, 0):
                    self._request()
                    last = time.perf_counter()
                elif not eng.idle():
                    st.collect()
                self.send_acks()
                continue
            if eng.idle():  # nothing can complete: wait on the socket alone (cheaper)
                if zmq_poll(items, 100):
                    self._request()
                    last = time.perf_counter()
                continue
            events = dict(self.poller.poll(100))
            if sock in events:
                self._request()
                last = time.perf_counter()
            if self._wake_r in events:
                self._drain_wake()
            st.collect()
            self.send_acks()

    def _request(self) -> None:
        """Handle the requests waiting now (at most ``BATCH``; one ``zmq.Again`` ends a batch,
        cheaper than a poll per request when several clients are busy)."""
        recv, handle = self.sock.recv_multipart, self._handle
        for _ in range(BATCH):
            try:
                frames = recv(_NOBLOCK)
            except zmq.Again:
                return
            handle(frames)
            if self.state.stopping:
                return

    def _handle(self, frames: list[bytes]) -> None:
        t0 = time.perf_counter()
        st = self.state
        ident, body = frames[0], frames[1:]
        cmd, rid, code = "invalid", None, None
        try:
            c = st.registry.touch(ident, time.monotonic())
            h, arrays = P.decode_request(body)
            cmd, rid = h["cmd"], h["id"]
            if st.stopping and cmd != "shutdown":
                raise P.ProtocolError("shutting_down", "the daemon is stopping")
            fields, out = HANDLERS[cmd](st, c, h, arrays)
            reply = P.encode_reply(rid, fields, out)
        except Exception as e:  # noqa: BLE001 - every failure gets an error reply
            code = error_code(e)
            if rid is None and body:
                rid = P.request_id(body[0])
            if code is not None:  # a refusal: the command changed nothing
                reply = P.encode_error(rid, code, str(e))
            else:  # a daemon bug: answer, log, keep serving
                code = "internal"
                log.exception("command %s (id %s) failed", cmd, rid)
                reply = P.encode_error(rid, "internal", f"{cmd}: {type(e).__name__}: {e}"[:500])
        try:
            self.sock.send_multipart([ident, *reply], _NOBLOCK)
        except zmq.ZMQError:
            pass  # client gone or its queue is full: the reply is lost, the state is not
        st.metrics.command(cmd, code is None, time.perf_counter() - t0, code)
        if st.post:
            st.after_reply()
        if st.outbox:
            self.send_acks()

    def send_acks(self) -> None:
        """Push the acks the state collected (completed operations) to their clients."""
        st = self.state
        if not st.outbox:
            return
        out, st.outbox = st.outbox, []
        for c, ack in out:
            self._deliver(c, ack)

    def _deliver(self, c: ClientState, ack: dict[str, Any]) -> None:
        st = self.state
        if st.registry.clients.get(c.ident) is not c:
            return  # reaped or unregistered meanwhile
        try:
            self.sock.send_multipart([c.ident, *P.encode_ack(ack)], _NOBLOCK)
            pushed = True
        except zmq.ZMQError:
            pushed = False  # peer gone or its queue full: poll_acks still has it
        if st.registry.retain(c, ack["op"], ack, pushed):
            st.metrics.inc("acks_dropped")

    def _housekeeping(self, now: float) -> None:
        st = self.state
        for c in st.registry.silent(now, st.heartbeat_timeout):
            st.reap(c, f"silent for {now - c.last_seen:.1f} s")
            st.metrics.inc("clients_reaped")
        st.refresh_gauges()

    # ------------------------------------------------------------------ shutdown
    def refuse_pending(self) -> None:
        """Answer every request already waiting with ``shutting_down`` (state is stopping)."""
        for _ in range(10_000):
            if not zmq.zmq_poll([(self.sock, _POLLIN)], 0):
                return
            self._request()

    def close(self) -> None:
        try:
            self.poller.unregister(self.sock)
        except KeyError:
            pass
        self.sock.close(0)
        if self.auth is not None:
            self.auth.stop()
        self.ctx.term()
        for fd in (self._wake_r, self._wake_w):
            try:
                os.close(fd)
            except OSError:
                pass
        if self.ipc_path:
            try:
                os.unlink(self.ipc_path)
            except FileNotFoundError:
                pass
