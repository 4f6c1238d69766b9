"""The L3 commands (``l3_query``, ``l3_prefetch``, ``l3_put``) and the acks of their jobs.

Same rules as ``handlers``: every check passes before anything changes, a refusal is one
``ProtocolError``. Each command is asynchronous: the reply carries an op id at once, the result
comes in that op's ack (pushed, or read with ``poll_acks``), so a slow or absent master never
holds the daemon's loop, and the client bounds its own wait.

Every command names its objects with ``mirror`` (``full``, the default: a page carries every
pool of every page space; ``checkpoints``: a page carries its ``page`` rows) and ``ckpt``
(with ``checkpoints``: the objects are the resume checkpoints of those page keys, one row each
of the checkpoint space); see ``l3_format``. A kind this stage cannot store is refused.

* ``l3_query {keys, deadline_ms}``: ack ``l3 = {"hits": N}``, the number of leading objects of
  the key chain the store holds (an offline store answers 0); with ``each``, ``l3 = {"hits": N,
  "present": [0|1 per key]}`` (checkpoints exist at some boundaries only). A store call that
  hangs past the deadline does not hold the ack either: 0 hits (none present), ``misses:
  {deadline: n}``, 50 ms after it (the engine's request waits for that answer).
* ``l3_prefetch {keys, rows: {space: frame}, deadline_ms}``: reads the objects into host rows
  the client owns (one row per object in every space the kind uses); best effort: the ack's
  ``hits`` is the number of leading objects read and verified by the time the deadline passed;
  rows after them hold nothing usable. ``misses`` says why the chain stopped (miss, corrupt,
  transfer, offline, deadline). A store call that hangs past the deadline (a hung master) does
  not hold the ack: it comes 50 ms after the deadline with 0 hits, and the rows stay busy until
  the call returns (``DaemonState.expire_l3``). Only the pools the kind holds become readable; the rest of a row a
  checkpoint fills in part (the SWA head) is zeroed first, so no earlier owner's bytes show.
* ``l3_put {keys, rows}``: writes the objects of those host rows in the background, skipping
  keys that exist; the ack's ``written`` / ``skipped``. Only the pools the kind holds are read,
  and they must have been written by this client.

While a job runs, its rows count as in flight (a free is deferred until the job ends);
``DaemonState.finish_l3`` ends that and queues the ack. At most ``L3_READS_PER_CLIENT`` reads
(queries, prefetches) of one client and ``L3_READS_MAX`` in all are in flight (``busy``
beyond): one client's queries cannot queue without bound ahead of every other client's
prefetches on the one read thread.
"""
from __future__ import annotations

import time
from typing import Any, Sequence

import numpy as np

from hicache.core.protocol import DEFAULT_DEADLINE_MS, ProtocolError

from . import l3_format as F
from .copy_commands import Reply, _bounds, _distinct
from .host_access import begin_fill, check_readable
from .l3_store import L3Job
from .ops import Ids
from .registry import ClientState
from .state import DaemonState

MAX_DEADLINE_MS = 60_000
L3_READS_PER_CLIENT = 32  # L3 queries and prefetches of one client in flight at once
L3_READS_MAX = 256  # ... of all clients (puts have their own queue, bounded by host rows)


def _l3(st: DaemonState) -> Any:
    if st.l3 is None:
        raise ProtocolError("unsupported", "this daemon runs without an L3 tier (start it with "
                                           "--l3 mooncake)")
    return st.l3


def _format(st: DaemonState, h: dict) -> F.ObjectFormat:
    """The object kind the command names (``mirror``, ``ckpt``), or a refusal."""
    try:
        return st.l3.objects.get(F.kind_of(h.get("mirror", "full"), bool(h.get("ckpt", False))))
    except ValueError as e:
        raise ProtocolError("bad_field", str(e)) from None


def _keys(st: DaemonState, c: ClientState, keys: list[str], fmt: F.ObjectFormat) -> list[str]:
    if not keys:
        raise ProtocolError("bad_field", "keys is empty")
    for k in keys:
        why = F.check_page_key(k)
        if why is not None:
            raise ProtocolError("bad_field", why)
    return [st.l3.objects.key(k, fmt.kind, st.tenant(c)) for k in keys]


