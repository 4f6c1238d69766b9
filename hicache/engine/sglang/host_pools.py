"""SGLang 0.5.23 DSV4 host pools whose bytes and rows live in the hicache daemon.

``bind_host_pools(link)`` returns three classes, bound to one ``DaemonLink``, that stand in for
SGLang's ``LogicalHostPool`` (the KV anchor), ``DeepSeekV4PagedHostPool`` (SWA, C4, C4 indexer,
C128) and ``DeepSeekV4StateHostPool`` (C4 and C4-indexer compress states) when the assembler
builds the DSV4 HiCache stack. They allocate no host memory. What SGLang's controller calls:

* ``alloc(n)`` / ``free(idx)`` / ``available_size()`` on the anchor (``page`` space) and on the
  SWA pool (``swa_page`` space): forwarded to the daemon, which owns the rows. A host index is
  SGLang's token index ``row * 256 + t``; the rows are whole pages. C4/C128/indexer pools and the
  state pools reuse the anchor's / SWA pool's indices, as in SGLang.
* One command per submission: SGLang's ``L2TransferEngine.submit_device_to_host`` and
  ``submit_host_to_device`` call every pool of a submission in turn; the assembler patch wraps
  them in ``submission(link, kind, transfers)``, and the pools' calls then reach the daemon as
  one ``backup`` or one ``load`` of every pool (the daemon copies layer by layer across the
  pools, layer 0 of every pool first, instead of one whole pool after another: on an H100 an
  8-page DSV4-Flash load took 2.75 ms as one command and 10.7 ms as six). Transfers that
  cannot go together (a pool not this link's, one pool twice, an MTP draft, ids SGLang
  translates first; SGLang's KV anchor moves no bytes and is left out) go one command per
  pool, as below.
* ``backup_from_device_all_layer``: one daemon ``backup`` of this pool (every layer), or of
  every pool of the submission at its first call (the later calls return at once), waited for
  before returning, since SGLang records its completion event right after the call returns.
* ``load_to_device_per_layer``: the pool's first layer (the submission's first call) submits
  one daemon ``load`` for every layer; on a GPU it first records the link's load event on the
  current stream (SGLang's H2D stream, which waits on its load fence: pages freed under overlap
  scheduling may still be written by the previous forward) and the daemon's copy waits for it.
  With ``forward_waits`` (the link's ``layer_waits`` attached), a GPU load that
  ``start_loading`` submits (the submission's ``defer``) is kept under SGLang's producer index
  and the calls do not wait for copies: SGLang's forward waits for each layer where it reads
  it (the counter's ``wait_until``: the host polls that layer's event; at the stage's last
  layer the load's ack is waited for and checked), so the forward's first layers overlap the
  load's later ones. The last call puts a wait for the load's last layer on the current
  stream (once the daemon has issued it), so SGLang's completion event follows the copies.
  Any other load (nothing attached, one command per pool, CPU) waits in its calls: each layer
  for its own part (GPU: ``Client.wait_layer`` polls the daemon's interprocess event for that
  layer from this thread, so the call returns once the layer is copied; CPU: the op's ack,
  taken at the first call), and at the last layer (of the submission's last pool) a GPU
  load's ack is waited for and checked: a load that failed raises ``TransferFailed`` there and
  is never counted as loaded.
* Every use of the daemon's ``Client`` holds the link's lock (its heartbeat thread shares it).
* ``clear()`` (SGLang's ``flush_cache``) on the anchor and the SWA pool gives back every row
  of its space the link holds.
* The ``_physical`` wrappers and ``prepare_transfer_indices`` are SGLang's own (they call the
  methods above with the indices unchanged).

Refused, one line each: token-granular (not page-aligned) transfers (and SGLang's own
``backup_tokens_from_device_all_layer``), MTP draft loads, and the calls that read host bytes
in SGLang's process (storage backends' page access, PD direct-to-host).
"""
from __future__ import annotations

import contextlib
import threading
from typing import Any, Iterator

import numpy as np
import torch

from hicache.core.errors import HicacheError
from hicache.engine.client import Op
from hicache.engine.sglang.link import DaemonLink
from hicache.engine.sglang.stage_map import SGLANG_POOLS

LOAD_EVENT = 1  # the link's interprocess event recorded before each GPU load (0: backups)


class HostBytesElsewhere(HicacheError, RuntimeError):
    """A call that needs host bytes inside SGLang's process; they live in the daemon."""


