"""One client never reads another's bytes: host rows are readable only once their owner's
backup into them completed (issue 17, item 1). A real CPU daemon, two clients with
shared-memory DSV4-Flash pools; every byte a refused load could have touched is checked."""
from __future__ import annotations

import numpy as np
import pytest
import torch

from hicache.engine.client import CommandRefused
from hicache.engine.device_pools import DevicePools
from hicache.core.layout import build_layout, preset
from hicache.host_pools.group import (CLEAN, FEW_ROWS, SCALAR_ROWS, STALE, UNWRITTEN, WRITTEN,
                                     HostPoolGroup)

ROWS = {"page": 8, "swa_page": 4, "req_slot": 4}
FLASH = build_layout(preset("dsv4-flash"))
SECRET = 0xA5  # every byte the first client writes


def snap(pools: DevicePools) -> dict[str, list[torch.Tensor]]:
    return {k: [t.clone() for t in v] for k, v in pools.layers.items()}


def same(pools: DevicePools, before: dict[str, list[torch.Tensor]]) -> bool:
    return all(torch.equal(t, b) for k, v in pools.layers.items() for t, b in zip(v, before[k]))


def refused(code: str, fn) -> None:
    with pytest.raises(CommandRefused) as e:
        fn()
    assert e.value.code == code, e.value


@pytest.fixture
def two(shared_daemon):
    """Client A (device pools all SECRET) and client B (device pools all 0x11)."""
    pa, pb = DevicePools(FLASH, ROWS), DevicePools(FLASH, ROWS)
    for p, v in ((pa, SECRET), (pb, 0x11)):
        for layers in p.layers.values():
            for t in layers:
                t.fill_(v)
    a, b = shared_daemon.client(name="tenant-a"), shared_daemon.client(name="tenant-b")
    a.register(pa)
    b.register(pb)
    yield a, pa, b, pb
    let_go(((a, pa), (b, pb)))


def let_go(pairs) -> None:
    """Unregister and close each (client, device pools), whatever state a test left them in."""
    for c, p in pairs:
        try:
            c.unregister()
        except CommandRefused:
            pass
        c.close()
        p.close()


def fill_all_host_rows(a, host_rows: dict) -> dict:
    """A takes every host row of page and swa_page, writes SECRET into all of them."""
    rows = a.alloc({s: host_rows[s] for s in ("page", "swa_page")})
    for s in ("page", "swa_page"):
        n = len(rows[s])
        dev = [i % ROWS[s] for i in range(n)]
        for k in range(0, n, ROWS[s]):  # device rows are fewer: in chunks
            assert a.wait_ack(a.backup({s: (dev[k:k + ROWS[s]], rows[s][k:k + ROWS[s]])})).ok
    return rows


def test_alloc_after_free_and_load_of_unwritten_rows(two):
    a, pa, b, pb = two
    host_rows = a.heartbeat(full=True)["host_rows"]
    rows = fill_all_host_rows(a, host_rows)
    a.free(rows)
    got = b.alloc({s: host_rows[s] for s in ("page", "swa_page")})  # necessarily A's old rows
    before = snap(pb)
    for s in ("page", "swa_page"):
        refused("not_written", lambda: b.load({s: (got[s][:2], [0, 1])}))
        for spec in FLASH.space_pools(s):  # every pool, one by one, row and token units
            refused("not_written", lambda: b.load({spec.name: (got[s][:1], [2])}))
            if spec.token_granular:
                refused("not_written", lambda: b.load(
                    {spec.name: ([int(got[s][0]) * spec.tokens_per_page + 3], [5], "token")}))
    assert same(pb, before)  # nothing moved

    # B writes one pool of a row: only that pool becomes readable, the others stay refused
    r = int(got["page"][0])
    assert b.wait_ack(b.backup({"c4_kv": ([0], [r])})).ok
    assert b.wait_ack(b.load({"c4_kv": ([r], [1])})).ok
    for t in pb.layers["c4_kv"]:
        assert bool((t[1] == 0x11).all())
    refused("not_written", lambda: b.load({"c128_kv": ([r], [1])}))

    # B writes one token of a fresh page: the rest of that page reads as zeros, never A's bytes
    spec = FLASH.pool("c128_kv")
    P_ = spec.tokens_per_page
    q = int(got["page"][1])
    assert b.wait_ack(b.backup({"c128_kv": ([0], [q * P_ + 1], "token")})).ok
    assert b.wait_ack(b.load({"c128_kv": ([q], [3])})).ok  # the whole row
    for t in pb.layers["c128_kv"]:
        row = t[3].numpy()
        assert not (row == SECRET).any(), "a byte of the previous owner came back"
        assert (row != 0).any()  # B's token is there
    b.free(got)


