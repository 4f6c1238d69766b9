"""Registering host memory with one CUDA device, and the driver queries around it.

Contract: ``CudaHostRegistrar(device_index)`` acts on that device only (every call runs under
``torch.cuda.device(index)``; nothing initializes other devices).

* ``register(ptr, nbytes)``: ``cudaHostRegister(ptr, nbytes, 0)`` through torch's cudart;
  raises ``ArenaError`` carrying the driver's error code and text (the runtime's last error is
  cleared so a later kernel launch does not report it).
* ``unregister(ptr) -> str | None``: the error text, or ``None`` on success.
* ``device_pointer(ptr) -> int | None``: ``cuMemHostGetDevicePointer`` (driver API via
  ``libcuda.so.1``); ``None`` when it cannot be asked.
* ``can_use_host_pointer() -> bool | None``: ``CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM``.

Any object with these four methods can stand in for it (tests inject failing ones).
"""
from __future__ import annotations

import ctypes
import logging
from typing import Any, Protocol

from hicache.core.cuda_runtime import clear_runtime_error

from .errors import ArenaError

log = logging.getLogger("hicache.host_pools")
_ATTR_CAN_USE_HOST_POINTER = 91  # CU_DEVICE_ATTRIBUTE_CAN_USE_HOST_POINTER_FOR_REGISTERED_MEM


class HostRegistrar(Protocol):
    device_index: int

    def register(self, ptr: int, nbytes: int) -> None: ...
    def unregister(self, ptr: int) -> str | None: ...
    def device_pointer(self, ptr: int) -> int | None: ...
    def can_use_host_pointer(self) -> bool | None: ...


_driver: Any = False  # False = not tried yet, None = unavailable


def _libcuda() -> Any | None:
    global _driver
    if _driver is False:
        try:
            lib = ctypes.CDLL("libcuda.so.1")
            _driver = lib if lib.cuInit(0) == 0 else None
        except OSError:
            _driver = None
    return _driver


def _cu_device(ordinal: int) -> ctypes.c_int | None:
    lib = _libcuda()
    dev = ctypes.c_int()
    if lib is None or lib.cuDeviceGet(ctypes.byref(dev), ctypes.c_int(ordinal)) != 0:
        return None
    return dev


def driver_pci_bus_id(ordinal: int) -> str | None:
    """``cuDeviceGetPCIBusId`` (no context needed), or ``None``."""
    dev = _cu_device(ordinal)
    if dev is None:
        return None
    buf = ctypes.create_string_buffer(32)
    if _libcuda().cuDeviceGetPCIBusId(buf, ctypes.c_int(32), dev) != 0:
        return None
    return buf.value.decode()


class CudaHostRegistrar:
    """Page-locks host ranges for ``device_index`` (default flags: this context only)."""

    def __init__(self, device_index: int) -> None:
        import torch

        if not torch.cuda.is_available():
            raise ArenaError("CUDA is not available; use device_index=None for CPU mode")
        count = torch.cuda.device_count()
        if isinstance(device_index, bool) or not isinstance(device_index, int) \
                or not 0 <= device_index < count:
            raise ArenaError(f"cuda:{device_index} does not exist; {count} device(s) visible")
        self.device_index = device_index
        with torch.cuda.device(device_index):
            torch.cuda.synchronize()  # create this device's (only this device's) context now,
            # so it is neither timed as registration nor made on another device later

    def register(self, ptr: int, nbytes: int) -> None:
        import torch

        with torch.cuda.device(self.device_index):
            rt = torch.cuda.cudart()
            rc = rt.cudaHostRegister(ptr, nbytes, 0)
            if int(rc) != 0:
                text = _error_text(rt, rc)
                clear_runtime_error()
                raise ArenaError(
                    f"cudaHostRegister of {nbytes} bytes at {ptr:#x} on cuda:{self.device_index} "
                    f"failed: error {int(rc)} ({text})"
                )

    def unregister(self, ptr: int) -> str | None:
        import torch

        with torch.cuda.device(self.device_index):
            rt = torch.cuda.cudart()
            rc = rt.cudaHostUnregister(ptr)
            if int(rc) != 0:
                clear_runtime_error()
                return f"error {int(rc)} ({_error_text(rt, rc)})"
        return None

    def device_pointer(self, ptr: int) -> int | None:
        import torch

        lib = _libcuda()
        if lib is None:
            return None
        out = ctypes.c_uint64()
        with torch.cuda.device(self.device_index):  # the primary context is current here
            rc = lib.cuMemHostGetDevicePointer_v2(ctypes.byref(out), ctypes.c_void_p(ptr),
                                                  ctypes.c_uint(0))
        if rc != 0:
            log.warning("cuMemHostGetDevicePointer(%#x) failed with driver error %d", ptr, rc)
            return None
        return int(out.value)

    def can_use_host_pointer(self) -> bool | None:
        dev = _cu_device(self.device_index)
        if dev is None:
            return None
        val = ctypes.c_int()
        rc = _libcuda().cuDeviceGetAttribute(ctypes.byref(val),
                                             ctypes.c_int(_ATTR_CAN_USE_HOST_POINTER), dev)
        return bool(val.value) if rc == 0 else None


def _error_text(rt: Any, rc: Any) -> str:
    try:
        return str(rt.cudaGetErrorString(rc))
    except Exception:  # noqa: BLE001 - the code alone still says something
        return "no error text"
