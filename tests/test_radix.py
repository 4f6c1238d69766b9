"""Radix tree policies, eviction order, locks and failure handling, with fake tier hooks."""
from __future__ import annotations

import random
import re

import pytest

from hicache.engine.hooks import HostExhausted, HostUnavailable, TransferFailed
from hicache.engine.radix import DeviceFull, RadixTree, RowFreeList


class FakeHooks:
    """A host tier in a dict: content moves with the pages, so loads can be checked."""

    def __init__(self, capacity: int = 1000, device: dict | None = None, async_backup=False):
        self.capacity = capacity
        self.free_rows = list(range(capacity))
        self.host: dict[int, object] = {}  # host row -> content
        self.device = {} if device is None else device  # device row -> content
        self.calls: list[tuple] = []
        self.async_backup = async_backup
        self.pending: dict[int, tuple] = {}
        self.next_ticket = 0
        self.fail: str | None = None  # None | "unreachable" | "transfer"

    def _check(self):
        if self.fail == "unreachable":
            raise HostUnavailable("daemon unreachable (fake)")

    def host_alloc(self, n):
        self._check()
        self.calls.append(("alloc", n))
        if n > len(self.free_rows):
            raise HostExhausted(f"{n} > {len(self.free_rows)} free")
        rows, self.free_rows = self.free_rows[:n], self.free_rows[n:]
        return rows

    def host_free(self, handles):
        self._check()
        self.calls.append(("free", list(handles)))
        for h in handles:
            assert h not in self.free_rows, f"double free of host row {h}"
            self.host.pop(h, None)
        self.free_rows.extend(handles)

    def backup(self, rows, handles):
        self._check()
        if self.fail == "transfer":
            raise TransferFailed("fake")
        self.calls.append(("backup", list(rows), list(handles)))
        t = self.next_ticket
        self.next_ticket += 1
        job = lambda: [self.host.__setitem__(h, self.device[r]) for r, h in zip(rows, handles)]
        if self.async_backup:
            self.pending[t] = job
        else:
            job()
        return t

    def load(self, handles, rows):
        self._check()
        if self.fail == "transfer":
            raise TransferFailed("fake")
        self.calls.append(("load", list(handles), list(rows)))
        for h, r in zip(handles, rows):
            self.device[r] = self.host[h]
        t = self.next_ticket
        self.next_ticket += 1
        return t

    def wait(self, ticket):
        self._check()
        job = self.pending.pop(ticket, None)
        if job:
            job()

    def done(self, ticket):
        self._check()
        return ticket not in self.pending

    running = False  # what copies_running answers (a load of unknown outcome still copying)

    def copies_running(self, tickets):
        return self.running

    epoch = 0  # row_epoch: +1 when every host row is given back (a client reset, a restart)

    def row_epoch(self):
        return self.epoch

    def reset(self):
        """What ``client.reset()`` (or a restarted daemon) does: every host row back."""
        self.host.clear()
        self.free_rows = list(range(self.capacity))
        self.epoch += 1

    def finish_all(self):
        for t in list(self.pending):
            self.pending.pop(t)()

    def count(self, verb):
        return sum(len(c[1]) if verb != "alloc" else c[1] for c in self.calls if c[0] == verb)


def run_request(tree: RadixTree, keys, device: dict | None = None, extra_rows=0):
    """prepare -> compute misses (write their content) -> release; returns the prefix."""
    prefix = tree.prepare(keys)
    if device is not None:  # every prefix page must hold its own content now
        for node in prefix.nodes:
            assert device[node.device] == node.key, (node.key, device[node.device])
    rows = tree.alloc_device(len(keys) - prefix.pages + extra_rows)
    if device is not None:
        for k, r in zip(keys[prefix.pages:], rows):
            device[r] = k
    tree.release(prefix, keys, rows[: len(keys) - prefix.pages])
    if extra_rows:
        tree.free_device(rows[len(keys) - prefix.pages:])
    tree.check()
    return prefix


