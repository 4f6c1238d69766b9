"""Run a test module's kernel cases in a child process under ``TRITON_INTERPRET=1``.

The interpreter must be switched on before Triton is imported, so the cases run in a child:
``child(cases, run_case)`` (the module's ``--child`` entry) runs every case and prints one JSON
verdict per line, going on after a failure; ``verdicts(path)`` starts that child for the module
at ``path`` and returns ``{case: verdict}``, failing the test when the child produced none.
"""
from __future__ import annotations

import json
import os
import subprocess
import sys
from typing import Callable, Sequence

import pytest


def child(cases: Sequence[str], run_case: Callable[[str], None]) -> int:
    assert os.environ.get("TRITON_INTERPRET") == "1"
    for name in cases:
        try:
            run_case(name)
            print(json.dumps({"case": name, "ok": True}), flush=True)
        except Exception as e:  # report every case, keep going
            print(json.dumps({"case": name, "ok": False, "err": f"{type(e).__name__}: {e}"}),
                  flush=True)
    return 0


def verdicts(path: str, timeout: float = 300) -> dict:
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONUNBUFFERED="1")
    p = subprocess.run([sys.executable, os.path.abspath(path), "--child"], env=env,
                       capture_output=True, text=True, timeout=timeout)
    out = {}
    for line in p.stdout.splitlines():
        if line.startswith("{"):
            d = json.loads(line)
            out[d["case"]] = d
    if not out:
        pytest.fail(f"interpreter child produced no verdicts (rc {p.returncode}):\n"
                    f"{p.stderr[-3000:]}")
    return out
