"""HiSparse swap-in: map one layer's top-k C4 token ids of a whole batch to hot-buffer device
locations, copying the misses from the host region, in one Triton launch (one program per
batch row). The contract (``hisparse_reference`` implements the same, byte for byte):

Tables (``HotTables``, fixed shapes, so a step can be captured in a CUDA graph): per request
slot ``r`` a hot buffer of ``S`` LRU slots plus one reserved slot (index ``S``) for the newest
token; ``slot_loc[r, s]`` is the device token location of slot ``s`` (page ``loc // P``, slot
``loc % P`` of the layer's device C4 buffer); per layer, ``slot_tok[l, r, s]`` is the token id
slot ``s`` holds (-1 empty) and ``order[l, r]`` the LRU order of slots ``0..S-1``, oldest first;
``lens[r]`` is the request's C4 length ``n`` (newest token ``n - 1``); ``host_pages[r, j]`` the
host page row of the request's tokens ``j*P .. j*P+P-1``.

For batch row ``b`` with ``r = req_slots[b]`` and top-k ids ``ids = topk[b]``:

* ``r < 0`` (CUDA-graph padding): ``out[b] = -1``, nothing else changes.
* an id outside ``[0, n)`` gives -1 (the indexer pads short rows with -1).
* ``n <= S`` (fast path, the buffer holds the whole request, slot = token id):
  ``out = slot_loc[r, id]``; no table changes, nothing copied.
* else (sparse): the newest id maps to the reserved slot. Every other id is a hit when a slot
  holds it. Each distinct missed id, in order of first occurrence, takes the next LRU slot that
  no id of this row hits (so a step never evicts what it reads); its 576 + 8 B are copied from
  the host page row to that slot's device location. The new LRU order is: untouched slots
  (oldest first), then hit slots, then the slots just filled (in old order each).
  Duplicated ids all get the same location.

``stats[l] += (valid ids, tokens copied)``. Ids of the host region below ``n - 1`` must already
be there (the daemon's backup); the newest token is written by the engine to
``slot_loc[r, min(n - 1, S)]``. Scratch buffers (``pos``, ``first``, ``need``, ``vict``, ``src``, ``dst``)
are per batch row; ``need`` (zeros) and ``first`` (``FIRST_CLEAN``) are left as they were found.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from .tables import TokenFormat, _pow2_align
from .tokens import _split, _tokens_step

FIRST_CLEAN = 2**31 - 1  # value of every entry of the ``first`` scratch between launches
_FIRST_CLEAN = tl.constexpr(FIRST_CLEAN)


@dataclass(frozen=True)
class SwapInConfig:
    """Launch shape: ``tokens`` copied per loop iteration of a program, ``num_warps``."""

    tokens: int = 32
    num_warps: int = 8


@triton.jit
def _swap_in_kernel(req_ptr, topk_ptr, topk_stride, out_ptr, lens_ptr, tok_ptr, ord_ptr,
                    loc_ptr, hp_ptr, maxp, pos_ptr, first_ptr, maxt, need_ptr, vict_ptr, src_ptr, dst_ptr,
                    stats_ptr, host_tab, dev_tab, host_stride, dev_stride,
                    K: tl.constexpr, KP: tl.constexpr, S: tl.constexpr, SP: tl.constexpr,
                    P: tl.constexpr, VB: tl.constexpr, SB: tl.constexpr, SOFF: tl.constexpr,
                    V1: tl.constexpr, V2: tl.constexpr, SE: tl.constexpr, NS: tl.constexpr,
                    T: tl.constexpr, ALIGN: tl.constexpr, FLIP: tl.constexpr):
    b = tl.program_id(0).to(tl.int64)
    r = tl.load(req_ptr + b).to(tl.int64)
    ki = tl.arange(0, KP)
    kin = ki < K
    ids = tl.load(topk_ptr + b * topk_stride + ki, mask=kin, other=-1).to(tl.int64)
    out_row = out_ptr + b * K
    if r < 0:
        tl.store(out_row + ki, tl.full([KP], -1, tl.int64), mask=kin)
    else:
        n = tl.load(lens_ptr + r)
        valid = kin & (ids >= 0) & (ids < n)
        loc_row = loc_ptr + r * (S + 1)
        tl.atomic_add(stats_ptr, tl.sum(valid.to(tl.int64), axis=0))
        if n <= S:  # fast path: identity mapping
            loc = tl.load(loc_row + ids, mask=valid, other=-1)
            tl.store(out_row + ki, tl.where(valid, loc, -1), mask=kin)
        else:
            si = tl.arange(0, SP)
            sin = si < S
            tok_row = tok_ptr + r * S
            ord_row = ord_ptr + r * S
            pos_row = pos_ptr + b * maxt
            first_row = first_ptr + b * maxt
            need_row = need_ptr + b * S
            vict_row = vict_ptr + b * K
            is_new = valid & (ids == n - 1)
            cand = valid & (ids != n - 1)
            # 1. independent loads first (one memory latency), then where each held token sits
            toks = tl.load(tok_row + si, mask=sin, other=-1)
            order = tl.load(ord_row + si, mask=sin, other=0)
            hp = tl.load(hp_ptr + r * maxp + ids // P, mask=cand, other=0)
            tl.store(pos_row + toks, si, mask=sin & (toks >= 0))
            tl.debug_barrier()
            # 2. hits (a stale pos entry fails the check against slot_tok)
            s = tl.load(pos_row + ids, mask=cand, other=-1)
            sv = cand & (s >= 0) & (s < S)
            hit = sv & (tl.load(tok_row + s, mask=sv, other=-1) == ids)
            miss = cand & (hit == 0)
            # 3. slots this row reads; first occurrence of each missed id (first_row is kept
            # at FIRST_CLEAN between launches); then the LRU scan for victims
            tl.store(need_row + s, tl.full([KP], 1, tl.int8), mask=hit)
            tl.atomic_min(first_row + ids, ki, mask=miss)
            tl.debug_barrier()
            w = tl.load(first_row + ids, mask=miss, other=-1)
            first = miss & (w == ki)
            dup = miss & (w != ki)
            fi = first.to(tl.int32)
            m = tl.sum(fi, axis=0)
            q = tl.cumsum(fi, axis=0) - fi
            nd = sin & (tl.load(need_row + order, mask=sin, other=0) != 0)
            ev = sin & (nd == 0)
            evi = ev.to(tl.int32)
            ndi = nd.to(tl.int32)
            erank = tl.cumsum(evi, axis=0) - evi
            nrank = tl.cumsum(ndi, axis=0) - ndi
            n_ev = tl.sum(evi, axis=0)
            vic = ev & (erank < m)
            tl.store(vict_row + erank, order, mask=vic)
            newpos = tl.where(vic, S - m + erank, tl.where(ev, erank - m, n_ev - m + nrank))
            tl.debug_barrier()
            # 4. tables: LRU order, scratch back to clean, victims take the missed ids
            tl.store(need_row + s, tl.zeros([KP], tl.int8), mask=hit)
            tl.store(first_row + ids, tl.full([KP], _FIRST_CLEAN, tl.int32), mask=miss)
            tl.store(ord_row + newpos, order, mask=sin)
            v = tl.load(vict_row + q, mask=first, other=0)
            tl.store(tok_row + v, ids.to(tl.int32), mask=first)
            slot = tl.where(hit, s, v)
            if tl.sum(dup.to(tl.int32), axis=0) > 0:  # repeated missed ids follow their first
                tl.store(pos_row + ids, v, mask=first)
                tl.debug_barrier()
                slot = tl.where(dup, tl.load(pos_row + ids, mask=dup, other=0), slot)
            slot = tl.where(is_new, S, slot)
            loc = tl.load(loc_row + slot, mask=valid, other=-1)
            tl.store(out_row + ki, tl.where(valid, loc, -1), mask=kin)
            # 5. copy list (host token -> device token), then the copies
            tl.store(src_ptr + b * K + q, hp * P + ids % P, mask=first)
            tl.store(dst_ptr + b * K + q, loc, mask=first)
            tl.debug_barrier()
            for it in tl.static_range(KP // T):
                if it * T < m:
                    _tokens_step(it, host_tab, dev_tab, src_ptr + b * K, dst_ptr + b * K, m, m,
                                 host_stride, dev_stride, P, VB, SB, SOFF, V1, V2, SE, NS, T,
                                 ALIGN, FLIP)
            tl.atomic_add(stats_ptr + 1, m.to(tl.int64))


def swap_in_consts(fmt: TokenFormat, *, topk: int, slots: int, host_stride: int,
                   dev_stride: int, align: int, cfg: SwapInConfig = SwapInConfig()) -> dict:
    """The launch's compile-time constants and shape (computed once per hot buffer)."""
    v1, v2 = _split(fmt.value_bytes)
    se = _pow2_align(fmt.scale_bytes, fmt.scale_offset, host_stride, dev_stride,
                     cap=min(8, align))
    kp = triton.next_power_of_2(topk)
    return dict(K=topk, KP=kp, S=slots, SP=triton.next_power_of_2(slots),
                P=fmt.tokens_per_page, VB=fmt.value_bytes, SB=fmt.scale_bytes,
                SOFF=fmt.scale_offset, V1=v1, V2=v2, SE=se,
                NS=triton.next_power_of_2(fmt.scale_bytes // se) if fmt.scale_bytes else 0,
                T=min(cfg.tokens, kp), ALIGN=align,
                FLIP=1 if v2 == 64 and v1 + v2 == fmt.value_bytes else 0,
                num_warps=cfg.num_warps)


class SwapInLaunch:
    """One layer's swap-in launch with every argument but ``req_slots`` and ``topk`` bound once
    (the host-side cost of a decode step is 21 of these per step).

    ``SwapInLaunch(args, consts, out, cuda)``: ``args`` maps every non-constexpr kernel
    parameter after ``out`` to its value (tables of one layer, scratch, strides), ``consts``
    comes from ``swap_in_consts``, ``out`` is the layer's ``[max_batch, K]`` int64 output.
    ``launch(req_slots, topk) -> out[:B]`` runs one layer for ``B = len(req_slots)`` batch rows
    on the current stream. Shapes: ``req_slots [B]`` int64, ``topk [B, K]`` (int32/int64, rows
    may be strided), ``lens [R]`` int64, ``slot_tok``/``order [R, S]`` int32, ``slot_loc [R,
    S+1]`` int64, ``host_pages [R, maxp]`` int64, scratch ``pos``/``first [>=B, maxt]`` int32
    (``first`` all ``FIRST_CLEAN``, and left so), ``need [>=B, S]`` int8, ``vict [>=B, K]``
    int32, ``src``/``dst [>=B, K]`` int64, ``stats [2]`` int64, ``host_tab``/``dev_tab [1]``
    int64 layer base addresses. Nothing is checked here (``HotBuffer`` does it).

    Without a GPU (``TRITON_INTERPRET=1``), or with ``cached = False``, every call goes through
    ``JITFunction.run``. On a GPU the first call of each specialization does too (Triton binds, specializes, compiles or finds
    the kernel) and returns the ``CompiledKernel``; it is kept under the key that decides
    Triton's specialization of the per-call arguments (their dtypes, ``topk``'s row stride, and
    the 16-byte alignment of both pointers; every other argument is fixed per layer), and later
    calls launch it through ``CompiledKernel[grid]`` directly, skipping the binder and the cache
    lookup, with the fixed tensors passed as their device addresses (ints). The ``[B]`` output
    views are made once per batch size.
    """

    def __init__(self, args: dict, consts: dict, out: torch.Tensor, cuda: bool) -> None:
        names = _swap_in_kernel.arg_names
        self._jit_kwargs = dict(args, **consts)
        fixed = dict(args)
        fixed.update({k: v for k, v in consts.items() if k in names})
        # after req, topk, topk_stride, out; tensors as their device addresses (the launcher
        # takes an int as is, where a tensor costs a data_ptr call and a driver query per call)
        self._tail = tuple(v.data_ptr() if isinstance(v, torch.Tensor) else v
                           for v in (fixed[n] for n in names[4:]))
        self._keep = fixed  # the tensors those addresses point into stay alive with the launch
        self._out, self._out_ptr = out, out.data_ptr()
        self._views: dict[int, torch.Tensor] = {}
        self._compiled: dict[tuple, object] = {}
        self._runners: dict[tuple, object] = {}
        self.cached = cuda  # False: every call through the JIT (the bench compares both)

    def launch(self, req_slots: torch.Tensor, topk: torch.Tensor) -> torch.Tensor:
        B = req_slots.shape[0]
        out = self._views.get(B)
        if out is None:
            out = self._views[B] = self._out[:B]
        if B == 0:
            return out
        ts = topk.stride(0)
        if not self.cached:
            _swap_in_kernel[(B,)](req_slots, topk, ts, out, **self._jit_kwargs)
            return out
        key = (B, req_slots.dtype, topk.dtype, ts, req_slots.data_ptr() & 15,
               topk.data_ptr() & 15)
        run = self._runners.get(key)
        if run is not None:
            run(req_slots, topk, ts, self._out_ptr, *self._tail)
            return out
        spec = key[1:]
        ck = self._compiled.get(spec)
        if ck is None:
            ck = _swap_in_kernel[(B,)](req_slots, topk, ts, out, **self._jit_kwargs)
            if hasattr(ck, "result"):  # a Triton that compiles asynchronously returns a future
                ck = ck.result()
            order = getattr(getattr(ck, "metadata", None), "runtime_argument_order", None)
            if order and list(order) != list(_swap_in_kernel.arg_names):
                self.cached = False  # this Triton reorders launcher arguments: JIT every call
                return out
            self._compiled[spec] = ck
        else:
            ck[(B, 1, 1)](req_slots, topk, ts, self._out_ptr, *self._tail)
        self._runners[key] = ck[(B, 1, 1)]
        return out

    @property
    def specializations(self) -> int:
        """Compiled kernels kept (GPU); each was launched once through the JIT."""
        return len(self._compiled)
