"""``hicache bench e2e``: its arguments (CPU), one functional run in CPU mode (a real daemon,
shared-memory device pools, churned host allocator, every loaded byte verified), and one GPU
run (CUDA) with the engine's probe steps."""
from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from hicache.bench import e2e
from hicache.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]


def _args(**kw):
    p = argparse.ArgumentParser()
    e2e.add_arguments(p)
    a = p.parse_args([])
    for k, v in kw.items():
        setattr(a, k, v)
    return a


def test_sizes_and_arguments_are_checked():
    assert e2e.parse_sizes("2k, 32k") == ["2k", "32k"]
    with pytest.raises(UsageError, match=r"--sizes wants sizes from 2k, 8k.*, got '3k'"):
        e2e.parse_sizes("2k,3k")
    with pytest.raises(UsageError, match="--sizes wants"):
        e2e.parse_sizes(" , ")
    assert e2e.parse_mirrors("checkpoints") == ["checkpoints"]
    with pytest.raises(UsageError, match="--mirror wants mirrors from full, checkpoints, got 'half'"):
        e2e.check_args(_args(device="cpu", mirror="half"))
    with pytest.raises(UsageError, match="--runs"):
        e2e.check_args(_args(device="cpu", runs=0))
    with pytest.raises(UsageError, match="--churn"):
        e2e.check_args(_args(device="cpu", churn=-1))
    for bad in ("tpu", "cuda", "cuda:x"):  # the daemon's own check: cuda names its index
        with pytest.raises(UsageError, match="'cpu' or 'cuda:N'"):
            e2e.check_args(_args(device=bad))
    with pytest.raises(UsageError, match="--pp-rank 2 is outside 0..1"):
        e2e.check_args(_args(device="cpu", pp_size=2, pp_rank=2))
    with pytest.raises(UsageError, match="--gpus must be at least 1"):
        e2e.check_args(_args(device="cpu", gpus=0))
    with pytest.raises(UsageError, match="--fence applies to GPU runs"):
        e2e.check_args(_args(device="cpu", fence=True))
    with pytest.raises(UsageError, match="--layer-wait stream applies to GPU runs"):
        e2e.check_args(_args(device="cpu", layer_wait="stream"))
    assert _args().host_fill == "full" and not _args().fence  # the defaults
    assert _args().layer_wait == "host"
    if torch.cuda.device_count() < 64:
        with pytest.raises(UsageError, match="--gpus 64 needs 64 CUDA GPUs"):
            e2e.check_args(_args(device="cuda:0", gpus=64))
    if not torch.cuda.is_available():
        with pytest.raises(UsageError, match="needs a CUDA GPU"):
            e2e.check_args(_args(device="cuda:0"))


def test_cpu_run_refuses_sizes_that_do_not_fit_in_memory(monkeypatch):
    """CPU mode keeps the engine's pools in host memory beside the daemon's: sizes whose two
    pools exceed the memory available (less the daemon's reserve) are refused at once, with
    what it needs, what there is and the sizes that fit."""
    from hicache.core.layout import build_layout, preset
    from hicache.core.sizes import arena_bytes, host_rows, used_spaces

    layout = build_layout(preset("dsv4-flash"), 1, 0)
    used = {s: n for s, n in e2e._rows_for(layout, ["32k"]).items() if s in used_spaces(layout)}
    need_32k = arena_bytes(layout, used) + arena_bytes(layout, host_rows(layout, used,
                                                                         ratio=e2e.HOST_RATIO))
    reserve = e2e.default_reserve(e2e.psutil.virtual_memory().total)
    # room for exactly 32k: 128k is refused, naming 2k, 8k and 32k as fitting
    monkeypatch.setattr(e2e, "available_bytes", lambda: (need_32k + reserve, "of memory is "
                                                                              "available"))
    e2e.check_cpu_memory(layout, ["2k", "32k"])
    with pytest.raises(UsageError, match=r"--sizes 2k,128k needs .* --sizes 2k,8k,32k fits"):
        e2e.check_cpu_memory(layout, ["2k", "128k"])
    monkeypatch.setattr(e2e, "available_bytes", lambda: (reserve, "of memory is available"))
    with pytest.raises(UsageError, match="no size fits"):
        e2e.check_cpu_memory(layout, ["2k"])


