"""``kv_attach`` with ``handoff``: the engine hands its shared-memory files in on the daemon's
descriptor socket (``fd_handout`` intake) instead of the daemon opening ``/proc/<pid>/fd``.

Against a real ``hicache serve`` (CPU, dsv4-tiny): every byte a handed-in pool moves is compared;
each refusal (not yet handed in, a wrong count, a pipe, a token used twice, a detach before the
hand-in, both ``pid`` and ``handoff``, a marker pool) is one line, enables nothing and leaves no
descriptor open in the daemon; and an engine in another pid namespace, which the ``pid`` way
cannot reach, attaches and moves its pages this way.
"""
from __future__ import annotations

import ctypes
import os
from typing import Any

import pytest
import torch

from hicache.core import fd_handout as F
from hicache.engine.daemon_process import DaemonProcess

from test_fd_handout import _can_unshare, in_new_pid_namespace
from test_kv_store import NS, EnginePool, _geom, _refused, store  # noqa: F401 (fixture)


def _attach(c: Any, ep: EnginePool, name: str, **kw: Any) -> dict[str, Any]:
    return c.kv_attach(name, NS, pages=ep.pages, pool=name, page_bytes=ep.page_bytes,
                       layers=ep.spec, handoff=True, **kw)


def _daemon_fds(d: Any) -> int:
    return len(os.listdir(f"/proc/{d.proc.pid}/fd"))


def test_handed_in_pools_move_every_byte_and_grow_no_file(store: Any) -> None:
    d, pools, _ = store
    layers, pb = _geom(pools, "c4_kv")
    eng = EnginePool(layers, 6, pb, seed=11)
    paged = EnginePool(*_geom(pools, "swa_kv")[:1], 5, _geom(pools, "swa_kv")[1],
                       page_first=True, seed=12)
    sizes = [os.fstat(fd).st_size for fd in eng.fds + paged.fds]
    keys = ["k1", "k2", "k3"]
    with d.client(name="handoff") as c:
        assert c.kv_attach_proven("c4_kv", NS, pages=6, pool="c4_kv", page_bytes=pb,
                                  layers=eng.spec, handoff=True) == ["c4_kv"]
        assert c.kv_attach_proven("swa_kv", NS, pages=5, pool="swa_kv",
                                  page_bytes=paged.page_bytes, layers=paged.spec,
                                  handoff=True) == ["c4_kv", "swa_kv"]
        # no proof was written: the engine's files never grew
        assert [os.fstat(fd).st_size for fd in eng.fds + paged.fds] == sizes
        before = {"c4_kv": eng.snapshot(), "swa_kv": paged.snapshot()}
        assert c.kv_put("c4_kv", keys, [5, 0, 2]) == [True] * 3
        assert c.kv_put("swa_kv", keys, [4, 1, 3]) == [True] * 3
        for t in eng.layers + paged.layers:
            t.zero_()
        assert c.kv_get("c4_kv", keys, [1, 3, 4]) == [True] * 3
        assert c.kv_get("swa_kv", keys, [0, 2, 4]) == [True] * 3
        for name, ep, src, dst in (("c4_kv", eng, [5, 0, 2], [1, 3, 4]),
                                   ("swa_kv", paged, [4, 1, 3], [0, 2, 4])):
            for new, old in zip(ep.layers, before[name]):
                for p in range(ep.pages):  # the pages got back, and every other page still 0
                    want = old[src[dst.index(p)]] if p in dst else torch.zeros_like(old[p])
                    assert torch.equal(new[p], want), (name, p)
        assert c.kv_detach() == 2
    eng.close()
    paged.close()


