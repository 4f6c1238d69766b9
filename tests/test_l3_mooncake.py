"""L3 on a real Mooncake Store: a ``mooncake_master`` and a storage member on loopback, real
``hicache serve --l3 mooncake`` daemons, the client library. No mocks.

Every page that comes back from L3 is loaded into device rows and compared byte for byte with
the device rows it was backed up from, in every pool. Skipped (with the reason) only when the
Mooncake wheel is not installed: ``pip install 'hicache[l3]'``.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import textwrap
import time
from typing import Any

import pytest
import torch

from hicache.controllers import l3_format
from hicache.core.layout import build_layout, preset
from hicache.engine.client import Client, CommandRefused
from hicache.engine.device_pools import DevicePools
from hicache.engine import l3_master

import background_jobs
from conftest import ROOT, close_all, start_daemon

pytestmark = pytest.mark.skipif(l3_master.mooncake_dir() is None,
                                reason="Mooncake wheel not installed (pip install 'hicache[l3]')")
TINY = build_layout(preset("dsv4-tiny"))
ROWS = {"page": 8, "swa_page": 8, "req_slot": 4}
ROWS_FLAG = "page=8,swa_page=8,req_slot=4"
SCOPE = "test/dsv4-tiny@1"  # --l3-scope: the served weights
SPACES = ("page", "swa_page")


def thread_states(pid: int) -> dict[str, str]:
    """Each thread's state letter (``/proc/PID/task/TID/stat``; "T": stopped)."""
    out = {}
    for task in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{task}/stat") as f:
                out[task] = f.read().rsplit(")", 1)[1].split()[0]
        except FileNotFoundError:  # a thread that ended meanwhile
            pass
    return out


def stop_process(pid: int, timeout: float = 5.0) -> None:
    """SIGSTOP ``pid`` and return once every one of its threads is stopped (a signal is
    delivered at each thread's next return to user mode: on a loaded machine, later)."""
    os.kill(pid, signal.SIGSTOP)
    deadline = time.monotonic() + timeout
    while set(thread_states(pid).values()) != {"T"}:
        assert time.monotonic() < deadline, f"process {pid} not stopped: {thread_states(pid)}"
        time.sleep(0.005)


@pytest.fixture(scope="module")
def store():
    s = l3_master.LocalStore(segment="256MB").start()
    yield s
    s.close()


@pytest.fixture
def l3_daemon(tmp_path, store):
    """Start ``hicache serve --l3 mooncake`` daemons against the store; all are closed at
    teardown, and so are the workers made with ``worker`` (also when a test fails). The store's
    segment is mounted first (after an earlier test's master restart the member mounts it
    again only after a while)."""
    store.wait_mounted()
    started: list = []

    def make(**kw):
        extra = ("--l3", "mooncake", "--l3-master", store.master_addr,
                 "--l3-metadata", kw.pop("metadata", store.metadata_url),
                 "--l3-scope", kw.pop("scope", SCOPE))
        env = {**l3_master.loopback_env(), **kw.pop("env", {})}
        d = start_daemon(tmp_path, preset="dsv4-tiny", device_rows=ROWS_FLAG, extra=extra,
                         env=env, **kw)  # (``fault``: tests/fault_daemon.py)
        started.append(d)
        return d

    yield make
    close_all(started)


@pytest.fixture
def worker():
    made: list = []

    def make(d, seed: int) -> "Worker":
        w = Worker(d, seed)
        made.append(w)
        return w

    yield make
    for w in made:
        w.close()


def wait_online(c: Client, timeout: float = 20.0) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < timeout:
        if c.stats()["l3"]["online"]:
            return time.monotonic() - t0
        time.sleep(0.1)
    raise AssertionError(f"L3 not online after {timeout} s: {c.stats()['l3']}")


def wait_offline(c: Client, timeout: float = 20.0) -> float:
    """Seconds until ``stats`` says the tier is offline (the master found down or hung)."""
    t0 = time.monotonic()
    while c.stats()["l3"]["online"] and time.monotonic() - t0 < timeout:
        time.sleep(0.05)
    assert not c.stats()["l3"]["online"], f"L3 still online after {timeout} s"
    return time.monotonic() - t0


def stopped_soon(d: Any, code: Any, took: float, out: str, what: str, says: str) -> None:
    """A stop (``stop_taking_acks``) with ``what`` hung exited cleanly within 5 s, its log
    saying ``says``."""
    print(f"stopped in {took:.2f} s with {what}")
    assert d.clean_exit(code), (code, out[-2000:])
    assert took < 5, took
    assert says in out, out[-2000:]


def stop_taking_acks(d: Any, c: Client, ops: list[Any]) -> tuple[list[Any], Any, float]:
    """SIGTERM ``d`` and take the acks of ``ops`` as it stops (an engine waits on them
    meanwhile; what a client has not read when the daemon exits is lost with the connection):
    (the acks, unchecked; the exit code; seconds from the signal to the exit)."""
    import signal

    t0 = time.monotonic()
    d.proc.send_signal(signal.SIGTERM)
    acks = [c.wait_ack(op, timeout=10, check=False) for op in ops]
    code = d.stop(timeout=60)
    return acks, code, time.monotonic() - t0


class Worker:
    """A registered client with random tiny device pools."""

    def __init__(self, d, seed: int) -> None:
        self.pools = DevicePools(TINY, ROWS)
        g = torch.Generator().manual_seed(seed)
        for layers in self.pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        self.closed = False
        self.c = d.client(name=f"w{seed}")
        self.c.register(self.pools)
        wait_online(self.c)

    def put(self, keys: list[str], dev: list[int]) -> dict:
        """Device rows ``dev`` -> host -> L3 under ``keys``; returns the put ack's l3 field."""
        c = self.c
        host = c.alloc({s: len(keys) for s in SPACES})
        c.wait_ack(c.backup({s: (dev, host[s]) for s in SPACES}))
        ack = c.wait_ack(c.l3_put(keys, host), timeout=30)
        c.free(host)
        return ack.l3

    def get(self, keys: list[str], dev: list[int], deadline_ms: int = 10_000) -> int:
        """L3 -> host -> device rows ``dev``; returns the pages L3 delivered (and loaded)."""
        c = self.c
        host = c.alloc({s: len(keys) for s in SPACES})
        ack = c.l3_prefetch(keys, host, deadline_ms=deadline_ms, timeout=30)
        n = ack.l3["hits"]
        if n:
            c.wait_ack(c.load({s: (host[s][:n], dev[:n]) for s in SPACES}))
        c.free(host)
        return n

    def page(self, row: int) -> list[torch.Tensor]:
        return [t[row].clone() for name in sorted(self.pools.layers)
                if TINY.pools[name].index in SPACES for t in self.pools.layers[name]]

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        try:
            self.c.unregister(timeout=5)
        except Exception:  # noqa: BLE001 - a killed daemon or a closed client: nothing to undo
            pass
        self.c.close()
        self.pools.close()


