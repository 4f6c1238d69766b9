"""CPU end-to-end: a real ``hicache serve`` subprocess, shared-memory device pools of the
DSV4-Flash layout (8 page rows, 4 SWA rows, 4 request slots), the client library.

Every transfer test checks every byte: copied rows equal their source, untouched rows keep
their content. Refused commands must leave the daemon's state exactly as it was.
"""
from __future__ import annotations

import contextlib
import os
import re
import signal
import subprocess
import sys
import time
from typing import Any, Iterator

import numpy as np
import pytest
import torch
import zmq

from hicache.core import protocol as P
from hicache.engine.client import Client, CommandRefused, DaemonUnreachable
from hicache.engine.device_pools import DevicePools
from hicache.core.errors import UsageError
from hicache.kernels.reference import copy_tokens_ref
from hicache.kernels.tables import TokenFormat
from hicache.core.layout import build_layout, preset

ROWS = {"page": 8, "swa_page": 4, "req_slot": 4}
FLASH = build_layout(preset("dsv4-flash"))


def fill(pools: DevicePools, seed: int) -> None:
    g = torch.Generator().manual_seed(seed)
    for layers in pools.layers.values():
        for t in layers:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))


def snap(pools: DevicePools) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in pools.layers.items()}


@pytest.fixture
def worker(shared_daemon):
    """A registered client with random-filled Flash device pools."""
    pools = DevicePools(FLASH, ROWS)
    fill(pools, 1)
    c = shared_daemon.client(name="worker")
    c.register(pools)
    yield c, pools
    try:
        c.unregister()
    except (CommandRefused, DaemonUnreachable):
        pass
    c.close()
    pools.close()


def usage(c: Client) -> dict:
    s = c.stats()
    return {sp: (v["used"], v["free"]) for sp, v in s["host"]["spaces"].items()}


# ----------------------------------------------------------------------------- page-aligned rows
def test_backup_overwrite_load_every_pool(worker):
    c, pools = worker
    host = c.alloc({"page": 3, "swa_page": 2, "req_slot": 2}, request="r1")
    src = {"page": [1, 5, 7], "swa_page": [0, 3], "req_slot": [2, 1]}
    dst = {"page": [0, 2, 6], "swa_page": [2, 1], "req_slot": [0, 3]}
    before = snap(pools)
    acks = [c.wait_ack(c.backup({sp: (src[sp], host[sp])})) for sp in src]
    assert all(a.ok for a in acks)
    assert set().union(*(a.pools for a in acks)) == set(FLASH.pools)
    fill(pools, 2)  # overwrite every device byte
    after_overwrite = snap(pools)
    op = c.load({sp: (host[sp], dst[sp]) for sp in src})
    ack = c.wait_ack(op)
    assert ack.ok and ack.bytes == sum(
        len(src[p.index]) * p.page_bytes * p.num_layers for p in FLASH.pools.values())
    for name, spec in FLASH.pools.items():
        sp = spec.index
        for layer, (t, old, over) in enumerate(zip(pools.layers[name], before[name],
                                                   after_overwrite[name])):
            for s_row, d_row in zip(src[sp], dst[sp]):
                assert torch.equal(t[d_row], old[s_row]), (name, layer, s_row, d_row)
            untouched = [r for r in range(ROWS[sp]) if r not in dst[sp]]
            assert torch.equal(t[untouched], over[untouched]), (name, layer)
    c.free(host, request="r1")


def test_many_rows_async_path_and_push(worker):
    """Above the inline threshold: the worker thread copies, the ack is pushed and retained."""
    c, pools = worker
    host = c.alloc({"swa_page": 4})["swa_page"]
    before = snap(pools)
    op = c.backup({"swa_page": ([3, 2, 1, 0], host)})
    assert op.ack is None  # 4 SWA rows of 44 layers: far above the inline limit
    ack = c.wait_ack(op, timeout=30)
    assert ack.ok and ack.path
    fill(pools, 3)
    c.wait_ack(c.load({"swa_page": (host, [0, 1, 2, 3])}), timeout=30)
    for name in ("swa_kv", "c4_state", "c4_indexer_state"):
        for t, old in zip(pools.layers[name], before[name]):
            assert torch.equal(t, old.flip(0))
    c.free({"swa_page": host})


def test_poll_acks_returns_retained_ack(worker):
    c, _ = worker
    host = c.alloc({"swa_page": 2})["swa_page"]
    op = c.backup({"swa_page": ([0, 1], host)})
    deadline = time.monotonic() + 20
    got = []
    while not got and time.monotonic() < deadline:
        got = [a for a in c.poll_acks() if a.op == op.op_id]
        time.sleep(0.01)
    assert got and got[0].ok and got[0].kind == "backup"
    c.free({"swa_page": host})


# ----------------------------------------------------------------------------- token granular
@pytest.mark.parametrize("pool", ["c4_kv", "swa_kv", "c128_kv", "c4_indexer"])
def test_token_granular_backup_and_load(worker, pool):
    c, pools = worker
    spec = FLASH.pool(pool)
    P_ = spec.tokens_per_page
    fmt = TokenFormat.from_spec(spec)
    host_pages = c.alloc({spec.index: 2})[spec.index]
    rng = np.random.default_rng(5)
    n_dev = ROWS[spec.index] * P_
    n = min(5, P_ * 2)
    dev_tok = rng.choice(n_dev, n, replace=False).astype(np.int64)
    host_tok = np.array([host_pages[i % 2] * P_ + (i * 3) % P_ for i in range(n)],
                        dtype=np.int64)
    host_tok = np.unique(host_tok)[:n]
    dev_tok = dev_tok[:host_tok.size]
    before = snap(pools)
    c.wait_ack(c.backup({pool: (dev_tok, host_tok, "token")}))
    fill(pools, 9)
    over = snap(pools)
    back = rng.choice(n_dev, host_tok.size, replace=False).astype(np.int64)
    c.wait_ack(c.load({pool: (host_tok, back, "token")}))
    expect = [t.clone() for t in over[pool]]
    copy_tokens_ref(before[pool], expect, torch.from_numpy(dev_tok), torch.from_numpy(back), fmt)
    for t, e in zip(pools.layers[pool], expect):
        assert torch.equal(t, e)
    c.free({spec.index: host_pages})


