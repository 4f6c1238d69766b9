"""Loads layer by layer: every pool of a stage layer in one launch group, layer 0 first.

* ``layer_parts(src, dst, src_ids, dst_ids, fmt, layers)`` makes a buffer pair's
  ``SegmentPart`` s (its byte ranges per layer; the ranges that qualify for the copy engines
  in a part of their own); ``check_layer_part`` is its validation (``TransferError`` before
  anything is built).
* ``copy_by_layer(parts, layer_order, on_layer)`` copies them layer by layer in
  ``layer_order``; ``issue_by_layer`` is the same as a generator: it yields after layer 0's
  step (the daemon answers its client there and issues the rest right after the reply), then
  after each later launch group, the number of layers issued so far (the daemon tells its
  client how far the issue got, so a layer's wait need not wait for the whole issue).
  Groups are 1, 1, 2, 4, 8, ... layers (``layer_groups``); with ``fine=False`` (a caller
  whose client hears of the later layers only when all are issued) the later layers are one
  group. A load of ``SPLIT_COPIES`` or more
  copy-engine copies plans layer 1's group on its own before the other later layers. Whole
  rows of ``copy_engine.MIN_BYTES`` (32 KiB) or more, and blocks of rows consecutive on both
  sides (one copy per block of 2^k rows, ``segments.row_offsets``) or of tokens that reach it,
  between GPU and pinned host memory (``dma`` parts, any number of rows) go to the copy
  engines as batched DMA, the other rows and tokens to one segment-kernel launch per group and
  word width (``segments``); **everything of a load runs on the one stream it is issued on**,
  so ``on_layer(i)`` (the daemon records layer ``i``'s event there) follows the group's copies
  in stream order, with nothing across streams. (On an H200, while copy-engine batches ran on
  a side stream, the load stream's own commands, an event record or a wait, ran up to 0.3 ms
  late, and 3.6-3.7 ms late with a lead stream beside it: a layer was held back until the
  whole load was nearly done; docs/perf.md, eighteenth session.) A step issues the
  copy-engine copies of its first groups (up to ``LEAD_BYTES``) before it builds its segment
  plan, so the link is busy while that plan is built; each later group's copies go out at its
  own launch. Before any of that, right after layer 0's step, the copy-engine rows of the
  parts already built (those holding layer 0) go out for the next whole layers (the first
  lead: up to ``FIRST_LEAD_BYTES``, when they reach ``FIRST_LEAD_MIN_BYTES``), so the link
  has work while ``more`` builds the other parts and the later layers are planned. In a load
  in launch groups (``fine``) the lead goes only when it holds all of layer 1 (no segment
  part and no part ``more`` may build, ``more_layers``, holds it: DSV4-Flash's layer 1 is
  SWA only), and layer 1 is marked right after its share, so its event does not wait for the
  rest of the lead (H200, 8k tokens: last layer 0.797-0.815 of the limit against
  0.709-0.788, layer 1 ready sooner; docs/perf.md, nineteenth session).
* ``warm_up(device)`` compiles the segment kernel's variants before the first load.

Public through ``hicache.kernels.dispatch`` (the one entry point of the copy paths).
"""
from __future__ import annotations

from typing import Callable, Collection, Iterator, Optional, Sequence

import numpy as np
import torch

from . import copy_engine
from .checks import _check_ctas, _check_pair, _dma_direction
from .copy_engine import DmaPlan
from .segments import (Blocks, SegmentPart, SegmentPlan, launch_segments, row_blocks,
                       row_offsets, token_offsets)
from .streams import on_stream
from .tables import LayerTable, TokenFormat, TransferError

DEFAULT_CTAS = 4
# copy-engine bytes issued before the segment plan of a step is built (about 0.6 ms of an H200's
# link): building that plan first left the GPU idle for 0.3-0.7 ms after layer 0's copy. The
# later groups' copies go out at their own launch: keeping the copy engines this far ahead of
# every launched group as well (tried) gained nothing measurable on an H200
LEAD_BYTES = 32 << 20
# copy-engine bytes of the parts already built (those holding layer 0) issued for the next
# layers as soon as layer 0's step returns, before the other parts are built and the later
# layers planned: on an H200 host that host time (0.7-1.6 ms at 8k-32k tokens of DSV4-Flash)
# left the link idle after layer 0's copy. About 1.2 ms of the link; 0 turns it off. In a
# load in launch groups only when it holds all of layer 1 (see the docstring); in any load
# only when it holds at least ``FIRST_LEAD_MIN_BYTES`` (a checkpoint's SWA tail, ~3 MB, is
# host-bound: the lead's own plan and driver calls would only add host time)
FIRST_LEAD_BYTES = 64 << 20
FIRST_LEAD_MIN_BYTES = 8 << 20
# a load whose copy-engine copies reach this many plans its later layers in two (the first
# group first, so its copy, and the engine's word that it is issued, come before the rest is
# planned; a plan of the first two groups up to 48 or 96 MiB gained nothing clear either,
# nineteenth session).
# 1,024 (8k tokens of DSV4-Flash's full mirror split too) brought 8k's second layer from
# 3.0-3.3 to 1.8-2.5 ms but left its last layer at the bottom of its spread (H200, 2 runs)
SPLIT_COPIES = 4096


