"""matplotlib for the benches' ``--plot``: ``pyplot()`` gives the Agg-backed module, or None when
matplotlib is not installed (the callers say so in one line; it is an optional extra)."""
from __future__ import annotations

from typing import Any


def pyplot() -> Any | None:
    try:
        import matplotlib
        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt
