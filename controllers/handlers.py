"""One function per command: validate everything against the daemon's state, then act.

Each handler is ``fn(state, client, header, arrays) -> (reply fields, reply arrays)`` and raises
``ProtocolError(code, message)`` to refuse; it never mutates anything before the last check has
passed, so a refused command leaves the daemon exactly as it was. Headers reach here already
type-checked against ``protocol.SCHEMAS``; index frames arrive as int64 memoryviews.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Sequence

import numpy as np

from hicache.core.version import __version__
from hicache.host_pools.errors import PoolError, PoolExhausted
from hicache.kernels.tables import LayerTable, TokenFormat, TransferError
from hicache.core.ipc import make_ipc_events
from hicache.core.layout import Layout, LayoutError, PoolSpec
from hicache.core.protocol import MAX_NAME_LEN, VERSION, ProtocolError

from .device_buffers import open_buffers, open_events
from .registry import ClientState, Worker
from .state import DaemonState
from .transfer_engine import ClearSpec, ClearTarget, Ids, Item, Op

Reply = tuple[dict[str, Any], list[Any]]
OWNER_LOOP_MAX = 32  # rows checked one by one (owner_of); above, one vectorised pass


def _err(code: str, msg: str) -> ProtocolError:
    return ProtocolError(code, msg)


def _worker(c: ClientState) -> Worker:
    if c.worker is None:
        raise _err("not_registered", "register a worker first")
    return c.worker


def _request(h: dict[str, Any]) -> str | None:
    r = h.get("request")
    if r is not None and (not r or len(r) > MAX_NAME_LEN):
        raise _err("bad_field", f"request must be 1..{MAX_NAME_LEN} characters")
    return r


def _space(st: DaemonState, space: str) -> str:
    if space not in st.host_rows:
        raise _err("bad_field", f"unknown index space {space[:64]!r}; this stage uses "
                                f"{sorted(st.host_rows)}")
    return space


def _pool(st: DaemonState, name: str) -> PoolSpec:
    try:
        return st.layout.pool(name)
    except LayoutError as e:
        raise _err("bad_field", str(e)[:300]) from None


# ------------------------------------------------------------------------------- index checks
def _bounds(ids: Ids, limit: int, what: str) -> None:
    if ids.n <= OWNER_LOOP_MAX:
        lo, hi = min(ids.mv), max(ids.mv)
    else:
        a = ids.np()
        lo, hi = int(a.min()), int(a.max())
    if lo < 0 or hi >= limit:
        raise _err("bad_rows", f"{what}: id {lo if lo < 0 else hi} is outside 0..{limit - 1}")


def _unique(ids: Ids, what: str) -> None:
    if ids.n <= 1:
        return
    if ids.n <= OWNER_LOOP_MAX:
        dup = len(set(ids.list())) != ids.n
    else:
        dup = np.unique(ids.np()).size != ids.n
    if dup:
        raise _err("bad_rows", f"{what}: a destination id is listed twice")


def _owned(st: DaemonState, c: ClientState, space: str, rows: Any, what: str) -> None:
    """Every row (a list or an int64 array) allocated to this client (any request) and not
    being freed."""
    alloc = st.group.allocators[space]
    if len(rows) <= OWNER_LOOP_MAX:
        for r in list(rows):
            o = alloc.owner_of(r)
            if o is None or o[0] != c.cid:
                raise _err("not_owner", f"{what}: host row {r} of space {space} is "
                                        f"{'not allocated' if o is None else 'not yours'}")
    else:
        rows = np.asarray(rows)
        mine = alloc.rows_of(c.cid).numpy()
        ok = np.isin(rows, mine)
        if not ok.all():
            r = int(rows[~ok][0])
            raise _err("not_owner", f"{what}: host row {r} of space {space} is not allocated "
                                    f"to this client")
    if st.tracker.busy(space, rows):
        raise _err("busy", f"{what}: host rows of space {space} are being freed")


def _host_pages(ids: Ids, P: int | None) -> Any:
    """Host rows an item touches: the ids themselves (rows), or their pages (tokens)."""
    if P is None:
        return ids.list() if ids.n <= OWNER_LOOP_MAX else ids.np()
    return np.unique(ids.np() // P)


# ------------------------------------------------------------------------------- commands
def heartbeat(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    out = {"t": time.time(), "version": __version__, "protocol": VERSION,
           "device": str(st.device), "heartbeat_timeout": st.heartbeat_timeout,
           "registered": c.worker is not None}
    if h.get("full"):
        out.update(host_rows=st.host_rows, layout=st.layout.to_dict(),
                   stage_layers=list(st.stage_layers))
    return out, []


def register(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    if c.worker is not None:
        raise _err("already_registered", "this client already registered a worker; "
                                         "unregister first")
    mode = h["mode"]
    if mode not in ("cpu", "cuda"):
        raise _err("bad_field", f"mode must be 'cpu' or 'cuda', got {mode[:32]!r}")
    try:
        layout = Layout.from_dict(h["layout"])
    except (ValueError, TypeError, KeyError, AttributeError, OverflowError) as e:
        raise _err("layout_mismatch", f"bad layout: {type(e).__name__}: {str(e)[:300]}") from None
    mine, theirs = st.layout.to_dict(), layout.to_dict()
    if theirs != mine:
        diff = [k for k in mine if mine[k] != theirs.get(k)]
        detail = "; ".join(f"{k}: daemon {_short(mine[k])} vs worker {_short(theirs.get(k))}"
                           for k in diff)
        raise _err("layout_mismatch", f"the worker's layout differs from the daemon's: {detail}")
    dev_rows = h["device_rows"]
    spaces = sorted({p.index for p in st.layout.pools.values()})
    if sorted(dev_rows) != spaces or any(v <= 0 for v in dev_rows.values()):
        raise _err("bad_field", f"device_rows must give a positive row count for exactly the "
                                f"spaces {spaces}, got {dict(list(dev_rows.items())[:8])}")
    tp_rank = h.get("tp_rank", 0)
    if tp_rank < 0:
        raise _err("bad_field", "tp_rank must not be negative")
    events_h = h.get("events", [])
    if mode == "cpu" and events_h:
        raise _err("bad_field", "events are CUDA interprocess events; CPU mode has none")
    bufs = open_buffers(st.layout, dev_rows, h["buffers"], mode, st.device, st.shm_dirs)
    try:
        tables = {name: LayerTable(layers, f"device:{name}") for name, layers in bufs.layers.items()}
        events = open_events(events_h, st.device) if events_h else []
        load_events, load_handles = [], []
        if mode == "cuda":
            for _ in range(st.load_event_sets):
                evs, hs = make_ipc_events(len(st.stage_layers), st.device)
                load_events.append(evs)
                load_handles.append(hs)
    except TransferError as e:
        bufs.close()
        raise _err("bad_handle", str(e)[:300]) from None
    except BaseException:
        bufs.close()
        raise
    c.worker = Worker(h.get("name"), tp_rank, dict(dev_rows), bufs, tables, events, load_events,
                      load_handles)
    return {"client": c.cid, "host_rows": st.host_rows, "device": str(st.device),
            "stage_layers": list(st.stage_layers), "load_events": load_handles}, []


def _short(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 120 else s[:117] + "..."


def unregister(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    _worker(c)
    freed, deferred = st.release_client(c)
    st.registry.remove(c)
    return {"freed": freed, "deferred": deferred}, []


def alloc(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    counts = h["counts"]
    for s in counts:
        _space(st, s)
    owner = (c.cid, _request(h))
    try:
        rows = st.group.alloc(counts, owner)
    except PoolExhausted as e:
        raise _err("no_space", str(e)) from None
    except PoolError as e:
        raise _err("bad_field", str(e)) from None
    names = list(rows)
    return {"rows": {s: i for i, s in enumerate(names)}}, [rows[s].numpy() for s in names]


def free(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    owner = (c.cid, _request(h))
    checked: dict[str, np.ndarray] = {}
    for space, f in h["rows"].items():
        _space(st, space)
        rows = Ids(arrays[f]).np()
        try:
            checked[space] = st.group.allocators[space].check_free(rows, owner)
        except PoolError as e:
            code = "bad_rows" if "outside" in str(e) or "more than once" in str(e) else "not_owner"
            raise _err(code, str(e)) from None
        if checked[space].size and st.tracker.busy(space, checked[space]):
            raise _err("busy", f"free: rows of space {space} already have a free pending")
    deferred = st.free_rows(checked, owner)
    return {"freed": sum(int(a.size) for a in checked.values()), "deferred": deferred}, []


def _items(st: DaemonState, c: ClientState, w: Worker, h: dict, arrays: Sequence,
           to_host: bool) -> tuple[list[Item], list[tuple[str, np.ndarray, bool]], int]:
    ids_cache: dict[int, Ids] = {}
    checked: set[tuple] = set()
    seen_pools: set[str] = set()
    items: list[Item] = []
    host: dict[str, list[Any]] = {}
    total = 0
    for i, it in enumerate(h["items"]):
        if "pool" in it:
            specs = [_pool(st, it["pool"])]
        else:
            specs = st.layout.space_pools(_space(st, it["space"]))
        unit = it.get("unit", "row")
        fs, fd = it["src"], it["dst"]
        src = ids_cache.get(fs) or ids_cache.setdefault(fs, Ids(arrays[fs]))
        dst = ids_cache.get(fd) or ids_cache.setdefault(fd, Ids(arrays[fd]))
        if src.n != dst.n or src.n == 0:
            raise _err("bad_rows", f"items[{i}]: {src.n} source ids and {dst.n} destination ids")
        dev_ids, host_ids = (src, dst) if to_host else (dst, src)
        for spec in specs:
            if spec.name in seen_pools:
                raise _err("bad_field", f"items[{i}]: pool {spec.name} appears in two items; "
                                        f"give each pool once per command")
            seen_pools.add(spec.name)
            token = unit == "token"
            if token and not spec.token_granular:
                raise _err("bad_field", f"items[{i}]: pool {spec.name} has no token format; "
                                        f"use unit 'row'")
            P = spec.tokens_per_page if token else None
            space = spec.index
            key = (it["src"], it["dst"], space, P)
            if key not in checked:
                k = P or 1
                _bounds(dev_ids, w.device_rows[space] * k, f"items[{i}] device {unit}s")
                _bounds(host_ids, st.host_rows[space] * k, f"items[{i}] host {unit}s")
                _unique(dst, f"items[{i}]")
                pages = _host_pages(host_ids, P)
                _owned(st, c, space, pages, f"items[{i}]")
                host.setdefault(space, []).append(pages)
                checked.add(key)
            dev_t, host_t = w.tables[spec.name], st.host_tables[spec.name]
            nbytes = src.n * spec.num_layers * (spec.token_bytes if token else spec.page_bytes)
            total += nbytes
            items.append(Item(spec.name, dev_t if to_host else host_t,
                              host_t if to_host else dev_t, src, dst,
                              TokenFormat.from_spec(spec) if token else None, spec.layers, nbytes))
    host_list = [(s, _rows_of(parts), to_host) for s, parts in host.items()]
    return items, host_list, total


def _rows_of(parts: list[Any]) -> Any:
    """Host rows of one space over all items: a list or an int64 array (the tracker takes
    both; converting is left to it, so inline ops never pay for it)."""
    if len(parts) == 1:
        return parts[0]
    return np.unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))


def _ack_fields(op: Op, ack: dict | None, extra: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"op": op.op_id}
    if ack is not None:
        out["ack"] = ack
    if extra:
        out.update(extra)
    return out


def backup(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = _worker(c)
    wait = _wait_event(st, w, h.get("wait_event"))
    items, host, nbytes = _items(st, c, w, h, arrays, to_host=True)
    op = Op(st.next_op_id(), c.cid, "backup", items, host, wait_event=wait, nbytes=nbytes)
    return _ack_fields(op, st.start(c, op)), []


def _wait_event(st: DaemonState, w: Worker, k: int | None) -> Any:
    if k is None or not st.engine.cuda:
        return None  # CPU mode: the engine's writes are visible before it sends the command
    if not 0 <= k < len(w.events):
        raise _err("bad_field", f"wait_event {k}: the worker registered {len(w.events)} events")
    return w.events[k]


def load(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = _worker(c)
    items, host, nbytes = _items(st, c, w, h, arrays, to_host=False)
    op = Op(st.next_op_id(), c.cid, "load", items, host, nbytes=nbytes)
    extra = {}
    if st.engine.cuda:
        s = w.next_set
        w.next_set = (s + 1) % len(w.load_events)
        op.layer_events, op.stage_layers = w.load_events[s], st.stage_layers
        extra["event_set"] = s
    return _ack_fields(op, st.start(c, op), extra), []


def _slot_pools(st: DaemonState) -> list[PoolSpec]:
    pools = st.layout.space_pools("req_slot")
    if not pools:
        raise _err("unsupported", "this stage has no request-slot pools (no C128 layers and "
                                  "paged SWA): nothing to swap or clear")
    return pools


def _slot(w: Worker, slot: int, what: str) -> None:
    n = w.device_rows["req_slot"]
    if not 0 <= slot < n:
        raise _err("bad_rows", f"{what} {slot} is outside 0..{n - 1}")


def _state_items(st: DaemonState, w: Worker, pools: list[PoolSpec], slot: int, row: int,
                 to_host: bool) -> tuple[list[Item], int]:
    items, total = [], 0
    d, hh = Ids.of([slot]), Ids.of([row])
    for spec in pools:
        dev_t, host_t = w.tables[spec.name], st.host_tables[spec.name]
        nbytes = spec.page_bytes * spec.num_layers
        total += nbytes
        items.append(Item(spec.name, dev_t if to_host else host_t, host_t if to_host else dev_t,
                          d if to_host else hh, hh if to_host else d, None, spec.layers, nbytes))
    return items, total


def swap_out(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = _worker(c)
    pools = _slot_pools(st)
    _slot(w, h["slot"], "slot")
    wait = _wait_event(st, w, h.get("wait_event"))
    request = _request(h)
    row = h.get("host_row")
    if row is not None:
        if not 0 <= row < st.host_rows["req_slot"]:
            raise _err("bad_rows", f"host_row {row} is outside 0..{st.host_rows['req_slot'] - 1}")
        _owned(st, c, "req_slot", np.array([row]), "host_row")
    else:
        try:
            row = int(st.group.alloc({"req_slot": 1}, (c.cid, request))["req_slot"][0])
        except PoolExhausted as e:
            raise _err("no_space", str(e)) from None
    items, nbytes = _state_items(st, w, pools, h["slot"], row, to_host=True)
    op = Op(st.next_op_id(), c.cid, "swap_out", items, [("req_slot", np.array([row]), True)],
            wait_event=wait, nbytes=nbytes)
    return _ack_fields(op, st.start(c, op), {"host_row": row}), []


def swap_in(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = _worker(c)
    pools = _slot_pools(st)
    _slot(w, h["slot"], "slot")
    row = h["host_row"]
    if not 0 <= row < st.host_rows["req_slot"]:
        raise _err("bad_rows", f"host_row {row} is outside 0..{st.host_rows['req_slot'] - 1}")
    rows = np.array([row])
    _owned(st, c, "req_slot", rows, "host_row")
    owner = st.group.allocators["req_slot"].owner_of(row)
    request = _request(h)
    if request is not None and owner != (c.cid, request):
        raise _err("not_owner", f"host_row {row} belongs to request {owner[1]!r}, not {request!r}")
    items, nbytes = _state_items(st, w, pools, h["slot"], row, to_host=False)
    op = Op(st.next_op_id(), c.cid, "swap_in", items, [("req_slot", rows, False)], nbytes=nbytes)
    if st.engine.cuda:
        s = w.next_set
        w.next_set = (s + 1) % len(w.load_events)
        op.layer_events, op.stage_layers = w.load_events[s], st.stage_layers
    if h.get("release", False):
        st.tracker.defer({"req_slot": rows}, owner)  # freed as soon as the copy has read it
    ack = st.start(c, op)
    st.release_ready()
    return _ack_fields(op, ack, {"event_set": s} if st.engine.cuda else None), []


def clear_slot(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = _worker(c)
    pools = _slot_pools(st)
    slots = h["slots"]
    if not slots:
        raise _err("bad_field", "slots is empty")
    for s in slots:
        _slot(w, s, "slot")
    if len(set(slots)) != len(slots):
        raise _err("bad_rows", "a slot is listed twice")
    draft = h.get("draft")
    spec_draft = None
    if draft is not None:
        spec_draft = _draft(draft, slots)
    targets = [ClearTarget(p.name, w.tables[p.name], p.ring, p.dtype == "fp32_state")
               for p in pools]
    clear = ClearSpec(targets, [] if spec_draft else list(slots), spec_draft)
    nbytes = 0 if spec_draft else sum(p.page_bytes * p.num_layers for p in pools) * len(slots)
    op = Op(st.next_op_id(), c.cid, "clear_slot", [], [], clear=clear, nbytes=nbytes)
    return _ack_fields(op, st.start(c, op)), []


def _draft(d: dict, slots: list[int]) -> list[tuple[int, list[int]]]:
    """MTP rule: ring positions (seq_len + k) for k in [accepted, num_draft) get kv 0, score -inf."""
    if set(d) - {"seq_lens", "accept_lens", "num_draft"}:
        raise _err("bad_field", f"draft: unknown fields {sorted(set(d) - {'seq_lens', 'accept_lens', 'num_draft'})}")
    seq, acc, nd = d.get("seq_lens"), d.get("accept_lens"), d.get("num_draft")
    if type(nd) is not int or not 0 < nd <= 64:
        raise _err("bad_field", "draft.num_draft must be an int in 1..64")
    for name, v in (("seq_lens", seq), ("accept_lens", acc)):
        if not isinstance(v, list) or len(v) != len(slots) or \
                not all(type(x) is int and x >= 0 for x in v):
            raise _err("bad_field", f"draft.{name} must list one non-negative int per slot")
    if any(a > nd for a in acc):  # type: ignore[union-attr]
        raise _err("bad_field", "draft.accept_lens must not exceed num_draft")
    return [(s, [q + k for k in range(a, nd)]) for s, q, a in zip(slots, seq, acc)]  # type: ignore[arg-type]


def poll_acks(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    limit = h.get("max", 1024)
    if not 0 < limit <= 4096:
        raise _err("bad_field", "max must be in 1..4096")
    return {"acks": st.registry.take_acks(c, h.get("ops"), limit),
            "in_flight": c.in_flight}, []


def stats(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    st.refresh_gauges()
    out = {"device": str(st.device), "clients": len(st.registry.clients),
           "workers": st.registry.workers(), "in_flight": st.engine.in_flight,
           "merged_ops": st.engine.merged_ops, "host": st.group.usage(),
           "pending_free": {s: st.tracker.pending_rows(s) for s in st.host_rows},
           "metrics": st.metrics.snapshot()}
    if st.l3 is not None:
        out["l3"] = st.l3.summary()
    if h.get("check"):  # the allocators' own invariant check (O(rows): for tests and fuzzing)
        try:
            st.group.check_invariants()
            # and no row outlives its client (a reaped client's rows wait only for its ops)
            known = {x.cid for x in st.registry.clients.values()}
            known.update(x.cid for _, x in st.ops.values())
            stray = sorted({o[0] for a in st.group.allocators.values() for o in a.owners()}
                           - known)
            out["invariants"] = "ok" if not stray else \
                f"host rows owned by clients the daemon no longer tracks: {stray[:4]}"
        except PoolError as e:
            out["invariants"] = f"{type(e).__name__}: {e}"
    return out, []


def buffer_infos(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    return {"pools": {k: [list(x) for x in v] for k, v in st.group.buffer_infos().items()}}, []


def reset(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    freed, deferred = st.release_client(c)
    return {"freed": freed, "deferred": deferred}, []


def shutdown(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    st.stopping = True
    return {"stopping": True}, []


HANDLERS: dict[str, Callable[[DaemonState, ClientState, dict, Sequence], Reply]] = {
    "heartbeat": heartbeat, "register": register, "unregister": unregister, "alloc": alloc,
    "free": free, "backup": backup, "load": load, "swap_out": swap_out, "swap_in": swap_in,
    "clear_slot": clear_slot, "poll_acks": poll_acks, "stats": stats,
    "buffer_infos": buffer_infos, "reset": reset, "shutdown": shutdown,
}