def seq(prefix, n):
    return [f"{prefix}{i}" for i in range(n)]


def test_device_only_hits_and_lru_leaf_first():
    tree = RadixTree(8)
    a = seq("a", 4)
    run_request(tree, a)
    p = run_request(tree, a + seq("b", 2))
    assert (p.device_pages, p.host_pages) == (4, 0)
    # 6 pages on device; a new 4-page request needs 2 evicted: the leaves b1 then b0 go first
    run_request(tree, seq("c", 4))
    assert tree.match(a + seq("b", 2)) == (4, 0)
    assert tree.device_pages == 8
    run_request(tree, seq("d", 2))  # now the oldest leaves are a3, a2 (a is older than c)
    assert tree.match(a) == (2, 0)
    assert tree.match(seq("c", 4)) == (4, 0)
    assert tree.stats.dropped_pages == 4


def test_parent_keeps_device_copy_while_children_have_one():
    tree = RadixTree(6)
    run_request(tree, seq("a", 2) + seq("x", 2))
    run_request(tree, seq("a", 2) + seq("y", 2))  # a0 a1 shared, oldest by insertion
    run_request(tree, seq("z", 2))  # needs 2 rows: must be the x leaves, never a0/a1
    assert tree.match(seq("a", 2) + seq("y", 2)) == (4, 0)
    assert tree.match(seq("a", 2) + seq("x", 2)) == (2, 0)


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_host_tier_hit_loads_the_right_content(policy):
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(8, hooks, policy=policy)
    a = seq("a", 6)
    run_request(tree, a, dev)
    assert hooks.count("backup") == (6 if policy == "write_through" else 0)
    run_request(tree, seq("b", 6), dev)  # evicts a's device copies (backed up first under write_back)
    assert hooks.count("backup") == (12 if policy == "write_through" else 4)
    assert tree.match(a) == (2, 4)
    p = run_request(tree, a + seq("c", 1), dev)
    assert (p.device_pages, p.host_pages) == (2, 4)
    assert [k for k, _ in p.loaded] == a[p.device_pages:]
    assert tree.stats.loaded_pages == p.host_pages


def test_write_back_backs_up_only_on_eviction_and_leaf_first():
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(4, hooks, policy="write_back")
    run_request(tree, seq("a", 4), dev)
    assert hooks.count("backup") == 0
    run_request(tree, seq("b", 2), dev)
    backed = [c for c in hooks.calls if c[0] == "backup"]
    assert len(backed) == 1  # one command for the whole eviction batch, leaves first
    assert [hooks.host[h] for h in backed[0][2]] == ["a3", "a2"]
    assert tree.match(seq("a", 4)) == (2, 2)  # a2, a3 now host-only below a0, a1


def test_selective_backs_up_on_second_use():
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(16, hooks, policy="write_through_selective")
    a = seq("a", 3)
    run_request(tree, a, dev)
    assert hooks.count("backup") == 0
    run_request(tree, a + seq("b", 2), dev)  # second use of a*: backed up; b* used once
    assert hooks.count("backup") == 3
    run_request(tree, a + seq("b", 2), dev)
    assert hooks.count("backup") == 5


def test_running_request_pages_are_never_evicted():
    tree = RadixTree(4)
    keys = seq("a", 3)
    prefix = tree.prepare(keys)
    rows = tree.alloc_device(3)
    tree.release(prefix, keys, rows)
    locked = tree.prepare(keys)  # the running request holds a0..a2
    assert locked.device_pages == 3
    with pytest.raises(DeviceFull):
        tree.alloc_device(2)
    assert tree.device.available() == 1
    got = tree.alloc_device(1)
    tree.free_device(got)
    tree.release(locked, keys, [])
    tree.check()
    rows = tree.alloc_device(4)  # now everything can go
    assert len(rows) == 4 and tree.device_pages == 0