def test_functional_run_on_cpu_verifies_every_loaded_byte():
    # ``bench e2e --device cpu --preset dsv4-tiny --sizes 2k --runs 2 --churn 60 --json``, run
    # beside the main suite (conftest; tests/background_jobs.py)
    import background_jobs

    r = background_jobs.completed("bench_e2e_cpu")
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    m = out["sizes"]["2k"]["summary"]
    assert m["verified"] is True and m["pages"] == 8 and m["bytes"] > 0
    assert out["device_order"] == "random" and m["device_mean_run"] >= 1.0
    # the host pool as a full server's: the churn held all but the run's room
    assert out["host_fill"] == "full" and out["fence"] is False
    assert all(0.2 < v < 1 for v in out["host_held"].values()), out["host_held"]
    assert 1.0 <= m["host_mean_run"] <= 8
    assert m["load_gbps"] > 0 and m["backup_gbps"] > 0
    assert out["daemon_spin_us"] == 0.0 and out["client_reply_spin_us"] == 0.0  # CPU mode
    assert out["channel"] is False and "--spin-us 0" in out["channel_refused"]  # it sleeps
    assert len(out["sizes"]["2k"]["runs"]["load_last"]) == 2
    # first, second and last layer ready: in CPU mode (no per-layer events) all three are the
    # ack, so they are equal run by run
    runs = out["sizes"]["2k"]["runs"]
    assert len(runs["load_second"]) == 2 and runs["load_second"] == runs["load_last"]
    assert runs["load_first"] == runs["load_second"]
    assert m["load_second_ms"] == m["load_last_ms"] > 0
    assert m["load_second_max_ms"] == max(runs["load_second"]) * 1e3  # the slowest run's
    assert m["busy_second_ms"] is None and m["busy_vs_solo"] is None  # GPU runs only
    assert m["engine_wait"] is None  # GPU runs only (the engine's probe steps)
    assert m["idle_first_ms"] is None and runs["idle_first"] == []  # GPU runs only
    assert out["gpu_sharing"] == {"engine": "unknown", "daemon": "unknown"}  # no GPU at all
    # a heartbeat right after a load's reply: timed once per run, both mirrors
    assert len(out["sizes"]["2k"]["runs"]["cmd_during_load"]) == 2 and m["load_cmd_ms"] > 0
    assert out["checkpoints"]["2k"]["summary"]["load_cmd_ms"] > 0
    # the daemon's own handling of this size's commands (its stats), below what the engine
    # waited for the same commands (the timed runs' acks are another sample: not comparable)
    assert 0 < m["load_handler_ms"] < m["load_handler_ack_ms"]
    assert 0 < m["backup_handler_ms"] < m["backup_handler_ack_ms"]
    # over the solo runs' own commands only: a second LOAD (with a heartbeat beside it) ran in
    # each of them and doubled the loads (forty-eighth session's bench review)
    from hicache.bench.e2e import HANDLER_RUNS
    for summary in (m, out["checkpoints"]["2k"]["summary"]):
        assert summary["handler_commands"] == {"load": HANDLER_RUNS, "backup": HANDLER_RUNS}
    # the checkpoints mirror: compressed pages plus one checkpoint, every byte verified
    from hicache.core.layout import build_layout, preset
    from hicache.core.resume import ResumeModel
    ck = out["checkpoints"]["2k"]["summary"]
    assert ck["verified"] is True and ck["pages"] == 8
    assert ck["bytes"] == ResumeModel(build_layout(preset("dsv4-tiny"))).load_bytes(8, "checkpoints")
    assert ck["bytes"] < m["bytes"]


def test_summary_of_a_load_while_a_backup_streams():
    """The busy load's figures: its second layer (median, ms) beside its last layer's rate
    against the solo load's."""
    from hicache.bench.e2e_measure import FIGURES, summarize

    out = {k: [] for k in FIGURES}
    for k, v in (("backup_ack", 0.01), ("load_first", 0.001), ("load_second", 0.002),
                 ("load_last", 0.010), ("load_ack", 0.011)):
        out[k] = [v] * 3
    out["busy_second"] = [0.002, 0.006, 0.003]
    out["busy_last"] = [0.0125, 0.0125, 0.020]
    out["busy_backup_end"] = [0.0130, 0.0125, 0.015]  # the third ended before its load
    m = summarize(out, 8, 10 ** 8, {"h2d": 50.0, "d2h": 50.0}, True, True)["summary"]
    assert m["busy_second_ms"] == pytest.approx(3.0)
    assert m["busy_vs_solo"] == pytest.approx(0.8)
    assert m["load_ratio"] == pytest.approx(0.2)
    assert m["busy_backup_end_ms"] == pytest.approx(13.0)
    assert m["busy_covered"] == pytest.approx(2 / 3)
    assert m["idle_first_ms"] is None and m["idle_last_ms"] is None  # none taken
    assert m["idle_reply_ms"] is None
    out["busy_backup_end"] = []  # not measured (CPU): no figure, not a zero
    out["idle_first"], out["idle_last"] = [0.003, 0.001, 0.002], [0.02, 0.01, 0.03]
    out["idle_reply"] = [0.0025, 0.0005, 0.0015]
    m = summarize(out, 8, 10 ** 8, {"h2d": 50.0, "d2h": 50.0}, True, True)["summary"]
    assert m["busy_covered"] is None and m["busy_backup_end_ms"] is None
    assert (m["idle_first_ms"], m["idle_last_ms"]) == (pytest.approx(2.0), pytest.approx(20.0))
    assert m["idle_reply_ms"] == pytest.approx(1.5)


