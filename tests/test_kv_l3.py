"""The key store with L3 behind it: real ``hicache serve --l3 mooncake`` daemons, a real
``mooncake_master`` and storage member on loopback (the fixtures of ``test_l3_mooncake``), engine
pools in memfds of this process (``test_kv_store.EnginePool``).

Every page that comes back is compared byte for byte with what was put, in every pool, and the
engine pages no key named are checked untouched. Skipped only without the Mooncake wheel.
"""
from __future__ import annotations

import os
import signal
import time
from typing import Any

import pytest
import torch

from hicache.controllers import l3_format
from hicache.controllers.kv_l3 import kv_prefix, object_key
from hicache.core.layout import Layout
from hicache.engine import l3_master

from test_kv_store import EnginePool
from test_l3_mooncake import (SCOPE, SPACES, l3_daemon, metric, raw_gets, raw_puts,  # noqa: F401
                              stop_process, stop_taking_acks, stopped_soon, store,
                              thread_states, wait_offline, wait_online, worker)

pytestmark = pytest.mark.skipif(l3_master.mooncake_dir() is None,
                                reason="Mooncake wheel not installed (pip install 'hicache[l3]')")
NS = "model-a/pp0of1"


def layout_of(c: Any) -> Layout:
    return Layout.from_dict(c.heartbeat(full=True)["layout"])


def _engine(pools: Any, seed: int | None) -> dict[str, EnginePool]:
    """A C4 pool in one memfd per layer and an SWA pool page-first in one memfd."""
    c4, sw = pools["c4_kv"], pools["swa_kv"]
    return {"c4_kv": EnginePool(c4.num_layers, 6, c4.page_bytes, seed=seed),
            "swa_kv": EnginePool(sw.num_layers, 5, sw.page_bytes, page_first=True,
                                 seed=None if seed is None else seed + 1)}


def _attach(c: Any, eng: dict[str, EnginePool], ns: str = NS) -> None:
    for name, ep in eng.items():
        ep.attach(c, name, name, ns=ns)
    c.kv_attach_proven("kv", ns, pages=6, space="page")


