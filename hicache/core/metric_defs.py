"""What a metric catalog entry is (``MetricDef``) and the shared latency buckets.

The daemon's catalog (``hicache.controllers.metrics``) and the demo's (``hicache.sim``) are
both lists of ``MetricDef``: name (no ``hicache_`` prefix, no ``_total``), kind (counter, gauge,
histogram), label names, help text, and the operator question the metric answers.
"""
from __future__ import annotations

from dataclasses import dataclass

LATENCY_BUCKETS = (1e-5, 2.5e-5, 5e-5, 1e-4, 2.5e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2,
                   5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 10.0)


@dataclass(frozen=True)
class MetricDef:
    name: str  # without the hicache_ prefix, without _total
    kind: str  # counter | gauge | histogram
    labels: tuple[str, ...]
    help: str
    question: str
