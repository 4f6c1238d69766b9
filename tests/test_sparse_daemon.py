"""HiSparse on a live CPU daemon: the sparse host region (a sealed memfd, 0600, that an engine
cannot truncate under the daemon), admission, backup from the worker's C4 device rows and decode
tokens, ownership, reaping, metrics, and refusals that change nothing. Then the engine's hot
buffer runs on the daemon's region."""
from __future__ import annotations

import contextlib
import errno
import os
import stat
import time
from typing import Any

import pytest
import torch

from hicache.core.fd_handout import FdHandout, fetch_fd
from hicache.core.layout import build_layout, preset
from hicache.engine.client import CommandRefused, DaemonUnreachable
from hicache.engine.device_pools import DevicePools

ROWS = {"page": 8, "swa_page": 4, "req_slot": 4}
FLASH = build_layout(preset("dsv4-flash"))
P, VB, SOFF = 64, 576, 36_864
EXTRA = ("--sparse-rows", "6", "--min-sparse-prompt-len", "300", "--sparse-clients", "4")


@pytest.fixture(scope="module")
def sparse_daemon(tmp_path_factory):
    """One daemon with a 6-row sparse region for the module; each test frees what it took."""
    from conftest import start_daemon

    d = start_daemon(tmp_path_factory.mktemp("sparse"), extra=EXTRA, heartbeat_timeout=3.0)
    yield d
    d.close()


def _worker(d, name="engine"):
    pools = DevicePools(FLASH, ROWS)
    g = torch.Generator().manual_seed(3)
    for t in pools.layers["c4_kv"]:
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    c = d.client(name=name)
    c.register(pools)
    return c, pools


def _leave(*pairs):
    """Unregister and close each (client, pools): the client's sparse region goes with it."""
    for c, pools in pairs:
        c.unregister()
        c.close()
        pools.close()


