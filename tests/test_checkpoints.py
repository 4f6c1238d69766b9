"""Resume checkpoints in the radix tree: match rule, eviction apart from pages, invariants.

A fake host tier moves page content and checkpoint content separately (a checkpoint is the
boundary key written into the device row's SWA/state part, or into a request slot's rings), so
every prefix a ``prepare`` returns is checked: each page holds its key, and the boundary's
checkpoint holds the boundary's key, wherever it came from.
"""
from __future__ import annotations

import random
import re

import pytest

from hicache.core.layout import LayoutError, build_layout, preset
from hicache.core.resume import ResumeModel
from hicache.engine.hooks import HostExhausted, HostUnavailable, TransferFailed
from hicache.engine.radix import PAGE_TOKENS, POLICIES, RadixTree


class CkptHooks:
    """Pages and checkpoints in dicts; content follows every copy."""

    def __init__(self, pages: int = 1000, ckpts: int = 1000) -> None:
        self.free = {"page": list(range(pages)), "ckpt": list(range(ckpts))}
        self.host: dict[tuple[str, int], object] = {}
        self.device: dict[int, object] = {}  # page row -> key
        self.dev_ckpt: dict[int, object] = {}  # page row -> key of the checkpoint in its SWA part
        self.ring: dict[int, object] = {}  # request slot -> key of the checkpoint in its rings
        self.fail: str | None = None
        self.ops: list[tuple[str, int, int]] = []  # (verb, pages, checkpoints) per command

    def _check(self) -> None:
        if self.fail == "unreachable":
            raise HostUnavailable("fake")

    def host_alloc(self, n, kind="page"):
        self._check()
        if n > len(self.free[kind]):
            raise HostExhausted(f"{kind}: {n} > {len(self.free[kind])}")
        out, self.free[kind] = self.free[kind][:n], self.free[kind][n:]
        return out

    def host_free(self, handles, kind="page"):
        self._check()
        for h in handles:
            assert h not in self.free[kind], f"double free of {kind} {h}"
            self.host.pop((kind, h), None)
        self.free[kind].extend(handles)

    def backup(self, rows, handles, ckpts=()):
        self._check()
        if self.fail == "transfer":
            raise TransferFailed("fake")
        for r, h in zip(rows, handles):
            self.host[("page", h)] = self.device[r]
        for src, h, depth in ckpts:
            self.host[("ckpt", h)] = (self.ring if self.slots else self.dev_ckpt)[src]
        self.ops.append(("backup", len(rows), len(ckpts)))
        return len(self.ops)

    def load(self, handles, rows, ckpts=()):
        self._check()
        if self.fail == "transfer":
            raise TransferFailed("fake")
        for h, r in zip(handles, rows):
            self.device[r] = self.host[("page", h)]
        for dst, h, depth in ckpts:
            (self.ring if self.slots else self.dev_ckpt)[dst] = self.host[("ckpt", h)]
        self.ops.append(("load", len(rows), len(ckpts)))
        return len(self.ops)

    slots = False  # ring SWA mode: checkpoints live in request slots

    def wait(self, ticket):
        self._check()

    def done(self, ticket):
        self._check()
        return True

    def copies_running(self, tickets):
        return False

    epoch = 0  # row_epoch: +1 when every host row is given back (a client reset, a restart)

    def row_epoch(self):
        return self.epoch


def run(tree: RadixTree, hooks: CkptHooks | None, keys, slot: int = 0):
    """prepare -> check every page and the checkpoint -> compute the rest -> release."""
    prefix = tree.prepare(keys, slot=slot) if not tree.device_ckpts else tree.prepare(keys)
    dev = hooks.device if hooks else None
    if dev is not None:
        for n in prefix.nodes:
            assert dev[n.device] == n.key
        if prefix.nodes:
            end = prefix.nodes[-1]
            if tree.device_ckpts:
                assert end.ckpt_dev and hooks.dev_ckpt[end.device] == end.key, "no checkpoint"
            else:
                assert prefix.ckpt == "host" and hooks.ring[slot] == end.key
    rows = tree.alloc_device(len(keys) - prefix.pages)
    if dev is not None:
        for k, r in zip(keys[prefix.pages:], rows):
            dev[r] = k
            hooks.dev_ckpt[r] = k  # prefill writes SWA and states of every page
        if not tree.device_ckpts and len(keys) > prefix.pages:
            hooks.ring[slot] = keys[-1]  # the slot's rings at the last page written
    tree.release(prefix, keys, rows, slot=slot, slot_tokens=len(keys) * PAGE_TOKENS)
    tree.check()
    return prefix


def seq(p, n):
    return [f"{p}{i}" for i in range(n)]


def test_match_stops_at_the_deepest_checkpoint():
    h = CkptHooks()
    tree = RadixTree(32, h, mirror="checkpoints")
    a = seq("a", 6)
    run(tree, h, a)
    assert tree.match(a + ["x"]) == (6, 0)
    assert tree.match(a[:4] + ["x"]) == (0, 0)  # pages cached, no checkpoint at 4
    p = run(tree, h, a[:4] + ["x"])
    assert p.pages == 0 and p.unresumable_pages == 4
    every = RadixTree(32, CkptHooks(), mirror="checkpoints", checkpoint_every=2)
    run(every, every.hooks, a)
    assert [every.match(a[:k] + ["x"])[0] for k in range(1, 7)] == [0, 2, 2, 4, 4, 6]


def test_full_mirror_resumes_anywhere():
    tree = RadixTree(32, None)
    run(tree, None, seq("a", 6))
    assert tree.match(seq("a", 4) + ["x"]) == (4, 0)


