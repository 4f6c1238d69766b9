"""Retained acks and ``poll_acks``: a reply carries at most what fits the header limit.

4,096 retained acks of a 7-pool backup are ~1.35 MB of JSON; ``poll_acks`` with ``max: 4096``
(allowed) took them all and built a reply over the 1 MiB header limit, which the client
refused, and every one of those acks was gone. Now a reply stops at ``ACKS_REPLY_BYTES`` and
what it cannot carry stays retained for the next call.
"""
from __future__ import annotations

from hicache.controllers.handlers import ACKS_REPLY_BYTES, _ack_size
from hicache.controllers.registry import ClientState, Registry
from hicache.core import protocol as P


def _ack(op: int) -> dict:
    pools = {f"pool_{k}_kv": [1, 34560, 30000] for k in range(7)}
    return {"op": op, "kind": "backup", "status": "ok", "bytes": 241920, "ns": 40000,
            "exec_ns": 30000, "path": "numpy", "pools": pools}


def _client(reg: Registry, n: int) -> ClientState:
    c = ClientState("c", b"c", 0.0)
    for op in range(1, n + 1):
        assert reg.retain(c, op, _ack(op), pushed=False) == 0
    return c


def test_a_full_poll_stays_under_the_header_limit_and_keeps_the_rest():
    reg = Registry(8, 4096)
    c = _client(reg, 4096)
    got: list[dict] = []
    while c.acks:
        part = reg.take_acks(c, None, 4096, _ack_size, ACKS_REPLY_BYTES)
        reply = P.encode_reply(1, {"acks": part, "in_flight": 0})[0]
        assert len(reply) <= P.MAX_HEADER_BYTES
        P.decode_reply([reply])  # the client takes it
        assert 0 < len(part) < 4096
        got += part
    assert [a["op"] for a in got] == list(range(1, 4097))  # each once, oldest first


def test_named_ops_and_the_count_limit():
    reg = Registry(8, 4096)
    c = _client(reg, 10)
    part = reg.take_acks(c, [3, 3, 99, 5, 7], 2, _ack_size, ACKS_REPLY_BYTES)
    assert [a["op"] for a in part] == [3, 5]  # once each; 99 is not retained; at most 2
    assert list(c.acks) == [1, 2, 4, 6, 7, 8, 9, 10]
    one = reg.take_acks(c, None, 10, _ack_size, 1)  # a budget below one ack: still one
    assert [a["op"] for a in one] == [1]
