"""A ``kv_clear`` with L3 behind the key store holds across any daemon restart: real ``hicache
serve --l3 mooncake`` daemons, a real ``mooncake_master`` and storage member on loopback (the
fixtures of ``test_l3_mooncake``), engine pools in memfds of this process.

Each namespace's L3 objects are named under its epoch, kept in L3 (``controllers/kv_epochs.py``):
a clear writes a new epoch before it answers, so the old objects are unreachable whatever
becomes of their removal; a clear that cannot write it fails, naming why, and changes nothing;
another daemon on the store sees the clear within its recheck interval. Skipped only without
the Mooncake wheel.
"""
from __future__ import annotations

import hashlib
import os
import re
import signal
import time
from typing import Any

import pytest
import torch

from hicache.controllers import l3_format
from hicache.controllers.kv_l3 import kv_prefix
from hicache.engine import l3_master
from hicache.engine.acks import TransferFailed

from test_kv_l3 import layout_of, tenant_page_in_l3, written
from test_kv_store import EnginePool, _refused
from test_l3_mooncake import (SCOPE, l3_daemon, metric, raw_gets, raw_puts, store,  # noqa: F401
                              stop_process, wait_online)

pytestmark = pytest.mark.skipif(l3_master.mooncake_dir() is None,
                                reason="Mooncake wheel not installed (pip install 'hicache[l3]')")
EPOCH_VALUE = re.compile(rb"hc-epoch1:[0-9a-f]{32}")  # docs/l3.md


def _ns_dir(c: Any, ns: str) -> str:
    """Where the objects of the client namespace ``ns`` lie (docs/l3.md: ``<prefix>/<digest of
    the key store's namespace>/``; no CURVE key name here)."""
    prefix = kv_prefix(l3_format.namespace(layout_of(c), SCOPE))
    digest = hashlib.blake2b(("\x1f" + ns).encode(), digest_size=16).hexdigest()
    return f"{prefix}/{digest}/"


def _page_keys(store: Any, ns_dir: str) -> list[str]:
    """The stored objects of that namespace's key "k0" (whatever the epoch)."""
    return [k for k in store.keys() if k.startswith(ns_dir) and k.endswith("/k0")]


def _until(cond: Any, timeout: float, what: str) -> float:
    t0 = time.monotonic()
    while not cond():
        if time.monotonic() - t0 > timeout:
            raise AssertionError(f"{what}: not within {timeout} s")
        time.sleep(0.05)
    return time.monotonic() - t0


def test_a_stored_value_that_is_not_an_epoch_is_refused_with_the_reason() -> None:
    from hicache.controllers import kv_epochs

    good = kv_epochs.encode(kv_epochs.new_epoch())
    assert len(good) == 42 and kv_epochs.parse(good) == good[10:].decode()
    for raw, why in ((b"", "holds 0 bytes"), (good + b"\n", "holds 43 bytes"),
                     (b"hc-epoch2:" + good[10:], "does not start with hc-epoch1:"),
                     (good[:10] + b"__import__('os').system('x')"[:32].ljust(32, b"0"),
                      "no 32 lowercase hex digits"),
                     (good[:10] + good[10:].upper(), "no 32 lowercase hex digits")):
        with pytest.raises(ValueError, match=why):
            kv_epochs.parse(raw)


