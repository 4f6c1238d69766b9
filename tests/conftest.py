"""Shared fixtures.

``start_daemon(tmp_path, **options) -> DaemonProcess`` starts a real ``hicache serve`` subprocess
(CPU mode unless ``device="cuda:N"``) on a private ipc socket and waits until it answers a heartbeat; ``daemon`` is a
function-scoped fixture with the defaults below, ``daemon_factory`` lets a test pick options
(every daemon it starts is stopped at teardown). Defaults: the DSV4-Flash layout with scaled-down
device rows ``page=8, swa_page=4, req_slot=4`` and host rows twice that (``--host-ratio 2``),
heartbeat timeout 10 s, metrics on a free loopback port.

``shared_daemon`` is the same default daemon shared by a whole test module.

``DaemonProcess``: ``.address``, ``.metrics_port``, ``.proc``, ``.output()`` (stdout+stderr so
far), ``.client(**kw)`` (a ``hicache.client.Client``), ``.stop(sig=SIGTERM) -> returncode``.
"""
from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = "page=8,swa_page=4,req_slot=4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class DaemonProcess:
    def __init__(self, proc: subprocess.Popen, address: str, metrics_port: int, log: Path) -> None:
        self.proc = proc
        self.address = address
        self.metrics_port = metrics_port
        self.log = log

    def output(self) -> str:
        return self.log.read_text(errors="replace") if self.log.exists() else ""

    def client(self, **kw: Any):
        from hicache.client import Client

        kw.setdefault("timeout", 10.0)
        return Client(self.address, **kw)

    def alive(self) -> bool:
        return self.proc.poll() is None

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 20.0) -> int:
        if self.proc.poll() is None:
            self.proc.send_signal(sig)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        return self.proc.returncode


def start_daemon(tmp: Path, *, device: str = "cpu", preset: str = "dsv4-flash",
                 device_rows: str = DEFAULT_ROWS,
                 host: tuple[str, str] = ("--host-ratio", "2"), heartbeat_timeout: float = 10.0,
                 metrics: bool = True, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, ready_timeout: float = 60.0) -> DaemonProcess:
    # ipc paths are limited to ~100 bytes: keep the socket in a short private directory
    sockdir = tempfile.mkdtemp(prefix="hc-", dir="/tmp")
    address = f"ipc://{sockdir}/d.sock"
    port = free_port() if metrics else 0
    cmd = [sys.executable, "-m", "hicache.cli", "serve", "--device", device, "--preset", preset,
           "--device-rows", device_rows, *host, "--socket", address,
           "--heartbeat-timeout", str(heartbeat_timeout), "--metrics-port", str(port), *extra]
    log = tmp / f"daemon-{os.path.basename(sockdir)}.log"
    penv = dict(os.environ)
    penv.update(env or {})
    penv["PYTHONPATH"] = os.pathsep.join(p for p in (str(ROOT), penv.get("PYTHONPATH")) if p)
    with open(log, "wb") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, cwd=str(ROOT), env=penv)
    d = DaemonProcess(proc, address, port, log)
    from hicache.client import Client, DaemonUnreachable

    deadline = time.monotonic() + ready_timeout
    with Client(address, timeout=0.5) as c:
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"daemon exited with {proc.returncode}:\n{d.output()}")
            try:
                c.heartbeat(timeout=0.5)
                return d
            except DaemonUnreachable:
                if time.monotonic() > deadline:
                    d.stop(signal.SIGKILL)
                    raise RuntimeError(f"daemon not ready in {ready_timeout} s:\n{d.output()}")


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def make(**kw: Any) -> DaemonProcess:
        d = start_daemon(tmp_path, **kw)
        started.append(d)
        return d

    yield make
    for d in started:
        d.stop()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One default daemon for a whole test module (tests isolate themselves by client)."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.stop()
