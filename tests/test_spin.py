"""Busy-polling on both ends of the wire: the daemon's ``--spin-us`` default per mode, and the
engine client's reply spin (``Client(reply_spin_us=...)``; on a GPU host a sleeping thread's
wake-up costs a LOAD 0.2-0.5 ms, docs/perf.md).

* config: ``spin_us`` unset is 0 in CPU mode and ``GPU_SPIN_US`` in GPU mode; a given value
  wins either way; out of range is refused in one line.
* client: an explicit ``reply_spin_us`` is kept through registration; unset, a CPU-mode
  registration leaves it at 0; a wait with a spin burns CPU for that long, one without sleeps.
"""
from __future__ import annotations

import time

import pytest

from hicache.core.config import GPU_SPIN_US, load_config
from hicache.core.errors import UsageError
from hicache.core.layout import build_layout, preset
from hicache.engine.client import Client
from hicache.engine.device_pools import DevicePools

ROWS = {"page": 4, "swa_page": 4, "req_slot": 2}


def test_daemon_spin_default_follows_the_mode() -> None:
    cpu = load_config({"preset": "dsv4-tiny"}, env={})
    assert cpu.spin_us is None and cpu.server_spin_us == 0.0
    gpu = load_config({"preset": "dsv4-tiny", "device": "cuda:0"}, env={})
    assert gpu.server_spin_us == GPU_SPIN_US == 50_000.0
    assert load_config({"preset": "dsv4-tiny", "device": "cuda:0", "spin_us": 0},
                       env={}).server_spin_us == 0.0
    assert load_config({"preset": "dsv4-tiny"}, env={"HICACHE_SPIN_US": "250"}).server_spin_us \
        == 250.0
    for bad in (-1, 100_001):
        with pytest.raises(UsageError, match="--spin-us must be 0..100000") as e:
            load_config({"preset": "dsv4-tiny", "spin_us": bad}, env={})
        assert "\n" not in str(e.value)


def test_client_reply_spin_setting(shared_daemon) -> None:
    with pytest.raises(ValueError, match="reply_spin_us"):
        Client(shared_daemon.address, reply_spin_us=-1)
    pools = DevicePools(build_layout(preset("dsv4-flash")), ROWS)
    try:
        for given, after in ((None, 0.0), (1500.0, 1500e-6)):
            c = Client(shared_daemon.address, reply_spin_us=given)
            try:
                c.register(pools)
                assert c.reply_spin_us == pytest.approx(after * 1e6)  # CPU: none unless asked
                assert c.stats()["spin_us"] == 0.0  # the CPU-mode daemon sleeps
                c.heartbeat()
                c.unregister()
            finally:
                c.close()
    finally:
        pools.close()


def test_a_reply_wait_spins_then_sleeps(shared_daemon) -> None:
    """Nothing to receive: with a 1 s spin the 1.1 s wait burns CPU, without one it sleeps. (A
    50 ms spin asked for 15 ms of CPU in it: a loaded 2-core VM gives a spinning thread ~20%
    of a core at times, fifty-fourth session's `bench control`; a second of it is ~0.2 s.)"""
    used = {}
    for spin in (1_000_000.0, 0.0):
        c = Client(shared_daemon.address, reply_spin_us=spin)
        try:
            t0 = time.thread_time()
            assert c._recv(1100) is None
            used[spin] = time.thread_time() - t0
        finally:
            c.close()
    assert used[1_000_000.0] > 0.1, used  # ~1 s of CPU unless the VM starves the thread
    assert used[0.0] < 0.05, used
