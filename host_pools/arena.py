"""``PinnedArena``: one exact-size, NUMA-local, page-locked host mapping for one GPU.

Contract:

* ``PinnedArena(nbytes, device_index, *, numa_node="auto", touch_threads=None,
  chunk_bytes=64 GiB, reserve_bytes=None, progress=True, cut_hints=(), registrar=None,
  check_memory=True)``
  maps ``nbytes`` (rounded up to the 4 KiB page only) of anonymous private memory, advises
  transparent huge pages when it will register the arena, first-touches every page from
  threads placed on the GPU's NUMA node
  (see ``numa_node``), then ``cudaHostRegister``s it in chunks of at most ``chunk_bytes``
  (cut preferably at ``cut_hints``, e.g. region starts, so no region spans two registrations).
  ``device_index=None`` is CPU mode: the same arena, not registered (unless a ``registrar``
  is given, which tests use to inject failures).
* Refuses (``CapacityError``, ``memory.check_memory_for``) sizes above available memory (psutil, and the memory cgroup's
  room) minus ``reserve_bytes``, saying how much is available; ``check_memory=False`` skips
  this for VMs whose RAM grows on use (their MemTotal starts below the real limit). Any registration failure unregisters the chunks already registered and
  unmaps before raising ``ArenaError`` with the driver's error.
* ``.ptr``, ``.nbytes``, ``.device_ptr``, ``.device_address(offset)``,
  ``.tensor(offset, nbytes)`` (a ``torch.uint8`` view; it keeps the mapping alive),
  ``.stats`` (placement, threads, timings, GiB/s, pinned bytes) and ``.close()``: idempotent,
  also a context manager. After close every method raises ``ArenaError``; views still held
  stay valid host memory (unregistered) and are unmapped when the last one is dropped.
"""
from __future__ import annotations

import bisect
import logging
import mmap
import sys
import threading
import time
import weakref
from typing import Any, Callable, Sequence

import numpy as np
import torch

from .cuda_host import CudaHostRegistrar, HostRegistrar
from .errors import ArenaError
from .memory import check_memory_for
from .numa_node import Placement, plan_placement
from hicache.core.sizes import format_bytes

log = logging.getLogger("hicache.host_pools")

PAGE = mmap.PAGESIZE
GiB = 1 << 30
DEFAULT_CHUNK = 64 * GiB  # larger single registrations fail on recent drivers
PROGRESS_MIN = 4 * GiB  # progress=True prints only for arenas at least this large
TOUCH_SLICE = 256 << 20  # progress granularity of a touching thread
MIN_BYTES_PER_THREAD = 64 << 20
MAX_DEFAULT_THREADS = 32
ProgressFn = Callable[[str, int, int], None]  # (phase, done bytes, total bytes)


def chunk_plan(nbytes: int, chunk_bytes: int, cuts: Sequence[int] = ()) -> list[tuple[int, int]]:
    """``[(offset, length)]`` covering ``nbytes``; each at most ``chunk_bytes``, page-aligned,
    ending at the last page-aligned cut hint that fits, else at the chunk limit."""
    if chunk_bytes < PAGE:
        raise ArenaError(f"chunk size {chunk_bytes} is below one page ({PAGE} bytes)")
    step = chunk_bytes // PAGE * PAGE
    hints = sorted({c for c in cuts if 0 < c < nbytes and c % PAGE == 0})
    plan, pos = [], 0
    while pos < nbytes:
        limit = pos + step
        if limit >= nbytes:
            end = nbytes
        else:
            i = bisect.bisect_right(hints, limit) - 1
            end = hints[i] if i >= 0 and hints[i] > pos else limit
        plan.append((pos, end - pos))
        pos = end
    return plan


class _Mapping:
    """What must be released, kept apart from the arena so a finalizer can release it."""

    def __init__(self, mm: mmap.mmap) -> None:
        self.mm: mmap.mmap | None = mm
        self.base: torch.Tensor | None = None
        self.registrar: HostRegistrar | None = None
        self.registered: list[tuple[int, int]] = []  # (ptr, nbytes), in registration order

    def release(self) -> list[str]:
        """Unregister (last first) and unmap; returns the errors met (never raises)."""
        errors = []
        while self.registered:
            ptr, n = self.registered.pop()
            err = self.registrar.unregister(ptr) if self.registrar else None
            if err:
                errors.append(f"cudaHostUnregister({ptr:#x}, {n}) failed: {err}")
        self.base = None
        mm, self.mm = self.mm, None
        if mm is not None:
            try:
                mm.close()
            except BufferError:  # views are alive; the mapping goes with the last of them
                log.debug("host arena closed; tensor views still alive keep it mapped")
        return errors