def test_backup_in_flight_pins_pages_until_done():
    dev: dict = {}
    hooks = FakeHooks(async_backup=True, device=dev)
    tree = RadixTree(4, hooks, policy="write_through")
    run_request(tree, seq("a", 4), dev)
    assert hooks.pending and tree.host_pages == 4
    # an eviction has to wait for the in-flight backup, then finds backed-up pages
    run_request(tree, seq("b", 2), dev)
    assert 0 not in hooks.pending
    assert tree.match(seq("a", 4)) == (2, 2)
    tree.check()


def test_host_capacity_lru_and_exhaustion_drop_instead_of_fail():
    dev: dict = {}
    hooks = FakeHooks(capacity=4, device=dev)
    tree = RadixTree(4, hooks, policy="write_through", host_capacity=4)
    for name in "abc":
        run_request(tree, seq(name, 4), dev)
    assert tree.host_pages == 4 and tree.stats.host_evicted_pages == 8
    assert tree.match(seq("c", 4)) == (4, 0)
    assert tree.match(seq("a", 4)) == (0, 0)
    # a daemon that refuses although the tree thinks there is room: the page is dropped
    hooks2 = FakeHooks(capacity=1, device=dev)
    tree2 = RadixTree(4, hooks2, policy="write_back")
    run_request(tree2, seq("a", 3), dev)
    run_request(tree2, seq("b", 3), dev)  # evicts a2, a1, a0; host refuses 3 pages even after LRU
    assert tree2.stats.backup_dropped_pages >= 1
    assert tree2.match(seq("a", 3))[1] <= 1
    tree2.check()


def test_daemon_unreachable_falls_back_to_recompute():
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(4, hooks, policy="write_through")
    run_request(tree, seq("a", 4), dev)
    run_request(tree, seq("b", 4), dev)
    assert tree.match(seq("a", 4)) == (0, 4)
    tree.drain()
    hooks.fail = "unreachable"
    p = run_request(tree, seq("a", 4), dev)  # load fails: recompute, no exception
    assert (p.device_pages, p.host_pages) == (0, 0)
    assert tree.stats.host_offline == 1 and tree.stats.load_failed_pages == 4
    assert not tree.host_online and tree.host_pages == 0
    run_request(tree, seq("c", 4), dev)  # keeps serving device-only, no hook calls
    assert tree.stats.host_offline == 1


def test_daemon_lost_with_backups_in_flight():
    dev: dict = {}
    hooks = FakeHooks(device=dev, async_backup=True)
    tree = RadixTree(4, hooks, policy="write_through")
    run_request(tree, seq("a", 4), dev)
    hooks.fail = "unreachable"
    p = run_request(tree, seq("a", 2) + seq("b", 2), dev)
    assert p.device_pages == 2 and tree.stats.host_offline == 1
    assert tree.host_pages == 0 and not hooks.pending == {}  # nothing waited on forever


def test_transfer_failure_drops_suspect_copies():
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(4, hooks)
    run_request(tree, seq("a", 4), dev)
    run_request(tree, seq("b", 4), dev)
    assert tree.host_pages == 8 and len(hooks.free_rows) == 992
    hooks.fail = "transfer"
    p = run_request(tree, seq("a", 4), dev)
    assert p.host_pages == 0 and tree.stats.transfer_failures >= 1
    assert tree.host_online
    # the host copies of "a" the failed load read are dropped and their rows freed (a load
    # that failed may have read torn rows); "b"'s stay
    a_keys = set(seq("a", 4))
    assert tree.host_pages == 4 and len(hooks.free_rows) == 996
    a_nodes = [n for n in tree.nodes() if n.key in a_keys]
    assert a_nodes and all(n.host is None for n in a_nodes)


