"""Fault injection for tests: ``hicache serve`` with one fault, named by ``FAULT_DAEMON`` (not a
``HICACHE_`` name: the daemon refuses those it does not know).

* ``lost_acks``: every ack push is lost (as when a client's queue is full): each ack is only
  retained for ``poll_acks``, marked not pushed.
* ``slow_kv_copy=SECONDS``: every key-store copy (``kv_put`` / ``kv_get``) sleeps that long on
  the server thread first, as a put of gigabytes does on a slow host.
* ``slow_l3_reads=SECONDS``: every Mooncake read (``batch_get_*``, ``batch_is_exist``) sleeps
  that long on its L3 worker first, as against a slow or hung storage node.
* ``slow_cpu_copy=SECONDS``: every CPU copy (one pool's ids of an operation, on the copy
  worker) sleeps that long first, so an operation queued behind it is surely still in flight
  when the test's next command comes.
* ``warm_fails_at_register``: the copy kernels' warm-up for a registering worker's pools
  raises (as a Triton compile error would); the start-up warm-up runs as usual.
* ``slot_after_scan``: the housekeeping pass's scan of the channels finds nothing, so a request
  written to a slot without a wake-up is still unread when that pass reaps its client (a
  request written between the scan and the reap: a window of microseconds, widened to the
  whole pass).
* ``hold_house_on_sigusr1=SECONDS``: after a SIGUSR1 the daemon's next housekeeping pass
  sleeps that long first (once): the loop held off the CPU outside its poll and outside any
  command, as when a SIGSTOP lands mid-step (a stop is not otherwise placed there at will).
* ``hold_gil_on_sigusr1=SECONDS``: a SIGUSR1 starts a thread that holds the GIL for about that
  much of its own CPU time in one C call (a ``sum`` over a ``range`` sized from a timed
  sample), as the load issuer can hold it from the loop: the process runs while the loop waits
  off the CPU. The thread writes ``fault: holding the GIL`` to stderr (the daemon's log) as it
  starts the call, and ``fault: held the GIL <wall> s, <cpu> s on the CPU`` after it (on a busy
  machine the wall time is longer: the thread waited for a CPU part of it).
* ``reap_on_sigusr1``: after a SIGUSR1 the daemon's next silence check finds every client
  silent (once), so the real reap runs at a moment the test picks, under a long heartbeat
  timeout (a short one reaps a test's own client when a loaded machine pauses it).

Run as ``python tests/fault_daemon.py serve ...``; ``faulty(fault, **kw)`` builds the process,
``inject(process, fault)`` turns a built one into it (``conftest.start_daemon(fault=...)``).
"""
from __future__ import annotations

import os
import sys
import time
from typing import Any

FAULT = "FAULT_DAEMON"


def faulty(fault: str, **kw: Any) -> Any:
    """A ``DaemonProcess`` (not started) that runs this file instead of ``hicache.cli``."""
    from hicache.engine.daemon_process import DaemonProcess

    return inject(DaemonProcess(**kw), fault)


def inject(d: Any, fault: str) -> Any:
    """``d`` (a ``DaemonProcess``, not started) made to run this file with ``fault``."""
    assert d.cmd[1:3] == ["-m", "hicache.cli"], d.cmd
    d.cmd[1:3] = [os.path.abspath(__file__)]
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    d.env["PYTHONPATH"] = os.pathsep.join(filter(None, [root, d.env.get("PYTHONPATH")]))
    d.env[FAULT] = fault
    return d


def _install(fault: str) -> None:
    name, _, arg = fault.partition("=")
    if name == "lost_acks":
        from hicache.controllers import server

        def deliver(self: Any, c: Any, ack: dict[str, Any]) -> None:
            reg = self.state.registry
            if reg.clients.get(c.ident) is c:
                reg.retain(c, ack["op"], ack, False)

        server.Server._deliver = deliver
    elif name == "slow_kv_copy":
        from hicache.controllers import kv_store

        real, delay = kv_store._copy, float(arg)

        def slow(*a: Any, **k: Any) -> None:
            time.sleep(delay)
            real(*a, **k)

        kv_store._copy = slow
    elif name == "slow_l3_reads":
        from hicache.controllers import l3_store

        call, pause = l3_store.MooncakeL3._call, float(arg)

        def slow_call(self: Any, fn: Any, *a: Any, **k: Any) -> Any:
            if getattr(fn, "__name__", "").startswith(("batch_get", "batch_is_exist")):
                time.sleep(pause)
            return call(self, fn, *a, **k)

        l3_store.MooncakeL3._call = slow_call
    elif name == "slow_cpu_copy":
        from hicache.controllers import scheduler

        run, hold = scheduler.run_cpu_item, float(arg)

        def slow_item(*a: Any, **k: Any) -> str:
            time.sleep(hold)
            return run(*a, **k)

        scheduler.run_cpu_item = slow_item
    elif name == "warm_fails_at_register":
        from hicache.controllers import handlers

        def broken(*a: Any, **k: Any) -> Any:
            raise RuntimeError("injected: the copy kernels failed to compile")

        handlers.warm_pools = broken
    elif name == "slot_after_scan":
        from hicache.controllers import server

        house = server.Server._housekeeping

        def blind(self: Any, now: float) -> None:
            self._channels = lambda: False  # (an instance attribute hides the method)
            try:
                house(self, now)
            finally:
                del self._channels

        server.Server._housekeeping = blind
    elif name == "hold_house_on_sigusr1":
        import signal

        from hicache.controllers import server

        told: list[bool] = []
        signal.signal(signal.SIGUSR1, lambda *_: told.append(True))
        house = server.Server._housekeeping

        def held(self: Any, now: float) -> None:
            if told:
                told.clear()
                time.sleep(float(arg))
            house(self, now)

        server.Server._housekeeping = held
    elif name == "hold_gil_on_sigusr1":
        import signal
        import threading

        def hold() -> None:
            sample = 1 << 22
            c0 = time.thread_time()
            sum(range(sample))
            n = int(float(arg) / max(time.thread_time() - c0, 1e-6) * sample)
            print("fault: holding the GIL", file=sys.stderr, flush=True)
            t0, c0 = time.perf_counter(), time.thread_time()
            sum(range(n))  # one C call: the GIL is not given up inside it
            print(f"fault: held the GIL {time.perf_counter() - t0:.2f} s, "
                  f"{time.thread_time() - c0:.2f} s on the CPU", file=sys.stderr, flush=True)

        signal.signal(signal.SIGUSR1,
                      lambda *_: threading.Thread(target=hold, daemon=True).start())
    elif name == "reap_on_sigusr1":
        import signal

        from hicache.controllers import registry

        asked: list[bool] = []
        signal.signal(signal.SIGUSR1, lambda *_: asked.append(True))
        silent = registry.Registry.silent

        def all_once(self: Any, now: float, timeout: float) -> list[Any]:
            if asked:
                asked.clear()
                return list(self.clients.values())
            return silent(self, now, timeout)

        registry.Registry.silent = all_once
    else:
        raise SystemExit(f"{FAULT}={fault!r}: no such fault")


if __name__ == "__main__":
    _install(os.environ[FAULT])
    from hicache.cli import main

    sys.exit(main())
