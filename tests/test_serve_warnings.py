"""``hicache serve`` prints the planner's warnings for the stage it serves (``hicache plan``'s
lines, from ``StagePlan.warnings``), one ``hicache serve: warning: ...`` line each on stderr, and
still starts: a daemon sized by a plan that warns mirrors the engine's rows all the same."""
from __future__ import annotations

import os
import subprocess
import sys

from hicache.core.layout import preset
from hicache.core.planner import PlanInputs, plan
from hicache.core.sizes import parse_bytes

from conftest import ROOT
from test_serve_cli import run_until_ready

TINY_256 = ["--preset", "dsv4-tiny", "--kv-mem", "256MiB", "--host-mem", "512MiB"]


def _plan_warnings(*args: str) -> list[str]:
    p = subprocess.run([sys.executable, "-m", "hicache.cli", "plan", *args], cwd=str(ROOT),
                       env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                       text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    return [x for x in p.stdout.splitlines() if x.startswith("warning: ")]


def _serve_until_ready(tmp_path, *args: str) -> tuple[str, str]:
    """Start ``hicache serve --device cpu ARGS``, wait for ``ready``, SIGTERM it; returns its
    stdout and stderr."""
    err_path = tmp_path / "stderr"
    with open(err_path, "w") as err:
        out = run_until_ready([sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu",
                               *args], {"XDG_RUNTIME_DIR": str(tmp_path)}, stderr=err)
    return out, err_path.read_text()


def test_stage_warnings_are_the_plans_own():
    """Each stage carries its own lines; the plan's list is theirs, then the other mode's."""
    pl = plan(PlanInputs(model=preset("dsv4-tiny"), kv_mem=parse_bytes("256MiB"), pp=2))
    per_stage = [list(s.warnings) for s in pl.stages]
    assert [len(w) for w in per_stage] == [1, 1], per_stage
    assert per_stage[0][0].startswith("stage 0: ") and per_stage[1][0].startswith("stage 1: ")
    assert pl.warnings[:2] == per_stage[0] + per_stage[1]
    ok = plan(PlanInputs(model=preset("dsv4-tiny"), kv_mem=parse_bytes("256MiB"),
                         max_running=32))
    assert all(not s.warnings for s in ok.stages)


def test_serve_prints_the_warnings_plan_gives_for_its_stage(tmp_path):
    args = [*TINY_256, "--pp-size", "2", "--pp-rank", "1"]
    planned = _plan_warnings(*args[:-2])  # plan prints every stage's; serve its own
    mine = [w for w in planned if w.startswith("warning: stage 1: ")]
    assert len(mine) == 1 and any(w.startswith("warning: stage 0: ") for w in planned), planned
    out, err = _serve_until_ready(tmp_path, *args)
    said = [x[len("hicache serve: "):] for x in err.splitlines()
            if x.startswith("hicache serve: warning: ")]
    assert said == mine, (said, planned, err)
    assert "warning: " not in out, out  # on stderr only, once


def test_serve_prints_the_default_shapes_warning_and_none_when_the_plan_has_none(tmp_path):
    planned = _plan_warnings(*TINY_256)
    _, err = _serve_until_ready(tmp_path, *TINY_256)
    said = [x[len("hicache serve: "):] for x in err.splitlines() if "warning: " in x]
    assert said == [w for w in planned if w.startswith("warning: stage 0: ")], (said, err)
    assert "fewer than the 512 that 256 request slots need" in said[0]
    _, err = _serve_until_ready(tmp_path, *TINY_256, "--max-running", "32")
    assert "warning" not in err.lower().replace(str(tmp_path).lower(), ""), err
