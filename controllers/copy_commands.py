"""Handlers of the commands that move bytes: backup, load, swap_out, swap_in, clear_slot.

Each is ``fn(state, client, header, arrays) -> (reply fields, reply arrays)``: validate every
item against the daemon's state (pools, spaces, bounds, distinct destinations, ownership), and
only then build an ``Operation`` and ``state.start`` it, so a refused command changes nothing.
``backup`` with ``alloc`` allocates its destination rows itself (owner recorded in the same
step), in one round trip; a refused backup allocates nothing, and when allocating would have
the key store evict entries, its items are checked before anything is evicted.
"""
from __future__ import annotations

from typing import Any, NamedTuple, Sequence

import numpy as np

from hicache.core.layout import PoolSpec
from hicache.core.id_sets import has_duplicates, sort_checked, sorted_unique
from hicache.core.protocol import MAX_NAME_LEN, ProtocolError
from hicache.kernels.tables import TokenFormat

from .host_access import check_readable
from .ops import ClearSpec, ClearTarget, Ids, Item, Operation
from .registry import ClientState, RegisteredWorker
from .state import OWNER_LOOP_MAX, DaemonState

Reply = tuple[dict[str, Any], list[Any]]
HostRows = list[tuple[str, np.ndarray, bool]]


def worker_of(c: ClientState) -> RegisteredWorker:
    if c.worker is None:
        raise ProtocolError("not_registered", "register a worker first")
    return c.worker


def request_of(h: dict[str, Any]) -> str | None:
    r = h.get("request")
    if r is not None and (not r or len(r) > MAX_NAME_LEN):
        raise ProtocolError("bad_field", f"request must be 1..{MAX_NAME_LEN} characters")
    return r


def _bounds(ids: Ids, limit: int, what: str, side: str = "") -> None:
    """Every id in ``0..limit - 1``; the error names ``what`` (and ``side``, e.g. "device
    rows", when given: the message is built only on a refusal)."""
    if ids.n <= OWNER_LOOP_MAX:
        v = ids.list()
        lo, hi = (v[0], v[0]) if ids.n == 1 else (min(v), max(v))
    elif ids.run():  # its ends (a checkpoint's tail tokens)
        lo, hi = ids.mv[0], ids.mv[-1]
    else:
        a = ids.np()
        lo, hi = int(a.min()), int(a.max())
    _check_range(lo, hi, limit, what, side)


def _check_range(lo: int, hi: int, limit: int, what: str, side: str) -> None:
    if lo < 0 or hi >= limit:
        raise ProtocolError("bad_rows", f"{what}{' ' + side if side else ''}: id "
                                        f"{lo if lo < 0 else hi} is outside 0..{limit - 1}")


def _distinct(ids: Ids, what: str) -> None:
    if ids.n > 1 and (len(set(ids.list())) != ids.n if ids.n <= OWNER_LOOP_MAX
                      else not ids.run() and has_duplicates(ids.np())):
        _twice(what)


def _twice(what: str) -> None:
    raise ProtocolError("bad_rows", f"{what}: a destination id is listed twice")


def _destination(ids: Ids, limit: int, what: str, side: str = "") -> None:
    """``_bounds`` then ``_distinct`` (a destination's ids), many ids in one sort: its ends
    are the bounds (a live daemon pays ~10-25 µs for each numpy pass over a command's ids)."""
    if ids.n <= OWNER_LOOP_MAX or ids.run():  # a run: its ends, and distinct
        _bounds(ids, limit, what, side)
        _distinct(ids, what)
        return
    s, twice = sort_checked(ids.np())
    _check_range(int(s[0]), int(s[-1]), limit, what, side)
    if twice:
        _twice(what)


