"""``hicache serve``: run the per-GPU host-offload daemon until a stop signal or ``shutdown``.

Settings come from defaults < ``--config-file`` (TOML) < ``HICACHE_*`` environment < flags; the
flags are built from ``hicache.core.config.SETTINGS`` (docs/config.md has the table). A
``HICACHE_*`` variable that names no setting, a setting given (even at its default) where it does
not apply, and an abbreviated flag are refused. Model, stage, sizing, the socket address, CURVE
keys, a tcp port and the NUMA node are checked next (``controllers.preflight``), before the
daemon's modules (and torch) load, so such a refusal comes at once. The daemon checks the
device, the socket folder and the metrics port before it allocates, then pins the whole host
pool, so an overcommit fails at start-up. The planner's warnings for the served
stage are printed (``hicache serve: warning: ...`` on stderr), not refused. With ``--l3
mooncake`` and a loopback ``--l3-local-host`` the process first executes itself again with the
loopback bind shim preloaded (``_loopback_mooncake``). Every refusal is one line
``hicache serve: error: ...`` and exit status 2. ``--check`` runs the checks before torch
loads (with ``--l3 mooncake`` also whether the master and the metadata server answer now: a
warning when not, as a daemon would still start), prints one line of what the daemon would
serve and exits 0 (``check_only``).

Stopping: SIGINT, SIGTERM or SIGHUP drain in-flight transfers, close the socket and unmap the
pool, print ``hicache serve: stopped by SIGNAL`` and exit 128 + signal; the ``shutdown`` command
exits 0. With ``--parent-pid`` the daemon stops the same way when that process is gone. Once
the daemon has released everything, the process ends at once (``lifecycle.exit_now``).
"""
from __future__ import annotations

import argparse
import logging
import os
import re
import sys
from typing import Any

from hicache.cli.plan import negatives_as_values
from hicache.core.config import BOOL_FIELDS, SETTINGS, default_text, tp_note
from hicache.core.errors import UsageError


_BRACKETED = re.compile(r"\s\[[^\[\]]*\]$")  # a help that ends with its default in brackets


def add_arguments(p: argparse.ArgumentParser) -> None:
    negatives_as_values(p)
    groups: dict[str, Any] = {}
    for s in SETTINGS:
        if s.option is None:
            continue
        g = groups.get(s.group) or groups.setdefault(s.group, p.add_argument_group(s.group))
        shown = default_text(s.name)
        said = "default" in s.help or _BRACKETED.search(s.help)  # (a help ending "[auto]")
        text = s.help if not shown or said else f"{s.help} (default: {shown})"
        text = text.replace("%", "%%")
        if s.name in BOOL_FIELDS:  # --x / --no-x: a flag turns off what a file turned on
            g.add_argument(s.option, dest=s.name, action=argparse.BooleanOptionalAction,
                           default=None, help=text)
        else:
            g.add_argument(s.option, dest=s.name, metavar=s.name.split("_")[-1].upper(),
                           help=text)
        for alias in s.aliases:
            g.add_argument(alias, dest=s.name, help=argparse.SUPPRESS)
    p.add_argument("--config-file", metavar="TOML",
                   help="TOML file with these settings (top level or [serve]); also "
                        "HICACHE_CONFIG_FILE")
    p.add_argument("--check", action="store_true",
                   help="check the settings (every check before torch loads: values, parent, "
                        "model, stage, sizing, socket address and path, CURVE keys, ports, "
                        "NUMA node, memory), print what the daemon would serve, and exit (0: "
                        "they hold, 2: refused); nothing is allocated or created, and ports "
                        "are only probed")


def run(args: argparse.Namespace) -> int:
    from hicache.core.config import load_config

    flags: dict[str, Any] = {s.name: getattr(args, s.name, None) for s in SETTINGS}
    cfg = load_config(flags, getattr(args, "config_file", None))
    if getattr(args, "check", False):
        return check_only(cfg)
    _loopback_mooncake(cfg, getattr(args, "config_file", None)
                       or os.environ.get("HICACHE_CONFIG_FILE"))
    # the level is hicache's: torch's INFO lines (its FakeTensor cache stats at exit) stay out
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr,
                        format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    logging.getLogger("hicache").setLevel(cfg.log_level.upper())
    code = serve(cfg)
    from hicache.cli import lifecycle

    lifecycle.exit_now(code)  # everything is released: skip the interpreter's slow teardown
    return code


