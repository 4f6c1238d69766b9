"""PinnedArena on CPU: lifecycle, views, error paths, chunked registration and rollback
(through an injected registrar), NUMA placement decisions on a fake sysfs."""
from __future__ import annotations

import logging
import os
import threading

import pytest
import torch

from hicache.core.errors import UsageError
from hicache.host_pools import arena as arena_mod
from hicache.host_pools import memory as memory_mod
from hicache.host_pools import numa_node
from hicache.host_pools.arena import PAGE, PinnedArena, chunk_plan
from hicache.host_pools.errors import ArenaError, CapacityError

MiB = 1 << 20


class FakeRegistrar:
    """Stands in for CudaHostRegistrar: records calls, fails where told."""

    def __init__(self, fail_at: int | None = None, dev_shift: int = 0,
                 unregister_error: str | None = None) -> None:
        self.device_index = 0
        self.fail_at = fail_at  # 0-based index of the register call that fails
        self.dev_shift = dev_shift  # device pointer = host pointer + shift * (chunk number + 1)
        self.unregister_error = unregister_error
        self.registered: dict[int, int] = {}
        self.calls: list[tuple[str, int, int]] = []

    def register(self, ptr: int, nbytes: int) -> None:
        n = sum(1 for c in self.calls if c[0] == "reg")
        self.calls.append(("reg", ptr, nbytes))
        if n == self.fail_at:
            raise ArenaError("cudaHostRegister failed: error 2 (out of memory)")
        self.registered[ptr] = nbytes

    def unregister(self, ptr: int) -> str | None:
        self.calls.append(("unreg", ptr, self.registered.pop(ptr)))
        return self.unregister_error

    def device_pointer(self, ptr: int) -> int | None:
        order = sorted(self.registered).index(ptr) + 1
        return ptr + self.dev_shift * order

    def can_use_host_pointer(self) -> bool | None:
        return self.dev_shift == 0


def vm_flags(addr: int) -> list[str]:
    """The ``VmFlags`` of this process's mapping that holds ``addr`` (``/proc/self/smaps``)."""
    inside = False
    for line in open("/proc/self/smaps"):
        head = line.split()[0]
        if "-" in head and ":" not in head:
            lo, hi = (int(x, 16) for x in head.split("-"))
            inside = lo <= addr < hi
        elif inside and head == "VmFlags:":
            return line.split()[1:]
    raise AssertionError(f"no mapping holds {addr:#x}")


# ---------------------------------------------------------------------------- lifecycle
def test_open_views_close_twice():
    a = PinnedArena(3 * MiB + 5, None)
    assert a.nbytes == 3 * MiB + 5 and not a.closed
    assert a.stats["mapped_bytes"] == 3 * MiB + PAGE  # page rounding only
    assert a.stats["pinned_bytes"] == 0 and a.stats["registered"] is False
    # unpinned: the kernel's default pages (huge pages are advised for registration only)
    assert a.stats["hugepages"] == "not advised (not pinned)" and "hg" not in vm_flags(a.ptr)
    assert a.ptr % PAGE == 0 and a.device_ptr == a.ptr  # CPU mode: device address = host
    v = a.tensor(4096, 100)
    assert v.dtype == torch.uint8 and v.shape == (100,) and v.data_ptr() == a.ptr + 4096
    v.fill_(7)
    assert a.tensor(4090, 112).tolist() == [0] * 6 + [7] * 100 + [0] * 6
    assert a.tensor(a.nbytes - 1, 1).shape == (1,) and a.tensor(5, 0).numel() == 0
    a.close()
    a.close()  # idempotent
    assert a.closed
    assert v.sum().item() == 700  # a view outlives close as plain host memory


def test_context_manager_and_use_after_close():
    with PinnedArena(MiB, None, progress=False) as a:
        a.tensor(0, 10).fill_(1)
    assert a.closed
    for call in (lambda: a.tensor(0, 1), lambda: a.ptr, lambda: a.device_address(0),
                 lambda: a.device_ptr):
        with pytest.raises(ArenaError, match="closed"):
            call()
    assert "closed" in repr(a)


