"""The scheduler's issuer threads on their failure paths and orders, on CPU (no GPU needed).

A ``Scheduler`` shell holds only what the issuers and the completion threads touch;
``torch.cuda``'s ``Event`` is replaced by a stand-in. Whatever fails, the issuer lists the load
as issued, releases a server waiting in ``_wait_issues`` and hands the op to its completion
thread, which completes it with its failure on the ack. The backup issuer takes large backups
(``DEFER_BACKUP_BYTES``) and every backup-stream op sent while it holds one, issues them in
command order, hands each to the backup stream's completion thread before it counts as issued,
and never holds back a load that does not depend on them.
"""
from __future__ import annotations

import queue
import threading

import pytest
import torch

from hicache.controllers.ops import Operation
from hicache.controllers.scheduler import Scheduler


class _Event:
    def __init__(self) -> None:
        self.recorded = False

    def record(self, stream: object = None) -> None:
        self.recorded = True

    def synchronize(self) -> None:
        pass


def _shell() -> tuple[Scheduler, queue.SimpleQueue, list[int]]:
    s = object.__new__(Scheduler)
    s._issue_cv = threading.Condition()
    s._issuing = {"load": 0, "backup": 0}
    s._issued = []
    s._progress = []
    s._done, s._done_lock, s._pending = [], threading.Lock(), 0
    woke: list[int] = []
    s._wake = lambda: woke.append(1)
    s.streams = {"load": None, "backup": None}  # on_stream(None) does nothing
    s._last = {"load": None, "backup": None}
    issue_q: queue.SimpleQueue = queue.SimpleQueue()
    s._queues = {"issue": issue_q, "issue-backup": queue.SimpleQueue(),
                 "load": queue.SimpleQueue(), "backup": queue.SimpleQueue()}
    s.cuda, s._closed = True, False
    return s, issue_q, woke


def _load(op_id: int, fail_at: int | None) -> Operation:
    op = Operation(op_id, "c", "load")

    def rest():
        for n in (2, 3):
            if n == fail_at:
                raise RuntimeError("launch refused")
            yield n

    op.rest = rest()
    return op


@pytest.mark.parametrize("case", ["ok", "launch", "event"])
def test_issuer_always_releases_the_server_and_completes_the_op(case, monkeypatch):
    class Failing(_Event):
        def record(self, stream: object = None) -> None:
            raise RuntimeError("no event")

    monkeypatch.setattr(torch.cuda, "Event", Failing if case == "event" else _Event)
    s, issue_q, woke = _shell()
    op = _load(1, 3 if case == "launch" else None)
    s._pending = 1
    s.defer_issue(op)
    assert s.issuing() and s._last["load"] is op
    issue_q.put(None)
    th = threading.Thread(target=s._issuer, args=(issue_q,), daemon=True)
    th.start()
    # the server's wait returns once the issuer is done with the op, whatever happened
    waiter = threading.Thread(target=s._wait_issues, daemon=True)
    waiter.start()
    waiter.join(10)
    th.join(10)
    assert not waiter.is_alive() and not th.is_alive() and not s.issuing()
    assert s.take_issued() == ([], [op]) and s.take_issued() == ([], []) and woke
    assert op.rest is None and op.issue_s > 0
    if case == "ok":
        assert op.ok and op.issued == 3 and op.done_event.recorded
    elif case == "launch":  # the layers issued so far still complete, the ack says it failed
        assert not op.ok and "launch failed" in op.error and op.issued == 2
        assert op.done_event.recorded
    else:
        assert not op.ok and "completion event failed" in op.error and op.done_event is None
    # the completion thread finishes it (a missing event is not waited for)
    load_q = s._queues["load"]
    load_q.put(None)
    s._gpu_completer(load_q)
    assert s.take_completed() == [op] and op.t_end > 0
    assert op.ok == (case == "ok") and (case != "event" or "completion event failed" in op.error)


@pytest.mark.parametrize("every", [True, False])
def test_issuer_reports_progress_before_the_end(every, monkeypatch):
    """After a launch group that ends ``PROGRESS_S`` or more after the last word, the issuer
    lists (op, layers issued) for a progress notice, and wakes the server; never for the last
    group (the end says it), and everything of an op is taken before or with its end."""
    import hicache.controllers.scheduler as sched_mod
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(sched_mod, "PROGRESS_S", 0.0 if every else 3600.0)
    monkeypatch.setattr(sched_mod, "PROGRESS_BYTES", 100)
    s, issue_q, woke = _shell()
    op = Operation(4, "c", "load")
    op.stage_layers = tuple(range(6))
    op.rest = iter([2, 4, 6])
    op.nbytes = 100
    s._pending = 1
    s.defer_issue(op)
    issue_q.put(None)
    s._issuer(issue_q)
    progress, issued = s.take_issued()
    assert issued == [op] and op.issued == 6
    assert progress == ([(op, 2), (op, 4)] if every else [])
    assert len(woke) == (3 if every else 1)
    assert s.take_issued() == ([], [])


