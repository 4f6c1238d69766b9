"""One SGLang worker's connection to its hicache daemon: device buffers shared, rows owned.

``DaemonLink.connect(kvcache, layout, client)`` maps SGLang's DSV4 device pools onto ``layout``
(``stage_map.map_stage``), shares them with the daemon and registers the worker (refused, and
unregistered again, when the daemon already serves another worker: one worker per daemon;
``DaemonLink.share(stage, client, shm)`` is that second half, from the mapped ``StageBuffers``):

* CUDA: the tensors are exported as they are (CUDA IPC handles of SGLang's own allocations).
* CPU (tests, no GPU): the daemon maps device pools from sealed memfds the worker hands in, and
  SGLang's are ordinary heap tensors. Each owning tensor is moved, in place, into one sealed
  memfd (``core.sealed_memfd.new_sealed_fd``; ``Tensor.set_`` onto its mapping's storage: the
  bytes are copied, every Python reference to the tensor object sees the new memory; views
  taken *before* the move keep the old memory, so ``connect`` must run before the host pools
  take their views, which the assembler patch guarantees). ``close()`` closes the descriptor;
  the daemon's mapping stays valid.

Host rows: ``alloc(space, pages)`` / ``free(space, rows)`` forward to the daemon (it owns them),
and the link keeps the set it holds. Whether an ``alloc`` gets rows is decided here, from the
link's own count (``free_rows``): None, without asking the daemon, when too few are free. That
count follows SGLang's calls alone, which are the same on every TP rank, so every rank's
outcome is the same; a daemon that refuses (``no_space``) what the count says is free holds
fewer rows than the worker was given (restarted, or rows not this worker's), and that is
``OutOfStep``, an error that stops the scheduler, never a None on this rank alone (SGLang
would take it for memory pressure and put its ranks out of step). A free the daemon deferred
(an operation still used a row) is counted free here at once: a ``no_space`` while one may be
pending waits (up to the call timeout) until the daemon says none of this worker's operations
runs, and asks once more before it says ``OutOfStep``. ``free_all(space)`` gives them all back
(SGLang's ``flush_cache`` clears its host pools); ``capacity(space)`` is the daemon's host row
count.
``pool_global_layer(pool, local)`` turns a pool-local layer id into the global layer the
daemon's per-layer events are indexed by. ``layer_waits`` keeps the GPU loads whose layers
SGLang's forward waits for (``layer_waits.LayerWaits``; the assembler patch attaches the
controller's layer counter).

Liveness: SGLang calls the host pools only when it moves or allocates KV, so an idle server
would be reaped by the daemon (its host rows freed under SGLang's tree). The link's
``engine.heartbeats.Heartbeats`` thread sends a heartbeat when nothing else was sent for a third
of the daemon's timeout, waiting at most ``BEAT_S`` for its reply (it holds the lock
meanwhile). The ``Client`` is not thread-safe: every use of it goes through ``lock`` (the host
pools take it too); the rows the link holds have a lock of their own, so ``free_rows``
(SGLang's ``available_size``) never waits on the daemon. A heartbeat that fails is kept in
``beats.error`` and is a warning, once until one succeeds again (SGLang's next call meets the
same daemon). A reply that
says the daemon no longer holds the worker (``registered`` false: reaped, or a restarted
daemon) is logged as an error once (``lost``): SGLang's tree still lists host hits, its next
host-tier call fails and SGLang stops its scheduler, so the server is restarted with its daemon
(nothing re-registers behind SGLang's back). ``close()`` stops the thread, unregisters (a
failure is a warning: SGLang's shutdown goes on) and closes the client; it runs once (the host
pools' ``destroy`` calls it at SGLang's shutdown).
"""
from __future__ import annotations

import logging
import mmap
import os
import threading
import time
import weakref
from typing import Any, Mapping

from hicache.core.errors import HicacheError

import torch

from hicache.core.ipc import export_buffers
from hicache.core.layout import Layout
from hicache.core.sealed_memfd import new_sealed_mapping
from hicache.engine.client import Client, CommandRefused
from hicache.engine.heartbeats import Heartbeats
from hicache.engine.sglang.layer_waits import LayerWaits
from hicache.engine.sglang.stage_map import StageBuffers, map_stage

log = logging.getLogger("hicache.sglang")
ALIGN = 4096
UNREGISTER_S = 2.0  # the longest the shutdown's unregister waits for the daemon


class OutOfStep(HicacheError, RuntimeError):
    """The daemon refused host rows the link counts free: this rank's allocations would no
    longer match the other ranks' (see the module docstring)."""


