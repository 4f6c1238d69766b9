"""A worker's device KV pools for one ``Layout``, and the handles that share them with the daemon.

``DevicePools(layout, rows, device)`` allocates one buffer per pool per layer, each a
``torch.uint8`` tensor ``[rows[pool.index], pool.page_bytes]`` (``.layers[pool]``), zeroed:

* ``device="cuda:N"``: one CUDA allocation per pool (its layers are views), shared with the
  daemon through CUDA IPC (``export_buffer``: the storage's IPC handle, the storage's byte offset
  inside its allocator block, and the layer's byte offset inside the storage). Memory from
  ``expandable_segments`` or the ``cudaMallocAsync`` backend cannot be shared that way:
  ``check_ipc_allocator`` refuses it with a message that says what to change.
* ``device="cpu"``: one sealed memfd (``core.sealed_memfd.new_sealed_fd``: no file name, mode
  0600, its pages reserved, sealed against shrinking and growing) holding every layer region
  4 KiB-aligned, mapped with ``mmap``; a handle names the descriptor's place in ``fds()``
  (``"fd": 0``), the offset and the shape. ``Client.register`` hands the descriptor to the
  daemon over its descriptor socket; the seal is what lets the daemon map it safely (no process
  can cut the file under its mapping, which would make its next copy a SIGBUS). ``close()``
  closes the descriptor and the mapping; the memory goes with the last mapping (the daemon's
  included), and nothing is left behind when the worker dies.

``handles()`` -> ``{pool: [handle per layer]}`` and ``fds()`` (CPU: the one descriptor; GPU:
none) are what ``Client.register`` sends.
``make_ipc_events(n, device)`` creates interprocess CUDA events and their wire handles.
"""
from __future__ import annotations

import mmap
import os
import weakref
from typing import Any, Mapping

import torch

from hicache.core.ipc import check_ipc_allocator, export_buffers
from hicache.core.layout import Layout
from hicache.core.sealed_memfd import new_sealed_mapping

ALIGN = 4096


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


def _close_quietly(fd: int) -> None:
    try:
        os.close(fd)
    except OSError:
        pass


class DevicePools:
    """Every device pool of one stage (see the module docstring)."""

    def __init__(self, layout: Layout, rows: Mapping[str, int],
                 device: str | torch.device = "cpu") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.mode = "cuda" if self.device.type == "cuda" else "cpu"
        spaces = {p.index for p in layout.pools.values()}
        missing = sorted(s for s in spaces if rows.get(s, 0) <= 0)
        if missing:
            raise ValueError(f"device rows missing or not positive for spaces {missing}")
        self.rows = {s: int(rows[s]) for s in spaces}
        self.layers: dict[str, list[torch.Tensor]] = {}
        self._handles: dict[str, list[dict[str, Any]]] = {}
        self._fd = -1
        self._mm: mmap.mmap | None = None
        self._finalizer: Any = None
        if self.mode == "cuda":
            self._alloc_cuda()
        else:
            self._alloc_memfd()

    # GPU: one allocation per pool, per-layer views
    def _alloc_cuda(self) -> None:
        check_ipc_allocator()
        for name, spec in self.layout.pools.items():
            n = self.rows[spec.index]
            big = torch.zeros(spec.num_layers, n, spec.page_bytes, dtype=torch.uint8,
                              device=self.device)
            self.layers[name] = [big[i] for i in range(spec.num_layers)]

    # CPU: one sealed memfd, 4 KiB aligned regions
    def _alloc_memfd(self) -> None:
        plan, end = [], 0
        for name, spec in self.layout.pools.items():
            nbytes = self.rows[spec.index] * spec.page_bytes
            for _ in range(spec.num_layers):
                plan.append((name, end, self.rows[spec.index], spec.page_bytes))
                end = _align(end + nbytes)
        fd, mm = new_sealed_mapping("hicache-dev", max(end, ALIGN))
        self._fd, self._mm = fd, mm
        self._finalizer = weakref.finalize(self, _close_quietly, fd)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        for name, off, n, rb in plan:
            t = base[off: off + n * rb].view(n, rb)
            self.layers.setdefault(name, []).append(t)
            self._handles.setdefault(name, []).append(
                {"kind": "memfd", "fd": 0, "offset": off, "rows": n, "row_bytes": rb})

    def pool(self, name: str) -> list[torch.Tensor]:
        return self.layers[self.layout.pool(name).name]

    def handles(self) -> dict[str, list[dict[str, Any]]]:
        """{pool: [wire handle per layer]} for ``register``."""
        if self.mode == "cpu":
            return {k: [dict(h) for h in v] for k, v in self._handles.items()}
        if not self._handles:  # export once: every export creates a ref counter in torch
            self._handles = export_buffers(self.layers)
        return {k: [dict(h) for h in v] for k, v in self._handles.items()}

    def fds(self) -> list[int]:
        """The descriptors the handles name, in order (CPU: the pools' memfd; GPU: none)."""
        if self.mode == "cpu" and self._fd < 0:
            raise ValueError("these device pools are closed")
        return [self._fd] if self.mode == "cpu" else []

    def nbytes(self) -> int:
        return sum(t.numel() for layers in self.layers.values() for t in layers)

    def close(self) -> None:
        """Drop the tensors; in CPU mode close the memfd (the daemon's mapping stays valid) and
        unmap it here, unless a caller still holds a view of it (then it goes with that
        view)."""
        self.layers = {}
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None
            self._fd = -1
        if self._mm is not None:
            try:
                self._mm.close()
            except BufferError:  # a view outlives this object: the mapping stays with it
                pass
            self._mm = None

    def __enter__(self) -> "DevicePools":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