def same(a: list[torch.Tensor], b: list[torch.Tensor]) -> bool:
    return len(a) == len(b) and all(torch.equal(x, y) for x, y in zip(a, b))


def metric(c: Client, name: str, **labels: str) -> float:
    for s in c.stats()["metrics"].get(name, []):
        if all(s["labels"].get(k) == v for k, v in labels.items()):
            return s["value"]
    return 0.0


def raw_put(store: l3_master.LocalStore, key: str, value: bytes) -> None:
    """Store ``value`` under ``key`` with Mooncake's own client (a foreign writer)."""
    raw_puts(store, {key: value})


def raw_puts(store: l3_master.LocalStore, items: dict[str, bytes],
             replace: bool = False) -> None:
    """``raw_put`` of several objects, by one foreign client (``put`` keeps an object that
    exists; with ``replace``, ``upsert`` overwrites it)."""
    sizes = [(k, len(v)) for k, v in items.items()]
    call = "upsert" if replace else "put"
    _raw(store, f"""
        data, at, bad = sys.stdin.buffer.read(), 0, 0
        for key, n in {sizes!r}:
            bad += s.{call}(key, data[at:at + n]) != 0
            at += n
        sys.exit(3 if bad else 0)
    """, b"".join(items.values()))


def raw_gets(store: l3_master.LocalStore, keys: list[str]) -> dict[str, bytes | None]:
    """The objects under ``keys`` as a foreign client reads them (None: not there)."""
    out = _raw(store, f"""
        import json
        sizes = [s.get_size(k) for k in {keys!r}]
        print("\\n" + json.dumps([s.get(k).hex() if n >= 0 else None
                                  for k, n in zip({keys!r}, sizes)]))
    """)
    got = json.loads(out.strip().splitlines()[-1])
    return {k: None if v is None else bytes.fromhex(v) for k, v in zip(keys, got)}


def _raw(store: l3_master.LocalStore, body: str, stdin: bytes = b"") -> str:
    """Run ``body`` with ``s``, a Mooncake client of ``store``, in a process of its own."""
    code = textwrap.dedent(f"""
        import sys
        from mooncake.store import MooncakeDistributedStore
        s = MooncakeDistributedStore()
        assert s.setup("127.0.0.1", {store.metadata_url!r}, 0, 16 << 20, "tcp", "",
                       {store.master_addr!r}) == 0
        try:
    """) + textwrap.indent(textwrap.dedent(body), "    ") + "finally:\n    s.close()\n"
    env = {**os.environ, **l3_master.loopback_env()}
    r = subprocess.run([sys.executable, "-c", code], input=stdin, env=env,
                       capture_output=True, timeout=60)
    assert r.returncode == 0, r.stderr.decode()[-800:]
    return r.stdout.decode()


# ----------------------------------------------------------------------------- tests
def test_round_trip_every_pool_and_skip_existing(l3_daemon, worker):
    d = l3_daemon()
    w = worker(d, 1)
    keys = [f"rt-{i}" for i in range(4)]
    src = [1, 3, 4, 6]
    want = [w.page(r) for r in src]
    others = [w.page(r) for r in range(8) if r not in (0, 2, 5, 7)]
    assert w.put(keys, src) == {"written": 4, "skipped": 0, "misses": {}}
    assert w.c.l3_query(keys) == 4
    assert w.c.l3_query(keys[:2] + ["rt-absent"] + keys[3:]) == 2
    got = w.get(keys, [0, 2, 5, 7])
    assert got == 4
    assert all(same(w.page(r), p) for r, p in zip([0, 2, 5, 7], want))  # every pool, every byte
    assert all(same(w.page(r), p) for r, p in zip([1, 3, 4, 6], others))  # nothing else moved
    # the same keys again: nothing written, every key skipped
    assert w.put(keys, src) == {"written": 0, "skipped": 4, "misses": {}}
    assert metric(w.c, "hicache_l3_pages_total", result="skipped_existing") == 4
    assert metric(w.c, "hicache_l3_hit_tokens_total") == 4 * 256
    assert metric(w.c, "hicache_l3_online") == 1
    w.close()
    d.close()


def test_cross_instance_hit_and_restart_recovery(l3_daemon, worker):
    a, b = l3_daemon(), l3_daemon()
    wa, wb = worker(a, 2), worker(b, 3)
    keys = [f"xi-{i}" for i in range(3)]
    want = [wa.page(r) for r in (0, 1, 2)]
    assert wa.put(keys, [0, 1, 2])["written"] == 3
    assert wb.get(keys, [5, 6, 7]) == 3  # B resumes what A computed
    assert all(same(wb.page(r), p) for r, p in zip((5, 6, 7), want))
    wa.c.close()
    a.kill()  # A crashes; its pages live in the store, not in A
    a.start()
    wa2 = worker(a, 4)
    assert wa2.get(keys, [3, 4, 5]) == 3
    assert all(same(wa2.page(r), p) for r, p in zip((3, 4, 5), want))
    wa2.close()
    wb.close()
    a.close()
    b.close()


def test_daemons_of_other_weights_never_read_each_others_pages(l3_daemon, worker):
    """Two daemons of one preset (one layout) whose scopes differ, a base model and its
    fine-tune: the same prompt's page keys are misses across them. Before ``--l3-scope`` the
    second daemon read the first one's KV as verified hits (L3 review); the first one's scope
    still reads them (across daemons of one scope: ``test_cross_instance_hit...``)."""
    base, tuned = l3_daemon(scope="test/base@1"), l3_daemon(scope="test/base-tuned@1")
    wa, wb = worker(base, 2), worker(tuned, 3)
    keys = [f"sc-{i}" for i in range(2)]
    before = [wb.page(r) for r in (5, 6)]
    assert wa.put(keys, [0, 1])["written"] == 2
    assert wb.get(keys, [5, 6]) == 0  # misses: its rows keep what they held
    assert all(same(wb.page(r), p) for r, p in zip((5, 6), before))
    assert wb.put(keys, [2, 3])["written"] == 2  # stored beside the base model's, not skipped
    wb.close()
    wc = worker(base, 4)  # a new worker of the base daemon: its rows come from L3
    assert wc.get(keys, [5, 6]) == 2
    assert all(same(wc.page(r), wa.page(p)) for r, p in zip((5, 6), (0, 1)))
    wa.close()
    wc.close()
    for d in (base, tuned):
        d.close()


