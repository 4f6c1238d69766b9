"""``engine.completion``: pushed messages (acks, GPU loads' "issued" notices) and the wait for a
load's later layers, on CPU with scripted daemon messages (no daemon, no GPU)."""
from __future__ import annotations

from typing import Any

import pytest

from hicache.engine.acks import AckTimeout, CommandRefused, Op
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
    c._wait_issued(op, 1, 1.0)
    assert op.issued is None and 7 not in c._issued  # consumed
    assert 3 in c._acks  # the other op's ack, pushed meanwhile, is kept
    c.close()


def test_an_ack_counts_as_issued_and_stays_for_wait_ack():
    c = Scripted([ACK])
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 1, 1.0)
    assert op.issued is None
    assert c.wait_ack(op, 0.1).ok  # still there for the caller
    c.close()


def test_a_lost_notice_falls_back_to_the_ack_and_times_out_cleanly():
    c = Scripted([])
    op = Op(7, "load", event_set=0, issued=1)
    with pytest.raises(AckTimeout):
        c._wait_issued(op, 1, 0.6)
    c.close()


def test_progress_notices_release_the_layers_they_cover():
    """``layers: K`` releases stage layer positions below K; a wait beyond them takes the next
    notice; the notice without ``layers`` releases all and is consumed."""
    c = Scripted([{"v": 1, "k": "issued", "op": 7, "layers": 4},
                  {"v": 1, "k": "issued", "op": 7, "layers": 12},
                  {"v": 1, "k": "issued", "op": 7}])
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 1, 1.0)  # covered by the first notice: the second is not read yet
    assert op.issued == 4 and len(c.script) == 2 and c._issued[7] == 4
    c._wait_issued(op, 11, 1.0)  # position 11 < 12
    assert op.issued == 12 and len(c.script) == 1
    c._wait_issued(op, 12, 1.0)  # beyond every progress notice: the last one
    assert op.issued is None and 7 not in c._issued and not c.script
    c.close()


def test_a_late_progress_notice_never_undoes_the_last_one_and_never_shrinks():
    c = Scripted([])
    c._pushed({"v": 1, "k": "issued", "op": 7, "layers": 9})
    c._pushed({"v": 1, "k": "issued", "op": 7, "layers": 5})
    assert c._issued[7] == 9
    c._pushed({"v": 1, "k": "issued", "op": 7})
    c._pushed({"v": 1, "k": "issued", "op": 7, "layers": 20})
    assert c._issued[7] is None
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 30, 1.0)
    assert op.issued is None and 7 not in c._issued
    c.close()


def test_an_ack_after_a_progress_notice_releases_every_layer():
    c = Scripted([{"v": 1, "k": "issued", "op": 7, "layers": 3}, ACK])
    op = Op(7, "load", event_set=0, issued=1)
    c._wait_issued(op, 5, 1.0)  # the progress notice does not cover 5; the ack does
    assert op.issued is None and 7 not in c._issued
    assert c.wait_ack(op, 0.1).ok
    c.close()


def test_taking_a_load_s_ack_drops_its_kept_pushes():
    """An engine that waits for a load's ack alone (no ``wait_layer``) keeps none of its
    "issued" pushes afterwards: they all came before the ack."""
    c = Scripted([])
    c._pushed({"v": 1, "k": "issued", "op": 7, "layers": 3})
    c._pushed({"v": 1, "k": "issued", "op": 7})
    c._pushed(ACK)
    op = Op(7, "load", event_set=0, issued=1)
    assert c.wait_ack(op, 0.1).ok
    assert 7 not in c._issued and op.issued is None
    c._pushed({"v": 1, "k": "issued", "op": 8})
    c._pushed(ACK | {"op": 8})
    assert [a.op for a in c.poll_acks([8])] == [8] and 8 not in c._issued
    c.close()


class _Done:
    """An event of a reused set: recorded, and completed, by an earlier load."""

    def query(self) -> bool:
        return True


