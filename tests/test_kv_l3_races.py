"""The key store's L3 paths where the order of L3 jobs decides: a real CPU daemon state in
process and a stand-in tier whose jobs the test runs one at a time (``kv_fake_l3``). Both were
found by a review helper; each test fails on the code before.

* A daemon that knew no epoch for a namespace when its engine put a page (its tier offline or
  connecting, or the namespace's first epoch read in flight) cannot tell whether another
  daemon's clear came before the put: the first read that finds an epoch it did not make drops
  those pages and their waiting writes (thirty-seventh session; before, they were served, or
  written under the clear's new epoch). A first read that made the epoch keeps them.
* An old epoch's removal joins a queued remove job only when no write-through put was
  submitted after that job, so it never runs ahead of a put under the epoch it collects.

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

import time
from typing import Any

from hicache.controllers.kv_l3 import QUERIES_MAX, object_key
from hicache.controllers.kv_store import store_of

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


def _other_daemon_clears(st: Any, ns: str, l3: Any) -> str:
    """Another daemon's ``kv_clear`` on the same store: its upsert of a new epoch."""
    from hicache.controllers import kv_epochs as E
    new = E.new_epoch()
    l3.small[E.epoch_key(st.kv_store.l3.prefix, ns)] = E.encode(new)
    return new


def _get_settled(st: Any, c: Any, l3: Any, key: str) -> dict[str, Any]:
    for _ in range(4):
        r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": [key], "pages": 0}, ids([5]))
        if not r["pending"]:
            return r
        l3.run_all()
        pump(st)
    raise AssertionError("kv_get still pending")


def test_pages_put_offline_do_not_survive_another_daemons_clear(dstate: Any) -> None:
    """A daemon whose tier was offline (or that started while it was) knew no epoch when its
    engine put a page; another daemon then cleared the namespace. Once this daemon reads the
    epoch, the page is gone: nothing can tell whether it came before the clear. On the code
    before, it was served as a hit for as long as it stayed in the host rows."""
    st = dstate
    l3 = with_l3(st)
    c = client(st)
    ep = engine_pool(st, c, "c4_kv", "c4_kv")
    l3.online, l3.state = False, "offline"
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1]
    _other_daemon_clears(st, ep.ns, l3)
    l3.online, l3.state = True, "online"
    # the first use after the outage may still hit (the clear is not known yet) and starts
    # the epoch read; once that read ran, the page is gone
    call(st, c, "kv_get", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([5]))
    l3.run_all()
    pump(st)
    r = _get_settled(st, c, l3, "a")
    assert r["found"] == [0]
    assert st.kv_store.l3.epochs.current(ep.ns) is not None
    assert st.kv_store.summary()["entries"]["page"] == 0
    assert st.kv_store.l3.pinned == 0 and not st.l3_ops


def test_a_put_before_another_daemons_clear_is_not_written_under_its_epoch(dstate: Any) -> None:
    """The namespace's first epoch read is in flight when the engine puts a page; another
    daemon's clear lands before that read runs. The waiting write must not go under the epoch
    the read returns (the clear's): every daemon would read the page put before the clear. On
    the code before, it did, and this daemon's kv_get found it."""
    from hicache.controllers import kv_epochs as E
    st = dstate
    l3 = with_l3(st)
    c = client(st)
    ep = engine_pool(st, c, "c4_kv", "c4_kv")
    store_of(st)
    key = E.epoch_key(st.kv_store.l3.prefix, ep.ns)
    l3.small[key] = E.encode(E.new_epoch())  # the namespace's epoch before
    st.kv_store.l3.touch(ep.ns)  # kv_attach's epoch read, not run yet
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1] and [j.kind for j in l3.queued] == ["meta"]
    new = _other_daemon_clears(st, ep.ns, l3)
    l3.run_all()
    pump(st)
    l3.run_all()
    pump(st)
    assert st.kv_store.l3.epochs.current(ep.ns) == new
    assert object_key(st.kv_store.l3.prefix, ep.ns, new, "c4_kv", "a") not in l3.store
    assert _get_settled(st, c, l3, "a")["found"] == [0]
    assert st.kv_store.l3.pinned == 0 and not st.l3_ops


def test_a_first_read_that_makes_the_epoch_keeps_the_pages_put_before_it(dstate: Any) -> None:
    """No epoch stored yet, so no clear came before: pages put while this daemon's read (which
    makes the namespace's first epoch) was in flight stay, and their write goes under it."""
    st = dstate
    l3 = with_l3(st)
    c = client(st)
    ep = engine_pool(st, c, "c4_kv", "c4_kv")
    store_of(st)
    st.kv_store.l3.touch(ep.ns)
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1]
    l3.run_all()
    pump(st)
    l3.run_all()
    pump(st)
    epoch = st.kv_store.l3.epochs.current(ep.ns)
    assert object_key(st.kv_store.l3.prefix, ep.ns, epoch, "c4_kv", "a") in l3.store
    assert _get_settled(st, c, l3, "a")["found"] == [1]


