"""Percentiles of timing samples: one definition for every report (benches, fuzz, demo).

Contract:

* ``percentile(xs, q)``, ``q`` in [0, 1]: the nearest-rank value ``sorted(xs)[min(n - 1,
  int(q * n))]`` (so p50 of an even count is the upper of the two middle values, p100 the
  largest); ``None`` for no samples. ``xs`` is not changed.
* ``median(xs)`` = ``percentile(xs, 0.5)``.
"""
from __future__ import annotations

from typing import Iterable, Optional


def percentile(xs: Iterable[float], q: float) -> Optional[float]:
    if not 0.0 <= q <= 1.0:
        raise ValueError(f"percentile q must be in [0, 1], got {q}")
    s = sorted(xs)
    return s[min(len(s) - 1, int(q * len(s)))] if s else None


def median(xs: Iterable[float]) -> Optional[float]:
    return percentile(xs, 0.5)
