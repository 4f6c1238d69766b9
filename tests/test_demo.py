"""`hicache demo` end to end: a daemon subprocess, the simulated worker, the JSON report."""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
KEYS = ("requests", "device_hit_tokens", "host_hit_tokens", "miss_tokens",
        "device_only_hit_tokens", "bytes_backed_up", "bytes_loaded", "verified")


def demo(*args: str, timeout: float = 120) -> subprocess.CompletedProcess:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(ROOT)
    return subprocess.run([sys.executable, "-m", "hicache.cli", "demo", "--device", "cpu",
                           "--progress-seconds", "0", *args], cwd=str(ROOT), env=env,
                          capture_output=True, text=True, timeout=timeout)


def report(p: subprocess.CompletedProcess) -> dict:
    assert p.returncode == 0, p.stderr[-3000:]
    out = json.loads(p.stdout)
    for k in KEYS:
        assert k in out, k
    return out


def test_small_generated_demo_verifies_every_byte():
    # ``demo --requests 40 --device-pages 40 --host-pages 160 --json``, run beside the main
    # suite (conftest; tests/background_jobs.py)
    import background_jobs

    p = background_jobs.completed("demo_small")
    s = report(p)
    assert s["verified"] is True and s["mismatched_bytes"] == 0
    assert s["requests"] == 40 and s["config"]["swa_mode"] == "paged"
    assert s["device_hit_tokens"] + s["host_hit_tokens"] + s["miss_tokens"] == s["input_tokens"]
    assert s["host_hit_tokens"] > 0 and s["bytes_loaded"] > 0 and s["bytes_backed_up"] > 0
    assert s["device_hit_tokens"] + s["host_hit_tokens"] > s["device_only_hit_tokens"]
    assert s["state_swaps"] > 0
    assert "metrics" in p.stderr and "http://127.0.0.1:" in p.stderr
    # its daemon took the shutdown command (it starts it with --allow-shutdown): exit 0, not
    # a SIGTERM after a refusal
    assert s["daemon_exit"] == 0 and "did not take shutdown" not in p.stderr


def test_trace_demo_with_a_small_trace(tmp_path):
    lines = []
    for turn in range(6):  # 4 conversations sharing a 2-block system prompt, growing each turn
        for conv in range(4):
            ids = [0, 1] + [100 * conv + k for k in range(2, 3 + 2 * turn)]
            lines.append(json.dumps({"timestamp": 10 * len(lines), "input_length": 512 * len(ids),
                                     "output_length": 20, "hash_ids": ids}))
    trace = tmp_path / "t.jsonl"
    trace.write_text("\n".join(lines) + "\n")
    s = report(demo("--trace", str(trace), "--device-pages", "32", "--host-pages", "128",
                    "--policy", "write_back", "--json"))
    assert s["verified"] is True and s["requests"] == 24
    assert s["config"]["swa_mode"] == "ring" and s["config"]["policy"] == "write_back"
    assert s["mirror"] == "checkpoints" and s["device_only_hit_tokens"] == 0  # ring: no window
    assert s["host_hit_tokens"] > 0 and s["checkpoints"]["loaded"] > 0  # kept on the device
    assert s["resumable_hit_tokens"] == s["device_hit_tokens"] + s["host_hit_tokens"]
    assert s["host_bytes_per_cached_token"] > 0
    # the human summary gives no rate or latency for a kind of copy that never ran (it said
    # "0.00 GB/s copy, latency p50 0.00 ms": an operator review)
    from hicache.sim.demo import _human

    text = _human({**s, "load_ops": 0}, "x").splitlines()
    loaded = [ln for ln in text if ln.lstrip().startswith("loaded:")]
    assert loaded and loaded[0].endswith(" pages)"), loaded
    backed = [ln for ln in text if ln.lstrip().startswith("backed up:")]
    assert backed and " GB/s copy, latency p50 " in backed[0], backed
    dry = report(demo("--trace", str(trace), "--device-pages", "32", "--host-pages", "128",
                      "--policy", "write_back", "--dry", "--json"))
    assert dry["verified"] is None and dry["dry"] is True
    for k in ("device_hit_tokens", "host_hit_tokens", "unresumable_tokens", "bytes_loaded"):
        assert dry[k] == s[k], k


