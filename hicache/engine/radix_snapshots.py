"""Ring SWA checkpoints taken at the page boundary, before the request writes on.

``Snapshots`` is a mixin of ``RadixTree`` (``hicache.engine.radix``; contract and invariants
are stated there). In ring SWA mode a request slot holds one SWA window and one set of
compress states: those after the last token the request took in. A checkpoint of page ``k``
is the slot as it stood right after page ``k``'s last token, so ``release`` can back it up
from the slot only when the request ended exactly there (``slot_tokens``). A request that goes
on past that boundary (a prompt ending mid-page, decode) gets its checkpoint only if the
engine stops at the boundary and calls ``snapshot_slot(slot, keys)`` there: one BACKUP of the
slot into a host checkpoint row, settled (the copy has read the slot) before it returns.
``release`` of the same slot with the same ``keys`` attaches that row to page ``keys[-1]``
(or frees it when the page already has a host checkpoint); a snapshot not used by then, one
taken anew for the slot, or one of an ``abort(prefix, slot)`` is freed. While held it counts
against ``host_ckpt_capacity`` (``_ckpt_pending``). Losing the host tier forgets it.
"""
from __future__ import annotations

from typing import Any, Hashable, Sequence

from hicache.engine.hooks import HostTierError, HostUnavailable
from hicache.engine.radix_nodes import Node
from hicache.engine.radix_transfers import Transfers


class Snapshots(Transfers):
    """Boundary snapshots of request slots for ``RadixTree`` (a mixin; module docstring)."""

    ckpt_mode: bool
    device_ckpts: bool
    _snapshots: dict[int, Any]

    def snapshot_slot(self, slot: int, keys: Sequence[Hashable]) -> bool:
        """The request in ``slot`` stands right after page ``keys[-1]`` (its rings and states
        took in exactly ``len(keys)`` pages of tokens) and will write on before ``release``:
        back that boundary's checkpoint up from the slot now. True once the copy has read the
        slot; False when none was taken (host tier offline or full, the copy refused or
        failed: ``release`` then makes no checkpoint at that page)."""
        if not self.ckpt_mode or self.device_ckpts:
            raise ValueError("snapshot_slot is for ring SWA mode with the checkpoints mirror "
                             "(device_ckpts=False); paged SWA keeps each boundary in its page row")
        if not keys:
            raise ValueError("snapshot_slot needs the keys of the pages up to the boundary")
        self.drop_snapshot(slot)
        if not self.host_online:
            return False
        handles = self._ckpt_alloc(1)
        if not handles or not self.host_online:
            self.stats.checkpoint_backup_dropped += 1
            return False
        assert self.hooks is not None
        self._ckpt_pending += 1  # held: counted against host_ckpt_capacity from here
        try:
            self.hooks.wait(self.hooks.backup([], [], ckpts=[(slot, handles[0], len(keys))]))
        except HostUnavailable:  # unknown outcome included: the tier is dropped, as for pages
            self._go_offline()
            return False
        except HostTierError:
            self.stats.transfer_failures += 1
            self._ckpt_pending -= 1
            self._free_handles(handles, "ckpt")
            return False
        self._snapshots[slot] = (tuple(keys), handles[0])
        return True

    def drop_snapshot(self, slot: int) -> None:
        """Free the snapshot held for ``slot``, if any (the request took another path)."""
        snap = self._snapshots.pop(slot, None)
        if snap is not None and self.host_online:
            self._ckpt_pending -= 1
            self._free_handles([snap[1]], "ckpt")

    def _snapshot_for(self, slot: int | None, keys: Sequence[Hashable]) -> Any:
        """The host handle of ``slot``'s snapshot taken after ``keys`` (None: none). A
        snapshot of other keys is freed."""
        if slot is None or slot not in self._snapshots:
            return None
        if self._snapshots[slot][0] != tuple(keys):
            self.drop_snapshot(slot)
            return None
        return self._snapshots.pop(slot)[1]

    def _attach_snapshot(self, node: Node, handle: Any) -> None:
        """Page ``node``'s host checkpoint is the snapshot ``handle`` (freed if it has one)."""
        self._ckpt_pending -= 1
        if node.ckpt_host is not None:
            self._free_handles([handle], "ckpt")
            return
        node.ckpt_host = handle
        self._ckpt_lru[node] = None
        self.stats.checkpoints_backed_up += 1
        self._l3_put([], [node])