def test_evicting_a_checkpoint_shortens_later_matches():
    h = CkptHooks()
    tree = RadixTree(16, h, mirror="checkpoints", checkpoint_every=4)
    a = seq("a", 8)
    run(tree, h, a)
    tree.drain()
    assert tree.host_pages == 8 and tree.host_checkpoints == 2
    tree.evict_device(16)  # pages and device checkpoints leave the device; host copies stay
    assert tree.device_pages == 0 and tree.match(a + ["x"]) == (0, 8)
    deepest = next(n for n in tree.nodes() if n.key == "a7")
    tree._drop_ckpts([deepest])  # the checkpoint goes, its pages stay
    tree.check()
    assert tree.host_pages == 8 and tree.match(a + ["x"]) == (0, 4)
    p = run(tree, h, a + ["x"])
    assert (p.host_pages, p.unresumable_pages, p.ckpt) == (4, 4, "host")
    assert h.ops[-2:] == [("load", 4, 1), ("backup", 1, 2)]  # pages + checkpoints, one command


def test_checkpoint_capacity_evicts_checkpoints_apart_from_pages():
    h = CkptHooks()
    tree = RadixTree(64, h, mirror="checkpoints", host_ckpt_capacity=2)
    for p in "abc":
        run(tree, h, seq(p, 3))
    tree.drain()
    tree.check()
    assert tree.host_checkpoints == 2 and tree.host_pages == 9
    assert tree.stats.checkpoints_dropped == 1
    oldest = next(n for n in tree.nodes() if n.key == "a2")
    assert oldest.ckpt_host is None and oldest.host is not None and oldest.ckpt_dev
    tree.evict_device(64)
    assert tree.match(seq("a", 3) + ["x"]) == (0, 0)  # its pages alone are no hit
    assert tree.match(seq("c", 3) + ["x"]) == (0, 3)


def _checkpoint_on_host_only(h: CkptHooks) -> tuple[RadixTree, list, object]:
    """Four pages a0..a3 on the device and the host; a3's checkpoint only on the host (as
    after the engine reused the SWA rows of that page). Returns (tree, keys, a3's node)."""
    tree = RadixTree(16, h, mirror="checkpoints")
    a = seq("a", 4)
    run(tree, h, a)
    tree.drain()
    end = next(n for n in tree.nodes() if n.key == "a3")
    end.ckpt_dev = False
    return tree, a, end


def test_checkpoint_on_host_restores_into_a_device_page():
    """Pages on the device, their checkpoint only on the host: the load carries it alone."""
    h = CkptHooks()
    tree, a, end = _checkpoint_on_host_only(h)
    h.dev_ckpt[end.device] = "garbage"
    p = run(tree, h, a + ["x"])
    assert (p.device_pages, p.host_pages, p.ckpt) == (4, 0, "host")
    assert h.ops[-2] == ("load", 0, 1)


def test_ring_mode_needs_a_host_checkpoint_and_restores_into_the_slot():
    shadow = RadixTree(16, None, mirror="checkpoints", device_ckpts=False)
    a = seq("a", 4)
    run(shadow, None, a)
    assert shadow.match(a + ["x"]) == (0, 0)  # no device checkpoint in ring mode
    h = CkptHooks()
    h.slots = True
    tree = RadixTree(16, h, mirror="checkpoints", device_ckpts=False, policy="write_back")
    run(tree, h, a, slot=1)
    tree.drain()
    assert tree.host_checkpoints == 1 and tree.host_pages == 0  # write_back: the ring now
    h.ring[2] = "stale"
    p = run(tree, h, a + ["x"], slot=2)
    assert (p.device_pages, p.ckpt, p.ckpt_dst) == (4, "host", 2)
    with pytest.raises(ValueError, match="request slot"):
        tree.prepare(a + ["x"])
    with pytest.raises(ValueError, match="checkpoint_every"):
        RadixTree(4, h, mirror="checkpoints", device_ckpts=False, checkpoint_every=2)
    with pytest.raises(ValueError, match="full mirror"):
        RadixTree(4, h, checkpoint_every=2)


def test_write_back_saves_device_checkpoints_with_their_pages():
    h = CkptHooks()
    tree = RadixTree(4, h, mirror="checkpoints", policy="write_back")
    run(tree, h, seq("a", 4))
    assert tree.host_pages == 0 and tree.host_checkpoints == 0
    run(tree, h, seq("b", 4))  # evicts a*: pages and the a3 checkpoint in one command
    assert ("backup", 4, 1) in h.ops
    assert tree.match(seq("a", 4) + ["x"]) == (0, 4)


@pytest.mark.parametrize("policy", POLICIES)
@pytest.mark.parametrize("seed", range(4))
@pytest.mark.parametrize("fault", [None, "transfer", "unreachable"])
def test_random_workload_counts_no_page_without_its_checkpoint(policy, seed, fault):
    rnd = random.Random(seed)
    h = CkptHooks(pages=40, ckpts=6)
    tree = RadixTree(24, h, policy=policy, mirror="checkpoints",
                     checkpoint_every=rnd.choice([0, 3]), host_capacity=30, host_ckpt_capacity=5)
    prompts = [seq(f"s{i}-", rnd.randint(1, 6)) for i in range(4)]
    hits = 0
    for step in range(120):
        if fault and step == 60:
            h.fail = fault
        if fault == "transfer" and step == 70:
            h.fail = None
        keys = rnd.choice(prompts) + seq(f"u{rnd.randint(0, 15)}-", rnd.randint(0, 5))
        p = run(tree, h, keys)  # checks every page and the checkpoint of each hit
        hits += p.pages
        if rnd.random() < 0.1:
            tree.evict_checkpoints(rnd.randint(1, 3))
            tree.check()
    tree.drain()
    tree.check()
    assert hits > 0
    st = tree.stats
    assert st.device_hit_pages + st.host_hit_pages == hits


