"""The L3 tier of the reference radix tree (``hicache.engine.radix``): match-time fetches and
writes after backups. ``L3Tier`` is a mixin of ``RadixTree`` (through ``Transfers``); it does
nothing unless the hooks have ``l3 = True`` (``ClientHooks(l3=True)``), whose extra verbs are
``l3_query(keys) -> n`` (leading pages held), ``l3_prefetch(keys, handles) -> n``,
``l3_put(keys, handles)`` and, with checkpoints, ``l3_ckpt_present(keys) -> [0|1]``,
``l3_ckpt_prefetch(keys, handles) -> n`` and ``l3_ckpt_put(keys, handles)``.

* ``_l3_extend(keys, path, end) -> nodes``: ``path`` is the tree's cached path for ``keys``
  and ``end`` its resume point. Full mirror (every page is a resume point): when the whole
  path is resumable, the pages after it that L3 holds are fetched into new host handles and
  become host-only nodes. Checkpoints: a prefix is resumable only up to a checkpoint, so L3
  is asked for the pages after the path (unless the tree holds them, or holds the next one)
  and for the checkpoints of every boundary past ``end`` (the tree's own unresumable pages
  included, also when the tree holds every page of ``keys``); the pages up to the deepest boundary
  whose checkpoint L3 holds are fetched, and that checkpoint into a host checkpoint handle of
  the boundary node. All or nothing: when a page or the checkpoint does not arrive, what was
  fetched is freed. The nodes of ``path`` are pinned meanwhile (making room on the host tier
  must not drop them). The caller then recomputes the resume point; the new nodes are loaded
  like any host hit.
* ``_l3_put(nodes, ckpts)``: after a backup settled, its pages and checkpoints go to L3 too
  (asynchronous, best effort: a failure leaves the host copies as they are).
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

from hicache.engine.hooks import CopyOutcomeUnknown, HostTierError, HostUnavailable
from hicache.engine.radix_nodes import Node
from hicache.engine.radix_tiers import TierOps


class L3Tier(TierOps):
    """L3 fetches and writes for ``RadixTree`` (a mixin; see the module docstring)."""

    def _l3_on(self) -> bool:
        return self.host_online and bool(getattr(self.hooks, "l3", False))

    def _l3_extend(self, keys: Sequence[Hashable], path: list[Node], end: int) -> list[Node]:
        if not self._l3_on() or (not self.ckpt_mode and end < len(path)):
            return []
        parent = path[-1] if path else self.root
        # pages after the path come from L3 unless the tree holds them all, or holds the next
        # one (busy: not an L3 matter); checkpoints of the path's own boundaries past ``end``
        # are asked for either way
        pages = len(path) < len(keys) and keys[len(path)] not in parent.children
        if not pages and not (self.ckpt_mode and end < len(path)):
            return []
        for n in path:
            n.io += 1
        try:
            return self._l3_fetch(keys, path, end, parent, pages)
        except HostUnavailable:
            self._go_offline()
            return []
        except HostTierError:
            return []
        finally:
            for n in path:
                n.io -= 1

    def _l3_fetch(self, keys: Sequence[Hashable], path: list[Node], end: int,
                  parent: Node, pages: bool) -> list[Node]:
        hooks: Any = self.hooks
        rest = list(keys[len(path):]) if pages else []
        n = hooks.l3_query(rest) if rest else 0
        ck_node: Node | None = None
        if self.ckpt_mode:  # only up to the deepest boundary whose checkpoint L3 holds
            cand = list(keys[end:len(path) + n])
            present = hooks.l3_ckpt_present(cand) if cand else []
            for i in range(end, len(path)):  # a checkpoint of its own in flight: leave it be
                if path[i].ckpt_host is not None:
                    present[i - end] = 0
            deepest = max((i for i, x in enumerate(present) if x), default=-1)
            if deepest < 0:
                return []
            n = max(0, end + deepest + 1 - len(path))
            ck_node = path[end + deepest] if end + deepest < len(path) else None
        if n == 0 and ck_node is None:
            return []
        handles = self._host_alloc(n) if n else []
        if handles is None:
            return []
        ck_handle, ck = None, []
        try:
            got = hooks.l3_prefetch(rest[:n], handles) if n else 0
            if self.ckpt_mode and got == n and self.host_online:
                ck_key = rest[n - 1] if ck_node is None else ck_node.key
                ck = self._ckpt_alloc(1) or []
                if ck:
                    if hooks.l3_ckpt_prefetch([ck_key], ck) == 1:
                        ck_handle = ck[0]
                    else:
                        self._free_handles(ck, "ckpt")
        except HostTierError as e:  # a refused or failed prefetch: its rows go back
            if self.host_online and not isinstance(e, HostUnavailable):
                self._free_handles(handles)
                if ck and ck_handle is None:
                    self._free_handles(ck, "ckpt")
            raise
        if not self.host_online:
            return []
        if self.ckpt_mode and ck_handle is None:
            got = 0  # pages without their checkpoint resume nothing: all or nothing
        if got < len(handles):
            self._free_handles(handles[got:])
        nodes = []
        for key, h in zip(rest[:got], handles[:got]):
            node = Node(key, parent)
            node.host = h
            parent.children[key] = node
            self._host_lru[node] = None
            nodes.append(node)
            parent = node
        self.stats.l3_hit_pages += got
        if ck_handle is not None:
            boundary = ck_node if ck_node is not None else nodes[-1]
            boundary.ckpt_host = ck_handle
            self._ckpt_lru[boundary] = None
            self.stats.l3_hit_checkpoints += 1
        return nodes

    def _l3_put(self, nodes: list[Node], ckpts: Sequence[Node] = ()) -> None:
        if not self._l3_on() or not (nodes or ckpts):
            return
        hooks: Any = self.hooks
        try:
            if nodes:
                hooks.l3_put([n.key for n in nodes], [n.host for n in nodes])
                self.stats.l3_put_pages += len(nodes)
            if ckpts:
                hooks.l3_ckpt_put([n.key for n in ckpts], [n.ckpt_host for n in ckpts])
                self.stats.l3_put_checkpoints += len(ckpts)
        except CopyOutcomeUnknown:  # the put may or may not have been queued: L3 is best
            pass  # effort, it writes nothing the tree holds, and the daemon keeps its rows
        except HostUnavailable:  # busy until it read them (a free meanwhile waits)
            self._go_offline()
        except HostTierError:
            pass  # L3 is best effort: the host copies stand
