"""Sustained load for ``hicache bench soak``: client processes, their counters, the daemon's RSS.

``run_soak(address, clients, ops, ...)`` starts ``clients`` processes (spawned) that each run
``ops`` operations against the daemon and report their counters; the daemon's RSS is sampled
after ``warmup`` of all operations, at every tenth and at the end. The clock (``seconds``,
``ops_per_s``) starts once every client has set up and registered (``client_setup_s``); a
progress line (operations, ops/s, daemon RSS) every ``PROGRESS_S``. Two mixes:

* ``mix="page"`` (``_soak_client`` driving ``_PageClient``): ``alloc`` / ``backup`` / ``load`` /
  ``free`` of 1..``max_rows`` rows of one unit (an index space or one pool), every load checked
  against the content its host rows were last backed up with;
* ``mix="all"`` (``_mix_client`` driving ``soak_mix.MixClient``): rows of the page and SWA
  spaces from 1 row to 512 pages, token ids of every token-granular pool, request-state swaps,
  every loaded byte checked; ``device`` picks shared memory or CUDA device pools.
"""
from __future__ import annotations

import multiprocessing as mp
import os
import random
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Mapping

SOAK_DAEMON_ROWS = "page=64,swa_page=8,req_slot=4"  # x --host-ratio 4: 256 page rows
SOAK_DEV_ROWS = {"page": 32, "swa_page": 4, "req_slot": 2}  # per client
SETUP_TIMEOUT_S = 300.0  # clients importing torch and opening CUDA on a busy machine
PROGRESS_S = 10.0  # a progress line at least this often


class _PageClient:
    """State and operations of one ``--mix page`` soak client (see the module docstring)."""

    def __init__(self, address: str, idx: int, seed: int, unit: str, space: str, nd: int,
                 bufs: Any, pattern: Any) -> None:
        """Its counters and empty row books; then its daemon connection."""
        from hicache.engine.client import Client
        from hicache.fuzz.runner import mix64

        self.idx, self.seed, self.unit, self.space, self.nd = idx, seed, unit, space, nd
        self.bufs, self.pattern, self.mix64 = bufs, pattern, mix64
        self.rng = random.Random(mix64(seed, idx))
        self.st: dict[str, Any] = {
            "ops": 0, "backups": 0, "loads": 0, "frees": 0, "allocs": 0, "lost_acks": 0,
            "failed_ops": 0, "corrupted_pages": 0, "verified_pages": 0, "refused": 0,
            "unreachable": 0, "first_problem": None}
        self.held: dict[int, int] = {}  # host row -> salt of the content last backed up into it
        # held rows a backup into which was acked (loads read only these)
        self.readable: set[int] = set()
        self.spare: list[int] = []  # host rows allocated, nothing backed up yet
        self.busy: set[int] = set()  # device rows used by operations in flight
        self.pending: deque = deque()  # (op, kind, device rows, expected salts)
        self.version = 0
        self.c = Client(address, timeout=60.0, name=f"soak{idx}")

    def problem(self, msg: str) -> None:
        """Remember the client's first problem (the counters count them all)."""
        if self.st["first_problem"] is None:
            self.st["first_problem"] = f"client {self.idx} op {self.st['ops']}: {msg}"

    def complete(self) -> None:
        """Wait for the oldest operation in flight's ack; a load's rows are checked on it."""
        from hicache.engine.client import AckTimeout

        st = self.st
        op, kind, drows, salts = self.pending.popleft()
        try:
            ack = self.c.wait_ack(op, timeout=60.0, check=False)
        except AckTimeout:
            st["lost_acks"] += 1
            self.problem(f"{kind} op {op.op_id}: no ack within 60 s")
            self.busy.difference_update(drows)
            return
        if not ack.ok:
            st["failed_ops"] += 1
            self.problem(f"{kind} op {op.op_id} failed: {ack.error}")
        elif kind == "backup":  # readable now, unless freed (or rewritten) meanwhile
            self.readable.update(h for h, salt in salts if self.held.get(h) == salt)
        elif kind == "load":
            bad = self.pattern.bad_rows(self.bufs, drows, salts)
            st["verified_pages"] += len(drows)
            if bad:
                st["corrupted_pages"] += len(bad)
                self.problem(f"load op {op.op_id}: device rows {[drows[j] for j in bad]} differ")
        self.busy.difference_update(drows)

    def dev_rows_free(self, k: int) -> list[int]:
        """``k`` device rows no operation in flight uses (completing operations until so)."""
        while self.nd - len(self.busy) < k and self.pending:
            self.complete()
        return self.rng.sample([r for r in range(self.nd) if r not in self.busy], k)

    def step(self, i: int, max_rows: int, quota: int) -> None:
        """Operation ``i``: an alloc, free, backup or load of 1..``max_rows`` rows."""
        k = self.rng.randint(1, max_rows)
        x = self.rng.random()
        total = len(self.held) + len(self.spare)
        if x < 0.1 and total + k <= quota or total == 0:  # alloc
            got = self.c.alloc({self.space: k})[self.space]
            self.spare.extend(int(r) for r in got)
            self.st["allocs"] += 1
        elif x < 0.2 and total:  # free
            pick = self.rng.sample(list(self.held) + self.spare, min(k, total))
            self.c.free({self.space: pick})
            for r in pick:
                self.held.pop(r, None)
                self.readable.discard(r)
            self.spare[:] = [r for r in self.spare if r not in pick]
            self.st["frees"] += 1
        elif x < 0.6 or not self.readable:  # backup into spare rows, else over held rows
            self.backup(k)
        else:  # load held rows into device rows, verify on its ack
            self.load(k, i)

    def backup(self, k: int) -> None:
        """Back up fresh content into ``k`` host rows: spare ones first, else held ones."""
        hosts = self.spare[:k]
        del self.spare[:len(hosts)]
        if len(hosts) < k and self.held:
            hosts += self.rng.sample([r for r in self.held if r not in hosts],
                                     min(k - len(hosts), len(self.held)))
        drows = self.dev_rows_free(len(hosts))
        self.version += 1
        salts = [self.mix64(self.seed, self.idx, d, self.version) for d in drows]
        self.pattern.fill(self.bufs, drows, salts)
        op = self.c.backup({self.unit: (drows, hosts)})
        for h, s in zip(hosts, salts):
            self.held[h] = s
        self.busy.update(drows)
        self.pending.append((op, "backup", drows, list(zip(hosts, salts))))
        self.st["backups"] += 1

    def load(self, k: int, i: int) -> None:
        """Load up to ``k`` readable host rows into scribbled device rows (checked on the ack)."""
        hosts = self.rng.sample(sorted(self.readable), min(k, len(self.readable)))
        drows = self.dev_rows_free(len(hosts))
        self.pattern.scribble(self.bufs, drows, self.mix64(self.seed, self.idx, 0xDEAD, i))
        op = self.c.load({self.unit: (hosts, drows)})
        self.busy.update(drows)
        self.pending.append((op, "load", drows, [self.held[h] for h in hosts]))
        self.st["loads"] += 1


