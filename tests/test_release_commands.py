"""``unregister`` and ``reset`` answer without waiting for the client's copies (issue 17, item 5).

A client with 0.87 GB of backups in flight sends ``unregister`` or ``reset``: the reply comes at
once with ``deferred: true``; its rows are pending (``stats`` ``pending_free``, refused ``busy``)
until those copies ended, then go back in time-bounded turns; the copies run to their end and
their acks still reach the client. Meanwhile another client (a
``Victim`` with known bytes in every space) keeps being answered, can allocate (never one of the
pending rows), and at the end its rows load back byte for byte; no row leaks and the allocator
check passes. CPU mode, a real daemon, shared-memory device pools."""
from __future__ import annotations

import os
import shutil
import time

import pytest

from hicache.core.layout import build_layout, preset
from hicache.engine.client import Client, CommandRefused
from hicache.engine.device_pools import DevicePools
from hicache.fuzz.runner import DaemonRunner, Victim, private_address

DEV_PAGE = 2048  # dsv4-tiny page rows of 141 KiB: 3 backups of 2048 rows = 0.87 GB
BACKUPS = 3
LAYOUT = build_layout(preset("dsv4-tiny"))


@pytest.fixture(scope="module")
def daemon():
    addr, d = private_address("hcrl-")
    r = DaemonRunner(addr, device_rows=f"page={DEV_PAGE * 2},swa_page=4,req_slot=4",
                     heartbeat_timeout=60, log_path=os.path.join(d, "daemon.log"))
    r.start()
    vic = Victim(addr, LAYOUT, {"page": 8, "swa_page": 4, "req_slot": 4}, name="victim")
    try:
        yield addr, vic
    finally:
        vic.close()
        r.stop()
        shutil.rmtree(d, ignore_errors=True)


def _used(c: Client) -> dict[str, int]:
    return {s: v["used"] for s, v in c.stats()["host"]["spaces"].items()}


def _start_big(addr: str) -> tuple[Client, DevicePools, list[int], list[int]]:
    """A client with 3 backups of 2,048 page rows (0.87 GB) just sent: (client, pools, its
    host rows, op ids)."""
    pools = DevicePools(LAYOUT, {"page": DEV_PAGE, "swa_page": 4, "req_slot": 4})
    c = Client(addr, timeout=60, name="big")
    c.register(pools)
    rows = [int(x) for x in c.alloc({"page": DEV_PAGE * BACKUPS})["page"]]
    dev = list(range(DEV_PAGE))
    ops = [c.backup({"page": (dev, rows[k * DEV_PAGE:(k + 1) * DEV_PAGE])})
           for k in range(BACKUPS)]
    return c, pools, rows, ops


def _until_back(vic: Victim, base: dict[str, int]) -> tuple[float, list[float]]:
    """Heartbeats of the victim every ~1 ms until the host rows in use are ``base`` and nothing
    is pending; returns (seconds it took, the heartbeat latencies)."""
    t0 = time.monotonic()
    lat: list[float] = []
    while time.monotonic() - t0 < 60:
        for _ in range(20):
            t = time.perf_counter()
            vic.client.heartbeat()
            lat.append(time.perf_counter() - t)
            time.sleep(0.001)
        s = vic.client.stats()
        if _used(vic.client) == base and not any(s["pending_free"].values()):
            break
    return time.monotonic() - t0, lat


def _check_clean(vic: Victim, base: dict[str, int]) -> None:
    assert _used(vic.client) == base
    assert vic.client.call("stats", {"check": True})[0]["invariants"] == "ok"
    assert vic.verify() == 0  # every byte of the other client as it was


