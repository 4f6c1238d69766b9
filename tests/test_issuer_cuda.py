"""GPU: a load's later layers go out from the scheduler's issuer thread, and stream order stays
command order.

An in-process ``Scheduler`` on cuda:0 gets a per-layer load whose later layers are held back
(the test gates the generator the scheduler runs after the reply). While they are held:

* ``defer_issue`` has returned, so the server thread is free; nothing is listed as issued;
* a backup with no dependency goes out on its own stream at once and completes;
* a backup that must wait for the held load (its host rows) does not launch, and neither does
  a second load on the load stream; both launch once the held layers are issued, in command
  order;
* the load is listed by ``take_issued`` no later than ``take_completed`` returns it, and every
  byte of every layer of both loads and of the backups is what was copied.

A load's kernels get the busy CTA budget only while a backup is in flight.

A large backup (``DEFER_BACKUP_BYTES``, lowered here) is issued by the backup issuer thread:
``submit`` returns before its copies are issued, a smaller backup sent meanwhile goes there
too, behind it, a load with no dependency launches and completes meanwhile, and a load that
reads the large backup's host rows waits for its issue; every byte checked. Its engine event
counts as recorded when the command came: a record into the same event afterwards (behind a
long sleep on the engine's stream) does not hold it, nor do the engine's writes after it reach
the host rows.

Skipped without CUDA.
"""
from __future__ import annotations

import threading
import time

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hicache.controllers.ops import Ids, Item, Operation  # noqa: E402
from hicache.controllers.scheduler import Scheduler  # noqa: E402
from hicache.kernels.tables import LayerTable  # noqa: E402

DEV = torch.device("cuda:0")
LAYERS = (0, 1, 2)
ROWS, ROW = 16, 4096


def _tables() -> tuple[LayerTable, LayerTable]:
    host = LayerTable([torch.randint(0, 256, (ROWS, ROW), dtype=torch.uint8).pin_memory()
                       for _ in LAYERS], "host")
    dev = LayerTable([torch.zeros(ROWS, ROW, dtype=torch.uint8, device=DEV) for _ in LAYERS],
                     "dev")
    return host, dev


def _engine_and_tables() -> tuple[Scheduler, threading.Event, LayerTable, LayerTable,
                                  LayerTable, list[torch.Tensor]]:
    """A scheduler on cuda:0 and the event its completions set; host rows, device rows filled
    at random, a zeroed pinned table for backups, and the device rows' bytes before."""
    torch.cuda.set_device(DEV)
    woke = threading.Event()
    eng = Scheduler(DEV, woke.set)
    host, dev = _tables()
    back = LayerTable([torch.zeros(ROWS, ROW, dtype=torch.uint8).pin_memory() for _ in LAYERS],
                      "back")
    for t in dev.layers:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEV))
    torch.cuda.synchronize()
    return eng, woke, host, dev, back, [t.cpu() for t in dev.layers]


def _op(op_id: int, kind: str, src: LayerTable, dst: LayerTable, s: list[int], d: list[int],
        host_rows: list[int]) -> Operation:
    it = Item("p", src, dst, Ids.of(s), Ids.of(d), None, LAYERS, len(s) * ROW * len(LAYERS))
    op = Operation(op_id, "c", kind, [it], [("page", host_rows, kind == "backup")],
                   nbytes=it.nbytes)
    if kind == "load":
        op.layer_events = [torch.cuda.Event() for _ in LAYERS]
        op.stage_layers = LAYERS
    return op


def _collect(eng: Scheduler, woke: threading.Event, want: int) -> tuple[list, list]:
    """(issued, completed) in the order the server thread would see them."""
    seen: list[tuple[str, int]] = []
    done: list[Operation] = []
    deadline = time.monotonic() + 30
    while len(done) < want and time.monotonic() < deadline:
        woke.wait(0.2)
        woke.clear()
        progress, issued = eng.take_issued()
        seen += [("progress", op.op_id) for op, _ in progress]
        seen += [("issued", op.op_id) for op in issued]
        got = eng.take_completed()
        seen += [("done", op.op_id) for op in got]
        done += got
    return seen, done


