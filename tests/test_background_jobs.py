"""The suite's background lane (``tests/background_jobs.py``): its error paths, and a lane whose
pytest died, each in a child Python (the session's own lane is module state of this process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import background_jobs as b

HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, os, signal, time
import background_jobs as b

out = {}
try:
    b.result("l3_demo")
except RuntimeError as e:
    out["no_lane"] = str(e)
b.start(["l3_ckpt_demo"])
time.sleep(0.5)
lane, folder = b._lane.pid, b._folder
os.killpg(lane, signal.SIGKILL)                      # the lane dies mid-job
r = b.result("l3_ckpt_demo", timeout=30)
out.update(steps=len(r.steps), note=r.notes[0].splitlines()[0])
b.stop()
out["first_folder"] = os.path.exists(folder)
b.start(["l3_ckpt_demo"])                            # a session interrupted mid-job
time.sleep(0.5)
group, folder = b._lane.pid, b._folder
b.stop()
out["group_left"] = b._group_left(group) != []             # no live process of its group
out["second_folder"] = os.path.exists(folder)
print(json.dumps(out))
"""


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(HERE.parent), str(HERE)] + [p for p in os.environ.get("PYTHONPATH", "")
                                          .split(os.pathsep) if p])}


def test_a_dead_lane_is_reported_and_a_stop_leaves_nothing() -> None:
    r = subprocess.run([sys.executable, "-c", _CHILD], env=_env(), capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    assert "no background lane runs job l3_demo" in out["no_lane"], out
    assert out["steps"] == 0, out
    assert out["note"].startswith("the lane exited (status -9) before job l3_ckpt_demo"), out
    assert out == {**out, "first_folder": False, "group_left": False,
                   "second_folder": False}, out


_ORPHAN = r"""
import json, os, signal, sys, time
import background_jobs as b

b.start(["l3_ckpt_demo"])
time.sleep(float(sys.argv[1]))                       # its demo's processes are running
print(json.dumps({"group": b._lane.pid, "folder": b._folder}), flush=True)
os.kill(os.getpid(), signal.SIG)                     # a pytest killed mid-session
"""



def test_a_lane_whose_pytest_died_stops_its_jobs_and_removes_its_folder() -> None:
    for sig, wait in (("SIGKILL", 3.0), ("SIGTERM", 1.0)):
        r = subprocess.run([sys.executable, "-c", _ORPHAN.replace("signal.SIG)", f"signal.{sig})"),
                            str(wait)], env=_env(), capture_output=True, text=True, timeout=60)
        assert r.returncode == -getattr(signal, sig), (sig, r.returncode, r.stderr[-3000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])
        deadline = time.monotonic() + 30
        while (b._group_left(out["group"]) or os.path.exists(out["folder"])) and \
                time.monotonic() < deadline:
            time.sleep(0.1)
        assert b._group_left(out["group"]) == [], (sig, out)  # no live process of its group
        assert not os.path.exists(out["folder"]), (sig, out)
