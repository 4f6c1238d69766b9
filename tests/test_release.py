"""The pieces that keep the reaper off the server loop (issue 17, item 5): a reaped client's rows
go back a slice at a time (``HostPoolGroup.free_client_rows``, all or nothing, only its own
rows, zeroed with ``zero_on_free``), and its mappings are unmapped on the ``Unmapper`` thread,
never while a view of them is alive; a daemon's stop waits for that thread (and says when it
could not). CPU only, in-process."""
from __future__ import annotations

import mmap
import os
import threading
import time
import weakref

import numpy as np
import pytest
import torch

from hicache.controllers import background
from hicache.controllers.background import Unmapper, background_priority
from hicache.core.layout import build_layout, preset
from hicache.host_pools.errors import PoolError
from hicache.host_pools.group import UNWRITTEN, WRITTEN, HostPoolGroup

ROWS = {"page": 12, "swa_page": 6, "req_slot": 4}


def _group(**kw) -> HostPoolGroup:
    return HostPoolGroup(build_layout(preset("dsv4-tiny")), ROWS, **kw)


def test_free_client_rows_any_request_all_or_nothing():
    with _group() as g:
        a1 = g.alloc({"page": 3}, ("a", "r1"))["page"].numpy()
        a2 = g.alloc({"page": 2, "swa_page": 2}, ("a", None))
        b = g.alloc({"page": 2}, ("b", None))["page"].numpy()
        before = g.allocators["page"].snapshot()
        # a row of another client, a repeated row, a free row: refused, nothing changes
        for bad in ([a1[0], b[0]], [a1[0], a1[0]], [a1[0], 11]):
            with pytest.raises(PoolError):
                g.free_client_rows("a", {"page": np.array(bad)})
        with pytest.raises(PoolError):  # the second space is wrong: the first is not freed
            g.free_client_rows("a", {"page": a1[:1], "swa_page": np.array([5])})
        assert g.allocators["page"].snapshot() == before
        # rows of both requests of "a" in one slice, then the rest
        assert g.free_client_rows("a", {"page": np.array([a1[0], int(a2["page"][0])])}) == 2
        assert g.free_client_rows("a", {"page": np.concatenate([a1[1:], a2["page"][1:]]),
                                        "swa_page": a2["swa_page"].numpy()}) == 5
        assert g.rows_of("a")["page"].numel() == 0 and g.rows_of("a")["swa_page"].numel() == 0
        assert sorted(g.rows_of("b")["page"].tolist()) == sorted(b.tolist())
        g.check_invariants()


def test_free_client_rows_returns_rows_unwritten_and_zeroed():
    with _group(zero_on_free=True) as g:
        rows = g.alloc({"page": 4}, ("a", None))["page"].numpy()
        for name in ("c4_kv", "c128_kv"):
            g.begin_write(name, rows, zero=False)
            for t in g.pools[name].layers:
                t[torch.from_numpy(rows)] = 0xAB
            g.end_write(name, rows, ok=True)
        assert (g.written["c4_kv"][rows] == WRITTEN).all()
        g.free_client_rows("a", {"page": rows[:2]})
        for name in ("c4_kv", "c128_kv"):
            assert (g.written[name][rows[:2]] == UNWRITTEN).all()
            assert (g.written[name][rows[2:]] == WRITTEN).all()
            for t in g.pools[name].layers:
                assert int(t[rows[:2]].count_nonzero()) == 0  # zeroed in the release
                assert bool((t[rows[2:]] == 0xAB).all())  # the rest untouched
        g.check_invariants()


def _shm(nbytes: int) -> tuple[mmap.mmap, str]:
    path = f"/dev/shm/hicache-test-unmap-{os.getpid()}-{time.monotonic_ns()}"
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes), path
    finally:
        os.close(fd)


def test_unmapper_waits_for_the_last_view_and_unmaps_on_its_thread(monkeypatch):
    mm, path = _shm(1 << 20)
    try:
        gone = weakref.ref(mm)
        view = torch.frombuffer(mm, dtype=torch.uint8)[4096:8192].view(4, 1024)
        view.fill_(7)
        u = Unmapper()
        u.hand([mm])
        del mm
        time.sleep(0.1)
        assert u.pending() == 1 and gone() is not None  # a view is alive: still mapped
        assert int(view.sum()) == 7 * 4096  # and readable
        del view
        assert u.flush(5.0) and gone() is None  # the unmapper dropped the last reference
        with open(path, "rb") as f:  # emptying the mapping first left the file's bytes alone
            data = f.read()
        assert data[4096:8192] == b"\x07" * 4096 and data[:4096] == bytes(4096)
    finally:
        os.unlink(path)


