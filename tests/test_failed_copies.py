"""What a copy that fails leaves behind: the host rows a request or a load depends on.

* ``swap_in`` with ``release``: the request's saved state (``swap_out``) lives in one
  ``req_slot`` host row. ``swap_in`` with ``release`` used to defer the row's free before the
  copy ran, so a copy that failed (say a GPU launch error) still freed it: the request's only
  saved state was gone, and a retry was refused ``not_owner`` (forty-fifth session's review).
  Now a failed copy keeps the row, owned as before; a successful one frees it as before; a
  release of the client's rows (reset, unregister, reap) that started while the copy was in
  flight left the row to its pending free, which stands; one that started before does not
  (forty-sixth session's review: any pending release of the client used to).
* A load queued behind a backup that overwrites its host row, when that backup fails part-way
  (the row then holds some pools of each prefix): the load is failed too, never acked ``ok``
  with the mix (forty-sixth session's review); a load of other rows is not.

In-process daemon state driven through the handlers, a copy failure injected at the CPU copy
worker; inline (the ack in the reply) and submitted.
"""
from __future__ import annotations

import threading
import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hicache.controllers import scheduler as sched_mod
from hicache.controllers.handlers import HANDLERS
from hicache.controllers.metrics import Metrics
from hicache.controllers.registry import RegisteredWorker, Registry
from hicache.controllers.scheduler import Scheduler
from hicache.controllers.state import DaemonState
from hicache.core.layout import build_layout, preset
from hicache.host_pools.group import HostPoolGroup
from hicache.kernels.tables import LayerTable

DEVICE_ROWS = {"page": 8, "swa_page": 4, "req_slot": 4}


def _state(inline: bool, req_slots: int = 8) -> DaemonState:
    lay = build_layout(preset("dsv4-tiny"))
    g = HostPoolGroup(lay, {"page": 16, "swa_page": 8, "req_slot": req_slots})
    sch = Scheduler(torch.device("cpu"), lambda: None, inline_max_bytes=1 << 30 if inline else 0)
    return DaemonState(lay, g, sch, Registry(8, 64), Metrics(process_metrics=False),
                       torch.device("cpu"), heartbeat_timeout=60, load_event_sets=1,
                       shm_dirs=("/dev/shm",))


def _engine(st: DaemonState) -> Any:
    """A registered client whose device pools are plain tensors (slot 1 holds 0x5A)."""
    c = st.registry.touch(b"engine", time.monotonic())
    layers = {name: [torch.zeros((DEVICE_ROWS[spec.index], spec.page_bytes), dtype=torch.uint8)
                     for _ in range(spec.num_layers)] for name, spec in st.layout.pools.items()}
    for name, spec in st.layout.pools.items():
        if spec.index == "req_slot":
            for t in layers[name]:
                t[1] = 0x5A
    tables = {k: LayerTable(v, f"device:{k}") for k, v in layers.items()}
    c.worker = RegisteredWorker("engine", 0, dict(DEVICE_ROWS),
                                SimpleNamespace(layers=layers, close=lambda fn=None: None),
                                tables, [], [])
    c.layers = layers
    return c


def _send(st: DaemonState, c: Any, cmd: str, fields: dict, *ids: list[int]) -> dict:
    """A command as the server runs it (``ids``: its index arrays): the handler's reply, then
    the after-reply work."""
    arrays = [np.array(a, dtype=np.int64) for a in ids]
    reply, out = HANDLERS[cmd](st, c, {"v": 1, "cmd": cmd, "id": 1, **fields}, arrays)
    if out:
        reply = {**reply, "arrays": [np.asarray(a).tolist() for a in out]}
    if st.post:
        st.after_reply()
    return reply


def _ack(st: DaemonState, reply: dict) -> dict:
    """The reply with its op's ack (in the reply, or once the op completed)."""
    ack = reply.get("ack")
    deadline = time.monotonic() + 10
    while ack is None:
        st.collect()
        done = [a for cc, a in st.outbox if a["op"] == reply["op"]]
        if done:
            ack = done[0]
        assert time.monotonic() < deadline, "the op never completed"
        time.sleep(0.002)
    st.collect()
    return {**reply, "ack": ack}


def _run(st: DaemonState, c: Any, cmd: str, fields: dict, *ids: list[int]) -> dict:
    """A command as the server runs it, its ack awaited."""
    return _ack(st, _send(st, c, cmd, fields, *ids))


