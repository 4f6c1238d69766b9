"""Assembly of one daemon: config -> layout -> host rows -> arena + pool group -> engine -> server.

``Daemon(cfg)`` brings everything up (the host arena is mapped, touched and pinned here, so an
overcommit fails at start-up with the sizes in the message), ``summary()`` describes it,
``serve()`` runs the loop until ``shutdown`` / ``stop()`` / SIGTERM, ``close()`` tears down in
order: stop taking commands, let in-flight transfers finish (or report them failed), deliver
their acks, drop every worker's device mappings, unregister and unmap the arena, close the
socket and remove its file.
"""
from __future__ import annotations

import gc
import logging
import os
import stat
import time
from typing import Any

import torch

from hicache.core.config import ServeConfig, check_address, check_curve, default_socket
from hicache.core.errors import UsageError
from hicache.host_pools.group import HostPoolGroup
from hicache.core.sizes import format_bytes, host_rows
from hicache.controllers.metrics import Metrics

from .registry import Registry
from .server import Server
from .state import DaemonState
from .scheduler import Scheduler

log = logging.getLogger("hicache.daemon")


def _prepare_ipc(address: str) -> None:
    """Create the socket's directory (0700 when we create it) and refuse a live socket."""
    path = address[len("ipc://"):]
    d = os.path.dirname(os.path.abspath(path))
    if not os.path.isdir(d):
        os.makedirs(d, mode=0o700, exist_ok=True)
    st = os.stat(d)
    if st.st_uid != os.getuid():
        raise UsageError(f"socket directory {d} belongs to uid {st.st_uid}, not to you")
    if st.st_mode & 0o077:
        log.warning("socket directory %s is accessible by other users (mode %o); the socket "
                    "itself is 0600", d, stat.S_IMODE(st.st_mode))
    if os.path.exists(path):
        if _answers(address):
            raise UsageError(f"another daemon already serves {address}")
        os.unlink(path)  # stale socket file of a dead daemon


def _answers(address: str) -> bool:
    import zmq

    from hicache.core import protocol as P

    ctx = zmq.Context()
    s = ctx.socket(zmq.DEALER)
    s.setsockopt(zmq.LINGER, 0)
    s.setsockopt(zmq.IMMEDIATE, 1)
    try:
        s.connect(address)
        if not s.poll(300, zmq.POLLOUT):
            return False
        s.send_multipart(P.encode_request("heartbeat", 0))
        return bool(s.poll(500, zmq.POLLIN))
    finally:
        s.close(0)
        ctx.term()


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


