"""``hicache bench control``: control-plane latency and throughput of a live daemon (CPU mode).

A daemon subprocess serves the DSV4-Flash layout with tiny shared-memory pools; 1 and 4 client
processes each register their pools and issue backups of one ``c128_kv`` row (one 1,728-byte
row per C128 layer, so the figure is the control plane, not the copy), each timed from send to
completion ack. Reported per client count: p50 / p99 latency (us) and commands per second over
all clients. The same clients against a bare pyzmq ROUTER echo give the limit of the transport
(``--no-echo`` skips it).
"""
from __future__ import annotations

import argparse
import gc
import json
import multiprocessing as mp
import os
import shutil
import tempfile
import time
from typing import Any

from hicache.engine.daemon_process import DaemonProcess

TARGETS = {"p50_us_1": 150.0, "p99_us_1": 500.0, "commands_per_s_4": 10_000.0}
# The bare echo the targets were set against (issue #5, a 2-core machine): the targets are
# 1.83x its p50, 3.6x its p99 and 0.34x its 4-client rate. ``vs_echo`` in the report gives the
# same ratios for the daemon against the echo measured in the same run, so machines whose
# wake-ups cost more than the anchor's can be compared on the daemon's own overhead.
ANCHOR_ECHO = {"p50_us_1": 82.0, "p99_us_1": 139.0, "commands_per_s_4": 29_700.0}
ROWS = "page=8,swa_page=4,req_slot=4"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--clients", default="1,4", help="client process counts (default 1,4)")
    p.add_argument("--ops", type=int, default=5000, help="timed backups per client")
    p.add_argument("--warmup", type=int, default=500, help="untimed backups per client first")
    p.add_argument("--no-echo", action="store_true", help="skip the bare pyzmq echo baseline")
    p.add_argument("--spin-us", type=float, default=0.0,
                   help="the daemon's --spin-us (busy-poll after a request; default 0)")


# ----------------------------------------------------------------------------- client processes
def _timed(step: Any, ops: int, warmup: int, barrier: Any) -> tuple[list[int], float, float]:
    """Run ``step`` ``warmup`` times, wait at the barrier, then time ``ops`` calls (ns each)."""
    for _ in range(warmup):
        step()
    lat = [0] * ops
    pc = time.perf_counter_ns
    barrier.wait()
    t_start = time.perf_counter()
    for i in range(ops):
        t0 = pc()
        step()
        lat[i] = pc() - t0
    return lat, t_start, time.perf_counter()


def _daemon_client(address: str, ops: int, warmup: int, barrier: Any, out: Any) -> None:
    _quiet()
    from hicache.engine.client import Client
    from hicache.engine.device_pools import DevicePools
    from hicache.core.layout import build_layout, preset

    pools = DevicePools(build_layout(preset("dsv4-flash")), {"page": 8, "swa_page": 4,
                                                              "req_slot": 4})
    with Client(address, timeout=10.0, name="bench") as c:
        c.register(pools)
        row = c.alloc({"page": 1})["page"]
        items = {"c128_kv": ([3], row)}
        # this process imported torch (the echo client did not): keep the cyclic GC from
        # re-scanning it mid-run, as serving engines do after warm-up (the daemon does too)
        gc.collect()
        gc.freeze()
        out.put(_timed(lambda: c.wait_ack(c.backup(items)), ops, warmup, barrier))
        c.unregister()
    pools.close()


def _quiet() -> None:
    """Worker processes: SIGINT ignored, SIGTERM or the parent's death end them quietly."""
    from hicache.cli.lifecycle import quiet_worker

    quiet_worker(os.getppid())


def _echo_server(address: str, ready: Any) -> None:
    _quiet()
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.ROUTER)
    s.bind(address)
    ready.set()
    while True:
        f = s.recv_multipart()
        if f[1] == b"stop":
            break
        s.send_multipart(f)
    s.close(0)
    ctx.term()


def _echo_client(address: str, ops: int, warmup: int, barrier: Any, out: Any) -> None:
    _quiet()
    import zmq

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.connect(address)
    msg = [b'{"v":1,"cmd":"backup","id":1,"items":[{"pool":"c128_kv","src":0,"dst":1}]}',
           b"\x03" + b"\0" * 7, b"\0" * 8]
    def step() -> None:
        s.send_multipart(msg)
        s.recv_multipart()

    out.put(_timed(step, ops, warmup, barrier))
    s.close(0)
    ctx.term()


def _cpu_s(pid: int | None) -> float:
    """User + system CPU seconds of a process (all its threads); 0 when unknown."""
    if pid is None:
        return 0.0
    try:
        import psutil

        t = psutil.Process(pid).cpu_times()
        return t.user + t.system
    except Exception:  # noqa: BLE001
        return 0.0


def _run_clients(target: Any, address: str, n: int, ops: int, warmup: int,
                 server_pid: int | None = None) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    barrier, out = ctx.Barrier(n), ctx.Queue()
    procs = [ctx.Process(target=target, args=(address, ops, warmup, barrier, out), daemon=True)
             for _ in range(n)]
    for p in procs:
        p.start()
    cpu0 = _cpu_s(server_pid)
    try:
        results = [out.get(timeout=300) for _ in procs]  # warm-up done once the first arrives
    except BaseException:  # interrupted: the workers stop now
        for p in procs:
            p.terminate()
        raise
    cpu1 = _cpu_s(server_pid)
    for p in procs:
        p.join(30)
    lat = sorted(x for r in results for x in r[0])
    t0, t1 = min(r[1] for r in results), max(r[2] for r in results)

    def pct(q: float) -> float:
        return lat[min(len(lat) - 1, int(q * len(lat)))] / 1000.0

    row = {"clients": n, "ops": len(lat), "p50_us": round(pct(0.50), 1),
           "p99_us": round(pct(0.99), 1), "commands_per_s": round(len(lat) / (t1 - t0), 1)}
    if server_pid is not None:  # includes warm-up and registration: an upper bound
        row["server_cpu_us_per_cmd"] = round((cpu1 - cpu0) / (n * (ops + warmup)) * 1e6, 1)
    return row