# ----------------------------------------------------------------------------- request state
def test_swap_out_clear_swap_in(worker):
    c, pools = worker
    state_pools = [p.name for p in FLASH.space_pools("req_slot")]
    before = snap(pools)
    used0 = usage(c)
    out = c.swap_out(1, request="req-a")
    assert c.wait_ack(out).ok and out.host_row is not None
    c.wait_ack(c.clear_slot([1]))
    for name in state_pools:
        for t in pools.layers[name]:
            assert not t[1].any()
    inn = c.swap_in(out.host_row, 3, request="req-a")
    c.wait_ack(inn)
    for name in state_pools:
        for t, old in zip(pools.layers[name], before[name]):
            assert torch.equal(t[3], old[1])
            assert torch.equal(t[0], old[0]) and torch.equal(t[2], old[2])
    assert usage(c) == used0  # release=True gave the host row back


def test_swap_in_release_frees_its_host_row_only_once_the_copy_read_it(daemon_factory):
    """Every op goes to the copy worker (``inline_max_bytes`` 1) and a backup queued first
    keeps it busy (each of its pools' copies held 0.2 s by the ``slow_cpu_copy`` fault: on a
    loaded machine the worker had once finished both before the next command came), so the
    swap-in is still in flight when the next command comes: its host row (``release=True``)
    must not be handed out again before the swap-in's ack; the swap-in's bytes arrive."""
    d = daemon_factory(env={"HICACHE_INLINE_MAX_BYTES": "1"}, metrics=False,
                       fault="slow_cpu_copy=0.2")
    state_pools = [p.name for p in FLASH.space_pools("req_slot")]
    with DevicePools(FLASH, ROWS) as pools, d.client() as c:
        fill(pools, 5)
        c.register(pools)
        before = snap(pools)
        out = c.swap_out(1, request="req-a")
        assert c.wait_ack(out).ok
        host = c.alloc({"page": 8, "swa_page": 4})
        big = c.backup({"page": (list(range(8)), host["page"]),
                        "swa_page": (list(range(4)), host["swa_page"])})
        inn = c.swap_in(out.host_row, 3, request="req-a")
        assert inn.ack is None  # queued behind the backup, not run inline
        got = c.alloc({"req_slot": 1}, request="req-b")["req_slot"]
        assert out.host_row not in got  # still being read: not free yet
        assert c.wait_ack(big).ok and c.wait_ack(inn).ok
        for name in state_pools:
            for t, old in zip(pools.layers[name], before[name]):
                assert torch.equal(t[3], old[1])
        c.unregister()


def test_clear_slot_draft_rule_offline(daemon_factory):
    d = daemon_factory(extra=("--c128-state", "offline"), metrics=False)
    lay = build_layout(preset("dsv4-flash"), c128_state="offline")
    with DevicePools(lay, ROWS) as pools, d.client() as c:
        fill(pools, 4)
        before = snap(pools)
        c.register(pools)
        c.wait_ack(c.clear_slot([2], draft={"seq_lens": [126], "accept_lens": [1],
                                            "num_draft": 4}))
        for t, old in zip(pools.layers["c128_state"], before["c128_state"]):
            ring = t[2].view(torch.float32).view(128, -1)
            half = ring.shape[1] // 2
            for pos in range(128):
                if pos in (127, 0, 1):  # (126 + k) % 128 for k = 1, 2, 3
                    assert not ring[pos, :half].any()
                    assert torch.isneginf(ring[pos, half:]).all()
                else:
                    assert torch.equal(t[2].view(128, -1)[pos], old[2].view(128, -1)[pos])
            assert torch.equal(t[[0, 1, 3]], old[[0, 1, 3]])


# ----------------------------------------------------------------------------- refusals
def _state(c: Client, pools: DevicePools) -> tuple:
    s = c.stats()
    return ({sp: (v["used"], v["free"], v["owners"]) for sp, v in s["host"]["spaces"].items()},
            s["pending_free"], snap(pools))


def _same(a: tuple, b: tuple) -> bool:
    return a[0] == b[0] and a[1] == b[1] and all(
        torch.equal(x, y) for k in a[2] for x, y in zip(a[2][k], b[2][k]))


