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
them).

Live CPU daemons (dsv4-tiny); the loop is stopped with SIGSTOP, or held by real ``kv_put``s whose
copies wait first (``fault_daemon``: the copies alone are too fast here).
"""
from __future__ import annotations

import os
import signal
import threading
import time
from typing import Any

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
    rows = [c.alloc({"page": 1})["page"] for c in clients]
    stop = threading.Event()

    def beat(c: Any) -> None:
        while not stop.is_set():
            c.heartbeat()
            time.sleep(0.05)

    threads = [threading.Thread(target=beat, args=(c,), daemon=True) for c in clients]
    try:
        for t in threads:
            t.start()
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
    reaped = []
    for i, (c, r) in enumerate(zip(clients, rows)):
        try:
            c.free({"page": r})
        except CommandRefused as e:
            reaped.append(f"b{i}: {e}")
        c.close()
    assert not reaped, f"{len(reaped)} of 40 talking clients reaped: {reaped[0]}"
    with d.client() as probe:
        assert probe.call("stats", {"check": True})[0]["invariants"] == "ok"


def _slow_puts(delay: float, keys: int) -> Any:
    """A CPU daemon whose key-store copies each hold the loop ``delay`` s first (a put of
    gigabytes on a slow host: the copy itself is too fast here to hold it that long)."""
    from fault_daemon import faulty
    return faulty(f"slow_kv_copy={delay}", preset="dsv4-tiny",
                  device_rows=f"page=4,swa_page={keys},req_slot=4", host=("--host-ratio", "1.25"),
                  heartbeat_timeout=0.5, metrics_port=0, extra=TINY)


def test_a_command_that_held_the_loop_past_the_timeout_does_not_reap_its_client() -> None:
    keys = 4
    with _slow_puts(1.0, keys) as d:
        with d.client() as c:
            sw = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["swa_kv"]
        pool = EnginePool(sw.num_layers, keys, sw.page_bytes, page_first=True, seed=3)
        try:
            with d.client(name="big") as big:
                pool.attach(big, "swa", "swa_kv", ns=NS)
                t = time.monotonic()
                assert all(big.kv_put("swa", [f"k{i}" for i in range(keys)], list(range(keys)),
                                      timeout=60))
                assert time.monotonic() - t >= 1.0  # twice the heartbeat timeout
                time.sleep(0.2)  # a housekeeping pass (every 0.125 s) after the put's reply
                assert big.kv_exists("swa", ["k0"]) == [True]  # still attached: not reaped
        finally:
            pool.close()


def test_a_gone_client_is_reaped_while_another_keeps_the_loop_busy() -> None:
    """Long puts back to back: the loop stands still most of the time, but it reads everything
    that waits between two of them, and a client that went silent is reaped all the same (the
    diff review of the first version, which skipped the reap after every long turn: never)."""
    keys = 4
    with _slow_puts(0.3, keys) as d:  # each put a long turn (over ``server.STALL_S``)
        with d.client() as c:
            sw = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["swa_kv"]
        gone = d.client(name="gone")
        row = gone.alloc({"page": 1})["page"]
        pool = EnginePool(sw.num_layers, keys, sw.page_bytes, page_first=True, seed=5)
        try:
            with d.client(name="busy") as busy:
                pool.attach(busy, "swa", "swa_kv", ns=NS)
                end, n = time.monotonic() + 2.0, 0  # 4 heartbeat timeouts
                while time.monotonic() < end:  # new keys each time (a stored one is not copied)
                    n += 1
                    busy.kv_put("swa", [f"k{n}-{i}" for i in range(keys)], list(range(keys)),
                                timeout=60)
                with pytest.raises(CommandRefused, match="silent for"):  # reaped meanwhile
                    gone.free({"page": row})
        finally:
            gone.close()
            pool.close()
