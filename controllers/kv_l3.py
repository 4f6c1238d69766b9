"""The key store's L3: every entry written through to Mooncake Store, and read back on a miss.

``KeyStore`` (``kv_store``) makes a ``KvL3(st, store)`` when the daemon serves with ``--l3``;
without L3 nothing here runs and the key store behaves as before.

Objects and keys:

* One object per (entry, slot): the page one engine pool put under ``(namespace, key)`` —
  pools arrive in separate ``kv_put`` calls and L3 puts skip existing keys, so an object per
  whole entry written at the first pool's put would never receive the later pools. A byte
  pool's object is its whole host row in every layer (an ``l3_format.ObjectFormat`` of one
  ``Segment``); a marker pool's object is the header alone (``MarkerFormat``). Both carry the
  same verified header (magic, version, length, checksum, key digest) as every L3 object.
* ``object_key(prefix, ns, epoch, slot, key) = "<prefix>/<ns digest>/<epoch>/<slot
  digest>/<key>"`` with ``prefix = kv_prefix(objects) = "hc2/<model>/<layout
  fingerprint>/w-<scope digest>/kv/pp<r>of<n>"``: the namespace is the key store's own
  (CURVE key name + the client's namespace), digested, so two namespaces never name the same
  object; ``epoch`` is the namespace's current epoch, kept in L3 (``kv_epochs``): a ``kv_clear``
  replaces it, so no daemon names the older objects again.

Every L3 read of a namespace's objects (``fetch``, ``exists``) goes under an epoch confirmed
less than ``--l3-epoch-recheck`` seconds ago (``kv_epochs.Epochs.for_read``), else its keys are
answered *pending* while the epoch is read; a write goes under the epoch the daemon knows
(waiting for the first one). A read's result is used only if its epoch is still current and
fresh when it completes, and remembered answers only under the epoch they were found in.

Write-through (``write``): the entries a ``kv_put`` filled go out as one put job. Their rows
are pinned until it completes: ``Entry.pins`` (eviction skips pinned entries) and the row
tracker (a ``kv_clear`` meanwhile defers the free until the job ends). A put completion is
recorded in the L3 metrics like any other (written / skipped_existing / errors); a write with
no usable epoch (the tier connecting or offline: nothing is submitted; or the stored value
refused) is dropped and counted
(``l3_errors{kind="offline" | "epoch"}``).

Read-through, never blocking the server thread (every L3 call runs on the L3 worker threads):

* ``fetch`` (``kv_get`` of keys the host store lacks): a key not known to be in the store is
  first asked about (as ``exists`` does) and answered *pending*, so rows are taken (and
  entries evicted) only for objects the store holds; for keys known present it allocates
  fresh store rows (LRU eviction as a put does; keys that find no row report 0), starts one
  prefetch job and answers those keys *pending*. When the job completes, each object whose
  header, length and checksum verify becomes an entry (or fills that slot of an entry a put
  made meanwhile); the others free their rows and are remembered absent for ``ABSENT_TTL``
  seconds, so the client's retry gets 0, never bytes. While the prefetch worker is stalled (a
  storage node holds its call, ``MooncakeL3.stalled``) a key known present is a miss at once
  (no row taken, nothing remembered; counted ``l3_errors{kind="stalled"}`` too), and a prefetch
  answered ``stalled`` unrun frees its rows without remembering its keys absent. Every key a
  ``kv_get`` answers 0 after consulting L3 (known absent or corrupt, offline, stalled, no row
  free, no usable epoch) counts in ``l3_pages{result="kv_miss"}``.
* ``exists`` (``kv_exists``) answers from what the daemon knows: entries, objects it wrote
  or saw (present for ``PRESENT_TTL`` s), objects found absent (``ABSENT_TTL`` s). An unknown
  key starts one asynchronous query and is answered *pending*; the client asks again.
* While the tier connects, unknown keys are pending (nothing is submitted); while it is
  offline they are misses at once. With ``QUERIES_MAX`` query jobs in flight (a hung master
  holds each up to its RPC timeout), an unknown key is a miss at once, counted
  ``l3_errors{kind="busy"}``: the queue in front of the store stays bounded.
* Every such read (prefetch, query; and ``kv_epochs``' epoch reads) is answered by
  ``READ_DEADLINE``: past it (plus ``state.L3_DEADLINE_GRACE_S``) ``DaemonState.expire_l3``
  marks the job and its ``expire`` hook makes its keys misses (remembered absent for
  ``ABSENT_TTL``); a prefetch no worker took yet gives its rows back then (it never runs), one
  whose call still runs gives them back when the call returns, and what that call read is not
  used (``_free`` empties the row list it frees: the rows go back once).

Clear (``kv_clear``, ``clear``): a new epoch is upserted on the L3 meta thread; the command is
answered in its op's ack once that call returned, or at its deadline (plus
``state.L3_DEADLINE_GRACE_S``) with an error when it has not. Nothing changes before the epoch is
written: reads and writes of the namespace go on under the old epoch meanwhile. When it is
written, the namespace's host entries are dropped (the ack's ``dropped``), results of reads
under the old epoch are no longer used, and the old epoch's objects are removed in the
background (``_collect``: one ``remove_by_regex`` on ``<prefix>/<ns digest>/<old epoch>/``;
garbage collection only, never needed for correctness: every namespace collected while a remove
job waits in the write queue joins it, and with ``GC_MAX`` regexes waiting, one more is skipped,
logged and counted in ``gc_skipped``: its objects stay until Mooncake evicts them, unread). A
clear whose call returns after its error ack and did write the epoch takes effect then. At most
``CLEARS_MAX`` clears are in flight; one more is refused ``busy`` before anything changes.

Another daemon's clear is seen here when an epoch read finds the new epoch
(``kv_epochs.Epochs``): the same local effects (host entries of the namespace dropped, old
epoch's objects collected).

A job's bookkeeping (``_Tag``) is finished by ``DaemonState.finish_l3`` on the server thread;
a clear's ``_Tag`` also has the ``expire`` hook ``DaemonState.expire_l3`` calls.
"""
from __future__ import annotations

