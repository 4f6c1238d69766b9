"""The daemon hands one client the descriptor of memory it made for that client, over a Unix
socket (``SCM_RIGHTS``), so no process needs the daemon's ``/proc/<pid>/fd``; and takes in the
descriptors an engine hands it (its shared host pool for ``kv_attach``), so the daemon needs no
``/proc/<pid>/fd`` of the engine's either.

Why: a sealed memfd (``core.sealed_memfd``) has no name. Opened through the daemon's
``/proc/<pid>/fd`` link it is open to every process that may read the daemon's descriptors
(each process of its uid, unless it is non-dumpable), and to none in another pid namespace. A
descriptor passed over a socket reaches only the process that asked with the memory's token,
in any pid namespace; ``hicache serve`` makes itself non-dumpable (``core.dumpable``), so its
``/proc`` links open to no process of its uid.

Why an abstract socket (a name in the kernel, no file): a socket file lives in a folder its
uid can write, so any process of that uid could rename it aside, bind its own in its place,
and relay every client's token to the real one, keeping a copy of each descriptor. Nobody can
move, replace or take over an abstract name while the daemon holds it, and the name is random
and reaches a client only in its own reply. It leaves no file behind when the daemon dies.
The cost: it is reachable only from the daemon's network namespace (a pod's containers share
one), and it has no file mode, so the daemon checks each peer's uid (``SO_PEERCRED``).

What it does not do: stop an *active* process of the daemon's uid. Such a process can rename
the daemon's ZMQ ipc socket file aside and relay every message (learning each reply's name and
token; CURVE keeps replies unreadable to a relay), signal the daemon, and, where the kernel
lets a process ptrace its uid's others (no Yama), read the engine's own mappings. What the
descriptor socket and a non-dumpable daemon close is every *passive* way in: no process of
the uid opens a client's memory or reads the daemon's through ``/proc``.

Contract:
- ``FdHandout.create()`` (the daemon): a listening abstract Unix stream socket named
  ``@hicache-fds-<pid>-<hex>`` (``path``: ``@`` stands for the leading NUL), served by one
  thread (``hicache-fd-handout``). A peer whose uid is neither the daemon's nor root is told so
  and closed on at once. (A peer whose uid has no mapping in the daemon's user namespace reads
  as the overflow uid, 65534: a daemon running as that uid cannot tell such peers apart.)
  Everything the thread needs is made before ``create`` returns: no descriptor (or thread)
  left raises ``OSError`` there and leaves nothing open.
- ``offer(fd, token)``: one more connection that presents ``token`` gets a duplicate of ``fd``.
  One offer is one hand-out: once the offers of a token are taken, a request with it is
  refused until the memory is offered again (each ``channel`` or ``sparse_region`` reply
  offers it once). The hand-out keeps its own duplicate of ``fd`` while offers are left, so
  the owner may close ``fd`` at any time; ``withdraw(token)`` drops the offers not taken (the
  memory closes). ``pending`` counts the offers not taken, all tokens together.
- ``expect(token, count)``: the intake the other way: one connection that presents ``token``
  with exactly ``count`` descriptors attached (at most ``MAX_INTAKE_FDS``) hands them in, once.
  ``take(token)`` (the owner's thread) returns them, close-on-exec and now the caller's to
  close, or ``None`` while none came; ``withdraw(token)`` also drops an intake and closes what
  it received. ``awaiting`` counts the intakes not taken. What came in is only descriptors:
  the owner checks what they are before it uses them.
- Wire: the client connects and sends the token, a little-endian u64 (for an intake, with its
  descriptors attached to those bytes); the daemon answers one byte, ``1`` (with the offered
  descriptor attached; for an intake, none: they were taken in), or ``0`` followed by the
  reason (UTF-8, at most 200 bytes) and no descriptor, then closes. Descriptors sent where
  none are expected, a count other than the one expected, or descriptors that come ahead of
  the token's last byte (in a read that leaves it incomplete) are closed and refused. The
  thread serves connections side by side (one ``selectors`` loop, the whole backlog taken
  each turn): a connection that sends no token is closed after ``TOKEN_WAIT_S`` and holds no
  other back; past ``MAX_CONNECTIONS`` open at once, the oldest silent one is closed (told
  why) to make room. A wrong token changes nothing.
- ``fetch_fd(path, token, what)`` (the client): the descriptor (close-on-exec), else an
  ``OSError`` naming ``what``, the socket and the reason (no daemon there, which for an
  abstract name says that it is reachable from the daemon's network namespace only; a
  refusal; a reply with no descriptor; no connection or reply within ``TOKEN_WAIT_S`` + 3 s:
  a full backlog is waited out, not failed at once). ``path`` is an abstract name
  (``@...``) or a file path.
- ``send_fds(path, token, fds, what)`` (the client): hands ``fds`` in for an intake; an
  ``OSError`` naming ``what``, the socket and the reason when they were not taken in.
- ``close()`` stops the thread, closes the socket (the name goes with it), every offer's
  duplicate and every descriptor received and not taken.
"""
from __future__ import annotations

