"""One ``hicache serve`` subprocess, for the demo, the benches, the fuzzer and the tests.

Contract of ``DaemonProcess``:

* The constructor only builds the command line (``python -m hicache.cli serve ...``) from its
  arguments and the environment (``os.environ`` without ``serve``'s settings, which the caller
  gives as arguments: no ``HICACHE_*`` setting or ``HICACHE_CONFIG_FILE`` of the caller's
  shell reaches the daemon unless ``env`` names it; then ``env``, with this checkout first on
  ``PYTHONPATH``); nothing runs yet. With ``address=None`` it makes a private 0700 directory
  under /tmp (ipc paths are limited to ~100 bytes) and serves on ``ipc://<dir>/d.sock``;
  ``close()`` removes that directory.
* Output (stdout and stderr together) goes to ``log_path`` (appended to, so a restarted daemon
  keeps one log), or to a pipe (``pipe=True``; a thread drains it as the daemon writes, so a
  chatty daemon never blocks on a full pipe, keeping its last ``PIPE_KEEP`` bytes for
  ``output()``),
  or, with neither, to ``<private dir>/daemon.log`` when the directory is ours and else nowhere.
* ``start()`` launches it and returns once a heartbeat on ``address`` is answered. If the daemon
  exits first, or does not answer within ``ready_timeout`` seconds (it is then killed), it
  raises ``RuntimeError`` whose message ends with the tail of the daemon's output; a daemon that
  refused its settings (exit status 2, one line) raises ``DaemonRefused``, a ``UsageError``
  (and ``RuntimeError``) whose message is that line, so a command that starts one says it in
  one line and exits 2.
* ``restart()`` stops it and starts it again on the same address; ``kill()`` sends SIGKILL (as a
  crash would, no shutdown path runs); ``stop(sig, timeout)`` sends ``sig``, waits, falls back to
  SIGKILL and returns the exit code (``None`` if never started): a daemon that stopped in order
  exits 128 + ``sig`` (``clean_exit(code, sig)`` says whether ``code`` is that, or 0 after a
  ``shutdown`` command).
* Parent death: with ``exit_with_parent=True`` (the default) the daemon gets ``--parent-pid``
  of this process and stops in order (and unlinks its socket) within a second of this process
  dying, SIGKILL included (``hicache.cli.lifecycle.exit_with_parent``). Linux delivers the
  parent-death signal when the launching *thread* exits: start the daemon from a thread that
  outlives it (the main thread), or pass ``exit_with_parent=False``.
* ``client(**kw)``, ``alive()``, ``pid``, ``rss()``, ``output(tail)``, ``maps_path(path)``; as a
  context manager it starts on entry and ``close()``s (stop + private directory removed) on exit.

Nothing here is imported by the daemon; it talks to it only through the client.
"""
from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import weakref
from pathlib import Path
from typing import IO, Any, Mapping, Sequence

from hicache.core.config import without_serve_settings
from hicache.core.errors import UsageError

REFUSAL = "hicache serve: error: "  # how serve's one-line refusals begin (exit status 2)


class DaemonRefused(UsageError, RuntimeError):
    """The daemon refused the settings it was started with: ``str(e)`` is its one line
    (``the daemon refused to start: ...``), ``output`` all it printed."""

    def __init__(self, line: str, output: str) -> None:
        super().__init__(f"the daemon refused to start: {line}")
        self.output = output

ROOT = Path(__file__).resolve().parents[2]  # the checkout
PIPE_KEEP = 1 << 20  # bytes of a piped daemon's output kept for output()


def _remove_if_empty(folder: str) -> None:
    """Remove ``folder`` if it is empty (a daemon's socket and lock keep its own folder)."""
    try:
        os.rmdir(folder)
    except OSError:  # gone already, or not empty (a daemon's socket is in it)
        pass