class Daemon:
    def __init__(self, cfg: ServeConfig) -> None:
        self.cfg = cfg
        self.layout = cfg.layout()
        if not cfg.device_rows:
            raise UsageError("device rows per index space are needed to size and check the host "
                             "pools: --device-rows page=N,swa_page=M,req_slot=K")
        if cfg.host_mem is None and cfg.host_ratio is None:
            raise UsageError("give the host memory: --host-mem 8GiB or --host-ratio 2")
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"{cfg.device} asked but CUDA is not available")
            if self.device.index >= torch.cuda.device_count():
                raise UsageError(f"{cfg.device} asked but there are "
                                 f"{torch.cuda.device_count()} GPUs")
            torch.cuda.set_device(self.device)  # never a context on another GPU
        self.address = cfg.socket or default_socket(cfg.device)
        curve = _curve_keys(cfg) if check_curve(cfg) else None
        check_address(self.address, cfg.allow_remote, curve is not None)
        self.rows = host_rows(self.layout, cfg.device_rows, host_bytes=cfg.host_mem,
                              ratio=cfg.host_ratio)
        if self.address.startswith("ipc://"):
            _prepare_ipc(self.address)
        numa: Any = cfg.numa_node if cfg.numa_node in ("auto",) else (
            None if cfg.numa_node == "off" else int(cfg.numa_node))
        self.metrics = Metrics()
        self.group = HostPoolGroup(self.layout, self.rows, device_index=cfg.cuda_index,
                                   arena_options={"numa_node": numa,
                                                  "touch_threads": cfg.touch_threads},
                                   zero_on_free=cfg.zero_on_free)
        self.server: Server | None = None
        self.scheduler: Scheduler | None = None
        try:
            self.scheduler = Scheduler(self.device, self._wake,
                                         inline_max_bytes=cfg.inline_max_bytes)
            registry = Registry(cfg.max_clients, cfg.ack_retention)
            self.state = DaemonState(self.layout, self.group, self.scheduler, registry,
                                     self.metrics, self.device,
                                     heartbeat_timeout=cfg.heartbeat_timeout,
                                     load_event_sets=cfg.load_event_sets,
                                     shm_dirs=tuple(cfg.shm_dirs))
            if cfg.sparse_rows:
                self.state.sparse = _sparse_region(self.layout, cfg)
            self.server = Server(self.state, self.address, cfg.spin_us, curve)
            self.metrics_port = 0
            if cfg.metrics_port:
                self.metrics_port = self.metrics.serve_http(cfg.metrics_port, cfg.metrics_addr)
        except BaseException:
            self._teardown()
            raise
        self._init_gauges()
        self._closed = False

    def _wake(self) -> None:
        if self.server is not None:
            self.server.wake()

    def _init_gauges(self) -> None:
        st = self.group.arena.stats
        m = self.metrics
        m.set("pinned_bytes", st.get("requested_bytes", self.group.arena_bytes))
        m.set("pin_seconds", st.get("seconds") or 0.0)
        m.set("pin_gibps", st.get("gib_per_s") or 0.0)
        for name, p in self.group.pools.items():
            m.set("host_pool_bytes", p.data_bytes, name)
        if st.get("numa_policy") in ("first-touch", "preferred"):
            m.fallback("numa_" + str(st["numa_policy"]).replace("-", "_"))  # logged by host_pools
        self.state.refresh_gauges()

    # ------------------------------------------------------------------ description
    def summary(self) -> str:
        a = self.group.arena.stats
        lay = self.layout
        lines = [
            f"hicache serve: {lay.model.name} stage {lay.stage.pp_rank}/{lay.stage.pp_size} "
            f"layers [{lay.stage.start}, {lay.stage.end}) swa={lay.swa_mode} "
            f"c128_state={lay.c128_state} mtp={lay.mtp} on {self.device}",
            f"  {'pool':<17}{'space':<10}{'layers':>7}{'row bytes':>11}{'host rows':>11}"
            f"{'host bytes':>13}",
        ]
        for name, p in self.group.pools.items():
            lines.append(f"  {name:<17}{p.spec.index:<10}{p.spec.num_layers:>7}"
                         f"{p.spec.page_bytes:>11}{p.num_rows:>11}{format_bytes(p.data_bytes):>13}")
        rows = ", ".join(f"{s}={n}" for s, n in self.rows.items())
        lines += [
            f"  host rows: {rows} (device rows {self.cfg.device_rows})",
            f"  arena: {format_bytes(self.group.arena_bytes)}, NUMA node {a.get('numa_node')} "
            f"({a.get('numa_policy')}), {'pinned' if a.get('registered') else 'not pinned (CPU mode)'}"
            f" in {a.get('seconds')} s = {a.get('gib_per_s')} GiB/s with "
            f"{a.get('touch_threads')} touch threads, huge pages {a.get('hugepages')}",
            f"  socket: {self.server.endpoint if self.server else self.address}; metrics: "
            + (f"http://{self.cfg.metrics_addr}:{self.metrics_port}/metrics"
               if self.metrics_port else "off")
            + f"; heartbeat timeout {self.cfg.heartbeat_timeout:g} s",
        ]
        return "\n".join(lines)

    # ------------------------------------------------------------------ running
    def serve(self) -> None:
        assert self.server is not None
        # everything built so far (torch, the layout, the pools) lives until exit: keep the
        # cyclic GC from re-scanning it on every collection of the hot loop's short-lived objects
        gc.collect()
        gc.freeze()
        self.server.serve()

    def stop(self) -> None:
        """Ask the loop to return (safe from a signal handler)."""
        if self.server is not None:
            self.server.stop()

    def close(self, timeout: float = 30.0) -> None:
        if getattr(self, "_closed", True):
            return
        self._closed = True
        st = self.state
        st.stopping = True
        t0 = time.monotonic()
        if not st.wait_idle(timeout):
            log.error("shutdown: %d operations did not finish within %.0f s; their acks report "
                      "them failed and the host arena stays mapped until the process exits",
                      self.scheduler.in_flight if self.scheduler else -1, timeout)
            self._leak_arena = True  # a copy may still touch it: never unmap under it
            st.fail_pending("daemon shutting down")
        st.collect()
        if self.server is not None:
            self.server.send_acks()
            self.server.refuse_pending()
        for c in [*st.registry.clients.values(), *st.registry.retiring.values()]:
            st.registry.remove(c)  # closes device mappings
        log.info("shutdown: drained in %.3f s", time.monotonic() - t0)
        self._teardown()

    def _teardown(self) -> None:
        if self.scheduler is not None:
            self.scheduler.close(timeout=5.0)
        sparse = getattr(getattr(self, "state", None), "sparse", None)
        if sparse is not None and not getattr(self, "_leak_arena", False):
            sparse.close()
        if self.server is not None:
            self.server.close()
        self.metrics.close()
        if not getattr(self, "_leak_arena", False):
            self.group.close()


def _sparse_region(layout: Any, cfg: Any) -> Any:
    """The HiSparse host region (``--sparse-rows``), pinned for the daemon's GPU."""
    from hicache.host_pools.cuda_host import CudaHostRegistrar

    from .sparse import SparseRegion

    if "c4_kv" not in layout.pools:
        raise UsageError("--sparse-rows: this stage has no C4 layers")
    reg = CudaHostRegistrar(cfg.cuda_index) if cfg.cuda_index is not None else None
    return SparseRegion(layout, cfg.sparse_rows, cfg.shm_dirs[0], reg, cfg.min_sparse_prompt_len)
