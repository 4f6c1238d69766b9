"""``hicache bench soak``: sustained load, crashed clients and a crashed daemon (the command line).

Three modes, each against its own daemon subprocess on a private ipc socket:

* default — ``--clients N --ops M``: N client processes each run M operations, a random mix of
  ``alloc``, ``backup``, ``load`` and ``free`` (``--window`` operations in flight per client).
  ``--mix page`` (default) moves 1..``--max-rows`` rows of one ``--unit``; ``--mix all`` moves
  rows of the page and SWA spaces (1 row to 512 pages), token ids of every token-granular pool
  and request-state swaps, every loaded byte checked (``soak_mix``); ``--device cuda:N`` runs
  the daemon and the clients' device pools on that GPU (``--mix all`` only).
  Every backup first fills its device rows with content derived from (client, row, version);
  every load first overwrites its device rows, then checks every loaded row against the content
  its host row was last backed up with. Reported: lost acks (an accepted operation whose ack
  never came), failed operations, corrupted pages, refused commands, the daemon's RSS after
  ``--warmup`` of all operations and at the end (growth in %), ops/s.
* ``--crash-clients N`` — a victim holds rows with known content; N times a client process
  registers, allocates rows, streams backups and loads, and is killed with SIGKILL in the middle.
  Reported per crash: seconds until the daemon reaped it (rows back to the victim's only, its
  worker gone), rows still leaked after the heartbeat timeout + 2 s, whether the daemon still
  maps its pools' memfd; at the end the victim's rows must load back unchanged.
* ``--crash-daemon N`` — a worker (client + ``ClientHooks`` + ``RadixTree``) with pages on the
  host tier; N times the daemon is killed with SIGKILL: every client call must fail with
  ``DaemonUnreachable`` within its timeout, the tree must fall back to recompute, and after a
  restart on the same socket the worker registers again and its host tier works (a backup, an
  eviction and a load of verified content).

``--json`` prints one object (``clients``, ``ops``, ``lost_acks``, ``corrupted_pages``,
``rss_growth_pct``, ``ops_per_s``, ``seconds`` for the default mode; ``seconds`` starts once
every client has set up, which ``client_setup_s`` reports apart; ``--mix all`` adds
``verified_bytes`` and ``client_seconds``, a client's average time split into its loop,
command round trips, ack waits and checks; ``daemon_handler_ms`` gives, per command the
clients sent, how many the daemon handled and the mean milliseconds of its server thread from
the request to the reply, from its own ``hicache_command_seconds`` metric). Exit status 0 when
the mode's checks pass.
Progress goes to stderr in every mode (``--json`` too: stdout holds the object only; the
sustained load prints operations done and ops/s every 10 s). Any failure of the bench itself (the daemon not answering, a client process
dying, an exception) ends with one line ``hicache bench soak: FAILED: ...`` on stderr, the tail
of the daemon's log before it, exit status 1, and with ``--json`` an object ``{"ok": false,
"error": ...}`` on stdout; a run whose checks fail prints the daemon log's tail too. A daemon
that refuses its settings is a usage error (its one line, exit status 2).

The parts: ``soak_load`` (sustained load), ``soak_mix`` (the ``--mix all`` client),
``soak_crash`` (crashed clients and daemon); their entry points are re-exported here.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import time
from typing import Any, Mapping

from hicache.bench.daemon_times import command_times
from hicache.bench.flags import say
from hicache.bench.soak_crash import (CRASH_DEV_ROWS, RadixWorker, crash_child, crash_clients,
                                      crash_daemon)
from hicache.bench.soak_load import SOAK_DAEMON_ROWS, SOAK_DEV_ROWS, run_soak

__all__ = ["CRASH_DEV_ROWS", "RadixWorker", "SOAK_DAEMON_ROWS", "SOAK_DEV_ROWS", "add_arguments",
           "crash_child", "crash_clients", "crash_daemon", "run", "run_soak"]
MIX_DAEMON_ROWS = "page=1280,swa_page=24,req_slot=9"  # x --host-ratio 4: 600 page rows x 8 + slack


CRASH_TIMEOUT_S = 1.0  # the crash modes' default heartbeat and call timeouts


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--clients", type=int, default=8, help="client processes (default 8)")
    p.add_argument("--ops", type=int, default=50_000, help="operations per client (default 50000)")
    p.add_argument("--window", type=int, default=4,
                   help="operations in flight per client (default 4)")
    p.add_argument("--unit", default="page",
                   help="what one backup/load moves per row: an index space (all its pools) or "
                        "one pool name (default: space 'page')")
    p.add_argument("--max-rows", type=int, default=4, help="rows per operation, 1..N (default 4)")
    p.add_argument("--mix", choices=("page", "all"), default="page",
                   help="page: rows of --unit only (default); all: rows of the page and SWA "
                        "spaces from 1 row to 512 pages, tokens, request-state swaps")
    p.add_argument("--device", default="cpu",
                   help="cpu (default) or cuda:N: the daemon's device and the clients' device "
                        "pools (CUDA needs --mix all)")
    p.add_argument("--warmup", type=float, default=0.2,
                   help="fraction of all operations before the first RSS sample (default 0.2)")
    p.add_argument("--crash-clients", type=int, default=0, metavar="N",
                   help="instead: kill N clients with SIGKILL mid-transfer, check reaping")
    p.add_argument("--crash-daemon", type=int, default=0, metavar="N",
                   help="instead: kill the daemon N times, check client timeouts and re-register")
    p.add_argument("--heartbeat-timeout", type=float, default=CRASH_TIMEOUT_S,
                   help="daemon heartbeat timeout for --crash-clients (default 1 s)")
    p.add_argument("--call-timeout", type=float, default=CRASH_TIMEOUT_S,
                   help="client call timeout for --crash-daemon (default 1 s)")
    p.add_argument("--preset", default="dsv4-tiny", help="layout (default dsv4-tiny)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--json", action="store_true", help="print one JSON object")


# ============================================================================ command line
def _say(msg: str) -> None:
    say("  " + msg)


def run(args: argparse.Namespace) -> int:
    """The bench; any failure of its own: one line on stderr (and an error object with
    ``--json``), exit status 1. Usage errors and interrupts go to the command line as usual."""
    from hicache.core.errors import UsageError
    from hicache.core.layout import LayoutError

    tail: list[str] = []
    try:
        return _run(args, tail)
    except (UsageError, LayoutError):
        raise
    except Exception as e:  # noqa: BLE001 - reported in one line, never a silent empty stdout
        import traceback

        traceback.print_exc(file=sys.stderr)
        if tail and tail[0]:
            print("--- daemon log (tail) ---\n" + tail[0], file=sys.stderr)
        why = f"{type(e).__name__}: {e}".splitlines()[0][:500]
        if args.json:
            print(json.dumps({"bench": "soak", "ok": False, "error": why,
                              "device": args.device}), flush=True)
        print(f"hicache bench soak: FAILED: {why}", file=sys.stderr, flush=True)
        return 1


def _run(args: argparse.Namespace, tail: list[str]) -> int:
    from hicache.core.config import MIN_HEARTBEAT_TIMEOUT_S
    from hicache.core.errors import UsageError
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.fuzz.runner import ROOT, DaemonRunner, private_address

    if args.device != "cpu" and (args.mix != "all" or args.crash_clients or args.crash_daemon):
        raise UsageError("--device cuda:N runs the sustained load with --mix all only")
    if args.crash_clients < 0 or args.crash_daemon < 0 or (args.crash_clients and args.crash_daemon):
        raise UsageError("give at most one of --crash-clients N and --crash-daemon N")
    # the two timeouts apply to their crash mode only, and must be finite and positive
    for flag, value, mode, on in (("--heartbeat-timeout", args.heartbeat_timeout,
                                   "--crash-clients", args.crash_clients),
                                  ("--call-timeout", args.call_timeout, "--crash-daemon",
                                   args.crash_daemon)):
        if not on and value != CRASH_TIMEOUT_S:
            raise UsageError(f"{flag} applies with {mode} N only")
        if flag == "--heartbeat-timeout":  # what the daemon takes
            ok, span = MIN_HEARTBEAT_TIMEOUT_S <= value <= 3600, \
                f"[{MIN_HEARTBEAT_TIMEOUT_S:g}, 3600]"
        else:
            ok, span = 0 < value <= 3600, "(0, 3600]"
        if not ok:
            raise UsageError(f"{flag} must be in {span} seconds, got {value}")
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

    note = _say
    runner = None
    out = ""
    try:
        if args.crash_daemon:
            runner = DaemonRunner(address, preset_name=args.preset, log_path=log)
            rep = crash_daemon(runner, args.crash_daemon, call_timeout=args.call_timeout,
                               seed=args.seed, preset_name=args.preset, progress=note)
        elif args.crash_clients:
            runner = DaemonRunner(address, preset_name=args.preset,
                                  device_rows="page=16,swa_page=8,req_slot=4",
                                  host=("--host-ratio", "2"),
                                  heartbeat_timeout=args.heartbeat_timeout, log_path=log,
                                  # it reads the daemon's /proc maps (is a crashed client's
                                  # file still mapped?), which only a dumpable daemon allows
                                  extra=("--dumpable",))
            runner.start()
            rep = crash_clients(runner, args.crash_clients,
                                heartbeat_timeout=args.heartbeat_timeout, seed=args.seed,
                                preset_name=args.preset, progress=note)
        else:
            rows = MIX_DAEMON_ROWS if args.mix == "all" else SOAK_DAEMON_ROWS
            if args.device == "cpu":
                runner = DaemonRunner(address, preset_name=args.preset, device_rows=rows,
                                      host=("--host-ratio", "4"), heartbeat_timeout=30.0,
                                      log_path=log)
            else:
                runner = DaemonProcess(address, device=args.device, preset=args.preset,
                                       device_rows=rows, host=("--host-ratio", "4"),
                                       heartbeat_timeout=30.0, log_level="warning",
                                       log_path=log, cwd=ROOT, ready_timeout=180.0)
            note(f"starting the daemon ({args.device}, preset {args.preset})")
            t0 = time.monotonic()
            runner.start()
            note(f"daemon ready in {time.monotonic() - t0:.1f} s; {args.clients} clients x "
                 f"{args.ops} operations, mix {args.mix}")
            rep = run_soak(address, args.clients, args.ops, seed=args.seed,
                           preset_name=args.preset, unit=args.unit, max_rows=args.max_rows,
                           window=args.window, warmup=args.warmup, quota=quota,
                           rss=runner.rss, mix=args.mix, device=args.device, progress=note)
            rep["daemon_handler_ms"] = handler_ms(address)
            rep["ok"] = (rep["lost_acks"] == 0 and rep["corrupted_pages"] == 0
                         and rep["failed_ops"] == 0 and rep["refused"] == 0
                         and rep["clients_missing"] == 0 and rep["unreachable"] == 0
                         and rep["ops"] == args.clients * args.ops
                         and rep["rss_growth_pct"] is not None and rep["rss_growth_pct"] < 1.0)
    finally:
        code = runner.stop() if runner is not None else None
        out = runner.output() if runner is not None else ""
        tail.append(out[-3000:])
        shutil.rmtree(tmp, ignore_errors=True)
    rep["daemon_tracebacks"] = out.count("Traceback")
    if runner is not None and not args.crash_daemon:
        rep["daemon_exit_code"] = code
    rep["ok"] = bool(rep["ok"]) and rep["daemon_tracebacks"] == 0
    if not rep["ok"]:
        for p in rep.get("failures", []) or rep.get("problems", []):
            note(f"PROBLEM: {p}")
        if out:
            print("--- daemon log (tail) ---\n" + out[-3000:], file=sys.stderr)
        print("hicache bench soak: FAILED: " + _why(rep), file=sys.stderr, flush=True)
    if args.json:
        print(json.dumps(rep))
        return 0 if rep["ok"] else 1
    _print(rep)
    return 0 if rep["ok"] else 1


def handler_ms(address: str) -> dict[str, list[float]]:
    """{command: [count, mean ms]} of the daemon's handling (request to reply) of every command
    it saw, from its ``stats`` (its ``hicache_command_seconds`` histogram); {} if it cannot
    answer (the report still stands without it)."""
    from hicache.engine.client import Client

    try:
        with Client(address, timeout=10.0, name="soak-stats") as c:
            m = c.stats()["metrics"]
    except Exception:  # noqa: BLE001 - a daemon gone or hung is reported by the checks
        return {}
    return {cmd: [n, round(t / n * 1e3, 3)] for cmd, (n, t) in command_times(m).items()
            if n and cmd not in ("register", "unregister", "stats", "heartbeat", "buffer_infos")}


def _why(rep: Mapping[str, Any]) -> str:
    """The first failed check of a report, in a few words."""
    for k in ("clients_missing", "lost_acks", "corrupted_pages", "failed_ops", "refused",
              "unreachable", "daemon_tracebacks", "leaked_rows_total", "victim_rows_corrupted"):
        if rep.get(k):
            return f"{k} = {rep[k]}" + (f"; first problem: {rep['problems'][0]}"
                                        if rep.get("problems") else "")
    found = rep.get("failures") or rep.get("problems")
    if found:
        return "; ".join(found[:2])
    g = rep.get("rss_growth_pct")
    if rep.get("bench") == "soak" and (g is None or g >= 1.0):
        return f"daemon RSS growth {g}% (limit 1%)"
    return "a check failed (see the report)"


def _print(rep: Mapping[str, Any]) -> None:
    b = rep["bench"]
    if b == "soak":
        print(f"hicache bench soak: {rep['clients']} clients x {rep['ops_per_client']} operations "
              f"(window {rep['window']}, mix {rep['mix']}, unit {rep['unit']}, 1..{rep['max_rows']}"
              f" rows), device {rep['device']}")
        # bytes and the split of a client's time are counted by --mix all's client only
        size = (f", {rep['verified_bytes'] / 1e9:.2f} GB" if rep.get("mix") == "all" else "")
        print(f"  {rep['ops']} operations in {rep['seconds']} s = {rep['ops_per_s']:.0f}/s: "
              f"{rep['backups']} backups, {rep['loads']} loads ({rep['verified_pages']} pages "
              f"verified{size}), {rep['swaps']} swaps, {rep['frees']} frees, "
              f"{rep['allocs']} allocs")
        split = rep.get("client_seconds") or {}
        where = (", ".join(f"{k} {v} s" for k, v in split.items()) if split else
                 "not split (--mix all splits it, and counts the bytes verified)")
        print(f"  clients set up in {rep.get('client_setup_s')} s (not timed); a client's time: "
              f"{where}")
        print(f"  lost acks {rep['lost_acks']}, failed ops {rep['failed_ops']}, corrupted pages "
              f"{rep['corrupted_pages']}, refused {rep['refused']}")
        print(f"  daemon RSS {rep['rss_warm_mib']} MiB after {rep['warmup_fraction']:.0%} -> "
              f"{rep['rss_end_mib']} MiB at the end: {rep['rss_growth_pct']}%")
        print("  RSS at each tenth of the operations (MiB): "
              + " ".join(str(x) for x in rep["rss_curve_mib"]))
        hm = rep.get("daemon_handler_ms") or {}
        if hm:
            print("  daemon's server thread per command, request to reply (mean ms, count): "
                  + ", ".join(f"{k} {v[1]} ({v[0]})" for k, v in sorted(hm.items())))
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
