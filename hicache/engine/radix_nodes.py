"""The parts of the reference radix tree (``hicache.engine.radix``): rows, nodes, results, counters.

* ``RowFreeList`` — device page rows ``0 .. capacity-1``: alloc all-or-nothing, checked frees.
* ``Node`` — one 256-token page: its key, device row, host handle, locks, and its resume
  checkpoint (``ckpt_dev``: the device row's SWA tail and states hold this boundary's checkpoint;
  ``ckpt_host``: a host checkpoint handle), see ``hicache.core.resume``.
* ``Prefix`` — what ``prepare`` locked for a request, by tier, and where its checkpoint came from.
* ``TreeStats`` — counters, every one a number of pages or checkpoints.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Hashable, Iterable

from hicache.core.errors import HicacheError


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

    def allocated(self, rows: Iterable[int]) -> bool:
        """Whether every row of ``rows`` is in range and handed out."""
        return all(0 <= r < self.capacity and self._used[r] for r in rows)

    def free(self, rows: Iterable[int]) -> None:
        rows = list(rows)
        if len(set(rows)) != len(rows):
            raise ValueError(f"device rows {sorted(rows)[:16]} name a row twice")
        for r in rows:
            if not 0 <= r < self.capacity or not self._used[r]:
                raise ValueError(f"device row {r} is not allocated (capacity {self.capacity})")
        for r in rows:
            self._used[r] = 0
        self._free.extend(rows)


class Node:
    __slots__ = ("key", "parent", "children", "device", "host", "lock", "io", "hits",
                 "dev_children", "depth", "ckpt_dev", "ckpt_host")

    def __init__(self, key: Hashable, parent: "Node | None") -> None:
        self.key = key
        self.parent = parent
        self.children: dict[Hashable, Node] = {}
        self.device: int | None = None  # device page row
        self.host: Any = None  # host handle (opaque to the tree)
        self.lock = 0  # running requests using this page
        self.io = 0  # transfers in flight on this page or its checkpoint
        self.hits = 0  # requests that used this page (its creator included)
        self.dev_children = 0  # children that hold a device copy
        self.depth = 0 if parent is None else parent.depth + 1  # pages up to and with this one
        self.ckpt_dev = False  # the device row holds this boundary's checkpoint
        self.ckpt_host: Any = None  # host checkpoint handle (opaque to the tree)

    def __repr__(self) -> str:  # pragma: no cover - debugging aid
        return (f"Node({self.key!r}, dev={self.device}, host={self.host is not None}, "
                f"ckpt_dev={self.ckpt_dev}, ckpt_host={self.ckpt_host is not None}, "
                f"lock={self.lock}, io={self.io}, hits={self.hits})")


@dataclass
class Prefix:
    """What ``prepare`` found for a request: locked nodes, by tier, and the rows loaded.

    ``ckpt``: where the boundary checkpoint of the prefix came from — ``"page"`` (full mirror:
    the page copy carries it), ``"device"``, ``"host"`` (loaded by this prepare) or ``None``
    (empty prefix). ``ckpt_dst``: the device row or request slot it was loaded into.
    ``slot_held``: a checkpoint load into the request's slot had an unknown outcome (it may
    still land): the request must run in another slot (the tree's ``held_slots``).
    """

    nodes: list[Node]
    device_pages: int  # pages that were on device already
    host_pages: int  # pages loaded from host (now on device)
    loaded: list[tuple[Hashable, int]] = field(default_factory=list)  # (key, device row)
    load_failed_pages: int = 0  # host hits recomputed because the host tier failed
    ckpt: str | None = None
    ckpt_dst: int | None = None
    unresumable_pages: int = 0  # cached pages past the deepest checkpoint (recomputed)
    l3_pages: int = 0  # of host_pages: pages the L3 tier supplied (fetched at match time)
    slot_held: bool = False
    done: bool = False  # released or aborted: a prefix is ended once

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
    unresumable_pages: int = 0  # cached pages past a prefix's deepest checkpoint
    checkpoints_made: int = 0  # boundaries a request wrote a checkpoint for
    checkpoints_backed_up: int = 0
    checkpoints_loaded: int = 0
    checkpoints_dropped: int = 0  # host checkpoints evicted or lost with their page
    checkpoint_backup_dropped: int = 0  # a checkpoint backup found no host room
    checkpoints_skipped: int = 0  # ring SWA: the slot was past the page at release, no snapshot
    l3_hit_pages: int = 0  # pages fetched from L3 into the host tier at match time
    l3_put_pages: int = 0  # pages handed to L3 after their backup (written or skipped there)
    l3_hit_checkpoints: int = 0  # checkpoints fetched from L3 at match time (checkpoints mirror)
    l3_put_checkpoints: int = 0  # checkpoints handed to L3 after their backup

    def as_dict(self) -> dict[str, int]:
        return dict(self.__dict__)