def test_swap_in_of_another_clients_row_and_of_unwritten_rows(two):
    a, pa, b, pb = two
    out = a.swap_out(1, request="ra")
    assert a.wait_ack(out).ok
    before = snap(pb)
    refused("not_owner", lambda: b.swap_in(out.host_row, 0))  # A's row: never B's
    assert same(pb, before)
    row = int(b.alloc({"req_slot": 1}, request="rb")["req_slot"][0])
    refused("not_written", lambda: b.swap_in(row, 0, request="rb"))  # allocated, never written
    assert same(pb, before)
    back = a.swap_in(out.host_row, 2, request="ra")  # the owner may, and release frees it
    assert a.wait_ack(back).ok
    # the freed row is unwritten again: a new owner cannot read it, even the same client
    got = int(a.alloc({"req_slot": 1}, request="ra2")["req_slot"][0])
    if got == out.host_row:
        refused("not_written", lambda: a.swap_in(got, 0, request="ra2"))
    b.free({"req_slot": [row]}, request="rb")


def test_swap_out_into_another_requests_row_is_refused(two):
    """``swap_out`` into a named ``host_row`` checks the request as ``swap_in`` does: the row of
    request ``ra`` is not overwritten by a swap-out for request ``rb`` of the same client."""
    a, pa, b, pb = two
    req_pools = [n for n, spec in FLASH.pools.items() if spec.index == "req_slot"]
    assert req_pools
    out = a.swap_out(1, request="ra")  # slot 1 holds SECRET
    assert a.wait_ack(out).ok
    for n in req_pools:
        for t in pa.layers[n]:
            t[0].fill_(0x33)
    refused("not_owner", lambda: a.swap_out(0, request="rb", host_row=out.host_row))
    for n in req_pools:  # what comes back is still slot 1's
        for t in pa.layers[n]:
            t[2].zero_()
    assert a.wait_ack(a.swap_in(out.host_row, 2, request="ra")).ok
    assert all(bool((t[2] == SECRET).all()) for n in req_pools for t in pa.layers[n])


def test_written_state_in_the_pool_group():
    """Group level: begin/end of a write, failure, release back to UNWRITTEN, zero on free."""
    lay = build_layout(preset("dsv4-tiny"))
    rows = {"page": 6, "swa_page": 4, "req_slot": 2}
    with HostPoolGroup(lay, rows, zero_on_free=True) as g:
        r = g.alloc({"page": 3}, ("a", None))["page"].numpy()
        pool = lay.space_pools("page")[0].name
        assert g.unwritten(pool, r).tolist() == r.tolist()
        for t in g.pools[pool].layers:
            t[r] = 7  # a previous owner's bytes
        assert g.begin_write(pool, r[:1], zero=True) == 1  # token write: zeroed first
        assert all(not t[int(r[0])].any() for t in g.pools[pool].layers)
        assert g.written[pool][r[0]] == CLEAN
        g.end_write(pool, r[:1], ok=False)
        assert g.written[pool][r[0]] == UNWRITTEN
        g.begin_write(pool, r[1:], zero=False)
        g.end_write(pool, r[1:], ok=True)
        assert g.unwritten(pool, r).tolist() == [int(r[0])]
        assert g.written[pool][r[1]] == WRITTEN
        g.free({"page": r}, ("a", None))
        assert (g.written[pool][r] == UNWRITTEN).all()
        for t in g.pools[pool].layers:  # zero_on_free
            assert not t[r].any()
        g.check_invariants()