def test_a_read_answered_at_its_deadline_counts_no_hit(l3_daemon, worker):
    """A prefetch whose store call outlives its deadline is answered then with 0 hits (a
    deadline miss); when the call returned, its pages were counted hits all the same, so the
    hit-rate panels looked healthy exactly while a slow store made every engine miss (metrics
    review). Mooncake's reads are slowed to 0.8 s here (``tests/fault_daemon.py``)."""
    d = l3_daemon(fault="slow_l3_reads=0.8")
    w = worker(d, 43)
    keys = ["dl-0", "dl-1"]
    assert w.put(keys, [0, 1])["written"] == 2
    hits = metric(w.c, "hicache_l3_pages_total", result="prefetch_hit")
    tokens = metric(w.c, "hicache_l3_hit_tokens_total")
    late = metric(w.c, "hicache_l3_deadline_misses_total", op="prefetch")
    host = w.c.alloc({s: 2 for s in SPACES})
    ack = w.c.l3_prefetch(keys, host, deadline_ms=200, timeout=30)
    assert ack.l3["hits"] == 0 and ack.l3["misses"] == {"deadline": 2}, ack.l3
    assert w.get(keys[:1], [5], deadline_ms=20_000) == 1  # queued behind the slow call
    assert metric(w.c, "hicache_l3_deadline_misses_total", op="prefetch") == late + 2
    assert metric(w.c, "hicache_l3_pages_total", result="prefetch_hit") == hits + 1
    assert metric(w.c, "hicache_l3_hit_tokens_total") == tokens + TINY.model.page_size
    w.c.free(host)