def test_the_busy_load_waits_for_its_backups_and_records_the_last_end(monkeypatch):
    """``load_while_busy``: after the timed load, every backup's ack; the end is the last
    backup's (its send time after the start plus its daemon time); a failed backup fails the
    run instead of counting as covered. ``stream_backups`` sends ``BUSY_BACKUPS`` of them
    back to back, each with its send time."""
    from types import SimpleNamespace

    from hicache.bench import e2e_measure
    from hicache.engine.acks import Ack

    monkeypatch.setattr(e2e_measure, "timed_load",
                        lambda *a: e2e_measure.LoadTimes(0.001, 0.002, 0.010, 0.011))
    acks = {7: Ack(7, "backup", "ok", {}, 10, 0.0123, 0.01, "ce"),
            8: Ack(8, "backup", "ok", {}, 10, 0.0100, 0.01, "ce")}
    c = SimpleNamespace(wait_ack=lambda op, timeout: acks[op.op_id])
    out = {k: [] for k in e2e_measure.FIGURES}
    ops = iter([SimpleNamespace(op_id=7), SimpleNamespace(op_id=8)])
    sent = e2e_measure.stream_backups(lambda: next(ops))
    assert [op.op_id for op, _ in sent] == [7, 8] and e2e_measure.BUSY_BACKUPS == 2
    assert sent[0][1] <= sent[1][1]
    begun = (None, sent[0][1])
    sent = [(sent[0][0], begun[1]), (sent[1][0], begun[1] + 0.004)]  # the second 4 ms later
    e2e_measure.load_while_busy(out, c, {}, None, True, begun, sent)
    assert out["busy_last"] == [0.010]
    assert out["busy_backup_end"] == [pytest.approx(0.014)]  # 4 ms + 10 ms, after 12.3 ms
    acks[8] = Ack(8, "backup", "error", {}, 0, 0.001, 0.0, "ce", {"reason": "x"})
    with pytest.raises(RuntimeError, match="the busy run's backup failed"):
        e2e_measure.load_while_busy(out, c, {}, None, True, begun, sent)


def test_checkpoint_verification_catches_a_wrong_byte():
    """The checkpoints mirror's byte check fails on one differing tail byte, state byte or
    page byte (so a run that reports verified really compared them)."""
    from types import SimpleNamespace

    from hicache.bench.e2e_checkpoint import _pairs, _verify
    from hicache.bench.e2e_measure import layer_compare
    from hicache.core.layout import build_layout, preset
    from hicache.core.resume import ResumeModel
    from hicache.kernels.tables import TokenFormat

    layout = build_layout(preset("dsv4-tiny"))
    r = ResumeModel(layout)
    layers = {n: [torch.zeros(6, p.page_bytes, dtype=torch.uint8) for _ in range(p.num_layers)]
              for n, p in layout.pools.items()}
    pools = SimpleNamespace(layers=layers)
    _verify(pools, r, [0, 1], [2, 3], 4, 5)  # all equal: passes
    fmt = TokenFormat.from_spec(r.swa_pool)
    last = r.tail_offsets.stop - 1
    cases = [(r.swa_pool.name, 5, fmt.scale_offset + last * fmt.scale_bytes, "tail"),
             (r.state_pools[0].name, 5, 7, "state"), (r.page_pools[0].name, 3, 0, "differs")]
    compare = layer_compare(pools, layout, _pairs(r, [0, 1], [2, 3], 4, 5), torch.device("cpu"))
    stage = layout.stage.layers("swa")
    assert [int(compare(g)) for g in stage] == [0] * len(stage)
    for name, row, byte, what in cases:
        layers[name][-1][row, byte] = 1
        with pytest.raises(RuntimeError, match=what):
            _verify(pools, r, [0, 1], [2, 3], 4, 5)
        # the per-layer comparison (each layer at its ready event) counts it in its layer only
        spec = layout.pools[name]
        g = layout.stage.global_id(spec.family, spec.num_layers - 1)
        assert [int(compare(x)) for x in stage] == [int(x == g) for x in stage], name
        layers[name][-1][row, byte] = 0
    layers[r.swa_pool.name][-1][5, fmt.scale_offset + r.tail_offsets.stop * fmt.scale_bytes] = 1
    assert [int(compare(x)) for x in stage] == [0] * len(stage)  # past the tail: not loaded


