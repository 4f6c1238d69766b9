"""A local Mooncake Store on loopback for the demo, the benches and the tests (real binaries).

Contract:

* ``mooncake_dir()`` and ``loopback_env()`` (Mooncake processes on 127.0.0.1 only): from
  ``hicache.core.bind_shim``, re-exported here for the tests and benches.
* ``LocalStore(segment="512MiB")``: ``start()`` runs ``mooncake_master`` (RPC, embedded HTTP
  metadata server and metrics, each on a free loopback port) and one ``mooncake_client``
  storage member contributing ``segment`` bytes (so pages outlive the daemons that wrote them),
  and returns once the master counts that segment as mounted (``wait_mounted()``: also after
  an outage; ``capacity()`` reads the master's metric; a port that another process took
  after it was picked is picked again, as ``_wait_port`` checks that the process it started
  is the one listening); ``keys()``: every object key the
  master holds; ``kill_master()`` / ``start_master()`` (same ports) for outage tests; ``pids()``,
  ``master_addr``, ``metadata_url``; ``close()`` stops both. A ``start_master()`` after
  ``kill_master()`` keeps the ports (clients know them): one taken meanwhile fails it.
* ``listeners(pids) -> [(pid, address)]``: the TCP listening sockets of those processes
  (from ``ss -ltnpH``); ``non_loopback(listeners)`` keeps those not on a loopback address.
"""
from __future__ import annotations

import os
import re
import shutil
import signal
import socket
import subprocess
import tempfile
import time
import urllib.request
from pathlib import Path
from typing import Mapping

from hicache.core.bind_shim import loopback_env, mooncake_dir  # noqa: F401 (re-exported)

def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class PortTaken(RuntimeError):
    """Another process listens on the port a Mooncake process was given."""


def _listens(pid: int, port: int) -> bool:
    """Whether process ``pid`` holds a TCP socket listening on ``port`` (its descriptors'
    socket inodes against the kernel's IPv4 and IPv6 tables)."""
    inodes = set()
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            link = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # closed meanwhile
            continue
        if link.startswith("socket:["):
            inodes.add(link[8:-1])
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            with open(table) as f:
                rows = f.read().splitlines()[1:]
        except OSError:
            continue
        for row in rows:
            col = row.split()
            if col[3] == "0A" and int(col[1].rsplit(":", 1)[1], 16) == port and \
                    col[9] in inodes:
                return True
    return False