def test_refused_commands_change_nothing(shared_daemon, worker):
    c, pools = worker
    host = c.alloc({"page": 2, "swa_page": 1})
    with shared_daemon.client(name="other") as other:
        theirs = other.alloc({"page": 1})["page"]
        state0 = _state(c, pools)
        bad = [
            ("bad_rows", lambda: c.backup({"c128_kv": ([100], host["page"][:1])})),
            ("bad_rows", lambda: c.backup({"page": ([0, 1], host["page"][:1])})),
            ("bad_rows", lambda: c.load({"c4_kv": (host["page"], [3, 3])})),
            ("bad_rows", lambda: c.load({"c4_kv": ([-1, 0], [0, 1])})),
            ("not_owner", lambda: c.backup({"page": ([0], theirs)})),
            ("not_owner", lambda: c.load({"page": ([15], [0])})),
            ("bad_field", lambda: c.backup({"no_such_pool": ([0], host["page"][:1])})),
            ("bad_field", lambda: c.backup({"c4_state": ([0], host["swa_page"], "token")})),
            ("bad_field", lambda: c.backup({"c4_kv": ([0], host["page"][:1]),
                                            "page": ([1], host["page"][1:])})),
            ("no_space", lambda: c.alloc({"page": 10_000})),
            ("bad_field", lambda: c.alloc({"nowhere": 1})),
            ("not_owner", lambda: c.free({"page": theirs})),
            ("bad_rows", lambda: c.free({"page": [host["page"][0]] * 2})),
            ("bad_rows", lambda: c.swap_out(99)),
            ("bad_rows", lambda: c.swap_in(0, 99)),
            ("not_owner", lambda: c.swap_in(7, 0)),
            ("bad_rows", lambda: c.clear_slot([1, 1])),
            ("bad_field", lambda: c.clear_slot([1], draft={"seq_lens": [1], "num_draft": 2})),
            ("already_registered", lambda: c.register(DevicePools(FLASH, ROWS))),
            ("bad_field", lambda: c.poll_acks(max=0)),
            ("unsupported", lambda: c.load({"c4_kv": (host["page"][:1], [0])}, wait_event=0)),
        ]
        for code, fn in bad:
            other.heartbeat()  # snapshots of the Flash pools are slow: keep "other" from the reaper
            with pytest.raises(CommandRefused) as e:
                fn()
            assert e.value.code == code, (code, e.value)
            assert _state(c, pools)[:2] == state0[:2], code
        assert _same(_state(c, pools), state0)
        # a second free of the same rows is a double free, and still nothing changes
        c.free({"page": host["page"]})
        with pytest.raises(CommandRefused) as e:
            c.free({"page": host["page"]})
        assert e.value.code == "not_owner"
        other.free({"page": theirs})
    c.free({"swa_page": host["swa_page"]})


def test_unregistered_and_mismatched_workers_are_refused(shared_daemon):
    with shared_daemon.client() as c:
        with pytest.raises(CommandRefused) as e:
            c.backup({"page": ([0], [0])})
        assert e.value.code == "not_registered"
        other_stage = build_layout(preset("dsv4-flash"), pp_size=2, pp_rank=1)
        with DevicePools(other_stage, ROWS) as pools:
            with pytest.raises(CommandRefused) as e:
                c.register(pools)
            assert e.value.code == "layout_mismatch" and "stage" in e.value.message
        with DevicePools(FLASH, {"page": 8, "swa_page": 4, "req_slot": 4}) as pools:
            h = pools.handles()
            h["c4_kv"][0] = dict(h["c4_kv"][0], fd=1)  # names no descriptor handed in
            with pytest.raises(CommandRefused) as e:
                c.register(layout=FLASH.to_dict(), device_rows=pools.rows, buffers=h, mode="cpu",
                           fds=pools.fds())
            assert e.value.code == "bad_handle" and "names none" in e.value.message, e.value
            # numbers of the wrong type: refused with one line, not an internal error
            for key in ("rows", "row_bytes"):
                bad = {n: [dict(x, **{key: float(x[key])}) for x in hs] for n, hs in
                       pools.handles().items()}
                with pytest.raises(CommandRefused) as e:
                    c.register(layout=FLASH.to_dict(), device_rows=pools.rows, buffers=bad,
                               mode="cpu", fds=pools.fds())
                assert e.value.code == "bad_handle" and "shape" in e.value.message, e.value
            for rows in ({**pools.rows, "page": 8.0}, {**pools.rows, "page": "8"},
                         {**pools.rows, "page": True}):
                with pytest.raises(CommandRefused) as e:
                    c.register(layout=FLASH.to_dict(), device_rows=rows,
                               buffers=pools.handles(), mode="cpu", fds=pools.fds())
                assert e.value.code == "bad_field" and "device_rows" in e.value.message, e.value
        assert not c.heartbeat()["registered"]
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_malformed_frames_get_error_replies(shared_daemon):
    ctx = zmq.Context.instance()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.connect(shared_daemon.address)
    cases = [
        ([b"not json"], "bad_header"),
        ([b"[1,2]"], "bad_header"),
        ([b'{"v":9,"cmd":"stats","id":1}'], "bad_version"),
        ([b'{"v":1,"cmd":"pickle","id":2}'], "unknown_command"),
        ([b'{"v":1,"cmd":"stats","id":3,"x":1}'], "bad_field"),
        ([b'{"v":1,"cmd":"alloc","id":4,"counts":{"page":true}}'], "bad_field"),
        ([b'{"v":1,"cmd":"free","id":5,"rows":{"page":0}}', b"123"], "bad_frame"),
        ([b'{"v":1,"cmd":"free","id":6,"rows":{"page":3}}', b"\0" * 8], "bad_frame"),
        ([b'{"v":1,"cmd":"stats","id":7}'] + [b""] * (P.MAX_INDEX_FRAMES + 1), "bad_frame"),
        ([b'{"v":1,"cmd":"register","id":8,"layout":' + b"[" * 50 + b"]" * 50 + b"}"],
         "bad_header"),
    ]
    try:
        for frames, code in cases:
            s.send_multipart(frames)
            assert s.poll(5000)
            h, _ = P.decode_reply(s.recv_multipart())
            assert h["ok"] is False and h["error"]["code"] == code, (frames[0][:60], h)
        s.send_multipart(P.encode_request("heartbeat", 99))  # still serving
        assert s.poll(5000) and P.decode_reply(s.recv_multipart())[0]["id"] == 99
    finally:
        s.close(0)


