"""Crashed peers: a client killed mid-transfer is reaped (rows freed, mappings closed) within the
heartbeat timeout without disturbing others; a killed daemon makes every client call fail fast,
the radix tree recomputes, and after a restart the worker registers again and carries on.
(The full figures, x50 and x20, come from ``hicache bench soak --crash-clients/--crash-daemon``.)
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Any

import pytest

from hicache.bench.soak import crash_clients, crash_daemon
from hicache.fuzz.runner import DaemonRunner, private_address


@pytest.fixture
def address():
    addr, d = private_address("hcc-")
    yield addr, d
    shutil.rmtree(d, ignore_errors=True)


def test_sigkilled_clients_are_reaped_within_the_heartbeat_timeout(address):
    addr, d = address
    r = DaemonRunner(addr, device_rows="page=16,swa_page=8,req_slot=4", heartbeat_timeout=1.0,
                     log_path=os.path.join(d, "daemon.log"))
    r.start()
    try:
        rep = crash_clients(r, 3, heartbeat_timeout=1.0, seed=11)
    finally:
        r.stop()
    assert rep["reaped"] == 3, rep["failures"]
    assert rep["leaked_rows_total"] == 0, rep["failures"]
    assert rep["still_mapped"] == 0, rep["failures"]  # its shm mapping is closed, not just idle
    assert rep["reclaim_seconds_max"] < 1.0 + 1.5
    assert rep["victim_rows_corrupted"] == 0 and rep["invariants_ok"]
    assert rep["ok"], rep
    assert "Traceback" not in r.output()


def test_sigkilled_daemon_fails_calls_fast_then_worker_reregisters(address):
    addr, d = address
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"))
    rep = crash_daemon(r, 1, call_timeout=0.4, seed=5, slack=0.3)  # (one kill: suite time)
    assert rep["calls_wrong_exception"] == 0, rep["failures"]
    assert rep["calls_over_timeout"] == 0, rep["failures"]
    assert rep["max_call_seconds"] < 0.4 + 0.3
    assert rep["radix_fallbacks"] == 1 and rep["reregistered"] == 1, rep["failures"]
    assert rep["corrupted_pages"] == 0 and rep["pages_verified"] > 0
    assert rep["ok"], rep
    assert r.starts == 2


def test_a_restarted_daemon_never_answers_a_new_op_with_an_old_ack():
    """An ack of the old daemon the client holds unconsumed (pushed, read by another call)
    must not answer a new op after the daemon restarts and the client registers again: op
    ids start at a random base per run (they used to start at 1 each time, so the new daemon's
    first op took the old daemon's first ack at once)."""
    import time

    from hicache.core.layout import build_layout, preset
    from hicache.engine.client import Client
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.engine.device_pools import DevicePools

    rows_flag = "page=8,swa_page=4,req_slot=4"
    pools = DevicePools(build_layout(preset("dsv4-tiny")), {"page": 8, "swa_page": 4,
                                                            "req_slot": 4})
    dp = DaemonProcess(device_rows=rows_flag, preset="dsv4-tiny", heartbeat_timeout=30.0,
                       env={"HICACHE_INLINE_MAX_BYTES": "1"}).start()  # every ack pushed
    c = Client(dp.address, timeout=10.0, name="restart", channel=False)
    try:
        c.register(pools)
        old = c.backup({"page": ([3], c.alloc({"page": 1})["page"])})
        deadline = time.monotonic() + 10
        while old.op_id not in c._acks and time.monotonic() < deadline:
            time.sleep(0.05)
            c.stats()  # reads the push without consuming it
        stale = c._acks[old.op_id]
        dp.kill()
        dp.start()
        c.register(pools)
        new = c.backup({"page": ([5], c.alloc({"page": 1})["page"])})
        assert new.op_id != old.op_id
        ack = c.wait_ack(new)
        assert ack is not stale and ack.ok and ack.op == new.op_id
    finally:
        c.close()
        dp.close()
        pools.close()


def test_a_piped_daemon_that_writes_a_lot_never_blocks():
    """With ``pipe=True`` a thread drains the daemon's output as it comes: a daemon writing
    far more than a pipe holds (64 KiB; here Python's import trace, ``PYTHONVERBOSE``) starts
    and serves, and ``output()`` has its last lines (it used to block on the full pipe)."""
    from hicache.engine.daemon_process import PIPE_KEEP, DaemonProcess

    dp = DaemonProcess(device_rows="page=8,swa_page=4,req_slot=4", preset="dsv4-tiny",
                       pipe=True, heartbeat_timeout=30.0, ready_timeout=60.0,
                       env={**os.environ, "PYTHONVERBOSE": "1"}).start()
    try:
        with dp.client(timeout=5.0, channel=False) as c:
            assert c.stats()["clients"] >= 1
        dp.stop()
        out = dp.output()
        assert "hicache serve: stopped" in out and 1 << 16 < len(out.encode()) <= PIPE_KEEP
    finally:
        dp.close()


def test_a_daemon_killed_mid_call_ends_the_wait_at_once(tmp_path):
    """A call whose daemon was killed while it waited for the reply waited out its whole
    timeout: each call in flight held the demo 30 s after its daemon died (its test took 35 s).
    Now the wait checks every ``GONE_CHECK_S`` whether the daemon is gone: ``GoneMidCall``, a
    ``DaemonGone`` (the daemon is not there) and a ``NoReply`` (what the command did is
    unknown) at once. Only while ZMQ holds no live connection to it: a live daemon whose
    socket file was removed (a cleaner, an ``rm``) is not taken for a gone one (the first
    version did, and a caller would have reused pages that daemon may still write)."""
    import signal
    import threading
    import time

    from hicache.engine.acks import DaemonGone, GoneMidCall, NoReply
    from hicache.engine.client import GONE_CHECK_S, Client
    from hicache.engine.daemon_process import DaemonProcess

    dp = DaemonProcess(device_rows="page=8,swa_page=4,req_slot=4", preset="dsv4-tiny",
                       heartbeat_timeout=30.0).start()
    c = Client(dp.address, timeout=20.0, name="mid", channel=False)
    try:
        assert c.heartbeat()["pid"] == dp.pid
        os.kill(dp.pid, signal.SIGSTOP)  # a slow daemon: the reply comes after 1.5 s
        os.unlink(dp.address[len("ipc://"):])  # its socket file goes; its connection stays
        t = threading.Timer(1.5, os.kill, (dp.pid, signal.SIGCONT))
        t.start()
        assert c.stats()["daemon"]["pid"] == dp.pid  # answered, not "gone"
        t.join()
        os.kill(dp.pid, signal.SIGSTOP)  # the request is taken in, never answered
        got: list[BaseException | None] = []
        t = threading.Thread(target=lambda: got.append(_raised(c.stats)))
        t0 = time.perf_counter()
        t.start()
        time.sleep(0.5)
        os.kill(dp.pid, signal.SIGKILL)
        t.join(20)
        took = time.perf_counter() - t0
        dp.proc.wait(10)
    finally:
        c.close()
        dp.close()
    (e,) = got
    assert isinstance(e, GoneMidCall) and isinstance(e, DaemonGone) and isinstance(e, NoReply), e
    assert "went while this call waited for its reply" in str(e), e
    # (the daemon binds a removed socket file again at its next housekeeping, which may or
    # may not have come between the SIGCONT and the second SIGSTOP)
    assert "there is no socket file" in e.why or "its socket refuses connections" in e.why, \
        e.why
    print(f"the wait ended {took - 0.5:.2f} s after the kill")
    assert took < 0.5 + 2 * GONE_CHECK_S + 1.0, took


def _raised(fn: Any) -> BaseException | None:
    try:
        fn()
    except BaseException as e:  # noqa: BLE001 - the test looks at it
        return e
    return None


def test_a_gone_daemon_is_named_at_once_not_after_the_timeout(tmp_path):
    """A client with no live connection used to wait its whole timeout (30 s in the demo) for
    a daemon that was gone. Now, once a daemon answered this client, an ``ipc://`` socket that
    refuses connections (the daemon was killed) or a socket file that is gone (it stopped) is
    named at once; a new client still waits for a daemon that may be starting, also over a
    killed daemon's socket file."""
    import signal
    import time

    from hicache.engine.acks import DaemonUnreachable
    from hicache.engine.client import Client
    from hicache.engine.daemon_process import DaemonProcess

    rows = "page=8,swa_page=4,req_slot=4"
    for stop in ("kill", "stop"):
        dp = DaemonProcess(device_rows=rows, preset="dsv4-tiny", heartbeat_timeout=30.0).start()
        c = Client(dp.address, timeout=20.0, name="gone", channel=False)
        try:
            assert c.heartbeat()["pid"] == dp.pid
            if stop == "kill":
                os.kill(dp.pid, signal.SIGKILL)
                dp.proc.wait(10)
                want = "refuses connections"
            else:
                dp.stop(timeout=30)
                want = "there is no socket file"
            time.sleep(0.3)  # ZMQ saw the connection drop
            t = time.perf_counter()
            with pytest.raises(DaemonUnreachable, match=want):
                c.stats()
            assert time.perf_counter() - t < 2.0
        finally:
            c.close()
            dp.close()
    import socket

    stale = tmp_path / "stale.sock"
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(stale))  # a killed daemon's socket file: nothing listens
        for path in (tmp_path / "not-yet.sock", stale):
            fresh = Client(f"ipc://{path}", timeout=0.5, name="fresh", channel=False)
            try:
                t = time.perf_counter()
                with pytest.raises(DaemonUnreachable, match="within 0.5 s"):
                    fresh.stats()
                assert time.perf_counter() - t >= 0.45
            finally:
                fresh.close()


