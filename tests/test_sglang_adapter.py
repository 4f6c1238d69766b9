"""The SGLang adapter, tested against SGLang 0.5.23's own cache classes on CPU.

SGLang lives in its own environment, ``.venv-sglang`` (``scripts/setup_sglang.sh``: CPU torch,
sglang installed without its GPU dependencies; built once, then cached).
``tests/background_jobs.py`` (job ``sglang``) builds it when missing and runs
``tests/sglang/check_dsv4_l2.py`` (the host-pool seam, a real ``hicache serve`` per PP stage)
and ``tests/sglang/check_dynamic_backend.py`` (the ``dynamic`` storage backend across an
engine restart, and, when this environment has the Mooncake wheel, across a daemon restart with
L3 behind the key store: this process runs the ``mooncake_master`` and passes its addresses and
this Python, which runs that daemon, in ``HICACHE_TEST_L3``) there; the test fails with the
inner run's output if any inner test fails or is skipped. The inner run starts beside the main
suite when collection selects it (``conftest``; it overlaps the rest).
The version gate is also checked here, in the main environment (no sglang installed).
"""
from __future__ import annotations

import re
import sys
from typing import Any

import pytest

from hicache.engine.sglang import UnsupportedSglang, check_sglang_version
from hicache.engine.sglang.version import installed_sglang

import background_jobs


def _tail(text: str, n: int = 6000) -> str:
    return text[-n:]


def test_sglang_adapter_against_sglang_classes() -> None:
    r = background_jobs.result("sglang")  # (run beside the main suite: conftest)
    assert r.steps, r.notes
    setup = r.steps[0]
    assert setup.rc == 0, f"setup_sglang.sh failed {r.notes}:\n{_tail(setup.out + setup.err)}"
    assert len(r.steps) == 2, r.notes
    out = r.steps[1].out + r.steps[1].err
    assert r.steps[1].rc == 0, f"SGLang adapter tests failed {r.notes}:\n{_tail(out)}"
    m = re.search(r"(\d+) passed", out)
    assert m and int(m.group(1)) == r.want, f"expected {r.want} passed:\n{_tail(out)}"
    assert not re.search(r"\d+ (skipped|failed|error)", out), _tail(out)  # deselected: fine


def test_version_gate_refuses_other_versions_in_one_line() -> None:
    for bad in ("0.5.22", "0.5.24", "0.6.0"):
        with pytest.raises(UnsupportedSglang) as e:
            check_sglang_version(bad)
        msg = str(e.value)
        assert "\n" not in msg and f"found sglang {bad}" in msg and "0.5.23" in msg
    assert check_sglang_version("0.5.23") == "0.5.23"


@pytest.mark.skipif(installed_sglang() is not None, reason="sglang installed in this env")
def test_install_refuses_without_sglang() -> None:
    from hicache.engine import sglang as hs

    with pytest.raises(UnsupportedSglang, match="sglang is not installed"):
        hs.install("dsv4-tiny", address="ipc:///nonexistent")
    assert "sglang" not in sys.modules  # the gate runs before any SGLang import


