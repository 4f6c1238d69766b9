"""Sustained load for ``hicache bench soak``: client processes, their counters, the daemon's RSS.

``run_soak(address, clients, ops, ...)`` starts ``clients`` processes (spawned) that each run
``ops`` operations against the daemon and report their counters; the daemon's RSS is sampled
after ``warmup`` of all operations, at every tenth and at the end. The clock (``seconds``,
``ops_per_s``) starts once every client has set up and registered (``client_setup_s``); a
progress line (operations, ops/s, daemon RSS) every ``PROGRESS_S``. Two mixes:

* ``mix="page"`` (``_soak_client``): ``alloc`` / ``backup`` / ``load`` / ``free`` of 1..``max_rows``
  rows of one unit (an index space or one pool), every load checked against the content its
  host rows were last backed up with;
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
from typing import Any, Callable

SOAK_DAEMON_ROWS = "page=64,swa_page=8,req_slot=4"  # x --host-ratio 4: 256 page rows
SOAK_DEV_ROWS = {"page": 32, "swa_page": 4, "req_slot": 2}  # per client
SETUP_TIMEOUT_S = 300.0  # clients importing torch and opening CUDA on a busy machine
PROGRESS_S = 10.0  # a progress line at least this often


def _soak_client(address: str, idx: int, ops: int, seed: int, preset_name: str, unit: str,
                 max_rows: int, window: int, quota: int, counter: Any, bad: Any, ready: Any,
                 go: Any, release: Any, out: Any) -> None:
    """One soak client process (see the module docstring); puts its counters on ``out``.
    SIGTERM or the parent's death end it quietly, its pools closed (``quiet_worker``)."""
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
    readable: set[int] = set()  # held rows a backup into which was acked (loads read only these)
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
        elif kind == "backup":  # readable now, unless freed (or rewritten) meanwhile
            readable.update(h for h, salt in salts if held.get(h) == salt)
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

    registered = False
    try:
        c.register(**bufs.register_fields(), fds=bufs.fds())
        registered = True
        _count(ready, 1)
        go.wait(300)
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
                        readable.discard(r)
                    spare[:] = [r for r in spare if r not in pick]
                    st["frees"] += 1
                elif x < 0.6 or not readable:  # backup into spare rows, else over held rows
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
                    pending.append((op, "backup", drows, list(zip(hosts, salts))))
                    st["backups"] += 1
                else:  # load held rows into device rows, verify on its ack
                    hosts = rng.sample(sorted(readable), min(k, len(readable)))
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
                _tick(st, counter, bad, 50)
        while pending:
            complete()
        _tick(st, counter, bad, st["ops"] % 50)
    except Exception as e:  # noqa: BLE001 - report it instead of dying silently
        problem(f"{type(e).__name__}: {e}")
        if not registered:
            _count(ready, 1)
    report_and_leave(out, idx, st, release, c, bufs)


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
    from hicache.engine.client import Client, CommandRefused, DaemonUnreachable
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
        for _ in range(ops):
            try:
                m.step()
            except CommandRefused as e:
                st["refused"] += 1
                m.problem(str(e))
            except DaemonUnreachable as e:
                st["unreachable"] += 1
                m.problem(str(e))
                break
            st["ops"] += 1
            while len(m.pending) > window:
                m.complete()
            if st["ops"] % 50 == 0:
                _tick(st, counter, bad, 50)
        while m.pending:
            m.complete()
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
    if mix == "all":
        procs = [ctx.Process(target=_mix_client, name=f"mix{i}", daemon=True,
                             args=(address, i, ops, seed, preset_name, device, window, counter,
                                   bad, ready, go, release, out)) for i in range(clients)]
    else:
        procs = [ctx.Process(target=_soak_client, name=f"soak{i}", daemon=True,
                             args=(address, i, ops, seed, preset_name, unit, max_rows, window,
                                   quota, counter, bad, ready, go, release, out))
                 for i in range(clients)]
    for p in procs:
        p.start()
    results: dict[int, dict[str, Any]] = {}
    total = clients * ops
    rss_warm = rss_end = None
    curve: list[float] = []
    t0 = time.monotonic()
    deadline = t0 + 3600
    try:  # the clock starts once every client has set up (torch, CUDA, pools, register)
        while ready.value + sum(p.exitcode is not None for p in procs) < clients \
                and time.monotonic() < t0 + SETUP_TIMEOUT_S:  # (a dead client: reported below)
            time.sleep(0.05)
        setup_s = time.monotonic() - t0
        if progress is not None:
            progress(f"{ready.value} of {clients} clients set up in {setup_s:.1f} s")
        go.set()
        t0 = time.monotonic()
        next_note = t0 + PROGRESS_S
        last = (t0, 0)  # (time, operations) at the previous progress line
        dead: set[int] = set()
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
                now = time.monotonic()
                progress(f"{done}/{total} operations, {done / (now - t0):.0f}/s (last "
                         f"{now - last[0]:.0f} s: {(done - last[1]) / (now - last[0]):.0f}/s){mib}"
                         f", failures so far {bad.value}")
                last = (now, done)
                next_note += PROGRESS_S
            for i, p in enumerate(procs):  # a client gone without its counters: say so now
                if i not in dead and p.exitcode is not None and i not in results \
                        and out.empty():
                    dead.add(i)
                    if progress is not None:
                        progress(f"client {i} exited with status {p.exitcode} before reporting")
            if len(results) < clients and not any(p.is_alive() for p in procs):
                break
        seconds = time.monotonic() - t0
        if rss is not None:
            rss_end = rss()
            if rss_warm is None:
                rss_warm = rss_end
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
    sums: dict[str, Any] = {}
    for st in results.values():
        for k, v in st.items():
            if isinstance(v, (int, float)) and not isinstance(v, bool) and k[0] != "_":
                sums[k] = sums.get(k, 0) + v
    n = max(1, len(results))  # where a client's time went, averaged over the clients
    split = {k: round(sums[f"t_{k}"] / n, 2) for k in ("loop", "calls", "ack_wait", "check")
             if f"t_{k}" in sums}
    problems = [st["first_problem"] for st in results.values() if st.get("first_problem")]
    problems += [f"client {i} exited with status {procs[i].exitcode} without reporting (its "
                 f"traceback, if any, is on stderr above)" for i in range(clients)
                 if i not in results]
    missing = clients - len(results)
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
        "unreachable": sums.get("unreachable", 0), "clients_missing": missing,
        "rss_warm_mib": None if rss_warm is None else round(rss_warm / 2**20, 2),
        "rss_end_mib": None if rss_end is None else round(rss_end / 2**20, 2),
        "rss_growth_pct": growth, "warmup_fraction": warmup,
        "rss_curve_mib": curve + ([round(rss_end / 2**20, 2)] if rss_end is not None else []),
        "seconds": round(seconds, 2), "ops_per_s": round(sums.get("ops", 0) / max(seconds, 1e-9), 1),
        "client_setup_s": round(setup_s, 2), "client_seconds": split,
        "problems": problems[:8],
        "problem_log": [x for st in results.values() for x in st.get("problem_log", [])][:64],
    }


