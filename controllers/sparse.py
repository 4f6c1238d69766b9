"""HiSparse on the daemon side: the commands ``sparse_region``, ``sparse_admit``,
``sparse_extend``, ``sparse_free`` and ``sparse_report`` (handlers in ``SPARSE_HANDLERS``, same
contract as ``handlers``: validate everything, then act; a refusal changes nothing). The host
memory is ``controllers.sparse_regions``: one region (a sealed memfd) per client.

* ``sparse_region`` names the client's own region (binding one to it: the spare made at start,
  or a new one, at most ``--sparse-clients`` at once; only a registered worker binds one): its
  descriptor socket and token (its memfd offered once per reply); the engine maps it and runs
  the swap-in kernel on it. A client's first admission
  binds its region too (after every check: a refused admission binds nothing).
* A request is admitted when its prompt has at least ``min_sparse_prompt_len`` full tokens and
  its C4 pages fit in the client's region. Admission takes ``floor(prompt_tokens / 4)`` C4
  tokens' pages and, with ``device_rows``, backs the prompt's C4 KV up from the registered
  worker's ``c4_kv`` pool.
  Pages that are host-tier prefix hits (``host_rows``: the client's written ``c4_kv`` host rows
  of the first pages) are filled from host memory instead: nothing is read from the device (on
  a GPU daemon refused ``busy`` while a backup into those rows is in flight).
  Without ``device_rows`` the pages the hits do not cover are zeroed (a row may have held an
  earlier request's bytes).
  ``sparse_extend`` grows the request (new pages) and backs up new decode tokens from device
  token locations (``device_tokens``: locations in the worker's registered ``c4_kv`` pool,
  where the engine wrote them; the hot buffer's slots are no registered pool) for C4 tokens
  ``first ..``). The copies of one command are one ``sparse_backup`` operation of the daemon's
  scheduler (``state.start``: CPU inline when small, else the copy worker; GPU: the load
  stream), so a large admission does not hold the server loop; the reply carries ``op`` (and
  ``ack`` when it ran inline), and the engine reads those rows after the ack (the engine calls
  after its own stream wrote the device rows). ``sparse_free`` is refused ``busy`` while a copy
  into the request's rows is in flight; a reaped or unregistered client's requests are freed
  once its operations completed, and its region then goes (``release``).
* Request names are each client's own: a name another client admitted is unknown here
  (``bad_field``, as a name nobody admitted), and does not keep this client from admitting
  it.
"""
from __future__ import annotations

from typing import Any, Callable, Sequence

import numpy as np
import torch

from hicache.core.protocol import MAX_NAME_LEN, ProtocolError
from hicache.core.resume import C4_RATIO
from hicache.kernels.tables import LayerTable, TokenFormat

from .host_access import check_readable
from .ops import Ids, Item, Operation
from .registry import ClientState
from .sparse_regions import ClientRegion, SparseRegions, SparseRequest

Reply = tuple[dict[str, Any], list[Any]]


def _err(code: str, msg: str) -> ProtocolError:
    return ProtocolError(code, msg)


def _region(st: Any) -> SparseRegions:
    sp = getattr(st, "sparse", None)
    if sp is None:
        raise _err("unsupported", "this daemon has no sparse region: start it with "
                                  "--sparse-rows N")
    return sp


def _name(h: dict) -> str:
    r = h["request"]
    if not r or len(r) > MAX_NAME_LEN:
        raise _err("bad_field", f"request must be 1..{MAX_NAME_LEN} characters")
    return r


def _own(sp: SparseRegions, c: ClientState, r: str) -> SparseRequest:
    """This client's request ``r`` (names are per client: another client's is unknown here)."""
    e = sp.requests.get((c.cid, r))
    if e is None:
        raise _err("bad_field", f"unknown sparse request {r[:64]!r}: sparse_admit it first")
    return e


def _device_c4(st: Any, c: ClientState, what: str) -> LayerTable:
    if c.worker is None:
        raise _err("not_registered", f"{what} copies from the worker's c4_kv pool: register "
                                     f"a worker first")
    return c.worker.tables["c4_kv"]