import hashlib
import logging
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import l3_format as F
from hicache.core.protocol import ProtocolError

from .kv_epochs import Epochs, ns_digest
from .l3_store import L3Job
from .state import l3_ack

if TYPE_CHECKING:  # kv_store imports this module: its types are named, not imported
    from .kv_regions import EnginePool
    from .registry import ClientState
    from .state import DaemonState

log = logging.getLogger("hicache.l3")
PRESENT_TTL = 30.0  # s: an object written or seen is reported present this long
ABSENT_TTL = 2.0  # s: an object found absent or corrupt is a miss this long
# s: the key store's own reads (epoch reads, queries, prefetches) are answered by then: a
# prefetch stops at the first batch past it, and one whose Mooncake call still runs (a hung
# master holds it up to its RPC timeout, 30 s) is a miss from then on; below the client's
# default wait (``kv_client.L3_WAIT``, 5 s), so a kv_get or kv_exists gets that miss
READ_DEADLINE = 4.0
KNOWN_MAX = 1 << 18  # remembered (entry, slot) answers, oldest dropped first
CLEARS_MAX = 64  # kv_clears in flight (their epoch writes); one more is refused busy
GC_MAX = 4096  # old epochs waiting for their removal; past it one more is left to eviction
# the key store's query jobs in flight (``exists``, and ``fetch`` of keys not known present);
# past it an unknown key is a miss at once (as a client's own L3 reads stop at
# ``l3_handlers.L3_READS_MAX``)
QUERIES_MAX = 256
_REGEX_SPECIAL = set(".^$|?*+()[]{}\\")

Ident = tuple[str, str, str, str]  # (space, namespace, slot, key)


def kv_prefix(full_ns: str) -> str:
    """``hc2/<model>/<fingerprint>/w-<scope digest>/kv/pp<r>of<n>`` from the stage's
    full-mirror namespace (``l3_format.namespace``): the key-store objects of this stage."""
    head, _, pp = full_ns.rsplit("/", 2)
    return f"{head}/kv/{pp}"