def test_a_gpu_loads_last_layer_waits_for_its_ack_and_a_failure_raises() -> None:
    """At a GPU load's last layer the adapter waits for the op's ack and checks it: a load that
    failed (say a later layer's launch) raises ``TransferFailed`` there, so SGLang never counts
    it as loaded. Earlier layers return once their event says they are copied."""
    from types import SimpleNamespace

    import torch

    from hicache.engine.acks import TransferFailed

    class GpuClient:
        backup_events: list = []  # (no CUDA here: the load fence is the CUDA test's)

        def __init__(self) -> None:
            self.calls: list = []

        def load(self, items, wait_event=None):
            self.calls.append(("load", items))
            return SimpleNamespace(op_id=7, event_set=0, ack=None)

        def wait_layer(self, op, layer):
            self.calls.append(("layer", layer))

        def wait_ack(self, op, timeout=None, check=True):
            self.calls.append(("ack", check))
            raise TransferFailed(SimpleNamespace(op=op.op_id, ok=False, kind="load",
                                                 error={"message": "launch failed"}))

    c = GpuClient()
    pool = _stand_in_pool(c, "c4_kv")
    host, dev = torch.arange(4, 8), torch.arange(8, 12)
    pool.load_to_device_per_layer(None, host, dev, 0, "direct")
    assert c.calls == [("load", {"c4_kv": ([1], [2])}), ("layer", 0)]
    with pytest.raises(TransferFailed, match="launch failed"):
        pool.load_to_device_per_layer(None, host, dev, 1, "direct")
    assert c.calls[-2:] == [("layer", 1), ("ack", True)] and pool._loads == {}

    # one submission of two pools (the assembler patch's ``submission``): one load of both at
    # the first call; a layer one pool's call found copied is not waited for again (the op's
    # layer event covers every pool); the ack is waited for and checked once, at the last
    # pool's last layer
    from hicache.engine.sglang.host_pools import submission

    c = GpuClient()
    a = _stand_in_pool(c, "c4_kv")
    b = _stand_in_pool(c, "swa_kv", link=a.link)
    sa, sb = (torch.arange(4, 8), torch.arange(8, 12)), (torch.arange(0, 4), torch.arange(12, 16))
    transfers = [SimpleNamespace(host_pool=a, host_indices=sa[0], device_indices=sa[1]),
                 SimpleNamespace(host_pool=b, host_indices=sb[0], device_indices=sb[1])]
    with submission(a.link, "loads", transfers):
        a.load_to_device_per_layer(None, *sa, 0, "direct")
        b.load_to_device_per_layer(None, *sb, 0, "direct")
        a.load_to_device_per_layer(None, *sa, 1, "direct")  # a's last: b still has a layer
        assert c.calls == [("load", {"c4_kv": ([1], [2]), "swa_kv": ([0], [3])}),
                           ("layer", 0), ("layer", 1)]
        with pytest.raises(TransferFailed, match="launch failed"):
            b.load_to_device_per_layer(None, *sb, 1, "direct")
    assert c.calls[-2:] == [("layer", 1), ("ack", True)]
    assert a.link.submitting.loads is None  # the submission is over

    # ids SGLang translates before the calls (a device pool's ``host_transfer_translate``), a
    # pool of another link, one pool twice, an MTP draft: no group, each pool sends its own
    from hicache.engine.sglang.host_pools import _grouped

    translated = SimpleNamespace(host_transfer_translate=lambda ids: ids + 1)
    other = _stand_in_pool(c, "c128_kv")
    def changed(**kw: Any) -> Any:
        return SimpleNamespace(**{**vars(transfers[1]), **kw})

    for bad in ([transfers[0], changed(device_pool=translated)],
                [transfers[0], changed(host_pool=other)], [transfers[0], transfers[0]],
                [transfers[0], changed(is_draft=True)]):
        assert _grouped(a.link, bad) is None
    assert _grouped(a.link, transfers) is not None


