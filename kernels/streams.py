"""The current CUDA stream, cheaply: the copy paths ask for it on every command.

* ``current_stream(device=None)``: ``torch.cuda.current_stream(device)``, one ``Stream`` object kept
  per raw stream (the torch call builds a new object each time, ~30 µs of host time).
* ``on_stream(stream, device=...)``: makes ``stream`` current for a ``with`` block, and the
  stream that was current before it again after the block. Nothing is done when ``stream`` or
  ``device`` is None (not on a GPU) or when ``stream`` is current already. On the stream's own
  device the switch is two raw ``setStream`` calls (``torch.cuda.stream`` costs ~30 µs of host
  time a call: it resolves devices and asks whether CUDA is available each time); a stream of
  another device goes through ``torch.cuda.stream``, which also switches the device.
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
    if torch._C._cuda_getDevice() != idx:
        return torch.cuda.stream(stream)
    if torch._C._cuda_getCurrentRawStream(idx) == stream.cuda_stream:
        return contextlib.nullcontext()
    return _Scope(stream, current_stream(torch.device("cuda", idx)))


class _Scope:
    """``stream`` current inside the block, ``prev`` (both on the current device) after it."""

    __slots__ = ("stream", "prev")

    def __init__(self, stream: "torch.cuda.Stream", prev: "torch.cuda.Stream") -> None:
        self.stream, self.prev = stream, prev

    def __enter__(self) -> "torch.cuda.Stream":
        _set(self.stream)
        return self.stream

    def __exit__(self, *exc: object) -> None:
        _set(self.prev)


def _set(s: "torch.cuda.Stream") -> None:
    torch._C._cuda_setStream(stream_id=s.stream_id, device_index=s.device_index,
                             device_type=s.device_type)