def test_unmapper_drops_on_its_own_thread():
    seen: list[str] = []

    class Probe:
        def __del__(self) -> None:
            seen.append(threading.current_thread().name)

    u = Unmapper()
    u.hand([Probe()])
    assert u.flush(5.0)
    assert seen == ["hicache-unmap"]


def test_background_priority_lowers_only_the_calling_thread():
    got: dict[str, int] = {}

    def worker() -> None:
        assert background_priority()
        got["worker"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    before = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())
    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got["worker"] == max(before, background.BACKGROUND_NICE)
    assert os.getpriority(os.PRIO_PROCESS, threading.get_native_id()) == before


def test_cpu_copy_thread_leaves_a_core_to_the_loop():
    got: dict[str, int] = {}

    def worker() -> None:
        got["threads"] = background.cpu_copy_thread()
        got["nice"] = os.getpriority(os.PRIO_PROCESS, threading.get_native_id())

    t = threading.Thread(target=worker)
    t.start()
    t.join()
    assert got["threads"] == max(1, len(os.sched_getaffinity(0)) - 1)
    assert got["nice"] >= background.BACKGROUND_NICE


# ----------------------------------------------------------------------------- the releaser
def _releaser(g: HostPoolGroup, live: set[int], cancelled: list[int], sparse=lambda: None):
    from hicache.controllers.loop_watch import LoopWatch
    from hicache.controllers.registry import ClientState, Registry
    from hicache.controllers.release import Releaser
    from hicache.controllers.row_tracker import RowTracker

    tracker = RowTracker(dict(g.rows))
    reg = Registry(8, 16)
    gauge: list[float] = []
    rel = Releaser(g, tracker, reg, lambda ids: cancelled.extend(ids) or len(ids),
                   live.__contains__, sparse, LoopWatch(), gauge.append)
    return rel, tracker, reg, gauge, ClientState


