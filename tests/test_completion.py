"""``engine.completion``: pushed messages (acks, GPU loads' "issued" notices) and the wait for a
load's later layers, on CPU with scripted daemon messages (no daemon, no GPU)."""
from __future__ import annotations

from typing import Any

import pytest

from hicache.engine.acks import AckTimeout, Op
from hicache.engine.client import Client

ACK = {"v": 1, "k": "ack", "op": 7, "kind": "load", "status": "ok", "bytes": 0, "ns": 1,
       "exec_ns": 1, "path": "by_layer", "pools": {}}


class Scripted(Client):
    """A Client whose socket reads come from a list (None: nothing arrived in the wait)."""

    def __init__(self, script: list[Any]) -> None:
        super().__init__("ipc:///tmp/hicache-test-completion-none.sock", timeout=0.3)
        self.script = script

    def _recv(self, wait_ms: int) -> Any:
        return (self.script.pop(0), []) if self.script else None

    def call(self, cmd: str, fields: Any = None, arrays: Any = (), timeout: Any = None) -> Any:
        assert cmd == "poll_acks"  # the fallback when a push went missing
        return {"acks": [a for a in self.script if a.get("k") == "ack"]}, []


def test_issued_notice_releases_the_later_layers():
    c = Scripted([{"v": 1, "k": "ack", "op": 3, "status": "ok"} | ACK | {"op": 3},
                  {"v": 1, "k": "issued", "op": 7}])
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 1.0)
    assert op.issued is None and 7 not in c._issued  # consumed
    assert 3 in c._acks  # the other op's ack, pushed meanwhile, is kept
    c.close()


def test_an_ack_counts_as_issued_and_stays_for_wait_ack():
    c = Scripted([ACK])
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 1.0)
    assert op.issued is None
    assert c.wait_ack(op, 0.1).ok  # still there for the caller
    c.close()


def test_a_lost_notice_falls_back_to_the_ack_and_times_out_cleanly():
    c = Scripted([])
    op = Op(7, "load", event_set=0, issued=1)
    with pytest.raises(AckTimeout):
        c._wait_issued(op, 0.6)
    c.close()
