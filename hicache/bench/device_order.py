"""Which device rows a bench's engine loads into: the order its allocator hands rows out in.

Contract: ``device_order(pattern, total, rng) -> ndarray``: a permutation of ``range(total)``;
consecutive slices of it are what consecutive allocations of an engine's paged allocator hand
out (a load's destination rows, a backup's source rows). ``transfer_rows.mean_run`` measures
their runs (a copy merges rows only where the host side runs too, so a load's device runs
bound its merging from above).

* ``random``: rows scattered at random (issue #12's pattern: the fewest runs, so every row is
  a copy of its own).
* ``sglang``: the free list of a paged allocator that hands pages out from its head and appends
  freed pages at its tail, unsorted (SGLang's paged allocator outside PD disaggregation, where
  it does not sort its free list), after ``CHURN_OPS`` requests of 1-64 pages allocated and
  freed at random (each free returns one request's pages in their order), then every request
  still held freed in random order. Measured (``mean_run`` of a load's rows of 8 to 512 pages,
  pools of 1,032 rows, 20 orders each): medians 1.6-1.7 rows per run (1.0-2.7), close to
  ``random``: the unsorted list fragments as it churns.
* ``consecutive``: every load's rows one run (a sorted free list on a pool with room, as
  SGLang's allocator keeps it under PD disaggregation): the best case for copies, one per
  block of 2^k rows (``kernels.segments.row_offsets``).
"""
from __future__ import annotations

from collections import deque

import numpy as np

PATTERNS = ("random", "sglang", "consecutive")
CHURN_OPS = 2000
MAX_REQUEST_PAGES = 64


def device_order(pattern: str, total: int, rng: np.random.Generator) -> np.ndarray:
    if pattern == "random":
        return rng.permutation(total)
    if pattern == "consecutive":
        return np.arange(total, dtype=np.int64)
    if pattern != "sglang":
        raise ValueError(f"device order {pattern!r} is not one of {PATTERNS}")
    if total == 0:
        return np.zeros(0, dtype=np.int64)
    free: deque[int] = deque(range(total))
    held: list[list[int]] = []
    for _ in range(CHURN_OPS):
        if free and (not held or rng.random() < 0.5):
            m = min(len(free), int(rng.integers(1, MAX_REQUEST_PAGES + 1)))
            held.append([free.popleft() for _ in range(m)])
        else:
            free.extend(held.pop(int(rng.integers(len(held)))))
    for i in rng.permutation(len(held)):
        free.extend(held[int(i)])
    return np.fromiter(free, dtype=np.int64, count=total)
