"""Reference radix tree over 256-token pages with a device tier and a host tier.

A node is one page: its key (a hash of the page's tokens chained with its prefix, or any
hashable the engine uses), at most one device row, at most one host handle and, with
``mirror="checkpoints"``, a resume checkpoint (``hicache.core.resume``). Engine-side verbs:

* ``prepare(keys, slot=None) -> Prefix`` — the longest cached prefix that ends at a
  checkpoint: device pages, then the host pages that follow them, cut at the deepest boundary
  whose checkpoint is in some tier. Host pages and the checkpoint (when not on the device) are
  loaded in one transfer and waited for; the checkpoint goes into the boundary's device row
  (paged SWA) or into request slot ``slot`` (ring SWA). Every page is locked until ``release``.
* ``alloc_device(n) -> rows`` — device rows for the pages the engine computes, evicting least
  recently used device copies when the pool is short.
* ``release(prefix, keys, rows, slot=None, slot_tokens=None, snapshot=None)`` — the request
  finished: its new pages enter the tree, the last page it wrote (and every
  ``checkpoint_every``-th, and with ``checkpoint_branch`` the deepest cached page it had to
  recompute) becomes a checkpoint, the prefix is unlocked and the write policy runs.
  ``free_device(rows)`` returns rows not cached.
* ``snapshot_slot(slot, keys) -> Snapshot`` — ring SWA: the request stands at the end of page
  ``keys[-1]`` and will write on (its prompt ends mid-page, or it decodes): that boundary's
  checkpoint is backed up from the slot now, and ``release(..., snapshot=)`` attaches it
  (``hicache.engine.radix_snapshots``). Without one, ``release`` checkpoints a ring slot only
  when ``slot_tokens`` says it stands exactly at the end of ``keys[-1]``.

Mirrors. ``full`` (default): a page copy carries every pool (SWA and states included), so
every cached page is a resumable boundary — SGLang HiCache's behaviour. ``checkpoints``: a
page carries its compressed rows only; a checkpoint (SWA tail + boundary states) is kept at
chosen boundaries, on the device (``ckpt_dev``: in the page's device row; paged SWA only,
``device_ckpts``) and on the host (``ckpt_host``: its own handle, own LRU, own capacity
``host_ckpt_capacity``). Pages past the deepest checkpoint are not a hit
(``stats.unresumable_pages``). Eviction may drop a host checkpoint apart from its pages; a
device eviction takes the device checkpoint with the page (``write_back`` backs both up).

Invariants (``check()`` verifies them):

* Every node has a device copy or a host copy (or both); a node with neither is removed.
* Device copies are evicted from the leaves upward: the device-resident pages form a
  prefix-closed subtree. Host-only pages hang below device pages, never above.
* A host copy is dropped only from a page that keeps a device copy or has no children, so
  every cached page stays reachable from the root through cached pages.
* Nothing locked is evicted: ``lock`` counts running requests using the page, ``io`` counts
  transfers in flight on it or its checkpoint (a backup pins both copies; a load the host one).
* A checkpoint lives only on a node with a page copy; ``ckpt_dev`` only with a device copy,
  in checkpoint mode with device checkpoints; a full mirror holds no separate checkpoint.

Write policies: ``write_through`` backs up every new page (and new checkpoint) right after its
request (asynchronously; ``poll`` completes backups), ``write_through_selective`` backs a page
up on its second use (``selective_threshold``), with the boundary checkpoint of that use,
``write_back`` backs pages and device checkpoints up only when their device copy is evicted.
Ring SWA mode backs a checkpoint up at ``release`` whatever the policy: the slot's rings are
reused by the next request. A page evicted from the device without a host copy is dropped, and
with it any host-only pages below it.

L3 (hooks with ``l3``, ``hicache.engine.radix_l3``): at match time the tree's resumable prefix
is extended with what an L3 store holds past it (pages, and with checkpoints the deepest
boundary checkpoint), fetched into host handles and loaded like host hits; settled backups go
to L3 too.

Host tier failures never fail a request: ``HostExhausted`` drops the page, ``HostUnavailable``
empties the host tier (every host copy and checkpoint is forgotten, ``stats.host_offline``)
and the tree runs device-only until ``reset_host_tier``. A load that ends so may still be
writing its device rows (``CopyOutcomeUnknown``: it was accepted, and its ack timed out or
the daemon stopped answering while the tree waited for it, or its command got no reply):
they are held aside (``held_device_rows``) and reused only after ``reset_host_tier``, which
goes on only once none of those loads can still copy (``hooks.copies_running``, asked of the
hooks that sent them; it returns False and changes nothing while one may), and only once the
host rows the tree forgot are gone (``hooks.row_epoch`` moved on: the client registered or
reset again; else a ``ValueError``). The same epoch is checked whenever the tree asks whether
its host tier is online: one that moved while the tree was online (the engine learned of a
reap or a daemon restart from a heartbeat and registered again, or reset the client) means the
rows it held were freed, and may be handed out again: the tree forgets the host tier then
(offline; ``reset_host_tier`` needs no further epoch). So is
the destination of its checkpoint: a node's device row stays the node's and is held once
evicted (``suspect_rows``); a request slot (ring SWA) is held (``held_slots``), the
``Prefix`` says ``slot_held`` (the request must move to another slot), and ``prepare`` refuses
a held slot. ``hooks=None``: device-only.
"""
from __future__ import annotations

