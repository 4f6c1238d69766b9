"""The client side of the reliability tools: torch-free "device" pools, row content, peers.

* ``ShmBuffers(layout, rows)`` — a worker's "device" pools in one sealed memfd (as
  ``engine.device_pools`` makes them), the wire fields ``register`` takes and the descriptor it
  hands in (``fds``), and numpy views; no torch, so a client process starts in a
  fraction of a second (crash and soak clients are many short-lived processes).
* ``mix64`` / ``Pattern`` — row content derived from a 64-bit salt (client, row, version): fill
  rows of every layer of a pool, count the rows that differ.
* ``RawPeer`` — a DEALER that sends arbitrary frames and reads the next reply (no validation on
  our side, so hostile messages reach the daemon as they are); ``hand_in(bufs)`` hands the
  pools' descriptor in, ``register(bufs)`` then registers them.
* ``Victim`` — a registered client whose host rows hold known content, and ``verify()`` that
  loads them back and counts the rows that differ.

Nothing here is imported by the daemon; everything talks to it through the wire protocol.
"""
from __future__ import annotations

import mmap
import os
import secrets
import time
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import zmq

from hicache.core import protocol as P
from hicache.core.channel import ClientEnd
from hicache.core.fd_handout import send_fds
from hicache.core.layout import Layout
from hicache.core.sealed_memfd import new_sealed_mapping

ALIGN = 4096
_M64 = (1 << 64) - 1


# ----------------------------------------------------------------------------- shm "device" pools
def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _space_rows(layout: Layout, rows: Mapping[str, int]) -> dict[str, int]:
    return {s: n for s, n in rows.items() if layout.space_pools(s)}


class ShmBuffers:
    """Every pool of ``layout`` in one sealed memfd: per pool, its layers one after another
    (4 KiB-aligned), so ``view(pool)`` is one ``[layers, rows, row_bytes]`` array.
    ``handles()`` is the ``buffers`` field of ``register`` and ``fds()`` the descriptors it
    hands in; ``name`` is the memfd's unique name (``/proc/<pid>/maps`` shows
    ``/memfd:<name>``). ``close()`` closes the descriptor and the mapping."""

    def __init__(self, layout: Layout, rows: Mapping[str, int], tag: str = "rel") -> None:
        self.layout = layout
        self.rows = {p.index: int(rows[p.index]) for p in layout.pools.values()}
        plan, end = {}, 0
        for name, spec in layout.pools.items():
            n = self.rows[spec.index]
            stride = _align(n * spec.page_bytes)
            plan[name] = (end, stride, n, spec.page_bytes, spec.num_layers)
            end += stride * spec.num_layers
        # the memfd's name, unique, as /proc/<pid>/maps shows it ("/memfd:<name> (deleted)")
        self.name = f"hicache-dev-{tag}-{os.getpid()}-{secrets.token_hex(4)}"
        self._fd, mm = new_sealed_mapping(self.name, max(end, ALIGN))
        self._mm: mmap.mmap | None = mm
        self.plan = plan
        self._views: dict[str, np.ndarray] = {}
        for name, (off, stride, n, rb, layers) in plan.items():
            self._views[name] = np.ndarray((layers, n, rb), dtype=np.uint8, buffer=self._mm,
                                           offset=off, strides=(stride, rb, 1))

    def view(self, pool: str) -> np.ndarray:
        return self._views[pool]

    def handles(self) -> dict[str, list[dict[str, Any]]]:
        out = {}
        for name, (off, stride, n, rb, layers) in self.plan.items():
            out[name] = [{"kind": "memfd", "fd": 0, "offset": off + i * stride,
                          "rows": n, "row_bytes": rb} for i in range(layers)]
        return out

    def fds(self) -> list[int]:
        return [self._fd]

    def register_fields(self) -> dict[str, Any]:
        """The wire fields of ``register`` (the descriptors go separately: ``fds``)."""
        return {"layout": self.layout.to_dict(), "device_rows": dict(self.rows),
                "buffers": self.handles(), "mode": "cpu"}

    def close(self) -> None:
        self._views = {}
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view is still alive somewhere: the unmap waits for it
                pass
            self._mm = None
        if self._fd >= 0:
            os.close(self._fd)
            self._fd = -1

    def __enter__(self) -> "ShmBuffers":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()


# ----------------------------------------------------------------------------- row content
def mix64(*parts: int) -> int:
    """A well-mixed 64-bit word of ``parts`` (splitmix64 finaliser over a running hash)."""
    x = 0x9E3779B97F4A7C15
    for p in parts:
        x = (x ^ (p & _M64)) * 0xBF58476D1CE4E5B9 & _M64
        x ^= x >> 31
        x = x * 0x94D049BB133111EB & _M64
        x ^= x >> 29
    return x