def _run_ops(client: Any, step: Callable[[int], None], ops: int, window: int, counter: Any,
             bad: Any) -> None:
    """A client's operation loop: ``step(i)`` ``ops`` times (at most ``window`` in flight),
    counters published every 50; ends with every operation in flight completed."""
    from hicache.engine.client import CommandRefused, DaemonUnreachable

    st = client.st
    for i in range(ops):
        try:
            step(i)
        except CommandRefused as e:
            st["refused"] += 1
            client.problem(str(e))
        except DaemonUnreachable as e:
            st["unreachable"] += 1
            client.problem(str(e))
            break
        st["ops"] += 1
        while len(client.pending) > window:
            client.complete()
        if st["ops"] % 50 == 0:
            _tick(st, counter, bad, 50)
    while client.pending:
        client.complete()


def _soak_client(address: str, idx: int, ops: int, seed: int, preset_name: str, unit: str,
                 max_rows: int, window: int, quota: int, counter: Any, bad: Any, ready: Any,
                 go: Any, release: Any, out: Any) -> None:
    """One soak client process (see the module docstring); puts its counters on ``out``.
    SIGTERM or the parent's death end it quietly, its pools closed (``quiet_worker``)."""
    from multiprocessing.util import Finalize

    from hicache.cli.lifecycle import quiet_worker

    quiet_worker(os.getppid())
    from hicache.fuzz.runner import Pattern, ShmBuffers
    from hicache.core.layout import INDEX_SPACES, build_layout, preset

    layout = build_layout(preset(preset_name))
    space = unit if unit in INDEX_SPACES else layout.pool(unit).index
    pools = [p.name for p in layout.space_pools(unit)] if unit in INDEX_SPACES else [unit]
    dev_rows = {s: n for s, n in SOAK_DEV_ROWS.items() if layout.space_pools(s)}
    nd = dev_rows[space]
    bufs = ShmBuffers(layout, dev_rows, tag=f"soak{idx}")
    Finalize(bufs, bufs.close, exitpriority=10)  # runs on SystemExit too
    pc = _PageClient(address, idx, seed, unit, space, nd, bufs, Pattern(layout, pools, seed))
    registered = False
    try:
        pc.c.register(**bufs.register_fields(), fds=bufs.fds())
        registered = True
        _count(ready, 1)
        go.wait(300)
        _run_ops(pc, lambda i: pc.step(i, max_rows, quota), ops, window, counter, bad)
        _tick(pc.st, counter, bad, pc.st["ops"] % 50)
    except Exception as e:  # noqa: BLE001 - report it instead of dying silently
        pc.problem(f"{type(e).__name__}: {e}")
        if not registered:
            _count(ready, 1)
    report_and_leave(out, idx, pc.st, release, pc.c, bufs)