@pytest.mark.parametrize("off,n", [(-1, 1), (0, -1), (MiB, 1), (MiB - 1, 2), (1.0, 1), (0, True)])
def test_view_out_of_range(off, n):
    with PinnedArena(MiB, None) as a:
        with pytest.raises(ArenaError):
            a.tensor(off, n)
        with pytest.raises(ArenaError):
            a.device_address(MiB)


@pytest.mark.parametrize("bad", [0, -5, 1.5, True, "1MiB", None])
def test_bad_size(bad):
    with pytest.raises(ArenaError, match="positive int"):
        PinnedArena(bad, None)  # type: ignore[arg-type]


@pytest.mark.parametrize("bad", [0, -1, 2.0, True])
def test_bad_touch_threads(bad):
    with pytest.raises(ArenaError, match="touch_threads"):
        PinnedArena(MiB, None, touch_threads=bad)  # type: ignore[arg-type]


def test_refuses_more_than_available():
    import psutil

    avail = psutil.virtual_memory().available
    with pytest.raises(CapacityError, match="available") as e:
        PinnedArena(avail + (1 << 30), None)
    assert isinstance(e.value, UsageError)  # a user-fixable size, reported as one line
    with pytest.raises(CapacityError, match="reserve"):  # the reserve counts too
        PinnedArena(MiB, None, reserve_bytes=avail)


def test_cgroup_limit_counts(tmp_path, monkeypatch):
    assert memory_mod.cgroup_room(str(tmp_path)) is None  # no cgroup files: no limit
    (tmp_path / "memory.max").write_text("max\n")
    (tmp_path / "memory.current").write_text("100\n")
    assert memory_mod.cgroup_room(str(tmp_path)) is None
    (tmp_path / "memory.max").write_text(f"{64 * MiB}\n")
    (tmp_path / "memory.current").write_text(f"{60 * MiB}\n")
    assert memory_mod.cgroup_room(str(tmp_path)) == 4 * MiB
    monkeypatch.setattr(memory_mod, "cgroup_room", lambda: 4 * MiB)
    assert memory_mod.available_bytes() == (4 * MiB, "is left under this container's memory limit")
    with pytest.raises(CapacityError, match="container's memory limit"):
        PinnedArena(8 * MiB, None, reserve_bytes=0)


def test_many_touch_threads_and_progress_callback():
    events: list[tuple[str, int, int]] = []
    with PinnedArena(8 * MiB, None, touch_threads=4,
                     progress=lambda *e: events.append(e)) as a:
        assert a.stats["touch_threads"] == 4
        assert a.stats["seconds"] >= a.stats["touch_s"] >= 0
        assert a.tensor(0, a.nbytes).sum().item() == 0
    assert events[-1] == ("done", 8 * MiB, 8 * MiB)
    assert all(p in ("touch", "done") for p, _, _ in events)


def test_default_threads_scale_with_size():
    small = PinnedArena(MiB, None)
    assert small.stats["touch_threads"] == 1
    small.close()


def test_progress_printed_only_for_large_arenas(capsys, monkeypatch):
    monkeypatch.setattr(arena_mod, "PROGRESS_MIN", 2 * MiB)
    PinnedArena(MiB, None).close()
    assert capsys.readouterr().err == ""
    PinnedArena(2 * MiB, None).close()
    assert "host arena" in capsys.readouterr().err


# ---------------------------------------------------------------------------- chunks
def test_chunk_plan():
    assert chunk_plan(10 * PAGE, 4 * PAGE) == [(0, 4 * PAGE), (4 * PAGE, 4 * PAGE),
                                              (8 * PAGE, 2 * PAGE)]
    # cut at the last hint inside each chunk; unaligned or out-of-range hints are ignored
    plan = chunk_plan(10 * PAGE, 4 * PAGE, [3 * PAGE, 5 * PAGE + 1, 6 * PAGE, 99 * PAGE])
    assert plan == [(0, 3 * PAGE), (3 * PAGE, 3 * PAGE), (6 * PAGE, 4 * PAGE)]
    assert chunk_plan(PAGE, 1 << 40) == [(0, PAGE)]
    assert chunk_plan(8 * PAGE, 3 * PAGE + 7) == [(0, 3 * PAGE), (3 * PAGE, 3 * PAGE),
                                                 (6 * PAGE, 2 * PAGE)]
    with pytest.raises(ArenaError, match="below one page"):
        chunk_plan(PAGE, PAGE - 1)