def test_resume_model_of_dsv4_flash():
    lay = build_layout(preset("dsv4-flash"))
    r = ResumeModel(lay)
    assert r.page_bytes == 998_208 and r.full_page_bytes == 11_028_288
    assert list(r.tail_offsets) == list(range(128, 256))
    assert r.swa_tail_bytes == 128 * 584 * 44
    assert r.state_bytes == 2_752_512 + 688_128
    assert r.checkpoint_host_bytes == lay.row_bytes("swa_page")
    full, ckpt = r.load_bytes(128, "full"), r.load_bytes(128, "checkpoints")
    assert full == 128 * 11_028_288 and ckpt * 5 <= full
    over = ResumeModel(lay, state_slots="overlap")
    assert over.state_bytes * 4 == r.state_bytes  # 4 of 16 slots (MTP ring)
    assert over.copyable and r.copyable is None
    ring = ResumeModel(build_layout(preset("dsv4-flash"), swa_mode="ring"))
    assert ring.checkpoint_space == "req_slot" and ring.ring_positions(3) == list(range(128))
    with pytest.raises(LayoutError, match="ring mode"):
        ring.load_bytes(4, "full")
    with pytest.raises(LayoutError, match="state_slots"):
        ResumeModel(lay, state_slots="half")
    odd = preset("dsv4-tiny").with_options(window=96)
    assert ResumeModel(build_layout(odd, swa_mode="ring")).ring_positions(1)[:2] == [64, 65]


def test_plan_reports_the_host_tier_under_both_mirrors(capsys):
    from hicache.cli import main
    from hicache.core.host_tier import host_tier_by_mirror
    from hicache.core.planner import PlanInputs

    flash = preset("dsv4-flash")
    t = host_tier_by_mirror(PlanInputs(flash, 100 << 30, host_mem=64 << 30))
    assert t["full"]["pages"] == (64 << 30) // 11_028_288
    ck = t["checkpoints"]
    assert ck["pages"] * 998_208 + ck["checkpoints"] * 10_030_080 <= 64 << 30
    assert ck["checkpoints"] == ck["pages"] // 32 and t["checkpoints_vs_full"] >= 5
    # what the daemon `serve` starts holds: its host rows follow the device rows' proportions,
    # so a checkpoints mirror there is bounded by its page rows, not by the split above
    from hicache.core.planner import plan
    rows = plan(PlanInputs(flash, 100 << 30, host_mem=64 << 30)).stages[0].host_rows
    assert t["full"]["served_pages"] == min(rows["page"], rows["swa_page"])
    assert ck["served_pages"] == min(rows["page"], rows["swa_page"] * 32) == rows["page"]
    assert ck["served_cached_tokens"] == rows["page"] * 256 < ck["cached_tokens"] // 5
    ring = host_tier_by_mirror(PlanInputs(flash, 100 << 30, swa_mode="ring", host_mem=64 << 30))
    assert "paged SWA" in ring["full"]["error"] and ring["checkpoints"]["pages"] > 0
    assert host_tier_by_mirror(PlanInputs(flash, 100 << 30)) is None
    # 64 GiB is smaller than the full-mirror device pools (plan refuses that without --force),
    # yet under checkpoints it holds more pages than the device: the comparison plan prints
    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--host-mem", "64GiB",
                 "--pages-per-checkpoint", "16", "--force"]) == 0
    out = capsys.readouterr().out
    assert "per host GiB" in out and "one checkpoint per 16 pages" in out


class LostLoadHooks(CkptHooks):
    """Every load is taken by the daemon but its outcome never comes back (a command without
    a reply, or an ack that never came): ``wait`` raises ``CopyOutcomeUnknown``."""

    def wait(self, ticket):
        from hicache.engine.hooks import CopyOutcomeUnknown

        if self.ops and self.ops[-1][0] == "load":
            raise CopyOutcomeUnknown("load: no reply from the hicache daemon within 5 s (fake)")


def test_a_lost_checkpoint_load_holds_the_nodes_row_once_it_is_evicted():
    """Paged SWA: the checkpoint of a device page was to be loaded into that page's own row
    and the load's outcome is unknown. The row stays the node's (its KV is fine), but once the
    node is evicted the row is held, not reused, until ``reset_host_tier``."""
    h = LostLoadHooks()
    tree, a, end = _checkpoint_on_host_only(h)
    row = end.device
    p = run(tree, h, a + ["x"])  # the checkpoint load is lost: recomputed
    assert p.ckpt != "host" and not tree.host_online and tree.suspect_rows == {row}
    assert tree.held_device_rows == []
    assert end.device == row  # the node keeps its row (its KV is intact)
    tree.evict_device(16)
    assert end.device is None and tree.held_device_rows == [row] and not tree.suspect_rows
    assert tree.device.available() == 15
    assert row not in tree.alloc_device(15)
    tree.check()
    h.epoch += 1  # the client reset (or registered again): the forgotten host rows are gone
    assert tree.reset_host_tier() is True
    assert tree.held_device_rows == [] and not tree.suspect_rows
    assert tree.device.alloc(1) == [row]  # the row held until the reset is free again


def test_a_lost_checkpoint_load_into_a_request_slot_holds_the_slot():
    """Ring SWA: the checkpoint load into request slot 2 had an unknown outcome. The prefix
    says ``slot_held``, the tree refuses slot 2 until ``reset_host_tier``, and other slots
    work."""
    h = LostLoadHooks()
    h.slots = True
    tree = RadixTree(16, h, mirror="checkpoints", device_ckpts=False, policy="write_back")
    a = seq("a", 4)
    run(tree, h, a, slot=1)
    tree.drain()
    prefix = tree.prepare(a + ["x"], slot=2)
    assert prefix.slot_held and prefix.pages == 0 and tree.held_slots == {2}
    rows = tree.alloc_device(5)
    tree.release(prefix, a + ["x"], rows, slot=3,  # the request moved to slot 3
                 slot_tokens=5 * PAGE_TOKENS)
    with pytest.raises(ValueError, match="request slot 2 is held"):
        tree.prepare(a, slot=2)
    other = tree.prepare(a, slot=3)  # another slot is taken (device-only now: no resume point)
    assert not other.slot_held
    tree.abort(other)
    with pytest.raises(ValueError, match="still holds the host rows"):  # same registration
        tree.reset_host_tier()
    assert tree.held_slots == {2} and not tree.host_online
    h.epoch += 1  # the client reset (or registered again): the forgotten host rows are gone
    assert tree.reset_host_tier() is True
    assert tree.held_slots == set()
    tree.abort(tree.prepare(a, slot=2))
    tree.check()