class Pattern:
    """Row content ``base[pool][layer] XOR salt``: ``base`` is a seeded random row of uint64 per
    pool and layer (a row of another pool or layer does not match), ``salt`` one word per
    (client, row, version) (a stale or foreign row does not match). Rows must be multiples of
    8 bytes (every DSV4 pool row is)."""

    def __init__(self, layout: Layout, pools: Iterable[str], seed: int = 0) -> None:
        self.pools = list(pools)
        self.base: dict[str, np.ndarray] = {}
        for i, name in enumerate(self.pools):
            spec = layout.pool(name)
            if spec.page_bytes % 8:
                raise ValueError(f"pool {name}: rows of {spec.page_bytes} bytes are not words")
            g = np.random.default_rng([seed, i])
            self.base[name] = g.integers(0, 1 << 63, size=(spec.num_layers, spec.page_bytes // 8),
                                         dtype=np.uint64)

    @staticmethod
    def _words(view: np.ndarray) -> np.ndarray:
        return view.view(np.uint64)

    def fill(self, bufs: ShmBuffers, rows: Sequence[int], salts: Sequence[int]) -> None:
        s = np.asarray(salts, dtype=np.uint64)
        for name in self.pools:
            w = self._words(bufs.view(name))
            b = self.base[name]
            for j, r in enumerate(rows):
                w[:, r, :] = b ^ s[j]

    def scribble(self, bufs: ShmBuffers, rows: Sequence[int], salt: int) -> None:
        """Overwrite ``rows`` with content no valid row has (before a load into them)."""
        for name in self.pools:
            w = self._words(bufs.view(name))
            for r in rows:
                w[:, r, :] = np.uint64(salt)

    def bad_rows(self, bufs: ShmBuffers, rows: Sequence[int], salts: Sequence[int]) -> list[int]:
        """Positions ``j`` whose row ``rows[j]`` does not hold the content of ``salts[j]``."""
        s = np.asarray(salts, dtype=np.uint64)
        bad: set[int] = set()
        for name in self.pools:
            w = self._words(bufs.view(name))
            b = self.base[name]
            for j, r in enumerate(rows):
                if j not in bad and not np.array_equal(w[:, r, :], b ^ s[j]):
                    bad.add(j)
        return sorted(bad)


# ----------------------------------------------------------------------------- raw peer
class RawPeer:
    """One DEALER identity that sends frames as given and reads replies (acks are kept aside).
    After ``open_channel`` its messages go through a shared-memory channel where they fit (the
    daemon sends every reply over ZMQ too, which is what ``reply`` reads)."""

    def __init__(self, address: str, name: str, ctx: zmq.Context | None = None) -> None:
        self.address = address
        self.ident = f"{name}-{os.getpid()}-{secrets.token_hex(4)}"
        self._ctx = ctx or zmq.Context.instance()
        s = self._ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.ROUTING_ID, self.ident.encode())
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.SNDHWM, 10_000)
        s.setsockopt(zmq.RCVHWM, 10_000)
        s.connect(address)
        self.sock = s
        self._ids = 1 << 40  # far from anything a Client would use
        self.acks = 0
        self._chan: ClientEnd | None = None
        self._seq = 0  # the channel's last request sequence
        self._own_seq = 1 << 62  # sequences of requests without a usable id
        self.via_channel = 0  # messages that went through the channel

    def next_id(self) -> int:
        self._ids += 1
        return self._ids

    def open_channel(self) -> None:
        """Send through a shared-memory channel from now on (a busy-polling daemon grants one;
        the daemon closes it when this peer unregisters, and sends go back to ZMQ)."""
        self._chan = ClientEnd.open(self.call("channel"))

    def send(self, frames: Sequence[bytes]) -> None:
        ch = self._chan
        if ch is not None:
            # the channel's sequence is the request's id (``core.channel``: a slot the daemon
            # cannot parse is answered under it); a header without a usable id, or one that
            # repeats the last, gets a sequence of its own
            rid = P.request_id(frames[0]) if frames else None
            if isinstance(rid, int) and 0 < rid < 1 << 62 and rid != self._seq:
                self._seq = rid
            else:
                self._own_seq += 1
                self._seq = self._own_seq
            if ch.send(self._seq, frames):  # what does not fit goes over ZMQ
                self.via_channel += 1
                return
        self.sock.send_multipart(list(frames), copy=True)

    def reply(self, timeout: float, want_id: Any = "any") -> dict[str, Any] | None:
        """The next reply header (skipping acks, and replies whose id is not ``want_id`` when it
        is given), or None when nothing came within ``timeout`` seconds."""
        deadline = time.monotonic() + timeout
        while True:
            left = deadline - time.monotonic()
            if left <= 0 or not self.sock.poll(max(1, int(left * 1000)), zmq.POLLIN):
                return None
            frames = self.sock.recv_multipart()
            h, arrays = P.decode_reply(frames)
            if h.get("k") == "ack":
                self.acks += 1
                continue
            if want_id != "any" and h.get("id") not in (want_id, None):
                continue  # a late reply to something that timed out
            h["_arrays"] = [list(a) for a in arrays]
            return h

    def call(self, cmd: str, fields: dict[str, Any] | None = None, arrays: Iterable[Any] = (),
             timeout: float = 10.0) -> dict[str, Any]:
        """A well-formed command; raises RuntimeError unless it got an ok reply."""
        rid = self.next_id()
        self.send(P.encode_request(cmd, rid, fields, arrays))
        h = self.reply(timeout, rid)
        if h is None:
            raise RuntimeError(f"{cmd}: no reply within {timeout} s")
        if not h.get("ok"):
            raise RuntimeError(f"{cmd} refused: {h.get('error')}")
        return h

    def hand_in(self, bufs: ShmBuffers, timeout: float = 10.0) -> int:
        """Hand ``bufs``' descriptor in for this peer's next ``register``: its ``fd_token``."""
        got = self.call("hand_in", {"count": 1}, timeout=timeout)
        send_fds(str(got["fd_socket"]), int(got["fd_token"]), bufs.fds(), "device pools")
        return int(got["fd_token"])

    def register(self, bufs: ShmBuffers, timeout: float = 10.0) -> dict[str, Any]:
        """Hand ``bufs``' descriptor in and register them (raises like ``call``)."""
        return self.call("register", dict(bufs.register_fields(),
                                          fd_token=self.hand_in(bufs, timeout)), timeout=timeout)

    def close(self) -> None:
        if self._chan is not None:
            self._chan.close()
            self._chan = None
        self.sock.close(0)