def _mix_client(address: str, idx: int, ops: int, seed: int, preset_name: str, device: str,
                window: int, counter: Any, bad: Any, ready: Any, go: Any, release: Any,
                out: Any) -> None:
    """One ``--mix all`` soak client process (see ``soak_mix``); puts its counters on ``out``.
    SIGTERM or the parent's death end it (its device pools freed), so a
    bench killed by a timeout leaves no client holding GPU memory."""
    from hicache.cli.lifecycle import quiet_worker

    quiet_worker(os.getppid())
    import torch

    from hicache.bench.soak_mix import MIX_DEV_ROWS, MixClient
    from hicache.core.layout import build_layout, preset
    from hicache.engine.client import Client
    from hicache.engine.device_pools import DevicePools

    layout = build_layout(preset(preset_name))
    st: dict[str, Any] = {"ops": 0, "backups": 0, "loads": 0, "frees": 0, "allocs": 0,
                          "swaps": 0, "lost_acks": 0, "failed_ops": 0, "corrupted_pages": 0,
                          "verified_pages": 0, "verified_bytes": 0, "refused": 0,
                          "unreachable": 0, "first_problem": None}
    if device == "cpu":  # eight clients share the cores: no intra-op threads of their own
        torch.set_num_threads(1)
    try:  # a client that cannot even start says why (CUDA pools, IPC export, registration)
        pools = DevicePools(layout, {s: n for s, n in MIX_DEV_ROWS.items()
                                     if layout.space_pools(s)}, device)
        c = Client(address, timeout=120.0, name=f"mix{idx}")
        m = MixClient(c, pools, layout, idx, seed, st)
        c.register(pools)
    except Exception as e:  # noqa: BLE001
        st["first_problem"] = f"client {idx}: setup on {device} failed: {type(e).__name__}: {e}"
        out.put((idx, st))
        _count(ready, 1)
        return
    _count(ready, 1)
    try:
        go.wait(300)
        t0 = time.perf_counter()
        _run_ops(m, lambda _: m.step(), ops, window, counter, bad)
        st["t_loop"] = time.perf_counter() - t0
        _tick(st, counter, bad, st["ops"] % 50)
    except Exception as e:  # noqa: BLE001 - report it instead of dying silently
        m.problem(f"{type(e).__name__}: {e}")
    report_and_leave(out, idx, st, release, c, pools)


BAD = ("lost_acks", "failed_ops", "corrupted_pages", "refused", "unreachable")  # what fails a run


def _tick(st: dict[str, Any], counter: Any, bad: Any, n: int) -> None:
    """Publish ``n`` more operations and any new failures (``BAD``) to the parent's counters."""
    now = sum(st[k] for k in BAD)
    with counter.get_lock():
        counter.value += n
    if now != st.setdefault("_bad_sent", 0):
        _count(bad, now - st["_bad_sent"])
        st["_bad_sent"] = now


def _count(value: Any, n: int) -> None:
    with value.get_lock():
        value.value += n


def report_and_leave(out: Any, idx: int, st: dict[str, Any], release: Any, c: Any,
                     buffers: Any) -> None:
    """A worker's last steps: its counters to the parent, then (once the parent has sampled the
    daemon's RSS while every worker is still mapped) unregister and close."""
    out.put((idx, st))
    release.wait(300)
    try:
        c.unregister(timeout=10)
    except Exception:  # noqa: BLE001 - the daemon may be gone; the counters are already out
        pass
    c.close()
    buffers.close()


@dataclass
class _Watch:
    """What the parent saw of a run: each client's counters, the daemon's RSS, the times."""

    results: dict[int, dict[str, Any]] = field(default_factory=dict)
    curve: list[float] = field(default_factory=list)  # MiB, at every tenth of the operations
    rss_warm: int | None = None
    rss_end: int | None = None
    setup_s: float = 0.0
    seconds: float = 0.0