from collections import OrderedDict
from typing import Any, Hashable, Iterable, Sequence

from hicache.engine.hooks import CopyOutcomeUnknown, HostTierError, HostUnavailable, TierHooks
from hicache.engine.radix_nodes import DeviceFull, Node, Prefix, RowFreeList, TreeStats
from hicache.engine.radix_snapshots import Snapshot, Snapshots
from hicache.engine.radix_tiers import check_hooks

__all__ = ["DeviceFull", "MIRRORS", "Node", "PAGE_TOKENS", "POLICIES", "Prefix", "RadixTree",
           "RowFreeList", "Snapshot", "TreeStats"]

PAGE_TOKENS = 256
POLICIES = ("write_through", "write_through_selective", "write_back")
MIRRORS = ("full", "checkpoints")


class RadixTree(Snapshots):
    """Two-tier page cache for one worker (see the module docstring for the contract)."""

    def __init__(
        self,
        device: RowFreeList | int,
        hooks: TierHooks | None = None,
        *,
        policy: str = "write_through",
        host_capacity: int | None = None,
        selective_threshold: int = 2,
        mirror: str = "full",
        device_ckpts: bool = True,
        checkpoint_every: int = 0,
        checkpoint_branch: bool = False,
        host_ckpt_capacity: int | None = None,
    ) -> None:
        if policy not in POLICIES:
            raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}")
        if mirror not in MIRRORS:
            raise ValueError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
        if checkpoint_every < 0:
            raise ValueError(f"checkpoint_every must be >= 0, got {checkpoint_every}")
        if mirror == "full" and (checkpoint_every or checkpoint_branch
                                 or host_ckpt_capacity is not None or not device_ckpts):
            raise ValueError("a full mirror makes every page a checkpoint: checkpoint_every, "
                             "checkpoint_branch, host_ckpt_capacity and device_ckpts=False "
                             "do not apply")
        if not device_ckpts and (checkpoint_every or checkpoint_branch):
            raise ValueError("checkpoint_every / checkpoint_branch need device checkpoints "
                             "(paged SWA): a ring "
                             "holds one window per request slot, so only the last page it "
                             "wrote can be checkpointed at release")
        check_hooks(hooks, mirror == "checkpoints", device_ckpts)
        self.device = RowFreeList(device) if isinstance(device, int) else device
        self.hooks = hooks
        self.policy = policy
        self.host_capacity = host_capacity
        self.selective_threshold = selective_threshold
        self.mirror = mirror
        self.ckpt_mode = mirror == "checkpoints"
        self.device_ckpts = device_ckpts
        self.checkpoint_every = checkpoint_every
        self.checkpoint_branch = checkpoint_branch
        self.host_ckpt_capacity = host_ckpt_capacity
        self._online = hooks is not None  # read through ``host_online`` (radix_tiers)
        self._online_epoch = hooks.row_epoch() if hooks is not None else None
        # device rows of accepted loads whose ack never came (``CopyOutcomeUnknown``: the
        # daemon may still be writing them): reused only after ``reset_host_tier``
        self.held_device_rows: list[int] = []
        self.page_rows: set[int] = set()  # the device rows pages hold (``Node.device``)
        # a checkpoint destination of such a load: a live node's device row (held once it is
        # evicted) or a request slot (ring SWA: ``prepare`` refuses it); both until the reset
        self.suspect_rows: set[int] = set()
        self.held_slots: set[int] = set()
        # the tickets of those loads (None: a request that got no reply), asked about by
        # ``reset_host_tier`` (``hooks.copies_running``)
        self.unknown_loads: list[Any] = []
        self.root = Node(None, None)
        self.stats = TreeStats()
        # LRU orders, oldest first. A path is touched leaf-first, so an ancestor always sits
        # after its descendants and eviction finds leaves first.
        self._dev_lru: OrderedDict[Node, None] = OrderedDict()
        self._host_lru: OrderedDict[Node, None] = OrderedDict()
        self._ckpt_lru: OrderedDict[Node, None] = OrderedDict()  # settled host checkpoints
        self._host_pending = 0  # host handles held by backups not yet in _host_lru
        self._ckpt_pending = 0  # checkpoint handles held by backups not yet in _ckpt_lru
        self._inflight: list[tuple[Any, list[Node], list[Node]]] = []  # (ticket, pages, ckpts)
        self._snapshots: set[Snapshot] = set()  # boundary snapshots held (radix_snapshots)
        # (hooks, their row_epoch) when the host tier went offline (``reset_host_tier``)
        self._offline_rows: tuple[Any, Any] | None = None

    # ------------------------------------------------------------------ queries
    @property
    def device_pages(self) -> int:
        return len(self._dev_lru)

    @property
    def device_checkpoints(self) -> int:
        if not self.ckpt_mode:
            return self.device_pages
        return sum(1 for n in self._dev_lru if n.ckpt_dev)

    def _dev_ckpt(self, n: Node) -> bool:
        return n.device is not None and (not self.ckpt_mode or n.ckpt_dev)

    def _host_ckpt(self, n: Node) -> bool:
        if not self.host_online:
            return False
        if not self.ckpt_mode:
            return n.host is not None
        return n in self._ckpt_lru and n.io == 0

    def _cached_path(self, keys: Sequence[Hashable], idle: bool) -> tuple[list[Node], int]:
        """Cached pages along ``keys`` (device first, then host) and how many are on device."""
        path: list[Node] = []
        n_dev = 0
        node = self.root
        for key in keys:
            child = node.children.get(key)
            if child is None:
                break
            if child.device is not None and n_dev == len(path):
                n_dev += 1
            elif not (child.host is not None and self.host_online
                      and (child.io == 0 or not idle)):
                break
            path.append(child)
            node = child
        return path, n_dev

    def _resume_point(self, path: list[Node], n_dev: int) -> tuple[int, str | None]:
        """Pages up to the deepest checkpoint on ``path``, and where that checkpoint is."""
        for i in range(len(path) - 1, -1, -1):
            n = path[i]
            if i < n_dev and self._dev_ckpt(n):
                return i + 1, "device" if self.ckpt_mode else "page"
            if self._host_ckpt(n):
                return i + 1, "host" if self.ckpt_mode else "page"
        return 0, None

    def match(self, keys: Sequence[Hashable]) -> tuple[int, int]:
        """(device hit pages, host hit pages after them) a ``prepare`` would resume from."""
        path, n_dev = self._cached_path(keys, idle=False)
        end, _ = self._resume_point(path, n_dev)
        return min(n_dev, end), max(0, end - n_dev)

    # ------------------------------------------------------------------ request path
    def prepare(self, keys: Sequence[Hashable], slot: int | None = None) -> Prefix:
        """Lock the resumable cached prefix of ``keys``; load its host part first. Ring SWA
        (``device_ckpts=False``) needs the request's ``slot``, whatever is cached: refused
        before anything (an L3 fetch included) changes."""
        if not self.device_ckpts and slot is None:
            raise ValueError("ring SWA mode restores a checkpoint into a request slot: "
                             "pass prepare(keys, slot=...)")
        self.poll()
        if slot is not None and slot in self.held_slots:
            raise ValueError(f"request slot {slot} is held: a checkpoint load into it had an "
                             f"unknown outcome and may still land; use another slot until "
                             f"reset_host_tier")
        path, n_dev = self._cached_path(keys, idle=True)
        end, where = self._resume_point(path, n_dev)
        l3_nodes = self._l3_extend(keys, path, end)  # L3: pages, checkpoint (radix_l3)
        if l3_nodes or (self.ckpt_mode and self.host_online and end < len(path)):
            path = path + l3_nodes
            end, where = self._resume_point(path, n_dev)
        cut = len(path) - end
        path, n_dev = path[:end], min(n_dev, end)
        dev_nodes, host_nodes = path[:n_dev], path[n_dev:]
        for n in dev_nodes:
            n.lock += 1
        prefix = Prefix(dev_nodes, len(dev_nodes), 0, ckpt=where, unresumable_pages=cut)
        ckpt_node = path[-1] if where == "host" else None
        if host_nodes or ckpt_node is not None:
            self._load(prefix, host_nodes, ckpt_node, slot)
        for n in prefix.nodes:
            n.hits += 1
        self._touch(prefix.nodes)
        st = self.stats
        st.device_hit_pages += prefix.device_pages
        st.host_hit_pages += prefix.host_pages
        st.miss_pages += len(keys) - prefix.pages
        st.unresumable_pages += prefix.unresumable_pages
        prefix.l3_pages = sum(1 for n in l3_nodes if n in prefix.nodes)
        if self.policy == "write_through_selective":
            hot = [n for n in prefix.nodes if n.host is None and n.hits >= self.selective_threshold]
            edge = prefix.nodes[-1:] if self.ckpt_mode and self.device_ckpts else []
            self._backup(hot, [n for n in edge if n.ckpt_dev and n.ckpt_host is None
                               and n.hits >= self.selective_threshold])
        return prefix

    def _load(self, prefix: Prefix, host_nodes: list[Node], ckpt_node: Node | None,
              slot: int | None) -> None:
        pinned = host_nodes + ([ckpt_node] if ckpt_node is not None
                               and ckpt_node not in host_nodes else [])
        for n in pinned:
            n.io += 1  # pin the host copies while we make room on the device
        # (a tier lost while L3 was asked evicts nothing for a load that cannot run)
        rows = self._alloc_device_upto(len(host_nodes)) if self.host_online else []
        short = len(rows) < len(host_nodes)
        if not self.host_online or (short and self.ckpt_mode):
            for n in pinned:  # lost while making room, or no room for the whole resume
                n.io -= 1
            self.device.free(rows)
            if not self.host_online:
                self.stats.load_failed_pages += len(host_nodes)
                prefix.load_failed_pages = len(host_nodes)
            self._fallback(prefix, len(host_nodes))
            return
        for n in host_nodes[len(rows):]:  # full mirror: any page is a resume point
            n.io -= 1
        host_nodes = host_nodes[:len(rows)]
        if not host_nodes and ckpt_node is None:
            return
        assert self.hooks is not None
        ckpts: list[tuple[int, Any, int]] = []
        if ckpt_node is not None:
            if not self.device_ckpts:
                dst = slot
            elif ckpt_node.device is not None:
                dst = ckpt_node.device
            else:
                dst = rows[-1]  # the boundary is the last host page
            ckpts.append((dst, ckpt_node.ckpt_host, ckpt_node.depth))  # type: ignore[arg-type]
        ok = unknown = False
        ticket = None
        try:
            kw = {"ckpts": ckpts} if ckpts else {}
            ticket = self.hooks.load([n.host for n in host_nodes], rows, **kw)
            self.hooks.wait(ticket)
            ok = True
        except CopyOutcomeUnknown:  # the load may still be writing its rows: hold them
            unknown = True
            self._go_offline()
        except HostUnavailable:
            self._go_offline()
        except HostTierError:
            self.stats.transfer_failures += 1
        finally:
            for n in host_nodes:
                n.io -= 1
            if ckpt_node is not None and ckpt_node not in host_nodes:
                ckpt_node.io -= 1
        if not ok:
            if unknown:
                self.unknown_loads.append(ticket)
                self.held_device_rows.extend(rows)
                for dst, _, _ in ckpts:
                    if not self.device_ckpts:
                        self.held_slots.add(dst)
                        prefix.slot_held = True
                    elif dst not in rows:  # a live node's own row: held when it is evicted
                        self.suspect_rows.add(dst)
            else:
                self.device.free(rows)
            self.stats.load_failed_pages += len(host_nodes)
            prefix.load_failed_pages = len(host_nodes)
            if self.host_online:  # the copies are suspect: drop them (leaf first)
                if ckpt_node is not None and ckpt_node.ckpt_host is not None:
                    self._drop_ckpts([ckpt_node])
                self._drop_host([n for n in reversed(host_nodes) if n.host is not None])
            self._fallback(prefix, len(host_nodes))
            return
        for n, row in zip(host_nodes, rows):
            self._set_device(n, row)
            n.lock += 1
            prefix.nodes.append(n)
            prefix.loaded.append((n.key, row))
        prefix.host_pages = len(host_nodes)
        self.stats.loaded_pages += len(host_nodes)
        if ckpt_node is not None:
            self.stats.checkpoints_loaded += 1
            prefix.ckpt_dst = ckpts[0][0]
            if self.device_ckpts:
                ckpt_node.ckpt_dev = True

    def _fallback(self, prefix: Prefix, not_loaded: int) -> None:
        """The host part was not loaded: keep the device part up to its deepest device checkpoint."""
        nodes = prefix.nodes
        end = next((i + 1 for i in range(len(nodes) - 1, -1, -1) if self._dev_ckpt(nodes[i])), 0)
        for n in nodes[end:]:
            n.lock -= 1
        prefix.unresumable_pages += len(nodes) - end + (not_loaded if self.ckpt_mode else 0)
        prefix.nodes, prefix.device_pages = nodes[:end], end
        prefix.ckpt = ("device" if self.ckpt_mode else "page") if end else None

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
        """Rows ``alloc_device`` gave that the engine did not use; a row a page holds (or one
        held aside) is refused, nothing freed."""
        rows = list(rows)
        self._check_engine_rows(rows, "free_device")
        self.device.free(rows)

    def _check_engine_rows(self, rows: list[int], what: str) -> None:
        """``rows`` must be the engine's: allocated, each once, none a page's or held."""
        bad = (set(rows) & self.page_rows) | (set(rows) & set(self.held_device_rows))
        if bad:
            raise ValueError(f"{what}: device rows {sorted(bad)[:16]} belong to cached pages "
                             f"(or are held), not to the engine")
        if len(set(rows)) != len(rows):
            raise ValueError(f"{what}: device rows {sorted(rows)[:16]} name a row twice")
        if not self.device.allocated(rows):
            raise ValueError(f"{what}: device rows {sorted(rows)[:16]} were not all given by "
                             f"alloc_device")

    def checkpoint_indices(self, written_from: int, pages: int, cached: int = 0) -> list[int]:
        """Indices (0-based) of the pages a request that wrote ``[written_from, pages)``
        checkpoints: its last page, every ``checkpoint_every``-th, and with
        ``checkpoint_branch`` the deepest cached page it recomputed (``cached`` pages were in
        the tree past its resume point: later requests sharing them resume there)."""
        if not self.ckpt_mode or pages <= written_from:
            return []
        every = self.checkpoint_every
        out = {i for i in range(written_from, pages - 1) if every and (i + 1) % every == 0}
        if self.checkpoint_branch and written_from < cached <= pages:
            out.add(cached - 1)
        out.add(pages - 1)
        return sorted(out)

    def release(self, prefix: Prefix, keys: Sequence[Hashable], rows: Sequence[int],
                slot: int | None = None, slot_tokens: int | None = None,
                snapshot: Snapshot | None = None) -> None:
        """Insert ``keys[prefix.pages:]`` computed into ``rows``; unlock the prefix. Ring SWA:
        page ``keys[-1]`` is the one page whose checkpoint is read from the request ``slot``
        (``checkpoint_every`` / ``_branch`` are refused in ring mode), and only when the
        slot's rings and states took in exactly ``len(keys) * PAGE_TOKENS`` tokens
        (``slot_tokens``, required unless ``snapshot`` covers that page); a slot past that
        boundary (a prompt ending mid-page, decode) makes none there
        (``stats.checkpoints_skipped``). ``snapshot`` (``snapshot_slot``), taken after the
        first ``k`` of ``keys``, becomes page ``keys[k - 1]``'s checkpoint; one of other keys
        is freed. A backup from the slot has read it when this returns (the engine may reuse
        the slot at once)."""
        self._check_unused(prefix)
        if [n.key for n in prefix.nodes] != list(keys[:prefix.pages]):
            raise ValueError("release: keys must begin with the prefix's own pages (the keys "
                             "prepare() was given)")
        new_keys = keys[prefix.pages:]
        if len(new_keys) != len(rows):
            raise ValueError(f"{len(new_keys)} new pages but {len(rows)} rows given")
        self._check_engine_rows(list(rows), "release")
        bounds = set(self.checkpoint_indices(prefix.pages, len(keys),
                                             prefix.pages + prefix.unresumable_pages))
        if not self.device_ckpts and not self.host_online:
            bounds = set()  # ring SWA: a checkpoint is the host's copy of the slot, or nothing
        ring = bool(bounds) and not self.device_ckpts
        covered = self._covers(snapshot, keys)  # pages the snapshot stands after (0: none)
        at_end = ring and covered == len(keys)  # the snapshot is the last page's checkpoint
        if ring and not at_end and (slot is None or slot_tokens is None):
            raise ValueError("ring SWA mode: pass release(..., slot=..., slot_tokens=...), the "
                             "request slot and the tokens its rings and states took in (a "
                             "checkpoint is the slot at a page boundary), or a snapshot_slot() "
                             "taken at the boundary")
        if not covered:
            self.drop_snapshot(snapshot)  # other keys (or none held): nothing to attach
        if ring and not at_end and slot_tokens != len(keys) * PAGE_TOKENS:
            bounds.discard(len(keys) - 1)  # the slot is past that page: its state is not it
            self.stats.checkpoints_skipped += 1
        node = prefix.nodes[-1] if prefix.nodes else self.root
        path = list(prefix.nodes)
        created: list[Node] = []
        ckpt_nodes: list[Node] = []
        duplicate: list[int] = []
        for i, (key, row) in enumerate(zip(new_keys, rows), prefix.pages):
            child = node.children.get(key)
            mine = True
            if child is None:
                child = Node(key, node)
                node.children[key] = child
                child.hits = 1
                self._set_device(child, row)
                created.append(child)
            elif child.device is None:  # host-only (inserted meanwhile): take our copy
                self._set_device(child, row)
                child.hits += 1
            else:  # another request inserted this page meanwhile: keep theirs ...
                child.hits += 1
                if (i in bounds and self.device_ckpts and not child.ckpt_dev
                        and not child.lock and not child.io):  # ... unless ours has a checkpoint
                    duplicate.append(child.device)
                    self.page_rows.discard(child.device)
                    child.device = row
                    self.page_rows.add(row)
                else:
                    duplicate.append(row)
                    mine = False
            if i in bounds:
                if mine or not self.device_ckpts:
                    child.ckpt_dev = self.device_ckpts
                    # (a ring slot's checkpoint is made only where the host has none yet)
                    if self.device_ckpts or child.ckpt_host is None:
                        self.stats.checkpoints_made += 1
                if child.ckpt_dev or not self.device_ckpts:
                    ckpt_nodes.append(child)
            path.append(child)
            node = child
        if duplicate:  # (a node's own row may be suspect: held, not freed)
            self._free_node_rows(duplicate)
        self._unlock(prefix)
        self._touch(path)
        if covered and snapshot is not None:  # a boundary's checkpoint, taken before it wrote on
            if self._attach_snapshot(snapshot, path[covered - 1]) and covered < len(keys):
                self.stats.checkpoints_made += 1  # (the last page's is counted above)
        ckpts = [n for n in ckpt_nodes if n.ckpt_host is None]
        if self.policy == "write_through":
            self._backup([n for n in created if n.host is None], ckpts, slot)
        elif self.policy == "write_through_selective":
            pages = [n for n in path if n.host is None and n.io == 0
                     and n.hits >= self.selective_threshold]
            ok = set(pages)
            self._backup(pages, [n for n in ckpts if n.host is not None or n in ok
                                 or not self.device_ckpts], slot)
        elif not self.device_ckpts:  # write_back, ring: the slot is reused, now or never
            self._backup([], ckpts, slot)
        if slot is not None and not self.device_ckpts:
            self._settle_slot_backup()  # before the engine reuses the slot

    def abort(self, prefix: Prefix, snapshot: Snapshot | None = None) -> None:
        """Unlock a prefix whose request is dropped without inserting anything (and free its
        ``snapshot``, if any)."""
        self._check_unused(prefix)
        self._unlock(prefix)
        self.drop_snapshot(snapshot)

    @staticmethod
    def _check_unused(prefix: Prefix) -> None:
        if prefix.done:
            raise ValueError("this prefix was released or aborted already: each prepare() is "
                             "ended once")

    @staticmethod
    def _unlock(prefix: Prefix) -> None:
        for n in prefix.nodes:
            n.lock -= 1
        prefix.done = True

    # ------------------------------------------------------------------ helpers
    def _set_device(self, node: Node, row: int) -> None:
        node.device = row
        self.page_rows.add(row)
        node.parent.dev_children += 1  # type: ignore[union-attr]
        self._dev_lru[node] = None

    def _touch(self, path: list[Node]) -> None:
        for n in reversed(path):  # leaf first: ancestors end up more recent
            if n.device is not None and n in self._dev_lru:
                self._dev_lru.move_to_end(n)
            if n in self._host_lru:
                self._host_lru.move_to_end(n)
            if n in self._ckpt_lru:
                self._ckpt_lru.move_to_end(n)