def test_handoff_refusals_enable_nothing_and_leave_no_descriptor(store: Any) -> None:
    d, pools, _ = store
    layers, pb = _geom(pools, "c4_kv")
    ep = EnginePool(layers, 4, pb, seed=3)
    with d.client(name="refusals") as c:
        c.kv_attach_proven("kv", NS, pages=4, space="page")
        # not handed in yet: kv_verify names it and enables nothing
        reply = _attach(c, ep, "c4_kv")
        base = _daemon_fds(d)  # (the descriptor socket is made by its first use, just now)
        assert reply["nonce"] == "" and reply["proofs"] == [] and reply["fds"] == ep.fds
        msg = _refused("not_owner", c.kv_verify)
        assert "not handed in" in msg
        _refused("not_registered", c.kv_put, "c4_kv", ["a"], [0])
        # a wrong count: refused by the socket, nothing taken in
        with pytest.raises(OSError, match=f"2 descriptors came, {len(ep.fds)} expected"):
            F.send_fds(reply["fd_socket"], reply["fd_token"], ep.fds[:1] * 2, "test")
        # the right files: taken in once; the same token again is refused
        F.send_fds(reply["fd_socket"], reply["fd_token"], ep.fds, "test")
        with pytest.raises(OSError, match="no intake is open|already handed in"):
            F.send_fds(reply["fd_socket"], reply["fd_token"], ep.fds, "test")
        assert c.kv_verify() == ["c4_kv", "kv"]
        assert c.kv_put("c4_kv", ["a"], [1]) == [True]
        assert c.kv_detach() == 2
        c.kv_attach_proven("kv", NS, pages=4, space="page")
        # a pipe handed in for the files: refused at kv_verify, the pool stays unusable
        r, w = os.pipe()
        reply = _attach(c, ep, "c4_kv")
        F.send_fds(reply["fd_socket"], reply["fd_token"], [r] * len(ep.fds), "test")
        msg = _refused("not_owner", c.kv_verify)
        assert "not a shared-memory file" in msg and "attach it again" in msg
        _refused("not_registered", c.kv_get, "c4_kv", ["a"], [0])
        # attached again without a detach: the pending pool is replaced, its token withdrawn
        old = reply
        reply = _attach(c, ep, "c4_kv")
        with pytest.raises(OSError, match="no intake is open"):
            F.send_fds(old["fd_socket"], old["fd_token"], ep.fds, "test")
        F.send_fds(reply["fd_socket"], reply["fd_token"], ep.fds, "test")
        assert c.kv_verify() == ["c4_kv", "kv"]
        assert c.kv_put("c4_kv", ["b"], [2]) == [True]
        _refused("already_registered", c.kv_attach, "c4_kv", NS, pages=ep.pages, pool="c4_kv",
                 page_bytes=ep.page_bytes, layers=ep.spec, handoff=True)  # verified: kept
        assert c.kv_put("c4_kv", ["c"], [3]) == [True]
        assert c.kv_detach() == 2
        c.kv_attach_proven("kv", NS, pages=4, space="page")
        # detached before the hand-in: the intake is gone with the pool
        reply = _attach(c, ep, "c4_kv")
        assert c.kv_detach() == 2
        with pytest.raises(OSError, match="no intake is open"):
            F.send_fds(reply["fd_socket"], reply["fd_token"], ep.fds, "test")
        c.kv_attach_proven("kv", NS, pages=4, space="page")
        # both ways at once, or a marker pool with handoff: one line each
        with pytest.raises(ValueError, match="pid or handoff"):
            _attach(c, ep, "c4_kv", pid=os.getpid())
        msg = _refused("bad_handle", c.call, "kv_attach",
                       {"name": "c4_kv", "namespace": NS, "pages": 4, "pool": "c4_kv",
                        "page_bytes": pb, "layers": ep.spec, "pid": os.getpid(),
                        "handoff": True})
        assert "not both" in msg
        _refused("bad_field", c.call, "kv_attach", {"name": "m", "namespace": NS, "pages": 4,
                                                    "space": "page", "handoff": True})
        os.close(r), os.close(w)
        assert _daemon_fds(d) == base  # every descriptor taken in was closed again
        after = c.call("stats", {"check": True})[0]
        assert after["invariants"] == "ok"
    ep.close()