def _start_clients(ctx: Any, clients: int, mix: str, address: str, ops: int, seed: int,
                   preset_name: str, own: Mapping[str, Any], shared: tuple[Any, ...]
                   ) -> list[Any]:
    """Start the ``clients`` processes of ``mix`` (spawned, daemonic) and return them; each gets
    its mix's settings from ``own``, then ``shared`` (the parent's counters, events, queue)."""
    if mix == "all":
        procs = [ctx.Process(target=_mix_client, name=f"mix{i}", daemon=True,
                             args=(address, i, ops, seed, preset_name, own["device"],
                                   own["window"], *shared)) for i in range(clients)]
    else:
        procs = [ctx.Process(target=_soak_client, name=f"soak{i}", daemon=True,
                             args=(address, i, ops, seed, preset_name, own["unit"],
                                   own["max_rows"], own["window"], own["quota"], *shared))
                 for i in range(clients)]
    for p in procs:
        p.start()
    return procs


def _await_setup(ready: Any, procs: list[Any], t0: float,
                 progress: Callable[[str], None] | None) -> float:
    """Wait until every client has set up or exited (at most ``SETUP_TIMEOUT_S``); returns the
    seconds since ``t0``."""
    clients = len(procs)
    while ready.value + sum(p.exitcode is not None for p in procs) < clients \
            and time.monotonic() < t0 + SETUP_TIMEOUT_S:  # (a dead client: reported below)
        time.sleep(0.05)
    setup_s = time.monotonic() - t0
    if progress is not None:
        progress(f"{ready.value} of {clients} clients set up in {setup_s:.1f} s")
    return setup_s


def _say_progress(progress: Callable[[str], None], done: int, total: int, t0: float,
                  last: tuple[float, int], rss: Callable[[], int] | None, bad: Any
                  ) -> tuple[float, int]:
    """One progress line (operations, ops/s overall and since ``last``, RSS, failures); returns
    the new ``last`` (time, operations)."""
    mib = f", daemon RSS {rss() / 2**20:.1f} MiB" if rss is not None else ""
    now = time.monotonic()
    progress(f"{done}/{total} operations, {done / (now - t0):.0f}/s (last "
             f"{now - last[0]:.0f} s: {(done - last[1]) / (now - last[0]):.0f}/s){mib}"
             f", failures so far {bad.value}")
    return (now, done)


def _note_dead(procs: list[Any], results: Mapping[int, Any], out: Any, dead: set[int],
               progress: Callable[[str], None] | None) -> None:
    """Say once of each client that exited without putting its counters on ``out``."""
    for i, p in enumerate(procs):
        if i not in dead and p.exitcode is not None and i not in results and out.empty():
            dead.add(i)
            if progress is not None:
                progress(f"client {i} exited with status {p.exitcode} before reporting")


def _collect(watch: _Watch, procs: list[Any], out: Any, counter: Any, bad: Any, total: int,
             warmup: float, rss: Callable[[], int] | None,
             progress: Callable[[str], None] | None, deadline: float) -> None:
    """Gather the clients' counters into ``watch`` as they finish (until ``deadline`` or all
    are gone), sampling the daemon's RSS and saying progress every ``PROGRESS_S``."""
    clients = len(procs)
    t0 = time.monotonic()
    next_note = t0 + PROGRESS_S
    last = (t0, 0)  # (time, operations) at the previous progress line
    dead: set[int] = set()
    while len(watch.results) < clients and time.monotonic() < deadline:
        try:
            idx, st = out.get(timeout=0.2)
            watch.results[idx] = st
        except Exception:  # noqa: BLE001 - queue.Empty
            pass
        done = counter.value
        if rss is not None and done >= (len(watch.curve) + 1) * total / 10 \
                and len(watch.curve) < 9:
            watch.curve.append(round(rss() / 2**20, 2))  # RSS at every tenth of the operations
        if watch.rss_warm is None and done >= warmup * total and rss is not None:
            watch.rss_warm = rss()
        if progress is not None and time.monotonic() >= next_note:
            last = _say_progress(progress, done, total, t0, last, rss, bad)
            next_note += PROGRESS_S
        _note_dead(procs, watch.results, out, dead, progress)  # gone without counters: say so
        if len(watch.results) < clients and not any(p.is_alive() for p in procs):
            break
    watch.seconds = time.monotonic() - t0