def _close(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


def _rehome_to_memfd(owners: list[torch.Tensor]) -> tuple[int, mmap.mmap]:
    """Move every distinct tensor of ``owners`` into one fresh sealed memfd (see the module
    docstring): its descriptor and mapping."""
    distinct: dict[int, torch.Tensor] = {}
    for t in owners:
        distinct.setdefault(id(t), t)
    plan, end = [], 0
    for t in distinct.values():
        if t.device.type != "cpu" or not t.is_contiguous() or t.storage_offset() != 0:
            raise ValueError("CPU mode shares whole contiguous CPU tensors only")
        plan.append((t, end))
        end += (t.nbytes + ALIGN - 1) // ALIGN * ALIGN
    fd, mm = new_sealed_mapping("hicache-dev-sglang", max(end, ALIGN))
    whole = torch.frombuffer(mm, dtype=torch.uint8)
    for t, off in plan:
        region = whole[off: off + t.nbytes]
        region.copy_(t.detach().reshape(-1).view(torch.uint8))
        t.set_(whole.untyped_storage(), off // t.element_size(), t.size(), t.stride())
    return fd, mm


def _on_gpu(stage: StageBuffers) -> bool:
    return next(iter(stage.layers.values()))[0].device.type == "cuda"


def _alone(client: Client) -> None:
    """Unregister and refuse (``ValueError``) when the daemon serves another worker besides
    this one: SGLang sizes its host tier by ``available_size``, which counts this worker's rows
    only, and TP ranks sharing a daemon would allocate out of step."""
    n = int(client.stats().get("workers", 1))
    if n <= 1:
        return
    try:
        client.unregister(timeout=min(client.timeout, UNREGISTER_S))
    except HicacheError as e:  # the refusal below is what matters
        log.warning("hicache: unregistering a refused worker failed: %s", e)
    raise ValueError(f"the hicache daemon at {client.address} already serves {n - 1} other "
                     f"worker(s): each SGLang worker (TP rank, PP stage) needs a daemon of its "
                     f"own (HICACHE_SGLANG_SOCKET with {{gpu}} and {{pp_rank}}, or each GPU's "
                     f"default socket)")


class DaemonLink:
    """See the module docstring."""

    def __init__(self, client: Client, stage: StageBuffers, host_rows: Mapping[str, int],
                 shm: tuple[int, mmap.mmap] | None) -> None:
        self.client = client
        self.stage = stage
        self.layout: Layout = stage.layout
        self.host_rows = dict(host_rows)
        self.lock = threading.RLock()
        self.layer_waits = LayerWaits(client, self.lock)  # GPU loads the forward waits for
        self._held: dict[str, set[int]] = {s: set() for s in self.host_rows}
        self._held_lock = threading.Lock()  # ``_held`` alone (``free_rows`` takes no ``lock``)
        self._deferred = False  # a free the daemon deferred may still be pending
        self.submitting = threading.local()  # each thread's SGLang submission (host_pools)
        self._mm = shm[1] if shm else None
        self._fin = weakref.finalize(self, _close, shm[0]) if shm else None
        self.lost: str | None = None  # why the daemon no longer holds the worker (``_lost``)
        self.closed = False
        client.heartbeat()  # the daemon's timeout sets the client's heartbeat interval
        self.beats = Heartbeats(client, self.lock, self._beat_reply, who="hicache (SGLang)",
                                logger=log)

    def _beat_reply(self, h: dict[str, Any]) -> None:
        if not h.get("registered", True):
            why = h.get("reaped") or "the daemon restarted, or the worker unregistered"
            self._lost(f"the daemon no longer holds this worker ({why})")

    def _lost(self, why: str) -> None:
        """Log once that the host tier is gone (nothing re-registers the worker, so it stays
        gone): SGLang's tree still lists host hits the daemon no longer holds, and its next
        host-tier call fails (SGLang then stops its scheduler); restart the server with its
        daemon."""
        if self.lost is None:
            self.lost = why
            log.error("hicache: %s: SGLang's host tier is gone; its next host-tier call fails. "
                      "Restart the SGLang server (with its daemon running).", why)

    @classmethod
    def connect(cls, kvcache: Any, layout: Layout, client: Client, *,
                name: str = "sglang") -> "DaemonLink":
        beat = float(client.heartbeat().get("heartbeat_timeout", 10.0))
        if 2 * client.timeout > beat:  # refused before anything is mapped or registered
            raise ValueError(
                f"the adapter's call timeout ({client.timeout:g} s: HICACHE_SGLANG_TIMEOUT) is "
                f"over half the daemon's heartbeat timeout ({beat:g} s): a host wait holds the "
                f"link's lock, so no heartbeat goes out meanwhile, and the daemon could reap the "
                f"worker mid-load; start the daemon with --heartbeat-timeout "
                f"{2 * client.timeout:g} or more")
        stage = map_stage(kvcache, layout)
        shm = None
        if not _on_gpu(stage):
            shm = _rehome_to_memfd([t for ts in stage.owners.values() for t in ts])
            stage = map_stage(kvcache, layout)  # fresh views of the moved memory
        return cls.share(stage, client, shm, name=name)

    @classmethod
    def share(cls, stage: StageBuffers, client: Client, shm: tuple[int, mmap.mmap] | None, *,
              name: str = "sglang") -> "DaemonLink":
        """Share ``stage``'s device rows with the daemon and register the worker: CUDA tensors
        as CUDA IPC handles of their own allocations, CPU tensors as ranges of ``shm`` (the
        sealed memfd ``connect`` moved them into). ``connect``'s second half; the CUDA adapter
        test calls it with SGLang-shaped tensors, SGLang not being on the GPU machine."""
        layout = stage.layout
        cuda = _on_gpu(stage)
        if not cuda and shm is None:
            raise ValueError("share: CPU tensors are shared from the sealed memfd connect "
                             "moves them into; none was given")
        shared = {p: [t[: stage.rows[layout.pool(p).index]] for t in ts]
                  for p, ts in stage.layers.items()}
        if cuda:
            buffers = export_buffers(shared)
            mode = "cuda"
        else:
            assert shm is not None
            base = torch.frombuffer(shm[1], dtype=torch.uint8).data_ptr()
            buffers = {p: [{"kind": "memfd", "fd": 0, "offset": t.data_ptr() - base,
                            "rows": int(t.shape[0]), "row_bytes": int(t.shape[1])} for t in ts]
                       for p, ts in shared.items()}
            mode = "cpu"
        try:
            client._device = next(iter(shared.values()))[0].device if cuda else None
            # GPU: interprocess events the engine records on its stream: 0 before each backup
            # (the KV it wrote), 1 before each load (SGLang's load fence)
            h = client.register(layout=layout.to_dict(), device_rows=stage.rows, buffers=buffers,
                                mode=mode, name=name, events=2 if cuda else 0,
                                fds=[shm[0]] if shm else ())
            _alone(client)
        except BaseException:
            if shm:
                _close(shm[0])
            raise
        return cls(client, stage, h["host_rows"], shm)

    # ------------------------------------------------------------------ host rows
    def capacity(self, space: str) -> int:
        return self.host_rows[space]

    def free_rows(self, space: str) -> int:
        with self._held_lock:
            return self.host_rows[space] - len(self._held[space])

    def alloc(self, space: str, pages: int) -> list[int] | None:
        """``pages`` host rows of ``space`` from the daemon, or None when the link counts too
        few free (the daemon is not asked); ``OutOfStep`` when the daemon has fewer."""
        with self.lock:
            free = self.free_rows(space)
            if free < pages:
                return None
            try:
                rows = self._alloc_counted(space, pages)
            except CommandRefused as e:
                if e.code == "no_space":
                    raise OutOfStep(f"hicache daemon at {self.client.address} has fewer free "
                                    f"{space} rows than this SGLang worker was given ({pages} "
                                    f"asked, {free} free by the worker's count; {e.message}): "
                                    f"it is not this worker's alone, or it restarted; this "
                                    f"rank would go out of step with the others, so it "
                                    f"stops") from None
                raise
            with self._held_lock:
                self._held[space].update(int(r) for r in rows)
            return rows

    def _alloc_counted(self, space: str, pages: int) -> list[int]:
        """The daemon's ``alloc`` of rows the link counts free; a ``no_space`` while a free it
        deferred may still be pending is asked again once the daemon says none of this
        worker's operations runs (those frees are done then), within the call timeout."""
        try:
            return self.client.alloc({space: pages})[space]
        except CommandRefused as e:
            if e.code != "no_space" or not self._deferred:
                raise
        deadline = time.monotonic() + self.client.timeout
        while True:
            self.client.poll_acks(ops=[])  # takes no ack; says what is in flight
            if self.client.daemon_in_flight == 0:
                self._deferred = False
                break
            if time.monotonic() > deadline:
                break
            time.sleep(0.005)
        return self.client.alloc({space: pages})[space]

    def free(self, space: str, rows: list[int]) -> None:
        with self.lock:
            if self.client.free({space: rows}).get("deferred"):
                self._deferred = True  # back in the daemon once its operations end
            with self._held_lock:
                self._held[space].difference_update(int(r) for r in rows)

    def free_all(self, space: str) -> int:
        """Give back every row of ``space`` this link holds (the daemon defers the free of
        rows a copy still uses); returns how many."""
        with self.lock:
            with self._held_lock:
                rows = sorted(self._held[space])
            if rows:
                self.free(space, rows)
            return len(rows)

    def pool_global_layer(self, pool: str, local: int) -> int:
        return self.layout.stage.global_id(self.layout.pool(pool).family, local)

    def close(self) -> None:
        """Stop the heartbeats, unregister (a failure is logged, not raised: SGLang's shutdown
        goes on), close the client (once; a second call does nothing: every host pool of the
        stack closes it at SGLang's shutdown)."""
        with self.lock:
            if self.closed:
                return
            self.closed = True
        self.beats.stop()  # a heartbeat in flight ends within BEAT_S
        self.layer_waits.detach()  # (SGLang's counter waits on its own events again)
        try:
            with self.lock:
                self.client.unregister(timeout=min(self.client.timeout, UNREGISTER_S))
        except HicacheError as e:  # SGLang's own shutdown goes on whatever the daemon says
            # not_registered: reaped, or a restarted daemon, nothing to undo; a daemon stopped
            # first (or hung): it frees the rows when it reaps the worker or restarts
            if not (isinstance(e, CommandRefused) and e.code == "not_registered"):
                log.warning("hicache: unregistering at shutdown failed: %s", e)
        finally:
            self.client.close()
            if self._fin is not None:
                self._fin()
