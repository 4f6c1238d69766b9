"""Row allocators, host pools, the pool group (atomicity, owners, buffer infos) and sizing,
all on CPU with the dsv4-tiny layout and a handful of rows."""
from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from hicache.core.errors import UsageError
from hicache.host_pools.allocator import RowAllocator
from hicache.host_pools.errors import CapacityError, InvariantError, PoolError, PoolExhausted
from hicache.host_pools.group import HostPoolGroup
from hicache.core.sizes import (REGION_ALIGN, arena_bytes, format_bytes, host_rows,
                                       parse_bytes, plan_regions)
from hicache.core.layout import INDEX_SPACES, build_layout, preset

A, B = ("a", None), ("b", "r1")
TINY = preset("dsv4-tiny")
ROWS = {"page": 12, "swa_page": 6, "req_slot": 4}


def tiny(mode: str = "paged", **kw):
    return build_layout(TINY, swa_mode=mode, **kw)


def rows_for(layout):
    return {s: ROWS[s] for s in INDEX_SPACES if layout.space_pools(s)}


# ---------------------------------------------------------------------------- allocator
def test_alloc_lowest_first_row_zero_valid():
    a = RowAllocator(5, "page")
    r = a.alloc(3, A)
    assert r.dtype == torch.int64 and r.tolist() == [0, 1, 2]
    assert a.owner_of(0) == A and a.owner_of(3) is None
    assert a.alloc(0, A).numel() == 0
    assert a.stats() == {"space": "page", "rows": 5, "used": 3, "free": 2, "owners": 1,
                         "free_runs": 1, "mean_free_run": 2.0, "fragmentation": 0.0}
    assert a.free(r, A) == 3
    assert a.alloc(5, B).tolist() == [0, 1, 2, 3, 4]
    a.check_invariants()


def test_exhausted_changes_nothing():
    a = RowAllocator(4, "page")
    a.alloc(3, A)
    before = a.snapshot()
    with pytest.raises(PoolExhausted, match="2 rows asked, 1 of 4 free"):
        a.alloc(2, B)
    assert a.snapshot() == before


@pytest.mark.parametrize("rows,owner,match", [
    ([7], A, "outside 0..5"),
    ([-1], A, "outside"),
    ([0, 1, 0], A, "more than once"),
    ([4], A, "not allocated"),
    ([0, 1], B, r"not owned by \('b', 'r1'\); row 0 belongs to another owner$"),
    ([2, 3], A, "not owned by"),
    ([0, 2], A, r"row 2 belongs to another owner$"),  # owned first, then foreign (test review)
    (torch.tensor([0.0]), A, "integers"),
    (torch.tensor([[0]]), A, "1-D"),
    (np.array(["x"]), A, "integers"),
    ([0], ("", None), "owner must be"),
    ([0], ("a",), "owner must be"),
    ([0], ["a", None], "owner must be"),
    ([0], ("a", 3), "owner must be"),
])
def test_bad_free_changes_nothing(rows, owner, match):
    a = RowAllocator(6, "page")
    a.alloc(2, A)  # rows 0, 1
    a.alloc(2, B)  # rows 2, 3
    before = a.snapshot()
    with pytest.raises(PoolError, match=match):
        a.free(rows, owner)
    assert a.snapshot() == before
    a.check_invariants()


def test_double_free_detected():
    a = RowAllocator(3, "page")
    r = a.alloc(2, A)
    a.free(r[:1], A)
    with pytest.raises(PoolError, match="double free"):
        a.free(r, A)
    assert a.owner_of(1) == A


@pytest.mark.parametrize("n", [-1, 1.5, True, "2"])
def test_bad_alloc_count(n):
    with pytest.raises(PoolError, match="non-negative int"):
        RowAllocator(3, "page").alloc(n, A)


def test_bad_row_count():
    for n in (0, -1, 2.0):
        with pytest.raises(PoolError):
            RowAllocator(n, "page")  # type: ignore[arg-type]


def test_free_owner_by_client_and_request():
    a = RowAllocator(10, "page")
    a.alloc(2, ("c", "r1"))
    a.alloc(3, ("c", "r2"))
    a.alloc(1, ("c", None))
    a.alloc(2, ("d", "r1"))
    assert a.rows_of("c", "r2").tolist() == [2, 3, 4]
    assert a.free_owner("c", "r1") == 2
    assert a.free_owner("c", "r1") == 0
    assert a.free_owner("c") == 4  # every request of c, and its request-less rows
    assert a.owners() == {("d", "r1"): 2}
    assert a.free_owner("nobody") == 0
    a.check_invariants()