def test_region_admit_extend_free_bytes(sparse_daemon):
    c, pools = _worker(sparse_daemon)
    s = c
    info = s.sparse_region()
    assert info["rows"] == 6 and info["layers"] == 21 and info["min_sparse_prompt_len"] == 300
    from hicache.core.protocol import COMMANDS

    assert set(info) == set(COMMANDS["sparse_region"].reply)  # what the table declares
    fd = fetch_fd(info["fds"], info["token"], "sparse region")
    mode = stat.S_IMODE(os.fstat(fd).st_mode)
    os.close(fd)
    assert mode == 0o600, oct(mode)
    shm = s.map_sparse_region()
    # every row of the region first holds another request's bytes (freed): what a new page
    # shows must be what this request put there, or zeros
    assert len(s.sparse_admit("r0", 6 * P * 4, device_rows=[0, 1, 2, 3, 4, 5])) == 6
    assert s.sparse_free("r0") == 6
    assert all(t.any() for t in shm.layers)
    before = [t.clone() for t in shm.layers]
    # 400 full tokens = 100 C4 tokens -> 2 pages, backed up from device rows 5 and 2
    rows = s.sparse_admit("r1", 400, device_rows=[5, 2])
    assert len(rows) == 2
    for l, (h, d) in enumerate(zip(shm.layers, pools.layers["c4_kv"])):
        assert torch.equal(h[rows[0]], d[5]) and torch.equal(h[rows[1]], d[2]), l
        for r in range(6):
            if r not in rows:
                assert torch.equal(h[r], before[l][r]), "rows nobody owns changed"
    # decode: C4 tokens 100..130 arrive from device token locations (one more page)
    dev_tok = list(range(7, 7 + 31))
    rows2 = s.sparse_extend("r1", 131 * 4, device_tokens=dev_tok, first=100)
    assert rows2[:2] == rows and len(rows2) == 3
    for h, d in zip(shm.layers, pools.layers["c4_kv"]):
        for i, t in enumerate(range(100, 131)):
            hr, hs = rows2[t // P], t % P
            dr, ds = dev_tok[i] // P, dev_tok[i] % P
            assert torch.equal(h[hr, hs * VB:(hs + 1) * VB], d[dr, ds * VB:(ds + 1) * VB])
            assert torch.equal(h[hr, SOFF + hs * 8: SOFF + hs * 8 + 8],
                               d[dr, SOFF + ds * 8: SOFF + ds * 8 + 8])
        # the page the extend added: zero past its 3 tokens (values and scales); the page
        # before keeps its admitted tokens 64..99
        new = rows2[2]
        assert not h[new, 3 * VB:SOFF].any() and not h[new, SOFF + 3 * 8:SOFF + P * 8].any()
        assert torch.equal(h[rows[1], :36 * VB], d[2, :36 * VB])
        assert torch.equal(h[rows[1], SOFF:SOFF + 36 * 8], d[2, SOFF:SOFF + 36 * 8])
    assert s.sparse_free("r1") == 3
    with pytest.raises(CommandRefused, match="unknown sparse request"):
        s.sparse_free("r1")
    c.unregister()
    c.close()
    pools.close()


def test_the_planner_counts_the_host_pages_an_admission_takes(sparse_daemon):
    """``hicache plan --hisparse``'s host C4 KV per request is the rows the daemon gives it,
    also when the prompt's tokens modulo 256 are 1-3 (no C4 entry yet for those tokens: the
    planner used to count one page more there)."""
    from hicache.core.hisparse_plan import hisparse_plan

    c, pools = _worker(sparse_daemon)
    c.sparse_region()
    c4_row = FLASH.pools["c4_kv"].page_bytes * FLASH.pools["c4_kv"].num_layers
    try:
        for tokens in (4 * P * 4, 4 * P * 4 + 1, 4 * P * 4 + 3, 4 * P * 4 + 4, 5 * P * 4 - 1):
            planned = hisparse_plan([FLASH], 1 << 40, tokens).stages[0].host_c4_bytes
            got = len(c.sparse_admit("p", tokens))
            c.sparse_free("p")
            assert planned == got * c4_row, (tokens, planned // c4_row, got)
    finally:
        _leave((c, pools))


def test_admit_reuses_host_tier_prefix_hits(sparse_daemon):
    """The prompt's first pages are host-tier prefix hits (c4_kv rows this client backed up):
    they come from host memory, byte for byte, while the device rows they were backed up from
    now hold other bytes; the rest comes from device_rows. Nothing else changes."""
    c, pools = _worker(sparse_daemon)
    dev = pools.layers["c4_kv"]
    host = c.alloc({"page": 2}, request="prefix")["page"]
    assert c.wait_ack(c.backup({"c4_kv": ([1, 4], host)})).ok
    prefix = [(t[1].clone(), t[4].clone()) for t in dev]
    g = torch.Generator().manual_seed(11)
    for t in dev:  # the device rows the hits came from now hold other bytes
        t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    shm = c.map_sparse_region()
    before = [t.clone() for t in shm.layers]
    # 800 tokens = 200 C4 tokens = 4 pages: 2 prefix hits + 2 from device rows 6 and 3
    h, arr = c.call("sparse_admit", {"request": "hit", "prompt_tokens": 800, "host_rows": 0,
                                     "device_rows": 1}, [host, [6, 3]])
    rows = [int(x) for x in arr[0]]
    assert (h["pages"], h["reused_pages"], len(rows)) == (4, 2, 4)
    # 4 pages x 21 layers: above the inline limit, so the copy ran on the scheduler's worker
    # (not the server loop); its ack tells when the rows are filled
    assert "op" in h and "ack" not in h, h
    ack = c.wait_ack(h["op"])
    assert ack.ok and ack.kind == "sparse_backup" and ack.bytes == 4 * 37_440 * 21, ack
    for l, (hl, dl) in enumerate(zip(shm.layers, dev)):
        assert torch.equal(hl[rows[0]], prefix[l][0]) and torch.equal(hl[rows[1]], prefix[l][1]), l
        assert torch.equal(hl[rows[2]], dl[6]) and torch.equal(hl[rows[3]], dl[3]), l
        for r in set(range(6)) - set(rows):
            assert torch.equal(hl[r], before[l][r]), "rows nobody owns changed"
    # only hits, no device rows: the rest of the pages are left for sparse_extend
    assert c.sparse_free("hit") == 4
    rows2 = c.sparse_admit("hit2", 2 * 64 * 4, host_rows=host[::-1])
    for l, hl in enumerate(shm.layers):
        assert torch.equal(hl[rows2[0]], prefix[l][1]) and torch.equal(hl[rows2[1]], prefix[l][0])
    assert c.sparse_free("hit2") == 2
    c.free({"page": host}, request="prefix")
    _leave((c, pools))


def test_prefix_hits_refused_change_nothing(sparse_daemon):
    """host_rows that are not this client's, not written, too many, out of range, or a
    device_rows frame that does not cover the rest: one clear refusal, nothing taken."""
    a, pa = _worker(sparse_daemon, "a")
    b, pb = _worker(sparse_daemon, "b")
    mine = a.alloc({"page": 2}, request="p")["page"]
    assert a.wait_ack(a.backup({"c4_kv": ([0, 1], mine)})).ok
    theirs = b.alloc({"page": 1}, request="p")["page"]
    assert b.wait_ack(b.backup({"c4_kv": ([2], theirs)})).ok
    blank = a.alloc({"page": 1}, request="q")["page"]  # allocated, never backed up
    shm = a.map_sparse_region()
    snap = [t.clone() for t in shm.layers]
    cases = [
        (dict(host_rows=theirs), "not_owner", "not yours"),
        (dict(host_rows=blank), "not_written", "holds nothing you backed up"),
        (dict(host_rows=mine + mine), "bad_rows", "the prompt has 2 C4 pages"),
        (dict(host_rows=[10 ** 6]), "bad_rows", "out of range"),
        (dict(host_rows=mine[:1], device_rows=[3, 4]), "bad_rows", "1 of them from host_rows"),
    ]
    for kw, code, msg in cases:
        with pytest.raises(CommandRefused) as e:
            a.sparse_admit("r", 2 * 64 * 4, **kw)
        assert e.value.code == code and msg in e.value.message, (kw, e.value.code, e.value.message)
    assert all(torch.equal(x, y) for x, y in zip(snap, shm.layers)), "region bytes changed"
    assert len(a.sparse_admit("all", 6 * 64 * 4)) == 6, "sparse rows were taken"
    assert a.sparse_free("all") == 6
    _leave((a, pa), (b, pb))


@pytest.mark.parametrize("call, code, msg", [
    (lambda s: s.sparse_admit("short", 299), "unsupported", "below min_sparse_prompt_len 300"),
    (lambda s: s.sparse_admit("big", 7 * 64 * 4), "no_space", "sparse host rows needed"),
    (lambda s: s.sparse_admit("r0", 2000), "bad_field", "already admitted"),
    (lambda s: s.sparse_admit("r9", 300, device_rows=[1, 2, 3]), "bad_rows", "take 2"),
    (lambda s: s.sparse_admit("r9", 300, device_rows=[99, 1]), "bad_rows", "out of range"),
    (lambda s: s.sparse_extend("nope", 2000), "bad_field", "unknown sparse request"),
    (lambda s: s.sparse_extend("r0", 300), "bad_field", "would shrink"),
    (lambda s: s.sparse_extend("r0", 4000, device_tokens=[1], first=2000), "bad_rows", "outside"),
    (lambda s: s.sparse_extend("r0", 4000, device_tokens=[1]), "bad_field", "go together"),
    (lambda s: s.sparse_extend("r0", 600, device_tokens=[10 ** 6], first=0), "bad_rows", "out of range"),
    (lambda s: s.sparse_report(5, 6), "bad_field", "swapped_in <= lookups"),
])
def test_refusals_change_nothing(sparse_daemon, call, code, msg):
    c, pools = _worker(sparse_daemon)
    s = c
    s.sparse_admit("r0", 400)  # 100 C4 tokens: 2 of the 6 rows
    shm = s.map_sparse_region()
    snap = [t.clone() for t in shm.layers]
    with pytest.raises(CommandRefused) as e:
        call(s)
    assert e.value.code == code and msg in e.value.message, (e.value.code, e.value.message)
    assert all(torch.equal(a, b) for a, b in zip(snap, shm.layers)), "region bytes changed"
    assert len(s.sparse_admit("fill", 4 * 64 * 4)) == 4, "free rows changed"
    assert s.sparse_free("r0") == 2 and s.sparse_free("fill") == 4
    _leave((c, pools))


def test_pages_an_admission_does_not_fill_are_zeroed(sparse_daemon):
    """A row freed by one request and admitted by another without ``device_rows`` reads zeros,
    not the earlier request's C4 KV."""
    a, pa = _worker(sparse_daemon, "a")
    try:
        shm = a.map_sparse_region()
        rows_a = a.sparse_admit("ra", 6 * 64 * 4, device_rows=list(range(6)))  # every row
        assert all(bool(t[rows_a].any()) for t in shm.layers)  # random KV from a's device
        assert a.sparse_free("ra") == 6
        rows_b = a.sparse_admit("rb", 2 * 64 * 4)
        assert all(not t[rows_b].any() for t in shm.layers)
        assert a.sparse_free("rb") == 2
    finally:
        _leave((a, pa))


def test_each_client_has_its_own_region(sparse_daemon):
    """Two engines get two regions: neither maps the other's rows, and one's admissions take
    nothing from the other's. Another's request is unknown to it (``bad_field``, as a name
    nobody admitted: nothing tells it the name is taken), and it may admit the same name for
    itself. A dead client's
    region goes after its reap; one that unregisters loses its region at once; ``reset``
    keeps it (the engine's mapping stays valid)."""
    from conftest import region_held

    a, pa = _worker(sparse_daemon, "a")
    b, pb = _worker(sparse_daemon, "b")
    ia, ib = a.sparse_region(), b.sparse_region()
    assert ia["token"] != ib["token"] and ia["rows"] == ib["rows"] == 6
    assert a.sparse_region() == ia  # asking again names the same region
    sa, sb = a.map_sparse_region(), b.map_sparse_region()
    rows_a = a.sparse_admit("mine", 5 * 64 * 4, device_rows=[0, 1, 2, 3, 4])  # 5 of a's 6
    snap_a = [t.clone() for t in sa.layers]
    for call in (lambda: b.sparse_extend("mine", 5 * 64 * 4), lambda: b.sparse_free("mine"),
                 lambda: b.sparse_free("nobody's")):
        with pytest.raises(CommandRefused) as e:
            call()
        assert e.value.code == "bad_field" and "unknown sparse request" in e.value.message
    rows_b = b.sparse_admit("mine", 6 * 64 * 4)  # a's name, b's own request: all of b's region
    assert len(rows_b) == 6 and all(not t.any() for t in sb.layers)  # zeros, never a's KV
    assert all(torch.equal(x, y) for x, y in zip(snap_a, sa.layers)), "a's region changed"
    assert all(bool(t[rows_a].any()) for t in sa.layers)
    assert b.sparse_free("mine") == 6
    assert a.sparse_extend("mine", 5 * 64 * 4) == rows_a  # a's request is still a's
    b.reset()
    assert b.sparse_region() == ib and region_held(ib)  # (b's first reply's hand-out is left)
    _leave((b, pb))
    assert not region_held(ib), "an unregistered client's region is left open"
    for _ in range(60):  # hand-outs for the loop below to take: more than its turns
        assert a.sparse_region() == ia
    a.close()  # no unregister, no heartbeats: reaped after the 3 s timeout
    deadline = time.monotonic() + 15
    while region_held(ia):
        assert time.monotonic() < deadline, "a dead client's region was never closed"
        time.sleep(0.3)
    pa.close()


def test_sparse_clients_bounds_the_regions(tmp_path):
    """``--sparse-clients 1``: a second client's first sparse command is refused ``no_space``
    naming the option, and changes nothing; once the first unregisters, the second gets a new
    region (never the first's)."""
    from conftest import region_held, start_daemon

    d = start_daemon(tmp_path, extra=("--sparse-rows", "2", "--min-sparse-prompt-len", "256"))
    try:
        a, pa = _worker(d, "a")
        b, pb = _worker(d, "b")
        first = a.sparse_region()
        for call in (b.sparse_region, lambda: b.sparse_admit("r", 256)):
            with pytest.raises(CommandRefused) as e:
                call()
            assert e.value.code == "no_space" and "--sparse-clients 1" in e.value.message
        assert len(a.sparse_admit("r", 2 * 64 * 4)) == 2  # a's region is whole
        assert a.sparse_free("r") == 2
        _leave((a, pa))
        second = b.sparse_region()
        assert second["token"] != first["token"] and not region_held(first)
        assert len(b.sparse_admit("r", 2 * 64 * 4)) == 2
        assert b.call("stats", {"check": True})[0]["invariants"] == "ok"
        _leave((b, pb))
    finally:
        d.close()


def _touch_rows(a, r: str) -> list[int]:
    """Commands that make the daemon write A's region: an admission without device rows (its
    pages zeroed), an extend by one page (zeroed), an admission copied from device rows."""
    rows = a.sparse_admit(r, 2 * 64 * 4)
    rows = a.sparse_extend(r, 3 * 64 * 4)
    return rows + a.sparse_admit(r + "-copy", 2 * 64 * 4, device_rows=[5, 2])


def test_an_engine_that_truncates_its_region_cannot_take_the_daemon_down(tmp_path):
    """Engine A truncates its sparse region (through the path ``sparse_region`` names, as any
    process of its uid could) to half its rows, then to nothing, then grows it, and after each
    makes the daemon write the region (zeroing rows, copying device rows into them): the daemon
    maps that memory too, and died of SIGBUS at its first such write (exit -7), every client's
    work with it. The region is sealed now: each truncate is refused (EPERM), the daemon lives,
    A's region holds what the daemon wrote, and engine B is served."""
    from conftest import start_daemon

    d = start_daemon(tmp_path, extra=("--sparse-rows", "6", "--min-sparse-prompt-len", "256",
                                      "--sparse-clients", "2"))
    try:
        (a, pa), (b, pb) = _worker(d, "a"), _worker(d, "b")
        shm, info = a.map_sparse_region(), a.sparse_region()
        fd = fetch_fd(info["fds"], info["token"], "sparse region")
        full = os.fstat(fd).st_size
        try:
            for i, size in enumerate((info["bytes"] // 2, 0, full + 4096)):
                try:
                    os.ftruncate(fd, size)
                    refused = None
                except OSError as e:
                    refused = e.errno
                rows = []
                with contextlib.suppress(DaemonUnreachable):
                    rows = _touch_rows(a, f"r{i}")
                assert d.alive(), (f"A's region truncated to {size} bytes killed the daemon "
                                   f"(exit status {d.returncode})")
                assert refused == errno.EPERM and os.fstat(fd).st_size == full, (size, refused)
                for h, dv in zip(shm.layers, pa.layers["c4_kv"]):
                    assert not h[rows[:3]].any()  # zeroed
                    assert torch.equal(h[rows[3]], dv[5]) and torch.equal(h[rows[4]], dv[2])
                assert a.sparse_free(f"r{i}") == 3 and a.sparse_free(f"r{i}-copy") == 2
                got = b.sparse_admit("b", 2 * 64 * 4, device_rows=[1, 4])  # B is served
                assert len(got) == 2 and b.sparse_free("b") == 2
        finally:
            os.close(fd)
        assert b.call("stats", {"check": True})[0]["invariants"] == "ok"
        _leave((a, pa), (b, pb))
    finally:
        d.close()


def test_no_sparse_region_is_refused(shared_daemon):
    c = shared_daemon.client(name="x")
    with pytest.raises(CommandRefused) as e:
        c.sparse_region()
    assert e.value.code == "unsupported" and "--sparse-rows" in e.value.message
    c.close()


def test_metrics_and_hot_buffer_on_the_daemon_region(sparse_daemon):
    from hicache.engine.hot_buffer import HotBuffer

    c, pools = _worker(sparse_daemon)
    s = c
    n_c4 = 3 * 64
    rows = s.sparse_admit("long", n_c4 * 4, device_rows=[0, 3, 6])
    shm = s.map_sparse_region()
    spec = FLASH.pool("c4_kv")
    hb = HotBuffer(shm.layers, fmt=spec, topk=16, slots=32, max_requests=2, max_batch=2,
                   max_tokens=n_c4, impl="reference")
    hb.admit(0, n_c4, rows)
    ids = torch.arange(0, 16, dtype=torch.int64) * 11
    out = hb.swap_in(0, torch.tensor([0]), ids[None])
    dev, host = hb.dev.layers[0], pools.layers["c4_kv"][0]
    src_rows = [0, 3, 6]
    for t, loc in zip(ids.tolist(), out[0].tolist()):
        d = host[src_rows[t // P], (t % P) * VB:(t % P + 1) * VB]
        assert torch.equal(dev[loc // P, (loc % P) * VB:(loc % P + 1) * VB], d)
    lookups, copied = hb.hits()[0]
    s.sparse_report(lookups, copied)
    want = [f"hicache_hisparse_lookups_total {float(lookups)}",
            f"hicache_hisparse_swapped_in_bytes_total {float(copied * 584)}",
            'hicache_hisparse_host_rows{state="used"} 3.0', "hicache_hisparse_requests 1.0"]
    deadline = time.monotonic() + 10  # gauges refresh on the daemon's housekeeping tick
    while True:
        text = sparse_daemon_metrics(sparse_daemon)
        missing = [w for w in want if w not in text]
        if not missing:
            break
        assert time.monotonic() < deadline, missing
        c.heartbeat()
        time.sleep(0.2)
    s.sparse_free("long")
    _leave((c, pools))


def sparse_daemon_metrics(d) -> str:
    import urllib.request
    return urllib.request.urlopen(f"http://127.0.0.1:{d.metrics_port}/metrics", timeout=10).read().decode()


# ----------------------------------------------------------------------------- fuzz
from hypothesis import HealthCheck, given, settings  # noqa: E402
from hypothesis import strategies as st  # noqa: E402

_NAMES = st.one_of(st.just("victim"), st.just(""), st.text(min_size=1, max_size=8),
                   st.just("x" * 200))
_INTS = st.one_of(st.integers(-2**63, 2**63 - 1), st.integers(-5, 3000))


def _hostile():
    """Messages of an attacker that must all be refused (never ok)."""
    rows = st.lists(st.integers(-2**40, 2**40), max_size=12)
    return st.one_of(
        st.tuples(st.just("sparse_extend"), st.fixed_dictionaries(
            {"request": st.just("victim"), "tokens": _INTS}), st.just([])),
        st.tuples(st.just("sparse_free"), st.fixed_dictionaries({"request": _NAMES}),
                  st.just([])),
        st.tuples(st.just("sparse_admit"), st.fixed_dictionaries(
            {"request": _NAMES, "prompt_tokens": st.integers(-2**63, 299)}), st.just([])),
        st.tuples(st.just("sparse_admit"), st.fixed_dictionaries(
            {"request": st.just("huge"), "prompt_tokens": st.integers(7 * 64 * 4, 2**62)}),
            st.just([])),
        st.tuples(st.just("sparse_admit"), st.fixed_dictionaries(
            {"request": st.just("rows"), "prompt_tokens": st.just(300), "device_rows": st.just(0)}),
            rows.filter(lambda r: len(r) != 2 or min(r) < 0 or max(r) >= 8).map(lambda r: [r])),
        st.tuples(st.just("sparse_report"), st.fixed_dictionaries(
            {"lookups": st.integers(-10, 10), "swapped_in": st.integers(-10, 30)}).filter(
                lambda d: not 0 <= d["swapped_in"] <= d["lookups"]), st.just([])),
    )


@pytest.fixture
def fuzz_world(sparse_daemon):
    # one test's: its two clients, silent once it ends, would be reaped (3 s timeout) by the
    # time a module-scoped teardown ran after the module's later tests
    v, vp = _worker(sparse_daemon, "victim")
    sv = v
    rows = sv.sparse_admit("victim", 300, device_rows=[4, 5])  # 2 rows; 4 free
    a, ap = _worker(sparse_daemon, "attacker")
    shm = sv.map_sparse_region()
    yield sv, a, shm, rows
    sv.sparse_free("victim")
    _leave((v, vp), (a, ap))


@settings(max_examples=30, deadline=None, suppress_health_check=list(HealthCheck))
@given(msg=_hostile())
def test_fuzz_sparse_commands_refused_and_change_nothing(fuzz_world, msg):
    sv, sa, shm, rows = fuzz_world
    before = [t[r].clone() for t in shm.layers for r in rows]  # row slices: fast copies
    cmd, fields, arrays = msg
    with pytest.raises(CommandRefused) as e:
        sa.call(cmd, dict(fields), arrays)
    assert e.value.code in ("bad_field", "not_owner", "unsupported", "no_space", "bad_rows",
                            "bad_frame"), (e.value.code, e.value.message)
    assert "internal" not in e.value.code
    assert all(torch.equal(b, t[r]) for b, (t, r) in
               zip(before, [(t, r) for t in shm.layers for r in rows]))
    sv.heartbeat()
    sa.heartbeat()
    assert sv.sparse_extend("victim", 300) == rows  # still the victim's, unchanged


def test_free_refused_busy_while_a_copy_is_in_flight(tmp_path):
    """The handler on its own: a request whose sparse_backup op the state still holds in flight
    is not freed (its rows could be reallocated under the copy); once the op is done it is."""
    from types import SimpleNamespace

    from hicache.controllers.sparse import sparse_free
    from hicache.controllers.sparse_regions import SparseRegions, SparseRequest
    from hicache.core.protocol import ProtocolError

    region = SparseRegions(FLASH, 4, str(tmp_path), None, 1)
    try:
        c = SimpleNamespace(cid="eng")
        st = SimpleNamespace(sparse=region, ops={7: object()})
        alloc = region.bind("eng").alloc
        rows = alloc.alloc(2, ("eng", "r")).tolist()
        region.requests[("eng", "r")] = SparseRequest("eng", 100, rows, ops=[7])
        with pytest.raises(ProtocolError) as e:
            sparse_free(st, c, {"request": "r"}, [])
        assert e.value.code == "busy" and "in flight" in e.value.message
        assert ("eng", "r") in region.requests and alloc.free_rows == 2
        del st.ops[7]  # the op completed
        assert sparse_free(st, c, {"request": "r"}, [])[0] == {"freed_rows": 2}
        assert alloc.free_rows == 4 and not region.requests
    finally:
        region.close()


def test_admit_hands_one_sparse_backup_op_to_the_scheduler(tmp_path):
    """The handler on its own: its copies become one ``sparse_backup`` operation for
    ``state.start`` (not a copy on the server loop), the host-tier rows it reads are declared
    to the row tracker (their frees wait for it), and the reply names the op."""
    from types import SimpleNamespace

    import numpy as np

    from hicache.controllers.sparse import sparse_admit
    from hicache.controllers.sparse_regions import SparseRegions
    from hicache.kernels.tables import LayerTable

    region = SparseRegions(FLASH, 6, str(tmp_path), None, 1)
    try:
        pb = region.spec.page_bytes
        host_tier = LayerTable([torch.zeros(8, pb, dtype=torch.uint8) for _ in range(21)], "h")
        dev = LayerTable([torch.zeros(8, pb, dtype=torch.uint8) for _ in range(21)], "d")
        started = []
        st = SimpleNamespace(
            sparse=region, host_rows={"page": 8}, host_tables={"c4_kv": host_tier},
            check_owned=lambda *a: None, check_l3_clash=lambda *a: None, next_op_id=lambda: 41,
            group=SimpleNamespace(first_unwritten=lambda pool, rows: None),
            scheduler=SimpleNamespace(cuda=False), start=lambda c, op: started.append(op))
        c = SimpleNamespace(cid="eng", worker=SimpleNamespace(tables={"c4_kv": dev}))
        hits, devrows = np.array([5, 2], dtype=np.int64), np.array([7], dtype=np.int64)
        h, arr = sparse_admit(st, c, {"request": "r", "prompt_tokens": 3 * 64 * 4,
                                      "host_rows": 0, "device_rows": 1},
                              [hits.tobytes(), devrows.tobytes()])
        rows = arr[0].tolist()
        assert h == {"c4_tokens": 192, "pages": 3, "reused_pages": 2, "op": 41}
        (op,) = started
        assert op.kind == "sparse_backup" and op.op_id == 41
        assert [(s, r.tolist(), w) for s, r, w in op.host] == [("page", [5, 2], False)]
        (a, b) = op.items
        assert a.src is host_tier and a.dst is region.of("eng").table and a.fmt is None
        assert a.src_ids.list() == [5, 2] and a.dst_ids.list() == rows[:2]
        assert b.src is dev and b.src_ids.list() == [7] and b.dst_ids.list() == rows[2:]
        assert op.nbytes == 3 * pb * 21 == a.nbytes + b.nbytes
        assert region.requests[("eng", "r")].ops == [41]
    finally:
        region.close()


def test_later_sparse_regions_are_made_off_the_loop(tmp_path, monkeypatch):
    """After a bind (and after a detach) the next client's region is made on a thread of its
    own, so that client's bind only takes it; at most ``max_regions`` regions exist besides
    those closing; one the thread failed to make is made by the bind (a one-line refusal when
    that fails too)."""
    import threading

    from conftest import sparse_memfds

    from hicache.controllers.sparse_regions import SparseRegions
    from hicache.core.protocol import ProtocolError

    made: list[str] = []
    before = sparse_memfds()
    fail: list[bool] = []
    region = SparseRegions(FLASH, 2, str(tmp_path), None, 1, max_regions=2)
    real = region._make

    def make():
        made.append(threading.current_thread().name)
        if fail:
            raise OSError(28, "No space left on device")
        return real()

    monkeypatch.setattr(region, "_make", make)
    try:
        files = lambda: sparse_memfds() - before  # noqa: E731 - regions open
        assert files() == 1  # the spare made at start
        a = region.bind("a")
        region._making[0].join(10)  # the next spare, for a second client
        assert made == ["hicache-sparse-region"] and files() == 2
        b = region.bind("b")  # takes it: nothing made on this thread
        assert made == ["hicache-sparse-region"] and b is not a and not region.making
        del a  # (the closed region's memory goes with its last view)
        with pytest.raises(ProtocolError, match="--sparse-clients 2"):
            region.bind("c")
        assert files() == 2  # two bound, no spare beyond max_regions
        region.close_region(region.detach("a"))  # a place is free: the next spare is made
        region._making[0].join(10)
        assert made == ["hicache-sparse-region"] * 2 and files() == 2
        fail.append(True)
        region.bind("c")  # takes that spare; two bound: no refill
        assert len(made) == 2 and not region.making
        region.close_region(region.detach("b"))  # a refill, which fails on its thread
        region._making[0].join(10)
        assert made[-1] == "hicache-sparse-region" and region.spare is None
        with pytest.raises(ProtocolError, match="cannot make a sparse region .*No space left"):
            region.bind("d")  # the thread failed, and so does the bind's own attempt
        assert made[-1] == threading.current_thread().name and region.of("d") is None
    finally:
        region.close()
    del b
    assert sparse_memfds() == before  # every region closed, its memory gone
    assert list(tmp_path.iterdir()) == []  # and no file made


def test_an_abandoned_stop_closes_every_region_memfd_and_keeps_the_mappings(tmp_path):
    """A stop that gave up waiting for copies (``close_memfds``): no engine can open a region
    any more, while the mappings a late copy may still touch stay valid."""
    from conftest import region_held, sparse_memfds

    from hicache.controllers.sparse_regions import SparseRegions

    before = sparse_memfds()
    region = SparseRegions(FLASH, 2, str(tmp_path), None, 1, max_regions=2)
    a = region.bind("a")
    region._collect(wait=True)  # the spare made for a second client
    handout = FdHandout.create()
    info = region.hand_out("a", handout)
    region.hand_out("a", handout)  # two hand-outs: one for each region_held below
    region.detach("a")  # closing: still mapped
    assert sparse_memfds() - before == 2 and region_held(info)
    region.close_memfds()
    assert not region_held(info) and list(tmp_path.iterdir()) == []
    assert handout.pending == 0
    handout.close()
    a.table.layers[0][1].fill_(7)  # the mapping is still there
    assert int(a.table.layers[0][1][0]) == 7


def test_a_region_is_sealed_checked_on_open_and_refused_past_memory(monkeypatch):
    """The region (``core.sealed_memfd``): no descriptor of it can change its size, the engine's
    open checks the size and the token (a reused descriptor number is never taken for it), a
    closed one cannot be opened, and one larger than the memory available is refused up front
    (ENOMEM, nothing left open: a memfd has no tmpfs cap, and reserving past memory would end
    in the OOM killer)."""
    from hicache.core import sealed_memfd
    from hicache.core.sparse_shm import ALIGN, SparseShm

    shm = SparseShm.create(3, 5, 1000)
    handout = FdHandout.create()
    info = shm.hand_out(handout)
    assert (info["bytes"], info["layer_stride"]) == (3 * 8192, 8192)
    assert info == dict(shm.info(), fds=handout.path)
    eng = SparseShm.open(info)
    shm.hand_out(handout)
    fd = fetch_fd(info["fds"], info["token"], "sparse region")
    try:
        assert os.fstat(fd).st_size == info["bytes"] + ALIGN
        assert stat.S_IMODE(os.fstat(fd).st_mode) == 0o600
        for size in (0, ALIGN, info["bytes"], info["bytes"] + 2 * ALIGN):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, size)
    finally:
        os.close(fd)
    eng.layers[2][4].fill_(3)  # one memory: the daemon's view sees the engine's write
    assert bool((shm.layers[2][4] == 3).all())
    other = SparseShm.create(3, 5, 1000)  # another region handed over for our token
    handout.offer(other._sealed.fd, info["token"])
    with pytest.raises(ValueError, match="not this hicache sparse region"):
        SparseShm.open(info)
    other.close()
    with pytest.raises(OSError, match="no memory is offered for this token"):
        SparseShm.open(dict(shm.hand_out(handout), token=info["token"] ^ 2))
    with pytest.raises(ValueError, match="expected"):
        SparseShm.open(dict(info, rows=4))
    shm.hand_out(handout)
    shm.close()
    with pytest.raises(OSError, match="no memory is offered for this token"):  # withdrawn
        SparseShm.open(info)
    assert handout.pending == 0
    handout.close()
    before = set(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(sealed_memfd, "memory_available", lambda: 1 << 20)
    with pytest.raises(OSError) as e:
        SparseShm.create(3, 200, 8192)
    assert e.value.errno == errno.ENOMEM and "available" in str(e.value)
    assert set(os.listdir("/proc/self/fd")) <= before


def test_a_refused_sparse_region_binds_nothing_and_a_failed_offer_is_one_refusal(tmp_path):
    """``sparse_region`` whose descriptor socket cannot be made, or whose memfd offer fails (no
    descriptor left for the duplicate), is refused ``unsupported`` and leaves the client with
    no region (from a review helper: on the code before the first bound a region, counted
    against ``--sparse-clients``, and the second escaped as an internal error)."""
    from types import SimpleNamespace

    from hicache.controllers.sparse import sparse_region
    from hicache.controllers.sparse_regions import SparseRegions
    from hicache.core.protocol import ProtocolError

    region = SparseRegions(FLASH, 4, str(tmp_path), None, 1)
    c = SimpleNamespace(cid="eng", worker=object())

    def no_socket() -> Any:
        raise OSError(errno.EMFILE, "Too many open files")

    class NoOffer:  # FdHandout.offer's os.dup failing
        path = "@x"

        def offer(self, fd: int, token: bytes) -> None:
            raise OSError(errno.EMFILE, "Too many open files")

    try:
        for handout, why in ((no_socket, "descriptor socket"), (NoOffer, "offer")):
            with pytest.raises(ProtocolError) as e:
                sparse_region(SimpleNamespace(sparse=region, handout=handout), c, {}, [])
            assert e.value.code == "unsupported" and why in str(e.value), str(e.value)
            assert region.of("eng") is None and not region.regions
        # a client that holds a region keeps it when a later offer fails
        region.bind("eng")
        with pytest.raises(ProtocolError):
            sparse_region(SimpleNamespace(sparse=region, handout=NoOffer), c, {}, [])
        assert region.of("eng") is not None
    finally:
        region.close()


def test_prefix_hits_under_a_backup_in_flight_are_refused_busy_on_a_gpu_daemon():
    """The handler's check on its own (the GPU test in ``test_sparse_daemon_cuda`` runs it
    live): on a GPU daemon prefix hits that a backup still writes are refused ``busy``, as their
    host-to-host copy would not wait for it; on a CPU daemon (the copy worker's FIFO orders
    them) and with no writer in flight they pass."""
    from types import SimpleNamespace

    import numpy as np

    from hicache.controllers.row_tracker import RowTracker
    from hicache.controllers.sparse import _prefix_hits
    from hicache.core.protocol import ProtocolError

    tracker = RowTracker({"page": 8})
    sp = SimpleNamespace(spec=FLASH.pool("c4_kv"))
    c = SimpleNamespace(cid="eng")
    hits = np.array([5, 2], dtype=np.int64)

    def st(cuda: bool) -> Any:
        return SimpleNamespace(
            host_rows={"page": 8}, check_owned=lambda *a: None, check_l3_clash=lambda *a: None,
            group=SimpleNamespace(first_unwritten=lambda pool, rows: None), tracker=tracker,
            scheduler=SimpleNamespace(cuda=cuda))

    _prefix_hits(st(True), sp, c, hits, 4)  # nothing in flight
    backup = [("page", np.array([2], dtype=np.int64), True)]
    tracker.begin(backup)
    with pytest.raises(ProtocolError) as e:
        _prefix_hits(st(True), sp, c, hits, 4)
    assert e.value.code == "busy" and "still in flight" in str(e.value)
    _prefix_hits(st(False), sp, c, hits, 4)
    tracker.end(backup)
    _prefix_hits(st(True), sp, c, hits, 4)


def test_a_region_past_the_containers_memory_limit_is_refused_not_made(tmp_path, monkeypatch):
    """A sparse region was checked against MemAvailable alone: in a memory-limited container
    the daemon made it anyway and was OOM-killed mid-service (HiSparse review). It is checked
    as the host arena is (the container's limit, the reserve): ``no_space``, nothing made."""
    from conftest import sparse_memfds
    from hicache.controllers.sparse_regions import SparseRegions
    from hicache.core.protocol import ProtocolError
    from hicache.host_pools import memory

    before = sparse_memfds()
    region = SparseRegions(FLASH, 2, str(tmp_path), None, 1, max_regions=2)
    try:
        monkeypatch.setattr(memory, "cgroup_room", lambda *a: 64 << 20)  # a 64 MiB limit
        a = region.bind("a")  # the spare made at start
        region._making[0].join(10)  # the next one, refused on its thread
        with pytest.raises(ProtocolError, match="cannot make a sparse region .* can be "):
            region.bind("b")  # and by the bind's own attempt
        assert region.of("b") is None and sparse_memfds() - before == 1
    finally:
        del a
        region.close()


def test_serve_counts_every_sparse_region_in_its_memory_check(tmp_path):
    """The start-up memory check counted the host arena and the L3 segment, never the sparse
    regions (``--sparse-clients`` of them), made later (HiSparse review)."""
    import subprocess
    import sys
    from pathlib import Path

    import psutil

    from hicache.core.sizes import sparse_region_bytes
    from hicache.host_pools.memory import available_bytes, default_reserve

    tiny = build_layout(preset("dsv4-tiny"))
    room = available_bytes()[0] - default_reserve(psutil.virtual_memory().total)
    per_row = sparse_region_bytes(tiny, 2) - sparse_region_bytes(tiny, 1)
    rows = int(room * 0.4) // per_row  # one region fits, four do not

    def check(clients: int) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu", "--preset",
             "dsv4-tiny", "--device-rows", "page=8,swa_page=8,req_slot=4", "--host-ratio", "2",
             "--sparse-rows", str(rows), "--sparse-clients", str(clients),
             "--socket", f"ipc://{tmp_path}/d.sock", "--check"],
            cwd=str(Path(__file__).resolve().parents[1]), capture_output=True, text=True,
            timeout=120)

    r = check(4)
    assert r.returncode == 2, r
    assert f"--sparse-rows {rows} x --sparse-clients 4 (HiSparse regions of" in r.stderr
    assert len(r.stderr.splitlines()) == 1, r.stderr
    assert check(1).returncode == 0
