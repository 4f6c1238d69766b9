"""Plain-torch HiSparse swap-in: the CPU path of ``HotBuffer`` and the oracle the Triton kernel
(``hisparse``) is tested against. Same contract, same tables, same results: output locations,
slot tokens, LRU order, statistics and device bytes.

``swap_in_ref(...)`` loops over batch rows (at most the engine's batch size) and uses whole-
tensor operations inside a row; the copies go through ``copy_tokens_ref``.
"""
from __future__ import annotations

import torch

from .reference import copy_tokens_ref
from .tables import TokenFormat


def _row(ids: torch.Tensor, n: int, newest_slot: int, toks: torch.Tensor, order: torch.Tensor
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sparse row: (slot of each id or -1, first-miss mask, victims, new order,
    missed ids in first-occurrence order). ``toks``/``order`` are this row's tables."""
    K, S = ids.numel(), toks.numel()
    valid = (ids >= 0) & (ids < n)
    is_new = valid & (ids == n - 1)
    cand = valid & ~is_new
    match = (ids[:, None] == toks[None, :].long()) & cand[:, None]
    hit = match.any(1)
    hit_slot = match.to(torch.int8).argmax(1)
    miss = cand & ~hit
    earlier = torch.ones(K, K, dtype=torch.bool).tril(-1)
    dup = ((ids[:, None] == ids[None, :]) & miss[None, :] & earlier).any(1)
    first = miss & ~dup
    m = int(first.sum())
    needed = torch.zeros(S, dtype=torch.bool)
    needed[hit_slot[hit]] = True
    nd = needed[order.long()]
    ev_slots = order[~nd]
    victims = ev_slots[:m]
    new_order = torch.cat([ev_slots[m:], order[nd], victims])
    missed = ids[first]
    slot = torch.full((K,), -1, dtype=torch.int64)
    slot[hit] = hit_slot[hit]
    for i in torch.nonzero(miss).flatten().tolist():  # duplicates follow their first id
        slot[i] = int(victims[int((missed == ids[i]).nonzero()[0])])
    slot[is_new] = newest_slot
    return slot, first, victims, new_order, missed


def swap_in_ref(req_slots: torch.Tensor, topk: torch.Tensor, out: torch.Tensor,
                lens: torch.Tensor, slot_tok: torch.Tensor, order: torch.Tensor,
                slot_loc: torch.Tensor, host_pages: torch.Tensor, stats: torch.Tensor,
                host_layer: torch.Tensor, dev_layer: torch.Tensor, fmt: TokenFormat) -> None:
    """One layer's swap-in, in place on the given tables (one layer's views, shapes as in
    ``hisparse.SwapInLaunch``); ``host_layer``/``dev_layer`` are the layer's page rows."""
    S = int(slot_tok.shape[1])
    P = fmt.tokens_per_page
    looked = copied = 0
    for b, r in enumerate(req_slots.tolist()):
        if r < 0:
            out[b] = -1
            continue
        ids = topk[b].to(torch.int64).cpu()
        n = int(lens[r])
        valid = (ids >= 0) & (ids < n)
        looked += int(valid.sum())
        locs = slot_loc[r].cpu()
        if n <= S:
            out[b] = torch.where(valid, locs[ids.clamp(0, S)], -1).to(out.device)
            continue
        slot, first, victims, new_order, missed = _row(ids, n, S, slot_tok[r].cpu(),
                                                       order[r].cpu())
        slot_tok[r, victims.long()] = missed.to(torch.int32).to(slot_tok.device)
        order[r] = new_order.to(order.device)
        out[b] = torch.where(valid, locs[slot.clamp(0, S)], -1).to(out.device)
        if missed.numel():
            src = host_pages[r].cpu()[missed // P] * P + missed % P
            copy_tokens_ref([host_layer], [dev_layer], src, locs[victims.long()], fmt)
        copied += int(missed.numel())
    stats[0] += looked
    stats[1] += copied
