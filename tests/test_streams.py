"""``kernels.streams`` without a GPU: no stream, or no device, means no stream switch at all
(CPU copies and the interpreter pass ``None``); nothing of CUDA is touched."""
from __future__ import annotations

import contextlib

from hicache.kernels.streams import on_stream


def test_no_stream_or_no_device_is_a_null_context():
    assert isinstance(on_stream(None), contextlib.nullcontext)
    assert isinstance(on_stream(object(), None), contextlib.nullcontext)  # type: ignore[arg-type]
    with on_stream(None):
        pass
