"""L3 pieces that need no store: settings validation, namespaces, object headers, page keys,
and where a page's bytes lie in a real host arena (with its checksum); and the tier's
connector and workers (online state, the hung-master check) over a stand-in store."""
from __future__ import annotations

import contextlib
import threading
import time
from typing import Any, Callable, Iterator

import numpy as np
import pytest

from hicache.controllers import l3_format as F
from hicache.core.config import load_config
from hicache.core.errors import UsageError
from hicache.core.layout import build_layout, preset
from hicache.engine.hooks import page_key
from hicache.host_pools.group import HostPoolGroup

from kv_fake_l3 import client, dstate, with_l3  # noqa: F401 (fixture)

TINY = build_layout(preset("dsv4-tiny"))
BASE = {"preset": "dsv4-tiny"}


def test_l3_settings_from_flags_env_and_file(tmp_path):
    cfg = load_config({**BASE, "l3": "mooncake", "l3_master": "127.0.0.1:50051",
                       "l3_metadata": "http://127.0.0.1:8080/metadata",
                       "l3_scope": "deepseek-ai/DeepSeek-V4-Flash@main"}, env={})
    assert (cfg.l3, cfg.l3_protocol, cfg.l3_segment) == ("mooncake", "tcp", 0)
    assert cfg.l3_scope == "deepseek-ai/DeepSeek-V4-Flash@main"
    env = {"HICACHE_L3": "mooncake", "HICACHE_L3_MASTER": "m:1",
           "HICACHE_L3_METADATA": "P2PHANDSHAKE", "HICACHE_L3_SEGMENT": "1GiB",
           "HICACHE_L3_SCOPE": "m@1"}
    cfg = load_config(BASE, env=env)
    assert (cfg.l3_master, cfg.l3_metadata, cfg.l3_segment) == ("m:1", "P2PHANDSHAKE", 1 << 30)
    f = tmp_path / "c.toml"
    f.write_text('[serve]\nl3 = "mooncake"\nl3-master = "h:2"\n'
                 'l3-metadata = "http://h:3/metadata"\nl3-protocol = "rdma"\n'
                 'l3-rdma-devices = "mlx5_0"\nl3-scope = "m@2"\n')
    cfg = load_config(BASE, str(f), env={})
    assert (cfg.l3_protocol, cfg.l3_rdma_devices, cfg.l3_scope) == ("rdma", "mlx5_0", "m@2")


@pytest.mark.parametrize("flags,msg", [
    ({"l3": "redis"}, "l3 must be 'off' or 'mooncake'"),
    ({"l3": "mooncake"}, "--l3-master HOST:PORT"),
    ({"l3": "mooncake", "l3_master": "nohostport"}, "--l3-master HOST:PORT"),
    ({"l3": "mooncake", "l3_master": "h:1"}, "--l3-metadata"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "ftp://x"}, "--l3-metadata"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE",
      "l3_protocol": "udp"}, "--l3-protocol must be"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE",
      "l3_rdma_devices": "mlx5_0"}, "rdma only"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE",
      "l3_local_host": "::1"}, r"::1: Mooncake's listeners cannot be kept on IPv6 loopback"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE",
      "l3_local_host": "::ffff:7f00:1"}, r"::ffff:7f00:1: Mooncake's listeners cannot"),
    ({"l3_master": "h:1"}, "l3 is off"),
    ({"l3_scope": "m@1"}, "--l3-scope given but --l3 is off"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE"},
     r"^--l3 mooncake needs --l3-scope: not given; name the served weights"),
    ({"l3": "mooncake", "l3_master": "h:1", "l3_metadata": "P2PHANDSHAKE",
      "l3_scope": "my model"}, r"^--l3-scope 'my model': must be 1\.\.200 characters"),
    ({"l3_segment": "1GiB"}, "l3 is off"),
])
def test_l3_settings_refused_with_one_line(flags, msg):
    with pytest.raises(UsageError, match=msg) as e:
        load_config({**BASE, **flags}, env={})
    assert "\n" not in str(e.value)


