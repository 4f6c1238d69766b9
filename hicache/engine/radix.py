"""Reference radix tree over 256-token pages with a device tier and a host tier.

A node is one page: its key (a hash of the page's tokens chained with its prefix, or any
hashable the engine uses), at most one device row and at most one host handle. The engine-side
verbs, in the order a request uses them:

* ``prepare(keys) -> Prefix`` — longest cached prefix: device hits, then the host hits that
  follow them contiguously, which are loaded into newly allocated device rows (and waited
  for). Every page of the prefix is locked until ``release``.
* ``alloc_device(n) -> rows`` — device rows for the pages the engine computes itself,
  evicting least recently used device copies when the pool is short.
* ``release(prefix, keys, rows)`` — the request finished: its new pages (``keys`` after the
  prefix, computed into ``rows``) enter the tree, the prefix is unlocked and the write policy
  runs. ``free_device(rows)`` returns rows the engine does not cache (a partial last page).

Invariants (``check()`` verifies them):

* Every node has a device copy or a host copy (or both); a node with neither is removed.
* Device copies are evicted from the leaves upward: a page whose children still have device
  copies keeps its own, so the device-resident pages form a prefix-closed subtree and a
  device hit is always a prefix. Host-only pages hang below device pages, never above.
* A host copy is dropped only from a page that keeps a device copy or has no children, so
  every cached page stays reachable from the root through cached pages.
* Nothing locked is evicted: ``lock`` counts running requests using the page, ``io`` counts
  transfers in flight on it (a backup pins both copies; a load pins the host copy).

Write policies: ``write_through`` backs up every new page right after its request
(asynchronously; ``poll`` completes backups), ``write_through_selective`` backs a page up on
its second use (the request that computed it is the first, each later prefix hit adds one;
``selective_threshold``), ``write_back`` backs a page up only when its device copy is evicted.
A device copy that is evicted without a host copy (not write_back, or the host pool is full)
is dropped, and with it any host-only pages below it.

Host tier failures never fail a request: ``HostExhausted`` drops the page, ``HostUnavailable``
empties the host tier (every host copy is forgotten, host hits become misses, counted in
``stats.host_offline``) and the tree runs device-only from then on until ``reset_host_tier``.
A tree built with ``hooks=None`` is device-only (the counterfactual of the demo).
"""
from __future__ import annotations

from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable, Sequence

from hicache.core.errors import HicacheError
from hicache.engine.hooks import HostExhausted, HostTierError, HostUnavailable, TierHooks

PAGE_TOKENS = 256
POLICIES = ("write_through", "write_through_selective", "write_back")


class DeviceFull(HicacheError):
    """The device pool cannot hold a request even after evicting everything unlocked."""


class RowFreeList:
    """Device page rows ``0 .. capacity-1``: a free list with O(n) alloc/free and checks."""

    def __init__(self, capacity: int) -> None:
        if capacity <= 0:
            raise ValueError(f"device capacity must be positive, got {capacity}")
        self.capacity = capacity
        self._free = list(range(capacity - 1, -1, -1))
        self._used = bytearray(capacity)

    def available(self) -> int:
        return len(self._free)

    def alloc(self, n: int) -> list[int] | None:
        """``n`` rows, or ``None`` (and nothing taken) when fewer are free."""
        if n > len(self._free):
            return None
        rows = self._free[len(self._free) - n:]
        del self._free[len(self._free) - n:]
        for r in rows:
            self._used[r] = 1
        return rows

    def free(self, rows: Iterable[int]) -> None:
        rows = list(rows)
        for r in rows:
            if not 0 <= r < self.capacity or not self._used[r]:
                raise ValueError(f"device row {r} is not allocated (capacity {self.capacity})")
        for r in rows:
            self._used[r] = 0
        self._free.extend(rows)


class Node:
    __slots__ = ("key", "parent", "children", "device", "host", "lock", "io", "hits",
                 "dev_children")

    def __init__(self, key: Hashable, parent: "Node | None") -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.device: int | None = None  # device page row
        self.host: Any = None  # host handle (opaque to the tree)
        self.lock = 0  # running requests using this page
        self.io = 0  # transfers in flight on this page
        self.hits = 0  # requests that used this page (its creator included)
        self.dev_children = 0  # children that hold a device copy

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Node({self.key!r}, dev={self.device}, host={self.host is not None}, "
                f"lock={self.lock}, io={self.io}, hits={self.hits})")


