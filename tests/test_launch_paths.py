"""The daemons the tests, benches and the fuzzer launch run the code of this checkout.

``DaemonProcess`` puts the checkout first on ``PYTHONPATH`` and ``DaemonRunner`` runs from it;
both once named ``<checkout>/hicache`` instead, so a daemon launched from a second clone
imported whatever ``hicache`` the virtualenv had installed, and its tests passed against other
code.
"""
from __future__ import annotations

import subprocess
import sys
from pathlib import Path

from hicache.engine.daemon_process import ROOT, DaemonProcess
from hicache.fuzz.runner import ROOT as RUNNER_ROOT
from hicache.fuzz.runner import DaemonRunner

CHECKOUT = Path(__file__).resolve().parents[1]


def test_roots_name_the_checkout():
    assert ROOT == CHECKOUT and RUNNER_ROOT == CHECKOUT
    assert (ROOT / "hicache" / "__init__.py").is_file()


def _imported_from(env: dict[str, str], cwd: str) -> str:
    out = subprocess.run([sys.executable, "-c", "import hicache; print(hicache.__file__)"],
                         env=env, cwd=cwd, capture_output=True, text=True, timeout=60, check=True)
    return out.stdout.strip()


def test_a_launched_daemon_imports_this_checkout(tmp_path):
    d = DaemonProcess("ipc:///tmp/unused.sock", exit_with_parent=False)
    assert d.env["PYTHONPATH"].split(":")[0] == str(CHECKOUT)
    # from a folder outside the checkout, the interpreter the daemon runs finds this checkout
    assert _imported_from(d.env, str(tmp_path)) == str(CHECKOUT / "hicache" / "__init__.py")
    r = DaemonRunner("ipc:///tmp/unused.sock")
    assert r.cwd == str(CHECKOUT)
    assert _imported_from(r.env, r.cwd) == str(CHECKOUT / "hicache" / "__init__.py")
