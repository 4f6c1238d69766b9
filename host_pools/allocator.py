"""``RowAllocator``: the free runs and owner table of one row-id space.

Contract (one instance per index space; pools of a space share its row ids; callers serialize):

* ``alloc(n, owner) -> torch.int64 tensor`` of ``n`` distinct free rows, owned by ``owner`` from
  that moment (the owner is written in the same step: bookkeeping lives in the allocation).
  Rows come in runs: the free rows are kept as maximal runs of consecutive ids, indexed by
  size class (``floor(log2(length))``). A request of ``n`` rows takes a fitting run of its
  own class (the tightest fit, among the first few of that class), else the lowest-starting
  run of the smallest larger class (where every run fits); only when no
  single run holds ``n`` rows does it take runs of the largest size classes first (lowest
  start first within a class). So one request's rows are
  consecutive whenever a free run can hold them. Raises ``PoolExhausted`` when fewer than
  ``n`` rows are free. O(n + runs touched + classes).
* ``free(rows, owner)``: O(n log n). Out-of-range rows, rows listed twice, rows already free
  (double free) and rows owned by someone else raise ``PoolError`` naming the rows, and change
  nothing: ``check_free`` validates fully, then ``_release`` mutates. Freed rows coalesce with
  their free neighbours into one run.
* ``free_owner(client_id, request=None) -> int``: frees every row of that client (any request)
  or of exactly ``(client_id, request)``; O(rows in the space).
* ``free_client_rows(client_id, rows) -> int``: frees ``rows``, each held by some request of
  ``client_id``, all or nothing (``PoolError`` otherwise); O(n log n). A reaped client's rows
  go back this way, a bounded slice at a time.
* ``on_release``: optional callable given the int64 rows of every release (free, free_owner,
  deferred frees all pass through ``_release``), before they become allocatable again; the
  pool group uses it to return rows to "unwritten" (and to zero them when asked).
* ``owner_of(row)``, ``rows_of(client_id, request=None)``, ``foreign_rows(client_id, rows)`` (the
  rows no request of that client holds), ``runs()``, ``stats()`` (with
  ``free_runs``, ``mean_free_run`` and ``fragmentation`` = 1 - largest free run / free rows),
  ``snapshot()``, ``check_invariants()`` (free runs sorted, disjoint, coalesced, exactly the
  unowned rows; size-class index exact; owner counts exact).

Host row 0 is a valid row (host and device index spaces are separate). Rows come out lowest
first from a fresh allocator; an alloc followed by the free of the same rows restores the
free runs exactly (a rollback leaves no row taken or split), though not the order of the
runs within a size class, so a later request may be placed in another run of the same size.
"""
from __future__ import annotations

import heapq
from typing import Any, Callable, Sequence, Tuple, Union

import numpy as np
import torch

from .errors import InvariantError, NotOwnerError, PoolError, PoolExhausted, RowRangeError

Owner = Tuple[str, Union[str, None]]  # (client_id, request id or None)
RowsLike = Union[torch.Tensor, np.ndarray, Sequence[int]]
FREE = -1
_SHOW = 8  # rows named in an error message
_SCAN = 64  # runs of the tightest class examined first for a fit
_SMALL = 16  # up to this many rows, plain loops instead of numpy calls


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


def runs_of(rows: np.ndarray) -> list[tuple[int, int]]:
    """``(start, length)`` of the maximal runs of consecutive ids in ``rows`` (sorted first)."""
    if rows.size == 0:
        return []
    if rows.size <= _SMALL:  # a plain loop beats numpy's per-call overhead here
        out: list[tuple[int, int]] = []
        for r in sorted(rows.tolist()):
            if out and out[-1][0] + out[-1][1] == r:
                out[-1] = (out[-1][0], out[-1][1] + 1)
            else:
                out.append((r, 1))
        return out
    s = np.sort(rows)
    brk = np.flatnonzero(np.diff(s) != 1) + 1
    starts = np.concatenate(([0], brk))
    ends = np.concatenate((brk, [s.size]))
    return [(int(s[a]), int(b - a)) for a, b in zip(starts.tolist(), ends.tolist())]