@pytest.mark.parametrize("policy", ["write_through", "write_through_selective", "write_back"])
@pytest.mark.parametrize("seed, fault", [(0, None), (1, None), (2, "transfer"), (3, "unreachable")])
def test_random_workload_keeps_invariants_and_content(policy, seed, fault):
    rnd = random.Random(seed)
    dev: dict = {}
    hooks = FakeHooks(capacity=40, device=dev, async_backup=bool(seed % 2))
    tree = RadixTree(RowFreeList(24), hooks, policy=policy, host_capacity=30 + seed)
    shared = [seq(f"s{i}.", rnd.randint(1, 6)) for i in range(4)]
    convs: list[list[str]] = []
    for step in range(150):
        if convs and rnd.random() < 0.6:
            conv = rnd.choice(convs)
        else:
            conv = list(rnd.choice(shared))
            convs.append(conv)
        conv += seq(f"t{step}.", rnd.randint(1, 4))
        keys = conv[: rnd.randint(1, 12)] if len(conv) > 12 else list(conv)
        run_request(tree, keys, dev, extra_rows=rnd.randint(0, 1))
        if rnd.random() < 0.2:
            tree.poll()
        if fault == "transfer":  # a failed transfer now and then
            hooks.fail = "transfer" if rnd.random() < 0.1 else None
        elif fault == "unreachable" and step == 100:
            hooks.fail = "unreachable"
    tree.drain()
    tree.check()
    assert all(n.io == 0 and n.lock == 0 for n in tree.nodes())
    s = tree.stats
    assert s.device_hit_pages > 0
    assert s.host_hit_pages > 0
    if fault == "unreachable":
        assert s.host_offline == 1 and tree.host_pages == 0
    else:
        assert (s.transfer_failures > 0) == (fault == "transfer")
        assert len(hooks.free_rows) + tree.host_pages == hooks.capacity  # no host row leaks


def _late_load_tree(dev: dict) -> tuple:
    """Fake hooks whose loads never get their ack, and a tree whose host hit of 4 pages was
    just loaded that way (recomputed in other rows; the tree went device-only)."""
    from hicache.engine.hooks import CopyOutcomeUnknown

    class AckLost(FakeHooks):
        def wait(self, ticket):
            if self.calls and self.calls[-1][0] == "load":
                raise CopyOutcomeUnknown("op 7 did not complete within 5 s (fake)")
            super().wait(ticket)

    hooks = AckLost(device=dev)
    tree = RadixTree(12, hooks, policy="write_through")
    run_request(tree, seq("a", 4), dev)
    tree.drain()
    assert tree.evict_device(4) == 4
    assert tree.match(seq("a", 4)) == (0, 4)
    p = run_request(tree, seq("a", 4), dev)  # recomputed, in rows the load did not take
    assert p.pages == 0 and not tree.host_online
    return hooks, tree


def test_a_load_whose_ack_timed_out_keeps_its_device_rows_until_the_tier_is_reset():
    """The daemon answered but the load's ack never came: the copy may still be writing its
    device rows, so the tree goes device-only and holds them aside (a recompute takes other
    rows); ``reset_host_tier`` gives them back once the load is over and the host rows the
    tree forgot are given back (refused before: the registration is still live)."""
    dev: dict = {}
    hooks, tree = _late_load_tree(dev)
    held = list(tree.held_device_rows)
    assert len(held) == 4 and held == [c for c in hooks.calls if c[0] == "load"][-1][2]
    assert not set(held) & {n.device for n in tree.nodes() if n.device is not None}
    assert tree.device.available() == 12 - 4 - 4
    hooks.running = True  # the daemon still runs it: nothing changes
    assert tree.reset_host_tier() is False
    assert tree.held_device_rows == held and not tree.host_online and tree.unknown_loads
    hooks.running = False
    # the registration is still live: the host rows the tree forgot are still held, so the
    # reset is refused (nothing changes) until they are given back
    with pytest.raises(ValueError, match="still holds the host rows the tree forgot"):
        tree.reset_host_tier()
    assert tree.held_device_rows == held and not tree.host_online and tree.unknown_loads
    assert len(hooks.free_rows) < hooks.capacity  # the forgotten pages' rows
    hooks.reset()  # client.reset(): every host row back, a new row epoch
    assert tree.reset_host_tier() is True
    assert tree.held_device_rows == [] and tree.device.available() == 12 - 4
    assert tree.host_online and tree.unknown_loads == []
    assert len(hooks.free_rows) + tree.host_pages == hooks.capacity  # no host row leaks
    tree.check()