def test_a_small_load_reports_no_progress(monkeypatch):
    """Below ``PROGRESS_BYTES`` the issue is short: only its end is told."""
    import hicache.controllers.scheduler as sched_mod
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    monkeypatch.setattr(sched_mod, "PROGRESS_S", 0.0)
    s, issue_q, woke = _shell()
    op = Operation(5, "c", "load", nbytes=sched_mod.PROGRESS_BYTES - 1)
    op.stage_layers = tuple(range(6))
    op.rest = iter([2, 4, 6])
    s._pending = 1
    s.defer_issue(op)
    issue_q.put(None)
    s._issuer(issue_q)
    assert s.take_issued() == ([], [op]) and op.issued == 6 and len(woke) == 1


@pytest.mark.parametrize("small", [True, False])
def test_a_small_load_issues_its_later_layers_in_one_group(small, monkeypatch):
    """A load that sends no progress notice (under ``PROGRESS_BYTES``) issues its layers after
    layer 0 as one launch group: the engine hears of them only at the issue's end, so finer
    groups would cost host time for nothing; a bigger one issues them group by group."""
    import hicache.controllers.scheduler as sched_mod
    got = {}

    def fake(first, order, on_layer, **kw):
        got.update(kw, first=first, order=order)
        return iter([1])

    monkeypatch.setattr(sched_mod, "issue_by_layer", fake)
    nbytes = sched_mod.PROGRESS_BYTES - 1 if small else sched_mod.PROGRESS_BYTES
    op = Operation(6, "c", "load", nbytes=nbytes)
    op.stage_layers, op.layer_events = (3, 4, 5), [_Event() for _ in range(3)]
    assert next(sched_mod.issue_layers(op, None, 4, torch.device("cpu"))) == 1
    assert got["fine"] is (not small) and got["order"] == (3, 4, 5) and got["first"] == []


def test_state_queues_progress_then_the_end_and_skips_loads_of_gone_clients():
    """``DaemonState.collect``: a load's progress notices (with their layer counts) before its
    last notice (no count), in that order; a load whose client is gone (no entry in
    ``ops``) gets no notice."""
    from types import SimpleNamespace

    from hicache.controllers.state import DaemonState
    a, gone = Operation(1, "c", "load"), Operation(2, "d", "load")
    a.issue_s, a.issue_cpu_s = 0.002, 0.0015
    client = object()
    observed: list[str] = []
    st = object.__new__(DaemonState)
    st.scheduler = SimpleNamespace(take_issued=lambda: ([(a, 2), (gone, 2), (a, 4)], [a]),
                                   take_completed=lambda: [])
    st.ops = {1: (a, client)}
    st.metrics = SimpleNamespace(observe=lambda name, v: observed.append(name),
                                 inc=lambda name, v: observed.append(f"{name} += {v}"))
    st.notices, st.l3_ops = [], {}
    st.releaser = SimpleNamespace(pending=False)
    assert st.collect() == 0
    assert st.notices == [(client, 1, 2, False), (client, 1, 4, False), (client, 1, None, False)]
    assert observed == ["load_issue_seconds", "load_issue_cpu_seconds += 0.0015"]
    a.ok, st.notices = False, []  # an issue that failed: its last notice says so
    st.scheduler.take_issued = lambda: ([], [a])
    assert st.collect() == 0
    assert st.notices == [(client, 1, None, True)]


def _op(op_id: int, nbytes: int, kind: str = "backup") -> Operation:
    return Operation(op_id, "c", kind, nbytes=nbytes)


def test_large_backups_and_those_behind_them_go_to_the_backup_issuer_in_order(monkeypatch):
    """A backup of ``DEFER_BACKUP_BYTES`` goes to the backup issuer (the server answers at once);
    a small one sent while the issuer holds it goes there too, behind it; a load is launched
    by the server meanwhile, waiting for no backup issue; once the issuer is done, a small
    backup goes out from the server again. The stream's completion thread gets them in
    command order."""
    import hicache.controllers.scheduler as sched_mod
    s, _, _ = _shell()
    launched: list[tuple[int, str]] = []

    def launch(op: Operation, track: bool = True) -> None:
        s._wait_for_deps(op)
        launched.append((op.op_id, threading.current_thread().name))
        op.done_event = _Event()

    monkeypatch.setattr(s, "_launch_gpu", launch)
    big = sched_mod.DEFER_BACKUP_BYTES
    b1, b2, ld, b3 = _op(1, big), _op(2, 10, "swap_out"), _op(3, 10, "load"), _op(4, 10)
    assert not s._defers(_op(9, big - 1)) and not s._defers(_op(9, big, "load"))
    s.submit(b1)
    s.submit(b2)
    assert s._issuing["backup"] == 2 and s._last["backup"] is b2 and launched == []
    s.submit(ld)  # a load with no dependency: not held by the backup issue
    assert launched == [(3, "MainThread")] and s.issuing()
    q = s._queues["issue-backup"]
    q.put(None)
    th = threading.Thread(target=s._backup_issuer, args=(q,), name="backup-issuer")
    th.start()
    th.join(10)
    assert launched[1:] == [(1, "backup-issuer"), (2, "backup-issuer")]
    assert s._issuing["backup"] == 0 and not s.issuing()
    assert not s._defers(b3)
    s.submit(b3)  # the issuer holds nothing: the server launches it
    assert launched[-1] == (4, "MainThread")
    assert [o.op_id for o in _drain_q(s._queues["backup"])] == [1, 2, 4]
    assert [o.op_id for o in _drain_q(s._queues["load"])] == [3]


