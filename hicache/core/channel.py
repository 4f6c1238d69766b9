"""A local client's shared-memory command channel: one sealed memfd both map, with a request
slot and a reply slot, and the daemon's wake-up socket.

What it saves: a ZMQ message crosses two I/O threads (the sender's and the receiver's), each a
thread wake-up; on a GPU host between loads that is 0.1-0.2 ms each way. Through the channel a
request is a memory write the daemon's busy-polling loop sees at once (or one datagram that
wakes its ``poll`` directly), and a reply is a memory write the client's reply spin sees.

Contract:
- ``Channel.create(request_bytes, reply_bytes)`` (the daemon) makes an anonymous sealed memfd
  (``core.sealed_memfd``, shared with the sparse region): sized, its pages reserved (no memory
  is an ``OSError`` there, not a fault at a first touch), mode 0600, and sealed against
  shrinking and growing (``F_SEAL_SHRINK | F_SEAL_GROW | F_SEAL_SEAL``), so no process holding
  it, the client included, can change its size: a truncate is refused (EPERM) instead of
  making the daemon's next touch of the mapping a SIGBUS. A hole punched in it reads as zeros
  (a malformed slot), never a fault.
  ``hand_out(handout)`` offers its descriptor once on the daemon's descriptor socket
  (``core.fd_handout``) and returns what the ``channel`` reply names: that socket and a
  random token the header holds too. ``Channel.open(info)`` (the client) takes the descriptor
  with the token (an ``OSError`` that says why when it cannot), checks the size, magic and
  token, and maps it. No file name exists anywhere; only the process handed the token can
  take the descriptor, once per reply.
- Layout: a 4 KiB header page of little-endian u64 words (magic, capacities, closed, token,
  taken; the client's request sequence and length; the daemon's reply sequence and length),
  then the request slot, then the reply slot. A slot holds one message: u32 frame count, u32
  length per frame, the frames' bytes.
- Ordering: the writer stores the payload, then the length, then the sequence word (one aligned
  8-byte store); the reader loads the sequence first. On x86-64 (TSO: stores are seen in order,
  loads are not reordered with older loads) that is enough; ``supported()`` says whether this
  machine is one (elsewhere the channel is refused and ZMQ carries everything).
- One request at a time per channel (a ``Client`` waits for each reply). The client's request
  sequence is its request id; the daemon answers with the same sequence. A client whose call
  through the channel timed out goes over ZMQ from then on, its request maybe still in the
  slot: the daemon takes a sender's slot request before its ZMQ request
  (``Server._request``), so one client's commands run in the order it sent them; and the
  daemon's ZMQ copy of every reply follows what it pushed before, so a client that reads a
  refusal from the slot reads the socket up to that copy first (``Client._zmq_copy``). The
  daemon copies a request out of the mapping before it decodes it (the client cannot change
  bytes under the decoder), and bounds every count and length: a bad slot gives a reason
  string, never an exception or a read outside the slot.
- The daemon sets the header's closed word when it drops the channel (the client unregistered
  or was reaped, or the daemon stops), after the taken word: the last request sequence it
  took. The client sees it before its next request (``peer_closed``) and goes back to ZMQ; a
  client waiting for a reply sees whether its request was left unread (``unread``), so the
  command certainly did not run and can go again over ZMQ.
- A message that does not fit its slot is not written (``put_*`` returns False): the request
  goes over ZMQ; the reply slot then says ``TOO_BIG`` and the client takes the ZMQ copy (the
  daemon sends every reply over ZMQ too).
- ``ClientEnd``: a client's end, the mapping plus a socket connected to the daemon's wake-up
  socket: ``send`` writes a request and rings (False: it does not fit or the daemon closed the
  channel, so it goes over ZMQ; ``ConnectionError``: the daemon is gone).
- ``WakeSocket``: the daemon's Unix datagram socket (file mode 0600); making it first sweeps
  the sockets of daemons that were killed (and the channel files earlier versions made there).
  A client connects to it and sends one byte after each request, which wakes a daemon that
  sleeps in ``poll``; a full queue (the daemon busy-polled meanwhile) is fine, a refused send
  means the daemon is gone (a datagram socket, not a pipe: no SIGPIPE can reach an engine that
  restored its default).
"""
from __future__ import annotations

import mmap
import os
import platform
import secrets
import socket
import struct
from typing import Any, Sequence