# ----------------------------------------------------------------------------- freeing, reaping
def test_free_of_rows_in_flight_is_deferred(daemon_factory):
    """Every op goes to the copy worker (``inline_max_bytes`` 1) and a big backup is queued
    first, so the small backup is in flight when its rows are freed: the free is deferred (its
    rows are not handed out, nor freed twice) and they come back once the copy ended, with its
    bytes written. (It used to check the deferral only when the timing happened to give one;
    then, with one big backup ahead (88 MB), a fast CPU run finished both copies before the free
    arrived: six are queued ahead now, about 0.5 GB.)"""
    d = daemon_factory(env={"HICACHE_INLINE_MAX_BYTES": "1"}, metrics=False,
                       host=("--host-ratio", "8"))
    with DevicePools(FLASH, ROWS) as pools, d.client() as c:
        fill(pools, 6)
        c.register(pools)
        free0 = usage(c)["swa_page"][1]
        big_rows = c.alloc({"page": 48})["page"]
        bigs = [c.backup({"page": (list(range(8)), big_rows[8 * i:8 * i + 8])})
                for i in range(6)]
        host = c.alloc({"swa_page": 4})["swa_page"]
        op = c.backup({"swa_page": ([0, 1, 2, 3], host)})
        assert op.ack is None  # queued behind the big backup
        r = c.free({"swa_page": host})
        assert r["deferred"] is True and r["freed"] == 4, r
        assert usage(c)["swa_page"][1] == free0 - 4  # not back before the copy ended
        with pytest.raises(CommandRefused) as e:
            c.free({"swa_page": host})
        assert e.value.code in ("busy", "not_owner")
        assert all(c.wait_ack(b, timeout=30).ok for b in bigs) and c.wait_ack(op, timeout=30).ok
        deadline = time.monotonic() + 5
        while usage(c)["swa_page"][1] != free0 and time.monotonic() < deadline:
            time.sleep(0.01)
        assert usage(c)["swa_page"][1] == free0
        c.free({"page": big_rows})
        assert c.call("stats", {"check": True})[0]["invariants"] == "ok"
        c.unregister()


def test_a_stats_probe_is_forgotten_as_it_is_answered(daemon_factory):
    """A peer that asks for ``stats`` while it never registered and holds nothing is forgotten
    as it is answered: not among the clients it is told of, nor in the gauge, never counted
    as reaped (it used to count as a client until the heartbeat timeout). A peer that only
    sent a heartbeat is not forgotten by someone else's ``stats``."""
    d = daemon_factory(heartbeat_timeout=60, metrics=False)
    with d.client() as first:
        n = first.stats()["clients"]  # the fixture's readiness peer, if it stays
        with d.client() as probe:
            for _ in range(3):  # asked again: a new client each time, forgotten again
                s = probe.stats()
                assert s["clients"] == n
                gauge = s["metrics"]["hicache_clients_connected"][0]["value"]
                assert gauge == n
        with d.client() as quiet:
            quiet.heartbeat()
            s = first.stats()
            assert s["clients"] == n + 1  # the heartbeat peer stays; the asker does not count
        assert first.stats()["metrics"]["hicache_clients_reaped_total"][0]["value"] == 0


def test_stats_and_metrics_say_what_the_daemon_serves(daemon_factory):
    """With 8 daemons a host (and PP stages), ``stats`` and the metrics named none of model,
    stage, device or pid: now ``stats`` has them (``daemon``; its summary's first line) and
    ``hicache_daemon_info`` carries them as labels."""
    from hicache.cli.stats import summary

    d = daemon_factory(metrics=False)
    with d.client() as c:
        s = c.stats()
        me = s["daemon"]
        assert me["model"] == "dsv4-flash" and me["stage"] == [0, 1] and me["pid"] == d.pid
        assert me["socket"] == d.address and me["swa_mode"] in ("paged", "ring")
        assert me["host_split"] == "device" and 0 <= me["uptime_s"] < 600
        assert me["allow_shutdown"] is False
        (info,) = s["metrics"]["hicache_daemon_info"]
        assert info["value"] == 1 and info["labels"] == {
            "model": "dsv4-flash", "device": "cpu", "pp_rank": "0", "pp_size": "1",
            "swa_mode": me["swa_mode"], "host_split": "device", "socket": d.address}
        first = summary(s).splitlines()[0]
        assert first.startswith("device cpu: dsv4-flash stage 0/1 layers [0, ") and \
            f"pid {d.pid}, hicache " in first, first
        # a CPU daemon launches no copy kernel: no count, no summary line
        assert s["kernel_variants"] is None and "kernel variants" not in summary(s)


def test_silent_client_is_reaped(daemon_factory):
    d = daemon_factory(heartbeat_timeout=0.6, metrics=False)
    with d.client() as quiet, d.client() as watcher:
        rows = quiet.alloc({"page": 5})
        assert watcher.stats()["host"]["spaces"]["page"]["used"] == 5
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline:
            s = watcher.stats()  # the watcher keeps talking, the quiet one does not
            if s["host"]["spaces"]["page"]["used"] == 0:
                break
            time.sleep(0.2)
        assert s["host"]["spaces"]["page"]["used"] == 0
        reaped = s["metrics"]["hicache_clients_reaped_total"][0]["value"]
        assert reaped >= 1
        # the reaped client is a stranger now: its next call starts a fresh entry, which says
        # why the old one is gone, in the heartbeat and in every refusal, until it registers
        hb = quiet.heartbeat()
        assert not hb["registered"] and "silent for" in hb["reaped"]
        assert "heartbeat timeout of 0.6 s" in hb["reaped"]
        with pytest.raises(CommandRefused, match=r"not allocated.*this client was reaped "
                                                 r"\(silent for .*register again"):
            quiet.free(rows)
        assert watcher.heartbeat()["reaped"] is None  # others are not told anything
        with DevicePools(FLASH, ROWS) as pools:  # registering again closes the matter
            quiet.register(pools)
            assert quiet.heartbeat()["reaped"] is None
            quiet.unregister()


