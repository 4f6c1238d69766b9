"""HiSparse hot buffer (engine side): per request slot and C4 layer, ``slots`` device token slots
(default 2 x top-k) plus one reserved slot for the newest token, filled on demand from the sparse
host region by one swap-in launch per layer for the whole batch.

``HotBuffer(host, fmt=..., topk=..., max_requests=..., max_batch=..., max_tokens=..., device=...)``
(``host``: the sparse host region's per-layer C4 page rows, a ``LayerTable`` or a list of
``[rows, page_bytes]`` uint8 tensors; ``fmt``: a ``TokenFormat`` or the layout's ``c4_kv``
``PoolSpec``) owns the device side: a packed C4 page buffer per layer (slot ``s`` of request slot ``r`` at token
location ``r * (slots + 1) + s``) and every table of ``hicache.kernels.hisparse`` as device
tensors of fixed shape, so ``swap_in`` can be captured in a CUDA graph (``check=False``).

* ``admit(r, n, host_pages)``: a request of ``n`` C4 tokens whose tokens sit in the host page rows
  ``host_pages`` (token ``t`` in row ``host_pages[t // P]``). A short request (``n <= slots``) is
  loaded whole (slot = token id: the fast path); a long one starts empty, with its newest token
  in the reserved slot. ``extend(r, n, host_pages)`` grows it; ``release(r)`` frees the slot.
* ``newest_locs(req_slots)``: where the engine writes each request's newest C4 token.
* ``swap_in(layer, req_slots, topk) -> [B, K]`` int64 device locations (-1 for ids outside the
  request and for padding rows ``req_slots == -1``). ``impl``: ``"triton"`` (GPU, or CPU under
  ``TRITON_INTERPRET=1``), ``"reference"`` (torch), ``"auto"`` (triton on a GPU).
* ``hits()``: ``(lookups, tokens copied)`` per layer since the start, for metrics.

Bad input raises ``HotBufferError`` (one line) and changes nothing.
"""
from __future__ import annotations

import math
from typing import Optional, Sequence

import torch

from hicache.kernels.dispatch import copy_tokens
from hicache.kernels.hisparse import FIRST_CLEAN, SwapInConfig, SwapInLaunch, swap_in_consts
from hicache.kernels.hisparse_reference import swap_in_ref
from hicache.kernels.tables import Buffer, LayerTable, TokenFormat, as_table

IMPLS = ("auto", "triton", "reference")


class HotBufferError(ValueError):
    """A hot-buffer call that cannot be carried out; raised before anything changes."""


