"""Checks and small helpers the copy entry points share (``dispatch`` and ``by_layer``).

* ``_check_pair(src, dst)`` raises ``TransferError`` unless two buffers can be copied between
  (same layer count and row size, one GPU at most).
* ``_pinned(t)``: every layer of ``t`` is pinned or registered host memory (cached per table).
* ``_check_ctas(ctas)``: a positive int, or ``TransferError``.
* ``_dma_direction(src, dst, any_rows=False)``: ``"h2d"`` / ``"d2h"`` when whole rows of this
  pair (``any_rows``: blocks of rows or tokens, whatever one row's size) may go to the copy
  engines, else ``""``.
"""
from __future__ import annotations

from . import copy_engine
from .tables import LayerTable, TransferError


def _check_pair(src: LayerTable, dst: LayerTable) -> None:
    if src.num_layers != dst.num_layers:
        raise TransferError(f"source has {src.num_layers} layers, destination {dst.num_layers}")
    if src.row_bytes != dst.row_bytes:
        raise TransferError(f"source rows are {src.row_bytes} B, destination rows "
                            f"{dst.row_bytes} B")
    if src.is_cuda and dst.is_cuda and src.device != dst.device:
        raise TransferError(f"source on {src.device}, destination on {dst.device}: one GPU only")


def _pinned(t: LayerTable) -> bool:
    cached = getattr(t, "_pinned", None)
    if cached is None:
        cached = all(x.is_pinned() for x in t.layers)
        t._pinned = cached
    return cached


def _check_ctas(ctas: int) -> int:
    if not isinstance(ctas, int) or isinstance(ctas, bool) or ctas < 1:
        raise TransferError(f"ctas must be a positive int, got {ctas!r}")
    return ctas


def _dma_direction(src: LayerTable, dst: LayerTable, any_rows: bool = False) -> str:
    """``"h2d"`` / ``"d2h"`` when whole rows of this pair may go to the copy engines (one side on
    the GPU, the other pinned host memory the GPU sees at its own address, rows of
    ``copy_engine.MIN_BYTES`` or more), else ``""``. ``any_rows``: whatever the row size (the
    direction of blocks of several rows or tokens, which may reach ``MIN_BYTES`` where one
    row does not)."""
    if src.is_cuda == dst.is_cuda or (src.row_bytes < copy_engine.MIN_BYTES and not any_rows):
        return ""
    if not (src.uva and dst.uva and _pinned(dst if src.is_cuda else src)):
        return ""
    return "d2h" if src.is_cuda else "h2d"