@dataclass
class Prefix:
    """What ``prepare`` found for a request: locked nodes, by tier, and the rows loaded."""

    nodes: list[Node]
    device_pages: int  # pages that were on device already
    host_pages: int  # pages loaded from host (now on device)
    loaded: list[tuple[Hashable, int]] = field(default_factory=list)  # (key, device row)
    load_failed_pages: int = 0  # host hits recomputed because the host tier failed
    l3_pages: int = 0  # of host_pages: pages the L3 tier supplied (fetched at match time)

    @property
    def pages(self) -> int:
        return len(self.nodes)

    @property
    def rows(self) -> list[int]:
        return [n.device for n in self.nodes]  # type: ignore[misc]


@dataclass
class TreeStats:
    device_hit_pages: int = 0
    host_hit_pages: int = 0
    miss_pages: int = 0
    loaded_pages: int = 0
    backed_up_pages: int = 0
    backup_dropped_pages: int = 0  # a backup was wanted but the host pool had no room
    device_evicted_pages: int = 0  # device copy freed, host copy kept
    dropped_pages: int = 0  # pages that left the cache entirely
    host_evicted_pages: int = 0  # host copies dropped to make room
    host_offline: int = 0  # times the host tier was lost (daemon unreachable)
    load_failed_pages: int = 0  # host hits recomputed because a load failed
    transfer_failures: int = 0
    l3_hit_pages: int = 0  # pages fetched from L3 into the host tier at match time
    l3_put_pages: int = 0  # pages handed to L3 after their backup (written or skipped there)

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)