def test_a_clear_holds_across_a_restart_at_another_address_whatever_becomes_of_the_old_objects(
        l3_daemon: Any, store: Any) -> None:
    """A clear used to be held only until its removal ran, and a removal still pending when
    the daemon stopped was kept for the next daemon at the same address only. Here the
    removal runs, and then every object the namespace had before the clear is put back (as a
    removal that never ran, or a write that landed after it, would leave them); the daemon is
    killed and another one starts at another address: the cleared page is not served."""
    d1 = l3_daemon()
    with d1.client(name="clr", timeout=30) as c:
        ep = tenant_page_in_l3(c, 61, ns="gone")
        c4 = layout_of(c).pools["c4_kv"]
        ns_dir = _ns_dir(c, "gone")
        before = [k for k in store.keys() if k.startswith(ns_dir)]
        assert _page_keys(store, ns_dir), before
        saved = raw_gets(store, before)
        assert c.kv_clear("gone") == 1
        _until(lambda: not _page_keys(store, ns_dir), 20, "the old objects removed")
        ep.close()
    os.kill(d1.pid, signal.SIGKILL)
    d1.close()
    raw_puts(store, {k: v for k, v in saved.items() if v is not None})  # (put keeps what is there)
    assert _page_keys(store, ns_dir)  # the cleared page's object is back in the store
    d2 = l3_daemon()  # another address, another start
    assert d2.address != d1.address
    with d2.client(name="clr2", timeout=30) as c:
        wait_online(c)
        ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=None)
        ep.attach(c, "c4_kv", "c4_kv", ns="gone")
        assert c.kv_exists("c4_kv", ["k0"], l3_wait=10) == [False]
        assert c.kv_get("c4_kv", ["k0"], [2], l3_wait=10) == [False]
        assert not any(t.any() for t in ep.layers)  # not one byte of the cleared page
        # the namespace serves on under its new epoch
        ep.layers[0][1] = 7
        assert c.kv_put("c4_kv", ["k0"], [1]) == [True]
        written(c)
        ep.close()
    d3 = l3_daemon()
    with d3.client(name="clr3", timeout=30) as c:
        wait_online(c)
        ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=None)
        ep.attach(c, "c4_kv", "c4_kv", ns="gone")
        assert c.kv_get("c4_kv", ["k0"], [3], l3_wait=10) == [True]  # the page put after it
        assert bool((ep.layers[0][3] == 7).all())
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        ep.close()


def test_a_clear_the_master_does_not_answer_fails_visibly_and_changes_nothing(
        l3_daemon: Any, store: Any) -> None:
    """With the master hung (SIGSTOP) a clear returned at once and the page stayed in L3 until
    a removal ran. Now a clear that cannot write the namespace's new epoch fails with one line
    saying why, at its deadline; nothing changed (the host entry is still served) until the
    held call returns, and then the clear takes effect only if the epoch was written. A bad
    deadline is refused and drops nothing; with the master gone the clear fails at once."""
    d = l3_daemon()
    with d.client(name="hung", timeout=30) as c:
        ep = tenant_page_in_l3(c, 67, ns="hung")
        ek = _ns_dir(c, "hung") + "epoch"
        epoch = raw_gets(store, [ek])[ek]
        stop_process(store.master.pid)
        try:
            t0 = time.monotonic()
            with pytest.raises(TransferFailed, match="did not answer within 5000 ms") as e:
                c.kv_clear("hung")  # the default deadline
            took = time.monotonic() - t0
            assert "nothing was cleared" in str(e.value) and "\n" not in str(e.value)
            assert 5.0 <= took < 7.0, took
            assert c.kv_get("c4_kv", ["k0"], [2], l3_wait=0) == [True]  # still there
            assert c.stats()["kv_store"]["l3"]["clears"] == 1  # its call is still held
        finally:
            os.kill(store.master.pid, signal.SIGCONT)
        _until(lambda: not c.stats()["kv_store"]["l3"]["clears"], 60, "the held call returned")
        landed = raw_gets(store, [ek])[ek] != epoch
        print(f"the held epoch write {'landed' if landed else 'did not land'}")
        # either way the daemon agrees with the store: cleared here iff a new epoch is there
        assert c.kv_get("c4_kv", ["k0"], [3], l3_wait=10) == [not landed]
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        assert c.kv_put("c4_kv", ["k0"], [0]) == [True]
        msg = _refused("bad_field", c.kv_clear, "hung", deadline_ms=0)
        assert "deadline_ms must be in 1..60000" in msg
        assert c.kv_get("c4_kv", ["k0"], [2], l3_wait=0) == [True]  # nothing dropped
        store.kill_master()
        try:
            with pytest.raises(TransferFailed, match="kv_clear: ") as e:
                c.kv_clear("hung", deadline_ms=5000)
            assert "nothing was cleared" in str(e.value)
        finally:
            store.start_master()
            store.wait_mounted()
        ep.close()


