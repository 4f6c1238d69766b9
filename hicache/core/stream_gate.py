"""A CUDA stream's wait on a 32-bit word in this process's pinned memory, opened from the host.

``StreamGate()`` holds one pinned ``int32`` word (torch's pinned allocator; under unified
addressing its host address is also its device address). Contract:

- ``close(stream=None) -> int``: enqueues on ``stream`` (default: torch's current stream) a
  wait until the word reaches the next sequence number (``cuStreamWaitValue32``,
  ``CU_STREAM_WAIT_VALUE_GEQ``, a cyclic comparison, so the numbers may wrap) and returns that
  number. The host does not wait; work enqueued on ``stream`` after it runs once the gate is
  opened up to that number.
- ``open(seq)``: gate ``seq`` may open. Numbers open in order: the word is stored (from the
  host, a plain store the GPU's next read sees) up to the highest number whose every earlier
  number may open too, so opening a later gate never releases an earlier one.
- ``opened(seq)``: whether the word has reached ``seq``.
- The driver's entry point is looked up once per process (``cuStreamWaitValue32_v2``, else
  ``cuStreamWaitValue32``). A driver or device without stream memory operations makes
  ``close`` raise ``RuntimeError`` naming the ``CUresult``; nothing was enqueued then.
- Not thread-safe: the caller serializes ``close`` and ``open``.
"""
from __future__ import annotations

import ctypes
from typing import Any

_WAIT_GEQ = 0x0  # CU_STREAM_WAIT_VALUE_GEQ
_FN: Any = None


def _wait_value() -> Any:
    global _FN
    if _FN is None:
        lib = ctypes.CDLL("libcuda.so.1")
        fn = getattr(lib, "cuStreamWaitValue32_v2", None) or lib.cuStreamWaitValue32
        fn.argtypes = [ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32, ctypes.c_uint]
        fn.restype = ctypes.c_int
        _FN = fn
    return _FN


class StreamGate:
    """See the module docstring."""

    def __init__(self) -> None:
        import torch

        self.word = torch.zeros(1, dtype=torch.int32, pin_memory=True)
        self.addr = self.word.data_ptr()
        self.issued = 0  # the last number ``close`` gave
        self.value = 0  # what the word holds
        self._may: set[int] = set()  # numbers allowed to open, above ``value``

    def close(self, stream: Any = None) -> int:
        if stream is None:
            import torch

            stream = torch.cuda.current_stream()
        seq = (self.issued + 1) & 0xFFFFFFFF
        rc = _wait_value()(ctypes.c_void_p(stream.cuda_stream), self.addr, seq, _WAIT_GEQ)
        if rc != 0:
            raise RuntimeError(f"cuStreamWaitValue32 failed with CUresult {rc}: this driver or "
                               f"device does not support stream memory operations")
        self.issued = seq
        return seq

    def open(self, seq: int) -> None:
        self._may.add(seq)
        nxt = (self.value + 1) & 0xFFFFFFFF
        moved = False
        while nxt in self._may:
            self._may.discard(nxt)
            self.value, moved = nxt, True
            nxt = (nxt + 1) & 0xFFFFFFFF
        if moved:
            self.word[0] = self.value - (1 << 32) if self.value >= 1 << 31 else self.value

    def opened(self, seq: int) -> bool:
        return ((self.value - seq) & 0xFFFFFFFF) < 1 << 31
