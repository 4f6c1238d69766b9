"""A daemon loop that stood still reaps nobody for it (forty-sixth session's key-store review).

While the loop stands still (a long inline key-store copy on the server thread; the process
stopped or descheduled) nothing reads the socket, so every client looks silent. The daemon
used to reap, at its first housekeeping after the stall, the clients whose requests were still
queued past the 32 it read first, and the client whose own command had held the loop (its
silence counted from its command's arrival): their rows freed under engines that never
stopped talking. Now silence is counted up to the last time the loop had read every request
that waited (``Server._caught_up``), and a command that held the loop longer than
``server.STALL_S`` counts its client's silence from its reply; a client that is gone is still
reaped while another keeps the loop busy with long commands (the loop catches up between
them). Time the process itself stood still (a sleeping poll back far past its timeout) counts
toward no client's silence, and a long command credits the clients answered just before it
too: a reply still in the stopped process's ZMQ queue kept its client from sending (a loaded
CI run reaped 10 of the 40 clients below before the fix, sixty-sixth session). So does time it
stood still awake, outside its poll and outside any command (``Server._off_cpu``: wall time
less thread CPU time): a loaded CI run's SIGSTOP landed there once and the quiet client below
was reaped, silent 3.6 s (sixty-eighth session). Both checks take the process's CPU time, not
the loop thread's: another daemon thread holding the GIL is no stop (sixty-ninth session).

Live CPU daemons (dsv4-tiny); the loop is stopped with SIGSTOP, or held by real ``kv_put``s whose
copies wait first (``fault_daemon``: the copies alone are too fast here).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any, Callable

import pytest

from hicache.core.layout import Layout
from hicache.engine.client import CommandRefused
from test_kv_store import NS, EnginePool

TINY = ("--no-mtp", "--c128-state", "offline")


def test_clients_whose_requests_waited_through_a_stopped_loop_are_not_reaped(
        daemon_factory: Any) -> None:
    d = daemon_factory(preset="dsv4-tiny", device_rows="page=32,swa_page=4,req_slot=4",
                       heartbeat_timeout=1.0, metrics=False, extra=TINY)
    clients = [d.client(name=f"b{i}") for i in range(40)]  # more than one batch of 32
    stop = threading.Event()
    reaped: list[str] = []
    errors: list[str] = []

    def beat(i: int, c: Any, row: Any) -> None:
        """Heartbeats until ``stop``, then the client's free (refused if it was reaped): each
        client talks from its alloc to its free (sequential allocs or frees of 40 clients left
        the first or the last silent for all of them, on a loaded machine near the timeout)."""
        try:
            while not stop.is_set():
                c.heartbeat()
                time.sleep(0.05)
            c.free({"page": row})
        except CommandRefused as e:
            reaped.append(f"b{i}: {e}")
        except BaseException as e:  # noqa: BLE001 - asserted on in the test's thread
            errors.append(f"b{i}: {type(e).__name__}: {e}")

    threads = []
    try:
        for i, c in enumerate(clients):
            threads.append(threading.Thread(target=beat, args=(i, c, c.alloc({"page": 1})["page"]),
                                            daemon=True))
            threads[-1].start()
        time.sleep(0.3)
        os.kill(d.pid, signal.SIGSTOP)  # each client's heartbeat now waits in the socket
        time.sleep(1.6)  # past the 1 s heartbeat timeout
        os.kill(d.pid, signal.SIGCONT)
        time.sleep(1.0)  # housekeeping passes after the stall
    finally:
        os.kill(d.pid, signal.SIGCONT)
        stop.set()
        for t in threads:
            t.join(10)
        for c in clients:
            c.close()
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert not reaped, f"{len(reaped)} of 40 talking clients reaped: {reaped[0]}"
    with d.client() as probe:
        assert probe.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_stood_still_takes_the_stall_out_of_silence_and_no_more() -> None:
    """``Registry.stood_still``: each credited client's silence loses the stall's length (its
    ``last_seen`` moves on by it, to the stall's end at most); with ``answered_since`` only the
    clients answered since then are credited; the others keep their silence."""
    from hicache.controllers.registry import Registry

    r = Registry(8, 8)
    a, b, c = (r.touch(ident, t) for ident, t in ((b"a", 10.0), (b"b", 10.0), (b"c", 14.5)))
    a.answered, b.answered, c.answered = 10.0, 14.9, 14.5
    assert r.stood_still(15.0, 17.0, answered_since=14.75) == 1  # a long command: b only
    assert (a.last_seen, b.last_seen, c.last_seen) == (10.0, 12.0, 14.5)
    assert r.stood_still(20.0, 23.0) == 3  # the process stopped: everyone
    assert (a.last_seen, b.last_seen, c.last_seen) == (13.0, 15.0, 17.5)
    d = r.touch(b"d", 22.9)  # (seen during the stall: moved to its end, no further)
    r.stood_still(20.0, 23.0)
    assert (a.last_seen, b.last_seen, d.last_seen) == (16.0, 18.0, 23.0)
    assert [x.ident for x in r.silent(24.0, 7.5)] == [b"a"]


def _stand_still_then_check(d: Any, stand_still: Callable[[], None]) -> None:
    """Two clients of ``d`` (2 s heartbeat timeout) each allocate a row; ``stand_still()``
    keeps the daemon's loop still ~3 s and returns past the housekeeping pass after it. The
    client quiet since just before is not reaped (its free is served); the other, quiet past
    the timeout after it while the first beats, is; the invariants hold."""
    quiet, gone = d.client(name="quiet"), d.client(name="gone")
    try:
        rows = {n: c.alloc({"page": 1})["page"] for n, c in (("quiet", quiet), ("gone", gone))}
        stand_still()
        quiet.free({"page": rows["quiet"]})  # not reaped
        end = time.monotonic() + 3.5
        while time.monotonic() < end:  # ``gone`` silent past the timeout after the stall
            time.sleep(0.25)
            quiet.heartbeat()
        with pytest.raises(CommandRefused, match="silent for"):
            gone.free({"page": rows["gone"]})
    finally:
        quiet.close()
        gone.close()
    with d.client() as probe:
        assert probe.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_a_quiet_client_is_not_reaped_for_the_time_the_daemon_was_stopped(
        daemon_factory: Any) -> None:
    """The daemon stopped 3 s while idle (2 s heartbeat timeout): a client quiet since just
    before and for 0.7 s after is not reaped (about 0.9 s of silence, the stop not counted:
    before the fix the housekeeping pass 0.5 s after the stop reaped it, silent 3.7 s by the
    wall clock); a client that stays quiet past the timeout after it still is."""
    d = daemon_factory(preset="dsv4-tiny", device_rows="page=8,swa_page=4,req_slot=4",
                       heartbeat_timeout=2.0, metrics=False, extra=TINY)

    def stop() -> None:
        time.sleep(0.1)  # the loop asleep in its poll
        os.kill(d.pid, signal.SIGSTOP)
        try:
            time.sleep(3.0)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        time.sleep(0.7)  # past the housekeeping pass 0.5 s after the one the stop made due

    _stand_still_then_check(d, stop)


def test_a_stop_outside_the_poll_and_any_command_counts_toward_no_silence() -> None:
    """The loop held 3 s off the CPU inside a housekeeping pass (``fault_daemon``'s
    ``hold_house_on_sigusr1``: where a SIGSTOP that misses the poll lands), 2 s heartbeat
    timeout: a client quiet since just before and for 0.7 s after is not reaped (before the
    fix it was, at the next pass: only a stall inside the poll or a command was credited); a
    client that stays quiet past the timeout after it still is."""
    from fault_daemon import faulty

    with faulty("hold_house_on_sigusr1=3", preset="dsv4-tiny",
                device_rows="page=8,swa_page=4,req_slot=4", heartbeat_timeout=2.0,
                metrics_port=0, extra=TINY) as d:

        def hold() -> None:
            os.kill(d.pid, signal.SIGUSR1)  # the next pass (every 0.5 s) holds the loop 3 s
            time.sleep(3.5 + 0.7)  # through the hold and past the pass after it

        _stand_still_then_check(d, hold)
        assert "between its polls" in d.output()


def test_the_gil_held_by_another_daemon_thread_is_no_stop() -> None:
    """Another thread of the daemon holds the GIL for 1.5 s of its own CPU time in one C call
    (``fault_daemon``'s ``hold_gil_on_sigusr1``, as the load issuer can): a heartbeat sent
    meanwhile is answered late, but the process ran, so no more is credited as a stand-still
    than the time the holder waited for a CPU (on a busy machine the hold's wall time is
    longer than its CPU time: that much is real starvation), give or take 0.5 s (the poll's
    100 ms, the loop's own wait for a CPU after the hold). Before, the loop's poll back late
    counted as a stop whole (the loop thread's CPU clock stood still too): about the whole
    hold's wall time, "the loop stood still 1.4 s in its poll (the process stopped or
    starved)", over the bound by about the holder's CPU time."""
    import re

    from fault_daemon import faulty

    with faulty("hold_gil_on_sigusr1=1.5", preset="dsv4-tiny",
                device_rows="page=8,swa_page=4,req_slot=4", heartbeat_timeout=30.0,
                metrics_port=0, extra=TINY) as d:

        def logged(line: str) -> None:
            end = time.monotonic() + 60
            while line not in d.log_path.read_text(errors="replace"):
                assert time.monotonic() < end, f"the fault never logged {line!r}"
                time.sleep(0.01)

        with d.client(timeout=60) as c:
            c.heartbeat()
            os.kill(d.pid, signal.SIGUSR1)
            logged("fault: holding the GIL")  # (after its sample sum)
            t0 = time.monotonic()
            c.heartbeat()
            late = time.monotonic() - t0
            logged("fault: held the GIL")
            time.sleep(0.3)
            c.heartbeat()  # the loop's checks after the hold have run
        log = d.log_path.read_text(errors="replace")
    wall, cpu = map(float, re.search(r"fault: held the GIL ([0-9.]+) s, ([0-9.]+) s on the CPU",
                                     log).groups())
    credited = [float(x) for x in re.findall(r"the loop stood still ([0-9.]+) s", log)]
    # the hold was long enough that the code before credited over the bound (wall - 0.1 s
    # against wall - cpu + 0.5 s), and the loop was held
    assert cpu > 0.8 and late > 0.3, (wall, cpu, late, log[-2000:])
    assert all(x <= wall - cpu + 0.5 for x in credited), (credited, wall, cpu, log[-2000:])


def _slow_puts(delay: float, keys: int, spin: bool = False, timeout: float = 0.5) -> Any:
    """A CPU daemon whose key-store copies each hold the loop ``delay`` s first (a put of
    gigabytes on a slow host: the copy itself is too fast here to hold it that long), with a
    heartbeat timeout of ``timeout`` s; ``spin``: it busy-polls 2 ms after a request (and so
    offers channels)."""
    from fault_daemon import faulty
    return faulty(f"slow_kv_copy={delay}", preset="dsv4-tiny",
                  device_rows=f"page=4,swa_page={keys},req_slot=4", host=("--host-ratio", "1.25"),
                  heartbeat_timeout=timeout, metrics_port=0,
                  extra=TINY + (("--spin-us", "2000") if spin else ()))


def test_a_command_that_held_the_loop_past_the_timeout_does_not_reap_its_client() -> None:
    keys = 4
    # a 1.2 s timeout: the test's own client must send again within it after the put's reply
    # (a 0.5 s one left a loaded machine 0.3 s to do so)
    with _slow_puts(2.5, keys, timeout=1.2) as d:
        with d.client() as c:
            sw = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["swa_kv"]
        pool = EnginePool(sw.num_layers, keys, sw.page_bytes, page_first=True, seed=3)
        try:
            with d.client(name="big") as big:
                pool.attach(big, "swa", "swa_kv", ns=NS)
                t = time.monotonic()
                assert all(big.kv_put("swa", [f"k{i}" for i in range(keys)], list(range(keys)),
                                      timeout=60))
                assert time.monotonic() - t >= 2.5  # over twice the heartbeat timeout
                time.sleep(0.4)  # a housekeeping pass (every 0.3 s) after the put's reply
                assert big.kv_exists("swa", ["k0"]) == [True]  # still attached: not reaped
        finally:
            pool.close()


@pytest.mark.parametrize("channel", [False, True], ids=["socket", "channel"])
def test_a_gone_client_is_reaped_while_others_keep_the_loop_busy(channel: bool) -> None:
    """Long puts back to back from two clients: the loop stands still most of the time, and
    one client's put always waits while the other's runs, yet a client that went silent is
    reaped meanwhile, not once the puts stop (CI, 2026-12-07: with one busy client whose next
    put won the race to the socket, the loop never found it empty and reaped nobody; the diff
    review of the first version, which skipped the reap after every long turn: never).

    * Over the socket, the loop takes what waits off it before handling any of it: the
      socket is found empty before each long put runs, as neither client can send again
      before its reply.
    * Through channels (one request each), the reap scans them first: a socket found empty
      is a catch-up whatever the channels held."""
    keys = 4
    with _slow_puts(0.3, keys, spin=channel) as d:  # each put a long turn (> ``STALL_S``)
        with d.client() as c:
            sw = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["swa_kv"]
        gone = d.client(name="gone")
        row = gone.alloc({"page": 1})["page"]
        pools = [EnginePool(sw.num_layers, keys, sw.page_bytes, page_first=True, seed=5 + i)
                 for i in range(2)]
        errors: list[BaseException] = []
        puts = [0, 0]
        stop = threading.Event()

        def busy(i: int) -> None:
            try:
                with d.client(name=f"busy{i}") as b:
                    assert b.channel() == channel and b.uses_channel == channel
                    pools[i].attach(b, "swa", "swa_kv", ns=NS)
                    while not stop.is_set():  # new keys each time (a stored one is not copied)
                        puts[i] += 1
                        b.kv_put("swa", [f"b{i}-{puts[i]}-{k}" for k in range(keys)],
                                 list(range(keys)), timeout=60)
            except BaseException as e:  # noqa: BLE001 - raised in the test's thread below
                errors.append(e)

        threads = [threading.Thread(target=busy, args=(i,)) for i in range(2)]
        try:
            for t in threads:
                t.start()
            time.sleep(2.0)  # 4 heartbeat timeouts of long puts
            assert not errors, errors[0]
            assert min(puts) >= 2, puts  # both keep the loop busy, and still do
            with pytest.raises(CommandRefused, match="silent for"):  # reaped meanwhile
                gone.free({"page": row})
            assert all(t.is_alive() for t in threads)  # (the puts ran all along)
        finally:
            stop.set()
            for t in threads:
                t.join(60)
            gone.close()
            for p in pools:
                p.close()
        assert not errors, errors[0]
