"""Crashed peers for ``hicache bench soak``: clients killed mid-transfer, a daemon killed under
a working radix worker.

* ``crash_clients(runner, n, ...)`` — a victim holds rows with known content; ``n`` times a
  client process (``crash_child``) registers, allocates, streams backups and loads and is
  killed with SIGKILL: the daemon must reap it (rows back, worker gone) within the heartbeat
  timeout + 2 s, and unmap its pools within ``UNMAP_WAIT_S`` after that (its unmapper thread
  runs at a lower priority), and the victim's rows must load back unchanged at the end.
* ``crash_daemon(runner, n, ...)`` — a ``RadixWorker`` (client + ``ClientHooks`` + ``RadixTree``)
  with pages on the host tier; ``n`` times the daemon is killed: every call must fail with
  ``DaemonUnreachable`` within its timeout, the tree falls back to recompute, and after a
  restart the worker registers again and its host tier works.
"""
from __future__ import annotations

import random
import subprocess
import sys
import time
from collections import deque
from typing import Any, Callable

from hicache.core.percentiles import median

CRASH_DEV_ROWS = {"page": 16, "swa_page": 8, "req_slot": 4}
UNMAP_WAIT_S = 5.0  # after the reap, how long the daemon's unmapping may take


def crash_child() -> None:
    """Entry of a client process that is killed on purpose: register, allocate, print
    ``ready <memfd name>``, then stream backups and loads until killed (at most 120 s)."""
    from hicache.engine.client import Client
    from hicache.fuzz.runner import Pattern, ShmBuffers, mix64
    from hicache.core.layout import build_layout, preset

    address, preset_name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layout = build_layout(preset(preset_name))
    dev = {s: n for s, n in CRASH_DEV_ROWS.items() if layout.space_pools(s)}
    bufs = ShmBuffers(layout, dev, tag="crash")
    c = Client(address, timeout=30.0, name="crash")
    c.register(**bufs.register_fields(), fds=bufs.fds())
    rows = c.alloc({s: n // 2 for s, n in dev.items()})
    for s in dev:
        pat = Pattern(layout, [p.name for p in layout.space_pools(s)], seed)
        pat.fill(bufs, list(range(len(rows[s]))), [mix64(seed, r) for r in rows[s]])
    for s in dev:  # rows are readable once a backup into them completed
        c.wait_ack(c.backup({s: (list(range(len(rows[s]))), rows[s])}))
    print("ready", bufs.name, flush=True)
    pending: deque = deque()
    t_end = time.monotonic() + 120
    i = 0
    while time.monotonic() < t_end:
        s = "swa_page" if i % 3 == 0 and "swa_page" in dev else "page"
        d = list(range(len(rows[s])))
        op = c.backup({s: (d, rows[s])}) if i % 2 == 0 else c.load({s: (rows[s], d)})
        pending.append(op)
        if len(pending) > 6:
            c.wait_ack(pending.popleft())
        if i % 10 == 5:
            extra = c.alloc({"page": 1})
            c.free(extra)
        i += 1


def crash_clients(runner: Any, n: int, *, heartbeat_timeout: float, seed: int = 0,
                  preset_name: str = "dsv4-tiny",
                  progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Kill ``n`` busy clients with SIGKILL; see the module docstring. ``runner``: the
    ``DaemonRunner`` (started with that heartbeat timeout)."""
    from hicache.fuzz.runner import Victim, daemon_check
    from hicache.core.layout import build_layout, preset

    layout = build_layout(preset(preset_name))
    rng = random.Random(seed)
    vic = Victim(runner.address, layout, {"page": 8, "swa_page": 4, "req_slot": 2}, seed=seed,
                 share=4, name="crash-victim")
    env = dict(runner.env)
    reclaim: list[float] = []
    leaked: list[int] = []
    still_mapped = 0
    in_flight_at_kill = 0
    failures: list[str] = []
    t_start = time.monotonic()
    try:
        base = daemon_check(vic.client, vic.count)
        if not base["ok"]:
            failures.append(f"before: {base['problems']}")
        for i in range(n):
            child = subprocess.Popen(
                [sys.executable, "-c", "from hicache.bench.soak_crash import crash_child; crash_child()",
                 runner.address, preset_name, str(seed + i)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
            path = None
            try:
                line = _read_line(child, 60.0, vic.heartbeat)
                if not line.startswith("ready "):
                    raise RuntimeError(f"crash client {i} did not start: {line!r} "
                                       f"{child.stderr.read()[-1000:] if child.poll() is not None else ''}")
                path = line.split(None, 1)[1].strip()
                if not runner.maps_path(f"/memfd:{path} "):  # the check after the kill means
                    failures.append(f"crash {i}: the daemon does not map {path} while its "
                                    f"client lives")  # something only if this one holds
                t_wait = time.monotonic() + rng.uniform(0.005, 0.08)
                while time.monotonic() < t_wait:
                    time.sleep(0.002)
                s = vic.client.stats()
                in_flight_at_kill += int(s.get("in_flight", 0) > 0)
                child.kill()
                t_kill = time.monotonic()
                child.wait(10)
            finally:
                if child.poll() is None:
                    child.kill()
                    child.wait(10)
            # the daemon must reap it: its rows freed, its worker and mappings gone
            deadline = t_kill + heartbeat_timeout + 2.0
            took = None
            while time.monotonic() < deadline:
                chk = daemon_check(vic.client, vic.count)
                if chk["ok"] and chk["workers"] == 1:
                    took = time.monotonic() - t_kill
                    break
                time.sleep(0.05)
            chk = daemon_check(vic.client, vic.count)
            extra = sum(v["used"] for v in chk["spaces"].values()) - sum(vic.count.values())
            leaked.append(max(0, extra))
            if took is None:
                failures.append(f"crash {i}: not reaped within {heartbeat_timeout + 2:.1f} s "
                                f"({chk['problems']}, workers {chk['workers']})")
            else:
                reclaim.append(took)
            # the daemon unmaps on a background thread at a lower priority (controllers/
            # background.py): on a busy machine that comes after the reap; a mapping left
            # UNMAP_WAIT_S later is one the daemon kept
            unmap_by = time.monotonic() + UNMAP_WAIT_S
            while path and runner.maps_path(f"/memfd:{path} ") and time.monotonic() < unmap_by:
                vic.client.maybe_heartbeat()  # (the wait may outlast the heartbeat timeout)
                time.sleep(0.05)
            if path and runner.maps_path(f"/memfd:{path} "):
                still_mapped += 1
                failures.append(f"crash {i}: the daemon still maps {path} "
                                f"{UNMAP_WAIT_S:g} s after it reaped the client")
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"{i + 1}/{n} crashed clients reaped")
        corrupted = vic.verify()
        final = daemon_check(vic.client, vic.count)
    finally:
        vic.close()
    return {
        "bench": "crash_clients", "crashes": n, "heartbeat_timeout": heartbeat_timeout,
        "reaped": len(reclaim), "leaked_rows_total": sum(leaked),
        "leaked_rows_max": max(leaked, default=0), "still_mapped": still_mapped,
        "kills_with_ops_in_flight": in_flight_at_kill,
        "reclaim_seconds_p50": round(median(reclaim), 3) if reclaim else None,
        "reclaim_seconds_max": round(max(reclaim), 3) if reclaim else None,
        "victim_rows_corrupted": corrupted, "invariants_ok": bool(final["ok"]),
        "deep_check": final["deep"], "failures": failures[:10],
        "seconds": round(time.monotonic() - t_start, 2),
        "ok": not failures and corrupted == 0 and final["ok"] and sum(leaked) == 0,
    }


def _read_line(proc: subprocess.Popen, timeout: float, tick: Callable[[], None]) -> str:
    """One stdout line of ``proc`` within ``timeout`` s, calling ``tick()`` meanwhile."""
    import selectors

    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    deadline = time.monotonic() + timeout
    try:
        while time.monotonic() < deadline:
            tick()
            if sel.select(0.1):
                return proc.stdout.readline()
            if proc.poll() is not None:
                return proc.stdout.readline()
        return ""
    finally:
        sel.close()


# ============================================================================ crashed daemon
class RadixWorker:
    """A radix tree over ShmBuffers behind ``ClientHooks``: pages hold content keyed by the page
    key; ``request(keys)`` runs one request (loads verified, new pages filled)."""

    def __init__(self, address: str, layout: Any, call_timeout: float, seed: int,
                 pages: int = 8) -> None:
        from hicache.engine.client import Client
        from hicache.fuzz.runner import Pattern, ShmBuffers
        from hicache.engine.hooks import ClientHooks
        from hicache.engine.radix import RadixTree

        self.spaces = [s for s in ("page", "swa_page") if layout.space_pools(s)]
        self.pages = pages
        dev = {s: self.pages for s in self.spaces}
        if layout.space_pools("req_slot"):
            dev["req_slot"] = 2
        self.bufs = ShmBuffers(layout, dev, tag="worker")
        self.patterns = [Pattern(layout, [p.name for p in layout.space_pools(s)], seed)
                         for s in self.spaces]
        self.client = Client(address, timeout=call_timeout, name="worker")
        self.hooks = ClientHooks(self.client, self.spaces, timeout=call_timeout)
        self.tree = RadixTree(self.pages, self.hooks, policy="write_through")
        self.seed = seed
        self.corrupted = 0
        self.verified = 0

    def register(self) -> None:
        self.client.register(**self.bufs.register_fields(), fds=self.bufs.fds())

    def _salts(self, keys: list[Any]) -> list[int]:
        from hicache.fuzz.runner import mix64

        return [mix64(self.seed, hash(k) & 0xFFFFFFFF) for k in keys]

    def request(self, keys: list[Any]) -> Any:
        prefix = self.tree.prepare(keys)
        if prefix.loaded:
            ks, rows = [k for k, _ in prefix.loaded], [r for _, r in prefix.loaded]
            for p in self.patterns:
                bad = p.bad_rows(self.bufs, rows, self._salts(ks))
                self.corrupted += len(bad)
            self.verified += len(rows)
        new = keys[prefix.pages:]
        rows = self.tree.alloc_device(len(new))
        for p in self.patterns:
            p.fill(self.bufs, rows, self._salts(new))
        self.tree.release(prefix, keys, rows)
        self.tree.check()
        return prefix

    def close(self) -> None:
        self.client.close()
        self.bufs.close()


def _unreachable_calls(w: RadixWorker, timeout: float) -> list[tuple[str, float, str]]:
    """Every kind of client call against a dead daemon: (call, seconds, exception name; a
    ``NoReply`` counts as the ``DaemonUnreachable`` it is)."""
    from hicache.engine.client import DaemonUnreachable

    c = w.client
    calls: list[tuple[str, Callable[[], Any]]] = [
        ("heartbeat", c.heartbeat), ("stats", c.stats),
        ("alloc", lambda: c.alloc({"page": 1})), ("free", lambda: c.free({"page": [0]})),
        ("backup", lambda: c.backup({"page": ([0], [0])})),
        ("load", lambda: c.load({"page": ([0], [0])})),
        ("poll_acks", c.poll_acks), ("wait_ack", lambda: c.wait_ack(10**9, timeout)),
        ("unregister", c.unregister),
    ]
    out = []
    for name, fn in calls:
        t = time.monotonic()
        try:
            fn()
            exc = "none"
        except Exception as e:  # noqa: BLE001 - recorded and judged by the caller
            exc = "DaemonUnreachable" if isinstance(e, DaemonUnreachable) else type(e).__name__
        out.append((name, time.monotonic() - t, exc))
    return out


def _push_to_host(w: RadixWorker, tag: str, filler: str, it: int) -> list[tuple]:
    """Compute four pages ``tag``, back them up, then push them off the device with two
    requests of ``filler`` pages: afterwards they are host-tier hits. Returns their keys."""
    keys = [(tag, it, j) for j in range(4)]
    w.request(keys)
    w.tree.drain()
    for j in range(2):
        w.request([(filler, it, j, x) for x in range(4)])
        w.tree.drain()
    return keys


def crash_daemon(runner: Any, n: int, *, call_timeout: float = 1.0, seed: int = 0,
                 preset_name: str = "dsv4-tiny", slack: float = 0.25,
                 progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Kill the daemon ``n`` times under a working radix worker; see the module docstring.
    ``runner`` must not be running yet (it is started, killed and restarted here)."""
    from hicache.core.layout import build_layout, preset

    layout = build_layout(preset(preset_name))
    calls = over = wrong = 0
    worst = 0.0
    fallbacks = reregistered = 0
    radix_seconds: list[float] = []
    failures: list[str] = []
    t_start = time.monotonic()
    runner.start()
    w = RadixWorker(runner.address, layout, call_timeout, seed)
    try:
        w.register()
        for it in range(n):
            # pages on the host tier: A is computed, backed up, then pushed off the device
            a = _push_to_host(w, "a", "b", it)
            if w.tree.match(a)[1] == 0:
                failures.append(f"iteration {it}: no host hit set up")
            runner.kill()
            for name, sec, exc in _unreachable_calls(w, call_timeout):
                calls += 1
                worst = max(worst, sec)
                if sec > call_timeout + slack:
                    over += 1
                    failures.append(f"iteration {it}: {name} took {sec:.2f} s")
                if exc != "DaemonUnreachable":
                    wrong += 1
                    failures.append(f"iteration {it}: {name} raised {exc}")
            t = time.monotonic()
            offline_before = w.tree.stats.host_offline
            p = w.request(a)  # host hit -> load fails -> recompute
            radix_seconds.append(time.monotonic() - t)
            if w.tree.stats.host_offline == offline_before + 1 and p.host_pages == 0:
                fallbacks += 1
            else:
                failures.append(f"iteration {it}: the tree did not fall back "
                                f"(offline {w.tree.stats.host_offline}, host pages {p.host_pages})")
            # restart; the worker notices (heartbeat says not registered) and registers again
            runner.start()
            deadline = time.monotonic() + 30
            h = None
            while time.monotonic() < deadline:
                try:
                    h = w.client.heartbeat()
                    break
                except Exception:  # noqa: BLE001 - not back yet
                    time.sleep(0.05)
            if h is None or h.get("registered"):
                failures.append(f"iteration {it}: restarted daemon answered {h}")
                continue
            w.register()
            if not w.tree.reset_host_tier():  # the restarted daemon never ran the old loads
                failures.append(f"iteration {it}: the host tier was not reset after the restart")
                continue
            before = (w.tree.stats.backed_up_pages, w.tree.stats.loaded_pages)
            c = _push_to_host(w, "c", "d", it)
            w.request(c)  # a host hit again, loaded and verified
            if w.tree.stats.backed_up_pages > before[0] and w.tree.stats.loaded_pages > before[1]:
                reregistered += 1
            else:
                failures.append(f"iteration {it}: host tier idle after re-registering")
            if progress is not None and (it + 1) % 5 == 0:
                progress(f"{it + 1}/{n} daemon crashes survived")
    finally:
        w.close()
        runner.stop()
    return {
        "bench": "crash_daemon", "crashes": n, "call_timeout": call_timeout, "calls": calls,
        "calls_over_timeout": over, "calls_wrong_exception": wrong,
        "max_call_seconds": round(worst, 3), "radix_fallbacks": fallbacks,
        "radix_fallback_seconds_max": round(max(radix_seconds, default=0.0), 3),
        "reregistered": reregistered, "pages_verified": w.verified,
        "corrupted_pages": w.corrupted, "failures": failures[:10],
        "seconds": round(time.monotonic() - t_start, 2),
        "ok": not failures and w.corrupted == 0 and reregistered == n and fallbacks == n,
    }


