"""``controllers.kv_epochs.Epochs`` on its own, its L3 jobs run by the test in submission order
(the meta thread's order) against the stand-in tier of ``kv_fake_l3``: no Mooncake needed.

A write made while a ``kv_clear`` is in flight, waiting for the namespace's first epoch (an
engine that clears, attaches and puts at start-up), has its host entry dropped by the clear; its
objects must go under the epoch the clear replaced (removed with it) or nowhere, never under the
new epoch, where a later ``kv_get`` would find a page the clear reported dropped. On the code
before, the clear woke such writes with the new epoch (found by a review helper).
"""
from __future__ import annotations

from typing import Any

import pytest

from hicache.controllers import kv_epochs
from hicache.controllers.kv_epochs import Epochs, encode, epoch_key, new_epoch

from kv_fake_l3 import FakeL3


class _Tier:
    def __init__(self) -> None:
        self.l3 = FakeL3()  # its meta calls: ``get_small`` / ``put_small``
        self.queued: list[tuple[Any, Any]] = []
        self.events: list[tuple[str, Any]] = []

    def submit(self, job: Any, done: Any, expire: Any = None) -> int:
        self.queued.append((job, done))
        return len(self.queued)

    def run_all(self) -> None:
        while self.queued:
            job, done = self.queued.pop(0)
            job.value = job.call(self.l3)
            done(job)

    def epochs(self) -> Epochs:
        def changed(ns: str, olds: list[str]) -> int:
            self.events.append(("changed", tuple(olds)))
            return 1

        return Epochs(self.submit, "hc", recheck=2.0, read_deadline=5.0, changed=changed,
                      forget=lambda ns: None)


def _write_during_clear(stored_before: str | None) -> tuple[_Tier, str | None, list[Any]]:
    t = _Tier()
    if stored_before is not None:
        t.l3.small[epoch_key("hc", "ns")] = encode(stored_before)
    ep = t.epochs()
    cleared: list[Any] = []
    ep.clear("ns", float("inf"), lambda j, dropped: cleared.append(dropped), lambda *a: None)
    got: list[Any] = []
    ep.for_write("ns", lambda e: (got.append(e), t.events.append(("write", e))))
    assert got == [], "the write waits for the namespace's first epoch"
    t.run_all()  # the clear, then the read the write started
    assert cleared == [1]
    return t, ep.current("ns"), got


def test_a_write_waiting_during_a_clear_goes_under_the_replaced_epoch_not_the_new_one() -> None:
    old = new_epoch()
    t, now, got = _write_during_clear(old)
    assert now is not None and now != old
    assert got == [old], f"the write went under {got}; the clear replaced {old}, new {now}"
    # its objects are queued before the replaced epoch's objects are collected
    assert t.events == [("write", old), ("changed", (old,))]


def test_a_write_waiting_during_a_clear_of_a_namespace_without_an_epoch_is_dropped() -> None:
    t, now, got = _write_during_clear(None)
    assert now is not None
    assert got == [None]
    assert t.events == [("write", None), ("changed", ())]


def test_a_new_namespace_past_the_bound_with_every_older_one_busy_is_kept(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Past ``EPOCHS_MAX`` the idle namespaces go first; when every older one is busy (an epoch
    read in flight), the one just made stays (on the code before, ``_trim`` removed it and
    ``_entry`` raised ``KeyError``)."""
    monkeypatch.setattr(kv_epochs, "EPOCHS_MAX", 2)
    t = _Tier()
    ep = t.epochs()
    assert ep.for_read("a") is None and ep.for_read("b") is None  # both reading
    assert ep.for_read("c") is None  # a third, every older one busy: kept, its read started
    assert list(ep.ns) == ["a", "b", "c"] and ep.reads == 3
    t.run_all()
    assert ep.for_read("d") is None  # now the idle oldest go
    assert list(ep.ns) == ["c", "d"]
