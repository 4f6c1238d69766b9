"""Plain torch copy paths: the CPU-mode implementation and the oracle every kernel is tested
against byte for byte.

``copy_rows_ref`` copies row ``src_idx[i]`` of every layer of ``src`` to row ``dst_idx[i]`` of
the same layer of ``dst``. ``copy_tokens_ref`` copies token ``src_tok[i]`` (page ``t // P``,
slot ``t % P``) to token ``dst_tok[i]``: its value and its scale, each to their own place in the
destination page. Inputs are assumed valid (``dispatch`` checks them); a Python loop runs over
layers only, never over rows or tokens.
"""
from __future__ import annotations

from typing import Sequence

import torch

from .tables import TokenFormat


_WIDE = {8: torch.int64, 4: torch.int32, 2: torch.int16}


def _on(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    return idx if idx.device == device else idx.to(device)


def _word(*sizes: int) -> int:
    """Largest of 8, 4, 2, 1 dividing every size: the widest element all offsets align to."""
    for w in (8, 4, 2):
        if all(x % w == 0 for x in sizes):
            return w
    return 1


def _wide(t: torch.Tensor, w: int) -> torch.Tensor:
    """``t`` viewed as ``w``-byte words (same bytes). Indexing uint8 rows byte-wise in torch's
    CPU kernels runs at a few MB/s; whole words run at memory speed."""
    if w == 1:
        return t
    try:
        return t.view(_WIDE[w])
    except RuntimeError:  # misaligned storage offset: stay byte-wise, still correct
        return t


def copy_rows_ref(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                  src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[l][dst_idx[i]] = src[l][src_idx[i]] for every layer l and index i."""
    if len(src) == 0 or src_idx.numel() == 0:
        return
    s_idx = _on(src_idx, src[0].device)
    d_idx = _on(dst_idx, dst[0].device)
    w = _word(src[0].shape[1])
    for s, d in zip(src, dst):
        ws, wd = _wide(s, w), _wide(d, w)
        if ws.dtype != wd.dtype:
            ws, wd = s, d
        wd.index_copy_(0, d_idx, ws.index_select(0, s_idx).to(d.device))


def _token_views(t: torch.Tensor, fmt: TokenFormat,
                 bytewise: bool = False) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, P, value words] and [rows, P, scale words] views of one layer's page rows,
    in the widest word that every offset of the format aligns to (``bytewise``: bytes)."""
    P = fmt.tokens_per_page
    w = 1 if bytewise else _word(fmt.value_bytes, fmt.scale_bytes or 8, fmt.scale_offset,
                                 fmt.page_bytes)
    t = _wide(t, w)
    if t.dtype == torch.uint8:
        w = 1
    vw, sw, so = fmt.value_bytes // w, fmt.scale_bytes // w, fmt.scale_offset // w
    values = t[:, : P * vw].view(t.shape[0], P, vw)
    scales = t[:, so: so + P * sw]
    return values, scales.view(t.shape[0], P, sw)


def _token_words(tok: torch.Tensor, P: int, row_words: int, off: int, n: int,
                 device: torch.device) -> torch.Tensor:
    """Flat word indices of ``n`` words at ``off + slot * n`` in the page row of each token."""
    tok = _on(tok, device)
    base = (tok // P) * row_words + off + (tok % P) * n
    return (base.unsqueeze(1) + torch.arange(n, device=device)).reshape(-1)


def copy_tokens_ref(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                    src_tok: torch.Tensor, dst_tok: torch.Tensor, fmt: TokenFormat) -> None:
    """Copy each token's value and scale from its source slot to its destination slot.

    Contiguous buffers go through flat word indices (one ``index_select`` / ``index_copy_`` per
    layer and part: two-index advanced indexing of a [rows, P, words] view ran ~20x slower)."""
    if len(src) == 0 or src_tok.numel() == 0:
        return
    P = fmt.tokens_per_page
    w = _word(fmt.value_bytes, fmt.scale_bytes or 8, fmt.scale_offset, fmt.page_bytes)
    idx: dict[tuple[str, str], torch.Tensor] = {}
    for s, d in zip(src, dst):
        ws, wd = _wide(s, w), _wide(d, w)
        if not (s.is_contiguous() and d.is_contiguous()) or ws.dtype != wd.dtype:
            _copy_tokens_views(s, d, src_tok, dst_tok, fmt)
            continue
        ww = ws.element_size()
        parts = [("v", 0, fmt.value_bytes // ww)]
        if fmt.scale_bytes:
            parts.append(("s", fmt.scale_offset // ww, fmt.scale_bytes // ww))
        for name, off, n in parts:
            for side, t, tok in (("s", ws, src_tok), ("d", wd, dst_tok)):
                key = (name + side, str(t.device) + str(t.dtype))
                if key not in idx:
                    idx[key] = _token_words(tok, P, t.shape[1], off, n, t.device)
            vals = ws.reshape(-1).index_select(0, idx[(name + "s", str(ws.device) + str(ws.dtype))])
            wd.view(-1).index_copy_(0, idx[(name + "d", str(wd.device) + str(wd.dtype))],
                                    vals.to(wd.device))


def _copy_tokens_views(s: torch.Tensor, d: torch.Tensor, src_tok: torch.Tensor,
                       dst_tok: torch.Tensor, fmt: TokenFormat) -> None:
    """Non-contiguous buffers: index [rows, P, words] views of values and scales."""
    P = fmt.tokens_per_page
    s_tok = _on(src_tok, s.device)
    d_tok = _on(dst_tok, d.device)
    s_page, s_slot = s_tok // P, s_tok % P
    d_page, d_slot = d_tok // P, d_tok % P
    sv, ss = _token_views(s, fmt)
    dv, ds = _token_views(d, fmt)
    if sv.dtype != dv.dtype:  # one side has no word view (its storage starts off a word)
        sv, ss = _token_views(s, fmt, bytewise=True)
        dv, ds = _token_views(d, fmt, bytewise=True)
    dv[d_page, d_slot] = sv[s_page, s_slot].to(d.device)
    if fmt.scale_bytes:
        ds[d_page, d_slot] = ss[s_page, s_slot].to(d.device)
