"""The radix tree's L3 rules (``hicache.engine.radix_l3``) in the checkpoints mirror, over the
dry host tier plus an in-process key set standing in for the store: which pages and which
checkpoint a match fetches, all or nothing, and that no host handle leaks. The bytes of the
same paths through a real daemon and a real Mooncake Store are checked in test_l3_ckpt.py and
by the demo test."""
from __future__ import annotations

from typing import Any, Sequence

import pytest

from hicache.core.layout import build_layout, preset
from hicache.core.resume import ResumeModel
from hicache.engine.radix import RadixTree
from hicache.sim.dry import DryHooks


class StoreHooks(DryHooks):
    """Dry host tier with L3 verbs over ``store`` (a dict shared by several trees)."""

    l3 = True

    def __init__(self, store: dict[str, set], pages: int = 64, ckpts: int = 16) -> None:
        super().__init__(ResumeModel(build_layout(preset("dsv4-tiny"))), "checkpoints",
                         pages, ckpts)
        self.store = store
        self.fetched: list[tuple[str, list[Any]]] = []

    def l3_query(self, keys: Sequence[Any]) -> int:
        n = 0
        for k in keys:
            if k not in self.store["page"]:
                break
            n += 1
        return n

    def l3_ckpt_present(self, keys: Sequence[Any]) -> list[int]:
        return [int(k in self.store["ckpt"]) for k in keys]

    def l3_prefetch(self, keys: Sequence[Any], handles: Sequence[Any]) -> int:
        self.fetched.append(("page", list(keys)))
        return self.l3_query(keys[:len(handles)])

    def l3_ckpt_prefetch(self, keys: Sequence[Any], handles: Sequence[Any]) -> int:
        self.fetched.append(("ckpt", list(keys)))
        return sum(1 for k in keys if k in self.store["ckpt"])

    def l3_put(self, keys: Sequence[Any], handles: Sequence[Any]) -> None:
        self.store["page"].update(keys)

    def l3_ckpt_put(self, keys: Sequence[Any], handles: Sequence[Any]) -> None:
        self.store["ckpt"].update(keys)

    def free_rows(self) -> tuple[int, int]:
        return len(self._free["page"]), len(self._free["ckpt"])


def tree(hooks: StoreHooks, device: int = 32) -> RadixTree:
    return RadixTree(device, hooks, mirror="checkpoints", host_capacity=64,
                     host_ckpt_capacity=16)


def run(t: RadixTree, keys: list[int]) -> Any:
    """One request: resume what can be resumed, compute the rest, release, settle backups."""
    p = t.prepare(keys)
    rows = t.alloc_device(len(keys) - p.pages)
    t.release(p, keys, rows)
    t.drain()
    t.check()
    return p


def test_pages_and_their_checkpoint_come_from_l3():
    store: dict[str, set] = {"page": set(), "ckpt": set()}
    a = tree(StoreHooks(store))
    run(a, [1, 2, 3, 4, 5, 6])
    assert store == {"page": {1, 2, 3, 4, 5, 6}, "ckpt": {6}}  # the last page is checkpointed
    assert a.stats.l3_put_pages == 6 and a.stats.l3_put_checkpoints == 1
    hb = StoreHooks(store)
    b = tree(hb)
    p = run(b, [1, 2, 3, 4, 5, 6, 7])
    assert (p.pages, p.host_pages, p.l3_pages, p.ckpt) == (6, 6, 6, "host")
    assert b.stats.l3_hit_pages == 6 and b.stats.l3_hit_checkpoints == 1
    assert hb.fetched == [("page", [1, 2, 3, 4, 5, 6]), ("ckpt", [6])]


def test_only_up_to_the_deepest_checkpoint_and_all_or_nothing():
    store: dict[str, set] = {"page": {1, 2, 3, 4, 5, 6, 7, 8}, "ckpt": {3, 5}}
    h = StoreHooks(store)
    t = tree(h)
    free = h.free_rows()
    p = t.prepare([1, 2, 3, 4, 5, 6, 7, 8, 9])
    assert (p.pages, p.l3_pages) == (5, 5)  # up to the deepest boundary with a checkpoint
    t.abort(p)
    t.check()
    # a checkpoint whose pages L3 does not hold (a page was evicted): nothing fetched, no leak
    store2: dict[str, set] = {"page": {11, 12, 14}, "ckpt": {14}}
    h2 = StoreHooks(store2)
    t2 = tree(h2)
    free2 = h2.free_rows()
    p2 = t2.prepare([11, 12, 13, 14])
    assert p2.pages == 0 and h2.free_rows() == free2 and not list(t2.nodes())
    # pages arrive but the checkpoint does not (evicted between query and read): freed
    class Flaky(StoreHooks):
        def l3_ckpt_prefetch(self, keys: Sequence[Any], handles: Sequence[Any]) -> int:
            return 0

    h3 = Flaky({"page": {21, 22}, "ckpt": {22}})
    t3 = tree(h3)
    free3 = h3.free_rows()
    p3 = t3.prepare([21, 22, 23])
    assert p3.pages == 0 and h3.free_rows() == free3 and not list(t3.nodes())
    t3.check()
    assert h.free_rows() == (free[0] - 5, free[1] - 1)  # 5 pages and 1 checkpoint kept on host