def test_a_load_start_loading_submits_is_waited_for_by_the_forward_layer_by_layer() -> None:
    """With ``forward_waits``, a GPU load that SGLang's ``start_loading`` submits (``defer``)
    is not waited for in the submission: its calls wait for nothing but, at the last, put the
    last layer's wait on the stream (SGLang's completion event follows the copies). The
    forward's ``wait_until(t)`` (the layer counter the link's ``layer_waits`` wraps) then polls
    layer ``t`` on the host before SGLang's own wait, once per layer, and at the stage's last
    layer waits for the ack and checks it: a failed load raises there, before the forward's
    last layer. A load no forward waited for is finished before the next load its producer
    index takes is sent; a timeout leaves a load kept; ``detach`` restores SGLang's wait."""
    import threading
    from types import SimpleNamespace

    import torch

    from hicache.engine.acks import AckTimeout, TransferFailed
    from hicache.engine.sglang.host_pools import submission
    from hicache.engine.sglang.layer_waits import LayerWaits

    class GpuClient:
        backup_events: list = []
        stage_layers = [10, 11]  # (global layers of the stage: the counter counts from 0)

        def __init__(self, fail: bool = False) -> None:
            self.calls: list[tuple] = []
            self.fail = fail
            self.n = 0
            self.stall: int | None = None  # a layer whose wait times out

        def load(self, items: Any, wait_event: Any = None) -> Any:
            self.n += 1
            self.calls.append(("load", self.n))
            return SimpleNamespace(op_id=self.n, event_set=0, ack=None)

        def wait_layer(self, op: Any, layer: int, on_stream: bool = False) -> None:
            self.calls.append(("layer", op.op_id, layer, on_stream))
            if layer == self.stall:
                raise AckTimeout(f"op {op.op_id}: layer {layer} not copied in time")

        def wait_ack(self, op: Any, timeout: Any = None, check: bool = True) -> None:
            self.calls.append(("ack", op.op_id))
            if self.fail:
                raise TransferFailed(SimpleNamespace(op=op.op_id, ok=False, kind="load",
                                                     error={"message": "launch failed"}))

    class Counter:  # SGLang's ``LayerDoneCounter``, as far as the adapter reads it
        def __init__(self, log: list) -> None:
            self.producer_index = self.consumer_index = -1
            self.log = log

        def wait_until(self, t: int) -> None:
            self.log.append(("sglang", t))

    def stack(c: GpuClient) -> tuple[Any, Any, Any, list]:
        lock = threading.RLock()
        link = SimpleNamespace(client=c, lock=lock, pool_global_layer=lambda p, l: 10 + l,
                               submitting=threading.local(), layer_waits=LayerWaits(c, lock))
        a, b = _stand_in_pool(c, "c4_kv", link=link), _stand_in_pool(c, "swa_kv", link=link)
        ids = [(torch.arange(4, 8), torch.arange(8, 12)), (torch.arange(0, 4),
                                                           torch.arange(12, 16))]
        transfers = [SimpleNamespace(host_pool=p, host_indices=h, device_indices=d)
                     for p, (h, d) in zip((a, b), ids)]
        return link, a, b, [transfers, ids]

    def submit(link: Any, a: Any, b: Any, tr: list, defer: bool = True) -> None:
        transfers, (sa, sb) = tr
        with submission(link, "loads", transfers, defer):
            for layer in (0, 1):  # SGLang's loop: every pool per layer
                a.load_to_device_per_layer(None, *sa, layer, "direct")
                b.load_to_device_per_layer(None, *sb, layer, "direct")

    def kept(link: Any) -> dict[int, int]:
        return {i: op.op_id for i, op in link.layer_waits.pending().items()}

    c = GpuClient()
    link, a, b, tr = stack(c)
    counter = Counter(c.calls)
    link.layer_waits.attach(counter)
    with pytest.raises(RuntimeError, match="already waited for through a layer counter"):
        link.layer_waits.attach(Counter(c.calls))
    with pytest.raises(RuntimeError, match="this layer counter already waits"):
        LayerWaits(c, threading.RLock()).attach(counter)  # (another link, the same counter)
    counter.producer_index = 0  # (``start_loading`` advances it before it submits)
    submit(link, a, b, tr)
    assert c.calls == [("load", 1), ("layer", 1, 11, True)]  # no host wait for a copy
    assert kept(link) == {0: 1}
    counter.consumer_index = 0  # the batch's forward
    c.calls.clear()
    counter.wait_until(0)
    counter.wait_until(0)  # (a second accessor of layer 0: not polled again)
    counter.wait_until(1)
    assert c.calls == [("layer", 1, 10, False), ("sglang", 0), ("sglang", 0),
                       ("layer", 1, 11, False), ("ack", 1), ("sglang", 1)]
    assert kept(link) == {}
    c.calls.clear()
    counter.wait_until(1)  # nothing kept under the consumer now: SGLang's wait alone
    counter.consumer_index = -1
    counter.wait_until(0)
    assert c.calls == [("sglang", 1), ("sglang", 0)]

    # a load no forward waited for (a batch dropped) is finished, its ack taken and checked,
    # before the next load its producer index takes is sent
    c.calls.clear()
    counter.producer_index = 1
    submit(link, a, b, tr)
    submit(link, a, b, tr)  # (producer index 1 again)
    assert c.calls == [("load", 2), ("layer", 2, 11, True), ("ack", 2), ("load", 3),
                       ("layer", 3, 11, True)]
    assert kept(link) == {1: 3}
    # a wait that times out leaves the load kept (its outcome is still to be checked)
    c.stall, counter.consumer_index = 10, 1
    with pytest.raises(AckTimeout):
        counter.wait_until(0)
    assert kept(link) == {1: 3}
    c.wait_ack = lambda op, timeout=None, check=True: (_ for _ in ()).throw(
        AckTimeout(f"op {op.op_id} did not complete"))
    with pytest.raises(AckTimeout):  # retiring it times out too: still kept, nothing sent
        submit(link, a, b, tr)
    assert kept(link) == {1: 3} and c.n == 3
    link.layer_waits.detach()  # (the link's close): SGLang's own wait again, nothing kept
    assert kept(link) == {} and not getattr(counter.wait_until, "__hicache__", False)
    c.calls.clear()
    counter.wait_until(0)
    assert c.calls == [("sglang", 0)]

    # a failed load raises at the forward's last layer (SGLang's own wait never runs) and is
    # no longer kept; one no forward waited for raises before the next load is sent
    c = GpuClient(fail=True)
    link, a, b, tr = stack(c)
    counter = Counter(c.calls)
    link.layer_waits.attach(counter)
    counter.producer_index = counter.consumer_index = 2
    submit(link, a, b, tr)
    counter.wait_until(0)
    with pytest.raises(TransferFailed, match="launch failed"):
        counter.wait_until(1)
    assert c.calls[-2:] == [("layer", 1, 11, False), ("ack", 1)]
    assert kept(link) == {}
    counter.consumer_index = -1
    submit(link, a, b, tr)
    with pytest.raises(TransferFailed, match="launch failed") as e:
        submit(link, a, b, tr)
    assert "producer index 2, which no forward waited for" in "".join(e.value.__notes__)
    assert c.calls[-1] == ("ack", 2) and c.n == 2  # the next load was not sent

    # any other load waits in its calls, as before: one not ``start_loading``'s (no
    # ``defer``: SGLang's retraction restore), or with no counter attached, or a CPU load
    # (its ack came at submission)
    for case in ("no defer", "no counter", "cpu"):
        c = GpuClient()
        link, a, b, tr = stack(c)
        if case != "no counter":
            link.layer_waits.attach(Counter(c.calls))
            link.layer_waits.counter.producer_index = 0
        if case == "cpu":
            c.load = lambda items, wait_event=None: SimpleNamespace(op_id=1, event_set=None,
                                                                    ack=None)
            c.backup_events = []
        submit(link, a, b, tr, defer=case != "no defer")
        assert link.layer_waits.pending() == {}, case
        assert ("ack", 1) in c.calls, case


