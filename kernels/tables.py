"""Shared vocabulary of the copy paths: ``TransferError``, ``TokenFormat`` and ``LayerTable``.

A buffer is a list of per-layer 2-D ``torch.uint8`` tensors ``[rows, row_bytes]`` (device
memory, or pinned host memory the GPU can address). ``LayerTable`` wraps one such list, checks
that every layer has the same shape, row stride and device, and caches the int64 table of the
layers' base addresses on each device a kernel runs on (built once, uploaded on a stream of its
own and waited for, so any stream may use it at once; reused by every call).
``upload_tables(tables, device)`` makes many such tables with one wait (the daemon, before its
first copy needs them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Optional, Sequence, Union

import torch


class TransferError(ValueError):
    """A copy request that cannot be carried out; raised before anything is launched."""


@dataclass(frozen=True)
class TokenFormat:
    """Token layout inside one page row: value of slot s at ``s * value_bytes``, its scale at
    ``scale_offset + s * scale_bytes``; ``page_bytes`` is the row size, padding included."""

    tokens_per_page: int
    value_bytes: int
    scale_bytes: int
    scale_offset: int
    page_bytes: int

    def __post_init__(self) -> None:
        P, vb, sb = self.tokens_per_page, self.value_bytes, self.scale_bytes
        if P <= 0 or vb <= 0 or sb < 0:
            raise TransferError(f"bad token format {self}: tokens_per_page and value_bytes must "
                                f"be positive, scale_bytes not negative")
        if self.scale_offset < P * vb:
            raise TransferError(f"bad token format {self}: scales at {self.scale_offset} overlap "
                                f"the {P} values ending at {P * vb}")
        if self.scale_offset + P * sb > self.page_bytes:
            raise TransferError(f"bad token format {self}: scales end at "
                                f"{self.scale_offset + P * sb} > page_bytes {self.page_bytes}")

    @property
    def covers_row(self) -> bool:
        """Whether the tokens' values and scales are every byte of the row (no padding): only
        then is a copy of whole pages the same as a copy of their tokens."""
        P, vb, sb = self.tokens_per_page, self.value_bytes, self.scale_bytes
        if sb == 0:
            return P * vb == self.page_bytes
        return self.scale_offset == P * vb and self.scale_offset + P * sb == self.page_bytes

    @property
    def token_bytes(self) -> int:
        """Useful bytes one token moves (value + scale)."""
        return self.value_bytes + self.scale_bytes

    @classmethod
    def mla(cls, tokens_per_page: int, value_bytes: int = 576, scale_bytes: int = 8) -> "TokenFormat":
        """The fp8 MLA page format: values, then scales, zero padding to a multiple of 576 B."""
        P = tokens_per_page
        page = math.ceil(P * (value_bytes + scale_bytes) / value_bytes) * value_bytes
        return cls(P, value_bytes, scale_bytes, P * value_bytes, page)

    @classmethod
    def packed(cls, tokens_per_page: int, value_bytes: int, scale_bytes: int) -> "TokenFormat":
        """Values then scales, no padding (the C4 indexer K cache: 128 + 4 fp8, 64 + 4 fp4)."""
        P = tokens_per_page
        return cls(P, value_bytes, scale_bytes, P * value_bytes, P * (value_bytes + scale_bytes))

    @classmethod
    def from_spec(cls, spec: object) -> "TokenFormat":
        """From anything with the ``PoolSpec`` attributes of ``hicache.core.layout``."""
        return cls(int(spec.tokens_per_page), int(spec.value_bytes), int(spec.scale_bytes),
                   int(spec.scale_offset), int(spec.page_bytes))


def _pow2_align(*values: int, cap: int = 16) -> int:
    """Largest power of two <= cap dividing every value (0 divides by anything)."""
    a = cap
    for v in values:
        while a > 1 and v % a:
            a //= 2
    return a


class LayerTable:
    """One buffer: same-shaped per-layer ``[rows, row_bytes]`` uint8 tensors plus cached
    per-device int64 tables of their base addresses (the kernels' per-layer pointer table)."""

    def __init__(self, layers: Sequence[torch.Tensor], name: str = "buffer",
                 device_ptrs: Optional[Sequence[int]] = None) -> None:
        """``device_ptrs``: the layers' addresses as the GPU sees them, for registered host
        memory on platforms where ``cudaHostGetDevicePointer`` differs from the host pointer
        (default: the tensors' own addresses, right under UVA)."""
        layers = list(layers)
        if not layers:
            raise TransferError(f"{name}: no layers")
        first = layers[0]
        for i, t in enumerate(layers):
            if not isinstance(t, torch.Tensor):
                raise TransferError(f"{name}[{i}]: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != torch.uint8 or t.dim() != 2:
                raise TransferError(f"{name}[{i}]: expected a 2-D torch.uint8 tensor "
                                    f"[rows, row_bytes], got {t.dtype} of shape {tuple(t.shape)}")
            if t.stride(1) != 1 or t.stride(0) < t.shape[1]:
                raise TransferError(f"{name}[{i}]: rows must be dense byte ranges, got strides "
                                    f"{t.stride()} for shape {tuple(t.shape)}")
            if t.shape != first.shape or t.stride() != first.stride():
                raise TransferError(f"{name}[{i}]: shape {tuple(t.shape)} stride {t.stride()} differs "
                                    f"from layer 0's {tuple(first.shape)} {first.stride()}")
            if t.device != first.device:
                raise TransferError(f"{name}[{i}]: on {t.device}, layer 0 is on {first.device}")
        self.name = name
        self.layers = layers
        self.num_layers = len(layers)
        self.rows, self.row_bytes = int(first.shape[0]), int(first.shape[1])
        self.stride = int(first.stride(0))
        self.device = first.device
        self.is_cuda = first.device.type == "cuda"
        self.ptrs = [int(t.data_ptr()) for t in layers]
        if device_ptrs is not None:
            if len(device_ptrs) != len(layers):
                raise TransferError(f"{name}: {len(device_ptrs)} device pointers for "
                                    f"{len(layers)} layers")
            self.ptrs = [int(p) for p in device_ptrs]
        # the GPU sees these layers at their own addresses (what the copy engines need)
        self.uva = self.ptrs == [int(t.data_ptr()) for t in layers]
        self.align = _pow2_align(self.stride, *self.ptrs)
        self._tables: dict[torch.device, torch.Tensor] = {}

    def table(self, device: torch.device) -> torch.Tensor:
        """int64 tensor of the layers' base addresses, on ``device`` (cached; the first call
        per device uploads it: ``upload_tables``)."""
        t = self._tables.get(device)
        if t is None:
            upload_tables([self], device)
            t = self._tables[device]
        return t

    def contiguous_rows(self) -> bool:
        """True when each layer's rows are packed back to back (a run of rows is one range)."""
        return self.stride == self.row_bytes

    def __repr__(self) -> str:
        return (f"LayerTable({self.name}: {self.num_layers} x [{self.rows}, {self.row_bytes}] "
                f"stride {self.stride} on {self.device})")


Buffer = Union[LayerTable, Sequence[torch.Tensor]]


def upload_tables(tables: Iterable[LayerTable], device: torch.device) -> int:
    """Each table's pointer table (``LayerTable.table``) on ``device``, made now where not cached
    yet; returns how many were made. On a GPU every upload goes on one stream of its own, all
    waited for once: the cached table is used on every stream (a backup's, a load's), so its
    upload must not sit queued behind one stream's work while another's kernel reads it (and
    through pinned memory: a pageable upload would wait for that stream to drain). That wait is
    what a table's first use costs, more while another process keeps the GPU busy (each wait
    then waits for this process's time slice): the daemon makes its tables at start and at
    ``register`` (``controllers/warm_copies``), not at a copy."""
    todo = [t for t in dict.fromkeys(tables) if device not in t._tables]
    if not todo:
        return 0
    made = [torch.tensor(t.ptrs, dtype=torch.int64) for t in todo]
    if device.type == "cuda":
        side = _upload_stream(device)
        with torch.cuda.stream(side):
            made = [m.pin_memory().to(device, non_blocking=True) for m in made]
        side.synchronize()
    for t, m in zip(todo, made):
        t._tables[device] = m
    return len(todo)


def as_table(buf: Buffer, name: str) -> LayerTable:
    """Accept a LayerTable (cached tables) or a list of per-layer tensors (a new table)."""
    return buf if isinstance(buf, LayerTable) else LayerTable(buf, name)


_UPLOAD_STREAMS: dict[torch.device, "torch.cuda.Stream"] = {}


def _upload_stream(device: torch.device) -> "torch.cuda.Stream":
    """A stream per GPU for the layer tables' one-time uploads (``LayerTable.table``)."""
    s = _UPLOAD_STREAMS.get(device)
    if s is None:
        s = _UPLOAD_STREAMS[device] = torch.cuda.Stream(device)
    return s