def _failing_copy(monkeypatch: pytest.MonkeyPatch, gate: threading.Event | None = None) -> None:
    """Every CPU copy fails from now on (after ``gate`` is set, when given)."""
    def failing(*a: Any, **kw: Any) -> Any:
        if gate is not None:
            assert gate.wait(10)
        raise RuntimeError("injected copy failure")

    monkeypatch.setattr(sched_mod, "run_cpu_item", failing)


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "submitted"])
def test_a_failed_swap_in_keeps_the_saved_state_and_a_retry_takes_it(
        monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    st = _state(inline)
    try:
        c = _engine(st)
        out = _run(st, c, "swap_out", {"slot": 1, "request": "r1"})
        row = out["host_row"]
        assert out["ack"]["status"] == "ok"
        assert st.owner_of("req_slot", row) == (c.cid, "r1")
        real = sched_mod.run_cpu_item
        _failing_copy(monkeypatch)
        bad = _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                      "request": "r1"})
        assert bad["ack"]["status"] == "error" and "injected" in bad["ack"]["error"]["message"]
        # the state is where it was: owned as before, not pending a free, its bytes intact
        assert st.owner_of("req_slot", row) == (c.cid, "r1")
        assert not st.tracker.busy("req_slot", [row]) and not st.tracker.deferred
        monkeypatch.setattr(sched_mod, "run_cpu_item", real)
        good = _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                       "request": "r1"})
        assert good["ack"]["status"] == "ok"
        for name, spec in st.layout.pools.items():
            if spec.index == "req_slot":
                assert all(bool((t[2] == 0x5A).all()) for t in c.layers[name])
        assert st.owner_of("req_slot", row) is None  # released after the good copy
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def test_a_failed_swap_in_a_release_started_under_leaves_the_row_to_that_release(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset while the swap_in is in flight: the release skipped the row whose free was
    pending, so that free stands when the copy fails and the row still goes back (no leak)."""
    st = _state(inline=False)
    try:
        c = _engine(st)
        row = _run(st, c, "swap_out", {"slot": 1, "request": "r1"})["host_row"]
        gate = threading.Event()
        _failing_copy(monkeypatch, gate)
        sent = _send(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                        "request": "r1"})
        _send(st, c, "reset", {})
        assert st.releaser.pending and st.tracker.busy("req_slot", [row])
        gate.set()
        assert _ack(st, sent)["ack"]["status"] == "error"
        deadline = time.monotonic() + 10
        while st.releaser.pending and time.monotonic() < deadline:
            st.collect()
        assert st.owner_of("req_slot", row) is None  # gone back: not kept, not leaked
        assert not st.tracker.deferred and not st.tracker.busy("req_slot", [row])
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def test_a_failed_swap_in_of_a_row_taken_after_a_release_began_keeps_it(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A reset of a client holding many rows gives them back over many loop turns; a row the
    client took after it (a request preempted meanwhile) is not that release's: a failed
    swap_in of it keeps it, as for any other client (forty-sixth session's review)."""
    st = _state(inline=True, req_slots=8192)
    try:
        c = _engine(st)
        _send(st, c, "alloc", {"counts": {"req_slot": 8000}})
        _send(st, c, "reset", {})
        assert st.releaser.pending  # 8,000 rows: 256 a slice, a budget per loop turn
        out = _run(st, c, "swap_out", {"slot": 1, "request": "r1"})
        row = out["host_row"]
        assert out["ack"]["status"] == "ok" and st.releaser.pending
        real = sched_mod.run_cpu_item
        _failing_copy(monkeypatch)
        bad = _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                      "request": "r1"})
        assert bad["ack"]["status"] == "error"
        assert st.owner_of("req_slot", row) == (c.cid, "r1")  # kept
        monkeypatch.setattr(sched_mod, "run_cpu_item", real)
        assert _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                       "request": "r1"})["ack"]["status"] == "ok"
        while st.releaser.pending:
            st.collect()
        assert st.owner_of("req_slot", row) is None
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def test_a_load_behind_an_overwrite_that_fails_part_way_fails_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    st = _state(inline=False)
    try:
        c = _engine(st)
        page = [n for n, p in st.layout.pools.items() if p.index == "page"]
        assert len(page) > 1
        for n in page:  # prefix A in device rows 0 and 3
            for t in c.layers[n]:
                t[0] = t[3] = 0xAA
        first = _run(st, c, "backup", {"alloc": True, "items": [{"space": "page", "src": 0}]},
                     [0, 3])
        h, other = first["arrays"][0]
        assert first["ack"]["status"] == "ok"
        for n in page:  # prefix B, backed up into the same host row h
            for t in c.layers[n]:
                t[0] = 0xBB
        real, gate, pools = sched_mod.run_cpu_item, threading.Event(), []

        def second_pool_fails(it: Any, stop: Any = None) -> Any:
            if it.dst.name.startswith("host:"):  # the overwriting backup's items
                assert gate.wait(10)
                pools.append(it.pool)
                if len(pools) == 2:
                    raise RuntimeError("injected failure after the first pool")
            return real(it, stop)

        monkeypatch.setattr(sched_mod, "run_cpu_item", second_pool_fails)
        item = {"items": [{"space": "page", "src": 0, "dst": 1}]}
        over = _send(st, c, "backup", item, [0], [h])
        load = _send(st, c, "load", item, [h], [1])
        calm = _send(st, c, "load", item, [other], [2])
        gate.set()
        assert _ack(st, over)["ack"]["status"] == "error"
        ack = _ack(st, load)["ack"]
        assert ack["status"] == "error", "a load of a half-overwritten row was acked ok"
        assert f"operation {over['op']} (backup), which failed" in ack["error"]["message"]
        assert _ack(st, calm)["ack"]["status"] == "ok"  # rows nobody overwrote
        for n in page:
            assert all(bool((t[2] == 0xAA).all()) for t in c.layers[n])
            assert int(st.group.written[n][h]) == 0  # the row itself: unwritten, as before
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def _gated_failure(monkeypatch: pytest.MonkeyPatch, fails: Any) -> threading.Event:
    """Host-row writes wait for the returned gate; those ``fails(item, n)`` says (``n``: host
    writes so far, this one included) raise."""
    real, gate, n = sched_mod.run_cpu_item, threading.Event(), [0]

    def copy(it: Any, stop: Any = None) -> Any:
        if it.dst.name.startswith("host:"):
            assert gate.wait(10)
            n[0] += 1
            if fails(it, n[0]):
                raise RuntimeError("injected copy failure")
        return real(it, stop)

    monkeypatch.setattr(sched_mod, "run_cpu_item", copy)
    return gate