def test_releaser_waits_for_the_operations_then_frees_in_bounded_turns(monkeypatch):
    from hicache.controllers import release

    with HostPoolGroup(build_layout(preset("dsv4-tiny")), {"page": 4096, "swa_page": 6,
                                                           "req_slot": 4}) as g:
        live, cancelled = {7, 8}, []
        rel, tracker, reg, gauge, ClientState = _releaser(g, live, cancelled)
        mine = g.alloc({"page": 3000, "swa_page": 2}, ("a", None))["page"].numpy()
        other = g.alloc({"page": 10}, ("b", None))["page"].numpy()
        tracker.defer({"page": mine[:5]}, ("a", None))  # a free already pending: it stands
        c = reg.touch(b"a", 0.0)
        freed, deferred = rel.start(c, "reaped (test)", [7, 8], None, cancel=[7, 8], forget=True)
        assert (freed, deferred) == (0, True) and cancelled == [7, 8]
        assert tracker.busy("page", mine[5:]) and not tracker.busy("page", other)
        assert tracker.pending_rows("page") == 3000
        for _ in range(3):  # operations live: nothing goes back, however often the loop turns
            rel.dirty = True
            assert rel.step() == 0
        assert g.rows_of("a")["page"].numel() == 3000
        live.clear()
        rel.dirty = True
        monkeypatch.setattr(release, "BUDGET_S", 0.0)  # one slice per turn
        turns, n = 0, 0
        while rel.pending:
            got = rel.step()
            assert got <= release.SLICE_ROWS
            n += got
            turns += 1
        assert n == 2995 + 2 and turns == -(-2995 // release.SLICE_ROWS) + 1
        assert sorted(g.rows_of("a")["page"].tolist()) == sorted(mine[:5].tolist())
        assert sorted(g.rows_of("b")["page"].tolist()) == sorted(other.tolist())
        assert tracker.held == 0 and not tracker.busy("page", mine[5:]) and gauge
        g.check_invariants()


def test_releaser_zeroes_off_the_loop_then_frees_without_zeroing_again(monkeypatch):
    from hicache.controllers import release

    with HostPoolGroup(build_layout(preset("dsv4-tiny")), {"page": 512, "swa_page": 6,
                                                           "req_slot": 4},
                       zero_on_free=True) as g:
        rel, tracker, reg, gauge, _ = _releaser(g, set(), [])
        mine = g.alloc({"page": 300}, ("a", None))["page"].numpy()
        other = g.alloc({"page": 4}, ("b", None))["page"].numpy()
        for name in ("c4_kv", "c128_kv"):
            for t in g.pools[name].layers:
                t[torch.from_numpy(mine)] = 0xAB
                t[torch.from_numpy(other)] = 0xCD
        zeroing_threads: list[str] = []
        real = g._zero  # every zeroing, on the zero thread or in a free, goes through here
        gate = threading.Event()  # holds the zero thread until start() has returned

        def zero(pool: str, r: object) -> None:
            zeroing_threads.append(threading.current_thread().name)
            gate.wait(10)  # (a zeroing on the loop would wait too, and fail the check below)
            real(pool, r)

        monkeypatch.setattr(g, "_zero", zero)
        freed, deferred = rel.start(reg.touch(b"a", 0.0), "reset", [], None, cancel=[],
                                   forget=False)
        # 300 rows of 141 KiB: handed to the zero thread, none freed before they are zeroed
        assert deferred and freed == 0
        gate.set()
        deadline = time.monotonic() + 10
        while rel.pending and time.monotonic() < deadline:
            rel.step()
            time.sleep(0.001)
        assert not rel.pending and set(zeroing_threads) == {"hicache-zero"}
        for name in ("c4_kv", "c128_kv"):
            for t in g.pools[name].layers:
                assert int(t[torch.from_numpy(mine)].count_nonzero()) == 0
                assert bool((t[torch.from_numpy(other)] == 0xCD).all())
        assert g.rows_of("a")["page"].numel() == 0 and tracker.held == 0
        assert (g.written["c4_kv"][mine] == UNWRITTEN).all()
        g.check_invariants()


def test_a_zeroing_that_fails_leaves_no_row_behind_and_none_unzeroed(monkeypatch):
    """The zero thread fails after its first chunk: the loop frees the rest and zeroes them
    itself; every row goes back zeroed, none stays held."""
    from hicache.controllers import release

    monkeypatch.setattr(release, "ZERO_BYTES", 64 << 10)  # several chunks
    with HostPoolGroup(build_layout(preset("dsv4-tiny")), {"page": 512, "swa_page": 6,
                                                           "req_slot": 4},
                       zero_on_free=True) as g:
        rel, tracker, reg, _, _ = _releaser(g, set(), [])
        mine = g.alloc({"page": 300}, ("a", None))["page"].numpy()
        for t in g.pools["c4_kv"].layers:
            t[torch.from_numpy(mine)] = 0xAB
        real, calls = g.zero_space_rows, []

        def zero_then_fail(space: str, rows: np.ndarray) -> None:
            calls.append(rows.size)
            if len(calls) > 1:
                raise OSError("zeroing failed (test)")
            real(space, rows)

        monkeypatch.setattr(g, "zero_space_rows", zero_then_fail)
        rel.start(reg.touch(b"a", 0.0), "reset", [], None, cancel=[], forget=False)
        deadline = time.monotonic() + 10
        while rel.pending and time.monotonic() < deadline:
            rel.step()
            time.sleep(0.001)
        assert not rel.pending and len(calls) == 2 and calls[0] < mine.size
        assert g.rows_of("a")["page"].numel() == 0 and tracker.held == 0
        for t in g.pools["c4_kv"].layers:
            assert int(t[torch.from_numpy(mine)].count_nonzero()) == 0
        g.check_invariants()


def test_a_release_is_not_done_while_its_last_zeroed_chunk_is_being_handed_back():
    """The zero thread hands its last chunk back and clears ``zeroing`` between the loop's
    reads: the loop must read ``zeroing`` first, or it ends the release with rows queued."""
    from collections import deque

    from hicache.controllers.release import Release

    with HostPoolGroup(build_layout(preset("dsv4-tiny")), {"page": 64, "swa_page": 6,
                                                           "req_slot": 4}) as g:
        rel, tracker, reg, _, _ = _releaser(g, set(), [])
        rows = g.alloc({"page": 16}, ("a", None))["page"].numpy()
        tracker.hold("page", rows)
        r = Release(reg.touch(b"a", 0.0), "reset", {}, set(), None, [], None, 16, False)
        r.ready, r.zeroing = True, True

        class Racy(deque):  # the zero thread runs right after the loop's first look
            looks = 0

            def __len__(self) -> int:
                n = deque.__len__(self)
                Racy.looks += 1
                if Racy.looks == 2:
                    self.append(("page", rows, True))
                    r.zeroing = False
                return n

        r.zeroed = Racy()
        rel.pending.append(r)
        for _ in range(3):
            rel.step()
        assert not rel.pending and g.rows_of("a")["page"].numel() == 0 and tracker.held == 0


class _Region:
    """The sparse side a ``Releaser`` sees: no requests, no region to detach, and ``held``
    rows of a region the client bound again while its ``unregister`` waited."""

    def __init__(self) -> None:
        self.requests: dict = {}
        self.held, self.dropped = 0, []

    def detach(self, cid: str) -> None:
        return None

    def rows_held(self, cid: str) -> int:
        return self.held

    def drop(self, cid: str) -> None:
        self.dropped.append(cid)


@pytest.mark.parametrize("holds", ["in_flight", "kv", "channel", "sparse"])
def test_an_unregistered_client_that_opened_more_is_not_forgotten(holds):
    """An ``unregister`` waited for the client's copies; meanwhile it sent an L3 query, attached
    key-store pools, opened a channel or took rows of a sparse region it bound again: when the
    release ends it stays known (forgetting it dropped the query's ack, unmapped the pools,
    unlinked the channel, took the region away with its rows in use)."""
    region = _Region()
    with HostPoolGroup(build_layout(preset("dsv4-tiny")), dict(ROWS)) as g:
        live = {3}
        rel, _, reg, _, _ = _releaser(g, live, [], sparse=lambda: region)
        c = reg.touch(b"a", 0.0)
        rel.start(c, "unregister", [3], None, cancel=[], forget=True)
        if holds == "sparse":
            region.held = 2
        else:
            setattr(c, holds, 1 if holds == "in_flight" else object())
        live.clear()
        rel.dirty = True
        rel.step()
        assert not rel.pending and reg.clients.get(b"a") is c and region.dropped == []
        if holds == "sparse":
            region.held = 0
        else:
            setattr(c, holds, 0 if holds == "in_flight" else None)
        rel.start(c, "unregister", [], None, cancel=[], forget=True)  # holds nothing now
        assert not rel.pending and b"a" not in reg.clients and region.dropped == [c.cid]


def test_a_stop_waits_for_the_unmapper_and_names_what_it_could_not_drop(tmp_path, monkeypatch,
                                                                      caplog):
    """``Daemon.close`` waits for the unmapper (up to ``UNMAP_WAIT_S``) before the process may
    exit, and when the wait runs out it logs how many workers' mappings were still being
    dropped, then finishes its teardown. A real in-process CPU daemon; the held-up job is an
    object whose drop blocks until the test lets it go."""
    import logging

    from hicache.controllers import daemon as daemon_mod
    from hicache.core.config import ServeConfig

    cfg = ServeConfig(preset="dsv4-tiny", device_rows=dict(ROWS), host_ratio=2.0,
                      socket=f"ipc://{tmp_path}/d.sock", numa_node="off")
    d = daemon_mod.Daemon(cfg)
    let_go, dropped = threading.Event(), threading.Event()

    class Slow:
        def __del__(self) -> None:
            let_go.wait(30)
            dropped.set()

    monkeypatch.setattr(daemon_mod, "UNMAP_WAIT_S", 0.3)
    unmapper = d.state.unmapper
    unmapper.hand([Slow()])
    try:
        with caplog.at_level(logging.INFO, logger=daemon_mod.log.name):
            t0 = time.monotonic()
            d.close()
            took = time.monotonic() - t0
        assert 0.3 <= took < 10  # waited the whole window, then went on
        msgs = [r.getMessage() for r in caplog.records]
        assert "shutdown: device mappings of 1 workers were still being dropped after 0 s" \
            in msgs, msgs
        assert any(m.startswith("shutdown: drained in") for m in msgs)  # teardown went on
        assert not dropped.is_set() and unmapper.pending() == 1
    finally:
        let_go.set()
    assert unmapper.flush(10.0) and dropped.is_set()


def test_a_stop_with_nothing_left_to_unmap_logs_no_wait(tmp_path, caplog):
    import logging

    from hicache.controllers import daemon as daemon_mod
    from hicache.core.config import ServeConfig

    cfg = ServeConfig(preset="dsv4-tiny", device_rows=dict(ROWS), host_ratio=2.0,
                      socket=f"ipc://{tmp_path}/d.sock", numa_node="off")
    d = daemon_mod.Daemon(cfg)
    with caplog.at_level(logging.INFO, logger=daemon_mod.log.name):
        d.close()
    msgs = [r.getMessage() for r in caplog.records]
    assert not any("still being dropped" in m for m in msgs), msgs
    assert any(m.startswith("shutdown: drained in") for m in msgs)


def _daemon(tmp_path, **kw):
    from hicache.controllers import daemon as daemon_mod
    from hicache.core.config import ServeConfig

    return daemon_mod.Daemon(ServeConfig(preset="dsv4-tiny", device_rows=dict(ROWS),
                                         host_ratio=2.0, socket=f"ipc://{tmp_path}/d.sock",
                                         numa_node="off", **kw))


def test_an_op_failed_at_a_stop_then_completed_is_finished_once(tmp_path):
    """A stop whose drain timed out fails the ops left (``fail_pending``); one that completes
    after that is not finished again (it raised ``KeyError``, and the teardown was skipped)."""
    from hicache.controllers.ops import Operation

    d = _daemon(tmp_path)
    try:
        st = d.state
        c = st.registry.touch(b"x", time.monotonic())
        op = Operation(st.next_op_id(), c.cid, "backup", [], [], nbytes=0)
        op.t_submit = op.t_start = time.perf_counter()
        st.ops[op.op_id] = (op, c)
        c.in_flight += 1
        st.fail_pending("daemon shutting down")
        st._finish(op)  # its completion thread finished it after all
        assert c.in_flight == 0 and not st.ops and len(st.outbox) == 1
    finally:
        d.close()


def test_a_silent_probe_is_forgotten_without_a_reap_to_remember(tmp_path):
    """A peer that never registered and holds nothing (a ``stats`` probe) going silent is
    forgotten at once: its identity's next client is not told of a reap."""
    d = _daemon(tmp_path)
    try:
        st = d.state
        c = st.registry.touch(b"probe", 0.0)
        assert st.reap(c, "silent (test)") is False
        assert b"probe" not in st.registry.clients and b"probe" not in st.registry.retiring
        assert b"probe" not in st.registry.reaped and not st.releaser.pending
        assert st.registry.touch(b"probe", 1.0).reaped is None
    finally:
        d.close()


@pytest.mark.parametrize("how", ["reap", "reset", "unregister"])
def test_a_key_store_l3_job_in_flight_belongs_to_no_client(tmp_path, how):
    """The key store's own L3 jobs (write-through, fetch) sit in the same table as the clients'
    L3 jobs but carry no client. A reap, ``reset`` or ``unregister`` while one is in flight used
    to fail on it (the reap on the server loop itself, stopping the daemon); now the client's
    rows go back at once and the job is left alone."""
    from hicache.controllers.handlers import HANDLERS
    from hicache.controllers.kv_l3 import _Tag
    from hicache.controllers.l3_store import L3Job

    d = _daemon(tmp_path)
    st = d.state
    try:
        c = st.registry.touch(b"engine-b", 0.0)
        c.worker = _Worker()
        HANDLERS["alloc"](st, c, {"counts": {"page": 2}}, [])
        st.l3_ops[999] = L3Job("put", ["k"], tag=_Tag(999, lambda job: None))
        if how == "reap":
            st.reap(c, "silent")
        else:
            HANDLERS[how](st, c, {}, [])
        assert not st.group.rows_of(c.cid)["page"].numel() and not st.releaser.pending
        assert b"engine-b" not in st.registry.retiring and 999 in st.l3_ops
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.l3_ops.pop(999, None)  # no L3 tier here to finish it
        d.close()


class _Worker:
    """Stands in for a registered worker (nothing mapped)."""

    device_rows: dict[str, int] = {}

    def close(self, handoff=None) -> None:
        pass


def test_a_sparse_region_goes_with_its_client_and_never_comes_back(tmp_path):
    """``unregister`` with a copy in flight: the client's sparse region is taken from it at
    once (its memfd closes when the copy ended), and while the client waits to be forgotten it
    cannot bind another (``not_registered``: binding takes a worker). A client that registers
    again meanwhile gets a new region (``--sparse-clients 2``: the closing one still counts),
    never the one that is closing. ``stats check`` flags a region bound to a client the daemon
    forgot."""
    from types import SimpleNamespace

    from conftest import region_held

    from hicache.controllers.handlers import HANDLERS
    from hicache.core.protocol import ProtocolError

    d = _sparse_daemon(tmp_path, 2)
    try:
        st = d.state
        c = st.registry.touch(b"engine-s", 0.0)
        c.worker = _Worker()
        first = HANDLERS["sparse_region"](st, c, {}, [])[0]
        HANDLERS["sparse_region"](st, c, {}, [])  # a second hand-out: region_held takes one
        HANDLERS["sparse_admit"](st, c, {"request": "r", "prompt_tokens": 256}, [])
        st.ops[777] = (SimpleNamespace(nbytes=1), c)  # a copy of c still in flight
        HANDLERS["unregister"](st, c, {}, [])
        assert st.sparse.of(c.cid) is None and region_held(first)  # detached, still open
        with pytest.raises(ProtocolError) as e:
            HANDLERS["sparse_admit"](st, c, {"request": "r2", "prompt_tokens": 256}, [])
        assert e.value.code == "not_registered" and st.sparse.of(c.cid) is None
        c.worker = _Worker()  # it registers again: a new region
        second = HANDLERS["sparse_region"](st, c, {}, [])[0]
        HANDLERS["sparse_region"](st, c, {}, [])
        assert second["token"] != first["token"]
        del st.ops[777]
        st.releaser.dirty = True
        st.releaser.step()  # the copy ended: the first region closes, the second stays
        assert not region_held(first) and region_held(second)
        assert st.report(True)["invariants"] == "ok"
        st.sparse.regions["ghost"] = st.sparse.regions[c.cid]  # as if its client were forgotten
        assert "sparse regions bound to clients" in st.report(True)["invariants"]
        del st.sparse.regions["ghost"]
        st.reap(c, "silent")
        st.releaser.step()
        assert st.sparse.of(c.cid) is None and not region_held(second)
        assert st.report(True)["invariants"] == "ok"
    finally:
        d.close()


def test_l3_reads_are_bounded_and_a_reaped_clients_are_dropped(tmp_path):
    """One client's L3 reads (queries, prefetches) in flight are capped (32; 256 in all), so
    its queries cannot queue without bound ahead of every other client's on the one read
    thread: the next is refused ``busy`` and changes nothing, another client's is taken. A
    reap marks the reaped client's queued reads to complete unrun (its puts are left to
    publish); others' jobs are untouched. (An L3 tier that never runs its jobs stands in for a
    stalled master.)"""
    from types import SimpleNamespace

    from hicache.controllers import l3_format as F
    from hicache.controllers.handlers import HANDLERS
    from hicache.controllers.l3_handlers import L3_READS_MAX, L3_READS_PER_CLIENT
    from hicache.core.protocol import ProtocolError

    d = _daemon(tmp_path)
    try:
        st = d.state
        queued = []
        st.l3 = SimpleNamespace(objects=F.Objects(st.layout, st.group, "test-weights"),
                                submit=queued.append)
        a = st.registry.touch(b"engine-a", 0.0)
        b = st.registry.touch(b"engine-b", 0.0)
        for i in range(L3_READS_PER_CLIENT):
            HANDLERS["l3_query"](st, a, {"keys": [f"qa-{i}"]}, [])
        with pytest.raises(ProtocolError) as e:
            HANDLERS["l3_query"](st, a, {"keys": ["qa-x"]}, [])
        assert e.value.code == "busy" and f"{L3_READS_PER_CLIENT} L3 reads of this client" \
            in e.value.message
        assert len(queued) == len(st.l3_ops) == st.l3_reads == a.l3_reads == L3_READS_PER_CLIENT
        HANDLERS["l3_query"](st, b, {"keys": ["qb-0"]}, [])  # another client's is taken
        assert b.l3_reads == 1 and len(queued) == L3_READS_PER_CLIENT + 1
        st.l3_reads = L3_READS_MAX  # as if the other clients filled the rest
        with pytest.raises(ProtocolError, match=f"at most {L3_READS_MAX}"):
            HANDLERS["l3_query"](st, b, {"keys": ["qb-1"]}, [])
        st.l3_reads = L3_READS_PER_CLIENT + 1
        st.reap(a, "silent")
        mine = [j for j in queued if j.tag[1] is a]
        assert len(mine) == L3_READS_PER_CLIENT and all(j.cancelled == "cancelled" for j in mine)
        assert [j.cancelled for j in queued if j.tag[1] is b] == [""]
    finally:
        st.l3_ops.clear()  # no tier here to finish them: the reap's release may go now
        st.l3 = None
        st.releaser.dirty = True
        st.releaser.step()
        d.close()


def test_request_state_swaps_racing_an_l3_job_on_their_host_row_are_refused(tmp_path):
    """Ring mode keeps a checkpoint in one ``req_slot`` host row, which ``swap_out`` writes and
    ``swap_in`` reads: a ``swap_out`` into a row an L3 put reads, and a ``swap_in`` from a row
    an L3 prefetch writes, are refused ``busy`` (nothing orders them with L3 jobs); a
    ``swap_in`` beside a put (both read) is not refused for it."""
    from types import SimpleNamespace

    import numpy as np

    from hicache.controllers.handlers import HANDLERS
    from hicache.core.protocol import ProtocolError

    d = _daemon(tmp_path)
    try:
        st = d.state
        c = st.registry.touch(b"engine-r", 0.0)
        c.worker = SimpleNamespace(device_rows={"req_slot": 4}, close=lambda handoff=None: None)
        row = int(st.alloc_rows({"req_slot": 1}, (c.cid, None))["req_slot"][0])
        for writes, cmd, fields, refused in (
                (False, "swap_out", {"slot": 1, "host_row": row}, True),  # an L3 put reads it
                (False, "swap_in", {"slot": 1, "host_row": row}, False),
                (True, "swap_in", {"slot": 1, "host_row": row}, True)):  # a prefetch writes it
            host = [("req_slot", np.array([row]), writes)]
            st.l3_ops[999] = SimpleNamespace(kind="prefetch" if writes else "put")
            st.l3_rows.begin(host)
            try:
                with pytest.raises(ProtocolError) as e:
                    HANDLERS[cmd](st, c, fields, [])
                assert (e.value.code == "busy" and "L3" in e.value.message) == refused, \
                    (cmd, writes, e.value.code, e.value.message)
            finally:
                st.l3_rows.end(host)
                del st.l3_ops[999]
    finally:
        d.close()


def _sparse_daemon(tmp_path, clients: int):
    return _daemon(tmp_path, sparse_rows=8, min_sparse_prompt_len=64,
                   shm_dirs=(str(tmp_path),), sparse_clients=clients)


def _engine_with_region(st):
    """A registered engine (no mappings) holding its sparse region, and a copy of it in flight
    (op 777; ``_copy_ends`` ends it)."""
    from types import SimpleNamespace

    from hicache.controllers.handlers import HANDLERS

    c = st.registry.touch(b"engine-s", 0.0)
    c.worker = _Worker()
    HANDLERS["sparse_region"](st, c, {}, [])
    st.ops[777] = (SimpleNamespace(nbytes=1), c)
    return c


def _copy_ends(st) -> None:
    del st.ops[777]
    st.releaser.dirty = True
    st.releaser.step()


def test_a_reset_frees_its_sparse_rows_in_the_region_they_came_from(tmp_path):
    """A ``reset`` waits for a copy in flight; meanwhile the client unregisters, registers
    again and admits a request into its new region: when the copy ends the reset frees its
    rows in the old region, never the new request's rows (it used to free them under it, or
    raise on the server loop)."""
    from hicache.controllers.handlers import HANDLERS

    d = _sparse_daemon(tmp_path, 2)
    try:
        st = d.state
        c = _engine_with_region(st)  # a copy of c in flight
        HANDLERS["sparse_admit"](st, c, {"request": "old", "prompt_tokens": 512}, [])
        old = st.sparse.of(c.cid)
        HANDLERS["reset"](st, c, {}, [])
        HANDLERS["unregister"](st, c, {}, [])
        c.worker = _Worker()
        HANDLERS["sparse_region"](st, c, {}, [])
        _, b = HANDLERS["sparse_admit"](st, c, {"request": "new", "prompt_tokens": 512}, [])
        new = st.sparse.of(c.cid)
        assert new is not old and new.alloc.used_rows == 2
        _copy_ends(st)
        assert new.alloc.used_rows == 2 and st.sparse.requests[(c.cid, "new")].rows == b[0].tolist()
        assert old.alloc.used_rows == 0 and old not in st.sparse.closing
        assert HANDLERS["sparse_free"](st, c, {"request": "new"}, [])[0] == {"freed_rows": 2}
        assert st.report(True)["invariants"] == "ok"
    finally:
        d.close()


def test_regions_still_closing_count_against_sparse_clients(tmp_path):
    """``--sparse-clients 1``: a client that unregisters while a copy into its region runs,
    registers again and asks for a region is refused ``busy`` until that copy ended and the
    region closed (it used to get a new full-size region each time); then it gets one."""
    from conftest import sparse_memfds

    from hicache.controllers.handlers import HANDLERS
    from hicache.core.protocol import ProtocolError

    before = sparse_memfds()
    d = _sparse_daemon(tmp_path, 1)
    try:
        st = d.state
        c = _engine_with_region(st)
        regions_open = lambda: sparse_memfds() - before  # noqa: E731
        for _ in range(3):
            HANDLERS["unregister"](st, c, {}, [])
            c.worker = _Worker()
            with pytest.raises(ProtocolError) as e:
                HANDLERS["sparse_region"](st, c, {}, [])
            assert e.value.code == "busy" and "still close" in str(e.value)
        assert regions_open() == 1 and len(st.sparse.closing) == 1
        _copy_ends(st)  # the region closes, the next is made off the loop
        assert not st.sparse.closing
        HANDLERS["sparse_region"](st, c, {}, [])
        assert regions_open() == 1 and st.sparse.of(c.cid) is not None
    finally:
        d.close()


def test_sparse_report_is_bounded_and_needs_a_region(tmp_path):
    """``sparse_report`` from a client without a region is refused; numbers past the cap are
    refused before any counter moves (they used to move two counters, then fail)."""
    from hicache.controllers.handlers import HANDLERS
    from hicache.controllers.sparse import REPORT_MAX
    from hicache.core.protocol import ProtocolError

    d = _sparse_daemon(tmp_path, 1)
    try:
        st = d.state
        c = st.registry.touch(b"engine-s", 0.0)
        with pytest.raises(ProtocolError, match="holds no sparse region"):
            HANDLERS["sparse_report"](st, c, {"lookups": 4, "swapped_in": 1}, [])
        c.worker = _Worker()
        HANDLERS["sparse_region"](st, c, {}, [])
        before = st.metrics.snapshot()
        for n in (REPORT_MAX + 1, 10 ** 308):
            with pytest.raises(ProtocolError, match="lookups <="):
                HANDLERS["sparse_report"](st, c, {"lookups": n, "swapped_in": n}, [])
        assert st.metrics.snapshot()["hicache_hisparse_lookups_total"] == \
            before["hicache_hisparse_lookups_total"]
        HANDLERS["sparse_report"](st, c, {"lookups": 4, "swapped_in": 1}, [])
        assert st.metrics.snapshot()["hicache_hisparse_lookups_total"][0]["value"] == \
            before["hicache_hisparse_lookups_total"][0]["value"] + 4
    finally:
        d.close()


def test_a_dead_daemons_sparse_region_files_are_swept(tmp_path):
    """A region file (``/dev/shm/hicache-sparse-*``, what earlier versions made) whose creating
    process is gone (a killed daemon) is removed when the next daemon with sparse regions
    starts; a live process's file stays."""
    from hicache.core import shm_file
    from hicache.core.sparse_shm import SPARSE_PREFIX

    dead = tmp_path / f"{SPARSE_PREFIX}{2 ** 22 + 12345}-abcdef"
    live = tmp_path / f"{SPARSE_PREFIX}{os.getpid()}-abcdef"
    for p in (dead, live):
        p.write_bytes(b"x")
        os.utime(p, (time.time() - 2 * shm_file.STALE_AFTER_S,) * 2)
    d = _sparse_daemon(tmp_path, 1)
    try:
        assert not dead.exists() and live.exists()
    finally:
        d.close()
