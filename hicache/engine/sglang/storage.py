"""SGLang 0.5.23's ``dynamic`` storage backend backed by the hicache daemon's key store.

SGLang loads it with ``--hicache-storage-backend dynamic`` and the extra config
``{"backend_name": "hicache", "module_path": "hicache.engine.sglang.storage",
"class_name": "HicacheStorage", "interface_v1": 1, "allocator": "shm",
"hicache_socket": "ipc:///..."}`` (see docs/sglang.md). SGLang then keeps its host pools in
shared memory (one memfd per buffer) and its factory calls ``HicacheStorage(config, {})``,
``register_mem_pool_host(anchor)`` and ``register_mem_host_pool_v2(pool, name)`` per pool.

* Each pool is attached to the daemon once (``kv_attach`` with the memfd, offset and page
  stride of every layer; the memfds handed in on the daemon's descriptor socket, which works
  from any pid namespace that shares the daemon's network namespace, then ``kv_verify``).
  ``"hicache_attach": "pid"`` has the daemon open them through ``/proc/<pid>/fd`` instead
  (same pid namespace, any network namespace), with the nonce proof.
  DSV4 pools go to the daemon pool of the same bytes (``stage_map.SGLANG_POOLS``); the DSV4
  KV anchor (``LogicalHostPool``, no bytes) becomes a marker pool that records which keys
  were written. Any other pool, a pool not in shared memory, or a page size that differs from
  the daemon's, is refused with one line when registered.
* ``batch_set_v1 / batch_get_v1`` (anchor) and ``batch_set_v2 / batch_get_v2`` (one
  ``PoolTransfer`` per pool) send keys and page indices; the daemon copies the bytes. They
  return one bool per key, as SGLang expects. ``batch_exists`` counts the leading keys the
  anchor holds; ``batch_exists_v2`` applies SGLang's hit policies (all pages / trailing pages)
  per pool; block groups are refused.
* The pages live in the daemon's host rows under a namespace (``hicache_namespace`` or the model
  name, plus the TP rank for non-MLA models, the attention-CP and DCP ranks when there are
  several, and the PP rank, as SGLang's file backend keys them; DP ranks share it), so they
  survive an engine restart and are shared by engines of the same namespace on the node (and, with
  L3, beyond it). A heartbeat thread (``engine.heartbeats``) keeps an idle engine's client from
  being reaped (SGLang calls the backend only when it moves pages; it used to be reaped after the
  daemon's heartbeat timeout, 10 s by default, and re-attached at its next call). A daemon that
  dropped this client all the same (a restart, a stall past the timeout) is re-attached once,
  transparently; an unreachable daemon makes the call fail (all False, logged), never hang. A call
  that went out and got no reply (``NoReply``) is a miss only once a later round trip answered
  (the daemon handles one client's commands in order and copies inline, so any late copy of that
  call is done by then) or the daemon's process is gone (its pid, from the heartbeat of the first
  attach and of every re-attach, trusted only where the process it names here started when the
  daemon says it did: ``pid_start``, the same from every pid namespace). Until then the call does
  not return: SGLang takes any exception of a storage call for a miss and reuses its pages, into
  which a stalled daemon may still copy (or from which it may still store a page under the call's
  key), so the fence is asked again every ``hicache_timeout`` seconds, with an error logged each
  time. SGLang's scheduler waits for its I/O thread's acknowledgement before it frees a prefetch's
  pages, so they stay unused meanwhile.
* A daemon with an L3 tier (``--l3 mooncake``) writes every stored page through to Mooncake
  Store and reads back pages its host rows lack (after a daemon restart, or from another node's
  daemon): it answers such keys *pending* and ``kv_get`` / ``kv_exists`` ask again until they
  are answered or ``hicache_l3_wait`` seconds (default 5) passed; a key still pending then,
  or whose object is missing or fails verification, is False (a miss), never wrong bytes.
* The tensor-passing calls (``get / set / batch_get / batch_set``) are refused: this backend
  is zero-copy only (``interface_v1``), which the constructor requires.

Importing this module checks the SGLang version (``UnsupportedSglang`` otherwise).
"""
from __future__ import annotations

import ctypes
import logging
import os
import threading
import time
from typing import Any, Callable, Optional

import torch

from hicache.engine.sglang.version import check_sglang_version

check_sglang_version()

from sglang.srt.mem_cache.hicache_storage import (HiCacheStorage,  # noqa: E402
                                                  HiCacheStorageConfig,
                                                  HiCacheStorageExtraInfo, PoolHitPolicy,
                                                  PoolTransfer, PoolTransferResult)