import array
import errno
import logging
import os
import secrets
import selectors
import socket
import struct
import threading
import time

FDS_PREFIX = "hicache-fds-"
TOKEN_WAIT_S = 2.0  # s a connection may take to send its token
MAX_CONNECTIONS = 64  # connections waiting for their token at once (more are closed at once)
MAX_INTAKE_FDS = 64  # descriptors one intake may hand in (an engine pool's distinct files)
_TOKEN = struct.Struct("<Q")
_REASON_MAX = 200

log = logging.getLogger("hicache.daemon")


class FdHandout:
    """The daemon's descriptor hand-out socket (see the module docstring)."""

    def __init__(self, path: str, sock: socket.socket, sel: selectors.BaseSelector) -> None:
        self.path, self._sock, self._sel = path, sock, sel
        # token -> [our duplicate of the descriptor, offers left]
        self._offers: dict[int, list[int]] = {}
        # token -> [descriptors expected, descriptors received (None until they came)]
        self._intake: dict[int, list] = {}
        self._lock = threading.Lock()
        self._stop = False
        self._thread = threading.Thread(target=self._serve, name="hicache-fd-handout",
                                        daemon=True)
        self._thread.start()

    @classmethod
    def create(cls) -> "FdHandout":
        path = f"@{FDS_PREFIX}{os.getpid()}-{secrets.token_hex(16)}"
        s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        sel: selectors.BaseSelector | None = None
        try:
            s.bind(_address(path))
            s.listen(socket.SOMAXCONN)
            s.setblocking(False)  # an accept after a peer gave up must not hold the loop
            # made here, not in the thread: its descriptor can fail (EMFILE), and a thread that
            # died of that would leave every later hand-out to time out, unexplained
            sel = selectors.DefaultSelector()
            sel.register(s, selectors.EVENT_READ)
            try:
                return cls(path, s, sel)
            except RuntimeError as e:  # the thread could not start (no thread left)
                raise OSError(errno.EAGAIN, f"cannot start the hand-out thread ({e})") from None
        except BaseException:
            if sel is not None:
                sel.close()
            s.close()
            raise

    # ---------------------------------------------------------------- the daemon's side
    def offer(self, fd: int, token: int) -> None:
        """One more request with ``token`` gets a duplicate of ``fd`` (``ValueError`` once
        closed)."""
        with self._lock:
            if self._stop:
                raise ValueError("the descriptor hand-out is closed")
            o = self._offers.get(token)
            if o is not None:
                o[1] += 1
                return
            self._offers[token] = [os.dup(fd), 1]

    def withdraw(self, token: int) -> None:
        """Drop the offers of ``token`` not taken, and its intake with what it received."""
        with self._lock:
            o = self._offers.pop(token, None)
            i = self._intake.pop(token, None)
        if o is not None:
            os.close(o[0])
        for fd in (i[1] or ()) if i is not None else ():
            os.close(fd)

    def expect(self, token: int, count: int) -> None:
        """One connection with ``token`` may hand in exactly ``count`` descriptors
        (``ValueError`` once closed, or for a count out of 1..``MAX_INTAKE_FDS``)."""
        if not 0 < count <= MAX_INTAKE_FDS:
            raise ValueError(f"an intake takes 1 to {MAX_INTAKE_FDS} descriptors, not {count}")
        with self._lock:
            if self._stop:
                raise ValueError("the descriptor hand-out is closed")
            if token in self._offers or token in self._intake:
                raise ValueError("this token is in use")
            self._intake[token] = [count, None]

    def take(self, token: int) -> list[int] | None:
        """The descriptors handed in for ``token`` (now the caller's), or ``None`` while none
        came (the intake stays open)."""
        with self._lock:
            i = self._intake.get(token)
            if i is None or i[1] is None:
                return None
            del self._intake[token]
            return i[1]

    @property
    def awaiting(self) -> int:
        with self._lock:
            return len(self._intake)

    @property
    def pending(self) -> int:
        with self._lock:
            return sum(o[1] for o in self._offers.values())

    def close(self) -> None:
        with self._lock:
            self._stop = True
        try:
            self._sock.shutdown(socket.SHUT_RDWR)  # wakes the thread's accept
        except OSError:
            pass
        self._thread.join(TOKEN_WAIT_S + 1.0)
        self._sock.close()
        with self._lock:
            fds, self._offers = [o[0] for o in self._offers.values()], {}
            fds += [fd for i in self._intake.values() for fd in i[1] or ()]
            self._intake = {}
        for fd in fds:
            os.close(fd)

    def _serve(self) -> None:
        sel = self._sel
        # connection -> [deadline, token bytes so far, descriptors received with them]
        waiting: dict[socket.socket, list] = {}
        try:
            while not self._stop:
                now = time.monotonic()
                timeout = min((w[0] for w in waiting.values()), default=now + 1.0) - now
                for key, _ in sel.select(max(0.0, timeout)):
                    try:
                        if key.fileobj is self._sock:
                            self._accept(sel, waiting)
                        elif key.fileobj in waiting:  # (not made room for just now)
                            self._read(sel, waiting, key.fileobj)  # type: ignore[arg-type]
                    except Exception:  # noqa: BLE001 - a bug here must not end every hand-out
                        log.exception("fd hand-out: serving a connection failed")
                now = time.monotonic()
                for conn in [c for c, w in waiting.items() if w[0] <= now]:  # silent too long
                    self._drop(sel, waiting, conn)
        finally:
            for conn in list(waiting):
                self._drop(sel, waiting, conn)
            sel.close()

    def _accept(self, sel: selectors.BaseSelector, waiting: dict) -> None:
        """Take every connection waiting in the backlog. A peer of another uid is told so and
        closed on; past ``MAX_CONNECTIONS`` the oldest silent connection makes room (a client
        sends its token at once: only a silent one can hold a place)."""
        while True:
            try:
                conn, _ = self._sock.accept()
            except (BlockingIOError, InterruptedError):  # the backlog is empty
                return
            except OSError:  # shut down (close); else (no descriptor left) not a busy loop
                if not self._stop:
                    time.sleep(0.05)
                return
            if not _same_user(conn):
                _refuse(conn, "this socket serves processes of the daemon's uid")
                continue
            if len(waiting) >= MAX_CONNECTIONS:
                oldest = min(waiting, key=lambda c: waiting[c][0])
                _refuse(oldest, f"{MAX_CONNECTIONS} connections sent no token in time: "
                                f"the oldest is closed")
                self._drop(sel, waiting, oldest, closed=True)
            conn.setblocking(False)
            waiting[conn] = [time.monotonic() + TOKEN_WAIT_S, b"", []]
            sel.register(conn, selectors.EVENT_READ)

    @staticmethod
    def _drop(sel: selectors.BaseSelector, waiting: dict, conn: socket.socket,
              closed: bool = False) -> None:
        sel.unregister(conn)
        for fd in waiting.pop(conn)[2]:  # descriptors no intake took
            os.close(fd)
        if not closed:
            conn.close()

    def _read(self, sel: selectors.BaseSelector, waiting: dict, conn: socket.socket) -> None:
        w = waiting[conn]
        try:
            part, fds = _receive(conn, _TOKEN.size - len(w[1]), MAX_INTAKE_FDS, flags=0)
        except (BlockingIOError, InterruptedError):
            return
        except OSError:
            part, fds = b"", []
        w[1] += part
        w[2] += fds
        if part and len(w[1]) < _TOKEN.size:
            if fds:  # ``send_fds`` sends them with the whole token, in one message: a peer
                # that sends them ahead of it could hold hundreds per connection meanwhile
                _refuse(conn, "descriptors came before the whole token; send them with it, "
                              "in one message")
                self._drop(sel, waiting, conn, closed=True)
            return
        if part:  # a whole token: answered, then closed
            try:
                self._answer(conn, w[1], w)
            except OSError as e:  # the client went away mid-answer: its loss alone
                log.debug("fd hand-out: %s", e)
        self._drop(sel, waiting, conn)

    def _answer(self, conn: socket.socket, got: bytes, w: list) -> None:
        conn.settimeout(TOKEN_WAIT_S)  # (a fresh socket's buffer takes the few bytes at once)
        token = _TOKEN.unpack(got)[0]
        if w[2] or token in self._intake:  # (read without the lock: only a hint)
            return self._take_in(conn, token, w)
        with self._lock:  # the descriptor sent is ours alone (the last offer's, or a new
            o = self._offers.get(token)  # duplicate): a withdraw meanwhile cannot close it
            why = b""
            if o is None:
                fd, why = -1, (b"no memory is offered for this token (each reply that names it "
                               b"may be opened once)")
            elif o[1] > 1:
                try:  # the offer is spent only once its duplicate exists
                    fd = os.dup(o[0])
                    o[1] -= 1
                except OSError as e:
                    fd, why = -1, (f"the daemon has no descriptor left to hand out "
                                   f"({e.strerror}); the offer stands, ask again").encode()
            else:
                fd = self._offers.pop(token)[0]
        if fd < 0:
            conn.sendall(b"\0" + why[:_REASON_MAX])
            return
        try:
            socket.send_fds(conn, [b"\1"], [fd])
        finally:
            os.close(fd)

    def _take_in(self, conn: socket.socket, token: int, w: list) -> None:
        """An intake: the connection's descriptors go to ``token``'s intake when it expects
        exactly that many and has none yet; else they are closed (``_drop``) and refused."""
        fds = w[2]
        with self._lock:
            i = self._intake.get(token)
            why = ("no intake is open for this token" if i is None else
                   "this token's descriptors were already handed in" if i[1] is not None else
                   f"{len(fds)} descriptors came, {i[0]} expected" if len(fds) != i[0] else "")
            if not why:
                i[1], w[2] = fds, []
        if why:
            conn.sendall(b"\0" + why.encode()[:_REASON_MAX])
        else:
            conn.sendall(b"\1")


