"""The engine client's arguments, checked before a request goes out (no daemon needed: the
client connects lazily, and ``call`` is replaced where a reply is needed).

* A timeout is a finite number of seconds above 0 (0 too for ``wait_ack`` / ``wait_layer``,
  which then only look); NaN used to spin a core forever, infinity raised ``OverflowError``
  after the request went out, a negative one sent the request and reported ``NoReply``.
* A bad address or CURVE key file is a ``ValueError`` from ``Client(...)`` and leaves no socket
  open.
* ``kv_get``'s pages are int64s as ``kv_put``'s are, one per key: it used to cut 1.7 to page
  1, read "3" as page 3, drop all but the first of a nested list, and ignore extra pages.
* The L3 commands wait for their ack past the command's deadline: with the defaults (a 5 s
  client timeout, the daemon's 5,000 ms deadline) every call on a store that hangs raised
  ``AckTimeout`` just before the daemon's "0 hits at the deadline" came.
"""
from __future__ import annotations

import math

import pytest
import zmq

from hicache.engine.acks import Ack
from hicache.engine.client import Client


@pytest.fixture
def client(tmp_path):
    c = Client(f"ipc://{tmp_path}/nobody.sock", timeout=5.0, channel=False)
    yield c
    c.close()


@pytest.mark.parametrize("bad", [math.nan, math.inf, -1.0, 0.0, 2e6, "soon", object()])
def test_a_bad_timeout_is_refused_before_anything_is_sent(client, bad, monkeypatch):
    def send(frames):
        raise AssertionError("a request went out")

    monkeypatch.setattr(client, "_send", send)
    with pytest.raises(ValueError, match="timeout must be"):
        client.stats(timeout=bad)
    assert client.sent == 0


@pytest.mark.parametrize("bad", [math.nan, math.inf, -0.5, 0.0])
def test_a_client_with_a_bad_default_timeout_is_refused(tmp_path, bad):
    with pytest.raises(ValueError, match="timeout must be"):
        Client(f"ipc://{tmp_path}/nobody.sock", timeout=bad)


def test_waits_take_zero_to_only_look_but_nothing_unbounded(client):
    from hicache.engine.acks import AckTimeout

    with pytest.raises(AckTimeout):
        client.wait_ack(12345, timeout=0)  # nothing sent: no ack here, and it does not wait
    for bad in (math.nan, math.inf, -1):
        with pytest.raises(ValueError, match="timeout must be"):
            client.wait_ack(12345, timeout=bad)
    assert client.sent == 0


def test_a_bad_address_or_key_file_is_a_value_error_and_leaves_no_socket(tmp_path, monkeypatch):
    made: list[zmq.Socket] = []
    real = zmq.Context.socket

    def socket(self, *a, **k):
        s = real(self, *a, **k)
        made.append(s)
        return s

    monkeypatch.setattr(zmq.Context, "socket", socket)
    with pytest.raises(ValueError, match="cannot connect to 'nonsense://x'"):
        Client("nonsense://x")
    with pytest.raises(ValueError, match="CURVE key file"):
        Client("tcp://127.0.0.1:1", curve_server_key=str(tmp_path / "none.key"),
               curve_secret_key=str(tmp_path / "none.key_secret"))
    assert len(made) == 2 and all(s.closed for s in made)


def test_kv_get_pages_are_int64s_one_per_key(client, monkeypatch):
    sent: list = []

    def call(cmd, fields=None, arrays=(), timeout=None):
        sent.append(list(arrays[0]))
        return {"found": [1] * len(fields["keys"])}, []

    monkeypatch.setattr(client, "call", call)
    for pages in ([1.7], ["3"], [[5, 6]]):
        with pytest.raises(TypeError):
            client.kv_get("pool", ["a"], pages)
    with pytest.raises(ValueError, match="2 keys but 1 pages"):
        client.kv_get("pool", ["a", "b"], [5])
    with pytest.raises(ValueError, match="1 keys but 2 pages"):
        client.kv_get("pool", ["a"], [5, 6])
    assert sent == []  # nothing went out for any of those
    assert client.kv_get("pool", ["a", "b"], [7, 9]) == [True, True]
    assert sent == [[7, 9]]


@pytest.mark.parametrize("deadline_ms, timeout, want", [
    (None, None, 6.0), (2000, None, 5.0), (10_000, None, 11.0), (None, 30.0, 30.0)])
def test_l3_commands_wait_for_their_ack_past_the_deadline(client, monkeypatch, deadline_ms,
                                                          timeout, want):
    waits: list[float] = []

    def call(cmd, fields=None, arrays=(), timeout=None):
        return {"op": 77}, []

    def wait_ack(op, timeout=None, check=True):
        waits.append(timeout)
        return Ack(77, "l3_query", "ok", {}, 0, 0.0, 0.0, "", l3={"hits": 0, "present": [0]})

    monkeypatch.setattr(client, "call", call)
    monkeypatch.setattr(client, "wait_ack", wait_ack)
    kw = {} if deadline_ms is None else {"deadline_ms": deadline_ms}
    client.l3_query(["k"], timeout=timeout, **kw)
    client.l3_present(["k"], timeout=timeout, **kw)
    client.l3_prefetch(["k"], {"page": [1]}, timeout=timeout, **kw)
    assert waits == [want] * 3