def test_alloc_then_free_restores_free_list_exactly():
    a = RowAllocator(8, "page")
    a.alloc(3, A)
    before = a.snapshot()
    a.free(a.alloc(4, B), B)
    assert a.snapshot() == before


def test_invariant_checker_catches_corruption():
    a = RowAllocator(4, "page")
    a.alloc(2, A)
    a._owner[3] = 0  # a free row marked owned
    with pytest.raises(InvariantError):
        a.check_invariants()


def _runs_of_two() -> RowAllocator:
    a = RowAllocator(16, "page")
    rows = a.alloc(16, A)
    a.free(rows[[2, 3, 4, 9, 10]], A)  # free runs (2, 3) and (9, 2)
    a.check_invariants()
    return a


@pytest.mark.parametrize("corrupt,match", [
    (lambda a: a._by_start.update({9: 20}), "out of range"),
    (lambda a: a._by_start.update({2: 0}), "out of range"),
    (lambda a: (a._by_start.update({2: 8}), a._by_end.update({10: 2})), "not coalesced"),
    (lambda a: a._by_end.update({12: 9}), "run end index"),
    (lambda a: a._by_end.pop(5), "run end index"),
    (lambda a: a._classes[1].remove(9), "size class"),
    (lambda a: setattr(a, "_free", 6), "free count"),
])
def test_invariant_checker_catches_each_broken_free_run(corrupt, match):
    """Each free-run invariant (in range, coalesced, end index, size class, free count) is
    checked: a corruption of just that one is named."""
    a = _runs_of_two()
    corrupt(a)
    with pytest.raises(InvariantError, match=match):
        a.check_invariants()


def test_invariant_checker_catches_a_client_table_out_of_step():
    a = RowAllocator(4, "page")
    a.alloc(2, A)
    a._oid_client[0] = 7  # the owner id filed under another client
    with pytest.raises(InvariantError, match="client"):
        a.check_invariants()


def test_free_accepts_numpy_lists_and_cuda_style_tensors():
    a = RowAllocator(6, "page")
    r = a.alloc(4, A)
    a.free(np.array([0], dtype=np.int32), A)
    a.free([1], A)
    a.free(r[2:].to(torch.int32), A)
    a.free([], A)
    assert a.free_rows == 6


# ---------------------------------------------------------------------------- pools
@pytest.mark.parametrize("mode", ["paged", "ring"])
def test_group_regions_and_buffer_infos(mode):
    lay = tiny(mode)
    rows = rows_for(lay)
    with HostPoolGroup(lay, rows) as g:
        assert set(g.pools) == set(lay.pools)
        infos = g.buffer_infos()
        spans = []
        for name, spec in lay.pools.items():
            assert len(infos[name]) == spec.num_layers  # every layer of every pool
            pool = g.pool(name)
            for layer, (ptr, n, item) in zip(pool.layers, infos[name]):
                assert item == spec.page_bytes and n == rows[spec.index] * spec.page_bytes
                assert layer.shape == (rows[spec.index], spec.page_bytes)
                assert ptr == layer.data_ptr() and (ptr - g.arena.ptr) % REGION_ALIGN == 0
                spans.append((ptr - g.arena.ptr, n))
        spans.sort()
        assert all(a + n <= b for (a, n), (b, _) in zip(spans, spans[1:]))  # disjoint
        total = sum(n for _, n in spans)
        assert g.arena.nbytes == arena_bytes(lay, rows) == spans[-1][0] + spans[-1][1]
        assert 0 <= g.arena.nbytes - total < REGION_ALIGN * len(spans)  # alignment only
        assert total == sum(p.data_bytes for p in g.pools.values())


def test_pool_rows_are_layer_major_row_views():
    lay = tiny()
    with HostPoolGroup(lay, rows_for(lay)) as g:
        p = g.pool("c4_kv")
        pb = p.spec.page_bytes
        p.layers[1][3].fill_(9)
        start = p.offset + p.stride + 3 * pb
        assert g.arena.tensor(start - 1, pb + 2).tolist() == [0] + [9] * pb + [0]
        assert p.device_ptrs() == p.layer_ptrs()  # CPU mode: same addresses
        with pytest.raises(PoolError, match="no host pool"):
            g.pool("nope")


