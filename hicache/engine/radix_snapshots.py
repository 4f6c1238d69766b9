"""Ring SWA checkpoints taken at a page boundary, before the request writes on.

``Snapshots`` is a mixin of ``RadixTree`` (``hicache.engine.radix``; contract and invariants
are stated there). In ring SWA mode a request slot holds one SWA window and one set of
compress states: those after the last token the request took in. A checkpoint of page ``k``
is the slot as it stood right after page ``k``'s last token, so ``release`` can back it up
from the slot only when the request ended exactly there (``slot_tokens``). A request that goes
on past that boundary (a prompt ending mid-page, decode) gets its checkpoint only if the
engine stops at the boundary and calls ``snapshot_slot(slot, keys)`` there: one BACKUP of the
slot into a host checkpoint row, settled (the copy has read the slot) before it returns a
``Snapshot``. The engine owns it: ``release(..., snapshot=s)`` attaches it to page
``keys[len(s.keys) - 1]`` when ``s.keys`` are the first keys of the release (whatever slot the
request is in by then; freed when that page already has a host checkpoint or the keys differ),
``abort(prefix, snapshot=s)`` or ``drop_snapshot(s)`` frees it. While held it counts against
``host_ckpt_capacity`` (``_ckpt_pending``; ``held_snapshots``). Losing the host tier forgets
every one (``Snapshot.handle`` None: a later release of it makes no checkpoint).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Hashable, Sequence

from hicache.engine.hooks import HostTierError, HostUnavailable
from hicache.engine.radix_nodes import Node
from hicache.engine.radix_transfers import Transfers


@dataclass(eq=False)
class Snapshot:
    """A request slot's checkpoint taken right after page ``keys[-1]`` (``snapshot_slot``)."""

    keys: tuple[Hashable, ...]
    handle: Any  # its host checkpoint handle; None once attached, freed or lost


class Snapshots(Transfers):
    """Boundary snapshots of request slots for ``RadixTree`` (a mixin; module docstring)."""

    ckpt_mode: bool
    device_ckpts: bool
    _snapshots: set[Snapshot]

    @property
    def held_snapshots(self) -> int:
        """Snapshots taken and not yet attached or freed."""
        return len(self._snapshots)

    def snapshot_slot(self, slot: int, keys: Sequence[Hashable]) -> Snapshot | None:
        """The request in ``slot`` stands right after page ``keys[-1]`` (its rings and states
        took in exactly ``len(keys)`` pages of tokens) and will write on before ``release``:
        back that boundary's checkpoint up from the slot now. Returns once the copy has read
        the slot; None when none was taken (host tier offline or full, the copy refused or
        failed: ``release`` then makes no checkpoint at that page)."""
        if not self.ckpt_mode or self.device_ckpts:
            raise ValueError("snapshot_slot is for ring SWA mode with the checkpoints mirror "
                             "(device_ckpts=False); paged SWA keeps each boundary in its page row")
        if not keys:
            raise ValueError("snapshot_slot needs the keys of the pages up to the boundary")
        if not self.host_online:
            return None
        handles = self._ckpt_alloc(1)
        if not handles or not self.host_online:
            self.stats.checkpoint_backup_dropped += 1
            return None
        assert self.hooks is not None
        self._ckpt_pending += 1  # held: counted against host_ckpt_capacity from here
        try:
            self.hooks.wait(self.hooks.backup([], [], ckpts=[(slot, handles[0], len(keys))]))
        except HostUnavailable:  # unknown outcome included: the tier is dropped, as for pages
            self._go_offline()
            return None
        except HostTierError:
            self.stats.transfer_failures += 1
            self._ckpt_pending -= 1
            self._free_handles(handles, "ckpt")
            return None
        snap = Snapshot(tuple(keys), handles[0])
        self._snapshots.add(snap)
        return snap

    def drop_snapshot(self, snap: Snapshot | None) -> None:
        """Free ``snap`` if the tree still holds it (the request will not release it)."""
        if snap is None or snap not in self._snapshots:
            return
        self._snapshots.discard(snap)
        handle, snap.handle = snap.handle, None
        self._ckpt_pending -= 1
        self._free_handles([handle], "ckpt")

    def _covers(self, snap: Snapshot | None, keys: Sequence[Hashable]) -> int:
        """Pages of ``keys`` a held ``snap`` was taken after (0: none, or not a prefix)."""
        if snap is None or snap not in self._snapshots:
            return 0
        n = len(snap.keys)
        return n if n <= len(keys) and tuple(keys[:n]) == snap.keys else 0

    def _attach_snapshot(self, snap: Snapshot, node: Node) -> bool:
        """Page ``node``'s host checkpoint is ``snap``'s (freed instead if it has one);
        True when attached."""
        if node.ckpt_host is not None:
            self.drop_snapshot(snap)
            return False
        self._snapshots.discard(snap)
        node.ckpt_host, snap.handle = snap.handle, None
        self._ckpt_pending -= 1
        self._ckpt_lru[node] = None
        self.stats.checkpoints_backed_up += 1
        self._l3_put([], [node])
        return True
