"""What a daemon's start checks before anything heavy loads: ``preflight(cfg) -> Preflight``.

Light: this module imports neither torch nor the daemon's copy path, so ``serve`` runs it first
and a refusal here comes in a tenth of a second, not after torch loaded (~2 s). It checks, in
this order, and raises ``UsageError`` (one line naming the setting) on the first that fails:

* ``--parent-pid`` names this process's parent;
* the served stage's sizing (``core.config.sizing``: model, stage, device and host rows);
* the socket address (``ipc://`` or ``tcp://`` as ``--allow-remote`` and CURVE allow) and the
  CURVE keys (the secret key file is read; this libzmq must have CURVE);
* a tcp address is free to bind (a probe bind, released at once);
* a ``--numa-node`` number is online;
* ``--l3-protocol rdma``: the host has RDMA devices, and every one ``--l3-rdma-devices`` names
  (``RDMA_SYSFS``; Mooncake would fall back to none with one warning of its own);
* an ipc socket's path: its folder exists, is a folder this user owns and may write in, or can
  be made (its first missing folder is made and removed again at once), the path is no other
  kind of file, and no daemon holds it (its ``.lock`` is held);
* the metrics port is free to bind (a probe bind, released at once);
* last, the memory the daemon will take, its host arena and its L3 segment (``--l3-segment``)
  together, against what the machine (or its container) has less a reserve
  (``host_pools.memory``), led by the settings that asked for it.

It allocates nothing and leaves nothing changed (the probe binds and folder are undone at
once). What needs
torch (the device) or changes the machine (the socket folder and lock, the fd limit, the
metrics port, the arena) stays in ``controllers.daemon.Daemon``, which takes the
``Preflight`` (or runs this itself). ``preflight(cfg, check=True)`` (``serve --check``)
reports a socket a daemon already holds (an ipc socket's lock held; a tcp port whose socket
answers a ``heartbeat``, or under CURVE greets as ZMQ does) in ``Preflight.notes`` instead of
refusing it (a tcp port another program holds is refused as at a start), and so a metrics
port taken then (that daemon's, presumably), and skips the memory check (that daemon holds
memory a restart would free)."""
from __future__ import annotations

import errno
import fcntl
import os
import socket
import stat
import tempfile
import time
from dataclasses import dataclass
from typing import Any

from hicache.core.config import ServeConfig, Sizing, check_address, check_curve, default_socket, \
    metrics_listen, sizing
from hicache.core.errors import CapacityError, UsageError
from hicache.core.sizes import arena_bytes, format_bytes, sparse_region_bytes
from hicache.host_pools.memory import check_memory_for
from hicache.host_pools.numa_node import online_nodes


@dataclass(frozen=True)
class Preflight:
    sized: Sizing
    address: str  # the socket the daemon binds
    ipc: bool  # an ipc:// address (else tcp://)
    curve: tuple[bytes, bytes, str] | None  # (public, secret, clients dir); None without CURVE
    numa: int | str | None  # the arena's ``numa_node`` option
    notes: tuple[str, ...] = ()  # ``check=True``: what a start would meet but a check does not


def preflight(cfg: ServeConfig, check: bool = False) -> Preflight:
    if cfg.parent_pid is not None and cfg.parent_pid != os.getppid():
        # it would stop at once, for no reason it could say
        raise UsageError(f"--parent-pid {cfg.parent_pid} is not this process's parent (its "
                         f"parent is {os.getppid()}): it names the launcher that started "
                         "this daemon, which it exits with")
    sized = sizing(cfg)
    address = cfg.socket or default_socket(cfg.device)
    curve = _curve_keys(cfg) if check_curve(cfg) else None
    ipc = check_address(address, cfg.allow_remote, curve is not None) == "ipc"
    held = None  # why a daemon (maybe) serves the socket already
    if not ipc:
        try:
            _check_tcp_port(address)
        except PortInUse as e:  # (another failure, such as an address not of this host: as is)
            seen = _daemon_at(address, curve is not None)
            if seen is None:
                raise
            held = f"{e} ({seen})"
    numa = _numa_node(cfg)
    _check_rdma(cfg)
    notes: list[str] = []
    if ipc:
        held = _check_ipc_path(address)
    if held is not None:
        if not check:
            raise UsageError(held)
        notes.append(f"{held}: a start is refused while it runs, and the memory was not "
                     f"checked (it holds memory of its own)")
    if cfg.metrics_port:
        try:
            _probe_bind(cfg.metrics_addr, cfg.metrics_port, metrics_listen(cfg))
        except PortInUse as e:
            if held is None:  # nothing serves the socket: another program has the port
                raise
            notes.append(f"{e} (the daemon on {address} serves its metrics there, presumably)")
    if held is None:
        _check_memory(cfg, sized)
    return Preflight(sized, address, ipc, curve, numa, tuple(notes))


