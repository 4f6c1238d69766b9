"""How every ``hicache`` command stops: interrupts, parent death and worker processes.

Contract:

* ``install()`` (called by ``hicache.cli.main``, undone by ``restore`` when it returns): SIGINT, SIGTERM and SIGHUP raise
  ``Interrupted(signum)`` in the main thread, so every ``finally`` of the running command runs
  (children stopped, shared memory unlinked, private folders removed). Only the first signal
  raises; later ones are ignored while its clean-up runs, so that the clean-up is not itself
  interrupted (a signal whose ``Interrupted`` C code cleared, as ``import torch`` can, does not
  count: the next one raises again). ``main`` then prints
  one line and exits with ``exit_code(signum)`` = 128 + signum (130 SIGINT, 143 SIGTERM,
  129 SIGHUP). A process started with SIGHUP ignored (``nohup``) keeps ignoring it.
* ``deferred()``: stop signals inside the block are held and delivered when it ends (imports
  of C extensions, where a handler's exception can be dropped or abort the process).
* ``on_signals(handler)``: a command with its own orderly stop (``serve``) swaps the raising
  handler for ``handler(signum)`` while it runs, and gets the raising one back on exit; a signal
  that came before and whose ``Interrupted`` was cleared is handed to ``handler`` at once.
* ``exit_with_parent(ppid, stop)``: the calling process calls ``stop()`` once its parent
  ``ppid`` is gone: Linux ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` (delivered when the parent's
  launching thread exits) and a watchdog thread that polls ``os.getppid()`` every
  ``WATCHDOG_S`` (any POSIX system; also covers a parent that died before the prctl).
* ``quiet_worker(ppid)``: for worker processes of a bench: SIGINT and SIGHUP ignored (the parent
  decides), SIGTERM raises ``SystemExit(143)`` (``finally`` blocks run, no traceback), and the
  worker exits when the parent dies.
* ``exit_now(code)``: end a process whose command has already released everything it owns
  (``serve`` after its orderly stop): output flushed, logging shut down, then ``os._exit`` without
  the interpreter's finalization (on a 2-core VM, collecting the heap torch leaves and running
  its library finalizers took 1.1-1.4 s of every daemon stop, after the daemon was done).
"""
from __future__ import annotations

import contextlib
import ctypes
import ctypes.util
import logging
import os
import signal
import sys
import threading
from typing import Any, Callable, Iterator

SIGNALS = (signal.SIGINT, signal.SIGTERM, signal.SIGHUP)
WATCHDOG_S = 0.5
PR_SET_PDEATHSIG = 1


class Interrupted(BaseException):
    """A stop signal arrived; ``signum`` says which (BaseException: ``except Exception`` in a
    command does not swallow it)."""

    def __init__(self, signum: int) -> None:
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


def exit_code(signum: int) -> int:
    return 128 + int(signum)


def signal_name(signum: int) -> str:
    return signal.Signals(signum).name


_fired: list[int] = []


def _raise(signum: int, frame: Any) -> None:
    if _fired and _interrupt_handled():
        return  # clean-up of the first one is running: let it finish
    _fired.append(signum)
    raise Interrupted(signum)


def _interrupt_handled() -> bool:
    """Whether an ``Interrupted`` is being handled where the signal came (its ``finally`` and
    ``except`` blocks, and what they raised and caught meanwhile). Not so when C code cleared
    it: ``import torch`` imports numpy from C and drops an exception raised there, which used
    to leave every later stop signal ignored."""
    e = sys.exc_info()[1]
    while e is not None:
        if isinstance(e, Interrupted):
            return True
        e = e.__context__
    return False


def install() -> dict[int, Any]:
    """Route SIGINT / SIGTERM / SIGHUP to ``Interrupted`` (main thread only); returns the
    previous handlers for ``restore``."""
    _fired.clear()
    if threading.current_thread() is not threading.main_thread():
        return {}
    return {s: signal.signal(s, _raise) for s in _stop_signals()}


def _stop_signals() -> list[int]:
    """``SIGNALS``, less SIGHUP when this process started with it ignored (``nohup``: the
    operator asked to outlive the terminal)."""
    return [s for s in SIGNALS
            if not (s == signal.SIGHUP and signal.getsignal(s) is signal.SIG_IGN)]


def restore(old: dict[int, Any]) -> None:
    """Put back the handlers ``install`` replaced (``main`` called in-process, e.g. by tests)."""
    for s, h in old.items():
        signal.signal(s, h)


@contextlib.contextmanager
def deferred() -> Iterator[None]:
    """Stop signals that arrive inside are recorded, and the first is raised again once the
    block ends, to the handler there was before: for imports of C extensions (``import
    torch``), where an exception raised by a handler in the middle of their C code is dropped,
    or ends the process (SIGABRT, seen during ``serve``'s start-up)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    got: list[int] = []
    old = {s: signal.signal(s, lambda signum, frame: got.append(signum))
           for s in _stop_signals()}
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)
    if got:
        signal.raise_signal(got[0])


class on_signals:
    """``with on_signals(handler):`` run ``handler(signum)`` on a stop signal instead of raising."""

    def __init__(self, handler: Callable[[int], None]) -> None:
        self.handler = handler
        self.old: dict[int, Any] = {}

    def __enter__(self) -> "on_signals":
        for s in _stop_signals():
            self.old[s] = signal.signal(s, lambda signum, frame: self.handler(signum))
        if _fired:  # raised earlier and cleared by C code (``_interrupt_handled``): it still
            self.handler(_fired[0])  # stops the command
        return self

    def __exit__(self, *exc: object) -> None:
        for s, h in self.old.items():
            signal.signal(s, h)


def _pdeathsig(sig: int) -> bool:
    """Ask Linux to send ``sig`` when the parent exits; False where prctl is not available."""
    if not sys.platform.startswith("linux"):
        return False
    try:
        libc = ctypes.CDLL(ctypes.util.find_library("c") or "libc.so.6", use_errno=True)
        return libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) == 0
    except (OSError, AttributeError):
        return False


def exit_with_parent(ppid: int, stop: Callable[[], None],
                     sig: int = signal.SIGTERM) -> threading.Thread:
    """Call ``stop()`` (from a watchdog thread) once ``ppid`` is no longer our parent; also
    set the kernel's parent-death signal to ``sig``. Returns the watchdog thread."""
    _pdeathsig(sig)
    done = threading.Event()

    def watch() -> None:
        while os.getppid() == ppid:
            if done.wait(WATCHDOG_S):
                return
        stop()

    t = threading.Thread(target=watch, name="parent-watchdog", daemon=True)
    t.start()
    return t


def signal_self(sig: int = signal.SIGTERM) -> Callable[[], None]:
    """A ``stop`` for ``exit_with_parent`` that takes the process's own signal path."""
    return lambda: os.kill(os.getpid(), sig)


def _exit_on_term(signum: int, frame: Any) -> None:
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    raise SystemExit(exit_code(signum))


def quiet_worker(ppid: int | None = None) -> None:
    """Signal set-up of a bench worker process (see the module docstring)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGHUP, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, _exit_on_term)
    if ppid is not None:
        exit_with_parent(ppid, signal_self(signal.SIGTERM))


def exit_now(code: int) -> None:
    """Flush stdout, stderr and logging, then ``os._exit(code)`` (see the module docstring):
    only for a process that owns nothing more (no child, no file or socket left to remove)."""
    logging.shutdown()
    for f in (sys.stdout, sys.stderr):
        try:
            f.flush()
        except (OSError, ValueError):  # a closed or broken pipe: nothing left to say there
            pass
    os._exit(code)
