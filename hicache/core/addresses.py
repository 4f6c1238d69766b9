"""Where a daemon listens: socket addresses, the default runtime directory, CURVE settings.

* ``default_socket(device)``: ``ipc://$XDG_RUNTIME_DIR/hicache/<device without ':'>.sock`` (e.g.
  ``cuda0.sock``), or ``/tmp/hicache-$UID/...`` without a runtime dir; the directory is 0700.
* ``check_address(addr, allow_remote, curve) -> "ipc" | "tcp"``: ``ipc://PATH`` (a filesystem
  path, never abstract) or ``tcp://`` on loopback; any other address needs ``allow_remote``
  *and* CURVE. IPv6 (``tcp://[::1]:PORT``) is refused: the daemon's and the engines' ZMQ
  sockets have ``zmq.IPV6`` off, so such an address would fail only after the arena is
  pinned. ``check_curve(cfg)``: True when both CURVE settings are given and sane.
* ``url_host(host)``: ``host`` as a URL writes it (an IPv6 address in brackets).
Every refusal is a ``UsageError`` naming the setting.
"""
from __future__ import annotations

import ipaddress
import os
from typing import Any

from hicache.core.errors import UsageError


def url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def check_curve(cfg: Any) -> bool:
    """True when CURVE is configured (both settings, a private key file, a client directory)."""
    key, clients = cfg.curve_secret_key, cfg.curve_clients
    if key is None and clients is None:
        return False
    if key is None or clients is None:
        raise UsageError("CURVE needs both --curve-secret-key (the daemon's secret key file) "
                         "and --curve-clients (a directory of allowed client public keys)")
    try:
        st = os.stat(key)
    except OSError as e:
        raise UsageError(f"curve secret key {key}: {e.strerror}") from None
    if st.st_mode & 0o077:
        raise UsageError(f"curve secret key {key} is readable by other users (mode "
                         f"{st.st_mode & 0o777:o}); chmod 600 it")
    if not os.path.isdir(clients):
        raise UsageError(f"curve clients directory {clients} does not exist")
    return True


def runtime_dir() -> str:
    """Owner-only directory for default sockets: $XDG_RUNTIME_DIR/hicache or /tmp/hicache-UID."""
    base = os.environ.get("XDG_RUNTIME_DIR")
    if base and os.path.isdir(base):
        return os.path.join(base, "hicache")
    return f"/tmp/hicache-{os.getuid()}"


def default_socket(device: str) -> str:
    tag = device.replace(":", "")
    return f"ipc://{os.path.join(runtime_dir(), tag + '.sock')}"


IPC_PATH_MAX = 107  # bytes of a Unix socket path (sun_path, less its terminating zero)


def check_address(addr: str, allow_remote: bool = False, curve: bool = False) -> str:
    """Return the transport ('ipc' or 'tcp') of an acceptable address, else raise UsageError:
    a non-loopback tcp address needs ``allow_remote`` and CURVE."""
    if addr.startswith("ipc://"):
        path = addr[len("ipc://"):]
        if not path or path.startswith("@"):
            raise UsageError(f"ipc socket {addr!r}: give a filesystem path (abstract sockets "
                             f"have no permissions)")
        if len(path.encode()) > IPC_PATH_MAX:
            raise UsageError(f"ipc socket path is {len(path.encode())} bytes, over the "
                             f"{IPC_PATH_MAX} a Unix socket takes: name a shorter one")
        return "ipc"
    if addr.startswith("tcp://"):
        host, _, port = addr[len("tcp://"):].rpartition(":")
        if host.startswith("[") or ":" in host:  # ZMQ sockets here have IPv6 off: no bind
            raise UsageError(f"tcp address {addr!r}: IPv6 addresses are not supported; use "
                             f"tcp://127.0.0.1:PORT (or an IPv4 address)")
        if not port.isdigit():
            raise UsageError(f"tcp address {addr!r} needs a port, e.g. tcp://127.0.0.1:5577")
        if not 0 < int(port) < 65536:
            raise UsageError(f"tcp address {addr!r}: port {int(port)} is outside 1..65535")
        loopback = host == "localhost"
        if not loopback:
            try:
                loopback = ipaddress.ip_address(host).is_loopback
            except ValueError:
                loopback = False
        if loopback:
            return "tcp"
        if not allow_remote:
            raise UsageError(f"{addr} is not a loopback address; remote clients need "
                             f"--allow-remote and CURVE keys")
        if not curve:
            raise UsageError(f"{addr}: remote access needs CURVE authentication: give "
                             f"--curve-secret-key and --curve-clients")
        return "tcp"
    raise UsageError(f"unsupported socket address {addr!r}; use ipc://PATH or "
                     f"tcp://127.0.0.1:PORT")