def test_another_daemon_sees_a_clear_within_its_recheck_interval(l3_daemon: Any,
                                                                  store: Any) -> None:
    """Daemons A and B share a store and a namespace; B holds a page it read from L3. A clears
    the namespace: B read its epoch again within ``--l3-epoch-recheck`` (0.5 s here) while it
    used the namespace, found the new one, and dropped the page (before, B served it from its
    host rows forever). B's later writes go under the new epoch, and A reads them."""
    env = {"HICACHE_L3_EPOCH_RECHECK": "0.5"}
    a, b = l3_daemon(env=env), l3_daemon(env=env)
    with a.client(name="a", timeout=30) as ca, b.client(name="b", timeout=30) as cb:
        ea = tenant_page_in_l3(ca, 71, ns="shared")
        wait_online(cb)
        c4 = layout_of(cb).pools["c4_kv"]
        eb = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=None)
        eb.attach(cb, "c4_kv", "c4_kv", ns="shared")
        assert cb.kv_get("c4_kv", ["k0"], [1], l3_wait=10) == [True]  # from L3, now B's entry
        assert all(torch.equal(x[1], y[0]) for x, y in zip(eb.layers, ea.layers))
        assert cb.kv_get("c4_kv", ["k0"], [1], l3_wait=0) == [True]  # a host hit at B
        assert ca.kv_clear("shared") == 1
        seen = _until(lambda: cb.kv_get("c4_kv", ["k0"], [2], l3_wait=0) == [False], 10,
                      "B drops the cleared page")
        print(f"B saw the clear {seen:.2f} s after it returned")
        assert seen < 0.5 + 1.5, seen
        assert cb.kv_exists("c4_kv", ["k0"], l3_wait=10) == [False]
        eb.layers[0][3] = 9
        assert cb.kv_put("c4_kv", ["k1"], [3]) == [True]
        written(cb)
        assert ca.kv_get("c4_kv", ["k1"], [2], l3_wait=10) == [True]
        assert bool((ea.layers[0][2] == 9).all())
        for c in (ca, cb):
            assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        ea.close()
        eb.close()


def test_an_epoch_object_that_is_no_epoch_is_refused_and_never_trusted(l3_daemon: Any,
                                                                         store: Any) -> None:
    """The namespace's epoch object is overwritten with a value that is not an epoch: a
    daemon that reads it says so in one line, does not use the namespace's L3 objects (the
    page put before is not served, a new put is not written) until a clear writes a new
    epoch. Before, nothing was read and the old page came back."""
    d = l3_daemon()
    with d.client(name="m", timeout=30) as c:
        ep = tenant_page_in_l3(c, 73, ns="forged")
        ek = _ns_dir(c, "forged") + "epoch"
        c4 = layout_of(c).pools["c4_kv"]
        ep.close()
    d.kill()
    raw_puts(store, {ek: b"hc-epoch1:__import__('os').system('true')#"}, replace=True)
    d.start()
    with d.client(name="m2", timeout=30) as c:
        wait_online(c)
        ep = EnginePool(c4.num_layers, 4, c4.page_bytes, seed=5)
        ep.attach(c, "c4_kv", "c4_kv", ns="forged")
        before = ep.snapshot()
        assert c.kv_get("c4_kv", ["k0"], [2], l3_wait=10) == [False]
        assert all(torch.equal(x, y) for x, y in zip(ep.layers, before))
        assert c.kv_put("c4_kv", ["k1"], [1]) == [True]  # a host entry; not written to L3
        written(c)
        assert metric(c, "hicache_l3_errors_total", kind="epoch") >= 2  # the read, the write
        assert metric(c, "hicache_l3_pages_total", result="written") == 0
        lines = [ln for ln in d.log_path.read_text().splitlines() if "L3 epoch object" in ln]
        assert len(lines) == 1, lines
        assert ek in lines[0] and "no 32 lowercase hex digits" in lines[0]
        assert c.kv_clear("forged") == 1  # writes a well-formed epoch
        assert EPOCH_VALUE.fullmatch(raw_gets(store, [ek])[ek])
        assert c.kv_put("c4_kv", ["k2"], [0]) == [True]
        written(c)
        assert metric(c, "hicache_l3_pages_total", result="written") == 1
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        ep.close()