def _stand_in_pool(client: Any, ours: str, link: Any = None) -> Any:
    """A host pool of the adapter with two layers and 4-token pages on a stand-in link."""
    import threading
    from types import SimpleNamespace

    from hicache.engine.sglang.host_pools import _DaemonPoolMixin

    pool = object.__new__(_DaemonPoolMixin)
    pool.link = link or SimpleNamespace(client=client, lock=threading.RLock(),
                                        pool_global_layer=lambda p, l: l,
                                        submitting=threading.local())
    pool.ours, pool.layer_num, pool.page_size = ours, 2, 4
    pool._loads, pool._load_lock = {}, threading.Lock()
    return pool


def test_the_link_keeps_an_idle_worker_alive_and_frees_what_it_holds(daemon_factory) -> None:
    """SGLang calls the host pools only when it moves KV: the link's heartbeat thread keeps an
    idle worker registered past the daemon's timeout (it used to be reaped, its host rows freed
    under SGLang's tree). ``free_all`` (SGLang's ``flush_cache``) gives back every row the
    link holds; ``close`` unregisters and closes the client."""
    import time
    from types import SimpleNamespace

    from hicache.core.layout import build_layout, preset
    from hicache.engine.client import Client
    from hicache.engine.device_pools import DevicePools
    from hicache.engine.sglang.link import DaemonLink

    # 1.2 s: the heartbeat thread beats every 0.4 s, leaving a loaded machine ~0.7 s of slack
    # (0.6 s left ~0.35 s)
    d = daemon_factory(heartbeat_timeout=1.2, metrics=False)
    layout = build_layout(preset("dsv4-flash"))
    with DevicePools(layout, {"page": 8, "swa_page": 4, "req_slot": 4}) as pools:
        client = Client(d.address, timeout=5.0, name="sglang-idle")
        h = client.register(pools)
        link = DaemonLink(client, SimpleNamespace(layout=layout), h["host_rows"], None)
        rows = link.alloc("page", 3)
        assert rows is not None and link.free_rows("page") == link.capacity("page") - 3
        time.sleep(3.6)  # three heartbeat timeouts with no call from SGLang
        assert link.beats.error is None
        with d.client(name="watch") as w:
            assert w.stats()["workers"] == 1, "the idle worker was reaped"
        assert link.alloc("page", 1) is not None  # still registered: no not_registered
        assert link.free_all("page") == 4 and link.free_rows("page") == link.capacity("page")
        link.close()
        assert not link.beats.thread.is_alive()
        with d.client(name="watch") as w:
            assert w.stats()["workers"] == 0


