"""The daemon's state and the life of an operation: submit -> (engine) -> complete -> ack.

``DaemonState`` holds the layout, the host pool group, the transfer engine, the client registry,
the row tracker and the metrics; handlers validate a command against it and then call
``start(client, op)``. ``start`` either runs a small CPU-mode op inline (its ack goes into the
reply; its metrics are recorded by ``after_reply`` once the reply is sent) or marks the op's
host rows in flight and submits it. ``finish(op)`` (server thread, for every completed
asynchronous op) unmarks the rows, carries out frees that were waiting for them, records
metrics and returns the ack, which ``deliver_completed`` pushes. Freeing and reaping go through here so that rows in flight are
never released early (``free_rows``, ``release_client``).
Single-threaded: only the server thread calls in here.
"""
from __future__ import annotations

import itertools
import logging
import time
from typing import Any, Callable

import numpy as np
import torch

from hicache.host_pools.errors import PoolError
from hicache.host_pools.group import HostPoolGroup
from hicache.kernels.tables import LayerTable
from hicache.core.layout import Layout
from hicache.controllers.metrics import Metrics

from .registry import ClientState, Registry
from .row_tracker import RowTracker
from .sparse import refresh_gauges as refresh_sparse_gauges
from .transfer_engine import Op, TransferEngine

log = logging.getLogger("hicache.daemon")


