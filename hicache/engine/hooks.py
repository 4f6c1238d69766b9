"""The tier hooks: how a radix tree asks a host tier to allocate, back up, load and free pages.

Contract. A tree (``hicache.engine.radix.RadixTree``, or an engine's own radix cache) never talks to
the daemon directly; it calls one object with these verbs, one radix page per element:

* ``host_alloc(n) -> list[handle]`` — ``n`` host page handles, all or none. A handle is opaque
  to the tree (for ``ClientHooks`` it is one host row per index space the page uses).
* ``host_free(handles)`` — give host pages back.
* ``backup(device_rows, handles) -> ticket`` — start copying device page rows to host pages.
* ``load(handles, device_rows) -> ticket`` — start copying host pages into device page rows.
* ``wait(ticket)`` — block until that transfer finished (bounded by the hooks' timeout);
  ``done(ticket) -> bool`` asks without blocking.
* ``copies_running(tickets) -> bool`` — whether loads whose outcome was never learned may
  still write their device rows; ``row_epoch()`` — a value that changes whenever every host
  row the hooks handed out so far is freed or gone (``ClientHooks``: the client registered,
  unregistered or reset again), so a tree knows whether the rows it forgot are still held.

Failures the tree understands (and nothing else):

* ``HostExhausted`` — the host pool has no room: the tree drops the page instead of failing.
* ``HostUnavailable`` — the daemon cannot be reached or lost our state: the tree treats its
  host tier as empty and recomputes (never retries forever, never hangs).
* ``TransferFailed`` — one transfer failed; its pages' host copies are not trusted.

``ClientHooks`` implements the verbs on ``hicache.engine.client.Client``: one host handle is a tuple
of host rows, one per index space a radix page uses (``page``, plus ``swa_page`` in paged SWA
mode), allocated together; a backup or load is one command with one item per space.

Resume checkpoints (``resume=ResumeModel``, the tree's ``mirror="checkpoints"``): a page handle is
its ``page`` row only; ``host_alloc(n, kind="ckpt")`` gives checkpoint handles (one host row of
the checkpoint space: ``swa_page`` in paged SWA mode, ``req_slot`` in ring mode) and
``backup``/``load`` take ``ckpts=[(device row or request slot, handle, boundary pages)]``. The
same one command then also carries, per checkpoint, the SWA tail as token ids of ``swa_kv``
(paged: tokens ``P - window .. P`` of the page row; ring: ring positions ``pos % window`` of the
slot's row, the host row keeps the same positions) and the state rows of ``c4_state`` and
``c4_indexer_state``.
"""
from __future__ import annotations

import hashlib
import numbers
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol, Sequence

import zmq

from hicache.core.errors import HicacheError
from hicache.core.protocol import ProtocolError
from hicache.core.resume import ResumeModel
from hicache.engine.acks import (AckTimeout, ClientClosed, CommandRefused, DaemonUnreachable,
                                 NoReply)
from hicache.engine.acks import TransferFailed as ClientTransferFailed


class HostTierError(HicacheError):
    """Base of the failures a tier hook reports to the tree."""


class HostExhausted(HostTierError):
    """The host pool has no free page for this allocation or backup."""


class HostUnavailable(HostTierError):
    """The host tier is gone (daemon unreachable, restarted or reaped us)."""


class CopyOutcomeUnknown(HostUnavailable):
    """A copy may have been taken and may still run: its command went out and got no reply
    (``NoReply``), its ack never came (``AckTimeout``), a stopping daemon acked it
    ``abandoned`` (its copy may still run), or the daemon stopped answering while we waited
    for it. A load's device rows (and its checkpoint's destination) must not be
    reused until the registration is gone."""


class TransferFailed(HostTierError):
    """A backup or load did not complete; the pages involved hold no trusted copy."""


Checkpoint = tuple[int, Any, int]  # (device page row or request slot, host handle, boundary pages)


class TierHooks(Protocol):
    """The verbs a radix tree calls on its host tier (see the module docstring)."""

    def host_alloc(self, n: int, kind: str = "page") -> list[Any]: ...

    def host_free(self, handles: Sequence[Any], kind: str = "page") -> None: ...

    def backup(self, device_rows: Sequence[int], handles: Sequence[Any],
               ckpts: Sequence[Checkpoint] = ()) -> Any: ...

    def load(self, handles: Sequence[Any], device_rows: Sequence[int],
             ckpts: Sequence[Checkpoint] = ()) -> Any: ...

    def wait(self, ticket: Any) -> None: ...

    def done(self, ticket: Any) -> bool: ...

    def copies_running(self, tickets: Sequence[Any]) -> bool: ...

    def row_epoch(self) -> Any: ...