def test_the_links_alloc_is_decided_by_its_own_count_and_a_daemon_short_of_it_stops(
        daemon_factory) -> None:
    """Every TP rank allocates on a daemon of its own, and SGLang reads ``None`` from ``alloc``
    as memory pressure on that rank alone: a ``no_space`` on one rank put the ranks out of
    step (an SGLang review). The link decides from its own count, which follows SGLang's calls
    only (the same on every rank): too few free is ``None`` without a daemon call; a daemon
    that refuses what the count says is free is ``OutOfStep``, an error that stops the
    scheduler, and the link's count is unchanged."""
    from types import SimpleNamespace

    from hicache.core.layout import build_layout, preset
    from hicache.engine.client import Client
    from hicache.engine.device_pools import DevicePools
    from hicache.engine.sglang.link import DaemonLink, OutOfStep

    d = daemon_factory(metrics=False)
    layout = build_layout(preset("dsv4-flash"))
    with DevicePools(layout, {"page": 8, "swa_page": 4, "req_slot": 4}) as pools:
        client = Client(d.address, timeout=5.0, name="sglang-count")
        h = client.register(pools)
        link = DaemonLink(client, SimpleNamespace(layout=layout), h["host_rows"], None)
        try:
            cap = link.capacity("page")
            rows = link.alloc("page", cap - 2)
            assert rows is not None and link.free_rows("page") == 2
            sent = client.sent
            assert link.alloc("page", 3) is None and client.sent == sent  # not asked
            with link.lock:
                other = client.alloc({"page": 1})["page"]  # a row not counted by the link
            with pytest.raises(OutOfStep, match=r"fewer free page rows than this SGLang worker "
                                                r"was given \(2 asked, 2 free"):
                link.alloc("page", 2)
            assert link.free_rows("page") == 2
            with link.lock:
                client.free({"page": other})
            assert link.alloc("page", 2) is not None and link.free_rows("page") == 0
            assert link.free_all("page") == cap
        finally:
            link.close()


def test_a_no_space_while_a_deferred_free_may_be_pending_waits_for_it() -> None:
    """The daemon defers the free of a row an operation still uses, while the link counts it
    free at once: an ``alloc`` in between met ``no_space`` and stopped the server (a diff
    review). With a deferred free pending the link waits (within the call timeout) until the
    daemon says none of the worker's operations runs, then asks once more; only a refusal
    after that, or one with no deferral pending, is ``OutOfStep``. (A stand-in client: the
    CPU daemon's copies end too soon to hold a free deferred on purpose.)"""
    import threading

    from hicache.engine.client import CommandRefused
    from hicache.engine.sglang.link import DaemonLink, OutOfStep

    class Daemon:
        timeout, address = 0.3, "ipc:///stand-in"

        def __init__(self) -> None:
            self.room, self.in_flight_for, self.polls, self.allocs = 0, 2, 0, 0
            self.daemon_in_flight = 1

        def free(self, rows: dict) -> dict:
            return {"freed": 0, "deferred": True}

        def alloc(self, counts: dict) -> dict:
            self.allocs += 1
            if self.room < counts["page"]:
                raise CommandRefused("alloc", "no_space", "0 page rows free")
            return {"page": list(range(100, 100 + counts["page"]))}

        def poll_acks(self, ops: list | None = None) -> list:
            assert ops == []  # takes no ack the host pools wait for
            self.polls += 1
            if self.polls >= self.in_flight_for:  # the operation ended: the rows are back
                self.daemon_in_flight, self.room = 0, 8
            return []

    def link(d: Daemon) -> DaemonLink:
        ln = DaemonLink.__new__(DaemonLink)
        ln.client, ln.host_rows, ln.lock = d, {"page": 4}, threading.RLock()
        ln._held, ln._held_lock, ln._deferred = {"page": {0, 1, 2, 3}}, threading.Lock(), False
        return ln

    d = Daemon()
    ln = link(d)
    ln.free("page", [0, 1])
    assert ln.free_rows("page") == 2 and ln._deferred
    assert ln.alloc("page", 2) == [100, 101]  # waited for the operation, asked again
    assert (d.allocs, d.polls, ln._deferred) == (2, 2, False)
    d = Daemon()
    d.in_flight_for = 10**9  # the operation outlasts the call timeout
    ln = link(d)
    ln.free("page", [0, 1])
    with pytest.raises(OutOfStep, match="fewer free page rows"):
        ln.alloc("page", 2)
    assert d.allocs == 2 and d.polls > 1 and ln.free_rows("page") == 2
    d = Daemon()
    ln = link(d)
    ln._held["page"] = {0, 1}  # no deferral pending: refused at once, nothing polled
    with pytest.raises(OutOfStep):
        ln.alloc("page", 2)
    assert (d.allocs, d.polls) == (1, 0)


