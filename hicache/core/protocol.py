"""hicache wire protocol v1: frames, field checks, size caps and error codes (a leaf module; the
command table itself is ``commands``, re-exported here).

A message is a list of ZMQ frames. Frame 0 is a UTF-8 JSON object (the header); frames 1.. are
raw little-endian int64 index arrays that the header refers to by position (0 = frame 1).
Nothing received is ever unpickled or evaluated: headers go through ``json.loads`` and a typed
schema check (``check_fields``), index frames through a length check and a ``memoryview`` cast.

* request  ``{"v": 1, "cmd": NAME, "id": INT, ...fields}`` + index frames
* reply    ``{"v": 1, "k": "reply", "id": INT, "ok": true, ...fields}`` + index frames, or
           ``{"v": 1, "k": "reply", "id": INT, "ok": false, "error": {"code", "message"}}``
* ack      ``{"v": 1, "k": "ack", "op": INT, "status": "ok"|"error", ...}`` (pushed, no reply)
* issued   ``{"v": 1, "k": "issued", "op": INT}`` (pushed, GPU loads: every layer's event is
           recorded; the reply said how many were at reply time), before it maybe progress
           notices ``{"v": 1, "k": "issued", "op": INT, "layers": INT}`` (the first that many
           stage layers' events are recorded)

See docs/protocol.md for every command, its fields and its reply.
"""
from __future__ import annotations

import array
import json
import sys
from typing import Any, Iterable, Sequence

from .commands import _TABLE, _T, COMMANDS, Command, markdown_table  # noqa: F401
from .wire_json import ack_members as _ack_members, dumps as _dumps, loads as _parse

VERSION = 1

# ------------------------------------------------------------------------------- size caps
MAX_HEADER_BYTES = 1 << 20  # registration of a 62-layer stage with CUDA IPC handles is ~60 KiB
MAX_INDEX_BYTES = 16 << 20  # one index frame: 2 Mi int64 ids
MAX_INDEX_FRAMES = 64  # index frames per message
MAX_MESSAGE_BYTES = 64 << 20  # all frames of one message together
MAX_ITEMS = 256  # transfer items per backup/load
MAX_NAME_LEN = 128  # client names, request ids, pool and space names
MAX_KV_KEY_LEN = 256  # a key-store key (printable ASCII)
MAX_KV_NS_LEN = 256  # a key-store namespace (printable)
MAX_LIST_LEN = 4096  # any JSON list in a header (slots, op ids, handles per pool ...)
MAX_DEPTH = 8  # JSON nesting depth accepted in a header
DEFAULT_DEADLINE_MS = 5000  # an L3 command's deadline when the request names none


class ProtocolError(ValueError):
    """A message that breaks the protocol; ``code`` is one of ``ERROR_CODES``; ``cmd``: the
    known command whose fields broke it (``decode_request``), else None."""

    def __init__(self, code: str, message: str) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.cmd: str | None = None


ERROR_CODES = {
    "bad_frame": "a frame is missing, too large, or not a whole number of int64 ids",
    "bad_header": "frame 0 is not a JSON object with v, cmd and id",
    "bad_version": "the protocol version is not supported",
    "unknown_command": "no such command",
    "bad_field": "a field is missing, unknown, of the wrong type or out of range",
    "not_registered": "the command needs a registered worker",
    "already_registered": "this client already registered a worker",
    "layout_mismatch": "the worker's layout differs from the layout the daemon serves",
    "bad_handle": "a device buffer or event handle cannot be opened",
    "bad_rows": "row ids out of range, duplicated destinations, or length mismatch",
    "not_owner": "host rows not allocated to this client (or request)",
    "busy": "what the command needs is still in use (rows being freed, work in flight); retry",
    "not_written": "host rows that no completed backup of this client wrote (nothing to read)",
    "no_space": "not enough free host rows",
    "too_many_clients": "the daemon's client table is full",
    "unsupported": "the command is valid but not available in this mode",
    "shutting_down": "the daemon is stopping",
    "internal": "a bug in the daemon; the message says where",
}

