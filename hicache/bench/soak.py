"""``hicache bench soak``: sustained load, crashed clients and a crashed daemon (CPU mode).

Three modes, each against its own daemon subprocess on a private ipc socket:

* default — ``--clients N --ops M``: N client processes each run M operations, a random mix of
  ``alloc``, ``backup``, ``load`` and ``free`` (``--window`` operations in flight per client).
  Every backup first fills its device rows with content derived from (client, row, version);
  every load first overwrites its device rows, then checks every loaded row against the content
  its host row was last backed up with. Reported: lost acks (an accepted operation whose ack
  never came), failed operations, corrupted pages, refused commands, the daemon's RSS after
  ``--warmup`` of all operations and at the end (growth in %), ops/s.
* ``--crash-clients N`` — a victim holds rows with known content; N times a client process
  registers, allocates rows, streams backups and loads, and is killed with SIGKILL in the middle.
  Reported per crash: seconds until the daemon reaped it (rows back to the victim's only, its
  worker gone), rows still leaked after the heartbeat timeout + 2 s, whether the daemon still
  maps its shm file; at the end the victim's rows must load back unchanged.
* ``--crash-daemon N`` — a worker (client + ``ClientHooks`` + ``RadixTree``) with pages on the
  host tier; N times the daemon is killed with SIGKILL: every client call must fail with
  ``DaemonUnreachable`` within its timeout, the tree must fall back to recompute, and after a
  restart on the same socket the worker registers again and its host tier works (a backup, an
  eviction and a load of verified content).

``--json`` prints one object (``clients``, ``ops``, ``lost_acks``, ``corrupted_pages``,
``rss_growth_pct``, ``ops_per_s``, ``seconds`` for the default mode). Exit status 0 when the
mode's checks pass.
"""
from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import random
import shutil
import subprocess
import sys
import time
from collections import deque
from typing import Any, Callable, Mapping

