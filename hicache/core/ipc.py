"""IPC helpers both sides share: CUDA IPC exports of device buffers, interprocess events and
base64 wire forms of their handles. (CPU-mode device pools are sealed memfds a worker hands in:
``core.sealed_memfd``, ``core.fd_handout``.)

Contract:

* ``export_buffer(t)`` / ``export_buffers(layers)`` -> wire handles of contiguous 2-D CUDA
  tensors (the storage's IPC handle, the storage's offset inside its allocator block, the
  tensor's byte offset inside the storage). ``check_ipc_allocator()`` refuses memory CUDA IPC
  cannot share (``expandable_segments``, a non-native allocator backend) with a message.
* ``make_ipc_events(n, device)`` -> ``n`` interprocess CUDA events and their wire handles.
* ``encode_b64(bytes)`` / ``decode_b64(field, value)``: the handle wire form; decoding raises
  ``ValueError`` naming the field.
"""
from __future__ import annotations

import base64
import binascii
import os
from typing import Any

import torch

MAX_B64 = 4096  # longest handle string accepted from the wire


def decode_b64(field: str, v: Any) -> bytes:
    """Bytes of a base64 handle string received from the wire; ``ValueError`` naming ``field``."""
    if not isinstance(v, str) or len(v) > MAX_B64:
        raise ValueError(f"{field} must be a base64 string")
    try:
        return base64.b64decode(v, validate=True)
    except (binascii.Error, ValueError):
        raise ValueError(f"{field} is not valid base64") from None


def encode_b64(b: bytes | None) -> str | None:
    """Wire form of an IPC handle (None stays None)."""
    return None if b is None else base64.b64encode(bytes(b)).decode()


def check_ipc_allocator() -> None:
    """Raise RuntimeError when torch's CUDA allocator hands out memory CUDA IPC cannot share."""
    conf = ",".join(os.environ.get(k, "") for k in ("PYTORCH_CUDA_ALLOC_CONF", "PYTORCH_ALLOC_CONF"))
    getter = getattr(torch._C, "_accelerator_getAllocatorSettings", None)
    if getter is not None:
        try:
            conf += "," + str(getter())
        except Exception:  # noqa: BLE001 - informational only
            pass
    norm = conf.replace(" ", "").lower()
    if "expandable_segments:true" in norm or "expandable_segments:1" in norm:
        raise RuntimeError(
            "device pools come from expandable_segments (PYTORCH_CUDA_ALLOC_CONF="
            f"{os.environ.get('PYTORCH_CUDA_ALLOC_CONF', '')!r}); CUDA IPC cannot share that "
            "memory with the hicache daemon. Start the worker without expandable_segments:True.")
    try:
        backend = torch.cuda.get_allocator_backend()
    except Exception:  # noqa: BLE001
        backend = "native"
    if backend != "native":
        raise RuntimeError(f"torch's CUDA allocator backend is {backend!r}; hicache shares "
                           f"device pools through CUDA IPC, which needs the 'native' backend")


def _segment_is_expandable(t: torch.Tensor) -> bool:
    """Best effort: does the allocator segment holding ``t`` come from expandable segments?"""
    try:
        ptr = t.data_ptr()
        for seg in torch.cuda.memory_snapshot():
            base, size = seg.get("address", 0), seg.get("total_size", 0)
            if base <= ptr < base + size:
                return bool(seg.get("is_expandable", False))
    except Exception:  # noqa: BLE001
        pass
    return False


def device_uuid(index: int) -> str:
    try:
        return str(torch.cuda.get_device_properties(index).uuid)
    except Exception:  # noqa: BLE001 - older torch: no uuid
        return ""


def export_buffer(t: torch.Tensor, _shared: dict[int, tuple] | None = None) -> dict[str, Any]:
    """Wire handle of one per-layer buffer: a 2-D contiguous CUDA tensor ``[rows, row_bytes]``
    (any dtype; it is shared as bytes). ``_shared`` caches the storage's IPC export so that the
    layers of one allocation share one handle (one mapping and one ref counter in the daemon)."""
    if t.dim() != 2 or not t.is_contiguous():
        raise ValueError(f"a buffer must be a contiguous 2-D tensor, got shape {tuple(t.shape)} "
                         f"strides {t.stride()}")
    rows, row_bytes = int(t.shape[0]), int(t.shape[1]) * t.element_size()
    if t.device.type != "cuda":
        raise ValueError("export_buffer shares CUDA tensors; CPU pools use DevicePools.handles()")
    storage = t.untyped_storage()
    key = storage.data_ptr()
    exp = None if _shared is None else _shared.get(key)
    if exp is None:
        check_ipc_allocator()
        if _segment_is_expandable(t):
            raise RuntimeError("this buffer lives in an expandable segment; CUDA IPC cannot "
                               "share it (start the worker without expandable_segments:True)")
        exp = storage._share_cuda_()
        if _shared is not None:
            _shared[key] = exp
    (dev, handle, storage_bytes, storage_offset, ref_handle, ref_offset, ev_handle, ev_sync) = exp
    return {
        "kind": "cuda_ipc", "uuid": device_uuid(t.device.index), "device": int(dev),
        "handle": encode_b64(handle), "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_counter": encode_b64(ref_handle),
        "ref_counter_offset": int(ref_offset), "event": encode_b64(ev_handle),
        "event_sync": bool(ev_sync), "offset": int(t.storage_offset()) * t.element_size(),
        "rows": rows, "row_bytes": row_bytes,
    }


def export_buffers(layers: dict[str, list[torch.Tensor]]) -> dict[str, list[dict[str, Any]]]:
    """Handles of every pool's layers; one IPC export per underlying allocation."""
    shared: dict[int, tuple] = {}
    return {name: [export_buffer(t, shared) for t in ts] for name, ts in layers.items()}


def make_ipc_events(n: int, device: torch.device | str) -> tuple[list[Any], list[str]]:
    """``n`` interprocess CUDA events on ``device`` and their base64 IPC handles."""
    dev = torch.device(device)
    events, handles = [], []
    with torch.cuda.device(dev):
        for _ in range(n):
            ev = torch.cuda.Event(interprocess=True)
            ev.record(torch.cuda.current_stream(dev))  # give the event a device and a state
            events.append(ev)
            handles.append(encode_b64(ev.ipc_handle()))
    return events, handles
