"""How an operation's bytes move: the copy planner between the scheduler and the kernels.

* CPU mode: ``run_cpu(items)`` — a few ids per pool go id by id (``kernels.cpu_copy``), larger
  copies through ``kernels.dispatch``'s reference path; ``merge_key`` / ``disjoint`` / ``merge``
  decide when consecutive queued operations may share one copy per pool.
* GPU mode: ``issue_gpu(op, stream, ctas)`` enqueues an operation on ``stream``: a load (or a
  swap-in) goes layer by layer through ``dispatch.copy_by_layer`` (one launch per stage layer for
  every pool of that layer, layer 0 first) and records layer ``i``'s interprocess event right
  after layer ``i``; a backup goes pool by pool through ``dispatch.copy_rows`` /
  ``copy_tokens`` (staged gather + DMA when host rows come in runs). Clears run last.

Returns the copy path names the ack reports. Validation happened in the handlers.
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache.kernels.cpu_copy import clear_slots, copy_few
from hicache.kernels.dispatch import copy_by_layer, copy_rows, copy_tokens, layer_part

from .ops import ClearSpec, Ids, Item, Operation

SMALL_IDS = 64  # up to this many ids per pool, CPU copies go id by id (numpy / memmove)


def run_cpu_item(it: Item) -> str:
    if it.n <= SMALL_IDS:
        return copy_few(it.src, it.dst, it.src_ids.list(), it.dst_ids.list(), it.fmt)
    if it.fmt is None:
        return copy_rows(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(), impl="reference")
    return copy_tokens(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(), it.fmt,
                       impl="reference")


def run_clear(spec: ClearSpec) -> None:
    for tg in spec.targets:
        clear_slots(tg.table.layers, tg.ring, tg.fp32, spec.slots, spec.draft)


def issue_gpu(op: Operation, stream: Any, ctas: int, device: torch.device) -> str:
    """Enqueue ``op``'s copies on ``stream`` (the caller made it current)."""
    paths: set[str] = set()
    if op.layer_events is not None:
        events = op.layer_events
        parts = [layer_part(it.src, it.dst, it.src_ids.np(), it.dst_ids.np(), it.fmt, it.layers)
                 for it in op.items]
        paths.add(copy_by_layer(parts, op.stage_layers, lambda i: events[i].record(stream),
                                device=device, ctas=ctas, stream=stream))
    else:
        for it in op.items:
            if it.fmt is None:
                paths.add(copy_rows(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(),
                                    ctas=ctas, stream=stream))
            else:
                paths.add(copy_tokens(it.src, it.dst, it.src_ids.torch(), it.dst_ids.torch(),
                                      it.fmt, ctas=ctas, stream=stream))
    if op.clear is not None:
        run_clear(op.clear)
        paths.add("clear")
    return "+".join(sorted(paths))


def merge_key(op: Operation) -> tuple | None:
    """Operations with equal keys may merge; None: this op runs on its own."""
    if op.kind not in ("backup", "load") or op.clear is not None or \
            any(it.n > MERGE_MAX_IDS for it in op.items):
        return None
    return (op.kind, tuple((it.pool, id(it.src), id(it.dst), it.fmt is None) for it in op.items))


MERGE_MAX_IDS = 4096  # ops with more ids per item run on their own (their copy dominates anyway)


def disjoint(dsts: list[set[int]], op: Operation) -> bool:
    """True when ``op`` may join a merged run whose destinations per item are ``dsts``."""
    for d, it in zip(dsts, op.items):
        if len(d) > MERGE_MAX_IDS or not d.isdisjoint(it.dst_ids.list()):
            return False
    return True


def merge(ops: list[Operation]) -> list[Item]:
    """One item per (pool, buffers) with the ids of every op concatenated; [] if unsafe."""
    merged: list[Item] = []
    for k in range(len(ops[0].items)):
        parts = [op.items[k] for op in ops]
        dst = np.concatenate([p.dst_ids.np() for p in parts])
        if np.unique(dst).size != dst.size:
            return []  # overlapping destinations: keep the ops apart, in order
        src = np.concatenate([p.src_ids.np() for p in parts])
        p0 = parts[0]
        merged.append(Item(p0.pool, p0.src, p0.dst, Ids.of(src), Ids.of(dst), p0.fmt, p0.layers,
                           sum(p.nbytes for p in parts)))
    return merged