class DaemonProcess:
    """``hicache serve`` in a subprocess; see the module docstring."""

    def __init__(self, address: str | None = None, *, device: str = "cpu",
                 preset: str = "dsv4-flash",
                 device_rows: str | Mapping[str, int] = "page=8,swa_page=4,req_slot=4",
                 host: Sequence[str] = ("--host-ratio", "2"),
                 heartbeat_timeout: float | None = 10.0, metrics_port: int | None = None,
                 log_level: str | None = None, extra: Sequence[str] = (),
                 env: Mapping[str, str] | None = None,
                 log_path: str | os.PathLike[str] | None = None, pipe: bool = False,
                 socket_flag: bool = True, cwd: str | os.PathLike[str] | None = None,
                 new_session: bool = False, ready_timeout: float = 60.0,
                 probe_kw: Mapping[str, Any] | None = None,
                 exit_with_parent: bool = True) -> None:
        """``host``: the host sizing flags (``--host-ratio R`` or ``--host-mem``/rows).
        ``heartbeat_timeout``/``metrics_port``/``log_level`` ``None``: flag left out (the
        daemon's default). ``socket_flag=False``: no ``--socket`` (the daemon's default address
        must then be ``address``). ``new_session``: the daemon gets its own session (a terminal's
        Ctrl-C does not reach it). ``probe_kw``: extra ``Client`` arguments of the readiness
        probe (e.g. CURVE keys)."""
        self.dir: str | None = None
        if address is None:
            self.dir = tempfile.mkdtemp(prefix="hc-", dir="/tmp")
            os.chmod(self.dir, 0o700)
            address = f"ipc://{self.dir}/d.sock"
            # one built and never closed leaves no empty folder behind (at its collection or
            # the interpreter's exit; never one a daemon still uses: only an empty one goes)
            weakref.finalize(self, _remove_if_empty, self.dir)
        self.address = address
        self.metrics_port = metrics_port
        if not isinstance(device_rows, str):
            device_rows = ",".join(f"{s}={n}" for s, n in device_rows.items())
        self.cmd: list[str] = [sys.executable, "-m", "hicache.cli", "serve", "--device", device,
                               "--preset", preset, "--device-rows", device_rows, *host]
        if socket_flag:
            self.cmd += ["--socket", address]
        if heartbeat_timeout is not None:
            self.cmd += ["--heartbeat-timeout", str(heartbeat_timeout)]
        if metrics_port is not None:
            self.cmd += ["--metrics-port", str(metrics_port)]
        if log_level is not None:
            self.cmd += ["--log-level", log_level]
        if exit_with_parent:
            self.cmd += ["--parent-pid", str(os.getpid())]
        self.cmd += list(extra)
        self.env: dict[str, str] = without_serve_settings(os.environ)
        self.env.update(env or {})
        self.env["PYTHONPATH"] = os.pathsep.join(
            p for p in (str(ROOT), self.env.get("PYTHONPATH")) if p)
        if log_path is None and not pipe and self.dir is not None:
            log_path = os.path.join(self.dir, "daemon.log")
        self.log_path: Path | None = Path(log_path) if log_path is not None else None
        self.pipe = pipe
        self.cwd = str(cwd) if cwd is not None else None
        self.new_session = new_session
        self.ready_timeout = ready_timeout
        self.probe_kw: dict[str, Any] = dict(probe_kw or {})
        self.proc: subprocess.Popen[bytes] | None = None
        self._signalled: int | None = None  # the stop signal sent to ``proc`` (signal_stop)
        self.starts = 0
        self._piped = b""
        self._reader: threading.Thread | None = None

    # ------------------------------------------------------------------------- state
    @property
    def pid(self) -> int | None:
        return self.proc.pid if self.proc is not None else None

    @property
    def returncode(self) -> int | None:
        return self.proc.returncode if self.proc is not None else None

    def alive(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def output(self, tail: int | None = None) -> str:
        """The daemon's output so far (its last ``tail`` characters; with ``pipe=True`` at most
        the last ``PIPE_KEEP`` bytes)."""
        if self.pipe:
            reader = self._reader
            if reader is not None and self.proc is not None and self.proc.poll() is not None:
                reader.join(5.0)  # it exited: the rest of its output is in the pipe
            text = self._piped.decode(errors="replace")
        elif self.log_path is None:
            return ""
        else:
            try:
                text = self.log_path.read_text(errors="replace")
            except OSError:
                return ""
        return text[-tail:] if tail else text

    def client(self, **kw: Any) -> Any:
        """A ``hicache.engine.client.Client`` on the daemon's address (``timeout`` 10 s by default)."""
        from hicache.engine.client import Client

        kw.setdefault("timeout", 10.0)
        return Client(self.address, **kw)

    def rss(self) -> int:
        import psutil

        assert self.proc is not None
        return int(psutil.Process(self.proc.pid).memory_info().rss)

    def maps_path(self, path: str) -> bool:
        """True when the daemon still maps ``path`` (Linux /proc; False once it exited). The
        daemon is not dumpable: only a caller with ``CAP_SYS_PTRACE`` may read its maps, and
        any other gets the ``PermissionError`` (never a False it could not know)."""
        if self.proc is None:
            return False
        try:
            with open(f"/proc/{self.proc.pid}/maps") as f:
                return any(path in line for line in f)
        except (FileNotFoundError, ProcessLookupError):
            return False

    # ------------------------------------------------------------------------- lifecycle
    def start(self, ready_timeout: float | None = None) -> "DaemonProcess":
        """Launch the daemon and wait until it answers a heartbeat (see the module docstring)."""
        if self.alive():
            raise RuntimeError("the daemon is already running")
        timeout = self.ready_timeout if ready_timeout is None else ready_timeout
        out: IO[bytes] | int = subprocess.DEVNULL
        if self.pipe:
            out = subprocess.PIPE
            if self._reader is not None:  # the last run's tail first, never into this run's
                self._reader.join(5.0)
            self._piped = b""
        elif self.log_path is not None:
            out = open(self.log_path, "ab")
        try:
            self._signalled = None
            self.proc = subprocess.Popen(self.cmd, stdout=out, stderr=subprocess.STDOUT,
                                         cwd=self.cwd, env=self.env,
                                         start_new_session=self.new_session)
        finally:
            if not isinstance(out, int):
                out.close()
        if self.pipe:
            self._reader = threading.Thread(target=self._drain, args=(self.proc.stdout,),
                                            name="daemon-output", daemon=True)
            self._reader.start()
        self.starts += 1
        try:
            self._wait_ready(timeout)
        except BaseException:  # not ready, or interrupted (Ctrl-C): no daemon outlives it
            self.kill()
            raise
        return self

    def _drain(self, f: IO[bytes]) -> None:
        """Read the daemon's pipe until it closes, keeping the last ``PIPE_KEEP`` bytes."""
        try:
            for chunk in iter(lambda: f.read1(1 << 16), b""):  # type: ignore[attr-defined]
                self._piped = (self._piped + chunk)[-PIPE_KEEP:]
        finally:
            f.close()

    def _wait_ready(self, timeout: float) -> None:
        from hicache.engine.client import Client, DaemonUnreachable

        assert self.proc is not None
        kw = {"name": "ready-probe", **self.probe_kw}
        deadline = time.monotonic() + timeout
        with Client(self.address, timeout=0.5, **kw) as c:
            while True:
                if self.proc.poll() is not None:
                    out = self.output(4000)
                    last = [ln for ln in out.splitlines() if ln.strip()][-1:] or ["(no output)"]
                    if self.proc.returncode == 2 and last[0].startswith(REFUSAL):
                        raise DaemonRefused(last[0][len(REFUSAL):], out)
                    raise RuntimeError(f"the daemon exited with status {self.proc.returncode}: "
                                       f"{last[0]}\n--- daemon output ---\n{out}")
                # ready when *this* daemon answers: another one may serve the address (ours
                # then exits, refused, and the check above reports it)
                try:
                    if c.heartbeat(timeout=0.5).get("pid") == self.proc.pid:
                        return
                    time.sleep(0.05)
                except DaemonUnreachable:  # (at once when the address has no daemon yet)
                    time.sleep(0.05)
                if time.monotonic() > deadline:
                    self.kill()
                    raise RuntimeError(
                        f"the daemon did not answer a heartbeat within {timeout:g} s\n"
                        f"--- daemon output ---\n{self.output(4000)}") from None

    def restart(self, ready_timeout: float | None = None,
                sig: int = signal.SIGTERM) -> "DaemonProcess":
        """Stop (``sig``) if running, then start again on the same address."""
        self.stop(sig)
        return self.start(ready_timeout)

    def kill(self) -> None:
        """SIGKILL, as a crash would: no shutdown path runs."""
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGKILL)
            self.proc.wait(30)

    def signal_stop(self, sig: int = signal.SIGTERM) -> None:
        """Send ``sig`` now without waiting (``stop`` then only waits): several daemons stop
        together."""
        if self.proc is not None and self.proc.poll() is None and self._signalled != sig:
            self.proc.send_signal(sig)
            self._signalled = sig

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int | None:
        """Send ``sig`` (unless ``signal_stop`` did) and wait ``timeout`` s; SIGKILL if it does
        not stop. The exit code."""
        if self.proc is None:
            return None
        if self.proc.poll() is None:
            self.signal_stop(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(10)
        return self.proc.returncode

    @staticmethod
    def clean_exit(code: int | None, sig: int = signal.SIGTERM) -> bool:
        """True for the exit code of an orderly stop: 0 (``shutdown``) or 128 + ``sig``."""
        return code in (0, 128 + int(sig))

    def close(self) -> int | None:
        """``stop()``, then remove the private directory if this object made one."""
        try:
            return self.stop()
        finally:
            if self.dir is not None:
                shutil.rmtree(self.dir, ignore_errors=True)

    def __enter__(self) -> "DaemonProcess":
        try:
            return self.start()
        except BaseException:  # ``__exit__`` will not run: the private directory goes here
            self.close()
            raise

    def __exit__(self, *exc: object) -> None:
        self.close()