def test_mirror_full_in_ring_mode_and_plot_without_sweep_are_refused(tmp_path, capsys):
    from hicache.cli import main

    assert main(["demo", "--swa-mode", "ring", "--mirror", "full", "--dry"]) == 2
    assert "--mirror full needs paged SWA" in capsys.readouterr().err
    assert main(["demo", "--dry", "--plot", str(tmp_path / "x.png")]) == 2
    assert "give --sweep-host too" in capsys.readouterr().err
    assert main(["demo", "--state-slots", "overlap"]) == 2  # refused before a daemon starts
    assert "use it with --dry" in capsys.readouterr().err
    # options this run would ignore (found by a review: each used to be accepted silently)
    for argv, msg in (
            (["--dry", "--hisparse-steps", "5"], "--hisparse-steps: applies to --hisparse only"),
            (["--dry", "--metrics-port", "9999"], "--metrics-port: --dry and --sweep-host start"),
            (["--dry", "--mirror", "full", "--pages-per-checkpoint", "4"],
             "--pages-per-checkpoint: a full mirror keeps no checkpoints"),
            (["--hisparse", "--dry", "--l3", "mooncake", "--kv-mem", "1TiB"],
             "--kv-mem, --l3, --dry: does not apply to --hisparse"),
            (["--l3", "mooncake", "--dry"], "--dry: does not apply to --l3 mooncake"),
            (["--l3", "mooncake", "--metrics-port", "9999"],
             "--metrics-port: does not apply to --l3 mooncake"),
            (["--dry", "--preempt-every", "3"], "--preempt-every: --dry and --sweep-host move"),
            (["--dry", "--no-verify-hits"], "--no-verify-hits: --dry and --sweep-host move"),
            (["--dry", "--device", "cuda:x"], "--device cuda:x: --dry and --sweep-host run on"),
            (["--sweep-host", "1GiB", "--host-pages", "7"],
             "--host-pages: --sweep-host sizes its own host tiers"),
            (["--sweep-host", "1GiB", "--mirror", "full"],
             "--mirror: --sweep-host sizes its own host tiers")):
        assert main(["demo", *argv]) == 2, argv
        assert msg in capsys.readouterr().err, argv
    assert main(["demo", "--state-slots", "overlap", "--dry", "--requests", "20",
                 "--progress-seconds", "0"]) == 0


def test_host_sweep_sized_by_memory(tmp_path):
    p = demo("--requests", "100", "--sweep-host", "64MiB,256MiB", "--json",
             "--progress-seconds", "1")  # the sweep prints a line after every replay
    assert p.returncode == 0, p.stderr[-2000:]
    out = json.loads(p.stdout)
    rows = {(r["host_mem"], r["mirror"]): r for r in out["rows"]}
    assert set(rows) == {(s << 20, m) for s in (64, 256) for m in ("full", "checkpoints")}
    lines = re.findall(r"^\[demo\] (\d+)\.00 MiB (full|checkpoints): ([\d,]+) resumable hit tokens "
                       r"\(\d+ s\)$", p.stderr, re.M)
    assert [(int(s) << 20, m, int(t.replace(",", ""))) for s, m, t in lines] == \
        [(r["host_mem"], r["mirror"], r["resumable_hit_tokens"]) for r in out["rows"]]
    for size in (64 << 20, 256 << 20):  # same host memory: checkpoints hold more pages
        full, ck = rows[(size, "full")], rows[(size, "checkpoints")]
        assert ck["host_pages"] > 5 * full["host_pages"]
    for size in (64 << 20, 256 << 20):  # and resume more of the workload
        assert rows[(size, "checkpoints")]["resumable_hit_tokens"] > \
            rows[(size, "full")]["resumable_hit_tokens"]
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        p = demo("--requests", "10", "--sweep-host", "1GiB", "--plot", str(tmp_path / "s.png"))
        assert p.returncode == 2 and "pip install 'hicache[plot]'" in p.stderr


def test_malformed_trace_is_a_usage_error_with_line_number(tmp_path, capsys):
    from hicache.cli import main

    trace = tmp_path / "trace.jsonl"
    ok = json.dumps({"timestamp": 0, "input_length": 600, "output_length": 1, "hash_ids": [1, 2]})
    trace.write_text(ok + "\n" + ok + "\n" + ok.replace("[1, 2]", '[1, "x"]') + "\n")
    assert main(["demo", "--trace", str(trace)]) == 2  # refused before any daemon starts
    err = capsys.readouterr().err
    assert f"hicache demo: error: {trace}:3: hash_ids must be a list of integers" in err


def test_device_tier_too_small_for_a_request(tmp_path, capsys):
    from hicache.cli import main

    trace = tmp_path / "big.jsonl"
    trace.write_text(json.dumps({"timestamp": 0, "input_length": 512 * 40, "output_length": 1,
                                 "hash_ids": list(range(40))}) + "\n")
    assert main(["demo", "--trace", str(trace), "--device-pages", "16"]) == 2
    assert "raise --device-pages" in capsys.readouterr().err


