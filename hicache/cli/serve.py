"""``hicache serve``: run the per-GPU host-offload daemon until SIGTERM / SIGINT / ``shutdown``.

Settings come from defaults < ``--config-file`` (TOML) < ``HICACHE_*`` environment < flags
(see ``hicache.core.config``). Start-up pins the whole host pool, so an overcommit fails here.
"""
from __future__ import annotations

import argparse
import logging
import signal
import sys
from typing import Any


def add_arguments(p: argparse.ArgumentParser) -> None:
    g = p.add_argument_group("daemon")
    g.add_argument("--device", help="cuda:N or cpu (default cpu)")
    g.add_argument("--socket", help="ipc://PATH (default: a 0600 socket in a 0700 runtime dir) "
                                    "or tcp://127.0.0.1:PORT")
    g.add_argument("--allow-remote", action="store_true", default=None,
                   help="accept non-loopback addresses (needs --curve-secret-key and "
                        "--curve-clients)")
    g.add_argument("--curve-secret-key", help="the daemon's CURVE secret key file (mode 0600; "
                                              "zmq.auth certificate format)")
    g.add_argument("--curve-clients", help="directory of allowed clients' CURVE public .key "
                                           "files")
    g.add_argument("--config-file", help="TOML file with these settings (top level or [serve])")
    g.add_argument("--heartbeat-timeout", type=float,
                   help="seconds of silence after which a client is reaped (default 10)")
    g.add_argument("--metrics-port", type=int, help="Prometheus /metrics port (0 = off)")
    g.add_argument("--metrics-addr", help="address the metrics endpoint binds (default 127.0.0.1)")
    g.add_argument("--log-level", help="debug, info, warning or error (default info)")
    g.add_argument("--spin-us", type=float,
                   help="busy-poll this many microseconds after a request before sleeping "
                        "(lower latency, more CPU; default 0)")
    m = p.add_argument_group("layout served")
    m.add_argument("--preset", help="model preset: dsv4-flash, dsv4-pro, dsv4-tiny")
    m.add_argument("--config", help="model config.json (instead of --preset)")
    m.add_argument("--pp-size", type=int)
    m.add_argument("--pp-rank", type=int)
    m.add_argument("--swa-mode", choices=("paged", "ring"))
    m.add_argument("--c128-state", choices=("online", "offline"))
    m.add_argument("--mtp", action=argparse.BooleanOptionalAction, default=None,
                   help="include MTP draft layers on the last stage (default on)")
    h = p.add_argument_group("host memory")
    h.add_argument("--host-mem", help="host pool size, e.g. 64GiB")
    h.add_argument("--host-ratio", type=float, help="host rows = ratio x device rows")
    h.add_argument("--device-rows", help="device rows per index space, e.g. "
                                         "page=4096,swa_page=512,req_slot=64")
    h.add_argument("--sparse-rows", type=int, help="HiSparse: C4 page rows per C4 layer of the "
                   "sparse host region (0 = no sparse mode, the default)")
    h.add_argument("--min-sparse-prompt-len", type=int,
                   help="HiSparse: shortest prompt admitted to sparse mode (default 32768)")
    h.add_argument("--numa-node", help="auto (GPU's node), off, or a node number")
    h.add_argument("--touch-threads", type=int, help="threads first-touching the arena")
    h.add_argument("--zero-on-free", action="store_true", default=None,
                   help="zero host rows when they are freed (rows are unreadable until their "
                        "owner backs something up into them either way)")


FLAG_NAMES = ("device", "socket", "allow_remote", "heartbeat_timeout", "metrics_port",
              "metrics_addr", "log_level", "preset", "config", "pp_size", "pp_rank", "swa_mode",
              "c128_state", "mtp", "host_mem", "host_ratio", "device_rows", "numa_node",
              "touch_threads", "spin_us", "curve_secret_key", "curve_clients", "zero_on_free",
              "sparse_rows", "min_sparse_prompt_len")


def run(args: argparse.Namespace) -> int:
    from hicache.core.config import load_config

    flags: dict[str, Any] = {k: getattr(args, k, None) for k in FLAG_NAMES}
    cfg = load_config(flags, getattr(args, "config_file", None))
    logging.basicConfig(level=cfg.log_level.upper(), stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    return serve(cfg)


def serve(cfg: Any) -> int:
    from hicache.controllers.daemon import Daemon

    daemon = Daemon(cfg)
    print(daemon.summary(), flush=True)

    def on_signal(signum: int, frame: Any) -> None:
        daemon.stop()

    old = {s: signal.signal(s, on_signal) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        print("hicache serve: ready", flush=True)
        daemon.serve()
    finally:
        daemon.close()
        for s, h in old.items():
            signal.signal(s, h)
    print("hicache serve: stopped", flush=True)
    return 0