def _drain_q(q: queue.SimpleQueue) -> list[Operation]:
    got = []
    while not q.empty():
        got.append(q.get())
    return got


def test_a_load_that_depends_on_a_backup_being_issued_waits_for_its_issue(monkeypatch):
    """A load whose ``after`` names a backup the backup issuer has not issued yet (no
    completion event) waits until that issue is done, then launches."""
    import hicache.controllers.scheduler as sched_mod
    s, _, _ = _shell()
    order: list[int] = []

    def launch(op: Operation, track: bool = True) -> None:
        s._wait_for_deps(op)
        order.append(op.op_id)
        op.done_event = _Event()

    monkeypatch.setattr(s, "_launch_gpu", launch)
    b = _op(1, sched_mod.DEFER_BACKUP_BYTES)
    s.submit(b)
    ld = _op(2, 10, "load")
    ld.after = [b]
    loader = threading.Thread(target=s.submit, args=(ld,), daemon=True)
    loader.start()
    loader.join(0.3)
    assert loader.is_alive() and order == []  # held: its dependency has no event yet
    q = s._queues["issue-backup"]
    q.put(None)
    s._backup_issuer(q)
    loader.join(10)
    assert not loader.is_alive() and order == [1, 2]


@pytest.mark.parametrize("case", ["launch", "event"])
def test_a_failed_deferred_backup_is_finished_with_its_failure_and_releases_waiters(
        case, monkeypatch):
    """A backup the backup issuer fails to launch: its ack says so; with its completion event
    recorded it goes to its completion thread, without one its stream is waited for and it is
    finished there; either way the issue count drops (a waiting server goes on)."""
    import hicache.controllers.scheduler as sched_mod

    class Failing(_Event):
        def record(self, stream: object = None) -> None:
            raise RuntimeError("no event")

    monkeypatch.setattr(torch.cuda, "Event", Failing if case == "event" else _Event)
    s, _, woke = _shell()
    s._drain = lambda op: setattr(op, "done_event", None)  # (no stream to wait for here)

    def launch(op: Operation, track: bool = True) -> None:
        raise RuntimeError("launch refused")

    monkeypatch.setattr(s, "_launch_gpu", launch)
    b = _op(1, sched_mod.DEFER_BACKUP_BYTES)
    s._pending = 1
    s.submit(b)
    q = s._queues["issue-backup"]
    q.put(None)
    s._backup_issuer(q)
    s._wait_issues()  # returns: nothing held
    assert not b.ok and "launch failed: RuntimeError: launch refused" in b.error
    if case == "launch":  # its event recorded after what it queued: the completion thread's
        assert b.done_event.recorded and _drain_q(s._queues["backup"]) == [b]
        assert s._last["backup"] is b  # (recorded at the handoff; the issuer sets nothing)
    else:  # no event: finished here, after its stream
        assert _drain_q(s._queues["backup"]) == [] and s.take_completed() == [b] and woke


def test_a_deferred_backup_whose_engine_event_cannot_be_snapshotted_fails_at_once(monkeypatch):
    """The snapshot of the engine's event failed (a CUDA error): nothing was queued, so the
    backup is finished failed at once, never handed to the backup issuer."""
    import hicache.controllers.scheduler as sched_mod
    s, _, woke = _shell()

    def broken(event: object) -> object:
        raise RuntimeError("invalid resource handle")

    monkeypatch.setattr(s, "_snapshot", broken)
    b = _op(1, sched_mod.DEFER_BACKUP_BYTES)
    b.wait_event = object()
    s._pending = 1
    s.submit(b)
    assert s.take_completed() == [b] and woke and not s.issuing()
    assert not b.ok and b.error == "launch failed: RuntimeError: invalid resource handle"
    assert s._queues["issue-backup"].empty() and s._last["backup"] is None