def test_unregister_with_copies_in_flight_replies_at_once(daemon):
    addr, vic = daemon
    base = _used(vic.client)
    c, pools, rows, ops = _start_big(addr)
    try:
        t = time.perf_counter()
        r = c.unregister()
        reply_s = time.perf_counter() - t
        s = vic.client.stats()
        assert r["deferred"] is True and r["freed"] < len(rows), r
        assert s["in_flight"] >= 1  # the reply did not wait for the copies
        assert s["pending_free"]["page"] + r["freed"] == len(rows), s["pending_free"]
        got = [int(x) for x in vic.client.alloc({"page": 4})["page"]]  # never a pending row
        assert not set(got) & set(rows)
        took, lat = _until_back(vic, {**base, "page": base["page"] + 4})
        # the acks of its copies still come: the engine knows when its buffers are unused
        acks = [c.wait_ack(op, timeout=30) for op in ops]
        assert all(a.ok for a in acks), acks
        print(f"unregister: reply {reply_s * 1e3:.1f} ms, rows back after {took:.2f} s, "
              f"victim heartbeat max {max(lat) * 1e3:.1f} ms over {len(lat)} calls")
        assert reply_s < took / 2 and max(lat) < took / 2, (reply_s, max(lat), took)
        vic.client.free({"page": got})
        # forgotten once its copies ended: the same identity registers afresh
        c.register(pools)
        r = c.unregister()
        assert r["freed"] == 0 and r["deferred"] is False, r
        _check_clean(vic, base)
    finally:
        c.close()
        pools.close()


def test_a_small_unregistered_clients_ack_still_reaches_it(daemon):
    """256 rows go back in one release turn, the one that runs right after the copy completes:
    the client was forgotten before its ack went out, and the ack was dropped."""
    addr, vic = daemon
    base = _used(vic.client)
    pools = DevicePools(LAYOUT, {"page": 256, "swa_page": 4, "req_slot": 4})
    c = Client(addr, timeout=30, name="small", channel=False)
    try:
        for _ in range(3):
            c.register(pools)
            rows = c.alloc({"page": 256})["page"]
            op = c.backup({"page": (list(range(256)), rows)})
            assert op.ack is None  # queued, not inline: in flight at the unregister
            r = c.unregister()
            assert r["deferred"] is True, r
            a = c.wait_ack(op, timeout=10)
            assert a.ok and a.pools and all(v["rows"] == 256 for v in a.pools.values()), a
        _until_back(vic, base)
        _check_clean(vic, base)
    finally:
        c.close()
        pools.close()


def test_reset_with_copies_in_flight_replies_at_once_and_acks_follow(daemon):
    addr, vic = daemon
    base = _used(vic.client)
    c, pools, rows, ops = _start_big(addr)
    try:
        t = time.perf_counter()
        r = c.reset()
        reply_s = time.perf_counter() - t
        assert r["deferred"] is True and r["freed"] < len(rows), r
        # pending rows are refused, to the client itself too
        with pytest.raises(CommandRefused) as e:
            c.free({"page": rows[:2]})
        assert e.value.code == "busy"
        with pytest.raises(CommandRefused) as e:
            c.load({"page": (rows[-2:], [0, 1])})
        assert e.value.code == "busy"
        took, lat = _until_back(vic, base)
        print(f"reset: reply {reply_s * 1e3:.1f} ms, rows back after {took:.2f} s, victim "
              f"heartbeat max {max(lat) * 1e3:.1f} ms over {len(lat)} calls")
        assert reply_s < took / 2 and max(lat) < took / 2, (reply_s, max(lat), took)
        acks = [c.wait_ack(op, timeout=30) for op in ops]  # the copies ran to their end
        assert all(a.ok for a in acks), acks
        _check_clean(vic, base)
        # still registered: new rows, a copy into them, and a reset with nothing in flight
        again = [int(x) for x in c.alloc({"page": 200})["page"]]
        c.wait_ack(c.backup({"page": (list(range(200)), again)}))
        r = c.reset()  # a few hundred rows, nothing in flight: back before the reply
        assert r["freed"] == 200 and r["deferred"] is False, r
        assert _used(vic.client) == base
        c.unregister()
        _check_clean(vic, base)
    finally:
        c.close()
        pools.close()