def layer_parts(src: LayerTable, dst: LayerTable, src_ids: np.ndarray, dst_ids: np.ndarray,
                fmt: Optional[TokenFormat], layers: Sequence[int],
                memo: Optional[dict[tuple[int, int], tuple[np.ndarray, np.ndarray, Blocks]]]
                = None) -> list[SegmentPart]:
    """The ``SegmentPart`` s of one buffer pair of a ``copy_by_layer`` call: rows (``fmt``
    None) or tokens of ``fmt``; ``layers[l]`` is the global layer id of buffer layer ``l``.
    Blocks of ``copy_engine.MIN_BYTES`` or more between the GPU and pinned host memory are one
    part marked for the copy engines, beside a part of the other ranges: whole rows that
    large, runs of rows consecutive on both sides that reach it (``row_offsets``: one copy
    per block of 2^k rows), and blocks of tokens whose values reach it (a checkpoint's SWA
    tail: 128 tokens, 72 KiB). ``memo``: a dict the caller keeps across the pools of one
    operation, so the blocks of rows are found once per pair of id arrays (the same array
    objects: an entry keeps its arrays and is used only for those very objects, so a new
    array at a freed one's address is never taken for it; the arrays must not change while
    the memo is used)."""
    check_layer_part(src, dst, src_ids, dst_ids, fmt, layers)
    way = _dma_direction(src, dst, any_rows=True)
    big = copy_engine.MIN_BYTES if way else 0
    if fmt is None:
        blocks = None
        if memo is not None:
            key = (id(src_ids), id(dst_ids))
            hit = memo.get(key)
            if hit is not None and hit[0] is src_ids and hit[1] is dst_ids:
                blocks = hit[2]
            else:
                blocks = row_blocks(src_ids, dst_ids)
                memo[key] = (src_ids, dst_ids, blocks)
        big_r, rest = row_offsets(src, dst, src_ids, dst_ids, big, blocks)
    else:
        big_r, rest = token_offsets(src, dst, src_ids, dst_ids, fmt, big)
    return [SegmentPart(src.ptrs, dst.ptrs, list(layers), r, dma=w)
            for r, w in ((big_r, way), (rest, "")) if r]


def check_layer_part(src: LayerTable, dst: LayerTable, src_ids: np.ndarray, dst_ids: np.ndarray,
                     fmt: Optional[TokenFormat], layers: Sequence[int]) -> None:
    _check_pair(src, dst)
    if len(layers) != src.num_layers:
        raise TransferError(f"{len(layers)} layer ids for {src.num_layers} buffer layers")
    if src_ids.shape != dst_ids.shape or src_ids.ndim != 1:
        raise TransferError(f"{src_ids.shape} source ids, {dst_ids.shape} destination ids")
    if src_ids.dtype != np.int64 or dst_ids.dtype != np.int64:  # (int32 offsets would wrap)
        raise TransferError(f"ids must be int64, got {src_ids.dtype} and {dst_ids.dtype}")
    if fmt is not None and src.row_bytes != fmt.page_bytes:  # (as ``copy_tokens`` checks)
        raise TransferError(f"rows are {src.row_bytes} B, token format pages are "
                            f"{fmt.page_bytes} B")
    if src_ids.size:
        k = fmt.tokens_per_page if fmt is not None else 1
        for name, ids, t in (("src", src_ids, src), ("dst", dst_ids, dst)):
            lo, hi = int(ids.min()), int(ids.max())
            if lo < 0 or hi >= t.rows * k:
                raise TransferError(f"{name} id {lo if lo < 0 else hi} out of range "
                                    f"[0, {t.rows * k})")


def copy_by_layer(parts: Sequence[SegmentPart], layer_order: Sequence[int],
                  on_layer: Optional[Callable[[int], None]] = None, *, device: torch.device,
                  ctas: int = DEFAULT_CTAS,
                  stream: Optional["torch.cuda.Stream"] = None) -> str:
    """See the module docstring. ``device``: the GPU the kernels run on (CPU: the Triton
    interpreter). Layer 0 of ``layer_order`` is issued first."""
    for _ in issue_by_layer(parts, layer_order, on_layer, device=device, ctas=ctas,
                            stream=stream):
        pass
    return "by_layer"