def test_the_client_hands_in_only_the_files_its_layers_name(store: Any,
                                                             monkeypatch: Any) -> None:
    """A reply asking for other descriptors than the layers named gets none of them, and the
    pool it left pending is replaced by the retry."""
    d, pools, _ = store
    layers, pb = _geom(pools, "c4_kv")
    ep = EnginePool(layers, 4, pb)
    sent: list[Any] = []
    monkeypatch.setattr("hicache.engine.kv_client.send_fds", lambda *a: sent.append(a))
    with d.client(name="asks") as c:
        real = c.kv_attach

        def greedy(*a: Any, **kw: Any) -> dict[str, Any]:
            return {**real(*a, **kw), "fds": [0, 1, 2]}

        monkeypatch.setattr(c, "kv_attach", greedy)
        with pytest.raises(ValueError, match="not the files"):
            c.kv_attach_proven("c4_kv", NS, pages=4, pool="c4_kv", page_bytes=pb,
                               layers=ep.spec, handoff=True)
        assert sent == []
        # the real reply and hand-in: a retry replaces the pending pool, no kv_detach needed
        # (it was refused already_registered before)
        monkeypatch.undo()
        assert c.kv_attach_proven("c4_kv", NS, pages=4, pool="c4_kv", page_bytes=pb,
                                  layers=ep.spec, handoff=True) == ["c4_kv"]
        assert c.kv_detach() == 1
    ep.close()


_ENGINE = """
import json, mmap, os, sys
from hicache.core.layout import Layout
from hicache.engine.client import Client, CommandRefused
c = Client(sys.argv[1], timeout=10.0)
spec = Layout.from_dict(c.heartbeat(full=True)["layout"]).pools["c4_kv"]
pages, pb, n = 4, spec.page_bytes, spec.num_layers
fds = [os.memfd_create("engine-pool") for _ in range(n)]
maps = []
for i, fd in enumerate(fds):
    os.ftruncate(fd, pages * pb)
    maps.append(mmap.mmap(fd, pages * pb))
    for p in range(pages):
        maps[i][p * pb:(p + 1) * pb] = bytes([(i * 7 + p * 13 + 1) % 256]) * pb
layers = [{"fd": fd, "offset": 0, "stride": pb} for fd in fds]
try:  # the /proc way cannot reach this process from the daemon's pid namespace
    c.kv_attach("viapid", "ns", pages=pages, pool="c4_kv", page_bytes=pb, layers=layers)
    by_pid = "attached"
except CommandRefused as e:
    by_pid = e.code
attached = c.kv_attach_proven("c4_kv", "ns", pages=pages, pool="c4_kv", page_bytes=pb,
                              layers=layers, handoff=True)
stored = c.kv_put("c4_kv", ["x", "y"], [0, 3])
for m in maps:
    m[:] = bytes(len(m))
found = c.kv_get("c4_kv", ["x", "y"], [2, 1])
ok = all(maps[i][2 * pb:3 * pb] == bytes([(i * 7 + 1) % 256]) * pb and
         maps[i][1 * pb:2 * pb] == bytes([(i * 7 + 39 + 1) % 256]) * pb and
         maps[i][0:pb] == bytes(pb) and maps[i][3 * pb:] == bytes(pb) for i in range(n))
print(json.dumps({"pid": os.getpid(), "by_pid": by_pid, "attached": attached,
                  "stored": stored, "found": found, "bytes_ok": ok}))
c.kv_detach()
c.close()
"""


def test_an_engine_in_another_pid_namespace_attaches_by_handoff() -> None:
    if _can_unshare() is not None:
        pytest.skip(f"needs a new pid namespace ({_can_unshare()})")
    with DaemonProcess(device="cpu", preset="dsv4-tiny", device_rows="page=4,swa_page=4,"
                       "req_slot=4", extra=("--no-mtp", "--c128-state", "offline")) as d:
        got = in_new_pid_namespace(_ENGINE, d.address)
        assert got["pid"] < 10  # its own pid namespace
        assert got["by_pid"] == "bad_handle"
        assert got["attached"] == ["c4_kv"]
        assert got["stored"] == [True, True] and got["found"] == [True, True]
        assert got["bytes_ok"] is True