def test_the_checkpoints_demo_daemon_splits_its_host_tier_for_the_tree():
    """The checkpoints mirror's daemon is a real ``serve --host-split checkpoints``: given
    the worker's device rows and the fewest bytes whose split holds the tree's page and
    checkpoint rows, it holds at least those (paged: ``swa_page`` rows; ring: ``req_slot`` rows
    beyond the request slots), and no page or checkpoint row fewer than asked for."""
    from hicache.core.sizes import checkpoint_host_bytes
    from hicache.engine.client import Client
    from hicache.sim.demo import _daemon
    from hicache.sim.replay import WorkerConfig

    for swa, ck in (("paged", "swa_page"), ("ring", "req_slot")):
        cfg = WorkerConfig(preset="dsv4-tiny", swa_mode=swa, device_pages=40, host_pages=160,
                           req_slots=4, host_ckpts=5)
        d = _daemon(cfg, None)
        cmd = " ".join(d.cmd)
        assert "--host-split checkpoints" in cmd and "--pages-per-checkpoint 32" in cmd
        assert f"--host-mem {checkpoint_host_bytes(cfg.layout(), cfg.device_rows(), 160, 5, 32)}" \
            in cmd and "--force" not in cmd
        with d:
            c = Client(d.address, timeout=10.0)
            try:
                total: dict[str, int] = {}
                for x in c.stats()["metrics"]["hicache_host_rows"]:
                    sp = x["labels"]["space"]
                    total[sp] = total.get(sp, 0) + int(x["value"])
            finally:
                c.close()
        slots = 4 if ck == "req_slot" else 0
        assert total["page"] >= 160 and total[ck] - slots >= 5, (swa, total)
        # the fewest bytes: one byte less would not hold the tree's rows
        from hicache.core.sizes import checkpoint_host_rows
        nbytes = checkpoint_host_bytes(cfg.layout(), cfg.device_rows(), 160, 5, 32)
        less = checkpoint_host_rows(cfg.layout(), cfg.device_rows(), nbytes - 1, 32)
        assert less["page"] < 160 or less[ck] - slots < 5


def test_a_daemon_that_dies_mid_run_fails_the_demo(tmp_path):
    """The daemon killed while the demo replays: the tree recomputes (every byte it still
    checked is right), but the run exits 1 and says the daemon failed; it used to print
    "verified: true" and exit 0, so ``make demo`` passed with a dead daemon."""
    import signal
    import time

    import psutil

    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    err = tmp_path / "err.txt"
    with open(err, "w") as f:
        p = subprocess.Popen([sys.executable, "-m", "hicache.cli", "demo", "--device", "cpu",
                              "--progress-seconds", "0", "--requests", "200", "--json"],
                             cwd=str(ROOT), env=env, stdout=subprocess.PIPE, stderr=f,
                             text=True)
    try:
        end = time.monotonic() + 120
        while "replaying" not in err.read_text() and time.monotonic() < end:
            assert p.poll() is None, err.read_text()
            time.sleep(0.1)
        time.sleep(0.5)
        daemons = [c for c in psutil.Process(p.pid).children()
                   if "serve" in " ".join(c.cmdline())]
        assert len(daemons) == 1, daemons
        daemons[0].send_signal(signal.SIGKILL)
        out, _ = p.communicate(timeout=300)
    finally:
        if p.poll() is None:
            p.kill()
    s = json.loads(out)
    assert p.returncode == 1, err.read_text()[-2000:]
    assert s["daemon_ok"] is False and s["daemon_exit"] == -signal.SIGKILL
    assert s["host_tier_lost"] >= 1 and s["mismatched_bytes"] == 0
    assert "[demo] daemon killed by SIGKILL; its last output:" in err.read_text()
    # said when it happened too, not only in the summary (progress lines off: still said)
    assert re.search(r"\[demo\] host tier lost at request \d+ \(the daemon went away",
                     err.read_text()), err.read_text()[-2000:]


def test_a_shutdown_whose_reply_went_with_the_daemon_is_not_called_refused(capsys):
    """The daemon takes ``shutdown`` and exits; its reply, on its way, can go with the
    connection unread (a loaded CI machine: the demo then said "the daemon did not take
    shutdown" of a daemon that exited 0). The exit status decides: 0 is a shutdown taken,
    anything else is said."""
    import subprocess
    import sys

    from hicache.sim import demo

    class Daemon:  # a process that exits with ``code`` shortly after the command
        def __init__(self, code: int) -> None:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", f"import time; time.sleep(0.5); raise SystemExit({code})"])

        def alive(self) -> bool:
            return self.proc.poll() is None

        def stop(self, timeout: float = 30) -> int:
            self.proc.kill()
            return self.proc.wait()

        def output(self, n: int) -> str:
            return ""

        def close(self) -> int:
            return self.proc.wait()

    class Client:  # (``Client.shutdown``'s answer when the reply went with the daemon)
        def shutdown(self, timeout: float) -> dict:
            return {"stopping": True, "gone": "its socket refuses connections"}

    assert demo._close_daemon(Daemon(0), Client())[0] == 0
    assert "shutdown" not in capsys.readouterr().err
    assert demo._close_daemon(Daemon(3), Client())[0] == 3
    assert "went during shutdown, exit status 3" in capsys.readouterr().err
