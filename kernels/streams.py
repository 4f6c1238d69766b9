"""The current CUDA stream, cheaply: the copy paths ask for it on every command.

* ``current_stream(device=None)``: ``torch.cuda.current_stream(device)``, one ``Stream`` object kept
  per raw stream (the torch call builds a new object each time, ~30 µs of host time).
* ``on_stream(stream, device=...)``: makes ``stream`` current for a ``with`` block. Nothing is
  done when ``stream`` or ``device`` is None (not on a GPU) or when ``stream`` is current
  already (``torch.cuda.stream`` costs ~30 µs of host time a call, this check ~1 µs).
"""
from __future__ import annotations

import contextlib
from typing import Optional

import torch


_NO_DEVICE = torch.device("cpu")


def _index(device: Optional[torch.device]) -> int:
    if device is not None and device.index is not None:
        return device.index
    return torch._C._cuda_getDevice()


_current: dict[tuple[int, int], "torch.cuda.Stream"] = {}


def current_stream(device: Optional[torch.device] = None) -> "torch.cuda.Stream":
    """The current stream of ``device`` (default: the current device), as a cached object."""
    idx = _index(device)
    key = (idx, torch._C._cuda_getCurrentRawStream(idx))
    s = _current.get(key)
    if s is None:
        s = _current[key] = torch.cuda.current_stream(idx)
    return s


def on_stream(stream: Optional["torch.cuda.Stream"],
              device: Optional[torch.device] = _NO_DEVICE) -> contextlib.AbstractContextManager:
    """Context making ``stream`` current (see the module docstring); ``device=None`` means
    "not on a GPU" (nothing to do), the default means ``stream``'s own device."""
    if stream is None or device is None:
        return contextlib.nullcontext()
    idx = stream.device_index
    if torch._C._cuda_getDevice() == idx and \
            torch._C._cuda_getCurrentRawStream(idx) == stream.cuda_stream:
        return contextlib.nullcontext()
    return torch.cuda.stream(stream)