def _address(path: str) -> str | bytes:
    """A socket address: ``@name`` is the abstract name (a leading NUL byte), else a path."""
    return b"\0" + path[1:].encode() if path.startswith("@") else path


_UCRED = struct.Struct("iII")  # pid, uid, gid


def _same_user(conn: socket.socket) -> bool:
    """The peer runs as this process's effective uid, or as root."""
    try:
        _, uid, _ = _UCRED.unpack(conn.getsockopt(socket.SOL_SOCKET, socket.SO_PEERCRED,
                                                  _UCRED.size))
    except OSError:
        return False
    return uid in (os.geteuid(), 0)


def _refuse(conn: socket.socket, why: str) -> None:
    """Tell a peer why it gets nothing (as far as it reads), and close."""
    try:
        conn.setblocking(False)
        conn.send(b"\0" + why.encode()[:_REASON_MAX])
    except OSError:
        pass
    conn.close()


def _receive(s: socket.socket, size: int = 1 + _REASON_MAX, most: int = 1,
             flags: int = 0) -> tuple[bytes, list[int]]:
    """Up to ``size`` bytes and the descriptors (up to ``most``) they carry, close-on-exec from
    the start (Python 3.11's ``socket.recv_fds`` drops its ``flags``)."""
    msg, anc, _, _ = s.recvmsg(size, socket.CMSG_SPACE(4 * most),
                               socket.MSG_CMSG_CLOEXEC | flags)
    fds: list[int] = []
    for level, kind, data in anc:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            a = array.array("i")
            a.frombytes(data[:len(data) - len(data) % a.itemsize])
            fds.extend(a)
    return msg, fds