def test_corrupted_and_truncated_objects_are_counted_misses(l3_daemon, worker, store):
    d = l3_daemon()
    w = worker(d, 5)
    ns = l3_format.namespace(TINY, SCOPE)
    n = l3_format.HEADER_BYTES + sum(TINY.row_bytes(s) for s in SPACES)
    w.put(["cx-0"], [0])
    raw_put(store, l3_format.object_key(ns, "cx-1"), os.urandom(n))  # right size, garbage
    raw_put(store, l3_format.object_key(ns, "cx-2"), os.urandom(n // 2))  # truncated
    before = w.page(4)
    assert w.get(["cx-0", "cx-1"], [3, 4]) == 1  # stops at the corrupted page
    assert same(w.page(4), before)  # nothing loaded from it
    assert w.get(["cx-2"], [4]) == 0
    assert same(w.page(4), before)
    assert metric(w.c, "hicache_l3_errors_total", kind="corrupt") == 2
    assert metric(w.c, "hicache_l3_errors_total", kind="transfer") == 0
    # the corrupt objects were removed: the good pages are stored under their keys again
    # (a put skips keys that exist, so they blocked those pages until Mooncake evicted them)
    assert w.put(["cx-1", "cx-2"], [1, 2])["written"] == 2
    assert w.get(["cx-1", "cx-2"], [4, 5]) == 2
    assert same(w.page(4), w.page(1)) and same(w.page(5), w.page(2))
    w.close()
    d.close()


def test_a_read_from_a_dead_storage_node_is_a_transfer_failure_not_corrupt(tmp_path):
    """The storage member holding the objects dies: the reads fail on their way, which said
    nothing about the objects; they were counted (and handled) as corrupt data."""
    own = l3_master.LocalStore(segment="64MB").start()
    try:
        extra = ("--l3", "mooncake", "--l3-master", own.master_addr,
                 "--l3-metadata", own.metadata_url, "--l3-scope", SCOPE)
        d = start_daemon(tmp_path, preset="dsv4-tiny", device_rows=ROWS_FLAG, extra=extra,
                         env=l3_master.loopback_env())
        w = Worker(d, 9)
        try:
            assert w.put(["dm-0", "dm-1"], [0, 1])["written"] == 2
            own.member.kill()  # the node holding the segment dies
            own.member.wait(10)
            before = w.page(4)
            assert w.get(["dm-0", "dm-1"], [4, 5]) == 0
            assert same(w.page(4), before)  # nothing loaded
            assert metric(w.c, "hicache_l3_errors_total", kind="corrupt") == 0
            assert metric(w.c, "hicache_l3_errors_total", kind="transfer") >= 1
        finally:
            w.close()
            d.close()
    finally:
        own.close()


def test_a_failed_prefetch_into_rows_a_backup_wrote_leaves_them_unreadable(l3_daemon, worker,
                                                                           store):
    """The store's read lands in the rows before the checks: a prefetch into rows this client
    had backed up, whose object fails its checks, leaves those rows unreadable (``not_written``),
    never readable with bytes that failed verification (they used to stay "written")."""
    d = l3_daemon()
    w = worker(d, 8)
    c = w.c
    ns = l3_format.namespace(TINY, SCOPE)
    n = l3_format.HEADER_BYTES + sum(TINY.row_bytes(s) for s in SPACES)
    raw_put(store, l3_format.object_key(ns, "fx-bad"), b"\xab" * n)  # right size, forged
    host = c.alloc({s: 1 for s in SPACES})
    assert c.wait_ack(c.backup({s: ([0], host[s]) for s in SPACES})).ok
    ack = c.l3_prefetch(["fx-bad"], host, timeout=30)
    assert ack.l3["hits"] == 0 and ack.l3["misses"] == {"corrupt": 1}, ack.l3
    before = w.page(3)
    with pytest.raises(CommandRefused) as e:
        c.load({s: (host[s], [3]) for s in SPACES})
    assert e.value.code == "not_written", e.value
    assert same(w.page(3), before)
    c.free(host)


def test_a_copy_racing_an_l3_job_on_its_rows_is_refused_busy(l3_daemon, worker, store):
    """L3 jobs run on their own threads, outside the copy streams: with the master stopped
    (SIGSTOP) a put of row H and a prefetch into row G hang. A backup into H (the put would
    publish the new bytes under the old key) and a load from G (half-written) are refused
    ``busy``; a load from H (both read) is not. Once the jobs end, both go through."""
    import signal

    d = l3_daemon()
    w = worker(d, 9)
    c = w.c
    h = c.alloc({s: 1 for s in SPACES})
    g = c.alloc({s: 1 for s in SPACES})
    assert c.wait_ack(c.backup({s: ([0], h[s]) for s in SPACES})).ok
    assert c.wait_ack(c.backup({s: ([1], g[s]) for s in SPACES})).ok
    stop_process(store.master.pid)
    try:
        put = c.l3_put(["race-h"], h)
        r, frames = c._l3_rows(g)  # the prefetch's op without waiting for its ack
        fetch = int(c.call("l3_prefetch", {"keys": ["race-g"], "rows": r,
                                           "deadline_ms": 60_000}, frames)[0]["op"])
        with pytest.raises(CommandRefused) as e:
            c.backup({s: ([2], h[s]) for s in SPACES})
        assert e.value.code == "busy" and "L3 put" in e.value.message, e.value
        assert c.wait_ack(c.load({s: (h[s], [4]) for s in SPACES})).ok  # read beside a read
        assert same(w.page(4), w.page(0))
        with pytest.raises(CommandRefused) as e:
            c.load({s: (g[s], [5]) for s in SPACES})
        assert e.value.code == "busy" and "L3 prefetch" in e.value.message, e.value
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    assert c.wait_ack(put, timeout=60).ok
    c.wait_ack(fetch, timeout=60, check=False)  # a miss (no such object): its rows unreadable
    assert c.wait_ack(c.backup({s: ([2], h[s]) for s in SPACES})).ok
    c.free(h)
    c.free(g)


def test_master_down_then_back(l3_daemon, worker, store):
    d = l3_daemon()
    w = worker(d, 6)
    keys = [f"md-{i}" for i in range(2)]
    assert w.put(keys, [0, 1])["written"] == 2
    errors0 = metric(w.c, "hicache_l3_errors_total", kind="error")
    store.kill_master()
    # every call returns within its timeout; host-tier traffic goes on
    t0 = time.monotonic()
    for _ in range(3):
        w.c.l3_query(keys, timeout=10)
    assert time.monotonic() - t0 < 30
    host = w.c.alloc({"page": 1})
    w.c.wait_ack(w.c.backup({"page": ([2], host["page"])}), timeout=5)
    w.c.wait_ack(w.c.load({"page": (host["page"], [3])}), timeout=5)
    assert torch.equal(w.pools.layers["c4_kv"][0][3], w.pools.layers["c4_kv"][0][2])
    deadline = time.monotonic() + 15
    while w.c.stats()["l3"]["online"] and time.monotonic() < deadline:
        w.c.l3_query(keys, timeout=10)
    assert not w.c.stats()["l3"]["online"]
    assert w.c.l3_query(keys, timeout=2) == 0  # offline: an immediate miss
    # the query that found the master gone counts offline, as a put does: not a surprise
    assert metric(w.c, "hicache_l3_errors_total", kind="error") == errors0
    store.start_master()
    t_back = time.monotonic()
    online = wait_online(w.c, timeout=10)  # within 10 s of the master's return
    # the restarted master lost its objects; writes work again once the storage member has
    # re-mounted its segment (until then they are counted 'full' misses, never errors)
    tries = []
    while time.monotonic() - t_back < 10:
        r = w.put(keys, [0, 1])
        tries.append(r)
        if r["written"] == 2:
            break
        time.sleep(0.25)
    writes = time.monotonic() - t_back
    assert tries[-1]["written"] == 2, tries
    # before the member re-mounted, Mooncake's "no space" (-200) was counted error, not full
    assert all(set(r["misses"]) <= {"full"} for r in tries), tries
    assert metric(w.c, "hicache_l3_errors_total", kind="error") == errors0
    assert w.get(keys, [4, 5]) == 2
    assert same(w.page(4), w.page(0)) and same(w.page(5), w.page(1))  # the pages, byte for byte
    assert metric(w.c, "hicache_l3_transitions_total", to="offline") >= 1
    print(f"L3 online {online:.2f} s, writes stored {writes:.2f} s after the master restarted")
    w.close()
    d.close()


def test_an_idle_daemon_reports_a_dead_master_without_any_l3_call(l3_daemon, worker, store):
    """With no L3 traffic at all, a master that dies takes the tier offline within a few
    seconds (the liveness check): ``hicache_l3_online`` used to stay 1, and ``stats`` said
    online, until the first L3 call, so an alert on it missed an outage of a quiet daemon."""
    d = l3_daemon()
    w = worker(d, 2)
    wait_online(w.c)
    before = metric(w.c, "hicache_l3_transitions_total", to="offline")
    store.kill_master()
    try:
        t0 = time.monotonic()
        while w.c.stats()["l3"]["online"] and time.monotonic() - t0 < 15:
            time.sleep(0.2)  # stats and heartbeats only: no L3 command
        took = time.monotonic() - t0
        assert not w.c.stats()["l3"]["online"] and metric(w.c, "hicache_l3_online") == 0
        assert metric(w.c, "hicache_l3_transitions_total", to="offline") == before + 1
        assert took < 6, took  # LIVENESS_S (2 s) plus the connect check
    finally:
        store.start_master()
    wait_online(w.c)  # and back, as after a call found it down
    w.close()
    d.close()


def test_a_daemon_started_while_the_master_is_down_serves_at_once(l3_daemon, worker, store):
    """Mooncake's setup retries an unreachable master for ~90 s holding the GIL: the daemon
    answered its first heartbeat after ~95 s and then one heartbeat in ~88 s, L1/L2 included,
    and L3 stayed "connecting" (kv keys pending). Now it checks the master first: the daemon
    serves at once, the tier is offline, and it connects when the master comes back."""
    store.kill_master()
    t0 = time.monotonic()
    d = l3_daemon()
    try:
        with d.client(name="early", timeout=5) as c:
            worst = 0.0
            while time.monotonic() - t0 < 6:  # over two connect attempts
                t = time.monotonic()
                c.heartbeat()
                worst = max(worst, time.monotonic() - t)
                time.sleep(0.1)
            l3 = c.stats()["l3"]
            # offline from the start counts as a transition, once (an alert on it fires for a
            # master never reached too), however many connects failed
            down = metric(c, "hicache_l3_transitions_total", to="offline")
            up = metric(c, "hicache_l3_transitions_total", to="online")
        assert worst < 1.0, worst
        assert l3["state"] == "offline" and not l3["online"], l3
        assert (down, up) == (1, 0), (down, up)
    finally:
        store.start_master()
    w = worker(d, 8)  # waits for the tier to come online
    assert metric(w.c, "hicache_l3_transitions_total", to="online") == 1
    store.wait_mounted()  # a restarted master knows the storage member once it mounted again
    keys = [f"late-{i}" for i in range(2)]
    assert w.put(keys, [0, 1])["written"] == 2
    assert w.get(keys, [4, 5]) == 2
    for name, layers in w.pools.layers.items():
        if w.pools.layout.pools[name].index in ("page", "swa_page"):
            for t in layers:
                assert torch.equal(t[4:6], t[0:2]), name


def _worst_heartbeat(c: Client, seconds: float) -> float:
    """The slowest heartbeat round trip over ``seconds`` (one every 50 ms)."""
    worst, t0 = 0.0, time.monotonic()
    while time.monotonic() - t0 < seconds:
        t = time.monotonic()
        c.heartbeat()
        worst = max(worst, time.monotonic() - t)
        time.sleep(0.05)
    return worst


def test_a_wrong_metadata_url_never_stalls_the_daemon(l3_daemon, store):
    """A metadata URL on the right server with the wrong path passed the TCP check, and
    Mooncake's setup then held the GIL ~2 s per attempt, forever: heartbeats took up to 2 s
    (L1/L2 included) and Mooncake logged ~110 lines a second. Now the URL is checked over HTTP
    first: the tier is offline, one line says why, and the daemon answers at once."""
    wrong = store.metadata_url.rsplit("/", 1)[0] + "/foo"
    d = l3_daemon(metadata=wrong)
    with d.client(name="early", timeout=5) as c:
        worst = _worst_heartbeat(c, 4.0)
        l3 = c.stats()["l3"]
    assert worst < 1.0, worst  # (the bugs it guards took 2-30 s)
    assert l3["state"] == "offline" and not l3["online"], l3
    assert f"the metadata URL {wrong} answers 404" in l3["why"], l3  # stats says why
    log = d.output()
    assert f"the metadata URL {wrong} answers 404" in log, log[-2000:]
    assert log.count("answers 404") == 1  # said once, not per attempt
    assert len(log.splitlines()) < 60, log[-3000:]  # no flood of Mooncake's retries


def test_a_hung_master_at_start_never_stalls_the_daemon(l3_daemon, worker, store):
    """A master that accepts connections but answers nothing (SIGSTOP) when the daemon starts:
    Mooncake's setup held the GIL ~30 s, and the daemon, though "ready", answered nothing.
    Now the checks before it (the metadata GET, the set-up in a child) see it hang: the daemon
    answers at once, the tier is offline, and it connects once the master answers again."""
    import signal

    stop_process(store.master.pid)
    try:
        d = l3_daemon()
        with d.client(name="early", timeout=5) as c:
            worst = _worst_heartbeat(c, 4.0)
            l3 = c.stats()["l3"]
        assert worst < 1.0, worst  # (the bugs it guards took 2-30 s)
        assert l3["state"] == "offline" and "does not answer in time" in l3["why"], l3
        assert "does not answer in time" in d.output(), d.output()[-2000:]
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    w = worker(d, 9)  # waits for the tier to come online (the next check, within 10 s)
    assert w.put(["hung-0"], [0])["written"] == 1


def test_the_set_up_check_names_a_failure_a_hang_and_a_stop(store, monkeypatch):
    """``l3_reach.setup_fails``, Mooncake's ``setup`` in a child: a failed set-up is its code
    and Mooncake's last error line; a master that accepts and never answers is killed at the
    check's limit; a stopping daemon kills it at once (it used to outlive the daemon)."""
    import socket
    import threading

    from hicache.controllers import l3_reach
    from hicache.controllers.l3_store import L3Settings

    for k, v in l3_master.loopback_env().items():
        monkeypatch.setenv(k, v)
    wrong = store.metadata_url.rsplit("/", 1)[0] + "/foo"
    started: list[subprocess.Popen] = []

    class Recorded(subprocess.Popen):
        def __init__(self, *a, **kw) -> None:
            super().__init__(*a, **kw)
            started.append(self)

    monkeypatch.setattr(l3_reach.subprocess, "Popen", Recorded)
    why = l3_reach.setup_fails(L3Settings(master=store.master_addr, metadata=wrong))
    assert why is not None and why.startswith("Mooncake's set-up failed (code "), why
    assert l3_reach.setup_fails(L3Settings(master=store.master_addr,
                                           metadata=store.metadata_url)) is None
    # answered as soon as the child printed it; the child, closing its client (~1 s), is
    # reaped on a thread: each set-up child waited for (no zombie, none left running). Only
    # the check's own children count: another test's zombie is not this one's.
    for t in [t for t in threading.enumerate() if t.name == "l3-setup-reaper"]:
        t.join(15)
    checks = [p for p in started if "hicache-setup-rc" in " ".join(p.args)]
    assert len(checks) == 2, [p.args for p in started]
    left = [p.pid for p in checks if p.returncode is None]
    assert not left, f"set-up check children left: {left}"
    hang = socket.socket()
    hang.bind(("127.0.0.1", 0))
    hang.listen(8)
    try:
        monkeypatch.setattr(l3_reach, "SETUP_PROBE_S", 2.0)
        silent = L3Settings(master=f"127.0.0.1:{hang.getsockname()[1]}", metadata="P2PHANDSHAKE")
        t0 = time.monotonic()
        why = l3_reach.setup_fails(silent)
        assert "did not finish within 2 s" in why and time.monotonic() - t0 < 4, why
        stop = threading.Event()
        threading.Timer(0.3, stop.set).start()
        t0 = time.monotonic()
        assert l3_reach.setup_fails(silent, stop) == "the daemon is stopping"
        assert time.monotonic() - t0 < 1.5
    finally:
        hang.close()


def test_a_prefetch_is_acked_at_its_deadline_while_the_master_hangs(l3_daemon, worker,
                                                                   store):
    """A hung master (SIGSTOP) holds a Mooncake call up to its RPC timeout (30 s): the
    prefetch was acked only then, whatever its deadline. Now it is acked at its deadline with 0
    hits; its rows stay busy until the call returns, and nothing read late becomes readable."""
    import signal

    d = l3_daemon()
    w = worker(d, 12)
    assert w.put(["dl-0"], [0])["written"] == 1
    c = w.c
    host = c.alloc({s: 1 for s in SPACES})
    stop_process(store.master.pid)
    try:
        t0 = time.monotonic()
        ack = c.l3_prefetch(["dl-0"], host, deadline_ms=1000, timeout=60)
        took = time.monotonic() - t0
        assert ack.l3 == {"hits": 0, "misses": {"deadline": 1}}, ack.l3
        assert took < 3.0, took
        c.poll_acks([])
        assert c.daemon_in_flight == 1  # the store call still runs: its rows are busy
        with pytest.raises(CommandRefused) as e:
            c.backup({s: ([1], host[s]) for s in SPACES})
        assert e.value.code == "busy"
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while c.poll_acks([]) == [] and c.daemon_in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.daemon_in_flight == 0
    with pytest.raises(CommandRefused) as e:  # what the late call read is not readable
        c.load({s: (host[s], [4]) for s in SPACES})
    assert e.value.code == "not_written"
    c.free(host)
    assert w.get(["dl-0"], [5]) == 1  # the tier serves on
    assert same(w.page(5), w.page(0))
    assert c.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_a_query_is_answered_at_its_deadline_while_the_master_hangs(l3_daemon, worker, store):
    """A query or presence check waited out a hung master's Mooncake call (30 s RPC timeout),
    and the engine's request with it (its tree asks L3 at match time). Now the ack comes at the
    query's deadline: nothing found, ``misses: {deadline: n}``; the tier answers again once
    the master does."""
    import signal

    d = l3_daemon()
    w = worker(d, 12)
    assert w.put(["dq-0"], [0])["written"] == 1
    c = w.c
    stop_process(store.master.pid)
    try:
        t0 = time.monotonic()
        assert c.l3_query(["dq-0"], timeout=60, deadline_ms=800) == 0
        assert c.l3_present(["dq-0", "dq-1"], timeout=60, mirror="full", ckpt=False,
                            deadline_ms=800) == [0, 0]
        took = time.monotonic() - t0
        assert took < 4.0, took
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while c.poll_acks([]) == [] and c.daemon_in_flight and time.monotonic() < deadline:
        time.sleep(0.1)
    assert c.daemon_in_flight == 0  # the late calls ended; their acks were not sent twice
    assert c.poll_acks([]) == []
    assert c.l3_query(["dq-0"], timeout=60) == 1  # the tier serves on
    with pytest.raises(CommandRefused, match="deadline_ms must be in 1..60000"):
        c.l3_query(["dq-0"], timeout=10, deadline_ms=0)
    assert c.call("stats", {"check": True})[0]["invariants"] == "ok"


@pytest.mark.parametrize("port", ["rpc_port", "http_port", "metrics_port", "member_port"])
def test_a_store_whose_port_another_process_took_starts_on_other_ports(port: str) -> None:
    """A free port picked for the master can be another process's by the time it binds (the
    suite's two workers start stores at once). A connect alone then reached that process while
    the master had exited, and a test that hung "the" master (SIGSTOP) hung a process nobody
    used (its query was answered). The store now checks that its own process listens, and
    picks other ports when another one holds any of them (a master that cannot bind its
    metadata or metrics port exits; a member, its own)."""
    import socket

    squatter = socket.socket()
    squatter.bind(("127.0.0.1", 0))
    squatter.listen(8)
    taken = squatter.getsockname()[1]
    s = l3_master.LocalStore(segment="64MB")
    setattr(s, port, taken)
    try:
        s.start()
        assert getattr(s, port) != taken
        assert l3_master._listens(s.master.pid, s.rpc_port)
        assert l3_master._listens(s.member.pid, s.member_port)
        assert s.capacity()  # the member mounted at the master it was given
    finally:
        s.close()
        squatter.close()


def test_a_store_that_fails_to_start_leaves_no_process() -> None:
    """A start that fails for another reason than a taken port (here: no segment mounted in
    time) stops what it started: the master and the member no longer outlived it."""
    s = l3_master.LocalStore(segment="64MB")
    started: list[subprocess.Popen] = []
    real = s._spawn

    def spawn(args: list[str], log: str) -> subprocess.Popen:
        started.append(real(args, log))
        return started[-1]

    def never_mounted(timeout: float = 30.0) -> None:
        raise RuntimeError("no storage segment mounted (this test)")

    s._spawn = spawn  # type: ignore[method-assign]
    s.wait_mounted = never_mounted  # type: ignore[method-assign]
    try:
        with pytest.raises(RuntimeError, match="this test"):
            s.start()
        assert len(started) == 2 and all(p.poll() is not None for p in started), started
        with pytest.raises(ValueError, match="tries must be >= 1"):
            s.start(tries=0)
    finally:
        s.close()


def test_a_master_without_a_mounted_segment_is_reported_not_waited_for() -> None:
    s = l3_master.LocalStore(segment="64MB")
    try:
        s.start_master()
        assert s.capacity() == 0  # a master alone counts no segment
        with pytest.raises(RuntimeError, match="no storage segment mounted"):
            s.wait_mounted(timeout=0.5)
    finally:
        s.close()


def test_no_listener_off_loopback(l3_daemon, worker, store):
    d = l3_daemon()
    w = worker(d, 7)
    w.put(["nl-0"], [0])
    found = l3_master.listeners(store.pids() + [d.pid])
    assert len(found) >= 5, found  # master: rpc, metadata, metrics; member and daemon clients
    assert l3_master.non_loopback(found) == []
    w.close()
    d.close()


def test_l3_refused_without_l3_and_missing_wheel(tmp_path, daemon):
    c = daemon.client()
    with pytest.raises(Exception, match="without an L3 tier"):
        c.l3_query(["k"])
    c.close()
    fake = tmp_path / "fake"
    (fake / "mooncake").mkdir(parents=True)
    (fake / "mooncake" / "__init__.py").write_text("raise ImportError('libibverbs.so.1')\n")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(fake), str(ROOT)])}
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--preset", "dsv4-tiny",
                        "--device-rows", ROWS_FLAG, "--host-ratio", "2", "--socket",
                        f"ipc://{tmp_path}/x.sock", "--l3", "mooncake", "--l3-master",
                        "127.0.0.1:1", "--l3-metadata", "http://127.0.0.1:1/metadata",
                        "--l3-scope", SCOPE],
                       env=env, capture_output=True, text=True, timeout=120)
    assert r.returncode != 0
    err = [ln for ln in r.stderr.splitlines() if ln.strip()]
    assert "pip install 'hicache[l3]'" in err[-1] and "libibverbs1" in err[-1], r.stderr[-500:]
    r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--preset", "dsv4-tiny",
                        "--l3", "mooncake"], env=env, capture_output=True, text=True, timeout=60)
    assert r.returncode != 0 and "--l3-master HOST:PORT" in r.stderr


