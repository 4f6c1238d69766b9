"""A full-mirror host hit longer than the device rows free: the short load of ``RadixTree._load``.

With ``mirror="full"`` every cached page is a resume point, so when the device pool cannot take
every host page of a hit (the other rows are locked by live requests) ``prepare`` loads as many
pages as it got rows for and gives up the rest: the pages it does not load were pinned
(``io += 1``) while room was made, and must be unpinned again. Without that unpinning the tail
stays pinned forever: ``evict_host`` skips it, its host rows are never given back, and a later
request can no longer resume from it (a hit takes only idle host pages).

The tests build that situation with the in-memory ``FakeHooks`` of ``test_radix`` (content
moves with each copy, so the loaded rows are checked to hold their own pages), with the free
device rows interleaved with locked ones (every other row belongs to another live prefix), and
check what the hit loaded, that the tail is idle and host-resident after the request ends, that
it can be evicted from the host (or loaded by the next request), and that nothing stays locked
or pinned once no transfer is in flight.
"""
from __future__ import annotations

from typing import Any

from hicache.engine.radix import Node, Prefix, RadixTree

from test_radix import FakeHooks, run_request, seq

DEVICE_ROWS = 8
HIT_PAGES = 6  # the cached host prefix: longer than the rows free at the hit


def _node(tree: RadixTree, keys: list[str]) -> Node:
    """The node of page ``keys[-1]`` along ``keys``."""
    node = tree.root
    for k in keys:
        node = node.children[k]
    return node


def _short_hit() -> tuple[RadixTree, FakeHooks, dict[int, Any], list[Prefix], list[int]]:
    """A write-through full-mirror tree whose ``a`` prefix (``HIT_PAGES`` pages) is host-only,
    and whose device holds eight one-page prefixes ``p0..p7``, the even ones locked by live
    requests. Returns (tree, hooks, device content, the live prefixes, the rows of p1,p3,..)."""
    dev: dict[int, Any] = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(DEVICE_ROWS, hooks, policy="write_through", mirror="full")
    a = seq("a", HIT_PAGES)
    run_request(tree, a, dev)
    tree.drain()  # the backups of a* settle: their host copies are idle
    assert tree.evict_device(HIT_PAGES) == HIT_PAGES
    assert tree.match(a) == (0, HIT_PAGES) and tree.device_pages == 0
    for i in range(DEVICE_ROWS):  # eight one-page prefixes fill the device
        run_request(tree, [f"p{i}"], dev)
    tree.drain()
    live = [tree.prepare([f"p{i}"]) for i in range(0, DEVICE_ROWS, 2)]
    assert all(p.device_pages == 1 for p in live)
    odd = [_node(tree, [f"p{i}"]).device for i in range(1, DEVICE_ROWS, 2)]
    odd_rows = [r for r in odd if r is not None]
    assert len(odd_rows) == len(odd) and tree.device.available() == 0
    return tree, hooks, dev, live, odd_rows


def _assert_idle(tree: RadixTree) -> None:
    """Nothing locked, nothing pinned, no transfer in flight; the invariants hold."""
    busy = [(n.key, n.lock, n.io) for n in tree.nodes() if n.lock or n.io]
    assert busy == [], f"pages still locked or pinned: {busy}"
    assert not tree._inflight and tree._host_pending == 0
    tree.check()


def test_short_full_mirror_load_unpins_the_pages_it_does_not_load() -> None:
    tree, hooks, dev, live, odd_rows = _short_hit()
    free = DEVICE_ROWS - len(live)  # the rows unlocked pages can give up: fewer than the hit
    assert free < HIT_PAGES
    a = seq("a", HIT_PAGES)
    tail = [_node(tree, a[:i + 1]) for i in range(free, HIT_PAGES)]
    tail_handles = [n.host for n in tail]
    loads_before = sum(1 for c in hooks.calls if c[0] == "load")
    stats_before = tree.stats.as_dict()

    prefix = tree.prepare(a)

    # exactly as many host pages loaded as rows could be freed: the leading ones, in order
    assert (prefix.device_pages, prefix.host_pages, prefix.pages) == (0, free, free)
    assert prefix.ckpt == "page" and prefix.load_failed_pages == 0
    assert [k for k, _ in prefix.loaded] == a[:free]
    assert sorted(prefix.rows) == sorted(odd_rows)  # the rows between the locked ones
    assert all(dev[row] == key for key, row in prefix.loaded)  # each row holds its own page
    loads = [c for c in hooks.calls if c[0] == "load"]
    assert len(loads) == loads_before + 1  # one command, for the loaded pages only
    assert loads[-1][2] == prefix.rows and len(loads[-1][1]) == free
    stats = {k: v - stats_before[k] for k, v in tree.stats.as_dict().items()}
    assert stats["loaded_pages"] == free and stats["host_hit_pages"] == free
    assert stats["miss_pages"] == HIT_PAGES - free and stats["load_failed_pages"] == 0
    assert all(n.lock == 1 and n.io == 0 for n in prefix.nodes)
    # the tail was pinned while room was made, and is unpinned now: idle, host-only, unlocked
    for n in tail:
        assert (n.device, n.lock, n.io) == (None, 0, 0), n
        assert n.host is not None
    assert tree.match(a) == (free, HIT_PAGES - free)
    tree.check()

    # the request ends (it computed nothing: the device is full), the live ones too
    tree.release(prefix, a[:prefix.pages], [])
    for i, p in zip(range(0, DEVICE_ROWS, 2), live):
        tree.release(p, [f"p{i}"], [])
    _assert_idle(tree)
    for n in tail:  # still host-resident (the tree's node, a host copy in the host LRU)
        assert n.host is not None and n in tree._host_lru and n.io == 0
        assert hooks.host[n.host] == n.key

    # every host copy can be evicted now, the tail included, and its host rows come back
    held = tree.host_pages
    assert tree.evict_host(held) == held
    assert tree.host_pages == 0
    assert tree.match(a) == (free, 0)  # the tail left the tree
    assert a[free] not in _node(tree, a[:free]).children
    assert all(h in hooks.free_rows and h not in hooks.host for h in tail_handles)
    assert sorted(hooks.free_rows) == list(range(hooks.capacity))
    _assert_idle(tree)
    assert tree.evict_device(DEVICE_ROWS) == DEVICE_ROWS
    assert tree.device.available() == DEVICE_ROWS and not list(tree.nodes())
    tree.check()


def test_the_tail_of_a_short_load_is_a_hit_for_the_next_request() -> None:
    tree, hooks, dev, live, _ = _short_hit()
    free = DEVICE_ROWS - len(live)
    a = seq("a", HIT_PAGES)
    first = tree.prepare(a)
    assert first.host_pages == free
    tree.release(first, a[:first.pages], [])
    for i, p in zip(range(0, DEVICE_ROWS, 2), live):
        tree.release(p, [f"p{i}"], [])
    _assert_idle(tree)

    # room again: the next request resumes past the tail, loading just the pages left
    nxt = run_request(tree, a + ["b0"], dev)  # checks every prefix row holds its own page
    assert (nxt.device_pages, nxt.host_pages) == (free, HIT_PAGES - free)
    assert [k for k, _ in nxt.loaded] == a[free:]
    assert tree.stats.loaded_pages == HIT_PAGES
    tree.drain()
    _assert_idle(tree)
    held = tree.host_pages
    assert tree.evict_host(held) == held and tree.host_pages == 0
    assert sorted(hooks.free_rows) == list(range(hooks.capacity))
    _assert_idle(tree)
