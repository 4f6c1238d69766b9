"""One client's HiSparse host region as a named shared-memory file the daemon and that engine map.

Contract: ``SparseShm.create(shm_dir, layers, rows, page_bytes)`` (the daemon) makes
``/dev/shm/hicache-sparse-<pid>-<random>``, mode 0600, exclusive, one 4 KiB-aligned region of
``rows`` C4 page rows per C4 layer, its memory reserved at once (a full tmpfs is an
``OSError`` then, never a SIGBUS later); ``SparseShm.open(info)`` (the engine) maps the file a
``info()`` dict describes, checking its size. ``layers`` are per-layer ``[rows, page_bytes]``
uint8 tensors over the mapping (row ``k`` of every layer holds the same 64 C4 tokens of one
request). ``close()`` drops the mapping; the creator also unlinks the file. Pinning is the
caller's (the daemon registers the mapping with CUDA through its registrar); ``pin(device)``
page-locks this mapping for a GPU (the engine's side) and ``close()`` unpins it again. A
creator sweeps the files of creators that died (``shm_file.sweep_stale``: a killed daemon's
regions, reserved at full size, would hold tmpfs memory until a reboot).
"""
from __future__ import annotations

import mmap
import os
import secrets
from typing import Any

import torch

from .shm_file import new_mapped_file, sweep_stale

SPARSE_PREFIX = "hicache-sparse-"
ALIGN = 4096


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


class SparseShm:
    """One mapped sparse host region (see the module docstring)."""

    def __init__(self, path: str, mm: mmap.mmap, layers: int, rows: int, page_bytes: int,
                 owner: bool) -> None:
        self.path, self._mm, self.rows, self.page_bytes = path, mm, rows, page_bytes
        self.stride = _align(rows * page_bytes)
        self.nbytes = max(ALIGN, layers * self.stride)
        self._owner = owner
        self._pinned_on: int | None = None  # the GPU ``pin`` page-locked it for
        base = torch.frombuffer(mm, dtype=torch.uint8)
        self.base_ptr = int(base.data_ptr())
        self.layers = [base[l * self.stride: l * self.stride + rows * page_bytes]
                       .view(rows, page_bytes) for l in range(layers)]

    @classmethod
    def create(cls, shm_dir: str, layers: int, rows: int, page_bytes: int) -> "SparseShm":
        if layers <= 0 or rows <= 0 or page_bytes <= 0:
            raise ValueError(f"sparse region needs positive layers, rows and page bytes, got "
                             f"{layers}, {rows}, {page_bytes}")
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shared-memory directory {shm_dir} does not exist")
        sweep_stale(shm_dir, (SPARSE_PREFIX,))
        path = os.path.join(shm_dir, f"{SPARSE_PREFIX}{os.getpid()}-{secrets.token_hex(6)}")
        nbytes = max(ALIGN, layers * _align(rows * page_bytes))
        return cls(path, new_mapped_file(path, nbytes, reserve=True), layers, rows, page_bytes,
                   owner=True)

    @classmethod
    def open(cls, info: dict[str, Any]) -> "SparseShm":
        """Map the region ``info`` (a ``sparse_region`` reply) describes."""
        path, layers = str(info["path"]), int(info["layers"])
        rows, pb = int(info["rows"]), int(info["page_bytes"])
        if not os.path.basename(path).startswith(SPARSE_PREFIX):
            raise ValueError(f"{path} is not a hicache sparse region")
        fd = os.open(path, os.O_RDWR)
        try:
            size = os.fstat(fd).st_size
            want = max(ALIGN, layers * _align(rows * pb))
            if size != want:
                raise ValueError(f"{path} has {size} bytes; {layers} layers x {rows} rows of "
                                 f"{pb} B need {want}")
            mm = mmap.mmap(fd, size)
        finally:
            os.close(fd)
        return cls(path, mm, layers, rows, pb, owner=False)

    def info(self) -> dict[str, Any]:
        return {"path": self.path, "layers": len(self.layers), "rows": self.rows,
                "page_bytes": self.page_bytes, "layer_stride": self.stride,
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
        if self._owner:
            try:
                os.unlink(self.path)
            except FileNotFoundError:
                pass
        # the mapping itself goes with the last tensor view (mmap refuses to close under them)