def test_a_row_epoch_that_moves_under_an_online_tree_forgets_its_host_tier():
    """Every host row of the client given back while no tree call failed (a reap or a restart
    the engine learned of from a heartbeat, a ``client.reset()``): the tree forgets its host
    copies at its next question, instead of loading or freeing rows that may now hold other
    pages (the daemon-level case: ``tests/test_radix_epoch_daemon.py``). A tree that held no
    host row keeps its tier: it takes the new epoch (made before the client registered)."""
    dev: dict = {}
    hooks = FakeHooks(device=dev)
    tree = RadixTree(12, hooks, policy="write_through")
    hooks.epoch += 1  # registered after the tree was made: it held nothing
    run_request(tree, seq("a", 4), dev)
    tree.drain()
    assert tree.host_online and tree.host_pages == 4 and tree.stats.host_offline == 0
    assert tree.evict_device(4) == 4 and tree.match(seq("a", 4)) == (0, 4)
    hooks.reset()  # every host row back; the next pages get the same row ids
    assert tree.match(seq("a", 4)) == (0, 0) and not tree.host_online
    assert tree.stats.host_offline == 1 and tree.host_pages == 0
    assert hooks.calls[-1][0] == "backup"  # nothing loaded or freed since the reset
    assert tree.reset_host_tier() is True and tree.host_online  # nothing forgotten is held
    p = run_request(tree, seq("b", 4), dev)
    tree.drain()
    assert p.pages == 0 and tree.evict_device(4) == 4
    p = run_request(tree, seq("b", 4), dev)  # checks the loaded content is b's
    assert p.pages == 4 and p.host_pages == 4
    assert len(hooks.free_rows) + tree.host_pages == hooks.capacity
    tree.check()


def test_a_tree_over_hooks_that_copy_other_rows_than_its_mirror_is_refused():
    """Hooks that say what they copy (``resume``, as ``ClientHooks`` do) must copy what the
    tree's mirror counts on: a full-mirror tree over checkpoint hooks counted pages whose SWA
    and states were never copied as resumable hits (forty-fifth session's review), and a
    checkpoint's rows (paged SWA ``swa_page`` rows, ring SWA request slots) must agree with
    ``device_ckpts``. Refused when made, and at ``reset_host_tier`` with other hooks."""
    from hicache.core.layout import build_layout, preset
    from hicache.core.resume import ResumeModel

    paged = ResumeModel(build_layout(preset("dsv4-flash"), swa_mode="paged"))
    ring = ResumeModel(build_layout(preset("dsv4-flash"), swa_mode="ring"))

    def saying(resume):
        h = FakeHooks()
        h.resume = resume
        return h

    for hooks, kw, says in (
            (saying(paged), {}, "mirror='full' over hooks that copy checkpoints"),
            (saying(None), {"mirror": "checkpoints"}, "over hooks without a resume model"),
            (saying(paged), {"mirror": "checkpoints", "device_ckpts": False},
             "device_ckpts=False but the hooks' layout keeps a checkpoint in 'swa_page'"),
            (saying(ring), {"mirror": "checkpoints"},
             "device_ckpts=True but the hooks' layout keeps a checkpoint in 'req_slot'")):
        with pytest.raises(ValueError, match=re.escape(says)):
            RadixTree(8, hooks, **kw)
    RadixTree(8, saying(None))  # what they copy agrees: accepted
    RadixTree(8, saying(paged), mirror="checkpoints")
    tree = RadixTree(8, saying(ring), mirror="checkpoints", device_ckpts=False)
    tree.lose_host_tier()
    with pytest.raises(ValueError, match="'swa_page'"):
        tree.reset_host_tier(saying(paged))
    assert not tree.host_online
    assert RadixTree(8, FakeHooks(), mirror="checkpoints")  # hooks that say nothing: trusted


