"""HiSparse host memory, one region per client: no engine can map another engine's sparse rows.

Contract:
* ``SparseRegions(layout, rows, shm_dir, registrar, min_prompt, max_regions)``: every client
  that uses sparse mode gets its own ``ClientRegion``, a sealed memfd
  (``hicache.core.sparse_shm``: no engine can truncate it under the daemon's mapping) of
  ``rows`` C4 page rows per C4 layer of the stage, pinned with ``registrar`` on a GPU, with its
  own ``LayerTable`` and ``RowAllocator`` (rows owned by ``(client, request)``). An honest
  engine maps only its own region (``hand_out``: each ``sparse_region`` reply offers its memfd
  once on the daemon's descriptor socket, to be taken with a token only that reply holds), so
  the bytes of one client's requests are never in memory another client is handed. ``shm_dir`` is only swept
  once, at start, of the region files earlier versions' killed daemons left there.
* One region is made at start (``spare``: the memory is checked then, and the first client
  takes it with no wait); ``bind(cid)`` gives a client its region, taking the spare, at most
  ``max_regions`` at once (``no_space`` beyond, naming ``--sparse-clients``). Whenever no spare
  is left and another client could still bind one (after a bind, a detach or a drop), the next
  spare is made on a thread of its own (``hicache-sparse-region``): reserving the memory and, on
  a GPU, its ``cudaHostRegister`` take milliseconds per GiB that the server loop would
  otherwise spend. A bind that comes first waits for that thread, or (it failed) makes the
  region itself. Regions detached and not yet closed count against ``max_regions`` too (a
  bind then is refused ``busy``): at most ``max_regions`` regions exist, spare aside.
* ``detach(cid)``: an ``unregister`` or a reap takes the client's region away at once (a later
  bind, even by the same client, gets a new region) and ``close_region`` closes it once the
  copies into it ended: unpinned, memfd closed (the memory goes when the engine's mapping goes
  too). ``drop(cid)`` closes a bound region that holds no row (a client forgotten). A region
  is never handed to another client.
* ``requests``: sparse requests by (client id, name): each client names its own, and
  another client's names are unknown to it (neither seen nor taken). ``used_rows`` / ``free_rows`` / ``allocators()`` cover the bound regions (gauges and
  the invariant check). ``close()`` drops every region (daemon stop).
"""
from __future__ import annotations

import logging
import threading
from dataclasses import dataclass, field
from typing import Any

from hicache.core.fd_handout import FdHandout
from hicache.core.layout import Layout
from hicache.core.protocol import ProtocolError
from hicache.core.sizes import sparse_region_bytes
from hicache.core.sparse_shm import SparseShm, sweep_old_regions
from hicache.host_pools.memory import check_memory_for
from hicache.host_pools.allocator import RowAllocator
from hicache.kernels.tables import LayerTable, TokenFormat

log = logging.getLogger("hicache.daemon")


@dataclass
class SparseRequest:
    cid: str
    c4_tokens: int
    rows: list[int] = field(default_factory=list)
    ops: list[int] = field(default_factory=list)  # sparse_backup operations possibly in flight


@dataclass
class ClientRegion:
    """One client's sparse host memory: its memfd, its kernel table, its rows."""

    shm: SparseShm
    table: LayerTable
    alloc: RowAllocator