def _exchange(path: str, token: int, what: str, doing: str,
              send: list[int]) -> tuple[bytes, list[int]]:
    """Connect to the hand-out socket ``path``, present ``token`` (with ``send`` attached) and
    read the answer; an ``OSError`` naming ``what`` and why when no answer came."""
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:  # blocking, bounded by the kernel's timeouts: a full backlog is waited out, not
        # refused at once (``settimeout`` would make the socket non-blocking: EAGAIN)
        wait = struct.pack("ll", int(TOKEN_WAIT_S + 3.0), 0)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, wait)
        s.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, wait)
        try:
            s.connect(_address(path))
            try:
                if send:
                    socket.send_fds(s, [_TOKEN.pack(token)], send)
                else:
                    s.sendall(_TOKEN.pack(token))
            except (BrokenPipeError, ConnectionResetError):  # closed on at once: the reason
                pass  # it was told, if any, is still there to read
            return _receive(s)
        except OSError as e:
            why = "no answer in time" if e.errno in (errno.EAGAIN, errno.EINPROGRESS) else \
                (e.strerror or str(e))
            if e.errno == errno.ECONNREFUSED and path.startswith("@"):
                why += ("; the name is reachable only from the daemon's network namespace, "
                        "while it runs")
            raise OSError(e.errno, f"cannot {doing} the {what} {'to' if send else 'from'} "
                                   f"the daemon's socket {path} ({why})") from None
    finally:
        s.close()