class SlotHooks:
    """Ring SWA hooks whose copies run only when waited for (as an asynchronous daemon's
    would land late): a checkpoint backup reads the slot's rings then, not when it is sent."""

    def __init__(self) -> None:
        self.free = {"page": list(range(50)), "ckpt": list(range(50))}
        self.host: dict = {}
        self.ring: dict = {}
        self.dev: dict = {}
        self.tickets: dict = {}

    def host_alloc(self, n, kind="page"):
        out = self.free[kind][:n]
        del self.free[kind][:n]
        return out

    def host_free(self, handles, kind="page"):
        self.free[kind] += list(handles)

    def backup(self, rows, handles, ckpts=()):
        t = len(self.tickets) + 1
        self.tickets[t] = (list(rows), list(handles), list(ckpts))
        return t

    def load(self, handles, rows, ckpts=()):
        for h, r in zip(handles, rows):
            self.dev[r] = self.host[("p", h)]
        for dst, h, _ in ckpts:
            self.ring[dst] = self.host[("c", h)]
        return 0

    def wait(self, t):
        rows, handles, ckpts = self.tickets.pop(t, ((), (), ()))
        for r, h in zip(rows, handles):
            self.host[("p", h)] = self.dev[r]
        for src, h, _ in ckpts:
            self.host[("c", h)] = self.ring[src]  # the copy reads the slot now

    def done(self, t):
        return False

    def copies_running(self, tickets):
        return False

    epoch = 0  # row_epoch: +1 when every host row is given back (a client reset, a restart)

    def row_epoch(self):
        return self.epoch


def test_ring_release_backs_the_slot_up_before_it_returns():
    """Ring SWA: the checkpoint backup ``release`` starts reads the request slot. The next
    request could reuse the slot (and a later one restored the wrong request's window as a
    hit); ``release`` now returns once that backup read the slot."""
    h = SlotHooks()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False)
    a, b = ["a0", "a1"], ["b0", "b1", "b2"]
    p = t.prepare(a[:1], slot=0)
    rows = t.alloc_device(2)
    for k, r in zip(a, rows):
        h.dev[r] = k
    h.ring[0] = a[-1]
    t.release(p, a, rows, slot=0, slot_tokens=len(a) * PAGE_TOKENS)
    p = t.prepare(b[:2], slot=0)  # the next request in the same slot, at once
    rows = t.alloc_device(3)
    for k, r in zip(b, rows):
        h.dev[r] = k
    h.ring[0] = b[-1]
    t.release(p, b, rows, slot=0, slot_tokens=len(b) * PAGE_TOKENS)
    t.drain()
    p = t.prepare(a + ["a2"], slot=1)  # resumes a in another slot
    assert p.pages == 2 and p.nodes[-1].key == "a1"
    assert h.ring.get(1) == "a1"  # a1's window, not b2's
    t.check()


def _ring_request(t: RadixTree, h: SlotHooks, keys: list, slot: int) -> tuple:
    """prepare ``keys[:1]`` in ``slot``, compute every page; the slot's rings stand after
    ``keys[-1]`` (the boundary). Returns (prefix, rows)."""
    p = t.prepare(keys[:1], slot=slot)
    rows = t.alloc_device(len(keys))
    for k, r in zip(keys, rows):
        h.dev[r] = k
    h.ring[slot] = keys[-1]
    return p, rows


def test_a_ring_slot_past_its_last_page_makes_no_checkpoint():
    """Ring SWA: a request whose prompt ends mid-page (or that decodes) hands ``release`` a
    slot past its last full page. Backing that slot up gave the page a checkpoint of other
    tokens, and a later hit restored it as the page's window. No checkpoint is made now, and
    a release that does not say where the slot stands is refused with nothing changed."""
    h = SlotHooks()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False)
    a = ["a0", "a1"]
    p, rows = _ring_request(t, h, a, 0)
    h.ring[0] = "a-own-state"  # 20 more tokens went in: the slot left a1's boundary
    free = t.device.available()
    with pytest.raises(ValueError, match="slot_tokens"):
        t.release(p, a, rows, slot=0)
    assert t.root.children == {} and t.device.available() == free and not h.tickets
    t.release(p, a, rows, slot=0, slot_tokens=len(a) * PAGE_TOKENS + 20)
    t.drain()
    assert t.stats.checkpoints_skipped == 1 and t.host_checkpoints == 0
    assert all(not ck for _, _, ck in h.tickets.values())  # no backup read the slot
    p = t.prepare(a + ["a2"], slot=1)
    assert p.pages == 0 and 1 not in h.ring  # nothing to resume from: recomputed, not wrong
    t.abort(p)
    t.check()