def test_daemon_times_mean_between_two_readings():
    from hicache.bench.daemon_times import command_times, mean_ms

    def metrics(n: int, total: float) -> dict:
        return {"hicache_command_seconds_count": [{"labels": {"command": "load"}, "value": n}],
                "hicache_command_seconds_sum": [{"labels": {"command": "load"}, "value": total}]}
    a, b = command_times(metrics(3, 0.003)), command_times(metrics(5, 0.007))
    assert a == {"load": (3, 0.003)}
    assert abs(mean_ms(a, b, "load") - 2.0) < 1e-9
    assert mean_ms(a, a, "load") is None and mean_ms(a, b, "backup") is None


def test_daemon_times_add_the_load_issue_after_the_reply():
    """``daemon_times`` = the commands' times plus the unlabelled load-issue histogram; a
    daemon's real ``stats`` metrics carry both (the issue at 0 until a GPU load)."""
    from hicache.bench.daemon_times import command_times, daemon_times, mean_ms
    from hicache.controllers.metrics import Metrics

    m = Metrics(process_metrics=False)
    m.command("load", True, 0.001)
    first = daemon_times(m.snapshot())
    assert first["load_issue"] == (0, 0.0) and first["load"] == (1, 0.001)
    assert "load_issue" not in command_times(m.snapshot())
    m.observe("load_issue_seconds", 0.004)
    m.observe("load_issue_seconds", 0.002)
    m.inc("load_issue_cpu_seconds", 0.003)  # the issuer's CPU time in those two issues
    m.inc("load_issue_cpu_seconds", 0.001)
    after = daemon_times(m.snapshot())
    assert abs(mean_ms(first, after, "load_issue") - 3.0) < 1e-9
    assert abs(mean_ms(first, after, "load_issue_cpu") - 2.0) < 1e-9


def test_device_orders_are_permutations_with_their_runs():
    """Every order hands out each row once; ``consecutive`` is one run, ``random`` and the
    churned unsorted free list (``sglang``) mostly single rows; bad names are refused."""
    import numpy as np

    from hicache.bench.device_order import PATTERNS, device_order
    from hicache.bench.transfer_rows import mean_run as runs

    def mean_run(ids: np.ndarray) -> float:
        return runs(torch.from_numpy(np.ascontiguousarray(ids)))

    rng = np.random.default_rng(1)
    for p in PATTERNS:
        order = device_order(p, 300, rng)
        assert sorted(order.tolist()) == list(range(300))
    assert mean_run(device_order("consecutive", 300, rng)[100:200]) == 100.0
    assert mean_run(device_order("random", 300, rng)[100:200]) < 1.5
    assert mean_run(np.array([3, 4, 5, 9, 1, 2])) == 2.0 and mean_run(np.array([])) == 0.0
    assert all(device_order(p, 0, rng).size == 0 for p in PATTERNS)
    with pytest.raises(ValueError, match="not one of"):
        device_order("sorted", 10, rng)


def test_table_notes_busy_second_only_when_measured(capsys):
    """The table names what ``busy 2nd`` is (GPU events at time-slice steps) only when a GPU
    run measured it; a CPU run's table has no such line."""
    def result(busy2: float | None) -> dict:
        keys = ("load_first_ms", "load_second_ms", "load_second_max_ms", "load_last_ms",
                "load_gbps", "backup_gbps")
        m = {k: 1.0 for k in keys} | {
            "bytes": 88e6, "load_ratio": 0.5, "backup_ratio": 0.5, "daemon_vs_inproc": None,
            "busy_vs_solo": None if busy2 is None else 0.9, "busy_second_ms": busy2,
            "load_reply_ms": None, "load_handler_ms": 0.3, "load_issue_ms": None,
            "load_cmd_ms": 0.2}
        return {"device": "x", "preset": "dsv4-flash", "pp_size": 1, "pp_rank": 0, "ctas": 4,
                "runs": 5, "limit_gbps": {}, "daemon_spin_us": 0.0, "client_reply_spin_us": 0.0,
                "channel": True, "channel_refused": None, "sizes": {"2k": {"summary": m}}}
    e2e._table(result(2.11))
    assert "busy 2nd: GPU events" in capsys.readouterr().out
    e2e._table(result(None))
    out = capsys.readouterr().out
    assert "busy 2nd: GPU events" not in out and " 2k " in out