@pytest.mark.parametrize("when", ["before", "during"])
def test_wait_layer_raises_when_the_loads_ack_says_it_failed(when):
    """A load that failed after the daemon accepted it records no events, and a reused event
    set's old records say done: ``wait_layer`` must raise ``TransferFailed`` once the error ack
    is in (it used to return for every layer). The ack stays the caller's to take."""
    from hicache.engine.acks import TransferFailed

    err = ACK | {"status": "error", "error": {"code": "transfer_failed",
                                               "message": "launch failed: boom"}}
    c = Scripted([err] if when == "during" else [])
    c.stage_layers = [0, 1, 2, 3]
    c._layer_pos = {g: i for i, g in enumerate(c.stage_layers)}
    c._load_events = [[_Done() for _ in range(4)]]
    op = Op(op_id=7, kind="load", event_set=0, issued=1)  # the reply: layer 0 issued
    if when == "before":
        c._pushed(err)
        with pytest.raises(TransferFailed):
            c.wait_layer(op, 0)
    else:
        c.wait_layer(op, 0)  # layer 0 is issued and its event done: nothing known yet
        with pytest.raises(TransferFailed):
            c.wait_layer(op, 1)  # waits for the notice, gets the error ack instead
    with pytest.raises(TransferFailed):
        c.wait_ack(op)
    assert 7 not in c._acks
    c.close()


def test_an_ack_taken_once_never_comes_back():
    """The daemon retains pushed acks: a later ``poll_acks()`` (or a late push) brought an ack
    the engine already took with ``wait_ack`` back again, as if a second op had completed."""
    c = Scripted([])
    c._pushed(ACK)
    assert c.wait_ack(Op(7, "load"), 0.1).ok
    c.script = [ACK]  # the daemon's retained copy
    assert c.poll_acks() == []
    c._pushed(ACK)  # a late duplicate push
    assert 7 not in c._acks
    c._pushed(ACK | {"op": 9})
    assert [a.op for a in c.poll_acks()] == [9]
    c.script = [ACK | {"op": 9}]
    assert c.poll_acks() == []  # taken by poll_acks: not again either
    c.close()


def test_an_ack_is_awaited_without_being_taken_so_it_is_handed_out_once():
    """The waits for a load's later layers used to take the op's ack (``wait_ack``) and put
    it back: an ack that came inline in the reply was then handed out again by the next
    ``poll_acks()`` (forty-fifth session's review). Now they only wait for it to be in."""
    from hicache.engine.acks import Ack

    c = Scripted([])
    op = Op(7, "load", event_set=0, issued=1)
    op.ack = Ack.from_wire(ACK)  # completed inline: the engine has it from the reply
    c._wait_issued(op, 1, 1.0)
    assert op.issued is None
    assert c.poll_acks() == [] and 7 not in c._acks  # not a second time
    assert c.wait_ack(op, 0.1) is op.ack
    # a pushed ack awaited by a layer wait stays the caller's, and goes out once
    c._pushed(ACK | {"op": 9})
    op9 = Op(9, "load", event_set=0, issued=1)
    c._wait_issued(op9, 1, 1.0)
    assert [a.op for a in c.poll_acks()] == [9]
    c.script = [ACK | {"op": 9}]  # the daemon's retained copy
    assert c.poll_acks() == []
    c.close()


class Stopping(Scripted):
    """A daemon that is stopping: it pushed its last acks (``pushed``), then refuses what waited
    (a ``poll_acks`` among them) ``shutting_down``; the client keeps the pushes it reads while
    it waits for the reply (``Client._reply_to``)."""

    def __init__(self, pushed: list[Any]) -> None:
        super().__init__([])
        self.pushed = pushed

    def call(self, cmd: str, fields: Any = None, arrays: Any = (), timeout: Any = None) -> Any:
        for a in self.pushed:
            self._pushed(a)
        raise CommandRefused(cmd, "shutting_down", "the daemon is stopping")


def test_a_wait_for_an_ack_a_stopping_daemon_pushed_before_its_refusal_takes_the_ack():
    c = Stopping([ACK])
    assert c.wait_ack(Op(7, "load"), 2.0).ok  # the op completed: not a refusal
    c.close()
    c = Stopping([])  # nothing came: the refusal stands
    with pytest.raises(CommandRefused, match="shutting_down"):
        c.wait_ack(Op(7, "load"), 2.0)
    c.close()