class HotBuffer:
    """Device hot buffers and tables of up to ``max_requests`` sparse requests (see module)."""

    def __init__(self, host: Buffer, *, fmt: object, topk: int, max_requests: int,
                 max_batch: int, max_tokens: int, slots: Optional[int] = None,
                 device: str | torch.device = "cpu", impl: str = "auto",
                 cfg: SwapInConfig = SwapInConfig()) -> None:
        if impl not in IMPLS:
            raise HotBufferError(f"impl {impl!r} is not one of {IMPLS}")
        host = as_table(host, "sparse host")
        fmt = fmt if isinstance(fmt, TokenFormat) else TokenFormat.from_spec(fmt)
        slots = 2 * topk if slots is None else slots
        for name, v in (("topk", topk), ("max_requests", max_requests),
                        ("max_batch", max_batch), ("max_tokens", max_tokens), ("slots", slots)):
            if not isinstance(v, int) or v <= 0:
                raise HotBufferError(f"{name} must be a positive int, got {v!r}")
        if slots < topk:
            raise HotBufferError(f"slots ({slots}) must be at least topk ({topk}): a step's "
                                 f"misses need that many evictable slots")
        if host.row_bytes != fmt.page_bytes:
            raise HotBufferError(f"host rows are {host.row_bytes} B, the token format's pages "
                                 f"{fmt.page_bytes} B")
        self.device = torch.device(device)
        if self.device.type == "cuda" and self.device.index is None:
            self.device = torch.device("cuda", torch.cuda.current_device())
        self.impl = ("triton" if self.device.type == "cuda" else "reference") \
            if impl == "auto" else impl
        self.host, self.fmt, self.cfg = host, fmt, cfg
        self.K, self.S, self.R, self.B = topk, slots, max_requests, max_batch
        self.L, self.P = host.num_layers, fmt.tokens_per_page
        self.max_tokens = max_tokens
        self.maxp = math.ceil(max_tokens / self.P)
        dev, L, R, S, K = self.device, self.L, self.R, self.S, self.K
        rows = math.ceil(R * (S + 1) / self.P)
        self.dev = LayerTable([torch.zeros(rows, fmt.page_bytes, dtype=torch.uint8, device=dev)
                               for _ in range(L)], "hot buffer")
        self.slot_loc = (torch.arange(R * (S + 1), dtype=torch.int64, device=dev)
                         .view(R, S + 1).contiguous())
        self.slot_tok = torch.full((L, R, S), -1, dtype=torch.int32, device=dev)
        self.order = torch.arange(S, dtype=torch.int32, device=dev).repeat(L, R, 1).contiguous()
        self.lens = torch.zeros(R, dtype=torch.int64, device=dev)
        self.host_pages = torch.zeros(R, self.maxp, dtype=torch.int64, device=dev)
        self.out = torch.full((L, self.B, K), -1, dtype=torch.int64, device=dev)
        self.stats = torch.zeros(L, 2, dtype=torch.int64, device=dev)
        self._pos = torch.zeros(self.B, max_tokens, dtype=torch.int32, device=dev)
        self._first = torch.full((self.B, max_tokens), FIRST_CLEAN, dtype=torch.int32,
                                 device=dev)
        self._need = torch.zeros(self.B, S, dtype=torch.int8, device=dev)
        self._vict = torch.zeros(self.B, K, dtype=torch.int32, device=dev)
        self._src = torch.zeros(self.B, K, dtype=torch.int64, device=dev)
        self._dst = torch.zeros(self.B, K, dtype=torch.int64, device=dev)
        self._kdev = dev if dev.type == "cuda" else torch.device("cpu")
        self._lens_host = [0] * R  # admitted lengths as the host knows them (0 = free)
        kd = self._kdev
        ht, dt = self.host.table(kd), self.dev.table(kd)
        # per-layer launches, built once: the launch path creates no tensors
        consts = swap_in_consts(fmt, topk=K, slots=S, host_stride=host.stride,
                                dev_stride=self.dev.stride,
                                align=min(host.align, self.dev.align), cfg=cfg)
        common = dict(lens_ptr=self.lens, loc_ptr=self.slot_loc, hp_ptr=self.host_pages,
                      maxp=self.maxp, pos_ptr=self._pos, first_ptr=self._first, maxt=max_tokens,
                      need_ptr=self._need, vict_ptr=self._vict, src_ptr=self._src,
                      dst_ptr=self._dst, host_stride=host.stride, dev_stride=self.dev.stride)
        self._launch = [SwapInLaunch(dict(common, tok_ptr=self.slot_tok[l], ord_ptr=self.order[l],
                                          stats_ptr=self.stats[l], host_tab=ht[l:l + 1],
                                          dev_tab=dt[l:l + 1]),
                                     consts, self.out[l], cuda=dev.type == "cuda")
                        for l in range(L)] if self.impl == "triton" else []

    # ------------------------------------------------------------------ request slots
    def _check_slot(self, r: object, admitted: Optional[bool]) -> int:
        if not isinstance(r, int) or isinstance(r, bool) or not 0 <= r < self.R:
            raise HotBufferError(f"request slot {r!r} is not an int in [0, {self.R})")
        if admitted is True and self._lens_host[r] == 0:
            raise HotBufferError(f"request slot {r} is not admitted")
        if admitted is False and self._lens_host[r] != 0:
            raise HotBufferError(f"request slot {r} is already admitted")
        return r

    def _check_pages(self, n: object, host_pages: Sequence[int]) -> torch.Tensor:
        if not isinstance(n, int) or isinstance(n, bool) or not 0 < n <= self.max_tokens:
            raise HotBufferError(f"length {n!r} is not an int in [1, {self.max_tokens}]")
        need = math.ceil(n / self.P)
        pages = list(host_pages)
        if len(pages) < need:
            raise HotBufferError(f"{n} tokens need {need} host pages, got {len(pages)}")
        bad = [p for p in pages if not isinstance(p, int) or not 0 <= p < self.host.rows]
        if bad:
            raise HotBufferError(f"host page {bad[0]!r} is not a row in [0, {self.host.rows})")
        return torch.tensor(pages[:need], dtype=torch.int64)

    def admit(self, r: int, n: int, host_pages: Sequence[int]) -> None:
        """Take request slot ``r`` for a request of ``n`` C4 tokens held in ``host_pages``."""
        r = self._check_slot(r, False)
        pages = self._check_pages(n, host_pages)
        S = self.S
        self.host_pages[r].zero_()
        self.host_pages[r, : pages.numel()] = pages.to(self.device)
        held = torch.arange(S, dtype=torch.int32) if n <= S else torch.full((S,), -1, dtype=torch.int32)
        self.slot_tok[:, r] = held.to(self.device)
        self.order[:, r] = torch.arange(S, dtype=torch.int32, device=self.device)
        self.lens[r] = n
        self._lens_host[r] = n
        toks = torch.arange(n) if n <= S else torch.tensor([n - 1])
        self._load(r, toks, toks.clamp(max=S))

    def extend(self, r: int, n: int, host_pages: Sequence[int]) -> None:
        """Request slot ``r`` now has ``n`` C4 tokens (never fewer than before); ``host_pages``
        covers them all. The engine writes the new newest token at ``newest_locs``. A step that
        added more than one token (MTP, a batch of extends) while the request used the fast
        path: the tokens before the newest that sit in their own slots (slot = token id) come
        from the host here, as no one else writes them (those slots hold a previous request's
        bytes)."""
        r = self._check_slot(r, True)
        pages = self._check_pages(n, host_pages)
        old = self._lens_host[r]
        if n < old:
            raise HotBufferError(f"request slot {r}: length {n} < current {old}"
                                 f" (lengths only grow; release and admit again)")
        self.host_pages[r, : pages.numel()] = pages.to(self.device)
        self.lens[r] = n
        self._lens_host[r] = n
        top = min(n - 1, self.S)  # identity slots below the newest token
        if old < top:
            toks = torch.arange(old, top)
            self._load(r, toks, toks)

    def release(self, r: int) -> None:
        """Free request slot ``r`` (its device slots are reused by the next admit)."""
        r = self._check_slot(r, True)
        self.lens[r] = 0
        self.slot_tok[:, r] = -1
        self._lens_host[r] = 0

    def _load(self, r: int, toks: torch.Tensor, slots: torch.Tensor) -> None:
        """Copy tokens ``toks`` of request slot ``r`` from the host into ``slots``, all layers."""
        hp = self.host_pages[r].cpu()
        src = hp[toks // self.P] * self.P + toks % self.P
        dst = self.slot_loc[r].cpu()[slots]
        copy_tokens(self.host, self.dev, src, dst, self.fmt,
                    impl="reference" if self.impl == "reference" else "auto")

    def newest_locs(self, req_slots: torch.Tensor) -> torch.Tensor:
        """Device token location of each request's newest C4 token (identity while the request
        fits, else the reserved slot); padding rows get -1. Device ops only (graph-safe)."""
        r = req_slots.clamp(min=0)
        s = (self.lens[r] - 1).clamp(min=0, max=self.S)
        return torch.where(req_slots >= 0, self.slot_loc[r, s], -1)

    # ------------------------------------------------------------------ swap-in
    def _check_step(self, layer: object, req_slots: torch.Tensor, topk: torch.Tensor) -> None:
        if not isinstance(layer, int) or not 0 <= layer < self.L:
            raise HotBufferError(f"layer {layer!r} is not an int in [0, {self.L})")
        if not isinstance(req_slots, torch.Tensor) or req_slots.dtype != torch.int64 \
                or req_slots.dim() != 1 or (req_slots.numel() > 1 and req_slots.stride(0) != 1):
            # (the kernel reads row b at req_slots' data + b: a strided view would make it run
            # on elements these checks never saw)
            raise HotBufferError("req_slots must be a contiguous 1-D int64 tensor")
        B = req_slots.numel()
        if not 0 < B <= self.B:
            raise HotBufferError(f"batch of {B} rows, the buffer takes 1..{self.B}")
        if not isinstance(topk, torch.Tensor) or topk.dtype not in (torch.int32, torch.int64) \
                or tuple(topk.shape) != (B, self.K) or topk.stride(1) != 1:
            raise HotBufferError(f"topk must be an int32/int64 tensor [{B}, {self.K}] with "
                                 f"unit column stride")
        for name, t in (("req_slots", req_slots), ("topk", topk)):
            if t.device != self.device:
                raise HotBufferError(f"{name} is on {t.device}, the hot buffer on {self.device}")
        rs = req_slots.tolist()
        live = [r for r in rs if r != -1]
        bad = [r for r in live if not 0 <= r < self.R or self._lens_host[r] == 0]
        if bad or min(rs) < -1:
            what = bad[0] if bad else min(rs)
            raise HotBufferError(f"request slot {what} in req_slots is not an admitted slot "
                                 f"(or -1 for padding)")
        if len(set(live)) != len(live):
            raise HotBufferError("a request slot appears twice in req_slots")

    def swap_in(self, layer: int, req_slots: torch.Tensor, topk: torch.Tensor, *,
                check: bool = True) -> torch.Tensor:
        """Map ``topk [B, K]`` ids of layer ``layer`` to device locations, copying misses in;
        returns this layer's output buffer rows ``[B, K]``. ``check=False`` skips the input
        checks (they sync the host with the device; use it under CUDA-graph capture, with
        inputs of the shape the checks passed: ``req_slots`` contiguous)."""
        if check:
            self._check_step(layer, req_slots, topk)
        if self.impl == "reference":
            out = self.out[layer, : req_slots.shape[0]]
            swap_in_ref(req_slots, topk, out, self.lens, self.slot_tok[layer],
                        self.order[layer], self.slot_loc, self.host_pages, self.stats[layer],
                        self.host.layers[layer], self.dev.layers[layer], self.fmt)
            return out
        return self._launch[layer].launch(req_slots, topk)

    @property
    def launches(self) -> list[SwapInLaunch]:
        """The per-layer launches of the Triton path (``SwapInLaunch``; empty for reference)."""
        return self._launch

    def hits(self) -> list[tuple[int, int]]:
        """(lookups, tokens copied) per layer since the start (one device sync)."""
        return [tuple(x) for x in self.stats.cpu().tolist()]

    @property
    def device_bytes_per_request(self) -> int:
        """Device bytes one request's hot buffers take over all layers (token bytes, unpadded)."""
        return (self.S + 1) * self.fmt.token_bytes * self.L