def test_engine_wait_statistics_and_table(capsys):
    """The engine's probe steps: p50 / p99 / max per kind in ms, None for a kind with no step;
    the table prints them (and nothing for a run without them)."""
    from hicache.bench.e2e_engine import wait_stats
    from hicache.bench.e2e_measure import FIGURES, summarize

    steps = [0.001 * (i + 1) for i in range(100)]  # 1..100 ms, shuffled
    steps = steps[37:] + steps[:37]
    w = wait_stats(steps)
    assert w == {"steps": 100, "p50_ms": pytest.approx(51.0), "p99_ms": pytest.approx(100.0),
                 "max_ms": pytest.approx(100.0)}
    assert wait_stats([]) is None
    out = {k: [0.01] for k in FIGURES}
    m = summarize(out, 8, 10 ** 8, {"h2d": 50.0, "d2h": 50.0}, True, True,
                  {"idle": [2e-5, 1e-5], "load": steps, "backup": []})["summary"]
    assert m["engine_wait"]["idle"]["max_ms"] == pytest.approx(0.02)
    assert m["engine_wait"]["load"] == w and m["engine_wait"]["backup"] is None
    e2e._engine_table({"sizes": {"8k": {"summary": m}}})
    text = capsys.readouterr().out
    assert "engine step" in text and "51.000/100.000/100.00" in text and "n/a" in text
    e2e._engine_table({"sizes": {"8k": {"summary": {"engine_wait": None}}}})
    assert capsys.readouterr().out == ""


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("fence,wait", [(False, "host"), (True, "stream")])
def test_gpu_run_times_the_engines_steps_beside_each_kind_of_daemon_work(fence, wait):
    """One GPU run of both mirrors at 2k: every byte verified (each stage layer's too, at its
    ready event), and the engine's probe steps taken idle and while a LOAD and a BACKUP ran,
    in both mirrors; with ``--fence`` every command waits for the engine's event (as the SGLang
    adapter's do), and with ``--layer-wait stream`` the engine waits for each layer on its
    stream; the limit is read at the start and at the end, and the ratios divide by the
    better."""
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "bench", "e2e", "--sizes", "2k",
                        "--runs", "2", "--churn", "60", "--json", "--layer-wait", wait]
                       + (["--fence"] if fence else []),
                       capture_output=True, text=True, timeout=600, cwd=ROOT)
    assert r.returncode == 0, r.stderr[-2000:]
    out = json.loads(r.stdout)
    assert out["fence"] is fence and out["layer_wait"] == wait
    assert out["limit_gbps"] == {k: max(out["limit_gbps_start"][k], out["limit_gbps_end"][k])
                                 for k in ("h2d", "d2h")}
    # this process and the daemon it started share one environment: the same MPS or none
    assert out["gpu_sharing"]["engine"] == out["gpu_sharing"]["daemon"] in ("mps", "time-slices")
    for key in ("sizes", "checkpoints"):
        m = out[key]["2k"]["summary"]
        assert m["verified"] is True and m["load_ratio"] > 0
        w = m["engine_wait"]
        assert w["idle"]["steps"] == 200
        for kind in ("idle", "load", "backup"):
            assert w[kind]["steps"] >= 1
            assert 0 < w[kind]["p50_ms"] <= w[kind]["p99_ms"] <= w[kind]["max_ms"] < 5000
        # a load after the daemon's busy-poll window, once per timed run
        assert len(out[key]["2k"]["runs"]["idle_first"]) == 2
        assert 0 < m["idle_first_ms"] <= m["idle_last_ms"]
        assert len(out[key]["2k"]["runs"]["idle_reply"]) == 2 and 0 < m["idle_reply_ms"]


def test_engine_steps_run_until_the_ack_and_a_missing_ack_times_out(monkeypatch):
    """``op_waits`` times steps until the op's ack is there (read through ``drain`` and a
    zero-timeout ``wait_ack``), and gives up with ``AckTimeout`` naming the op after its
    timeout; a failed op's ``TransferFailed`` goes through. The GPU step itself is stubbed."""
    from types import SimpleNamespace

    from hicache.bench import e2e_engine
    from hicache.engine.acks import AckTimeout, TransferFailed

    monkeypatch.setattr(e2e_engine, "_step", lambda stream, probe: 0.001)

    class Fake:
        def __init__(self, acked_after: int | None, fail: bool = False) -> None:
            self.left, self.fail, self.drained = acked_after, fail, 0

        def drain(self) -> int:
            self.drained += 1
            return 0

        def wait_ack(self, op, timeout=None):
            assert timeout == 0  # never blocks between steps
            if self.left is not None:
                self.left -= 1
                if self.left <= 0:
                    if self.fail:
                        raise TransferFailed(SimpleNamespace(op=op.op_id, ok=False, kind="load",
                                                          error={"message": "x"}))
                    return SimpleNamespace(ok=True)
            raise AckTimeout("not yet")

        def poll_acks(self, ops):
            self.polled = getattr(self, "polled", 0) + 1
            return list(self.held) if hasattr(self, "held") else []

    op = SimpleNamespace(op_id=7)
    c = Fake(acked_after=5)
    assert e2e_engine.op_waits(c, op, None, None) == [0.001] * 5 and c.drained == 5
    with pytest.raises(AckTimeout, match="op 7 did not complete within 0.05 s"):
        e2e_engine.op_waits(Fake(acked_after=None), op, None, None, timeout=0.05)
    with pytest.raises(TransferFailed):
        e2e_engine.op_waits(Fake(acked_after=2, fail=True), op, None, None)
    # an ack whose push was lost: asked for every POLL_S (each ask is a heartbeat too)
    monkeypatch.setattr(e2e_engine, "POLL_S", 0.0)
    lost = Fake(acked_after=None)
    lost.held = [SimpleNamespace(op=7, ok=True)]
    assert e2e_engine.op_waits(lost, op, None, None, timeout=5) == [0.001] and lost.polled == 1
    lost.held = [SimpleNamespace(op=7, ok=False, kind="load", error={"message": "x"})]
    with pytest.raises(TransferFailed):
        e2e_engine.op_waits(lost, op, None, None, timeout=5)