def test_group_rejects_bad_rows_and_small_arena():
    from hicache.host_pools.arena import PinnedArena

    lay = tiny()
    with pytest.raises(UsageError, match="missing"):
        HostPoolGroup(lay, {"page": 4})
    with pytest.raises(UsageError, match=r"has no pool of swa_page: drop it$"):
        HostPoolGroup(tiny("ring"), ROWS)
    with pytest.raises(UsageError, match="positive int"):
        HostPoolGroup(lay, {**ROWS, "page": 0})
    with PinnedArena(4096, None) as small:
        with pytest.raises(PoolError, match="cannot hold"):
            HostPoolGroup(lay, ROWS, small)
    big = PinnedArena(arena_bytes(lay, ROWS), None)
    g = HostPoolGroup(lay, ROWS, big)
    g.close()
    assert not big.closed  # a borrowed arena stays open
    big.close()
    with pytest.raises(PoolError, match="closed"):
        HostPoolGroup(lay, ROWS, big)


def test_group_arena_registered_in_chunks_cut_at_regions():
    from test_host_arena import FakeRegistrar

    lay = tiny()
    reg = FakeRegistrar()
    with HostPoolGroup(lay, ROWS, arena_options={"registrar": reg,
                                                 "chunk_bytes": 2 << 20}) as g:
        starts = {off for infos in g.buffer_infos().values() for off, _, _ in infos}
        cuts = [ptr for _, ptr, _ in reg.calls]
        assert len(cuts) > 2 and set(cuts) <= starts | {g.arena.ptr}
    assert reg.registered == {}


# ---------------------------------------------------------------------------- group alloc
def test_group_alloc_free_and_owner_in_one_step():
    lay = tiny()
    with HostPoolGroup(lay, ROWS) as g:
        got = g.alloc({"page": 3, "swa_page": 2, "req_slot": 1}, ("c", "r"))
        assert {s: t.tolist() for s, t in got.items()} == {
            "page": [0, 1, 2], "swa_page": [0, 1], "req_slot": [0]}
        assert all(g.allocators[s].owner_of(0) == ("c", "r") for s in got)
        assert g.alloc({"page": 1}, ("c", "r2"))["page"].tolist() == [3]
        u = g.usage()
        assert u["spaces"]["page"]["used"] == 4 and u["pools"]["swa_kv"]["used_rows"] == 2
        assert u["pools"]["swa_kv"]["used_bytes"] == 2 * lay.pools["swa_kv"].page_bytes * 7
        assert g.free({"swa_page": got["swa_page"][:1]}, ("c", "r")) == 1
        assert g.free_owner("c", "r") == 5
        assert g.free_owner("c") == 1
        g.check_invariants()
        assert all(a.used_rows == 0 for a in g.allocators.values())


def test_group_alloc_refuses_before_taking_anything():
    lay = tiny()
    with HostPoolGroup(lay, ROWS) as g:
        g.alloc({"req_slot": 3}, A)
        before = {s: a.snapshot() for s, a in g.allocators.items()}
        with pytest.raises(PoolExhausted, match="req_slot"):
            g.alloc({"page": 2, "swa_page": 2, "req_slot": 2}, B)
        with pytest.raises(PoolError, match="no pool of this stage uses"):
            g.alloc({"page": 1, "bogus": 1}, B)
        with pytest.raises(PoolError, match="owner must be"):
            g.alloc({"page": 1}, "b")  # type: ignore[arg-type]
        with pytest.raises(PoolError, match="non-negative"):
            g.alloc({"page": -1}, B)
        assert {s: a.snapshot() for s, a in g.allocators.items()} == before


