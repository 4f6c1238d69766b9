"""Wire protocol v1: encoding, decoding, schemas and caps (no daemon needed)."""
from __future__ import annotations

import array
import json

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core import protocol as P


def codes(frames) -> str:
    with pytest.raises(P.ProtocolError) as e:
        P.decode_request(frames)
    assert e.value.code in P.ERROR_CODES
    return e.value.code


def req(cmd: str, rid: int = 1, arrays=(), **fields):
    return P.encode_request(cmd, rid, fields, arrays)


def test_round_trip_with_index_frames():
    frames = req("backup", 42, [[1, 2, 3], array.array("q", [7, 8, 9])],
                 items=[{"pool": "c4_kv", "src": 0, "dst": 1},
                        {"space": "swa_page", "src": 0, "dst": 1, "unit": "row"}],
                 wait_event=None)
    assert all(isinstance(f, bytes) for f in frames)
    h, arrays = P.decode_request(frames)
    assert h["cmd"] == "backup" and h["id"] == 42 and h["v"] == P.VERSION
    assert list(arrays[0]) == [1, 2, 3] and list(arrays[1]) == [7, 8, 9]
    assert frames[1] == np.array([1, 2, 3], dtype="<i8").tobytes()  # raw little-endian int64


@given(st.lists(st.integers(-(2**63), 2**63 - 1), max_size=64))
@settings(max_examples=50, deadline=None)
def test_pack_unpack_any_int64(ids):
    for form in (ids, array.array("q", ids), np.array(ids, dtype=np.int64)):
        assert list(P.unpack_index(P.pack_index(form))) == ids


def test_pack_index_refuses_partial_int64():
    with pytest.raises(P.ProtocolError):
        P.pack_index(b"\x01\x02\x03")


def test_every_command_has_a_schema_and_minimal_request_decodes():
    minimal = {
        "heartbeat": {}, "unregister": {}, "stats": {}, "buffer_infos": {}, "reset": {},
        "shutdown": {}, "poll_acks": {}, "channel": {}, "hand_in": {"count": 1},
        "register": {"layout": {}, "device_rows": {}, "buffers": {}, "mode": "cpu"},
        "alloc": {"counts": {"page": 1}}, "free": {"rows": {}},
        "backup": {"items": [{"pool": "x", "src": 0, "dst": 0}]},
        "load": {"items": [{"pool": "x", "src": 0, "dst": 0}]},
        "swap_out": {"slot": 0}, "swap_in": {"host_row": 0, "slot": 0},
        "clear_slot": {"slots": [0]},
        "l3_query": {"keys": ["k"]}, "l3_prefetch": {"keys": ["k"], "rows": {"page": 0}},
        "l3_put": {"keys": ["k"], "rows": {"page": 0}},
        "sparse_region": {}, "sparse_admit": {"request": "r", "prompt_tokens": 1},
        "sparse_extend": {"request": "r", "tokens": 1}, "sparse_free": {"request": "r"},
        "sparse_report": {"lookups": 0, "swapped_in": 0},
        "kv_attach": {"name": "c4", "namespace": "m", "pages": 1, "space": "page"},
        "kv_verify": {}, "kv_put": {"name": "c4", "keys": ["k"], "pages": 0},
        "kv_get": {"name": "c4", "keys": ["k"], "pages": 0},
        "kv_exists": {"name": "c4", "keys": ["k"]}, "kv_clear": {"namespace": "m"},
        "kv_detach": {},
    }
    assert set(minimal) == set(P.COMMANDS)
    for cmd, f in minimal.items():
        arrays = [[0]] if cmd in ("backup", "load", "l3_prefetch", "l3_put", "kv_put",
                                  "kv_get") else []
        h, _ = P.decode_request(req(cmd, 3, arrays, **f))
        assert h["cmd"] == cmd


