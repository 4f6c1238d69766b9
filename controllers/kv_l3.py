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
* ``object_key(prefix, ns, slot, key) = "<prefix>/<ns digest>/<slot digest>/<key>"`` with
  ``prefix = kv_prefix(objects) = "hc2/<model>/<layout fingerprint>/kv/pp<r>of<n>"``: the
  namespace is the key store's own (CURVE key name + the client's namespace), digested, so
  two namespaces never name the same object, and a namespace's objects share one key prefix
  (``kv_clear`` removes them by regex).

Write-through (``write``): the entries a ``kv_put`` filled go out as one put job. Their rows
are pinned until it completes: ``Entry.pins`` (eviction skips pinned entries) and the row
tracker (a ``kv_clear`` meanwhile defers the free until the job ends). A put completion is
recorded in the L3 metrics like any other (written / skipped_existing / errors).

Read-through, never blocking the server thread (every L3 call runs on the L3 worker threads):

* ``fetch`` (``kv_get`` of keys the host store lacks): a key not known to be in the store is
  first asked about (as ``exists`` does) and answered *pending*, so rows are taken (and
  entries evicted) only for objects the store holds; for keys known present it allocates
  fresh store rows (LRU eviction as a put does; keys that find no row report 0), starts one
  prefetch job and answers those keys *pending*. When the job completes, each object whose header, length and
  checksum verify becomes an entry (or fills that slot of an entry a put made meanwhile);
  the others free their rows and are remembered absent for ``ABSENT_TTL`` seconds, so the
  client's retry gets 0, never bytes. Every key a ``kv_get`` answers 0 after consulting L3
  (known absent or corrupt, offline, no row free) counts in ``l3_pages{result="kv_miss"}``.
* ``exists`` (``kv_exists``) answers from what the daemon knows: entries, objects it wrote
  or saw (present for ``PRESENT_TTL`` s), objects found absent (``ABSENT_TTL`` s). An unknown
  key starts one asynchronous query and is answered *pending*; the client asks again.
* While the tier connects, unknown keys are pending (nothing is submitted); while it is
  offline they are misses at once, and so are a namespace's keys while ``clear`` removes its
  objects (a read then could bring cleared pages back).

Clear (``kv_clear``): reads of the namespace in flight drop their result (its generation
moves on), answers remembered before the clear are forgotten, and its objects are removed by one
``remove_by_regex`` on its prefix. The namespaces whose removal has not run yet are also kept
on disk (``kv_clears.ClearJournal``, in the first shared-memory folder): a daemon that stops or
is killed first leaves them there, and the next one with the same L3 master, key prefix and
address clears them again when its key store starts, before it serves their keys. Bounded
whatever a client sends: a namespace's generation is kept only while a put or prefetch of it
is in flight, clear times only for ``PRESENT_TTL`` seconds (older answers have expired anyway),
and every namespace cleared while a remove job waits in the write queue joins that job (unless a put of it is in flight: the put, queued after
the job, would outlive it). With ``REMOVING_MAX`` namespaces waiting, a clear of one more is
refused ``busy`` before anything changes.

A job's bookkeeping (``_Tag``) is finished by ``DaemonState.finish_l3`` on the server thread.
"""
from __future__ import annotations

import hashlib
import time
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Callable

import numpy as np

from . import l3_format as F
from hicache.core.protocol import ProtocolError

from .kv_clears import ClearJournal
from .l3_store import L3Job

if TYPE_CHECKING:  # kv_store imports this module: its types are named, not imported
    from .kv_regions import EnginePool
    from .state import DaemonState

PRESENT_TTL = 30.0  # s: an object written or seen is reported present this long
ABSENT_TTL = 2.0  # s: an object found absent or corrupt is a miss this long
FETCH_DEADLINE = 10.0  # s: a read-through prefetch stops at the first batch past it
KNOWN_MAX = 1 << 18  # remembered (entry, slot) answers, oldest dropped first
REMOVING_MAX = 4096  # namespaces waiting for their L3 removal; a clear past it is refused
_REGEX_SPECIAL = set(".^$|?*+()[]{}\\")

Ident = tuple[str, str, str, str]  # (space, namespace, slot, key)


def kv_prefix(full_ns: str) -> str:
    """``hc2/<model>/<fingerprint>/kv/pp<r>of<n>`` from the stage's full-mirror namespace
    (``l3_format.namespace(layout)``): the key-store objects of this stage."""
    head, _, pp = full_ns.rsplit("/", 2)
    return f"{head}/kv/{pp}"


def _digest(s: str, n: int) -> str:
    return hashlib.blake2b(s.encode(), digest_size=n).hexdigest()


def ns_prefix(prefix: str, ns: str) -> str:
    return f"{prefix}/{_digest(ns, 16)}/"


def object_key(prefix: str, ns: str, slot: str, key: str) -> str:
    return f"{ns_prefix(prefix, ns)}{_digest(slot, 8)}/{key}"


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


@dataclass
class _Tag:
    """``L3Job.tag`` of the key store's jobs: ``DaemonState.finish_l3`` calls ``done(job)``."""

    op_id: int
    done: Callable[[L3Job], None]


