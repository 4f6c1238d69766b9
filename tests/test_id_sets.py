"""``hicache.core.id_sets`` against numpy's own set operations, on random and edge-case ids."""
from __future__ import annotations

import numpy as np

from hicache.core.id_sets import has_duplicates, sort_checked, sorted_unique


def test_sorted_unique_has_duplicates_and_sort_checked_match_numpy():
    rng = np.random.default_rng(7)
    cases = [np.zeros(0, np.int64), np.array([5]), np.array([3, 3]), np.array([2, 1]),
             np.array([-4, 9, -4, 0]), np.arange(1000)[::-1].copy()]
    for n in (2, 33, 128, 1000, 5000):
        cases.append(rng.integers(0, n * 2, n))  # duplicates likely
        cases.append(rng.permutation(n * 3)[:n])  # distinct
    for a in cases:
        a = np.asarray(a, dtype=np.int64)
        before = a.copy()
        assert np.array_equal(sorted_unique(a), np.unique(a))
        assert has_duplicates(a) == (np.unique(a).size != a.size)
        s, twice = sort_checked(a)
        assert np.array_equal(s, np.sort(a)) and twice == has_duplicates(a)
        assert np.array_equal(a, before)  # inputs are never changed

