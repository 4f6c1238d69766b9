"""One client's HiSparse host region: a sealed memfd the daemon makes and that engine maps.

Contract: ``SparseShm.create(layers, rows, page_bytes)`` (the daemon) makes an anonymous sealed
memfd (``core.sealed_memfd``: mode 0600, its memory reserved at once, so no memory is an
``OSError`` then, never a SIGBUS later; sealed against shrinking and growing, so an engine that
truncates its region gets EPERM instead of killing the daemon at its next touch of a row) of
one 4 KiB-aligned region of ``rows`` C4 page rows per C4 layer, then one 4 KiB page whose first
u64 is a random token. ``hand_out(handout)`` offers its descriptor once on the daemon's
descriptor socket (``core.fd_handout``) and returns the fields a ``sparse_region`` reply gives
(that socket and the token among them); ``SparseShm.open(info)`` (the engine) takes the
descriptor with the token (an ``OSError`` that says why when it cannot), checks the size and
token, and maps it; ``info()`` is the same fields without an offer. ``layers`` are per-layer ``[rows, page_bytes]`` uint8 tensors over the mapping (row
``k`` of every layer holds the same 64 C4 tokens of one request); ``nbytes`` (``bytes``) covers
the layers, not the token page. ``close()`` drops the layers; the creator also withdraws an offer not taken and closes its
memfd (Python's mapping keeps a descriptor of its own until it is unmapped, and the memory goes
with the last mapping, which goes with the last tensor view). Pinning is the caller's (the daemon registers ``base_ptr`` /
``nbytes`` with CUDA through its registrar); ``pin(device)`` page-locks this mapping for a GPU
(the engine's side) and ``close()`` unpins it again. ``sweep_old_regions(shm_dir)`` removes the
``hicache-sparse-*`` files earlier versions' killed daemons left in a shared-memory folder
(``shm_file.sweep_stale``: reserved at full size, they would hold tmpfs memory until a reboot).
"""
from __future__ import annotations

import mmap
from typing import Any

import torch

from .cuda_runtime import clear_runtime_error
from .fd_handout import FdHandout
from .sealed_memfd import Sealed, create_sealed, open_sealed
from .shm_file import sweep_stale
from .sizes import SPARSE_ALIGN as ALIGN, align_up, sparse_layers_bytes

SPARSE_PREFIX = "hicache-sparse-"
def sweep_old_regions(shm_dir: str) -> int:
    """Remove the region files (``/dev/shm/hicache-sparse-<pid>-<hex>``) that daemons of earlier
    versions were killed before unlinking; returns how many."""
    return sweep_stale(shm_dir, (SPARSE_PREFIX,))


class SparseShm:
    """One mapped sparse host region (see the module docstring)."""

    def __init__(self, mm: mmap.mmap, layers: int, rows: int, page_bytes: int,
                 token: int, sealed: Sealed | None = None) -> None:
        self._mm, self.rows, self.page_bytes = mm, rows, page_bytes
        self.token, self._sealed = token, sealed  # the daemon's memfd (None: the engine's)
        self.stride = align_up(rows * page_bytes, ALIGN)
        self.nbytes = sparse_layers_bytes(layers, rows, page_bytes)
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
        nbytes = sparse_layers_bytes(layers, rows, page_bytes)
        m = create_sealed(SPARSE_PREFIX, nbytes + ALIGN, nbytes)
        return cls(m.mm, layers, rows, page_bytes, m.token, m)

    @classmethod
    def open(cls, info: dict[str, Any]) -> "SparseShm":
        """Take, map and check the region a ``sparse_region`` reply (``hand_out``) offered."""
        layers, token = int(info["layers"]), int(info["token"])
        rows, pb = int(info["rows"]), int(info["page_bytes"])
        nbytes = sparse_layers_bytes(layers, rows, pb)
        mm = open_sealed(str(info["fds"]), token, nbytes + ALIGN, nbytes, "sparse region")
        return cls(mm, layers, rows, pb, token)

    def info(self) -> dict[str, Any]:
        """The region's shape and token (no offer: ``hand_out`` makes one)."""
        return {"token": self.token, "layers": len(self.layers), "rows": self.rows,
                "page_bytes": self.page_bytes, "layer_stride": self.stride,
                "bytes": self.nbytes}

    def hand_out(self, handout: FdHandout) -> dict[str, Any]:
        """Offer the memfd once on ``handout`` (the daemon's end); ``info()`` plus the socket
        the engine takes it from."""
        if self._sealed is None:
            raise ValueError("only the daemon's end of a sparse region can hand it out")
        return dict(self.info(), **self._sealed.offer(handout))

    def pin(self, device: torch.device) -> None:
        """Page-lock the mapping for ``device`` (once); ``close`` unpins it."""
        if self._pinned_on is not None:
            return
        with torch.cuda.device(device):
            rc = torch.cuda.cudart().cudaHostRegister(self.base_ptr, self.nbytes, 0)
        if int(rc) != 0:  # the error is ours to report, not the engine's next launch's
            clear_runtime_error()
            raise RuntimeError(f"cudaHostRegister of the sparse region failed ({int(rc)})")
        self._pinned_on = device.index if device.index is not None else \
            torch.cuda.current_device()

    def close(self) -> None:
        if self._pinned_on is not None:  # the caller's kernels no longer read it
            with torch.cuda.device(self._pinned_on):
                if int(torch.cuda.cudart().cudaHostUnregister(self.base_ptr)) != 0:
                    clear_runtime_error()  # (nothing else to do at close)
            self._pinned_on = None
        self.layers = []
        if self._sealed is not None:  # (the mapping keeps its own descriptor)
            self._sealed.close()
        # the mapping itself goes with the last tensor view (mmap refuses to close under them)