def _refusal(msg: bytes, default: str) -> str:
    return msg[1:].decode("utf-8", "replace") if msg[:1] == b"\0" and len(msg) > 1 else default


def fetch_fd(path: str, token: int, what: str) -> int:
    """The descriptor the daemon offered for ``token`` on its hand-out socket ``path`` (see the
    module docstring); ``what`` names the memory in errors."""
    msg, fds = _exchange(path, token, what, "get", [])
    if msg[:1] == b"\1" and len(fds) == 1:
        return fds[0]
    for fd in fds:
        os.close(fd)
    raise OSError(f"cannot get the {what} from the daemon's socket {path}: "
                  f"{_refusal(msg, 'the daemon sent no descriptor')}")


def send_fds(path: str, token: int, fds: list[int], what: str) -> None:
    """Hand ``fds`` in to the intake the daemon opened for ``token`` on ``path``."""
    if not 0 < len(fds) <= MAX_INTAKE_FDS:
        raise ValueError(f"an intake takes 1 to {MAX_INTAKE_FDS} descriptors, not {len(fds)}")
    msg, back = _exchange(path, token, what, "hand", list(fds))
    for fd in back:
        os.close(fd)
    if msg[:1] != b"\1":
        raise OSError(f"cannot hand the {what} to the daemon's socket {path}: "
                      f"{_refusal(msg, 'the daemon did not answer')}")