def test_demo_two_instances_and_bench_l3():
    """``hicache demo --l3 mooncake`` (small): L3 lifts cached tokens, cross-instance and
    after-restart hits exist, every byte verified, listeners on loopback; ``bench l3`` runs
    both sides in one process tree and reports positive rates."""
    run = background_jobs.result("l3_demo")  # (run beside the main suite: conftest)
    assert len(run.steps) == 3, run.notes
    r = run.steps[0]
    assert r.rc == 0, (run.notes, r.err[-1500:])
    out = json.loads(r.out.strip().splitlines()[-1])
    assert out["verified"] and out["l3"]["mismatched_bytes"] == 0
    assert out["l3_hit_tokens"] > 0 and out["cross_instance_hit_tokens"] > 0
    assert out["l3_hit_tokens"] == out["cross_instance_hit_tokens"] + \
        out["restart_hit_tokens"] + out["own_l3_hit_tokens"]
    assert out["l3"]["cached_tokens"] > out["independent"]["cached_tokens"]
    assert out["l3_errors"] == 0, out["l3_error_kinds"]
    assert out["l3_bytes_written"] > 0 and out["l3_bytes_read"] > 0
    assert out["l3"]["listeners"] and all(a.startswith(("127.", "[::ffff:127."))
                                          for a in out["l3"]["listeners"])
    r = run.steps[1]
    assert r.rc == 0, (run.notes, r.err[-1500:])
    b = json.loads(r.out.strip().splitlines()[-1])
    assert all(b[side][k] > 0 for side in ("daemon_gbps", "mooncake_gbps") for k in ("put", "get"))
    # checkpoints mirror, 60 requests: the pages A's drain put into L3 before its restart
    # were counted in no category when hit later (27,392 L3 hit tokens, 26,624 in the three;
    # a review): every L3 hit token is cross-instance, after-restart or the instance's own
    r = run.steps[2]
    assert r.rc == 0, (run.notes, r.err[-1500:])
    out = json.loads(r.out.strip().splitlines()[-1])
    assert out["verified"] and out["mirror"] == "checkpoints" and out["restart_hit_tokens"] > 0
    assert out["l3_hit_tokens"] == out["cross_instance_hit_tokens"] + \
        out["restart_hit_tokens"] + out["own_l3_hit_tokens"], out


