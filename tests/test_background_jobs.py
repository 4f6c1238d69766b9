"""The suite's background lane (``tests/background_jobs.py``): its error paths, and a lane whose
pytest died, each in a child Python (the session's own lane is module state of this process)."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from pathlib import Path


HERE = Path(__file__).resolve().parent

_CHILD = r"""
import json, os, signal, time
import background_jobs as b

out = {}
try:
    b.result("l3_demo")
except RuntimeError as e:
    out["no_lane"] = str(e)
b.start(["sleep"])
time.sleep(0.5)
lane, folder = b._lane.pid, b._folder
os.killpg(lane, signal.SIGKILL)                      # the lane dies mid-job
r = b.result("sleep", timeout=30)
out.update(steps=len(r.steps), note=r.notes[0].splitlines()[0])
b.stop()
out["first_folder"] = os.path.exists(folder)
b.start(["sleep"])                                   # a session interrupted mid-job
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
    assert out["note"].startswith("the lane exited (status -9) before job sleep"), out
    assert out == {**out, "first_folder": False, "group_left": False,
                   "second_folder": False}, out


_ORPHAN = r"""
import json, os, signal, sys, time
import background_jobs as b

b.start([sys.argv[1]])
time.sleep(float(sys.argv[2]))                       # its job runs, or has ended
print(json.dumps({"group": b._lane.pid, "folder": b._folder}), flush=True)
os.kill(os.getpid(), getattr(signal, sys.argv[3]))   # a pytest killed mid-session
"""

# the killed "pytest"'s orphans (the lane) come to this process (a subreaper), which reaps them:
# a lane reparented to this VM's PID 1 would stay a zombie
_REAPER = r"""
import ctypes, json, os, subprocess, sys, time
import background_jobs as b

ctypes.CDLL("libc.so.6").prctl(36, 1, 0, 0, 0)
r = subprocess.run([sys.executable, "-c", sys.argv[1], *sys.argv[2:]], capture_output=True,
                   text=True, timeout=60)
out = json.loads(r.stdout.strip().splitlines()[-1])
out["rc"] = r.returncode
deadline = time.monotonic() + 30
while (b._group_left(out["group"]) or os.path.exists(out["folder"])) and \
        time.monotonic() < deadline:
    b._reap_children()
    time.sleep(0.1)
b._reap_children()
out.update(left=b._group_left(out["group"]), folder_left=os.path.exists(out["folder"]))
print(json.dumps(out))
"""


def test_a_lane_whose_pytest_died_stops_its_jobs_and_removes_its_folder() -> None:
    """A pytest killed without its session's end (SIGKILL, SIGTERM) left the lane running its
    jobs, and, once they had ended, its folder under /tmp: the lane stops its group and
    removes its folder when its parent dies, during a job or after the jobs."""
    for job, wait, sig in (("sleep", 1.0, "SIGKILL"), ("quick", 1.5, "SIGTERM"),
                           ("quick", 1.5, "SIGKILL")):
        r = subprocess.run([sys.executable, "-c", _REAPER, _ORPHAN, job, str(wait), sig],
                           env=_env(), capture_output=True, text=True, timeout=120)
        assert r.returncode == 0, (job, sig, r.stderr[-3000:])
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["rc"] == -getattr(signal, sig), (job, sig, out)
        assert out["left"] == [] and not out["folder_left"], (job, sig, out)


# an xdist worker (``join``, ``announce``, ``result``), run by the controller below
_WORKER = r"""
import json, sys
import background_jobs as b

b.join(sys.argv[1])
b.announce(sys.argv[2:])
out = {}
try:
    b.result("l3_demo", timeout=30)
except RuntimeError as e:
    out["not_run"] = str(e)
r = b.result(sys.argv[2], timeout=60)
out.update(rcs=[x.rc for x in r.steps], notes=[n.splitlines()[0] for n in r.notes])
print(json.dumps(out), flush=True)
"""

# the xdist controller: the shared folder, the lane started from a worker's announcement, a
# worker reading a job that ended, then one whose lane died mid-job
_CONTROLLER = r"""
import json, os, signal, subprocess, sys, time
import background_jobs as b

out = {}
for job in ("quick", "sleep"):
    folder = b.share()
    w = subprocess.Popen([sys.executable, "-c", sys.argv[1], folder, job],
                         stdout=subprocess.PIPE, text=True)
    deadline = time.monotonic() + 30
    while not os.path.exists(os.path.join(folder, b.ANNOUNCED)) and time.monotonic() < deadline:
        time.sleep(0.05)
    b.start_announced()
    b.start_announced()                                  # (once: a second worker's)
    if job == "sleep":
        time.sleep(0.5)
        os.killpg(b._lane.pid, signal.SIGKILL)           # the lane dies mid-job
    out[job] = json.loads(w.communicate(timeout=90)[0].strip().splitlines()[-1])
    b.stop()
    out[job]["folder_left"] = os.path.exists(folder)
print(json.dumps(out))
"""


def test_xdist_workers_share_the_controllers_one_lane() -> None:
    """Under pytest-xdist the controller starts the one lane from the jobs a worker announced;
    a worker reads its job's result from the controller's folder, is told of a lane that died
    first, and of a job no lane runs."""
    r = subprocess.run([sys.executable, "-c", _CONTROLLER, _WORKER], env=_env(),
                       capture_output=True, text=True, timeout=180)
    assert r.returncode == 0, r.stderr[-3000:]
    out = json.loads(r.stdout.strip().splitlines()[-1])
    quick, sleep = out["quick"], out["sleep"]
    assert quick["rcs"] == [0] and quick["notes"] == [], out
    assert sleep["rcs"] == [] and sleep["notes"] == [
        "the lane exited (gone) before job sleep ended; its output:"], out
    for o in (quick, sleep):
        assert "no background lane runs job l3_demo" in o["not_run"] and not o["folder_left"], out