def _host_pages(ids: Ids, P: int | None) -> Any:
    """Host rows an item touches: the ids themselves (rows), or their pages (tokens)."""
    if P is None:
        return ids.list() if ids.n <= OWNER_LOOP_MAX else ids.np()
    if ids.run():  # a checkpoint's tail: one page, or a few in a row
        return list(range(ids.mv[0] // P, ids.mv[-1] // P + 1))
    return sorted_unique(ids.np() // P)


_SIDES = (("device rows", "host rows"), ("device tokens", "host tokens"))  # [token]


class _PoolPlan(NamedTuple):
    """What an item of one pool needs from the layout, worked out once per daemon."""

    spec: PoolSpec
    fmt: TokenFormat | None  # token format, when the pool has one
    row_bytes: int  # bytes of one row id over all the pool's layers
    token_bytes: int  # bytes of one token id over all its layers (0: no token format)


def _plans(st: DaemonState, it: dict[str, Any]) -> tuple[_PoolPlan, ...]:
    """The pools an item names (its ``pool``, or every pool of its ``space``): cached per name
    on the state; an unknown name is refused (``bad_field``) and never cached."""
    pool = it.get("pool")
    key = ("pool", pool) if pool is not None else ("space", it["space"])
    plans = st.item_plans.get(key)
    if plans is None:
        specs = [st.pool_spec(pool)] if pool is not None else \
            st.layout.space_pools(st.check_space(it["space"]))
        plans = st.item_plans[key] = tuple(
            _PoolPlan(p, TokenFormat.from_spec(p) if p.token_granular else None,
                      p.num_layers * p.page_bytes, p.num_layers * p.token_bytes)
            for p in specs)
    return plans


def _items(st: DaemonState, c: ClientState, w: RegisteredWorker, h: dict, arrays: Sequence,
           to_host: bool, fresh: dict[str, Ids] | None = None) -> tuple[list[Item], HostRows, int]:
    """Validated items of a backup / load. ``fresh``: host rows per space that this command
    allocates (backup with alloc): they are the items' destinations, owned by construction."""
    frames: dict[int, Ids] = {}
    checked: dict[tuple, Any] = {}  # (src, dst, space, P) -> host rows touched
    seen: set[str] = set()
    items: list[Item] = []
    host: dict[str, list[Any]] = {}
    total = 0
    for i, it in enumerate(h["items"]):
        plans = _plans(st, it)
        token = it.get("unit") == "token"  # the protocol let "row" or "token" through
        f = it.get("src")
        src = None
        if f is not None:
            src = frames.get(f)
            if src is None:
                src = frames[f] = Ids(arrays[f])
        for spec, fmt, row_bytes, token_bytes in plans:
            name = spec.name
            if name in seen:
                raise ProtocolError("bad_field", f"items[{i}]: pool {name} appears in two "
                                                 f"items; give each pool once per command")
            seen.add(name)
            space = spec.index
            if fresh is not None:
                dst = fresh[space]
            else:
                f = it["dst"]
                dst = frames.get(f)
                if dst is None:
                    dst = frames[f] = Ids(arrays[f])
            assert src is not None
            n = src.n
            if n != dst.n or n == 0:
                raise ProtocolError("bad_rows", f"items[{i}]: {n} source ids and {dst.n} "
                                                f"destination ids")
            dev_ids, host_ids = (src, dst) if to_host else (dst, src)
            if token and fmt is None:
                raise ProtocolError("bad_field", f"items[{i}]: pool {name} has no token "
                                                 f"format; use unit 'row'")
            P = spec.tokens_per_page if token else None
            key = (id(src), id(dst), space, P)
            pages = checked.get(key)
            if pages is None:
                k = P or 1
                what = f"items[{i}]"
                dev_limit, host_limit = w.device_rows[space] * k, st.host_rows[space] * k
                dev_side, host_side = _SIDES[token]
                if not to_host:  # a load: the device ids are its destination
                    _destination(dst, dev_limit, what, dev_side)
                    _bounds(host_ids, host_limit, what, host_side)
                else:
                    _bounds(dev_ids, dev_limit, what, dev_side)
                    if fresh is None:  # new rows (alloc) are in bounds and distinct
                        _destination(dst, host_limit, what, host_side)
                if fresh is None:
                    pages = _host_pages(host_ids, P)
                    st.check_owned(c.cid, space, pages, what)
                    st.check_l3_clash(space, pages, to_host, what)
                else:
                    pages = dst.np()
                parts = host.get(space)
                if parts is None:
                    host[space] = [pages]
                else:
                    parts.append(pages)
                checked[key] = pages
            if not to_host:
                check_readable(st.group, name, pages, f"items[{i}]")
            dev_t, host_t = w.tables[name], st.host_tables[name]
            nbytes = n * (token_bytes if token else row_bytes)
            total += nbytes
            items.append(Item(name, dev_t if to_host else host_t, host_t if to_host else dev_t,
                              src, dst, fmt if token else None, spec.layers, nbytes))
    return items, [(s, _rows_of(parts), to_host) for s, parts in host.items()], total


def _rows_of(parts: list[Any]) -> Any:
    """Host rows of one space over all items: a list or an int64 array (the tracker takes
    both; converting is left to it, so inline ops never pay for it)."""
    if len(parts) == 1:
        return parts[0]
    return sorted_unique(np.concatenate([np.asarray(p, dtype=np.int64) for p in parts]))


def _reply(op: Operation, ack: dict | None, extra: dict | None = None) -> dict[str, Any]:
    out: dict[str, Any] = {"op": op.op_id}
    if ack is not None:
        out["ack"] = ack
    if extra:
        out.update(extra)
    return out


def _wait_event(st: DaemonState, w: RegisteredWorker, k: int | None) -> Any:
    if k is None:
        return None
    if not st.cuda:  # the engine's writes are visible before it sends the command
        raise ProtocolError("unsupported", "wait_event: CPU mode has no interprocess events; "
                                           "send the command once the device rows are written")
    if not 0 <= k < len(w.events):
        raise ProtocolError("bad_field", f"wait_event {k}: the worker registered "
                                         f"{len(w.events)} events")
    return w.events[k]


def _alloc_counts(st: DaemonState, h: dict, arrays: Sequence) -> dict[str, int]:
    """Rows per space a backup with ``alloc`` needs: one per source id of that space's items."""
    counts: dict[str, int] = {}
    for i, it in enumerate(h["items"]):
        if it.get("unit", "row") != "row":
            raise ProtocolError("bad_field", f"items[{i}]: alloc backs up whole rows only")
        specs = [st.pool_spec(it["pool"])] if "pool" in it else \
            st.layout.space_pools(st.check_space(it["space"]))
        n = len(arrays[it["src"]])
        for spec in specs:
            if counts.setdefault(spec.index, n) != n:
                raise ProtocolError("bad_rows", f"items[{i}]: items of space {spec.index} give "
                                                f"{counts[spec.index]} and {n} source ids; with "
                                                f"alloc they share one set of new rows")
    return counts


def backup(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = worker_of(c)
    wait = _wait_event(st, w, h.get("wait_event"))
    if not h.get("alloc"):
        if "request" in h:
            raise ProtocolError("bad_field", "backup: request names the owner of rows that "
                                             "alloc allocates; it needs alloc: true")
        items, host, nbytes = _items(st, c, w, h, arrays, to_host=True)
        op = Operation(st.next_op_id(), c.cid, "backup", items, host, wait_event=wait,
                       nbytes=nbytes)
        return _reply(op, st.start(c, op)), []
    counts = _alloc_counts(st, h, arrays)
    owner = (c.cid, request_of(h))
    if st.alloc_evicts(counts):  # every check first: the store's evictions cannot be undone
        _items(st, c, w, h, arrays, to_host=True,
               fresh={s: Ids.of(np.zeros(n, dtype=np.int64)) for s, n in counts.items()})
    fresh_t = st.alloc_rows(counts, owner)  # all or none; refusals below give them back
    fresh = {s: Ids.of(t.numpy()) for s, t in fresh_t.items()}
    try:
        items, host, nbytes = _items(st, c, w, h, arrays, to_host=True, fresh=fresh)
    except BaseException:
        st.free_rows({s: i.np() for s, i in fresh.items()}, owner)
        raise
    op = Operation(st.next_op_id(), c.cid, "backup", items, host, wait_event=wait, nbytes=nbytes)
    names = list(fresh)
    return _reply(op, st.start(c, op), {"rows": {s: k for k, s in enumerate(names)}}), \
        [fresh[s].np() for s in names]


def load(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = worker_of(c)
    wait = _wait_event(st, w, h.get("wait_event"))
    items, host, nbytes = _items(st, c, w, h, arrays, to_host=False)
    op = Operation(st.next_op_id(), c.cid, "load", items, host, wait_event=wait, nbytes=nbytes)
    extra = _layer_events(st, w, op)
    ack = st.start(c, op)
    return _reply(op, ack, _issued(op, extra)), []


def _layer_events(st: DaemonState, w: RegisteredWorker, op: Operation) -> dict[str, Any]:
    """GPU: give ``op`` the worker's next set of per-layer events (the reply names the set)."""
    if not st.cuda:
        return {}
    s, op.layer_events = w.next_load_events()
    op.stage_layers = st.stage_layers
    return {"event_set": s}


def _issued(op: Operation, extra: dict[str, Any]) -> dict[str, Any]:
    """GPU: how many stage layers' events are recorded as the reply goes out (layer 0's; the
    rest follow right after the reply, then an "issued" push). A launch that failed issues
    nothing more: all count as issued, ``failed`` says so (its events hold older records: the
    engine waits for the ack, which reports the failure)."""
    if "event_set" in extra:
        extra["issued"] = op.issued if op.rest is not None else len(op.stage_layers)
        if not op.ok:
            extra["failed"] = True
    return extra


def _slot_pools(st: DaemonState) -> list[PoolSpec]:
    pools = st.layout.space_pools("req_slot")
    if not pools:
        raise ProtocolError("unsupported", "this stage has no request-slot pools (no C128 layers "
                                           "and paged SWA): nothing to swap or clear")
    return pools


def _slot(w: RegisteredWorker, slot: int, what: str) -> None:
    n = w.device_rows["req_slot"]
    if not 0 <= slot < n:
        raise ProtocolError("bad_rows", f"{what} {slot} is outside 0..{n - 1}")


def _host_row(st: DaemonState, row: int) -> None:
    if not 0 <= row < st.host_rows["req_slot"]:
        raise ProtocolError("bad_rows", f"host_row {row} is outside "
                                        f"0..{st.host_rows['req_slot'] - 1}")


def _slot_row_owner(st: DaemonState, c: ClientState, row: int, request: str | None
                    ) -> tuple[str, str | None]:
    """The owner of request-state host row ``row``: the client's (``not_owner`` if not), and
    when ``request`` is named, that request's."""
    st.check_owned(c.cid, "req_slot", np.array([row]), "host_row")
    owner = st.owner_of("req_slot", row)
    if request is not None and owner != (c.cid, request):
        raise ProtocolError("not_owner", f"host_row {row} belongs to request {owner[1]!r}, "
                                         f"not {request!r}")
    return owner


def _state_items(st: DaemonState, w: RegisteredWorker, pools: list[PoolSpec], slot: int,
                 row: int, to_host: bool) -> tuple[list[Item], int]:
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
    w = worker_of(c)
    pools = _slot_pools(st)
    _slot(w, h["slot"], "slot")
    wait = _wait_event(st, w, h.get("wait_event"))
    request = request_of(h)
    row = h.get("host_row")
    if row is not None:
        _host_row(st, row)
        _slot_row_owner(st, c, row, request)
        st.check_l3_clash("req_slot", [row], True, "host_row")  # (a ring-mode checkpoint's row)
    else:
        row = int(st.alloc_rows({"req_slot": 1}, (c.cid, request))["req_slot"][0])
    items, nbytes = _state_items(st, w, pools, h["slot"], row, to_host=True)
    op = Operation(st.next_op_id(), c.cid, "swap_out", items,
                   [("req_slot", np.array([row]), True)], wait_event=wait, nbytes=nbytes)
    return _reply(op, st.start(c, op), {"host_row": row}), []


def swap_in(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = worker_of(c)
    pools = _slot_pools(st)
    _slot(w, h["slot"], "slot")
    row = h["host_row"]
    _host_row(st, row)
    rows = np.array([row])
    owner = _slot_row_owner(st, c, row, request_of(h))
    st.check_l3_clash("req_slot", rows, False, "host_row")
    for spec in pools:
        check_readable(st.group, spec.name, rows, "host_row")
    items, nbytes = _state_items(st, w, pools, h["slot"], row, to_host=False)
    op = Operation(st.next_op_id(), c.cid, "swap_in", items, [("req_slot", rows, False)],
                   nbytes=nbytes)
    extra = _layer_events(st, w, op)
    if h.get("release", False):  # freed once the op has read it, if it succeeded
        op.release = ({"req_slot": rows}, owner)
        st.free_after_use(*op.release)
    ack = st.start(c, op)
    return _reply(op, ack, _issued(op, extra)), []


def clear_slot(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    w = worker_of(c)
    pools = _slot_pools(st)
    slots = h["slots"]
    if not slots:
        raise ProtocolError("bad_field", "slots is empty")
    for s in slots:
        _slot(w, s, "slot")
    if len(set(slots)) != len(slots):
        raise ProtocolError("bad_rows", "a slot is listed twice")
    draft = None if h.get("draft") is None else _draft(h["draft"], slots)
    if draft is not None:
        _draft_applies(pools)
    targets = [ClearTarget(p.name, w.tables[p.name], p.ring, p.dtype == "fp32_state")
               for p in pools]
    clear = ClearSpec(targets, [] if draft else list(slots), draft)
    nbytes = 0 if draft else sum(p.page_bytes * p.num_layers for p in pools) * len(slots)
    op = Operation(st.next_op_id(), c.cid, "clear_slot", [], [], clear=clear, nbytes=nbytes)
    return _reply(op, st.start(c, op)), []


DRAFT_FIELDS = {"seq_lens", "accept_lens", "num_draft"}


def _draft_applies(pools: list[PoolSpec]) -> None:
    """The draft rule rewrites ring entries of fp32 state pools: refuse it where there are none
    (it would change nothing and ack ok)."""
    if not any(p.dtype == "fp32_state" and p.ring > 1 for p in pools):
        raise ProtocolError("unsupported", "clear_slot draft=: this stage's request-slot pools ("
                            + ", ".join(p.name for p in pools) + ") hold no ring state (paged "
                            "SWA with online C128 state), so the MTP draft rule has nothing to "
                            "void; clear whole slots instead")


def _draft(d: dict, slots: list[int]) -> list[tuple[int, list[int]]]:
    """MTP rule: ring positions (seq_len + k) for k in [accepted, num_draft) get kv 0, score -inf."""
    if set(d) - DRAFT_FIELDS:
        raise ProtocolError("bad_field", f"draft: unknown fields {sorted(set(d) - DRAFT_FIELDS)}")
    seq, acc, nd = d.get("seq_lens"), d.get("accept_lens"), d.get("num_draft")
    if type(nd) is not int or not 0 < nd <= 64:
        raise ProtocolError("bad_field", "draft.num_draft must be an int in 1..64")
    for name, v in (("seq_lens", seq), ("accept_lens", acc)):
        if not isinstance(v, list) or len(v) != len(slots) or \
                not all(type(x) is int and x >= 0 for x in v):
            raise ProtocolError("bad_field", f"draft.{name} must list one non-negative int per "
                                             f"slot")
    if any(a > nd for a in acc):  # type: ignore[union-attr]
        raise ProtocolError("bad_field", "draft.accept_lens must not exceed num_draft")
    return [(s, [q + k for k in range(a, nd)]) for s, q, a in zip(slots, seq, acc)]  # type: ignore[arg-type]
