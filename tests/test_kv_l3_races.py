"""The key store's L3 paths where the order of L3 jobs decides: a real CPU daemon state in
process and a stand-in tier whose jobs the test runs one at a time (``kv_fake_l3``). Both were
found by a review helper; each test fails on the code before.

* A ``kv_put`` made while a ``kv_clear`` is in flight and the namespace's first epoch is being
  read (an engine that clears, attaches and puts at start-up): the clear drops the put's host
  entry (its ack counts it), so its L3 object must not appear under the new epoch. On the code
  before, the clear woke the waiting write with the new epoch, and a later ``kv_get`` found the
  page.
* Key-store queries (``kv_exists`` / ``kv_get`` of keys the daemon knows nothing of) in flight
  are bounded by ``kv_l3.QUERIES_MAX``; past it a new unknown key is absent (a miss) at once and
  counted ``l3_errors{kind="busy"}``. On the code before, every call queued one more query job
  and ``l3_ops`` entry: with a hung master (each call held up to its 30 s RPC timeout) both grew
  without bound.
* A ``kv_put`` while the tier is still connecting submits nothing (its write is dropped,
  counted ``offline``), as the module promises: on the code before it started an epoch read,
  which would fail and make the namespace's L3 reads miss for a second once connected.
"""
from __future__ import annotations

from typing import Any

from hicache.controllers.kv_l3 import QUERIES_MAX, object_key

from kv_fake_l3 import call, client, dstate, engine_pool, ids, pump, with_l3  # noqa: F401


def test_a_put_the_clear_dropped_is_not_written_under_the_new_epoch(dstate: Any) -> None:
    st = dstate
    l3 = with_l3(st)
    c = client(st)
    ep = engine_pool(st, c, "c4_kv", "c4_kv")
    r, _ = call(st, c, "kv_clear", {"namespace": "ns"})  # the clear is sent first
    op = r["op"]
    st.kv_store.l3.touch(ep.ns)  # kv_attach's epoch read
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1]
    assert [j.kind for j in l3.queued] == ["meta", "meta"]  # the clear, then the read
    l3.run_all()
    pump(st)
    acks = [a for _, a in st.outbox if a.get("op") == op]
    assert acks and acks[0]["kv"]["dropped"] == 1
    l3.run_all()  # whatever the woken write queued
    pump(st)
    new = st.kv_store.l3.epochs.current(ep.ns)
    assert new is not None
    assert object_key(st.kv_store.l3.prefix, ep.ns, new, "c4_kv", "a") not in l3.store
    for _ in range(4):  # a kv_get after the clear finds nothing
        r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([5]))
        if not r["pending"]:
            break
        l3.run_all()
        pump(st)
    assert r["found"] == [0] and not r["pending"]
    assert st.kv_store.l3.pinned == 0 and not st.l3_ops


def test_key_store_queries_in_flight_are_bounded(dstate: Any) -> None:
    st = dstate
    l3 = with_l3(st, recheck=600.0)
    c = client(st)
    engine_pool(st, c, "c4_kv", "c4_kv")
    call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["x"]})
    l3.run_all()  # the namespace's epoch, and the first query
    pump(st)
    busy0 = st.metrics.value("l3_errors", "busy")
    for i in range(QUERIES_MAX):  # a hung master: none of them is answered
        r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": [f"k{i}-a", f"k{i}-b"]})
        assert r["pending"] == [0, 1]
    assert sum(j.kind == "query" for j in l3.queued) == QUERIES_MAX
    ops = len(st.l3_ops)
    # one more: absent at once, nothing queued, counted
    r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["late-a", "late-b", "late-a"]})
    assert r == {"present": [0, 0, 0], "pending": []}
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["late-c"], "pages": 0}, ids([4]))
    assert r["found"] == [0] and not r["pending"]
    assert sum(j.kind == "query" for j in l3.queued) == QUERIES_MAX and len(st.l3_ops) == ops
    assert st.metrics.value("l3_errors", "busy") - busy0 == 3
    # keys already asked about stay pending; once the queries are answered, new ones go out
    r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["k0-a"]})
    assert r["pending"] == [0]
    l3.run_all()
    pump(st)
    assert st.kv_store.l3.queries == 0 and not st.l3_ops
    r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["later"]})
    assert r["pending"] == [0] and st.kv_store.l3.queries == 1


def test_a_put_while_the_tier_connects_submits_nothing(dstate: Any) -> None:
    st = dstate
    l3 = with_l3(st)
    l3.online, l3.state = False, "connecting"
    c = client(st)
    engine_pool(st, c, "c4_kv", "c4_kv")
    off0 = st.metrics.value("l3_errors", "offline")
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1]
    assert l3.queued == [] and not st.l3_ops
    assert st.metrics.value("l3_errors", "offline") - off0 == 1
    assert st.kv_store.l3.pinned == 0
    r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["b"]})
    assert r["pending"] == [0] and l3.queued == []  # connecting: pending, nothing asked