class DaemonState:
    def __init__(self, layout: Layout, group: HostPoolGroup, engine: TransferEngine,
                 registry: Registry, metrics: Metrics, device: torch.device, *,
                 heartbeat_timeout: float, load_event_sets: int,
                 shm_dirs: tuple[str, ...]) -> None:
        self.layout = layout
        self.group = group
        self.engine = engine
        self.registry = registry
        self.metrics = metrics
        self.device = device
        self.heartbeat_timeout = heartbeat_timeout
        self.load_event_sets = load_event_sets
        self.shm_dirs = shm_dirs
        self.host_rows = dict(group.rows)
        self.tracker = RowTracker(self.host_rows)
        self.host_tables = {name: LayerTable(p.layers, f"host:{name}")
                            for name, p in group.pools.items()}
        self.stage_layers = layout.stage.layers("swa")  # every layer of the stage, in order
        self._op_ids = itertools.count(1)
        self.ops: dict[int, tuple[Op, ClientState]] = {}
        self.stopping = False
        self.sparse: Any = None  # controllers.sparse.SparseRegion when --sparse-rows is set
        self.post: list[Op] = []  # inline ops whose accounting waits until the reply is sent
        # the server sets this: push one ack to its client (or drop it if the client is gone)
        self.deliver: Callable[[ClientState, dict[str, Any]], None] = lambda c, ack: None

    def next_op_id(self) -> int:
        return next(self._op_ids)

    # ------------------------------------------------------------------ operations
    def start(self, c: ClientState, op: Op) -> dict[str, Any] | None:
        """Run or submit ``op``. Returns its ack when it ran inline (CPU mode, small, engine
        idle: nothing else can touch its rows meanwhile, so no in-flight bookkeeping; metrics
        are recorded after the reply went out), else None (the ack is pushed later)."""
        if self.engine.run_inline(op):
            self.post.append(op)
            return self._ack(op)
        if self.engine.cuda and self.tracker.hazard(op.host):
            other = self.engine.last_op("load" if op.stream == "backup" else "backup")
            if other is not None:
                op.after.append(other)
        self.tracker.begin(op.host)
        c.in_flight += 1
        self.ops[op.op_id] = (op, c)
        self.metrics.in_flight(op.kind, 1)
        self.engine.submit(op)
        return None

    def after_reply(self) -> None:
        """Work deferred until the reply is sent: metrics and frees of inline ops."""
        post, self.post = self.post, []
        for op in post:
            self._account(op)
            if self.tracker.deferred:
                self.release_ready()

    def finish(self, op: Op) -> dict[str, Any]:
        """Bookkeeping of one completed asynchronous op; returns its ack."""
        _, c = self.ops.pop(op.op_id)
        self.engine.forget(op)
        self.tracker.end(op.host)
        c.in_flight -= 1
        self.metrics.in_flight(op.kind, -1)
        if self.tracker.deferred:
            self.release_ready()
        if c.closing and c.in_flight == 0:
            self._free_all(c)
        self._account(op)
        return self._ack(op)

    def _account(self, op: Op) -> None:
        self.metrics.transfer(op.kind, op.ok, op.t_end - op.t_submit, op.t_end - op.t_start,
                              op.per_pool(), op.path or "none")

    @staticmethod
    def _ack(op: Op) -> dict[str, Any]:
        """The ack of a completed op (see docs/protocol.md, "acks"); times in integer ns."""
        ex = int((op.t_end - op.t_start) * 1e9)
        ack: dict[str, Any] = {
            "op": op.op_id, "kind": op.kind, "status": "ok" if op.ok else "error",
            "bytes": op.nbytes, "ns": int((op.t_end - op.t_submit) * 1e9), "exec_ns": ex,
            "path": op.path, "pools": {p: [r, b, ex] for p, (r, b) in op.per_pool().items()},
        }
        if not op.ok:
            ack["error"] = {"code": "transfer_failed", "message": op.error or "unknown error"}
        return ack

    def deliver_completed(self) -> int:
        """Finish every op the engine completed since the last call and deliver its ack."""
        n = 0
        for op in self.engine.take_completed():
            c = self.ops[op.op_id][1]
            self.deliver(c, self.finish(op))
            n += 1
        return n

    # ------------------------------------------------------------------ freeing
    def release_ready(self) -> None:
        for rows, owner in self.tracker.ready():
            try:
                self.group.free(rows, owner)
            except PoolError as e:  # rows already went with a reaped owner: log, keep going
                log.warning("deferred free for %s: %s", owner, e)

    def free_rows(self, rows: dict[str, np.ndarray], owner: tuple[str, str | None]) -> bool:
        """Free now, or defer when an op still uses a row. True when deferred. Rows must have
        passed ``check_free``."""
        if any(self.tracker.in_use(s, r) for s, r in rows.items()):
            self.tracker.defer(rows, owner)
            return True
        self.group.free(rows, owner)
        return False

    def _free_all(self, c: ClientState) -> int:
        c.closing = False
        n = self.group.free_owner(c.cid)
        return n + (self.sparse.free_client(c.cid) if self.sparse is not None else 0)

    def drain_client(self, c: ClientState, timeout: float) -> bool:
        """Wait (delivering acks) until ``c`` has no op in flight; False on timeout."""
        deadline = time.monotonic() + timeout
        while c.in_flight and time.monotonic() < deadline:
            if not self.deliver_completed():
                time.sleep(0.0005)
        return c.in_flight == 0

    def release_client(self, c: ClientState, timeout: float = 30.0) -> tuple[int, bool]:
        """Free every row of ``c`` once its in-flight ops ended. Returns (rows freed, deferred):
        deferred when they did not end within ``timeout`` (then rows go when they do)."""
        if self.drain_client(c, timeout):
            return self._free_all(c), False
        c.closing = True  # rows stay allocated (so never reused) until its ops complete
        log.error("client %s: %d operations still running after %.0f s; its rows are freed "
                  "when they end", c.cid, c.in_flight, timeout)
        return 0, True

    def reap(self, c: ClientState, why: str) -> None:
        n, deferred = self.release_client(c)
        self.registry.remove(c)
        log.warning("client %s %s: %d host rows freed%s, device mappings closed", c.cid, why,
                    n, " (more when its in-flight ops end)" if deferred else "")

    # ------------------------------------------------------------------ gauges
    def refresh_gauges(self) -> None:
        m = self.metrics
        for s, a in self.group.allocators.items():
            pend = self.tracker.pending_rows(s)
            m.set("host_rows", a.used_rows - pend, s, "used")
            m.set("host_rows", a.free_rows, s, "free")
            m.set("host_rows", pend, s, "pending_free")
        m.set("clients_connected", len(self.registry.clients))
        m.set("workers_registered", self.registry.workers())
        if self.sparse is not None:
            refresh_sparse_gauges(self)

    def wait_idle(self, timeout: float) -> bool:
        deadline = time.monotonic() + timeout
        while not self.engine.idle() and time.monotonic() < deadline:
            if not self.deliver_completed():
                time.sleep(0.001)
        return self.engine.idle()
