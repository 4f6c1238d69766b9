"""Long subprocess runs of the suite, run by one process beside the main suite.

Three tests each check one long run of other processes that uses about one core while the main
suite's process mostly waits on its own daemons (2-core CI machine): the SGLang adapter's
inner suite (~80 s), the two-instance L3 demo with ``bench l3`` (~25 s) and the trace's L3
checkpoints demo (~20 s). ``start(names)`` (``conftest``, once collection selected their
tests and none is skipped) starts the lane: this file run as a process of its own, at the
lowest CPU priority (``nice 19``: the main suite's processes, whose tests time things, come
first when both want a core), in a process group of its own, which runs those jobs one after
another and writes each job's ``Run`` as JSON into a private folder. A process, not a thread
of pytest's: tests that count or reuse their own process's descriptors see none of the lane's.
``result(name)`` (the test) waits for its job's file; a lane that died first is a ``Run``
whose notes say so, with the lane's output. ``stop()`` (the session's end) stops a lane still
running (SIGTERM to its group, SIGKILL to what is left 10 s later), reaps it and removes its
folder. A lane whose pytest died without its session's end (SIGKILL, SIGTERM) stops its group
the same way and removes its folder itself (``_main``).

A job's ``Run`` holds what ran (exit status, output, notes); nothing here decides a pass.

* ``sglang``: ``scripts/setup_sglang.sh`` (builds ``.venv-sglang`` when missing, else returns
  at once); when this environment has the Mooncake wheel, a ``mooncake_master``
  (``LocalStore``) whose addresses and this Python (which runs the L3 daemon) go to the inner
  run in ``HICACHE_TEST_L3``, else the L3 test is deselected (``want`` one less); then the
  inner pytest in that environment.
* ``l3_demo``: ``hicache demo --l3 mooncake`` (small, full mirror), then ``hicache bench l3``,
  then the same demo with 60 requests and its defaults (checkpoints mirror).
* ``l3_ckpt_demo``: ``hicache demo --l3 mooncake`` on the shared trace's first two
  conversations, checkpoints mirror.
* ``bench_control``, ``bench_e2e_cpu``, ``demo_small``: one ``hicache`` command each (a short
  ``bench control``, a CPU ``bench e2e``, a small demo), whose tests read it through
  ``completed(name)`` (their checks are of what the command printed, none of its timing).
* ``sleep``, ``quick``: the lane's own test's jobs.

Under pytest-xdist (``make test`` runs two workers) there is still one lane, the controller's:
``share()`` (the controller, at configure) makes its folder, which each worker gets
(``join(folder)``); a worker's collection writes the selected jobs into it (``announce``), and
the controller starts the lane from that once a worker has collected (``start_announced``),
so the lane's parent, which it watches, is the process whose session's end stops it. A worker's
``result(name)`` reads the folder: it waits for the lane's record (``lane.json``: its pid and
jobs), then for its job's file; a lane process gone (or a zombie) first is the same dead-lane
``Run``.
"""
from __future__ import annotations

import dataclasses
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from hicache.engine import l3_master

ROOT = Path(__file__).resolve().parents[1]
TRACE = ROOT.parent / "shared" / "data" / "synthetic_trace.jsonl"
SGLANG_VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
SGLANG_INNER = ["tests/sglang/check_dsv4_l2.py", "tests/sglang/check_dynamic_backend.py"]
SGLANG_INNER_TESTS = 28  # (the engine-restart test runs once per attach way); +1 with Mooncake
NICE = 19  # the jobs take the cores the main suite leaves idle, not its timing tests' share
SETUP_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 900.0
PR_SET_CHILD_SUBREAPER = 36


@dataclass
class Step:
    """One command of a job: its exit status (None: killed at its timeout) and its stdout and
    stderr."""

    rc: int | None
    out: str
    err: str


@dataclass
class Run:
    """A job's steps in order, its notes, and (``sglang``) how many inner tests must pass."""

    steps: list[Step] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)
    want: int = 0


_lane: subprocess.Popen[bytes] | None = None
_names: list[str] = []
_folder: str | None = None  # the lane's folder (in the lane too: its jobs' scratch goes there)
_joined: str | None = None  # an xdist worker: the controller's lane folder
LANE_RECORD = "lane.json"  # in the folder: the lane's pid and jobs, once started
ANNOUNCED = "announced.json"  # in a shared folder: the jobs a worker's collection selected
ANNOUNCE_WAIT_S = 120.0  # how long a worker's result() waits for the controller's lane record


