"""Small host-to-device uploads (a plan's descriptor tables) at a few driver calls each.

Contract: ``upload(arrays, device)`` concatenates the int64 numpy ``arrays`` into one new int64
tensor on ``device``, copied on the current stream without blocking the host. Off a GPU it
returns the concatenation itself.

On a GPU the bytes go through pinned staging buffers owned by the calling thread: each buffer
has a driver event recorded right after the copy that reads it, and a buffer is written again
only once its event says that copy is done (otherwise the thread takes another one, or a new
one; past ``MAX_BUFFERS`` (32) it waits for the copy of the buffer used longest ago). So a
caller normally never waits, and no upload overwrites bytes a copy still reads: a buffer whose
event could not be recorded after its copy was queued is never used again (it stays allocated,
``_ORPHANS``). The copy and the event are raw driver calls
(``cuMemcpyHtoDAsync``, ``cuEventRecord``, ``cuEventQuery``) on the raw current stream of
``device``, with ``device`` made the current device for the call when it is not. A thread's
buffers live as long as the thread; when it ends, it first waits for the copies they may still
feed (PyTorch, which gets their memory back, knows nothing of those copies).

Why: on an H200 host, PyTorch's route (a pinned tensor per upload, ``copy_``, an event
recorded on ``current_stream()``) cost a daemon's issuer thread 0.2-0.27 ms of CPU per upload,
on the critical path of a load's later layers (docs/perf.md, twenty-second session).
"""
from __future__ import annotations

import ctypes
import threading
from dataclasses import dataclass
from typing import Optional, Sequence

import numpy as np
import torch

from .tables import TransferError

MIN_WORDS = 1 << 12  # a staging buffer's smallest size, in int64 words (32 KiB)
# staging buffers per thread; past it an upload waits for the oldest copy. A buffer is busy from
# its upload until the stream reaches that copy: with loads queued back to back, each load's
# plans hold one until the loads before it are copied. 32 lets that many plans wait in the
# stream before a thread (the issuer; the server's, when a load's layer 0 has segments)
# blocks. A buffer is 32 KiB, or the next power of two of a bigger plan's words.
MAX_BUFFERS = 32
_CU_EVENT_DISABLE_TIMING = 2
_CUDA_SUCCESS, _CUDA_ERROR_NOT_READY = 0, 600


class _Calls:
    """The driver functions an upload uses (``libcuda``, loaded once per process)."""

    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u64 = ctypes.c_void_p, ctypes.c_uint64
        self.htod = lib.cuMemcpyHtoDAsync_v2
        self.htod.argtypes = [u64, vp, ctypes.c_size_t, vp]
        self.create = lib.cuEventCreate
        self.create.argtypes = [ctypes.POINTER(vp), ctypes.c_uint]
        self.record = lib.cuEventRecord
        self.record.argtypes = [vp, vp]
        self.query = lib.cuEventQuery
        self.query.argtypes = [vp]
        self.sync = lib.cuEventSynchronize
        self.sync.argtypes = [vp]
        self.destroy = lib.cuEventDestroy_v2
        self.destroy.argtypes = [vp]
        for f in (self.htod, self.create, self.record, self.query, self.sync, self.destroy):
            f.restype = ctypes.c_int


_calls: Optional[_Calls] = None


def _driver() -> _Calls:
    global _calls
    if _calls is None:
        _calls = _Calls()
    return _calls


@dataclass(eq=False)  # a buffer is itself: compared by identity
class _Buffer:
    host: torch.Tensor  # pinned int64 words
    view: np.ndarray  # the same memory as numpy
    ptr: int  # its address
    device: int  # the GPU whose context made ``event``
    event: ctypes.c_void_p  # recorded after the last copy out of ``host`` (a driver event
    # never recorded reports done: a new buffer needs no flag)


