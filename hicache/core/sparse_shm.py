"""One client's HiSparse host region: a sealed memfd the daemon makes and that engine maps.

Contract: ``SparseShm.create(layers, rows, page_bytes)`` (the daemon) makes an anonymous sealed
memfd (``core.sealed_memfd``: mode 0600, its memory reserved at once, so no memory is an
``OSError`` then, never a SIGBUS later; sealed against shrinking and growing, so an engine that
truncates its region gets EPERM instead of killing the daemon at its next touch of a row) of
one 4 KiB-aligned region of ``rows`` C4 page rows per C4 layer, then one 4 KiB page whose first
u64 is a random token. ``info()`` names it as ``/proc/<daemon pid>/fd/<fd>`` with that token;
``SparseShm.open(info)`` (the engine) opens that path (a process of the daemon's uid in its pid
namespace, /proc not restricted: else an ``OSError`` that says so), checks the size and token,
and maps it. ``layers`` are per-layer ``[rows, page_bytes]`` uint8 tensors over the mapping (row
``k`` of every layer holds the same 64 C4 tokens of one request); ``nbytes`` (``bytes``) covers
the layers, not the token page. ``close()`` drops the layers; the creator also closes its memfd
(the path the reply named no longer opens it; Python's mapping keeps a descriptor of its own
until it is unmapped, and the memory goes with the last mapping, which goes with the last tensor
view). Pinning is the caller's (the daemon registers ``base_ptr`` /
``nbytes`` with CUDA through its registrar); ``pin(device)`` page-locks this mapping for a GPU
(the engine's side) and ``close()`` unpins it again. ``sweep_old_regions(shm_dir)`` removes the
``hicache-sparse-*`` files earlier versions' killed daemons left in a shared-memory folder
(``shm_file.sweep_stale``: reserved at full size, they would hold tmpfs memory until a reboot).
"""
from __future__ import annotations

import mmap
import os
from typing import Any

import torch

from .sealed_memfd import create_sealed, open_sealed
from .shm_file import sweep_stale

SPARSE_PREFIX = "hicache-sparse-"
ALIGN = 4096


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _region_bytes(layers: int, rows: int, page_bytes: int) -> int:
    """The layers' bytes; the memfd holds one token page more, at this offset."""
    return max(ALIGN, layers * _align(rows * page_bytes))


def sweep_old_regions(shm_dir: str) -> int:
    """Remove the region files (``/dev/shm/hicache-sparse-<pid>-<hex>``) that daemons of earlier
    versions were killed before unlinking; returns how many."""
    return sweep_stale(shm_dir, (SPARSE_PREFIX,))


class SparseShm:
    """One mapped sparse host region (see the module docstring)."""

    def __init__(self, path: str, mm: mmap.mmap, layers: int, rows: int, page_bytes: int,
                 token: int, fd: int = -1) -> None:
        self.path, self._mm, self.rows, self.page_bytes = path, mm, rows, page_bytes
        self.token, self._fd = token, fd  # fd: the daemon's memfd (-1: the engine's mapping)
        self.stride = _align(rows * page_bytes)
        self.nbytes = _region_bytes(layers, rows, page_bytes)
        self._pinned_on: int | None = None  # the GPU ``pin`` page-locked it for
        base = torch.frombuffer(mm, dtype=torch.uint8)
        self.base_ptr = int(base.data_ptr())
        self.layers = [base[l * self.stride: l * self.stride + rows * page_bytes]
                       .view(rows, page_bytes) for l in range(layers)]

    @classmethod
    def create(cls, layers: int, rows: int, page_bytes: int) -> "SparseShm":
        if layers <= 0 or rows <= 0 or page_bytes <= 0:
            raise ValueError(f"sparse region needs positive layers, rows and page bytes, got "
                             f"{layers}, {rows}, {page_bytes}")
        nbytes = _region_bytes(layers, rows, page_bytes)
        m = create_sealed(SPARSE_PREFIX, nbytes + ALIGN, nbytes)
        return cls(m.path, m.mm, layers, rows, page_bytes, m.token, m.fd)

    @classmethod
    def open(cls, info: dict[str, Any]) -> "SparseShm":
        """Open and map the region ``info`` (a ``sparse_region`` reply) names, and check it."""
        path, layers = str(info["path"]), int(info["layers"])
        rows, pb, token = int(info["rows"]), int(info["page_bytes"]), int(info["token"])
        nbytes = _region_bytes(layers, rows, pb)
        mm = open_sealed(path, nbytes + ALIGN, token, nbytes, "sparse region")
        return cls(path, mm, layers, rows, pb, token)

    def info(self) -> dict[str, Any]:
        return {"path": self.path, "token": self.token, "layers": len(self.layers),
                "rows": self.rows, "page_bytes": self.page_bytes, "layer_stride": self.stride,
                "bytes": self.nbytes}

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for ``device`` (once); ``close`` unpins it."""
        if self._pinned_on is not None:
            return
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.nbytes, 0)
        if int(rc) != 0:
            raise RuntimeError(f"cudaHostRegister of the sparse region failed ({int(rc)})")
        self._pinned_on = device.index if device.index is not None else \
            torch.cuda.current_device()

    def close(self) -> None:
        if self._pinned_on is not None:  # the caller's kernels no longer read it
            with torch.cuda.device(self._pinned_on):
                torch.cuda.cudart().cudaHostUnregister(self.base_ptr)
            self._pinned_on = None
        self.layers = []
        if self._fd >= 0:  # the path the reply named goes (the mapping keeps its own descriptor)
            os.close(self._fd)
            self._fd = -1
        # the mapping itself goes with the last tensor view (mmap refuses to close under them)