def test_a_key_named_twice_in_one_prefetch_reads_both_and_removes_nothing(l3_daemon, worker):
    """One Mooncake batch read fills only the last copy of a key named twice and reports
    success for both: the daemon checked the other copy against bytes never read, found it
    corrupt and force-removed another client's good object (found by a review helper). A
    batch never names a key twice now: both copies are read, in two calls."""
    d = l3_daemon()
    a, b = worker(d, 31), worker(d, 32)
    assert a.put(["dupk-0"], [0])["written"] == 1
    host = b.c.alloc({s: 2 for s in SPACES})
    ack = b.c.l3_prefetch(["dupk-0", "dupk-0"], host, timeout=30)
    assert ack.l3["hits"] == 2 and not ack.l3["misses"], ack.l3
    b.c.free(host)
    assert a.c.l3_query(["dupk-0"]) == 1  # A's object is still in the store
    assert metric(a.c, "hicache_l3_errors_total", kind="corrupt") == 0
    # a put naming a key twice was acked ``written: 2`` for one object (the L3 review); it is
    # refused, nothing written
    host = a.c.alloc({s: 2 for s in SPACES})
    a.c.wait_ack(a.c.backup({s: ([1, 2], host[s]) for s in SPACES}))
    with pytest.raises(CommandRefused, match="names 'dupk-1' twice") as e:
        a.c.l3_put(["dupk-1", "dupk-1"], host)
    assert e.value.code == "bad_field"
    assert a.c.l3_query(["dupk-1"]) == 0
    a.c.free(host)