@pytest.mark.parametrize("token_first", [True, False])
@pytest.mark.parametrize("n", [2, FEW_ROWS + 3])
def test_a_token_write_beside_a_failed_whole_row_write_never_makes_old_bytes_readable(
        token_first, n):
    """A whole-row write (a row backup, an L3 prefetch) leaves a previous owner's bytes until
    it lands. A token write accepted meanwhile cannot zero the row, and when the whole-row
    write then fails (or an L3 read misses), the row must stay unreadable whichever of the two
    ends first (it used to become readable: the token write's success marked it WRITTEN)."""
    lay = build_layout(preset("dsv4-tiny"))
    with HostPoolGroup(lay, {"page": 32, "swa_page": 4, "req_slot": 2}) as g:
        r = g.alloc({"page": n}, ("b", None))["page"].numpy()
        pool = lay.space_pools("page")[0].name
        for t in g.pools[pool].layers:
            t[torch.from_numpy(r)] = 7  # the previous owner's bytes
        g.begin_write(pool, r, zero=False)  # whole rows: nothing zeroed
        assert (g.written[pool][r] == STALE).all()
        assert g.begin_write(pool, r, zero=True) == 0  # a token write cannot zero them now
        if token_first:
            g.end_write(pool, r, ok=True, partial=True)
            assert g.unwritten(pool, r).size == n  # the whole-row write has not landed
            g.end_write(pool, r, ok=False)
        else:
            g.end_write(pool, r, ok=False)
            g.end_write(pool, r, ok=True, partial=True)
        assert g.unwritten(pool, r).size == n and g.first_unwritten(pool, r) == int(r[0])
        # a later token write zeroes them again, and its success makes them readable
        assert g.begin_write(pool, r, zero=True) == n
        g.end_write(pool, r, ok=True, partial=True)
        assert g.unwritten(pool, r).size == 0
        assert all(not t[torch.from_numpy(r)].any() for t in g.pools[pool].layers)
        # a whole-row write that succeeds makes its rows readable whatever came before
        r2 = g.alloc({"page": 1}, ("b", None))["page"].numpy()
        g.begin_write(pool, r2, zero=False)
        g.begin_write(pool, r2, zero=True)
        g.end_write(pool, r2, ok=True, partial=True)
        assert g.unwritten(pool, r2).size == 1
        g.end_write(pool, r2, ok=True)
        assert g.unwritten(pool, r2).size == 0
        g.check_invariants()


@pytest.mark.parametrize("n", [3, FEW_ROWS, FEW_ROWS + 5])
@pytest.mark.parametrize("as_list", [True, False])
def test_written_state_same_for_few_and_many_rows(n, as_list):
    """begin/end_write take a few rows one by one and more through numpy; a list or an array
    of either size gives the same states (a failed write returns them to UNWRITTEN)."""
    lay = build_layout(preset("dsv4-tiny"))
    with HostPoolGroup(lay, {"page": 32, "swa_page": 4, "req_slot": 2}) as g:
        r = g.alloc({"page": n}, ("a", None))["page"].numpy()
        pool = lay.space_pools("page")[0].name
        rows = r.tolist() if as_list else r
        for t in g.pools[pool].layers:  # a previous owner's bytes everywhere
            t.fill_(0xAB)
        assert g.begin_write(pool, rows, zero=True) == n
        assert (g.written[pool][r] == CLEAN).all()
        others = np.setdiff1d(np.arange(32), r)
        for t in g.pools[pool].layers:  # the rows written to are zeroed, and only they
            assert not t[torch.from_numpy(r)].any()
            assert (t[torch.from_numpy(others)] == 0xAB).all()
        assert g.begin_write(pool, rows, zero=True) == 0  # CLEAN already: not zeroed again
        g.end_write(pool, rows, ok=False)
        assert (g.written[pool][r] == UNWRITTEN).all()
        g.begin_write(pool, rows, zero=False)
        g.end_write(pool, rows, ok=True)
        assert (g.written[pool][r] == WRITTEN).all() and g.unwritten(pool, r).size == 0
        assert (g.written[pool][others] == UNWRITTEN).all()


