"""``RowTracker.hazard``: an operation waits only for the other kind of access to its rows."""
from __future__ import annotations

import numpy as np

from hicache.controllers.row_tracker import RowTracker


def test_row_tracker_hazard_only_against_the_other_kind_in_flight():
    t = RowTracker({"page": 64})
    read = [("page", np.arange(40, dtype=np.int64), False)]  # a load of 40 rows (numpy path)
    write_same = [("page", [3], True)]
    write_other = [("page", np.arange(50, 60, dtype=np.int64), True)]
    assert not t.hazard(write_same)  # nothing in flight
    t.begin(read)
    assert t.live == [1, 0]
    assert t.hazard(write_same) and not t.hazard(write_other)
    assert not t.hazard(read)  # reads never wait for reads
    t.begin(write_other)
    assert t.hazard([("page", [55], False)]) and not t.hazard([("page", [45], False)])
    t.end(read)
    t.end(write_other)
    assert t.live == [0, 0] and not t.hazard(write_same)
    assert not t.readers["page"].any() and not t.writers["page"].any()
