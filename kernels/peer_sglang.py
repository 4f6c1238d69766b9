"""Load SGLang's HiCache transfer op from a prebuilt ``common_ops.abi3.so`` to benchmark beside
our kernels (never a dependency; the library is not shipped with hicache).

``sglang-kernel==0.4.6`` matches torch 2.11 / CUDA 13; only ``sgl_kernel/sm90/common_ops.abi3.so``
(16 MB) is needed, loaded under the module name ``common_ops``; ``scripts/fetch_peer.sh``
puts it into ``.peer/`` with a ``common_ops.abi3.so.version`` file naming the wheel it came
from. ``load`` names the peer from that file, or else by the library's sha256 (never a
version it cannot see). Its op
``torch.ops.sgl_kernel.transfer_kv_all_layer_mla(src_ptrs, dst_ptrs, src_idx, dst_idx,
item_bytes, num_layers, block_quota, warps_per_block)`` copies ``item_bytes`` contiguous bytes
per index per layer (uint64 CUDA pointer tables, int64 CUDA indices): rows, or 584-B contiguous
tokens, not the split value/scale token format.
"""
from __future__ import annotations

import ctypes
import glob
import hashlib
import importlib.util
import os
from typing import Callable, Optional

import torch

OP = "transfer_kv_all_layer_mla"
DEFAULT_WARPS = 32  # SGLang's default warps per block on CUDA
VERSION_SUFFIX = ".version"  # beside the library: the wheel it came from (fetch_peer.sh)


def describe(path: str) -> str:
    """The peer's name: the version file beside ``path`` when there is one, else the
    library's file name and sha256 prefix."""
    try:
        with open(path + VERSION_SUFFIX, encoding="utf-8") as f:
            version = f.read().strip()
    except OSError:
        version = ""
    if version:
        return f"{version} {OP}"
    with open(path, "rb") as f:
        digest = hashlib.sha256(f.read()).hexdigest()[:12]
    return f"sglang {OP} ({os.path.basename(path)} sha256:{digest})"


def _preload_cuda_libs() -> None:
    """The library needs libnvrtc.so.13, which torch loads only on demand: load it (and the
    other ``nvidia/*/lib`` libraries torch's wheel brings) from torch's site-packages first,
    so the dynamic linker finds them by soname."""
    site = os.path.dirname(os.path.dirname(torch.__file__))
    for lib in sorted(glob.glob(os.path.join(site, "nvidia", "*", "lib", "libnvrtc.so.*"))):
        try:
            ctypes.CDLL(lib, mode=ctypes.RTLD_GLOBAL)
        except OSError:
            pass  # a wrong one is named by the load below, with the linker's message


def load(path: str) -> tuple[Optional[Callable[..., None]], str, str]:
    """(copy function, message, peer name). The function is None when the library cannot be
    loaded (the message says why)."""
    if not path or not os.path.exists(path):
        return None, f"peer library not found at {path!r} (scripts/fetch_peer.sh fetches it)", ""
    name = describe(path)
    try:
        _preload_cuda_libs()
        spec = importlib.util.spec_from_file_location("common_ops", path)
        mod = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(mod)  # registers torch.ops.sgl_kernel.*
        op = getattr(torch.ops.sgl_kernel, OP)
    except Exception as e:  # a peer that fails to load is reported, never fatal
        return None, f"peer library {path} did not load: {type(e).__name__}: {e}", name

    def copy(src_tab: torch.Tensor, dst_tab: torch.Tensor, src_idx: torch.Tensor,
             dst_idx: torch.Tensor, item_bytes: int, num_layers: int, block_quota: int,
             warps: int = DEFAULT_WARPS) -> None:
        """Tables: int64 CUDA tensors of layer base addresses (viewed as uint64 here)."""
        op(src_tab.view(torch.uint64), dst_tab.view(torch.uint64), src_idx, dst_idx,
           int(item_bytes), int(num_layers), int(block_quota), int(warps))

    return copy, f"loaded {name} from {path}", name