def test_a_load_no_failed_write_tore_is_not_failed(monkeypatch: pytest.MonkeyPatch) -> None:
    """A failed backup of one pool does not fail a load of another pool of the same row; a
    failed overwrite followed by a whole overwrite that succeeded does not fail a load behind
    both (it reads the second's bytes whole)."""
    st = _state(inline=False)
    try:
        c = _engine(st)
        page = [n for n, p in st.layout.pools.items() if p.index == "page"]
        for n in page:
            for t in c.layers[n]:
                t[0], t[3] = 0xAA, 0xBB
        h = _run(st, c, "backup", {"alloc": True, "items": [{"space": "page", "src": 0}]},
                 [0])["arrays"][0][0]
        gate = _gated_failure(monkeypatch, lambda it, n: n == 1)  # the first host write fails
        c4 = _send(st, c, "backup", {"items": [{"pool": "c4_kv", "src": 0, "dst": 1}]}, [3], [h])
        other = _send(st, c, "load", {"items": [{"pool": "c128_kv", "src": 0, "dst": 1}]}, [h],
                      [2])
        gate.set()
        assert _ack(st, c4)["ack"]["status"] == "error"
        assert _ack(st, other)["ack"]["status"] == "ok"  # c128_kv: nobody wrote it
        assert all(bool((t[2] == 0xAA).all()) for t in c.layers["c128_kv"])
        h2 = _run(st, c, "backup", {"alloc": True, "items": [{"space": "page", "src": 0}]},
                  [0])["arrays"][0][0]
        gate = _gated_failure(monkeypatch, lambda it, n: n == 2)  # W1's second pool fails
        item = {"items": [{"space": "page", "src": 0, "dst": 1}]}
        w1 = _send(st, c, "backup", item, [3], [h2])
        w2 = _send(st, c, "backup", item, [3], [h2])  # whole rows, succeeds
        load = _send(st, c, "load", item, [h2], [5])
        gate.set()
        assert [_ack(st, x)["ack"]["status"] for x in (w1, w2, load)] == ["error", "ok", "ok"]
        for n in page:
            assert all(bool((t[5] == 0xBB).all()) for t in c.layers[n])  # W2's, whole
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def test_a_sparse_copy_of_host_hits_behind_a_failed_overwrite_fails_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``sparse_admit``'s copy of host-tier hits into the sparse region reads host rows as a
    load does (forty-sixth session's diff review: only loads and swap-ins were covered)."""
    from hicache.controllers.ops import Ids, Item, Operation
    from hicache.kernels.tables import LayerTable

    st = _state(inline=False)
    try:
        c = _engine(st)
        h = _run(st, c, "backup", {"alloc": True, "items": [{"space": "page", "src": 0}]},
                 [0])["arrays"][0][0]
        gate = _gated_failure(monkeypatch, lambda it, n: it.pool == "c4_kv")
        over = _send(st, c, "backup", {"items": [{"space": "page", "src": 0, "dst": 1}]}, [3],
                     [h])
        spec = st.layout.pools["c4_kv"]  # what sparse._copy submits for a host hit
        region = LayerTable([torch.zeros((2, spec.page_bytes), dtype=torch.uint8)
                             for _ in range(spec.num_layers)], "sparse:region")
        it = Item("c4_kv", st.host_tables["c4_kv"], region, Ids.of([h]), Ids.of([0]), None,
                  tuple(spec.layers), spec.num_layers * spec.page_bytes)
        op = Operation(st.next_op_id(), c.cid, "sparse_backup", [it],
                       [("page", np.array([h], dtype=np.int64), False)], nbytes=it.nbytes)
        assert st.start(c, op) is None
        st.after_reply()
        gate.set()
        assert _ack(st, over)["ack"]["status"] == "error"
        ack = _ack(st, {"op": op.op_id})["ack"]
        assert ack["status"] == "error" and "which failed" in ack["error"]["message"]
    finally:
        st.group.close()


@pytest.mark.parametrize("honours_cancel", [True, False], ids=["cpu_copy", "stuck_copy"])
def test_a_stop_past_its_drain_never_acks_a_copy_that_may_still_write(
        monkeypatch: pytest.MonkeyPatch, honours_cancel: bool) -> None:
    """A stop whose drain ran out (30 s in the daemon) acked every op still in flight "failed"
    while its copy went on writing the engine's device rows: an engine that reads the ack as
    "buffers free" reuses them under the late copy (forty-eighth session's lifecycle review).
    Now CPU copies are cancelled and waited for (their acks come once they stopped, nothing
    written after), and one that still runs is acked ``abandoned``, which the radix hooks read
    as an unknown outcome (keep the device rows), not a plain failure."""
    from hicache.controllers.scheduler import Cancelled
    from hicache.engine.acks import Ack
    from hicache.engine.acks import TransferFailed as ClientFailed
    from hicache.engine.hooks import ClientHooks, CopyOutcomeUnknown, Ticket, TransferFailed

    st = _state(inline=False)
    gate = threading.Event()
    real = sched_mod.run_cpu_item
    try:
        c = _engine(st)
        h = _run(st, c, "backup", {"alloc": True, "items": [{"space": "page", "src": 0}]},
                 [0])["arrays"][0][0]
        for name, spec in st.layout.pools.items():
            if spec.index == "page":
                for t in c.layers[name]:
                    t[5] = 0x33

        def long_copy(it: Any, stop: Any = None) -> Any:  # a copy of many chunks
            while not gate.wait(0.01):
                if honours_cancel and stop is not None and stop():
                    raise Cancelled("cancelled at a chunk")
            return real(it, stop)

        monkeypatch.setattr(sched_mod, "run_cpu_item", long_copy)
        load = _send(st, c, "load", {"items": [{"space": "page", "src": 0, "dst": 1}]}, [h],
                     [5])
        st.stopping = True
        waited = st.stop_drain(0.2, 0.5 if honours_cancel else 0.2)
        if honours_cancel:
            assert waited == "idle"
        else:
            assert waited == "timeout"
            st.fail_pending("daemon shutting down")
        ack = _ack(st, load)["ack"]
        assert ack["status"] == "error"
        code = ack["error"]["code"]
        assert code == ("transfer_failed" if honours_cancel else "abandoned"), ack
        assert ack["error"]["message"].startswith("daemon shutting down"), ack
        gate.set()  # a stuck copy goes on now, after its ack

        def row_5_kept() -> bool:
            return all(bool((t[5] == 0x33).all()) for name, spec in st.layout.pools.items()
                       if spec.index == "page" for t in c.layers[name])

        deadline = time.monotonic() + 5
        while row_5_kept() and not honours_cancel and time.monotonic() < deadline:
            time.sleep(0.01)
        time.sleep(0.05)
        # a cancelled copy wrote nothing, before or after its ack; a stuck one wrote after it
        assert row_5_kept() == honours_cancel
        # what the radix tree hears, on each path an ack reaches it: a raised ``check=True``
        # failure, and the tree's own ``wait`` (``check=False``: the ack is read); then whether
        # ``reset_host_tier`` may free the load's device rows (``copies_running``)
        got = Ack(ack["op"], "load", "error", {}, 0, 0.0, 0.0, "", ack["error"])
        client = SimpleNamespace(daemon_in_flight=1, poll_acks=lambda ids, **kw: [],
                                 wait_ack=lambda op, timeout=None, check=True: got)
        hooks = ClientHooks(client, ["page"])
        want = CopyOutcomeUnknown if code == "abandoned" else TransferFailed

        def failed() -> None:
            raise ClientFailed(got)

        with pytest.raises(want):
            hooks._call(failed)
        ticket = Ticket(SimpleNamespace(op_id=ack["op"], ack=None), "load", 1, 0.0)
        with pytest.raises(want):
            hooks.wait(ticket)
        assert hooks.copies_running([ticket]) is (code == "abandoned")  # (while it may copy)
        client.daemon_in_flight = 0  # a restarted daemon at the address: none can copy
        assert hooks.copies_running([ticket]) is False
    finally:
        gate.set()
        st.group.close()
