"""``kernels.sharing.gpu_sharing``: MPS or time slices, as the CUDA driver reports it for this
process; "unknown" with the reason where it cannot tell."""
from __future__ import annotations

import pytest
import torch

from hicache.kernels import sharing


def test_without_a_gpu_the_mode_is_unknown_and_says_why() -> None:
    assert sharing.gpu_sharing(None) == ("unknown", "no CUDA GPU in this process")
    if not torch.cuda.is_available():
        assert sharing.gpu_sharing(0) == ("unknown", "no CUDA GPU in this process")


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_the_driver_names_the_mode_and_a_daemon_reports_the_same(tmp_path) -> None:
    """The driver knows the attribute (the GPU machine's driver), so the mode is MPS or time
    slices, with its operator phrase; a GPU daemon started from here (same environment, so
    the same MPS server or none) reports the same mode in ``stats``."""
    from conftest import start_daemon

    mode, why = sharing.gpu_sharing(torch.cuda.current_device())
    assert mode in ("mps", "time-slices") and why == sharing.WHY[mode]
    d = start_daemon(tmp_path, device=f"cuda:{torch.cuda.current_device()}")
    try:
        with d.client() as c:
            assert c.stats()["gpu_sharing"] == mode
        assert f"GPU sharing: {why}" in d.output()
    finally:
        d.close()


class _Lib:
    """A driver whose ``cuDeviceGetAttribute`` returns ``rc`` and reports ``value``."""

    def __init__(self, rc: int, value: int = 0) -> None:
        self.rc, self.value = rc, value

    def cuDeviceGet(self, dev, index) -> int:  # noqa: N802 - the driver's name
        return 0

    def cuDeviceGetAttribute(self, out, attr, dev) -> int:  # noqa: N802
        out._obj.value = self.value
        return self.rc


@pytest.mark.parametrize("rc, value, mode", [(0, 1, "mps"), (0, 0, "time-slices"),
                                             (1, 0, "unknown")])
def test_the_driver_answer_gives_the_mode_and_a_refusal_says_so(monkeypatch, rc, value,
                                                                mode) -> None:
    """What the driver answers decides the mode; a driver that refuses the attribute (one that
    predates it) gives "unknown" naming its CUresult, never a guess."""
    monkeypatch.setattr(sharing.torch.cuda, "init", lambda: None)
    monkeypatch.setattr(sharing.ctypes, "CDLL", lambda name: _Lib(rc, value))
    got, why = sharing._ask(0)
    assert got == mode
    assert why == (sharing.WHY[mode] if rc == 0 else
                   "the CUDA driver does not report it (CUresult 1)")


def test_a_missing_driver_library_is_named(monkeypatch) -> None:
    def missing(name: str):
        raise OSError(f"{name}: cannot open shared object file")

    monkeypatch.setattr(sharing.torch.cuda, "init", lambda: None)
    monkeypatch.setattr(sharing.ctypes, "CDLL", missing)
    mode, why = sharing._ask(0)
    assert mode == "unknown" and "libcuda.so.1: cannot open" in why


def test_a_cuda_init_failure_is_unknown_with_its_reason(monkeypatch) -> None:
    def broken() -> None:
        raise RuntimeError("CUDA driver initialization failed")

    monkeypatch.setattr(sharing.torch.cuda, "init", broken)
    mode, why = sharing._ask(0)
    assert mode == "unknown" and "initialization failed" in why