class SparseRegions:
    """The sparse host regions of one daemon (see the module docstring)."""

    def __init__(self, layout: Layout, rows: int, shm_dir: str, registrar: Any,
                 min_prompt: int, max_regions: int = 1) -> None:
        spec = layout.pool("c4_kv")
        self.layout, self.spec, self.fmt = layout, spec, TokenFormat.from_spec(spec)
        self.P = spec.tokens_per_page
        self.rows, self.shm_dir, self.registrar = rows, shm_dir, registrar
        self.min_prompt, self.max_regions = min_prompt, max_regions
        self.regions: dict[str, ClientRegion] = {}
        self.closing: list[ClientRegion] = []  # detached, open until their copies ended
        self.requests: dict[tuple[str, str], SparseRequest] = {}
        sweep_old_regions(shm_dir)
        self.spare: ClientRegion | None = self._make()
        # the next spare being made off the loop: its thread and what it made (or raised)
        self._making: tuple[threading.Thread, list[Any]] | None = None

    def _make(self) -> ClientRegion:
        # the container's limit and the reserve, as at the start (MemAvailable alone let a
        # region past a memory cgroup's limit: the daemon was OOM-killed mid-service)
        check_memory_for(self.region_bytes, pinned=self.registrar is not None)
        shm = SparseShm.create(self.spec.num_layers, self.rows, self.spec.page_bytes)
        if self.registrar is not None:
            try:
                self.registrar.register(shm.base_ptr, shm.nbytes)
            except BaseException:
                shm.close()
                raise
        return ClientRegion(shm, LayerTable(shm.layers, "sparse host"),
                            RowAllocator(self.rows, "sparse"))

    def of(self, cid: str) -> ClientRegion | None:
        return self.regions.get(cid)

    def bind(self, cid: str) -> ClientRegion:
        """The client's region: its own, else the spare, else a new one (``no_space`` when
        ``max_regions`` clients hold one; ``no_space`` too when the memory cannot be
        reserved)."""
        reg = self.regions.get(cid)
        if reg is not None:
            return reg
        if len(self.regions) >= self.max_regions:
            raise ProtocolError("no_space", f"all {self.max_regions} sparse regions are held by "
                                            f"other clients (--sparse-clients "
                                            f"{self.max_regions})")
        if len(self.regions) + len(self.closing) >= self.max_regions:
            raise ProtocolError("busy", f"{len(self.closing)} sparse region(s) of gone clients "
                                        f"still close (copies into them run; --sparse-clients "
                                        f"{self.max_regions}); retry in a moment")
        self._collect(wait=True)
        reg, self.spare = self.spare, None
        if reg is None:
            try:
                reg = self._make()
            except Exception as e:  # noqa: BLE001 - no memory, pinning refused: one line
                raise ProtocolError("no_space", f"cannot make a sparse region of "
                                                f"{self.region_bytes} B: "
                                                f"{getattr(e, 'strerror', None) or e}") from None
        self.regions[cid] = reg
        self._refill()
        return reg

    def _refill(self) -> None:
        """Start making the next spare off the loop when none is left (or being made) and
        another client could still bind one."""
        self._collect(wait=False)
        if self.spare is not None or self._making is not None or \
                len(self.regions) + len(self.closing) >= self.max_regions:
            return
        box: list[Any] = []

        def make() -> None:
            try:
                box.append(self._make())
            except Exception as e:  # noqa: BLE001 - the bind that needs it makes its own
                box.append(e)

        t = threading.Thread(target=make, name="hicache-sparse-region", daemon=True)
        self._making = (t, box)
        t.start()

    def _collect(self, wait: bool) -> None:
        """Take the spare the thread made (``wait``: wait for it); one it failed to make is
        logged, and the next bind makes its own (and says why it could not)."""
        if self._making is None:
            return
        t, box = self._making
        if not wait and t.is_alive():
            return
        t.join()
        self._making = None
        got = box[0] if box else None
        if isinstance(got, ClientRegion):
            self.spare = got
        else:
            log.warning("sparse region: making the next one in the background failed: %s", got)

    @property
    def making(self) -> bool:
        """A spare is being made off the loop."""
        return self._making is not None and self._making[0].is_alive()

    @property
    def region_bytes(self) -> int:
        return sparse_region_bytes(self.layout, self.rows)

    def hand_out(self, cid: str, handout: FdHandout) -> dict[str, Any]:
        """The bound region of ``cid`` as the engine maps it, its memfd offered once on
        ``handout``."""
        return dict(self.regions[cid].shm.hand_out(handout), tokens_per_page=self.P,
                    min_sparse_prompt_len=self.min_prompt, c4_layers=list(self.spec.layers))

    def rows_held(self, cid: str) -> int:
        reg = self.regions.get(cid)
        return 0 if reg is None else reg.alloc.used_rows

    def detach(self, cid: str) -> ClientRegion | None:
        """Unbind the client's region (it stays open for ``close_region``)."""
        reg = self.regions.pop(cid, None)
        if reg is not None:
            self.closing.append(reg)  # (no refill: it still counts until it is closed)
        return reg

    def drop(self, cid: str) -> bool:
        """Close the client's region if it holds no row; True when it went (or had none)."""
        reg = self.regions.get(cid)
        if reg is None:
            return True
        if reg.alloc.used_rows:
            return False
        del self.regions[cid]
        self.close_region(reg)
        self._refill()
        return True

    def close_region(self, reg: ClientRegion) -> None:
        """Unpin and close ``reg`` (the copies into it ended); a place for the next spare."""
        if self.registrar is not None:
            self.registrar.unregister(reg.shm.base_ptr)
        reg.shm.close()
        if any(r is reg for r in self.closing):
            self.closing = [r for r in self.closing if r is not reg]
            self._refill()

    @property
    def used_rows(self) -> int:
        return sum(r.alloc.used_rows for r in self.regions.values())

    @property
    def free_rows(self) -> int:
        return sum(r.alloc.free_rows for r in self.regions.values())

    def allocators(self) -> list[RowAllocator]:
        return [r.alloc for r in self.regions.values()]

    def close_memfds(self) -> None:
        """A stop that gave up waiting for copies: every region's memfd is closed (the
        offer not taken goes; the mapping's own descriptor stays until it is
        unmapped), its mapping (and pinning) left alone until the process exits (a copy may
        still touch it)."""
        self._collect(wait=True)
        for reg in [*self.regions.values(), *self.closing, *([self.spare] if self.spare else [])]:
            reg.shm.close()  # the mapping lives on in the region's table

    def close(self) -> None:
        self._collect(wait=True)  # a spare still being made is closed too
        self.max_regions = 0  # no refill while closing
        for reg in [*self.regions.values(), *self.closing, *([self.spare] if self.spare else [])]:
            self.close_region(reg)
        self.regions, self.closing, self.spare = {}, [], None