def written(c: Any, timeout: float = 20.0) -> dict[str, Any]:
    """Wait until no write-through is in flight (no pinned row, empty put queue)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        s = c.stats()
        if not s["kv_store"]["l3"]["pinned"] and not s["l3"]["put_queue_pages"]:
            return s
        time.sleep(0.02)
    raise AssertionError(f"write-through still in flight: {c.stats()['kv_store']}")


def tenant_page_in_l3(c: Any, seed: int, ns: str = "tenant") -> EnginePool:
    """A C4 engine pool attached in namespace ``ns``, its page 0 put as key "k0" and written
    through to L3."""
    wait_online(c)
    c4 = layout_of(c).pools["c4_kv"]
    ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=seed)
    ep.attach(c, "c4_kv", "c4_kv", ns=ns)
    assert c.kv_put("c4_kv", ["k0"], [0]) == [True]
    written(c)  # k0 is in L3
    return ep


def _close(eng: dict[str, EnginePool]) -> None:
    for ep in eng.values():
        ep.close()


def test_put_daemon_restart_get_every_byte(l3_daemon: Any) -> None:
    d = l3_daemon()
    keys = ["a" * 64, "b" * 64, "c" * 64]
    src = {"c4_kv": [5, 1, 3], "swa_kv": [4, 0, 2]}
    with d.client(name="engine-a") as a:
        wait_online(a)
        layout = layout_of(a)
        pools = layout.pools
        eng = _engine(pools, seed=11)
        _attach(a, eng)
        before = {n: ep.snapshot() for n, ep in eng.items()}
        for name in eng:
            assert a.kv_put(name, keys, src[name]) == [True] * 3
        assert a.kv_put("kv", keys, [5, 1, 3]) == [True] * 3
        s = written(a)
        assert metric(a, "hicache_l3_pages_total", result="written") == 9  # 3 keys x 3 slots
        assert s["kv_store"]["entries"]["page"] == 3
    _close(eng)

    d.kill()  # the daemon dies with its host rows; the pages live on in the store
    d.start()
    eng2 = _engine(pools, seed=None)  # a fresh engine: zeroed pools
    dst = {"c4_kv": [0, 2, 4], "swa_kv": [1, 3, 4]}
    with d.client(name="engine-b") as b:
        wait_online(b)
        _attach(b, eng2)
        assert b.stats()["kv_store"]["entries"] == {"page": 0, "swa_page": 0, "req_slot": 0}
        assert b.kv_exists("kv", keys + ["d" * 64]) == [True, True, True, False]
        assert b.kv_exists("swa_kv", ["d" * 64] + keys) == [False, True, True, True]
        # the marker of the first key is put again: its entry exists without the C4 page, so
        # that page is read into a fresh row and copied into the entry's (the others become
        # entries of their own)
        assert b.kv_put("kv", keys[:1], [0]) == [True]
        for name, ep in eng2.items():
            assert b.kv_get(name, keys, dst[name]) == [True] * 3
            for layer, (new, old) in enumerate(zip(ep.layers, before[name])):
                for s_, t in zip(src[name], dst[name]):
                    assert torch.equal(new[t], old[s_]), (name, layer, s_, t)
                untouched = sorted(set(range(ep.pages)) - set(dst[name]))
                assert not new[untouched].any(), (name, layer)
        assert b.kv_get("kv", keys, [0, 2, 4]) == [True] * 3
        st = b.call("stats", {"check": True})[0]
        assert st["invariants"] == "ok"
        assert st["kv_store"]["entries"]["page"] == 3 and st["kv_store"]["entries"]["swa_page"] == 3
        assert metric(b, "hicache_l3_pages_total", result="prefetch_hit") == 8  # 3 + 3 + 2
        # tokens counted once per key, through the marker's objects
        assert metric(b, "hicache_l3_hit_tokens_total") == 2 * layout.model.page_size
        assert metric(b, "hicache_l3_pages_total", result="kv_miss") == 0
        # a second get is a host hit: nothing more is read from L3
        assert b.kv_get("c4_kv", keys, dst["c4_kv"]) == [True] * 3
        assert metric(b, "hicache_l3_pages_total", result="prefetch_hit") == 8
    _close(eng2)


def test_corrupt_or_missing_object_is_a_miss_never_bytes(l3_daemon: Any, store: Any) -> None:
    from hicache.controllers import kv_epochs  # (test_kv_epochs imports this module's helpers)

    d = l3_daemon()
    with d.client(name="e") as c:
        wait_online(c)
        layout = layout_of(c)
        pools = layout.pools
        eng = _engine(pools, seed=21)
        _attach(c, eng, ns="model-c")
        assert c.kv_put("c4_kv", ["good"], [0]) == [True]
        written(c)
        prefix = kv_prefix(l3_format.namespace(layout, SCOPE))
        size = l3_format.HEADER_BYTES + pools["c4_kv"].page_bytes * pools["c4_kv"].num_layers
        ns = "\x1fmodel-c"  # the key store's namespace: (no CURVE key name) + the client's
        ek = kv_epochs.epoch_key(prefix, ns)
        epoch = kv_epochs.parse(raw_gets(store, [ek])[ek])  # the put went under it
        # garbage of the right size, a truncated object, and a right-sized object whose
        # header names another key
        stolen = bytearray(size)
        l3_format.pack_header(memoryview(stolen),
                              object_key(prefix, ns, epoch, "c4_kv", "good"),
                              size - l3_format.HEADER_BYTES, 0)
        raw_puts(store, {object_key(prefix, ns, epoch, "c4_kv", "garbage"): os.urandom(size),
                         object_key(prefix, ns, epoch, "c4_kv", "short"): os.urandom(size // 2),
                         object_key(prefix, ns, epoch, "c4_kv", "stolen"): bytes(stolen)})
        bad = ["garbage", "short", "stolen"]
        assert c.kv_exists("c4_kv", bad + ["absent"]) == [True, True, True, False]
        ep = eng["c4_kv"]
        before = ep.snapshot()
        assert c.kv_get("c4_kv", bad + ["absent"], [1, 2, 3, 4]) == [False] * 4
        assert all(torch.equal(x, y) for x, y in zip(ep.layers, before))  # no byte moved
        assert metric(c, "hicache_l3_errors_total", kind="corrupt") == 3
        assert metric(c, "hicache_l3_pages_total", result="kv_miss") == 4
        # the good key is still served (from host rows), and a miss stays a quick miss
        t0 = time.monotonic()
        assert c.kv_get("c4_kv", ["good", "garbage"], [5, 1]) == [True, False]
        assert time.monotonic() - t0 < 2.0
        assert all(torch.equal(x[5], y[0]) for x, y in zip(ep.layers, before))
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        assert c.stats()["kv_store"]["entries"]["page"] == 1  # nothing inserted for the bad
    _close(eng)


def test_namespaces_never_see_each_others_objects(l3_daemon: Any) -> None:
    d = l3_daemon()
    with d.client(name="a") as a:
        wait_online(a)
        pools = layout_of(a).pools
        ea = _engine(pools, seed=31)
        _attach(a, ea, ns="tenant-a")
        assert a.kv_put("c4_kv", ["k1", "k2"], [0, 1]) == [True, True]
        written(a)
        want = [t[[0, 1]].clone() for t in ea["c4_kv"].layers]
    _close(ea)
    d.kill()
    d.start()  # empty host rows: every answer below comes from L3
    with d.client(name="b") as b, d.client(name="a2") as a2:
        wait_online(b)
        eb, ea2 = _engine(pools, seed=None), _engine(pools, seed=None)
        _attach(b, eb, ns="tenant-b")
        _attach(a2, ea2, ns="tenant-a")
        assert b.kv_exists("c4_kv", ["k1", "k2"]) == [False, False]
        assert b.kv_get("c4_kv", ["k1", "k2"], [0, 1]) == [False, False]
        assert not any(t.any() for t in eb["c4_kv"].layers)
        assert b.kv_clear("tenant-b") == 0  # removes tenant-b's objects only
        assert a2.kv_get("c4_kv", ["k1", "k2"], [2, 3]) == [True, True]
        assert all(torch.equal(t[[2, 3]], w) for t, w in zip(ea2["c4_kv"].layers, want))
        # clearing tenant-a drops its host entries, and its L3 objects are no longer read
        # (the old epoch's are removed in the background)
        assert a2.kv_clear("tenant-a") == 2
        deadline = time.monotonic() + 10
        while a2.stats()["kv_store"]["l3"]["jobs"] and time.monotonic() < deadline:
            time.sleep(0.02)  # the removal runs on the L3 write thread
        l3 = a2.stats()["kv_store"]["l3"]
        assert (l3["jobs"], l3["gc_waiting"], l3["gc_skipped"]) == (0, 0, 0), l3
        assert a2.kv_get("c4_kv", ["k1", "k2"], [4, 5]) == [False, False]  # gone from L3 too
        assert not ea2["c4_kv"].layers[0][[4, 5]].any()
    _close(eb)
    _close(ea2)


def test_markers_of_one_name_in_two_spaces_never_share_objects(l3_daemon: Any) -> None:
    """A marker pool's objects are named by its space and name: a key put through a ``page``
    marker is not present for a ``swa_page`` marker of the same name (forty-sixth session's
    review: both were named by the name alone, so the second found the first's keys)."""
    d = l3_daemon()
    with d.client(name="a") as a, d.client(name="b") as b:
        wait_online(a)
        a.kv_attach_proven("kv", NS, pages=4, space="page")
        b.kv_attach_proven("kv", NS, pages=4, space="swa_page")
        # the namespace's epoch read first: a put made before it is known is dropped when an
        # earlier test's daemon made that epoch (kv_epochs: unanchored entries)
        assert a.kv_exists("kv", ["none"]) == [False]
        assert a.kv_put("kv", ["K"], [0]) == [True]
        written(a)  # K's object is in L3
        assert b.kv_exists("kv", ["K"]) == [False]
        assert b.kv_get("kv", ["K"], [1]) == [False]
        assert a.stats()["kv_store"]["entries"]["swa_page"] == 0
        assert a.kv_exists("kv", ["K"]) == [True]


def test_rows_of_a_put_in_flight_are_never_evicted(l3_daemon: Any, store: Any) -> None:
    """A write-through job holds its rows: with the master stopped (SIGSTOP), the job hangs in
    a Mooncake call; meanwhile puts that need room evict only unpinned entries."""
    d = l3_daemon()
    with d.client(name="e") as c:
        wait_online(c)
        pools = layout_of(c).pools
        n = c.heartbeat(full=True)["host_rows"]["page"]
        c4 = pools["c4_kv"]
        ep = EnginePool(c4.num_layers, n + 4, c4.page_bytes, seed=41)
        ep.attach(c, "c4_kv", "c4_kv", ns="pin")
        before = ep.snapshot()
        old = [f"old{i}" for i in range(n - 2)]
        assert c.kv_put("c4_kv", old, list(range(n - 2))) == [True] * (n - 2)
        written(c)  # these are unpinned now
        stop_process(store.master.pid)
        try:
            assert c.kv_put("c4_kv", ["p0", "p1"], [n - 2, n - 1]) == [True, True]
            s = c.stats()["kv_store"]
            assert s["l3"]["pinned"] == 2, s  # the job hangs on the dead master
            new = [f"new{i}" for i in range(n)]
            got = c.kv_put("c4_kv", new, [i % (n + 4) for i in range(n)])
            s = c.stats()["kv_store"]
            assert s["l3"]["pinned"] >= 2, s  # still in flight: the test proved something
            assert got == [True] * (n - 2) + [False] * 2  # only unpinned rows were taken
            assert s["evicted"] == n - 2  # every unpinned entry went, no pinned one
            # the pinned rows still hold their bytes (host hits: L3 is not asked)
            ep.layers[0].zero_()
            assert c.kv_get("c4_kv", ["p0", "p1"], [0, 1], l3_wait=0) == [True, True]
            assert torch.equal(ep.layers[0][[0, 1]], before[0][[n - 2, n - 1]])
            # an unknown key: asked in the background, the loop answers at once meanwhile
            t0 = time.monotonic()
            assert c.kv_exists("c4_kv", ["unknown"], l3_wait=0.3) == [False]
            c.heartbeat()
            assert time.monotonic() - t0 < 2.0
            assert c.stats()["kv_store"]["l3"]["querying"] == 1
        finally:
            os.kill(store.master.pid, signal.SIGCONT)
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
    ep.close()


def _used(c: Any) -> int:
    return c.stats()["host"]["spaces"]["page"]["used"]


def test_a_kv_fetch_is_a_miss_at_its_deadline_while_the_master_hangs(l3_daemon: Any,
                                                                     store: Any) -> None:
    """A hung master (SIGSTOP) held a read-through fetch's Mooncake call up to its RPC timeout
    (30 s): the key stayed pending, its store row taken, and later fetches queued behind the
    call on the one read thread. Now a key-store read is a miss at its deadline
    (``READ_DEADLINE``): the fetch whose call hangs keeps its row until the call returns and
    then frees it, and nothing the late call read becomes an entry; once the tier found the
    master hung (its probe unanswered, within seconds: offline) later reads are misses at
    once. (The epoch is kept fresh for the whole test: the fetch itself hangs, not an epoch
    read.)"""
    from hicache.controllers.kv_l3 import ABSENT_TTL, READ_DEADLINE

    d = l3_daemon(env={"HICACHE_L3_EPOCH_RECHECK": "600"})
    with d.client(name="f", timeout=30) as c:
        ep = tenant_page_in_l3(c, 79, ns="fetch")
        assert c.kv_put("c4_kv", ["k1"], [1]) == [True]
        written(c)
        want = [t[[0, 1]].clone() for t in ep.layers]
        ep.close()
    d.kill()
    d.start()  # empty host rows: the pages are in L3 only
    with d.client(name="f2", timeout=30) as c:
        wait_online(c)
        c4 = layout_of(c).pools["c4_kv"]
        ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=None)
        ep.attach(c, "c4_kv", "c4_kv", ns="fetch")
        assert c.kv_exists("c4_kv", ["k0", "k1"]) == [True, True]  # known present: fetched next
        used = _used(c)
        stop_process(store.master.pid)
        try:
            t0 = time.monotonic()
            assert c.kv_get("c4_kv", ["k0"], [2], l3_wait=15) == [False]  # its call hangs
            took = time.monotonic() - t0
            assert READ_DEADLINE <= took < READ_DEADLINE + 2, took
            # meanwhile the tier found the master hung (its probe went unanswered: offline),
            # so later reads are misses at once, neither queued behind the call nor waiting
            # out their deadline
            wait_offline(c, 10)
            assert "answered no probe" in c.stats()["l3"]["why"]
            t0 = time.monotonic()
            assert c.kv_get("c4_kv", ["k1"], [3], l3_wait=15) == [False]
            assert c.kv_exists("c4_kv", ["unknown"], l3_wait=15) == [False]  # a query too
            assert time.monotonic() - t0 < 2.0  # (at once; waiting out l3_wait is 15 s)
            l3 = c.stats()["kv_store"]["l3"]
            assert (l3["fetching"], l3["querying"]) == (0, 0), l3
            assert _used(c) == used + 1  # the hung call's row only
            assert c.kv_get("c4_kv", ["k0", "k1"], [2, 3], l3_wait=0) == [False, False]
        finally:
            os.kill(store.master.pid, signal.SIGCONT)
        deadline = time.monotonic() + 60
        while c.stats()["kv_store"]["l3"]["jobs"] and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.stats()["kv_store"]["l3"]["jobs"] == 0
        assert _used(c) == used  # the late call's row freed once, nothing made of what it read
        assert c.stats()["kv_store"]["entries"]["page"] == 0
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        time.sleep(ABSENT_TTL)  # the misses are forgotten
        assert c.kv_get("c4_kv", ["k0", "k1"], [2, 3], l3_wait=10) == [True, True]
        assert all(torch.equal(t[[2, 3]], w) for t, w in zip(ep.layers, want))
        ep.close()


