"""The HiSparse swap-in kernel on CPU under the Triton interpreter: every scenario of
``hisparse_cases`` with all its byte checks, and random runs in lockstep with the torch
reference (identical locations, tables, statistics and device bytes after every swap-in).

``TRITON_INTERPRET=1`` must be set before triton is imported, so the cases run in one child
process (this file run as a script) and the parent collects per-case verdicts.
"""
from __future__ import annotations

import os
import sys

import pytest

import interp_harness

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, HERE)

from hisparse_cases import CASES as SCENARIOS  # noqa: E402

LOCKSTEP = [f"lockstep_{s}" for s in range(3)]
CASES = [f"scenario_{c}" for c in SCENARIOS] + LOCKSTEP


def _run_case(name: str) -> None:
    from hisparse_cases import lockstep_case, run_case

    if name.startswith("scenario_"):
        run_case(name[len("scenario_"):], "triton")
    elif name.startswith("lockstep_"):
        lockstep_case(int(name.split("_")[1]), "triton")
    else:
        raise KeyError(name)


@pytest.fixture(scope="module")
def verdicts() -> dict:
    return interp_harness.verdicts(__file__)


@pytest.mark.parametrize("case", CASES)
def test_interpreter_swap_in(verdicts, case):
    d = verdicts.get(case)
    assert d is not None, f"no verdict for {case} (child crashed?)"
    assert d["ok"], d.get("err")


if __name__ == "__main__" and "--child" in sys.argv:
    sys.exit(interp_harness.child(CASES, _run_case))