def _check_ipc_path(address: str) -> str | None:
    """Refuse what ``Daemon`` would refuse of an ipc socket's path, leaving nothing made: a
    folder that cannot be made (its first missing folder is made and removed at once), a path
    that is another kind of file (``check_socket_file``). Returns why a daemon already holds
    the socket (its ``.lock`` is held), else None; ``Daemon`` also asks whether an older daemon
    without the lock answers there."""
    path = address[len("ipc://"):]
    folder = up = os.path.dirname(os.path.abspath(path))
    first = None  # the first folder that would be made
    while not os.path.isdir(up) and up != os.path.dirname(up):
        if os.path.lexists(up):
            raise UsageError(f"--socket {address}: {up} is not a folder")
        first, up = up, os.path.dirname(up)
    if first is None:
        check_socket_folder(address, folder, os.stat(folder))
        try:  # a file made and removed at once: access() says yes to root where none can be
            fd, probe = tempfile.mkstemp(prefix=".hicache-check-", dir=folder)  # made (/sys)
        except OSError as e:
            raise UsageError(f"--socket {address}: cannot create files in the socket folder "
                             f"{folder}: {e.strerror}") from None
        os.close(fd)
        os.unlink(probe)
    else:  # made and removed at once: access() says yes to root where mkdir fails (/proc)
        try:
            os.mkdir(first, 0o700)
        except FileExistsError:  # a daemon starting beside this one made it meanwhile
            pass
        except OSError as e:
            raise UsageError(f"--socket {address}: cannot create the socket folder {folder}: "
                             f"{e.strerror}") from None
        else:
            try:
                os.rmdir(first)
            except OSError:  # that daemon is already using it
                pass
    check_socket_file(address, path)
    if socket_locked(path):
        return f"another daemon already serves {address} (it holds {path}.lock)"
    return None


def socket_locked(path: str) -> bool:
    """Whether a daemon holds the lock of ipc socket ``path`` (its ``.lock``, flocked for the
    daemon's life), whether or not the socket file is still there."""
    try:
        fd = os.open(path + ".lock", os.O_RDONLY | os.O_CLOEXEC)
    except OSError:  # no lock file: no daemon of this version holds it
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    finally:
        os.close(fd)
    return False


def check_socket_folder(address: str, folder: str, st: os.stat_result) -> None:
    """An existing socket folder (``st``: its stat) must be a folder this user owns and may
    write in."""
    if not stat.S_ISDIR(st.st_mode):
        raise UsageError(f"--socket {address}: {folder} is not a folder")
    if not os.access(folder, os.W_OK | os.X_OK):
        raise UsageError(f"--socket {address}: the socket folder {folder} is not writable")
    if st.st_uid != os.getuid():
        raise UsageError(f"--socket {address}: the socket folder {folder} belongs to uid "
                         f"{st.st_uid}, not to this user (uid {os.getuid()})")


def check_socket_file(address: str, path: str) -> None:
    """A path that exists must be a socket (a stale one is replaced; any other file is kept)."""
    if os.path.lexists(path) and not stat.S_ISSOCK(os.lstat(path).st_mode):
        raise UsageError(f"--socket {address}: {path} exists and is not a socket; name "
                         "another path")


class PortInUse(UsageError):
    """A probe bind found the port taken (by a daemon, perhaps: ``_daemon_at`` asks)."""


def _probe_bind(host: str, port: int, what: str) -> None:
    """``host:port`` must be free to bind (a probe bind, released at once); ``PortInUse``
    when something holds it, ``UsageError`` for any other failure."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host.strip("[]"), int(port)))
        except OSError as e:
            kind = PortInUse if e.errno == errno.EADDRINUSE else UsageError
            raise kind(f"{what}: {e.strerror}") from None


def _check_memory(cfg: ServeConfig, sized: Sizing) -> None:
    """The host arena, the L3 segment and every HiSparse region the daemon may make must fit
    the machine's (or its container's) memory less the reserve; the refusal names the
    settings that size them (``with_source`` then says where they came from)."""
    arena = arena_bytes(sized.layout, sized.host_rows)
    segment = cfg.l3_segment if cfg.l3 != "off" else 0
    sparse = cfg.sparse_clients * sparse_region_bytes(sized.layout, cfg.sparse_rows)
    try:
        check_memory_for(arena + segment + sparse, pinned=cfg.device != "cpu")
    except CapacityError as e:
        if cfg.host_mem is None:
            host = f"--host-ratio {cfg.host_ratio:g} (a host arena of {format_bytes(arena)})"
        elif cfg.pp_size > 1:  # the stages agree on the smallest stage's rows: less than it
            host = (f"--host-mem {format_bytes(cfg.host_mem)} (a host arena of "
                    f"{format_bytes(arena)}: the host rows agreed over the {cfg.pp_size} PP "
                    f"stages)")
        else:
            host = f"--host-mem {format_bytes(cfg.host_mem)}"
        what = [host] + ([f"--l3-segment {format_bytes(segment)}"] if segment else []) + \
            ([f"--sparse-rows {cfg.sparse_rows} x --sparse-clients {cfg.sparse_clients} "
              f"(HiSparse regions of {format_bytes(sparse)})"] if sparse else [])
        raise CapacityError(f"{' and '.join(what)}: {e}") from None


def _curve_keys(cfg: ServeConfig) -> tuple[bytes, bytes, str]:
    """(public, secret, clients dir) from the daemon's CURVE key file."""
    import zmq
    import zmq.auth

    if not zmq.has("curve"):
        raise UsageError("this libzmq has no CURVE support; cannot serve with CURVE keys")
    try:
        public, secret = zmq.auth.load_certificate(cfg.curve_secret_key)
    except (OSError, ValueError) as e:
        raise UsageError(f"curve secret key {cfg.curve_secret_key}: {e}") from None
    if not secret:
        raise UsageError(f"curve key file {cfg.curve_secret_key} holds no secret key "
                         f"(give the .key_secret file)")
    return public, secret, str(cfg.curve_clients)


