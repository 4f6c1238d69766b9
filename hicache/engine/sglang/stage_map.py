"""SGLang 0.5.23 DSV4 device pools -> our ``Layout``: which tensor is which pool, byte for byte.

``map_stage(kvcache, layout)`` takes an SGLang ``DeepSeekV4TokenToKVPool`` of one PP stage and
our ``Layout`` of that stage and returns ``StageBuffers``: for every pool of ours the per-layer
uint8 tensors ``[rows, page_bytes]`` SGLang owns, and the device row count of each index space.
It refuses (``LayoutMismatch``, one line) anything that does not map exactly:

==================  =========================================  =========  ==================
ours                SGLang 0.5.23 (host pool name)             row space  SGLang row index
==================  =========================================  =========  ==================
``swa_kv``          ``swa_kv_pool.kv_buffer`` (``swa``)        swa_page   SWA page
``c4_kv``           ``c4_kv_pool.kv_buffer`` (``..._c4``)      page       full page (256 tok)
``c4_indexer``      indexer region (``..._c4_indexer``)        page       full page
``c128_kv``         ``c128_kv_pool.kv_buffer`` (``..._c128``)  page       full page
``c4_state``        C4 ``CompressStatePool`` rings             swa_page   SWA page (ring R)
``c4_indexer_state`` indexer ``CompressStatePool`` rings       swa_page   SWA page (ring R)
``c128_state``      C128 ``CompressStatePool`` (ring 128)      req_slot   ring block; SGLang
                                                                          never offloads it
==================  =========================================  =========  ==================

SGLang sizes each device buffer of one space separately (e.g. C4 and C128 rows differ); the
daemon addresses one row range per space, so a space's device rows are the smallest buffer's row
count and only that prefix of the larger buffers is shared. Unsupported SGLang modes (unified
KV, FP4 or page-8 indexer split regions, MTP draft pools, online C128 state) are refused.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from hicache.core.errors import HicacheError
from hicache.core.layout import Layout

# SGLang host-pool name (PoolName value) -> our pool name
SGLANG_POOLS = {
    "swa": "swa_kv",
    "deepseek_v4_c4": "c4_kv",
    "deepseek_v4_c4_indexer": "c4_indexer",
    "deepseek_v4_c128": "c128_kv",
    "deepseek_v4_c4_state": "c4_state",
    "deepseek_v4_c4_indexer_state": "c4_indexer_state",
}


class LayoutMismatch(HicacheError, ValueError):
    """SGLang's device pools do not match the hicache layout byte for byte."""


@dataclass
class StageBuffers:
    layout: Layout
    layers: dict[str, list[torch.Tensor]]  # our pool -> [rows_i, page_bytes] uint8 per layer
    rows: dict[str, int]  # index space -> device rows shared with the daemon
    owners: dict[str, list[torch.Tensor]]  # our pool -> tensors whose storage backs each layer


def _as_rows(t: torch.Tensor, what: str) -> torch.Tensor:
    if not t.is_contiguous():
        raise LayoutMismatch(f"{what}: SGLang buffer is not contiguous")
    return t.view(torch.uint8).reshape(t.shape[0], -1)


