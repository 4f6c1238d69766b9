"""``hicache bench fuzz``: malformed and hostile messages against a live CPU-mode daemon.

Starts a daemon subprocess (CPU mode, ``--preset``, small pools) on a private ipc socket, then
``hicache.fuzz.runner.run_fuzz``: a victim backs up rows with known content, an attacker, an
unregistered stranger and an unregistered-again ghost send ``--messages`` hostile messages
(random bytes, truncated and extra frames, wrong types, huge counts, negative, duplicate and
out-of-range ids, unknown pools, mismatched lengths, double frees, use after free, commands
before register and after unregister, another client's rows, bad registrations, oversize
frames). Every message must get an error reply within ``--reply-timeout``; afterwards the
daemon must answer, its host row accounting and allocator invariants must hold, its error
metric must have counted every refusal, the victim's rows must load back byte for byte, and
no row may stay used once everyone unregistered. The daemon is then stopped with SIGTERM and
must exit 0 with no traceback in its log. ``--channel``: the daemon busy-polls and the attacker
and the stranger send through shared-memory channels (``hicache.core.channel``), so the
hostile messages that fit a slot enter the daemon there.

Exit status 0 when every check holds, 1 when any fails (``failed_checks`` names them: a
hostile message accepted, an unexpected error code, the errors metric not matching ...). ``--json`` prints one object with at least
``messages``, ``error_replies``, ``unanswered``, ``daemon_alive``, ``invariants_ok``,
``seconds``.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--messages", type=int, default=10_000, help="hostile messages (default 10000)")
    p.add_argument("--seed", type=int, default=0, help="random seed (default 0)")
    p.add_argument("--json", action="store_true", help="print one JSON object")
    p.add_argument("--preset", default="dsv4-tiny", help="layout the daemon serves")
    p.add_argument("--reply-timeout", type=float, default=5.0,
                   help="seconds a message may wait for its reply (default 5)")
    p.add_argument("--time-limit", type=float, default=None,
                   help="stop sending after this many seconds (reported)")
    p.add_argument("--keep-log", action="store_true", help="print the daemon log path, keep it")
    p.add_argument("--channel", action="store_true",
                   help="the daemon busy-polls (--spin-us 2000) and the attacker and stranger "
                        "send through shared-memory channels")


def run(args: argparse.Namespace) -> int:
    from hicache.core.errors import UsageError
    from hicache.fuzz.runner import SPARSE_FLAGS, DaemonRunner, private_address, run_fuzz
    from hicache.core.layout import build_layout, preset

    if args.messages < 1 or not 0 < args.reply_timeout < float("inf"):
        raise UsageError("--messages must be positive and --reply-timeout above 0")
    if args.time_limit is not None and not 0 < args.time_limit < float("inf"):
        raise UsageError(f"--time-limit must be a positive number of seconds, got "
                         f"{args.time_limit}")
    layout = build_layout(preset(args.preset))
    address, tmp = private_address("hcf-")
    log = os.path.join(tmp, "daemon.log")
    rows = "page=16,swa_page=8,req_slot=4"
    runner = DaemonRunner(address, preset_name=args.preset, device_rows=rows,
                          heartbeat_timeout=60.0, log_path=log,
                          extra=SPARSE_FLAGS + (("--spin-us", "2000") if args.channel else ()))
    report: dict[str, Any] = {}
    try:
        runner.start()

        def progress(n: int, counts: dict[str, Any]) -> None:
            if not args.json and n % 5000 == 0:
                print(f"  {n} messages, {counts['error_replies']} error replies, "
                      f"{counts['unanswered']} unanswered", file=sys.stderr, flush=True)

        report = run_fuzz(address, args.messages, seed=args.seed, layout=layout,
                          reply_timeout=args.reply_timeout, time_limit=args.time_limit,
                          daemon_pid=runner.pid, channel=args.channel, progress=progress)
    finally:
        code = runner.stop()
        out = runner.output()
        report["daemon_exit_code"] = code
        report["daemon_tracebacks"] = out.count("Traceback")
        if args.keep_log:
            report["daemon_log"] = log
        else:
            shutil.rmtree(tmp, ignore_errors=True)
    failed = list(report.get("failed_checks", ["the fuzz run did not finish"]))
    if not runner.clean_exit(code):
        failed.append(f"daemon exit code {code}")
    if report["daemon_tracebacks"]:
        failed.append("tracebacks in the daemon log")
    report["failed_checks"] = failed
    ok = not failed
    report["ok"] = ok
    if args.json:
        print(json.dumps(report))
        return 0 if ok else 1
    print(f"hicache bench fuzz: {report['messages']} hostile messages (+{report['setup_messages']} "
          f"set-up) in {report['fuzz_seconds']} s = {report['messages_per_s']:.0f}/s, "
          f"seed {args.seed}, preset {args.preset}, CPU mode")
    print(f"  error replies {report['error_replies']}, accepted {report['ok_replies']}, "
          f"unanswered {report['unanswered']}, internal errors {report['internal_errors']}, "
          f"codes other than expected {report['unexpected_codes']}")
    print("  codes: " + ", ".join(f"{k} {v}" for k, v in report["codes"].items()))
    print(f"  daemon alive {report['daemon_alive']}, invariants ok {report['invariants_ok']} "
          f"(allocator check: {report['deep_check']}), errors metric +"
          f"{report['metrics_errors_delta']:.0f} ({'matches' if report['metrics_match'] else 'MISMATCH'})")
    print(f"  victim rows {report['victim_rows_checked']}, corrupted "
          f"{report['victim_rows_corrupted']}; rows left used after unregister "
          f"{report['leaked_rows']}; daemon exit {code}, tracebacks {report['daemon_tracebacks']}")
    for p in report.get("invariant_problems", []):
        print(f"  PROBLEM: {p}")
    for e in report.get("examples", [])[:10]:
        print(f"  EXAMPLE {e['problem']}: {e['case']} via {e['peer']}, expected "
              f"{e['expected']}: {str(e['reply'])[:200]}")
    print("  PASS" if ok else "  FAIL: " + "; ".join(failed))
    return 0 if ok else 1