def issue_by_layer(parts: Sequence[SegmentPart], layer_order: Sequence[int],
                   on_layer: Optional[Callable[[int], None]] = None, *, device: torch.device,
                   ctas: int = DEFAULT_CTAS,
                   stream: Optional["torch.cuda.Stream"] = None,
                   more: Optional[Callable[[], Sequence[SegmentPart]]] = None,
                   more_layers: Optional[Collection[int]] = None,
                   fine: bool = True) -> Iterator[int]:
    """``copy_by_layer`` step by step, each step yielding how many layers of ``layer_order``
    are issued so far (their ``on_layer`` calls made). The first step plans and issues layer 0
    alone (its own small plan, so its copy starts before the other layers are planned); every
    later step issues one launch group of the rest (planned when the first of them is issued).
    A caller may answer its client, or report progress, between steps; every step enters
    ``stream`` itself, so nothing of the stream context leaks across a pause. Parts naming a
    layer outside ``layer_order`` are refused before anything is launched. ``more``
    (optional) builds further parts after the first step, so building parts that do not hold
    layer 0 waits until layer 0's copy is issued; ``more_layers``: the layers its parts may
    hold (None: any after the first), so a layer outside it may be issued before ``more``
    runs. Its parts must not name a layer already issued, one outside ``more_layers``, or one
    outside ``layer_order`` (ValueError before they are planned). ``fine`` False: every layer
    after the first in one launch group (one step after the first)."""
    ctas = _check_ctas(ctas)
    _check_layers(parts, layer_order)
    if not layer_order:
        return
    dev = device if device.type == "cuda" else None
    # layer 0's big rows start on the copy engines before its segment plan is built or
    # uploaded (the latency the engine waits for first)
    yield from _issue_groups(parts, layer_order, [(0, 1)], on_layer, device, ctas, dev, stream,
                             ramp=True)
    n = len(layer_order)
    groups = layer_groups(n)[1:] if fine else [(1, n)] if n > 1 else []
    announced = set() if more is None else set(layer_order[1:]) if more_layers is None \
        else set(more_layers)
    done = 1
    if groups:
        parts, done = _issue_first_lead(parts, layer_order, dev, stream,
                                        on_layer if fine else None, announced)
        if done > 1:  # layer 1 marked after its share of the lead: its group is issued
            groups = groups[1:]
            yield done
    if more is not None:
        extra = list(more())
        held = {g for p in extra for g in p.layers}
        issued = sorted(held & set(layer_order[:done]))
        if issued:
            raise ValueError(f"a part built after the first step holds layer {issued[0]}, "
                             f"which that step issued")
        _check_layers(extra, layer_order)
        unknown = sorted(held - announced)
        if unknown:
            raise ValueError(f"a part built after the first step holds layer {unknown[0]}, "
                             f"which more_layers does not name")
        parts = parts + extra
    if not groups:
        return
    # a big rest is planned in two: its first group alone first, so its copies start while the
    # other layers are planned (one plan of 33k copies took 1-2 ms before its first copy)
    head = 1 if len(groups) > 1 and _dma_copies(parts, dev) >= SPLIT_COPIES else len(groups)
    yield from _issue_groups(parts, layer_order, groups[:head], on_layer, device, ctas, dev,
                             stream)
    if head < len(groups):
        yield from _issue_groups(parts, layer_order, groups[head:], on_layer, device, ctas, dev,
                                 stream)


def _issue_groups(parts: Sequence[SegmentPart], layer_order: Sequence[int],
                  groups: Sequence[tuple[int, int]], on_layer: Optional[Callable[[int], None]],
                  device: torch.device, ctas: int, dev: Optional[torch.device],
                  stream: Optional["torch.cuda.Stream"], ramp: bool = False) -> Iterator[int]:
    """One plan for the layers of consecutive launch ``groups`` (positions ``[a, b)`` of
    ``layer_order``), launched group by group on ``stream``; ``on_layer(i)`` after the group
    holding position ``i``; yields ``b`` after each group. ``ramp``: the copy engines' calls
    grow from a short first one (``copy_engine.issue``; layer 0's step, the link idle)."""
    lo, hi = groups[0][0], groups[-1][1]
    plan: Optional[_LayerPlan] = None
    for k, (a, b) in enumerate(groups):
        with on_stream(stream, dev):  # one stream switch for the plan and the first launch
            if plan is None:
                plan = _LayerPlan(parts, set(layer_order[lo:hi]).__contains__,
                                  layer_order[lo:hi], dev, [(x - lo, y - lo) for x, y in groups],
                                  ramp)
            plan.launch(device, k, ctas)
            if on_layer is not None:
                for i in range(a, b):
                    on_layer(i)
        yield b