def test_namespace_separates_models_stages_layouts_mirrors_and_weights():
    """The layout says nothing of the weights: a base model and its fine-tune (one preset, one
    layout) shared every object, each verified as good by the other's daemon (L3 review).
    The scope (``--l3-scope``) names the weights."""
    names = {F.namespace(build_layout(preset(p), pp, r, swa_mode=swa), w, m)
             for p in ("dsv4-tiny", "dsv4-flash") for pp, r in ((1, 0), (2, 0), (2, 1))
             for swa in ("paged", "ring") for m in F.MIRRORS for w in ("base@1", "tuned@1")}
    assert len(names) == 2 * 3 * 2 * 2 * 2
    assert F.namespace(TINY, "w@1") == F.namespace(build_layout(preset("dsv4-tiny")), "w@1")
    assert F.namespace(TINY, "a/b") != F.namespace(TINY, "a_b")  # a digest, not a cleaned name
    with pytest.raises(ValueError):
        F.namespace(TINY, "w@1", "partial")
    with pytest.raises(ValueError, match="scope"):
        F.namespace(TINY, "")


def test_header_round_trip_and_every_mismatch():
    buf = bytearray(F.HEADER_BYTES)
    F.pack_header(memoryview(buf), "ns/k1", 1000, 0xDEADBEEF)
    assert F.check_header(memoryview(buf), "ns/k1", 1000) is None
    assert F.header_checksum(memoryview(buf)) == 0xDEADBEEF
    assert F.check_header(memoryview(buf), "ns/k2", 1000) == "header names another key"
    assert "payload" in F.check_header(memoryview(buf), "ns/k1", 999)
    bad = bytearray(buf)
    bad[0] ^= 1
    assert F.check_header(memoryview(bad), "ns/k1", 1000) == "not a hicache object"
    bad = bytearray(buf)
    bad[4] += 1
    assert "format version" in F.check_header(memoryview(bad), "ns/k1", 1000)


def test_page_keys():
    assert F.check_page_key("i1f") is None
    for k in ("", "a b", "x" * 129, "é", 5, None):
        assert F.check_page_key(k) is not None
    keys = [page_key(k) for k in (0, 31, -5, "abc", b"\x00\x01", (1, 2), "long " * 40)]
    assert keys[:4] == ["i0", "i1f", "n5", "sabc"]
    assert all(F.check_page_key(k) is None for k in keys)
    assert len(set(keys)) == len(keys)
    with pytest.raises(TypeError):
        page_key(True)
    # integers by value, whatever their type: numpy's repr differs by version (forty-fifth
    # session's review), so a digest of it gave other L3 names for the same page
    assert page_key(np.int64(31)) == "i1f" and page_key(np.uint8(5)) == "i5"
    assert page_key((np.int32(1), 2)) == page_key((1, 2)) == keys[5]
    assert page_key(("a", (np.int64(3),))) == page_key(("a", (3,)))


