"""Builds SGLang 0.5.23's own DSV4 cache stack on CPU for the adapter tests (sglang venv only).

``build_dsv4_cache(stage, ...)`` makes a ``DeepSeekV4TokenToKVPool`` for one PP stage of the
``dsv4-tiny`` layer pattern (ratios 0,4,128,4,128,4), SGLang's ``SWATokenToKVPoolAllocator`` and
``ReqToTokenPool``, and a ``UnifiedRadixCache`` (FULL + SWA components) with HiCache initialised
through SGLang's own ``init_hicache`` -> DSV4 stack strategy -> (patched) assembler.
``DEVICE_ROWS`` is what that pool shares with the daemon per index space.
"""
from __future__ import annotations

import atexit
from unittest import mock
from typing import Any

import torch

PAGE = 256
RATIOS = [0, 4, 128, 4, 128, 4]
FULL_TOKENS = 2048
SWA_TOKENS = 2048
# rows SGLang allocates for the sizes above: page = min(C4 12, indexer 12, C128 136),
# swa_page = 9 (SWA, both state rings), req_slot = C128 state 896 / 128
DEVICE_ROWS = "page=12,swa_page=9,req_slot=7"


def server_args() -> Any:
    from sglang.srt.server_args import ServerArgs, set_global_server_args_for_scheduler

    sa = ServerArgs(model_path="dummy", page_size=PAGE, hicache_io_backend="direct",
                    hicache_write_policy="write_through", hicache_mem_layout="layer_first")
    set_global_server_args_for_scheduler(sa)
    return sa


def build_dsv4_cache(start: int, end: int, device: str = "cpu") -> tuple[Any, Any, Any, Any]:
    """(cache, allocator, req_to_token_pool, kvcache) for stage [start, end) on ``device``."""
    from sglang.srt.mem_cache.allocator.swa import SWATokenToKVPoolAllocator
    from sglang.srt.mem_cache.cache_init_params import CacheInitParams
    from sglang.srt.mem_cache.deepseek_v4_memory_pool import DeepSeekV4TokenToKVPool
    from sglang.srt.mem_cache.memory_pool import ReqToTokenPool
    from sglang.srt.mem_cache.unified_cache.components.base import ComponentType
    from sglang.srt.environ import envs
    from sglang.srt.mem_cache.unified_cache.tree_core_registry import _TREE_CORE_REGISTRY
    from sglang.srt.mem_cache.unified_radix_cache import UnifiedRadixCache
    from sglang.test.kits.unified_radix_cache.unified_tree_core_inspector import (
        UnifiedTreeCoreInspector)

    sa = server_args()
    kv = DeepSeekV4TokenToKVPool(
        max_num_reqs=4, swa_size=SWA_TOKENS, c4_size=FULL_TOKENS // 4,
        c128_size=FULL_TOKENS // 128, c4_state_pool_size=SWA_TOKENS // PAGE * 8,
        c128_state_pool_size=0, page_size=PAGE, swa_page_size=PAGE, dtype=torch.float8_e4m3fn,
        c4_state_dtype=torch.float32, c128_state_dtype=torch.float32, qk_nope_head_dim=448,
        qk_rope_head_dim=64, indexer_head_dim=128, layer_num=len(RATIOS), device=device,
        enable_memory_saver=False, compression_ratios=RATIOS, start_layer=start, end_layer=end)
    r2t = ReqToTokenPool(size=4, max_context_len=4096, device=device, enable_memory_saver=False)
    alloc = SWATokenToKVPoolAllocator(FULL_TOKENS, SWA_TOKENS, page_size=PAGE,
                                      dtype=torch.float8_e4m3fn, device=device, kvcache=kv,
                                      need_sort=False, req_to_token_pool=r2t)
    kv.register_mapping(alloc.full_to_swa_index_mapping)
    params = CacheInitParams(req_to_token_pool=r2t, token_to_kv_pool_allocator=alloc,
                             page_size=PAGE, disable=False, sliding_window_size=128,
                             tree_components=(ComponentType.FULL, ComponentType.SWA),
                             eviction_policy="lru")
    with envs.SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND.override("python"), mock.patch.dict(
            _TREE_CORE_REGISTRY, {"python": UnifiedTreeCoreInspector}):
        cache = UnifiedRadixCache(params=params)  # the kit's inspectable Python tree core
    cache.init_hicache(sa, params)
    atexit.unregister(cache.shutdown)
    cache.write_through_threshold = 1 << 30
    cache.load_back_threshold = 0
    return cache, alloc, r2t, kv