# commands with free-form JSON objects in their fields
_FREE_FORM = ("register", "clear_slot", "kv_attach")
ITEM_FIELDS = {"pool": str, "space": str, "src": int, "dst": int, "unit": str}
UNITS = ("row", "token")


def _is_int(x: Any) -> bool:
    return type(x) is int


def _depth(x: Any, d: int = 0) -> int:
    if d > MAX_DEPTH:
        return d
    if isinstance(x, dict):
        return max((_depth(v, d + 1) for v in x.values()), default=d + 1)
    if isinstance(x, list):
        if len(x) > MAX_LIST_LEN:
            raise ProtocolError("bad_field", f"a list has {len(x)} entries; at most {MAX_LIST_LEN}")
        return max((_depth(v, d + 1) for v in x), default=d + 1)
    return d


# per command, from the table: the keys a header may hold; (field, kind, required, types,
# extra check) per field; the fields naming an index frame; whether it carries items / rows maps
_X_MAP, _X_INTS, _X_STRS, _X_NAME = 1, 2, 3, 4
_EXTRA = {"str_int_map": _X_MAP, "int_list": _X_INTS, "opt_int_list": _X_INTS,
          "str_list": _X_STRS}
_ALLOWED = {c.name: frozenset((*c.fields, "v", "cmd", "id")) for c in _TABLE}
_CHECKS = {c.name: tuple(
    (k, kind, req, _T[kind], _EXTRA.get(kind, _X_NAME if kind in ("str", "opt_str") and k in (
        "request", "name", "mode") else 0), kind in ("int", "frame", "opt_int"))
    for k, (kind, req) in c.fields.items()) for c in _TABLE}
_FRAME_FIELDS = {c.name: tuple(k for k, (kind, _) in c.fields.items() if kind == "frame")
                 for c in _TABLE}
_HAS_ITEMS = frozenset(("backup", "load"))
_HAS_ROWS = frozenset(("free", "l3_prefetch", "l3_put"))


def check_fields(cmd: str, h: dict[str, Any], n_frames: int) -> None:
    """Type-check the fields of a request header against the command table; raise ProtocolError."""
    if not h.keys() <= _ALLOWED[cmd]:
        schema = COMMANDS[cmd].fields
        for k in h:
            if k not in schema and k not in ("v", "cmd", "id"):
                raise ProtocolError("bad_field", f"{cmd}: unknown field {k!r}")
    for k, kind, required, types, extra, no_bool in _CHECKS[cmd]:
        if k not in h:
            if required:
                raise ProtocolError("bad_field", f"{cmd}: missing field {k!r}")
            continue
        v = h[k]
        if not isinstance(v, types) or (no_bool and type(v) is bool):
            raise ProtocolError("bad_field", f"{cmd}: field {k!r} must be {kind}, "
                                             f"got {type(v).__name__}")
        if not extra:
            continue
        if extra == _X_MAP:
            if len(v) > MAX_LIST_LEN:
                raise ProtocolError("bad_field", f"{cmd}: field {k!r} has too many keys")
            for kk, vv in v.items():
                if not _is_int(vv) or vv < 0:
                    raise ProtocolError("bad_field",
                                        f"{cmd}: {k}[{kk!r}] must be a non-negative int")
        elif extra == _X_INTS and v is not None:
            if len(v) > MAX_LIST_LEN or not all(_is_int(x) for x in v):
                raise ProtocolError("bad_field", f"{cmd}: field {k!r} must be a list of at most "
                                                 f"{MAX_LIST_LEN} ints")
        elif extra == _X_STRS:
            if len(v) > MAX_LIST_LEN or not all(isinstance(x, str) for x in v):
                raise ProtocolError("bad_field", f"{cmd}: field {k!r} must be a list of strings")
        elif extra == _X_NAME and isinstance(v, str) and len(v) > MAX_NAME_LEN:
            raise ProtocolError("bad_field", f"{cmd}: field {k!r} is longer than {MAX_NAME_LEN}")
    used: set[int] = set()
    if cmd in _HAS_ITEMS:
        alloc = bool(h.get("alloc"))
        check_items(h["items"], n_frames, need_dst=not alloc)
        for it in h["items"]:
            used.add(it["src"])
            if not alloc:
                used.add(it["dst"])
    for k in _FRAME_FIELDS[cmd]:
        if k in h:
            if not 0 <= h[k] < n_frames:
                raise ProtocolError("bad_frame", f"{cmd}: {k} names frame {h[k]} but the "
                                                 f"message has {n_frames} index frames")
            used.add(h[k])
    if cmd in _HAS_ROWS:
        for space, f in h["rows"].items():
            if f >= n_frames:
                raise ProtocolError("bad_frame", f"{cmd}: rows[{space!r}] names frame {f} but "
                                                 f"the message has {n_frames} index frames")
            used.add(f)
    if len(used) != n_frames:  # every index frame must be named by the header
        raise ProtocolError("bad_frame", f"{cmd}: {n_frames - len(used)} of {n_frames} index "
                                         f"frames are not referenced by the header")