def _step(cmd: list[str], timeout: float, **kw: object) -> Step:
    """Run ``cmd`` (in the lane's process group); its ``Step``."""
    p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                         **kw)  # type: ignore[call-overload]
    try:
        out, err = p.communicate(timeout=timeout)
        return Step(p.returncode, out, err)
    except subprocess.TimeoutExpired:
        p.kill()  # (its daemons exit with their parent)
        out, err = p.communicate()
        return Step(None, out, err + f"\n(killed at its {timeout:g} s timeout)")


def _env(*first: Path) -> dict[str, str]:
    """This environment with this checkout, then ``first``, first on ``PYTHONPATH``."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), *map(str, first)] +
        [p for p in os.environ.get("PYTHONPATH", "").split(os.pathsep) if p])}


def _sglang(run: Run) -> None:
    setup = _step(["bash", "scripts/setup_sglang.sh"], SETUP_TIMEOUT_S, cwd=ROOT,
                  env={**os.environ, "SGLANG_VENV": str(SGLANG_VENV)})
    run.steps.append(setup)
    if setup.rc != 0:
        return
    env = _env(ROOT / "tests", ROOT / "tests" / "sglang")
    store, args, run.want = None, [], SGLANG_INNER_TESTS
    if l3_master.mooncake_dir() is not None:
        store = l3_master.LocalStore(segment="256MB",
                                     log_dir=tempfile.mkdtemp(prefix="hc-l3-", dir=_folder))
        store.start()
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
    with tempfile.TemporaryDirectory(prefix="hc-job-", dir=_folder,
                                     ignore_cleanup_errors=True) as cwd:
        run.steps.append(_step(_demo(["--requests", "24", "--device-pages", "48",
                                      "--host-pages", "96", "--mirror", "full",
                                      "--l3-routing", "alternate"]),
                               400, env=_env(), cwd=cwd))
        run.steps.append(_step([sys.executable, "-m", "hicache.cli", "bench", "l3",
                                "--preset", "dsv4-tiny", "--pages", "8", "--trials", "1",
                                "--json"], 300, env=_env(), cwd=cwd))
        # the default checkpoints mirror, routed by conversation: A's drain before its
        # restart puts pages into L3 that later requests hit
        run.steps.append(_step(_demo(["--requests", "60"]), 400, env=_env(), cwd=cwd))


def _l3_ckpt_demo(run: Run) -> None:
    with tempfile.TemporaryDirectory(prefix="hc-job-", dir=_folder,
                                     ignore_cleanup_errors=True) as cwd:
        run.steps.append(_step(_demo(["--trace", str(TRACE), "--l3-conversations", "2",
                                      "--swa-mode", "paged", "--checkpoint-every", "8",
                                      "--pages-per-checkpoint", "8", "--device-pages", "768",
                                      "--host-pages", "96"]), 400, env=_env(), cwd=cwd))


def _cli(*args: str, timeout: float = 300) -> Callable[[Run], None]:
    """A job of one ``hicache`` command (this checkout's, run from it)."""
    def job(run: Run) -> None:
        run.steps.append(_step([sys.executable, "-m", "hicache.cli", *args], timeout, env=_env(),
                               cwd=ROOT))
    return job


def _sleep(run: Run) -> None:  # (the lane's own test: a job that runs a while)
    run.steps.append(_step(["sleep", "60"], 70))


def _quick(run: Run) -> None:  # (the lane's own test: a job that ends at once)
    run.steps.append(_step(["true"], 10))


JOBS: dict[str, Callable[[Run], None]] = {
    "sglang": _sglang, "l3_demo": _l3_demo, "l3_ckpt_demo": _l3_ckpt_demo,
    "bench_control": _cli("bench", "control", "--clients", "1,2", "--ops", "60", "--warmup", "5",
                          "--rounds", "1", "--json", timeout=240),
    "bench_e2e_cpu": _cli("bench", "e2e", "--device", "cpu", "--preset", "dsv4-tiny", "--sizes",
                          "2k", "--runs", "2", "--churn", "60", "--json"),
    "demo_small": _cli("demo", "--device", "cpu", "--progress-seconds", "0", "--requests", "40",
                       "--device-pages", "40", "--host-pages", "160", "--json", timeout=120),
    "sleep": _sleep, "quick": _quick}


def _do(name: str) -> Run:
    run = Run()
    try:
        JOBS[name](run)
    except Exception as e:  # noqa: BLE001 - the test reports it
        run.notes.append(f"the job raised {type(e).__name__}: {e}")
    return run


def _from_json(d: dict[str, Any]) -> Run:
    return Run([Step(**x) for x in d["steps"]], d["notes"], d["want"])


def _write(path: str, value: Any) -> None:
    """``value`` as JSON at ``path``, whole or not at all (a reader never sees half of it)."""
    tmp = os.path.join(os.path.dirname(path), f".{os.path.basename(path)}.{os.getpid()}")
    with open(tmp, "w") as f:
        json.dump(value, f)
    os.replace(tmp, path)


def start(names: list[str]) -> None:
    """Start the lane for ``names`` (jobs of ``JOBS``), once per session, in the shared folder
    when ``share()`` made one."""
    global _lane, _folder
    if _lane is not None or not names:
        return
    if _folder is None:
        _folder = tempfile.mkdtemp(prefix="hc-jobs-")
    env = _env(ROOT / "tests")
    with open(os.path.join(_folder, "lane.log"), "wb") as log:
        _lane = subprocess.Popen(["nice", "-n", str(NICE), sys.executable, __file__, _folder,
                                  str(os.getpid()), *names], stdout=log,
                                 stderr=subprocess.STDOUT,
                                 stdin=subprocess.DEVNULL, env=env, cwd=ROOT,
                                 start_new_session=True)
    _names[:] = names
    _write(os.path.join(_folder, LANE_RECORD), {"pid": _lane.pid, "names": names})


def share() -> str:
    """The xdist controller: make the lane's folder now (its workers ``join`` it); the lane
    starts once a worker announced the selected jobs (``start_announced``)."""
    global _folder
    if _folder is None:
        _folder = tempfile.mkdtemp(prefix="hc-jobs-")
    return _folder


def join(folder: str) -> None:
    """An xdist worker: results come from the controller's lane in ``folder``."""
    global _joined
    _joined = folder


def announce(names: list[str]) -> None:
    """An xdist worker's collection: the selected jobs, for the controller to start (every
    worker collects the same tests; the first file written stays)."""
    if _joined is not None and names and \
            not os.path.exists(os.path.join(_joined, ANNOUNCED)):
        _write(os.path.join(_joined, ANNOUNCED), names)


def start_announced() -> None:
    """The xdist controller, once a worker has collected: start the lane for the jobs it
    announced (none announced: no selected test needs the lane)."""
    if _folder is None or _lane is not None:
        return
    try:
        with open(os.path.join(_folder, ANNOUNCED)) as f:
            names = json.load(f)
    except FileNotFoundError:
        return
    start(names)


def _lane_exit() -> str | None:
    """None while the lane runs; else how it ended: ``status N`` when this process started it,
    ``gone`` for the controller's lane that no longer runs (or is a zombie)."""
    if _lane is not None:
        return None if _lane.poll() is None else f"status {_lane.returncode}"
    import psutil

    assert _joined is not None
    with open(os.path.join(_joined, LANE_RECORD)) as f:
        pid = json.load(f)["pid"]
    try:
        return "gone" if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE else None
    except psutil.NoSuchProcess:
        return "gone"


def _joined_names(name: str, deadline: float) -> list[str]:
    """A worker: the jobs of the controller's lane, once it has recorded them (wait until
    ``deadline``)."""
    assert _joined is not None
    record = os.path.join(_joined, LANE_RECORD)
    while not os.path.exists(record):
        if time.monotonic() > deadline:
            raise RuntimeError(f"no background lane runs job {name}: the controller started none "
                               f"in {_joined} within {ANNOUNCE_WAIT_S:g} s")
        time.sleep(0.2)
    with open(record) as f:
        return json.load(f)["names"]


def result(name: str, timeout: float = SETUP_TIMEOUT_S + 3 * RUN_TIMEOUT_S) -> Run:
    """Job ``name``'s ``Run`` once the lane ended it."""
    folder = _folder if _lane is not None else _joined
    names = _names if _lane is not None else [] if _joined is None else \
        _joined_names(name, time.monotonic() + ANNOUNCE_WAIT_S)
    if folder is None or name not in names:
        raise RuntimeError(f"no background lane runs job {name} (conftest starts one at "
                           f"collection for the selected tests that no skipif skips)")
    path = os.path.join(folder, f"{name}.json")
    deadline = time.monotonic() + timeout
    while not os.path.exists(path):
        ended = _lane_exit()
        if ended is not None and not os.path.exists(path):
            with open(os.path.join(folder, "lane.log"), "rb") as f:
                tail = f.read().decode(errors="replace")[-4000:]
            return Run(notes=[f"the lane exited ({ended}) before job {name} "
                              f"ended; its output:\n{tail}"])
        if time.monotonic() > deadline:
            raise TimeoutError(f"background job {name} still runs after {timeout:g} s")
        time.sleep(0.2)
    with open(path) as f:
        return _from_json(json.load(f))


def completed(name: str) -> subprocess.CompletedProcess[str]:
    """Job ``name``'s one command (a ``_cli`` job) as ``subprocess.run`` returns it; an
    ``AssertionError`` with the job's notes when it did not run to an exit status."""
    run = result(name)
    if len(run.steps) != 1 or run.steps[0].rc is None:
        raise AssertionError(f"background job {name}: {run.notes} "
                             f"{[x.err[-1500:] for x in run.steps]}")
    x = run.steps[0]
    return subprocess.CompletedProcess(name, x.rc, x.out, x.err)


def _group_left(group: int) -> list[int]:
    """The live (not zombie) processes of process group ``group``."""
    import psutil

    left = []
    for p in psutil.process_iter():
        try:
            if os.getpgid(p.pid) == group and p.status() != psutil.STATUS_ZOMBIE:
                left.append(p.pid)
        except (OSError, psutil.Error):
            pass
    return left


def stop() -> None:
    """Stop a lane still running: its process group (the jobs' processes too) gets SIGTERM,
    and SIGKILL what is left 10 s later; the lane is reaped and its folder removed."""
    global _lane, _folder
    if _lane is not None:
        group = _lane.pid
        if _group_left(group):
            for sig in (signal.SIGTERM, signal.SIGKILL):
                try:
                    os.killpg(group, sig)
                except ProcessLookupError:
                    break
                deadline = time.monotonic() + 10.0
                while _group_left(group) and time.monotonic() < deadline:
                    _lane.poll()  # (reaps the lane once it exits)
                    time.sleep(0.05)
                if not _group_left(group):
                    break
        _lane.wait()
        _lane = None
    if _folder is not None:
        shutil.rmtree(_folder, ignore_errors=True)
        _folder = None


def _reap_children() -> None:
    """Reap every child of this process that has exited (no wait)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def _end_group() -> None:
    """Stop the rest of the lane's process group (its jobs' processes): SIGTERM, then SIGKILL
    to each one left 10 s later (never the lane itself), every exited child reaped."""
    me, group = os.getpid(), os.getpgrp()
    try:
        os.killpg(group, signal.SIGTERM)  # (the lane ignores it by now)
    except ProcessLookupError:
        return
    for sig, wait in ((signal.SIGKILL, 10.0), (None, 5.0)):
        deadline = time.monotonic() + wait
        while True:
            _reap_children()
            left = [p for p in _group_left(group) if p != me]
            if not left or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        if not left or sig is None:
            return
        for p in left:
            try:
                os.kill(p, sig)
            except ProcessLookupError:
                pass


def _on_term(signum: int, frame: Any) -> None:
    """SIGTERM (``stop()``, or the parent's death: its death signal and the watchdog may both
    send one): the jobs' processes are stopped first, so the clean-up that unwinds after
    (their folders, a Mooncake master's close) never runs under live processes."""
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    _end_group()
    raise SystemExit(128 + signum)


def _main(folder: str, parent: int, names: list[str]) -> None:
    """The lane: each job in turn, its ``Run`` written to ``folder/<name>.json`` (atomically),
    then it waits for the session's end. It stops with its parent (the pytest process, whose
    pid it is given): a pytest that dies without its session's end (SIGKILL, SIGTERM), while
    a job runs or after, leaves no job running and no folder. On SIGTERM (``stop()``, or the
    parent's death: the kernel's parent-death signal and a watchdog send it) it ends the rest
    of its group (``_end_group``), then, when its parent is gone, removes its folder. It is
    its descendants' reaper (``PR_SET_CHILD_SUBREAPER``): a job's process orphaned by its
    parent is reparented to the lane, which reaps it, not to a PID 1 that may not."""
    global _folder
    _folder = folder
    _subreaper()
    signal.signal(signal.SIGTERM, _on_term)
    from hicache.cli.lifecycle import exit_with_parent, signal_self

    exit_with_parent(parent, signal_self(signal.SIGTERM))  # (a parent gone already: at once)
    try:
        for name in names:
            _write(os.path.join(folder, f"{name}.json"), dataclasses.asdict(_do(name)))
        while True:  # until ``stop()`` or the parent's death
            signal.pause()
    finally:
        _reap_children()
        if os.getppid() != parent:  # orphaned: nobody else removes the folder
            shutil.rmtree(folder, ignore_errors=True)


def _subreaper() -> None:
    """Make this process the reaper of its orphaned descendants (Linux; elsewhere a no-op,
    as orphans there go to an init that reaps)."""
    if not sys.platform.startswith("linux"):
        return
    import ctypes

    libc = ctypes.CDLL("libc.so.6", use_errno=True)
    libc.prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)


if __name__ == "__main__":
    _main(sys.argv[1], int(sys.argv[2]), sys.argv[3:])
