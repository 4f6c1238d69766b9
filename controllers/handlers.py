"""Handlers of the session and bookkeeping commands, and the table that routes every command.

Each handler is ``fn(state, client, header, arrays) -> (reply fields, reply arrays)``; it raises
``ProtocolError(code, message)`` to refuse, or lets a host-pool error through, which
``error_code`` maps to its code by type. Nothing is changed before the last check has passed,
so a refused command leaves the daemon exactly as it was. Headers reach here type-checked
against ``protocol.COMMANDS``; index frames arrive as int64 memoryviews. ``HANDLERS`` is built
from the command table's ``handler`` names (here, in ``copy_commands``, ``l3_handlers``,
``kv_store`` and ``sparse``).
"""
from __future__ import annotations

import logging
import os
import secrets
import time
from typing import Any, Callable, Sequence

from hicache.core.channel import Channel, WakeSocket, supported
from hicache.core.ipc import make_ipc_events
from hicache.core.layout import Layout
from hicache.core.model import brief
from hicache.core.proc_start import own_start
from hicache.core import wire_json
from hicache.core.protocol import COMMANDS, MAX_HEADER_BYTES, VERSION, ProtocolError
from hicache.core.version import __version__
from hicache.host_pools.errors import NotOwnerError, PoolError, PoolExhausted, RowRangeError
from hicache.kernels.tables import LayerTable, TransferError

from . import copy_commands, kv_store, l3_handlers, sparse
from .copy_commands import Reply, request_of, worker_of
from .device_buffers import open_buffers, open_events
from .ops import Ids
from .registry import ClientState, Intake, RegisteredWorker, public_label
from .state import DaemonState
from .warm_copies import warm_pools

log = logging.getLogger("hicache.daemon")
MAX_POOL_FDS = 16  # descriptors one worker hands in for its pools (hicache's own workers: 1)
MAX_INTAKE_HELD = 256  # descriptors all clients' open intakes may hold at once

# a host-pool refusal's error code, by exception type (first match)
POOL_ERROR_CODES: tuple[tuple[type, str], ...] = (
    (PoolExhausted, "no_space"), (RowRangeError, "bad_rows"), (NotOwnerError, "not_owner"),
    (PoolError, "bad_field"))


def error_code(e: BaseException) -> str | None:
    """The protocol error code of an exception a handler let through; None: a daemon bug."""
    if isinstance(e, ProtocolError):
        return e.code
    for t, code in POOL_ERROR_CODES:
        if isinstance(e, t):
            return code
    return None