# ----------------------------------------------------------------------------- the victim
class Victim:
    """A registered client whose host rows hold known content: it allocates ``rows[s]`` host rows
    in every space, fills its device rows ``0..n-1`` with ``Pattern`` content and backs them
    up. ``verify()`` overwrites those device rows, loads the host rows back and returns how
    many rows differ (0 = the daemon kept them byte for byte). ``heartbeat()`` as needed."""

    def __init__(self, address: str, layout: Layout, dev_rows: Mapping[str, int], *,
                 seed: int = 0, share: int = 3, timeout: float = 10.0,
                 name: str = "victim") -> None:
        from hicache.engine.client import Client

        self.layout = layout
        self.dev_rows = _space_rows(layout, dev_rows)
        self.bufs = ShmBuffers(layout, self.dev_rows, tag=name)
        self.client = Client(address, timeout=timeout, name=name)
        try:
            self.client.register(**self.bufs.register_fields(), fds=self.bufs.fds())
            self.host_rows = {s: int(n) for s, n in self.client.registered["host_rows"].items()}
            self.count = {s: max(1, min(self.dev_rows[s], self.host_rows[s] // share))
                          for s in self.dev_rows}
            got = self.client.alloc(self.count)
            self.rows = {s: [int(x) for x in r] for s, r in got.items()}
            self.patterns = {s: Pattern(self.layout, [p.name for p in layout.space_pools(s)],
                                        seed) for s in self.dev_rows}
            self.salts = {s: [mix64(seed, 7, i, len(s)) for i in range(self.count[s])]
                          for s in self.dev_rows}
            for s in self.dev_rows:
                d = list(range(self.count[s]))
                self.patterns[s].fill(self.bufs, d, self.salts[s])
                self.client.wait_ack(self.client.backup({s: (d, self.rows[s])}))
        except BaseException:
            self.close()
            raise

    def heartbeat(self) -> None:
        self.client.heartbeat()

    def verify(self) -> int:
        bad = 0
        for s in self.dev_rows:
            d = list(range(self.count[s]))
            self.patterns[s].scribble(self.bufs, d, 0x5A5A5A5A5A5A5A5A)
            self.client.wait_ack(self.client.load({s: (self.rows[s], d)}))
            bad += len(self.patterns[s].bad_rows(self.bufs, d, self.salts[s]))
        return bad

    def close(self) -> None:
        self.client.close()
        self.bufs.close()