def test_later_layers_issue_off_the_server_thread_in_command_order():
    eng, woke, host, dev, back, dev_before = _engine_and_tables()
    host_before = [t.clone() for t in host.layers]

    # 1) load A: host rows 0..3 -> device rows 8..11; its later layers are held back
    a = _op(1, "load", host, dev, [0, 1, 2, 3], [8, 9, 10, 11], [0, 1, 2, 3])
    eng.submit(a)
    assert a.issued == 1 and a.rest is not None  # layer 0 went out with submit
    gate = threading.Event()
    inner = a.rest

    def held():
        gate.wait(30)
        yield from inner

    a.rest = held()
    t0 = time.perf_counter()
    eng.defer_issue(a)
    assert time.perf_counter() - t0 < 0.05  # the server thread is not held
    assert eng.take_issued() == ([], []) and a.done_event is None

    # 2) backup B of other device rows to other host rows: no dependency, goes out at once
    b = _op(2, "backup", dev, back, [0, 1], [0, 1], [0, 1])
    eng.submit(b)
    assert b.done_event is not None
    b.done_event.synchronize()

    # 3) backup C writes host row 2, which A reads: it must wait for A (after its issue);
    #    load D on the load stream waits too. Both are submitted from a helper thread.
    c = _op(3, "backup", dev, host, [12], [2], [2])
    c.after.append(a)
    d = _op(4, "load", host, dev, [5, 6], [13, 14], [5, 6])
    order: list[str] = []

    def server():
        eng.submit(c)
        order.append("c")
        eng.submit(d)
        order.append("d")
        eng.defer_issue(d)

    th = threading.Thread(target=server)
    th.start()
    time.sleep(0.3)
    assert order == [] and c.t_start == 0.0  # held behind A's issue
    t_gate = time.perf_counter()
    gate.set()
    th.join(30)
    assert order == ["c", "d"] and a.done_event is not None and c.t_start >= t_gate
    assert c.after == []  # its wait is queued: it holds A no longer (nor A's own ``after``)
    seen, done = _collect(eng, woke, 4)
    assert eng.close()
    assert sorted(op.op_id for op in done) == [1, 2, 3, 4] and all(op.ok for op in done)
    for op_id in (1, 4):  # each load is listed as issued before (or with) its completion
        assert seen.index(("issued", op_id)) < seen.index(("done", op_id))
    assert a.issue_s > 0 and a.rest is None and a.issued == len(LAYERS)

    # every byte: A read host rows 0..3 before C overwrote row 2; D; B; nothing else changed
    for li in range(len(LAYERS)):
        got, was, h = dev.layers[li].cpu(), dev_before[li], host_before[li]
        assert torch.equal(got[8:12], h[0:4]) and torch.equal(got[13:15], h[5:7])
        untouched = [r for r in range(ROWS) if r not in (8, 9, 10, 11, 13, 14)]
        assert torch.equal(got[untouched], was[untouched])
        assert torch.equal(back.layers[li][0:2], was[0:2])
        assert not back.layers[li][2:].any()
        assert torch.equal(host.layers[li][2], was[12])  # C wrote it, after A read it
        rest = [r for r in range(ROWS) if r != 2]
        assert torch.equal(host.layers[li][rest], h[rest])