def check_items(items: list, n_frames: int, need_dst: bool = True) -> None:
    """Shape of backup/load items: ``{"pool"|"space": NAME, "src": FRAME, "dst": FRAME,
    "unit": "row"|"token"}``; frames must exist. ``need_dst`` False (a backup with ``alloc``):
    items name no destination, the daemon allocates it."""
    if not items:
        raise ProtocolError("bad_field", "items is empty")
    if len(items) > MAX_ITEMS:
        raise ProtocolError("bad_field", f"{len(items)} items; at most {MAX_ITEMS}")
    fields = ITEM_FIELDS
    for i, it in enumerate(items):
        if type(it) is not dict:
            raise ProtocolError("bad_field", f"items[{i}] must be an object")
        for k, v in it.items():
            t = fields.get(k)
            if t is None:
                raise ProtocolError("bad_field", f"items[{i}]: unknown field {k!r}")
            if type(v) is not t:
                raise ProtocolError("bad_field", f"items[{i}].{k} must be {t.__name__}")
        if ("pool" in it) == ("space" in it):
            raise ProtocolError("bad_field", f"items[{i}] needs exactly one of 'pool' or 'space'")
        if not need_dst and "dst" in it:
            raise ProtocolError("bad_field", f"items[{i}]: with alloc the daemon picks the "
                                             f"destination rows; drop 'dst'")
        for k in ("src", "dst") if need_dst else ("src",):
            f = it.get(k)
            if f is None:
                raise ProtocolError("bad_field", f"items[{i}] is missing {k!r}")
            if not 0 <= f < n_frames:
                raise ProtocolError("bad_frame", f"items[{i}].{k} names frame {f} but the "
                                                 f"message has {n_frames} index frames")
        if "unit" in it and it["unit"] not in UNITS:
            raise ProtocolError("bad_field", f"items[{i}].unit must be one of {UNITS}")


# ------------------------------------------------------------------------------- index frames
_LITTLE = sys.byteorder == "little"


def as_index(x: Any) -> Any:
    """Anything index-like -> something ``pack_index`` takes (torch tensors included; torch is
    recognised by its module name, never imported here)."""
    if type(x).__module__.startswith("torch"):
        return x.detach().to("cpu").contiguous().numpy().astype("int64", copy=False)
    return x


def pack_index(ids: Any) -> bytes:
    """Little-endian int64 bytes of ``ids`` (a sequence of ints, an ``array('q')``, bytes of
    int64, or anything with ``.tobytes()`` of int64 such as a numpy array)."""
    if type(ids) is list and _LITTLE:  # the common case: a list of ints
        return array.array("q", ids).tobytes()
    if isinstance(ids, (bytes, bytearray, memoryview)):
        b = bytes(ids)
        if len(b) % 8:
            raise ProtocolError("bad_frame", f"index bytes of length {len(b)} are not int64s")
        return b
    if isinstance(ids, array.array) and ids.typecode == "q":
        a = ids
    elif hasattr(ids, "tobytes") and str(getattr(ids, "dtype", "")) == "int64":
        if _LITTLE:
            return ids.tobytes()
        a = array.array("q")
        a.frombytes(ids.tobytes())
    else:
        a = array.array("q", ids)
    if not _LITTLE:
        a = array.array("q", a)
        a.byteswap()
    return a.tobytes()