RDMA_SYSFS = "/sys/class/infiniband"  # one entry per RDMA device of the host


def _check_rdma(cfg: ServeConfig) -> None:
    if cfg.l3 != "mooncake" or cfg.l3_protocol != "rdma":
        return
    try:
        have = sorted(os.listdir(RDMA_SYSFS))
    except OSError:
        have = []
    if not have:
        raise UsageError(f"--l3-protocol rdma: this host has no RDMA device ({RDMA_SYSFS} is "
                         f"empty or missing); use --l3-protocol tcp")
    named = [d.strip() for d in cfg.l3_rdma_devices.split(",") if d.strip()]
    missing = [d for d in named if d not in have]
    if missing:
        raise UsageError(f"--l3-rdma-devices {cfg.l3_rdma_devices}: no RDMA device "
                         f"{', '.join(missing)} on this host (it has {', '.join(have)})")


def _check_tcp_port(address: str) -> None:
    """A tcp address must be free to bind (a probe bind, released at once)."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    _probe_bind(host, int(port), f"--socket {address}: cannot bind")


def _daemon_at(address: str, curve: bool, timeout: float = 1.0) -> str | None:
    """What serves a tcp address this check could not bind, when it is a daemon: one that
    answers a ``heartbeat`` within ``timeout`` (without CURVE), or, under CURVE (this check
    holds no client key to ask with), a socket that opens with ZMTP's greeting; None for
    anything else (another program holds the port)."""
    if curve:
        return "a ZMQ socket listens there: a CURVE daemon serves it, presumably" \
            if _greets_as_zmq(address, timeout) else None
    import zmq

    from hicache.core import protocol as P

    s = zmq.Context.instance().socket(zmq.DEALER)
    try:
        s.setsockopt(zmq.LINGER, 0)
        s.connect(address)
        s.send_multipart(P.encode_request("heartbeat", 1), zmq.NOBLOCK)
        if not s.poll(int(timeout * 1000)):
            return None
        h, _ = P.decode_reply(s.recv_multipart(zmq.NOBLOCK))
    except (zmq.ZMQError, P.ProtocolError):
        return None
    finally:
        s.close()
    # (a refusal is a daemon's answer too: one at its client limit, or stopping)
    return "a hicache daemon serves it" if h.get("id") == 1 else None


def _greets_as_zmq(address: str, timeout: float) -> bool:
    """Whether what listens on a tcp address opens with ZMTP's greeting (its first byte 0xff,
    its tenth 0x7f) within ``timeout`` in all."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    end = time.monotonic() + timeout
    got = b""
    try:
        with socket.create_connection((host.strip("[]"), int(port)), timeout=timeout) as s:
            while len(got) < 10 and (left := end - time.monotonic()) > 0:
                s.settimeout(left)
                part = s.recv(10 - len(got))
                if not part:
                    break
                got += part
    except OSError:
        return False
    return len(got) == 10 and got[0] == 0xFF and got[9] == 0x7F


def _numa_node(cfg: Any) -> int | str | None:
    """The arena's ``numa_node`` option; a node number must be online."""
    if cfg.numa_node in ("auto", "off"):
        return None if cfg.numa_node == "off" else "auto"
    node, nodes = int(cfg.numa_node), online_nodes()
    if nodes and node not in nodes:
        raise UsageError(f"--numa-node {node}: node {node} is not online; online nodes: "
                         f"{', '.join(map(str, sorted(nodes)))}")
    return node
