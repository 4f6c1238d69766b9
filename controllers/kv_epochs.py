"""Key-store namespaces' epochs, kept in L3: why a ``kv_clear`` holds across any restart.

Every L3 object of a key-store namespace is named under the namespace's current epoch
(``kv_l3.object_key``: ``<prefix>/<ns digest>/<epoch>/<slot digest>/<key>``). The epoch lives in
L3 itself, one small object per namespace under ``epoch_key(prefix, ns) = "<prefix>/<ns
digest>/epoch"`` holding ``MAGIC`` and 32 lowercase hex digits: a random 128-bit value, never
reused, stored hard-pinned (Mooncake never evicts it). ``kv_clear`` writes a new epoch (upsert)
before it answers; from then on every daemon that reads the epoch names other objects, so the
old ones are unreachable whatever becomes of their removal (background garbage collection,
``kv_l3``), across a restart at any address, a reboot or a crash. A namespace with no epoch
object (never used; the master restarted, which loses every object; removed by hand) gets a
fresh epoch from the first daemon that reads it: ``put`` keeps an existing object (the first
writer wins) and every reader reads the stored value back, so a lost epoch object costs cached
pages and never brings old ones back.

Contract:

* ``parse(raw) -> epoch`` (its 32 hex digits) or ``ValueError`` naming why (length, magic,
  digits): a stored value is compared with a pattern, never evaluated. ``encode(epoch)``;
  ``new_epoch()``.
* ``Epochs(submit, prefix, recheck, changed, forget)``: the server thread's view of each
  namespace's epoch (see the class). Its reads and writes are ``L3Job("meta")`` jobs, run in
  submission order on the L3 meta thread: a read returns the stored epoch, creating one when
  there is none; a clear upserts its new epoch and returns the one stored before. A stored
  value that does not parse fails the read with ``L3CallFailed("epoch", ...)``: one line naming
  the key and why, logged once per namespace and value, counted
  ``hicache_l3_errors_total{kind="epoch"}``; the namespace's L3 objects are then not used
  (reads miss, writes are dropped) until a read finds a well-formed epoch again (a
  ``kv_clear`` writes one).
"""
from __future__ import annotations

import hashlib
import logging
import re
import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Callable

from .l3_store import L3CallFailed, L3Job

log = logging.getLogger("hicache.l3")
MAGIC = b"hc-epoch1:"
EPOCH_DIGITS = 32
_VALUE = re.compile(rb"hc-epoch1:([0-9a-f]{32})")
EPOCHS_MAX = 65536  # namespaces whose epoch is kept; past it the least recently used idle go
FAILED_TTL = 1.0  # s: after a read that failed, the namespace's L3 reads miss this long
TOLD_MAX = 1024  # refusals remembered as logged (then forgotten: logged again, not grown)

Waiter = Callable[[str | None], None]
# submit(job, done, expire=None) -> op id: ``KvL3._submit``
Submit = Callable[..., int]


def ns_digest(ns: str) -> str:
    return hashlib.blake2b(ns.encode(), digest_size=16).hexdigest()


def epoch_key(prefix: str, ns: str) -> str:
    return f"{prefix}/{ns_digest(ns)}/epoch"