def unpack_index(buf: Any) -> Sequence[int]:
    """Validate one index frame and view it as int64 (zero-copy on little-endian hosts)."""
    mv = memoryview(buf)
    n = mv.nbytes
    if n % 8:
        raise ProtocolError("bad_frame", f"index frame of {n} bytes is not a whole number of int64")
    if n > MAX_INDEX_BYTES:
        raise ProtocolError("bad_frame", f"index frame of {n} bytes exceeds {MAX_INDEX_BYTES}")
    if _LITTLE:
        return mv.cast("B").cast("q")
    a = array.array("q", mv.tobytes())
    a.byteswap()
    return a


# ------------------------------------------------------------------------------- messages


def encode_request(cmd: str, req_id: int, fields: dict[str, Any] | None = None,
                   arrays: Iterable[Any] = ()) -> list[bytes]:
    h = {"v": VERSION, "cmd": cmd, "id": req_id}
    if fields:
        h.update(fields)
    out = [_dumps(h)]
    for a in arrays:
        out.append(pack_index(a))
    return out


def encode_reply(req_id: int, fields: dict[str, Any] | None = None,
                 arrays: Iterable[Any] = ()) -> list[bytes]:
    if fields and type(req_id) is int and len(fields) == 2 and tuple(fields) == ("op", "ack"):
        op, ack = fields["op"], fields["ack"]
        text = _ack_members(ack) if type(op) is int and type(ack) is dict else None
        if text is not None:  # an operation's reply with its ack inline
            out = [f'{{"v":{VERSION},"k":"reply","id":{req_id},"ok":true,"op":{op},'
                   f'"ack":{{{text}}}}}'.encode()]
            for a in arrays:
                out.append(pack_index(a))
            return out
    h = {"v": VERSION, "k": "reply", "id": req_id, "ok": True}
    if fields:
        h.update(fields)
    out = [_dumps(h)]
    for a in arrays:
        out.append(pack_index(a))
    return out


def encode_error(req_id: int | None, code: str, message: str) -> list[bytes]:
    return [_dumps({"v": VERSION, "k": "reply", "id": req_id, "ok": False,
                    "error": {"code": code, "message": message}})]


def encode_ack(ack: dict[str, Any]) -> list[bytes]:
    text = _ack_members(ack)
    if text is not None:
        return [f'{{"v":{VERSION},"k":"ack",{text}}}'.encode()]
    h = {"v": VERSION, "k": "ack"}
    h.update(ack)
    return [_dumps(h)]


def encode_issued(op_id: int, layers: int | None = None, failed: bool = False) -> list[bytes]:
    """The "issued" push: every layer of load ``op_id`` (``layers`` None), or its first
    ``layers`` stage layers, have their events recorded; ``failed``: its issue failed, so
    the layers it did not record hold older records (wait for its ack)."""
    h: dict[str, Any] = {"v": VERSION, "k": "issued", "op": op_id}
    if layers is not None:
        h["layers"] = layers
    if failed:
        h["failed"] = True
    return [_dumps(h)]