@pytest.mark.parametrize("fail_space", ["swa_page", "req_slot"])
def test_group_alloc_atomic_under_injected_failure(fail_space):
    class Failing(RowAllocator):
        armed = True

        def alloc(self, n, owner):
            if self.armed:
                raise RuntimeError(f"injected failure in {self.space}")
            return super().alloc(n, owner)

    def factory(n, space):
        return (Failing if space == fail_space else RowAllocator)(n, space)

    lay = tiny()
    with HostPoolGroup(lay, ROWS, allocator_factory=factory) as g:
        Failing.armed = False
        g.alloc({"page": 2, "swa_page": 1, "req_slot": 1}, A)
        Failing.armed = True
        before = {s: a.snapshot() for s, a in g.allocators.items()}
        with pytest.raises(RuntimeError, match="injected"):
            g.alloc({"page": 3, "swa_page": 2, "req_slot": 1}, B)
        assert {s: a.snapshot() for s, a in g.allocators.items()} == before
        g.check_invariants()
        assert g.free_owner("b") == 0
        Failing.armed = False
        got = g.alloc({"page": 3, "swa_page": 2, "req_slot": 1}, B)
        assert got["page"].tolist() == [2, 3, 4]  # the rolled-back rows come out again


def test_group_free_is_atomic_across_spaces():
    lay = tiny()
    with HostPoolGroup(lay, ROWS) as g:
        ra = g.alloc({"page": 2, "swa_page": 2}, A)
        rb = g.alloc({"page": 2}, B)
        before = {s: a.snapshot() for s, a in g.allocators.items()}
        with pytest.raises(PoolError, match="not owned"):
            g.free({"swa_page": ra["swa_page"], "page": rb["page"]}, A)
        with pytest.raises(PoolError, match="no pool of this stage uses"):
            g.free({"page": ra["page"], "x": []}, A)
        assert {s: a.snapshot() for s, a in g.allocators.items()} == before


def test_stage_local_pools_pp2():
    flash = preset("dsv4-flash")
    for rank in range(2):
        lay = build_layout(flash, pp_size=2, pp_rank=rank)
        with HostPoolGroup(lay, {"page": 2, "swa_page": 1, "req_slot": 1}) as g:
            infos = g.buffer_infos()
            for name, spec in lay.pools.items():
                assert len(infos[name]) == spec.num_layers == len(lay.stage.layers(spec.family))


# ---------------------------------------------------------------------------- property
CLIENTS = ["a", "b"]
REQUESTS = [None, "r1", "r2"]
owner_st = st.tuples(st.sampled_from(CLIENTS), st.sampled_from(REQUESTS))
op_st = st.one_of(
    st.tuples(st.just("alloc"), owner_st,
              st.fixed_dictionaries({}, optional={s: st.integers(0, 5) for s in INDEX_SPACES})),
    st.tuples(st.just("free"), owner_st, st.integers(0, 2**16)),
    st.tuples(st.just("bad_free"), owner_st, st.integers(0, 2**16)),
    st.tuples(st.just("free_owner"), st.sampled_from(CLIENTS), st.sampled_from(REQUESTS)),
)


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(mode=st.sampled_from(["paged", "ring"]), ops=st.lists(op_st, max_size=25))
def test_random_sequences_keep_invariants(mode, ops):
    lay = tiny(mode)
    rows = rows_for(lay)
    model: dict[str, dict[int, tuple]] = {s: {} for s in rows}  # space -> row -> owner
    with HostPoolGroup(lay, rows) as g:
        for op in ops:
            snap = {s: a.snapshot() for s, a in g.allocators.items()}
            if op[0] == "alloc":
                _, owner, counts = op
                counts = {s: n for s, n in counts.items() if s in rows}
                fits = all(len(model[s]) + n <= rows[s] for s, n in counts.items())
                if fits:
                    got = g.alloc(counts, owner)
                    assert set(got) == set(counts)
                    for s, t in got.items():
                        assert len(t) == counts[s] and not set(t.tolist()) & set(model[s])
                        model[s].update({r: owner for r in t.tolist()})
                else:
                    with pytest.raises(PoolExhausted):
                        g.alloc(counts, owner)
                    assert {s: a.snapshot() for s, a in g.allocators.items()} == snap
            elif op[0] == "free":
                _, owner, seed = op
                pick = {s: [r for r in sorted(m) if m[r] == owner and (r + seed) % 3]
                        for s, m in model.items()}
                assert g.free(pick, owner) == sum(map(len, pick.values()))
                for s, rs in pick.items():
                    for r in rs:
                        del model[s][r]
            elif op[0] == "bad_free":
                _, owner, seed = op
                s = sorted(rows)[seed % len(rows)]
                bad = [seed % rows[s]]
                if model[s].get(bad[0]) == owner:
                    bad = bad * 2  # listed twice
                with pytest.raises(PoolError):
                    g.free({s: bad}, owner)
                assert {s: a.snapshot() for s, a in g.allocators.items()} == snap
            else:
                _, client, request = op
                hit = {s: [r for r, o in m.items()
                           if o[0] == client and (request is None or o[1] == request)]
                       for s, m in model.items()}
                assert g.free_owner(client, request) == sum(map(len, hit.values()))
                for s, rs in hit.items():
                    for r in rs:
                        del model[s][r]
            g.check_invariants()
            for s, a in g.allocators.items():  # owners exact, row by row
                assert [a.owner_of(r) for r in range(rows[s])] == \
                    [model[s].get(r) for r in range(rows[s])]


