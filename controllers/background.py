"""Work the server loop hands off so that it keeps answering: CPU priority and unmapping.

* ``background_priority()``: called by a bulk-work thread (the CPU copy worker, the unmapper) on
  itself: it runs at ``BACKGROUND_NICE`` (Linux: ``setpriority`` on the thread id; the OpenMP
  threads it starts afterwards inherit it). The server thread keeps nice 0, so on a machine
  with few cores a large copy or an unmapping yields the CPU to the loop instead of competing
  with it. Where the call is refused it logs once and changes nothing else.
* ``cpu_copy_thread()``: called by the CPU-mode transfer thread on itself: ``background_priority``
  plus at most one thread fewer than the cores this process may run on for its copies (torch's
  intra-op threads, at least one), so the server loop always finds a core free of copies.
* ``Unmapper``: ``hand(objects)`` takes a closed worker's device side (its tables and tensor
  views, and what keeps its mappings alive: ``mmap.mmap`` objects in CPU mode, CUDA IPC
  storages on GPU) and drops it on its own thread, so that neither the tensors' teardown
  (~0.3 ms of Python for a worker) nor the ``munmap`` (tens of ms per GB) or the IPC close runs
  on the loop. The views are dropped first; a job without mmaps (CUDA IPC storages) is held
  ``GRACE_S`` before (the loop drops the operation that used them within the same turn).
  An ``mmap`` is dropped once no tensor references it any more (its refcount shows only our
  hold; tensors made by ``torch.frombuffer`` hold a reference to it), so the thread that lets
  go of the last view never unmaps; after ``WAIT_S`` it is dropped anyway (a view still alive
  then unmaps whenever that view dies). An unreferenced shared mapping is first emptied
  ``ZAP_BYTES`` at a time (``MADV_DONTNEED``: page-table entries dropped, the file's data
  untouched), so the final ``munmap`` is short and no single step holds the process's memory
  map lock for long (the loop allocating memory would wait on it). The ``madvise`` goes through
  ``ctypes``, which lets go of the GIL for the call (``mmap.madvise`` keeps it: 0.1-0.5 ms per
  step that the loop could not run Python). The thread starts on the first ``hand`` and ends
  when its queue stays empty; ``pending()`` counts jobs not yet dropped; ``flush(timeout)``
  waits for them (tests, shutdown).
* ``Jobs``: ``run(fn)`` calls ``fn()`` on its own thread at background priority, in order
  (the release's zero-on-free of a gone client's rows: torch's fill lets go of the GIL). The
  thread starts on the first job and ends when idle; a job that raises is logged.
"""
from __future__ import annotations

import ctypes
import logging
import mmap
import os
import queue
import sys
import threading
import time
from typing import Any, Sequence

log = logging.getLogger("hicache.daemon")

BACKGROUND_NICE = 10
WAIT_S = 30.0  # longest wait for the last view of a mapping to go
GRACE_S = 0.05  # hold of non-mmap objects (CUDA storages) before dropping them
IDLE_EXIT_S = 2.0  # the thread ends after this long without work
ZAP_BYTES = 4 << 20  # page-table entries dropped per step before an unmap
_warned = False


def background_priority(nice: int = BACKGROUND_NICE) -> bool:
    """Lower the calling thread's CPU priority to ``nice`` (never raise it: a thread already
    nicer stays so); False where that is refused."""
    global _warned
    try:
        tid = threading.get_native_id()
        os.setpriority(os.PRIO_PROCESS, tid, max(nice, os.getpriority(os.PRIO_PROCESS, tid)))
        return True
    except (OSError, AttributeError) as e:
        if not _warned:
            _warned = True
            log.warning("cannot lower the priority of background thread %s (%s); it competes "
                        "with the server loop at the same priority",
                        threading.current_thread().name, e)
        return False


def cpu_copy_thread() -> int:
    """Set up the calling thread as the CPU copy thread; returns its intra-op thread count."""
    import torch

    background_priority()
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):
        cores = os.cpu_count() or 1
    want = max(1, cores - 1)
    if torch.get_num_threads() > want:
        torch.set_num_threads(want)
    return torch.get_num_threads()