def _digest(s: str, n: int) -> str:
    return hashlib.blake2b(s.encode(), digest_size=n).hexdigest()


def epoch_prefix(prefix: str, ns: str, epoch: str) -> str:
    """Where every object of ``ns`` under ``epoch`` lies."""
    return f"{prefix}/{ns_digest(ns)}/{epoch}/"


def object_key(prefix: str, ns: str, epoch: str, slot: str, key: str) -> str:
    return f"{epoch_prefix(prefix, ns, epoch)}{_digest(slot, 8)}/{key}"


def _regex_prefix(s: str) -> str:
    return "^" + "".join("\\" + ch if ch in _REGEX_SPECIAL else ch for ch in s)


class MarkerFormat:
    """The object of a marker pool's slot: a header and no payload (the ``ObjectFormat``
    interface ``MooncakeL3`` uses)."""

    kind = "kv"
    segments: tuple = ()
    payload_bytes = 0
    obj_bytes = F.HEADER_BYTES
    pieces_per_object = 0

    def __init__(self, space: str, page_tokens: int) -> None:
        self.spaces = (space,)
        self.page_tokens = page_tokens  # a key's tokens are counted once, through its marker

    def pieces(self, rows: dict[str, int]) -> tuple[list[int], list[int]]:
        return [], []

    def checksum(self, rows: dict[str, int]) -> int:
        return 0


Expire = Callable[[L3Job, float, bool], None]  # (job, now, queued: no worker took it)


@dataclass
class _Tag:
    """``L3Job.tag`` of the key store's jobs: ``DaemonState.finish_l3`` calls ``done(job)``;
    ``DaemonState.expire_l3`` calls ``expire(job, now, queued)`` where there is one (clears and
    reads) once the job's deadline passed, the job marked ``acked`` and cancelled."""

    op_id: int
    done: Callable[[L3Job], None]
    expire: Expire | None = None


def _clear_error(job: L3Job, deadline_ms: int, expired: bool) -> str:
    """The one line of a clear's error ack (nothing was cleared here)."""
    if expired and job.cancelled == "stopping":  # (``DaemonState.fail_pending``)
        if not job.started:
            return ("kv_clear: the daemon stopped before the L3 meta thread reached this clear "
                    "(an earlier call waits on an L3 store that does not answer); nothing was "
                    "cleared")
        return ("kv_clear: the daemon stopped while the L3 store did not answer; nothing was "
                "cleared here (the new epoch may still be written if the store takes the call "
                "it holds: clear again to know)")
    if expired and job.started:
        return (f"kv_clear: the L3 store did not answer within {deadline_ms} ms; nothing was "
                "cleared here (the new epoch may still be written when the call returns, and "
                "the clear then takes effect: clear again to know)")
    if expired:
        return (f"kv_clear: the L3 meta thread did not reach this clear within {deadline_ms} "
                "ms (an earlier call hangs); nothing was cleared")
    if "offline" in job.misses:
        return "kv_clear: the L3 tier is offline; no new epoch was written, nothing was cleared"
    if "stalled" in job.misses:
        return ("kv_clear: a storage node of the L3 store holds the key store's calls (stalled: "
                "it does not answer, the master does); no new epoch was written, nothing was "
                "cleared")
    if "stopping" in job.misses:
        return "kv_clear: the daemon is stopping; nothing was cleared"
    return (f"kv_clear: writing the namespace's new epoch failed ({job.error or 'Mooncake error'});"
            " nothing was cleared")


