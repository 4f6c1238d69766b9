"""The daemon hands one client the descriptor of memory it made for that client, over a Unix
socket (``SCM_RIGHTS``), so no process needs the daemon's ``/proc/<pid>/fd``.

Why: a sealed memfd (``core.sealed_memfd``) has no name. Opened through the daemon's
``/proc/<pid>/fd`` link it is open to every process that may read the daemon's descriptors
(each process of its uid, unless it is non-dumpable), and to none in another pid namespace. A
descriptor passed over a socket reaches only the process that asked with the memory's token,
in any pid namespace that shares the socket's folder; the daemon itself is made non-dumpable
(``controllers.daemon``), so its ``/proc`` links open to no process of its uid.

Contract:
- ``FdHandout.create(folder)`` (the daemon): a listening Unix stream socket
  ``<folder>/hicache-fds-<pid>-<hex>``, mode 0600 (a process of another uid cannot connect),
  served by one thread (``hicache-fd-handout``). First removes the sockets that killed daemons
  left there (``shm_file.sweep_stale``).
- ``offer(fd, token)``: one more connection that presents ``token`` gets a duplicate of ``fd``.
  One offer is one hand-out: once the offers of a token are taken, a request with it is
  refused until the memory is offered again (each ``channel`` or ``sparse_region`` reply
  offers it once). The hand-out keeps its own duplicate of ``fd`` while offers are left, so
  the owner may close ``fd`` at any time; ``withdraw(token)`` drops the offers not taken (the
  memory closes). ``pending`` counts the offers not taken, all tokens together.
- Wire: the client connects and sends the token, a little-endian u64; the daemon answers one
  byte, ``1`` with the descriptor attached, or ``0`` followed by the reason (UTF-8, at most 200
  bytes) and no descriptor, then closes. A connection that sends no token within
  ``TOKEN_WAIT_S`` is closed. A wrong token changes nothing.
- ``fetch_fd(path, token, what)`` (the client): the descriptor (close-on-exec), else an
  ``OSError`` naming ``what``, the socket and the reason (no daemon there, a refusal, a reply
  with no descriptor).
- ``close()`` stops the thread, removes the socket file and closes every offer's duplicate.
"""
from __future__ import annotations

import array
import logging
import os
import secrets
import socket
import struct
import threading

from .shm_file import sweep_stale

FDS_PREFIX = "hicache-fds-"
TOKEN_WAIT_S = 2.0  # s a connection may take to send its token
_TOKEN = struct.Struct("<Q")
_REASON_MAX = 200

log = logging.getLogger("hicache.daemon")


class FdHandout:
    """The daemon's descriptor hand-out socket (see the module docstring)."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path, self._sock = path, sock
        # token -> [our duplicate of the descriptor, offers left]
        self._offers: dict[int, list[int]] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="hicache-fd-handout",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def create(cls, folder: str) -> "FdHandout":
        sweep_stale(folder, (FDS_PREFIX,))
        path = os.path.join(folder, f"{FDS_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            s.bind(path)
            os.chmod(path, 0o600)
            s.listen(64)
        except BaseException:
            s.close()
            try:
                os.unlink(path)
            except FileNotFoundError:
                pass
            raise
        finally:
            os.umask(old)
        return cls(path, s)

    # ---------------------------------------------------------------- the daemon's side
    def offer(self, fd: int, token: int) -> None:
        """One more request with ``token`` gets a duplicate of ``fd``."""
        with self._lock:
            o = self._offers.get(token)
            if o is not None:
                o[1] += 1
                return
            self._offers[token] = [os.dup(fd), 1]

    def withdraw(self, token: int) -> None:
        """Drop the offers of ``token`` not taken."""
        with self._lock:
            o = self._offers.pop(token, None)
        if o is not None:
            os.close(o[0])

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(o[1] for o in self._offers.values())

    def close(self) -> None:
        self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept
        except OSError:
            pass
        self._thread.join(TOKEN_WAIT_S + 1.0)
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass
        with self._lock:
            fds, self._offers = [o[0] for o in self._offers.values()], {}
        for fd in fds:
            os.close(fd)

    def _serve(self) -> None:
        while not self._stop:
            try:
                conn, _ = self._sock.accept()
            except OSError:
                if self._stop:
                    return
                continue
            try:
                self._answer(conn)
            except OSError as e:  # the client went away mid-answer: its loss alone
                log.debug("fd hand-out: %s", e)
            finally:
                conn.close()

    def _answer(self, conn: socket.socket) -> None:
        conn.settimeout(TOKEN_WAIT_S)
        got = b""
        while len(got) < _TOKEN.size:
            part = conn.recv(_TOKEN.size - len(got))
            if not part:
                return
            got += part
        token = _TOKEN.unpack(got)[0]
        with self._lock:  # the descriptor sent is ours alone (the last offer's, or a new
            o = self._offers.get(token)  # duplicate): a withdraw meanwhile cannot close it
            if o is None:
                fd = -1
            elif o[1] > 1:
                o[1] -= 1
                fd = os.dup(o[0])
            else:
                fd = self._offers.pop(token)[0]
        if fd < 0:
            conn.sendall(b"\0" + b"no memory is offered for this token (each reply that names "
                                 b"it may be opened once)")
            return
        try:
            socket.send_fds(conn, [b"\1"], [fd])
        finally:
            os.close(fd)


def _receive(s: socket.socket) -> tuple[bytes, list[int]]:
    """One reply and the descriptors it carries, close-on-exec from the start (Python 3.11's
    ``socket.recv_fds`` drops its ``flags``)."""
    msg, anc, _, _ = s.recvmsg(1 + _REASON_MAX, socket.CMSG_SPACE(4), socket.MSG_CMSG_CLOEXEC)
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return msg, fds


def fetch_fd(path: str, token: int, what: str) -> int:
    """The descriptor the daemon offered for ``token`` on its hand-out socket ``path`` (see the
    module docstring); ``what`` names the memory in errors."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        s.settimeout(TOKEN_WAIT_S + 3.0)
        try:
            s.connect(path)
            s.sendall(_TOKEN.pack(token))
            msg, fds = _receive(s)
        except OSError as e:
            raise OSError(e.errno, f"cannot get the {what} from the daemon's socket {path} "
                                   f"({e.strerror or e})") from None
        if msg[:1] == b"\1" and len(fds) == 1:
            return fds[0]
        for fd in fds:
            os.close(fd)
        why = msg[1:].decode("utf-8", "replace") if msg[:1] == b"\0" and len(msg) > 1 else \
            "the daemon sent no descriptor"
        raise OSError(f"cannot get the {what} from the daemon's socket {path}: {why}")
    finally:
        s.close()
