"""matplotlib for the benches' ``--plot``: ``check_plot(path)`` refuses a ``--plot`` up front
(``UsageError``, one line) when matplotlib is not installed, so no bench runs for minutes and
then cannot draw; ``pyplot()`` gives the Agg-backed module, or None without matplotlib (it is an
optional extra)."""
from __future__ import annotations

from typing import Any

from hicache.core.errors import UsageError


def pyplot() -> Any | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def check_plot(path: str | None) -> None:
    """Refuse ``--plot path`` when matplotlib is missing (nothing to do without a path)."""
    if path and pyplot() is None:
        raise UsageError("--plot needs matplotlib (pip install matplotlib)")