def _issue_first_lead(parts: Sequence[SegmentPart], layer_order: Sequence[int],
                      dev: Optional[torch.device], stream: Optional["torch.cuda.Stream"],
                      on_layer: Optional[Callable[[int], None]],
                      more_layers: set[int]) -> tuple[list[SegmentPart], int]:
    """Right after layer 0's step: the copy-engine rows ``parts`` hold for the next layers,
    whole layers up to ``FIRST_LEAD_BYTES``, issued at once on ``stream`` (after layer 0's
    copies), before ``more`` builds the other parts and the later layers are planned (host
    time during which the link would sit idle once layer 0's copy is done). With ``on_layer``
    (a load in launch groups, whose client hears of each), only when the lead holds all of
    layer 1 (no segment part and no later part, ``more_layers``, holds it): ``on_layer(1)``
    right after layer 1's share, so its event does not wait for the rest of the lead. The
    other layers' events come after the lead in stream order, as every layer's does after its
    copies. Returns ``parts`` less the copies issued, and the layers marked (2 when layer 1
    was, else 1)."""
    dma, seg = _split(parts, dev)
    if not dma or FIRST_LEAD_BYTES <= 0:
        return list(parts), 1
    assert dev is not None
    pos = {g: i for i, g in enumerate(layer_order)}
    per = [0] * len(layer_order)  # copy-engine bytes of ``dma`` per layer position
    for p in dma:
        b = sum(rb * so.size for rb, so, _ in p.ranges)
        for g in p.layers:
            per[pos[g]] += b
    k, total = 1, 0
    while k < len(layer_order) and total < FIRST_LEAD_BYTES:
        total += per[k]
        k += 1
    if not total or total < FIRST_LEAD_MIN_BYTES:  # less link time than its own host time
        return list(parts), 1
    g1 = layer_order[1]
    whole = per[1] > 0 and g1 not in more_layers and not any(g1 in p.layers for p in seg)
    if on_layer is not None and not whole:
        return list(parts), 1
    keep = set(layer_order[1:k]).__contains__
    with on_stream(stream, dev):
        plans = _dma_plans(dma, keep, layer_order, dev)
        for plan in plans:  # layer 1's share first
            copy_engine.issue_current(plan, *plan.layers[1], dev)
        if on_layer is not None:
            on_layer(1)
        for plan in plans:
            copy_engine.issue_current(plan, plan.layers[1][1], len(plan.dst), dev)
    return _layers_of(dma, lambda g: not keep(g)) + seg, 2 if on_layer is not None else 1


def _dma_plans(dma: Sequence[SegmentPart], keep: Callable[[int], bool], order: Sequence[int],
               dev: Optional[torch.device]) -> list[DmaPlan]:
    """The copy-engine plans (one per direction present) of the ``dma`` parts' layers that
    ``keep`` accepts, grouped by position in ``order``."""
    plans = []
    for way in ("h2d", "d2h"):
        mine = _layers_of([p for p in dma if p.dma == way], keep)
        if mine:
            assert dev is not None
            plans.append(DmaPlan.build(mine, order).direction(way == "h2d", dev.index or 0))
    return plans


def _dma_copies(parts: Sequence[SegmentPart], dev: Optional[torch.device]) -> int:
    """Copy-engine copies the parts make over all their layers (those ``_split`` sends to the
    copy engines: none off a GPU or with the copy engines off)."""
    return sum(so.size * len(p.layers) for p in _split(parts, dev)[0] for _, so, _ in p.ranges)


def _check_layers(parts: Sequence[SegmentPart], layer_order: Sequence[int]) -> None:
    unknown = sorted({g for p in parts for g in p.layers} - set(layer_order))
    if unknown:
        raise ValueError(f"layer {unknown[0]} is not in this stage's layer order")


def _split(parts: Sequence[SegmentPart],
           dev: Optional[torch.device]) -> tuple[list[SegmentPart], list[SegmentPart]]:
    """(copy-engine parts, segment parts): a part goes to the copy engines when it qualifies
    (``dma``) and they are enabled, whatever its number of rows. A load issues a step's
    copy-engine copies before it plans the rest, so the driver's per-copy host time (about
    1 µs a row on an H200 host) overlaps copies already running (``dispatch`` keeps
    ``copy_engine.MIN_ROWS`` for backups, issued pool by pool)."""
    if dev is None or not copy_engine.enabled():
        return [], list(parts)
    dma = [p for p in parts if p.dma]
    return dma, [p for p in parts if not any(p is q for q in dma)]