def test_a_key_store_call_held_by_a_hung_storage_node_stalls_its_worker_not_a_stop(
        l3_daemon: Any, worker: Any, store: Any) -> None:
    """A storage node that hangs (the master answering) under a key-store epoch call held the
    meta worker until Mooncake's transfer gave up, and a stop waited for it: 26.2 s (the
    forty-fourth session's review). Now that call stalls the meta worker: the clear it held is
    answered at its deadline, the next clear fails at once naming the stalled store, and a stop
    exits in about a second."""
    d = l3_daemon()
    w = worker(d, 17)
    c = w.c
    c4 = layout_of(c).pools["c4_kv"]
    ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=4)
    ep.attach(c, "c4_kv", "c4_kv", ns="stl")
    assert c.kv_clear("stl") == 0
    stop_process(store.member.pid)
    try:
        h, _ = c.call("kv_clear", {"namespace": "stl", "deadline_ms": 1000})
        first = c.wait_ack(int(h["op"]), timeout=10, check=False)
        # (two CI runs found this clear answered in 1-2 ms with the member stopped, cause not
        # known: docs/reliability.md, section 8; what the next one looked like is kept here)
        assert not first.ok and "did not answer within 1000 ms" in first.error["message"], (
            first, c.stats()["l3"], thread_states(store.member.pid), store.log_tail(1500),
            d.output()[-1500:])
        t0 = time.monotonic()
        while "meta" not in c.stats()["l3"]["stalled"] and time.monotonic() - t0 < 10:
            time.sleep(0.05)
        l3 = c.stats()["l3"]
        assert l3["online"] and "key-store epoch call" in l3["stalled"]["meta"], l3
        t = time.monotonic()
        h, _ = c.call("kv_clear", {"namespace": "stl", "deadline_ms": 5000})
        second = c.wait_ack(int(h["op"]), timeout=10, check=False)
        assert time.monotonic() - t < 2.0, time.monotonic() - t  # (a wait is 5 s)
        assert not second.ok and second.error["message"].startswith(
            "kv_clear: a storage node of the L3 store holds the key store's calls"), second
        _, code, took = stop_taking_acks(d, c, [])
        out = d.output()
    finally:
        os.kill(store.member.pid, signal.SIGCONT)
    ep.close()
    stopped_soon(d, code, took, out, "the key store's call held by a hung storage node",
                 "wait on a storage node that does not answer (stalled: meta)")