class _Worker:
    """One daemon thread serving a queue in order: started by the first item, gone after
    ``IDLE_EXIT_S`` without one. Subclasses say what an item is (``_handle``)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self._q: queue.SimpleQueue[Any] = queue.SimpleQueue()
        self._lock = threading.Lock()
        self._thread: threading.Thread | None = None

    def _put(self, item: Any) -> None:
        with self._lock:
            self._q.put(item)
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name=self.name, daemon=True)
                self._thread.start()

    def _loop(self) -> None:
        background_priority()
        while True:
            try:
                item = self._q.get(timeout=IDLE_EXIT_S)
            except queue.Empty:
                with self._lock:
                    if self._q.empty():
                        self._thread = None
                        return
                continue
            self._handle(item)
            item = None  # hold nothing while idle

    def _handle(self, item: Any) -> None:
        raise NotImplementedError


class Unmapper(_Worker):
    """Drops device mappings off the server thread (see the module docstring)."""

    def __init__(self) -> None:
        super().__init__("hicache-unmap")
        self._pending = 0

    def hand(self, objects: Sequence[Any]) -> None:
        """Take over ``objects`` (the caller drops its own references); drop them off-loop."""
        if not objects:
            return
        with self._lock:
            self._pending += 1
        self._put(list(objects))

    def pending(self) -> int:
        return self._pending

    def flush(self, timeout: float) -> bool:
        """Wait until every handed job was dropped; False on timeout."""
        deadline = time.monotonic() + timeout
        while self._pending and time.monotonic() < deadline:
            time.sleep(0.002)
        return self._pending == 0

    def _handle(self, job: list[Any]) -> None:
        maps = [o for o in job if isinstance(o, mmap.mmap)]
        if not maps:  # CUDA IPC storages: after a grace
            time.sleep(GRACE_S)
        job.clear()  # the views first (they may hold the mappings)
        _empty_unreferenced(maps)  # its locals are gone on return: maps holds the last refs
        maps.clear()  # the munmap / IPC close happens here, on this thread
        with self._lock:
            self._pending -= 1


class Jobs(_Worker):
    """Callables run in order on one background thread (see the module docstring)."""

    def run(self, fn: Any) -> None:
        self._put(fn)

    def _handle(self, fn: Any) -> None:
        try:
            fn()
        except Exception:  # noqa: BLE001 - keep serving the next jobs
            log.exception("background job of %s failed", self.name)


def _empty_unreferenced(maps: list[mmap.mmap]) -> None:
    """Wait until each of ``maps`` is referenced by ``maps`` alone (bounded by ``WAIT_S``),
    then empty those that are (``_zap``)."""
    deadline = time.monotonic() + WAIT_S
    held = list(range(len(maps)))
    while True:
        # two references when nothing else holds it: the list's and getrefcount's argument
        held = [i for i in held if sys.getrefcount(maps[i]) > 2]
        if not held or time.monotonic() >= deadline:
            break
        time.sleep(0.005)
    for i in range(len(maps)):
        if i not in held:
            _zap(maps[i])


_madvise: Any = None


def _address(m: mmap.mmap) -> int | None:
    """The start address of a writable mapping (None when it has none: closed, read-only)."""
    try:
        view = ctypes.c_char.from_buffer(m)  # a buffer export, released right below
    except (TypeError, ValueError, BufferError):
        return None
    addr = ctypes.addressof(view)
    del view
    return addr


def _zap(m: mmap.mmap) -> None:
    """Drop the page-table entries of an unreferenced shared mapping, a step at a time, each
    ``madvise`` without the GIL (``mmap.madvise``, holding it, where ctypes cannot serve)."""
    global _madvise
    try:
        n = len(m)
        addr = _address(m)
        if addr is not None and _madvise is None:
            fn = ctypes.CDLL(None, use_errno=True).madvise
            fn.argtypes, fn.restype = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int], ctypes.c_int
            _madvise = fn
        for off in range(0, n, ZAP_BYTES):
            k = min(ZAP_BYTES, n - off)
            if addr is None or _madvise(addr + off, k, mmap.MADV_DONTNEED) != 0:
                m.madvise(mmap.MADV_DONTNEED, off, k)
            time.sleep(0)  # the loop may take the GIL between steps
    except (ValueError, OSError, AttributeError):
        pass  # closed, or no madvise here: the unmap does it all at once
