"""Long subprocess runs of the suite, run on one thread beside the main suite.

Three tests each check one long run of other processes that uses about one core while the main
suite's process mostly waits on its own daemons (2-core CI machine): the SGLang adapter's
inner suite (~80 s), the two-instance L3 demo with ``bench l3`` (~25 s) and the trace's L3
checkpoints demo (~20 s). ``start(names)`` (``conftest``, once collection selected their
tests and none is skipped) runs those jobs one after another on a thread from the session's
start, at the lowest CPU priority (``nice 19``: the main suite's processes, whose tests time
things, come first when both want a core); ``result(name)`` (the test) waits for its job, or
runs it now if no lane was to: the test checks the same run either way. ``stop()`` (the
session's end) kills a job still running (its whole process group) and ends the lane.

A job's ``Run`` holds what ran (exit status, output, notes); nothing here decides a pass.

* ``sglang``: ``scripts/setup_sglang.sh`` (builds ``.venv-sglang`` when missing, else returns
  at once); when this environment has the Mooncake wheel, a ``mooncake_master``
  (``LocalStore``) whose addresses and this Python (which runs the L3 daemon) go to the inner
  run in ``HICACHE_TEST_L3``, else the L3 test is deselected (``want`` one less); then the
  inner pytest in that environment.
* ``l3_demo``: ``hicache demo --l3 mooncake`` (small, full mirror), then ``hicache bench l3``.
* ``l3_ckpt_demo``: ``hicache demo --l3 mooncake`` on the shared trace's first two
  conversations, checkpoints mirror.
"""
from __future__ import annotations

import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable

from hicache.engine import l3_master

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "synthetic_trace.jsonl"
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_INNER = ["tests/sglang/check_dsv4_l2.py", "tests/sglang/check_dynamic_backend.py"]
SGLANG_INNER_TESTS = 22  # (the engine-restart test runs once per attach way); +1 with Mooncake
NICE = 19  # the jobs take the cores the main suite leaves idle, not its timing tests' share
SETUP_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 900.0


@dataclass
class Step:
    """One command of a job: its exit status (None: killed at its timeout or by ``stop``)
    and its stdout and stderr."""

    rc: int | None
    out: str
    err: str


@dataclass
class Run:
    """A job's steps in order, its notes, and (``sglang``) how many inner tests must pass."""

    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    want: int = 0


_lock = threading.Lock()
_queue: "queue.Queue[str | None]" = queue.Queue()
_queued: dict[str, threading.Event] = {}
_runs: dict[str, Run] = {}
_lane: threading.Thread | None = None
_proc: subprocess.Popen[str] | None = None
_stopping = threading.Event()


def _step(cmd: list[str], timeout: float, **kw: object) -> Step:
    """Run ``cmd`` at ``NICE`` in its own process group (``stop`` kills it there); its
    ``Step``."""
    global _proc
    if _stopping.is_set():
        return Step(None, "", "the session ended before this ran")
    p = subprocess.Popen(["nice", "-n", str(NICE), *cmd], stdout=subprocess.PIPE,
                         stderr=subprocess.PIPE, text=True, start_new_session=True,
                         **kw)  # type: ignore[call-overload]
    _proc = p
    try:
        out, err = p.communicate(timeout=timeout)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, err = p.communicate()
        rc, err = None, err + f"\n(killed at its {timeout:g} s timeout)"
    finally:
        _proc = None
    return Step(rc if not _stopping.is_set() else None, out, err)


def _env() -> dict[str, str]:
    """This environment with this checkout first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT)] + [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def _sglang(run: Run) -> None:
    setup = _step(["bash", "scripts/setup_sglang.sh"], SETUP_TIMEOUT_S, cwd=ROOT,
                  env={**os.environ, "SGLANG_VENV": str(SGLANG_VENV)})
    run.steps.append(setup)
    if setup.rc != 0:
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "sglang")])}
    store, args, run.want = None, [], SGLANG_INNER_TESTS
    if l3_master.mooncake_dir() is not None:
        store = l3_master.LocalStore(segment="256MB").start()
        env["HICACHE_TEST_L3"] = json.dumps({"master": store.master_addr,
                                             "metadata": store.metadata_url,
                                             "python": sys.executable})
        run.want += 1
    else:
        args = ["-k", "not through_l3"]
        run.notes.append("no Mooncake wheel here: the L3 test deselected")
    try:
        run.steps.append(_step([str(SGLANG_VENV / "bin" / "python"), "-m", "pytest", "-q",
                                "-p", "no:cacheprovider", "-W", "ignore::UserWarning",
                                *SGLANG_INNER, *args], RUN_TIMEOUT_S, cwd=ROOT, env=env))
    finally:
        if store is not None:
            store.close()


def _demo(args: list[str]) -> list[str]:
    return [sys.executable, "-m", "hicache.cli", "demo", "--l3", "mooncake", "--device", "cpu",
            "--preempt-every", "0", "--progress-seconds", "0", "--json", *args]


def _l3_demo(run: Run) -> None:
    with tempfile.TemporaryDirectory(prefix="hc-job-") as cwd:
        run.steps.append(_step(_demo(["--requests", "24", "--device-pages", "48",
                                      "--host-pages", "96", "--mirror", "full",
                                      "--l3-routing", "alternate"]),
                               400, env=_env(), cwd=cwd))
        run.steps.append(_step([sys.executable, "-m", "hicache.cli", "bench", "l3",
                                "--preset", "dsv4-tiny", "--pages", "8", "--trials", "1",
                                "--json"], 300, env=_env(), cwd=cwd))


def _l3_ckpt_demo(run: Run) -> None:
    with tempfile.TemporaryDirectory(prefix="hc-job-") as cwd:
        run.steps.append(_step(_demo(["--trace", str(TRACE), "--l3-conversations", "2",
                                      "--swa-mode", "paged", "--checkpoint-every", "8",
                                      "--pages-per-checkpoint", "8", "--device-pages", "768",
                                      "--host-pages", "96"]), 400, env=_env(), cwd=cwd))


JOBS: dict[str, Callable[[Run], None]] = {"sglang": _sglang, "l3_demo": _l3_demo,
                                          "l3_ckpt_demo": _l3_ckpt_demo}


def _do(name: str) -> None:
    run = _runs.setdefault(name, Run())
    try:
        JOBS[name](run)
    except Exception as e:  # noqa: BLE001 - the test reports it
        run.notes.append(f"the job raised {type(e).__name__}: {e}")


def _serve() -> None:
    while True:
        name = _queue.get()
        if name is None:
            return
        try:
            _do(name)
        finally:
            _queued[name].set()


def start(names: list[str]) -> None:
    """Queue ``names`` (jobs of ``JOBS``) on the lane, starting it if needed."""
    global _lane
    with _lock:
        for n in names:
            if n not in _queued:
                _queued[n] = threading.Event()
                _queue.put(n)
        if _lane is None and _queued:
            _lane = threading.Thread(target=_serve, name="background-jobs", daemon=True)
            _lane.start()


def result(name: str, timeout: float = SETUP_TIMEOUT_S + 3 * RUN_TIMEOUT_S) -> Run:
    """Job ``name``'s ``Run`` once it ended: waited for when the lane has it, else run now."""
    with _lock:
        done = _queued.get(name)
    if done is None:
        _do(name)
    elif not done.wait(timeout):
        raise TimeoutError(f"background job {name} still runs after {timeout:g} s")
    return _runs[name]


def stop() -> None:
    """Kill a job still running (its process group) and end the lane."""
    _stopping.set()
    p = _proc
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    _queue.put(None)
    if _lane is not None:
        _lane.join(30)
