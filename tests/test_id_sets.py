"""``hicache.core.id_sets`` against numpy's own set operations, on random and edge-case ids."""
from __future__ import annotations

import numpy as np

from hicache.core.id_sets import RUN_LIST_MAX, has_duplicates, is_run, sort_checked, sorted_unique


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


def test_is_run_on_both_sides_of_the_list_limit():
    """A run is what ``np.arange(first, first + n)`` gives; the ends alone do not make one (a
    swap, a repeat or a gap inside keeps them), on lists checked as lists and as arrays."""
    assert not is_run(np.zeros(0, np.int64)) and is_run(np.array([-3]))
    for n in (2, 3, 128, RUN_LIST_MAX, RUN_LIST_MAX + 1, 5000):
        run = np.arange(40, 40 + n, dtype=np.int64)
        assert is_run(run) and is_run(run - 40)
        assert not is_run(run[::-1].copy())
        if n > 3:
            swapped = run.copy()
            swapped[[1, 2]] = swapped[[2, 1]]
            repeated = run.copy()
            repeated[1] = repeated[2]
            hole = run.copy()
            hole[1:-1] += 1  # a gap after the first and one before the last: same ends
            hole[-2] = run[-1]
            for a in (swapped, repeated, hole):
                assert a[0] == run[0] and a[-1] == run[-1] and not is_run(a), a[:4]
        assert not is_run(np.r_[run, run[-1] + 2])