def test_a_slow_issue_reports_its_progress_before_its_end(monkeypatch):
    """With every group worth a notice (``PROGRESS_S`` and ``PROGRESS_BYTES`` 0), a load of 8
    layers (groups 1, 1, 2, 4) is listed with 2 and then 4 layers issued before it is listed as
    fully issued, and that before it completes; every byte arrives."""
    import hicache.controllers.scheduler as sched_mod
    monkeypatch.setattr(sched_mod, "PROGRESS_S", 0.0)
    monkeypatch.setattr(sched_mod, "PROGRESS_BYTES", 0)
    torch.cuda.set_device(DEV)
    layers = tuple(range(8))
    woke = threading.Event()
    eng = Scheduler(DEV, woke.set)
    host = LayerTable([torch.randint(0, 256, (ROWS, ROW), dtype=torch.uint8).pin_memory()
                       for _ in layers], "host")
    dev = LayerTable([torch.zeros(ROWS, ROW, dtype=torch.uint8, device=DEV) for _ in layers],
                     "dev")
    it = Item("p", host, dev, Ids.of([3, 1, 4]), Ids.of([9, 2, 6]), None, layers,
              3 * ROW * len(layers))
    op = Operation(1, "c", "load", [it], [("page", [1, 3, 4], False)], nbytes=it.nbytes)
    op.layer_events = [torch.cuda.Event() for _ in layers]
    op.stage_layers = layers
    eng.submit(op)
    assert op.issued == 1
    eng.defer_issue(op)
    seen: list[tuple] = []
    deadline = time.monotonic() + 30
    while ("done", 1) not in seen and time.monotonic() < deadline:
        woke.wait(0.2)
        woke.clear()
        progress, issued = eng.take_issued()
        seen += [("progress", o.op_id, n) for o, n in progress]
        seen += [("issued", o.op_id) for o in issued]
        seen += [("done", o.op_id) for o in eng.take_completed()]
    assert eng.close()
    assert seen == [("progress", 1, 2), ("progress", 1, 4), ("issued", 1), ("done", 1)]
    assert op.ok and op.issued == len(layers)
    for li in range(len(layers)):
        got = dev.layers[li].cpu()
        assert torch.equal(got[[9, 2, 6]], host.layers[li][[3, 1, 4]])
        assert not got[[r for r in range(ROWS) if r not in (9, 2, 6)]].any()


def test_a_load_issued_while_a_backup_is_in_flight_gets_the_busy_cta_budget(monkeypatch):
    """A load's kernels get ``CTAS`` alone and ``BUSY_LOAD_CTAS`` while a backup is in flight
    (submitted, not yet completed and forgotten by the server thread); with either budget every
    byte of every layer arrives and nothing else changes."""
    import hicache.controllers.scheduler as sched_mod
    budgets: list[int] = []
    real = sched_mod.issue_layers

    def spy(op, stream, ctas, device):
        budgets.append(ctas)
        return real(op, stream, ctas, device)

    monkeypatch.setattr(sched_mod, "issue_layers", spy)
    eng, woke, host, dev, back, dev_before = _engine_and_tables()

    def load(op_id: int, s: list[int], d: list[int]) -> Operation:
        op = _op(op_id, "load", host, dev, s, d, s)
        eng.submit(op)
        eng.defer_issue(op)
        return op

    load(1, [0, 1], [2, 3])  # nothing else in flight
    b = _op(2, "backup", dev, back, [4, 5], [4, 5], [4, 5])  # device rows nobody loads into
    eng.submit(b)
    load(3, [6, 7, 8], [9, 10, 11])  # the backup is held as in flight
    _, done = _collect(eng, woke, 3)
    for op in done:
        eng.forget(op)
    load(4, [12], [13])  # the backup completed and was forgotten
    _, done4 = _collect(eng, woke, 1)
    assert eng.close()
    assert budgets == [sched_mod.CTAS, sched_mod.BUSY_LOAD_CTAS, sched_mod.CTAS]
    assert sched_mod.BUSY_LOAD_CTAS > sched_mod.CTAS
    assert sorted(op.op_id for op in done + done4) == [1, 2, 3, 4]
    assert all(op.ok for op in done + done4)
    moved = {2: 0, 3: 1, 9: 6, 10: 7, 11: 8, 13: 12}  # device row <- host row
    for li in range(len(LAYERS)):
        got, h = dev.layers[li].cpu(), host.layers[li]
        for d, s in moved.items():
            assert torch.equal(got[d], h[s])
        rest = [r for r in range(ROWS) if r not in moved]
        assert torch.equal(got[rest], dev_before[li][rest])
        assert torch.equal(back.layers[li][[4, 5]], dev_before[li][[4, 5]])
        assert not back.layers[li][[r for r in range(ROWS) if r not in (4, 5)]].any()


