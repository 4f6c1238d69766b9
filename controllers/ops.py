"""The daemon's model of work: validated id lists, copy items and operations.

* ``Ids`` — one validated index frame (int64 ids) with cached list / numpy / torch forms,
  and whether they are one run of consecutive ids.
* ``Item`` — copy ``src_ids`` of every layer of one pool's ``src`` buffers to ``dst_ids`` of
  ``dst`` (rows, or tokens of a ``TokenFormat``); ``layers`` names each buffer layer's global id.
* ``ClearTarget`` / ``ClearSpec`` — request-slot state to zero, or the MTP draft rule.
* ``Operation`` — one accepted command's work: items, the host rows it reads or writes (for
  the row tracker), events, timing, outcome; ``ack()`` is what its client is told.

Handlers build these; the scheduler runs them; nothing here copies bytes.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Sequence

import numpy as np
import torch

from hicache.core.id_sets import is_run
from hicache.kernels.tables import LayerTable, TokenFormat


class Ids:
    """One validated index frame: int64 ids with cached list / numpy / torch forms."""

    __slots__ = ("mv", "n", "_list", "_np", "_t", "_run")

    def __init__(self, mv: Any) -> None:
        self.mv = mv
        self.n = len(mv)
        self._list: list[int] | None = None
        self._np: np.ndarray | None = None
        self._t: torch.Tensor | None = None
        self._run: bool | None = None

    @classmethod
    def of(cls, values: Sequence[int] | np.ndarray) -> "Ids":
        a = np.ascontiguousarray(values, dtype=np.int64)
        ids = cls(memoryview(a).cast("B").cast("q"))
        ids._np = a
        return ids

    def list(self) -> list[int]:
        if self._list is None:
            self._list = self.mv.tolist()
        return self._list

    def np(self) -> np.ndarray:
        if self._np is None:
            self._np = np.frombuffer(self.mv, dtype=np.int64)
        return self._np

    def run(self) -> bool:
        """The ids are ``first, first + 1, ..., last`` (``id_sets.is_run``): ``mv[0]`` and
        ``mv[-1]`` are then their bounds, none repeats, and their pages are one range."""
        if self._run is None:
            self._run = is_run(self.np())
        return self._run

    def torch(self) -> torch.Tensor:
        if self._t is None:
            self._t = torch.from_numpy(np.array(self.np(), dtype=np.int64))  # writable copy
        return self._t


@dataclass(eq=False)
class Item:
    """Copy ``src_ids`` of every layer of ``src`` to ``dst_ids`` of ``dst`` (one pool)."""

    pool: str
    src: LayerTable
    dst: LayerTable
    src_ids: Ids
    dst_ids: Ids
    fmt: TokenFormat | None  # token-granular when set
    layers: tuple[int, ...]  # global layer id of each buffer layer
    nbytes: int

    @property
    def n(self) -> int:
        return self.src_ids.n


@dataclass(eq=False)
class ClearTarget:
    """One req_slot pool to clear: its device layers, ring entries per row, fp32 state?"""

    pool: str
    table: LayerTable
    ring: int
    fp32: bool


@dataclass(eq=False)
class ClearSpec:
    targets: list[ClearTarget]
    slots: list[int]
    draft: list[tuple[int, list[int]]] | None = None  # (slot, positions to void, mod ring)


@dataclass(eq=False)
class Operation:
    op_id: int
    client: str
    kind: str  # backup | load | swap_out | swap_in | clear_slot
    items: list[Item] = field(default_factory=list)
    host: list[tuple[str, np.ndarray, bool]] = field(default_factory=list)  # (space, rows, writes)
    clear: ClearSpec | None = None
    wait_event: Any = None  # GPU: engine's interprocess event the copy waits for
    layer_events: list[Any] | None = None  # GPU load: one interprocess event per stage layer
    stage_layers: tuple[int, ...] = ()
    after: list["Operation"] = field(default_factory=list)  # GPU: other-stream ops to wait for
    # an op that reads host rows (load, swap_in, sparse_backup): the writes in flight into them
    # when it was accepted (it runs after them); one that left a row it read torn fails it
    # (``host_access.torn_by``, ``DaemonState._finish``)
    behind: list["Operation"] = field(default_factory=list)
    nbytes: int = 0
    t_submit: float = 0.0
    t_start: float = 0.0
    t_end: float = 0.0
    busy_share: float = 1.0  # of its run's time, what it adds to busy seconds (merged runs)
    ok: bool = True
    error: str | None = None
    # the ack's error code: ``abandoned`` when a stop acked it with its copy maybe still running
    error_code: str = "transfer_failed"
    cancelled: bool = False  # failed because its client was reaped (not counted as an error)
    path: str = ""
    done_event: Any = None
    rest: Any = None  # GPU load: the launch groups left to issue after the reply (a generator)
    issued: int = 0  # GPU load: stage layers whose events are recorded
    issue_s: float = 0.0  # GPU load: the issuer thread's time on its layers after the reply
    issue_cpu_s: float = 0.0  # ... of which its CPU time (the rest: waiting for a core or the GIL)
    inline: bool = False
    # a swap_in's ``release``: the deferred free of its host row ({space: rows}, owner), undone
    # when the copy fails (``DaemonState.keep_on_failure``)
    release: tuple[dict[str, np.ndarray], Any] | None = None
    _per_pool: dict[str, tuple[int, int]] | None = None

    @property
    def stream(self) -> str:
        return "backup" if self.kind in ("backup", "swap_out") else "load"

    def per_pool(self) -> dict[str, tuple[int, int]]:
        """{pool: (rows or tokens, bytes)} (computed once)."""
        out = self._per_pool
        if out is None:
            out = {}
            for it in self.items:
                r, b = out.get(it.pool, (0, 0))
                out[it.pool] = (r + it.n, b + it.nbytes)
            self._per_pool = out
        return out

    def ack(self) -> dict[str, Any]:
        """The ack of a completed operation (docs/protocol.md, "acks"); times in integer ns."""
        ex = int((self.t_end - self.t_start) * 1e9)
        out: dict[str, Any] = {
            "op": self.op_id, "kind": self.kind, "status": "ok" if self.ok else "error",
            "bytes": self.nbytes, "ns": int((self.t_end - self.t_submit) * 1e9), "exec_ns": ex,
            "path": self.path, "pools": {p: [r, b, ex] for p, (r, b) in self.per_pool().items()},
        }
        if not self.ok:
            out["error"] = {"code": self.error_code, "message": self.error or "unknown error"}
        return out