def _loads(frame: Any, what: str) -> dict[str, Any]:
    n = len(frame)
    if n > MAX_HEADER_BYTES:
        raise ProtocolError("bad_frame", f"{what} of {n} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        h = _parse(frame.decode() if isinstance(frame, bytes) else bytes(frame).decode())
    except (ValueError, RecursionError) as e:  # UnicodeDecodeError is a ValueError
        raise ProtocolError("bad_header", f"{what} is not JSON: {str(e)[:200]}") from None
    if not isinstance(h, dict):
        raise ProtocolError("bad_header", f"{what} must be a JSON object")
    return h


def check_sizes(frames: Sequence[Any]) -> None:
    if not frames:
        raise ProtocolError("bad_frame", "empty message")
    if len(frames) - 1 > MAX_INDEX_FRAMES:
        raise ProtocolError("bad_frame", f"{len(frames) - 1} index frames; at most "
                                         f"{MAX_INDEX_FRAMES}")
    total = 0
    for f in frames:
        total += len(f)
    if total > MAX_MESSAGE_BYTES:
        raise ProtocolError("bad_frame", f"message of {total} bytes exceeds {MAX_MESSAGE_BYTES}")


def decode_request(frames: Sequence[Any]) -> tuple[dict[str, Any], list[Sequence[int]]]:
    """Header + index views of one request, fully type-checked; raises ProtocolError.

    The error's request id (when the header had one) is in ``request_id(frames[0])``. A
    header byte-equal, but for its id, to one that passed before skips the field checks
    (``_PASSED``): the same bytes give the same fields.
    """
    check_sizes(frames)
    h = _loads(frames[0], "header")
    v = h.get("v")
    if type(v) is not int or v != VERSION:  # (true and 1.0 equal 1)
        raise ProtocolError("bad_version", f"protocol version {v!r} is not supported; "
                                           f"this daemon speaks v{VERSION}")
    rid = h.get("id")
    if not _is_int(rid):
        raise ProtocolError("bad_header", "header field 'id' must be an int")
    cmd = h.get("cmd")
    if not isinstance(cmd, str) or cmd not in COMMANDS:
        raise ProtocolError("unknown_command", f"unknown command {str(cmd)[:64]!r}; "
                                               f"commands are {', '.join(COMMANDS)}")
    try:
        return _checked(cmd, rid, h, frames)
    except ProtocolError as e:  # a known command, refused: named in the metrics
        e.cmd = cmd
        raise


def _checked(cmd: str, rid: int, h: dict[str, Any], frames: Sequence[Any]
             ) -> tuple[dict[str, Any], list[Sequence[int]]]:
    """``decode_request`` past the command's name: its fields and index frames."""
    if cmd in _FREE_FORM and _depth(h) > MAX_DEPTH:
        raise ProtocolError("bad_header", f"header nests deeper than {MAX_DEPTH}")
    arrays = [unpack_index(f) for f in frames[1:]]
    n = len(arrays)
    raw, key = frames[0], None
    if type(raw) is bytes and len(raw) <= _PASSED_BYTES:
        head = b'{"v":1,"cmd":"%s","id":%d' % (cmd.encode(), rid)
        if raw.startswith(head):
            key = (raw[len(head):], n)  # the header but for its id, and the frame count
            if _PASSED.get(key) == cmd:
                return h, arrays
    check_fields(cmd, h, n)
    if key is not None:
        if len(_PASSED) >= _PASSED_MAX:
            _PASSED.clear()
        _PASSED[key] = cmd
    return h, arrays


# Headers that passed the checks, as {(bytes after ``{"v":1,"cmd":"NAME","id":ID``, index
# frames): NAME}: a header with the same bytes but for the id's digits parses to the same
# fields (the id aside, which is checked above), so it passes too without checking them again.
_PASSED: dict[tuple[bytes, int], str] = {}
_PASSED_MAX = 1024  # entries; the table starts afresh when full
_PASSED_BYTES = 1024  # longer headers are always checked in full


def request_id(frame: Any) -> int | None:
    """Best-effort request id of a (possibly bad) header, for the error reply."""
    try:
        if len(frame) <= MAX_HEADER_BYTES:
            rid = json.loads(bytes(frame)).get("id")
            return rid if _is_int(rid) else None
    except Exception:  # noqa: BLE001 - any garbage: no id
        pass
    return None


def decode_reply(frames: Sequence[Any]) -> tuple[dict[str, Any], list[Sequence[int]]]:
    """Header + index views of a daemon message (a reply or an ack)."""
    check_sizes(frames)
    h = _loads(frames[0], "reply header")
    if type(h.get("v")) is not int or h["v"] != VERSION:
        raise ProtocolError("bad_version", f"daemon speaks protocol {h.get('v')!r}, "
                                           f"this client v{VERSION}")
    return h, [unpack_index(f) for f in frames[1:]]


if __name__ == "__main__":
    print(markdown_table())