# ---------------------------------------------------------------------------- sizing
def test_parse_and_format_bytes():
    assert parse_bytes("16GiB") == 16 << 30 == parse_bytes("16G") == parse_bytes("16 gib")
    assert parse_bytes("1.5M") == 3 << 19 and parse_bytes("2GB") == 2 * 10**9
    assert parse_bytes("4096") == 4096 == parse_bytes(4096)
    for bad in ("", "x", "1.2.3G", "5XB", -1, True):
        with pytest.raises(UsageError):
            parse_bytes(bad)  # type: ignore[arg-type]
    assert format_bytes(512) == "512 B" and format_bytes(16 << 30) == "16.00 GiB"
    assert format_bytes(3 << 40) == "3.00 TiB"
    # no machine's: refused in one line (a 320-digit --host-mem used to end in an
    # OverflowError traceback at the first print; found by a review)
    assert parse_bytes("1048576TiB") == 1 << 60
    for huge in ("1048577TiB", "1" + "0" * 320, 1 << 61):
        with pytest.raises(UsageError, match="which no machine has") as e:
            parse_bytes(huge, "--host-mem")  # type: ignore[arg-type]
        assert "\n" not in str(e.value) and len(str(e.value)) < 120


def test_host_rows_from_ratio():
    lay = tiny()
    dev = {"page": 100, "swa_page": 40, "req_slot": 8}
    assert host_rows(lay, dev, ratio=2.5) == {"page": 250, "swa_page": 100, "req_slot": 20}
    ring = tiny("ring")
    assert host_rows(ring, dev, ratio=1) == {"page": 100, "req_slot": 8}  # unused space ignored
    with pytest.raises(CapacityError, match="no host rows"):
        host_rows(lay, dev, ratio=0.01)
    for bad in (0, -1, float("inf"), "2", True):
        with pytest.raises(UsageError):
            host_rows(lay, dev, ratio=bad)  # type: ignore[arg-type]


def test_host_rows_from_bytes():
    lay = tiny()
    dev = {"page": 100, "swa_page": 40, "req_slot": 8}
    budget = 64 << 20
    rows = host_rows(lay, dev, host_bytes=budget)
    need = arena_bytes(lay, rows)
    assert need <= budget
    # proportional to the device rows, and the budget is used up to alignment slack
    assert abs(rows["page"] / rows["swa_page"] - 100 / 40) < 0.05
    one_row_each = sum(lay.row_bytes(s) for s in dev)  # what flooring can leave unused
    assert budget - need < one_row_each + REGION_ALIGN * len(plan_regions(lay, rows))
    with pytest.raises(CapacityError, match="too small"):
        host_rows(lay, dev, host_bytes=1 << 20)
    with pytest.raises(UsageError, match="exactly one"):
        host_rows(lay, dev)
    with pytest.raises(UsageError, match="exactly one"):
        host_rows(lay, dev, host_bytes=budget, ratio=1.0)
    with pytest.raises(UsageError, match="unknown index spaces"):
        host_rows(lay, {**dev, "tokens": 3}, ratio=1.0)
    with pytest.raises(UsageError, match="missing"):
        host_rows(lay, {"page": 3}, ratio=1.0)


def test_arena_bytes_formula():
    lay = tiny()
    regions = plan_regions(lay, ROWS)
    data = sum(ROWS[p.index] * p.page_bytes * p.num_layers for p in lay.pools.values())
    assert sum(r.nbytes for r in regions) == data
    assert data <= arena_bytes(lay, ROWS) < data + REGION_ALIGN * len(regions)
    assert [r.offset % REGION_ALIGN for r in regions] == [0] * len(regions)