def test_a_daemon_gone_between_hand_in_and_its_descriptors_is_named_gone(monkeypatch):
    """``register`` of CPU pools: the daemon answers ``hand_in``, then dies before the
    descriptors go in. The raw ``ConnectionRefusedError`` of the hand-in escaped, where an
    engine's recovery catches ``DaemonUnreachable`` (client review); it is ``DaemonGone``."""
    import signal

    from hicache.core.layout import build_layout, preset
    from hicache.engine import client as client_mod
    from hicache.engine.acks import DaemonGone
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.engine.device_pools import DevicePools

    rows = {"page": 8, "swa_page": 4, "req_slot": 4}
    real = client_mod.send_fds
    with DaemonProcess(device_rows=rows, preset="dsv4-tiny") as dp, \
            DevicePools(build_layout(preset("dsv4-tiny")), rows, device="cpu") as pools:
        c = dp.client(timeout=5.0, channel=False)
        try:
            c.heartbeat()

            def dying(*a: Any, **kw: Any) -> None:
                os.kill(dp.pid, signal.SIGKILL)
                dp.proc.wait(10)
                real(*a, **kw)

            monkeypatch.setattr(client_mod, "send_fds", dying)
            with pytest.raises(DaemonGone, match="descriptors could not be handed in"):
                c.register(pools)
        finally:
            c.close()