@pytest.mark.parametrize("frames,code", [
    ([], "bad_frame"),
    ([b"\xff\xfe"], "bad_header"),
    ([b"{"], "bad_header"),
    ([b'"a string"'], "bad_header"),
    ([b'{"cmd":"stats","id":1}'], "bad_version"),
    ([b'{"v":2,"cmd":"stats","id":1}'], "bad_version"),
    ([b'{"v":1,"cmd":"stats"}'], "bad_header"),
    ([b'{"v":1,"cmd":"stats","id":"1"}'], "bad_header"),
    ([b'{"v":1,"cmd":"stats","id":true}'], "bad_header"),
    ([b'{"v":1,"cmd":"__import__","id":1}'], "unknown_command"),
    ([b'{"v":1,"cmd":["stats"],"id":1}'], "unknown_command"),
    ([b'{"v":1,"cmd":"stats","id":1}', b"\0" * 8], "bad_frame"),  # a frame nobody names
    ([b'{"v":1,"cmd":"load","id":1,"items":[{"pool":"a","src":0,"dst":0}]}', b"", b""],
     "bad_frame"),
    ([b'{"v":1,"cmd":"stats","id":1,"extra":0}'], "bad_field"),
    ([b'{"v":1,"cmd":"alloc","id":1}'], "bad_field"),
    ([b'{"v":1,"cmd":"alloc","id":1,"counts":{"page":-1}}'], "bad_field"),
    ([b'{"v":1,"cmd":"alloc","id":1,"counts":{"page":1.5}}'], "bad_field"),
    ([b'{"v":1,"cmd":"alloc","id":1,"counts":{"page":1},"request":5}'], "bad_field"),
    ([b'{"v":1,"cmd":"swap_out","id":1,"slot":true}'], "bad_field"),
    ([b'{"v":1,"cmd":"clear_slot","id":1,"slots":[1,"2"]}'], "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[]}'], "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"a","src":0,"dst":0}]}'], "bad_frame"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"src":0,"dst":0}]}', b""], "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"a","space":"b","src":0,"dst":0}]}',
      b""], "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"a","src":0,"dst":0,"unit":"byte"}]}',
      b""], "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"a","src":0,"dst":0,"x":1}]}', b""],
     "bad_field"),
    ([b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"a","src":0,"dst":-1}]}', b""],
     "bad_frame"),
    ([b'{"v":1,"cmd":"free","id":1,"rows":{"page":2}}', b""], "bad_frame"),
    ([b'{"v":1,"cmd":"free","id":1,"rows":{}}', b"1234567"], "bad_frame"),
    ([b'{"v":1,"cmd":"register","id":1,"mode":"cpu","device_rows":{},"buffers":{},"layout":'
      + b"[" * 40 + b"]" * 40 + b"}"], "bad_header"),
])
def test_bad_messages_are_refused_with_a_code(frames, code):
    assert codes(frames) == code


def test_size_caps():
    big = json.dumps({"v": 1, "cmd": "stats", "id": 1, "pad": "x" * P.MAX_HEADER_BYTES}).encode()
    assert codes([big]) == "bad_frame"
    assert codes([b'{"v":1,"cmd":"stats","id":1}'] + [b""] * (P.MAX_INDEX_FRAMES + 1)) \
        == "bad_frame"
    assert codes([b'{"v":1,"cmd":"free","id":1,"rows":{"page":0}}',
                  b"\0" * (P.MAX_INDEX_BYTES + 8)]) == "bad_frame"
    items = [{"pool": "a", "src": 0, "dst": 0}] * (P.MAX_ITEMS + 1)
    assert codes(req("backup", 1, [[0]], items=items)) == "bad_field"
    assert codes(req("clear_slot", 1, slots=list(range(P.MAX_LIST_LEN + 1)))) == "bad_field"
    assert codes(req("alloc", 1, counts={"page": 1}, request="r" * (P.MAX_NAME_LEN + 1))) \
        == "bad_field"
    deep = {"a": 1}
    for _ in range(20):
        deep = {"a": deep}
    assert codes(req("register", 1, layout=deep, device_rows={}, buffers={}, mode="cpu")) \
        == "bad_header"


@given(st.binary(max_size=300))
@settings(max_examples=200, deadline=None)
def test_garbage_never_crashes_the_decoder(blob):
    try:
        P.decode_request([blob, blob[:16]])
    except P.ProtocolError as e:
        assert e.code in P.ERROR_CODES
    P.request_id(blob)  # never raises


def test_request_id_is_recovered_for_error_replies():
    assert P.request_id(b'{"v":1,"cmd":"nope","id":17}') == 17
    assert P.request_id(b"junk") is None
    h, _ = P.decode_reply(P.encode_error(17, "unknown_command", "no such command"))
    assert h == {"v": 1, "k": "reply", "id": 17, "ok": False,
                 "error": {"code": "unknown_command", "message": "no such command"}}


def test_replies_and_acks():
    h, arrays = P.decode_reply(P.encode_reply(5, {"rows": {"page": 0}}, [[4, 5]]))
    assert h["ok"] and h["k"] == "reply" and list(arrays[0]) == [4, 5]
    h, _ = P.decode_reply(P.encode_ack({"op": 3, "status": "ok"}))
    assert h["k"] == "ack" and h["op"] == 3
    with pytest.raises(P.ProtocolError):
        P.decode_reply([b'{"v":0,"k":"reply"}'])
    with pytest.raises(ValueError):  # NaN is not JSON: never sent
        P.encode_reply(1, {"x": float("nan")})


def test_the_command_table_drives_docs_client_and_daemon():
    """One table: docs/protocol.md shows it verbatim, the client has a method per command, the
    daemon a handler per command (looked up by the table's handler name)."""
    from pathlib import Path

    from hicache.controllers.handlers import HANDLERS
    from hicache.engine.client import Client

    doc = (Path(__file__).resolve().parents[1] / "docs" / "protocol.md").read_text()
    inner = doc.split("<!-- commands:begin -->\n", 1)[1].split("\n<!-- commands:end -->", 1)[0]
    assert inner == P.markdown_table()
    assert set(HANDLERS) == set(P.COMMANDS)
    for name, cmd in P.COMMANDS.items():
        assert HANDLERS[name].__name__ == cmd.handler
        assert callable(getattr(Client, name, None)), f"Client has no method {name}"