def test_a_boundary_snapshot_checkpoints_a_request_that_writes_on():
    """``snapshot_slot`` at the boundary backs the slot up before the request writes on;
    ``release(..., snapshot=)`` attaches it to the page, and a later hit restores that
    boundary's window. A snapshot of other keys, or one of an abort, is freed."""
    h = SlotHooks()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False, host_ckpt_capacity=4)
    a = ["a0", "a1"]
    p, rows = _ring_request(t, h, a, 0)
    ckpt_free = len(h.free["ckpt"])
    s = t.snapshot_slot(0, a)  # settled: the copy read the slot here
    assert s is not None and t.host_checkpoints == 1 and t.held_snapshots == 1
    assert len(h.free["ckpt"]) == ckpt_free - 1
    h.ring[0] = "a-own-state"  # then the request writes on
    t.release(p, a, rows, snapshot=s)  # neither slot nor slot_tokens needed: it covers a1
    t.drain()
    assert t.stats.checkpoints_skipped == 0 and t.stats.checkpoints_backed_up == 1
    assert t.host_checkpoints == 1 and t.held_snapshots == 0 and s.handle is None
    assert len(h.free["ckpt"]) == ckpt_free - 1
    p = t.prepare(a + ["a2"], slot=1)
    assert p.pages == 2 and p.ckpt == "host" and h.ring[1] == "a1"
    t.abort(p)
    b = ["b0", "b1"]
    p, rows = _ring_request(t, h, b, 2)
    z = t.snapshot_slot(2, ["z0", "z1"])
    assert z is not None and t.host_checkpoints == 2
    h.ring[2] = "b-own-state"
    t.release(p, b, rows, slot=2, slot_tokens=2 * PAGE_TOKENS + 1, snapshot=z)  # other keys
    assert t.stats.checkpoints_skipped == 1 and t.host_checkpoints == 1 and t.held_snapshots == 0
    assert len(h.free["ckpt"]) == ckpt_free - 1
    p = t.prepare(["c0"], slot=3)
    h.ring[3] = "c0"
    c = t.snapshot_slot(3, ["c0"])
    assert c is not None and t.host_checkpoints == 2
    t.abort(p, snapshot=c)
    assert t.host_checkpoints == 1 and len(h.free["ckpt"]) == ckpt_free - 1
    t.drop_snapshot(c)  # freed once only
    assert len(h.free["ckpt"]) == ckpt_free - 1
    with pytest.raises(ValueError, match="ring SWA"):
        RadixTree(4, h, mirror="checkpoints").snapshot_slot(0, ["a0"])
    t.check()


def test_a_snapshot_at_the_prompts_last_page_serves_a_request_that_decodes_on():
    """The snapshot taken where prefill ended (the prompt's last full page) is that page's
    checkpoint even when decode then fills more cached pages, and whichever slot the request
    ends in (found by the snapshot, not the slot; a review found both were thrown away)."""
    h = SlotHooks()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False, host_ckpt_capacity=1)
    prompt, keys = ["a0", "a1"], ["a0", "a1", "a2"]  # decode fills a2, then 12 tokens more
    p, rows = _ring_request(t, h, keys, 0)
    h.ring[0] = "a1"  # prefill's chunk ended at the prompt's last full page
    s = t.snapshot_slot(0, prompt)
    assert s is not None
    h.ring[3] = "a-own-state"  # the request moved to slot 3 (preempted, swapped back in)
    t.release(p, keys, rows, slot=3, slot_tokens=3 * PAGE_TOKENS + 12, snapshot=s)
    t.drain()
    assert t.stats.checkpoints_skipped == 1  # a2: the slot is past it
    assert t.root.children["a0"].children["a1"].ckpt_host is not None
    assert t.host_checkpoints == 1 and t.held_snapshots == 0 and t.stats.checkpoints_made == 1
    q = t.prepare(prompt + ["b"], slot=1)
    assert q.pages == 2 and h.ring[1] == "a1"
    t.abort(q)
    t.check()


@pytest.mark.parametrize("error", [TransferFailed, HostUnavailable])
def test_a_boundary_snapshot_whose_copy_fails_holds_nothing(error):
    """A snapshot's copy that fails frees its row and counts the failure (the tree goes on);
    one that loses the daemon takes the host tier offline, as for pages."""
    class Failing(SlotHooks):
        def wait(self, t):
            self.tickets.pop(t, None)
            raise error("copy failed")

    h = Failing()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False)
    p, rows = _ring_request(t, h, ["a0"], 0)
    free = len(h.free["ckpt"])
    assert t.snapshot_slot(0, ["a0"]) is None
    assert t.held_snapshots == 0 and t.host_checkpoints == 0
    if error is TransferFailed:
        assert t.host_online and t.stats.transfer_failures == 1 and len(h.free["ckpt"]) == free
    else:
        assert not t.host_online and t.stats.host_offline == 1
    t.release(p, ["a0"], rows, slot=0, slot_tokens=PAGE_TOKENS + 5)
    assert t.host_checkpoints == 0
    t.check()


def test_a_boundary_snapshot_is_refused_room_and_forgotten_with_the_tier():
    h = SlotHooks()
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False, host_ckpt_capacity=0)
    p, rows = _ring_request(t, h, ["a0"], 0)
    assert t.snapshot_slot(0, ["a0"]) is None and t.stats.checkpoint_backup_dropped == 1
    t.release(p, ["a0"], rows, slot=0, slot_tokens=PAGE_TOKENS + 1)
    assert t.host_checkpoints == 0 and t.stats.checkpoints_skipped == 1
    t2 = RadixTree(16, h, mirror="checkpoints", device_ckpts=False)
    p, rows = _ring_request(t2, h, ["b0"], 1)
    s = t2.snapshot_slot(1, ["b0"])
    assert s is not None and t2.host_checkpoints == 1
    t2.lose_host_tier()
    assert t2.host_checkpoints == 0 and t2.held_snapshots == 0 and s.handle is None
    t2.release(p, ["b0"], rows, snapshot=s)  # offline: no checkpoint wanted, nothing to say
    t2.check()


