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
