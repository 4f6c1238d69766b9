"""``controllers.catch_up``: what a client's silence is measured against.

A loop that finds nothing waiting has caught up then; one that reads nothing (it stood still)
has not, however long; one whose socket is never empty (saturated) has caught up with a mark
once enough reads followed it to take every message that waited then."""
from __future__ import annotations

from hicache.controllers.catch_up import CatchUp


def test_a_loop_that_stood_still_catches_up_with_nothing():
    c = CatchUp(10.0, bound=100)
    for now in (10.5, 11.0, 20.0):  # housekeeping passes, no read, nothing found empty
        c.tick(now)
    assert c.at == 10.0


def test_finding_nothing_waiting_is_caught_up_then():
    c = CatchUp(10.0, bound=100)
    c.empty(12.5)
    assert c.at == 12.5
    c.empty(12.0)  # (an older observation moves nothing back)
    assert c.at == 12.5


def test_a_saturated_loop_catches_up_with_its_marks():
    c = CatchUp(10.0, bound=100)
    c.tick(10.5)
    for _ in range(99):
        c.read()
    c.tick(11.0)
    assert c.at == 10.0  # 99 reads since the mark at 10.0: not yet
    c.read()
    c.tick(11.5)
    assert c.at == 10.0  # the mark was at the start: what waited at 10.0 was read
    for _ in range(100):
        c.read()
    c.tick(12.0)
    assert c.at == 11.5  # the next mark, set when the first was passed