def test_a_write_back_eviction_batch_counts_each_page_once():
    """write_back, host tier full: one eviction batch takes x (its host copy kept) and y (no
    host copy). Making room for y's backup used to drop x from the host tier too, while x was
    counted as evicted from the device with its host copy kept; x is pinned meanwhile now."""
    h = CkptHooks()
    t = RadixTree(4, h, policy="write_back", host_capacity=1)

    def run(keys):
        p = t.prepare(keys[:-1] if len(keys) > 1 else [])
        rows = t.alloc_device(len(keys) - p.pages)
        for k, r in zip(keys[p.pages:], rows):
            h.device[r] = k
        t.release(p, keys, rows)
        t.check()

    run(["x"])
    t.evict_device(1)  # x -> host
    p = t.prepare(["x"])
    t.release(p, ["x"], [])  # x back on the device, its host copy kept
    run(["y"])
    before = t.stats.as_dict()
    t.evict_device(2)
    after = t.stats.as_dict()
    delta = {k: after[k] - before[k] for k in after if after[k] != before[k]}
    assert delta == {"device_evicted_pages": 1, "backup_dropped_pages": 1,
                     "dropped_pages": 1}, delta
    assert [(n.key, n.device, n.host is not None) for n in t.nodes()] == [("x", None, True)]
    t.check()


def test_a_duplicate_with_a_checkpoint_never_takes_a_held_pages_row():
    """Request B computed page ``a1`` while X inserted it (without a checkpoint there) and A
    then locked it, resuming past it at X's checkpoint on ``a2``. B's copy of ``a1`` carries a
    checkpoint, but the node is held: B's row is the duplicate freed, and A's rows stay A's
    (B's row replaced the held node's row, and A's row was freed while A read it)."""
    h = CkptHooks()
    tree = RadixTree(16, h, mirror="checkpoints")
    a = seq("a", 3)
    pb = tree.prepare(a[:2])  # B: nothing cached yet
    assert pb.pages == 0
    rows_b = tree.alloc_device(2)
    run(tree, h, a)  # X: inserts a0..a2, its checkpoint on a2 only
    pa = tree.prepare(a)  # A: locks a0..a2
    assert pa.pages == 3 and not pa.nodes[1].ckpt_dev
    held = [n.device for n in pa.nodes]
    for k, r in zip(a[:2], rows_b):
        h.device[r] = k
        h.dev_ckpt[r] = k
    tree.release(pb, a[:2], rows_b)  # B's a1 has a checkpoint (its last page)
    tree.check()
    assert [n.device for n in pa.nodes] == held
    assert not any(tree.device._used[r] == 0 for r in held), "a row A holds was freed"


def test_serve_splits_the_host_for_checkpoints_when_asked(tmp_path):
    """``--host-split checkpoints``: the request slots keep their device rows' count, the rest
    of ``--host-mem`` is page rows and one checkpoint row per ``--pages-per-checkpoint`` of
    them (``swa_page`` in paged mode, an extra ``req_slot`` row in ring mode); the arena fits;
    about the pages the plan's checkpoints figure promises, 6-7x the device split's. Refused
    where it does not apply, one line each."""
    from hicache.core.config import load_config, sizing
    from hicache.core.errors import UsageError
    from hicache.core.host_tier import host_tier_by_mirror
    from hicache.core.sizes import arena_bytes, parse_bytes

    base = {"preset": "dsv4-flash", "kv_mem": parse_bytes("100GiB"),
            "host_mem": parse_bytes("256GiB")}
    ck = sizing(load_config({**base, "host_split": "checkpoints"}))
    dev = sizing(load_config(base))
    rows = ck.host_rows
    assert rows["req_slot"] == ck.device_rows["req_slot"]
    assert rows["swa_page"] == rows["page"] // 32 >= 1
    assert arena_bytes(ck.layout, rows) <= base["host_mem"]
    from hicache.core.planner import PlanInputs
    want = host_tier_by_mirror(PlanInputs(preset("dsv4-flash"), 100 << 30,
                                          host_mem=256 << 30))["checkpoints"]["pages"]
    assert rows["page"] == want and rows["page"] > 6 * dev.host_rows["page"]  # one function
    assert "host split for checkpoints, 1 per 32 pages" in ck.source
    k16 = sizing(load_config({**base, "host_split": "checkpoints", "pages_per_checkpoint": 16}))
    assert k16.host_rows["swa_page"] == k16.host_rows["page"] // 16
    ring = sizing(load_config({**base, "host_split": "checkpoints", "swa_mode": "ring"}))
    assert ring.host_rows["req_slot"] == ring.device_rows["req_slot"] + ring.host_rows["page"] // 32
    for bad, msg in (({"host_ratio": 2.0, "host_mem": None}, "splits --host-mem"),
                     ({"pages_per_checkpoint": 16, "host_split": "device"}, "applies to "
                      "--host-split checkpoints only"),
                     ({"host_split": "both"}, "--host-split must be one of device | checkpoints"),
                     ({"pages_per_checkpoint": 0}, "--pages-per-checkpoint must be positive"),
                     ({"host_split": "device", "host_ratio": 2.0, "host_mem": None},
                      "--host-split splits --host-mem; give it in bytes")):
        with pytest.raises(UsageError, match=re.escape(msg)):
            sizing(load_config({**base, "host_split": "checkpoints", **bad}))
    with pytest.raises(Exception, match="too small for a checkpoints split"):
        sizing(load_config({**base, "host_split": "checkpoints",
                            "host_mem": parse_bytes("8MiB"), "force": True}))


