"""``PagedHostPool``: the host mirror of one device pool, one ``[num_rows, page_bytes]`` view per layer.

Contract: ``PagedHostPool(spec, num_rows, arena, offset)`` carves ``spec.num_layers`` regions from
``arena`` starting at ``offset``, **layer-major**: layer ``l`` is the contiguous block
``[offset + l * stride, + num_rows * page_bytes)`` with ``stride`` = that size rounded up to
4 KiB (``sizing.REGION_ALIGN``). So one layer's rows are contiguous exactly like the device
pool's per-layer buffer, and a page-aligned transfer is a plain row copy per layer (row ``k``
of layer ``l`` is ``layers[l][k]``, byte-identical to the device row). Row 0 is valid.

* ``.layers: list[torch.Tensor]`` (uint8, ``[num_rows, spec.page_bytes]``, views of the arena)
* ``.layer_ptrs()`` host addresses, ``.device_ptrs()`` device addresses (equal under UVA)
* ``.buffer_infos() -> list[(ptr, nbytes, item_bytes)]`` per layer, for registering the host
  pool with a transfer engine (PD direct-to-host)
* ``.nbytes`` (span in the arena, alignment included), ``.data_bytes`` (without alignment)
"""
from __future__ import annotations

import torch

from hicache.core.layout import PoolSpec

from .arena import PinnedArena
from .errors import PoolError
from hicache.core.sizes import REGION_ALIGN, align_up

BufferInfo = tuple[int, int, int]  # (ptr, nbytes, item_bytes)


def layer_stride(spec: PoolSpec, num_rows: int) -> int:
    return align_up(num_rows * spec.page_bytes, REGION_ALIGN)


class PagedHostPool:
    """One device pool's host mirror: per-layer row-major views into the arena."""

    def __init__(self, spec: PoolSpec, num_rows: int, arena: PinnedArena, offset: int) -> None:
        if isinstance(num_rows, bool) or not isinstance(num_rows, int) or num_rows <= 0:
            raise PoolError(f"pool {spec.name}: row count must be a positive int, got {num_rows!r}")
        if offset % REGION_ALIGN:
            raise PoolError(f"pool {spec.name}: offset {offset} is not {REGION_ALIGN}-aligned")
        self.spec = spec
        self.num_rows = num_rows
        self.arena = arena
        self.offset = offset
        self.stride = layer_stride(spec, num_rows)
        self.data_bytes = num_rows * spec.page_bytes * spec.num_layers
        self.nbytes = self.stride * spec.num_layers
        n = num_rows * spec.page_bytes
        if offset + (spec.num_layers - 1) * self.stride + n > arena.nbytes:
            raise PoolError(
                f"pool {spec.name}: {spec.num_layers} layers x {num_rows} rows x "
                f"{spec.page_bytes} B at offset {offset} do not fit the {arena.nbytes}-byte arena"
            )
        self.layers: list[torch.Tensor] = [
            arena.tensor(offset + i * self.stride, n).view(num_rows, spec.page_bytes)
            for i in range(spec.num_layers)
        ]

    @property
    def name(self) -> str:
        return self.spec.name

    def layer_ptrs(self) -> list[int]:
        return [t.data_ptr() for t in self.layers]

    def device_ptrs(self) -> list[int]:
        return [self.arena.device_address(self.offset + i * self.stride)
                for i in range(len(self.layers))]

    def buffer_infos(self) -> list[BufferInfo]:
        return [(t.data_ptr(), t.numel(), self.spec.page_bytes) for t in self.layers]

    def __repr__(self) -> str:
        return (f"PagedHostPool({self.spec.name}, index={self.spec.index}, rows={self.num_rows}, "
                f"layers={self.spec.num_layers}, page_bytes={self.spec.page_bytes})")