def _answers(port: int) -> bool:
    """Whether something accepts a TCP connection on 127.0.0.1:``port``."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=0.2):
            return True
    except OSError:
        return False


def _wait_port(port: int, proc: subprocess.Popen, timeout: float, what: str,
               others: tuple[int, ...] = ()) -> None:
    """Return once ``proc`` itself listens on ``port``: a free port found earlier may be
    another process's by now (the suite's two workers start stores at once), and a connect
    alone then succeeded to *that* process while ours failed to bind, so a test that stopped
    "the" master stopped a process nobody used. ``PortTaken`` when ``proc`` exits or does not
    hold the port in time while another process holds it, or one of ``others`` (the rest of
    the ports ``proc`` was given: a master that cannot bind its metrics or metadata port
    exits too); ``RuntimeError`` otherwise."""
    deadline = time.monotonic() + timeout
    answered = False  # (once: a holder that never accepts fills its backlog)
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            taken = [p for p in (port, *others) if (p == port and answered) or _answers(p)]
            cls = PortTaken if taken else RuntimeError
            raise cls(f"{what} exited with code {proc.returncode}" +
                      (f" (another process listens on 127.0.0.1:{taken[0]})" if taken else ""))
        if _listens(proc.pid, port):
            return
        answered = answered or _answers(port)
        time.sleep(0.05)
    cls = PortTaken if answered else RuntimeError
    raise cls(f"{what} did not listen on 127.0.0.1:{port} within {timeout:g} s" +
              (" (another process does)" if answered else ""))


class LocalStore:
    """mooncake_master + one storage member on loopback (see the module docstring)."""

    def __init__(self, segment: str = "512MB", log_dir: str | None = None,
                 env: Mapping[str, str] | None = None) -> None:
        d = mooncake_dir()
        if d is None:
            raise RuntimeError("the Mooncake wheel is not installed (pip install 'hicache[l3]')")
        self.bin = d
        self.segment = segment
        self.rpc_port, self.http_port, self.metrics_port = free_port(), free_port(), free_port()
        self.member_port = free_port()
        self.log_dir = Path(log_dir or tempfile.mkdtemp(prefix="hc-l3-"))
        self.log_dir.mkdir(parents=True, exist_ok=True)
        self.env = {**os.environ, **loopback_env(), **(env or {})}
        self.master: subprocess.Popen | None = None
        self.member: subprocess.Popen | None = None

    @property
    def master_addr(self) -> str:
        return f"127.0.0.1:{self.rpc_port}"

    @property
    def metadata_url(self) -> str:
        return f"http://127.0.0.1:{self.http_port}/metadata"

    def _spawn(self, args: list[str], log: str) -> subprocess.Popen:
        f = open(self.log_dir / log, "ab")
        try:
            return subprocess.Popen(args, stdout=f, stderr=subprocess.STDOUT, env=self.env,
                                    stdin=subprocess.DEVNULL)
        finally:
            f.close()

    def start_master(self, timeout: float = 20.0) -> None:
        self.master = self._spawn([
            str(self.bin / "mooncake_master"), "--rpc_address=127.0.0.1",
            f"--rpc_port={self.rpc_port}", "--enable_http_metadata_server=true",
            "--http_metadata_server_host=127.0.0.1",
            f"--http_metadata_server_port={self.http_port}",
            "--metrics_host=127.0.0.1", f"--metrics_port={self.metrics_port}",
            "--rpc_thread_num=2", "--enable_metric_reporting=false"], "master.log")
        ports = (self.rpc_port, self.http_port, self.metrics_port)
        for port, what in zip(ports, ("mooncake_master", "mooncake_master metadata server",
                                      "mooncake_master metrics server")):
            _wait_port(port, self.master, timeout, what, tuple(p for p in ports if p != port))

    def start(self, timeout: float = 30.0, tries: int = 3) -> "LocalStore":
        """Start the master and the member; ports another process took meanwhile are picked
        again (``tries`` >= 1 attempts in all). A start that fails leaves no process running
        (its logs stay for ``log_tail``; ``close()`` removes them)."""
        if tries < 1:
            raise ValueError(f"tries must be >= 1, not {tries}")
        for attempt in range(tries):
            try:
                self._start(timeout)
                return self
            except PortTaken:
                self._stop()
                if attempt == tries - 1:
                    raise
                self.rpc_port, self.http_port, self.metrics_port = (free_port(), free_port(),
                                                                    free_port())
                self.member_port = free_port()
            except BaseException:
                self._stop()
                raise
        raise AssertionError("unreachable")

    def _start(self, timeout: float) -> None:
        self.start_master(timeout)
        self.member = self._spawn([
            str(self.bin / "mooncake_client"), "--host=127.0.0.1", f"--port={self.member_port}",
            f"--global_segment_size={self.segment}", f"--master_server_address={self.master_addr}",
            f"--metadata_server={self.metadata_url}", "--protocol=tcp",
            # its INFO lines (ports, attempts, mounts) too: it logs only warnings by default,
            # and a member that exited 1 once left no reason in its log (docs/reliability.md)
            "--minloglevel=0"], "member.log")
        _wait_port(self.member_port, self.member, timeout, "mooncake_client storage member")
        self.wait_mounted(timeout)

    def capacity(self) -> int | None:
        """Bytes of the segments the master counts as mounted (its metric
        ``master_total_capacity_bytes``); None while its metrics do not answer."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/metrics",
                                        timeout=1.0) as r:
                body = r.read().decode(errors="replace")
        except OSError:
            return None
        m = _CAPACITY_RE.search(body)
        return int(m.group(1)) if m else None

    def wait_mounted(self, timeout: float = 30.0) -> None:
        """Return once the master counts a mounted segment. A storage member listens before
        its segment is mounted, and a master that lost a member (its own restart, or a member
        that missed its heartbeats) counts no segment of it until the member mounts it again:
        puts meanwhile fail for "insufficient space"."""
        deadline = time.monotonic() + timeout
        cap = None
        while time.monotonic() < deadline:
            if self.member is not None and self.member.poll() is not None:
                raise RuntimeError(f"mooncake_client storage member exited with code "
                                   f"{self.member.returncode}\n{self.log_tail()}")
            cap = self.capacity()
            if cap:
                return
            time.sleep(0.05)
        raise RuntimeError(f"no storage segment mounted at the mooncake_master within "
                           f"{timeout:g} s (capacity {cap})\n{self.log_tail()}")

    def keys(self) -> list[str]:
        """Every object key the master holds (its HTTP ``/get_all_keys``, on the metrics
        port)."""
        with urllib.request.urlopen(f"http://127.0.0.1:{self.metrics_port}/get_all_keys",
                                    timeout=5.0) as r:
            return [k for k in r.read().decode().splitlines() if k]

    def kill_master(self) -> None:
        if self.master is not None and self.master.poll() is None:
            self.master.send_signal(signal.SIGKILL)
            self.master.wait(10)

    def pids(self) -> list[int]:
        return [p.pid for p in (self.master, self.member) if p is not None and p.poll() is None]

    def log_tail(self, n: int = 2000) -> str:
        out = []
        for f in sorted(self.log_dir.glob("*.log")):
            out.append(f"--- {f.name}\n" + f.read_text(errors="replace")[-n:])
        return "\n".join(out)

    def _stop(self) -> None:
        for p in (self.member, self.master):
            if p is not None and p.poll() is None:
                p.terminate()
                try:
                    p.wait(5)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)

    def close(self) -> None:
        self._stop()
        shutil.rmtree(self.log_dir, ignore_errors=True)

    def __enter__(self) -> "LocalStore":
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()


_CAPACITY_RE = re.compile(r"^master_total_capacity_bytes (\d+)", re.M)
_SS_RE = re.compile(r"^\S+\s+\d+\s+\d+\s+(\S+)\s+\S+.*pid=(\d+)")


def listeners(pids: list[int]) -> list[tuple[int, str]]:
    """(pid, local address) of every TCP listener owned by ``pids``."""
    r = subprocess.run(["ss", "-ltnpH"], capture_output=True, text=True, check=True)
    want = set(pids)
    out = []
    for line in r.stdout.splitlines():
        m = _SS_RE.match(line)
        if not m:
            continue
        for pid in re.findall(r"pid=(\d+)", line):
            if int(pid) in want:
                out.append((int(pid), m.group(1)))
    return out


def non_loopback(found: list[tuple[int, str]]) -> list[tuple[int, str]]:
    ok = ("127.", "[::1]", "[::ffff:127.")
    return [(p, a) for p, a in found if not a.startswith(ok)]