# ----------------------------------------------------------------------------- the daemon
def _start_daemon(address: str, spin_us: float = 0.0) -> DaemonProcess:
    return DaemonProcess(address, device="cpu", preset="dsv4-flash", device_rows=ROWS,
                         host=("--host-ratio", "4"), heartbeat_timeout=None,
                         log_level="warning", extra=("--spin-us", str(spin_us)),
                         pipe=True).start()


def _vs_echo(rows: list[dict[str, Any]], echo: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """Daemon / echo ratios per client count (latency: lower is better; rate: higher)."""
    by_n = {e["clients"]: e for e in echo}
    out = []
    for r in rows:
        e = by_n.get(r["clients"])
        if e:
            out.append({"clients": r["clients"],
                        "p50": round(r["p50_us"] / e["p50_us"], 2),
                        "p99": round(r["p99_us"] / e["p99_us"], 2),
                        "rate": round(r["commands_per_s"] / e["commands_per_s"], 2)})
    return out


def run(args: argparse.Namespace) -> int:
    from hicache.core.errors import UsageError

    try:
        counts = [int(x) for x in str(args.clients).split(",") if x.strip()]
    except ValueError:
        raise UsageError(f"--clients wants numbers like 1,4, got {args.clients!r}") from None
    if not counts or min(counts) < 1 or max(counts) > 32 or args.ops < 10 or args.warmup < 0:
        raise UsageError("--clients between 1 and 32, --ops at least 10")
    tmp = tempfile.mkdtemp(prefix="hcb-", dir="/tmp")
    os.chmod(tmp, 0o700)
    rows: list[dict[str, Any]] = []
    echo: list[dict[str, Any]] = []
    proc = None
    try:
        address = f"ipc://{tmp}/d.sock"
        proc = _start_daemon(address, args.spin_us)
        for n in counts:
            rows.append(_run_clients(_daemon_client, address, n, args.ops, args.warmup, proc.pid))
        if not args.no_echo:
            ctx = mp.get_context("spawn")
            ready = ctx.Event()
            eaddr = f"ipc://{tmp}/echo.sock"
            srv = ctx.Process(target=_echo_server, args=(eaddr, ready), daemon=True)
            srv.start()
            ready.wait(30)
            for n in counts:
                echo.append(_run_clients(_echo_client, eaddr, n, args.ops, args.warmup, srv.pid))
            import zmq

            s = zmq.Context.instance().socket(zmq.DEALER)
            s.connect(eaddr)
            s.send_multipart([b"stop"])
            srv.join(5)
            s.close(0)
            if srv.is_alive():
                srv.terminate()
    finally:
        if proc is not None:
            proc.stop(timeout=20)
        shutil.rmtree(tmp, ignore_errors=True)
    report = {"bench": "control", "cpus": os.cpu_count(), "spin_us": args.spin_us, "rows": rows,
              "echo": echo, "targets": TARGETS, "anchor_echo": ANCHOR_ECHO,
              "vs_echo": _vs_echo(rows, echo)}
    if args.json:
        print(json.dumps(report))
        return 0
    print(f"hicache bench control: backups of one c128_kv row per C128 layer, CPU mode, "
          f"{args.ops} timed ops per client, {os.cpu_count()} CPUs, daemon spin "
          f"{args.spin_us:g} us")
    print(f"  {'clients':>7} {'p50 us':>9} {'p99 us':>9} {'commands/s':>11} "
          f"{'daemon cpu':>11}   vs bare pyzmq echo (same clients, same run)")
    by_n = {e["clients"]: e for e in echo}
    for r in rows:
        e = by_n.get(r["clients"])
        cmp = (f"   echo {e['p50_us']:.0f} / {e['p99_us']:.0f} us, {e['commands_per_s']:.0f}/s "
               f"(daemon = {r['commands_per_s'] / e['commands_per_s']:.0%} of echo rate)"
               if e else "")
        cpu = f"{r['server_cpu_us_per_cmd']:.0f} us/cmd" if "server_cpu_us_per_cmd" in r else "-"
        print(f"  {r['clients']:>7} {r['p50_us']:>9.1f} {r['p99_us']:>9.1f} "
              f"{r['commands_per_s']:>11.0f} {cpu:>11}{cmp}")
    print(f"  targets: 1 client p50 <= {TARGETS['p50_us_1']:.0f} us, p99 <= "
          f"{TARGETS['p99_us_1']:.0f} us; 4 clients >= {TARGETS['commands_per_s_4']:.0f}/s "
          f"(set against an echo of {ANCHOR_ECHO['p50_us_1']:.0f} / "
          f"{ANCHOR_ECHO['p99_us_1']:.0f} us and {ANCHOR_ECHO['commands_per_s_4']:.0f}/s with 4: "
          f"1.83x / 3.6x / 0.34x of it)")
    for v in report["vs_echo"]:
        print(f"  daemon / echo, {v['clients']} client(s): p50 {v['p50']:.2f}x  p99 "
              f"{v['p99']:.2f}x  rate {v['rate']:.2f}x")
    return 0