def _abandoned(ack: Any) -> bool:
    """An ack a stopping daemon gave for an op whose copy may still run (``abandoned``): its
    device rows may be written until that daemon's process exits, an unknown outcome, not a
    plain failure."""
    return (ack.error or {}).get("code") == "abandoned"


def _registered(client: Any) -> bool:
    registered = getattr(client, "registered", None)
    return isinstance(registered, dict) and isinstance(registered.get("host_rows"), dict)


def _check_full_mirror(registered: Any, spaces: Sequence[str]) -> None:
    """Without a resume model a page is resumable only when its handle mirrors every page
    space of the registered stage (paged SWA: ``page`` and ``swa_page``; the SWA and the
    compress states of every page); refused otherwise (checked once the client registered:
    at the hooks' construction, or at their first page allocation)."""
    rows = registered.get("host_rows") if isinstance(registered, dict) else None
    if not isinstance(rows, dict):
        return  # not registered yet: the daemon's refusals say what is missing then
    if "swa_page" not in rows:
        raise ValueError("this stage keeps its SWA per request slot (ring SWA mode): a full "
                         "mirror cannot resume from it; give the hooks a resume model "
                         "(checkpoints)")
    need = sorted(s for s in rows if s != "req_slot")
    if sorted(spaces) != need:
        raise ValueError(f"a full-mirror page handle must cover the page spaces {need} of "
                         f"this stage, got {sorted(spaces)}: pages would be reported resumable "
                         f"without their SWA and compress states")


# ---------------------------------------------------------------------------- client adapter
@dataclass
class Ticket:
    """One backup or load in flight: the client's op, when it was sent, and (once known) its ack."""

    op: Any
    kind: str
    pages: int
    t_sent: float
    ckpts: int = 0
    ack: Any = None
    t_done: float | None = None


L3_POLL_AT = 64  # L3 writes awaiting acks at which ``l3_settle(0)`` asks the daemon for them
L3_PUTS_MAX = 4096  # ... and the most it keeps waiting for (the oldest are given up, counted)
POLL_MAX = 1024  # acks one poll_acks asks for (the daemon answers at most this many)
L3_POLL_S = 0.5  # ... and at most this often (a backlog must not add a round trip to every put)
LATENCY_SAMPLES = 1 << 16  # per direction: the latencies HookStats keeps (the newest)


@dataclass
class HookStats:
    """What the adapter saw, per direction: ops, pages, bytes, copy execution seconds (ops the
    daemon merged into one copy counted once) and latencies (daemon-side, accept to completion;
    the last ``LATENCY_SAMPLES`` per direction, so a long-running engine's memory stays flat)."""

    ops: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    pages: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    ckpts: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    bytes: dict[str, int] = field(default_factory=lambda: {"backup": 0, "load": 0})
    exec_seconds: dict[str, float] = field(default_factory=lambda: {"backup": 0.0, "load": 0.0})
    latencies: dict[str, deque[float]] = field(default_factory=lambda: {
        "backup": deque(maxlen=LATENCY_SAMPLES), "load": deque(maxlen=LATENCY_SAMPLES)})


