"""Backups and device eviction of the reference radix tree (``hicache.engine.radix``).

``Transfers`` is a mixin of ``RadixTree`` (contract and invariants are stated there):
``_backup`` starts one asynchronous BACKUP of device pages plus checkpoints, ``poll`` / ``drain``
settle backups in flight (pages and checkpoints become host copies, or are freed when the copy
failed), ``evict_device`` frees device rows leaf first (``write_back`` backs pages and their
device checkpoints up synchronously in one command, ``_backup_now``), ``_alloc_device_upto``
makes room for a request.
"""
from __future__ import annotations

from typing import Any

from hicache.engine.hooks import HostTierError, HostUnavailable
from hicache.engine.radix_nodes import Node
from hicache.engine.radix_l3 import L3Tier


class Transfers(L3Tier):
    """Backups in flight and device eviction for ``RadixTree`` (a mixin)."""

    policy: str

    # ------------------------------------------------------------------ backups
    def poll(self) -> None:
        """Complete the backups that finished (non-blocking)."""
        i = 0
        while i < len(self._inflight):
            ticket, nodes, ckpts = self._inflight[i]
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
            self._finish_backup(ticket, nodes, ckpts)
            if not self.host_online:
                return

    def drain(self) -> None:
        """Wait for every backup in flight."""
        while self._inflight:
            ticket, nodes, ckpts = self._inflight.pop(0)
            self._finish_backup(ticket, nodes, ckpts)

    def _settle_slot_backup(self) -> None:
        """Wait for the backup just started, if it reads checkpoints from a request slot."""
        if self._inflight and self._inflight[-1][2] and not self.device_ckpts:
            ticket, nodes, ckpts = self._inflight.pop()
            self._finish_backup(ticket, nodes, ckpts)

    def _finish_backup(self, ticket: Any, nodes: list[Node], ckpts: list[Node]) -> None:
        """Settle one backup that left ``_inflight``: its pages become host copies or not."""
        assert self.hooks is not None
        ok = lost = False
        try:
            self.hooks.wait(ticket)
            ok = True
        except HostUnavailable:
            lost = True
        except HostTierError:
            self.stats.transfer_failures += 1
        for n in nodes + ckpts:
            n.io -= 1
        self._host_pending -= len(nodes)
        self._ckpt_pending -= len(ckpts)
        if ok:
            for n in reversed(nodes):  # nodes run root to leaf: add leaves first
                self._host_lru[n] = None
            for n in reversed(ckpts):
                self._ckpt_lru[n] = None
            self.stats.backed_up_pages += len(nodes)
            self.stats.checkpoints_backed_up += len(ckpts)
            self._l3_put(nodes, ckpts)
            return
        handles = [n.host for n in nodes]
        ck_handles = [n.ckpt_host for n in ckpts]
        for n in nodes:
            n.host = None
        for n in ckpts:
            n.ckpt_host = None
        if lost:
            self._go_offline()
            return
        self._free_handles(handles)
        self._free_handles(ck_handles, "ckpt")
        self._prune_reversed(nodes)

    def _backup(self, nodes: list[Node], ckpts: list[Node] = (), slot: int | None = None) -> None:  # type: ignore[assignment]
        """Start an asynchronous backup of device pages ``nodes`` and checkpoints ``ckpts``."""
        if (not nodes and not ckpts) or not self.host_online:
            return
        handles = self._host_alloc(len(nodes)) if nodes else []
        if handles is None:
            self.stats.backup_dropped_pages += len(nodes)
            nodes, handles = [], []
        ck_handles = self._ckpt_alloc(len(ckpts)) if ckpts and self.host_online else []
        if ck_handles is None:
            self.stats.checkpoint_backup_dropped += len(ckpts)
            ckpts, ck_handles = [], []
        if not (nodes or ckpts) or not self.host_online:
            return
        assert self.hooks is not None
        src = [slot if not self.device_ckpts else n.device for n in ckpts]
        kw = {"ckpts": [(s, h, n.depth) for s, h, n in zip(src, ck_handles, ckpts)]} if ckpts else {}
        try:
            ticket = self.hooks.backup([n.device for n in nodes], handles, **kw)  # type: ignore[misc]
        except HostUnavailable:
            self._go_offline()
            return
        except HostTierError:
            self.stats.transfer_failures += 1
            self._free_handles(handles)
            self._free_handles(ck_handles, "ckpt")
            return
        for n, h in zip(nodes, handles):
            n.host = h
            n.io += 1
        for n, h in zip(ckpts, ck_handles):
            n.ckpt_host = h
            n.io += 1
        self._host_pending += len(nodes)
        self._ckpt_pending += len(ckpts)
        self._inflight.append((ticket, list(nodes), list(ckpts)))

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
        """Take the device copies of ``victims`` (leaf first); back up or drop as the policy says.
        Returns how many rows went back to the free list (a held row does not)."""
        rows = [v.device for v in victims]
        wb = self.policy == "write_back" and self.host_online
        ck = [(v, r) for v, r in zip(victims, rows) if wb and v.ckpt_dev and v.ckpt_host is None]
        for v in victims:
            del self._dev_lru[v]
            self.page_rows.discard(v.device)
            v.device = None
            v.ckpt_dev = False
        need_backup = [(v, r) for v, r in zip(victims, rows) if v.host is None]
        if (need_backup or ck) and wb:
            # the victims that keep a host copy are pinned while room is made for the others:
            # dropping one of them there left it counted as kept on the host
            kept = [v for v in victims if v.host is not None]
            for v in kept:
                v.io += 1
            try:
                saved = self._backup_now([v for v, _ in need_backup],
                                         [r for _, r in need_backup], ck)
            finally:
                for v in kept:
                    v.io -= 1
            lost = [v for v, _ in need_backup if v not in saved]
        else:
            lost = [v for v, _ in need_backup]
        freed = self._free_node_rows(rows)  # type: ignore[arg-type]
        self.stats.device_evicted_pages += len(victims) - len(lost)
        for v in lost:  # leaf first; a lost page takes its host-only subtree with it
            if v.parent is not None and v.parent.children.get(v.key) is v:
                self._drop_subtree(v)
        return freed

    def _backup_now(self, nodes: list[Node], rows: list[int],
                    ck: list[tuple[Node, int]]) -> set[Node]:
        """Synchronous backup before device copies go (write_back); returns the pages saved."""
        pinned = [v for v, _ in ck]
        for v in pinned:  # pinned: making room must not evict the host pages they belong to
            v.io += 1
        ck_handles: list[Any] | None = []
        try:
            handles = self._host_alloc(len(nodes)) if nodes else []
            if handles is not None:
                keep = set(nodes)
                ck = [(v, r) for v, r in ck if v.host is not None or v in keep]
                ck_handles = self._ckpt_alloc(len(ck)) if ck and self.host_online else []
        finally:
            for v in pinned:
                v.io -= 1
        if handles is None:
            self.stats.backup_dropped_pages += len(nodes)
            return set()
        if ck_handles is None:
            self.stats.checkpoint_backup_dropped += len(ck)
            ck, ck_handles = [], []
        if (not nodes and not ck) or not self.host_online:
            return set()
        assert self.hooks is not None
        kw = {"ckpts": [(r, h, v.depth) for (v, r), h in zip(ck, ck_handles)]} if ck else {}
        try:
            self.hooks.wait(self.hooks.backup(rows, handles, **kw))
        except HostUnavailable:
            self._go_offline()
            return set()
        except HostTierError:
            self.stats.transfer_failures += 1
            self._free_handles(handles)
            self._free_handles(ck_handles, "ckpt")
            return set()
        for n, h in zip(nodes, handles):  # victims run leaf first, as the LRU wants them
            n.host = h
            self._host_lru[n] = None  # newer than any host-only page (it was on device)
        for (v, _), h in zip(ck, ck_handles):
            v.ckpt_host = h
            self._ckpt_lru[v] = None
        self.stats.backed_up_pages += len(nodes)
        self.stats.checkpoints_backed_up += len(ck)
        self._l3_put(nodes, [v for v, _ in ck])
        return set(nodes)
