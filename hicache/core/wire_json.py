"""JSON of the wire protocol's headers, fast: json's C encoder and scanner made once.

``json.dumps`` builds a new C encoder on every call and ``json.loads`` wraps the C scanner in
two Python layers; per message that is ~2 us each way. ``dumps(obj) -> bytes`` gives exactly
``json.dumps(obj, separators=(",", ":"), allow_nan=False).encode()`` (NaN and infinities
refused with ``ValueError``, unknown types with ``TypeError``); ``loads(text)`` gives exactly
``json.loads(text)``: one scan when the text is one value with nothing around it, else
``json.loads`` itself (surrounding whitespace, trailing data, or its error). Standard library
only; where the C accelerator is missing both fall back to the ``json`` functions.
``ack_members(ack)`` writes the members of an operation's ack from one template, exactly as
``dumps`` would, or returns None when the ack is not of the daemon's plain shape.
"""
from __future__ import annotations

import json
import json.decoder
import json.encoder
import re
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


# An operation's ack as the daemon builds it (``controllers.ops.Operation.ack``): with these
# keys in this order, int values, plain strings and ``pools`` {plain name: [int, int, int]},
# ``ack_members`` writes its JSON members from one template, byte for byte what ``dumps``
# writes (in about half the instructions of json's C encoder); for anything else it returns
# None and ``protocol`` (replies, pushed acks) uses ``dumps``.
_ACK_KEYS = ("op", "kind", "status", "bytes", "ns", "exec_ns", "path", "pools")
_PLAIN_RE = re.compile(r"[A-Za-z0-9_.+:-]*")  # strings JSON writes as they are
_PLAIN: set[str] = set()  # strings seen to match it (names, kinds, paths: a few dozen)


def _plain(x: Any) -> bool:
    if type(x) is not str:
        return False
    if x in _PLAIN:
        return True
    if not _PLAIN_RE.fullmatch(x):
        return False
    if len(_PLAIN) < 4096:
        _PLAIN.add(x)
    return True


def ack_members(ack: dict[str, Any]) -> str | None:
    """The JSON members (no braces) of an ack of the daemon's shape, or None."""
    if tuple(ack) != _ACK_KEYS:
        return None
    op, kind, status, nbytes, ns, ex, path, pools = ack.values()
    if type(op) is not int or type(nbytes) is not int or type(ns) is not int or \
            type(ex) is not int or type(pools) is not dict or not _plain(kind) or \
            not _plain(status) or not _plain(path):
        return None
    parts = []
    for name, v in pools.items():
        if not _plain(name) or type(v) is not list or len(v) != 3:
            return None
        r, b, e = v
        if type(r) is not int or type(b) is not int or type(e) is not int:
            return None
        parts.append(f'"{name}":[{r},{b},{e}]')
    return f'"op":{op},"kind":"{kind}","status":"{status}","bytes":{nbytes},"ns":{ns},' \
        f'"exec_ns":{ex},"path":"{path}","pools":{{{",".join(parts)}}}'
