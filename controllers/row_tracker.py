"""Host rows used by in-flight operations, and frees deferred until those operations complete.

Per index space: a reader count (loads, swap-ins read host rows) and a writer count (backups,
swap-outs write them) per row, and a ``freeing`` mark for rows whose free was deferred. A free
of a row with a non-zero count is recorded with its owner and carried out by ``ready()`` once
the last operation using it ends — never a use-after-free. Rows marked ``freeing`` are refused
by new operations (``busy``). ``hazard(op)`` says whether an operation must wait for the other
stream (a load of rows being written, a backup into rows being read). ``hold(space, rows)``
marks rows ``freeing`` for a whole-client release (``controllers.release``), which gives them
back itself and ``unhold``s them slice by slice.
Single-threaded: only the server thread calls in here.
"""
from __future__ import annotations

from typing import Any, Iterable

import numpy as np

SMALL = 16  # up to this many rows, plain Python loops beat numpy's fancy indexing


def rows_np(rows: Any) -> np.ndarray:
    """An int64 numpy array of ``rows`` (an array, a list of ints, or anything with ``.np()``)."""
    if isinstance(rows, np.ndarray):
        return rows
    return rows.np() if hasattr(rows, "np") else np.asarray(rows, dtype=np.int64)


class RowTracker:
    def __init__(self, rows: dict[str, int]) -> None:
        self.readers = {s: np.zeros(n, np.int32) for s, n in rows.items()}
        self.writers = {s: np.zeros(n, np.int32) for s, n in rows.items()}
        self.freeing = {s: np.zeros(n, np.bool_) for s, n in rows.items()}
        self.live = [0, 0]  # (space, rows) entries in flight: [reads, writes]
        self.deferred: list[tuple[dict[str, np.ndarray], Any]] = []  # (rows by space, owner)
        self.held = 0  # rows marked freeing by hold() and not yet unhold()

    # ------------------------------------------------------------------ in-flight counts
    def _add(self, host: Iterable[tuple[str, np.ndarray, bool]], delta: int) -> None:
        for space, rows, writes in host:
            self.live[bool(writes)] += delta
            rows = rows_np(rows)
            arr = (self.writers if writes else self.readers)[space]
            if rows.size <= SMALL:
                for r in rows.tolist():
                    arr[r] += delta
            else:
                np.add.at(arr, rows, delta)

    def begin(self, host: list[tuple[str, np.ndarray, bool]]) -> None:
        self._add(host, 1)

    def end(self, host: list[tuple[str, np.ndarray, bool]]) -> None:
        self._add(host, -1)

    def in_use(self, space: str, rows: Any) -> bool:
        rows = rows_np(rows)
        return bool(self.readers[space][rows].any() or self.writers[space][rows].any())

    def hazard(self, host: list[tuple[str, np.ndarray, bool]]) -> bool:
        """True when some row is used by the other stream's kind of access."""
        for space, rows, writes in host:
            if not self.live[not writes]:  # nothing of the other kind in flight
                continue
            other = (self.readers if writes else self.writers)[space]
            if other[rows_np(rows)].any():
                return True
        return False

    def busy(self, space: str, rows: Any) -> bool:
        """Rows (array or list) whose free is pending: no new operation may use them."""
        if not self.deferred and not self.held:
            return False
        fr = self.freeing[space]
        if len(rows) <= SMALL:
            return any(fr[r] for r in list(rows))
        return bool(fr[np.asarray(rows)].any())

    # ------------------------------------------------------------------ deferred frees
    def defer(self, rows: dict[str, np.ndarray], owner: Any) -> None:
        for space, r in rows.items():
            self.freeing[space][r] = True
        self.deferred.append((rows, owner))

    def undefer(self, rows: dict[str, np.ndarray], owner: Any) -> None:
        """Take back the deferred free ``defer(rows, owner)`` made (the same ``rows`` object):
        its rows are no longer marked ``freeing``. Nothing when it already went."""
        for i, (r, o) in enumerate(self.deferred):
            if r is rows and o == owner:
                del self.deferred[i]
                for space, a in rows.items():
                    self.freeing[space][a] = False
                return

    def hold(self, space: str, rows: np.ndarray) -> None:
        """Mark ``rows`` (none marked yet) freeing until ``unhold``: refused by new operations."""
        self.freeing[space][rows] = True
        self.held += int(rows.size)

    def unhold(self, space: str, rows: np.ndarray) -> None:
        self.freeing[space][rows] = False
        self.held -= int(rows.size)

    def pending_rows(self, space: str) -> int:
        return int(self.freeing[space].sum())

    def ready(self) -> list[tuple[dict[str, np.ndarray], Any]]:
        """Deferred frees whose rows are no longer used; unmarked and removed from the list."""
        if not self.deferred:
            return []
        out, keep = [], []
        for rows, owner in self.deferred:
            if any(self.in_use(s, r) for s, r in rows.items()):
                keep.append((rows, owner))
            else:
                for s, r in rows.items():
                    self.freeing[s][r] = False
                out.append((rows, owner))
        self.deferred = keep
        return out
