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


def _on(idx: torch.Tensor, device: torch.device) -> torch.Tensor:
    return idx if idx.device == device else idx.to(device)


def copy_rows_ref(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                  src_idx: torch.Tensor, dst_idx: torch.Tensor) -> None:
    """dst[l][dst_idx[i]] = src[l][src_idx[i]] for every layer l and index i."""
    if len(src) == 0 or src_idx.numel() == 0:
        return
    s_idx = _on(src_idx, src[0].device)
    d_idx = _on(dst_idx, dst[0].device)
    for s, d in zip(src, dst):
        rows = s.index_select(0, s_idx)
        d.index_copy_(0, d_idx, rows.to(d.device))


def _token_views(t: torch.Tensor, fmt: TokenFormat) -> tuple[torch.Tensor, torch.Tensor]:
    """[rows, P, value_bytes] and [rows, P, scale_bytes] views of one layer's page rows."""
    P = fmt.tokens_per_page
    values = t[:, : P * fmt.value_bytes].view(t.shape[0], P, fmt.value_bytes)
    scales = t[:, fmt.scale_offset: fmt.scale_offset + P * fmt.scale_bytes]
    return values, scales.view(t.shape[0], P, fmt.scale_bytes)


def copy_tokens_ref(src: Sequence[torch.Tensor], dst: Sequence[torch.Tensor],
                    src_tok: torch.Tensor, dst_tok: torch.Tensor, fmt: TokenFormat) -> None:
    """Copy each token's value and scale from its source slot to its destination slot."""
    if len(src) == 0 or src_tok.numel() == 0:
        return
    P = fmt.tokens_per_page
    s_tok = _on(src_tok, src[0].device)
    d_tok = _on(dst_tok, dst[0].device)
    s_page, s_slot = s_tok // P, s_tok % P
    d_page, d_slot = d_tok // P, d_tok % P
    for s, d in zip(src, dst):
        sv, ss = _token_views(s, fmt)
        dv, ds = _token_views(d, fmt)
        dv[d_page, d_slot] = sv[s_page, s_slot].to(d.device)
        if fmt.scale_bytes:
            ds[d_page, d_slot] = ss[s_page, s_slot].to(d.device)