def heartbeat(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    out = {"t": time.time(), "version": __version__, "protocol": VERSION,
           "device": str(st.device), "heartbeat_timeout": st.heartbeat_timeout,
           "registered": c.worker is not None, "reaped": c.reaped, "pid": os.getpid(),
           "pid_start": own_start()}  # (the same from every pid namespace: proc_start)
    if h.get("full"):
        out.update(host_rows=st.host_rows, layout=st.layout.to_dict(),
                   stage_layers=list(st.stage_layers))
    return out, []


REFUSALS_LOGGED = 20  # refused registers logged per REFUSALS_WINDOW_S (a flood is counted)
REFUSALS_WINDOW_S = 60.0
WARM_LOGGED_S = 0.05  # a register whose kernel warm-up took longer logs it (it compiled)
_refusals = {"window": float("-inf"), "logged": 0, "skipped": 0}


def register(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    try:
        return _register(st, c, h)
    except ProtocolError as e:  # a worker that is not attached says why in the daemon's log
        _log_refused(c, e)
        raise


def _log_refused(c: ClientState, e: ProtocolError) -> None:
    """One INFO line per refused register, at most ``REFUSALS_LOGGED`` a window (a client
    retrying in a loop does not flood the log; the lines left out are counted in the next)."""
    now, r = time.monotonic(), _refusals
    if now - r["window"] > REFUSALS_WINDOW_S:
        if r["skipped"]:
            log.info("%d more refused registers were not logged", r["skipped"])
        r.update(window=now, logged=0, skipped=0)
    if r["logged"] >= REFUSALS_LOGGED:
        r["skipped"] += 1
        return
    r["logged"] += 1
    log.info("client %s: register refused (%s): %s", c.cid, e.code, e.message)


def _register(st: DaemonState, c: ClientState, h: dict) -> Reply:
    if c.worker is not None:
        raise ProtocolError("already_registered", "this client already registered a worker; "
                                         "unregister first")
    mode = h["mode"]
    if mode not in ("cpu", "cuda"):
        raise ProtocolError("bad_field", f"mode must be 'cpu' or 'cuda', got {mode[:32]!r}")
    try:
        layout = Layout.from_dict(h["layout"])
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise ProtocolError("layout_mismatch", f"bad layout: {type(e).__name__}: {str(e)[:300]}") from None
    mine, theirs = st.layout.to_dict(), layout.to_dict()
    if theirs != mine:
        diff = [k for k in mine if mine[k] != theirs.get(k)]
        detail = "; ".join(f"{k}: daemon {brief(mine[k], 120)} "
                           f"vs worker {brief(theirs.get(k), 120)}"
                           for k in diff)
        raise ProtocolError("layout_mismatch", f"the worker's layout differs from the daemon's: {detail}")
    dev_rows = h["device_rows"]
    spaces = sorted({p.index for p in st.layout.pools.values()})
    if not isinstance(dev_rows, dict) or sorted(dev_rows) != spaces or \
            any(type(v) is not int or v <= 0 for v in dev_rows.values()):
        raise ProtocolError("bad_field", f"device_rows must give a positive row count for exactly the "
                                f"spaces {spaces}, got {brief(dev_rows, 120)}")
    tp_rank = h.get("tp_rank", 0)
    if tp_rank < 0:
        raise ProtocolError("bad_field", "tp_rank must not be negative")
    events_h = h.get("events", [])
    if mode == "cpu" and events_h:
        raise ProtocolError("bad_field", "events are CUDA interprocess events; CPU mode has none")
    handed = mode == "cpu" or "fd_token" in h  # (refused in CUDA mode, by open_buffers)
    bufs = open_buffers(st.layout, dev_rows, h["buffers"], mode, st.device,
                        (lambda: _handed_in(st, c, h.get("fd_token"))) if handed else None)
    try:
        tables = {name: LayerTable(layers, f"device:{name}") for name, layers in bufs.layers.items()}
        events = open_events(events_h, st.device) if events_h else []
        load_events, load_handles = [], []
        if mode == "cuda":
            for _ in range(st.load_event_sets):
                evs, hs = make_ipc_events(len(st.stage_layers), st.device)
                load_events.append(evs)
                load_handles.append(hs)
            _warm(st, c, tables)
    except TransferError as e:
        bufs.close()
        raise ProtocolError("bad_handle", str(e)[:300]) from None
    except BaseException:
        bufs.close()
        raise
    c.worker = RegisteredWorker(h.get("name"), tp_rank, dict(dev_rows), bufs, tables, events,
                                load_events)
    st.registry.close_intake(c)  # its descriptors are mapped: closed (the mappings stay)
    _log_registered(st, c, dict(dev_rows))
    c.reaped = None  # registered afresh: the old client's reap is no news any more
    return {"client": c.cid, "host_rows": st.host_rows, "device": str(st.device),
            "stage_layers": list(st.stage_layers), "load_events": load_handles,
            "heartbeat_timeout": st.heartbeat_timeout, "session": c.session}, []


def _warm(st: DaemonState, c: ClientState, tables: dict[str, LayerTable]) -> None:
    """The copy kernels' variants for this worker's pools, before its first copy: loaded at
    start for dense pools (``warm_copies``), so this compiles only where its pools are aligned
    otherwise (then logged, with the time it took)."""
    launches, secs = warm_pools(st, tables)
    (log.info if secs > WARM_LOGGED_S else log.debug)(
        "client %s: copy kernels for its pools ready in %.3f s (%d launches)", c.cid, secs,
        launches)


def _log_registered(st: DaemonState, c: ClientState, dev_rows: dict[str, int]) -> None:
    """One INFO line per registered worker, and a WARNING when its device pools hold as many
    ``page`` rows as the daemon's host tier: the daemon was sized for smaller pools than the
    engine made (``--kv-mem`` / ``--device-rows``), and that host tier can only keep pages the
    device already holds (what ``serve`` refuses at start without ``--force``). Only ``page``:
    every mirror keeps a page's compressed rows there, while a checkpoints split holds far fewer
    ``swa_page`` / ``req_slot`` rows than the device on purpose (one per checkpoint)."""
    rows = ", ".join(f"{s}={n}" for s, n in sorted(dev_rows.items()))
    name = brief(c.worker.name if c.worker is not None and c.worker.name else "(unnamed)", 64)
    log.info("client %s registered worker %s: device rows %s", c.cid, name, rows)
    small = [s for s in ("page",) if s in dev_rows and st.host_rows.get(s, 0) <= dev_rows[s]]
    if small:
        log.warning("client %s: worker %s has as many device rows as the host tier has, or "
                    "more (%s): the host tier can only keep pages the device already holds; "
                    "size the daemon as the engine (--kv-mem or --device-rows) or give it more "
                    "host memory", c.cid, name,
                    ", ".join(f"{s} {dev_rows[s]} device >= {st.host_rows.get(s, 0)} host"
                              for s in small))


def hand_in(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """Take ``count`` descriptors in on the daemon's descriptor socket for this client's next
    ``register`` (a CPU worker's device pools: sealed memfds). A second ``hand_in`` replaces
    one not used yet; what it received is closed."""
    n = h["count"]
    reg = st.registry
    if st.device.type != "cpu":
        raise ProtocolError("unsupported", f"hand_in: this daemon serves {st.device}, where "
                                           f"device pools are shared by CUDA IPC handles")
    if c.worker is not None:
        raise ProtocolError("already_registered", "hand_in: this client already registered a "
                                                  "worker; unregister first")
    if not 0 < n <= MAX_POOL_FDS:
        raise ProtocolError("bad_field", f"hand_in: count must be 1..{MAX_POOL_FDS}, got {n}")
    held = reg.intake_fds - (c.intake.count if c.intake is not None else 0)
    if held + n > MAX_INTAKE_HELD:
        raise ProtocolError("busy", f"hand_in: {held} descriptors are being handed in by other "
                                    f"clients (at most {MAX_INTAKE_HELD} at once); retry")
    token = secrets.randbits(64) | 1
    try:
        handout = st.handout()
        handout.expect(token, n)
    except (OSError, ValueError) as e:
        raise ProtocolError("unsupported", f"hand_in: cannot take descriptors in on the "
                                           f"descriptor socket ({e})") from None
    reg.open_intake(c, Intake(token, handout, n))
    return {"fd_socket": handout.path, "fd_token": token}, []


def _handed_in(st: DaemonState, c: ClientState, token: Any) -> list[int]:
    """The descriptors this client handed in for ``token`` (still its intake's: closed when
    the registration succeeds, kept for a retry when it is refused)."""
    it = c.intake
    if it is None or token != it.token:
        raise ProtocolError("bad_handle", "register: a CPU worker's pools are sealed memfds "
                                          "handed in first: hand_in, send the descriptors to "
                                          "the socket it names with its token, then register "
                                          "with that fd_token")
    fds = it.received()
    if fds is None:
        raise ProtocolError("bad_handle", "register: the descriptors were not handed in (send "
                                          "them to the socket hand_in named, with its token)")
    return fds


def unregister(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    worker_of(c)
    st.registry.close_channel(c)  # the client drops its side too; register opens a new one
    freed, deferred = st.release_client(c, "unregister")
    return {"freed": freed, "deferred": deferred}, []


def alloc(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    rows = st.alloc_rows(h["counts"], (c.cid, request_of(h)))
    names = list(rows)
    return {"rows": {s: i for i, s in enumerate(names)}}, [rows[s].numpy() for s in names]


def free(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    owner = (c.cid, request_of(h))
    checked = st.check_free({space: Ids(arrays[f]).np() for space, f in h["rows"].items()}, owner)
    deferred = st.free_rows(checked, owner)
    return {"freed": sum(int(a.size) for a in checked.values()), "deferred": deferred}, []


def poll_acks(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    limit = h.get("max", 1024)
    if not 0 < limit <= 4096:
        raise ProtocolError("bad_field", "max must be in 1..4096")
    acks = st.registry.take_acks(c, h.get("ops"), limit, _ack_size, ACKS_REPLY_BYTES)
    return {"acks": acks, "in_flight": c.in_flight, "session": c.session}, []


ACKS_REPLY_BYTES = MAX_HEADER_BYTES // 2  # a poll_acks reply's acks; the rest stay retained


def _ack_size(ack: dict[str, Any]) -> int:
    return len(wire_json.dumps(ack)) + 1


def channel(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """Open this client's shared-memory command channel (``hicache.core.channel``): a sealed
    memfd, handed over on the daemon's descriptor socket, and its wake-up socket (mode 0600 in
    the first shm directory). A client that has one open gets the same one offered again. A
    channel this daemon does not offer (``_not_offered``: it sleeps between requests, CURVE,
    the platform) is refused ``unsupported``, or, for an ``optional`` request (what
    ``Client.register`` sends unless a channel is required), answered ``{"declined": why}``:
    the client's normal way to ZMQ, so no refused command is counted for it. One it offers but
    fails to make (no descriptor, no shm folder) is refused ``unsupported`` either way, and
    counted."""
    why = _not_offered(st, c)
    if why is not None:
        if h.get("optional"):
            return {"declined": _no_channel(why).message}, []
        raise _no_channel(why)
    return _open_channel(st, c)


def _not_offered(st: DaemonState, c: ClientState) -> str | None:
    """Why this daemon offers ``c`` no channel by design, or None."""
    why = supported()
    if why is None and not st.spin_us:
        why = ("this daemon sleeps between requests (--spin-us 0), where a channel saves "
               "nothing over ZMQ")
    if why is None and c.key is not None:
        why = "this daemon authenticates clients by CURVE key, and a shared-memory channel " \
              "carries no key"
    return why


def _open_channel(st: DaemonState, c: ClientState) -> Reply:
    try:
        handout = st.handout()
        if c.channel is None and st.wake_socket is None:
            st.wake_socket = WakeSocket.create(st.shm_dirs[0])
    except OSError as e:
        raise _no_channel(f"cannot create its sockets (the descriptor socket, the wake-up "
                          f"socket in {st.shm_dirs[0]}): {e}") from None
    ch = c.channel  # one open already: its hand-out failed, or the client maps it again; the
    fresh = ch is None  # same channel is offered once more (a client never has two)
    if fresh:
        try:
            ch = Channel.create()
        except OSError as e:
            raise _no_channel(f"cannot create its sealed memfd ({e})") from None
        st.registry.open_channel(c, ch)
    try:
        return dict(ch.hand_out(handout), wake=st.wake_socket.path), []
    except OSError as e:  # (no descriptor left for the offer's duplicate)
        if fresh:  # a refusal opens nothing: the channel made for it goes again
            st.registry.close_channel(c)
        raise _no_channel(f"cannot hand it out ({e})") from None


def _no_channel(why: str) -> ProtocolError:
    return ProtocolError("unsupported", f"channel: {why}; requests go over ZMQ")


def stats(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """The report; a peer that asks while it holds nothing (``hicache stats``) is forgotten
    first, so the report counts only the clients that stay."""
    st.forget_probe(c)
    return st.report(bool(h.get("check"))), []


def buffer_infos(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    return {"pools": st.buffer_infos()}, []


def reset(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    freed, deferred = st.release_client(c, "reset")
    return {"freed": freed, "deferred": deferred}, []


REFUSAL_LOG_S = 10.0  # a refused shutdown is logged at most this often (counted every time)
_refused_shutdown = [-REFUSAL_LOG_S]  # when one was last logged (monotonic)


def shutdown(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """Stop the daemon, as SIGTERM does; refused unless it was started with
    ``--allow-shutdown`` (a client of one engine must not stop the tier of the others)."""
    if not st.allow_shutdown:
        now = time.monotonic()
        if now - _refused_shutdown[0] >= REFUSAL_LOG_S:  # one line, not one per attempt
            _refused_shutdown[0] = now
            log.warning("shutdown asked by client %s: refused (no --allow-shutdown)",
                        public_label(c.cid))
        raise ProtocolError("unsupported", "shutdown: this daemon does not take the shutdown "
                                           "command (start it with --allow-shutdown); stop it "
                                           "with SIGTERM")
    who = public_label(c.cid)  # (never its routing id: the client's credential)
    log.warning("shutdown asked by client %s", who)
    st.stopped_by = f"the shutdown command of client {who}"
    st.stopping = True
    return {"stopping": True}, []


Handler = Callable[[DaemonState, ClientState, dict, Sequence], Reply]
HANDLERS: dict[str, Handler] = {
    name: globals().get(cmd.handler) or getattr(copy_commands, cmd.handler, None)
    or getattr(l3_handlers, cmd.handler, None) or getattr(kv_store, cmd.handler, None)
    or getattr(sparse, cmd.handler)  # HiSparse commands live in controllers/sparse.py
    for name, cmd in COMMANDS.items()}