from .fd_handout import FdHandout
from .sealed_memfd import Sealed, create_sealed, open_sealed
from .shm_file import sweep_stale

CHANNEL_PREFIX = "hicache-chan-"
WAKE_PREFIX = "hicache-wake-"
MAGIC = int.from_bytes(b"HICHAN01", "little")
HEADER = 4096
REQUEST_BYTES = 256 << 10  # up to ~32k ids (8 bytes each) in all; larger requests use ZMQ
REPLY_BYTES = 64 << 10
MAX_SLOT_BYTES = 16 << 20
TOO_BIG = (1 << 64) - 1  # reply length word: the reply did not fit, take the ZMQ copy
# u64 word indices in the header page
_MAGIC, _REQ_CAP, _REP_CAP, _CLOSED, _TOKEN, _TAKEN = 0, 1, 2, 3, 4, 5
_REQ_SEQ, _REQ_LEN = 8, 9  # the client's words (own cache line)
_REP_SEQ, _REP_LEN = 16, 17  # the daemon's words (own cache line)
_U32 = struct.Struct("<I")


def supported() -> str | None:
    """None when the channel's memory ordering holds on this machine, else why not."""
    m = platform.machine().lower()
    if m in ("x86_64", "amd64"):
        return None
    return (f"this machine is {m or 'unknown'}; the shared-memory channel relies on x86-64's "
            f"store ordering")


def pack(frames: Sequence[Any], cap: int) -> bytes | None:
    """One slot's bytes for ``frames`` (bytes-like), or None when they exceed ``cap``."""
    views = [memoryview(f).cast("B") for f in frames]
    n = 4 + 4 * len(views) + sum(v.nbytes for v in views)
    if n > cap:
        return None
    return b"".join([struct.pack(f"<{len(views) + 1}I", len(views), *(v.nbytes for v in views)),
                     *views])


def unpack(blob: bytes, max_frames: int) -> list[Any] | str:
    """Frames of one slot's bytes (the first as ``bytes``, the rest as memoryviews into
    ``blob``), or why they are malformed."""
    n = len(blob)
    if n < 4:
        return f"{n} bytes; a message needs at least 4"
    count = _U32.unpack_from(blob, 0)[0]
    if not 1 <= count <= max_frames:
        return f"{count} frames; a message has 1..{max_frames}"
    table = 4 + 4 * count
    if table > n:
        return f"{count} frame lengths do not fit in {n} bytes"
    lens = struct.unpack_from(f"<{count}I", blob, 4)
    if table + sum(lens) != n:
        return f"frame lengths add up to {sum(lens)} bytes, the message holds {n - table}"
    mv = memoryview(blob)
    out: list[Any] = []
    at = table
    for i, k in enumerate(lens):
        out.append(blob[at:at + k] if i == 0 else mv[at:at + k])
        at += k
    return out