def _state_rows(pool: Any, what: str) -> tuple[torch.Tensor, torch.Tensor, int]:
    """A CompressStatePool as ``[slots // ring, ring * slot_bytes]`` rows, its owner, its ring."""
    t = pool.kv_score_buffer.kv_score
    if not t.is_contiguous():
        raise LayoutMismatch(f"{what}: SGLang state tensor is not contiguous")
    ring = int(pool.ring_size)
    usable = (t.shape[0] // ring) * ring
    b = t.view(torch.uint8).reshape(t.shape[0], -1)[:usable]
    return b.reshape(usable // ring, -1), t, ring


def _check_layers(layout: Layout, pool: str, got: int) -> None:
    want = layout.pool(pool).num_layers
    if got != want:
        raise LayoutMismatch(f"{pool}: SGLang has {got} layers on this stage, the hicache layout "
                             f"has {want} (stage [{layout.stage.start}, {layout.stage.end}))")


def _check_family(layout: Layout, family: str, mapping: dict[int, int]) -> None:
    """SGLang's {stage-local layer: pool-local layer} must match our StageMap family."""
    for stage_local, pool_local in mapping.items():
        g = layout.stage.start + stage_local
        if layout.stage.local_id(family, g) != pool_local:
            raise LayoutMismatch(f"layer {g}: SGLang puts it at {family} index {pool_local}, "
                                 f"hicache at {layout.stage.local_id(family, g)}")


def map_stage(kvcache: Any, layout: Layout, *, mtp_draft_pools: Any = ()) -> StageBuffers:
    """Every pool of ``layout`` as SGLang's device tensors (see the module docstring)."""
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as A

    if getattr(kvcache, "_unified_kv", False):
        raise LayoutMismatch("SGLang unified KV mode has no separate pools; hicache maps the "
                             "paged DSV4 layout only")
    if mtp_draft_pools:
        raise LayoutMismatch("MTP draft device pools are not mapped by this adapter; serve and "
                             "launch without MTP (hicache --no-mtp)")
    if layout.mtp:
        raise LayoutMismatch("the hicache layout includes MTP layers; SGLang's target pool has "
                             "none: start the daemon with --no-mtp")
    if layout.swa_mode != "paged" or kvcache.swa_kv_pool is None:
        raise LayoutMismatch("only paged SWA maps onto SGLang's DSV4 HiCache (--swa-mode paged)")
    st = layout.stage
    if (kvcache.start_layer, kvcache.end_layer) != (st.start, st.end):
        raise LayoutMismatch(f"SGLang stage [{kvcache.start_layer}, {kvcache.end_layer}) is not "
                             f"the hicache stage [{st.start}, {st.end})")
    if kvcache.page_size != layout.model.page_size or kvcache.swa_page_size != layout.model.page_size:
        raise LayoutMismatch(f"SGLang page sizes {kvcache.page_size}/{kvcache.swa_page_size} "
                             f"differ from hicache's {layout.model.page_size}")
    maps = A._resolve_deepseek_v4_layer_mappings(kvcache)
    _check_family(layout, "swa", maps.swa)
    _check_family(layout, "c4", maps.c4)
    _check_family(layout, "c128", maps.c128)

    layers: dict[str, list[torch.Tensor]] = {}
    owners: dict[str, list[torch.Tensor]] = {}
    layers["swa_kv"] = [_as_rows(t, "swa_kv") for t in kvcache.swa_kv_pool.kv_buffer]
    owners["swa_kv"] = list(kvcache.swa_kv_pool.kv_buffer)
    if "c4_kv" in layout.pools:
        bufs, _ = A._dsv4_compressed_region_buffers(kvcache, 4)
        layers["c4_kv"], owners["c4_kv"] = [_as_rows(t, "c4_kv") for t in bufs], list(bufs)
        regions = list(A._dsv4_indexer_regions(kvcache, layout.model.page_size))
        if [str(r.name.value) for r in regions] != ["deepseek_v4_c4_indexer"]:
            raise LayoutMismatch(f"SGLang splits the C4 indexer into {[str(r.name.value) for r in regions]}"
                                 "; hicache maps one fused fp8 indexer row (no FP4/page-8 split)")
        layers["c4_indexer"] = [_as_rows(t, "c4_indexer") for t in regions[0].device_buffers]
        owners["c4_indexer"] = list(regions[0].device_buffers)
        for ours, src in (("c4_state", kvcache.compress_state_pools),
                          ("c4_indexer_state", kvcache.indexer_compress_state_pools)):
            got = [_state_rows(src[g], ours) for g in maps.c4_state_global_layers]
            for _, _, ring in got:
                if ring != layout.pool(ours).ring:
                    raise LayoutMismatch(f"{ours}: SGLang ring {ring}, hicache ring "
                                         f"{layout.pool(ours).ring}")
            layers[ours], owners[ours] = [g[0] for g in got], [g[1] for g in got]
    if "c128_kv" in layout.pools:
        bufs, _ = A._dsv4_compressed_region_buffers(kvcache, 128)
        layers["c128_kv"], owners["c128_kv"] = [_as_rows(t, "c128_kv") for t in bufs], list(bufs)
        got = [_state_rows(kvcache.compress_state_pools[g], "c128_state")
               for g in layout.stage.layers("c128")]
        if layout.c128_state != "offline" or any(r != layout.pool("c128_state").ring
                                                  for _, _, r in got):
            raise LayoutMismatch("SGLang keeps a ring of 128 C128 states per request: start the "
                                 "daemon with --c128-state offline")
        layers["c128_state"], owners["c128_state"] = [g[0] for g in got], [g[1] for g in got]
    if set(layers) != set(layout.pools):
        raise LayoutMismatch(f"SGLang pools {sorted(layers)} differ from hicache pools "
                             f"{sorted(layout.pools)}")
    rows: dict[str, int] = {}
    for name, ts in layers.items():
        spec = layout.pool(name)
        _check_layers(layout, name, len(ts))
        for i, t in enumerate(ts):
            if t.shape[1] != spec.page_bytes:
                raise LayoutMismatch(f"{name} layer {i}: SGLang row is {t.shape[1]} bytes, "
                                     f"hicache {spec.page_bytes}")
            rows[spec.index] = min(rows.get(spec.index, t.shape[0]), t.shape[0])
    return StageBuffers(layout, layers, rows, owners)
