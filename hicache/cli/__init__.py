"""The ``hicache`` command line: one sub-command per module, imported only when used.

Each command module exposes ``add_arguments(parser)`` and ``run(args) -> int``. Errors a user
caused (``UsageError``, ``LayoutError``) print one line and exit 2; nothing else is swallowed.
SIGINT / SIGTERM / SIGHUP stop any command the same way (``hicache.cli.lifecycle``): its clean-up
runs, one line ``hicache CMD: interrupted by SIGNAL`` and exit status 128 + signal number. Output
piped into a reader that closes early (``| head``) ends quietly (exit 141, as SIGPIPE would).
``hicache`` alone prints the help; ``hicache --version`` the version.
Every parser (``_OneLine``, which the sub-commands' parsers are made with too) takes a long flag
only as spelled in full: ``--kv-me 1G`` is refused, not read as ``--kv-mem``. A command whose
process or daemon reads ``HICACHE_*`` settings from the environment (``ENV_COMMANDS``; ``serve``
checks in ``load_config``) refuses a ``HICACHE_*`` variable that names no setting
(``config.check_env``) before it starts anything.
"""
from __future__ import annotations

import argparse
import difflib
import importlib
import os
import re
import signal
import sys
from typing import Any, NoReturn, Sequence

from hicache.cli import lifecycle
from hicache.core.errors import UsageError
from hicache.core.layout import LayoutError
from hicache.core.stdout import broken_pipe, open_std_fds
from hicache.core.version import __version__

COMMANDS: dict[str, tuple[str, str]] = {
    "plan": ("hicache.cli.plan", "capacity plan: tokens that fit per stage, device and host pools"),
    "serve": ("hicache.cli.serve", "run the per-GPU host-offload daemon"),
    "demo": ("hicache.sim.demo", "daemon + simulated DSV4 worker replaying a multi-turn workload"),
    "stats": ("hicache.cli.stats", "what a running daemon holds (clients, rows, operations)"),
}
BENCHES: dict[str, tuple[str, str]] = {
    "pin": ("hicache.bench.pin", "bring up the pinned host arena vs torch's pinned allocator"),
    "transfer": ("hicache.bench.transfer", "GPU<->host copy paths vs the PCIe limit and peers"),
    "e2e": ("hicache.bench.e2e", "LOAD / BACKUP through the daemon as the engine sees them"),
    "control": ("hicache.bench.control", "control-plane latency of a live daemon (CPU mode)"),
    "fuzz": ("hicache.bench.fuzz", "hostile messages against a live daemon"),
    "soak": ("hicache.bench.soak", "sustained mixed load from many clients, with checksums"),
    "l3": ("hicache.bench.l3", "L3 (Mooncake Store) put/get through the daemon vs Mooncake alone"),
    "hisparse": ("hicache.bench.hisparse", "HiSparse swap-in per decode step vs the H2D limit"),
}


# commands that read settings from the environment (``stats``: HICACHE_SOCKET / _DEVICE) or
# start daemons that do (``demo``, ``bench``); ``serve`` checks in ``config.load_config``
ENV_COMMANDS = ("stats", "demo", "bench")