from hicache.core.proc_start import process_start  # noqa: E402
from hicache.core.protocol import MAX_KV_NS_LEN  # noqa: E402
from hicache.engine.client import (Client, CommandRefused, DaemonGone,  # noqa: E402
                                   DaemonUnreachable, NoReply)
from hicache.engine.heartbeats import Heartbeats  # noqa: E402
from hicache.engine.sglang.host_pools import _pages  # noqa: E402
from hicache.engine.sglang.stage_map import SGLANG_POOLS  # noqa: E402

log = logging.getLogger("hicache.sglang.storage")

ANCHOR = "kv"  # SGLang's PoolName.KV: the pool of the v1 calls
CONFIG_KEYS = {"backend_name", "module_path", "class_name", "interface_v1", "allocator",
               "hicache_socket", "hicache_namespace", "hicache_timeout", "hicache_l3_wait",
               "hicache_attach"}
ATTACH_WAYS = ("handoff", "pid")  # how the daemon gets the pools' files (kv_attach)


class StorageRefused(ValueError):
    """A configuration or a pool the hicache storage backend cannot serve."""


def _namespace(cfg: HiCacheStorageConfig, extra: dict[str, Any]) -> str:
    """One namespace per set of ranks whose pages hold the same bytes, as SGLang's own file
    backend keys them: MLA pages are shared across TP ranks, but each attention-CP rank holds
    a disjoint slice of every page and each DCP shard its own part (their pages under one
    name would be one rank's bytes served to the others as hits). DP ranks share theirs (the
    same weights write the same pages; with DP attention the TP rank is the group's own), so
    a prefix one DP rank stored in L3 is a hit for the others (the DP rank used to be in the
    name, and each DP group stored its own copy)."""
    base = str(extra.get("hicache_namespace") or cfg.model_name or "default")
    tp = "" if cfg.is_mla_model else f"/tp{cfg.tp_rank}of{cfg.tp_size}"
    cp_size = int(getattr(cfg, "attn_cp_size", 1) or 1)
    cp = f"/cp{cfg.attn_cp_rank}of{cp_size}" if cp_size > 1 else ""
    dcp_size = int(getattr(cfg, "dcp_size", 1) or 1)
    dcp = f"/dcp{cfg.dcp_rank}of{dcp_size}" if dcp_size > 1 else ""
    ns = f"{base}{tp}{cp}{dcp}/pp{cfg.pp_rank}of{cfg.pp_size}"
    if len(ns) > MAX_KV_NS_LEN or not ns.isprintable():  # refused now, not at the first attach
        raise StorageRefused(f"the key-store namespace {ns[:80]!r}... ({len(ns)} characters) "
                             f"must be at most {MAX_KV_NS_LEN} printable characters: shorten "
                             f"hicache_namespace (default: the model name)")
    return ns


def _layer_views(pool: Any, name: str) -> list[torch.Tensor]:
    """One ``[pages, bytes]`` view per layer of an SGLang host pool."""
    buf, layout = pool.kv_buffer, getattr(pool, "layout", None)
    if layout == "layer_first" and isinstance(buf, list):
        views = list(buf)
    elif layout == "page_first" and isinstance(buf, torch.Tensor) and buf.dim() == 3:
        views = [buf[:, i] for i in range(buf.shape[1])]
    elif layout == "page_first_direct" and isinstance(buf, torch.Tensor) and buf.dim() == 4:
        views = [buf[:, i, 0] for i in range(buf.shape[1])]
    else:
        raise StorageRefused(f"host pool {name}: layout {layout!r} is not one hicache maps "
                             f"(layer_first, page_first, page_first_direct)")
    for v in views:
        if v.dim() != 2 or v.stride(1) != 1:
            raise StorageRefused(f"host pool {name}: a layer is not [pages, bytes] rows")
    return views


def _shm_files(pool: Any, name: str) -> list[tuple[int, int, int]]:
    """(fd, address, bytes) of every shared-memory file SGLang's shm allocator made."""
    a = getattr(pool, "allocator", None)
    fds, mms = getattr(a, "fds", None), getattr(a, "mms", None)
    if not fds or not mms:
        raise StorageRefused(f"host pool {name} is not in shared memory: start SGLang with "
                             f"\"allocator\": \"shm\" in --hicache-storage-backend-extra-config")
    return [(fd, ctypes.addressof(ctypes.c_char.from_buffer(mm)), len(mm))
            for fd, mm in zip(fds, mms) if fd is not None]


