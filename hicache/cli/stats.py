"""``hicache stats``: what a running daemon holds, for an operator.

``hicache stats [--socket ADDR | --device DEV | --config-file F] [--check] [--json]
[--timeout S] [--curve-server-key F --curve-secret-key F]`` asks the daemon on ``ADDR``
(default: the socket ``hicache serve`` picks from the same sources: ``HICACHE_SOCKET``, else the
default socket of ``--device``, itself defaulting to ``HICACHE_DEVICE`` or cpu, each over the
``socket`` / ``device`` of the settings file, ``--config-file`` or ``HICACHE_CONFIG_FILE``;
``config.served_address``) for its ``stats``: a short summary (clients, operations in
flight, a GPU daemon's loaded copy kernel variants, host rows per index space, rows waiting to
be freed, L3 and key store), or with ``--json`` the whole reply. ``--check``
adds the allocators' invariant check (O(rows)). The probe never registers and holds nothing,
so the daemon forgets it as it answers: the clients it reports are the others.

A ``HICACHE_*`` variable in the environment that names no setting (a misspelled
``HICACHE_SOCKET``, say) is refused before the probe (``config.check_env``, from
``hicache.cli.main``): it would otherwise send the probe to another daemon's socket.

Exit status: 0 when the daemon answered (and, with ``--check``, its invariants hold), 1 when
the check failed, the daemon refused (say, it is shutting down), no daemon answered within
``--timeout`` seconds (default 5), or an ``ipc://`` socket's path does not exist (or is no
socket: reported at once, without the wait) — one line naming the socket; 2 for a malformed
address or option.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
from typing import Any

from hicache.core.errors import UsageError


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--socket", help="the daemon's address (default: HICACHE_SOCKET, else "
                                    "--device's default socket)")
    p.add_argument("--device", help="cuda:N or cpu: names the default socket (default: "
                                    "HICACHE_DEVICE, else cpu)")
    p.add_argument("--config-file", help="the daemon's settings file: its socket or device "
                                         "names the socket (default: HICACHE_CONFIG_FILE)")
    p.add_argument("--check", action="store_true", help="also run the invariant check (O(rows))")
    p.add_argument("--json", action="store_true", help="print the whole stats reply as JSON")
    p.add_argument("--timeout", type=float, default=5.0,
                   help="seconds to wait for the daemon (default: 5)")
    p.add_argument("--curve-server-key", help="the daemon's public CURVE key file (a daemon "
                                              "started with --curve-secret-key answers only "
                                              "CURVE clients; with --curve-secret-key)")
    p.add_argument("--curve-secret-key", help="this client's CURVE key file (zmq.auth "
                                              "format; its public key in the daemon's "
                                              "--curve-clients folder)")


def summary(s: dict[str, Any]) -> str:
    """A few lines an operator reads: who is connected, what is moving, what is used."""
    d = s.get("daemon")
    lines = [f"device {s.get('device')}: " + (
        f"{d['model']} stage {d['stage'][0]}/{d['stage'][1]} layers [{d['layers'][0]}, "
        f"{d['layers'][1]}), swa {d['swa_mode']}, host split {d['host_split']}; pid "
        f"{d['pid']}, hicache {d['version']}, up {d['uptime_s']} s"
        if d else "(a daemon that does not say what it serves)"),
        f"  {s.get('clients')} clients, {s.get('workers')} workers, "
        f"{s.get('in_flight')} operations in flight, {s.get('channels')} channels"]
    variants = s.get("kernel_variants")
    if variants:  # a GPU daemon: a count that grows after register means a copy compiled
        lines.append("  copy kernel variants loaded: "
                     + ", ".join(f"{k} {n}" for k, n in variants.items()))
    for label, rows in s.get("worker_rows", {}).items():
        lines.append(f"  worker {label}: device rows "
                     + ", ".join(f"{k}={n}" for k, n in sorted(rows.items())))
    pending = s.get("pending_free", {})
    for space, a in s.get("host", {}).get("spaces", {}).items():
        lines.append(f"  host {space}: {a['used']} of {a['rows']} rows allocated (of them "
                     f"{pending.get(space, 0)} waiting to be freed), {a['free']} free in "
                     f"{a['free_runs']} run{'' if a['free_runs'] == 1 else 's'} "
                     f"(mean {a['mean_free_run']:.1f})")
    if "l3" in s:
        l3 = s["l3"]
        why = f" ({l3['why']})" if l3.get("why") else ""
        lines.append(f"  l3: {l3.get('state')}{why}; master {l3.get('master')}, put queue "
                     f"{l3.get('put_queue_pages')} pages")
        for queue, stuck in sorted((l3.get("stalled") or {}).items()):
            lines.append(f"  l3 {queue} worker stalled: {stuck}; its jobs are answered as "
                         f"misses until that call returns")
    if "kv_store" in s:
        kv = s["kv_store"]
        lines.append(f"  key store: entries {kv.get('entries')}")
    if "invariants" in s:
        lines.append(f"  invariants: {s['invariants']}")
    return "\n".join(lines)


TIMEOUT_MAX_S = 3600.0


def _no_socket(address: str) -> str | None:
    """Why an ``ipc://`` address cannot have a daemon behind it (its path does not exist, or is
    no socket), else None: the probe then reports at once instead of waiting ``--timeout``. A
    socket that exists but does not answer (a daemon hung, or killed without removing it) still
    waits."""
    import stat

    if not address.startswith("ipc://"):
        return None
    path = address[len("ipc://"):]
    try:
        st = os.stat(path)
    except FileNotFoundError:
        from hicache.controllers.preflight import socket_locked

        if socket_locked(path):  # (a /tmp cleaner removed it: the daemon serves nobody now)
            return (f"no socket at {path}, but a daemon holds its lock {path}.lock: its socket "
                    f"file was removed while it ran; a running daemon binds it again at its "
                    f"next housekeeping (every half second), so one that has not is stopped "
                    f"or hung, or cannot bind (its log says why); restart it")
        return f"no socket at {path} (is the daemon running?)"
    except OSError:  # a folder this user cannot search: let the probe say what it can
        return None
    if not stat.S_ISSOCK(st.st_mode):
        return f"{path} is not a socket (no daemon serves it)"
    return None


def run(args: argparse.Namespace) -> int:
    from hicache.core.addresses import check_address
    from hicache.core.config import check_device, default_socket, served_socket
    from hicache.engine.acks import CommandRefused, DaemonUnreachable
    from hicache.engine.client import Client, curve_keys, gone_reason

    if not 0 < args.timeout <= TIMEOUT_MAX_S:
        raise UsageError(f"--timeout must be in (0, {TIMEOUT_MAX_S}] seconds, got {args.timeout}")
    if sum(x is not None for x in (args.device, args.socket, args.config_file)) > 1:
        raise UsageError("give one of --socket, --device (its daemon's default socket) and "
                         "--config-file (the daemon's settings)")
    if args.device:
        check_device(args.device)
    named = bool(args.socket)
    if args.socket:
        address = args.socket
    elif args.device:
        address = default_socket(args.device)
    else:
        address, named = served_socket(args.config_file, strict=True)
    keys = (args.curve_server_key, args.curve_secret_key)
    if (keys[0] is None) != (keys[1] is None):
        raise UsageError("CURVE needs both --curve-server-key and --curve-secret-key")
    curve = keys[0] is not None
    if curve:  # a key file that cannot be used: said before any daemon is probed or asked
        try:
            curve_keys(keys[0], keys[1])
        except ValueError as e:
            raise UsageError(str(e)) from None
    check_address(address, allow_remote=True, curve=True)  # malformed: one line, exit 2
    if not curve:
        try:
            check_address(address)
        except UsageError:  # a remote daemon serves CURVE clients only
            raise UsageError(f"{address} is not a loopback address: a daemon there answers "
                             f"CURVE clients only; give --curve-server-key and "
                             f"--curve-secret-key") from None
    missing = _no_socket(address)
    if missing:  # nothing to wait for: no daemon made this socket (or it is gone)
        hint = ("" if named else
                "; this is the default socket, which follows XDG_RUNTIME_DIR and the device "
                "(a daemon started from another login, a unit or cron has another): give "
                "--socket as its start-up summary prints it")
        print(f"hicache stats: {missing}{hint}", file=sys.stderr)
        return 1
    gone = gone_reason(address)  # a socket file nothing listens on: a killed daemon's
    if gone:
        print(f"hicache stats: no daemon on {address}: {gone}", file=sys.stderr)
        return 1
    try:
        with Client(address, timeout=args.timeout, name="hicache-stats", channel=False,
                    curve_server_key=keys[0], curve_secret_key=keys[1]) as c:
            s, _ = c.call("stats", {"check": True} if args.check else None)
    except DaemonUnreachable:
        hint = ("; a daemon with CURVE keys answers only a client that gives "
                "--curve-server-key and --curve-secret-key"
                if address.startswith("tcp://") and not curve else "")
        print(f"hicache stats: no daemon answered on {address} within {args.timeout:g} s"
              f"{hint}", file=sys.stderr)
        return 1
    except CommandRefused as e:
        print(f"hicache stats: the daemon on {address} refused: {e}", file=sys.stderr)
        return 1
    except ValueError as e:  # a key file that cannot be read or holds no key (it says which)
        raise UsageError(str(e)) from None
    print(json.dumps(s, indent=1, sort_keys=True) if args.json else summary(s))
    return 1 if args.check and s.get("invariants") != "ok" else 0