def test_a_page_key_with_a_trailing_newline_is_refused(l3_daemon, worker):
    """Page keys are 1..128 characters of [A-Za-z0-9_.:-]; a final newline slipped by (a
    regex ``$`` matches before it) and became part of a store key."""
    w = worker(l3_daemon(), 33)
    for bad in ("nlkey\n", "k" * 128 + "\n"):
        with pytest.raises(CommandRefused) as e:
            w.put([bad], [0])
        assert e.value.code == "bad_field"


def test_a_hung_master_is_found_out_in_seconds_and_answered_at_once(l3_daemon, worker, store):
    """A master that hangs (SIGSTOP: it accepts, never answers) held every Mooncake call up to
    the RPC timeout (~30 s) while the tier read online: each engine lookup waited out its own
    deadline, and reads answered at their deadline were counted nowhere. Now a call that runs
    ``HUNG_CALL_S`` makes the daemon probe the master (on a thread of its own): no answer
    within ``PROBE_WAIT_S`` takes the tier offline, later L3 commands are answered at once as
    offline misses, the deadline misses are counted, and the tier comes back with the
    master."""
    import signal

    from hicache.controllers.l3_store import HUNG_CALL_S, LIVENESS_S, PROBE_WAIT_S

    d = l3_daemon()
    w = worker(d, 14)
    assert w.put(["hm-0"], [0])["written"] == 1
    c = w.c
    host = c.alloc({s: 1 for s in SPACES})
    down = metric(c, "hicache_l3_transitions_total", to="offline")
    late = metric(c, "hicache_l3_deadline_misses_total", op="prefetch")
    offline = metric(c, "hicache_l3_errors_total", kind="offline")
    stop_process(store.master.pid)
    try:
        t0 = time.monotonic()
        ack = c.l3_prefetch(["hm-0"], host, deadline_ms=500, timeout=60)  # its call hangs
        assert ack.l3 == {"hits": 0, "misses": {"deadline": 1}}, ack.l3
        assert metric(c, "hicache_l3_deadline_misses_total", op="prefetch") == late + 1
        worst = 0.0
        while c.stats()["l3"]["online"] and time.monotonic() - t0 < 20:
            t = time.monotonic()
            c.heartbeat()  # the loop serves on meanwhile
            worst = max(worst, time.monotonic() - t)
            time.sleep(0.1)
        took = time.monotonic() - t0
        l3 = c.stats()["l3"]
        assert not l3["online"] and "answered no probe" in l3["why"], l3
        print(f"offline {took:.2f} s after the hung call began")
        assert took < HUNG_CALL_S + LIVENESS_S + PROBE_WAIT_S + 1.5, took
        assert worst < 1.0, worst  # (the bugs it guards took 2-30 s)
        assert metric(c, "hicache_l3_online") == 0
        assert metric(c, "hicache_l3_transitions_total", to="offline") == down + 1
        t1 = time.monotonic()  # offline: answered now, not at the deadline nor behind the call
        assert c.l3_query(["hm-0"], timeout=60, deadline_ms=5000) == 0
        assert c.l3_present(["hm-0", "hm-1"], timeout=60, mirror="full", ckpt=False,
                            deadline_ms=5000) == [0, 0]
        assert time.monotonic() - t1 < 2.0, time.monotonic() - t1
        assert metric(c, "hicache_l3_errors_total", kind="offline") == offline + 3
        assert metric(c, "hicache_l3_deadline_misses_total", op="query") == 0
    finally:
        os.kill(store.master.pid, signal.SIGCONT)
    wait_online(c, 60)  # the hung call returns, a probe is answered: online again
    deadline = time.monotonic() + 60
    while c.daemon_in_flight and time.monotonic() < deadline:
        c.poll_acks([])
        time.sleep(0.1)
    assert c.daemon_in_flight == 0
    # the late call's result was neither acked again nor counted again
    assert metric(c, "hicache_l3_deadline_misses_total", op="prefetch") == late + 1
    c.free(host)
    assert w.get(["hm-0"], [5]) == 1  # the tier serves on
    assert same(w.page(5), w.page(0))
    assert c.call("stats", {"check": True})[0]["invariants"] == "ok"