class ClientHooks:
    """``TierHooks`` over a registered ``hicache.engine.client.Client`` (see the module docstring).

    ``spaces``: the index spaces one radix page uses, e.g. ``("page", "swa_page")``; device row
    ``r`` of a page is row ``r`` in every one of them. ``wait_event`` (GPU): index of the
    backup event the engine records after writing KV; the daemon's backup waits on it.
    ``on_ack(kind, ack)`` is called for every completed transfer (metrics).
    ``l3=True`` (a daemon serving ``--l3 mooncake``) adds the L3 verbs the tree uses at match
    time and after backups: ``l3_query``, ``l3_prefetch`` (best effort within
    ``l3_deadline_ms``), ``l3_put`` (asynchronous); page keys go to the daemon as
    ``page_key(key)``, the same string on every instance for the same key. With a resume model
    (checkpoints mirror) the objects are checkpoints-mirror pages, and ``l3_ckpt_present``,
    ``l3_ckpt_prefetch`` and ``l3_ckpt_put`` move checkpoint objects (one checkpoint handle
    each) under the same keys.
    """

    def __init__(self, client: Any, spaces: Sequence[str], *, timeout: float | None = None,
                 wait_event: int | None = None,
                 on_ack: Callable[[str, Any], None] | None = None,
                 resume: ResumeModel | None = None, l3: bool = False,
                 l3_deadline_ms: int = 2000) -> None:
        if not spaces:
            raise ValueError("a radix page must use at least one index space")
        if resume is not None:
            if tuple(spaces) != ("page",):
                raise ValueError(f"with checkpoints a page handle is its 'page' row only, "
                                 f"got spaces {tuple(spaces)}")
            why = resume.copyable
            if why:
                raise ValueError(why)
        else:
            _check_full_mirror(getattr(client, "registered", None), spaces)
        # hooks made before ``register``: the check runs at the first page allocation instead
        self._mirror_unchecked = resume is None and not _registered(client)
        self.client = client
        self.resume = resume
        self.spaces = tuple(spaces)
        self.timeout = timeout
        self.wait_event = wait_event
        self.on_ack = on_ack
        self.stats = HookStats()
        self._last_exec: dict[str, float] = {}
        self.l3 = l3
        self.l3_deadline_ms = l3_deadline_ms
        self.l3_stats = {"query_pages": 0, "prefetch_pages": 0, "put_pages": 0, "written": 0,
                         "skipped": 0, "bytes_read": 0, "bytes_written": 0, "errors": 0,
                         "prefetch_ckpts": 0, "put_ckpts": 0, "unsettled": 0}
        # the errors of ``l3_stats`` by the daemon's reason (``stalled``, ``busy``, ``transfer``
        # ...; docs/l3.md): whether a run's L3 misses came from a slow store or a broken one
        self.l3_error_kinds: dict[str, int] = {}
        self._l3_puts: list[Any] = []
        self._l3_next_poll = 0.0  # monotonic: the next time l3_settle may ask for lost acks
        self.l3_put_log: list[Any] | None = None  # a list: page keys handed to L3 are logged

    # errors: translate the client's exceptions into the three the tree understands
    def _call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:

        try:
            return fn(*args, **kw)
        except ClientClosed as e:  # the engine closed its client: no tier from here
            raise HostUnavailable(str(e)) from e
        except NoReply as e:  # the daemon may have taken the command: it may still copy
            raise CopyOutcomeUnknown(str(e)) from e
        except DaemonUnreachable as e:
            raise HostUnavailable(str(e)) from e
        except AckTimeout as e:  # the daemon answers but a copy never completes: do not trust it
            raise CopyOutcomeUnknown(str(e)) from e
        except ClientTransferFailed as e:
            if _abandoned(e.ack):
                raise CopyOutcomeUnknown(str(e)) from e
            raise TransferFailed(str(e)) from e
        except CommandRefused as e:
            if e.code == "no_space":
                raise HostExhausted(e.message) from e
            if e.code in ("not_registered", "not_owner", "shutting_down"):
                raise HostUnavailable(str(e)) from e  # restarted, reaped or stopping: state lost
            raise TransferFailed(str(e)) from e
        except ProtocolError as e:  # a reply it cannot read (or, a bug, a request it would not
            # send): the daemon may have taken the command, so nothing is reused yet
            raise CopyOutcomeUnknown(f"unreadable reply from the daemon: {e}") from e
        except zmq.ZMQError as e:  # the client's socket is closed (or broken): no tier
            raise HostUnavailable(f"the client's socket failed: {e}") from e

    def host_alloc(self, n: int, kind: str = "page") -> list[Any]:
        if kind == "ckpt":
            space = self._ckpt_space()
            return list(self._call(self.client.alloc, {space: n}, timeout=self.timeout)[space])
        if self._mirror_unchecked and _registered(self.client):
            _check_full_mirror(self.client.registered, self.spaces)
            self._mirror_unchecked = False
        rows = self._call(self.client.alloc, {s: n for s in self.spaces}, timeout=self.timeout)
        return list(zip(*(rows[s] for s in self.spaces)))

    def host_free(self, handles: Sequence[Any], kind: str = "page") -> None:
        if not handles:
            return
        if kind == "ckpt":
            rows = {self._ckpt_space(): list(handles)}
        else:
            rows = {s: [h[i] for h in handles] for i, s in enumerate(self.spaces)}
        self._call(self.client.free, rows, timeout=self.timeout)

    def _ckpt_space(self) -> str:
        if self.resume is None:
            raise ValueError("these hooks mirror full pages: they hold no checkpoints")
        return self.resume.checkpoint_space

    def checkpoint_items(self, ckpts: Sequence[Checkpoint], to_host: bool) -> dict[str, tuple]:
        """Items of the checkpoints ``ckpts`` (see the module docstring), device side first."""
        if not ckpts:
            return {}
        self._ckpt_space()  # refuses hooks without a resume model
        r = self.resume
        assert r is not None
        P = r.page_size
        dev_tok: list[int] = []
        host_tok: list[int] = []
        for loc, h, depth in ckpts:
            offs = list(r.tail_offsets) if r.checkpoint_space == "swa_page" \
                else r.ring_positions(depth)
            dev_tok += [loc * P + t for t in offs]
            host_tok += [h * P + t for t in offs]
        dev_rows, host_rows = [c[0] for c in ckpts], [c[1] for c in ckpts]
        out: dict[str, tuple] = {}
        if r.swa_pool is not None:
            out[r.swa_pool.name] = ((dev_tok, host_tok) if to_host else (host_tok, dev_tok)) \
                + ("token",)
        for p in r.state_pools:
            out[p.name] = (dev_rows, host_rows) if to_host else (host_rows, dev_rows)
        return out

    def backup(self, device_rows: Sequence[int], handles: Sequence[Any],
               ckpts: Sequence[Checkpoint] = ()) -> Ticket:
        return self._copy(True, device_rows, handles, ckpts)

    def load(self, handles: Sequence[Any], device_rows: Sequence[int],
             ckpts: Sequence[Checkpoint] = ()) -> Ticket:
        return self._copy(False, device_rows, handles, ckpts)

    def _copy(self, to_host: bool, device_rows: Sequence[int], handles: Sequence[Any],
              ckpts: Sequence[Checkpoint]) -> Ticket:
        """A backup (``to_host``) or a load of pages ``device_rows`` <-> host ``handles``
        (one id per index space each) and of checkpoints ``ckpts``."""
        items: dict[str, tuple] = {}
        for i, s in enumerate(self.spaces if device_rows else ()):
            dev, host = list(device_rows), [h[i] for h in handles]
            items[s] = (dev, host) if to_host else (host, dev)
        items.update(self.checkpoint_items(ckpts, to_host=to_host))
        t = time.perf_counter()
        if to_host:
            op = self._call(self.client.backup, items, wait_event=self.wait_event,
                            timeout=self.timeout)
        else:
            op = self._call(self.client.load, items, timeout=self.timeout)
        return Ticket(op, "backup" if to_host else "load", len(device_rows), t, len(ckpts))

    def _complete(self, ticket: Ticket, ack: Any) -> None:
        ticket.ack, ticket.t_done = ack, time.perf_counter()
        if not ack.ok:
            return
        k, st = ticket.kind, self.stats
        st.ops[k] += 1
        st.pages[k] += ticket.pages
        st.ckpts[k] += ticket.ckpts
        st.bytes[k] += int(ack.bytes)
        ex = float(ack.exec_seconds)
        if ex != self._last_exec.get(k):  # ops the daemon merged into one copy share its time
            st.exec_seconds[k] += ex
        self._last_exec[k] = ex
        st.latencies[k].append(float(ack.seconds))
        if self.on_ack is not None:
            self.on_ack(k, ack)

    def wait(self, ticket: Ticket) -> None:
        if ticket.ack is None:
            try:
                ack = self._call(self.client.wait_ack, ticket.op, self.timeout, check=False)
            except HostTierError as e:  # no ack came: the daemon took the op, which may still
                if isinstance(e, CopyOutcomeUnknown):  # be copying (a refused poll, busy or
                    raise  # internal, says nothing of the copy either)
                raise CopyOutcomeUnknown(str(e)) from e
            self._complete(ticket, ack)
        if not ticket.ack.ok:
            err = ticket.ack.error or {}
            why = f"{ticket.kind} op {ticket.ack.op} failed: {err.get('message', 'unknown')}"
            raise (CopyOutcomeUnknown if _abandoned(ticket.ack) else TransferFailed)(why)

    def row_epoch(self) -> int:
        """The client's ``row_epoch``: +1 at each register, unregister and reset."""
        return int(self.client.row_epoch)

    def copies_running(self, tickets: Sequence[Ticket | None]) -> bool:
        """Whether loads whose outcome was unknown (``tickets``; None for one whose request got
        no reply, so its op id is unknown) may still copy. False once the daemon acked every
        one, or holds no operation of this client at all (a restarted daemon never ran them).
        One ``poll_acks``; refused or unanswered: ``HostUnavailable`` / ``TransferFailed``."""
        ids = [t.op.op_id for t in tickets if t is not None and
               (t.ack is None or _abandoned(t.ack))]  # (acked, but maybe still copying)
        acked = {a.op for a in self._call(self.client.poll_acks, ids, max=POLL_MAX,
                                          timeout=self.timeout)}
        left = any(t is None for t in tickets) or bool(set(ids) - acked)
        return left and self.client.daemon_in_flight > 0

    def done(self, ticket: Ticket) -> bool:
        """Non-blocking: reads acks that already arrived, never waits for one."""

        if ticket.ack is not None:
            return True
        if ticket.op.ack is None:
            self._call(self.client.drain)
            try:
                ack = self.client.wait_ack(ticket.op, timeout=0.0, check=False)
            except AckTimeout:
                return False
        else:
            ack = ticket.op.ack
        self._complete(ticket, ack)
        return True

    # ------------------------------------------------------------------ L3 (``l3=True``)
    def _l3_handles(self, handles: Sequence[Any], ckpt: bool = False) -> dict[str, list[int]]:
        if ckpt:
            return {self._ckpt_space(): list(handles)}
        return {s: [h[i] for h in handles] for i, s in enumerate(self.spaces)}

    def _l3_kind(self, ckpt: bool = False) -> dict[str, Any]:
        if self.resume is None:
            return {}
        return {"mirror": "checkpoints", "ckpt": ckpt}

    def _l3_call(self, fn: Callable[..., Any], *args: Any, **kw: Any) -> Any:
        """``_call`` for an L3 command whose unknown outcome harms nothing the tree holds (a
        query writes nothing; a prefetch writes host rows whose free the daemon defers until
        it ends): no reply or a late ack fails the call (a miss), it does not take the host
        tier offline."""
        try:
            return self._call(fn, *args, **kw)
        except CopyOutcomeUnknown as e:
            raise TransferFailed(f"L3: {e}") from e

    def l3_query(self, keys: Sequence[Any]) -> int:
        n = self._l3_call(self.client.l3_query, [page_key(k) for k in keys],
                          timeout=self.timeout, deadline_ms=self.l3_deadline_ms,
                          **self._l3_kind())
        self.l3_stats["query_pages"] += n
        return n

    def l3_ckpt_present(self, keys: Sequence[Any]) -> list[int]:
        """1/0 per page key: does L3 hold that boundary's checkpoint."""
        self._ckpt_space()  # refuses hooks without a resume model
        return self._l3_call(self.client.l3_present, [page_key(k) for k in keys],
                             timeout=self.timeout, deadline_ms=self.l3_deadline_ms,
                             **self._l3_kind(True))

    def l3_prefetch(self, keys: Sequence[Any], handles: Sequence[Any],
                    ckpt: bool = False) -> int:
        """Fill ``handles`` with pages ``keys`` from L3; the number of leading pages filled."""
        ack = self._l3_call(self.client.l3_prefetch, [page_key(k) for k in keys],
                            self._l3_handles(handles, ckpt), deadline_ms=self.l3_deadline_ms,
                            timeout=self.timeout, **self._l3_kind(ckpt))
        n = int(ack.l3["hits"])
        self.l3_stats["prefetch_ckpts" if ckpt else "prefetch_pages"] += n
        self.l3_stats["bytes_read"] += int(ack.bytes)
        self._l3_errors(ack.l3["misses"], ("miss", "deadline"))
        return n

    def _l3_errors(self, misses: dict[str, int], plain: tuple[str, ...]) -> None:
        """Count an ack's L3 ``misses`` other than the ``plain`` reasons (a page L3 does not
        hold, a read past its deadline) as errors, in all and by reason."""
        for why, n in misses.items():
            if why not in plain and n:
                self.l3_stats["errors"] += int(n)
                self.l3_error_kinds[why] = self.l3_error_kinds.get(why, 0) + int(n)

    def l3_ckpt_prefetch(self, keys: Sequence[Any], handles: Sequence[Any]) -> int:
        """Fill checkpoint ``handles`` with the checkpoints of ``keys`` from L3."""
        return self.l3_prefetch(keys, handles, ckpt=True)

    def l3_put(self, keys: Sequence[Any], handles: Sequence[Any], ckpt: bool = False) -> None:
        """Hand host pages to L3 (asynchronous; acks are collected by ``l3_settle``)."""
        op = self._call(self.client.l3_put, [page_key(k) for k in keys],
                        self._l3_handles(handles, ckpt), timeout=self.timeout,
                        **self._l3_kind(ckpt))
        self.l3_stats["put_ckpts" if ckpt else "put_pages"] += len(keys)
        if self.l3_put_log is not None and not ckpt:
            self.l3_put_log.extend(keys)
        self._l3_puts.append(op)
        self.l3_settle(0.0)

    def l3_ckpt_put(self, keys: Sequence[Any], handles: Sequence[Any]) -> None:
        """Hand host checkpoints (boundaries ``keys``) to L3, asynchronously."""
        self.l3_put(keys, handles, ckpt=True)

    def l3_settle(self, timeout: float) -> int:
        """Collect the acks of finished L3 writes (waiting up to ``timeout`` for each);
        returns how many are still pending."""
        from hicache.engine.client import AckTimeout

        polled: dict[int, Any] = {}
        if timeout == 0.0:
            self._call(self.client.drain)
            now = time.monotonic()
            if len(self._l3_puts) >= L3_POLL_AT and now >= self._l3_next_poll:
                self._l3_next_poll = now + L3_POLL_S  # pushes may be lost: ask for their acks
                ids = [op.op_id for op in self._l3_puts]
                for i in range(0, len(ids), POLL_MAX):  # (poll_acks hands them over: kept here)
                    for a in self._call(self.client.poll_acks, ids[i:i + POLL_MAX], POLL_MAX):
                        polled[a.op] = a
        keep = []
        for op in self._l3_puts:
            a = polled.pop(op.op_id, None)
            if a is None:
                try:
                    a = self._call(self.client.wait_ack, op, timeout, check=False)
                except (AckTimeout, HostUnavailable):
                    keep.append(op)
                    continue
            st = self.l3_stats
            st["written"] += int(a.l3.get("written", 0))
            st["skipped"] += int(a.l3.get("skipped", 0))
            st["bytes_written"] += int(a.bytes)
            self._l3_errors(a.l3.get("misses", {}), ("miss",))
        if len(keep) > L3_PUTS_MAX:  # acks the daemon no longer holds: stop waiting for them
            self.l3_stats["unsettled"] += len(keep) - L3_PUTS_MAX
            keep = keep[-L3_PUTS_MAX:]
        self._l3_puts = keep
        return len(keep)