def test_dead_daemon_raises_daemon_unreachable(tmp_path):
    t0 = time.monotonic()
    with Client(f"ipc://{tmp_path}/nobody.sock", timeout=0.3) as c:
        with pytest.raises(DaemonUnreachable):
            c.heartbeat()
    assert time.monotonic() - t0 < 2.0


def test_a_request_that_went_out_without_a_reply_is_no_reply(tmp_path):
    """A peer took the request and never answered: ``NoReply`` (a ``DaemonUnreachable``: the
    daemon may have acted on it). A daemon that is not there at all is not ``NoReply``."""
    import zmq

    from hicache.engine.client import NoReply

    ctx = zmq.Context.instance()
    mute = ctx.socket(zmq.ROUTER)
    mute.bind(f"ipc://{tmp_path}/mute.sock")
    try:
        with Client(f"ipc://{tmp_path}/mute.sock", timeout=0.3) as c:
            with pytest.raises(NoReply, match="no reply"):
                c.heartbeat()
        assert mute.poll(1000), "the request did not go out"
    finally:
        mute.close(0)
    with Client(f"ipc://{tmp_path}/nobody.sock", timeout=0.3) as c:
        with pytest.raises(DaemonUnreachable) as e:
            c.heartbeat()
        assert not isinstance(e.value, NoReply)


def test_sigterm_shuts_down_cleanly(daemon_factory):
    d = daemon_factory(metrics=False)
    path = d.address[len("ipc://"):]
    assert os.stat(path).st_mode & 0o777 == 0o600
    with d.client() as c, DevicePools(FLASH, ROWS) as pools:
        c.register(pools)
        host = c.alloc({"swa_page": 4})["swa_page"]
        c.backup({"swa_page": ([0, 1, 2, 3], host)})  # in flight while we stop
        assert d.stop(signal.SIGTERM) == 143  # 128 + SIGTERM: stopped in order
        assert "stopped" in d.output()
        assert not os.path.exists(path)
        with pytest.raises(DaemonUnreachable):
            c.heartbeat(timeout=0.3)


def test_shutdown_command(daemon_factory):
    d = daemon_factory(metrics=False, extra=("--allow-shutdown",))
    with d.client(timeout=60) as c:  # (a loaded machine: it once timed out at 10 s)
        assert c.stats()["daemon"]["allow_shutdown"] is True
        rid = c._sock.getsockopt(zmq.ROUTING_ID).decode()
        # its reply can go with the daemon ("gone": an unread reply is lost when the daemon
        # exits, docs/reliability.md); the exit status and the log line say it ran
        assert c.shutdown()["stopping"] is True
    d.proc.wait(60)
    assert d.proc.returncode == 0, d.output()[-3000:]
    # said as what stopped it, as a signal is (a bare "stopped" before: operator review), by
    # the client's public label, never its routing id (its credential)
    (line,) = [x for x in d.output().splitlines() if x.startswith("hicache serve: stopped")]
    assert re.fullmatch(r"hicache serve: stopped by the shutdown command of client "
                        r"[^ ]*#[0-9a-f]{8}", line), line
    assert rid not in d.output()


def test_a_shutdown_whose_reply_went_with_the_daemon_says_gone(tmp_path):
    """A daemon that takes ``shutdown`` and exits before its reply is read: the engine's
    socket (IMMEDIATE) drops what it had not read when the connection goes, and the call
    raised ``GoneMidCall``, "whether it ran the command is unknown" (two CI runs). A daemon
    gone is what ``shutdown`` asks for: the call says so. Forced here with a bare ROUTER that
    answers one command, then takes ``shutdown`` and closes without a reply."""
    import threading

    addr = f"ipc://{tmp_path}/fake.sock"
    fake = zmq.Context.instance().socket(zmq.ROUTER)
    fake.bind(addr)
    got: list[str] = []

    def serve() -> None:
        try:
            for answer in (True, False):
                assert fake.poll(10_000), "no request came"
                ident, *body = fake.recv_multipart()
                h, _ = P.decode_request(body)
                got.append(h["cmd"])
                if answer:
                    fake.send_multipart([ident, *P.encode_reply(h["id"], {}, [])])
        finally:
            fake.close(0)  # the daemon's exit: its listener goes, nothing more is sent

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    with Client(addr, timeout=10) as c:
        c.call("heartbeat")  # answered: this client knows a daemon was there
        t0 = time.monotonic()
        out = c.shutdown()
        took = time.monotonic() - t0
    t.join(10)
    assert got == ["heartbeat", "shutdown"]
    assert out["stopping"] is True and out.keys() == {"stopping", "gone"}, out
    assert "refuses connections" in out["gone"] or "no socket file" in out["gone"], out
    assert took < 5, took  # found gone at the next check (GONE_CHECK_S), not at the timeout
    with Client(addr, timeout=0.3) as c2, pytest.raises(DaemonUnreachable):
        c2.shutdown()  # nobody there at all: unreachable, never "gone" made up


def test_shutdown_refused_by_default(daemon_factory):
    """Without --allow-shutdown a client cannot stop the daemon for the others: one clear
    refusal, counted as an error, and the daemon keeps serving every client."""
    from hicache.fuzz.runner import metric_total

    d = daemon_factory(metrics=False)
    with d.client() as c, d.client() as other:
        before = metric_total(c.stats(), "hicache_errors_total", kind="unsupported")
        with pytest.raises(CommandRefused) as e:
            c.shutdown()
        assert e.value.code == "unsupported"
        assert "--allow-shutdown" in str(e.value) and "SIGTERM" in str(e.value)
        other.heartbeat()
        st = c.stats()
        assert st["daemon"]["pid"] == d.proc.pid
        assert metric_total(st, "hicache_errors_total", kind="unsupported") == before + 1
    time.sleep(0.5)
    assert d.alive()
    assert "refused (no --allow-shutdown)" in d.output()  # the attempt is logged, once