def test_a_reset_through_other_hooks_asks_the_hooks_that_sent_the_load():
    """Loads of unknown outcome are asked about through the hooks that sent them: other hooks
    (another client) know nothing of them, so their answer would hand the held rows back while
    the old load still writes them."""
    dev: dict = {}
    old, tree = _late_load_tree(dev)
    held = list(tree.held_device_rows)
    assert len(held) == 4 and not tree.host_online
    new = FakeHooks(device=dev)  # over another client: it says nothing runs
    old.running = True
    assert tree.reset_host_tier(new) is False
    assert tree.hooks is old and tree.held_device_rows == held and not tree.host_online
    old.running = False
    assert tree.reset_host_tier(new) is True  # other hooks: their rows are their own
    assert tree.hooks is new and tree.host_online and tree.held_device_rows == []
    tree.check()


def test_a_load_command_without_a_reply_holds_its_device_rows():
    """``ClientHooks``: a load command that went out and got no reply (``NoReply``) may have
    been taken, so it is ``CopyOutcomeUnknown`` (rows held), not a plain unreachable daemon
    (rows freed); a command that could not be sent at all stays ``HostUnavailable``."""
    from hicache.engine.acks import DaemonUnreachable, NoReply
    from hicache.engine.hooks import ClientHooks, CopyOutcomeUnknown

    class Mute:
        def __init__(self, exc):
            self.exc = exc

        def load(self, items, timeout=None):
            raise self.exc

    h = ClientHooks(Mute(NoReply("load: no reply from the hicache daemon within 5 s")),
                    ("page",))
    with pytest.raises(CopyOutcomeUnknown):
        h.load([(1,)], [0])
    h = ClientHooks(Mute(DaemonUnreachable("load: cannot reach the hicache daemon")), ("page",))
    with pytest.raises(HostUnavailable) as e:
        h.load([(1,)], [0])
    assert not isinstance(e.value, CopyOutcomeUnknown)


def test_a_daemon_silent_while_an_accepted_copy_runs_is_an_unknown_outcome():
    """``ClientHooks.wait``: the daemon took the op and then stopped answering (a stalled loop:
    ``DaemonUnreachable`` from the ack poll). The copy may still run, so the tree must hold a
    load's rows: ``CopyOutcomeUnknown``, as for an ack timeout."""
    from hicache.engine.acks import DaemonUnreachable, Op
    from hicache.engine.hooks import ClientHooks, CopyOutcomeUnknown, Ticket

    class Stalled:
        def wait_ack(self, op, timeout, check=False):
            raise DaemonUnreachable("poll_acks: no reply from the hicache daemon within 5 s")

    h = ClientHooks(Stalled(), ("page",))
    with pytest.raises(CopyOutcomeUnknown):
        h.wait(Ticket(Op(7, "load"), "load", 4, 0.0))


def test_client_hooks_say_a_load_of_unknown_outcome_runs_until_acked_or_nothing_runs():
    """``ClientHooks.copies_running`` (what ``reset_host_tier`` asks): one ``poll_acks`` for the
    loads' op ids; they may still copy unless each was acked or the daemon holds no operation
    of this client (a restarted daemon, or the old registration's operations all ended). A
    load whose request got no reply (None: op id unknown) counts until nothing runs."""
    from types import SimpleNamespace

    from hicache.engine.hooks import ClientHooks, Ticket

    class Polled:
        def __init__(self, acked, in_flight):
            self.acked, self.daemon_in_flight, self.asked = acked, in_flight, []

        def poll_acks(self, ops, max=1024, timeout=None):
            self.asked.append(list(ops))
            return [SimpleNamespace(op=i) for i in ops if i in self.acked]

    def ticket(op_id):
        return Ticket(SimpleNamespace(op_id=op_id), "load", 1, 0.0)

    for acked, in_flight, tickets, running in (
            ((), 2, [ticket(5)], True), ((5,), 2, [ticket(5)], False),
            ((), 0, [ticket(5)], False), ((5,), 1, [ticket(5), None], True),
            ((5,), 0, [ticket(5), None], False), ((5,), 1, [ticket(5), ticket(6)], True)):
        client = Polled(set(acked), in_flight)
        hooks = ClientHooks(client, ["page"])
        assert hooks.copies_running(tickets) is running, (acked, in_flight, tickets)
        assert client.asked == [[t.op.op_id for t in tickets if t is not None]]