def _plain(key: Any) -> Any:
    """``key`` with integers of other types (numpy's) as Python ints, in tuples too: their
    repr differs (``np.int64(5)`` on numpy 2, ``5`` on numpy 1) where the value does not."""
    if isinstance(key, tuple):
        if all(type(k) is int for k in key):
            return key
        return tuple(_plain(k) for k in key)
    if isinstance(key, numbers.Integral) and not isinstance(key, bool) and type(key) is not int:
        return int(key)
    return key


def page_key(key: Any) -> str:
    """The L3 name of a radix page key: ints in hex, fitting strings as they are, anything
    else (bytes, tuples, long strings) by a digest of its repr — the same on every process.
    Integers count by value, whatever their type (numpy's included, in tuples too)."""
    if isinstance(key, bool):
        raise TypeError("a page key cannot be a bool")
    key = _plain(key)
    if isinstance(key, int):
        return f"i{key:x}" if key >= 0 else f"n{-key:x}"
    if isinstance(key, str) and 0 < len(key) <= 120 and all(c.isalnum() or c in "_.:-"
                                                              for c in key) and key.isascii():
        return f"s{key}"
    if isinstance(key, (bytes, bytearray)):
        return "b" + hashlib.blake2b(bytes(key), digest_size=16).hexdigest()
    return "h" + hashlib.blake2b(repr(key).encode(), digest_size=16).hexdigest()
