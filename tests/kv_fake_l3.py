"""Test support: a real CPU-mode ``DaemonState`` (``Daemon(ServeConfig)``, in process), engine
pools as ``EnginePool`` objects over tensors of this process (marked verified), and a stand-in
for the L3 tier whose jobs the test runs by hand, one at a time, in the order it chooses: for
races between the key store and its L3 jobs that a real Mooncake master cannot be made to show
on demand. The stand-in keeps objects in a set and their bytes in a dict, and answers the calls
``kv_l3`` / ``kv_epochs`` make (``submit``, ``extend_queued``, ``cancel``, the meta calls'
``get_small`` / ``put_small``). Real-Mooncake tests: ``test_kv_l3.py``, ``test_kv_epochs.py``.

Fixture ``dstate`` (the state), and ``with_l3(st)``, ``client(st)``, ``engine_pool(...)``,
``call(st, c, cmd, header, arrays)`` (a key-store handler as the server runs it), ``pump(st)``
(the server loop's completion step), ``ids(list)``.
"""
from __future__ import annotations

import collections
import re
import time
from typing import Any

import numpy as np
import pytest
import torch

from hicache.controllers import kv_store as K
from hicache.controllers.kv_regions import ClientPools, EnginePool
from hicache.controllers.l3_store import L3CallFailed, L3Settings

ROWS = {"page": 12, "swa_page": 6, "req_slot": 4}


def make_daemon(tmp_path: Any, **kw: Any) -> Any:
    from hicache.controllers import daemon as daemon_mod
    from hicache.core.config import ServeConfig
    return daemon_mod.Daemon(ServeConfig(preset="dsv4-tiny", device_rows=dict(ROWS),
                                         host_ratio=2.0, socket=f"ipc://{tmp_path}/d.sock",
                                         numa_node="off", **kw))


class FakeL3:
    """Jobs queue in ``queued``; ``run(job)`` executes one (meta: its call against ``small``;
    query/prefetch/put: per ``objects``) and appends it to ``completed``."""

    def __init__(self, recheck: float = 2.0) -> None:
        self.objects = type("O", (), {"ns": {"full": "hc2/m/fp/full/pp0of1"}})()
        self.settings = L3Settings("127.0.0.1:1", "P2PHANDSHAKE", kv_epoch_recheck=recheck)
        self.online = True
        self.state = "online"
        self.queued: list = []
        self.completed = collections.deque()
        self.small: dict[str, bytes] = {}
        self.store: set[str] = set()
        self.data: dict[str, list] = {}
        self.stalled_queues: dict[str, str] = {}  # what ``stalled()`` says (the test sets it)

    def submit(self, job: Any) -> None:
        job.t_submit = time.monotonic()
        self.queued.append(job)

    def extend_queued(self, job: Any, key: str) -> bool:
        if job.started:
            return False
        job.keys.append(key)
        return True

    def cancel(self, job: Any, why: str) -> bool:
        job.cancelled = job.cancelled or why
        return not job.started

    def stalled(self) -> dict[str, str]:
        return dict(self.stalled_queues)

    def drop(self, job: Any, why: str) -> None:
        """``job`` taken out of the queue and ended unrun, as the real tier's ``_stall``
        does (its own cancel reason first)."""
        self.queued.remove(job)
        job.started = True
        why = job.cancelled or why
        job.misses[why] = len(job.keys)
        job.present = [0] * len(job.keys) if job.each else []
        job.t_end = time.monotonic()
        self.completed.append(job)

    # meta helpers
    def get_small(self, key: str) -> bytes | None:
        return self.small.get(key)

    def put_small(self, key: str, value: bytes, replace: bool) -> None:
        if replace or key not in self.small:
            self.small[key] = value

    def run(self, job: Any) -> None:
        self.queued.remove(job)
        job.started = True
        if job.cancelled:
            job.misses[job.cancelled] = len(job.keys)
            job.present = [0] * len(job.keys) if job.each else []
        elif job.kind == "meta":
            try:
                job.value = job.call(self)
            except L3CallFailed as e:
                job.misses[e.why] = 1
                job.error = e.message
        elif job.kind == "put":
            for k, rows in zip(job.keys, job.rows):
                if k in self.store:
                    job.skipped += 1
                    continue
                self.store.add(k)
                self.data[k] = self._read(job.fmt, rows)
                job.written += 1
        elif job.kind == "query":
            job.present = [int(k in self.store) for k in job.keys]
            job.hits = sum(job.present)
        elif job.kind == "prefetch":
            job.present = []
            for k, rows in zip(job.keys, job.rows):
                ok = k in self.store
                if ok:
                    self._write(job.fmt, rows, self.data[k])
                job.present.append(int(ok))
            job.hits = sum(job.present)
        elif job.kind == "remove":  # regexes, as Mooncake's remove_by_regex takes them
            for rx in job.keys:
                gone = [k for k in self.store if re.match(rx, k)]
                self.store.difference_update(gone)
                job.written += len(gone)
        job.t_end = time.monotonic()
        self.completed.append(job)

    group: Any = None

    def _read(self, fmt: Any, rows: dict[str, int]) -> list[Any]:
        out = []
        for seg in getattr(fmt, "segments", ()):
            out += [t[rows[seg.space]].clone() for t in self.group.pools[seg.pool].layers]
        return out

    def _write(self, fmt: Any, rows: dict[str, int], data: list[Any]) -> None:
        i = 0
        for seg in getattr(fmt, "segments", ()):
            for t in self.group.pools[seg.pool].layers:
                t[rows[seg.space]] = data[i]
                i += 1

    def run_all(self, kind: str | None = None) -> int:
        n = 0
        while True:
            todo = [j for j in self.queued if kind is None or j.kind == kind]
            if not todo:
                return n
            self.run(todo[0])
            n += 1

    def take_completed(self) -> list[Any]:
        out = list(self.completed)
        self.completed.clear()
        return out

    def summary(self) -> dict[str, Any]:
        return {}


def client(st: Any, ident: bytes = b"eng", key: str | None = None) -> Any:
    return st.registry.touch(ident, time.monotonic(), key)


def engine_pool(st: Any, c: Any, name: str, pool: str, ns: str = "ns", pages: int = 8,
                seed: int = 0) -> EnginePool:
    """A verified byte pool (tensors of this process) attached for client ``c``."""
    spec = st.layout.pool(pool)
    ep = EnginePool(name, K._ns(st, c, ns), pool, spec.index, pages)
    g = torch.Generator().manual_seed(seed)
    ep.layers = [torch.randint(0, 256, (pages, spec.page_bytes), dtype=torch.uint8, generator=g)
                 for _ in range(spec.num_layers)]
    ep.verified = True
    if c.kv is None:
        c.kv = ClientPools()
    c.kv.pools[name] = ep
    return ep


def ids(a: Any) -> list[np.ndarray]:
    return [np.asarray(a, dtype=np.int64)]


def call(st: Any, c: Any, cmd: str, h: dict[str, Any], arrays: Any = ()) -> Any:
    return getattr(K, cmd)(st, c, h, list(arrays))


@pytest.fixture
def dstate(tmp_path: Any) -> Any:
    d = make_daemon(tmp_path)
    try:
        yield d.state
    finally:
        d.state.l3_ops.clear()
        d.state.l3 = None
        d.close()


def with_l3(st: Any, recheck: float = 2.0) -> FakeL3:
    st.l3 = FakeL3(recheck)
    st.l3.group = st.group
    return st.l3


def pump(st: Any) -> None:
    """The server loop's completion step."""
    st.collect()