def check_only(cfg: Any) -> int:
    """``serve --check``: the preflight (``controllers.preflight``, no torch, nothing made),
    then one line of what the daemon would serve; a refusal is the usual one line, exit 2."""
    from hicache.controllers.preflight import preflight
    from hicache.core.config import with_source
    from hicache.core.sizes import arena_bytes, format_bytes

    try:
        pre = preflight(cfg, check=True)
    except UsageError as e:
        raise UsageError(with_source(str(e), cfg)) from None
    s = pre.sized
    stage = s.layout.stage
    segment = f" + L3 segment {format_bytes(cfg.l3_segment)}" if cfg.l3 != "off" else ""
    notes = list(pre.notes)
    if cfg.l3 == "mooncake":  # reachable now? (TCP and the metadata URL: never Mooncake's setup)
        from hicache.controllers.l3_store import endpoints_note, l3_settings

        ok, what = endpoints_note(l3_settings(cfg))
        if ok:
            segment += f"; L3: {what}"
        else:
            notes.append(f"L3: {what}: a daemon started now would serve with the L3 tier "
                         f"offline, retrying until it answers")
    print(f"hicache serve --check: the settings hold: {s.layout.model.name} stage "
          f"{stage.pp_rank}/{stage.pp_size} layers [{stage.start}, {stage.end}) on {cfg.device}"
          f"{tp_note(cfg)}; "
          f"device rows {', '.join(f'{k}={n}' for k, n in s.device_rows.items())} "
          f"({s.source}); host rows {', '.join(f'{k}={n}' for k, n in s.host_rows.items())}, "
          f"arena {format_bytes(arena_bytes(s.layout, s.host_rows))}{segment}; socket "
          f"{pre.address}; checked only when it starts: the device", flush=True)
    for w in (*_device_warning(cfg), *s.warnings, *notes):
        print(f"hicache serve: warning: {w}", file=sys.stderr, flush=True)
    return 0


def _loopback_mooncake(cfg: Any, config_file: str | None) -> None:
    """``--l3 mooncake`` with a loopback ``--l3-local-host``: Mooncake binds its client's
    listeners to every interface whatever it is told (docs/l3.md), so this process executes
    itself once more, same arguments, with the loopback bind shim preloaded
    (``core.bind_shim.daemon_exec_env``), before anything is allocated. The summary says where
    Mooncake listens (``bind_shim.listen_note``), also when the shim could not be applied."""
    if cfg.l3 != "mooncake":
        return
    from hicache.core import bind_shim

    argv, why = _own_command_line(config_file)
    env = bind_shim.daemon_exec_env(cfg.l3_local_host, os.environ)
    if env is None:
        return
    if argv is None:
        bind_shim.shim_problem = why
        return
    sys.stdout.flush()
    sys.stderr.flush()
    try:
        os.execve(sys.executable, [sys.executable, *argv], {**os.environ, **env})
    except OSError as e:
        bind_shim.shim_problem = f"cannot execute {sys.executable} again: {e.strerror}"


def _own_command_line(config_file: str | None) -> tuple[list[str] | None, str]:
    """The interpreter's arguments that run this same ``serve`` again (``python -m hicache.cli
    serve ...`` or the ``hicache`` script), or None and why not: serve called in-process
    (``main([...])``: an exec would replace the caller), a program read from stdin or ``-c``,
    or a settings file that cannot be read twice (a pipe, ``/dev/stdin``)."""
    import hicache.cli as cli

    orig, args = list(sys.orig_argv[1:]), sys.argv[1:]
    if not cli.from_command_line or not args or orig[len(orig) - len(args):] != args:
        return None, "serve was not started from its own command line (called in-process)"
    if orig[:2] != ["-m", "hicache.cli"] and not os.path.isfile(sys.argv[0]):
        return None, f"serve was started as {sys.argv[0]!r}, which cannot be run again"
    if config_file and not os.path.isfile(config_file):
        return None, (f"the settings file {config_file} is not a regular file (it would be read "
                      f"twice)")
    return orig, ""


def _set_dumpable(on: bool) -> str:
    """Make this process (not) dumpable (``core.dumpable``); the line that says which."""
    from hicache.core.dumpable import is_dumpable, set_dumpable

    try:
        set_dumpable(on)
    except OSError as e:
        raise UsageError(f"--dumpable {'on' if on else 'off'}: cannot set it ({e})") from None
    if is_dumpable():
        return ("dumpable (--dumpable): processes of this uid can read its memory and open its "
                "descriptors")
    return ("not dumpable: no other process of this uid can read its memory or open its "
            "descriptors (--dumpable for a debugger)")