def _x_cleared_then_a_put_to_y(st: Any, names: tuple[str, ...]) -> tuple[Any, Any, Any, dict]:
    """Pools ``names`` (namespace: the name upper-cased), each namespace's epoch learnt; X
    cleared (its removal queued, not run: in the daemon a long write ahead of it holds the write
    thread); then a page put to Y (its write-through queued after that removal)."""
    l3 = with_l3(st)
    c = client(st)
    store_of(st)
    eps = {n: engine_pool(st, c, n, "c4_kv", ns=n.upper()) for n in names}
    for n in names:
        call(st, c, "kv_exists", {"name": n, "keys": ["zz"]})
    l3.run_all()
    pump(st)
    call(st, c, "kv_clear", {"namespace": "X"})
    l3.run_all("meta")
    pump(st)
    assert [j.kind for j in l3.queued] == ["remove"]
    call(st, c, "kv_put", {"name": "y", "keys": ["a"], "pages": 0}, ids([1]))
    return st, l3, c, eps


def test_a_removal_never_runs_ahead_of_puts_under_the_epoch_it_collects(dstate: Any) -> None:
    """X is cleared (its old epoch's remove job queued, not run yet), Y gets a page (its
    write-through put queued after that job), then Y is cleared: Y's old epoch must be removed
    after that put, not by joining the earlier job (the write queue runs in order). On the code
    before, it joined it, and the put's object stayed under the collected epoch."""
    st, l3, c, eps = _x_cleared_then_a_put_to_y(dstate, ("x", "y"))
    ep = eps["y"]
    old = st.kv_store.l3.epochs.current(ep.ns)
    call(st, c, "kv_clear", {"namespace": "Y"})
    l3.run_all("meta")
    pump(st)
    assert [j.kind for j in l3.queued] == ["remove", "put", "remove"]
    l3.run_all()
    pump(st)
    assert not [k for k in l3.store if f"/{old}/" in k]
    assert st.kv_store.l3.gc_waiting == 0 and st.kv_store.l3.pinned == 0 and not st.l3_ops


def test_removals_still_share_a_job_when_no_put_under_their_epoch_followed_it(dstate: Any) -> None:
    """Puts under other namespaces' epochs do not keep a removal out of the queued job: X is
    cleared (its removal queued), Y gets a page, then Z is cleared: Z's old epoch joins X's
    removal job (one regex scan on the master), ahead of Y's put, which it does not touch."""
    st, l3, c, _ = _x_cleared_then_a_put_to_y(dstate, ("x", "y", "z"))
    call(st, c, "kv_clear", {"namespace": "Z"})
    l3.run_all("meta")
    pump(st)
    assert [(j.kind, len(j.keys)) for j in l3.queued] == [("remove", 2), ("put", 1)]
    l3.run_all()
    pump(st)
    assert st.kv_store.l3.gc_waiting == 0 and st.kv_store.l3.pinned == 0 and not st.l3_ops


def _two_pages_written_through(st: Any) -> tuple[Any, Any, Any]:
    """A stand-in tier (epochs rechecked every 600 s), a client and its ``c4_kv`` pool, whose
    rows 1 and 2 were put as ``k0`` and ``k1`` and written through to L3: (tier, client,
    pool)."""
    l3 = with_l3(st, recheck=600.0)
    c = client(st)
    ep = engine_pool(st, c, "c4_kv", "c4_kv")
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["k0", "k1"], "pages": 0},
                ids([1, 2]))
    assert r["stored"] == [1, 1]
    for _ in range(2):  # the namespace's epoch, then the write-through
        l3.run_all()
        pump(st)
    return l3, c, ep


def test_a_fetch_queued_behind_a_hung_call_gives_its_row_back_at_its_deadline(
        dstate: Any) -> None:
    """A key-store fetch queued behind a read call that hangs (a storage node that accepts and
    never answers: the master answers, so the tier stays online) gives its store row back at
    its deadline, and its key is a miss; the hung call's own row stays taken until the call
    returns, and nothing it read late becomes an entry. (The real-master test of this,
    ``test_kv_l3.py``, now finds the master itself hung and takes the tier offline first.)"""
    from hicache.controllers.kv_l3 import READ_DEADLINE

    st = dstate
    l3, c, ep = _two_pages_written_through(st)
    epoch = st.kv_store.l3.epochs.current(ep.ns)
    assert {object_key(st.kv_store.l3.prefix, ep.ns, epoch, "c4_kv", k)
            for k in ("k0", "k1")} <= l3.store
    st.kv_store.drop(ep.ns)  # the host entries go (as after a restart); L3 keeps the pages
    alloc = st.group.allocators["page"]
    used = alloc.used_rows
    for k, dev in (("k0", 3), ("k1", 4)):  # known present (written): fetched at once
        r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": [k], "pages": 0}, ids([dev]))
        assert r["pending"] == [0], r
    hung, queued = [j for j in l3.queued if j.kind == "prefetch"]
    assert alloc.used_rows == used + 2
    hung.started = True  # a worker took it; its call never returns (until the end)
    st.expire_l3(time.monotonic() + READ_DEADLINE + 1)
    assert hung.acked and queued.acked and queued.cancelled == "deadline"
    assert alloc.used_rows == used + 1  # the queued fetch's row is back; the hung call's is not
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["k0", "k1"], "pages": 0},
                ids([3, 4]))
    assert r["found"] == [0, 0] and not r["pending"]  # misses now, nothing asked again
    assert [j for j in l3.queued if j.kind == "prefetch"] == [hung, queued]
    l3.queued.remove(hung)
    hung.started = False
    l3.queued.insert(0, hung)
    l3.run_all()  # the hung call returns (it read k0), then the dropped one runs unrun
    pump(st)
    assert queued.misses == {"deadline": 1}
    assert alloc.used_rows == used and not st.l3_ops  # the late call's row freed once
    assert not [k for k in st.kv_store.entries[ep.space] if k[0] == ep.ns]  # no entry made


