"""A worker's device KV pools for one ``Layout``, and the handles that share them with the daemon.

``DevicePools(layout, rows, device)`` allocates one buffer per pool per layer, each a
``torch.uint8`` tensor ``[rows[pool.index], pool.page_bytes]`` (``.layers[pool]``), zeroed:

* ``device="cuda:N"``: one CUDA allocation per pool (its layers are views), shared with the
  daemon through CUDA IPC (``export_buffer``: the storage's IPC handle, the storage's byte offset
  inside its allocator block, and the layer's byte offset inside the storage). Memory from
  ``expandable_segments`` or the ``cudaMallocAsync`` backend cannot be shared that way:
  ``check_ipc_allocator`` refuses it with a message that says what to change.
* ``device="cpu"``: one shared-memory file (``/dev/shm/hicache-dev-*``, mode 0600) holding every
  layer region 4 KiB-aligned, mapped with ``mmap``; a handle names the file, the offset and the
  shape. ``close()`` (or process exit) unlinks the file; the daemon's mapping outlives it.

``handles()`` -> ``{pool: [handle per layer]}`` is what ``Client.register`` sends.
``make_ipc_events(n, device)`` creates interprocess CUDA events and their wire handles.
"""
from __future__ import annotations

import base64
import mmap
import os
import secrets
import weakref
from typing import Any, Mapping

import torch

from hicache.layout import Layout

ALIGN = 4096


def _b64(b: bytes | None) -> str | None:
    return None if b is None else base64.b64encode(bytes(b)).decode()


def _align(n: int) -> int:
    return (n + ALIGN - 1) // ALIGN * ALIGN


# ----------------------------------------------------------------------------- CUDA IPC
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
        "handle": _b64(handle), "storage_bytes": int(storage_bytes),
        "storage_offset": int(storage_offset), "ref_counter": _b64(ref_handle),
        "ref_counter_offset": int(ref_offset), "event": _b64(ev_handle),
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
            handles.append(_b64(ev.ipc_handle()))
    return events, handles


# ----------------------------------------------------------------------------- shm files
def _unlink_quietly(path: str) -> None:
    try:
        os.unlink(path)
    except FileNotFoundError:
        pass


class DevicePools:
    """Every device pool of one stage (see the module docstring)."""

    def __init__(self, layout: Layout, rows: Mapping[str, int], device: str | torch.device = "cpu",
                 shm_dir: str = "/dev/shm") -> None:
        self.layout = layout
        self.device = torch.device(device)
        self.mode = "cuda" if self.device.type == "cuda" else "cpu"
        spaces = {p.index for p in layout.pools.values()}
        missing = sorted(s for s in spaces if rows.get(s, 0) <= 0)
        if missing:
            raise ValueError(f"device rows missing or not positive for spaces {missing}")
        self.rows = {s: int(rows[s]) for s in spaces}
        self.layers: dict[str, list[torch.Tensor]] = {}
        self._handles: dict[str, list[dict[str, Any]]] = {}
        self.path: str | None = None
        self._mm: mmap.mmap | None = None
        self._finalizer: Any = None
        if self.mode == "cuda":
            self._alloc_cuda()
        else:
            self._alloc_shm(shm_dir)

    # GPU: one allocation per pool, per-layer views
    def _alloc_cuda(self) -> None:
        check_ipc_allocator()
        for name, spec in self.layout.pools.items():
            n = self.rows[spec.index]
            big = torch.zeros(spec.num_layers, n, spec.page_bytes, dtype=torch.uint8,
                              device=self.device)
            self.layers[name] = [big[i] for i in range(spec.num_layers)]

    # CPU: one 0600 shm file, 4 KiB aligned regions
    def _alloc_shm(self, shm_dir: str) -> None:
        plan, end = [], 0
        for name, spec in self.layout.pools.items():
            nbytes = self.rows[spec.index] * spec.page_bytes
            for _ in range(spec.num_layers):
                plan.append((name, end, self.rows[spec.index], spec.page_bytes))
                end = _align(end + nbytes)
        if not os.path.isdir(shm_dir):
            raise ValueError(f"shared-memory directory {shm_dir} does not exist")
        path = os.path.join(shm_dir, f"hicache-dev-{os.getpid()}-{secrets.token_hex(6)}")
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            os.ftruncate(fd, max(end, ALIGN))
            mm = mmap.mmap(fd, max(end, ALIGN))
        except BaseException:
            os.close(fd)
            _unlink_quietly(path)
            raise
        os.close(fd)
        self.path, self._mm = path, mm
        self._finalizer = weakref.finalize(self, _unlink_quietly, path)
        base = torch.frombuffer(mm, dtype=torch.uint8)
        for name, off, n, rb in plan:
            t = base[off: off + n * rb].view(n, rb)
            self.layers.setdefault(name, []).append(t)
            self._handles.setdefault(name, []).append(
                {"kind": "shm", "path": path, "offset": off, "rows": n, "row_bytes": rb})

    def pool(self, name: str) -> list[torch.Tensor]:
        return self.layers[self.layout.pool(name).name]

    def handles(self) -> dict[str, list[dict[str, Any]]]:
        """{pool: [wire handle per layer]} for ``register``."""
        if self.mode == "cpu":
            return {k: [dict(h) for h in v] for k, v in self._handles.items()}
        if not self._handles:  # export once: every export creates a ref counter in torch
            self._handles = export_buffers(self.layers)
        return {k: [dict(h) for h in v] for k, v in self._handles.items()}

    def nbytes(self) -> int:
        return sum(t.numel() for layers in self.layers.values() for t in layers)

    def close(self) -> None:
        """Drop the tensors; in CPU mode unlink the shm file (the daemon's mapping stays valid)."""
        self.layers = {}
        if self._finalizer is not None:
            self._finalizer()
            self._finalizer = None

    def __enter__(self) -> "DevicePools":
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()
