"""Crashed peers: a client killed mid-transfer is reaped (rows freed, mappings closed) within the
heartbeat timeout without disturbing others; a killed daemon makes every client call fail fast,
the radix tree recomputes, and after a restart the worker registers again and carries on.
(The full figures, x50 and x20, come from ``hicache bench soak --crash-clients/--crash-daemon``.)
"""
from __future__ import annotations

import os
import shutil

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
    rep = crash_daemon(r, 2, call_timeout=0.4, seed=5, slack=0.3)
    assert rep["calls_wrong_exception"] == 0, rep["failures"]
    assert rep["calls_over_timeout"] == 0, rep["failures"]
    assert rep["max_call_seconds"] < 0.4 + 0.3
    assert rep["radix_fallbacks"] == 2 and rep["reregistered"] == 2, rep["failures"]
    assert rep["corrupted_pages"] == 0 and rep["pages_verified"] > 0
    assert rep["ok"], rep
    assert r.starts == 3
