"""CPU copies of a few ids, id by id, without torch dispatch overhead; and slot clearing.

* ``copy_few(src, dst, src_ids, dst_ids, fmt) -> path``: rows (or tokens of ``fmt``) of every
  layer through a strided numpy view of all layers (``"numpy"``, ~2 us per id) when both
  buffers' layers are equally spaced in memory, else ``ctypes.memmove`` per layer and id
  (``"memmove"``). For a handful of ids this beats ~10 us per layer per torch op; larger copies
  belong to ``dispatch`` (the reference path releases the GIL).
* ``clear_slots(layers, ring, fp32, slots, draft)``: zero request-slot rows, or apply the MTP
  draft rule to an fp32 state ring. Runs on the tensors' device (CPU or the current stream).
"""
from __future__ import annotations

import ctypes
from typing import Sequence

import numpy as np
import torch
from numpy.lib.stride_tricks import as_strided

from .tables import LayerTable, TokenFormat, TransferError

_memmove = ctypes.memmove


def _np3(table: LayerTable) -> np.ndarray | None:
    """A numpy ``[layers, rows, row_bytes]`` view of a CPU buffer whose layers are equally
    spaced in memory (host pools and ``DevicePools`` are), cached on the table; else None."""
    v = getattr(table, "_hicache_np3", False)
    if v is not False:
        return v
    v = None
    p = table.ptrs
    if not table.is_cuda:
        step = p[1] - p[0] if len(p) > 1 else 0
        if step >= 0 and all(p[i + 1] - p[i] == step for i in range(len(p) - 1)):
            span = (len(p) - 1) * step + (table.rows - 1) * table.stride + table.row_bytes
            raw = np.frombuffer((ctypes.c_uint8 * span).from_address(p[0]), dtype=np.uint8)
            v = as_strided(raw, shape=(len(p), table.rows, table.row_bytes),
                           strides=(step, table.stride, 1))
    table._hicache_np3 = v  # type: ignore[attr-defined]
    return v


def copy_few(src: LayerTable, dst: LayerTable, src_ids: Sequence[int], dst_ids: Sequence[int],
             fmt: TokenFormat | None) -> str:
    """A few ids: one strided numpy copy per id over all layers (``ctypes.memmove`` per layer
    and id when a buffer's layers are not equally spaced). Ids out of range (rows, or tokens
    of ``fmt``) are refused (``TransferError``) before anything is copied, as on every path."""
    k = fmt.tokens_per_page if fmt is not None else 1
    for name, ids, t in (("source", src_ids, src), ("destination", dst_ids, dst)):
        if ids and (min(ids) < 0 or max(ids) >= t.rows * k):
            raise TransferError(f"{name} id {min(ids) if min(ids) < 0 else max(ids)} out of "
                                f"range [0, {t.rows * k})")
    sv, dv = _np3(src), _np3(dst)
    pairs = zip(src_ids, dst_ids)
    f = fmt
    if sv is not None and dv is not None:
        if f is None:
            for a, b in pairs:
                dv[:, b, :] = sv[:, a, :]
            return "numpy"
        P, vb, sb, so = f.tokens_per_page, f.value_bytes, f.scale_bytes, f.scale_offset
        for a, b in pairs:
            ap, asl = divmod(a, P)
            bp, bsl = divmod(b, P)
            dv[:, bp, bsl * vb:(bsl + 1) * vb] = sv[:, ap, asl * vb:(asl + 1) * vb]
            if sb:
                dv[:, bp, so + bsl * sb:so + (bsl + 1) * sb] = \
                    sv[:, ap, so + asl * sb:so + (asl + 1) * sb]
        return "numpy"
    s, d = src, dst
    ss, ds = s.stride, d.stride
    pairs_l = list(pairs)
    if f is None:
        rb = s.row_bytes
        for sp, dp in zip(s.ptrs, d.ptrs):
            for a, b in pairs_l:
                _memmove(dp + b * ds, sp + a * ss, rb)
        return "memmove"
    P, vb, sb, so = f.tokens_per_page, f.value_bytes, f.scale_bytes, f.scale_offset
    offs = []
    for a, b in pairs_l:
        ap, asl = divmod(a, P)
        bp, bsl = divmod(b, P)
        offs.append((ap * ss + asl * vb, bp * ds + bsl * vb, ap * ss + so + asl * sb,
                     bp * ds + so + bsl * sb))
    for sp, dp in zip(s.ptrs, d.ptrs):
        for av, bv, asc, bsc in offs:
            _memmove(dp + bv, sp + av, vb)
            if sb:
                _memmove(dp + bsc, sp + asc, sb)
    return "memmove"


def clear_slots(layers: Sequence[torch.Tensor], ring: int, fp32: bool, slots: Sequence[int],
                draft: Sequence[tuple[int, list[int]]] | None) -> None:
    """Zero whole request-slot rows of every layer, or apply the MTP draft rule to ring
    entries of an fp32 state pool (positions mod ``ring``: first half 0, second half -inf)."""
    if not layers:
        return
    device = layers[0].device
    idx = torch.tensor(list(slots), dtype=torch.int64, device=device)
    for t in layers:
        if len(slots):
            t.index_fill_(0, idx, 0)
        if draft and fp32 and ring > 1:
            for slot, positions in draft:
                if not positions:
                    continue
                ring_rows = t[slot].view(torch.float32).view(ring, -1)
                half = ring_rows.shape[1] // 2
                pos = torch.tensor(sorted({p % ring for p in positions}),
                                   dtype=torch.int64, device=device)
                ring_rows[pos, :half] = 0.0
                ring_rows[pos, half:] = float("-inf")