def test_a_stop_that_finds_the_master_hung_first_takes_what_finished(dstate: Any) -> None:
    """A stop that found only L3 jobs left, waiting on a hung master, gave up before taking
    the jobs that had finished meanwhile: they were then answered as stopped and their
    results dropped (a write-through put's rows stayed pinned). It now collects first."""
    st = dstate
    l3 = with_l3(st, recheck=600.0)
    c = client(st)
    engine_pool(st, c, "c4_kv", "c4_kv")
    call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["zz"]})
    l3.run_all()  # the namespace's epoch, and the query
    pump(st)
    r, _ = call(st, c, "kv_put", {"name": "c4_kv", "keys": ["a"], "pages": 0}, ids([3]))
    assert r["stored"] == [1] and st.kv_store.l3.pinned == 1
    call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["stuck"]})  # its call hangs
    l3.run(next(j for j in l3.queued if j.kind == "put"))  # finished, not yet collected
    l3.hung = lambda: True  # the tier found the master hung
    assert st.wait_idle(5) == "hung"  # the stuck query is left
    assert st.kv_store.l3.pinned == 0  # the put was taken: its rows are no longer pinned
    assert [j.kind for j in st.l3_ops.values()] == ["query"]


def test_while_prefetches_stall_a_kv_get_misses_without_evicting_or_forgetting(
        dstate: Any) -> None:
    """While a storage node holds the prefetch worker (stalled), a ``kv_get`` of keys known
    present took store rows (evicting entries for them) for a prefetch answered ``stalled``
    at once, and remembered the keys absent, so ``kv_exists`` said absent and the next
    ``kv_get`` missed for ``ABSENT_TTL`` after the stall ended (the forty-fourth session's
    reviews). Now such a key is a miss at once, nothing taken, nothing remembered (once per
    position, a key named twice too); a fetch sent before the stall and dropped by it gives
    its row back and forgets nothing; and after the stall both keys are fetched."""
    st = dstate
    l3, c, ep = _two_pages_written_through(st)
    want = {k: [t[r].clone() for t in ep.layers] for k, r in (("k0", 1), ("k1", 2))}
    st.kv_store.drop(ep.ns)  # the host entries go; L3 keeps the pages
    alloc = st.group.allocators["page"]
    used = alloc.used_rows
    stalled = st.metrics.value("l3_errors", "stalled")
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["k0"], "pages": 0}, ids([3]))
    assert r["pending"] == [0], r
    (early,) = [j for j in l3.queued if j.kind == "prefetch"]
    assert alloc.used_rows == used + 1
    l3.stalled_queues["read"] = "a prefetch call has not returned for 2.0 s"
    l3.drop(early, "stalled")  # queued when the stall was found
    pump(st)
    assert early.misses == {"stalled": 1} and alloc.used_rows == used  # its row back
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["k1", "k1"], "pages": 0},
                ids([3, 4]))
    assert r["found"] == [0, 0] and not r["pending"], r
    assert not [j for j in l3.queued if j.kind == "prefetch"] and alloc.used_rows == used
    assert st.metrics.value("l3_errors", "stalled") == stalled + 2
    r, _ = call(st, c, "kv_exists", {"name": "c4_kv", "keys": ["k0", "k1"]})
    assert r == {"present": [1, 1], "pending": []}, r  # still known present
    l3.stalled_queues.clear()  # the call returned
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["k0", "k1"], "pages": 0},
                ids([5, 6]))
    assert r["pending"] == [0, 1], r
    l3.run_all()
    pump(st)
    r, _ = call(st, c, "kv_get", {"name": "c4_kv", "keys": ["k0", "k1"], "pages": 0},
                ids([5, 6]))
    assert r["found"] == [1, 1], r
    for k, dev in (("k0", 5), ("k1", 6)):
        assert all(bool((t[dev] == w).all()) for t, w in zip(ep.layers, want[k])), k