def _show(rows: np.ndarray) -> str:
    head = ", ".join(str(int(r)) for r in rows[:_SHOW])
    return f"[{head}{', ...' if rows.size > _SHOW else ''}] ({rows.size} row(s))"


class RowAllocator:
    """Free runs (coalesced, indexed by size class) plus an owner id per row, one index space."""

    def __init__(self, num_rows: int, space: str) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
            raise PoolError(f"space {space!r}: row count must be a positive int, got {num_rows!r}")
        self.space = space
        self.num_rows = num_rows
        self._free = 0
        self._by_start: dict[int, int] = {}  # run start -> length
        self._by_end: dict[int, int] = {}  # run end (exclusive) -> start
        self._classes: list[list[int]] = [[] for _ in range(num_rows.bit_length())]  # heaps
        self._owner = np.full(num_rows, FREE, dtype=np.int32)  # owner id per row
        self._scratch = np.zeros(num_rows, dtype=np.int64)  # duplicate detection in O(n)
        self._ids: dict[Owner, int] = {}
        self._owners: list[Owner | None] = []  # id -> owner
        self._counts: list[int] = []  # id -> rows held
        self._spare: list[int] = []  # ids to reuse
        # client of each owner id as a small int (-1: none), one slot past the ids for FREE (-1
        # indexes it), so whose rows a command names is one lookup per row, however many
        # requests (owner ids) its client holds; client numbers live while the client owns rows
        self._oid_client = np.full(17, -1, dtype=np.int64)
        self._clients: dict[str, list[int]] = {}  # client id -> [its number, owner ids held]
        self._next_client = 0
        self.on_release: Callable[[np.ndarray], None] | None = None
        self._add_run(0, num_rows)
        self._free = num_rows

    # ------------------------------------------------------------------ free runs
    def _add_run(self, start: int, n: int) -> None:
        """Insert the free run ``[start, start + n)``, merged with free neighbours."""
        left = self._by_end.pop(start, None)
        if left is not None:
            ln = self._by_start.pop(left)
            start, n = left, n + ln
        right = self._by_start.pop(start + n, None)
        if right is not None:
            del self._by_end[start + n + right]
            n += right
        self._by_start[start] = n
        self._by_end[start + n] = start
        heapq.heappush(self._classes[n.bit_length() - 1], start)

    def _live(self, c: int, start: int) -> bool:
        """Is a heap entry of class ``c`` the start of a current free run of that class?"""
        n = self._by_start.get(start)
        return n is not None and n.bit_length() - 1 == c

    def _top(self, c: int) -> int | None:
        """Lowest-starting live run of class ``c`` (stale heap entries dropped), or None."""
        h = self._classes[c]
        while h and not self._live(c, h[0]):
            heapq.heappop(h)
        return h[0] if h else None

    def _take(self, start: int, n: int) -> None:
        """Remove ``n`` rows from the front of the free run at ``start``."""
        length = self._by_start.pop(start)
        del self._by_end[start + length]
        if length > n:
            rest = start + n
            self._by_start[rest] = length - n
            self._by_end[start + length] = rest
            heapq.heappush(self._classes[(length - n).bit_length() - 1], rest)
        if sum(map(len, self._classes)) > 4 * len(self._by_start) + 64:
            self._compact()

    def _compact(self) -> None:
        """Rebuild the class heaps from the live runs (stale entries pile up otherwise)."""
        self._classes = [[] for _ in range(self.num_rows.bit_length())]
        for s, n in self._by_start.items():
            self._classes[n.bit_length() - 1].append(s)
        for h in self._classes:
            heapq.heapify(h)

    def _take_rows(self, n: int) -> list[tuple[int, int]]:
        """Take ``n`` rows out of the free runs (``n`` <= free rows); returns the pieces
        ``(start, length)``: one piece whenever some run holds ``n`` rows."""
        top = len(self._classes)
        c = n.bit_length() - 1  # the tightest class: runs of [2**c, 2**(c+1)), some >= n
        h = self._classes[c]
        if h:
            best, fit = -1, 0
            for s in h[:_SCAN]:  # the tightest fit among the first few
                if self._live(c, s) and n <= self._by_start[s] and (best < 0
                                                                     or self._by_start[s] < fit):
                    best, fit = s, self._by_start[s]
                    if fit == n:
                        break
            if best >= 0:
                self._take(best, n)
                return [(best, n)]
        for c in range(c + 1, top):  # every run of a larger class holds n: lowest start
            s = self._top(c)
            if s is not None:
                self._take(s, n)
                return [(s, n)]
        if len(h) > _SCAN:  # the rest of the tightest class, before splitting the request
            for s in h[_SCAN:]:
                if self._live(n.bit_length() - 1, s) and self._by_start[s] >= n:
                    self._take(s, n)
                    return [(s, n)]
        pieces, need = [], n  # no single run holds n: largest runs first
        for c in range(top - 1, -1, -1):
            while need:
                s = self._top(c)
                if s is None:
                    break
                k = min(need, self._by_start[s])
                self._take(s, k)
                pieces.append((s, k))
                need -= k
            if not need:
                break
        return pieces

    # ------------------------------------------------------------------ allocation
    @property
    def free_rows(self) -> int:
        return self._free

    @property
    def used_rows(self) -> int:
        return self.num_rows - self._free

    def check_alloc(self, n: int) -> None:
        if isinstance(n, bool) or not isinstance(n, (int, np.integer)) or n < 0:
            raise PoolError(f"space {self.space!r}: row count must be a non-negative int, "
                            f"got {n!r}")
        if n > self._free:
            raise PoolExhausted(f"space {self.space!r}: {n} rows asked, {self._free} of "
                                f"{self.num_rows} free")

    def alloc(self, n: int, owner: Owner) -> torch.Tensor:
        """``n`` free rows, now owned by ``owner`` (see the module docstring)."""
        owner = check_owner(owner)
        self.check_alloc(n)
        n = int(n)
        if not n:
            return torch.empty(0, dtype=torch.int64)
        pieces = self._take_rows(n)
        try:
            if len(pieces) == 1:
                rows = np.arange(pieces[0][0], pieces[0][0] + n, dtype=np.int64)
            else:
                rows = np.concatenate([np.arange(s, s + k, dtype=np.int64) for s, k in pieces])
            oid = self._intern(owner)
        except BaseException:  # e.g. MemoryError: the rows go back, nothing changed
            for s, k in pieces:
                self._add_run(s, k)
            raise
        self._free -= n
        self._owner[rows] = oid
        self._counts[oid] += n
        return torch.from_numpy(rows)

    def check_free(self, rows: RowsLike, owner: Owner) -> np.ndarray:
        """Validate a free without changing anything; returns the rows as int64 numpy."""
        owner = check_owner(owner)
        arr = self._distinct_rows(rows)
        if arr.size == 0:
            return arr
        held = self._owner[arr]
        free = arr[held == FREE]
        if free.size:
            raise NotOwnerError(f"space {self.space!r}: rows {_show(free)} are not allocated "
                            "(double free?)")
        oid = self._ids.get(owner)
        foreign = arr[held != (FREE if oid is None else oid)]
        if foreign.size:
            other = self._owners[int(self._owner[foreign[0]])]
            # another owner is not named: a daemon's owner ids are its clients' credentials
            whose = (f"request {other[1]!r} of the same client" if isinstance(other, tuple)
                     and isinstance(owner, tuple) and other[:1] == owner[:1]
                     else "another owner")
            raise NotOwnerError(f"space {self.space!r}: rows {_show(foreign)} are not owned by "
                            f"{owner}; row {int(foreign[0])} belongs to {whose}")
        return arr

    def _distinct_rows(self, rows: RowsLike) -> np.ndarray:
        """``rows`` as int64 numpy, each inside the space and listed once (else RowRangeError)."""
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
        return arr

    def free(self, rows: RowsLike, owner: Owner) -> int:
        """Return ``rows`` of ``owner`` to the free runs; all or nothing. Returns the count."""
        arr = self.check_free(rows, owner)
        self._release(arr)
        return int(arr.size)

    def _release(self, arr: np.ndarray) -> None:
        """Mutation half of ``free``: ``arr`` must have passed ``check_free``."""
        if arr.size == 0:
            return
        if self.on_release is not None:
            self.on_release(arr)
        held = self._owner[arr]
        if arr.size <= _SMALL:
            tally: dict[int, int] = {}
            for oid in held.tolist():
                tally[oid] = tally.get(oid, 0) + 1
            pairs = list(tally.items())
        else:
            ids, counts = np.unique(held, return_counts=True)
            pairs = list(zip(ids.tolist(), counts.tolist()))
        for oid, c in pairs:
            self._counts[oid] -= c
            if self._counts[oid] == 0:
                self._forget(oid)
        self._owner[arr] = FREE
        for s, k in runs_of(arr):
            self._add_run(s, k)
        self._free += int(arr.size)

    def free_client_rows(self, client_id: str, rows: RowsLike) -> int:
        """Free ``rows``, every one held by some request of ``client_id``; all or nothing."""
        arr = self.check_client_rows(client_id, rows)
        self._release(arr)
        return int(arr.size)

    def check_client_rows(self, client_id: str, rows: RowsLike) -> np.ndarray:
        """Validate ``free_client_rows`` without changing anything; the rows as int64 numpy."""
        arr = self._distinct_rows(rows)
        if arr.size == 0:
            return arr
        foreign = self.foreign_rows(client_id, arr)
        if foreign.size:
            raise NotOwnerError(f"space {self.space!r}: rows {_show(foreign)} are not held by "
                                f"client {client_id[:64]!r}")
        return arr

    def free_owner(self, client_id: str, request: str | None = None) -> int:
        """Free every row of ``client_id`` (``request=None``: all its requests). Count freed."""
        arr = self._select(client_id, request)
        self._release(arr)
        return int(arr.size)

    def foreign_rows(self, client_id: str, rows: np.ndarray) -> np.ndarray:
        """The rows of ``rows`` (int64, inside the space) that no request of ``client_id``
        holds: one pass over ``rows``, whatever the client holds elsewhere."""
        return rows[self._oid_client[self._owner[rows]] != self._client_number(client_id)]

    def holds(self, client_id: str) -> bool:
        """Whether ``client_id`` holds any row (O(1): its owner ids are counted)."""
        return client_id in self._clients

    def _client_number(self, client_id: str) -> int:
        """The client's number while it owns rows, else -2 (matches no owner id's client)."""
        c = self._clients.get(client_id)
        return c[0] if c is not None else -2

    def rows_of(self, client_id: str, request: str | None = None) -> torch.Tensor:
        """Rows held by ``client_id`` (one request, or all when ``request`` is None)."""
        return torch.from_numpy(self._select(client_id, request))

    def _select(self, client_id: str, request: str | None) -> np.ndarray:
        check_owner((client_id, request))
        if request is None:
            mine = self._oid_client[self._owner] == self._client_number(client_id)
        else:
            oid = self._ids.get((client_id, request))
            if oid is None:
                return np.empty(0, dtype=np.int64)
            mine = self._owner == oid
        return np.flatnonzero(mine).astype(np.int64)

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
                if oid + 1 >= len(self._oid_client):  # keep the last slot for FREE
                    grown = np.full(2 * len(self._oid_client), -1, dtype=np.int64)
                    grown[:oid] = self._oid_client[:oid]
                    self._oid_client = grown
            self._ids[owner] = oid
            c = self._clients.get(owner[0])
            if c is None:
                c = self._clients[owner[0]] = [self._next_client, 0]
                self._next_client += 1
            c[1] += 1
            self._oid_client[oid] = c[0]
        return oid

    def _forget(self, oid: int) -> None:
        owner = self._owners[oid]
        assert owner is not None
        del self._ids[owner]
        self._owners[oid] = None
        self._oid_client[oid] = -1
        c = self._clients[owner[0]]
        c[1] -= 1
        if c[1] == 0:
            del self._clients[owner[0]]
        self._spare.append(oid)

    # ------------------------------------------------------------------ inspection
    def owners(self) -> dict[Owner, int]:
        """Rows held per owner."""
        return {o: self._counts[i] for o, i in self._ids.items()}

    def runs(self) -> list[tuple[int, int]]:
        """The free runs ``(start, length)``, lowest first."""
        return sorted(self._by_start.items())

    def largest_run(self) -> int:
        """Length of the longest free run (0 when nothing is free)."""
        for c in range(len(self._classes) - 1, -1, -1):
            if self._top(c) is not None:
                return max(self._by_start[s] for s in self._classes[c] if self._live(c, s))
        return 0

    def stats(self) -> dict[str, Any]:
        runs = len(self._by_start)
        largest = self.largest_run()
        return {"space": self.space, "rows": self.num_rows, "used": self.used_rows,
                "free": self._free, "owners": len(self._ids), "free_runs": runs,
                "mean_free_run": self._free / runs if runs else 0.0,
                "fragmentation": 1.0 - largest / self._free if self._free else 0.0}

    def snapshot(self) -> tuple[tuple[tuple[int, int], ...], tuple[Owner | None, ...],
                                dict[Owner, int]]:
        """Comparable state: free runs (sorted), owner per row, rows per owner."""
        per_row = tuple(None if i == FREE else self._owners[i] for i in self._owner.tolist())
        return tuple(self.runs()), per_row, self.owners()

    def check_invariants(self) -> None:
        """Raise ``InvariantError`` unless free runs and owned rows partition the space exactly."""
        sp = self.space
        def pairs(d: dict[int, int]) -> np.ndarray:  # (key, value) rows, keys ascending
            k = np.fromiter(d.keys(), dtype=np.int64, count=len(d))
            v = np.fromiter(d.values(), dtype=np.int64, count=len(d))
            order = np.argsort(k)
            return np.stack([k[order], v[order]], axis=1)

        starts, lens = pairs(self._by_start).T
        ends = starts + lens
        bad = np.flatnonzero((lens <= 0) | (starts < 0) | (ends > self.num_rows))
        if bad.size:
            raise InvariantError(f"space {sp!r}: free run ({starts[bad[0]]}, {lens[bad[0]]}) "
                                 f"is out of range")
        joined = np.flatnonzero(starts[1:] <= ends[:-1])
        if joined.size:
            raise InvariantError(f"space {sp!r}: free run at {starts[joined[0] + 1]} overlaps "
                                 f"or touches the previous one (not coalesced)")
        by_end = pairs(self._by_end)
        if len(by_end) != len(starts) or not (np.array_equal(by_end[:, 0], np.sort(ends))
                                              and np.array_equal(by_end[:, 1], starts)):
            raise InvariantError(f"space {sp!r}: run end index disagrees with the runs")
        size_class = np.zeros(len(starts), dtype=np.int64)  # floor(log2(length))
        for b in range(1, int(lens.max()).bit_length() if len(lens) else 1):
            size_class[lens >= 1 << b] = b
        for c, heap in enumerate(self._classes):
            missing = set(starts[size_class == c].tolist()) - set(heap)
            if missing:
                raise InvariantError(f"space {sp!r}: run at {min(missing)} missing from its "
                                     f"size class")
        edges = np.zeros(self.num_rows + 1, dtype=np.int64)
        np.add.at(edges, starts, 1)
        np.add.at(edges, ends, -1)
        mask = np.cumsum(edges[:-1]) > 0
        if int(lens.sum()) != self._free:
            raise InvariantError(f"space {sp!r}: free count {self._free} but runs hold "
                                 f"{int(lens.sum())} rows")
        if (self._owner[mask] != FREE).any():
            raise InvariantError(f"space {sp!r}: a row is both free and owned")
        if ((self._owner == FREE) & ~mask).any():
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
        held: dict[str, int] = {}
        for o, i in self._ids.items():
            held[o[0]] = held.get(o[0], 0) + 1
            c = self._clients.get(o[0])
            if c is None or self._oid_client[i] != c[0]:
                raise InvariantError(f"space {sp!r}: owner {o} is not filed under its client")
        spare = [i for i in range(len(self._owners)) if i not in live]
        if {k: v[1] for k, v in self._clients.items()} != held or \
                (self._oid_client[spare] != -1).any() or self._oid_client[-1] != -1:
            raise InvariantError(f"space {sp!r}: client table out of step")