class KvL3:
    """The key store's bridge to the daemon's ``MooncakeL3`` (see the module docstring)."""

    def __init__(self, st: "DaemonState", store: Any) -> None:
        self.st, self.store, self.l3 = st, store, st.l3
        self.prefix = kv_prefix(self.l3.objects.ns["full"])
        self.formats: dict[str, Any] = {}
        # (entry, slot) -> (present, when, the epoch it was found under)
        self.known: OrderedDict[Ident, tuple[bool, float, str]] = OrderedDict()
        self.fetching: set[Ident] = set()
        self.querying: set[Ident] = set()
        self.epochs = Epochs(self._submit, self.prefix, self.l3.settings.kv_epoch_recheck,
                             READ_DEADLINE, self._changed, self.store.drop)
        self.gc: L3Job | None = None  # the last remove job submitted
        # (namespace, epoch) of the write-through puts submitted since ``gc``: the removal of
        # one of those epochs does not join ``gc`` (it would run ahead of those puts, and what
        # they write would stay in the store)
        self.puts_after_gc: set[tuple[str, str]] = set()
        self.gc_waiting = 0  # old epochs whose removal has not run yet
        self.gc_skipped = 0  # ... and those left to eviction (``GC_MAX`` were waiting)
        self.pinned = 0
        self.jobs = 0  # the key store's L3 jobs in flight
        self.queries = 0  # ... of which query jobs (at most ``QUERIES_MAX``)

    # ------------------------------------------------------------------ objects
    def fmt(self, ep: "EnginePool") -> Any:
        f = self.formats.get(ep.slot)
        if f is None:
            if ep.pool is None:
                f = MarkerFormat(ep.space, self.st.layout.model.page_size)
            else:
                spec = self.st.layout.pool(ep.pool)
                f = F.ObjectFormat("kv", self.st.group,
                                   [F.Segment(ep.space, ep.pool, 0, spec.page_bytes)])
            self.formats[ep.slot] = f
        return f

    def _key(self, ep: "EnginePool", epoch: str, key: str) -> str:
        return object_key(self.prefix, ep.ns, epoch, ep.slot, key)

    def _submit(self, job: L3Job, done: Callable[[L3Job], None],
                expire: Expire | None = None) -> int:
        op_id = self.st.next_op_id()

        def ended(j: L3Job) -> None:
            self.jobs -= 1
            done(j)

        job.tag = _Tag(op_id, ended, expire)
        self.st.l3_ops[op_id] = job
        self.jobs += 1
        self.l3.submit(job)
        return op_id

    def _remember(self, ident: Ident, present: bool, epoch: str) -> None:
        self.known[ident] = (present, time.monotonic(), epoch)
        self.known.move_to_end(ident)
        while len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)

    def _answer(self, ident: Ident, now: float, epoch: str) -> bool | None:
        """What the daemon knows of an object under ``epoch`` now: present, absent, or None
        (ask the store)."""
        k = self.known.get(ident)
        if k is None:
            return None
        present, t, e = k
        if e == epoch and now - t <= (PRESENT_TTL if present else ABSENT_TTL):
            return present
        del self.known[ident]
        return None

    def _read_epoch(self, ns: str) -> str | None | bool:
        """The epoch to read ``ns``'s objects under; None: answer pending, nothing asked (the
        tier is connecting, or the epoch is being read); False: a miss (the tier is offline,
        or the namespace has no usable epoch now)."""
        if not self.l3.online:
            return None if self.l3.state == "connecting" else False
        return self.epochs.for_read(ns)

    def touch(self, ns: str) -> None:
        """``ns`` is used (a host hit, an attach): read its epoch again when it is due, so a
        clear by another daemon is noticed (``kv_epochs``)."""
        if self.l3.online:
            self.epochs.touch(ns)

    # ------------------------------------------------------------------ write-through
    def write(self, ep: "EnginePool", stored: list[tuple[str, Any]]) -> None:
        """Write the slot ``ep.slot`` of these freshly filled entries (``(key, entry)``) to L3;
        their rows stay pinned until the job completes (or is dropped for want of an epoch)."""
        if not stored:
            return
        self.epochs.entries_made(ep.ns)
        fmt = self.fmt(ep)  # before any row is pinned: a failure here changes nothing
        space = ep.space
        rows = np.asarray([e.row for _, e in stored], dtype=np.int64)
        host = [(space, rows, False)]
        entries = [e for _, e in stored]
        for e in entries:
            e.pins += 1
        self.pinned += len(entries)
        self.st.tracker.begin(host)
        idents = [(space, ep.ns, ep.slot, k) for k, _ in stored]

        def go(epoch: str | None) -> None:
            def done(j: L3Job) -> None:
                for e in entries:
                    e.pins -= 1
                self.pinned -= len(entries)
                self.st.tracker.end(host)
                if self.st.tracker.deferred:
                    self.st.release_ready()
                if not j.misses and epoch is not None:  # all in the store
                    for i in idents:
                        self._remember(i, True, epoch)

            if epoch is None:  # no epoch to name the objects under: nothing is written
                why = "epoch" if self.l3.online else "offline"
                self.st.metrics.inc("l3_errors", len(stored), why)
                done(L3Job("put", [], misses={why: len(stored)}))
                return
            job = L3Job("put", [self._key(ep, epoch, k) for k, _ in stored],
                        [{space: int(r)} for r in rows.tolist()], fmt=fmt)
            if self.gc is not None:
                self.puts_after_gc.add((ep.ns, epoch))
            self._submit(job, done)

        if not self.l3.online:  # connecting or offline: nothing is submitted (an epoch read
            go(None)  # now would fail and make the namespace's reads miss for ``FAILED_TTL``)
            return
        self.epochs.for_write(ep.ns, go)

    # ------------------------------------------------------------------ read-through
    def fetch(self, ep: "EnginePool", missing: list[tuple[int, str]],
              keep: set[tuple[str, str]]) -> list[int]:
        """Start reading ``missing`` (position, key) from L3; returns the positions now
        pending (the others are misses). ``keep``: the call's entries, never evicted for
        the rows this takes."""
        now = time.monotonic()
        epoch = self._read_epoch(ep.ns)
        pending: list[int] = []
        misses = 0
        todo: list[tuple[int, Ident]] = []
        asked: set[Ident] = set()
        unknown: dict[Ident, None] = {}
        stalled = "read" in self.l3.stalled()  # a storage node holds the prefetch worker: a
        # key the store holds is a miss now, no entry evicted for it, nothing remembered
        for j, k in missing:
            ident = (ep.space, ep.ns, ep.slot, k)
            if ident in self.fetching or ident in asked or ident in self.querying:
                pending.append(j)
                continue
            if epoch is None:
                pending.append(j)
                continue
            a = False if epoch is False else self._answer(ident, now, epoch)
            if a is False:
                misses += 1
            elif a and stalled:
                misses += 1
                self.st.metrics.inc("l3_errors", 1, "stalled")
            elif a is None:  # ask first: rows are taken (and entries evicted) only for objects
                unknown[ident] = None  # the store holds
                pending.append(j)
            else:
                asked.add(ident)
                todo.append((j, ident))
        if unknown and not self._query(ep, epoch, list(unknown)):  # too many in flight: misses
            gone = {j for j, k in missing if (ep.space, ep.ns, ep.slot, k) in unknown}
            misses += len(gone)
            pending = [j for j in pending if j not in gone]
        rows = self.store.take_rows(ep.space, len(todo), keep) if todo else []
        misses += len(todo) - len(rows)  # no room for these
        todo = todo[:len(rows)]
        if misses:
            self.st.metrics.inc("l3_pages", misses, "kv_miss")
        if not todo:
            return pending
        idents = [i for _, i in todo]
        self.fetching.update(idents)
        job = L3Job("prefetch", [self._key(ep, epoch, i[3]) for i in idents],
                    [{ep.space: r} for r in rows], time.monotonic() + READ_DEADLINE,
                    fmt=self.fmt(ep), each=True)

        def expire(j: L3Job, now: float, queued: bool) -> None:
            self._missed(self.fetching, idents, epoch)
            if queued:  # no call will write them: free now (``_fetched`` frees the rest)
                self._free(ep.space, rows)

        self._submit(job, lambda j: self._fetched(j, ep.pool, idents, rows, epoch), expire)
        return sorted(pending + [j for j, _ in todo])

    def _missed(self, inflight: set[Ident], idents: list[Ident], epoch: str) -> None:
        """A read of ``idents`` passed its deadline: they are no longer in flight, and misses
        for ``ABSENT_TTL`` (the client's next ask gets 0 at once)."""
        for ident in idents:
            inflight.discard(ident)
            self._remember(ident, False, epoch)

    def _free(self, space: str, rows: list[int]) -> None:
        """Give a read's store rows back, once: the list is emptied."""
        if rows:
            self.st.group.free({space: np.asarray(rows, dtype=np.int64)}, self.store.owner)
            rows.clear()

    def _fetched(self, job: L3Job, pool: str | None, idents: list[Ident], rows: list[int],
                 epoch: str) -> None:
        """A read-through prefetch ended: verified objects become entries, the rest free
        their rows and are remembered absent. Nothing is used unless ``epoch`` is still the
        namespace's, confirmed within the recheck interval (a clear meanwhile, here or by
        another daemon, replaced it): the client asks again. A prefetch answered at its
        deadline (``acked``: its keys are misses already, and may be fetched again since)
        only gives back the rows it still holds."""
        space, ns = idents[0][0], idents[0][1]
        if job.acked:
            self._free(space, rows)
            return
        stale = not self.epochs.fresh(ns, epoch)
        unrun = "stalled" in job.misses  # (answered unrun: says nothing of the store)
        present = job.present + [0] * (len(idents) - len(job.present))
        od = self.store.entries[space]
        free = []
        for ident, row, ok in zip(idents, rows, present):
            self.fetching.discard(ident)
            if stale or (unrun and not ok):
                free.append(row)
                continue
            if not ok:
                self._remember(ident, False, epoch)
                free.append(row)
                continue
            self._remember(ident, True, epoch)
            slot, eid = ident[2], (ns, ident[3])
            e = od.get(eid)
            if e is None:
                od[eid] = self.store.new_entry(row, slot)
                continue
            if slot not in e.slots:  # a put made the entry meanwhile, without this pool
                if pool is not None:
                    for t in self.st.group.pools[pool].layers:
                        t[e.row] = t[row]
                e.slots.add(slot)
            free.append(row)
        self.store.touch(space, [(ns, i[3]) for i in idents])  # the chain's head last
        self._free(space, free)

    def exists(self, ep: "EnginePool", missing: list[tuple[int, str]]) -> tuple[list[int],
                                                                                 list[int]]:
        """(positions present in L3, positions pending) of ``missing`` (position, key); the
        rest are absent. Unknown keys start one query job."""
        now = time.monotonic()
        epoch = self._read_epoch(ep.ns)
        present, pending, ask = [], [], {}
        for j, k in missing:
            ident = (ep.space, ep.ns, ep.slot, k)
            if epoch is False:
                continue
            a = None if epoch is None else self._answer(ident, now, epoch)
            if a is True:
                present.append(j)
            elif a is False:
                continue
            elif ident in self.querying or ident in self.fetching or epoch is None:
                pending.append(j)
            else:
                ask.setdefault(ident, j)
                pending.append(j)
        if ask and not self._query(ep, epoch, list(ask)):  # too many in flight: absent
            gone = {j for j, k in missing if (ep.space, ep.ns, ep.slot, k) in ask}
            pending = [j for j in pending if j not in gone]
        return present, pending

    def _query(self, ep: "EnginePool", epoch: str, idents: list[Ident]) -> bool:
        """One background exists query for ``idents`` (none already asked) under ``epoch``;
        False (nothing submitted, counted ``l3_errors{kind="busy"}``) with ``QUERIES_MAX``
        query jobs in flight."""
        if self.queries >= QUERIES_MAX:
            self.st.metrics.inc("l3_errors", len(idents), "busy")
            return False
        self.queries += 1
        self.querying.update(idents)
        job = L3Job("query", [self._key(ep, epoch, i[3]) for i in idents],
                    deadline=time.monotonic() + READ_DEADLINE, fmt=self.fmt(ep), each=True)
        self._submit(job, lambda j: self._queried(j, idents, epoch),
                     lambda j, now, queued: self._missed(self.querying, idents, epoch))
        return True

    def _queried(self, job: L3Job, idents: list[Ident], epoch: str) -> None:
        self.queries -= 1  # (the job has ended, whether or not it was acked at its deadline)
        if job.acked:  # answered at its deadline: its keys were misses (maybe asked again since)
            return
        answered = len(job.present) == len(idents)  # else the store could not say: ask again
        for n, ident in enumerate(idents):
            self.querying.discard(ident)
            if answered:  # (used only while ``epoch`` is the namespace's: ``_answer``)
                self._remember(ident, bool(job.present[n]), epoch)

    # ------------------------------------------------------------------ clear
    def check_clear(self) -> None:
        """Refuse (``busy``, nothing changed) a clear past ``CLEARS_MAX`` in flight."""
        if self.epochs.clears >= CLEARS_MAX:
            raise ProtocolError("busy", f"kv_clear: {self.epochs.clears} clears wait for the "
                                        "L3 master; retry when they are answered")

    def clear(self, ns: str, c: "ClientState", deadline_ms: int) -> int:
        """Write a new epoch for ``ns``; its op id. The ack (to ``c``) comes once the call
        returned (``kv: {dropped}``) or failed, or at the deadline with an error."""

        def done(job: L3Job, dropped: int | None) -> None:
            if job.acked:  # answered at its deadline (or a stop): a late success took effect
                if dropped is not None:
                    log.warning("kv_clear of a namespace took effect %s answered it failed",
                                "after the daemon's stop" if job.cancelled == "stopping" else
                                f"{time.monotonic() - job.deadline:.1f} s after its deadline")
                return
            ok = dropped is not None
            self.st.outbox.append((c, l3_ack(
                job.tag.op_id, "kv_clear", job, job.t_end,
                {"kv": {"dropped": dropped}} if ok else
                {"error": {"code": "l3_failed", "message": _clear_error(job, deadline_ms,
                                                                       False)}})))

        def expire(job: L3Job, now: float, queued: bool) -> None:  # (dropped if still queued)
            self.st.outbox.append((c, l3_ack(job.tag.op_id, "kv_clear", job, now, {
                "error": {"code": "l3_failed",
                          "message": _clear_error(job, deadline_ms, True)}})))

        return self.epochs.clear(ns, time.monotonic() + deadline_ms / 1000, done, expire)

    def _changed(self, ns: str, olds: list[str]) -> int:
        """``ns`` has a new epoch (cleared here or elsewhere): its host entries go (how many),
        and the objects of its older epochs are collected."""
        dropped = self.store.drop(ns)
        for old in olds:
            self._collect(ns, old)
        return dropped

    def _collect(self, ns: str, old: str) -> None:
        """Remove the objects of ``ns`` under ``old`` in the background: one queued remove job
        takes every old epoch collected before it starts (none is read again either way), as
        long as no write-through put under ``old`` was submitted after it (the write queue
        runs in order: a removal that joined it would run ahead of those puts, and objects they
        write under the epoch it collects would stay)."""
        regex = _regex_prefix(epoch_prefix(self.prefix, ns, old))
        if self.gc_waiting >= GC_MAX:
            if not self.gc_skipped:
                log.warning("L3: %d old key-store epochs wait for their removal; further ones "
                            "are left to Mooncake's eviction (never read again)", GC_MAX)
            self.gc_skipped += 1
            return
        self.gc_waiting += 1
        if self.gc is not None and (ns, old) not in self.puts_after_gc and \
                self.l3.extend_queued(self.gc, regex):
            return
        self.gc, self.puts_after_gc = L3Job("remove", [regex]), set()

        def done(j: L3Job) -> None:
            self.gc_waiting -= len(j.keys)  # (fixed once a worker took it)

        self._submit(self.gc, done)

    def summary(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "pinned": self.pinned, "jobs": self.jobs,
                "fetching": len(self.fetching), "querying": len(self.querying),
                "known": len(self.known), "queries": self.queries, **self.epochs.summary(),
                "gc_waiting": self.gc_waiting, "gc_skipped": self.gc_skipped}