def _sum_counters(results: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
    """The clients' numeric counters summed (those starting with ``_`` left out)."""
    sums: dict[str, Any] = {}
    for st in results.values():
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k[0] != "_":
                sums[k] = sums.get(k, 0) + v
    return sums


def _soak_report(watch: _Watch, procs: list[Any], ops: int, window: int, warmup: float,
                 mix: str, device: str, unit: str, max_rows: int) -> dict[str, Any]:
    """The run's report: the clients' counters summed, their problems, RSS and rates."""
    results, rss_warm, rss_end, seconds = watch.results, watch.rss_warm, watch.rss_end, \
        watch.seconds
    clients, sums = len(procs), _sum_counters(watch.results)
    n = max(1, len(results))  # where a client's time went, averaged over the clients
    split = {k: round(sums[f"t_{k}"] / n, 2) for k in ("loop", "calls", "ack_wait", "check")
             if f"t_{k}" in sums}
    problems = [st["first_problem"] for st in results.values() if st.get("first_problem")]
    problems += [f"client {i} exited with status {procs[i].exitcode} without reporting (its "
                 f"traceback, if any, is on stderr above)" for i in range(clients)
                 if i not in results]
    growth = None
    if rss_warm and rss_end is not None:
        growth = round((rss_end - rss_warm) / rss_warm * 100, 3)
    return {
        "bench": "soak", "clients": clients, "ops": sums.get("ops", 0), "ops_per_client": ops,
        "window": window, "unit": unit if mix == "page" else "all", "mix": mix,
        "device": device, "max_rows": max_rows if mix == "page" else 512,
        "swaps": sums.get("swaps", 0), "verified_bytes": sums.get("verified_bytes", 0),
        "backups": sums.get("backups", 0), "loads": sums.get("loads", 0),
        "frees": sums.get("frees", 0), "allocs": sums.get("allocs", 0),
        "lost_acks": sums.get("lost_acks", 0), "failed_ops": sums.get("failed_ops", 0),
        "corrupted_pages": sums.get("corrupted_pages", 0),
        "verified_pages": sums.get("verified_pages", 0), "refused": sums.get("refused", 0),
        "unreachable": sums.get("unreachable", 0), "clients_missing": clients - len(results),
        "rss_warm_mib": None if rss_warm is None else round(rss_warm / 2**20, 2),
        "rss_end_mib": None if rss_end is None else round(rss_end / 2**20, 2),
        "rss_growth_pct": growth, "warmup_fraction": warmup,
        "rss_curve_mib": watch.curve + ([round(rss_end / 2**20, 2)]
                                        if rss_end is not None else []),
        "seconds": round(seconds, 2), "ops_per_s": round(sums.get("ops", 0) / max(seconds, 1e-9), 1),
        "client_setup_s": round(watch.setup_s, 2), "client_seconds": split,
        "problems": problems[:8],
        "problem_log": [x for st in results.values() for x in st.get("problem_log", [])][:64],
    }


def run_soak(address: str, clients: int, ops: int, *, seed: int = 0,
             preset_name: str = "dsv4-tiny", unit: str = "page", max_rows: int = 4,
             window: int = 4, warmup: float = 0.1, quota: int = 24,
             rss: Callable[[], int] | None = None, mix: str = "page", device: str = "cpu",
             progress: Callable[[str], None] | None = None) -> dict[str, Any]:
    """Run the sustained-load clients against the daemon at ``address`` (see the module
    docstring); ``rss()`` returns the daemon's RSS in bytes (sampled after ``warmup`` of all
    operations and once every client finished, before they unregister)."""
    ctx = mp.get_context("spawn")
    counter, bad, ready = ctx.Value("q", 0), ctx.Value("q", 0), ctx.Value("q", 0)
    go, release = ctx.Event(), ctx.Event()
    out = ctx.Queue()
    own = {"device": device, "unit": unit, "max_rows": max_rows, "window": window,
           "quota": quota}
    procs = _start_clients(ctx, clients, mix, address, ops, seed, preset_name, own,
                           (counter, bad, ready, go, release, out))
    watch = _Watch()
    t0 = time.monotonic()
    try:  # the clock starts once every client has set up (torch, CUDA, pools, register)
        watch.setup_s = _await_setup(ready, procs, t0, progress)
        go.set()
        _collect(watch, procs, out, counter, bad, clients * ops, warmup, rss, progress,
                 t0 + 3600)
        if rss is not None:
            watch.rss_end = rss()
            if watch.rss_warm is None:
                watch.rss_warm = watch.rss_end
    except BaseException:  # interrupted: stop the workers now (each closes its pools)
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
    return _soak_report(watch, procs, ops, window, warmup, mix, device, unit, max_rows)