def test_the_fewest_host_bytes_for_a_checkpoints_split():
    """``checkpoint_host_bytes``: its split holds the rows asked for, one byte less does not;
    nonsense is refused in one line."""
    import pytest

    from hicache.core.errors import CapacityError, UsageError
    from hicache.core.layout import build_layout, preset
    from hicache.core.sizes import checkpoint_host_bytes, checkpoint_host_rows

    for swa, ck in (("paged", "swa_page"), ("ring", "req_slot")):
        lay = build_layout(preset("dsv4-flash"), swa_mode=swa)
        dev = {s: n for s, n in {"page": 3000, "swa_page": 3000, "req_slot": 64}.items()
               if lay.space_pools(s)}
        slots = 64 if ck == "req_slot" else 0
        for pages, ckpts, k in ((5000, 156, 32), (4000, 4000, 1), (1, 1, 1)):
            n = checkpoint_host_bytes(lay, dev, pages, ckpts, k)
            got = checkpoint_host_rows(lay, dev, n, k)
            assert got["page"] >= pages and got[ck] - slots >= ckpts
            try:
                less = checkpoint_host_rows(lay, dev, n - 1, k)
            except CapacityError:  # not even one page row: holds less
                continue
            assert less["page"] < pages or less[ck] - slots < ckpts
    with pytest.raises(UsageError, match="pages >= 1"):
        checkpoint_host_bytes(lay, dev, 0, 1, 32)
    # no pages per checkpoint: refused, not "too small" nor a bound doubled to an overflow
    with pytest.raises(UsageError, match="pages per checkpoint >= 1"):
        checkpoint_host_bytes(lay, dev, 10, 1, 0)
    with pytest.raises(UsageError, match="--pages-per-checkpoint must be >= 1"):
        checkpoint_host_rows(lay, dev, 256 << 20, 0)
    # too small a budget names the least that holds one page row and one checkpoint row
    from hicache.core.sizes import format_bytes

    least = checkpoint_host_bytes(lay, dev, 1, 0, 32)
    for n in (1 << 20, least - 1):
        with pytest.raises(CapacityError, match=re.escape(f"(at least {format_bytes(least)} "
                                                          "with alignment)")):
            checkpoint_host_rows(lay, dev, n, 32)


def test_a_checkpoints_split_of_a_stage_without_page_pools_says_why():
    """DSV4-Flash's layers 0-1 hold SWA only: a stage of just those has no pages to
    checkpoint. ``--host-split checkpoints`` there ended in a row check meant for
    ``--device-rows`` (found by a review); it says what is wrong, and the device split serves
    it."""
    from hicache.core.config import load_config, sizing
    from hicache.core.errors import UsageError

    base = {"preset": "dsv4-flash", "kv_mem": 4 << 30, "stage_bounds": "0:2,2:43",
            "pp_rank": 0, "host_mem": 512 << 20}
    with pytest.raises(UsageError, match=r"this stage has no page pools \(layers \[0, 2\) "
                                         r"hold SWA only\).*device split"):
        sizing(load_config({**base, "host_split": "checkpoints"}, env={}))
    # the device split: the stages agree on their host rows, and 512 MiB leaves stage 1 (41
    # layers) fewer SWA rows than its device has, so stage 0 is refused too, saying why
    with pytest.raises(UsageError, match=r"host rows agreed over the 2 PP stages\) gives a "
                                         r"host tier no larger than the device pools"):
        sizing(load_config(base, env={}))
    assert sizing(load_config({**base, "host_mem": 8 << 30}, env={})).host_rows["swa_page"] > 0


def test_a_ring_release_with_the_host_tier_offline_makes_no_checkpoint():
    """Ring SWA keeps a checkpoint only as the host's copy of the slot: with the tier offline
    a release counted one made (and none skipped) though none existed anywhere (found by a
    review)."""
    h = CkptHooks()
    h.slots = True
    t = RadixTree(8, h, mirror="checkpoints", device_ckpts=False)
    t.lose_host_tier()
    p = t.prepare(seq("a", 2), slot=0)
    t.release(p, seq("a", 2), t.alloc_device(2), slot=0, slot_tokens=2 * PAGE_TOKENS)
    assert (t.stats.checkpoints_made, t.host_checkpoints, t.device_checkpoints) == (0, 0, 0)
    assert t.match(seq("a", 2)) == (0, 0)  # nothing to resume from: no checkpoint
    t.check()


def test_the_plans_checkpoints_figure_is_what_serve_makes_and_every_stage_counts():
    """``hicache plan``'s checkpoints figure was its own arithmetic: in ring mode serve held
    15-19% fewer pages (the request slots' rows come first) and could even refuse what the plan
    showed; a stage of SWA-only layers made every "the daemon the serve line starts" figure 0,
    and ring mode counted the slots' own rows as checkpoint rows (found by a review). The
    figure is serve's split now, row for row, and every stage bounds what it can."""
    from hicache.core.config import load_config, sizing
    from hicache.core.host_tier import host_tier_by_mirror
    from hicache.core.planner import PlanInputs, plan

    tiny = {"preset": "dsv4-tiny", "kv_mem": 64 << 20, "max_running": 16, "swa_mode": "ring",
            "host_mem": 128 << 20, "pages_per_checkpoint": 4}
    for swa in ("ring", "paged"):
        flags = {**tiny, "swa_mode": swa}
        inputs = PlanInputs(preset("dsv4-tiny"), 64 << 20, max_running=16, swa_mode=swa,
                            host_mem=128 << 20, pages_per_checkpoint=4)
        t = host_tier_by_mirror(inputs)["checkpoints"]
        got = sizing(load_config({**flags, "host_split": "checkpoints", "force": True},
                                 env={}))
        ck = "req_slot" if swa == "ring" else "swa_page"
        slots = got.device_rows["req_slot"] if swa == "ring" else 0
        assert (t["pages"], t["checkpoints"]) == (got.host_rows["page"],
                                                   got.host_rows[ck] - slots), swa
        st = plan(inputs).stages[0]
        beyond = st.host_rows[ck] - (st.device_rows["req_slot"] if swa == "ring" else 0)
        assert t["served_pages"] == min(st.host_rows["page"], beyond * 4), swa
    split = PlanInputs(preset("dsv4-flash"), 4 << 30, pp=2, bounds=((0, 2), (2, 43)),
                       host_mem=8 << 30)
    tiers = host_tier_by_mirror(split)
    stages = plan(split).stages
    assert "page" not in stages[0].host_rows  # layers 0-1: SWA only
    assert tiers["full"]["served_pages"] == min(
        stages[0].host_rows["swa_page"], stages[1].host_rows["page"],
        stages[1].host_rows["swa_page"]) > 0
    assert 0 < tiers["checkpoints"]["served_pages"] <= stages[1].host_rows["page"]