_JSON = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats(allow_nan=False, allow_infinity=False)
    | st.text(max_size=20),
    lambda kids: st.lists(kids, max_size=4) | st.dictionaries(st.text(max_size=8), kids,
                                                              max_size=4), max_leaves=20)


@given(_JSON, st.sampled_from(["", " ", "\n", "x", "{}", "]"]))
@settings(max_examples=200, deadline=None)
def test_wire_json_is_the_json_module(obj, tail):
    """The header codec made once (core/wire_json.py) gives json's bytes and json's verdicts."""
    from hicache.core import wire_json

    assert wire_json.dumps(obj) == json.dumps(obj, separators=(",", ":"),
                                              allow_nan=False).encode()
    for text in (json.dumps(obj), " " + json.dumps(obj), json.dumps(obj) + tail):
        try:
            want: object = json.loads(text)
        except ValueError as e:
            want = type(e)
        try:
            got: object = wire_json.loads(text)
        except ValueError as e:
            got = type(e)
        assert got == want or (got != got and want != want)


def test_wire_json_refuses_what_json_refuses():
    from hicache.core import wire_json

    with pytest.raises(ValueError):
        wire_json.dumps({"x": float("inf")})
    with pytest.raises(TypeError):
        wire_json.dumps({"x": object()})
    with pytest.raises(ValueError):
        wire_json.loads("")


def test_a_header_that_passed_passes_again_only_when_its_bytes_match_but_for_the_id():
    """The decoder skips the field checks for a header byte-equal but for its id to one that
    passed before; anything else is checked in full (``True`` is not ``1``, a frame count
    or another command is another key)."""
    items = [{"pool": "c128_kv", "src": 0, "dst": 1}]
    for rid in (1, 7, 123456, -3):
        h, arrays = P.decode_request(req("backup", rid, [[3], [5]], items=items, alloc=False))
        assert h["id"] == rid and h["items"] == items and list(arrays[1]) == [5]
    ok = req("backup", 8, [[3], [5]], items=items, alloc=False)
    assert codes([ok[0].replace(b'"alloc":false', b'"alloc":0'), *ok[1:]]) == "bad_field"
    assert codes(ok[:2]) == "bad_frame"  # dst names a frame the message lacks
    assert codes([ok[0].replace(b'"backup"', b'"load"'), *ok[1:]]) == "bad_field"  # no alloc
    passed = req("backup", 9, [[3]], items=[{"pool": "c128_kv", "src": 0}], alloc=True)
    P.decode_request(passed)
    assert codes([passed[0].replace(b'"id":9', b'"id":9.5'), *passed[1:]]) == "bad_header"
    assert codes([passed[0].replace(b'"id":9', b'"id":true'), *passed[1:]]) == "bad_header"
    assert codes([passed[0], passed[1], passed[1]]) == "bad_frame"  # an unnamed frame


@given(st.integers(-(2**70), 2**70), st.sampled_from(["backup", "load", "swap_out", "x\"y", "é"]),
       st.sampled_from(["ok", "error"]), st.text(max_size=12),
       st.dictionaries(st.text(max_size=10), st.lists(st.integers(0, 2**40), min_size=2,
                                                       max_size=4), max_size=3),
       st.booleans())
@settings(max_examples=200, deadline=None)
def test_ack_template_writes_what_json_writes(n, kind, status, path, pools, flag):
    """Replies with an inline ack and pushed acks: the template (wire_json.ack_members) gives
    the bytes json gives, or is not used (odd strings, wrong shapes, a bool for an int)."""
    ack = {"op": n, "kind": kind, "status": status, "bytes": True if flag else abs(n),
           "ns": 5, "exec_ns": 4, "path": path, "pools": pools}
    fields = {"op": n, "ack": ack}
    want = json.dumps({"v": 1, "k": "reply", "id": 3, "ok": True, **fields},
                      separators=(",", ":")).encode()
    assert P.encode_reply(3, fields) == [want]
    assert P.encode_ack(ack) == [json.dumps({"v": 1, "k": "ack", **ack},
                                            separators=(",", ":")).encode()]
    assert P.decode_reply([want])[0]["ack"] == ack


def test_issued_notice_names_the_layers_only_for_progress():
    assert json.loads(P.encode_issued(5)[0]) == {"v": P.VERSION, "k": "issued", "op": 5}
    assert json.loads(P.encode_issued(5, 12)[0]) == {"v": P.VERSION, "k": "issued", "op": 5,
                                                     "layers": 12}