# ----------------------------------------------------------------------------- serve config
def test_serve_refuses_bad_addresses_and_settings(tmp_path):
    from hicache.core.config import check_address, load_config

    assert check_address("tcp://127.0.0.1:5555") == "tcp"
    with pytest.raises(UsageError, match="use tcp://127.0.0.1:PORT"):  # ZMQ's IPv6 is off
        check_address("tcp://[::1]:5555")
    assert check_address("ipc:///tmp/x.sock") == "ipc"
    for addr, allow in [("tcp://10.0.0.1:5555", False), ("tcp://0.0.0.0:5555", True),
                        ("udp://x", False), ("ipc://@abstract", False)]:
        with pytest.raises(UsageError):
            check_address(addr, allow)
    toml = tmp_path / "serve.toml"
    toml.write_text('[serve]\npreset = "dsv4-flash"\nhost_mem = "1GiB"\n'
                    'metrics_port = 9000\ndevice_rows = { page = 8, swa_page = 4, req_slot = 4 }\n')
    cfg = load_config({"metrics_port": 9002}, str(toml), env={"HICACHE_METRICS_PORT": "9001",
                                                              "HICACHE_HOST_MEM": "2GiB"})
    assert cfg.metrics_port == 9002 and cfg.host_mem == 2 << 30 and cfg.device_rows == ROWS
    with pytest.raises(UsageError):
        load_config({"host_mem": "1GiB", "host_ratio": 2.0}, env={})
    with pytest.raises(UsageError):
        load_config(env={"HICACHE_DEVICE": "tpu"})
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--preset", "dsv4-flash",
                        "--host-mem", "1GiB", "--device-rows", "page=8,swa_page=4,req_slot=4",
                        "--socket", "tcp://192.0.2.1:5555"], capture_output=True, text=True,
                       timeout=60)
    assert r.returncode == 2 and "loopback" in r.stderr


# ----------------------------------------------------------------------------- scheduler
def test_cpu_engine_merges_queued_ops_and_keeps_order():
    """Ops queued behind a long one are merged per pool (distinct destinations) or run in
    order (overlapping destinations); every byte lands where the FIFO order says."""
    import threading

    from hicache.controllers.ops import Ids, Item, Operation
    from hicache.controllers.scheduler import Scheduler
    from hicache.kernels.tables import LayerTable

    woke = threading.Event()
    eng = Scheduler(torch.device("cpu"), woke.set, inline_max_bytes=0)
    big_src = LayerTable([torch.randint(0, 256, (64, 1 << 20), dtype=torch.uint8)], "bs")
    big_dst = LayerTable([torch.zeros(64, 1 << 20, dtype=torch.uint8)], "bd")
    src = LayerTable([torch.randint(0, 256, (16, 64), dtype=torch.uint8) for _ in range(3)], "s")
    dst = LayerTable([torch.zeros(16, 64, dtype=torch.uint8) for _ in range(3)], "d")

    def op(i, s_ids, d_ids, s=src, d=dst):
        it = Item("p", s, d, Ids.of(s_ids), Ids.of(d_ids), None, (0, 1, 2), len(s_ids) * 64)
        return Operation(i, "c", "backup", [it], nbytes=it.nbytes)

    ops = [op(0, list(range(64)), list(range(64)), big_src, big_dst)]  # keeps the worker busy
    ops += [op(i, [i], [i]) for i in range(1, 9)]  # distinct destinations: mergeable
    ops += [op(9, [10], [3]), op(10, [11], [3])]  # same destination twice: last one wins
    src0 = [t.clone() for t in src.layers]
    for o in ops:
        eng.submit(o)
    done: list = []
    deadline = time.monotonic() + 30
    while len(done) < len(ops) and time.monotonic() < deadline:
        woke.wait(0.5)
        woke.clear()
        done += eng.take_completed()
    assert eng.close()
    assert len(done) == len(ops) and all(o.ok for o in done)
    assert eng.merged_ops >= 1
    assert torch.equal(big_dst.layers[0], big_src.layers[0])
    for s_t, s0, d_t in zip(src.layers, src0, dst.layers):  # every byte: the rows no op
        want = torch.zeros_like(d_t)  # names stay 0, and the sources are unchanged
        for i in (1, 2, 4, 5, 6, 7, 8):
            want[i] = s_t[i]
        want[3] = s_t[11]
        assert torch.equal(d_t, want) and torch.equal(s_t, s0)


# ----------------------------------------------------------------------------- backup with alloc
def test_backup_with_alloc_is_one_round_trip_and_loads_back(worker):
    """``backup_new`` allocates the host rows itself (owner = client, request) in the same
    command; the rows it names hold the device bytes; a refused one allocates nothing."""
    c, pools = worker
    before_usage = usage(c)
    src = {"page": [6, 1, 3], "swa_page": [2, 0]}
    before = snap(pools)
    op = c.backup_new(src, request="conv-7")
    assert set(op.rows) == {"page", "swa_page"}
    assert [len(op.rows[s]) for s in src] == [3, 2]
    assert c.wait_ack(op).ok
    # the rows belong to (client, "conv-7"): a free for another request is refused
    with pytest.raises(CommandRefused) as e:
        c.free(op.rows, request="other")
    assert e.value.code == "not_owner"
    fill(pools, 9)
    dst = {"page": [0, 2, 4], "swa_page": [1, 3]}
    assert c.wait_ack(c.load({s: (op.rows[s], dst[s]) for s in src})).ok
    for name, spec in FLASH.pools.items():
        if spec.index not in src:
            continue
        for t, old in zip(pools.layers[name], before[name]):
            for s_row, d_row in zip(src[spec.index], dst[spec.index]):
                assert torch.equal(t[d_row], old[s_row]), name
    # refused (bad device row): nothing allocated, nothing changed
    used = usage(c)
    with pytest.raises(CommandRefused) as e:
        c.backup_new({"page": [0, 99]}, request="conv-8")
    assert e.value.code == "bad_rows" and usage(c) == used
    with pytest.raises(CommandRefused) as e:  # mismatched counts within one space
        c.backup_new({"c4_kv": [0, 1], "c4_indexer": [2]})
    assert e.value.code == "bad_rows" and usage(c) == used
    c.free(op.rows, request="conv-7")
    assert usage(c) == before_usage