class KvL3:
    """The key store's bridge to the daemon's ``MooncakeL3`` (see the module docstring)."""

    def __init__(self, st: "DaemonState", store: Any) -> None:
        self.st, self.store, self.l3 = st, store, st.l3
        self.prefix = kv_prefix(self.l3.objects.ns["full"])
        self.formats: dict[str, Any] = {}
        self.known: OrderedDict[Ident, tuple[bool, float]] = OrderedDict()
        self.fetching: set[Ident] = set()
        self.querying: set[Ident] = set()
        # namespace -> its puts and prefetches in flight, and -> the kv_clears since the
        # oldest of them began (an entry only while a job of that namespace is in flight)
        self.inflight: dict[str, int] = {}
        self.generation: dict[str, int] = {}
        self.cleared_at: OrderedDict[str, float] = OrderedDict()  # the last PRESENT_TTL s
        self.removing: dict[str, int] = {}  # namespace -> its removals in flight (no reads)
        self.retry: list[str] = []  # namespaces whose removal did not run or failed
        self.removal: L3Job | None = None  # the last remove job submitted
        self.removal_ns: list[str] = []  # ... and the namespaces it removes
        self.pinned = 0
        self.jobs = 0  # the key store's L3 jobs in flight
        # ``removing`` on disk: clears a daemon stopped (or killed) before it removed them
        self.journal = ClearJournal(st.shm_dirs[0], f"{self.l3.settings.master}|{self.prefix}|"
                                                    f"{st.address}")
        self._loading = True  # the file holds them already: no write per namespace
        for ns in self.journal.load():
            self.clear(ns)
        self._loading = False

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

    def _key(self, ep: "EnginePool", key: str) -> str:
        return object_key(self.prefix, ep.ns, ep.slot, key)

    def _submit(self, job: L3Job, done: Callable[[L3Job], None]) -> None:
        op_id = self.st.next_op_id()

        def ended(j: L3Job) -> None:
            self.jobs -= 1
            done(j)

        job.tag = _Tag(op_id, ended)
        self.st.l3_ops[op_id] = job
        self.jobs += 1
        self.l3.submit(job)

    def _remember(self, ident: Ident, present: bool) -> None:
        self.known[ident] = (present, time.monotonic())
        self.known.move_to_end(ident)
        while len(self.known) > KNOWN_MAX:
            self.known.popitem(last=False)

    def _answer(self, ident: Ident, now: float) -> bool | None:
        """What the daemon knows of an object now: present, absent, or None (ask the store)."""
        k = self.known.get(ident)
        if k is None:
            return None
        present, t = k
        if now - t <= (PRESENT_TTL if present else ABSENT_TTL) \
                and t > self.cleared_at.get(ident[1], -1.0):
            return present
        del self.known[ident]
        return None

    def _begin(self, ns: str) -> int:
        """A put or prefetch of ``ns`` starts: the generation its result is checked against."""
        self.inflight[ns] = self.inflight.get(ns, 0) + 1
        return self.generation.get(ns, 0)

    def _end(self, ns: str) -> None:
        """A put or prefetch of ``ns`` ended: the last one forgets the namespace."""
        self.inflight[ns] -= 1
        if not self.inflight[ns]:
            del self.inflight[ns]
            self.generation.pop(ns, None)

    def _unknown_is_pending(self, ns: str) -> bool | None:
        """True: ask the store; None: still connecting (pending, nothing asked); False: offline
        or the namespace's objects are being removed (a miss)."""
        if ns in self.removing:
            return False
        if self.l3.online:
            return True
        return None if self.l3.state == "connecting" else False

    # ------------------------------------------------------------------ write-through
    def write(self, ep: "EnginePool", stored: list[tuple[str, Any]]) -> None:
        """Write the slot ``ep.slot`` of these freshly filled entries (``(key, entry)``) to L3;
        their rows stay pinned until the job completes."""
        if not stored:
            return
        space = ep.space
        rows = np.asarray([e.row for _, e in stored], dtype=np.int64)
        host = [(space, rows, False)]
        entries = [e for _, e in stored]
        for e in entries:
            e.pins += 1
        self.pinned += len(entries)
        self.st.tracker.begin(host)
        idents = [(space, ep.ns, ep.slot, k) for k, _ in stored]
        gen = self._begin(ep.ns)
        job = L3Job("put", [self._key(ep, k) for k, _ in stored],
                    [{space: int(r)} for r in rows.tolist()], fmt=self.fmt(ep))

        def done(j: L3Job) -> None:
            for e in entries:
                e.pins -= 1
            self.pinned -= len(entries)
            self.st.tracker.end(host)
            if self.st.tracker.deferred:
                self.st.release_ready()
            if not j.misses and self.generation.get(ep.ns, 0) == gen:  # all in the store
                for i in idents:
                    self._remember(i, True)
            self._end(ep.ns)

        self._submit(job, done)

    # ------------------------------------------------------------------ read-through
    def fetch(self, ep: "EnginePool", missing: list[tuple[int, str]],
              keep: set[tuple[str, str]]) -> list[int]:
        """Start reading ``missing`` (position, key) from L3; returns the positions now
        pending (the others are misses). ``keep``: the call's entries, never evicted for
        the rows this takes."""
        now = time.monotonic()
        mode = self._unknown_is_pending(ep.ns)
        pending: list[int] = []
        misses = 0
        todo: list[tuple[int, Ident]] = []
        asked: set[Ident] = set()
        unknown: dict[Ident, None] = {}
        for j, k in missing:
            ident = (ep.space, ep.ns, ep.slot, k)
            a = self._answer(ident, now)
            if ident in self.fetching or ident in asked or ident in self.querying:
                pending.append(j)
            elif mode is False or a is False:
                misses += 1
            elif mode is None:
                pending.append(j)
            elif a is None:  # ask first: rows are taken (and entries evicted) only for objects
                unknown[ident] = None  # the store holds
                pending.append(j)
            else:
                asked.add(ident)
                todo.append((j, ident))
        if unknown:
            self._query(ep, list(unknown))
        rows = self.store.take_rows(ep.space, len(todo), keep) if todo else []
        misses += len(todo) - len(rows)  # no room for these
        todo = todo[:len(rows)]
        if misses:
            self.st.metrics.inc("l3_pages", misses, "kv_miss")
        if not todo:
            return pending
        idents = [i for _, i in todo]
        self.fetching.update(idents)
        gen = self._begin(ep.ns)
        job = L3Job("prefetch", [self._key(ep, i[3]) for i in idents],
                    [{ep.space: r} for r in rows], time.monotonic() + FETCH_DEADLINE,
                    fmt=self.fmt(ep), each=True)
        self._submit(job, lambda j: self._fetched(j, ep.pool, idents, rows, gen))
        return sorted(pending + [j for j, _ in todo])

    def _fetched(self, job: L3Job, pool: str | None, idents: list[Ident], rows: list[int],
                 gen: int) -> None:
        """A read-through prefetch ended: verified objects become entries, the rest free
        their rows and are remembered absent."""
        space, ns = idents[0][0], idents[0][1]
        cleared = self.generation.get(ns, 0) != gen
        present = job.present + [0] * (len(idents) - len(job.present))
        od = self.store.entries[space]
        free = []
        for ident, row, ok in zip(idents, rows, present):
            self.fetching.discard(ident)
            if cleared:
                free.append(row)
                continue
            if not ok:
                self._remember(ident, False)
                free.append(row)
                continue
            self._remember(ident, True)
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
        if free:
            self.st.group.free({space: np.asarray(free, dtype=np.int64)}, self.store.owner)
        self._end(ns)

    def exists(self, ep: "EnginePool", missing: list[tuple[int, str]]) -> tuple[list[int],
                                                                                 list[int]]:
        """(positions present in L3, positions pending) of ``missing`` (position, key); the
        rest are absent. Unknown keys start one query job."""
        now = time.monotonic()
        mode = self._unknown_is_pending(ep.ns)
        present, pending, ask = [], [], {}
        for j, k in missing:
            ident = (ep.space, ep.ns, ep.slot, k)
            a = self._answer(ident, now)
            if a is True:
                present.append(j)
            elif a is False:
                continue
            elif ident in self.querying or ident in self.fetching or mode is None:
                pending.append(j)
            elif mode:
                ask.setdefault(ident, j)
                pending.append(j)
        if ask:
            self._query(ep, list(ask))
        return present, pending

    def _query(self, ep: "EnginePool", idents: list[Ident]) -> None:
        """One background exists query for ``idents`` (none already asked)."""
        self.querying.update(idents)
        job = L3Job("query", [self._key(ep, i[3]) for i in idents], fmt=self.fmt(ep), each=True)
        t0 = time.monotonic()
        self._submit(job, lambda j: self._queried(j, idents, t0))

    def _queried(self, job: L3Job, idents: list[Ident], t0: float) -> None:
        answered = len(job.present) == len(idents)  # else the store could not say: ask again
        if self.cleared_at.get(idents[0][1], -1.0) >= t0:
            answered = False  # a kv_clear came meanwhile: the answer may predate the removal
        for n, ident in enumerate(idents):
            self.querying.discard(ident)
            if answered:
                self._remember(ident, bool(job.present[n]))

    # ------------------------------------------------------------------ clear
    def check_clear(self, ns: str) -> None:
        """Refuse (``busy``, nothing changed) a clear that would queue one namespace too many
        for removal while the L3 write thread is behind."""
        if ns in self.removing or len(self.removing) < REMOVING_MAX:
            return
        raise ProtocolError("busy", f"kv_clear: {len(self.removing)} namespaces wait for their "
                                    "L3 removal; retry when they are done")

    def _joins(self, ns: str) -> bool:
        """Whether ``ns``'s removal can ride on the queued remove job: no worker took it yet,
        and no put of ``ns`` is in flight (a put queued after it would outlive it)."""
        job = self.removal
        return job is not None and not job.started and ns not in self.inflight

    def clear(self, ns: str) -> None:
        """Forget ``ns`` (reads in flight drop their result, remembered answers go) and remove
        its objects: one queued remove job takes every namespace cleared before it starts."""
        now = time.monotonic()
        if ns in self.inflight:
            self.generation[ns] = self.generation.get(ns, 0) + 1
        self.cleared_at[ns] = now
        self.cleared_at.move_to_end(ns)
        while self.cleared_at and now - next(iter(self.cleared_at.values())) > PRESENT_TTL:
            self.cleared_at.popitem(last=False)  # every answer older than this has expired
        regex = _regex_prefix(ns_prefix(self.prefix, ns))
        if self._joins(ns):
            if ns in self.removal_ns or self.l3.extend_queued(self.removal, regex):
                if ns not in self.removal_ns:
                    self.removal_ns.append(ns)
                    self.removing[ns] = self.removing.get(ns, 0) + 1
                    self._journal()
                return
        self.removal, self.removal_ns = L3Job("remove", [regex]), [ns]
        self.removing[ns] = self.removing.get(ns, 0) + 1
        names = self.removal_ns

        def done(j: L3Job) -> None:
            # not run (offline, stopping) or a regex's call failed: its objects may all still
            # be there. The namespace stays ``removing`` (its reads miss) and the removal goes
            # again once the tier is online (``retry_removals``): a clear is an invalidation
            for n in names:
                if j.misses:
                    if n not in self.retry:
                        self.retry.append(n)
                    continue
                self.removing[n] -= 1
                if not self.removing[n]:
                    del self.removing[n]
            self._journal()

        self._journal()
        self._submit(self.removal, done)

    def _journal(self) -> None:
        """The namespaces waiting for their removal, to disk (``kv_clears``)."""
        if not self._loading:
            self.journal.save(self.removing)

    def retry_removals(self) -> None:
        """Queue again the removals that did not run or failed, once the tier is online (the
        server's housekeeping calls it)."""
        if not self.retry or not self.l3.online:
            return
        names, self.retry = self.retry, []
        for n in names:
            self.removing[n] -= 1  # this removal is over; ``clear`` counts the next one
            if not self.removing[n]:
                del self.removing[n]
            self.clear(n)

    def summary(self) -> dict[str, Any]:
        return {"prefix": self.prefix, "pinned": self.pinned, "jobs": self.jobs,
                "fetching": len(self.fetching),
                "querying": len(self.querying), "known": len(self.known),
                "removing": len(self.removing), "namespaces_in_flight": len(self.inflight),
                "namespaces_cleared": len(self.cleared_at)}