def test_client_hooks_turn_an_unreadable_reply_or_a_closed_socket_into_tier_errors():
    """What the tree understands, so a load's device rows are held or the tier dropped instead
    of an exception the tree never catches leaking them (forty-fifth session's review): a reply
    it cannot read may mean the daemon took the command (outcome unknown); a closed socket
    means no tier."""
    import zmq

    from hicache.core.protocol import ProtocolError
    from hicache.engine.hooks import ClientHooks, CopyOutcomeUnknown

    class Broken:
        registered = {"layout": {"pools": {}}}
        row_epoch = 0

        def __init__(self, exc):
            self.exc = exc

        def load(self, *a, **kw):
            raise self.exc

    for exc, want in ((ProtocolError("bad_version", "daemon speaks protocol 9"),
                       CopyOutcomeUnknown), (zmq.ZMQError(zmq.ENOTSOCK), HostUnavailable)):
        hooks = ClientHooks(Broken(exc), ["page"])
        with pytest.raises(want):
            hooks.load([(1,)], [2])
        dev: dict = {}
        tree_hooks = FakeHooks(device=dev)
        tree = RadixTree(12, tree_hooks, policy="write_through")
        run_request(tree, seq("a", 2), dev)
        tree.drain()
        assert tree.evict_device(2) == 2
        tree_hooks.load = lambda handles, rows: hooks.load([(h,) for h in handles], rows)
        p = tree.prepare(seq("a", 2))  # the tree copes: no exception reaches the engine
        assert p.pages == 0 and not tree.host_online
        assert len(tree.held_device_rows) == (2 if want is CopyOutcomeUnknown else 0)
        tree.check()


def test_full_mirror_hooks_must_cover_every_page_space_of_the_stage():
    """Without a resume model a page handle must mirror every page space the registered stage
    has (its SWA and compress states too); a ring-SWA stage cannot be full-mirrored."""
    from types import SimpleNamespace

    from hicache.engine.hooks import ClientHooks

    paged = SimpleNamespace(registered={"host_rows": {"page": 8, "swa_page": 4, "req_slot": 4}})
    ClientHooks(paged, ["page", "swa_page"])
    with pytest.raises(ValueError, match=r"must cover the page spaces \['page', 'swa_page'\]"):
        ClientHooks(paged, ["page"])
    ring = SimpleNamespace(registered={"host_rows": {"page": 8, "req_slot": 4}})
    with pytest.raises(ValueError, match="ring SWA mode"):
        ClientHooks(ring, ["page"])


def test_full_mirror_hooks_made_before_register_are_checked_at_the_first_allocation():
    """Hooks are naturally made before ``register``: their check used to be skipped then, so
    page-only handles of a paged-SWA stage counted host pages resumable without their SWA
    (found by a review). It runs at the first page allocation, before anything is asked."""
    from types import SimpleNamespace

    from hicache.engine.hooks import ClientHooks

    asked: list = []
    client = SimpleNamespace(registered=None, alloc=lambda *a, **k: asked.append(a))
    hooks = ClientHooks(client, ["page"])  # not registered yet: accepted for now
    client.registered = {"host_rows": {"page": 8, "swa_page": 4, "req_slot": 4}}
    with pytest.raises(ValueError, match=r"must cover the page spaces \['page', 'swa_page'\]"):
        hooks.host_alloc(2)
    assert asked == []
    good = ClientHooks(SimpleNamespace(registered=None, alloc=lambda counts, **k: {
        s: list(range(n)) for s, n in counts.items()}), ["page", "swa_page"])
    good.client.registered = client.registered
    assert good.host_alloc(2) == [(0, 0), (1, 1)]