def test_scramble_gives_the_verified_rows_fresh_distinct_bytes_and_nothing_else():
    """Before the run whose load is verified, its source and destination rows get fresh random
    bytes: rows earlier runs copied onto each other hold equal bytes, and a load that moved
    nothing passed the comparison on them."""
    import torch

    from hicache.bench.e2e_measure import scramble
    from hicache.core.layout import build_layout, preset
    from hicache.engine.device_pools import DevicePools

    lay = build_layout(preset("dsv4-tiny"))
    with DevicePools(lay, {"page": 8, "swa_page": 8, "req_slot": 4}) as pools:
        for ls in pools.layers.values():
            for t in ls:
                t.fill_(7)  # every row equal, as after many copies
        before = {n: [t.clone() for t in ls] for n, ls in pools.layers.items()}
        scramble(pools, {"c4_kv": [1, 5], "swa_kv": [2]}, seed=3)
        for name, ls in pools.layers.items():
            for t, was in zip(ls, before[name]):
                rows = {"c4_kv": [1, 5], "swa_kv": [2]}.get(name, [])
                for r in range(t.shape[0]):
                    assert torch.equal(t[r], was[r]) == (r not in rows), (name, r)
        c4 = pools.layers["c4_kv"][0]
        assert not torch.equal(c4[1], c4[5])  # the source and destination differ


def test_the_layer_comparison_counts_each_stage_layers_rows_that_differ():
    """``layer_compare`` (the GPU verified run compares each stage layer's rows at that layer's
    ready event): a layer's count is the destination rows, over every pool that has the layer,
    whose bytes differ from their source rows; the other layers read 0."""
    import torch

    from hicache.bench.e2e_measure import layer_compare
    from hicache.core.layout import build_layout, preset
    from hicache.engine.device_pools import DevicePools

    lay = build_layout(preset("dsv4-tiny"))
    src, dst = {"page": [0, 1, 2], "swa_page": [0, 1, 2]}, {"page": [5, 3, 4],
                                                            "swa_page": [5, 3, 4]}
    names = [m for m, spec in lay.pools.items() if spec.index in src]
    with DevicePools(lay, {"page": 8, "swa_page": 8, "req_slot": 4}) as pools:
        for ls in pools.layers.values():
            for t in ls:
                t.fill_(7)
        compare = layer_compare(pools, lay, {m: (src[lay.pools[m].index],
                                                 dst[lay.pools[m].index], None) for m in names},
                                torch.device("cpu"))
        layers = lay.stage.layers("swa")
        assert [int(compare(g)) for g in layers] == [0] * len(layers)
        c4 = [g for g in layers if lay.local_id("c4_kv", g) is not None]
        g = c4[-1]
        pools.layers["c4_kv"][lay.local_id("c4_kv", g)][3, 0] ^= 1  # one byte of a destination
        pools.layers["swa_kv"][lay.local_id("swa_kv", g)][5, -1] ^= 1
        pools.layers["swa_kv"][lay.local_id("swa_kv", g)][7] ^= 1  # not a destination row
        assert [int(compare(x)) for x in layers] == [2 if x == g else 0 for x in layers]


def test_a_layer_not_in_place_at_its_event_fails_the_checked_load():
    """``layers_checked_load`` compares each stage layer after the engine's wait on its event
    and names every layer whose rows were not in place; a load whose layers all were passes."""
    from hicache.bench.e2e_measure import layers_checked_load

    class Engine:  # the client calls the check makes, in order
        stage_layers = [0, 1, 2, 5]

        def __init__(self) -> None:
            self.calls: list[tuple] = []

        def load(self, items):
            self.calls.append(("load", items))
            return "op"

        def wait_layer(self, op, g, stream) -> None:
            self.calls.append(("wait", g))

        def wait_ack(self, op, timeout) -> None:
            self.calls.append(("ack",))

    e = Engine()
    compared: list[int] = []

    def compare(g: int) -> torch.Tensor:
        compared.append(g)
        assert e.calls[-1] == ("wait", g)  # enqueued right after that layer's wait
        return torch.tensor({1: 3, 5: 1}.get(g, 0))

    with pytest.raises(RuntimeError, match=r"\{1: 3, 5: 1\}"):
        layers_checked_load(e, {"page": ([1], [2])}, None, compare)
    assert compared == [0, 1, 2, 5] and e.calls[0] == ("load", {"page": ([1], [2])})
    assert e.calls[-1] == ("ack",)
    layers_checked_load(Engine(), {}, None, lambda g: torch.tensor(0))