def test_a_launch_that_fails_part_way_completes_after_what_it_queued(monkeypatch):
    """A backup's second item fails to launch after its first item's copy is queued (behind a
    long kernel on the backup stream): the op is acked failed only once that copy is done, so
    its rows are never freed or reused under it. (Both items' kernel copies launch at the
    backup's ``KernelBatch.flush``, so the failure is the second launch's, not the second
    ``copy_rows`` call's: that would now fail before anything was queued.)"""
    from hicache.kernels import dispatch

    eng, woke, host, dev, back, dev_before = _engine_and_tables()
    real, calls = dispatch.launch_row_copy, []

    def fail_second(*a, **k):
        calls.append(1)
        if len(calls) == 2:
            raise RuntimeError("second item (test)")
        return real(*a, **k)

    monkeypatch.setattr(dispatch, "launch_row_copy", fail_second)
    with torch.cuda.stream(eng.streams["backup"]):
        torch.cuda._sleep(int(1e9))  # the first item's copy waits behind ~0.5 s of kernel
    n = 2 * ROW * len(LAYERS)
    items = [Item(name, dev, back, Ids.of(rows), Ids.of(rows), None, LAYERS, n)
             for name, rows in (("p", [0, 1]), ("q", [2, 3]))]
    op = Operation(5, "c", "backup", items, [("page", [0, 1, 2, 3], True)], nbytes=2 * n)
    eng.submit(op)
    assert not op.ok and "second item (test)" in op.error and len(calls) == 2
    _, done = _collect(eng, woke, 1)
    assert done == [op]
    for layer, t in enumerate(back.layers):  # the queued copy had landed when it completed
        assert torch.equal(t[:2].cpu(), dev_before[layer][:2])
        assert int(t[2:].count_nonzero()) == 0


def test_a_load_whose_completion_event_fails_completes_after_its_copies(monkeypatch):
    """The issuer cannot make a load's completion event after it issued the later layers
    (queued behind a long kernel on the load stream): the load is acked failed only once
    those copies are done, so its rows are never freed or reused under them."""
    eng, woke, host, dev, back, dev_before = _engine_and_tables()
    a = _op(1, "load", host, dev, [0, 1, 2, 3], [8, 9, 10, 11], [0, 1, 2, 3])
    eng.submit(a)  # layer 0 goes out with the reply
    with torch.cuda.stream(eng.streams["load"]):
        torch.cuda._sleep(int(1e9))  # the later layers wait behind ~0.5 s of kernel
    real = torch.cuda.Event

    def event(*args, **kw):
        if threading.current_thread().name == "hicache-issue":
            raise RuntimeError("completion event (test)")
        return real(*args, **kw)

    monkeypatch.setattr(torch.cuda, "Event", event)
    eng.defer_issue(a)
    _, done = _collect(eng, woke, 1)
    monkeypatch.setattr(torch.cuda, "Event", real)
    assert done == [a] and not a.ok and "completion event (test)" in a.error
    for li in range(len(LAYERS)):  # every layer had landed when it completed
        assert torch.equal(dev.layers[li][8:12].cpu(), host.layers[li][0:4])
    assert eng.close()


