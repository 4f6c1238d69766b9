"""The handlers' id checks (``controllers.copy_commands``): the same refusal, word for word,
whether a command carries a few ids (Python loop) or many (one numpy sort)."""
from __future__ import annotations

import numpy as np
import pytest

from hicache.controllers.copy_commands import _bounds, _destination, _distinct
from hicache.controllers.ops import Ids
from hicache.controllers.state import OWNER_LOOP_MAX
from hicache.core.protocol import ProtocolError


def _refusal(fn, *args) -> str | None:
    try:
        fn(*args)
    except ProtocolError as e:
        assert e.code == "bad_rows"
        return str(e)
    return None


@pytest.mark.parametrize("n", [1, 2, OWNER_LOOP_MAX, OWNER_LOOP_MAX + 1, 500])
@pytest.mark.parametrize("case", ["ok", "twice", "high", "negative", "high and twice"])
def test_destination_is_bounds_then_distinct(n, case):
    """``_destination`` refuses exactly as ``_bounds`` then ``_distinct`` would, on both
    paths; a duplicate is only reported for ids in bounds."""
    rng = np.random.default_rng(n)
    limit = 4 * n + 10
    ids = rng.permutation(limit)[:n].astype(np.int64)
    if "twice" in case and n > 1:
        ids[-1] = ids[0]
    if "high" in case:
        ids[n // 2] = limit
    if case == "negative":
        ids[0] = -3
    got = _refusal(_destination, Ids.of(ids), limit, "items[0]", "device rows")
    want = _refusal(_bounds, Ids.of(ids), limit, "items[0]", "device rows") or \
        _refusal(_distinct, Ids.of(ids), "items[0]")
    assert got == want
    if case == "ok" or (case == "twice" and n == 1):
        assert got is None
    elif "high" in case or case == "negative":
        assert got is not None and "is outside 0.." in got
    else:
        assert got == "items[0]: a destination id is listed twice"
