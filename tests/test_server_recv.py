"""``server.recv_request``: frames kept as bytes (a large index frame as its zmq.Frame, read in
place), caps on frame count and message size applied while receiving; no daemon needed."""
from __future__ import annotations

import time
from typing import Any

import numpy as np
import zmq

from hicache.controllers.server import _COPY_MAX, recv_request, router_socket
from hicache.core import protocol as P


def _pair():
    ctx = zmq.Context()
    r = router_socket(ctx)
    r.bind("inproc://recv-test")
    d = ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.ROUTING_ID, b"peer")
    d.connect("inproc://recv-test")
    return ctx, r, d


def _wait(sock: zmq.Socket) -> None:
    deadline = time.monotonic() + 5
    while not zmq.zmq_poll([(sock, zmq.POLLIN)], 100):
        assert time.monotonic() < deadline


def test_recv_request_keeps_frames_and_refuses_over_the_caps():
    ctx, r, d = _pair()
    try:
        big = np.arange(_COPY_MAX // 8 + 5, dtype="<i8")
        msg = P.encode_request("backup", 4, {"items": [{"pool": "c128_kv", "src": 0, "dst": 1}]},
                               [[3], big])
        d.send_multipart(msg)
        _wait(r)
        frames, refused, user = recv_request(r)
        assert refused is None and user is None and frames[0] == b"peer"
        assert type(frames[1]) is bytes and type(frames[2]) is bytes  # header, small frame
        assert isinstance(frames[3], zmq.Frame) and bytes(frames[3]) == big.tobytes()
        h, arrays = P.decode_request(frames[1:])
        assert h["id"] == 4 and list(arrays[0]) == [3]
        assert np.array_equal(np.frombuffer(arrays[1], dtype=np.int64), big)

        d.send_multipart([msg[0]] + [b"\0" * 8] * (P.MAX_INDEX_FRAMES + 3))
        _wait(r)
        frames, refused, _ = recv_request(r)
        assert len(frames) == 2 and "index frames" in refused
        assert not zmq.zmq_poll([(r, zmq.POLLIN)], 0)  # the rest was taken off the socket
    finally:
        d.close(0)
        r.close(0)
        ctx.term()


def test_replies_queued_when_the_server_closes_still_reach_their_peer(tmp_path):
    """The daemon answers ``shutdown`` (and pushes its last acks) just before it closes its
    socket: ``Server.close`` lets what is queued to a connected peer go out (a bounded linger)
    instead of dropping it. A 32 MiB reply is still in the I/O thread when close is called."""
    from types import SimpleNamespace

    from hicache.controllers.server import Server

    srv = Server(SimpleNamespace(heartbeat_timeout=10.0, wake_socket=None,
                                 registry=SimpleNamespace(channels=[], max_clients=64),
                                 close_handout=lambda: None),
                 f"ipc://{tmp_path}/s.sock")
    ctx = zmq.Context()
    d = ctx.socket(zmq.DEALER)
    try:  # (a failure must not leave the context for the garbage collector: its term blocks)
        d.setsockopt(zmq.LINGER, 0)
        d.setsockopt(zmq.RCVHWM, 0)
        d.connect(srv.endpoint)
        d.send_multipart([b"hello"])
        _wait(srv.sock)
        frames, refused, _ = srv._recv()
        body = np.arange(8 << 20, dtype=np.int32).tobytes()
        assert srv._send(frames[0], [b"last", body])
        srv.close()
        _wait(d)
        got = d.recv_multipart()
        assert got[0] == b"last" and got[1] == body
    finally:
        d.close(0)
        ctx.term()


def _server_with_peer(tmp_path: Any) -> tuple[Any, zmq.Socket]:
    """A ``Server`` over a stub state (no channels, no stop) and a DEALER peer connected to it
    in process (``inproc``: a message sent is in the server's socket when ``send`` returns);
    its handler records each request's first frame and how many taken were still unhandled."""
    from types import SimpleNamespace

    from hicache.controllers.server import Server

    srv = Server(SimpleNamespace(heartbeat_timeout=10.0, wake_socket=None, stopping=False,
                                 registry=SimpleNamespace(channels=[], clients={},
                                                          max_clients=64),
                                 close_handout=lambda: None),
                 f"inproc://take-{tmp_path.name}")
    d = srv.ctx.socket(zmq.DEALER)
    d.setsockopt(zmq.LINGER, 0)
    d.connect(srv.address)
    srv.handled, srv.handled_at = [], []
    srv._handle = lambda frames, err: (srv.handled.append((bytes(frames[1]), len(srv._taken))),
                                       srv.handled_at.append(time.monotonic()))
    return srv, d


def test_the_loop_takes_what_waits_before_it_handles_any_and_then_catches_up(tmp_path):
    """Three small requests waiting: all three are taken before the first is handled, and the
    moment the socket was found empty (before any was handled) is the catch-up."""
    srv, d = _server_with_peer(tmp_path)
    try:
        for i in range(3):
            d.send_multipart([b"h%d" % i, b"x" * 100])
        before = time.monotonic()
        srv._request()
        assert srv.handled == [(b"h0", 2), (b"h1", 1), (b"h2", 0)]
        assert before <= srv.catch.at <= srv.handled_at[0] and srv.catch.reads == 3
    finally:
        d.close(0)
        srv.close()


def test_the_loop_takes_no_more_once_what_it_took_holds_take_bytes(tmp_path):
    """Three 40 MiB requests waiting (each under one message's 64 MiB cap): the second takes
    what was taken past ``TAKE_BYTES``, so two are handled and the third stays in the socket;
    the socket was never found empty, so there is no catch-up."""
    from hicache.controllers.server import TAKE_BYTES

    part = b"\1" * (10 << 20)  # index frames are capped at 16 MiB each
    assert 40 << 20 < TAKE_BYTES < 80 << 20
    srv, d = _server_with_peer(tmp_path)
    try:
        at = srv.catch.at
        for i in range(3):
            d.send_multipart([b"h%d" % i, part, part, part, part])
        srv._request()
        assert srv.handled == [(b"h0", 1), (b"h1", 0)]
        assert srv.catch.at == at and srv.catch.reads == 2
        assert zmq.zmq_poll([(srv.sock, zmq.POLLIN)], 0)  # the third still waits
        srv._request()
        assert srv.handled[2:] == [(b"h2", 0)] and srv.catch.at > at
    finally:
        d.close(0)
        srv.close()


def test_the_reap_counts_silence_up_to_the_scans_start_at_most(tmp_path):
    """A catch-up noted during housekeeping's channel scan (a long command handled there ends
    with one) may follow a channel request the scan had already passed: the reap measures
    silence up to the scan's start, not up to that later catch-up."""
    from types import SimpleNamespace

    srv, d = _server_with_peer(tmp_path)
    asked: list[float] = []
    srv.state.wake_socket = SimpleNamespace(drain=lambda: None, close=lambda: None)
    srv.state.registry.silent = lambda at, timeout: asked.append(at) or []
    srv.state.refresh_gauges = lambda: None

    def scan() -> bool:  # one long command in the scan, ending with a catch-up
        time.sleep(0.05)
        srv.catch.empty(time.monotonic())
        return True

    srv._channels = scan
    try:
        before = time.monotonic()
        srv._housekeeping(before)
        assert len(asked) == 1
        assert before <= asked[0] <= srv.catch.at - 0.04, (before, asked, srv.catch.at)
    finally:
        d.close(0)
        srv.close()
