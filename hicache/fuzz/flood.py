"""A flood of oversized and many-frame messages against a live daemon, with a bystander.

``run_flood(address, messages, rss, seed)`` sends ``messages`` messages as fast as the socket
takes them, from a few attacker identities, each message one of:

* ``many_frames`` — a valid header followed by ``MAX_INDEX_FRAMES + 1 .. 400`` small frames;
* ``over_total`` — a header and 16 MiB frames summing past ``MAX_MESSAGE_BYTES``;
* ``big_header`` — a header frame of ``MAX_HEADER_BYTES`` + a few bytes;
* ``beyond_transport`` — one frame over the transport's frame limit (the daemon's ZMQ drops it
  and disconnects that peer; sent from a fresh identity each time).

Meanwhile a *bystander* client sends well-formed ``heartbeat`` / ``stats`` commands in a loop
and records every round trip. The daemon's RSS (``rss()``) is sampled before, every 250
messages, and after the attackers' replies have drained. Returns a report: messages per kind,
replies the attackers got (all ``bad_frame``), bystander calls / failures / p50 / p99 / max
round trip, RSS before / peak / after and the growth in MiB. Nothing here imports the daemon.
"""
from __future__ import annotations

import random
import threading
import time
from typing import Any, Callable, Sequence

import zmq

from hicache.core import protocol as P
from hicache.core.percentiles import median, percentile

KINDS = (("many_frames", 0.9), ("big_header", 0.08), ("over_total", 0.015),
         ("beyond_transport", 0.005))
ATTACKERS = 4


def _dealer(ctx: zmq.Context, address: str, name: str) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, name.encode())
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.SNDHWM, 1000)
    s.setsockopt(zmq.RCVHWM, 100_000)
    s.connect(address)
    return s


def _drain(s: zmq.Socket, codes: dict[str, int]) -> int:
    n = 0
    while s.poll(0, zmq.POLLIN):
        h, _ = P.decode_reply(s.recv_multipart())
        if h.get("k") == "reply":
            code = (h.get("error") or {}).get("code", "ok")
            codes[code] = codes.get(code, 0) + 1
            n += 1
    return n


class _Bystander(threading.Thread):
    """Well-formed commands in a loop on its own client until stopped; records round trips."""

    def __init__(self, address: str, timeout: float) -> None:
        super().__init__(daemon=True, name="flood-bystander")
        self.address, self.timeout = address, timeout
        self.rtts: list[float] = []
        self.failures: list[str] = []
        self.stop = threading.Event()

    def run(self) -> None:
        from hicache.engine.client import Client

        with Client(self.address, timeout=self.timeout, name="bystander") as c:
            i = 0
            while not self.stop.is_set():
                t = time.perf_counter()
                try:
                    c.stats() if i % 4 == 3 else c.heartbeat()
                    self.rtts.append(time.perf_counter() - t)
                except Exception as e:  # noqa: BLE001 - a lost command is the finding
                    self.failures.append(f"{type(e).__name__}: {e}"[:200])
                i += 1
                time.sleep(0.002)


def run_flood(address: str, messages: int, rss: Callable[[], int], *, seed: int = 0,
              transport_max_frame: int, kinds: Sequence[tuple[str, float]] = KINDS,
              reply_wait: float = 30.0, bystander_timeout: float = 10.0) -> dict[str, Any]:
    """See the module docstring. ``transport_max_frame``: the daemon's ZMQ frame limit;
    ``kinds``: (kind, weight) pairs to draw from (default ``KINDS``)."""
    rng = random.Random(seed)
    ctx = zmq.Context()
    socks = [_dealer(ctx, address, f"flood-{seed}-{i}") for i in range(ATTACKERS)]
    names, weights = zip(*kinds)
    tiny = b"\0" * 8
    chunk = b"\0" * P.MAX_INDEX_BYTES
    big_head = P.encode_request("stats", 1, {"pad": "x" * (P.MAX_HEADER_BYTES + 8)})[0]
    huge = b"\0" * (transport_max_frame + 8)
    sent: dict[str, int] = {n: 0 for n, _ in KINDS}
    codes: dict[str, int] = {}
    replies = 0
    by = _Bystander(address, bystander_timeout)
    rss0 = rss()
    peak = rss0
    by.start()
    time.sleep(0.2)
    t0 = time.monotonic()
    try:
        for i in range(messages):
            kind = rng.choices(names, weights)[0]
            s = socks[i % ATTACKERS]
            head = P.encode_request("stats", i + 1)
            if kind == "many_frames":
                s.send_multipart(head + [tiny] * rng.randint(P.MAX_INDEX_FRAMES + 1, 400))
            elif kind == "big_header":
                s.send_multipart([big_head])
            elif kind == "over_total":
                n = P.MAX_MESSAGE_BYTES // P.MAX_INDEX_BYTES + 1
                s.send_multipart(head + [chunk] * n, copy=False)
            else:
                one = _dealer(ctx, address, f"flood-big-{seed}-{i}")
                one.send_multipart(head + [huge], copy=False)
                time.sleep(0.01)
                one.close(0)
            sent[kind] += 1
            if i % 250 == 249:
                replies += sum(_drain(x, codes) for x in socks)
                peak = max(peak, rss())
        deadline = time.monotonic() + reply_wait
        want = messages - sent["beyond_transport"]
        while replies < want and time.monotonic() < deadline:
            got = sum(_drain(x, codes) for x in socks)
            replies += got
            peak = max(peak, rss())
            if not got:
                time.sleep(0.02)
        seconds = time.monotonic() - t0
    finally:
        by.stop.set()
        by.join(bystander_timeout + 5)
        for x in socks:
            x.close(0)
        ctx.term()
    rss1 = rss()
    peak = max(peak, rss1)
    mib = 2 ** 20
    return {
        "messages": messages, "sent": sent, "seconds": round(seconds, 2),
        "attacker_replies": replies, "expected_replies": messages - sent["beyond_transport"],
        "reply_codes": dict(sorted(codes.items())),
        "bystander_calls": len(by.rtts), "bystander_failures": len(by.failures),
        "bystander_first_failure": by.failures[0] if by.failures else None,
        "bystander_p50_ms": None if not by.rtts else round(median(by.rtts) * 1e3, 3),
        "bystander_p99_ms": None if not by.rtts else round(percentile(by.rtts, 0.99) * 1e3, 3),
        "bystander_max_ms": None if not by.rtts else round(max(by.rtts) * 1e3, 3),
        "rss_before_mib": round(rss0 / mib, 1), "rss_peak_mib": round(peak / mib, 1),
        "rss_after_mib": round(rss1 / mib, 1),
        "rss_growth_mib": round((peak - rss0) / mib, 1),
    }