def test_registration_in_chunks_and_unregister_on_close():
    reg = FakeRegistrar()
    a = PinnedArena(10 * PAGE + 1, None, chunk_bytes=4 * PAGE, registrar=reg,
                    cut_hints=[3 * PAGE])
    ptr = a.ptr
    assert [(p - ptr, n) for _, p, n in reg.calls] == [(0, 3 * PAGE), (3 * PAGE, 4 * PAGE),
                                                      (7 * PAGE, 4 * PAGE)]
    assert a.stats["pinned_bytes"] == 11 * PAGE == a.stats["mapped_bytes"]
    assert a.stats["pinned_bytes"] - a.nbytes < PAGE
    assert a.stats["chunks"] == 3 and a.stats["registered"]
    # MADV_HUGEPAGE asked for (a kernel built without THP refuses it: "refused")
    assert a.stats["hugepages"] in ("advised", "refused", "unsupported")
    assert ("hg" in vm_flags(ptr)) == (a.stats["hugepages"] == "advised")
    assert a.stats["device_ptr_is_host_ptr"] and a.stats["can_use_host_pointer"]
    a.close()
    assert reg.registered == {}
    assert [c[0] for c in reg.calls] == ["reg"] * 3 + ["unreg"] * 3
    assert [c[1] for c in reg.calls[3:]] == [c[1] for c in reg.calls[2::-1]]  # last first
    a.close()
    assert len(reg.calls) == 6


@pytest.mark.parametrize("fail_at", [0, 1, 2])
def test_registration_failure_rolls_back(fail_at):
    reg = FakeRegistrar(fail_at=fail_at)
    with pytest.raises(ArenaError) as e:
        PinnedArena(12 * PAGE, None, chunk_bytes=4 * PAGE, registrar=reg)
    msg = str(e.value)
    assert f"chunk {fail_at + 1}/3" in msg and "error 2 (out of memory)" in msg
    assert f"rolled back {fail_at} registered chunk(s)" in msg
    assert reg.registered == {}  # everything registered was unregistered
    assert sum(c[0] == "unreg" for c in reg.calls) == fail_at


def test_rollback_reports_unregister_errors():
    reg = FakeRegistrar(fail_at=1, unregister_error="error 1 (invalid argument)")
    with pytest.raises(ArenaError, match="rollback errors: .*invalid argument"):
        PinnedArena(8 * PAGE, None, chunk_bytes=4 * PAGE, registrar=reg)


def test_unregister_error_on_close_is_logged(caplog):
    reg = FakeRegistrar(unregister_error="error 1 (invalid argument)")
    a = PinnedArena(4 * PAGE, None, registrar=reg)
    with caplog.at_level(logging.ERROR, logger="hicache.host_pools"):
        a.close()
    assert "invalid argument" in caplog.text and a.closed


def test_device_addresses_follow_chunks_when_they_differ():
    reg = FakeRegistrar(dev_shift=1 << 40)
    with PinnedArena(8 * PAGE, None, chunk_bytes=4 * PAGE, registrar=reg) as a:
        assert a.stats["device_ptr_is_host_ptr"] is False
        assert a.stats["can_use_host_pointer"] is False
        assert a.device_address(0) == a.ptr + (1 << 40)
        assert a.device_address(4 * PAGE + 5) == a.ptr + 4 * PAGE + 5 + (2 << 40)


def test_finalizer_releases_unclosed_arena():
    reg = FakeRegistrar()
    a = PinnedArena(4 * PAGE, None, registrar=reg)
    assert reg.registered
    del a
    import gc

    gc.collect()
    assert reg.registered == {}


