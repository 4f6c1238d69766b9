"""The one percentile definition every report uses (nearest rank)."""
from __future__ import annotations

import pytest

from hicache.core.percentiles import median, percentile


def test_nearest_rank_and_empty():
    xs = [5.0, 1.0, 4.0, 2.0, 3.0]
    assert (median(xs), percentile(xs, 0.0), percentile(xs, 1.0)) == (3.0, 1.0, 5.0)
    assert xs == [5.0, 1.0, 4.0, 2.0, 3.0]  # not sorted in place
    assert median([1.0, 2.0, 3.0, 4.0]) == 3.0  # an even count: the upper middle
    hundred = [float(i) for i in range(100)]
    assert percentile(hundred, 0.99) == 99.0 and percentile(hundred, 0.5) == 50.0
    assert percentile([], 0.5) is None and median(iter([])) is None


@pytest.mark.parametrize("q", [-0.1, 1.5, 99])
def test_q_outside_zero_to_one_is_refused(q):
    with pytest.raises(ValueError, match="must be in"):
        percentile([1.0], q)
