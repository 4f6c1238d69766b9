"""Assembly of one daemon: config -> layout -> host rows -> arena + pool group -> engine -> server.

``Daemon(cfg, pre=None)`` first checks everything that can be checked without memory (sizing,
socket address, CURVE keys, a tcp port and the NUMA node in ``controllers.preflight``, ``pre``
where the caller ran it already, as ``serve`` does before this module loads; then the device
and the socket folder) and binds the metrics port;
only then is the host arena mapped, touched and pinned (so an overcommit fails at start-up with
the sizes in the message, and a bad flag fails before any of that). ``start_error(e)`` turns a
start-up ``OSError`` / pool error into a one-line ``UsageError`` naming the setting.
``summary()`` describes the daemon,
``serve()`` runs the loop until ``shutdown`` / ``stop()`` / SIGTERM, ``close()`` tears down in
order: stop taking commands, let in-flight transfers finish (or report them failed), deliver
their acks, drop every worker's device mappings, unregister and unmap the arena, close the
socket and remove its file.
"""
from __future__ import annotations

import fcntl
import gc
import logging
import os
import resource
import stat
import time
from typing import Any

import torch

from hicache.core.channel import sweep_left_behind
from hicache.core.addresses import url_host
from hicache.core.config import ServeConfig, metrics_listen, tp_note
from hicache.core.errors import CapacityError, UsageError
from hicache.core.version import __version__
from hicache.host_pools.errors import PoolError
from hicache.kernels import copy_engine
from hicache.kernels.sharing import gpu_sharing
from hicache.kernels.tables import TransferError
from hicache.host_pools.group import HostPoolGroup
from hicache.core.sizes import arena_bytes, format_bytes, sparse_region_bytes
from hicache.controllers.metrics import Metrics

from .preflight import Preflight, check_socket_file, check_socket_folder, preflight
from .registry import Registry
from .server import Server
from .state import DaemonState
from .scheduler import Scheduler
from .warm_copies import warm_pools

# at a stop past the drain timeout: how long cancelled CPU copies get to reach their next chunk
STOP_CANCEL_WAIT_S = 5.0
UNMAP_WAIT_S = 10.0  # at shutdown, the longest wait for the unmapper to drop the workers' mappings
FD_LIMIT_CAP = 1 << 20  # the soft descriptor limit is raised to the hard one, at most this
log = logging.getLogger("hicache.daemon")