class PinnedArena:
    """An exact-size pinned host arena for one GPU (or for CPU mode)."""

    def __init__(
        self, nbytes: int, device_index: int | None = None, *,
        numa_node: int | str | None = "auto", touch_threads: int | None = None,
        chunk_bytes: int = DEFAULT_CHUNK, reserve_bytes: int | None = None,
        progress: bool | ProgressFn = True, cut_hints: Sequence[int] = (),
        registrar: HostRegistrar | None = None, check_memory: bool = True,
    ) -> None:
        if isinstance(nbytes, bool) or not isinstance(nbytes, int) or nbytes <= 0:
            raise ArenaError(f"arena size must be a positive int, got {nbytes!r}")
        if touch_threads is not None and (
                isinstance(touch_threads, bool) or not isinstance(touch_threads, int)
                or touch_threads <= 0):
            raise ArenaError(f"touch_threads must be a positive int, got {touch_threads!r}")
        if device_index is not None and registrar is None:
            registrar = CudaHostRegistrar(device_index)
        if check_memory:  # first: a size no machine has is refused before it is planned
            check_memory_for(nbytes, reserve_bytes, pinned=registrar is not None)
        chunks = chunk_plan(_page_up(nbytes), chunk_bytes, cut_hints)
        placement = plan_placement(device_index, numa_node, nbytes)
        threads = touch_threads or _default_threads(placement, nbytes)
        self.nbytes = nbytes
        self.device_index = device_index
        self._report = _progress_fn(progress, nbytes)
        self._closed = False
        t0 = time.perf_counter()
        try:
            mm = mmap.mmap(-1, _page_up(nbytes), flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
        except OSError as e:
            raise ArenaError(f"cannot map {format_bytes(nbytes)}: {e.strerror}") from None
        self._m = _Mapping(mm)
        self._finalizer = weakref.finalize(self, self._m.release)
        self._finalizer.atexit = False  # the process exit releases everything anyway
        try:
            # huge pages serve the registration (fewer, larger pages to pin and map); an
            # unpinned arena gets the kernel's default: on VMs its first touch of huge pages
            # ran at 0.10-0.14 GiB/s against 1.8-2.4 on 4 KiB pages (docs/host_pools.md)
            huge = _advise_hugepages(mm) if registrar is not None else "not advised (not pinned)"
            # frombuffer over a memoryview: views keep an export, so the map outlives them
            self._m.base = torch.frombuffer(memoryview(mm), dtype=torch.uint8)
            self._ptr = self._m.base.data_ptr()
            t1 = time.perf_counter()
            _touch(self._m.base, placement, threads, self._report)
            t2 = time.perf_counter()
            self._chunk_ptrs: list[int] = []
            self._chunk_dev: list[int] = []
            self._m.registrar = registrar
            can_host_ptr = self._register(registrar, chunks) if registrar else None
            t3 = time.perf_counter()
        except BaseException:
            self._finalizer()
            raise
        seconds = t3 - t0
        self.stats: dict[str, Any] = {
            "requested_bytes": nbytes,
            "mapped_bytes": len(mm),
            "pinned_bytes": sum(n for _, n in self._m.registered),
            "registered": registrar is not None,
            "chunks": len(self._m.registered),
            "device_index": device_index,
            "numa_node": placement.node,
            "numa_policy": placement.policy,
            "numa_note": placement.note,
            "touch_threads": threads,
            "hugepages": huge,
            "map_s": round(t1 - t0, 4),
            "touch_s": round(t2 - t1, 4),
            "register_s": round(t3 - t2, 4),
            "seconds": round(seconds, 4),
            "gib_per_s": round(nbytes / GiB / seconds, 3) if seconds > 0 else None,
            "can_use_host_pointer": can_host_ptr,
            "device_ptr_is_host_ptr": (self._chunk_dev == self._chunk_ptrs) if registrar
            else None,
        }
        self._report("done", nbytes, nbytes)

    # ------------------------------------------------------------------ registration
    def _register(self, registrar: HostRegistrar, chunks: list[tuple[int, int]]) -> bool | None:
        """Register every chunk or none; record device pointers. Returns the UVA attribute."""
        total = sum(n for _, n in chunks)
        done = 0
        for off, n in chunks:
            try:
                registrar.register(self._ptr + off, n)
            except Exception as e:
                undone = len(self._m.registered)
                errors = self._m.release()
                msg = (f"registering {format_bytes(total)} on cuda:{registrar.device_index} "
                       f"failed at chunk {len(self._chunk_ptrs) + 1}/{len(chunks)} "
                       f"(offset {off}, {n} bytes): {e}; rolled back {undone} registered "
                       f"chunk(s) and unmapped")
                if errors:
                    msg += "; rollback errors: " + "; ".join(errors)
                raise ArenaError(msg) from None
            self._m.registered.append((self._ptr + off, n))
            self._chunk_ptrs.append(self._ptr + off)
            done += n
            self._report("register", done, total)
        can = registrar.can_use_host_pointer()
        for p in self._chunk_ptrs:
            dev = registrar.device_pointer(p)
            if dev is None:
                log.warning("host arena: no device pointer for %#x; assuming the host address "
                            "(UVA)", p)
                dev = p
            self._chunk_dev.append(dev)
        if can is False and self._chunk_dev == self._chunk_ptrs:
            log.warning("host arena: cuda:%s cannot use host pointers for registered memory but "
                        "the device pointers equal the host ones", registrar.device_index)
        return can

    # ------------------------------------------------------------------ access
    def _live(self) -> None:
        if self._closed:
            raise ArenaError("the host arena is closed")

    @property
    def closed(self) -> bool:
        return self._closed

    @property
    def ptr(self) -> int:
        """Host address of byte 0."""
        self._live()
        return self._ptr

    @property
    def device_ptr(self) -> int:
        """Device address of byte 0 (the host address under UVA; equal on the H200)."""
        return self.device_address(0)

    def device_address(self, offset: int) -> int:
        """Device address of byte ``offset``; the host address in CPU mode."""
        self._live()
        if not 0 <= offset < self.nbytes:
            raise ArenaError(f"offset {offset} is outside the arena of {self.nbytes} bytes")
        if not self._chunk_dev:
            return self._ptr + offset
        addr = self._ptr + offset
        i = bisect.bisect_right(self._chunk_ptrs, addr) - 1
        return self._chunk_dev[i] + (addr - self._chunk_ptrs[i])

    def tensor(self, offset: int, nbytes: int) -> torch.Tensor:
        """A 1-D ``torch.uint8`` view of ``[offset, offset + nbytes)``."""
        self._live()
        for name, v in (("offset", offset), ("nbytes", nbytes)):
            if isinstance(v, bool) or not isinstance(v, int) or v < 0:
                raise ArenaError(f"{name} must be a non-negative int, got {v!r}")
        if offset + nbytes > self.nbytes:
            raise ArenaError(
                f"view [{offset}, {offset + nbytes}) is outside the arena of {self.nbytes} bytes"
            )
        assert self._m.base is not None
        return self._m.base[offset:offset + nbytes]

    # ------------------------------------------------------------------ lifetime
    def close(self) -> None:
        """Unregister and unmap; a second call does nothing."""
        if self._closed:
            return
        self._closed = True
        self._finalizer.detach()
        for err in self._m.release():
            log.error("host arena: %s", err)

    def __enter__(self) -> "PinnedArena":
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def __repr__(self) -> str:
        state = "closed" if self._closed else f"ptr={self._ptr:#x}"
        return f"PinnedArena({format_bytes(self.nbytes)}, device={self.device_index}, {state})"


# ---------------------------------------------------------------------- helpers
def _page_up(n: int) -> int:
    return (n + PAGE - 1) // PAGE * PAGE


def _default_threads(placement: Placement, nbytes: int) -> int:
    by_size = max(1, nbytes // MIN_BYTES_PER_THREAD)
    return int(max(1, min(len(placement.cpus) or 1, MAX_DEFAULT_THREADS, by_size)))


def _advise_hugepages(mm: mmap.mmap) -> str:
    advice = getattr(mmap, "MADV_HUGEPAGE", None)
    if advice is None:
        return "unsupported"
    try:
        mm.madvise(advice)
        return "advised"
    except OSError as e:
        log.info("host arena: MADV_HUGEPAGE refused (%s); using 4 KiB pages", e.strerror)
        return "refused"


def _progress_fn(progress: bool | ProgressFn, nbytes: int) -> ProgressFn:
    if callable(progress):
        return progress
    if not progress or nbytes < PROGRESS_MIN:
        return lambda phase, done, total: None
    last = [0.0]

    def report(phase: str, done: int, total: int) -> None:
        now = time.monotonic()
        if phase != "done" and done < total and now - last[0] < 1.0:
            return
        last[0] = now
        print(f"hicache: host arena {format_bytes(nbytes)}: {phase} "
              f"{format_bytes(done)} / {format_bytes(total)}", file=sys.stderr, flush=True)

    return report


def _touch(base: torch.Tensor, placement: Placement, threads: int, report: ProgressFn) -> None:
    """Write one byte per page from ``threads`` threads placed per ``placement``."""
    arr = np.frombuffer(memoryview(base.numpy()), dtype=np.uint8)
    total = base.numel()
    pages = (total + PAGE - 1) // PAGE
    bounds = [pages * i // threads * PAGE for i in range(threads)] + [total]
    done = [0] * threads
    errors: list[BaseException] = []

    def work(i: int) -> None:
        try:
            placement.enter_thread()
            lo, hi = bounds[i], min(bounds[i + 1], total)
            for s in range(lo, hi, TOUCH_SLICE):
                e = min(s + TOUCH_SLICE, hi)
                arr[s:e:PAGE] = 0  # numpy releases the GIL for this strided store
                done[i] += e - s
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller
            errors.append(e)

    pool = [threading.Thread(target=work, args=(i,), name=f"arena-touch-{i}", daemon=True)
            for i in range(threads)]
    for t in pool:
        t.start()
    for t in pool:
        while t.is_alive():
            t.join(timeout=0.5)
            report("touch", sum(done), total)
    if errors:
        raise errors[0]
    arr = None  # drop the view now (the workers' closure holds it)