def _rows(st: DaemonState, c: ClientState, h: dict, arrays: Sequence, n: int, writes: bool,
          fmt: F.ObjectFormat) -> tuple[list[dict[str, int]], list[tuple[str, np.ndarray, bool]]]:
    spaces = fmt.spaces
    pools = fmt.pools()
    if sorted(h["rows"]) != sorted(spaces):
        raise ProtocolError("bad_field", f"rows must give exactly the spaces {list(spaces)} of "
                                         f"{fmt.kind} objects, got {sorted(h['rows'])[:4]}")
    host, cols = [], {}
    for s in spaces:
        ids = Ids(arrays[h["rows"][s]])
        if ids.n != n:
            raise ProtocolError("bad_rows", f"rows[{s!r}] has {ids.n} ids for {n} keys")
        _bounds(ids, st.host_rows[s], f"rows[{s!r}]")
        _distinct(ids, f"rows[{s!r}]")
        a = ids.np().copy()
        st.check_owned(c.cid, s, a, f"rows[{s!r}]")
        if not writes:  # a put reads the rows: only what this client wrote may leave
            for pool in pools[s]:
                check_readable(st.group, pool, a, f"rows[{s!r}]")
        if (writes and st.tracker.in_use(s, a)) or \
                (not writes and st.tracker.hazard([(s, a, False)])):
            raise ProtocolError("busy", f"rows[{s!r}]: an operation in flight uses these rows")
        host.append((s, a, writes))
        cols[s] = a.tolist()
    return [{s: cols[s][i] for s in spaces} for i in range(n)], host


def _start(st: DaemonState, c: ClientState, job: L3Job,
           host: list[tuple[str, np.ndarray, bool]]) -> Reply:
    reads = job.kind != "put"
    if reads and c.l3_reads >= L3_READS_PER_CLIENT:
        raise ProtocolError("busy", f"{c.l3_reads} L3 reads of this client are in flight "
                                    f"(at most {L3_READS_PER_CLIENT}); send more after acks")
    if reads and st.l3_reads >= L3_READS_MAX:
        raise ProtocolError("busy", f"{st.l3_reads} L3 reads are in flight (at most "
                                    f"{L3_READS_MAX}); send more after acks")
    op_id = st.next_op_id()
    job.tag = (op_id, c, host)
    if job.kind == "prefetch":
        pools = job.fmt.pools()
        job.pools = {s: list(p) for s, p in pools.items()}
        job.partial = {p for ps in pools.values() for p, part in ps.items() if part}
        begin_fill(st.group, job.pools, host, partial=job.partial, landing=st.landing)
    st.tracker.begin(host)
    st.l3_rows.begin(host)
    c.in_flight += 1
    if reads:
        c.l3_reads += 1
        st.l3_reads += 1
    st.l3_ops[op_id] = job
    st.l3.submit(job)
    return {"op": op_id}, []


def deadline_ms(h: dict) -> int:
    """A command's ``deadline_ms`` (1..60,000; default 5,000), or a refusal (``kv_clear``
    takes it too)."""
    ms = h.get("deadline_ms", DEFAULT_DEADLINE_MS)
    if not 0 < ms <= MAX_DEADLINE_MS:
        raise ProtocolError("bad_field", f"deadline_ms must be in 1..{MAX_DEADLINE_MS}")
    return ms


def _deadline(h: dict) -> float:
    """The job's deadline (monotonic) from ``deadline_ms``."""
    return time.monotonic() + deadline_ms(h) / 1000


def l3_query(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    _l3(st)
    fmt = _format(st, h)
    keys = _keys(st, c, h["keys"], fmt)
    return _start(st, c, L3Job("query", keys, deadline=_deadline(h), fmt=fmt,
                               each=bool(h.get("each", False))), [])


def l3_prefetch(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    _l3(st)
    fmt = _format(st, h)
    keys = _keys(st, c, h["keys"], fmt)
    deadline = _deadline(h)
    rows, host = _rows(st, c, h, arrays, len(keys), True, fmt)
    return _start(st, c, L3Job("prefetch", keys, rows, deadline, fmt=fmt), host)


def l3_put(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    _l3(st)
    fmt = _format(st, h)
    keys = _keys(st, c, h["keys"], fmt)
    if len(set(keys)) != len(keys):  # one object, two sources: which one is stored is moot
        seen: set[str] = set()
        dup = next(k for k in h["keys"] if k in seen or seen.add(k))
        raise ProtocolError("bad_field", f"keys names {dup[:40]!r} twice (a put stores one "
                                         f"object per key)")
    rows, host = _rows(st, c, h, arrays, len(keys), False, fmt)
    return _start(st, c, L3Job("put", keys, rows, fmt=fmt), host)
