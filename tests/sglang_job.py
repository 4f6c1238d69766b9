"""The SGLang adapter's inner suite, run beside the main suite.

The inner suite (``tests/sglang/check_dsv4_l2.py``, ``tests/sglang/check_dynamic_backend.py``)
runs in SGLang's own environment, ``.venv-sglang``, as a pytest subprocess: about 80 s on a
2-core machine, most of it daemon starts that use one core while the main suite's process
waits on its own. ``start()`` (called by ``conftest`` once collection selected
``test_sglang_adapter_against_sglang_classes``) runs it on a thread from the session's
start, so the two overlap; ``result()`` (the test) waits for it, starting it first if nothing
did (a run of that test alone), so the test checks the same run either way.

What the job does, in order: ``scripts/setup_sglang.sh`` (builds the environment when missing,
else returns at once); when this environment has the Mooncake wheel, a ``mooncake_master``
(``LocalStore``) whose addresses and this Python (which runs the L3 daemon) go to the inner
run in ``HICACHE_TEST_L3``, else the L3 test is deselected; the inner pytest, in its own
process group. ``stop()`` (the session's end) kills a run still going (an interrupted
session) and closes the store. Nothing here decides a pass: ``Result`` holds what ran.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
from dataclasses import dataclass, field
from pathlib import Path

from hicache.engine import l3_master

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
INNER = ["tests/sglang/check_dsv4_l2.py", "tests/sglang/check_dynamic_backend.py"]
INNER_TESTS = 22  # (the engine-restart test runs once per attach way); +1 with Mooncake
SETUP_TIMEOUT_S = 1800.0
RUN_TIMEOUT_S = 900.0


@dataclass
class Result:
    """What the job ran: the set-up's exit status and output, then (when it passed) the inner
    run's exit status (None: killed at its timeout or by ``stop``), output and how many tests
    it must pass."""

    setup_rc: int | None = None
    setup_out: str = ""
    rc: int | None = None
    out: str = ""
    want: int = 0
    notes: list[str] = field(default_factory=list)


_lock = threading.Lock()
_thread: threading.Thread | None = None
_result = Result()
_proc: subprocess.Popen[str] | None = None
_stopping = threading.Event()


def start() -> None:
    """Start the job on a thread (once per session)."""
    global _thread
    with _lock:
        if _thread is None:
            _thread = threading.Thread(target=_run, name="sglang-inner-suite", daemon=True)
            _thread.start()


def result(timeout: float = SETUP_TIMEOUT_S + RUN_TIMEOUT_S + 60) -> Result:
    """The job's ``Result``, once it ended (started now if it was not)."""
    start()
    assert _thread is not None
    _thread.join(timeout)
    if _thread.is_alive():
        raise TimeoutError(f"the SGLang inner suite still runs after {timeout:g} s")
    return _result


def stop() -> None:
    """Kill an inner run still going (its whole process group) and let the job end."""
    _stopping.set()
    p = _proc
    if p is not None and p.poll() is None:
        try:
            os.killpg(p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
    if _thread is not None:
        _thread.join(30)


def _run() -> None:
    global _proc
    r = _result
    setup = subprocess.run(["bash", "scripts/setup_sglang.sh"], cwd=ROOT, capture_output=True,
                           text=True, timeout=SETUP_TIMEOUT_S,
                           env={**os.environ, "SGLANG_VENV": str(VENV)})
    r.setup_rc, r.setup_out = setup.returncode, setup.stdout + setup.stderr
    if setup.returncode != 0 or _stopping.is_set():
        return
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "sglang")])}
    store, args, r.want = None, [], INNER_TESTS
    if l3_master.mooncake_dir() is not None:
        store = l3_master.LocalStore(segment="256MB").start()
        env["HICACHE_TEST_L3"] = json.dumps({"master": store.master_addr,
                                             "metadata": store.metadata_url,
                                             "python": sys.executable})
        r.want += 1
    else:
        args = ["-k", "not through_l3"]
        r.notes.append("no Mooncake wheel here: the L3 test deselected")
    try:
        _proc = subprocess.Popen([str(VENV / "bin" / "python"), "-m", "pytest", "-q", "-p",
                                  "no:cacheprovider", "-W", "ignore::UserWarning", *INNER,
                                  *args], cwd=ROOT, stdout=subprocess.PIPE,
                                 stderr=subprocess.STDOUT, text=True, env=env,
                                 start_new_session=True)
        try:
            r.out, _ = _proc.communicate(timeout=RUN_TIMEOUT_S)
            r.rc = _proc.returncode if not _stopping.is_set() else None
        except subprocess.TimeoutExpired:
            os.killpg(_proc.pid, signal.SIGKILL)
            r.out = _proc.communicate()[0]
            r.notes.append(f"killed at its {RUN_TIMEOUT_S:g} s timeout")
    finally:
        if store is not None:
            store.close()