class RadixTree:
    """Two-tier page cache for one worker (see the module docstring for the contract)."""

    def __init__(
        self,
        device: RowFreeList | int,
        hooks: TierHooks | None = None,
        *,
        policy: str = "write_through",
        host_capacity: int | None = None,
        selective_threshold: int = 2,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        self.device = RowFreeList(device) if isinstance(device, int) else device
        self.hooks = hooks
        self.policy = policy
        self.host_capacity = host_capacity
        self.selective_threshold = selective_threshold
        self.host_online = hooks is not None
        self.root = Node(None, None)
        self.stats = TreeStats()
        # LRU orders, oldest first. A path is touched leaf-first, so an ancestor always sits
        # after its descendants and eviction finds leaves first.
        self._dev_lru: OrderedDict[Node, None] = OrderedDict()
        self._host_lru: OrderedDict[Node, None] = OrderedDict()
        self._host_pending = 0  # host handles held by backups not yet in _host_lru
        self._inflight: list[tuple[Any, list[Node]]] = []  # (ticket, nodes) of backups

    # ------------------------------------------------------------------ queries
    @property
    def device_pages(self) -> int:
        return len(self._dev_lru)

    @property
    def host_pages(self) -> int:
        return len(self._host_lru) + self._host_pending

    def match(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(device hit pages, host hit pages after them) for ``keys``; changes nothing."""
        dev = host = 0
        node = self.root
        for key in keys:
            node = node.children.get(key)  # type: ignore[assignment]
            if node is None:
                break
            if node.device is not None and host == 0:
                dev += 1
            elif node.host is not None and self.host_online:
                host += 1
            else:
                break
        return dev, host

    # ------------------------------------------------------------------ request path
    def prepare(self, keys: Sequence[Hashable]) -> Prefix:
        """Lock the cached prefix of ``keys``; load its host part onto the device first."""
        self.poll()
        dev_nodes: list[Node] = []
        host_nodes: list[Node] = []
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            if child.device is not None and not host_nodes:
                dev_nodes.append(child)
            elif child.host is not None and self.host_online and child.io == 0:
                host_nodes.append(child)
            else:
                break
            node = child
        l3_nodes = self._l3_fetch(node, keys[len(dev_nodes) + len(host_nodes):])
        host_nodes += l3_nodes
        for n in dev_nodes:
            n.lock += 1
        prefix = Prefix(dev_nodes, len(dev_nodes), 0)
        if host_nodes:
            self._load(prefix, host_nodes)
        for n in prefix.nodes:
            n.hits += 1
        self._touch(prefix.nodes)
        self.stats.device_hit_pages += prefix.device_pages
        self.stats.host_hit_pages += prefix.host_pages
        prefix.l3_pages = sum(1 for n in l3_nodes if n in prefix.nodes)
        self.stats.miss_pages += len(keys) - prefix.pages
        if self.policy == "write_through_selective":
            self._backup([n for n in prefix.nodes
                          if n.host is None and n.hits >= self.selective_threshold])
        return prefix

    def _load(self, prefix: Prefix, host_nodes: list[Node]) -> None:
        for n in host_nodes:
            n.io += 1  # pin the host copies while we make room on the device
        rows = self._alloc_device_upto(len(host_nodes))
        if not self.host_online:  # lost while making room (a backup found the daemon gone)
            for n in host_nodes:
                n.io -= 1
            self.device.free(rows)
            self.stats.load_failed_pages += len(host_nodes)
            prefix.load_failed_pages = len(host_nodes)
            return
        for n in host_nodes[len(rows):]:
            n.io -= 1
        host_nodes = host_nodes[:len(rows)]
        if not host_nodes:
            return
        assert self.hooks is not None
        ok = False
        try:
            ticket = self.hooks.load([n.host for n in host_nodes], rows)
            self.hooks.wait(ticket)
            ok = True
        except HostUnavailable:
            self._go_offline()
        except HostTierError:
            self.stats.transfer_failures += 1
        finally:
            for n in host_nodes:
                n.io -= 1
        if not ok:
            self.device.free(rows)
            self.stats.load_failed_pages += len(host_nodes)
            prefix.load_failed_pages = len(host_nodes)
            if self.host_online:  # the copies are suspect: drop them (leaf first)
                self._drop_host([n for n in reversed(host_nodes) if n.host is not None])
            return
        for n, row in zip(host_nodes, rows):
            self._set_device(n, row)
            n.lock += 1
            prefix.nodes.append(n)
            prefix.loaded.append((n.key, row))
        prefix.host_pages = len(host_nodes)
        self.stats.loaded_pages += len(host_nodes)

    def alloc_device(self, n: int) -> list[int]:
        """``n`` device rows for pages the engine computes, evicting as needed."""
        rows = self._alloc_device_upto(n)
        if len(rows) < n:
            self.device.free(rows)
            raise DeviceFull(
                f"device pool cannot supply {n} page rows: {self.device.capacity} rows, "
                f"{self.device.available()} free after evicting every unlocked page"
            )
        return rows

    def free_device(self, rows: Iterable[int]) -> None:
        self.device.free(rows)

    def release(self, prefix: Prefix, keys: Sequence[Hashable], rows: Sequence[int]) -> None:
        """Insert ``keys[prefix.pages:]`` computed into ``rows``; unlock the prefix."""
        new_keys = keys[prefix.pages:]
        if len(new_keys) != len(rows):
            raise ValueError(f"{len(new_keys)} new pages but {len(rows)} rows given")
        node = prefix.nodes[-1] if prefix.nodes else self.root
        path = list(prefix.nodes)
        created: list[Node] = []
        duplicate: list[int] = []
        for key, row in zip(new_keys, rows):
            child = node.children.get(key)
            if child is None:
                child = Node(key, node)
                node.children[key] = child
                child.hits = 1
                self._set_device(child, row)
                created.append(child)
            elif child.device is None:  # host-only (inserted meanwhile): take our copy
                self._set_device(child, row)
                child.hits += 1
            else:  # another request inserted this page meanwhile: keep theirs
                duplicate.append(row)
                child.hits += 1
            path.append(child)
            node = child
        if duplicate:
            self.device.free(duplicate)
        for n in prefix.nodes:
            n.lock -= 1
        self._touch(path)
        if self.policy == "write_through":
            self._backup([n for n in created if n.host is None])
        elif self.policy == "write_through_selective":
            self._backup([n for n in path if n.host is None and n.io == 0
                          and n.hits >= self.selective_threshold])

    def abort(self, prefix: Prefix) -> None:
        """Unlock a prefix whose request is dropped without inserting anything."""
        for n in prefix.nodes:
            n.lock -= 1

    # ------------------------------------------------------------------ backups
    def poll(self) -> None:
        """Complete the backups that finished (non-blocking)."""
        i = 0
        while i < len(self._inflight):
            ticket, nodes = self._inflight[i]
            assert self.hooks is not None
            try:
                done = self.hooks.done(ticket)
            except HostUnavailable:
                self._go_offline()  # settles every backup still listed
                return
            if not done:
                i += 1
                continue
            del self._inflight[i]
            self._finish_backup(ticket, nodes)
            if not self.host_online:
                return

    def drain(self) -> None:
        """Wait for every backup in flight."""
        while self._inflight:
            ticket, nodes = self._inflight.pop(0)
            self._finish_backup(ticket, nodes)

    def _finish_backup(self, ticket: Any, nodes: list[Node]) -> None:
        """Settle one backup that left ``_inflight``: its pages become host copies or not."""
        assert self.hooks is not None
        ok = False
        lost = False
        try:
            self.hooks.wait(ticket)
            ok = True
        except HostUnavailable:
            lost = True
        except HostTierError:
            self.stats.transfer_failures += 1
        for n in nodes:
            n.io -= 1
        self._host_pending -= len(nodes)
        if ok:
            for n in reversed(nodes):  # nodes run root to leaf: add leaves first
                self._host_lru[n] = None
            self.stats.backed_up_pages += len(nodes)
            self._l3_put(nodes)
            return
        handles = [n.host for n in nodes]
        for n in nodes:
            n.host = None
        if lost:
            self._go_offline()
            return
        self._free_handles(handles)
        self._prune_reversed(nodes)

    def _backup(self, nodes: list[Node]) -> None:
        """Start an asynchronous backup of device-resident ``nodes`` (write-through paths)."""
        if not nodes or not self.host_online:
            return
        handles = self._host_alloc(len(nodes))
        if handles is None:
            self.stats.backup_dropped_pages += len(nodes)
            return
        assert self.hooks is not None
        try:
            ticket = self.hooks.backup([n.device for n in nodes], handles)  # type: ignore[misc]
        except HostUnavailable:
            self._go_offline()
            return
        except HostTierError:
            self.stats.transfer_failures += 1
            self._free_handles(handles)
            return
        for n, h in zip(nodes, handles):
            n.host = h
            n.io += 1
        self._host_pending += len(nodes)
        self._inflight.append((ticket, nodes))

    # ------------------------------------------------------------------ eviction
    def _alloc_device_upto(self, n: int) -> list[int]:
        """Up to ``n`` device rows (fewer only when everything else is locked)."""
        if n <= 0:
            return []
        short = n - self.device.available()
        if short > 0:
            self.poll()
            self.evict_device(short)
            short = n - self.device.available()
            if short > 0 and self._inflight:  # backups in flight pin pages: let them finish
                self.drain()
                self.evict_device(short)
        got = min(n, self.device.available())
        return self.device.alloc(got) or []

    def evict_device(self, n: int) -> int:
        """Free ``n`` device rows (leaf first, LRU); returns how many were freed."""
        freed = 0
        while freed < n:
            victims: list[Node] = []
            chosen: set[Node] = set()
            for node in self._dev_lru:  # oldest first; cascades upward in the same pass
                if freed + len(victims) >= n:
                    break
                if node.lock or node.io or node.dev_children or node in chosen:
                    continue
                victims.append(node)
                chosen.add(node)
                node.parent.dev_children -= 1  # type: ignore[union-attr]
            if not victims:
                break
            freed += self._evict_batch(victims)
        return freed

    def _evict_batch(self, victims: list[Node]) -> int:
        """Take the device copies of ``victims`` (leaf first); back up or drop as the policy says."""
        rows = [v.device for v in victims]
        for v in victims:
            del self._dev_lru[v]
            v.device = None
        need_backup = [(v, r) for v, r in zip(victims, rows) if v.host is None]
        lost: list[Node] = []
        if need_backup and self.policy == "write_back" and self.host_online:
            saved = self._backup_now([v for v, _ in need_backup], [r for _, r in need_backup])
            lost = [v for v, _ in need_backup if v not in saved]
        else:
            lost = [v for v, _ in need_backup]
        self.device.free(rows)  # type: ignore[arg-type]
        self.stats.device_evicted_pages += len(victims) - len(lost)
        for v in lost:  # leaf first; a lost page takes its host-only subtree with it
            if v.parent is not None and v.parent.children.get(v.key) is v:
                self._drop_subtree(v)
        return len(rows)

    def _backup_now(self, nodes: list[Node], rows: list[int]) -> set[Node]:
        """Synchronous backup before a device copy goes (write_back); returns nodes saved."""
        handles = self._host_alloc(len(nodes))
        if handles is None:
            self.stats.backup_dropped_pages += len(nodes)
            return set()
        assert self.hooks is not None
        try:
            self.hooks.wait(self.hooks.backup(rows, handles))
        except HostUnavailable:
            self._go_offline()
            return set()
        except HostTierError:
            self.stats.transfer_failures += 1
            self._free_handles(handles)
            return set()
        for n, h in zip(nodes, handles):  # victims run leaf first, as the LRU wants them
            n.host = h
            self._host_lru[n] = None  # newer than any host-only page (it was on device)
        self.stats.backed_up_pages += len(nodes)
        return set(nodes)

    def _host_alloc(self, n: int) -> list[Any] | None:
        """``n`` host handles, evicting host LRU pages to make room; ``None`` = no room."""
        assert self.hooks is not None
        if self.host_capacity is not None:
            if n > self.host_capacity:
                return None
            over = self.host_pages + n - self.host_capacity
            if over > 0:
                self.evict_host(over)
                if self.host_pages + n > self.host_capacity:
                    return None
        for attempt in range(2):
            try:
                return self.hooks.host_alloc(n)
            except HostExhausted:
                if attempt == 0 and self.evict_host(n) == 0:
                    return None
            except HostUnavailable:
                self._go_offline()
                return None
        return None

    def evict_host(self, n: int) -> int:
        """Drop ``n`` host copies (LRU; leaves or device-resident pages only)."""
        total = 0
        while total < n:
            dropped: list[Node] = []
            for node in self._host_lru:  # oldest first; cascades upward in the same pass
                if total + len(dropped) >= n:
                    break
                if node.io or (node.device is None and node.children):
                    continue
                dropped.append(node)
                if node.device is None and node.parent is not None:  # host-only leaf: unlink
                    del node.parent.children[node.key]  # now, so its parent can follow
            if not dropped:
                break
            handles = []
            for node in dropped:
                del self._host_lru[node]
                handles.append(node.host)
                node.host = None
                if node.device is None:
                    self.stats.dropped_pages += 1
            self.stats.host_evicted_pages += len(dropped)
            self._free_handles(handles)
            total += len(dropped)
        return total

    # ------------------------------------------------------------------ helpers
    def _set_device(self, node: Node, row: int) -> None:
        node.device = row
        node.parent.dev_children += 1  # type: ignore[union-attr]
        self._dev_lru[node] = None

    def _touch(self, path: list[Node]) -> None:
        for n in reversed(path):  # leaf first: ancestors end up more recent
            if n.device is not None and n in self._dev_lru:
                self._dev_lru.move_to_end(n)
            if n in self._host_lru:
                self._host_lru.move_to_end(n)

    def _drop_host(self, nodes: list[Node]) -> None:
        """Forget host copies of ``nodes`` (leaf first) and free them."""
        handles = []
        for n in nodes:
            if n.host is None or n.io:
                continue
            handles.append(n.host)
            n.host = None
            self._host_lru.pop(n, None)
            if n.device is None:
                self._drop_subtree(n)
        self._free_handles(handles)

    def _drop_subtree(self, node: Node) -> None:
        """Remove ``node`` and everything below it (none of it device-resident)."""
        handles = []
        stack = [node]
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            assert n.device is None and not n.io, f"dropping a pinned page {n.key!r}"
            if n.host is not None:
                handles.append(n.host)
                n.host = None
                self._host_lru.pop(n, None)
            self.stats.dropped_pages += 1
        if node.parent is not None and node.parent.children.get(node.key) is node:
            del node.parent.children[node.key]
        self._free_handles(handles)

    def _prune_reversed(self, nodes: list[Node]) -> None:
        for n in reversed(nodes):
            if n.device is None and n.host is None and n.parent is not None:
                self._drop_subtree(n)

    def _free_handles(self, handles: list[Any]) -> None:
        if not handles or not self.host_online:
            return
        assert self.hooks is not None
        try:
            self.hooks.host_free(handles)
        except HostUnavailable:
            self._go_offline()
        except HostTierError:
            self.stats.transfer_failures += 1

    def _go_offline(self) -> None:
        """The host tier is gone: forget every host copy, keep serving from the device."""
        if not self.host_online:
            return
        self.host_online = False
        self.stats.host_offline += 1
        for _, nodes in self._inflight:
            for n in nodes:
                n.io -= 1
        self._inflight.clear()
        self._host_pending = 0
        for n in list(self._host_lru):
            n.host = None
        self._host_lru.clear()
        stack = [self.root]
        while stack:
            n = stack.pop()
            for key, child in list(n.children.items()):
                if child.device is None:
                    del n.children[key]  # host-only subtree (prefix-closed device set)
                    self.stats.dropped_pages += 1
                else:
                    child.host = None
                    stack.append(child)

    def lose_host_tier(self) -> None:
        """The engine learned the host tier is gone (e.g. a failed state swap): forget it."""
        self._go_offline()

    def reset_host_tier(self, hooks: TierHooks | None = None) -> None:
        """Start using a (re-registered) host tier again after ``HostUnavailable``."""
        if hooks is not None:
            self.hooks = hooks
        self.host_online = self.hooks is not None

    # ------------------------------------------------------------------ checking
    def nodes(self) -> Iterable[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check(self) -> None:
        """Raise AssertionError when an invariant of the module docstring is broken."""
        dev = host = 0
        rows = set()
        for n in self.nodes():
            assert n.parent is not None and n.parent.children.get(n.key) is n, n
            assert n.device is not None or n.host is not None, f"page {n.key!r} has no copy"
            dc = sum(1 for c in n.children.values() if c.device is not None)
            assert dc == n.dev_children, f"page {n.key!r}: dev_children {n.dev_children} != {dc}"
            if n.device is not None:
                dev += 1
                assert n.device not in rows, f"device row {n.device} used twice"
                rows.add(n.device)
                assert n in self._dev_lru
                p = n.parent
                assert p is self.root or p.device is not None, f"page {n.key!r} above no device"
            else:
                assert n not in self._dev_lru
            if n.host is not None and n.io == 0:
                host += 1
                assert n in self._host_lru
            assert n.lock >= 0 and n.io >= 0
        assert dev == len(self._dev_lru), (dev, len(self._dev_lru))
        assert host == len(self._host_lru), (host, len(self._host_lru))
        assert dev + self.device.available() <= self.device.capacity

    # ------------------------------------------------------------------ L3 tier (optional)
    # Hooks with ``l3 = True`` also offer ``l3_query(keys) -> n``, ``l3_prefetch(keys,
    # handles) -> n`` and ``l3_put(keys, handles)`` (``ClientHooks(l3=True)``). At match time
    # the pages after the tree's own prefix that L3 holds are fetched into new host handles and
    # become host-only nodes, loaded like any host hit; after a backup, pages go to L3 too.
    def _l3_fetch(self, parent: Node, keys: Sequence[Hashable]) -> list[Node]:
        if not keys or not self.host_online or not getattr(self.hooks, "l3", False) or \
                keys[0] in parent.children:
            return []
        hooks: Any = self.hooks
        try:
            n = hooks.l3_query(list(keys))
            handles = self._host_alloc(n) if n else None
            if not handles:
                return []
            got = hooks.l3_prefetch(list(keys[:n]), handles)
        except HostUnavailable:
            self._go_offline()
            return []
        except HostTierError:
            return []
        if got < len(handles):
            self._free_handles(handles[got:])
        nodes = []
        for key, h in zip(keys[:got], handles[:got]):
            node = Node(key, parent)
            node.host = h
            parent.children[key] = node
            self._host_lru[node] = None
            nodes.append(node)
            parent = node
        self.stats.l3_hit_pages += got
        return nodes

    def _l3_put(self, nodes: list[Node]) -> None:
        if not getattr(self.hooks, "l3", False) or not nodes:
            return
        hooks: Any = self.hooks
        try:
            hooks.l3_put([n.key for n in nodes], [n.host for n in nodes])
            self.stats.l3_put_pages += len(nodes)
        except HostUnavailable:
            self._go_offline()
        except HostTierError:
            pass  # L3 is best effort: the host copies stand
