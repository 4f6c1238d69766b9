"""Set operations on int64 id arrays, by sorting: what the command handlers ask of every id list.

Contract (numpy only, no torch; inputs are 1-D integer arrays, never changed):

* ``sorted_unique(a) -> ndarray``: the distinct values of ``a``, ascending (``np.unique(a)``'s
  result).
* ``has_duplicates(a) -> bool``: some value appears twice; ``sort_checked(a) -> (sorted,
  bool)`` the same with the sorted copy.
* ``is_run(a) -> bool``: ``a`` is ``a[0], a[0] + 1, ..., a[0] + n - 1`` (n >= 1): its ends are
  its bounds, it has no duplicates, and its pages are one range (a checkpoint's SWA tail).

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


RUN_LIST_MAX = 256  # up to this many ids a run is checked as a Python list (~1.5 µs at 128;
# numpy's slice-difference check costs ~2-3 µs at any size, the list ~13 µs at 512)


def is_run(a: np.ndarray) -> bool:
    n = int(a.size)
    if n < 2:
        return n == 1
    first = int(a[0])
    if int(a[-1]) - first != n - 1:  # most lists that are no run end here
        return False
    if n <= RUN_LIST_MAX:
        return a.tolist() == list(range(first, first + n))
    return bool((a[1:] - a[:-1] == 1).all())
