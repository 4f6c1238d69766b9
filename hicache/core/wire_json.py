"""JSON of the wire protocol's headers, fast: json's C encoder and scanner made once.

``json.dumps`` builds a new C encoder on every call and ``json.loads`` wraps the C scanner in
two Python layers; per message that is ~2 us each way. ``dumps(obj) -> bytes`` gives exactly
``json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()`` (NaN and infinities
refused with ``ValueError``, unknown types with ``TypeError``); ``loads(text)`` gives exactly
``json.loads(text)``: one scan when the text is one value with nothing around it, else
``json.loads`` itself (surrounding whitespace, trailing data, or its error). Standard library
only; where the C accelerator is missing both fall back to the ``json`` functions.
"""
from __future__ import annotations

import json
import json.decoder
import json.encoder
from typing import Any


def _no_default(o: Any) -> Any:
    raise TypeError(f"Object of type {type(o).__name__} is not JSON serializable")


_C_ENCODER = getattr(json.encoder, "c_make_encoder", None)
# markers None: no circular-reference check (headers are trees the daemon and client build)
_ITER = _C_ENCODER(None, _no_default, json.encoder.encode_basestring_ascii, None, ":", ",",
                   False, False, False) if _C_ENCODER is not None else None
_ENCODE = json.JSONEncoder(separators=(",", ":"), allow_nan=False).encode
_SCAN = json.JSONDecoder().scan_once


def dumps(obj: Any) -> bytes:
    return ("".join(_ITER(obj, 0)) if _ITER is not None else _ENCODE(obj)).encode()


def loads(text: str) -> Any:
    try:
        obj, end = _SCAN(text, 0)
    except StopIteration:
        return json.loads(text)
    return obj if end == len(text) else json.loads(text)