def test_a_stop_does_not_wait_out_a_hung_master(l3_daemon: Any, worker: Any,
                                               store: Any) -> None:
    """A stop while the master hung waited for the L3 call stuck in Mooncake until its RPC
    timeout, then for Mooncake's teardown: ~40 s. Now, once the tier found the master hung,
    the stop answers every job still waiting and leaves the store client and the host arena to
    the process's exit: it exits cleanly in seconds. A put's ack says nothing was written
    (``misses: {stopping: 1}``); a ``kv_clear`` (a key-store job, acked through its ``expire``
    hook) says the daemon stopped and nothing was cleared here: the first version of this
    stop sent it no ack at all, and its engine waited out its own timeout (the forty-third
    session's review)."""
    d = l3_daemon()
    w = worker(d, 15)
    c = w.c
    host = c.alloc({s: 1 for s in SPACES})
    c.wait_ack(c.backup({s: ([0], host[s]) for s in SPACES}))
    c4 = layout_of(c).pools["c4_kv"]
    ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=3)
    ep.attach(c, "c4_kv", "c4_kv", ns="clr")
    assert c.kv_clear("clr") == 0  # the namespace has an epoch (the master answers)
    stop_process(store.master.pid)
    try:
        put = c.l3_put(["hs-0"], host)  # its call hangs (no deadline: only its call ends it)
        h, _ = c.call("kv_clear", {"namespace": "clr", "deadline_ms": 30000})
        wait_offline(c)
        (ack, clear), code, took = stop_taking_acks(d, c, [put, int(h["op"])])
        out = d.output()
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    ep.close()
    stopped_soon(d, code, took, out, "the master hung",
                 "wait on a master that does not answer; not waiting for Mooncake's timeout")
    assert ack.l3 == {"written": 0, "skipped": 0, "misses": {"stopping": 1}}, ack.l3
    assert not clear.ok and clear.error["code"] == "l3_failed", clear
    assert clear.error["message"].startswith("kv_clear: the daemon stopped while the L3 "
                                             "store did not answer; nothing was cleared "
                                             "here"), clear.error