def test_plan_takes_the_checkpoints_split_and_its_serve_lines_reproduce_it(capsys):
    """``hicache plan`` had no ``--host-split``: it refused a ``--host-mem`` that serve's
    checkpoints split accepts, and no line it printed reproduced its checkpoints figure (found
    by a review). With ``--host-split checkpoints`` its stage rows are serve's split, its host
    check is serve's (page rows only), and each printed serve line sizes exactly those rows."""
    import json
    import shlex

    from hicache.cli import build_parser, main
    from hicache.core.config import SETTINGS, load_config, sizing

    def planned(*args: str) -> dict:
        assert main(["plan", *args, "--json"]) == 0
        return json.loads(capsys.readouterr().out)

    tiny = ["--preset", "dsv4-tiny", "--kv-mem", "64MiB", "--host-mem", "48MiB"]
    assert main(["plan", *tiny]) == 2  # the device split: not larger than the device pools
    assert "no larger than the device pools" in capsys.readouterr().err
    for extra in ([], ["--pages-per-checkpoint", "8"], ["--swa-mode", "ring", "--max-running",
                                                        "16", "--force"],
                  ["--pp-size", "2", "--pages-per-checkpoint", "4"]):
        d = planned(*tiny, "--host-split", "checkpoints", *extra)
        assert d["inputs"]["host_split"] == "checkpoints"
        for st in d["stages"]:
            line = st["serve_command"]
            assert "--host-split checkpoints" in line, line
            argv = shlex.split(line)[1:]
            args = build_parser(argv).parse_args(argv)
            cfg = load_config({s.name: getattr(args, s.name, None) for s in SETTINGS}, env={})
            assert sizing(cfg).host_rows == st["host_rows"], (extra, line)
        t = d["host_tier_by_mirror"]["checkpoints"]
        assert t["pages"] == min(st["host_rows"]["page"] for st in d["stages"])
    for bad, msg in ((["--host-split", "checkpoints", "--host-ratio", "2"], "splits --host-mem"),
                     (["--host-split", "device", "--host-ratio", "2"], "splits --host-mem"),
                     (["--host-split", "both"], "--host-split must be one of"),
                     (["--kv-mem", "4GiB", "--preset", "dsv4-flash", "--stage-bounds",
                       "0:2,2:43", "--host-mem", "8GiB", "--host-split", "checkpoints"],
                      "this stage has no page pools")):
        argv = ["plan", "--preset", "dsv4-tiny", "--kv-mem", "64MiB", *bad]
        if "--host-mem" not in bad and "--host-ratio" not in bad:
            argv += ["--host-mem", "48MiB"]
        assert main(argv) == 2, bad
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], (bad, err)


def _ring_round(t: RadixTree, h: CkptHooks, keys: list[str], slot: int,
                  match: list[str]) -> None:
    p = t.prepare(match, slot=slot)
    rows = t.alloc_device(len(keys) - p.pages)
    for k, r in zip(keys[p.pages:], rows):
        h.device[r] = k
    h.ring[slot] = keys[-1]
    t.release(p, keys, rows, slot=slot, slot_tokens=len(keys) * PAGE_TOKENS)
    t.drain()
    t.check()


def test_a_ring_checkpoint_the_host_holds_already_is_not_counted_made_again():
    """Ring SWA: a request that ends on a page whose checkpoint the host holds makes none (the
    backup skips it), but ``checkpoints_made`` counted one, so made minus backed up looked
    like lost backups (radix review)."""
    h = CkptHooks()
    h.slots = True
    t = RadixTree(16, h, mirror="checkpoints", device_ckpts=False)
    keys = ["a0", "a1", "a2"]
    _ring_round(t, h, keys, 0, keys[:-1])
    made, backed = t.stats.checkpoints_made, t.stats.checkpoints_backed_up
    assert made == backed == 1
    _ring_round(t, h, keys, 1, keys[:1])  # resumes nothing, recomputes a1, a2
    assert (t.stats.checkpoints_made, t.stats.checkpoints_backed_up) == (made, backed)
    assert t.host_checkpoints == 1


class _TierLostInL3(CkptHooks):
    """An L3 tier whose query finds the host tier gone, once armed."""

    l3 = True
    armed = False

    def l3_query(self, keys: list[str]) -> int:
        if not self.armed:
            return 0
        self.fail = "unreachable"
        raise HostUnavailable("gone during the L3 query")

    def l3_ckpt_present(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)

    def l3_put(self, *a: object) -> None:
        pass

    def l3_ckpt_put(self, *a: object) -> None:
        pass


def test_a_tier_lost_during_the_l3_query_evicts_no_device_page_for_the_load():
    """The host tier went offline while ``prepare`` asked L3: the load of the host pages could
    not run, but room was made for it first, evicting (under write-through: dropping) good
    device pages (radix review)."""
    h = _TierLostInL3()
    t = RadixTree(8, h, mirror="checkpoints", policy="write_through")

    def request(keys: list[str]) -> None:
        p = t.prepare(keys)
        rows = t.alloc_device(len(keys) - p.pages)
        for k, r in zip(keys[p.pages:], rows):
            h.device[r] = k
            h.dev_ckpt[r] = k
        t.release(p, keys, rows)
        t.drain()
        t.check()

    a = ["a0", "a1", "a2", "a3"]
    request(a)
    t.evict_device(4)  # a* on the host only, its checkpoint at a3
    request([f"b{i}" for i in range(8)])  # the device full of b*
    assert t.match(a + ["x"]) == (0, 4)
    before = t.device_pages
    h.armed = True
    p = t.prepare(a + ["x"])
    assert not t.host_online and p.pages == 0 and p.load_failed_pages == 4
    assert t.device_pages == before  # nothing evicted for it
    t.abort(p)
    t.check()
