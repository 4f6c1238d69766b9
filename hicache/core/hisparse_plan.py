"""How many long requests fit on one GPU with and without HiSparse (``hicache plan --hisparse``).

Contract (pure integer arithmetic over ``hicache.core.layout``; no I/O, no torch):
``hisparse_plan(layouts, kv_mem, request_tokens, slots=None) -> HiSparsePlan``.

Device bytes of one request of ``request_tokens`` full tokens, per pipeline stage:

* **dense**: its page rows (``ceil(tokens / 256)`` x every pool of space ``page``: C4 KV, C4
  indexer keys, C128 KV), its SWA window (paged SWA: ``ceil(window / 256) + 1`` SWA pages of
  space ``swa_page``; ring SWA: part of the request-slot row) and its request-slot row.
* **sparse**: the same without the C4 KV pool, plus per C4 layer a hot buffer of ``slots + 1``
  token slots (default ``2 x index_topk``, packed: ``page_bytes / tokens_per_page`` each), plus
  the hot-buffer tables and scratch of ``hicache.engine.hot_buffer`` (int32 slot tokens and LRU
  order per slot and layer, int64 slot locations and host pages, the int64 top-k output per
  layer, and per batch row two int32 words per C4 token plus the small K/S vectors).

A request has ``tokens // 4`` C4 tokens (a C4 entry exists once its 4 tokens do), as the daemon
counts them at ``sparse_admit``; its host C4 KV takes ``ceil(c4 tokens / tokens_per_page)``
pages of the C4 pool, the sparse region's rows the daemon allocates for it.

``concurrent = floor(kv_mem / bytes per request)``; a worker's is the minimum over its stages.
``ratio = sparse / dense``. The host keeps the C4 KV of every sparse request: its bytes are
reported beside. Every figure is shown with the terms that make it.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Any, Sequence

from hicache.core.layout import Layout
from hicache.core.resume import C4_RATIO


@dataclass(frozen=True)
class StageRequestBytes:
    """One stage's device bytes of one request, term by term."""

    stage: int
    pages: int
    page_bytes_dense: int  # all pools of space "page", per page row id
    page_bytes_sparse: int  # the same without C4 KV
    swa_bytes: int  # paged SWA window pages (0 in ring mode: inside req_slot)
    req_slot_bytes: int
    c4_layers: int
    hot_buffer_bytes: int
    table_bytes: int
    host_c4_bytes: int

    @property
    def dense(self) -> int:
        return self.pages * self.page_bytes_dense + self.swa_bytes + self.req_slot_bytes

    @property
    def sparse(self) -> int:
        return (self.pages * self.page_bytes_sparse + self.swa_bytes + self.req_slot_bytes
                + self.hot_buffer_bytes + self.table_bytes)


@dataclass(frozen=True)
class HiSparsePlan:
    """Concurrent long requests per GPU, dense vs sparse."""

    kv_mem: int
    request_tokens: int
    topk: int
    slots: int
    stages: tuple[StageRequestBytes, ...]

    def concurrent(self, kind: str) -> int:
        return min(self.kv_mem // getattr(s, kind) for s in self.stages)

    @property
    def ratio(self) -> float:
        return self.concurrent("sparse") / max(1, self.concurrent("dense"))

    def to_dict(self) -> dict[str, Any]:
        return {
            "request_tokens": self.request_tokens, "topk": self.topk, "hot_slots": self.slots,
            "reserved_slots": 1, "kv_mem": self.kv_mem,
            "dense_concurrent_requests": self.concurrent("dense"),
            "sparse_concurrent_requests": self.concurrent("sparse"),
            "hisparse_concurrency_ratio": round(self.ratio, 3),
            "host_c4_bytes_for_sparse_requests": self.concurrent("sparse")
            * max(s.host_c4_bytes for s in self.stages),
            "stages": [dict(s.__dict__, dense=s.dense, sparse=s.sparse) for s in self.stages],
        }

    def lines(self) -> list[str]:
        out = [f"hisparse  {self.request_tokens:,}-token requests, top-k {self.topk}, hot buffer "
               f"{self.slots} + 1 reserved slots per C4 layer"]
        for s in self.stages:
            swa = f" + SWA window {s.swa_bytes:,}" if s.swa_bytes else ""
            out += [
                f"  stage {s.stage}: dense  = {s.pages:,} pages x {s.page_bytes_dense:,} B{swa} + "
                f"request slot {s.req_slot_bytes:,} = {s.dense:,} B per request",
                f"  stage {s.stage}: sparse = {s.pages:,} pages x {s.page_bytes_sparse:,} B (no C4"
                f" KV){swa} + request slot {s.req_slot_bytes:,} + hot buffers {s.c4_layers} x "
                f"{self.slots + 1} slots = {s.hot_buffer_bytes:,} + tables {s.table_bytes:,} = "
                f"{s.sparse:,} B per request",
            ]
        d, sp = self.concurrent("dense"), self.concurrent("sparse")
        host = sp * max(s.host_c4_bytes for s in self.stages)
        out += [f"  concurrent per GPU: dense {self.kv_mem:,} // dense = {d:,}; sparse "
                f"{self.kv_mem:,} // sparse = {sp:,}; ratio {self.ratio:.2f}x",
                f"  host C4 KV for {sp:,} sparse requests: {host:,} B ({host / 2**30:,.1f} GiB)"]
        return out


def _stage_bytes(lay: Layout, tokens: int, topk: int, slots: int) -> StageRequestBytes:
    m = lay.model
    pages = math.ceil(tokens / m.page_size)
    c4 = lay.pools.get("c4_kv")
    c4_row = c4.page_bytes * c4.num_layers if c4 else 0
    c4_layers = c4.num_layers if c4 else 0
    swa_pages = m.window_pages
    swa = swa_pages * lay.row_bytes("swa_page") if lay.swa_mode == "paged" else 0
    slot_bytes = c4.page_bytes // c4.tokens_per_page if c4 else 0
    hot = c4_layers * (slots + 1) * slot_bytes
    c4_tokens = tokens // C4_RATIO
    c4_pages = -(-c4_tokens // c4.tokens_per_page) if c4 else 0  # the sparse region's rows
    tables = (c4_layers * (2 * 4 * slots + 8 * topk)  # slot tokens, LRU order, top-k output
              + 8 * (slots + 1) + 8 * c4_pages  # slot locations, host pages
              + 2 * 4 * c4_tokens + slots + (4 + 8 + 8) * topk) if c4 else 0  # scratch
    return StageRequestBytes(lay.stage.pp_rank, pages, lay.row_bytes("page"),
                             lay.row_bytes("page") - c4_row, swa, lay.row_bytes("req_slot"),
                             c4_layers, hot, tables, c4_pages * c4_row)


def hisparse_plan(layouts: Sequence[Layout], kv_mem: int, request_tokens: int,
                  slots: int | None = None) -> HiSparsePlan:
    """Dense vs sparse concurrency for ``request_tokens``-token requests (module docstring)."""
    topk = layouts[0].model.index_topk
    slots = 2 * topk if slots is None else slots
    return HiSparsePlan(kv_mem, request_tokens, topk, slots,
                        tuple(_stage_bytes(lay, request_tokens, topk, slots) for lay in layouts))
