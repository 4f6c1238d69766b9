"""The SGLang adapter, tested against SGLang 0.5.23's own cache classes on CPU.

SGLang lives in its own environment, ``.venv-sglang`` (``scripts/setup_sglang.sh``: CPU torch,
sglang installed without its GPU dependencies; built once, then cached). This module builds it
when missing and runs ``tests/sglang/check_dsv4_l2.py`` (the host-pool seam, a real
``hicache serve`` per PP stage) and ``tests/sglang/check_dynamic_backend.py`` (the ``dynamic``
storage backend across an engine restart, and, when this environment has the Mooncake wheel,
across a daemon restart with L3 behind the key store: this process runs the ``mooncake_master``
and passes its addresses and this Python, which runs that daemon, in ``HICACHE_TEST_L3``) there;
it fails with the inner run's output if any inner test fails or is skipped.
The version gate is also checked here, in the main environment (no sglang installed).
"""
from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest

from hicache.engine import l3_master
from hicache.engine.sglang import UnsupportedSglang, check_sglang_version
from hicache.engine.sglang.version import installed_sglang

ROOT = Path(__file__).resolve().parents[1]
VENV = Path(os.environ.get("SGLANG_VENV", ROOT / ".venv-sglang"))
INNER = ["tests/sglang/check_dsv4_l2.py", "tests/sglang/check_dynamic_backend.py"]
INNER_TESTS = 8


def _tail(text: str, n: int = 6000) -> str:
    return text[-n:]


def test_sglang_adapter_against_sglang_classes() -> None:
    setup = subprocess.run(["bash", "scripts/setup_sglang.sh"], cwd=ROOT, capture_output=True,
                           text=True, timeout=1800, env={**os.environ, "SGLANG_VENV": str(VENV)})
    assert setup.returncode == 0, f"setup_sglang.sh failed:\n{_tail(setup.stdout + setup.stderr)}"
    env = {**os.environ, "PYTHONPATH": os.pathsep.join(
        [str(ROOT), str(ROOT / "tests"), str(ROOT / "tests" / "sglang")])}
    store, args, want = None, [], INNER_TESTS
    if l3_master.mooncake_dir() is not None:
        store = l3_master.LocalStore(segment="256MB").start()
        env["HICACHE_TEST_L3"] = json.dumps({"master": store.master_addr,
                                             "metadata": store.metadata_url,
                                             "python": sys.executable})
        want += 1
    else:
        args = ["-k", "not through_l3"]
    try:
        run = subprocess.run([str(VENV / "bin" / "python"), "-m", "pytest", "-q", "-p",
                              "no:cacheprovider", "-W", "ignore::UserWarning", *INNER, *args],
                             cwd=ROOT, capture_output=True, text=True, timeout=900, env=env)
    finally:
        if store is not None:
            store.close()
    out = run.stdout + run.stderr
    assert run.returncode == 0, f"SGLang adapter tests failed:\n{_tail(out)}"
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == want, f"expected {want} passed:\n{_tail(out)}"
    assert not re.search(r"\d+ (skipped|failed|error)", out), _tail(out)  # deselected is fine


def test_version_gate_refuses_other_versions_in_one_line() -> None:
    for bad in ("0.5.22", "0.5.24", "0.6.0"):
        with pytest.raises(UnsupportedSglang) as e:
            check_sglang_version(bad)
        msg = str(e.value)
        assert "\n" not in msg and f"found sglang {bad}" in msg and "0.5.23" in msg
    assert check_sglang_version("0.5.23") == "0.5.23"


@pytest.mark.skipif(installed_sglang() is not None, reason="sglang installed in this env")
def test_install_refuses_without_sglang() -> None:
    from hicache.engine import sglang as hs

    with pytest.raises(UnsupportedSglang, match="sglang is not installed"):
        hs.install("dsv4-tiny", address="ipc:///nonexistent")
    assert "sglang" not in sys.modules  # the gate runs before any SGLang import


def test_a_gpu_loads_ack_is_taken_without_waiting_and_a_failure_raises() -> None:
    """At a GPU load's last layer the adapter takes the op's ack if it is in (never waiting:
    the engine's thread must not block on the daemon), keeps the ones not in yet for a later
    last layer, and raises ``TransferFailed`` for one that says the load failed."""
    import threading
    from types import SimpleNamespace

    from hicache.engine.acks import AckTimeout, TransferFailed
    from hicache.engine.sglang.host_pools import _DaemonPoolMixin

    class Acks:
        def __init__(self) -> None:
            self.acks: dict[int, bool] = {}

        def drain(self) -> int:
            return 0

        def wait_ack(self, op, timeout=None, check=True):
            assert timeout == 0
            if op.op_id not in self.acks:
                raise AckTimeout("not yet")
            ok = self.acks.pop(op.op_id)
            if check and not ok:
                raise TransferFailed(SimpleNamespace(op=op.op_id, ok=False, kind="load",
                                                     error={"message": "launch failed"}))
            return SimpleNamespace(ok=ok)

    pool = object.__new__(_DaemonPoolMixin)
    pool._load_lock, pool._unsettled = threading.Lock(), []
    c = Acks()
    first, second = SimpleNamespace(op_id=1), SimpleNamespace(op_id=2)
    pool._settle(c, first)  # its ack is not in: kept
    assert pool._unsettled == [first]
    c.acks.update({1: True, 2: False})
    with pytest.raises(TransferFailed):
        pool._settle(c, second)
    assert pool._unsettled == [] and c.acks == {}  # both taken