def test_gone_reason_probes_files_and_abstract_sockets(tmp_path):
    """``gone_reason`` (what a client asks once its daemon answered it) on each kind of ipc
    address: a socket that listens is not gone (None), one that refuses is named, and so is
    a missing file; ``ipc://@name`` is probed in the abstract namespace, never as a file
    called "@name"; a loopback tcp port that refuses is named (since the fiftieth session),
    one that listens is not; other tcp addresses are not probed."""
    import socket

    from hicache.engine.client import gone_reason

    name = f"hicache-test-{os.getpid()}-{tmp_path.name}"
    for address, bind in ((f"ipc://@{name}", "\0" + name),
                          (f"ipc://{tmp_path / 'd.sock'}", str(tmp_path / "d.sock"))):
        with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as s:
            s.bind(bind)
            s.listen(4)
            assert gone_reason(address) is None, address
        # closed: nothing listens (an abstract name dies with its socket, a file stays)
        assert "refuses connections" in (gone_reason(address) or ""), address
        if not bind.startswith("\0"):
            os.unlink(bind)
            assert "there is no socket file" in (gone_reason(address) or "")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))  # bound, not listening: its port refuses
        port = s.getsockname()[1]
        assert f"nothing listens on port {port}" in \
            (gone_reason(f"tcp://127.0.0.1:{port}") or "")
        s.listen(4)
        assert gone_reason(f"tcp://127.0.0.1:{port}") is None
    assert gone_reason("tcp://192.0.2.1:1") is None  # not loopback: not probed


def test_a_reply_that_came_before_the_daemon_went_is_read_not_called_gone(daemon, monkeypatch):
    """The daemon's last reply (e.g. to ``shutdown``) can arrive between the wait's last poll
    and its check that the daemon went: the call read it as ``GoneMidCall`` ("whether it ran
    the command is unknown", a CI run). What already arrived is read first now. Forced here:
    the first poll of the wait reports nothing though the reply is in, and the check says
    gone."""
    from hicache.engine import client as client_mod

    with daemon.client() as c:
        c.heartbeat()
        real = client_mod.Client._recv
        polls = []

        def recv(self, wait_ms):
            polls.append(wait_ms)
            if len(polls) == 1:
                time.sleep(0.3)  # the reply arrives meanwhile; this poll "missed" it
                return None
            return real(self, wait_ms)

        monkeypatch.setattr(client_mod.Client, "_recv", recv)
        monkeypatch.setattr(client_mod.Client, "_gone", lambda self: "forced: gone")
        assert c.heartbeat()["pid"] == daemon.proc.pid
        assert polls[1] == 0  # read once more, without waiting, before calling it gone