def test_a_hung_storage_node_stalls_its_reads_not_the_lookups_nor_a_stop(l3_daemon, worker,
                                                                          store):
    """A storage node that hangs (SIGSTOP; the master answers) held the prefetch reading from
    it up to Mooncake's own timeout, and every L3 read queued behind it, lookups too, waited out
    its deadline while the tier read online (12 of 12 queries in a row here). Now lookups
    have a worker of their own and are answered; once the call has run ``HUNG_CALL_S`` with the
    master answering, prefetches are answered at once (``stalled``) until it returns; the
    node's return ends the stall and the next prefetch loads every byte; and a stop with the
    node hung exits in about a second, not after its 30 s drain."""
    import signal

    from hicache.controllers.l3_store import HUNG_CALL_S, LIVENESS_S, PROBE_WAIT_S

    d = l3_daemon()
    w = worker(d, 16)
    assert w.put(["hn-0", "hn-1"], [0, 1])["written"] == 2
    c = w.c
    host = c.alloc({s: 3 for s in SPACES})
    one = [{s: host[s][i:i + 1] for s in SPACES} for i in range(3)]
    stalled = metric(c, "hicache_l3_errors_total", kind="stalled")
    stop_process(store.member.pid)
    try:
        t0 = time.monotonic()
        ack = c.l3_prefetch(["hn-0"], one[0], deadline_ms=500, timeout=60)  # its call hangs
        assert ack.l3 == {"hits": 0, "misses": {"deadline": 1}}, ack.l3
        t = time.monotonic()
        assert c.l3_query(["hn-0", "hn-1"], timeout=60, deadline_ms=5000) == 2  # the master's
        assert time.monotonic() - t < 2.0, time.monotonic() - t
        while not c.stats()["l3"]["stalled"] and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        took = time.monotonic() - t0
        l3 = c.stats()["l3"]
        print(f"prefetches stalled {took:.2f} s after the call began")
        assert l3["online"] and "storage node" in l3["stalled"]["read"], l3
        assert took < HUNG_CALL_S + LIVENESS_S + PROBE_WAIT_S + 1.5, took
        assert metric(c, "hicache_l3_stalled", queue="read") == 1
        t = time.monotonic()
        ack = c.l3_prefetch(["hn-1"], one[1], deadline_ms=5000, timeout=60)
        assert ack.l3 == {"hits": 0, "misses": {"stalled": 1}}, ack.l3  # at once
        assert time.monotonic() - t < 2.0, time.monotonic() - t
        assert metric(c, "hicache_l3_errors_total", kind="stalled") == stalled + 1
    finally:
        os.kill(store.member.pid, signal.SIGCONT)
    deadline = time.monotonic() + 60
    while c.stats()["l3"]["stalled"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not c.stats()["l3"]["stalled"] and metric(c, "hicache_l3_stalled", queue="read") == 0
    before = w.page(6)
    ack = c.l3_prefetch(["hn-1"], one[2], deadline_ms=10_000, timeout=30)
    assert ack.l3["hits"] == 1, ack.l3
    c.wait_ack(c.load({s: (one[2][s], [5]) for s in SPACES}))
    assert same(w.page(5), w.page(1)) and same(w.page(6), before)
    assert c.call("stats", {"check": True})[0]["invariants"] == "ok"

    stop_process(store.member.pid)  # again, and stop the daemon meanwhile
    try:
        c.l3_prefetch(["hn-0"], one[1], deadline_ms=500, timeout=60)
        t0 = time.monotonic()
        while not c.stats()["l3"]["stalled"] and time.monotonic() - t0 < 20:
            time.sleep(0.05)
        assert c.stats()["l3"]["stalled"]
        _, code, took = stop_taking_acks(d, c, [])
        out = d.output()
    finally:
        os.kill(store.member.pid, signal.SIGCONT)
    stopped_soon(d, code, took, out, "a storage node hung",
                 "wait on a storage node that does not answer (stalled: read)")


def test_serve_check_says_whether_the_master_and_the_metadata_server_answer(store, tmp_path):
    """``serve --check --l3 mooncake`` checked the settings' form only: a master that cannot be
    reached, or a metadata URL that is not Mooncake's metadata server, passed, and the daemon
    then served with the tier offline. It now says so: one warning naming what does not answer
    (exit 0, as a daemon would still start and retry), or what answers on the check line."""
    from conftest import free_port

    store.wait_mounted()
    host = store.master_addr.rsplit(":", 1)[0]
    base = ("serve", "--device", "cpu", "--preset", "dsv4-tiny", "--device-rows", ROWS_FLAG,
            "--socket", f"ipc://{tmp_path / 'd.sock'}", "--host-ratio", "2", "--l3", "mooncake",
            "--l3-scope", SCOPE, "--check")
    env = dict(os.environ, PYTHONPATH=str(ROOT))

    def check(master: str, metadata: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hicache.cli", *base, "--l3-master", master,
                               "--l3-metadata", metadata], cwd=str(ROOT), env=env,
                              capture_output=True, text=True, timeout=60)

    r = check(store.master_addr, store.metadata_url)
    assert r.returncode == 0 and r.stderr == "", r
    assert f"L3: the master at {store.master_addr} and the metadata server at " \
           f"{store.metadata_url} answer" in r.stdout, r.stdout
    gone = f"{host}:{free_port()}"
    wrong = store.metadata_url.rsplit("/", 1)[0] + "/not-metadata"
    gone_md = f"http://{host}:{free_port()}/metadata"
    for master, metadata, want in ((gone, store.metadata_url, f"the master at {gone} cannot "
                                                              f"be reached"),
                                   (store.master_addr, wrong, "not-metadata"),
                                   # both named, not the first one only (operator review)
                                   (gone, gone_md, f"the master at {gone} cannot be reached "
                                                   f"(Connection refused); the metadata server "
                                                   f"at {gone_md} cannot be reached")):
        r = check(master, metadata)
        assert r.returncode == 0 and "the settings hold" in r.stdout, r
        (line,) = r.stderr.splitlines()
        assert line.startswith("hicache serve: warning: L3: ") and want in line, line
        assert line.endswith("would serve with the L3 tier offline, retrying until it answers")
