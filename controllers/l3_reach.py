"""Can the daemon's Mooncake client reach its master and metadata server? Checks that never hold
the daemon's GIL.

Mooncake's ``setup`` holds the GIL for as long as it retries (about 2 s for a metadata URL that
is not a metadata server, 30 s for a hung master, ~90 s for one that is down): every other
thread of the daemon, its server loop and so L1/L2 included, would stand still. So the daemon
calls it only after these checks passed, each of which runs in Python (sockets, HTTP: the GIL
is free while they wait) or in a child process:

* ``unreachable(s)``: a TCP connect to the master and to the metadata server, each within
  ``CONNECT_CHECK_S``. Why one cannot be reached, or None.
* ``metadata_wrong(s)``: an HTTP metadata URL answers a GET of a key no one writes as Mooncake's
  metadata server does (404 with the body ``metadata not found``, or 200). Why not (another
  path, another server, not HTTP, no answer within ``CONNECT_CHECK_S``), or None. Other
  metadata forms (``P2PHANDSHAKE``, etcd) are not checked here.
* ``setup_fails(s)``: Mooncake's ``setup`` with these settings in a child process, mounting no
  segment, killed after ``SETUP_PROBE_S``, when the daemon stops, or when it dies. Why it
  failed or did not finish (with the last error line Mooncake logged), or None. The child
  inherits the daemon's environment (the bind shim: its listeners bind where the daemon's
  would) and closes its client when it succeeded; the answer is read as soon as the child
  prints it (Mooncake's ``close`` takes ~1 s, which the daemon's connect no longer waits for:
  a thread of its own reaps the child, killing it past ``SETUP_PROBE_S``).
* ``master_gone(s)``: the online tier's liveness check, a TCP connect to the master only: why
  it is certainly gone (refused, or no route to its host), or None. A connect that times out,
  or a name that does not resolve, says nothing certain (a hung master's accept queue fills
  with such checks; calls to it meet their own deadlines). The metadata server is not held
  against an online tier: the offline probe asks the master, so the tier would flap.
"""
from __future__ import annotations

import errno
import json
import os
import re
import socket
import subprocess
import sys
import tempfile
import threading
import time
from typing import Protocol


class ReachSettings(Protocol):
    """What the checks read of ``l3_store.L3Settings`` (structural: no import of it here)."""

    master: str
    metadata: str
    protocol: str
    rdma_devices: str
    local_host: str
    buffer_bytes: int


CONNECT_CHECK_S = 1.0  # TCP connect (and metadata GET) timeout of the checks
SETUP_PROBE_S = 10.0  # the child's ``setup`` is killed after this long
PROBE_KEY = "hicache-reach-probe"  # a metadata key no one writes
_CHILD = """
import ctypes, json, os, sys
a = json.loads(sys.argv[1])
try:  # SIGKILL when the daemon's thread that started it is gone (PR_SET_PDEATHSIG)
    ctypes.CDLL(None, use_errno=True).prctl(1, 9, 0, 0, 0)
except (OSError, AttributeError):
    pass
if os.getppid() != a["parent"]:  # gone before that
    sys.exit(1)
from mooncake.store import MooncakeDistributedStore
store = MooncakeDistributedStore()
rc = store.setup(a["local_host"], a["metadata"], 0, a["buffer"], a["protocol"], a["rdma"],
                 a["master"])
print("hicache-setup-rc", rc, flush=True)
if rc == 0:
    store.close()
"""
_SET_UP = b"hicache-setup-rc 0\n"  # what the child prints once its setup succeeded
_GLOG_ERROR = re.compile(r"^E\d{4} [\d:.]+\s+\d+\s+\S+\] (.*)$", re.M)


def endpoint(text: str) -> tuple[str, int] | None:
    """(host, port) of ``HOST:PORT`` or ``scheme://HOST:PORT/...``; None when it names none."""
    rest = text.split("://", 1)[1] if "://" in text else text
    hostport = rest.split("/", 1)[0]
    host, sep, port = hostport.rpartition(":")
    if not sep or not port.isdigit():
        return None
    return host.strip("[]"), int(port)


def unreachable(s: ReachSettings) -> str | None:
    """Why the master or the metadata server cannot be reached now (each one that cannot, so
    an operator mends both at once), or None (see the module docstring)."""
    why = []
    for what, addr in (("master", s.master), ("metadata server", s.metadata)):
        ep = endpoint(addr)
        if ep is None:  # P2PHANDSHAKE, or a form Mooncake resolves itself
            continue
        try:
            socket.create_connection(ep, timeout=CONNECT_CHECK_S).close()
        except OSError as e:
            why.append(f"the {what} at {addr} cannot be reached ({e.strerror or e})")
    return "; ".join(why) or None