def test_a_checkpoint_alone_makes_the_trees_own_pages_resumable():
    """The tree holds pages past its resume point (no checkpoint there); L3 holds one: only
    the checkpoint is fetched, and the prefix resumes on the tree's own pages."""
    store: dict[str, set] = {"page": set(), "ckpt": set()}
    a = tree(StoreHooks(store))
    run(a, [1, 2, 3, 4])  # checkpoint at 4 in the store
    hc = StoreHooks({"page": set(), "ckpt": set()})
    c = tree(hc)
    run(c, [1, 2, 3, 4, 5, 6])  # c holds 1..6, its checkpoint at 6 only
    hc.store = store  # c now shares a's store (which also got nothing from c)
    hc.fetched.clear()
    p = c.prepare([1, 2, 3, 4, 9])
    assert (p.pages, p.l3_pages) == (4, 0)
    assert c.stats.l3_hit_checkpoints == 1 and hc.fetched == [("ckpt", [4])]
    c.abort(p)
    c.check()


@pytest.mark.parametrize("fails", ["l3_prefetch", "l3_ckpt_prefetch"])
def test_a_failed_l3_fetch_gives_its_host_rows_back(fails):
    """A refused or failed prefetch (``TransferFailed``) after the tree took host rows for it:
    the rows go back (they used to stay allocated, owned by nobody)."""
    from hicache.engine.hooks import TransferFailed

    class Failing(StoreHooks):
        pass

    def boom(self, keys, handles):
        raise TransferFailed(f"{fails} refused (busy)")

    setattr(Failing, fails, boom)
    h = Failing({"page": {1, 2, 3, 4}, "ckpt": {4}})
    t = tree(h)
    before = h.free_rows()
    p = t.prepare([1, 2, 3, 4, 5])
    t.abort(p)
    t.check()
    assert p.pages == 0 and t.host_pages == 0 and t.host_checkpoints == 0
    assert h.free_rows() == before


def test_an_l3_put_of_unknown_outcome_leaves_the_host_tier_online():
    """A put whose command got no reply may or may not have been queued; L3 is best effort and
    writes nothing the tree holds (the daemon keeps the rows busy until it read them). It took
    the whole host tier offline, dropping every host page and checkpoint."""
    from hicache.engine.hooks import CopyOutcomeUnknown

    class NoReplyPut(StoreHooks):
        def l3_put(self, keys, handles):
            raise CopyOutcomeUnknown("no reply")

    t = tree(NoReplyPut({"page": set(), "ckpt": set()}))
    p = t.prepare([1, 2, 3])
    t.release(p, [1, 2, 3], t.alloc_device(3))
    t.drain()
    assert t.host_online and t.stats.host_offline == 0
    assert t.host_pages == 3


def test_l3_is_asked_for_a_deeper_checkpoint_when_the_tree_holds_every_page():
    """The tree holds every page of a re-sent prompt but its own deepest checkpoint is
    shallower; L3 holds the one at the end. L3 was asked only when the prompt went one page
    past what the tree held, so the same prompt resumed 2 pages instead of 4."""
    store: dict[str, set] = {"page": set(), "ckpt": set()}
    run(tree(StoreHooks(store)), [1, 2, 3, 4])  # L3: pages 1..4, a checkpoint at 4
    hooks = StoreHooks({"page": set(), "ckpt": set()})
    t = tree(hooks)
    run(t, [1, 2])
    run(t, [1, 2, 3, 4, 5, 6])  # the tree: pages 1..6, checkpoints at 2 and 6
    t.evict_checkpoints(99)
    hooks.store = store
    hooks.fetched.clear()
    p = t.prepare([1, 2, 3, 4])
    assert (p.pages, p.ckpt, p.unresumable_pages) == (4, "host", 0), p
    assert hooks.fetched == [("ckpt", [4])]  # the checkpoint only: the pages are the tree's
    t.abort(p)
    t.check()


def test_a_ring_prepare_without_its_slot_is_refused_before_l3_is_asked():
    """Ring SWA needs the request slot: ``prepare(keys)`` without it was refused only after
    the L3 fetch had put pages and a checkpoint into the host tier, and only when a checkpoint
    was found (found by a review). It is refused first, whatever is cached."""
    from hicache.engine.radix import PAGE_TOKENS

    def ring(h: StoreHooks) -> RadixTree:
        return RadixTree(32, h, mirror="checkpoints", device_ckpts=False, host_capacity=64,
                         host_ckpt_capacity=16)

    store: dict[str, set] = {"page": set(), "ckpt": set()}
    a = ring(StoreHooks(store))
    keys = [1, 2, 3, 4]
    p = a.prepare(keys, slot=0)
    a.release(p, keys, a.alloc_device(4), slot=0, slot_tokens=4 * PAGE_TOKENS)
    a.drain()
    assert store == {"page": {1, 2, 3, 4}, "ckpt": {4}}
    hb = StoreHooks(store)
    b = ring(hb)
    free = hb.free_rows()
    for k in (keys, [9]):  # a checkpoint in L3, and nothing cached at all
        with pytest.raises(ValueError, match="pass prepare\\(keys, slot=...\\)"):
            b.prepare(k)
    assert (b.host_pages, b.host_checkpoints, b.stats.l3_hit_pages) == (0, 0, 0)
    assert hb.free_rows() == free
    assert b.prepare(keys, slot=1).pages == 4  # with its slot: resumed from L3
