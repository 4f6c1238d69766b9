"""Host-tier bookkeeping of the reference radix tree: allocation with eviction, dropping, loss.

``TierOps`` is a mixin of ``hicache.engine.radix.RadixTree`` (the tree's contract and
invariants are stated there): ``_host_alloc`` / ``_ckpt_alloc`` make room by evicting host
pages / host checkpoints (LRU) under their capacities, ``evict_host`` drops host page copies
(leaves or device-resident pages), ``evict_checkpoints`` drops host checkpoints apart from their
pages, ``_drop_*`` remove copies and nodes (a node leaving the tree takes its checkpoint with it),
``_go_offline`` forgets the whole host tier, ``check`` verifies every invariant.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Iterable

from hicache.engine.hooks import HostExhausted, HostTierError, HostUnavailable, TierHooks
from hicache.engine.radix_nodes import Node, RowFreeList, TreeStats


def check_hooks(hooks: TierHooks | None, ckpt_mode: bool, device_ckpts: bool) -> None:
    """Refuse hooks that copy other rows than the tree's mirror counts on (hooks that say what
    they copy: ``resume``, as ``ClientHooks`` do): a full-mirror tree over checkpoint hooks
    would count pages whose SWA and states were never copied as resumable hits; a checkpoints
    tree over full-mirror hooks has no checkpoint copy; a checkpoint kept in request slots
    (ring SWA, ``device_ckpts=False``) over hooks that copy it as a ``swa_page`` row (or the
    reverse) would read or write the wrong rows (a running request's slot)."""
    if hooks is None or not hasattr(hooks, "resume"):
        return
    resume = hooks.resume
    if not ckpt_mode and resume is not None:
        raise ValueError("mirror='full' over hooks that copy checkpoints (ClientHooks with a "
                         "resume model): a page's SWA and states would never be copied, yet "
                         "count as restored; use mirror='checkpoints'")
    if ckpt_mode and resume is None:
        raise ValueError("mirror='checkpoints' over hooks without a resume model: they copy "
                         "whole pages and no checkpoint; pass ClientHooks(..., resume=...)")
    if ckpt_mode and device_ckpts != (resume.checkpoint_space == "swa_page"):
        raise ValueError(f"device_ckpts={device_ckpts} but the hooks' layout keeps a "
                         f"checkpoint in {resume.checkpoint_space!r} rows: device_ckpts is True "
                         f"for paged SWA (swa_page rows), False for ring SWA (request slots)")


class TierOps:
    """Host allocation, eviction, dropping and checking for ``RadixTree`` (a mixin)."""

    device: RowFreeList
    hooks: TierHooks | None
    host_capacity: int | None
    host_ckpt_capacity: int | None
    _online: bool  # the host tier in use (read through host_online)
    _online_epoch: Any  # the hooks' row_epoch when it came online
    held_device_rows: list[int]
    page_rows: set[int]
    suspect_rows: set[int]
    held_slots: set[int]
    ckpt_mode: bool
    device_ckpts: bool
    root: Node
    stats: TreeStats
    _dev_lru: OrderedDict[Node, None]
    _host_lru: OrderedDict[Node, None]
    _ckpt_lru: OrderedDict[Node, None]
    _host_pending: int
    _ckpt_pending: int
    _inflight: list[tuple[Any, list[Node], list[Node]]]
    _snapshots: set[Any]  # held boundary snapshots (radix_snapshots.Snapshot)
    _offline_rows: tuple[Any, Any] | None  # (hooks, their row_epoch) when the tier went offline

    @property
    def host_online(self) -> bool:
        """Whether the host tier is in use. Its hooks' ``row_epoch`` is compared with the one it
        came online at: moved on (the client registered, unregistered or reset since, say after
        a reap or a daemon restart the engine learned of from a heartbeat) means every host
        row the tree holds was freed and may belong to another page now: the tree forgets its
        host tier (``_go_offline``, nothing left held) instead of loading or freeing them. A
        tree that held no host row takes the new epoch and stays online."""
        if self._online and self.hooks is not None and \
                (epoch := self.hooks.row_epoch()) != self._online_epoch:
            if self._host_lru or self._ckpt_lru or self._inflight or self._snapshots or \
                    self._host_pending or self._ckpt_pending:
                self._go_offline(rows_gone=True)
            else:  # it held no host row (say the tree was made before the client registered)
                self._online_epoch = epoch
        return self._online

    @property
    def host_pages(self) -> int:
        return len(self._host_lru) + self._host_pending

    @property
    def host_checkpoints(self) -> int:
        return len(self._ckpt_lru) + self._ckpt_pending

    def _host_alloc(self, n: int) -> list[Any] | None:
        """``n`` host page handles, evicting host LRU pages to make room; ``None`` = no room."""
        return self._alloc(n, "page")

    def _ckpt_alloc(self, n: int) -> list[Any] | None:
        """``n`` host checkpoint handles, evicting LRU checkpoints; ``None`` = no room."""
        return self._alloc(n, "ckpt")

    def _alloc(self, n: int, kind: str) -> list[Any] | None:
        """``n`` host handles of ``kind`` ("page" / "ckpt"): within the tier's capacity for that
        kind, evicting its LRU entries first, then once more when the daemon's pool is full;
        ``None`` = no room (or the tier went offline)."""
        page = kind == "page"
        cap = self.host_capacity if page else self.host_ckpt_capacity
        evict = self.evict_host if page else self.evict_checkpoints

        def held() -> int:
            return self.host_pages if page else self.host_checkpoints
        if cap is not None:
            if n > cap:
                return None
            if held() + n > cap:
                evict(held() + n - cap)
                if held() + n > cap:
                    return None
        assert self.hooks is not None
        for attempt in range(2):
            try:
                if page:
                    return self.hooks.host_alloc(n)
                return self.hooks.host_alloc(n, kind=kind)  # type: ignore[call-arg]
            except HostExhausted:
                if attempt == 0 and evict(n) == 0:
                    return None
            except HostUnavailable:
                self._go_offline()
                return None
            except HostTierError:  # any other refusal (busy, internal): no room this time
                self.stats.transfer_failures += 1
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
            gone = []
            for node in dropped:  # the tree first, the daemon after (a call may go offline)
                del self._host_lru[node]
                handles.append(node.host)
                node.host = None
                if node.device is None:
                    self.stats.dropped_pages += 1
                    gone.append(node)  # the page left the tree: its checkpoint too
            self.stats.host_evicted_pages += len(dropped)
            self._free_handles(handles)
            self._drop_ckpts(gone)
            total += len(dropped)
            if not self.host_online:  # a free found the daemon gone: every copy is forgotten
                break
        return total

    def evict_checkpoints(self, n: int) -> int:
        """Drop ``n`` host checkpoints (LRU), keeping their pages."""
        victims = [v for v in self._ckpt_lru if not v.io][:n]
        self._drop_ckpts(victims)
        return len(victims)

    # ------------------------------------------------------------------ dropping
    def _drop_ckpts(self, nodes: list[Node]) -> None:
        """Forget and free the settled host checkpoints of ``nodes``."""
        handles = []
        for n in nodes:
            if n.ckpt_host is not None and n in self._ckpt_lru:
                handles.append(n.ckpt_host)
                n.ckpt_host = None
                del self._ckpt_lru[n]
        self.stats.checkpoints_dropped += len(handles)
        self._free_handles(handles, "ckpt")

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
        gone = []
        while stack:
            n = stack.pop()
            stack.extend(n.children.values())
            assert n.device is None and not n.io, f"dropping a pinned page {n.key!r}"
            if n.host is not None:
                handles.append(n.host)
                n.host = None
                self._host_lru.pop(n, None)
            gone.append(n)
            self.stats.dropped_pages += 1
        if node.parent is not None and node.parent.children.get(node.key) is node:
            del node.parent.children[node.key]
        self._free_handles(handles)
        self._drop_ckpts(gone)

    def _prune_reversed(self, nodes: list[Node]) -> None:
        for n in reversed(nodes):
            if n.device is None and n.host is None and n.parent is not None:
                self._drop_subtree(n)

    def _free_handles(self, handles: list[Any], kind: str = "page") -> None:
        if not handles or not self.host_online:
            return
        assert self.hooks is not None
        try:
            if kind == "page":
                self.hooks.host_free(handles)
            else:
                self.hooks.host_free(handles, kind=kind)  # type: ignore[call-arg]
        except HostUnavailable:
            self._go_offline()
        except HostTierError:
            self.stats.transfer_failures += 1

    def _go_offline(self, rows_gone: bool = False) -> None:
        """The host tier is gone: forget every host copy, keep serving from the device. The
        hooks and their ``row_epoch`` are noted: while both are the same, the daemon may still
        hold every host row forgotten here (``reset_host_tier`` refuses then); unless
        ``rows_gone`` (the epoch moved on since the tier came online: they were freed)."""
        if not self._online:
            return
        self._online = False
        self.stats.host_offline += 1
        assert self.hooks is not None
        self._offline_rows = None if rows_gone else (self.hooks, self.hooks.row_epoch())
        for _, nodes, ckpts in self._inflight:
            for n in nodes + ckpts:
                n.io -= 1
                n.ckpt_host = None
        self._inflight.clear()
        self._host_pending = self._ckpt_pending = 0
        for snap in self._snapshots:  # their handles went with the tier
            snap.handle = None
        self._snapshots.clear()
        for n in list(self._host_lru):
            n.host = None
        self._host_lru.clear()
        for n in list(self._ckpt_lru):
            n.ckpt_host = None
        self._ckpt_lru.clear()
        stack = [self.root]
        while stack:
            n = stack.pop()
            for key, child in list(n.children.items()):
                if child.device is None:
                    del n.children[key]  # host-only subtree (prefix-closed device set)
                    self.stats.dropped_pages += 1
                else:
                    child.host = None
                    child.ckpt_host = None
                    stack.append(child)

    def lose_host_tier(self) -> None:
        """The engine learned the host tier is gone (e.g. a failed state swap): forget it."""
        self._go_offline()

    def reset_host_tier(self, hooks: TierHooks | None = None) -> bool:
        """Start using a (re-registered) host tier again after ``HostUnavailable``, through
        ``hooks`` (default: the same hooks); True when it did.

        * The device rows of loads whose outcome was unknown, and their request slots, are
          usable again only once none of those loads can still copy: the daemon acked them, or
          holds no operation of the client that sent them (it restarted, or that
          registration's operations all ended). The hooks that sent them are asked
          (``copies_running``, one ``poll_acks``), also when ``hooks`` are new ones (another
          client knows nothing of them: keep the old client open until this returns True).
          While one may still copy, nothing changes and False is returned: call it again
          later.
        * The host rows the tree forgot when it went offline must be gone first: ``hooks``
          with another ``row_epoch`` than then (the client registered or reset since), or
          other hooks (over another client; the old one's rows go back when it unregisters or
          is reaped). The same hooks at the same epoch (the tier went offline on a late ack or
          a request without a reply, the registration still live) are refused with a
          ``ValueError`` that says so, and nothing changes: ``client.reset()`` (every host row
          and sparse request of the client) or ``unregister`` and ``register`` first.
        * Other hooks while the tier is online are refused the same way (the tree holds the
          current hooks' host rows): ``lose_host_tier()`` first."""
        old = self.hooks
        hooks = hooks if hooks is not None else old
        check_hooks(hooks, self.ckpt_mode, self.device_ckpts)
        if self.host_online and hooks is not old:
            raise ValueError("reset_host_tier: the host tier is online through other hooks, "
                             "whose host rows the tree holds; lose_host_tier() first (the tree "
                             "forgets them), then reset it through the new hooks")
        if self.unknown_loads and old is not None and old.copies_running(self.unknown_loads):
            return False
        gone = self._offline_rows
        if gone is not None and hooks is gone[0] and hooks.row_epoch() == gone[1]:
            raise ValueError("reset_host_tier: the client has not registered, unregistered "
                             "or reset since the host tier went offline, so a daemon still up "
                             "(a late ack, a request without a reply) still holds the host "
                             "rows the tree forgot: call client.reset() (or unregister and "
                             "register; after a restart, register), then reset the tier")
        self._offline_rows = None
        self.hooks = hooks
        self._online = self.hooks is not None
        self._online_epoch = self.hooks.row_epoch() if self.hooks is not None else None
        held, self.held_device_rows = self.held_device_rows, []
        self.unknown_loads = []
        self.suspect_rows.clear()
        self.held_slots.clear()
        self.device.free(held)
        return True

    def _free_node_rows(self, rows: list[int]) -> int:
        """Evicted nodes' device rows back to the free list, but for those a load of unknown
        outcome may still write (``suspect_rows``): held until ``reset_host_tier``. Returns how
        many went back."""
        sus = self.suspect_rows
        if sus and not sus.isdisjoint(rows):
            held = sus.intersection(rows)
            sus -= held
            self.held_device_rows.extend(sorted(held))
            rows = [r for r in rows if r not in held]
        self.device.free(rows)
        return len(rows)

    # ------------------------------------------------------------------ checking
    def nodes(self) -> Iterable[Node]:
        stack = list(self.root.children.values())
        while stack:
            n = stack.pop()
            yield n
            stack.extend(n.children.values())

    def check(self) -> None:
        """Raise AssertionError when an invariant of the module docstring is broken."""
        dev = host = ck = 0
        rows = set()
        for n in self.nodes():
            assert n.parent is not None and n.parent.children.get(n.key) is n, n
            assert n.device is not None or n.host is not None, f"page {n.key!r} has no copy"
            assert n.depth == n.parent.depth + 1, f"page {n.key!r}: depth {n.depth}"
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
            if n in self._host_lru:
                host += 1
                assert n.host is not None, f"page {n.key!r}: host LRU lists a page with no copy"
            elif n.host is not None:
                assert n.io > 0, f"page {n.key!r}: host copy neither settled nor in flight"
            if n.ckpt_dev:
                assert self.ckpt_mode and self.device_ckpts and n.device is not None, \
                    f"page {n.key!r}: device checkpoint without a device copy or mode"
            if n.ckpt_host is not None:
                assert self.ckpt_mode, f"page {n.key!r}: a full mirror holds no checkpoint"
                if n in self._ckpt_lru:
                    ck += 1
                else:
                    assert n.io > 0, f"page {n.key!r}: host checkpoint neither settled nor in flight"
            else:
                assert n not in self._ckpt_lru, f"page {n.key!r}: LRU lists a checkpoint it lacks"
            assert n.lock >= 0 and n.io >= 0
        assert dev == len(self._dev_lru), (dev, len(self._dev_lru))
        assert host == len(self._host_lru), (host, len(self._host_lru))
        assert ck == len(self._ckpt_lru), (ck, len(self._ckpt_lru))
        if self.host_ckpt_capacity is not None:
            assert self.host_checkpoints <= self.host_ckpt_capacity
        live = {n.device for n in self.nodes() if n.device is not None}
        assert live == self.page_rows, f"page rows out of step: {live ^ self.page_rows}"
        assert len(live) == dev, "a device row held by two pages"
        assert self.device.allocated(live), "a page's device row is on the free list"
        assert dev + self.device.available() + len(self.held_device_rows) <= self.device.capacity
        assert self.suspect_rows <= live, f"suspect rows no page holds: {self.suspect_rows - live}"
        assert not live & set(self.held_device_rows), "a held row is a page's device copy"