def test_the_in_process_load_is_byte_checked_in_the_verified_run(monkeypatch):
    """``inproc_into``: in the verified run the in-process pool's source rows are filled from
    the device first, the destination gets fresh bytes, and the loaded bytes are compared after
    the timed copy; other runs only time it."""
    from hicache.bench import e2e_measure

    calls: list[tuple] = []

    def fake(local, layout, items, dev, to_host=False):
        calls.append(("copy", items, to_host))
        return 0.25

    monkeypatch.setattr(e2e_measure, "inproc_load", fake)
    out = {"inproc_last": []}
    load, backup = {"page": ([7], [3])}, {"page": ([1], [7])}
    e2e_measure.inproc_into(out, None, None, load, None,
                            (backup, lambda: calls.append(("fresh",)),
                             lambda: calls.append(("check",))))
    assert calls == [("copy", backup, True), ("fresh",), ("copy", load, False), ("check",)]
    assert out["inproc_last"] == [0.25]
    calls.clear()
    e2e_measure.inproc_into(out, None, None, load, None)
    assert calls == [("copy", load, False)] and out["inproc_last"] == [0.25, 0.25]


def test_the_verified_load_also_checks_the_rows_it_must_not_write() -> None:
    """``untouched``: a write into the load's destination passes, one anywhere else (a stray
    row, another pool, two words of a row swapped) fails (the e2e byte checks compared only what a load wrote; forty-eighth
    session's bench review)."""
    from types import SimpleNamespace

    import torch

    from hicache.bench.e2e_measure import untouched

    g = torch.Generator().manual_seed(7)
    pools = SimpleNamespace(layers={
        "swa_kv": [torch.randint(0, 256, (6, 16), dtype=torch.uint8, generator=g)
                   for _ in range(2)],
        "c128_state": [torch.randint(0, 256, (3, 6), dtype=torch.uint8, generator=g)]})
    check = untouched(pools, {"swa_kv": [1, 4]})
    pools.layers["swa_kv"][1][4] = 0xEE  # the destination: written as a load writes it
    check()
    for name, layer, row in (("swa_kv", 1, 5), ("c128_state", 0, 2)):
        t = pools.layers[name][layer]
        old = t[row].clone()
        t[row, 3] ^= 0x01
        with pytest.raises(RuntimeError, match=f"pool {name} layer {layer}: rows outside"):
            check()
        t[row] = old
    check()
    t = pools.layers["swa_kv"][0]  # two words of a row swapped: the row's sum stays
    t[2, :4], t[2, 8:12] = t[2, 8:12].clone(), t[2, :4].clone()
    assert not torch.equal(t[2, :4], t[2, 8:12])
    with pytest.raises(RuntimeError, match="pool swa_kv layer 0: rows outside"):
        check()


def test_ratios_divide_by_the_better_limit_of_the_start_and_the_end():
    """A limit read low flatters every ratio of its run (a review): the limit is read again at
    the end and each direction's ratios divide by the better reading."""
    res = {"limit_gbps": {"h2d": 50.0, "d2h": 50.0},
           "sizes": {"2k": {"summary": {"load_gbps": 25.0, "backup_gbps": 20.0,
                                        "load_ratio": 0.5, "backup_ratio": 0.4}}},
           "checkpoints": {"2k": {"summary": {"load_gbps": 10.0, "backup_gbps": 5.0,
                                              "load_ratio": 0.2, "backup_ratio": 0.1}}}}
    e2e._rescale(res, {"h2d": 50.0, "d2h": 50.0}, {"h2d": 62.5, "d2h": 40.0})
    assert res["limit_gbps"] == {"h2d": 62.5, "d2h": 50.0}
    assert res["limit_gbps_end"] == {"h2d": 62.5, "d2h": 40.0}
    assert res["sizes"]["2k"]["summary"]["load_ratio"] == pytest.approx(0.4)
    assert res["sizes"]["2k"]["summary"]["backup_ratio"] == pytest.approx(0.4)
    assert res["checkpoints"]["2k"]["summary"]["load_ratio"] == pytest.approx(0.16)