def test_an_ack_in_a_late_poll_reply_is_kept():
    """A ``poll_acks`` reply that comes after its call timed out still hands its acks over
    (the daemon gave them up when it answered): they used to be dropped with the reply, so
    with the push lost too, every later ``wait_ack`` of the op timed out though it completed."""
    with _lost_acks_client() as (d, pools, c):
        c.register(pools)
        host = c.alloc({"page": 2})
        op = c.backup({"page": ([0, 1], host["page"])})
        assert op.ack is None  # queued: its ack is pushed (and lost) later
        time.sleep(0.5)
        os.kill(d.pid, signal.SIGSTOP)
        try:
            with pytest.raises(DaemonUnreachable):  # the poll times out
                c.wait_ack(op, timeout=0.4)
        finally:
            os.kill(d.pid, signal.SIGCONT)
        time.sleep(0.3)  # the daemon answers that poll now, late, with the ack
        assert c.wait_ack(op, timeout=3).ok


@contextlib.contextmanager
def _lost_acks_client() -> Iterator[tuple[Any, Any, Any]]:
    """A CPU daemon (dsv4-tiny, every copy queued) whose ack pushes are all lost
    (``fault_daemon``: acks only retained for ``poll_acks``), its device pools, and a client
    over ZMQ (closed after)."""
    from fault_daemon import faulty

    rows = {"page": 16, "swa_page": 16, "req_slot": 4}
    with faulty("lost_acks", device="cpu", preset="dsv4-tiny",
                device_rows=",".join(f"{k}={v}" for k, v in rows.items()),
                env={"HICACHE_INLINE_MAX_BYTES": "1"}) as d, \
            DevicePools(build_layout(preset("dsv4-tiny")), rows, device="cpu") as pools:
        c = d.client(channel=False)
        try:
            yield d, pools, c
        finally:
            c.close()


def test_an_op_a_restarted_daemon_lost_is_said_at_the_first_poll():
    """``wait_ack`` for an op whose daemon restarted meanwhile raises ``AckLost`` at its first
    poll (the new daemon's session of this client is not the one that issued it), and an op
    issued after re-registering is waited for as usual. It polled until its timeout before,
    though nothing on the new daemon would ever answer it. The same for a bare op id (not an
    ``Op``) asked after the client registered again (fiftieth session): the client compared
    the poll's session with its current one, the new registration's, so it polled until its
    timeout and raised a plain ``AckTimeout``; it now keeps the session each op id's reply came
    in. An id of this registration is waited for as usual."""
    from hicache.engine.acks import AckLost, AckTimeout

    with _lost_acks_client() as (d, pools, c):
        first = c.register(pools)["session"]
        host = c.alloc({"page": 4})["page"]
        op = c.backup({"page": ([0, 1], host[:2])})
        assert op.ack is None and op.session == first  # its ack is pushed (and lost)
        bare = c.backup({"page": ([2, 3], host[2:])}).op_id
        d.restart()
        t0 = time.monotonic()
        with pytest.raises(AckLost, match="no longer holds the registration"):
            c.wait_ack(op, timeout=20)
        assert time.monotonic() - t0 < 3  # the first poll, not the 20 s timeout
        assert issubclass(AckLost, AckTimeout)  # callers that handle a timeout handle it
        assert c.register(pools)["session"] != first
        t0 = time.monotonic()
        with pytest.raises(AckLost, match=f"op {bare}: the daemon no longer holds"):
            c.wait_ack(bare, timeout=8)
        assert time.monotonic() - t0 < 3
        host = c.alloc({"page": 2})
        op = c.backup({"page": ([0, 1], host["page"])})
        assert c.wait_ack(op, timeout=5).ok  # polled: this session's ack
        bare = c.backup({"page": ([2, 3], c.alloc({"page": 2})["page"])}).op_id
        assert c.wait_ack(bare, timeout=5).ok


def test_maybe_heartbeat_keeps_a_registered_client_under_a_short_timeout(daemon_factory):
    """``register`` tells the client the daemon's heartbeat timeout, so an idle engine calling
    ``maybe_heartbeat`` is not reaped under a timeout below its 3 s default interval (it was,
    at 2 s, and its host rows were freed)."""
    d = daemon_factory(heartbeat_timeout=2.0, metrics=False)
    with DevicePools(FLASH, ROWS) as pools, d.client() as c:
        h = c.register(pools)
        assert h["heartbeat_timeout"] == 2.0 and c.heartbeat_interval < 1.0
        end = time.monotonic() + 5
        while time.monotonic() < end:  # the engine's idle loop
            c.maybe_heartbeat()
            time.sleep(0.05)
        assert c.heartbeat()["registered"]
        c.unregister()