def test_sharing_cpu_tensors_without_their_memfd_is_refused_before_the_daemon_is_asked() -> None:
    """``DaemonLink.share`` (``connect``'s second half, called directly by the CUDA adapter
    test) shares CPU tensors only from the sealed memfd ``connect`` moved them into: without
    it, one line, and the client is never used."""
    import torch

    from hicache.core.layout import build_layout, preset
    from hicache.engine.sglang.link import DaemonLink
    from hicache.engine.sglang.stage_map import StageBuffers

    layout = build_layout(preset("dsv4-tiny"), c128_state="offline", mtp=False)
    t = torch.zeros(2, 8, dtype=torch.uint8)
    stage = StageBuffers(layout, {"swa_kv": [t]}, {"swa_page": 2}, {"swa_kv": [t]})

    class Untouched:
        def __getattr__(self, name: str) -> None:
            raise AssertionError(f"the client was used ({name})")

    with pytest.raises(ValueError, match="^share: CPU tensors are shared from the sealed memfd "
                                         "connect moves them into; none was given$"):
        DaemonLink.share(stage, Untouched(), None)  # type: ignore[arg-type]


def test_page_rows_from_token_indices_match_a_plain_reading_and_refuse_the_rest() -> None:
    """``_pages`` turns SGLang's token indices into page rows (numpy since the fifty-third
    session; torch's CPU ops cost ~0.2 ms before a load's first layer): whole aligned pages of
    any dtype and shape give their rows, in order; anything else is refused in one line, as
    a plain reading of the rule says."""
    import random

    import torch

    from hicache.engine.sglang.host_pools import _pages

    def plain(ids: list[int], page: int) -> list[int] | None:
        if len(ids) % page:
            return None
        chunks = [ids[i:i + page] for i in range(0, len(ids), page)]
        if any(c != list(range(c[0], c[0] + page)) or c[0] % page for c in chunks):
            return None
        return [c[0] // page for c in chunks]

    rnd = random.Random(7)
    for trial in range(400):
        page = rnd.choice([1, 2, 4, 64, 256])
        rows = rnd.sample(range(512), rnd.randint(1, 9))
        ids = [r * page + t for r in rows for t in range(page)]
        bad = trial % 4
        if bad == 1 and page > 1:  # two tokens of one page swapped
            i = rnd.randrange(len(ids) // page) * page
            ids[i], ids[i + 1] = ids[i + 1], ids[i]
        elif bad == 2:  # every index one token off (not aligned, or not whole)
            ids = [x + 1 for x in ids]
        elif bad == 3:  # a token short
            ids = ids[:-1]
        dtype = rnd.choice([torch.int64, torch.int32])
        t = torch.tensor(ids, dtype=dtype)
        if len(ids) % 2 == 0 and rnd.random() < 0.3:
            t = t.reshape(2, -1)  # (any shape: read flat)
        want = plain(ids, page)
        if want is None:
            with pytest.raises(ValueError, match=r"^x: .*(whole|aligned)"):
                _pages(t, page, "x")
        else:
            assert _pages(t, page, "x") == want, (page, ids)
    sliced = torch.arange(64, dtype=torch.int64)[::2]  # not contiguous: 0, 2, 4, ...
    with pytest.raises(ValueError, match="not whole aligned 4-token pages"):
        _pages(sliced, 4, "x")
    assert _pages(torch.arange(8, 16, dtype=torch.int64), 4, "x") == [2, 3]


def test_a_heartbeat_thread_whose_client_was_closed_ends_quietly(daemon_factory,
                                                                 caplog: Any) -> None:
    """``engine.heartbeats``: a client closed without ``stop()`` (a review found a test doing
    it) left the thread retrying forever, a warning each time it was found failing; it ends
    now, with no warning. An open client's beats go on until ``stop()``."""
    import logging
    import threading
    import time

    from hicache.engine.client import Client
    from hicache.engine.heartbeats import Heartbeats

    d = daemon_factory(heartbeat_timeout=0.6, metrics=False)
    c = Client(d.address, timeout=5.0, name="beats")
    c.heartbeat()
    with caplog.at_level(logging.INFO, logger="hicache.heartbeats"):
        beats = Heartbeats(c, threading.RLock())
        time.sleep(0.5)
        assert beats.thread.is_alive() and beats.error is None
        c.close()
        beats.thread.join(3.0)
        assert not beats.thread.is_alive()
    assert not [r for r in caplog.records if r.name == "hicache.heartbeats"], caplog.records
