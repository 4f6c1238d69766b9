"""What a daemon's start checks before anything heavy loads: ``preflight(cfg) -> Preflight``.

Light: this module imports neither torch nor the daemon's copy path, so ``serve`` runs it first
and a refusal here comes in a tenth of a second, not after torch loaded (~2 s). It checks, in
this order, and raises ``UsageError`` (one line naming the setting) on the first that fails:

* the served stage's sizing (``core.config.sizing``: model, stage, device and host rows);
* the memory the daemon will take, its host arena and its L3 segment (``--l3-segment``)
  together, against what the machine (or its container) has less a reserve
  (``host_pools.memory``), led by the settings that asked for it;
* the socket address (``ipc://`` or ``tcp://`` as ``--allow-remote`` and CURVE allow) and the
  CURVE keys (the secret key file is read; this libzmq must have CURVE);
* a tcp address is free to bind (a probe bind, released at once);
* a ``--numa-node`` number is online.

It allocates nothing and changes nothing. What needs torch (the device) or changes the machine
(the socket folder and lock, the fd limit, the metrics port, the arena) stays in
``controllers.daemon.Daemon``, which takes the ``Preflight`` (or runs this itself)."""
from __future__ import annotations

import socket
from dataclasses import dataclass
from typing import Any

from hicache.core.config import ServeConfig, Sizing, check_address, check_curve, default_socket, \
    sizing
from hicache.core.errors import CapacityError, UsageError
from hicache.core.sizes import arena_bytes, format_bytes
from hicache.host_pools.memory import check_memory_for
from hicache.host_pools.numa_node import online_nodes


@dataclass(frozen=True)
class Preflight:
    sized: Sizing
    address: str  # the socket the daemon binds
    ipc: bool  # an ipc:// address (else tcp://)
    curve: tuple[bytes, bytes, str] | None  # (public, secret, clients dir); None without CURVE
    numa: int | str | None  # the arena's ``numa_node`` option


def preflight(cfg: ServeConfig) -> Preflight:
    sized = sizing(cfg)
    _check_memory(cfg, sized)
    address = cfg.socket or default_socket(cfg.device)
    curve = _curve_keys(cfg) if check_curve(cfg) else None
    ipc = check_address(address, cfg.allow_remote, curve is not None) == "ipc"
    if not ipc:
        _check_tcp_port(address)
    return Preflight(sized, address, ipc, curve, _numa_node(cfg))


def _check_memory(cfg: ServeConfig, sized: Sizing) -> None:
    """The host arena and the L3 segment must fit the machine's memory less the reserve; the
    refusal names the settings that size them (``with_source`` then says where they came
    from)."""
    arena = arena_bytes(sized.layout, sized.host_rows)
    segment = cfg.l3_segment if cfg.l3 != "off" else 0
    try:
        check_memory_for(arena + segment, pinned=cfg.device != "cpu")
    except CapacityError as e:
        host = (f"--host-mem {format_bytes(cfg.host_mem)}" if cfg.host_mem is not None
                else f"--host-ratio {cfg.host_ratio:g} (a host arena of {format_bytes(arena)})")
        what = f"{host} and --l3-segment {format_bytes(segment)}" if segment else host
        raise CapacityError(f"{what}: {e}") from None


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


def _check_tcp_port(address: str) -> None:
    """A tcp address must be free to bind (a probe bind, released at once)."""
    host, _, port = address[len("tcp://"):].rpartition(":")
    host = host.strip("[]")
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, int(port)))
        except OSError as e:
            raise UsageError(f"--socket {address}: cannot bind: {e.strerror}") from None


def _numa_node(cfg: Any) -> int | str | None:
    """The arena's ``numa_node`` option; a node number must be online."""
    if cfg.numa_node in ("auto", "off"):
        return None if cfg.numa_node == "off" else "auto"
    node, nodes = int(cfg.numa_node), online_nodes()
    if nodes and node not in nodes:
        raise UsageError(f"--numa-node {node}: node {node} is not online; online nodes: "
                         f"{', '.join(map(str, sorted(nodes)))}")
    return node
