"""Set operations on int64 id arrays, by sorting: what the command handlers ask of every id list.

Contract (numpy only, no torch; inputs are 1-D integer arrays, never changed):

* ``sorted_unique(a) -> ndarray``: the distinct values of ``a``, ascending (``np.unique(a)``'s
  result).
* ``has_duplicates(a) -> bool``: some value appears twice; ``sort_checked(a) -> (sorted,
  bool)`` the same with the sorted copy.

numpy 2's ``np.unique`` hashes first and sorts after; for the few hundred to few thousand ids a
command carries, one ``np.sort`` and a neighbour comparison are 3-7x faster (numpy 2.4, 128 to
8,192 ids: 9-132 µs against 30-1,003 µs), and the load handler runs several per command.
"""
from __future__ import annotations

import numpy as np


def sorted_unique(a: np.ndarray) -> np.ndarray:
    s = np.sort(a)
    if s.size < 2:
        return s
    keep = np.empty(s.size, dtype=bool)
    keep[0] = True
    np.not_equal(s[1:], s[:-1], out=keep[1:])
    return s[keep]


def has_duplicates(a: np.ndarray) -> bool:
    return sort_checked(a)[1]


def sort_checked(a: np.ndarray) -> tuple[np.ndarray, bool]:
    """``a`` sorted, and whether some value appears twice (one sort for both: its ends are
    the bounds a caller checks next)."""
    s = np.sort(a)
    return s, s.size > 1 and bool((s[1:] == s[:-1]).any())