class _OneLine(argparse.ArgumentParser):
    """A parser whose refusals are one line (the usage block is what ``-h`` is for) and that
    takes no abbreviated long flag. ``add_subparsers`` makes its sub-parsers with this class, so
    every parser of the command line is one."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)  # "--kv-me" is a typo, not "--kv-mem"
        super().__init__(*args, **kwargs)

    def error(self, message: str) -> NoReturn:  # type: ignore[override]
        self.exit(2, f"{self.prog}: error: {message}{_choice_hint(message)} "
                     f"(see {self.prog} -h)\n")


def _choice_hint(message: str) -> str:
    """For argparse's "invalid choice: 'srve' (choose from ...)": the nearest choice, as
    ``_unrecognized`` names the nearest flag; else ""."""
    m = re.search(r"invalid choice: '?([^'(]*?)'? \(choose from (.*)\)$", message)
    if m is None:
        return ""
    choices = re.findall(r"'([^']*)'", m.group(2)) or \
        [c.strip() for c in m.group(2).split(",")]
    near = difflib.get_close_matches(m.group(1), choices, n=1)
    return f"; did you mean {near[0]}?" if near else ""


def _add(sub: argparse._SubParsersAction, name: str, module: str, help_: str) -> None:
    p = sub.add_parser(name, help=help_, description=help_)
    p.set_defaults(_module=module, _parser=p)
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        if e.name != module:
            raise
        p.set_defaults(_missing=f"'{name}' is not available in this build")
        return
    mod.add_arguments(p)


def build_parser(argv: Sequence[str]) -> argparse.ArgumentParser:
    parser = _OneLine(
        prog="hicache", description="hicache: a host-offload daemon for the hierarchical KV "
        "cache of LLM serving engines. Run `hicache COMMAND -h` for the options of a command.")
    parser.add_argument("--version", action="version", version=f"hicache {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND", required=True)
    wanted = argv[0] if argv else None
    for name, (module, help_) in COMMANDS.items():
        if wanted in (name, None, "-h", "--help"):
            _add(sub, name, module, help_)
        else:
            sub.add_parser(name, help=help_)
    bench = sub.add_parser("bench", help=f"benchmarks ({', '.join(BENCHES)})")
    bsub = bench.add_subparsers(dest="bench", metavar="BENCH", required=True)
    wanted_b = argv[1] if wanted == "bench" and len(argv) > 1 else None
    for name, (module, help_) in BENCHES.items():
        if wanted == "bench" and wanted_b in (name, None, "-h", "--help"):
            _add(bsub, name, module, help_)
        else:
            bsub.add_parser(name, help=help_)
    return parser


def _unrecognized(p: argparse.ArgumentParser, unknown: list[str]) -> NoReturn:
    """``p.error`` (one line) for arguments no parser took, naming the nearest flag of ``p`` to
    the first unknown flag (``--kv-me`` -> ``--kv-mem``)."""
    flags = [o for a in p._actions for o in a.option_strings if a.help != argparse.SUPPRESS]
    hint = ""
    for arg in unknown:
        if arg.startswith("--"):
            near = difflib.get_close_matches(arg.split("=", 1)[0], flags, n=1)
            hint = f"; did you mean {near[0]}?" if near else ""
            break
    p.error(f"unrecognized arguments: {' '.join(unknown)}{hint}")


# whether the running command was read from this process's own command line (``main()``),
# not passed in (``main([...])``): ``serve`` may then run it again (``serve._own_command_line``)
from_command_line = False


def main(argv: Sequence[str] | None = None) -> int:
    global from_command_line
    open_std_fds()  # before anything can print or open a file
    from_command_line = argv is None
    argv = list(sys.argv[1:] if argv is None else argv)
    prog = "hicache"
    # stop signals first: building the parser imports the command's module (a bench's imports
    # torch, ~2 s), and a Ctrl-C meanwhile is one line too, not a traceback or an abort
    old = lifecycle.install()
    try:
        try:
            with lifecycle.deferred():  # (held until the imports are done)
                parser = build_parser(argv)
            if not argv:
                parser.print_help()
                return 2
            args, unknown = parser.parse_known_args(argv)
            prog += "".join(f" {a}" for a in (args.command, getattr(args, "bench", None)) if a)
            if getattr(args, "_missing", None):  # (its flags are unknown: its module is)
                print(f"{prog}: error: {args._missing}", file=sys.stderr)
                return 2
            if unknown:  # refused by the command's own parser: its name, and the flag meant
                _unrecognized(getattr(args, "_parser", parser), unknown)
            if args.command in ENV_COMMANDS:
                from hicache.core.config import check_env

                check_env(os.environ)
            return int(importlib.import_module(args._module).run(args) or 0)
        finally:
            lifecycle.restore(old)
            sys.stdout.flush()
    except (UsageError, LayoutError) as e:
        print(f"{prog}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"{prog}: interrupted by SIGINT", file=sys.stderr)
        return lifecycle.exit_code(signal.SIGINT)
    except lifecycle.Interrupted as e:
        print(f"{prog}: interrupted by {lifecycle.signal_name(e.signum)}", file=sys.stderr)
        return lifecycle.exit_code(e.signum)
    except BrokenPipeError:
        return broken_pipe()


if __name__ == "__main__":
    sys.exit(main())