def raise_fd_limit() -> int:
    """Raise the soft ``RLIMIT_NOFILE`` to the hard one (at most ``FD_LIMIT_CAP``): clients'
    mappings and handed-in descriptors must not meet the common 1,024 default, where libzmq
    aborts the process at its next socket. Returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    want = FD_LIMIT_CAP if hard == resource.RLIM_INFINITY else min(hard, FD_LIMIT_CAP)
    if soft == resource.RLIM_INFINITY or soft >= want:
        return int(soft if soft != resource.RLIM_INFINITY else want)
    try:
        resource.setrlimit(resource.RLIMIT_NOFILE, (want, hard))
    except (ValueError, OSError) as e:
        log.warning("cannot raise the open-file limit from %d to %d: %s", soft, want, e)
        return int(soft)
    return int(want)


class SocketLock:
    """``<socket>.lock``, held (``flock``) for the daemon's life: a second daemon on the same
    socket is refused even while the first is too busy, or stopped, to answer a probe."""

    def __init__(self, path: str, address: str) -> None:
        self.path = path + ".lock"
        while True:
            try:
                self.fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
            except OSError as e:
                raise UsageError(f"--socket {address}: cannot create its lock file "
                                 f"{self.path}: {e.strerror}") from None
            try:
                fcntl.flock(self.fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(self.fd)
                raise UsageError(f"another daemon already serves {address} (it holds "
                                 f"{self.path})") from None
            if self._named():
                return
            os.close(self.fd)  # a stopping daemon removed the file we locked: take the new one

    def _named(self) -> bool:
        """Whether the locked file is still the one at ``path`` (not removed meanwhile)."""
        try:
            st = os.stat(self.path)
        except FileNotFoundError:
            return False
        mine = os.fstat(self.fd)
        return (st.st_dev, st.st_ino) == (mine.st_dev, mine.st_ino) and mine.st_nlink > 0

    def held(self) -> bool:
        """Whether this daemon holds the lock at ``path`` now: the file it locked is still
        there, or, when it was removed (a /tmp cleaner), a new one was created and locked
        (False: it cannot be, or another daemon locked one meanwhile)."""
        if self.fd < 0:
            return False
        try:
            if self._named():
                return True
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        except OSError:  # (its folder went too, or changed under it)
            return False
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:  # another daemon holds it (or the file system refuses locks)
            os.close(fd)
            return False
        os.close(self.fd)
        self.fd = fd
        try:
            return self._named()
        except OSError:
            return False

    def release(self) -> None:
        if self.fd < 0:
            return
        if self._named():  # while still held (a daemon that locked it meanwhile sees it gone
            os.unlink(self.path)  # and takes a new one)
        os.close(self.fd)
        self.fd = -1


def remove_folders(folders: list[str]) -> None:
    """Remove the folders ``_prepare_ipc`` created, deepest first, while they are empty."""
    for d in folders:
        try:
            os.rmdir(d)
        except OSError:
            return


def _prepare_ipc(address: str, warnings: list[str]) -> tuple[list[str], SocketLock]:
    """Create the socket's directory (each folder made, 0700), take the socket's lock, and
    refuse a live socket or a path that is not a socket. Returns the folders this call created
    (deepest first: ``remove_folders`` takes them away again; a refusal here does), and the
    lock; what the operator should hear of (a folder open to others, a stale socket file
    replaced) is added to ``warnings``."""
    path = address[len("ipc://"):]
    d = os.path.dirname(os.path.abspath(path))
    made: list[str] = []
    up = d
    while not os.path.isdir(up) and up != os.path.dirname(up):
        made.append(up)
        up = os.path.dirname(up)
    try:
        try:
            for f in reversed(made):  # every folder made here is 0700 (makedirs: the leaf only)
                try:
                    os.mkdir(f, 0o700)
                except FileExistsError:  # another daemon starting beside us made it: its own
                    made.remove(f)
            st = os.stat(d)
        except OSError as e:
            raise UsageError(f"--socket {address}: cannot create the socket folder {d}: "
                             f"{e.strerror}") from None
        return made, _take_socket(address, path, d, st, warnings)
    except BaseException:
        remove_folders(made)
        raise


def _take_socket(address: str, path: str, d: str, st: os.stat_result,
                 warnings: list[str]) -> SocketLock:
    """The checks of an existing socket folder ``d``, then the socket's lock and a stale
    socket file removed."""
    check_socket_folder(address, d, st)
    if st.st_mode & 0o077:
        warnings.append(f"socket directory {d} is accessible by other users (mode "
                        f"{stat.S_IMODE(st.st_mode):o}); the socket itself is 0600")
    lock = SocketLock(path, address)
    try:
        check_socket_file(address, path)  # again: the preflight's look may be old by now
        if os.path.lexists(path):
            if _answers(address):  # a daemon of a version without the lock
                raise UsageError(f"another daemon already serves {address}")
            os.unlink(path)  # stale socket file of a dead daemon
            warnings.append(f"replaced the stale socket file {path} (a daemon that did not "
                            f"stop cleanly left it; nothing answered there)")
    except BaseException:
        lock.release()
        raise
    return lock


def start_error(e: BaseException) -> BaseException:
    """A start-up failure as one line naming the setting; anything else unchanged."""
    if isinstance(e, UsageError):
        return e
    if isinstance(e, PoolError):
        return UsageError(f"host pool (--host-mem / --host-ratio): {e}")
    if isinstance(e, OSError):
        where = f" ({e.filename})" if e.filename else ""
        return UsageError(f"{e.strerror or e}{where}")
    return e


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


class Daemon:
    def __init__(self, cfg: ServeConfig, pre: Preflight | None = None) -> None:
        self.cfg = cfg
        # --- checks that allocate nothing
        pre = preflight(cfg) if pre is None else pre
        sized = pre.sized
        self.layout, self.device_rows, self.rows = sized.layout, sized.device_rows, sized.host_rows
        self.sizing_source = sized.source
        # the planner's, then the socket's, printed by ``serve`` at start
        self.start_warnings: list[str] = list(sized.warnings)
        self.device = torch.device(cfg.device)
        if self.device.type == "cuda":
            if not torch.cuda.is_available():
                raise UsageError(f"--device {cfg.device}: CUDA is not available")
            if self.device.index >= torch.cuda.device_count():
                raise UsageError(f"--device {cfg.device}: there are "
                                 f"{torch.cuda.device_count()} GPUs")
            torch.cuda.set_device(self.device)  # never a context on another GPU
            try:
                copy_engine.configure(cfg.copy_engine)
            except TransferError as e:
                raise UsageError(f"--copy-engine: {e}") from None
        self.address = pre.address
        raise_fd_limit()
        self.made_folders, self.socket_lock = _prepare_ipc(self.address, self.start_warnings) \
            if pre.ipc else ([], None)
        try:
            self._bring_up(cfg, pre.numa, pre.curve)
        except BaseException:
            if self.socket_lock is not None:
                self.socket_lock.release()
            remove_folders(self.made_folders)  # a failed start leaves no folder of ours behind
            raise

    def _bring_up(self, cfg: ServeConfig, numa: int | str | None, curve: Any) -> None:
        """Metrics endpoint, host arena, transfer engine, state and server, in that order."""
        self.metrics = Metrics()
        self.metrics_port = 0
        if cfg.metrics_port:
            try:
                self.metrics_port = self.metrics.serve_http(cfg.metrics_port, cfg.metrics_addr)
            except OSError as e:
                raise UsageError(f"{metrics_listen(cfg)}: {e.strerror}") from None
        # --- the host arena (mapped, touched, pinned)
        log.debug("host arena: %s for %s", format_bytes(arena_bytes(self.layout, self.rows)),
                 ", ".join(f"{s}={n}" for s, n in self.rows.items()))
        try:
            self.group = HostPoolGroup(self.layout, self.rows, device_index=cfg.cuda_index,
                                       arena_options={"numa_node": numa,
                                                      "touch_threads": cfg.touch_threads,
                                                      # its progress lines are INFO's
                                                      "progress": log.isEnabledFor(
                                                          logging.INFO)},
                                       zero_on_free=cfg.zero_on_free)
        except BaseException:
            self.metrics.close()
            raise
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
            self.state.wake = self._wake  # a reaped client's rows go back a slice per turn
            if self.device.type == "cuda":  # before the socket: no first copy compiles
                launches, secs = warm_pools(self.state)
                log.info("copy kernels ready in %.2f s (%d launches)", secs, launches)
            sweep_left_behind(cfg.shm_dirs[0])  # what killed daemons left there
            self.state.address = self.address
            if cfg.sparse_rows:
                self.state.sparse = _sparse_region(self.layout, cfg)
            self.server = Server(self.state, self.address, cfg.server_spin_us, curve)
            if self.socket_lock is not None:  # a socket file removed while it runs: bound again
                self.server.relock = self.socket_lock.held
            self.state.spin_us = cfg.server_spin_us
            self.state.allow_shutdown = cfg.allow_shutdown
            if cfg.l3 != "off":
                self._start_l3()
        except BaseException:
            self._teardown()
            raise
        self._init_gauges()
        self._closed = False

    def _start_l3(self) -> None:
        from . import l3_format
        from .l3_store import MooncakeL3, l3_settings, load_store_class

        cfg = self.cfg
        store_class = load_store_class()  # one clear line naming what to install, or the class
        settings = l3_settings(cfg)
        objects = l3_format.Objects(self.layout, self.group, cfg.l3_scope or "")
        if not objects.formats:
            raise UsageError(f"--l3: this stage has nothing to store: {objects.refused}")
        self.state.l3_ns = objects.ns["full"].rsplit("/", 2)[0]
        self.state.l3 = MooncakeL3(settings, self.group.arena, objects, self.metrics, self._wake,
                                   store_class)

    def _wake(self) -> None:
        if self.server is not None:
            self.server.wake()

    def _init_gauges(self) -> None:
        st = self.group.arena.stats
        m = self.metrics
        lay = self.layout
        stage = lay.stage
        self.state.identity = {
            "model": lay.model.name, "stage": [stage.pp_rank, stage.pp_size],
            "layers": [stage.start, stage.end], "swa_mode": lay.swa_mode,
            "host_split": self.cfg.host_split, "socket": self.address, "pid": os.getpid(),
            "version": __version__, "started": round(time.time(), 3),
            "allow_shutdown": bool(self.cfg.allow_shutdown)}
        m.set("daemon_info", 1, lay.model.name, str(self.device), str(stage.pp_rank),
              str(stage.pp_size), lay.swa_mode, self.cfg.host_split, self.address)
        m.set("pinned_bytes", st.get("requested_bytes", self.group.arena_bytes))
        m.set("pin_seconds", st.get("seconds") or 0.0)
        node = st.get("numa_node")
        m.set("numa_node", -1 if node is None else int(node))
        m.declare_pools(self.group.pools)
        for name, p in self.group.pools.items():
            m.set("host_pool_bytes", p.data_bytes, name)
        if st.get("numa_policy") in ("first-touch", "preferred"):
            m.fallback("numa_" + str(st["numa_policy"]).replace("-", "_"))  # logged by host_pools
        self.state.refresh_gauges()

    # ------------------------------------------------------------------ description
    def copy_path(self) -> str:
        """How bytes move between this daemon's host pool and the GPU, in one phrase."""
        if self.device.type != "cuda":
            return "CPU copies (CPU mode)"
        if copy_engine.enabled():
            return (f"copy-engine DMA for rows of {copy_engine.MIN_BYTES >> 10} KiB or more, "
                    f"zero-copy kernels for the rest")
        why = "off (--copy-engine off)" if self.cfg.copy_engine == "off" else copy_engine.status()
        return f"zero-copy kernels only; copy-engine DMA {why}"

    def summary(self) -> str:
        a = self.group.arena.stats
        lay = self.layout
        lines = [
            f"hicache serve: {lay.model.name} stage {lay.stage.pp_rank}/{lay.stage.pp_size} "
            f"layers [{lay.stage.start}, {lay.stage.end}) swa={lay.swa_mode} "
            f"c128_state={lay.c128_state} mtp={lay.mtp} on {self.device}{tp_note(self.cfg)}",
            f"  {'pool':<17}{'space':<10}{'layers':>7}{'row bytes':>11}{'host rows':>11}"
            f"{'host bytes':>13}",
        ]
        for name, p in self.group.pools.items():
            lines.append(f"  {name:<17}{p.spec.index:<10}{p.spec.num_layers:>7}"
                         f"{p.spec.page_bytes:>11}{p.num_rows:>11}{format_bytes(p.data_bytes):>13}")
        rows = ", ".join(f"{s}={n}" for s, n in self.rows.items())
        lines += [
            f"  host rows: {rows} (device rows "
            f"{', '.join(f'{s}={n}' for s, n in self.device_rows.items())} from "
            f"{self.sizing_source}); write policy {self.cfg.write_policy}",
            f"  arena: {format_bytes(self.group.arena_bytes)}, NUMA "
            + (f"node {a['numa_node']} ({a.get('numa_policy')})" if a.get("numa_node") is not None
               else f"off ({a.get('numa_policy')})") + ","
            f" {'pinned' if a.get('registered') else 'not pinned (CPU mode)'}"
            f" in {a.get('seconds')} s = {a.get('gib_per_s')} GiB/s with "
            f"{a.get('touch_threads')} touch thread{'' if a.get('touch_threads') == 1 else 's'}"
            f", huge pages {a.get('hugepages')}",
            f"  socket: {self.server.endpoint if self.server else self.address}"
            + (" (tcp without CURVE: every local user can connect; the ipc socket or CURVE "
               "keys restrict it)" if self.address.startswith("tcp://")
               and not self.cfg.curve_secret_key else "") + "; metrics: "
            + (f"http://{url_host(self.cfg.metrics_addr)}:{self.metrics_port}/metrics"
               if self.metrics_port else "off")
            + f"; heartbeat timeout {self.cfg.heartbeat_timeout:g} s; "
            + (f"busy-polls {self.cfg.server_spin_us / 1e3:g} ms after a request"
               if self.cfg.server_spin_us else "sleeps between requests (--spin-us 0)"),
            f"  copy path: {self.copy_path()}",
            *([f"  GPU sharing: {gpu_sharing(self.cfg.cuda_index)[1]}"]
              if self.device.type == "cuda" else []),
        ]
        if self.state.l3 is not None:
            from hicache.core import bind_shim

            lines.append(f"  L3: mooncake master {self.cfg.l3_master}, metadata "
                         f"{self.cfg.l3_metadata}, {self.cfg.l3_protocol}, scope "
                         f"{self.cfg.l3_scope}, namespace {self.state.l3_ns}/<mirror>, objects "
                         f"{self.state.l3.objects.describe()}, "
                         f"segment {format_bytes(self.cfg.l3_segment)}; "
                         f"{bind_shim.listen_note(self.cfg.l3_local_host)}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ running
    def serve(self) -> None:
        assert self.server is not None
        # everything built so far (torch, the layout, the pools) lives until exit: keep the
        # cyclic GC from re-scanning it on every collection of the hot loop's short-lived objects
        gc.collect()
        gc.freeze()
        try:
            self.server.serve()
        finally:  # frozen objects are never freed at exit: Triton's nanobind would report
            gc.unfreeze()  # them all as leaks on every stop

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
        if st.l3 is not None:  # queued L3 jobs complete unrun: no backlog of writes at a stop
            st.l3.drain()
        t0 = time.monotonic()
        waited = st.stop_drain(timeout, STOP_CANCEL_WAIT_S)
        if waited != "idle":
            stalled = st.l3.stalled() if st.l3 is not None else {}
            if waited == "hung":
                log.warning("shutdown: %d L3 jobs wait on %s; not waiting for Mooncake's "
                            "timeout: they are answered as stopped (nothing found or written; "
                            "a kv_clear failed), and the host arena stays mapped until the "
                            "process exits", len(st.l3_ops),
                            f"a storage node that does not answer (stalled: "
                            f"{', '.join(stalled)})" if stalled else
                            "a master that does not answer")
            else:
                log.error("shutdown: %d operations did not finish within %.0f s; their acks "
                          "report them failed (abandoned: their copies may still run) and the "
                          "host arena stays mapped until the process exits",
                          self.scheduler.in_flight if self.scheduler else -1, timeout)
            self._leak_arena = True  # a copy may still touch it: never unmap under it
            st.releaser.abandoned = True  # nor a client's sparse region
            st.collect()  # (what finished meanwhile keeps its results)
            st.fail_pending("daemon shutting down")
        st.collect()
        if self.server is not None:
            self.server.send_acks()
            self.server.refuse_pending()
        for c in [*st.registry.clients.values(), *st.registry.retiring.values()]:
            st.registry.remove(c)  # hands device mappings to the unmapper thread
        # the unmapper ends its work before the process does: a thread still dropping mappings
        # (its calls let go of the GIL) when the interpreter finalizes is killed there, and 1
        # of 65 runs of the channel fuzz test's daemon aborted so after "stopped by SIGTERM"
        # ("terminate called without an active exception", exit -6)
        if not st.unmapper.flush(UNMAP_WAIT_S):
            log.error("shutdown: device mappings of %d workers were still being dropped after "
                      "%.0f s", st.unmapper.pending(), UNMAP_WAIT_S)
        log.info("shutdown: drained in %.3f s", time.monotonic() - t0)
        self._teardown()

    def _teardown(self) -> None:
        l3 = getattr(getattr(self, "state", None), "l3", None)
        if l3 is not None:
            l3.close(timeout=1.0 if l3.hung() else 5.0)  # (hung: its calls end at the RPC
            # timeout, ~30 s; the store stays open under them)
            if l3.store is not None:  # a Mooncake call still runs: it may write the arena
                self._leak_arena = True
        if self.scheduler is not None:
            self.scheduler.close(timeout=5.0)
        sparse = getattr(getattr(self, "state", None), "sparse", None)
        if sparse is not None:
            if getattr(self, "_leak_arena", False):
                sparse.close_memfds()  # mapped (and pinned) until exit
            else:
                sparse.close()
        if self.server is not None:
            self.server.close()
        if getattr(self, "socket_lock", None) is not None:
            self.socket_lock.release()
        remove_folders(getattr(self, "made_folders", []))  # nor does a stop
        self.metrics.close()
        if not getattr(self, "_leak_arena", False):
            self.group.close()


def _sparse_region(layout: Any, cfg: Any) -> Any:
    """The HiSparse host regions (``--sparse-rows`` rows each, ``--sparse-clients`` at most),
    pinned for the daemon's GPU; the first one is made now."""
    from hicache.host_pools.cuda_host import CudaHostRegistrar

    from .sparse_regions import SparseRegions

    if "c4_kv" not in layout.pools:
        raise UsageError("--sparse-rows: this stage has no C4 layers")
    reg = CudaHostRegistrar(cfg.cuda_index) if cfg.cuda_index is not None else None
    try:
        return SparseRegions(layout, cfg.sparse_rows, cfg.shm_dirs[0], reg,
                             cfg.min_sparse_prompt_len, cfg.sparse_clients)
    except (OSError, MemoryError, CapacityError) as e:
        need = sparse_region_bytes(layout, cfg.sparse_rows)
        raise UsageError(f"--sparse-rows {cfg.sparse_rows}: cannot make the sparse region "
                         f"({format_bytes(need)} of C4 KV): "
                         f"{getattr(e, 'strerror', None) or e}") from None