def _frame(arrays: Sequence, h: dict, key: str) -> np.ndarray | None:
    if key not in h:
        return None
    return np.frombuffer(arrays[h[key]], dtype=np.int64)


def _pages(sp: SparseRegions, c4_tokens: int) -> int:
    return -(-c4_tokens // sp.P)


def _zero(reg: ClientRegion, rows: list[int]) -> None:
    idx = torch.as_tensor(rows, dtype=torch.long)
    for t in reg.shm.layers:
        t.index_fill_(0, idx, 0)


def _bind(sp: SparseRegions, c: ClientState) -> ClientRegion:
    """The client's region; binding one takes a registered worker (an engine)."""
    reg = sp.of(c.cid)
    if reg is None:
        if c.worker is None:
            raise _err("not_registered", "a sparse region is for a registered worker: "
                                         "register first")
        reg = sp.bind(c.cid)
    return reg


def _take(sp: SparseRegions, c: ClientState, n: int, r: str) -> tuple[ClientRegion, list[int]]:
    """``n`` rows of the client's own region (bound to it now if it had none), for request
    ``r``."""
    if n > sp.rows:  # checked before a bind: a refusal binds nothing
        raise _err("no_space", f"{n} sparse host rows needed; a client's region has {sp.rows}")
    reg = _bind(sp, c)
    if n > reg.alloc.free_rows:
        raise _err("no_space", f"{n} sparse host rows needed, {reg.alloc.free_rows} free in "
                               f"this client's region of {sp.rows}")
    return reg, (reg.alloc.alloc(n, (c.cid, r)).tolist() if n else [])


def sparse_region(st: Any, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """The client's region (bound now if it had none), its memfd offered on the daemon's
    descriptor socket. A refusal binds nothing: the socket is made first, and a region bound
    by this call is dropped again when its offer fails."""
    sp = _region(st)
    try:
        handout = st.handout()
    except OSError as e:
        raise ProtocolError("unsupported", f"sparse_region: cannot create the descriptor socket "
                                           f"({e})") from None
    fresh = sp.of(c.cid) is None
    _bind(sp, c)
    try:
        return sp.hand_out(c.cid, handout), []
    except (OSError, ValueError) as e:  # (no descriptor left for the offer's duplicate; a
        # socket or memfd closed by a stop under way)
        if fresh:
            sp.drop(c.cid)
        raise ProtocolError("unsupported", f"sparse_region: cannot offer the region's memfd "
                                           f"({e})") from None


def _prefix_hits(st: Any, sp: SparseRegions, c: ClientState, hits: np.ndarray, n: int) -> None:
    """``host_rows``: the client's host-tier rows of the ``c4_kv`` pool holding the prompt's
    first pages (prefix hits), each written by a completed backup of this client."""
    if len(hits) > n:
        raise _err("bad_rows", f"host_rows has {len(hits)} rows; the prompt has {n} C4 pages")
    if not len(hits):
        return
    space = sp.spec.index
    total = st.host_rows[space]
    if hits.min() < 0 or hits.max() >= total:
        raise _err("bad_rows", f"host_rows out of range [0, {total}) of space {space}")
    st.check_owned(c.cid, space, hits, "sparse_admit host_rows")
    st.check_l3_clash(space, hits, False, "sparse_admit host_rows")
    check_readable(st.group, "c4_kv", hits, "sparse_admit host_rows")
    # on a GPU daemon these rows are copied host to host when the command is handled, which no
    # stream wait orders after a backup into them still in flight: refused until its ack (on CPU
    # the copy worker's FIFO orders them)
    if st.scheduler.cuda and st.tracker.hazard([(space, hits, False)]):
        raise _err("busy", "sparse_admit host_rows: a backup into these host rows is still in "
                           "flight; send it after that op's ack")


def sparse_admit(st: Any, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    sp, r = _region(st), _name(h)
    prompt = h["prompt_tokens"]
    if (c.cid, r) in sp.requests:
        raise _err("bad_field", f"sparse request {r[:64]!r} is already admitted")
    if prompt < sp.min_prompt:
        raise _err("unsupported", f"prompt of {prompt} tokens is below min_sparse_prompt_len "
                                  f"{sp.min_prompt}: serve it dense")
    c4 = prompt // C4_RATIO
    n = _pages(sp, c4)
    hits = _frame(arrays, h, "host_rows")
    k = 0 if hits is None else len(hits)
    if hits is not None:
        _prefix_hits(st, sp, c, hits, n)
    src = _frame(arrays, h, "device_rows")
    dev = None
    if src is not None:
        dev = _device_c4(st, c, "sparse_admit")
        if len(src) != n - k:
            raise _err("bad_rows", f"device_rows has {len(src)} rows; {c4} C4 tokens take {n}"
                                   f" pages, {k} of them from host_rows")
        if len(src) and (src.min() < 0 or src.max() >= dev.rows):
            raise _err("bad_rows", f"device_rows out of range [0, {dev.rows})")
    reg, rows = _take(sp, c, n, r)
    if dev is None and n > k:  # pages no copy fills: zeroed, never an earlier request's bytes
        _zero(reg, rows[k:])
    e = sp.requests[(c.cid, r)] = SparseRequest(c.cid, c4, rows)
    items = []
    if k:  # prefix hits: host memory to host memory, nothing crosses PCIe
        items.append(_item(sp, reg, st.host_tables["c4_kv"], hits, rows[:k], None))
    if dev is not None and n > k:
        items.append(_item(sp, reg, dev, src, rows[k:], None))
    reply = {"c4_tokens": c4, "pages": n, "reused_pages": k}
    # the host-tier rows it reads stay allocated until it is done (frees of them are deferred)
    reads = [(sp.spec.index, np.array(hits, dtype=np.int64), False)] if k else []
    reply.update(_copy(st, c, e, items, reads))
    return reply, [np.asarray(rows, dtype=np.int64)]


def _item(sp: SparseRegions, reg: ClientRegion, src: LayerTable, src_ids: Any, dst_ids: Any,
          fmt: TokenFormat | None) -> Item:
    """Copy ``src_ids`` of ``src`` (rows, or tokens of ``fmt``) to ``dst_ids`` of ``reg``."""
    s, d = Ids.of(src_ids), Ids.of(dst_ids)
    unit = fmt.token_bytes if fmt is not None else sp.spec.page_bytes
    return Item("c4_kv", src, reg.table, s, d, fmt, tuple(sp.spec.layers),
                s.n * unit * sp.spec.num_layers)


def _copy(st: Any, c: ClientState, e: SparseRequest, items: list[Item],
          reads: list[tuple[str, np.ndarray, bool]] | None = None) -> dict[str, Any]:
    """Run ``items`` through the daemon's scheduler as one ``sparse_backup`` operation (CPU:
    inline when small, else the copy worker; GPU: the load stream), not on the server loop.
    Reply fields ``op`` (and ``ack`` when it ran inline); the engine reads the rows after the
    ack. ``reads``: host-tier rows it reads, for the row tracker. Nothing to copy: no
    operation."""
    if not items:
        return {}
    op = Operation(st.next_op_id(), c.cid, "sparse_backup", items, reads or [],
                   nbytes=sum(it.nbytes for it in items))
    ack = st.start(c, op)
    if ack is None:
        _in_flight(st, e)  # drop the ops that ended: a decode's list stays short
        e.ops.append(op.op_id)
        return {"op": op.op_id}
    return {"op": op.op_id, "ack": ack}


def _in_flight(st: Any, e: SparseRequest) -> bool:
    e.ops = [i for i in e.ops if i in st.ops]
    return bool(e.ops)


def sparse_extend(st: Any, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    sp, r = _region(st), _name(h)
    e = _own(sp, c, r)
    c4 = h["tokens"] // C4_RATIO
    if c4 < e.c4_tokens:
        raise _err("bad_field", f"sparse request {r[:64]!r} has {e.c4_tokens} C4 tokens; "
                                f"tokens {h['tokens']} would shrink it")
    toks = _frame(arrays, h, "device_tokens")
    first = h.get("first")
    dev = None
    if (toks is None) != (first is None):
        raise _err("bad_field", "device_tokens and first go together")
    if toks is not None:
        dev = _device_c4(st, c, "sparse_extend")
        if first < 0 or first + len(toks) > c4:
            raise _err("bad_rows", f"C4 tokens {first}..{first + len(toks) - 1} are outside "
                                   f"the request's [0, {c4})")
        if len(toks) and (toks.min() < 0 or toks.max() >= dev.rows * sp.P):
            raise _err("bad_rows", f"device_tokens out of range [0, {dev.rows * sp.P})")
    reg, new = _take(sp, c, _pages(sp, c4) - len(e.rows), r)
    if new:  # new pages hold no earlier request's bytes (only the tokens copied below land)
        _zero(reg, new)
    e.rows, e.c4_tokens = e.rows + new, c4
    reply = {"c4_tokens": c4, "pages": len(e.rows)}
    if dev is not None and len(toks):
        t = np.arange(first, first + len(toks))
        host_tok = np.asarray(e.rows, dtype=np.int64)[t // sp.P] * sp.P + t % sp.P
        reply.update(_copy(st, c, e, [_item(sp, reg, dev, toks, host_tok, sp.fmt)]))
    return reply, [np.asarray(e.rows, dtype=np.int64)]


def sparse_free(st: Any, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    sp, r = _region(st), _name(h)
    e = _own(sp, c, r)
    if _in_flight(st, e):
        raise _err("busy", f"sparse request {r[:64]!r}: copies into its rows are in flight "
                           f"(ops {e.ops[:4]}); free it after their acks")
    reg = sp.of(c.cid)
    n = reg.alloc.free(e.rows, (c.cid, r)) if e.rows and reg is not None else 0
    del sp.requests[(c.cid, r)]
    return {"freed_rows": n}, []


REPORT_MAX = 1 << 40  # lookups one sparse_report may add (a decode step reports thousands)


def sparse_report(st: Any, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    sp = _region(st)
    if sp.of(c.cid) is None:
        raise _err("bad_field", "sparse_report: this client holds no sparse region (report "
                                "what its hot buffer did over its own region)")
    looked, copied = h["lookups"], h["swapped_in"]
    if not 0 <= copied <= looked <= REPORT_MAX:
        raise _err("bad_field", f"need 0 <= swapped_in <= lookups <= {REPORT_MAX}, got "
                                f"{copied} and {looked}")
    nbytes = copied * sp.fmt.token_bytes  # every amount known before the first counter moves
    m = st.metrics
    m.inc("hisparse_lookups", looked)
    m.inc("hisparse_swapped_in_tokens", copied)
    m.inc("hisparse_swapped_in_bytes", nbytes)
    return {}, []


def refresh_gauges(st: Any) -> None:
    """HiSparse gauges (zeros without a region) and a first sample of each counter."""
    sp, m = getattr(st, "sparse", None), st.metrics
    m.set("hisparse_host_rows", sp.used_rows if sp else 0, "used")
    m.set("hisparse_host_rows", sp.free_rows if sp else 0, "free")
    m.set("hisparse_regions", len(sp.regions) if sp else 0, "bound")
    m.set("hisparse_regions", sp.max_regions if sp else 0, "max")
    m.set("hisparse_requests", len(sp.requests) if sp else 0)
    for name in ("hisparse_lookups", "hisparse_swapped_in_tokens", "hisparse_swapped_in_bytes"):
        m.inc(name, 0)


SPARSE_HANDLERS: dict[str, Callable[[Any, ClientState, dict, Sequence], Reply]] = {
    "sparse_region": sparse_region, "sparse_admit": sparse_admit,
    "sparse_extend": sparse_extend, "sparse_free": sparse_free,
    "sparse_report": sparse_report,
}
