"""``RowAllocator``: the free list and owner table of one row-id space.

Contract (one instance per index space; pools of a space share its row ids; callers serialize):

* ``alloc(n, owner) -> torch.int64 tensor`` of ``n`` distinct free rows, owned by ``owner`` from
  that moment (the owner is written in the same step: bookkeeping lives in the allocation).
  Raises ``PoolExhausted`` when fewer than ``n`` rows are free. O(n).
* ``free(rows, owner)``: O(n). Out-of-range rows, rows listed twice, rows already free (double
  free) and rows owned by someone else raise ``PoolError`` naming the rows, and change nothing:
  ``check_free`` validates fully, then ``_release`` mutates.
* ``free_owner(client_id, request=None) -> int``: frees every row of that client (any request)
  or of exactly ``(client_id, request)``; O(rows in the space).
* ``owner_of(row)``, ``rows_of(client_id, request=None)``, ``stats()``, ``snapshot()``,
  ``check_invariants()`` (free and used rows partition the space; owner counts exact).

Host row 0 is a valid row (host and device index spaces are separate). Rows come out lowest
first from a fresh allocator; an alloc followed by the free of the same rows restores the
free list exactly (so rollbacks leave no trace).
"""
from __future__ import annotations

from typing import Any, Sequence, Tuple, Union

import numpy as np
import torch

from .errors import InvariantError, NotOwnerError, PoolError, PoolExhausted, RowRangeError

Owner = Tuple[str, Union[str, None]]  # (client_id, request id or None)
RowsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]
FREE = -1
_SHOW = 8  # rows named in an error message


def check_owner(owner: Any) -> Owner:
    """``(client_id: non-empty str, request: str | None)`` or ``PoolError``."""
    if not (isinstance(owner, tuple) and len(owner) == 2 and isinstance(owner[0], str)
            and owner[0] and (owner[1] is None or isinstance(owner[1], str))):
        raise PoolError(f"owner must be (client_id: non-empty str, request: str | None), "
                        f"got {owner!r}")
    return owner


def as_rows(rows: RowsLike) -> np.ndarray:
    """A 1-D int64 numpy copy of ``rows`` (tensor on any device, array or sequence)."""
    if isinstance(rows, torch.Tensor):
        if rows.dtype.is_floating_point or rows.dtype.is_complex or rows.dtype == torch.bool:
            raise PoolError(f"rows must be integers, got a {rows.dtype} tensor")
        arr = rows.detach().to("cpu", torch.int64).numpy()
    else:
        arr = np.asarray(rows)
        if arr.size == 0:
            arr = arr.astype(np.int64)
        if arr.dtype.kind not in "iu":
            raise PoolError(f"rows must be integers, got {arr.dtype}")
    if arr.ndim != 1:
        raise PoolError(f"rows must be 1-D, got shape {tuple(arr.shape)}")
    return arr.astype(np.int64, copy=True)


def _show(rows: np.ndarray) -> str:
    head = ", ".join(str(int(r)) for r in rows[:_SHOW])
    return f"[{head}{', ...' if rows.size > _SHOW else ''}] ({rows.size} row(s))"


