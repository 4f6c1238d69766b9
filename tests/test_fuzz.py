"""Hostile messages against a live CPU-mode daemon: every one answered with an error, nothing
changed (host row accounting exact, allocator invariants, a victim's rows byte for byte)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.core import protocol as P
from hicache.fuzz.runner import (SPARSE_FLAGS, DaemonRunner, Hostile, RawPeer, daemon_check,
                                 private_address, run_fuzz)

ROOT = Path(__file__).resolve().parents[1]


@pytest.fixture(scope="module")
def runner():
    address, d = private_address("hcf-")
    r = DaemonRunner(address, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0,
                     extra=SPARSE_FLAGS)
    r.start()
    yield r
    r.stop()
    shutil.rmtree(d, ignore_errors=True)


def _assert_clean(rep: dict) -> None:
    ex = json.dumps(rep.get("examples", [])[:5], default=str)[:3000]
    assert rep["unanswered"] == 0, ex
    assert rep["ok_replies"] == 0, ex
    assert rep["internal_errors"] == 0, ex
    assert rep["setup_failures"] == 0, ex
    assert rep["unexpected_codes"] == 0, ex
    assert rep["error_replies"] == rep["messages"]
    assert rep["daemon_alive"] and rep["invariants_ok"], rep["invariant_problems"]
    assert rep["victim_rows_corrupted"] == 0 and rep["leaked_rows"] == 0
    assert rep["metrics_match"], (rep["metrics_errors_delta"], rep["error_replies"])
    assert rep["ok"]


def test_fuzz_every_hostile_message_refused_state_unchanged(runner):
    rep = run_fuzz(runner.address, 2500, seed=1234, daemon_pid=runner.pid)
    _assert_clean(rep)
    common = {n for n, w in Hostile.KINDS if w >= 1}
    assert common <= set(rep["kinds"]), sorted(common - set(rep["kinds"]))
    assert rep["deep_check"] == "ok"  # the allocator's own invariant check ran in the daemon


def test_fuzz_through_shared_memory_channels():
    """The attacker's and the stranger's hostile messages enter a busy-polling daemon through
    their channels (those that fit a slot): the same refusals, nothing changed."""
    address, d = private_address("hcf-")
    r = DaemonRunner(address, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0,
                     extra=SPARSE_FLAGS + ("--spin-us", "2000"))
    r.start()
    try:
        rep = run_fuzz(address, 800, seed=99, daemon_pid=r.pid, channel=True)
        _assert_clean(rep)
        assert rep["channel"] and len(rep["kinds"]) >= 20
        assert rep["channel_messages"] >= rep["messages"] // 2  # most entered through a slot
    finally:
        assert r.clean_exit(r.stop())
        shutil.rmtree(d, ignore_errors=True)


def test_fuzz_rare_and_heavy_kinds(runner):
    kinds = ["oversize_header", "deep_json", "too_many_frames", "long_list", "double_free",
             "use_after_free", "bad_register", "mixed_ownership"]
    rep = run_fuzz(runner.address, 120, seed=7, daemon_pid=runner.pid, kinds=kinds)
    _assert_clean(rep)
    assert set(rep["kinds"]) == set(kinds)


# A header drawn by hypothesis: a known command with arbitrary JSON fields. Some are valid
# (stats, alloc of a few rows ...): the property is only that every message is answered, never
# with an internal error, and the daemon's bookkeeping stays consistent.
_json = st.recursive(st.none() | st.booleans() | st.integers(-2**70, 2**70) | st.floats()
                     | st.text(max_size=8),
                     lambda ch: st.lists(ch, max_size=4) | st.dictionaries(st.text(max_size=6), ch,
                                                                            max_size=4),
                     max_leaves=12)
_cmds = st.sampled_from([c for c in P.COMMANDS if c not in ("shutdown",)])
_fields = st.dictionaries(st.sampled_from(["counts", "rows", "items", "slot", "slots", "host_row",
                                           "request", "max", "ops", "full", "layout", "mode",
                                           "draft", "release", "x"]), _json, max_size=4)
_frames = st.lists(st.binary(max_size=40), max_size=4)


@pytest.fixture(scope="module")
def prop_peer(runner):
    p = RawPeer(runner.address, "prop")
    yield p
    p.close()


@settings(max_examples=150, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(cmd=_cmds, fields=_fields, frames=_frames)
def test_any_header_gets_an_answer(runner, prop_peer, cmd, fields, frames):
    head = {"v": 1, "cmd": cmd, "id": prop_peer.next_id()}
    head.update(fields)
    try:
        body = json.dumps(head).encode()
    except (ValueError, TypeError):
        return
    prop_peer.send([body, *frames])
    h = prop_peer.reply(5.0, head["id"])
    assert h is not None, head
    if not h["ok"]:
        assert h["error"]["code"] in P.ERROR_CODES and h["error"]["code"] != "internal", h


def test_property_run_left_daemon_consistent(runner, prop_peer):
    from hicache.engine.client import Client

    with Client(runner.address, timeout=10) as c:
        chk = daemon_check(c)
    assert chk["ok"], chk["problems"]
    assert "Traceback" not in runner.output(), runner.output()[-3000:]


def test_bench_fuzz_cli_json():
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "fuzz", "--messages", "400",
                        "--seed", "3", "--json"], cwd=str(ROOT), env=env, capture_output=True,
                       text=True, timeout=180)
    assert p.returncode == 0, (p.stdout[-3000:], p.stderr[-3000:])
    rep = json.loads(p.stdout)
    for k in ("messages", "error_replies", "unanswered", "daemon_alive", "invariants_ok",
              "seconds"):
        assert k in rep, k
    assert rep["messages"] == 400 and rep["error_replies"] == 400 and rep["unanswered"] == 0
    assert rep["daemon_alive"] and rep["invariants_ok"] and rep["daemon_exit_code"] == 143


def test_bench_fuzz_exits_1_when_a_check_fails(monkeypatch, capsys):
    """A deliberately broken errors metric (every sample reads 0) must fail the bench."""
    import argparse

    import hicache.fuzz.runner as fr
    from hicache.bench import fuzz as bench_fuzz

    monkeypatch.setattr(fr, "metric_total", lambda *a, **k: 0.0)
    p = argparse.ArgumentParser()
    bench_fuzz.add_arguments(p)
    args = p.parse_args(["--messages", "150", "--seed", "5", "--json"])
    assert bench_fuzz.run(args) == 1
    rep = json.loads(capsys.readouterr().out)
    assert rep["ok"] is False and rep["failed_checks"] == ["errors metric counted every refusal"]
    assert rep["error_replies"] == 150 and rep["unanswered"] == 0  # everything else held


def test_the_pattern_checker_reports_every_wrong_row_and_only_those():
    """``Pattern.bad_rows`` is what the soak's and the fuzzer's "0 corrupted" rests on: one
    word wrong at the last word of the last layer of the last pool of a row, a row scribbled and
    never loaded, and a neighbour's salt (a row loaded from the wrong source) are each reported,
    at exactly their positions; rows with their own content are not."""
    from hicache.core.layout import build_layout, preset
    from hicache.fuzz.peers import Pattern, ShmBuffers

    layout = build_layout(preset("dsv4-tiny"), c128_state="offline", mtp=False)
    pools = [n for n, p in layout.pools.items() if p.index == "page"]
    pat = Pattern(layout, pools, seed=3)
    with ShmBuffers(layout, {"page": 8, "swa_page": 4, "req_slot": 4}, tag="pat") as bufs:
        rows, salts = [0, 1, 2, 3, 4, 5], [11, 12, 13, 14, 15, 16]
        pat.fill(bufs, rows, salts)
        assert pat.bad_rows(bufs, rows, salts) == []
        w = bufs.view(pools[-1]).view(np.uint64)
        w[-1, rows[1], -1] ^= np.uint64(1)  # one bit of the last word of the last layer
        pat.scribble(bufs, [rows[3]], 0xDEAD)  # scribbled, never loaded
        pat.fill(bufs, [rows[5]], [salts[4]])  # a neighbour's content
        assert pat.bad_rows(bufs, rows, salts) == [1, 3, 5]
        first = bufs.view(pools[0]).view(np.uint64)
        first[0, rows[0], 0] ^= np.uint64(1 << 62)  # the first word of the first pool too
        assert pat.bad_rows(bufs, rows, salts) == [0, 1, 3, 5]
