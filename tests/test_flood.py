"""Bounded input (issue 17, item 2): a flood of 10,000 many-frame, oversized-header and
beyond-the-transport messages leaves the daemon's RSS growth under 64 MiB, every one of them
is refused (or its peer dropped), and a well-formed client is answered all along."""
from __future__ import annotations

import os
import shutil

import pytest

from hicache.controllers.server import TRANSPORT_MAX_FRAME
from hicache.fuzz.flood import run_flood
from hicache.fuzz.runner import DaemonRunner, private_address

FLOOD = (("many_frames", 0.9), ("big_header", 0.098), ("beyond_transport", 0.002))


@pytest.fixture
def daemon():
    addr, d = private_address("hcfl-")
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0)
    r.start()
    yield r
    assert r.clean_exit(r.stop())  # SIGTERM: 143
    assert "Traceback" not in r.output()
    shutil.rmtree(d, ignore_errors=True)


def test_flood_of_malformed_messages_is_bounded_and_others_are_served(daemon):
    rep = run_flood(daemon.address, 10_000, daemon.rss, transport_max_frame=TRANSPORT_MAX_FRAME,
                    kinds=FLOOD, bystander_timeout=10.0)
    print(rep)
    assert rep["attacker_replies"] == rep["expected_replies"]
    assert set(rep["reply_codes"]) == {"bad_frame"}
    assert rep["bystander_calls"] > 0 and rep["bystander_failures"] == 0
    assert rep["rss_growth_mib"] < 64, rep
    assert daemon.alive()