def test_pieces_cover_exactly_one_page_and_checksum_sees_every_byte():
    rows = {"page": 6, "swa_page": 6, "req_slot": 2}
    with HostPoolGroup(TINY, rows) as g:
        fmt = F.Objects(TINY, g, "test-weights").get("full")
        assert fmt.spaces == ("page", "swa_page")
        assert fmt.payload_bytes == TINY.row_bytes("page") + TINY.row_bytes("swa_page")
        arena = g.arena.tensor(0, g.arena.nbytes).numpy()
        rng = np.random.default_rng(0)
        arena[:] = rng.integers(0, 256, arena.size, dtype=np.uint8)
        page = {"page": 3, "swa_page": 5}
        ptrs, sizes = fmt.pieces(page)
        assert sum(sizes) == fmt.payload_bytes
        want = [(p.layers[i][page[p.spec.index]].data_ptr(), p.spec.page_bytes)
                for p in g.pools.values() if p.spec.index in fmt.spaces
                for i in range(p.spec.num_layers)]
        assert sorted(zip(ptrs, sizes)) == sorted(want)
        c0 = fmt.checksum(page)
        assert c0 == fmt.checksum(dict(page))  # deterministic
        assert fmt.checksum({"page": 2, "swa_page": 5}) != c0  # another row
        base = g.arena.ptr
        for p, n in ((ptrs[0], 8), (ptrs[-1] + sizes[-1] - 1, 1), (ptrs[len(ptrs) // 2], 3)):
            off = p - base
            old = arena[off].copy()
            arena[off] ^= 0x40  # one bit anywhere in the page changes the checksum
            assert fmt.checksum(page) != c0
            arena[off] = old
        assert fmt.checksum(page) == c0
        # words moved within one layer (a slice delivered at the wrong offset, two halves
        # swapped) change it too (format 1 summed a layer's words: the same sum)
        for p, size in ((ptrs[0], sizes[0]), (ptrs[-1], sizes[-1])):
            off, half = p - base, size // 2 // 8 * 8
            old = arena[off:off + size].copy()
            arena[off:off + size] = np.concatenate([old[half:2 * half], old[:half],
                                                    old[2 * half:]])
            assert not np.array_equal(arena[off:off + size], old)
            assert fmt.checksum(page) != c0
            arena[off:off + size] = old
        assert fmt.checksum(page) == c0


def test_object_kinds_keys_and_refusals():
    assert F.kind_of("full", False) == "full"
    assert (F.kind_of("checkpoints", False), F.kind_of("checkpoints", True)) == ("page", "ckpt")
    for bad in (("full", True), ("partial", False)):
        with pytest.raises(ValueError):
            F.kind_of(*bad)
    ring = build_layout(preset("dsv4-tiny"), swa_mode="ring")
    with HostPoolGroup(ring, {"page": 4, "req_slot": 4}) as g:
        objs = F.Objects(ring, g, "test-weights")
        assert sorted(objs.formats) == ["ckpt", "page"]  # ring mode: no full-mirror pages
        with pytest.raises(ValueError, match="paged SWA"):
            objs.get("full")
        # pages and checkpoints of one key never share an object; mirrors never share a name
        keys = {objs.key("i1", k) for k in ("page", "ckpt")}
        assert len(keys) == 2 and all("/checkpoints/" in k for k in keys)
    with HostPoolGroup(TINY, {"page": 4, "swa_page": 4, "req_slot": 2}) as g:
        objs = F.Objects(TINY, g, "test-weights")
        assert objs.key("i1", "full") != objs.key("i1", "page")
        assert objs.get("page").spaces == ("page",)
        assert objs.get("page").payload_bytes == TINY.row_bytes("page")


@pytest.mark.parametrize("swa", ["paged", "ring"])
def test_checkpoint_object_holds_the_swa_tail_and_states_only(swa):
    """A checkpoint object covers exactly what a resume reads (core.resume): the SWA tail
    token range (values and scales) and the C4 / C4-indexer state rows, nothing else."""
    from hicache.core.resume import ResumeModel

    lay = build_layout(preset("dsv4-tiny"), swa_mode=swa)
    r = ResumeModel(lay)
    space = r.checkpoint_space
    rows = {"page": 4, "swa_page": 4, "req_slot": 4} if swa == "paged" else \
        {"page": 4, "req_slot": 4}
    with HostPoolGroup(lay, rows) as g:
        fmt = F.Objects(lay, g, "test-weights").get("ckpt")
        assert fmt.spaces == (space,) and fmt.page_tokens == 0
        assert fmt.payload_bytes == r.checkpoint_bytes
        swa_pool = r.swa_pool
        assert fmt.pools() == {space: {"swa_kv": True, "c4_state": False,
                                       "c4_indexer_state": False}}
        ptrs, sizes = fmt.pieces({space: 2})
        assert sum(sizes) == r.checkpoint_bytes
        pos = list(r.tail_offsets) if swa == "paged" else r.ring_positions(3)
        a, b = min(pos), max(pos) + 1
        want = []
        for i in range(swa_pool.num_layers):
            row = g.pools["swa_kv"].layers[i][2].data_ptr()
            want += [(row + a * swa_pool.value_bytes, (b - a) * swa_pool.value_bytes),
                     (row + swa_pool.scale_offset + a * swa_pool.scale_bytes,
                      (b - a) * swa_pool.scale_bytes)]
        for p in r.state_pools:
            want += [(g.pools[p.name].layers[i][2].data_ptr(), p.page_bytes)
                     for i in range(p.num_layers)]
        assert sorted(zip(ptrs, sizes)) == sorted(want)
        arena = g.arena.tensor(0, g.arena.nbytes).numpy()
        arena[:] = np.random.default_rng(1).integers(0, 256, arena.size, dtype=np.uint8)
        c0 = fmt.checksum({space: 2})
        row = g.pools["swa_kv"].layers[0][2].data_ptr() - g.arena.ptr
        arena[row] ^= 1  # the SWA head (token 0 in paged mode) is not in the object
        assert (fmt.checksum({space: 2}) == c0) == (swa == "paged")
        arena[row] ^= 1
        arena[row + (b - 1) * swa_pool.value_bytes] ^= 1  # the tail's last token is
        assert fmt.checksum({space: 2}) != c0


def test_each_curve_key_has_its_own_page_objects(dstate):
    """Under CURVE a client key's page objects are named under its own segment, so no key
    reads (prefetch) or plants (put) another key's page objects through the daemon; without
    CURVE (no key) every client shares them. Checked on the keys of the jobs the handlers
    queue (a stand-in tier that runs nothing)."""
    from hicache.controllers import l3_handlers

    st = dstate
    l3 = with_l3(st)
    l3.objects = F.Objects(st.layout, st.group, "test-weights")
    # the daemon's key files: named by their public keys, so one key filed under two names
    # (on two daemons) is one tenant, and a name says nothing
    st.curve_keys = {"alice": "PUBLIC-A", "alice-too": "PUBLIC-A", "bob": "PUBLIC-B"}
    keys = {}
    for who, key in (("a", "alice"), ("b", "bob"), ("a2", "alice-too"), ("plain", None)):
        c = client(st, who.encode(), key)
        l3_handlers.l3_query(st, c, {"keys": ["p1", "p2"], "mirror": "full"}, [])
        l3_handlers.l3_query(st, c, {"keys": ["p1"], "mirror": "checkpoints", "ckpt": True}, [])
        keys[who] = [k for j in l3.queued[-2:] for k in j.keys]
    ns = F.namespace(st.layout, "test-weights", "full")
    assert keys["plain"][:2] == [F.object_key(ns, "p1"), F.object_key(ns, "p2")]
    assert keys["plain"][2] == F.object_key(F.namespace(st.layout, "test-weights",
                                                        "checkpoints"), "p1", "ckpt")
    for who in ("a", "b"):
        assert all("/t-" in k and k.endswith(("/p1", "/p2")) for k in keys[who])
        assert "/ck/p1" in keys[who][2]
    assert not set(keys["a"]) & set(keys["b"]) and not set(keys["a"]) & set(keys["plain"])
    assert keys["a2"] == keys["a"]
    assert keys["a"][0].startswith(ns + "/t-")


def test_the_liveness_check_holds_only_a_refusing_master_against_the_tier():
    """``master_gone`` (the online tier's liveness check): a refused connect to the master
    only. A down metadata server made the check take the tier offline while the offline probe,
    which asks the master, brought it back: it flapped every 2 s. A master that does not
    accept in time (hung) is left to the calls' deadlines."""
    import socket

    from hicache.controllers.l3_reach import master_gone
    from hicache.controllers.l3_store import L3Settings

    up = socket.socket()
    up.bind(("127.0.0.1", 0))
    up.listen(1)
    closed = socket.socket()
    closed.bind(("127.0.0.1", 0))  # bound, not listening: connects are refused
    try:
        live = f"127.0.0.1:{up.getsockname()[1]}"
        dead = f"127.0.0.1:{closed.getsockname()[1]}"
        meta_down = f"http://127.0.0.1:{closed.getsockname()[1]}/metadata"
        assert master_gone(L3Settings(master=live, metadata=meta_down)) is None
        assert master_gone(L3Settings(master=dead, metadata="P2PHANDSHAKE")) == \
            f"the master at {dead} refuses connections"
        assert master_gone(L3Settings(master="no-such-host.invalid:50051",
                                      metadata="P2PHANDSHAKE")) is None  # uncertain: left
    finally:
        up.close()
        closed.close()



class _StandInStore:
    """A Mooncake client stand-in for the tier's own bookkeeping (what is tested is the
    connector's and the workers' handling, not Mooncake)."""

    def setup(self, *a: object) -> int:
        return 0

    def register_buffer(self, ptr: int, n: int) -> int:
        return 0

    def batch_is_exist(self, keys: list[str]) -> list[int]:
        return [0] * len(keys)

    def close(self) -> None:
        pass


class _Boom(BaseException):
    pass


@contextlib.contextmanager
def _tier(store_class: type) -> Iterator[tuple[Any, Any]]:
    """A ``MooncakeL3`` over ``store_class`` whose master is a listening socket: (tier,
    its metrics)."""
    import socket
    import types

    from hicache.controllers.l3_store import L3Settings, MooncakeL3
    from hicache.controllers.metrics import Metrics

    master = socket.socket()
    master.bind(("127.0.0.1", 0))
    master.listen(8)
    metrics = Metrics()
    settings = L3Settings(master=f"127.0.0.1:{master.getsockname()[1]}", metadata="P2PHANDSHAKE")
    l3 = MooncakeL3(settings, types.SimpleNamespace(ptr=0, nbytes=0), None, metrics,
                    lambda: None, store_class=store_class, setup_check=None)
    try:
        yield l3, metrics
    finally:
        l3.close()
        master.close()
        metrics.close()


@contextlib.contextmanager
def _hanging_tier() -> Iterator[tuple[Any, Any, threading.Event]]:
    """``_tier`` over a store whose ``batch_is_exist`` waits for ``gate``: online, then the
    gate closed (the master hangs until the test opens it): (tier, its metrics, gate)."""
    gate = threading.Event()

    class Hangs(_StandInStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            gate.wait(30)
            return [0] * len(keys)

    with _tier(Hangs) as (l3, m):
        assert _until(lambda: l3.online), l3.state
        gate.clear()
        try:
            yield l3, m, gate
        finally:
            gate.set()


def _until(cond: Callable[[], bool], timeout: float = 10.0) -> bool:
    deadline = time.monotonic() + timeout
    while not cond() and time.monotonic() < deadline:
        time.sleep(0.02)
    return cond()


def test_a_job_whose_call_raises_anything_is_acked_and_its_worker_goes_on():
    """A ``BaseException`` out of a job's call (not only an ``Exception``) killed its worker
    thread: the job was never acked, every later job of its queue never ran, and ``_running``
    stayed up, which held the liveness check off for good. Now it is counted as an error miss
    and acked, and the worker takes the next job."""
    from hicache.controllers.l3_store import LIVENESS_S, L3Job

    def boom(l3: object) -> None:
        raise _Boom("out of the call")

    with _tier(_StandInStore) as (l3, _):
        assert _until(lambda: l3.online), l3.state
        bad, good = L3Job("meta", ["k"], call=boom), L3Job("meta", ["k"], call=lambda l3: 5)
        l3.submit(bad)
        l3.submit(good)
        assert _until(lambda: len(l3.completed) == 2)
        assert l3.take_completed() == [bad, good]
        assert bad.misses == {"error": 1} and bad.value is None
        assert good.misses == {} and good.value == 5
        assert l3._running == 0 and l3._idle(time.monotonic() + LIVENESS_S + 0.1)


def test_a_connect_that_raises_anything_is_retried():
    """A ``BaseException`` out of Mooncake's set-up killed the connector thread: the tier
    stayed ``connecting`` for good, never retried. Now it is a failed attempt (one offline
    transition), and the next attempt connects."""
    calls: list[float] = []

    class Flaky(_StandInStore):
        def setup(self, *a: object) -> int:
            calls.append(time.monotonic())
            if len(calls) == 1:
                raise _Boom("surprise in setup")
            return 0

    with _tier(Flaky) as (l3, m):
        assert _until(lambda: l3.online), (l3.state, len(calls))
        assert len(calls) == 2
        assert m.value("l3_transitions", "offline") == 1
        assert m.value("l3_transitions", "online") == 1


def test_a_tier_refused_for_good_at_its_first_connect_counts_a_transition():
    """Mooncake refusing the arena's registration fails the tier for good (``failed: ...``,
    logged): that too counts one offline transition, so an alert on transitions fires."""

    class Refusing(_StandInStore):
        def register_buffer(self, ptr: int, n: int) -> int:
            return -1

    with _tier(Refusing) as (l3, m):
        assert _until(lambda: l3.state.startswith("failed")), l3.state
        assert not l3.online and m.value("l3_online") == 0
        assert m.value("l3_transitions", "offline") == 1


def test_a_slow_master_is_not_taken_for_a_hung_one():
    """The hung-master check first timed a whole job and ignored calls that ended while its
    probe waited: a master answering every call in 2.1 s took the tier offline and back four
    times in 11 s, each transition counted and the puts of each window dropped (the
    forty-third session's review). Now it times each call, and a call that ends while the probe
    waits speaks for the master."""
    from hicache.controllers.l3_store import L3Job

    class Slow(_StandInStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:
            time.sleep(2.1)
            return [0] * len(keys)

    with _tier(Slow) as (l3, m):
        assert _until(lambda: l3.online), l3.state
        jobs = [L3Job("query", [f"k{i}"]) for i in range(3)]  # two checks' worth
        for j in jobs:
            l3.submit(j)
        assert _until(lambda: len(l3.completed) == len(jobs), 30)
        assert m.value("l3_transitions", "offline") == 0 and l3.online
        assert all(j.misses == {} for j in jobs)


def test_a_job_between_two_calls_is_not_in_a_hung_call():
    """A call's start stayed recorded after it returned, until the job's next call: a probe
    whose wait ended while the job worked between two calls (verifying what it read) found
    the old call "stuck", and the tier went offline and straight back, with a master that
    answered every call (the forty-third session's second review)."""
    from hicache.controllers.l3_store import L3Job

    class Slow(_StandInStore):
        def batch_is_exist(self, keys: list[str]) -> list[int]:  # the probe's call
            time.sleep(3.9)
            return [0] * len(keys)

    def two_calls(tier: Any) -> int:
        # answered, slowly: a probe starts once it ran past HUNG_CALL_S (2 s) and its wait
        # ends ~2 s later, inside the job's own work between its calls (the window is 1 s
        # on either side: it was 0.1 s, which a loaded machine's late thread missed)
        tier._call(time.sleep, 3.0)
        time.sleep(2.0)
        tier._call(time.sleep, 0.05)
        return 2

    with _tier(Slow) as (l3, m):
        assert _until(lambda: l3.online, 10), l3.state
        job = L3Job("meta", [], call=two_calls)
        l3.submit(job)
        assert _until(lambda: job in l3.completed, 10) and job.value == 2
        assert l3.online and m.value("l3_transitions", "offline") == 0


def test_a_hung_master_is_found_and_a_job_of_short_calls_is_not_hung():
    """A call that does not return takes the tier offline once a probe of the master is not
    answered either (``hung()`` then holds, and jobs submitted meanwhile are answered at once,
    ``offline``); when the master answers again the tier comes back. A job of many short calls,
    however long, is not a hung call when the tier goes offline for another reason."""
    from hicache.controllers.l3_store import HUNG_CALL_S, PROBE_WAIT_S, L3Job

    with _hanging_tier() as (l3, m, gate):
        t0 = time.monotonic()
        stuck = L3Job("query", ["a"])
        l3.submit(stuck)
        assert _until(lambda: not l3.online, 15)
        took = time.monotonic() - t0
        assert HUNG_CALL_S + PROBE_WAIT_S - 0.1 < took < HUNG_CALL_S + PROBE_WAIT_S + 2.5, took
        assert "answered no probe" in l3.why and l3.hung()
        late = L3Job("query", ["b", "c"], each=True)
        l3.submit(late)  # answered now, not behind the stuck call
        assert late in l3.completed and late.misses == {"offline": 2} and late.present == [0, 0]
        gate.set()
        assert _until(lambda: l3.online, 10) and not l3.hung()
        assert _until(lambda: stuck in l3.completed)
        assert m.value("l3_transitions", "offline") == 1

    with _tier(_StandInStore) as (l3, m):
        assert _until(lambda: l3.online), l3.state
        began = threading.Event()

        def many(tier: Any) -> int:
            began.set()
            for _ in range(60):
                tier._call(time.sleep, 0.05)
            return 1

        job = L3Job("meta", [], call=many)
        l3.submit(job)
        assert began.wait(5)
        time.sleep(HUNG_CALL_S + 0.2)
        l3._set_online(False, "a call reported the master gone")  # (another worker's call)
        assert not l3.hung() and l3.call_age(time.monotonic()) < 1
        assert _until(lambda: job in l3.completed, 10) and job.value == 1


def test_a_probe_left_unanswered_counts_as_hung_and_none_starts_once_closing():
    """With the tier offline and its probe unanswered for ``PROBE_WAIT_S`` (the stuck job's
    call had returned, the master still hung), ``hung()`` said no: a stop then waited its whole
    close budget and logged an error. And a probe could start after ``close`` had looked for
    probes to wait on, so the store could be closed under it."""
    from hicache.controllers.l3_store import PROBE_WAIT_S

    with _hanging_tier() as (l3, _, gate):
        l3._set_online(False, "a call found the master gone")  # its offline probe now hangs
        assert _until(lambda: l3._asking is not None, 5)
        t0 = l3._asking.t0
        assert _until(l3.hung, PROBE_WAIT_S + 3) and time.monotonic() - t0 >= PROBE_WAIT_S
        gate.set()
        assert _until(lambda: l3.online, 10) and not l3.hung()
        l3._stop.set()  # closing
        assert l3._ask(0.1) is None and (l3._asking is None or l3._asking.done.is_set())


def _page_job(kind: str, key: str) -> Any:
    """An ``L3Job`` of one 8-byte page (a format that needs no arena: the stand-in stores
    never touch the bytes)."""
    import types

    from hicache.controllers.l3_store import L3Job

    fmt = types.SimpleNamespace(kind="full", pieces_per_object=1, payload_bytes=8,
                                obj_bytes=F.HEADER_BYTES + 8, page_tokens=4,
                                pieces=lambda rows: ([0], [8]), checksum=lambda rows: 0)
    return L3Job(kind, [key], rows=[{"page": 0}], fmt=fmt)


def test_a_storage_node_that_hangs_stalls_its_queue_not_the_tier():
    """A storage node that hangs (the master answering) held a prefetch's transfer call up to
    Mooncake's own timeout, and every read queued behind it, queries too (which the master
    alone answers), waited out its deadline while the tier read online; puts queued behind a
    stuck put, holding their host rows. Now queries have a worker of their own; a prefetch or
    put call that has run ``HUNG_CALL_S`` while the master answers its probe stalls its queue:
    the jobs queued behind it and those submitted meanwhile are answered at once as
    ``stalled`` misses, a stop does not wait for it (``hung()``), and its return ends the
    stall. The tier stays online throughout."""
    from hicache.controllers.l3_store import HUNG_CALL_S, LIVENESS_S, L3Job

    gate = threading.Event()

    class NodeHangs(_StandInStore):
        def batch_get_into_multi_buffers(self, keys: list[str], *a: object) -> list[int]:
            gate.wait(30)
            return [-704] * len(keys)  # not found

        def batch_put_from_multi_buffers(self, keys: list[str], *a: object) -> list[int]:
            gate.wait(30)
            return [0] * len(keys)

    with _tier(NodeHangs) as (l3, m):
        assert _until(lambda: l3.online), l3.state
        try:
            t0 = time.monotonic()
            stuck, behind = _page_job("prefetch", "a"), _page_job("prefetch", "b")
            put = _page_job("put", "p")
            for j in (stuck, behind, put):
                l3.submit(j)
            query = L3Job("query", ["a", "b"], each=True)
            l3.submit(query)  # not behind the stuck prefetch
            assert _until(lambda: query in l3.completed, 1.0) and query.present == [0, 0]
            assert _until(lambda: set(l3.stalled()) == {"read", "write"}, 15), l3.stalled()
            took = time.monotonic() - t0
            assert HUNG_CALL_S - 0.1 < took < HUNG_CALL_S + LIVENESS_S + 1.5, took
            assert "storage node" in l3.stalled()["read"]
            assert l3.online and l3.hung() and m.value("l3_transitions", "offline") == 0
            assert m.value("l3_stalled", "read") == 1 == m.value("l3_stalled", "write")
            # (the stall is published first, then its queued jobs are answered, outside the
            # lock: a loaded CI machine once looked in between)
            assert _until(lambda: behind in l3.completed, 2.0), l3.completed
            assert behind.misses == {"stalled": 1}
            late, late_put = _page_job("prefetch", "c"), _page_job("put", "q")
            l3.submit(late)
            l3.submit(late_put)  # answered now, not queued: no pages wait for the write worker
            assert late.misses == {"stalled": 1} == late_put.misses and late_put in l3.completed
            assert l3.put_pages_queued == 1  # the stuck put's
            assert stuck not in l3.completed and put not in l3.completed
            assert m.value("l3_errors", "stalled") == 3
            gate.set()
            assert _until(lambda: not l3.stalled(), 5) and not l3.hung()
            assert m.value("l3_stalled", "read") == 0 == m.value("l3_stalled", "write")
            assert _until(lambda: stuck in l3.completed and put in l3.completed)
            assert stuck.misses == {"miss": 1} and put.written == 1 and l3.put_pages_queued == 0
            after = _page_job("prefetch", "d")
            l3.submit(after)  # runs again
            assert _until(lambda: after in l3.completed) and after.misses == {"miss": 1}
            assert l3.online and m.value("l3_transitions", "offline") == 0
        finally:
            gate.set()  # (a failed assertion leaves no call hanging)


def test_a_stall_holds_neither_the_other_workers_nor_calls_only_the_master_answers():
    """The forty-fourth session's review of the stall: (1) ``hung()`` said True as soon as one
    queue stalled, so a stop answered healthy jobs of the other workers ``stopping`` (a clear
    that then succeeded was acked failed); now it says True only once every job running is
    held by a stalled call. (2) A remove (the master alone answers it) that ran over 2 s
    stalled the write queue and dropped the puts behind it; only calls that move data stall.
    (3) A queued job already cancelled (acked at its deadline, or its client reaped) was
    dropped as ``stalled`` and counted an error a second time; it keeps its own reason."""
    from hicache.controllers.l3_store import HUNG_CALL_S, L3Job

    gate, meta_gate = threading.Event(), threading.Event()

    class NodeHangs(_StandInStore):
        def batch_get_into_multi_buffers(self, keys: list[str], *a: object) -> list[int]:
            gate.wait(30)
            return [-704] * len(keys)

        def remove_by_regex(self, regex: str, force: bool) -> int:
            time.sleep(HUNG_CALL_S + 1.5)  # slow, and the master's alone
            return 0

        def batch_put_from_multi_buffers(self, keys: list[str], *a: object) -> list[int]:
            return [0] * len(keys)

    def healthy(tier: Any) -> str:
        tier._call(meta_gate.wait, 30)  # a call of the master's, as long as the test wants
        return "ok"

    with _tier(NodeHangs) as (l3, m):
        try:
            assert _until(lambda: l3.online), l3.state
            stuck, reaped, behind = _page_job("prefetch", "a"), _page_job("prefetch", "b"), \
                _page_job("prefetch", "c")
            remove, put = L3Job("remove", ["^x/"]), _page_job("put", "p")
            meta = L3Job("meta", [], call=healthy)
            for j in (stuck, reaped, behind, remove, put, meta):
                l3.submit(j)
            assert l3.cancel(reaped, "cancelled")  # (still queued: its client was reaped)
            assert _until(lambda: "read" in l3.stalled(), 15), l3.stalled()
            # (the stall is published under the lock, its queued jobs answered after it)
            assert _until(lambda: behind in l3.completed, 2.0)
            assert reaped.misses == {"cancelled": 1} and behind.misses == {"stalled": 1}
            assert m.value("l3_errors", "stalled") == 1  # (``cancelled`` is no error)
            assert not l3.hung()  # the meta worker's job is healthy: a stop waits for it
            time.sleep(HUNG_CALL_S + 0.5)  # the remove has run past 2 s: no stall
            assert _until(lambda: put in l3.completed, 5) and put.written == 1
            assert set(l3.stalled()) == {"read"} and remove.misses == {}
            meta_gate.set()
            assert _until(lambda: meta in l3.completed) and meta.value == "ok"
            assert _until(l3.hung, 2)  # only the stalled call runs now
            assert m.value("l3_stalled", "write") == 0 == m.value("l3_stalled", "meta")
        finally:
            gate.set()
            meta_gate.set()
        assert _until(lambda: not l3.stalled() and stuck in l3.completed, 5)
        assert not l3.hung()
