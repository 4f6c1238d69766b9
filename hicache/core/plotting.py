"""matplotlib for every ``--plot`` (the benches' and the demo's host sweep); it is an optional
extra (``pip install 'hicache[plot]'``).

Contract: ``pyplot()`` is the Agg-backed ``matplotlib.pyplot``, or a one-line ``UsageError``
naming the extra when matplotlib is not installed; ``check_plot(path)`` asks for it when a
``--plot`` path is given, so a run refuses ``--plot`` up front instead of failing to draw
after minutes of work.
"""
from __future__ import annotations

from typing import Any

from hicache.core.errors import UsageError


def _load() -> Any | None:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def pyplot() -> Any:
    plt = _load()
    if plt is None:
        raise UsageError("--plot needs matplotlib, which is not installed: "
                         "pip install 'hicache[plot]' (or run without --plot)")
    return plt


def check_plot(path: str | None) -> None:
    """Refuse ``--plot path`` when matplotlib is missing (nothing to do without a path)."""
    if path:
        pyplot()