class _Held(list[_Buffer]):
    """One thread's buffers, the one used longest ago first. When the thread ends they are
    dropped, and their pinned memory goes back to PyTorch, which knows nothing of the raw
    copies: so the end of a thread first waits for the copies its buffers may still feed."""

    def __del__(self) -> None:
        d = _calls
        if d is None:
            return
        for b in self:  # return codes ignored: at interpreter exit the driver may be gone
            d.sync(b.event)
            d.destroy(b.event)


class _Staging(threading.local):
    buffers: _Held

    def __init__(self) -> None:
        self.buffers = _Held()


_STAGING = _Staging()
# buffers whose copy was queued but whose event could not be recorded: nothing can tell when that
# copy is done, so they are neither written again nor given back to PyTorch
_ORPHANS: list[_Buffer] = []


def _check(rc: int, what: str) -> None:
    if rc != _CUDA_SUCCESS:
        raise TransferError(f"{what} failed with CUresult {rc}")


def _free_buffer(d: _Calls, n: int, device: int) -> _Buffer:
    """A staging buffer of at least ``n`` words on ``device`` whose last copy is done, moved to
    the end of the thread's list (the list runs from the buffer used longest ago)."""
    bufs = _STAGING.buffers
    for i, b in enumerate(bufs):
        if b.device == device and b.view.size >= n:
            rc = d.query(b.event)
            if rc == _CUDA_SUCCESS:
                bufs.append(bufs.pop(i))
                return b
            if rc != _CUDA_ERROR_NOT_READY:
                _check(rc, "cuEventQuery")
    if len(bufs) >= MAX_BUFFERS:  # wait for the copy of the buffer used longest ago, replace it
        old = bufs[0]
        _check(d.sync(old.event), "cuEventSynchronize")  # failed: the buffer stays, held
        del bufs[0]  # its copy is done: the buffer may go even if its event cannot be destroyed
        _check(d.destroy(old.event), "cuEventDestroy")
    ev = ctypes.c_void_p()
    _check(d.create(ctypes.byref(ev), _CU_EVENT_DISABLE_TIMING), "cuEventCreate")
    words = max(MIN_WORDS, 1 << max(0, n - 1).bit_length())
    try:
        host = torch.empty(words, dtype=torch.int64, pin_memory=True)
    except BaseException:
        d.destroy(ev)  # no buffer for it
        raise
    b = _Buffer(host, host.numpy(), host.data_ptr(), device, ev)
    bufs.append(b)
    return b


def upload(arrays: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """See the module docstring."""
    if device.type != "cuda":
        return torch.from_numpy(np.concatenate(arrays).astype(np.int64, copy=False))
    idx = device.index if device.index is not None else torch._C._cuda_getDevice()
    if torch._C._cuda_getDevice() != idx:  # the driver calls use the current context
        with torch.cuda.device(idx):
            return _upload(arrays, torch.device("cuda", idx))
    return _upload(arrays, torch.device("cuda", idx))


def _upload(arrays: Sequence[np.ndarray], device: torch.device) -> torch.Tensor:
    """``upload`` on a GPU that is the current device."""
    n = sum(int(a.size) for a in arrays)
    out = torch.empty(n, dtype=torch.int64, device=device)
    if n == 0:
        return out
    idx = out.device.index
    d = _driver()
    b = _free_buffer(d, n, idx)
    np.concatenate(arrays, out=b.view[:n])
    stream = torch._C._cuda_getCurrentRawStream(idx)
    _check(d.htod(out.data_ptr(), b.ptr, 8 * n, stream), "cuMemcpyHtoDAsync")
    _record(d, b, stream)
    return out


def _record(d: _Calls, b: _Buffer, stream: int) -> None:
    """Record ``b``'s event after the copy just queued out of it; when that fails, its old
    event would say done while the copy may still read it: ``b`` goes to ``_ORPHANS``."""
    rc = d.record(b.event, stream)
    if rc != _CUDA_SUCCESS:
        _STAGING.buffers.remove(b)
        _ORPHANS.append(b)
        _check(rc, "cuEventRecord")