# ---------------------------------------------------------------------------- NUMA
def _fake_sysfs(root, nodes: dict[int, str], bus: str | None = None, gpu_node: str = "1",
                free_kb: int = 1 << 30):
    for n, cpus in nodes.items():
        d = root / "devices" / "system" / "node" / f"node{n}"
        d.mkdir(parents=True)
        (d / "cpulist").write_text(cpus + "\n")
        (d / "meminfo").write_text(f"Node {n} MemTotal: {free_kb * 2} kB\n"
                                   f"Node {n} MemFree: {free_kb} kB\n")
    (root / "devices" / "system" / "node" / "online").write_text(
        ",".join(str(n) for n in nodes) + "\n")
    if bus:
        d = root / "bus" / "pci" / "devices" / bus
        d.mkdir(parents=True)
        (d / "numa_node").write_text(gpu_node + "\n")
    return str(root)


def test_parsers():
    assert numa_node.parse_cpulist("0-3,8,10-11\n") == {0, 1, 2, 3, 8, 10, 11}
    assert numa_node.parse_cpulist("") == set()
    assert numa_node.normalize_bus_id("00000000:3B:00.0") == "0000:3b:00.0"


def test_gpu_numa_node_from_sysfs(tmp_path):
    bus = "0000:3b:00.0"
    sysfs = _fake_sysfs(tmp_path, {0: "0", 1: "1"}, bus=bus, gpu_node="1")
    assert numa_node.gpu_numa_node(0, sysfs, bus_id=bus)[0] == 1
    node, why = numa_node.gpu_numa_node(0, sysfs, bus_id="0000:99:00.0")
    assert node is None and "no sysfs numa_node" in why


def test_gpu_numa_node_minus_one(tmp_path):
    bus = "0000:3b:00.0"
    sysfs = _fake_sysfs(tmp_path, {0: "0"}, bus=bus, gpu_node="-1")
    node, why = numa_node.gpu_numa_node(0, sysfs, bus_id=bus)
    assert node is None and "-1" in why


def test_placement_choices(tmp_path, monkeypatch, caplog):
    cpus = ",".join(str(c) for c in sorted(os.sched_getaffinity(0)))
    two = _fake_sysfs(tmp_path / "two", {0: cpus, 1: "4096"})
    one = _fake_sysfs(tmp_path / "one", {0: cpus})
    assert numa_node.plan_placement(None, "auto").policy == "none"
    assert numa_node.plan_placement(0, None).note == "NUMA placement disabled"
    p = numa_node.plan_placement(None, 0, 1, sysfs=one)
    assert p.policy == "none" and "single NUMA node" in p.note
    assert p.cpus == frozenset(os.sched_getaffinity(0))
    with pytest.raises(ArenaError, match="not online"):
        numa_node.plan_placement(None, 5, 1, sysfs=two)
    with pytest.raises(ArenaError, match="'auto', an int or None"):
        numa_node.plan_placement(None, "near", 1, sysfs=two)
    # node 1's CPUs are not ours: threads are not pinned, and the note says so
    monkeypatch.setattr(numa_node, "_numa_module", lambda: None)
    with caplog.at_level(logging.WARNING, logger="hicache.host_pools"):
        p = numa_node.plan_placement(None, 1, 1, sysfs=two)
    assert p.policy == "first-touch" and "not bound" in p.note and "no CPUs" in p.note
    assert "numa module" in caplog.text
    fake = object()
    monkeypatch.setattr(numa_node, "_numa_module", lambda: fake)
    p = numa_node.plan_placement(None, 0, 1 << 20, sysfs=two)
    assert p.policy == "bind" and p.node == 0 and p.numa is fake
    p = numa_node.plan_placement(None, 0, 1 << 50, sysfs=two)  # more than the node has
    assert p.policy == "preferred" and "not bound" in p.note


def test_bind_in_a_thread():
    numa = pytest.importorskip("numa")
    if not numa.available():
        pytest.skip("libnuma not usable here")
    p = numa_node.Placement(0, frozenset(os.sched_getaffinity(0)), "bind", "test", numa)
    seen: list = []

    def work():
        p.enter_thread()
        seen.append(numa.get_membind())

    t = threading.Thread(target=work)
    t.start()
    t.join()
    assert seen == [{0}]


def test_placement_failure_in_thread_is_raised():
    bad = numa_node.Placement(0, frozenset({10**6}), "none", "test")
    with pytest.raises(ArenaError, match="cannot place"):
        arena_mod._touch(torch.zeros(PAGE, dtype=torch.uint8), bad, 1, lambda *a: None)