def _say(line: str, err: bool = False) -> None:
    """One line to stdout (``err``: stderr), flushed. A stream whose reader went away (``serve
    ... | grep -m1 ready``) costs the line, never the daemon or its exit status: stdout is
    pointed at /dev/null then and the line goes to stderr instead."""
    try:
        print(line, file=sys.stderr if err else sys.stdout, flush=True)
    except OSError:
        if err:
            return
        try:
            os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())
        except (OSError, ValueError):
            pass
        _say(line, err=True)


def visible_gpus() -> int:
    """NVIDIA GPUs this process could use, read from the driver's /proc files (no CUDA
    initialisation in a CPU-mode daemon); 0 when ``CUDA_VISIBLE_DEVICES`` hides them all."""
    hidden = os.environ.get("CUDA_VISIBLE_DEVICES")
    if hidden is not None and hidden.strip() in ("", "-1"):
        return 0
    try:
        return len(os.listdir("/proc/driver/nvidia/gpus"))
    except OSError:
        return 0


def _device_warning(cfg: Any) -> list[str]:
    """A daemon left in CPU mode by default (no ``--device``) on a host whose GPUs are
    visible: said, since a per-GPU daemon is what such a host most likely wanted (the engine
    looks for it at another socket)."""
    from hicache.core.config import given

    if cfg.device != "cpu" or given(cfg, "device"):
        return []
    n = visible_gpus()
    if not n:
        return []
    return [f"--device not given: serving in CPU mode, though {n} CUDA device(s) are "
            f"visible; a GPU's daemon takes --device cuda:N"]


def serve(cfg: Any) -> int:
    from hicache.cli import lifecycle
    from hicache.cli.malloc import fix_mmap_threshold
    from hicache.controllers.preflight import preflight
    from hicache.core.config import with_source

    malloc = fix_mmap_threshold()  # before the daemon allocates; said with the summary

    dumpable = _set_dumpable(bool(cfg.dumpable))  # before any client's memory exists
    try:  # parent, sizing, address, keys, ports, NUMA, socket path and memory: refused before
        pre = preflight(cfg)  # torch loads (0.1 s, not 2)
    except UsageError as e:
        raise UsageError(with_source(str(e), cfg)) from None
    if cfg.parent_pid is not None:  # a launcher's daemon (checked: its parent): stop with it
        lifecycle.exit_with_parent(cfg.parent_pid, lifecycle.signal_self())
    with lifecycle.deferred():  # torch loads here: a signal meanwhile comes right after
        from hicache.controllers.daemon import Daemon, start_error
    warnings = _device_warning(cfg)

    try:
        daemon = Daemon(cfg, pre)
    except Exception as e:  # noqa: BLE001 - OSError / ArenaError at start-up: one line
        err = start_error(e)
        if isinstance(err, UsageError):  # naming where the settings it names came from
            err = UsageError(with_source(str(err), cfg))
        raise err from None
    got: list[int] = []

    def on_signal(signum: int) -> None:
        got.append(signum)
        daemon.stop()

    # the stop's clean-up (draining copies, up to ~45 s) runs under the same handler: a second
    # signal meanwhile (a launcher's death signal after a Ctrl-C, a supervisor repeating
    # SIGTERM) is recorded, not raised, so the socket and its lock still go
    with lifecycle.on_signals(on_signal):
        try:
            if not got:  # else a stop signal came while it started: it stops, never ready
                _say(daemon.summary())
                # the planner's warnings for this stage, worded as `hicache plan` prints them;
                # printed, not refused: the daemon mirrors whatever rows the engine has
                for w in [*warnings, *daemon.start_warnings]:
                    _say(f"hicache serve: warning: {w}", err=True)
                _say(f"hicache serve: {malloc}")
                _say(f"hicache serve: {dumpable}")
                _say("hicache serve: ready")
                daemon.serve()
        finally:
            daemon.close()
    if got:
        why = f"by {lifecycle.signal_name(got[0])}"
        if cfg.parent_pid is not None and os.getppid() != cfg.parent_pid:  # (its watchdog's
            why += f": its parent process {cfg.parent_pid} exited"  # or the kernel's signal)
        _say(f"hicache serve: stopped {why}")
        return lifecycle.exit_code(got[0])
    by = daemon.state.stopped_by
    _say(f"hicache serve: stopped by {by}" if by else "hicache serve: stopped")
    return 0
