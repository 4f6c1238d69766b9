"""Load SGLang's HiCache transfer op from a prebuilt ``common_ops.abi3.so`` to benchmark beside
our kernels (never a dependency; the library is not shipped with hicache).

``sglang-kernel==0.4.6`` matches torch 2.11 / CUDA 13; only ``sgl_kernel/sm90/common_ops.abi3.so``
is needed, loaded under the module name ``common_ops``. Its op
``torch.ops.sgl_kernel.transfer_kv_all_layer_mla(src_ptrs, dst_ptrs, src_idx, dst_idx,
item_bytes, num_layers, block_quota, warps_per_block)`` copies ``item_bytes`` contiguous bytes
per index per layer (uint64 CUDA pointer tables, int64 CUDA indices): rows, or 584-B contiguous
tokens, not the split value/scale token format.
"""
from __future__ import annotations

import importlib.util
import os
from typing import Callable, Optional

import torch

PEER_NAME = "sglang-kernel 0.4.6 transfer_kv_all_layer_mla"
DEFAULT_WARPS = 32  # SGLang's default warps per block on CUDA


def load(path: str) -> tuple[Optional[Callable[..., None]], str]:
    """(copy function, message). The function is None when the library cannot be loaded."""
    if not path or not os.path.exists(path):
        return None, f"peer library not found at {path!r}"
    try:
        spec = importlib.util.spec_from_file_location("common_ops", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # registers torch.ops.sgl_kernel.*
        op = torch.ops.sgl_kernel.transfer_kv_all_layer_mla
    except Exception as e:  # a peer that fails to load is reported, never fatal
        return None, f"peer library {path} did not load: {type(e).__name__}: {e}"

    def copy(src_tab: torch.Tensor, dst_tab: torch.Tensor, src_idx: torch.Tensor,
             dst_idx: torch.Tensor, item_bytes: int, num_layers: int, block_quota: int,
             warps: int = DEFAULT_WARPS) -> None:
        """Tables: int64 CUDA tensors of layer base addresses (viewed as uint64 here)."""
        op(src_tab.view(torch.uint64), dst_tab.view(torch.uint64), src_idx, dst_idx,
           int(item_bytes), int(num_layers), int(block_quota), int(warps))

    return copy, f"loaded {PEER_NAME} from {path}"