@pytest.mark.parametrize("n", [5, SCALAR_ROWS, SCALAR_ROWS + 9])
@pytest.mark.parametrize("as_list", [True, False])
def test_first_unwritten_same_for_few_and_many_rows(n, as_list):
    """A load's check (``first_unwritten``) reads a few rows one by one and more through numpy:
    a list or an array of either size names the same row, the first unwritten one in the
    order given, and None when every row was written."""
    lay = build_layout(preset("dsv4-tiny"))
    with HostPoolGroup(lay, {"page": 96, "swa_page": 4, "req_slot": 2}) as g:
        r = g.alloc({"page": n}, ("a", None))["page"].numpy()[::-1].copy()  # not sorted
        pool = lay.space_pools("page")[0].name
        rows = r.tolist() if as_list else r
        assert g.first_unwritten(pool, rows) == int(r[0])  # nothing written yet
        g.begin_write(pool, r, zero=False)
        g.end_write(pool, r, ok=True)
        assert g.first_unwritten(pool, rows) is None
        late = r[[n // 2, n - 1]]
        g.written[pool][late] = 0  # as a free does: back to UNWRITTEN
        assert g.first_unwritten(pool, rows) == int(r[n // 2])
        assert g.first_unwritten(pool, rows) == int(g.unwritten(pool, r)[0])


def test_a_failed_backup_into_written_rows_leaves_them_unreadable():
    """A backup into rows an earlier backup wrote fails (a launch failing after its first
    pools, a cancelled CPU copy): some of their bytes may be new, some old, so every row it
    was to write becomes unreadable, not a mix a load would return."""
    from types import SimpleNamespace

    from hicache.controllers.host_access import begin_writes, end_writes

    with HostPoolGroup(FLASH, ROWS) as g:
        rows = g.alloc({"page": 3}, ("a", None))["page"].numpy()
        item = SimpleNamespace(pool="c4_kv", dst_ids=SimpleNamespace(
            n=3, np=lambda: rows, list=lambda: rows.tolist()), fmt=None)
        op = SimpleNamespace(kind="backup", items=[item], ok=True)
        begin_writes(g, op)
        end_writes(g, op)
        assert (g.written["c4_kv"][rows] == WRITTEN).all()
        op.ok = False  # the same rows written again, and that write failed
        begin_writes(g, op)
        end_writes(g, op)
        assert (g.written["c4_kv"][rows] == UNWRITTEN).all()
        assert g.first_unwritten("c4_kv", rows) == rows[0]


@pytest.mark.parametrize("n", [2, FEW_ROWS + 3])
def test_a_token_write_never_zeroes_rows_another_write_is_landing_in(n):
    """Whole-row writes A and B into the same rows were accepted; A failed (its rows
    UNWRITTEN again) while B is still landing. A token write accepted then must not zero the
    rows under B (it used to: B's bytes partly zeros, readable once B ended). They become
    STALE, and readable once B completes, holding B's bytes. With no write in flight a token
    write zeroes them as before."""
    lay = build_layout(preset("dsv4-tiny"))
    with HostPoolGroup(lay, {"page": 32, "swa_page": 4, "req_slot": 2}) as g:
        r = g.alloc({"page": n}, ("b", None))["page"].numpy()
        rt = torch.from_numpy(r)
        pool = lay.space_pools("page")[0].name
        g.begin_write(pool, r, zero=False)  # A
        g.begin_write(pool, r, zero=False)  # B
        g.end_write(pool, r, ok=False, overwritten=True)  # A failed
        landing = set(r.tolist())  # B still writes them (``DaemonState.landing``)
        assert g.unwritten(pool, r).size == n
        for t in g.pools[pool].layers:
            t[rt] = 9  # B's bytes, landing
        assert g.begin_write(pool, r, zero=True, landing=landing) == 0  # nothing zeroed
        assert all((t[rt] == 9).all() for t in g.pools[pool].layers)
        assert (g.written[pool][r] == STALE).all()
        g.end_write(pool, r, ok=True)  # B completes
        g.end_write(pool, r, ok=True, partial=True)  # the token write completes
        assert g.unwritten(pool, r).size == 0
        assert all((t[rt] == 9).all() for t in g.pools[pool].layers)
        r2 = g.alloc({"page": n}, ("b", None))["page"].numpy()
        assert g.begin_write(pool, r2, zero=True, landing=landing) == n  # none in flight
        assert (g.written[pool][r2] == CLEAN).all()
        g.check_invariants()


def test_the_rows_a_token_write_must_not_zero_are_those_of_its_own_pool():
    """``DaemonState.landing``: a row is kept from zeroing only when an operation in flight
    writes that row *of the same pool*. Another pool's write into the same host row (a
    space's pools share row ids) does not count: the first version of this check took the
    row tracker's per-space counts alone, and a token backup beside another pool's backup
    left its row unreadable (the soak's load was refused ``not_written``)."""
    from hicache.controllers.metrics import Metrics
    from hicache.controllers.ops import Ids, Item, Operation
    from hicache.controllers.registry import Registry
    from hicache.controllers.scheduler import Scheduler
    from hicache.controllers.state import DaemonState

    lay = build_layout(preset("dsv4-tiny"))
    a, b = [p.name for p in lay.space_pools("page")][:2]
    with HostPoolGroup(lay, {"page": 16, "swa_page": 4, "req_slot": 4}) as g:
        sched = Scheduler(torch.device("cpu"), lambda: None)
        try:
            st = DaemonState(lay, g, sched, Registry(8, 64), Metrics(process_metrics=False),
                             torch.device("cpu"), heartbeat_timeout=60, load_event_sets=1,
                             shm_dirs=("/dev/shm",))
            ids = Ids.of(np.array([3, 5], dtype=np.int64))
            op = Operation(1, "c", "backup", [Item(a, None, None, ids, ids, None, (0,), 1)],
                           [("page", ids.np(), True)])
            st.tracker.begin(op.host)
            st.ops[1] = (op, object())
            assert st.landing(a, "page", [3, 4, 5]) == {3, 5}  # its own pool's rows
            assert st.landing(a, "page", np.array([3, 4, 5])) == {3, 5}
            assert st.landing(b, "page", [3, 4, 5]) is None  # another pool's: not landing
            assert st.landing(a, "page", np.array([4, 6])) is None
            # an L3 prefetch in flight that fills pool b's row 4 lands there too
            from types import SimpleNamespace

            st.tracker.begin([("page", np.array([4]), True)])
            st.l3_ops[2] = SimpleNamespace(kind="prefetch", pools={"page": [b]},
                                           rows=[{"page": 4}])
            assert st.landing(b, "page", [3, 4, 5]) == {4}
            assert st.landing(a, "page", [3, 4, 5]) == {3, 5}
        finally:
            sched.close()


@pytest.mark.parametrize("where", ["first", "last"])
def test_one_foreign_row_among_many_is_refused_on_every_copy_command(daemon_factory, where):
    """Above ``OWNER_LOOP_MAX`` rows the daemon checks ownership in one vectorised pass: one of
    another client's written rows among 40 of B's own, first or last, is ``not_owner`` for a
    load, a backup and a free, and neither B's device bytes nor A's host bytes change."""
    from hicache.controllers.state import OWNER_LOOP_MAX

    n = 40
    assert n > OWNER_LOOP_MAX
    tiny = build_layout(preset("dsv4-tiny"), c128_state="offline", mtp=False)
    rows = {"page": n, "swa_page": 4, "req_slot": 4}
    d = daemon_factory(preset="dsv4-tiny", device_rows="page=40,swa_page=4,req_slot=4",
                       metrics=False, extra=("--no-mtp", "--c128-state", "offline"))
    pa, pb = DevicePools(tiny, rows), DevicePools(tiny, rows)
    g = torch.Generator().manual_seed(5)
    for p in (pa, pb):
        for layers in p.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
    a, b = d.client(name="tenant-a"), d.client(name="tenant-b")
    try:
        a.register(pa)
        b.register(pb)
        ha = a.alloc({"page": n})["page"]
        a.wait_ack(a.backup({"page": (list(range(n)), ha)}))  # A's rows: written, readable
        hb = b.alloc({"page": n})["page"]
        b.wait_ack(b.backup({"page": (list(range(n)), hb)}))
        mixed = list(hb)
        mixed[0 if where == "first" else -1] = ha[7]
        before_b = snap(pb)
        refused("not_owner", lambda: b.load({"page": (mixed, list(range(n)))}))
        refused("not_owner", lambda: b.backup({"page": (list(range(n)), mixed)}))
        refused("not_owner", lambda: b.free({"page": mixed}))
        assert same(pb, before_b)
        # A's host rows still hold A's bytes: loaded back into A's zeroed device rows
        want = snap(pa)
        for layers in pa.layers.values():
            for t in layers:
                t.zero_()
        a.wait_ack(a.load({"page": (ha, list(range(n)))}))
        for name, layers in pa.layers.items():
            if tiny.pools[name].index == "page":
                assert all(torch.equal(t, w) for t, w in zip(layers, want[name])), name
        assert b.call("stats", {"check": True})[0]["invariants"] == "ok"
    finally:
        let_go(((a, pa), (b, pb)))


def test_no_reply_names_another_clients_id(two):
    """Without CURVE a routing identity is a client's only credential: ``stats`` listed every
    worker's id and a refused ``free`` named the owner of the row, so a peer that connected
    under a dead engine's id took over its rows, acks, channel and sparse region until the
    reap, and read its bytes (isolation review). Now no reply names another client's id, and
    the id's random tail is 128 bits."""
    import json

    a, pa, b, pb = two
    tail = a.client_id.rsplit("-", 1)[1]
    assert len(tail) == 32
    rows = a.alloc({"page": 1})
    said = [json.dumps(b.call("stats", {})[0])]
    with pytest.raises(CommandRefused) as e:
        b.free(rows)
    said.append(str(e.value))
    assert e.value.code == "not_owner" and "belongs to another owner" in str(e.value)
    assert not any(tail in x or a.client_id in x for x in said), said
    labels = json.loads(said[0])["worker_rows"]
    assert any(k.startswith(a.client_id.rsplit("-", 1)[0] + "#") for k in labels), labels
    a.free(rows)