class Channel:
    """One mapped channel memfd (see the module docstring)."""

    def __init__(self, mm: mmap.mmap, request_bytes: int, reply_bytes: int,
                 sealed: Sealed | None = None) -> None:
        self._mm, self._sealed = mm, sealed  # sealed: the daemon's memfd (None: the client's)
        self.request_bytes, self.reply_bytes = request_bytes, reply_bytes
        self._words = memoryview(mm).cast("B")[:HEADER].cast("Q")
        self._req_at, self._rep_at = HEADER, HEADER + request_bytes
        self.seen = 0  # daemon: the last request sequence taken
        self.closed = False

    @staticmethod
    def size(request_bytes: int, reply_bytes: int) -> int:
        return HEADER + request_bytes + reply_bytes

    @classmethod
    def create(cls, request_bytes: int = REQUEST_BYTES,
               reply_bytes: int = REPLY_BYTES) -> "Channel":
        for what, v in (("request", request_bytes), ("reply", reply_bytes)):
            if not 64 <= v <= MAX_SLOT_BYTES or v % 8:
                raise ValueError(f"channel {what} slot of {v} bytes; give a multiple of 8 in "
                                 f"64..{MAX_SLOT_BYTES}")
        m = create_sealed(CHANNEL_PREFIX, cls.size(request_bytes, reply_bytes), _TOKEN * 8)
        ch = cls(m.mm, request_bytes, reply_bytes, m)
        w = ch._words
        w[_REQ_CAP], w[_REP_CAP] = request_bytes, reply_bytes
        w[_MAGIC] = MAGIC
        return ch

    def hand_out(self, handout: FdHandout) -> dict[str, Any]:
        """Offer the memfd once on ``handout`` (the daemon's end); the fields a client opens
        it with."""
        if self._sealed is None:
            raise ValueError("only the daemon's end of a channel can hand it out")
        return dict(self._sealed.offer(handout), request_bytes=self.request_bytes,
                    reply_bytes=self.reply_bytes)

    @classmethod
    def open(cls, info: dict[str, Any]) -> "Channel":
        """Take the memfd a ``hand_out`` offered, map it, and check it."""
        req, rep = int(info["request_bytes"]), int(info["reply_bytes"])
        mm = open_sealed(str(info["fds"]), int(info["token"]), cls.size(req, rep), _TOKEN * 8,
                         "channel")
        ch = cls(mm, req, rep)
        w = ch._words
        if (w[_MAGIC], w[_REQ_CAP], w[_REP_CAP]) != (MAGIC, req, rep):
            ch.close()
            raise ValueError("the memory the daemon handed over is not this hicache channel")
        return ch

    # ---------------------------------------------------------------- client side
    def peer_closed(self) -> bool:
        """Whether the daemon dropped this channel (it reads no more requests from it)."""
        return self._words[_CLOSED] != 0

    def unread(self, seq: int) -> bool:
        """Whether the daemon dropped this channel without taking request ``seq``: it never
        read it, so the command did not run (the closed word is read before the taken word,
        which the daemon stores first)."""
        w = self._words
        return w[_CLOSED] != 0 and w[_TAKEN] < seq

    def put_request(self, seq: int, frames: Sequence[Any]) -> bool:
        """Write request ``seq`` (> 0); False (nothing written) when it does not fit."""
        blob = pack(frames, self.request_bytes)
        if blob is None:
            return False
        n = len(blob)
        self._mm[self._req_at:self._req_at + n] = blob
        w = self._words
        w[_REQ_LEN] = n
        w[_REQ_SEQ] = seq
        return True

    def reply(self, seq: int, max_frames: int) -> list[Any] | str | None:
        """The reply to request ``seq``: its frames, ``"too_big"`` (take the ZMQ copy), a reason
        it is malformed, or None when it has not come."""
        w = self._words
        if w[_REP_SEQ] != seq:
            return None
        n = w[_REP_LEN]
        if n == TOO_BIG:
            return "too_big"
        if n > self.reply_bytes:
            return f"reply of {n} bytes in a {self.reply_bytes}-byte slot"
        return unpack(self._mm[self._rep_at:self._rep_at + n], max_frames)

    # ---------------------------------------------------------------- daemon side
    def request(self, max_frames: int) -> tuple[int, list[Any] | str] | None:
        """A new request: (its sequence, its frames or why they are malformed); None when the
        sequence word has not changed since the last one taken. The bytes are copied out of the
        mapping first."""
        w = self._words
        seq = w[_REQ_SEQ]
        if seq == self.seen:
            return None
        self.seen = seq
        n = w[_REQ_LEN]
        if n > self.request_bytes:
            return seq, f"request of {n} bytes in a {self.request_bytes}-byte slot"
        return seq, unpack(self._mm[self._req_at:self._req_at + n], max_frames)

    def put_reply(self, seq: int, frames: Sequence[Any]) -> bool:
        """Write the reply to request ``seq``; one that does not fit writes ``TOO_BIG`` (the
        client takes the ZMQ copy) and returns False."""
        blob = pack(frames, self.reply_bytes)
        w = self._words
        if blob is None:
            w[_REP_LEN] = TOO_BIG
        else:
            self._mm[self._rep_at:self._rep_at + len(blob)] = blob
            w[_REP_LEN] = len(blob)
        w[_REP_SEQ] = seq
        return blob is not None

    def close(self) -> None:
        """Unmap; the daemon's end (the one that made it) first marks the channel closed for
        the client, and closes its memfd."""
        if self.closed:
            return
        self.closed = True
        if self._sealed is not None:
            self._words[_TAKEN] = self.seen  # before the closed word (see ``unread``)
            self._words[_CLOSED] = 1
            self._sealed.close()
        self._words.release()
        try:
            self._mm.close()
        except BufferError:  # a caller still holds a view: the mapping goes with it
            pass