def test_device_pools_close_unmaps_its_memory():
    """CPU mode: ``close`` closes the pools' memfd and unmaps it (the whole device KV stayed
    mapped, and resident, while the object lived)."""
    p = DevicePools(FLASH, ROWS)
    fd = p.fds()[0]
    ino = os.fstat(fd).st_ino
    p.close()
    with open("/proc/self/maps") as f:
        assert not [ln for ln in f if ln.split()[4] == str(ino) and "memfd:" in ln]
    with pytest.raises(OSError):
        os.fstat(fd)  # closed (no test opens a descriptor meanwhile)
    with pytest.raises(ValueError):
        p.fds()


def test_wait_layer_of_a_load_said_failed_waits_for_its_ack(daemon_factory):
    """A GPU load whose issue failed records no more events: its layers' events hold an older
    load's records, which read as done. The reply or the "issued" notice now says ``failed``
    and ``wait_layer`` waits for the ack (which reports the failure) instead of returning on
    a stale event before that ack arrived. Driven here with stand-in events: the daemon has
    no such op, so the wait ends in ``AckTimeout``, never in a normal return."""
    from hicache.engine.acks import AckTimeout, Op

    class Stale:  # an event an earlier load recorded: done
        def query(self) -> bool:
            return True

    d = daemon_factory(metrics=False)
    with d.client() as c:
        c._load_events = [[Stale(), Stale()]]
        c.stage_layers, c._layer_pos = [0, 1], {0: 0, 1: 1}
        c._pushed({"v": 1, "k": "issued", "op": 7001, "failed": True})
        for op in (Op(7001, "load", event_set=0, issued=None),
                   Op(7002, "load", event_set=0, issued=None, failed=True)):
            with pytest.raises(AckTimeout):
                c.wait_layer(op, 1, timeout=0.5)
        c.wait_layer(Op(7003, "load", event_set=0, issued=None), 1, timeout=0.5)  # not failed


def test_register_is_logged_and_a_worker_bigger_than_the_sizing_is_warned(daemon_factory):
    """Every register says in the daemon's log who registered with which device rows, or why
    it was refused; a worker whose device pools hold as many rows as the host tier (the daemon
    was sized for smaller pools than the engine made) gets a WARNING naming the spaces, and
    ``stats`` lists each worker's device rows."""
    d = daemon_factory(device_rows="page=8,swa_page=4,req_slot=4")  # host rows: 16 / 8 / 8
    big = {"page": 16, "swa_page": 4, "req_slot": 4}
    with d.client(name="bigger") as c, DevicePools(FLASH, big) as pools:
        other = build_layout(preset("dsv4-flash"), pp_size=2, pp_rank=1)
        with DevicePools(other, ROWS) as wrong, pytest.raises(CommandRefused):
            c.register(wrong)
        c.register(pools, name="worker-big")
        s = c.call("stats", {})[0]
        assert list(s["worker_rows"].values()) == [big]
        from hicache.cli.stats import summary
        assert f"worker {next(iter(s['worker_rows']))}: device rows page=16, req_slot=4, " \
            "swa_page=4" in summary(s)
        c.unregister()
    log = d.log_path.read_text()
    assert "register refused (layout_mismatch)" in log, log[-2000:]
    assert "registered worker 'worker-big': device rows page=16, req_slot=4, swa_page=4" in log
    warn = [ln for ln in log.splitlines() if "WARNING" in ln and "worker-big" in ln]
    assert len(warn) == 1 and "page 16 device >= 16 host" in warn[0], warn
    assert "swa_page" not in warn[0]


def test_refused_registers_are_logged_without_flooding(caplog, monkeypatch):
    """A client retrying a refused register in a loop gets ``REFUSALS_LOGGED`` lines a window;
    the rest are counted in the next window's first line."""
    import logging
    from types import SimpleNamespace

    from hicache.controllers import handlers as H
    from hicache.core.protocol import ProtocolError

    monkeypatch.setattr(H, "_refusals", {"window": float("-inf"), "logged": 0, "skipped": 0})
    c = SimpleNamespace(cid="looping")
    with caplog.at_level(logging.INFO, logger="hicache.daemon"):
        for _ in range(H.REFUSALS_LOGGED + 5):
            H._log_refused(c, ProtocolError("layout_mismatch", "no"))
        assert len(caplog.records) == H.REFUSALS_LOGGED
        H._refusals["window"] -= H.REFUSALS_WINDOW_S + 1  # the window ends
        H._log_refused(c, ProtocolError("layout_mismatch", "no"))
    msgs = [r.getMessage() for r in caplog.records]
    assert msgs[-2] == "5 more refused registers were not logged"
    assert msgs[-1] == "client looping: register refused (layout_mismatch): no"


def test_a_call_on_a_closed_client_says_so(shared_daemon) -> None:
    """A call, ``drain`` or ``wait_ack`` after ``close()`` raised a raw ``zmq.ZMQError``
    (ENOTSOCK; client review): ``ClientClosed``, which a radix tree's hooks read as a host tier
    gone (its first version, a bare ``ValueError``, escaped the tree's ``prepare``: the diff
    review)."""
    from hicache.engine.acks import ClientClosed
    from hicache.engine.hooks import ClientHooks, HostUnavailable

    c = shared_daemon.client()
    c.heartbeat()
    c.close()
    with pytest.raises(ClientClosed, match="^heartbeat: this Client is closed$"):
        c.heartbeat()
    for fn in (c.drain, lambda: c.wait_ack(1, timeout=1), lambda: c.wait_ack(1, timeout=0)):
        with pytest.raises(ClientClosed, match="this Client is closed"):
            fn()
    c.close()  # twice: nothing happens
    hooks = ClientHooks(c, ["page", "swa_page"])
    with pytest.raises(HostUnavailable, match="this Client is closed"):  # the tree's word
        hooks.host_alloc(1)