_OFFSETS: dict[int, np.ndarray] = {}  # page size -> 0..page-1


def _pages(indices: torch.Tensor, page: int, what: str) -> list[int]:
    """Whole-page token indices -> page rows (each page must be ``row*page + 0..page-1``).
    Checked with numpy on the indices' memory (a CPU int64 tensor is read in place): a load
    converts four index tensors before its first layer is issued, and with torch's CPU ops
    that first layer came 0.02-0.19 ms later at 8-128 pages (an H100 host, both alternated in
    one run; the conversions still take 0.08-0.29 ms there)."""
    flat = indices.reshape(-1)
    if flat.device.type != "cpu" or flat.dtype != torch.int64:
        flat = flat.to(device="cpu", dtype=torch.int64)
    a = flat.numpy()
    if a.size % page:
        raise ValueError(f"{what}: {a.size} indices are not whole {page}-token pages; "
                         f"hicache moves whole pages only (token-granular copies are refused)")
    grid = a.reshape(-1, page)
    first = grid[:, 0]
    offsets = _OFFSETS.get(page)
    if offsets is None:
        offsets = _OFFSETS[page] = np.arange(page, dtype=np.int64)
    if (first % page).any() or not (grid - first[:, None] == offsets).all():
        raise ValueError(f"{what}: indices are not whole aligned {page}-token pages")
    return (first // page).tolist()


def _token_ids(rows: list[int], page: int) -> torch.Tensor:
    """The token indices SGLang gives out for host page ``rows``: ``page`` per row, in order."""
    r = torch.tensor(rows, dtype=torch.int64)
    return (r[:, None] * page + torch.arange(page)).reshape(-1)


class _Group:
    """The transfers of one SGLang submission (``submit_host_to_device`` or
    ``submit_device_to_host``) as one daemon command: every pool's rows in one ``load`` (the
    daemon copies layer by layer across the pools, layer 0 of every pool first, instead of one
    whole pool after another) or one ``backup``."""

    def __init__(self, transfers: list[Any], defer: bool = False) -> None:
        self.transfers = transfers
        self.keys = {(id(t.host_indices), id(t.device_indices)) for t in transfers}
        self.waiting = {id(t.host_pool) for t in transfers}  # pools short of their last layer
        self.op: Op | None = None
        self.copied: set[int] = set()  # global layers a wait found copied (the next skip it)
        self.defer = defer  # a GPU load's layers may be waited for by the forward (layer_waits)
        self.deferred = False  # they are: the calls do not wait

    def items(self, to_device: bool) -> dict[str, tuple]:
        """Every pool's items; the pools of one index space share SGLang's index tensors, so
        each tensor is turned into page rows once."""
        memo: dict[int, list[int]] = {}

        def pages(t: torch.Tensor, page: int, what: str) -> list[int]:
            got = memo.get(id(t))
            if got is None:
                got = memo[id(t)] = _pages(t, page, what)
            return got

        out: dict[str, tuple] = {}
        for t in self.transfers:
            out.update(t.host_pool._items(t.host_indices, t.device_indices, to_device, pages))
        return out


def _grouped(link: DaemonLink, transfers: Any, defer: bool = False) -> _Group | None:
    """The group of ``transfers``, or None when they cannot go as one command (a pool that is
    not this link's, one pool twice, an MTP draft transfer, or a device pool whose ids SGLang
    translates before the calls, ``host_transfer_translate``: the calls would then carry ids
    other than these): each pool then sends its own."""
    live = [t for t in transfers
            if t.host_indices is not None and t.device_indices is not None
            and t.host_indices.numel() > 0
            and getattr(t.host_pool, "anchor_of", None) is not link]  # (moves no bytes)
    pools = [t.host_pool for t in live]
    if not live or len({id(p) for p in pools}) != len(pools) or any(
            not isinstance(p, _DaemonPoolMixin) or p.link is not link or
            getattr(t, "is_draft", False) or
            getattr(getattr(t, "device_pool", None), "host_transfer_translate", None) is not None
            for p, t in zip(pools, live)):
        return None
    return _Group(live, defer)


@contextlib.contextmanager
def submission(link: DaemonLink, kind: str, transfers: Any, defer: bool = False
               ) -> Iterator[None]:
    """While SGLang submits ``transfers`` (``kind``: ``loads`` or ``backups``) from this
    thread, the host pools' calls for them go to the daemon as one command. Installed around
    SGLang's ``L2TransferEngine.submit_*`` by the assembler patch. ``defer``: a load whose
    layers the forward waits for through the link's layer counter (``start_loading``'s, which
    passes ``on_layer_done``): on a GPU its calls do not wait (``layer_waits``)."""
    group = _grouped(link, transfers, defer)
    prev = getattr(link.submitting, kind, None)
    setattr(link.submitting, kind, group)
    try:
        yield
    finally:
        setattr(link.submitting, kind, prev)


def _group_of(pool: _DaemonPoolMixin, host_indices: Any, device_indices: Any,
              kind: str) -> _Group | None:
    """The open submission's group when it covers this call (the very index tensors SGLang's
    transfers hold: its ``prepare_transfer_indices`` hands ours back unchanged), else None."""
    group = getattr(pool.link.submitting, kind, None)
    if group is None or (id(host_indices), id(device_indices)) not in group.keys:
        return None
    return group


def _refuse(name: str) -> Any:
    def method(self: Any, *args: Any, **kwargs: Any) -> Any:
        raise HostBytesElsewhere(f"{type(self).__name__}.{name}: host bytes live in the hicache "
                                 f"daemon; SGLang-side storage backends and PD direct-to-host "
                                 f"transfers cannot read them (use the hicache dynamic backend)")
    method.__name__ = name
    return method


class _DaemonPoolMixin:
    """Backup/load forwarding shared by the paged and the state pools."""

    link: DaemonLink
    ours: str
    layer_num: int
    page_size: int

    def _init_daemon(self, pool_name: str) -> None:
        try:
            self.ours = SGLANG_POOLS[str(pool_name)]
        except KeyError:
            raise ValueError(f"SGLang host pool {pool_name!r} has no hicache pool; mapped pools "
                             f"are {sorted(SGLANG_POOLS)}") from None
        spec = self.link.layout.pool(self.ours)
        self.space = spec.index
        self.layer_num = spec.num_layers
        self.start_layer, self.end_layer = 0, spec.num_layers
        self._loads: dict[tuple[int, int], Op] = {}
        self._load_lock = threading.Lock()

    def _init_host(self, layout: str, gpu_device: Any) -> None:
        """What SGLang's host pool attributes say of a pool whose bytes live in the daemon:
        its rows (the daemon's capacity), no host buffer of its own, no JIT copy kernels."""
        self.num_host_pages = self.link.capacity(self.space)
        self.size = self.num_host_pages * self.page_size
        self.dtype, self.device, self.pin_memory, self.layout = torch.uint8, "cpu", False, layout
        self.gpu_device = gpu_device
        self.lock = threading.RLock()
        self.kv_buffer, self.data_refs, self.data_ptrs, self.staging_buffer = None, [], None, None
        self.can_use_jit = self.can_use_write_back_jit = False

    def _items(self, host_indices: torch.Tensor, device_indices: torch.Tensor,
               to_device: bool, pages: Any = _pages) -> dict[str, tuple]:
        host = pages(host_indices, self.page_size, f"{self.ours} host")
        dev = pages(device_indices, self.page_size, f"{self.ours} device")
        if len(host) != len(dev):
            raise ValueError(f"{self.ours}: {len(host)} host pages but {len(dev)} device pages")
        return {self.ours: (host, dev) if to_device else (dev, host)}

    def backup_from_device_all_layer(self, device_pool: Any, host_indices: torch.Tensor,
                                     device_indices: torch.Tensor, io_backend: str) -> None:
        if host_indices is None or device_indices is None or host_indices.numel() == 0:
            return
        group = _group_of(self, host_indices, device_indices, "backups")
        c = self.link.client
        with self.link.lock:
            if group is not None:
                if group.op is not None:  # the submission's one backup covered this pool
                    return
                items = group.items(to_device=False)
            else:
                items = self._items(host_indices, device_indices, to_device=False)
            wait_event = None
            if c.backup_events:  # GPU: the daemon waits for what this stream wrote so far
                c.backup_events[0].record(torch.cuda.current_stream())
                wait_event = 0
            op = c.backup(items, wait_event=wait_event)
            if group is not None:
                group.op = op
            c.wait_ack(op)

    def load_to_device_per_layer(self, device_pool: Any, host_indices: torch.Tensor,
                                 device_indices: torch.Tensor, layer_id: int, io_backend: str,
                                 *, is_draft: bool = False) -> None:
        if is_draft:
            raise ValueError(f"{self.ours}: MTP draft layers are not mapped by hicache")
        if host_indices is None or device_indices is None or host_indices.numel() == 0:
            return
        c = self.link.client
        layer = self.link.pool_global_layer(self.ours, layer_id)
        group = _group_of(self, host_indices, device_indices, "loads")
        if group is not None:
            with self.link.lock:
                if group.op is None:  # the submission's first call: every pool in one load
                    waits = self.link.layer_waits if group.defer else None
                    if waits is not None:  # (a load its producer index still keeps first)
                        waits.retire()
                    group.op = self._submit_load(group.items(to_device=True))
                    group.deferred = (waits is not None and group.op.event_set is not None
                                      and waits.keep(group.op))
                op = group.op
                if layer_id == self.layer_num - 1:
                    group.waiting.discard(id(self))
                last = not group.waiting
                if group.deferred:  # the forward waits for each layer (``layer_waits``); the
                    if last:  # completion event SGLang records next follows the last copy
                        c.wait_layer(op, layer, on_stream=True)
                    return
                if layer in group.copied and not last:  # another pool's call saw it copied
                    return
        else:
            key = (id(host_indices), id(device_indices))
            with self._load_lock, self.link.lock:
                if layer_id == 0:
                    self._loads[key] = self._submit_load(
                        self._items(host_indices, device_indices, to_device=True))
                op = self._loads.get(key)
                if op is None:
                    raise RuntimeError(f"{self.ours}: layer {layer_id} loaded before layer 0")
                last = layer_id == self.layer_num - 1
                if last:
                    del self._loads[key]
        with self.link.lock:
            c.wait_layer(op, layer)
            if group is not None:
                group.copied.add(layer)
            if last and op.event_set is not None:
                c.wait_ack(op, check=True)  # the whole load, verified: TransferFailed if not

    def _submit_load(self, items: dict[str, tuple]) -> Op:
        """One daemon ``load`` of ``items`` (the caller holds the link's lock). GPU: it waits
        for an event recorded on the current stream (SGLang's H2D stream, which waits on its
        load fence). CPU: no per-layer events; its ack, taken now, covers every layer."""
        c = self.link.client
        if c.backup_events:
            c.backup_events[LOAD_EVENT].record(torch.cuda.current_stream())
            op = c.load(items, wait_event=LOAD_EVENT)
        else:
            op = c.load(items)
        if op.event_set is None:
            op.ack = c.wait_ack(op)
        return op

    def backup_tokens_from_device_all_layer(self, host_indices: Any, device_indices: Any
                                            ) -> None:
        """SGLang's token-granular C4 backup (its HiSparse coordinator calls it directly):
        refused before anything moves, as every token-granular copy is."""
        raise ValueError(f"{type(self).__name__}.backup_tokens_from_device_all_layer: hicache "
                         f"moves whole pages only (token-granular copies are refused)")

    get_data_page = _refuse("get_data_page")
    set_from_flat_data_page = _refuse("set_from_flat_data_page")
    get_dummy_flat_data_page = _refuse("get_dummy_flat_data_page")
    get_page_buffer_meta = _refuse("get_page_buffer_meta")
    get_contiguous_buf_infos = _refuse("get_contiguous_buf_infos")

    def is_stride_page_aligned(self, page_size_bytes: int = 4096) -> bool:
        return False

    def destroy(self) -> None:
        """SGLang's shutdown (``HostPoolGroup.destroy``): unregister the worker and close the
        link (once for all the pools that share it), so the daemon frees the host rows at once
        instead of reaping the worker after its heartbeat timeout."""
        self.link.close()


def bind_host_pools(link: DaemonLink) -> tuple[type, type, type]:
    """(anchor, paged, state) classes bound to ``link`` (see the module docstring)."""
    from sglang.srt.mem_cache.memory_pool_host import (DeepSeekV4PagedHostPool,
                                                       DeepSeekV4StateHostPool, LogicalHostPool)

    page = link.layout.model.page_size

    class DaemonAnchorPool(LogicalHostPool):
        """The KV anchor: page rows allocated by the daemon."""

        def __init__(self, size: int, page_size: int, layout: str = "layer_first") -> None:
            if page_size != page:
                raise ValueError(f"anchor page size {page_size} is not hicache's {page}")
            super().__init__(link.capacity("page") * page, page_size, layout)
            self.anchor_of = link  # SGLang's transfers include it; its copies are no-ops

        def clear(self) -> None:
            self.free_slots = torch.empty(0, dtype=torch.int64)
            self.release_slots, self.num_release_slots = [], 0
            link.free_all("page")  # SGLang forgot every host node: their rows go back

        def available_size(self) -> int:
            return link.free_rows("page") * page

        def alloc(self, need_size: int) -> torch.Tensor | None:
            if need_size % page:
                raise ValueError(f"anchor allocation of {need_size} is not whole {page}-token pages")
            rows = link.alloc("page", need_size // page)
            if rows is None:
                return None
            return _token_ids(rows, page)

        def free(self, indices: torch.Tensor) -> int:
            if indices.numel() == 0:
                return 0
            link.free("page", _pages(indices, page, "anchor free"))
            return int(indices.numel())

    class DaemonPagedHostPool(_DaemonPoolMixin, DeepSeekV4PagedHostPool):
        """A DSV4 paged pool (SWA, C4, C4 indexer, C128) held by the daemon."""

        def __init__(self, pool_name: str, device_buffers: list, item_bytes: int,
                     num_host_pages: int, slot_page_size: int, layout: str = "layer_first",
                     device: str = "cpu", pin_memory: bool = True, allocator_type: str = "default",
                     page_aligned_only: bool = False) -> None:
            self.link = link
            self._init_daemon(pool_name)
            spec = link.layout.pool(self.ours)
            if item_bytes != spec.page_bytes or slot_page_size != page:
                raise ValueError(f"{self.ours}: SGLang rows of {item_bytes} B / {slot_page_size} "
                                 f"tokens, hicache {spec.page_bytes} B / {page}")
            mine = [t.data_ptr() for t in link.stage.layers[self.ours]]
            if [t.data_ptr() for t in device_buffers] != mine:
                raise ValueError(f"{self.ours}: SGLang's device buffers are not the ones "
                                 f"registered with the daemon")
            self.pool_name, self.item_bytes, self.size_per_token = pool_name, item_bytes, item_bytes
            self.page_aligned_only = True
            self.slot_page_size = self.page_size = page
            self.device_buffers = device_buffers
            self._init_host(layout, device_buffers[0].device)

        def clear(self) -> None:
            if self.space == "swa_page":  # SGLang forgot every host node: their rows go back
                link.free_all("swa_page")

        def available_size(self) -> int:
            return link.free_rows(self.space) * page

        def alloc(self, need_size: int) -> torch.Tensor | None:
            if self.space != "swa_page":
                raise ValueError(f"{self.ours} takes its rows from the KV anchor, not alloc()")
            rows = link.alloc("swa_page", -(-need_size // page))
            if rows is None:
                return None
            return _token_ids(rows, page)

        def free(self, indices: torch.Tensor) -> int:
            if self.space != "swa_page":
                raise ValueError(f"{self.ours} rows are freed through the KV anchor")
            if indices.numel() == 0:
                return 0
            link.free("swa_page", _pages(indices, page, f"{self.ours} free"))
            return int(indices.numel())

    class DaemonStateHostPool(_DaemonPoolMixin, DeepSeekV4StateHostPool):
        """A DSV4 compress-state pool held by the daemon (rows: SWA pages, ring per row)."""

        def __init__(self, pool_name: str, state_pools: list, num_host_pages: int,
                     swa_page_size: int, layout: str = "layer_first", device: str = "cpu",
                     pin_memory: bool = True, allocator_type: str = "default") -> None:
            self.link = link
            self._init_daemon(pool_name)
            if swa_page_size != page:
                raise ValueError(f"{self.ours}: SWA page {swa_page_size}, hicache {page}")
            spec = link.layout.pool(self.ours)
            mine = [id(t) for t in link.stage.owners[self.ours]]
            if [id(p.kv_score_buffer.kv_score) for p in state_pools] != mine:
                raise ValueError(f"{self.ours}: SGLang's state pools are not the ones "
                                 f"registered with the daemon")
            self.pool_name, self.state_pools = pool_name, state_pools
            self.swa_page_size = self.page_size = page
            self.ring_size, self.state_page_bytes = spec.ring, spec.page_bytes
            self.size_per_token = spec.page_bytes
            self.device_page_views = link.stage.layers[self.ours]
            self._init_host(layout, state_pools[0].kv_score_buffer.kv_score.device)

    return DaemonAnchorPool, DaemonPagedHostPool, DaemonStateHostPool