def test_a_large_backup_is_issued_off_the_server_thread_in_command_order(monkeypatch):
    import hicache.controllers.scheduler as sched_mod
    eng, woke, host, dev, back, dev_before = _engine_and_tables()
    host_before = [t.clone() for t in host.layers]
    monkeypatch.setattr(sched_mod, "DEFER_BACKUP_BYTES", 2 * ROW * len(LAYERS))
    gate = threading.Event()
    threads: dict[int, str] = {}
    real = sched_mod.issue_gpu

    def gated(op, stream, ctas, device):
        threads[op.op_id] = threading.current_thread().name
        if op.op_id == 1:
            gate.wait(30)
        return real(op, stream, ctas, device)

    monkeypatch.setattr(sched_mod, "issue_gpu", gated)
    b1 = _op(1, "backup", dev, back, [0, 1, 2], [0, 1, 2], [0, 1, 2])  # large: deferred
    t0 = time.perf_counter()
    eng.submit(b1)
    assert time.perf_counter() - t0 < 0.05 and b1.done_event is None and eng.issuing()
    b2 = _op(2, "backup", dev, back, [3], [3], [3])  # small, behind b1: deferred too
    eng.submit(b2)
    assert b2.done_event is None
    ld = _op(3, "load", host, dev, [5, 6], [8, 9], [5, 6])  # no dependency: goes out now
    eng.submit(ld)
    assert ld.issued == 1
    eng.defer_issue(ld)
    ld_done = False
    deadline = time.monotonic() + 10
    while not ld_done and time.monotonic() < deadline:
        woke.wait(0.2)
        woke.clear()
        eng.take_issued()
        ld_done = any(op is ld for op in eng.take_completed())
    assert ld_done and b1.done_event is None  # the load completed while b1 was held
    l2 = _op(4, "load", back, dev, [0], [10], [0])  # reads b1's host row 0: waits for b1
    l2.after.append(b1)
    started: list[float] = []

    def server():
        eng.submit(l2)
        started.append(time.perf_counter())
        eng.defer_issue(l2)

    th = threading.Thread(target=server)
    th.start()
    time.sleep(0.3)
    assert started == [] and l2.t_start == 0.0
    t_gate = time.perf_counter()
    gate.set()
    th.join(30)
    assert started and l2.t_start >= t_gate
    _, done = _collect(eng, woke, 3)
    assert eng.close()
    assert sorted(op.op_id for op in done) == [1, 2, 4] and all(op.ok for op in done)
    assert threads == {1: "hicache-issue-backup", 2: "hicache-issue-backup"}  # (loads: by layer)
    for li in range(len(LAYERS)):
        got, was, h = dev.layers[li].cpu(), dev_before[li], host_before[li]
        assert torch.equal(back.layers[li][0:4], was[0:4]) and not back.layers[li][4:].any()
        assert torch.equal(got[8:10], h[5:7]) and torch.equal(got[10], was[0])
        untouched = [r for r in range(ROWS) if r not in (8, 9, 10)]
        assert torch.equal(got[untouched], was[untouched])
        assert torch.equal(host.layers[li], h)


def test_a_deferred_backup_waits_for_the_engine_event_as_recorded_at_its_command(monkeypatch):
    import hicache.controllers.scheduler as sched_mod
    eng, woke, host, dev, back, _ = _engine_and_tables()
    monkeypatch.setattr(sched_mod, "DEFER_BACKUP_BYTES", 1)
    gate = threading.Event()
    real = sched_mod.issue_gpu

    def gated(op, stream, ctas, device):
        gate.wait(30)
        return real(op, stream, ctas, device)

    monkeypatch.setattr(sched_mod, "issue_gpu", gated)
    engine = torch.cuda.Stream(DEV)
    clock = getattr(torch.cuda.get_device_properties(DEV), "clock_rate", 1_980_000)  # kHz
    ev = torch.cuda.Event(interprocess=True)
    with torch.cuda.stream(engine):  # the engine writes the KV, then records the backup's event
        torch.cuda._sleep(int(0.2e3 * clock))
        for t in dev.layers:
            t[0].fill_(7)
        ev.record(engine)
    b = _op(1, "backup", dev, back, [0], [0], [0])
    b.wait_event = ev
    eng.submit(b)  # deferred (held at the gate)
    with torch.cuda.stream(engine):  # later engine work records the same event again
        torch.cuda._sleep(int(1.5e3 * clock))
        for t in dev.layers:
            t[0].fill_(9)
        ev.record(engine)
    t_gate = time.perf_counter()
    gate.set()
    _, done = _collect(eng, woke, 1)
    took = time.perf_counter() - t_gate
    assert done == [b] and b.ok
    assert took < 1.0, f"the backup waited {took:.2f} s: for the later record"
    for t in back.layers:
        assert bool((t[0] == 7).all()) and not t[1:].any()
    engine.synchronize()
    assert eng.close()
