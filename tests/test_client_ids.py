"""Who owns host rows: every ZMQ routing identity gets its own owner id (``registry.client_id``).

Two identities that differ only in bytes that are not valid UTF-8 used to share one owner (the
bytes were decoded with replacement characters), so one could free the other's rows; and an
identity of a zero byte followed by ``kvstore`` acted as the daemon's key store. A real CPU
daemon and raw DEALER sockets that set those identities.
"""
from __future__ import annotations

import itertools
from typing import Any

import numpy as np
import zmq

from hicache.controllers.registry import client_id
from hicache.core import protocol as P


def test_client_id_is_one_to_one_and_never_starts_with_a_zero_byte() -> None:
    idents = [bytes([a]) for a in range(256)]
    idents += [bytes(p) for p in itertools.product(range(256), (0x00, 0x41, 0x7E, 0xFF))]
    idents += [b"\xffvictim", b"\xfevictim", b"\x00kvstore", b"~006b7673746f7265", b"~",
               b"~abc", b"engine-host-12-ab", b"a b", b"tab\there", "café".encode()]
    ids = [client_id(i) for i in idents]
    assert len(set(ids)) == len(set(idents))  # one owner per identity
    assert not any(i.startswith("\x00") for i in ids)
    assert client_id(b"engine-host-12-ab") == "engine-host-12-ab"  # what Client sets: as is
    assert client_id(b"\x00kvstore") == "~006b7673746f7265"
    assert client_id(b"~abc") == "~7e616263"  # a printable one cannot pose as a hex form


def _peer(ctx: zmq.Context, address: str, ident: bytes) -> zmq.Socket:
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.ROUTING_ID, ident)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(address)
    return s


def _call(s: zmq.Socket, rid: int, cmd: str, fields: dict[str, Any] | None = None,
          arrays: tuple = ()) -> tuple[dict[str, Any], list[Any]]:
    s.send_multipart(P.encode_request(cmd, rid, fields, arrays))
    assert s.poll(10_000), f"{cmd}: no reply"
    return P.decode_reply(s.recv_multipart())


def test_identities_that_differ_in_non_utf8_bytes_own_different_rows(shared_daemon: Any
                                                                      ) -> None:
    ctx = zmq.Context()
    a = _peer(ctx, shared_daemon.address, b"\xffvictim")
    b = _peer(ctx, shared_daemon.address, b"\xfevictim")
    try:
        got, arrs = _call(a, 1, "alloc", {"counts": {"page": 3}})
        assert got["ok"], got
        rows = np.asarray(arrs[got["rows"]["page"]], dtype=np.int64)
        theirs = _call(b, 3, "free", {"rows": {"page": 0}}, (rows,))[0]
        assert not theirs["ok"] and theirs["error"]["code"] == "not_owner", theirs
        mine = _call(a, 4, "free", {"rows": {"page": 0}}, (rows,))[0]
        assert mine["ok"] and mine["freed"] == 3, mine
        check = _call(a, 5, "stats", {"check": True})[0]
        assert check["invariants"] == "ok", check["invariants"]
    finally:
        for s in (a, b):
            s.close(0)
        ctx.term()