def test_the_full_host_pool_leaves_the_run_its_room_in_holes(daemon_factory):
    """``--host-fill full`` (the default): the churn fills the daemon's host pool, churns it
    full (evict, admit), then frees random blocks until the run's room is free; the room then
    lies in holes, not in one untouched run at the pool's end (the churn before the
    fifty-third session left the pool 5-9% held and every timed load one run). ``light``
    keeps the old churn."""
    import numpy as np

    from hicache.bench.transfer_rows import mean_run

    d = daemon_factory(preset="dsv4-tiny", device_rows="page=256,swa_page=256,req_slot=4",
                       metrics=False)
    spaces = {"page": 256, "swa_page": 256}
    from hicache.core.layout import build_layout, preset
    from hicache.engine.device_pools import DevicePools

    with d.client(name="churn") as c:
        with DevicePools(build_layout(preset("dsv4-tiny")),
                         {"page": 256, "swa_page": 256, "req_slot": 4}) as pools:
            c.register(pools)
            total = c.registered["host_rows"]["page"]
            room = 72
            held = e2e.churn(c, spaces, 300, np.random.default_rng(1), room)
            assert total - room - e2e.BLOCK_ROWS < held["page"] * total <= total - room
            got = c.alloc({"page": room})["page"]
            assert mean_run(torch.tensor(got)) < room / 3, got  # holes, not one run
            c.unregister()
        with DevicePools(build_layout(preset("dsv4-tiny")),
                         {"page": 256, "swa_page": 256, "req_slot": 4}) as pools:
            c.register(pools)
            light = e2e.churn(c, spaces, 300, np.random.default_rng(1))
            assert light["page"] < 0.5
            c.unregister()


def test_the_busy_backups_run_through_a_real_daemon_and_every_ack_is_awaited(daemon_factory):
    """The busy run's ``BUSY_BACKUPS`` backups of the load's source pages, sent back to back
    through a real daemon (CPU: the GPU bench's busy path is CUDA only, so its daemon side
    runs here): each gets host rows of its own, the load beside them lands every byte, and the
    end recorded is after each backup's own completion."""
    from hicache.bench import e2e_measure
    from hicache.core.layout import build_layout, preset
    from hicache.engine.device_pools import DevicePools

    d = daemon_factory(preset="dsv4-tiny", device_rows="page=16,swa_page=16,req_slot=4",
                       metrics=False)
    with d.client(name="busy") as c, DevicePools(build_layout(preset("dsv4-tiny")),
                                                 {"page": 16, "swa_page": 16,
                                                  "req_slot": 4}) as pools:
        c.register(pools)
        for layers in pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8))
        src = {"page": [0, 3, 5, 6], "swa_page": [1, 2, 7, 9]}
        dst = {"page": [8, 9, 10, 11], "swa_page": [12, 13, 14, 15]}
        first = c.backup_new(src)
        c.wait_ack(first, timeout=30)
        items = {sp: (first.rows[sp], dst[sp]) for sp in src}
        out = {k: [] for k in e2e_measure.FIGURES}
        acks: dict = {}

        class Seen:  # the client, keeping each ack it waited for
            def __getattr__(self, name: str):
                return getattr(c, name)

            def wait_ack(self, op, timeout=None):
                acks[op.op_id] = c.wait_ack(op, timeout=timeout)
                return acks[op.op_id]

        t0 = time.perf_counter()
        sent = e2e_measure.stream_backups(lambda: c.backup_new(src))
        e2e_measure.load_while_busy(out, Seen(), items, None, False, (None, t0), sent)
        assert len(sent) == e2e_measure.BUSY_BACKUPS == 2
        rows = [set(op.rows["page"]) for op, _ in sent] + [set(first.rows["page"])]
        assert all(not (a & b) for i, a in enumerate(rows) for b in rows[i + 1:]), rows
        assert all(acks[op.op_id].ok for op, _ in sent), acks
        assert out["busy_backup_end"] == [pytest.approx(
            max(s - t0 + acks[op.op_id].seconds for op, s in sent))]
        lay = build_layout(preset("dsv4-tiny"))

        def landed() -> None:
            for name, layers in pools.layers.items():
                sp = lay.pools[name].index
                for t in layers if sp in src else ():  # (request-slot pools: not loaded)
                    assert torch.equal(t[src[sp]], t[dst[sp]]), name

        landed()
        # the idle load (its daemon side): after the quiet spell, the same load again
        for name, layers in pools.layers.items():
            for t in layers if lay.pools[name].index in dst else ():
                t[dst[lay.pools[name].index]] = 0
        t0 = time.perf_counter()
        e2e_measure.idle_load(out, c, items, None, False, 0.2)
        assert time.perf_counter() - t0 >= 0.2
        assert len(out["idle_first"]) == len(out["idle_last"]) == 1 and out["idle_last"][0] > 0
        assert out["idle_reply"] == []  # CPU: a load's reply is not timed apart from its ack
        landed()
        for op, _ in sent + [(first, 0.0)]:
            c.free(op.rows)
        c.unregister()