def metadata_wrong(s: ReachSettings) -> str | None:
    """Why an HTTP ``--l3-metadata`` URL is not Mooncake's metadata server, or None (see the
    module docstring)."""
    import http.client
    import urllib.parse

    url = s.metadata
    if not url.startswith("http://"):
        return None
    u = urllib.parse.urlsplit(url)
    if u.hostname is None:
        return f"the metadata URL {url} names no host"
    path = (u.path or "/") + "?" + urllib.parse.urlencode({"key": PROBE_KEY})
    conn = http.client.HTTPConnection(u.hostname, u.port or 80, timeout=CONNECT_CHECK_S)
    try:
        conn.request("GET", path)
        r = conn.getresponse()
        body = r.read(256).decode("utf-8", "replace").strip()
    except (OSError, http.client.HTTPException) as e:
        why = "does not answer in time" if isinstance(e, socket.timeout) else \
            f"does not answer HTTP ({type(e).__name__}: {str(e)[:80] or 'no reply'})"
        return f"the metadata server at {url} {why}"
    finally:
        conn.close()
    if r.status == 200 or (r.status == 404 and "metadata not found" in body):
        return None
    return (f"the metadata URL {url} answers {r.status} {body[:60]!r}, not as Mooncake's "
            f"metadata server does (its path is /metadata on the master's "
            f"--http_metadata_server_port)")


def setup_fails(s: ReachSettings, stop: threading.Event | None = None) -> str | None:
    """Why Mooncake's ``setup`` with ``s`` fails in a child process, or None (see the module
    docstring). The child is killed when it runs past ``SETUP_PROBE_S``, when ``stop`` is set
    (the daemon is stopping), and by the kernel when the thread that started it dies (a
    daemon killed mid-check leaves none behind)."""
    args = json.dumps({"local_host": s.local_host, "metadata": s.metadata,
                       "buffer": s.buffer_bytes, "protocol": s.protocol,
                       "rdma": s.rdma_devices, "master": s.master, "parent": os.getpid()})
    with tempfile.TemporaryFile() as out, tempfile.TemporaryFile() as err:
        try:
            p = subprocess.Popen([sys.executable, "-c", _CHILD, args], stdout=out, stderr=err,
                                 stdin=subprocess.DEVNULL)
        except OSError as e:
            return f"the set-up check could not run ({e.strerror or e})"
        deadline = time.monotonic() + SETUP_PROBE_S
        while p.poll() is None and time.monotonic() < deadline and \
                not (stop is not None and stop.is_set()):
            out.seek(0)
            if _SET_UP in out.read():  # set up: its client's close is left to a reaper
                threading.Thread(target=_reap, args=(p, deadline), name="l3-setup-reaper",
                                 daemon=True).start()
                return None
            time.sleep(0.02)
        timed_out = p.poll() is None
        if timed_out:
            p.kill()
        p.wait()
        out.seek(0)
        err.seek(0)
        stdout = out.read().decode("utf-8", "replace")
        stderr = err.read().decode("utf-8", "replace")
    errors = _GLOG_ERROR.findall(stderr)
    said = f": {errors[-1].strip()[:200]}" if errors else ""
    if timed_out:
        if stop is not None and stop.is_set():
            return "the daemon is stopping"
        return (f"Mooncake's set-up against the master at {s.master} did not finish within "
                f"{SETUP_PROBE_S:g} s (a hung master or metadata server, or an address that "
                f"is not theirs?){said}")
    m = re.search(r"^hicache-setup-rc (-?\d+)$", stdout, re.M)
    if m is not None and m.group(1) == "0":
        return None
    if m is None:
        tail = stderr.strip().splitlines()[-1:] or ["no output"]
        return (f"the set-up check ended without an answer (exit {p.returncode}; "
                f"{tail[0][:160]})")
    return f"Mooncake's set-up failed (code {m.group(1)}){said}"


def _reap(p: subprocess.Popen, deadline: float) -> None:
    """Wait for a set-up check's child that answered and now closes its client; killed at
    ``deadline``."""
    try:
        p.wait(max(0.0, deadline - time.monotonic()))
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait()


def master_gone(s: ReachSettings) -> str | None:
    """Why the master is certainly gone, or None (see the module docstring)."""
    ep = endpoint(s.master)
    if ep is None:
        return None
    try:
        socket.create_connection(ep, timeout=CONNECT_CHECK_S).close()
    except ConnectionRefusedError:
        return f"the master at {s.master} refuses connections"
    except OSError as e:
        if e.errno in (errno.EHOSTUNREACH, errno.ENETUNREACH):
            return f"the master at {s.master} cannot be reached ({e.strerror})"
    return None