class _LayerPlan:
    """The copies of some layers of an operation, in launch groups ``groups`` (positions
    ``[a, b)`` of ``order``), all on the stream current when it is made and launched. With
    segment launches beside them, the plan issues the copy-engine copies of the first groups,
    up to ``LEAD_BYTES``, before it builds the segment plan, so the link is busy while that
    plan is built. ``launch(k)`` issues group ``k``'s copy-engine copies if they are not issued
    yet and launches its segments, so whatever the caller queues next (the layers' events)
    comes after both."""

    def __init__(self, parts: Sequence[SegmentPart], keep: Callable[[int], bool],
                 order: Sequence[int], dev: Optional[torch.device],
                 groups: Sequence[tuple[int, int]], ramp: bool = False) -> None:
        dma_parts, seg_parts = _split(parts, dev)
        seg_parts = _layers_of(seg_parts, keep)
        self.dev = dev
        self.ramp = ramp
        self.groups = list(groups)
        self.dma = _dma_plans(dma_parts, keep, order, dev)
        self.issued = 0  # groups whose copy-engine copies are issued
        if self.dma and seg_parts:
            lead = 0
            while self.issued < len(self.groups) and lead < LEAD_BYTES:
                lead += self._issue_dma(self.issued)
        self.seg = SegmentPlan.build(seg_parts, order)

    def _issue_dma(self, k: int) -> int:
        """Issue group ``k``'s copy-engine copies (the next group not issued); their bytes."""
        a, b = self.groups[k]
        nbytes = 0
        for plan in self.dma:
            x, y = plan.layers[a][0], plan.layers[b - 1][1]
            if y > x:
                assert self.dev is not None
                copy_engine.issue_current(plan, x, y, self.dev, self.ramp)
                nbytes += int(plan.size[x:y].sum())
        self.issued = k + 1
        return nbytes

    def launch(self, device: torch.device, k: int, ctas: int) -> None:
        while self.dma and self.issued <= k:
            self._issue_dma(self.issued)
        a, b = self.groups[k]
        spans = self.seg.spans(a, b)
        if spans:
            self.seg.to(device)
        for lo, hi in spans:  # one launch per word width (segments.py)
            launch_segments(self.seg, lo, hi, ctas)


def _layers_of(parts: Sequence[SegmentPart], keep: Callable[[int], bool]) -> list[SegmentPart]:
    """``parts`` cut to the layers whose global id ``keep`` accepts (a part's byte offsets are
    the same for all its layers, so they are shared, not copied)."""
    out = []
    for p in parts:
        ks = [k for k, g in enumerate(p.layers) if keep(g)]
        if ks:
            out.append(SegmentPart([p.src_ptrs[k] for k in ks], [p.dst_ptrs[k] for k in ks],
                                   [p.layers[k] for k in ks], p.ranges, p.dma))
    return out


def layer_groups(n: int) -> list[tuple[int, int]]:
    """Layers ``[a, b)`` issued as one launch: 1, 1, 2, 4, 8, ... layers, so layer 0 is ready
    after its own copy, layer i no later than about twice its own turn, and the host issues
    O(log n) launches per load instead of n (a Python-issued launch costs tens of us)."""
    out, a, size = [], 0, 1
    while a < n:
        b = min(n, a + size)
        out.append((a, b))
        size = 1 if a == 0 else size * 2
        a = b
    return out


def warm_up(device: torch.device) -> None:
    """Compile the segment kernel's variants (16-byte vectors, 8- and 4-byte words) on
    ``device`` now, so no load waits for Triton's compiler."""
    layers = 4
    a = [torch.zeros(2, 64, dtype=torch.uint8, device=device) for _ in range(layers)]
    b = [torch.zeros(2, 64, dtype=torch.uint8, device=device) for _ in range(layers)]
    ta, tb = LayerTable(a), LayerTable(b)
    # 16-byte rows; 8-byte scales; 4-byte scales
    for fmt in (None, TokenFormat(1, 56, 8, 56, 64), TokenFormat(1, 60, 4, 60, 64)):
        parts = layer_parts(ta, tb, np.array([0]), np.array([1]), fmt, list(range(layers)))
        plan = SegmentPlan.build(parts, list(range(layers))).to(device)
        launch_segments(plan, 0, len(plan.desc), 1)
    if device.type == "cuda":
        torch.cuda.synchronize(device)