def new_epoch() -> str:
    return secrets.token_hex(EPOCH_DIGITS // 2)


def encode(epoch: str) -> bytes:
    return MAGIC + epoch.encode("ascii")


def parse(raw: bytes) -> str:
    """The epoch in a stored value, or ``ValueError`` saying why the value is not one."""
    want = len(MAGIC) + EPOCH_DIGITS
    if len(raw) != want:
        raise ValueError(f"holds {len(raw)} bytes, not the {want} of an epoch")
    m = _VALUE.fullmatch(raw)
    if m is None:
        what = "does not start with " + MAGIC.decode() if not raw.startswith(MAGIC) else \
            f"has no {EPOCH_DIGITS} lowercase hex digits after {MAGIC.decode()}"
        raise ValueError(what)
    return m.group(1).decode("ascii")


def _stored(l3: Any, key: str) -> str | None:
    """The epoch stored under ``key`` (None: no object); ``L3CallFailed("epoch")`` when the
    object is not an epoch."""
    try:
        raw = l3.get_small(key)
        if raw is None:
            return None
        return parse(raw)
    except ValueError as e:
        why = str(e)
    except L3CallFailed as e:
        if e.why != "corrupt":  # (too big to be one)
            raise
        why = e.message
    raise L3CallFailed("epoch", f"L3 epoch object {key} refused: it {why}")


def _read(key: str, fresh: str) -> Callable[[Any], tuple[str, bool]]:
    """The stored epoch, and whether this read made it (``fresh``: there was none)."""
    def call(l3: Any) -> tuple[str, bool]:
        got = _stored(l3, key)
        if got is None:  # none yet (or lost): ``fresh`` unless another writer came first
            l3.put_small(key, encode(fresh), replace=False)
            got = _stored(l3, key)
            if got is None:
                raise L3CallFailed("error", f"L3 epoch object {key} is not readable after "
                                            "it was written")
            return got, got == fresh
        return got, False
    return call


def _replace(key: str, new: str) -> Callable[[Any], str | None]:
    def call(l3: Any) -> str | None:
        try:
            old = _stored(l3, key)
        except L3CallFailed as e:  # a value that is no epoch names no objects to collect
            if e.why != "epoch":
                raise
            old = None
        l3.put_small(key, encode(new), replace=True)
        return old
    return call


@dataclass
class _Ns:
    epoch: str | None = None  # the epoch in use; None: none known yet
    checked: float = float("-inf")  # submit time of the read or clear that last confirmed it
    reading: bool = False
    bad: str = ""  # why the last read refused the stored value ("" = it was an epoch)
    failed: float = float("-inf")  # when the last read failed otherwise
    clears: int = 0  # this daemon's clears of the namespace in flight
    waiting: list[Waiter] = field(default_factory=list)  # writes waiting for a first epoch
    # host entries were made while no epoch was known: no later read can tell whether another
    # daemon's clear came before or after them
    unanchored: bool = False


class Epochs:
    """What this daemon knows of each namespace's epoch, and when it learnt it.

    * ``for_read(ns)``: the epoch to read L3 objects of ``ns`` under, when the read (or clear)
      that confirmed it was *submitted* at most ``recheck`` seconds ago; None when it must be
      read first (a read is started: answer the keys pending); False when L3 must not be read
      for ``ns`` now (its stored value was refused, or the last read failed, or found no answer
      within ``read_deadline``, less than ``FAILED_TTL`` ago: answer misses).
    * ``for_write(ns, fn)``: ``fn(epoch)`` now when any epoch is known (one older than
      ``recheck`` starts a read: the write goes under the epoch the daemon knows, and objects
      it writes under an epoch already replaced are never read by a daemon that saw the
      replacement); else once the read ends, ``fn(None)`` when there is no usable epoch.
    * ``fresh(ns, epoch)``: whether ``epoch`` is still the namespace's, confirmed within
      ``recheck``: a read's result is used only then.
    * ``touch(ns)``: start a read when none is known or the one known is older than
      ``recheck`` (host hits: so a clear elsewhere is noticed while a namespace is used).
    * ``clear(ns, deadline, done, expire) -> op id``: upsert a new epoch; ``done(job,
      dropped)`` once the call returned (``dropped``: what ``changed`` returned; None when
      the job failed); ``expire`` is the job's deadline hook (``DaemonState.expire_l3``).
      Writes waiting for a first epoch when the clear succeeds were made while it was in
      flight (their host entries are among those dropped): they go under the epoch the clear
      replaced (``fn(old)``, before its objects' removal is queued), or are dropped
      (``fn(None)``) when there was none; never under the new epoch.
    * ``entries_made(ns)``: host entries of ``ns`` were just made (a put). Made while no epoch
      is known, they are *unanchored*: a clear by another daemon may come before or after
      them, and no read can tell which. So the first read that finds an epoch this daemon did
      not make itself drops them (``changed(ns, [])``) and drops the writes waiting for it
      (``fn(None)``): a page put before another daemon's clear is never served or written
      under the new epoch after it. A first read that made the epoch (there was none, so no
      clear came before) keeps them.
    * A read that finds another epoch than the one known, and every successful clear, call
      ``changed(ns, old epochs) -> host entries dropped`` before anything else of the
      namespace happens; ``forget(ns)`` is called for a namespace whose idle entry goes (past
      ``EPOCHS_MAX`` namespaces), since a change could no longer be noticed.
    """

    def __init__(self, submit: Submit, prefix: str, recheck: float, read_deadline: float,
                 changed: Callable[[str, list[str]], int],
                 forget: Callable[[str], None]) -> None:
        self._submit, self.prefix, self.recheck = submit, prefix, recheck
        self.read_deadline = read_deadline
        self._changed, self._forget = changed, forget
        self.ns: OrderedDict[str, _Ns] = OrderedDict()
        self._told: set[tuple[str, str]] = set()  # (ns, refusal) logged already
        self.reads = 0  # reads in flight
        self.clears = 0  # clears in flight

    # ------------------------------------------------------------------ queries
    def _entry(self, ns: str) -> _Ns:
        e = self.ns.get(ns)
        if e is None:
            e = self.ns[ns] = _Ns()
            self._trim()
        self.ns.move_to_end(ns)
        return e

    def _trim(self) -> None:
        """Past ``EPOCHS_MAX`` namespaces, the least recently used idle ones go; never the
        newest (the one ``_entry`` just made), so with every older one busy there may be more
        for a while."""
        if len(self.ns) <= EPOCHS_MAX:
            return
        for ns, e in list(self.ns.items())[:-1]:
            if len(self.ns) <= EPOCHS_MAX:
                return
            if not (e.reading or e.clears or e.waiting):
                del self.ns[ns]
                self._forget(ns)

    def current(self, ns: str) -> str | None:
        e = self.ns.get(ns)
        return None if e is None or e.bad else e.epoch

    def fresh(self, ns: str, epoch: str, now: float | None = None) -> bool:
        e = self.ns.get(ns)
        now = time.monotonic() if now is None else now
        return e is not None and not e.bad and e.epoch == epoch and \
            now - e.checked <= self.recheck

    def for_read(self, ns: str) -> str | None | bool:
        now = time.monotonic()
        e = self._entry(ns)
        if e.bad and now - e.checked <= self.recheck:
            return False
        if e.epoch is not None and not e.bad and now - e.checked <= self.recheck:
            return e.epoch
        if not e.reading and now - e.failed <= FAILED_TTL:
            return False
        self._read(ns, e)
        return None

    def for_write(self, ns: str, fn: Waiter) -> None:
        e = self._entry(ns)
        self.touch(ns)
        if e.reading and (e.epoch is None or e.bad):
            e.waiting.append(fn)
        else:
            fn(None if e.bad else e.epoch)

    def entries_made(self, ns: str) -> None:
        e = self._entry(ns)
        if e.epoch is None:
            e.unanchored = True

    def touch(self, ns: str) -> None:
        now = time.monotonic()
        e = self._entry(ns)
        if now - e.checked > self.recheck and now - e.failed > FAILED_TTL:
            self._read(ns, e)

    # ------------------------------------------------------------------ reads
    def _read(self, ns: str, e: _Ns) -> None:
        if e.reading:
            return
        e.reading = True
        self.reads += 1
        key = epoch_key(self.prefix, ns)
        job = L3Job("meta", [key], deadline=time.monotonic() + self.read_deadline,
                    call=_read(key, new_epoch()))
        self._submit(job, lambda j: self._read_done(ns, j),
                     lambda j, now, queued: self._read_failed(ns))

    def _read_failed(self, ns: str) -> None:
        """A read failed, or passed its deadline (its late answer is not used): the
        namespace's L3 reads miss for ``FAILED_TTL``, and writes waiting for it are dropped."""
        e = self._entry(ns)
        e.reading = False
        e.failed = time.monotonic()
        self._wake(e, None)

    def _read_done(self, ns: str, job: L3Job) -> None:
        self.reads -= 1
        if job.acked:  # answered (as failed) at its deadline
            return
        e = self._entry(ns)
        if job.misses and "epoch" not in job.misses:
            self._read_failed(ns)
            return
        e.reading = False
        if job.misses:
            e.bad, e.checked = job.error, job.t_submit
            if (ns, job.error) not in self._told:
                if len(self._told) >= TOLD_MAX:
                    self._told.clear()
                self._told.add((ns, job.error))
                log.error("%s: the namespace's L3 objects are not used until a kv_clear "
                          "writes a new epoch", job.error)
            self._wake(e, None)
            return
        got, made = job.value
        if e.epoch is not None and got != e.epoch:  # cleared elsewhere (or the object lost)
            self._changed(ns, [e.epoch])
        unanchored, e.unanchored = e.unanchored and e.epoch is None and not made, False
        if unanchored:  # entries and writes made before any epoch was known (see the class)
            self._changed(ns, [])
        e.epoch, e.checked, e.bad = got, job.t_submit, ""
        self._wake(e, None if unanchored else got)

    @staticmethod
    def _wake(e: _Ns, epoch: str | None) -> None:
        waiting, e.waiting = e.waiting, []
        for fn in waiting:
            fn(epoch)

    # ------------------------------------------------------------------ clear
    def clear(self, ns: str, deadline: float, done: Callable[[L3Job, int | None], None],
              expire: Callable[[L3Job, float, bool], None]) -> int:
        e = self._entry(ns)
        e.clears += 1
        self.clears += 1
        new = new_epoch()
        key = epoch_key(self.prefix, ns)
        job = L3Job("meta", [key], deadline=deadline, call=_replace(key, new))

        def ended(j: L3Job) -> None:
            self.clears -= 1
            f = self._entry(ns)
            f.clears -= 1
            if j.misses:
                done(j, None)
                return
            # writes still waiting for a first epoch were made while this clear was in
            # flight: their host entries are dropped below, so their objects go under the epoch
            # the clear replaced (None: there was none, and they are dropped), ahead of that
            # epoch's removal, never under the new one (where a later read would find them)
            self._wake(f, j.value if j.value != new else None)
            olds = [x for x in dict.fromkeys((f.epoch, j.value)) if x is not None and x != new]
            dropped = self._changed(ns, olds)
            f.epoch, f.checked, f.bad, f.unanchored = new, j.t_submit, "", False
            done(j, dropped)

        return self._submit(job, ended, expire)

    def summary(self) -> dict[str, int]:
        return {"epochs": len(self.ns), "epoch_reads": self.reads, "clears": self.clears}