def test_reset_host_tier_refuses_other_hooks_while_the_tier_is_online():
    """Other hooks while online used to be taken at once, the tree keeping the first hooks'
    host rows: the next load read those row numbers through the new hooks (another client's
    bytes) and the first client's rows were never freed (found by a review)."""
    dev: dict = {}
    a = FakeHooks(capacity=16, device=dev)
    tree = RadixTree(4, a, policy="write_through")
    keys = seq("k", 4)
    run_request(tree, keys, dev)
    tree.drain()
    tree.evict_device(4)
    b = FakeHooks(capacity=16, device=dev)
    with pytest.raises(ValueError, match="online through other hooks"):
        tree.reset_host_tier(b)
    assert tree.hooks is a and tree.match(keys) == (0, 4)  # nothing changed
    tree.lose_host_tier()  # the documented way: forget a's rows, then take b
    assert tree.reset_host_tier(b) and tree.match(keys) == (0, 0)
    tree.check()


def test_a_prefix_is_ended_once_and_released_under_its_own_keys():
    """A second ``abort`` / ``release`` of one prefix drove its pages' locks below zero (a
    later request's pages could then be evicted while it ran); ``release`` with keys that do
    not begin with the prefix's hung new pages under the wrong parent (found by a review).
    Both are refused, nothing changed."""
    t = RadixTree(4)
    run_request(t, seq("a", 2))
    p = t.prepare(seq("a", 2))
    t.abort(p)
    with pytest.raises(ValueError, match="released or aborted already"):
        t.abort(p)
    with pytest.raises(ValueError, match="released or aborted already"):
        t.release(p, seq("a", 2), [])
    assert [n.lock for n in t.nodes()] == [0, 0]
    p = t.prepare(seq("a", 2))
    rows = t.alloc_device(1)
    with pytest.raises(ValueError, match="begin with the prefix's own pages"):
        t.release(p, seq("b", 2) + ["b2"], rows)
    assert [n.lock for n in t.nodes()] == [1, 1] and t.match(seq("b", 3)) == (0, 0)
    t.release(p, seq("a", 2) + ["a2"], rows)
    assert t.match(seq("a", 3)) == (3, 0)
    t.check()


def test_rows_the_engine_frees_or_releases_must_be_its_own():
    """``free_device`` took a cached page's row (handed out again while still a hit) and
    ``release`` a row given twice or never allocated (found by a review); each is refused,
    nothing changed, and ``check`` now sees a page's row on the free list."""
    t = RadixTree(4)
    run_request(t, seq("a", 2))
    cached = sorted(n.device for n in t.nodes())
    with pytest.raises(ValueError, match="belong to cached pages"):
        t.free_device(cached[:1])
    free = t.device.available()
    p = t.prepare(seq("b", 2)[:0])
    with pytest.raises(ValueError, match="name a row twice"):
        t.release(p, seq("b", 2), [t.alloc_device(1)[0]] * 2)
    spare = [r for r in range(4) if r not in cached and t.device.allocated([r])]
    unallocated = [r for r in range(4) if not t.device.allocated([r])]
    with pytest.raises(ValueError, match="not all given by alloc_device"):
        t.release(p, seq("b", 2), spare + unallocated[:1])
    assert sorted(n.device for n in t.nodes()) == cached and t.device.available() == free - 1
    t.release(p, seq("b", 1), spare)
    t.free_device([])
    t.check()
    t.device.free([cached[0]])  # behind the tree's back: check() names it
    with pytest.raises(AssertionError, match="on the free list"):
        t.check()