class RowAllocator:
    """Free-list stack plus an owner id per row for one index space."""

    def __init__(self, num_rows: int, space: str) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
            raise PoolError(f"space {space!r}: row count must be a positive int, got {num_rows!r}")
        self.space = space
        self.num_rows = num_rows
        self._stack = np.arange(num_rows - 1, -1, -1, dtype=np.int64)  # free rows, top at end
        self._top = num_rows
        self._owner = np.full(num_rows, FREE, dtype=np.int32)  # owner id per row
        self._scratch = np.zeros(num_rows, dtype=np.int64)  # duplicate detection in O(n)
        self._ids: dict[Owner, int] = {}
        self._owners: list[Owner | None] = []  # id -> owner
        self._counts: list[int] = []  # id -> rows held
        self._spare: list[int] = []  # ids to reuse

    # ------------------------------------------------------------------ allocation
    @property
    def free_rows(self) -> int:
        return self._top

    @property
    def used_rows(self) -> int:
        return self.num_rows - self._top

    def check_alloc(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise PoolError(f"space {self.space!r}: row count must be a non-negative int, "
                            f"got {n!r}")
        if n > self._top:
            raise PoolExhausted(f"space {self.space!r}: {n} rows asked, {self._top} of "
                                f"{self.num_rows} free")

    def alloc(self, n: int, owner: Owner) -> torch.Tensor:
        """``n`` free rows, now owned by ``owner`` (see the module docstring)."""
        owner = check_owner(owner)
        self.check_alloc(n)
        n = int(n)
        rows = self._stack[self._top - n:self._top][::-1].copy()
        if n:
            oid = self._intern(owner)
            self._top -= n
            self._owner[rows] = oid
            self._counts[oid] += n
        return torch.from_numpy(rows)

    def check_free(self, rows: RowsLike, owner: Owner) -> np.ndarray:
        """Validate a free without changing anything; returns the rows as int64 numpy."""
        owner = check_owner(owner)
        arr = as_rows(rows)
        if arr.size == 0:
            return arr
        bad = arr[(arr < 0) | (arr >= self.num_rows)]
        if bad.size:
            raise RowRangeError(f"space {self.space!r}: rows {_show(bad)} are outside "
                            f"0..{self.num_rows - 1}")
        pos = np.arange(arr.size, dtype=np.int64)
        self._scratch[arr] = pos  # a repeated row keeps one position: the others mismatch
        dup = arr[self._scratch[arr] != pos]
        if dup.size:
            raise RowRangeError(f"space {self.space!r}: rows {_show(np.unique(dup))} are listed "
                            "more than once")
        held = self._owner[arr]
        free = arr[held == FREE]
        if free.size:
            raise NotOwnerError(f"space {self.space!r}: rows {_show(free)} are not allocated "
                            "(double free?)")
        oid = self._ids.get(owner)
        foreign = arr[held != (FREE if oid is None else oid)]
        if foreign.size:
            other = self._owners[int(self._owner[foreign[0]])]
            raise NotOwnerError(f"space {self.space!r}: rows {_show(foreign)} are not owned by "
                            f"{owner}; row {int(foreign[0])} belongs to {other}")
        return arr

    def free(self, rows: RowsLike, owner: Owner) -> int:
        """Return ``rows`` of ``owner`` to the free list; all or nothing. Returns the count."""
        arr = self.check_free(rows, owner)
        self._release(arr)
        return int(arr.size)

    def _release(self, arr: np.ndarray) -> None:
        """Mutation half of ``free``: ``arr`` must have passed ``check_free``."""
        if arr.size == 0:
            return
        ids, counts = np.unique(self._owner[arr], return_counts=True)
        for oid, c in zip(ids.tolist(), counts.tolist()):
            self._counts[oid] -= c
            if self._counts[oid] == 0:
                self._forget(oid)
        self._owner[arr] = FREE
        self._stack[self._top:self._top + arr.size] = arr[::-1]
        self._top += arr.size

    def free_owner(self, client_id: str, request: str | None = None) -> int:
        """Free every row of ``client_id`` (``request=None``: all its requests). Count freed."""
        arr = self._select(client_id, request)
        self._release(arr)
        return int(arr.size)

    def rows_of(self, client_id: str, request: str | None = None) -> torch.Tensor:
        """Rows held by ``client_id`` (one request, or all when ``request`` is None)."""
        return torch.from_numpy(self._select(client_id, request))

    def _select(self, client_id: str, request: str | None) -> np.ndarray:
        check_owner((client_id, request))
        if request is not None:
            oids = [self._ids[(client_id, request)]] if (client_id, request) in self._ids else []
        else:
            oids = [i for o, i in self._ids.items() if o[0] == client_id]
        if not oids:
            return np.empty(0, dtype=np.int64)
        return np.flatnonzero(np.isin(self._owner, oids)).astype(np.int64)

    def owner_of(self, row: int) -> Owner | None:
        if not 0 <= row < self.num_rows:
            raise RowRangeError(f"space {self.space!r}: row {row} is outside 0..{self.num_rows - 1}")
        oid = int(self._owner[row])
        return None if oid == FREE else self._owners[oid]

    # ------------------------------------------------------------------ owner ids
    def _intern(self, owner: Owner) -> int:
        oid = self._ids.get(owner)
        if oid is None:
            if self._spare:
                oid = self._spare.pop()
                self._owners[oid], self._counts[oid] = owner, 0
            else:
                oid = len(self._owners)
                self._owners.append(owner)
                self._counts.append(0)
            self._ids[owner] = oid
        return oid

    def _forget(self, oid: int) -> None:
        owner = self._owners[oid]
        assert owner is not None
        del self._ids[owner]
        self._owners[oid] = None
        self._spare.append(oid)

    # ------------------------------------------------------------------ inspection
    def owners(self) -> dict[Owner, int]:
        """Rows held per owner."""
        return {o: self._counts[i] for o, i in self._ids.items()}

    def stats(self) -> dict[str, Any]:
        return {"space": self.space, "rows": self.num_rows, "used": self.used_rows,
                "free": self._top, "owners": len(self._ids)}

    def snapshot(self) -> tuple[bytes, tuple[Owner | None, ...], dict[Owner, int]]:
        """Comparable state: free list (in order), owner per row, rows per owner."""
        per_row = tuple(None if i == FREE else self._owners[i] for i in self._owner.tolist())
        return self._stack[:self._top].tobytes(), per_row, self.owners()

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless free and used rows partition the space exactly."""
        sp = self.space
        free = self._stack[:self._top]
        if free.size and (free.min() < 0 or free.max() >= self.num_rows):
            raise InvariantError(f"space {sp!r}: free list holds out-of-range rows")
        if np.unique(free).size != free.size:
            raise InvariantError(f"space {sp!r}: free list holds a row twice")
        if (self._owner[free] != FREE).any():
            raise InvariantError(f"space {sp!r}: a row is both free and owned")
        if int((self._owner == FREE).sum()) != free.size:
            raise InvariantError(f"space {sp!r}: a row is neither free nor owned")
        counts = np.bincount(self._owner[self._owner != FREE], minlength=len(self._owners))
        for o, i in self._ids.items():
            if self._owners[i] != o or counts[i] != self._counts[i] or self._counts[i] <= 0:
                raise InvariantError(f"space {sp!r}: owner {o} count {self._counts[i]} "
                                     f"but holds {counts[i]} rows")
        live = set(self._ids.values())
        stray = [i for i in range(len(self._owners)) if i not in live and counts[i]]
        if stray or len(live) + len(self._spare) != len(self._owners):
            raise InvariantError(f"space {sp!r}: owner table out of step (ids {stray})")