def test_clears_in_flight_are_bounded_while_the_master_hangs(l3_daemon: Any,
                                                             store: Any) -> None:
    """With the master hung, clears wait for their epoch writes: ``CLEARS_MAX`` of them are
    in flight at once, one more is refused ``busy``; once the master is back each is answered
    and the daemon holds nothing of them."""
    from hicache.controllers.kv_l3 import CLEARS_MAX

    d = l3_daemon()
    with d.client(name="many", timeout=30) as c:
        wait_online(c)
        stop_process(store.master.pid)
        try:
            ops = [int(c.call("kv_clear", {"namespace": f"n{i}", "deadline_ms": 60_000})[0]["op"])
                   for i in range(CLEARS_MAX)]
            msg = _refused("busy", c.call, "kv_clear", {"namespace": "one-more"})
            assert "clears wait for the L3 master" in msg
            assert c.stats()["kv_store"]["l3"]["clears"] == CLEARS_MAX
        finally:
            os.kill(store.master.pid, signal.SIGCONT)
        for op in ops:
            assert c.wait_ack(op, timeout=60).kv == {"dropped": 0}
        l3 = c.stats()["kv_store"]["l3"]
        assert (l3["clears"], l3["epoch_reads"]) == (0, 0), l3
        _until(lambda: not c.stats()["kv_store"]["l3"]["jobs"], 30, "the removals ran")
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_an_epoch_read_the_master_does_not_answer_is_a_miss_at_its_deadline(
        l3_daemon: Any, store: Any) -> None:
    """An epoch read held by a hung master (SIGSTOP) does not hold the namespace's keys
    pending for the master's RPC timeout: at the key store's read deadline they are misses
    (its host hits are served meanwhile), and once the master answers the namespace is read
    from L3 again."""
    from hicache.controllers.kv_epochs import FAILED_TTL
    from hicache.controllers.kv_l3 import READ_DEADLINE

    d = l3_daemon(env={"HICACHE_L3_EPOCH_RECHECK": "0.5"})
    with d.client(name="e", timeout=30) as c:
        ep = tenant_page_in_l3(c, 83, ns="slow")
        assert c.kv_put("c4_kv", ["k1"], [1]) == [True]
        written(c)
        stop_process(store.master.pid)
        try:
            time.sleep(0.6)  # the epoch is due for a read
            t0 = time.monotonic()
            assert c.kv_get("c4_kv", ["k0", "absent"], [2, 3], l3_wait=15) == [True, False]
            took = time.monotonic() - t0
            assert READ_DEADLINE <= took < READ_DEADLINE + 2, took
            assert c.kv_get("c4_kv", ["k1"], [2], l3_wait=0) == [True]  # host hits go on
        finally:
            os.kill(store.master.pid, signal.SIGCONT)
        _until(lambda: not c.stats()["kv_store"]["l3"]["jobs"], 60, "the held calls returned")
        time.sleep(FAILED_TTL)
        assert c.kv_exists("c4_kv", ["absent", "k0"], l3_wait=10) == [False, True]
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        ep.close()