SOAK_DAEMON_ROWS = "page=64,swa_page=8,req_slot=4"  # x --host-ratio 4: 256 page rows
SOAK_DEV_ROWS = {"page": 32, "swa_page": 4, "req_slot": 2}  # per client
CRASH_DEV_ROWS = {"page": 16, "swa_page": 8, "req_slot": 4}


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    p.add_argument("--ops", type=int, default=50_000, help="operations per client (default 50000)")
    p.add_argument("--window", type=int, default=4,
                   help="operations in flight per client (default 4)")
    p.add_argument("--unit", default="page",
                   help="what one backup/load moves per row: an index space (all its pools) or "
                        "one pool name (default: space 'page')")
    p.add_argument("--max-rows", type=int, default=4, help="rows per operation, 1..N (default 4)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="fraction of all operations before the first RSS sample (default 0.2)")
    p.add_argument("--crash-clients", type=int, default=0, metavar="N",
                   help="instead: kill N clients with SIGKILL mid-transfer, check reaping")
    p.add_argument("--crash-daemon", type=int, default=0, metavar="N",
                   help="instead: kill the daemon N times, check client timeouts and re-register")
    p.add_argument("--heartbeat-timeout", type=float, default=1.0,
                   help="daemon heartbeat timeout for --crash-clients (default 1 s)")
    p.add_argument("--call-timeout", type=float, default=1.0,
                   help="client call timeout for --crash-daemon (default 1 s)")
    p.add_argument("--preset", default="dsv4-tiny", help="layout (default dsv4-tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ============================================================================ sustained load
def _soak_client(address: str, idx: int, ops: int, seed: int, preset_name: str, unit: str,
                 max_rows: int, window: int, quota: int, counter: Any, go: Any, release: Any,
                 out: Any) -> None:
    """One soak client process (see the module docstring); puts its counters on ``out``.
    SIGTERM or the parent's death end it quietly, its shm file unlinked (``quiet_worker``)."""
    from multiprocessing.util import Finalize

    from hicache.cli.lifecycle import quiet_worker

    quiet_worker(os.getppid())
    from hicache.engine.client import AckTimeout, Client, CommandRefused, DaemonUnreachable
    from hicache.fuzz.runner import Pattern, ShmBuffers, mix64
    from hicache.core.layout import INDEX_SPACES, build_layout, preset

    layout = build_layout(preset(preset_name))
    space = unit if unit in INDEX_SPACES else layout.pool(unit).index
    pools = [p.name for p in layout.space_pools(unit)] if unit in INDEX_SPACES else [unit]
    dev_rows = {s: n for s, n in SOAK_DEV_ROWS.items() if layout.space_pools(s)}
    nd = dev_rows[space]
    bufs = ShmBuffers(layout, dev_rows, tag=f"soak{idx}")
    Finalize(bufs, bufs.close, exitpriority=10)  # runs on SystemExit too
    pattern = Pattern(layout, pools, seed)
    rng = random.Random(mix64(seed, idx))
    st = {"ops": 0, "backups": 0, "loads": 0, "frees": 0, "allocs": 0, "lost_acks": 0,
          "failed_ops": 0, "corrupted_pages": 0, "verified_pages": 0, "refused": 0,
          "unreachable": 0, "first_problem": None}
    held: dict[int, int] = {}  # host row -> salt of the content last backed up into it
    spare: list[int] = []  # host rows allocated, nothing backed up yet
    busy: set[int] = set()  # device rows used by operations in flight
    pending: deque = deque()  # (op, kind, device rows, expected salts)
    version = 0
    c = Client(address, timeout=60.0, name=f"soak{idx}")

    def problem(msg: str) -> None:
        if st["first_problem"] is None:
            st["first_problem"] = f"client {idx} op {st['ops']}: {msg}"

    def complete() -> None:
        op, kind, drows, salts = pending.popleft()
        try:
            ack = c.wait_ack(op, timeout=60.0, check=False)
        except AckTimeout:
            st["lost_acks"] += 1
            problem(f"{kind} op {op.op_id}: no ack within 60 s")
            busy.difference_update(drows)
            return
        if not ack.ok:
            st["failed_ops"] += 1
            problem(f"{kind} op {op.op_id} failed: {ack.error}")
        elif kind == "load":
            bad = pattern.bad_rows(bufs, drows, salts)
            st["verified_pages"] += len(drows)
            if bad:
                st["corrupted_pages"] += len(bad)
                problem(f"load op {op.op_id}: device rows {[drows[j] for j in bad]} differ")
        busy.difference_update(drows)

    def dev_rows_free(k: int) -> list[int]:
        while nd - len(busy) < k and pending:
            complete()
        return rng.sample([r for r in range(nd) if r not in busy], k)

    try:
        c.register(**bufs.register_fields())
        go.wait(120)
        for i in range(ops):
            k = rng.randint(1, max_rows)
            x = rng.random()
            total = len(held) + len(spare)
            try:
                if x < 0.1 and total + k <= quota or total == 0:  # alloc
                    got = c.alloc({space: k})[space]
                    spare.extend(int(r) for r in got)
                    st["allocs"] += 1
                elif x < 0.2 and total:  # free
                    pick = rng.sample(list(held) + spare, min(k, total))
                    c.free({space: pick})
                    for r in pick:
                        held.pop(r, None)
                    spare[:] = [r for r in spare if r not in pick]
                    st["frees"] += 1
                elif x < 0.6 or not held:  # backup into spare rows, else over held rows
                    hosts = spare[:k]
                    del spare[:len(hosts)]
                    if len(hosts) < k and held:
                        hosts += rng.sample([r for r in held if r not in hosts],
                                            min(k - len(hosts), len(held)))
                    drows = dev_rows_free(len(hosts))
                    version += 1
                    salts = [mix64(seed, idx, d, version) for d in drows]
                    pattern.fill(bufs, drows, salts)
                    op = c.backup({unit: (drows, hosts)})
                    for h, s in zip(hosts, salts):
                        held[h] = s
                    busy.update(drows)
                    pending.append((op, "backup", drows, salts))
                    st["backups"] += 1
                else:  # load held rows into device rows, verify on its ack
                    hosts = rng.sample(list(held), min(k, len(held)))
                    drows = dev_rows_free(len(hosts))
                    pattern.scribble(bufs, drows, mix64(seed, idx, 0xDEAD, i))
                    op = c.load({unit: (hosts, drows)})
                    busy.update(drows)
                    pending.append((op, "load", drows, [held[h] for h in hosts]))
                    st["loads"] += 1
            except CommandRefused as e:
                st["refused"] += 1
                problem(str(e))
            except DaemonUnreachable as e:
                st["unreachable"] += 1
                problem(str(e))
                break
            st["ops"] += 1
            while len(pending) > window:
                complete()
            if st["ops"] % 50 == 0:
                with counter.get_lock():
                    counter.value += 50
        while pending:
            complete()
        with counter.get_lock():
            counter.value += st["ops"] % 50
    except Exception as e:  # noqa: BLE001 - report it instead of dying silently
        problem(f"{type(e).__name__}: {e}")
    out.put((idx, st))
    release.wait(300)  # the parent samples the daemon's RSS while every worker is still mapped
    try:
        c.unregister(timeout=10)
    except Exception:  # noqa: BLE001
        pass
    c.close()
    bufs.close()


def run_soak(address: str, clients: int, ops: int, *, seed: int = 0,
             preset_name: str = "dsv4-tiny", unit: str = "page", max_rows: int = 4,
             window: int = 4, warmup: float = 0.1, quota: int = 24,
             rss: Callable[[], int] | None = None,
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sustained-load clients against the daemon at ``address`` (see the module
    docstring); ``rss()`` returns the daemon's RSS in bytes (sampled after ``warmup`` of all
    operations and once every client finished, before they unregister)."""
    ctx = mp.get_context("spawn")
    counter = ctx.Value("q", 0)
    go, release = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    procs = [ctx.Process(target=_soak_client, name=f"soak{i}", daemon=True,
                         args=(address, i, ops, seed, preset_name, unit, max_rows, window, quota,
                               counter, go, release, out)) for i in range(clients)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    total = clients * ops
    rss_warm = rss_end = None
    curve: list[float] = []
    t0 = time.monotonic()
    deadline = t0 + 3600
    try:
        time.sleep(0.2)
        go.set()
        t0 = time.monotonic()
        next_note = t0 + 15
        while len(results) < clients and time.monotonic() < deadline:
            try:
                idx, st = out.get(timeout=0.2)
                results[idx] = st
            except Exception:  # noqa: BLE001 - queue.Empty
                pass
            done = counter.value
            if rss is not None and done >= (len(curve) + 1) * total / 10 and len(curve) < 9:
                curve.append(round(rss() / 2**20, 2))  # RSS at every tenth of the operations
            if rss_warm is None and done >= warmup * total and rss is not None:
                rss_warm = rss()
            if progress is not None and time.monotonic() >= next_note:
                mib = f", daemon RSS {rss() / 2**20:.1f} MiB" if rss is not None else ""
                progress(f"{done}/{total} operations, {done / (time.monotonic() - t0):.0f}/s{mib}")
                next_note += 15
            if len(results) < clients and not any(p.is_alive() for p in procs):
                break
        seconds = time.monotonic() - t0
        if rss is not None:
            rss_end = rss()
            if rss_warm is None:
                rss_warm = rss_end
    except BaseException:  # interrupted: stop the workers now (each unlinks its shm file)
        for p in procs:
            if p.is_alive():
                p.terminate()
        raise
    finally:
        release.set()
        for p in procs:
            p.join(60)
            if p.is_alive():
                p.kill()
    sums: dict[str, Any] = {}
    for st in results.values():
        for k, v in st.items():
            if isinstance(v, int):
                sums[k] = sums.get(k, 0) + v
    problems = [st["first_problem"] for st in results.values() if st.get("first_problem")]
    missing = clients - len(results)
    growth = None
    if rss_warm and rss_end is not None:
        growth = round((rss_end - rss_warm) / rss_warm * 100, 3)
    return {
        "bench": "soak", "clients": clients, "ops": sums.get("ops", 0), "ops_per_client": ops,
        "window": window, "unit": unit, "max_rows": max_rows,
        "backups": sums.get("backups", 0), "loads": sums.get("loads", 0),
        "frees": sums.get("frees", 0), "allocs": sums.get("allocs", 0),
        "lost_acks": sums.get("lost_acks", 0), "failed_ops": sums.get("failed_ops", 0),
        "corrupted_pages": sums.get("corrupted_pages", 0),
        "verified_pages": sums.get("verified_pages", 0), "refused": sums.get("refused", 0),
        "unreachable": sums.get("unreachable", 0), "clients_missing": missing,
        "rss_warm_mib": None if rss_warm is None else round(rss_warm / 2**20, 2),
        "rss_end_mib": None if rss_end is None else round(rss_end / 2**20, 2),
        "rss_growth_pct": growth, "warmup_fraction": warmup,
        "rss_curve_mib": curve + ([round(rss_end / 2**20, 2)] if rss_end is not None else []),
        "seconds": round(seconds, 2), "ops_per_s": round(sums.get("ops", 0) / max(seconds, 1e-9), 1),
        "problems": problems[:8],
    }


# ============================================================================ crashed clients
def crash_child() -> None:
    """Entry of a client process that is killed on purpose: register, allocate, print
    ``ready <shm path>``, then stream backups and loads until killed (at most 120 s)."""
    from hicache.engine.client import Client
    from hicache.fuzz.runner import Pattern, ShmBuffers, mix64
    from hicache.core.layout import build_layout, preset

    address, preset_name, seed = sys.argv[1], sys.argv[2], int(sys.argv[3])
    layout = build_layout(preset(preset_name))
    dev = {s: n for s, n in CRASH_DEV_ROWS.items() if layout.space_pools(s)}
    bufs = ShmBuffers(layout, dev, tag="crash")
    c = Client(address, timeout=30.0, name="crash")
    c.register(**bufs.register_fields())
    rows = c.alloc({s: n // 2 for s, n in dev.items()})
    for s in dev:
        pat = Pattern(layout, [p.name for p in layout.space_pools(s)], seed)
        pat.fill(bufs, list(range(len(rows[s]))), [mix64(seed, r) for r in rows[s]])
    print("ready", bufs.path, flush=True)
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
                [sys.executable, "-c", "from hicache.bench.soak import crash_child; crash_child()",
                 runner.address, preset_name, str(seed + i)],
                stdout=subprocess.PIPE, stderr=subprocess.PIPE, env=env, text=True)
            path = None
            try:
                line = _read_line(child, 60.0, vic.heartbeat)
                if not line.startswith("ready "):
                    raise RuntimeError(f"crash client {i} did not start: {line!r} "
                                       f"{child.stderr.read()[-1000:] if child.poll() is not None else ''}")
                path = line.split(None, 1)[1].strip()
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
            if path and runner.maps_path(path):
                still_mapped += 1
                failures.append(f"crash {i}: the daemon still maps {path}")
            if path:  # a SIGKILLed CPU-mode client cannot unlink its own shm file
                try:
                    os.unlink(path)
                except FileNotFoundError:
                    pass
            if progress is not None and (i + 1) % 10 == 0:
                progress(f"{i + 1}/{n} crashed clients reaped")
        corrupted = vic.verify()
        final = daemon_check(vic.client, vic.count)
    finally:
        vic.close()
    reclaim.sort()
    return {
        "bench": "crash_clients", "crashes": n, "heartbeat_timeout": heartbeat_timeout,
        "reaped": len(reclaim), "leaked_rows_total": sum(leaked),
        "leaked_rows_max": max(leaked, default=0), "still_mapped": still_mapped,
        "kills_with_ops_in_flight": in_flight_at_kill,
        "reclaim_seconds_p50": round(reclaim[len(reclaim) // 2], 3) if reclaim else None,
        "reclaim_seconds_max": round(reclaim[-1], 3) if reclaim else None,
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
        self.client.register(**self.bufs.register_fields())

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
    """Every kind of client call against a dead daemon: (call, seconds, exception name)."""
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
            exc = type(e).__name__
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
            w.tree.reset_host_tier()
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


# ============================================================================ command line
def run(args: argparse.Namespace) -> int:
    from hicache.core.errors import UsageError
    from hicache.fuzz.runner import DaemonRunner, private_address

    if args.crash_clients < 0 or args.crash_daemon < 0 or (args.crash_clients and args.crash_daemon):
        raise UsageError("give at most one of --crash-clients N and --crash-daemon N")
    if args.clients < 1 or args.ops < 1 or args.window < 1 or args.max_rows < 1 \
            or not 0 <= args.warmup < 1:
        raise UsageError("--clients, --ops, --window, --max-rows must be positive; "
                         "--warmup in [0, 1)")
    from hicache.core.layout import INDEX_SPACES, LayoutError, build_layout, preset

    layout = build_layout(preset(args.preset))
    try:
        space = args.unit if args.unit in INDEX_SPACES else layout.pool(args.unit).index
    except LayoutError:
        raise UsageError(f"--unit {args.unit!r} is neither an index space nor a pool of "
                         f"{args.preset}") from None
    if space not in SOAK_DEV_ROWS or not layout.space_pools(space):
        raise UsageError(f"--unit {args.unit!r}: space {space} is not used by {args.preset}")
    host = dict(x.split("=") for x in SOAK_DAEMON_ROWS.split(","))
    quota = int(host[space]) * 4 // args.clients  # --host-ratio 4, shared by the clients
    if quota < args.max_rows:
        raise UsageError(f"{args.clients} clients leave {quota} host rows of {space} each, "
                         f"fewer than --max-rows {args.max_rows}")
    address, tmp = private_address("hcs-")
    log = os.path.join(tmp, "daemon.log")

    def note(msg: str) -> None:
        if not args.json:
            print("  " + msg, file=sys.stderr, flush=True)

    runner = None
    try:
        if args.crash_daemon:
            runner = DaemonRunner(address, preset_name=args.preset, log_path=log)
            rep = crash_daemon(runner, args.crash_daemon, call_timeout=args.call_timeout,
                               seed=args.seed, preset_name=args.preset, progress=note)
        elif args.crash_clients:
            runner = DaemonRunner(address, preset_name=args.preset,
                                  device_rows="page=16,swa_page=8,req_slot=4",
                                  host=("--host-ratio", "2"),
                                  heartbeat_timeout=args.heartbeat_timeout, log_path=log)
            runner.start()
            rep = crash_clients(runner, args.crash_clients,
                                heartbeat_timeout=args.heartbeat_timeout, seed=args.seed,
                                preset_name=args.preset, progress=note)
        else:
            runner = DaemonRunner(address, preset_name=args.preset, device_rows=SOAK_DAEMON_ROWS,
                                  host=("--host-ratio", "4"), heartbeat_timeout=30.0,
                                  log_path=log)
            runner.start()
            rep = run_soak(address, args.clients, args.ops, seed=args.seed,
                           preset_name=args.preset, unit=args.unit, max_rows=args.max_rows,
                           window=args.window, warmup=args.warmup, quota=quota,
                           rss=runner.rss, progress=note)
            rep["ok"] = (rep["lost_acks"] == 0 and rep["corrupted_pages"] == 0
                         and rep["failed_ops"] == 0 and rep["refused"] == 0
                         and rep["clients_missing"] == 0 and rep["unreachable"] == 0
                         and rep["ops"] == args.clients * args.ops
                         and rep["rss_growth_pct"] is not None and rep["rss_growth_pct"] < 1.0)
    finally:
        code = runner.stop() if runner is not None else None
        out = runner.output() if runner is not None else ""
        shutil.rmtree(tmp, ignore_errors=True)
    rep["daemon_tracebacks"] = out.count("Traceback")
    if runner is not None and not args.crash_daemon:
        rep["daemon_exit_code"] = code
    rep["ok"] = bool(rep["ok"]) and rep["daemon_tracebacks"] == 0
    if args.json:
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    _print(rep)
    return 0 if rep["ok"] else 1


def _print(rep: Mapping[str, Any]) -> None:
    b = rep["bench"]
    if b == "soak":
        print(f"hicache bench soak: {rep['clients']} clients x {rep['ops_per_client']} operations "
              f"(window {rep['window']}, unit {rep['unit']}, 1..{rep['max_rows']} rows), CPU mode")
        print(f"  {rep['ops']} operations in {rep['seconds']} s = {rep['ops_per_s']:.0f}/s: "
              f"{rep['backups']} backups, {rep['loads']} loads ({rep['verified_pages']} pages "
              f"verified), {rep['frees']} frees, {rep['allocs']} allocs")
        print(f"  lost acks {rep['lost_acks']}, failed ops {rep['failed_ops']}, corrupted pages "
              f"{rep['corrupted_pages']}, refused {rep['refused']}")
        print(f"  daemon RSS {rep['rss_warm_mib']} MiB after {rep['warmup_fraction']:.0%} -> "
              f"{rep['rss_end_mib']} MiB at the end: {rep['rss_growth_pct']}%")
        print("  RSS at each tenth of the operations (MiB): "
              + " ".join(str(x) for x in rep["rss_curve_mib"]))
    elif b == "crash_clients":
        print(f"hicache bench soak --crash-clients: {rep['crashes']} clients killed (SIGKILL) "
              f"mid-stream, heartbeat timeout {rep['heartbeat_timeout']} s")
        print(f"  reaped {rep['reaped']}, reclaim p50 {rep['reclaim_seconds_p50']} s max "
              f"{rep['reclaim_seconds_max']} s; leaked rows {rep['leaked_rows_total']}; "
              f"mappings left {rep['still_mapped']}; kills with ops in flight "
              f"{rep['kills_with_ops_in_flight']}")
        print(f"  victim rows corrupted {rep['victim_rows_corrupted']}; invariants ok "
              f"{rep['invariants_ok']} (allocator check {rep['deep_check']})")
    else:
        print(f"hicache bench soak --crash-daemon: daemon killed {rep['crashes']} times "
              f"(SIGKILL), client call timeout {rep['call_timeout']} s")
        print(f"  {rep['calls']} calls to the dead daemon: slowest {rep['max_call_seconds']} s, "
              f"over timeout {rep['calls_over_timeout']}, other exceptions "
              f"{rep['calls_wrong_exception']}")
        print(f"  radix fallbacks to recompute {rep['radix_fallbacks']} (slowest "
              f"{rep['radix_fallback_seconds_max']} s); re-registered and working again "
              f"{rep['reregistered']}; pages verified {rep['pages_verified']}, corrupted "
              f"{rep['corrupted_pages']}")
    for p in rep.get("failures", []) or rep.get("problems", []):
        print(f"  PROBLEM: {p}")
    print(f"  daemon tracebacks {rep['daemon_tracebacks']}; {'PASS' if rep['ok'] else 'FAIL'}")