DRAIN_MAX = 256  # wake-ups one ``WakeSocket.drain`` takes (a queue holds 10 by default)


def sweep_left_behind(shm_dir: str) -> int:
    """Remove the wake-up sockets (and channel files of earlier versions) that killed daemons
    left in ``shm_dir`` (``shm_file.sweep_stale``: their process gone, untouched for a
    minute); a daemon does it as it starts and again as it makes its wake-up socket."""
    return sweep_stale(shm_dir, (CHANNEL_PREFIX, WAKE_PREFIX))


class WakeSocket:
    """The daemon's wake-up socket: ``create`` (daemon), ``open_writer`` / ``ring`` (client)."""

    def __init__(self, path: str, sock: socket.socket) -> None:
        self.path, self._sock = path, sock
        self.fd = sock.fileno()

    @classmethod
    def create(cls, shm_dir: str) -> "WakeSocket":
        """The daemon's socket (made with its first channel); first removes the sockets (and
        channel files) a killed daemon left in ``shm_dir`` (``sweep_left_behind``)."""
        sweep_left_behind(shm_dir)
        path = os.path.join(shm_dir, f"{WAKE_PREFIX}{os.getpid()}-{secrets.token_hex(8)}")
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        old = os.umask(0o177)  # the socket file is created 0600
        try:
            s.bind(path)
        except BaseException:
            s.close()
            raise
        finally:
            os.umask(old)
        os.chmod(path, 0o600)
        return cls(path, s)

    def drain(self) -> None:
        """Take the wake-ups queued now, at most ``DRAIN_MAX``: processes that keep ringing
        cannot hold the loop here (what is left wakes it again, after the others' turn)."""
        recv = self._sock.recv
        try:
            for _ in range(DRAIN_MAX):
                if not recv(64):
                    return
        except (BlockingIOError, InterruptedError):
            pass

    def close(self) -> None:
        self._sock.close()
        try:
            os.unlink(self.path)
        except FileNotFoundError:
            pass

    @staticmethod
    def open_writer(path: str) -> socket.socket:
        """A client's end (non-blocking, connected); raises OSError when nobody listens."""
        s = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
        s.setblocking(False)
        try:
            s.connect(path)
        except BaseException:
            s.close()
            raise
        return s

    @staticmethod
    def ring(s: socket.socket) -> bool:
        """One wake-up datagram; False when the daemon's socket is gone (no signal is raised,
        unlike a write to a pipe nobody reads)."""
        try:
            s.send(b"\0")
        except BlockingIOError:  # its queue is full: the daemon has wake-ups pending already
            pass
        except OSError:  # ECONNREFUSED / ENOENT: the daemon closed it
            return False
        return True


class ClientEnd:
    """A client's end of a channel (see the module docstring)."""

    def __init__(self, chan: Channel, wake: socket.socket) -> None:
        self.chan, self._wake = chan, wake

    @classmethod
    def open(cls, info: dict[str, Any]) -> "ClientEnd":
        """Map the channel and connect to the wake-up socket a ``channel`` reply names; on a
        failure (``OSError``, ``ValueError``, ``KeyError``) nothing stays open."""
        chan = Channel.open(info)
        try:
            wake = WakeSocket.open_writer(str(info["wake"]))
        except BaseException:
            chan.close()
            raise
        return cls(chan, wake)

    def send(self, seq: int, frames: Sequence[Any]) -> bool:
        """Request ``seq`` into the slot, then a wake-up. False (nothing written) when it does
        not fit or the daemon closed the channel; ``ConnectionError`` when the daemon is gone."""
        if self.chan.peer_closed() or not self.chan.put_request(seq, frames):
            return False
        self.ring()
        return True

    def ring(self) -> None:
        if not WakeSocket.ring(self._wake):
            raise ConnectionError("its wake-up socket refuses: the daemon is gone")

    def usable(self) -> bool:
        """Whether requests may still go this way: the daemon has not closed the channel (a
        reap, an unregister) and its wake-up socket takes a ring (a spurious wake-up; it
        refuses once the daemon that made it is gone, say killed and restarted)."""
        return not self.chan.peer_closed() and WakeSocket.ring(self._wake)

    def close(self) -> None:
        self.chan.close()
        self._wake.close()