def _punch(fd: int, offset: int, length: int) -> None:
    """``fallocate(FALLOC_FL_PUNCH_HOLE | FALLOC_FL_KEEP_SIZE)``: the pages go, the size stays."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.fallocate.argtypes = [ctypes.c_int, ctypes.c_int, ctypes.c_long, ctypes.c_long]
    if libc.fallocate(fd, 0x02 | 0x01, offset, length) != 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))


@pytest.mark.parametrize("how", ["cut", "punched"])
@pytest.mark.parametrize("handoff", [True, False], ids=["handoff", "pid"])
def test_an_engine_that_cuts_its_pool_file_is_refused_not_a_sigbus(store: Any, handoff: bool,
                                                                   how: str) -> None:
    """An engine that shrinks an attached pool's file, or punches holes in it (by mistake: its
    files cannot be sealed), gets its next ``kv_put`` / ``kv_get`` refused ``bad_handle``
    naming the file, before any byte moves or any entry changes (``kv_exists``, which moves
    none, still answers); the daemon stays up and serves the engine's other pools (before, the
    copy past the file's end faulted and the daemon stopped answering; a copy into a hole of a
    full tmpfs would too)."""
    d, pools, _ = store
    layers, pb = _geom(pools, "c4_kv")
    cut = EnginePool(layers, 4, pb, seed=21)
    keep = EnginePool(layers, 4, pb, seed=22)
    with d.client(name="cutter") as c:
        for name, ep in (("cut", cut), ("keep", keep)):
            c.kv_attach_proven(name, NS, pages=4, pool="c4_kv", page_bytes=pb, layers=ep.spec,
                               handoff=handoff)
        assert c.kv_put("cut", ["a"], [0]) == [True]
        if how == "cut":
            os.ftruncate(cut.fds[-1], pb)  # the last layer's file: one page left of four
        else:  # the size stays, the last layer's pages go
            _punch(cut.fds[-1], 0, 4 * pb)
            assert os.fstat(cut.fds[-1]).st_size == 4 * pb
        for call in (lambda: c.kv_put("cut", ["b"], [3]), lambda: c.kv_get("cut", ["a"], [3])):
            msg = _refused("bad_handle", call)
            assert ("shorter than" if how == "cut" else "has holes now") in msg, msg
            assert "kv_detach" in msg, msg
        assert c.kv_exists("cut", ["a", "b"]) == [True, False]
        # the daemon and the other pool (same daemon pool, so the same entries) go on, and the
        # refused put stored nothing
        assert c.kv_exists("keep", ["a", "b"]) == [True, False]
        assert c.kv_put("keep", ["z"], [1]) == [True]
        assert c.kv_get("keep", ["z"], [2]) == [True]
        for t in keep.layers:
            assert torch.equal(t[2], t[1])
        assert c.kv_detach() == 2
    assert d.alive()
    cut.close()
    keep.close()


def test_the_key_store_maps_a_bounded_number_of_engine_files(store: Any) -> None:
    """Each mapped engine file holds two of the daemon's descriptors, and libzmq aborts the
    process when they run out: past ``file_budget()`` files over all clients (here an eighth
    of a soft limit lowered to 256: 32), an attach is refused ``busy``, maps nothing and
    leaves no descriptor; a detach makes room again."""
    import resource

    from hicache.controllers.kv_regions import MAX_FILES

    d, pools, _ = store
    layers, pb = _geom(pools, "c4_kv")
    hard = resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE)[1]
    resource.prlimit(d.proc.pid, resource.RLIMIT_NOFILE, (256, hard))
    budget = min(MAX_FILES, 256 // 8)
    per = EnginePool(layers, 2, pb, seed=31)  # one file per layer
    assert per.spec and len({s["fd"] for s in per.spec}) == layers
    fit = budget // layers
    with d.client(name="many-a") as a, d.client(name="many-b") as b:
        for i in range(fit):
            (a if i % 2 else b).kv_attach_proven(f"p{i}", NS, pages=2, pool="c4_kv",
                                                 page_bytes=pb, layers=per.spec)
        fds = _daemon_fds(d)
        msg = _refused("busy", lambda: a.kv_attach(f"p{fit}", NS, pages=2, pool="c4_kv",
                                                   page_bytes=pb, layers=per.spec))
        assert f"pass the key store's {budget}" in msg, msg
        assert _daemon_fds(d) == fds
        assert a.kv_put("p1", ["k"], [0]) == [True]  # the others still work
        a.kv_detach()
        b.kv_attach_proven(f"p{fit}", NS, pages=2, pool="c4_kv", page_bytes=pb,
                           layers=per.spec)
        assert b.kv_get(f"p{fit}", ["k"], [1]) == [True]
    per.close()