def describe_pool(pool: Any, name: str, attach: str = "handoff") -> dict[str, Any]:
    """The ``kv_attach`` fields of one SGLang host pool (see the module docstring); ``attach``:
    ``handoff`` (the files handed in) or ``pid`` (opened by the daemon through ``/proc``)."""
    if getattr(pool, "kv_buffer", None) is None:
        if name != ANCHOR:
            raise StorageRefused(f"host pool {name} holds no bytes; only the KV anchor may")
        return {"space": "page", "pages": int(pool.size) // int(pool.page_size)}
    ours = SGLANG_POOLS.get(name)
    if ours is None:
        raise StorageRefused(f"host pool {name} has no hicache pool; hicache stores the DSV4 "
                             f"pools {sorted(SGLANG_POOLS)}")
    views = _layer_views(pool, name)
    files = _shm_files(pool, name)
    layers = []
    for i, v in enumerate(views):
        ptr, size = v.data_ptr(), v.element_size()
        hit = [(fd, base) for fd, base, n in files if base <= ptr < base + n]
        if not hit:
            raise StorageRefused(f"host pool {name}: layer {i} is not in a shared-memory file")
        layers.append({"fd": hit[0][0], "offset": ptr - hit[0][1], "stride": v.stride(0) * size})
    way = {"handoff": True} if attach == "handoff" else {"pid": os.getpid()}
    return {"pool": ours, **way, "pages": int(views[0].shape[0]),
            "page_bytes": int(views[0].shape[1]) * views[0].element_size(), "layers": layers}


class HicacheStorage(HiCacheStorage):
    """See the module docstring."""

    def __init__(self, storage_config: HiCacheStorageConfig,
                 kwargs: Optional[dict] = None) -> None:
        extra = dict(storage_config.extra_config or {})
        if not extra.get("interface_v1"):
            raise StorageRefused("the hicache storage backend is zero-copy only: set "
                                 "\"interface_v1\": 1 in the extra config")
        if extra.get("allocator") != "shm":
            raise StorageRefused("the hicache storage backend maps SGLang's host pools: set "
                                 "\"allocator\": \"shm\" in the extra config")
        unknown = sorted(set(extra) - CONFIG_KEYS)
        if unknown:
            raise StorageRefused(f"unknown extra config keys {unknown}; known: "
                                 f"{sorted(CONFIG_KEYS)}")
        address = extra.get("hicache_socket") or os.environ.get("HICACHE_SOCKET")
        if not address:
            raise StorageRefused("no daemon address: set \"hicache_socket\" in the extra "
                                 "config or HICACHE_SOCKET")
        if storage_config.is_mla_model and storage_config.tp_size > 1 and \
                "{tp_rank}" in str(address):
            # SGLang stores an MLA model's pages from TP rank 0 only and takes the least of the
            # ranks' hits: a daemon per rank would never hit on ranks 1.. (nor at all)
            raise StorageRefused(f"hicache_socket {str(address)[:200]!r} names {{tp_rank}}, but "
                                 f"this model is MLA: SGLang writes storage from TP rank 0 only "
                                 f"and takes the least hit count over the ranks, so the "
                                 f"{storage_config.tp_size} TP ranks must share one daemon; "
                                 f"drop {{tp_rank}} from the address")
        try:
            address = str(address).format(pp_rank=storage_config.pp_rank,
                                          tp_rank=storage_config.tp_rank)
        except (KeyError, IndexError, ValueError) as e:  # e.g. {dp_rank}, or a lone brace
            raise StorageRefused(f"hicache_socket {str(address)[:200]!r}: only {{tp_rank}} and "
                                 f"{{pp_rank}} are filled in ({type(e).__name__}: {e})") \
                from None
        self.namespace = _namespace(storage_config, extra)
        wait = extra.get("hicache_l3_wait", 5.0)
        if type(wait) not in (int, float) or not 0 <= wait <= 600:
            raise StorageRefused(f"hicache_l3_wait must be a number of seconds in 0..600, got "
                                 f"{str(wait)[:40]!r}")
        self.l3_wait = float(wait)
        self.attach = extra.get("hicache_attach", "handoff")
        if self.attach not in ATTACH_WAYS:
            raise StorageRefused(f"hicache_attach must be one of {list(ATTACH_WAYS)}, got "
                                 f"{str(self.attach)[:40]!r}")
        self.client = Client(address, timeout=float(extra.get("hicache_timeout", 30.0)),
                             name=f"sglang-storage-tp{storage_config.tp_rank}")
        self._watch(self.client.heartbeat())  # it must answer now (DaemonUnreachable otherwise)
        self.lock = threading.RLock()
        self.pools: dict[str, tuple[Any, dict[str, Any]]] = {}  # name -> (pool, attach fields)
        # SGLang calls the backend only when it moves pages: an idle engine is kept attached
        self.beats = Heartbeats(self.client, self.lock, who=f"hicache storage ({self.namespace})",
                                logger=log)

    # ------------------------------------------------------------------ registration
    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        self._attach(ANCHOR, mem_pool_host)

    def register_mem_host_pool_v2(self, host_pool: Any, host_pool_name: Any) -> None:
        super().register_mem_host_pool_v2(host_pool, host_pool_name)
        self._attach(str(host_pool_name), host_pool)

    def _attach(self, name: str, pool: Any) -> None:
        with self.lock:
            if name in self.pools:
                if self.pools[name][0] is pool:
                    return  # the anchor comes both as mem_pool_host and as a v2 entry
                raise StorageRefused(f"host pool {name} is already registered (another pool)")
            fields = describe_pool(pool, name, self.attach)
            self.client.kv_attach_proven(name, self.namespace, **fields)
            self.pools[name] = (pool, fields)

    def _watch(self, hb: dict[str, Any]) -> None:
        """The process of the daemon that answered ``hb``, to tell a stalled daemon from a gone
        one after a ``NoReply`` (``_fence``). None: not visible from here (e.g. another pid
        namespace): a stalled call then waits for an answer however long it takes."""
        self.daemon_pid = hb.get("pid")
        start = process_start(self.daemon_pid)
        # the pid names the daemon here only if that process started when the daemon says it
        # did: in another pid namespace the number may be some other process of this one
        self.daemon_start = start if start is not None and start == hb.get("pid_start") \
            else None
        if self.daemon_start is None:
            log.warning("the hicache daemon's process (pid %s) is not visible here: a call it "
                        "stops answering waits until it answers again", self.daemon_pid)

    def _reattach(self) -> None:
        """The daemon dropped this client (a restart, a reap): watch the daemon that answers
        now (the one the next calls go to), then attach every pool again."""
        self._watch(self.client.heartbeat())
        self.client.kv_detach()
        for name, (_, fields) in self.pools.items():
            self.client.kv_attach_proven(name, self.namespace, **fields)

    def _call(self, what: str, n: int, fn: Callable[[], list[bool]]) -> list[bool]:
        with self.lock:
            try:
                try:
                    return fn()
                except CommandRefused as e:
                    if e.code != "not_registered":
                        raise
                    log.warning("%s: the daemon dropped this client (%s); re-attaching", what, e)
                    self._reattach()
                    return fn()
            except NoReply as e:
                self._fence(what, e)
                log.error("%s failed: %s", what, e)
                return [False] * n
            except (CommandRefused, DaemonUnreachable, OSError) as e:
                log.error("%s failed: %s", what, e)
                return [False] * n

    def _fence(self, what: str, e: NoReply) -> None:
        """After ``NoReply``: round trips until one is answered (the call was handled, its
        inline copy done, or it never arrived) or the daemon is gone (its process, or its
        socket, which it closes after its copies ended: nothing can copy into these pages any
        more); see the module docstring."""
        t0 = time.monotonic()
        while True:
            try:
                self.client.heartbeat()
                return
            except CommandRefused:  # a refusal is an answer too, in order: the fence passed
                return
            except DaemonGone as f:  # its socket refuses or is gone: its loop and copies ended
                log.error("%s: %s; the daemon is gone (%s): a miss", what, e, f.why)
                return
            except DaemonUnreachable as f:
                if self.daemon_start is not None and \
                        process_start(self.daemon_pid) != self.daemon_start:
                    log.error("%s: %s; the daemon's process %s is gone: a miss", what, e,
                              self.daemon_pid)
                    return
                log.error("%s: %s; no answer to a fence for %.0f s (%s): this thread waits, as "
                          "the daemon may still copy into these pages", what, e,
                          time.monotonic() - t0, f)

    def _page_ids(self, name: str, keys: list[str], host_indices: Any) -> list[int] | None:
        pool = self.pools[name][0]
        page = int(pool.page_size)
        try:
            pages = _pages(host_indices, page, name)
        except ValueError as e:
            log.error("%s: %s", name, e)
            return None
        if len(pages) != len(keys):
            log.error("%s: %d keys for %d pages", name, len(keys), len(pages))
            return None
        return pages

    def _move(self, verb: str, name: str, keys: list[str], host_indices: Any) -> list[bool]:
        if not keys:
            return []
        if name not in self.pools:
            raise StorageRefused(f"host pool {name} was never registered with this backend")
        pages = self._page_ids(name, keys, host_indices)
        if pages is None:
            return [False] * len(keys)
        if verb == "put":
            return self._call(f"kv_put {name}", len(keys),
                              lambda: self.client.kv_put(name, keys, pages))
        return self._call(f"kv_get {name}", len(keys),
                          lambda: self.client.kv_get(name, keys, pages, l3_wait=self.l3_wait))

    def _present(self, name: str, keys: list[str]) -> list[bool]:
        if not keys:
            return []
        return self._call(f"kv_exists {name}", len(keys),
                          lambda: self.client.kv_exists(name, keys, l3_wait=self.l3_wait))

    # ------------------------------------------------------------------ v1 (the anchor)
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        return self._move("put", ANCHOR, list(keys), host_indices)

    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> list[bool]:
        return self._move("get", ANCHOR, list(keys), host_indices)

    def exists(self, key: str) -> bool:
        return self._present(ANCHOR, [key]) == [True]

    def batch_exists(self, keys: list[str],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> int:
        return _leading(self._present(ANCHOR, list(keys)))

    # ------------------------------------------------------------------ v2 (pool transfers)
    def batch_set_v2(self, transfers: list[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, list[bool]]:
        return {str(t.name): self._move("put", str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    def batch_get_v2(self, transfers: list[PoolTransfer],
                     extra_info: Optional[HiCacheStorageExtraInfo] = None) -> dict[str, list[bool]]:
        return {str(t.name): self._move("get", str(t.name), list(t.keys or []), t.host_indices)
                for t in transfers}

    def batch_exists_v2(self, keys: list[str], pool_transfers: Optional[list[PoolTransfer]] = None,
                        extra_info: Optional[HiCacheStorageExtraInfo] = None) -> PoolTransferResult:
        keys = list(keys)
        kv_pages = _leading(self._present(ANCHOR, keys))
        hits: dict[str, int] = {ANCHOR: kv_pages} if kv_pages else {}
        ok = set(range(1, kv_pages + 1))  # prefix lengths every pool so far can restore
        for t in pool_transfers or []:
            if not ok:
                break
            name = str(t.name)
            have = self._present(name, keys[:kv_pages])
            if t.hit_policy == PoolHitPolicy.ALL_PAGES:
                mine = set(range(1, _leading(have) + 1))
            elif t.hit_policy == PoolHitPolicy.TRAILING_PAGES:
                window = max(1, len(t.keys or ()))
                mine = {n for n in range(1, kv_pages + 1) if all(have[max(0, n - window):n])}
            else:
                raise StorageRefused(f"pool {name}: hit policy {t.hit_policy} is not supported "
                                     f"by the hicache storage backend")
            if mine:
                hits[name] = max(mine)
            ok &= mine
        restorable = sorted(ok)
        return PoolTransferResult(restorable[-1] if restorable else 0, hits, restorable)

    # ------------------------------------------------------------------ refused / lifecycle
    def _tensor_calls(self, *args: Any, **kwargs: Any) -> Any:
        raise StorageRefused("the hicache storage backend moves pages by index only "
                             "(interface_v1); tensor get/set are not served")

    get = set = batch_get = batch_set = _tensor_calls

    def clear(self) -> None:
        """``kv_clear`` of the namespace. SGLang calls it on its scheduler thread, so it waits
        at most the call timeout for the backend's lock, which a call whose daemon stopped
        answering holds until the daemon answers or is gone (``_fence``): ``StorageRefused``
        then (SGLang's clear request fails; the whole server no longer waits)."""
        if not self.lock.acquire(timeout=self.client.timeout):
            raise StorageRefused(f"clear: another call of this backend has waited over "
                                 f"{self.client.timeout:g} s for the hicache daemon at "
                                 f"{self.client.address} (it does not answer); try again once "
                                 f"it does")
        try:
            n = self.client.kv_clear(self.namespace)
        finally:
            self.lock.release()
        log.info("cleared %d pages of namespace %s", n, self.namespace)

    def close(self) -> None:
        self.beats.stop()
        with self.lock:
            try:
                self.client.kv_detach()
            except (CommandRefused, DaemonUnreachable) as e:
                log.warning("kv_detach at close: %s", e)
            self.client.close()


def _leading(flags: list[bool]) -> int:
    for i, f in enumerate(flags):
        if not f:
            return i
    return len(flags)
