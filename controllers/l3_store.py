"""The daemon's Mooncake Store client: connection, online state, and the calls that move pages.

Contract of ``MooncakeL3(settings, arena, objects, metrics, wake)`` (``objects``: the
``l3_format.Objects`` of this stage — one ``ObjectFormat`` per object kind):

* ``load_store_class()`` imports the Mooncake client or raises ``UsageError`` with one line
  naming what to install (the daemon refuses ``--l3 mooncake`` at start without it).
* A connector thread runs ``setup`` against the master and the metadata server, registers the
  whole host arena and two header slabs for zero-copy transfers, and marks the tier online;
  the first ``setup`` logs the addresses Mooncake opened listeners on (loopback when the
  daemon runs under the bind shim: ``hicache serve`` arranges it, docs/l3.md).
  Before each ``setup`` it checks, without holding the GIL (``l3_reach``), that both accept a
  TCP connection, that an HTTP metadata URL answers as Mooncake's metadata server does, and that
  Mooncake's ``setup`` succeeds in a child process (``setup_check``; a stand-in store passes
  None): Mooncake's ``setup`` holds the GIL while it retries (2 s for a wrong metadata URL, 30 s
  for a hung master, ~90 s for one that is down), which would stop the whole daemon. A server
  that is down is tried again with the probe's backoff; a failed metadata or set-up check
  every ``SETUP_RETRY_S``, logged with its cause (Mooncake's last error line). A failed
  attempt marks the tier offline (state ``connecting`` only until then);
  the first one counts as a transition to offline (``l3_transitions``), as a later drop does.
  When a call reports the master unreachable (RPC failure or timeout, client unknown) the tier
  goes offline: no Mooncake call is made for jobs meanwhile (``submit`` completes them at once
  as misses or dropped writes, counted ``offline``), and a probe retries with backoff (0.25 s
  doubling to ``max_backoff``) until the master answers again. Mooncake's own client re-mounts
  its segments when the master returns; the probe sees it within ``max_backoff`` seconds. While
  online, the connector also checks every ``LIVENESS_S``: when no Mooncake call ran meanwhile,
  that the master does not refuse a TCP connection (``master_gone``), so a master that dies
  while the tier is idle takes it offline within a few seconds; when a job's calls have run
  ``HUNG_CALL_S``, that the master answers a probe within ``PROBE_WAIT_S`` (or that call ends
  meanwhile), so a master that hangs (accepts, never answers: its calls would wait out
  Mooncake's RPC timeout, ~30 s) takes it offline within ~4-6 s (``hung()`` then says a call
  or a probe waits on it). Probes run on a thread of their own (``_ask``), one at a time: a hung
  master holds the connector (and a stop) at most ``PROBE_WAIT_S``. A job whose call raises
  anything is counted ``misses["error"]`` and acked, and its worker goes on with the next; a
  connect or probe that raises anything is a failed attempt, retried.
* ``submit(job)`` queues a job (``L3Job``, whose ``fmt`` says what one object holds: a
  full-mirror page, a checkpoints-mirror page, a checkpoint, or a key-store entry's pool,
  ``kv_l3``): queries (the master alone answers them) on one worker thread, prefetches (data
  from the storage nodes) on another, writes (put, remove: every object whose key matches a
  regex) on a third, and ``meta`` jobs on a fourth, each in submission order, so a long write
  never delays a prefix lookup, a prefetch never delays a query, and none delays a small
  metadata call. A prefetch with ``each`` goes on past a missing or corrupt object. A
  ``meta`` job runs ``job.call(self)``, which uses ``get_small`` / ``put_small`` (objects of at
  most ``SMALL_BYTES``, kept hard-pinned: Mooncake never evicts them; the key store's epochs,
  ``kv_epochs``) and leaves its result in ``job.value``; either raises ``L3CallFailed(why,
  message)``, which the worker records as ``misses[why]`` and ``job.error``.
  ``extend_queued(job, key)`` adds a regex to a queued remove job until a worker takes it;
  ``cancel(job, why)`` marks a job ``cancelled`` and says whether no worker had taken it (then
  it completes unrun: no Mooncake call touches its rows). A
  finished job is appended to ``completed`` and ``wake()`` is called; the daemon's server
  thread takes it from there (``take_completed``). Workers touch only the arena rows of their
  job, which the server thread keeps marked in flight until then.
* A storage node that hangs (the master answering) holds a call that moves data from or to
  it (``_call(..., data=True)``: a prefetch's or a put's batch, a key-store epoch's
  ``get_small`` / ``put_small``) up to Mooncake's own timeout. When the liveness check finds
  such a call past ``HUNG_CALL_S`` while the master answers its probe, that worker's queue
  (``read``, ``write`` or ``meta``) is *stalled* (``stalled()``, the ``l3_stalled{queue}``
  gauge, logged): its queued jobs, and every job submitted to it until the call returns,
  complete at once unrun (``misses["stalled"]``; a job already cancelled keeps its own
  reason) instead of waiting behind it. The call's return ends the stall. A call the master
  alone answers (an existence check, a remove) never stalls a queue, however long it takes.
* Batches are at most ``BATCH_PAGES`` objects, and one Mooncake call carries at most
  ``SLICES_PER_CALL`` buffers (a full DSV4-Flash page is 149: 6 pages per call). Reads and
  writes go straight between the arena and the store (``batch_get_into_multi_buffers`` /
  ``batch_put_from_multi_buffers``: the header from a registered slab, the object from its
  arena rows). Puts skip keys that exist.
* A job marked ``cancelled`` (a read of a client that was reaped), and every job still queued
  once ``drain()`` was called (the daemon is stopping), completes unrun when a worker takes it
  (``misses[why]``, not counted as errors): a stop does not wait for a backlog of writes, nor
  a reap for its reads.
* ``close()`` stops the threads (waiting up to ``timeout`` in all) and closes the store, unless
  a Mooncake call still runs (then the client stays open under it until the process exits).
"""
from __future__ import annotations

import collections
import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Any, Callable

import numpy as np

from hicache.core.errors import UsageError
from hicache.core.sizes import format_bytes

from . import l3_format as F
from .l3_reach import master_gone, metadata_wrong, setup_fails, unreachable
from .metrics import L3_STALLABLE, Metrics

log = logging.getLogger("hicache.l3")
BATCH_PAGES = 128
# Mooncake's TCP transport queues at most 1024 transfers per peer (plus 1024 awaiting admission)
# and fails a batch that overflows them: one call carries at most this many buffers.
SLICES_PER_CALL = 1024
MISS_CODES = (-704, -703, -710, -712)  # not found, replica not ready / gone
OFFLINE_CODES = (-900, -901, -103, -601)  # RPC failed / timed out, client unknown to the master
SMALL_BYTES = 64  # the largest object ``get_small`` reads
# no space (-200: no segment can hold it, e.g. none mounted yet): Mooncake's eviction will make
# room, or a segment mounts; a skipped write
FULL_CODES = (-10, -101, -200, -1700)
EXISTS = -705
INSTALL_HINT = ("--l3 mooncake needs the Mooncake client: pip install 'hicache[l3]' "
                "(mooncake-transfer-engine-non-cuda==0.3.13.post1) and the system library "
                "libibverbs1 (apt-get install libibverbs1)")


def load_store_class() -> Any:
    try:
        from mooncake.store import MooncakeDistributedStore
    except ImportError as e:
        raise UsageError(f"{INSTALL_HINT}; import failed: {str(e)[:160]}") from None
    return MooncakeDistributedStore


@dataclass(frozen=True)
class L3Settings:
    master: str  # HOST:PORT of mooncake_master
    metadata: str  # http://HOST:PORT/metadata, or P2PHANDSHAKE
    protocol: str = "tcp"  # tcp | rdma
    rdma_devices: str = ""
    local_host: str = "127.0.0.1"  # the address this client advertises to its peers
    segment_bytes: int = 0  # memory this daemon contributes to the store (0 = none)
    buffer_bytes: int = 16 << 20  # Mooncake's local transfer buffer
    max_backoff: float = 2.0
    kv_epoch_recheck: float = 2.0  # s: the key store reads under an epoch this long (kv_epochs)


def l3_settings(cfg: Any) -> L3Settings:
    """The store client's settings from a ``ServeConfig`` (``--l3-*``)."""
    return L3Settings(cfg.l3_master, cfg.l3_metadata, cfg.l3_protocol, cfg.l3_rdma_devices,
                      cfg.l3_local_host, cfg.l3_segment, kv_epoch_recheck=cfg.l3_epoch_recheck)


def endpoints_note(s: L3Settings) -> tuple[bool, str]:
    """``serve --check``: (True, what answers) when the master and the metadata server accept a
    connection and an HTTP metadata URL is Mooncake's metadata server (``l3_reach``), else
    (False, why not): a daemon would then start with the tier offline and retry."""
    why = unreachable(s) or metadata_wrong(s)
    if why is not None:
        return False, why
    return True, f"the master at {s.master} and the metadata server at {s.metadata} answer"


# while online, the master is checked this often (``l3_reach.master_gone``): a daemon with no
# L3 traffic used to report the tier online for as long as it stayed idle after the master died
# (the first call found out)
LIVENESS_S = 2.0
# once one Mooncake call of a job has run this long, the connector asks the master whether it
# still answers (``_ask``): a master that hangs (accepts, never answers) held every call up to
# Mooncake's RPC timeout (~30 s) while the tier read online
HUNG_CALL_S = 2.0
# ... and the master must answer that probe (``batch_is_exist``) within this, or that call end
# meanwhile; the probe runs on a thread of its own, so a hung master holds the connector (and
# a stop) at most this long
PROBE_WAIT_S = 2.0
# a connect that failed the metadata or the set-up check (a setting, or a hung server: not one
# that is down) is tried again this often, not with the probe's backoff
SETUP_RETRY_S = 10.0


def _listening() -> list[str] | None:
    """This process's listening TCP addresses (``bind_shim.own_listeners``), None if unread."""
    from hicache.core.bind_shim import own_listeners

    try:
        return own_listeners()
    except (OSError, ValueError):
        return None


_WHAT = {"read": "prefetch", "write": "put", "meta": "key-store epoch"}  # a stalled queue's calls


class L3CallFailed(Exception):
    """A ``meta`` job's Mooncake call failed: ``why`` is its miss reason (``offline``, ``full``,
    ``error``, or the caller's own, e.g. ``epoch``), ``message`` one line naming the key."""

    def __init__(self, why: str, message: str) -> None:
        super().__init__(message)
        self.why = why
        self.message = message


@dataclass
class _Ask:
    """One probe of the master (``MooncakeL3._ask``): when it began, its thread, and what it
    found."""
    t0: float
    thread: threading.Thread | None = None
    done: threading.Event = field(default_factory=threading.Event)
    ok: bool = False
    error: str = ""


@dataclass
class L3Job:
    kind: str  # query | prefetch | put | remove (keys: regexes) | meta (``call`` runs)
    keys: list[str]  # full object keys
    rows: list[dict[str, int]] = field(default_factory=list)  # per page: space -> host row
    deadline: float = float("inf")  # monotonic; prefetch stops at the first batch past it;
    #                                 a query or prefetch still running past it is acked then
    # results
    hits: int = 0  # query: leading keys present; prefetch: leading pages loaded and verified
    written: int = 0
    skipped: int = 0
    misses: dict[str, int] = field(default_factory=dict)  # reason -> pages
    nbytes: int = 0
    t_submit: float = 0.0
    t_end: float = 0.0
    tag: Any = None  # the daemon's bookkeeping (op id, client)
    fmt: Any = None  # l3_format.ObjectFormat of the job's objects
    # query: also say, per key, whether the store holds it; prefetch: go on past a missing or
    # corrupt object (``hits`` then counts every object read and verified, not the leading ones)
    each: bool = False
    present: list[int] = field(default_factory=list)  # with ``each``: 1/0 per key (a prefix
    # of the keys when the job stopped early: the rest are 0)
    pools: dict[str, list[str]] = field(default_factory=dict)  # prefetch: pools it fills
    partial: set[str] = field(default_factory=set)  # ... those it fills only in part
    started: bool = False  # set (under the tier's lock) when a worker takes the job
    cancelled: str = ""  # why it is to be dropped unrun when a worker takes it ("" = run it)
    acked: bool = False  # query, prefetch: acked at its deadline while the store call ran
    call: Callable[["MooncakeL3"], Any] | None = None  # meta: run on the meta thread ...
    value: Any = None  # ... and what it returned
    error: str = ""  # meta: the one line of the ``L3CallFailed`` it raised

    def result(self) -> dict[str, Any]:
        """The ack's ``l3`` field."""
        out: dict[str, Any] = {"written": self.written, "skipped": self.skipped} \
            if self.kind == "put" else {"hits": self.hits}
        if self.each:
            out["present"] = self.present
        return {**out, "misses": self.misses}

    def unanswered_result(self, why: str) -> dict[str, Any]:
        """The ack's ``l3`` field when the job is acked while its store call still runs (at
        its deadline, ``why`` ``deadline``; at a stop, ``stopping``): nothing found, read or
        written."""
        out: dict[str, Any] = {"written": 0, "skipped": 0} if self.kind == "put" else \
            {"hits": 0}
        if self.each:
            out["present"] = [0] * len(self.keys)
        return {**out, "misses": {why: len(self.keys)}}


def count_hits(metrics: Metrics, job: L3Job) -> None:
    """The pages a finished query or prefetch gave whoever asked (the server thread, as it
    takes the job): none for one answered at its deadline (0 hits) or dropped, whatever its
    late store call found (it was counted a hit as well as a deadline miss)."""
    if job.kind not in ("query", "prefetch"):
        return
    hits = 0 if job.acked or job.cancelled else job.hits
    ck = "ckpt_" if job.fmt is not None and job.fmt.kind == "ckpt" else ""
    metrics.inc("l3_pages", hits, f"{ck}{job.kind}_hit")
    if job.kind == "prefetch":
        metrics.inc("l3_hit_tokens", hits * job.fmt.page_tokens)


def _unrun(job: L3Job, why: str) -> None:
    """``job`` ends with no Mooncake call: every key a miss for ``why``."""
    job.misses[why] = len(job.keys)
    job.present = [0] * len(job.keys) if job.each else []


class MooncakeL3:
    def __init__(self, settings: L3Settings, arena: Any, objects: F.Objects, metrics: Metrics,
                 wake: Callable[[], None], store_class: Any = None,
                 setup_check: Callable[[L3Settings, threading.Event], str | None] | None
                 = setup_fails
                 ) -> None:
        self.settings = settings
        self.setup_check = setup_check  # Mooncake's setup in a child first (None: skipped)
        self._slow_retry = False  # the last connect failed a setting or a hung server's check
        self.objects = objects
        self.metrics = metrics
        self.wake = wake
        self.store_class = store_class or load_store_class()
        self.arena_ptr, self.arena_bytes = arena.ptr, arena.nbytes
        self.store: Any = None
        self.online = False
        self.state = "connecting"
        self.why: str | None = None  # why the tier is offline (the last failed check or call)
        self._headers = {k: np.zeros(BATCH_PAGES * F.HEADER_BYTES, dtype=np.uint8)
                         for k in ("read", "write")}
        self._small = np.zeros(SMALL_BYTES, dtype=np.uint8)  # get_small's (meta thread only)
        self._running = 0  # jobs a worker has taken and not finished (the liveness check waits)
        self._last_call = 0.0  # when the last one finished
        self._timed: set[int] = set()  # worker threads whose job makes Mooncake calls
        self._calls: dict[int, float] = {}  # ... -> when the call it is in began (``_call``)
        self._queue_of: dict[int, str] = {}  # worker thread -> the queue it serves
        self._moving: set[int] = set()  # worker threads in a call that moves data (``_call``)
        self._stalled: dict[str, str] = {}  # queue -> why, while its worker's call is stuck
        self._asking: _Ask | None = None  # the probe ``_ask`` started and has not seen end
        self._next_check = 0.0  # the connector's next liveness check (``_check_alive``)
        self._queues: dict[str, queue.Queue[L3Job | None]] = {
            k: queue.Queue() for k in ("query", "read", "write", "meta")}
        self.put_pages_queued = 0
        self.completed: collections.deque[L3Job] = collections.deque()
        self._stop = threading.Event()
        self._draining = threading.Event()  # the daemon is stopping: queued jobs go unrun
        self._lock = threading.Lock()
        self._backoff = 0.25
        self._next_probe = 0.0
        self._codes_seen: set[int] = set()
        self._last_down: str | None = None  # why the last connect found the servers down
        self._was_online = False
        self._counted_down = False  # the first failed connect counted (``_down_from_start``)
        self._threads = [threading.Thread(target=self._connector, name="l3-connect", daemon=True)]
        self._threads += [threading.Thread(target=self._worker, args=(k,), name=f"l3-{k}",
                                           daemon=True) for k in self._queues]
        metrics.set("l3_online", 0)
        for t in self._threads:
            t.start()

    # ------------------------------------------------------------------ connection
    def _connect(self) -> bool:
        s = self.settings
        # Mooncake's setup holds the GIL while it retries (l3_reach): it runs only once the
        # servers answer, the metadata URL is a metadata server's, and a child's setup passed
        down, slow = unreachable(s), False
        if down is None:
            down = metadata_wrong(s)
            if down is None and self.setup_check is not None:
                down = self.setup_check(s, self._stop)
                if self._stop.is_set():  # stopped mid-check: nothing to log or count
                    return False
            slow = down is not None  # not a server down: a setting, or a hung server
        self._slow_retry = slow
        if down is not None:
            if self.state == "connecting" or self._last_down != down:
                log.warning("L3: %s; retrying%s (the tier is offline meanwhile)", down,
                            f" every {SETUP_RETRY_S:g} s" if slow else "")
            self._last_down = self.why = down
            self.state = "offline"  # a kv key it has not seen is a miss, not pending
            return False
        before = _listening()
        store = self.store_class()
        rc = store.setup(s.local_host, s.metadata, s.segment_bytes, s.buffer_bytes, s.protocol,
                         s.rdma_devices, s.master)
        if rc != 0:
            log.warning("L3: setup against master %s / metadata %s, mounting a segment of %s "
                        "(--l3-segment), failed (Mooncake's code %s); retrying", s.master,
                        s.metadata, format_bytes(s.segment_bytes), rc)
            self.state = "offline"
            self.why = f"Mooncake's setup failed (code {rc})"
            try:
                store.close()
            except Exception:  # noqa: BLE001 - a half set-up client: nothing more to do
                pass
            return False
        regs = [(self.arena_ptr, self.arena_bytes)] + \
               [(h.ctypes.data, h.nbytes) for h in (*self._headers.values(), self._small)]
        for ptr, n in regs:
            rc = store.register_buffer(ptr, n)
            if rc != 0:
                store.close()
                raise UsageError(f"L3: Mooncake refused to register {n} bytes at {ptr:#x} "
                                 f"(code {rc})")
        self.store = store
        opened = sorted(set(_listening() or ()) - set(before or ()))
        if before is not None and opened:  # the ports the summary could not know yet
            log.info("L3: Mooncake listens on %s", ", ".join(opened))
        return True

    def _connector(self) -> None:
        """Set the client up, then probe the master with backoff whenever it is offline, and
        check that it can still be reached every ``LIVENESS_S`` while online."""
        while not self._stop.is_set():
            now = time.monotonic()
            if self.online:
                self._check_alive(now)
            if not self.online and now >= self._next_probe:
                try:
                    ok = self._connect() if self.store is None else \
                        self._ask(PROBE_WAIT_S) is True
                except UsageError as e:
                    log.error("%s", e)
                    self._down_from_start()
                    self.state = f"failed: {e}"
                    return
                except BaseException as e:  # noqa: BLE001 - a Mooncake surprise: retry later
                    # (BaseException too: a connector that died here would leave the tier as
                    # it is for good, never probed again)
                    log.warning("L3: connecting or probing failed: %s: %s", type(e).__name__, e)
                    ok = False
                if ok:
                    self._set_online(True, "master answers again" if self._was_online
                                     else "connected")
                    self._was_online = True
                elif not self._stop.is_set():
                    self._down_from_start()
                    wait = max(self._backoff, SETUP_RETRY_S) if self._slow_retry \
                        else self._backoff
                    self._next_probe = time.monotonic() + wait
                    self._backoff = min(self._backoff * 2, self.settings.max_backoff)
            self._stop.wait(0.05)

    def _down_from_start(self) -> None:
        """The first connect failed (or was refused for good): the tier goes from
        ``connecting`` to ``offline``, counted as a transition like a later drop (an alert on
        ``l3_transitions{to="offline"}`` fires for a master never reached too)."""
        with self._lock:
            if self.state not in ("connecting", "offline") or self._was_online \
                    or self._counted_down:
                return
            self._counted_down = True
            self.state = "offline"
        self.metrics.inc("l3_transitions", 1, "offline")

    def _idle(self, now: float) -> bool:
        """No job running or queued, and none finished within ``LIVENESS_S``."""
        with self._lock:
            busy = self._running or now - self._last_call < LIVENESS_S
        return not busy and all(q.empty() for q in self._queues.values())

    def _check_alive(self, now: float) -> None:
        """While online, every ``LIVENESS_S``: an idle tier checks that the master does not
        refuse a TCP connection (``master_gone``); a busy one, once a call has run
        ``HUNG_CALL_S``, that the master answers a probe within ``PROBE_WAIT_S`` or that call
        ends meanwhile (a slow master is not a hung one). A refused connect, a failed probe, or
        no answer from either takes the tier offline."""
        if now < self._next_check or self._stop.is_set():  # (closing: nothing to tell)
            return
        if self._idle(now):
            self._next_check = now + LIVENESS_S
            down = master_gone(self.settings)
            if down is not None:
                self._set_online(False, f"{down} (liveness check)")
            return
        with self._lock:
            began = min(self._calls.values(), default=now)
        if now - began < HUNG_CALL_S:
            return
        self._next_check = now + LIVENESS_S
        ok = self._ask(PROBE_WAIT_S)
        if self._stop.is_set():
            return
        if ok is True:  # the master answers: a call it holds that long waits on a storage node
            self._stall(time.monotonic())
            return
        with self._lock:  # no answer: did that call end meanwhile (the master answered it)?
            stuck = began in self._calls.values()
        if ok is None and not stuck:
            return
        self._set_online(False, f"the master answered no probe within {PROBE_WAIT_S:g} s "
                                f"while a Mooncake call had run {time.monotonic() - began:.1f} "
                                f"s (hung?)" if ok is None else "a probe of the master failed")

    def _stall(self, now: float) -> None:
        """The master answered a probe: each ``L3_STALLABLE`` queue whose worker is in a call
        that moves data and has run ``HUNG_CALL_S`` stalls (``_call`` ends it when that call
        returns), and its queued jobs complete at once unrun, ``misses["stalled"]``."""
        new: list[tuple[str, float]] = []
        dropped: list[L3Job] = []
        with self._lock:  # (the queue emptied in the same hold: a stall that ends meanwhile
            for me, began in self._calls.items():  # waits for this lock, ``_call``)
                which = self._queue_of.get(me, "")
                if which in L3_STALLABLE and which not in self._stalled and \
                        me in self._moving and now - began >= HUNG_CALL_S:
                    self._stalled[which] = (
                        f"a {_WHAT[which]} call has not returned for {now - began:.1f} s while "
                        f"the master answers (a storage node hangs?)")
                    self.metrics.set("l3_stalled", 1, which)
                    new.append((which, now - began))
                    dropped += self._take_queued(which)
        for which, age in new:
            log.warning("L3: the %s worker's Mooncake call has not returned for %.1f s while "
                        "the master answers probes (a storage node hangs?): its queued jobs "
                        "and new ones are answered at once as misses (stalled) until it "
                        "returns", which, age)
        for job in dropped:
            self._end_unrun(job, "stalled", queued=True)

    def _take_queued(self, which: str) -> list[L3Job]:
        """Every job waiting in queue ``which``, taken out (the caller ends them unrun)."""
        q, out = self._queues[which], []
        while True:
            try:
                job = q.get_nowait()
            except queue.Empty:
                return out
            if job is None:  # closing: the worker's sentinel stays for it
                q.put(None)
                return out
            out.append(job)

    def stalled(self) -> dict[str, str]:
        """The stalled queues (``read``, ``write``, ``meta``) and why, while their calls are
        stuck."""
        with self._lock:
            return dict(self._stalled)

    def call_age(self, now: float) -> float:
        """Seconds the oldest Mooncake call of a job now running has run (0: none runs; a
        job between two calls is not in one)."""
        with self._lock:
            return now - min(self._calls.values()) if self._calls else 0.0

    def hung(self) -> bool:
        """Every job a worker runs is stuck: online, each worker in a job (``_timed``) serves
        a stalled queue (its call waits on a storage node that does not answer); offline, a
        Mooncake call has run ``HUNG_CALL_S`` or more, or a probe ``PROBE_WAIT_S`` or more (it
        waits on a master that no longer answers, up to Mooncake's RPC timeout, ~30 s)."""
        if self.online:
            with self._lock:
                return bool(self._stalled) and all(
                    self._queue_of.get(t) in self._stalled for t in self._timed)
        now = time.monotonic()
        with self._lock:
            ask = self._asking
            probing = ask is not None and not ask.done.is_set() and \
                now - ask.t0 >= PROBE_WAIT_S
        return probing or self.call_age(now) >= HUNG_CALL_S

    def _ask(self, wait: float) -> bool | None:
        """Whether the master answers a probe (``batch_is_exist``): True or False, or None when
        it has not answered within ``wait`` s. The probe runs on a thread of its own; while it
        has not returned no other starts (a later ask waits on the same one: its answer, when it
        comes, is the master's now); one that answered after an earlier ask gave up is stale
        and dropped, and a new one starts."""
        with self._lock:
            ask = self._asking
            if ask is not None and ask.done.is_set():  # answered after its asker gave up
                ask = self._asking = None
            if ask is None:
                if self._stop.is_set():  # closing: ``close`` has looked for probes already
                    return None
                ask = self._asking = _Ask(time.monotonic())
                ask.thread = threading.Thread(target=self._run_ask, args=(ask,),
                                              name="l3-probe", daemon=True)
                ask.thread.start()
        if not ask.done.wait(wait):
            return None
        with self._lock:
            if self._asking is ask:
                self._asking = None
        if ask.error:
            log.warning("L3: probing the master failed: %s", ask.error)
        return ask.ok

    def _run_ask(self, ask: _Ask) -> None:
        try:
            r = self.store.batch_is_exist(["hc-probe"])
            ask.ok = bool(r) and r[0] >= 0
        except BaseException as e:  # noqa: BLE001 - a Mooncake surprise: a failed probe
            ask.error = f"{type(e).__name__}: {e}"
        finally:
            ask.done.set()

    def _set_online(self, on: bool, why: str) -> None:
        with self._lock:
            if self.online == on:
                return
            self.online = on
            self.state = "online" if on else "offline"
            self.why = None if on else why
            if on:
                self._backoff = 0.25
            else:
                self._next_probe = time.monotonic() + self._backoff
        self.metrics.set("l3_online", 1 if on else 0)
        self.metrics.inc("l3_transitions", 1, "online" if on else "offline")
        master = self.settings.master
        (log.info if on else log.warning)("L3 %s: %s%s", self.state, why,
                                         "" if master in why else f" (master {master})")

    def _failed(self, code: int, what: str) -> None:
        if code not in self._codes_seen:  # each Mooncake error code is logged once
            self._codes_seen.add(code)
            hint = " (no storage segment can hold it: is any mounted? a mooncake_client, or " \
                "a daemon with --l3-segment; counted as full)" if code == -200 else ""
            log.warning("L3: %s returned Mooncake code %d%s", what, code, hint)
        if code in OFFLINE_CODES:
            self._set_online(False, f"{what} returned {code}")

    # ------------------------------------------------------------------ jobs
    def submit(self, job: L3Job) -> None:
        job.t_submit = time.monotonic()
        which = "write" if job.kind in ("put", "remove") else \
            "read" if job.kind == "prefetch" else job.kind  # query, meta
        with self._lock:  # (queued under the lock: a stall found meanwhile drops it, ``_stall``)
            # offline (or not yet connected): no Mooncake call would run for it, as a worker
            # taking it would find; stalled: it would wait behind a call a storage node holds.
            # Answered now, not behind a call that may hang (stopping: queued, dropped unrun)
            why = "" if self._draining.is_set() else "offline" if not self.online else \
                "stalled" if which in self._stalled else ""
            if not why:
                if job.kind == "put":  # (the gauge set under the lock too, never an older
                    self.put_pages_queued += len(job.keys)  # value last)
                    self.metrics.set("l3_put_queue_pages", self.put_pages_queued)
                self._queues[which].put(job)
        if why:
            self._end_unrun(job, why, queued=False)

    def _end_unrun(self, job: L3Job, why: str, queued: bool) -> None:
        """``job`` (``queued``: taken out of its queue) completes now with no Mooncake call,
        every key a miss for ``why``; a queued job cancelled meanwhile (or a stop's) for its
        own reason, as a worker taking it would say."""
        with self._lock:
            job.started = True
            if queued:
                why = self._unrun_reason(job) or why
                if job.kind == "put":
                    self.put_pages_queued -= len(job.keys)
                    self.metrics.set("l3_put_queue_pages", self.put_pages_queued)
        _unrun(job, why)
        job.t_end = time.monotonic()
        self._complete(job)

    def extend_queued(self, job: L3Job, key: str) -> bool:
        """Add ``key`` to a queued ``remove`` job that no worker has taken yet (False, and
        nothing added, once one has: its keys are then fixed)."""
        with self._lock:
            if job.started:
                return False
            job.keys.append(key)
            return True

    def cancel(self, job: L3Job, why: str) -> bool:
        """Mark ``job`` to be dropped unrun (``misses[why]``) when a worker takes it; True when
        none had taken it yet (no call of it will ever run), False when one had (its call may
        still be running)."""
        with self._lock:
            job.cancelled = job.cancelled or why
            return not job.started

    def _unrun_reason(self, job: L3Job) -> str:
        """Why a queued ``job`` is to end with no Mooncake call ("" when it is to run): the
        daemon stops, or it was cancelled (``cancel``)."""
        return "stopping" if self._draining.is_set() else job.cancelled

    def _worker(self, which: str) -> None:
        q = self._queues[which]
        with self._lock:
            self._queue_of[threading.get_ident()] = which
        while True:
            job = q.get()
            if job is None:
                return
            me = threading.get_ident()
            with self._lock:  # (one hold: a job taken is in ``_timed`` at once, for ``hung``)
                job.started = True
                self._running += 1
                why = self._unrun_reason(job)
                online = self.online  # (read once: the job runs its calls, timed, or none)
                called = not why and online
                if called:  # (``_call`` times each of the job's calls)
                    self._timed.add(me)
            try:
                if why:  # nobody waits for it any more: no Mooncake call
                    _unrun(job, why)
                elif not online:
                    _unrun(job, "offline")
                elif job.kind == "query":
                    self._query(job)
                elif job.kind == "prefetch":
                    self._prefetch(job)
                elif job.kind == "remove":
                    self._remove(job)
                elif job.kind == "meta":
                    job.value = job.call(self)
                else:
                    self._put(job)
            except L3CallFailed as e:
                job.misses[e.why] = 1
                job.error = e.message
            except BaseException:  # noqa: BLE001 - a bug or a Mooncake surprise: count, go on
                # (BaseException too: a worker that died here would leave its job unacked,
                # every later job of its queue unrun, and ``_running`` up, which holds the
                # liveness check off for good)
                log.exception("L3 %s failed", job.kind)  # (_record counts it kind="error")
                job.misses["error"] = job.misses.get("error", 0) + 1
            job.t_end = time.monotonic()
            with self._lock:
                if job.kind == "put":
                    self.put_pages_queued -= len(job.keys)
                    self.metrics.set("l3_put_queue_pages", self.put_pages_queued)
            self._complete(job)  # (before it leaves ``_timed``: never a running job that
            with self._lock:  # ``hung`` does not see, nor one the server cannot collect)
                self._running -= 1
                if called:  # a Mooncake call ran: it spoke for the master
                    self._last_call = job.t_end
                    self._timed.discard(me)

    def _call(self, fn: Callable[..., Any], *args: Any, data: bool = False) -> Any:
        """One Mooncake call of a worker's job, timed while it runs (``call_age``); ``data``:
        it moves bytes from or to a storage node, so a hung node can hold it (``_stall``). Its
        return ends its queue's stall."""
        me = threading.get_ident()
        with self._lock:
            timed = me in self._timed
            if timed:
                self._calls[me] = time.monotonic()
                if data:
                    self._moving.add(me)
        try:
            return fn(*args)
        finally:
            if timed:
                with self._lock:
                    self._moving.discard(me)
                    began = self._calls.pop(me)
                    which = self._queue_of.get(me, "")
                    was = self._stalled.pop(which, None)
                    if was is not None:
                        self.metrics.set("l3_stalled", 0, which)
                if was is not None:
                    log.info("L3: the %s worker's stalled Mooncake call returned after %.1f s; "
                             "its jobs run again", which, time.monotonic() - began)

    def _complete(self, job: L3Job) -> None:
        """A finished job: counted, handed to the server thread, which is woken."""
        self._record(job)
        self.completed.append(job)
        self.wake()

    def _record(self, job: L3Job) -> None:
        m = self.metrics
        m.observe("l3_seconds", job.t_end - job.t_submit, job.kind)
        for why, n in job.misses.items():
            if why not in ("miss", "deadline", "cancelled", "stopping"):  # (not the store's)
                m.inc("l3_errors", n, why)
        ck = "ckpt_" if job.fmt is not None and job.fmt.kind == "ckpt" else ""
        if job.kind == "prefetch":  # (its hits: ``count_hits``, at its ack)
            m.inc("l3_bytes", job.nbytes, "read")
        elif job.kind == "put":
            m.inc("l3_pages", job.written, f"{ck}written")
            m.inc("l3_pages", job.skipped, f"{ck}skipped_existing")
            m.inc("l3_bytes", job.nbytes, "write")

    def _exists(self, keys: list[str]) -> list[int] | None:
        """1/0 per key, or None when the store could not answer (offline when no key could)."""
        r = list(self._call(self.store.batch_is_exist, keys))
        if len(r) == len(keys) and all(x >= 0 for x in r):
            return r
        if all(x < 0 for x in r):
            self._set_online(False, "batch_is_exist failed")
        return None

    def _query(self, job: L3Job) -> None:
        leading = True
        for i in range(0, len(job.keys), BATCH_PAGES * 8):
            r = self._exists(job.keys[i:i + BATCH_PAGES * 8])
            if r is None:  # offline when the call found the master gone (``_exists``)
                if self.online:
                    job.misses["error"] = 1
                else:
                    job.misses["offline"] = len(job.keys) - i
                job.present = []
                return
            for x in r:
                leading = leading and x == 1
                job.hits += leading
                if job.each:
                    job.present.append(int(x == 1))
            if not leading and not job.each:
                return

    @staticmethod
    def call_pages(fmt: F.ObjectFormat) -> int:
        """Objects one Mooncake call carries (each is its header plus its pieces)."""
        return max(1, min(BATCH_PAGES, SLICES_PER_CALL // (1 + fmt.pieces_per_object)))

    def _prefetch(self, job: L3Job) -> None:
        hdr = self._headers["read"]
        base = hdr.ctypes.data
        n = len(job.keys)
        fmt, per_call = job.fmt, self.call_pages(job.fmt)
        b0 = 0
        while b0 < n:
            if time.monotonic() > job.deadline:
                job.misses["deadline"] = n - b0
                return
            keys = self._distinct_run(job.keys, b0, per_call)
            ptrs, sizes = [], []
            for j in range(len(keys)):
                p, s = fmt.pieces(job.rows[b0 + j])
                ptrs.append([base + j * F.HEADER_BYTES] + p)
                sizes.append([F.HEADER_BYTES] + s)
            t0 = time.perf_counter()
            res = self._call(self.store.batch_get_into_multi_buffers, keys, ptrs, sizes,
                             False, data=True)
            self.metrics.observe("l3_batch_seconds", time.perf_counter() - t0, "get")
            for j, rc in enumerate(res):
                why = self._verify(fmt, rc, memoryview(hdr)[j * F.HEADER_BYTES:], keys[j],
                                   job.rows[b0 + j])
                if why is not None and job.each and why in ("miss", "corrupt", "transfer"):
                    job.misses[why] = job.misses.get(why, 0) + 1  # this key only: go on
                    job.present.append(0)
                    continue
                if why is not None:
                    job.misses[why] = n - (b0 + j)
                    return
                job.hits += 1
                job.nbytes += fmt.obj_bytes
                if job.each:
                    job.present.append(1)
            b0 += len(keys)

    @staticmethod
    def _distinct_run(keys: list[str], b0: int, most: int) -> list[str]:
        """``keys[b0:]`` up to ``most`` of them and up to the first one named twice: one
        Mooncake batch read never names a key twice (it fills the last copy's buffers only and
        reports success for every copy, so the others would be checked against bytes it never
        read, found corrupt, and a good object removed from the shared store)."""
        seen: set[str] = set()
        b1 = b0
        while b1 < len(keys) and b1 - b0 < most and keys[b1] not in seen:
            seen.add(keys[b1])
            b1 += 1
        return keys[b0:b1]

    def _verify(self, fmt: F.ObjectFormat, rc: int, hdr: memoryview, key: str,
                rows: dict[str, int]) -> str | None:
        """None when the page just read is ours and intact; else the miss reason: ``miss``,
        ``offline``, ``corrupt`` (the object is not a page of ours: wrong size, header or
        checksum; it is removed, so a later put can store the page again) or ``transfer``
        (the read failed on its way, e.g. a storage node is gone: nothing says the object is
        bad)."""
        if rc < 0:
            if rc in MISS_CODES:
                return "miss"
            self._failed(rc, "batch_get")
            if rc in OFFLINE_CODES:
                return "offline"
            # an object of the wrong size fails the read too: ask for its size to tell
            size = self._call(self.store.get_size, key)
            if size < 0 or size == fmt.obj_bytes:
                return "transfer"
            return self._corrupt(key)
        if rc != fmt.obj_bytes or F.check_header(hdr, key, fmt.payload_bytes) is not None or \
                F.header_checksum(hdr) != fmt.checksum(rows):
            return self._corrupt(key)
        return None

    def _corrupt(self, key: str) -> str:
        """A corrupt object under ``key`` goes: puts skip keys that exist, so it would block
        that page for good (until Mooncake evicted it)."""
        rc = self._call(self.store.remove, key, True)  # force: our own read holds a lease on it
        if rc < 0 and rc not in MISS_CODES:
            self._failed(rc, "remove")
        return "corrupt"

    def _remove(self, job: L3Job) -> None:
        """Remove every object whose key matches one of the regexes ``keys`` (``written``:
        how many went; ``misses["error"]``: the regexes whose call failed)."""
        for regex in job.keys:
            rc = self._call(self.store.remove_by_regex, regex, True)
            if rc < 0:
                job.misses["error"] = job.misses.get("error", 0) + 1
                self._failed(rc, "remove_by_regex")
            else:
                job.written += rc

    # ------------------------------------------------------------------ small objects (meta)
    def _call_failed(self, rc: int, what: str, key: str) -> L3CallFailed:
        self._failed(rc, what)
        why = "offline" if rc in OFFLINE_CODES else "full" if rc in FULL_CODES else "error"
        return L3CallFailed(why, f"Mooncake {what} of {key} returned code {rc}")

    def get_small(self, key: str) -> bytes | None:
        """The value stored under ``key`` (at most ``SMALL_BYTES``), or None when the store
        holds no object there. Raises ``L3CallFailed``: ``corrupt`` for a larger object (its
        message says how large), else as the call failed. Meta thread only (one registered
        buffer)."""
        buf = self._small
        rc = self._call(self.store.get_into, key, buf.ctypes.data, SMALL_BYTES, data=True)
        if rc >= 0:
            return bytes(buf[:rc])
        if rc in MISS_CODES:
            return None
        if rc not in OFFLINE_CODES:  # an object too big for the buffer fails the read too
            size = self._call(self.store.get_size, key)
            if size > SMALL_BYTES:
                raise L3CallFailed("corrupt", f"holds {size} bytes, more than the "
                                              f"{SMALL_BYTES} of a small object")
        raise self._call_failed(rc, "get", key)

    def put_small(self, key: str, value: bytes, replace: bool) -> None:
        """Store ``value`` under ``key``, hard-pinned (Mooncake never evicts it). ``replace``:
        overwrite what is there (upsert); else an existing object stays as it is (the first
        writer wins: read it back to learn what is stored). Raises ``L3CallFailed``."""
        from mooncake.store import ReplicateConfig  # (the store class loaded it already)

        cfg = ReplicateConfig()
        cfg.with_hard_pin = True
        rc = self._call(self.store.upsert if replace else self.store.put, key, value, cfg,
                        data=True)
        if rc != 0 and not (rc == EXISTS and not replace):
            raise self._call_failed(rc, "upsert" if replace else "put", key)

    def _put(self, job: L3Job) -> None:
        hdr = self._headers["write"]
        base = hdr.ctypes.data
        fmt, per_call = job.fmt, self.call_pages(job.fmt)
        for b0 in range(0, len(job.keys), per_call):
            keys = job.keys[b0:b0 + per_call]
            there = self._exists(keys)
            if there is None:
                job.misses["offline" if not self.online else "error"] = len(job.keys) - b0
                return
            todo = [j for j, x in enumerate(there) if x != 1]
            job.skipped += len(keys) - len(todo)
            if not todo:
                continue
            wkeys, ptrs, sizes = [], [], []
            for k, j in enumerate(todo):
                rows = job.rows[b0 + j]
                F.pack_header(memoryview(hdr)[k * F.HEADER_BYTES:], keys[j],
                              fmt.payload_bytes, fmt.checksum(rows))
                p, s = fmt.pieces(rows)
                wkeys.append(keys[j])
                ptrs.append([base + k * F.HEADER_BYTES] + p)
                sizes.append([F.HEADER_BYTES] + s)
            t0 = time.perf_counter()
            res = self._call(self.store.batch_put_from_multi_buffers, wkeys, ptrs, sizes,
                             data=True)
            self.metrics.observe("l3_batch_seconds", time.perf_counter() - t0, "put")
            for rc in res:
                if rc == 0:
                    job.written += 1
                    job.nbytes += fmt.obj_bytes
                elif rc == EXISTS:
                    job.skipped += 1
                else:
                    why = "full" if rc in FULL_CODES else \
                        "offline" if rc in OFFLINE_CODES else "error"
                    job.misses[why] = job.misses.get(why, 0) + 1
                    self._failed(rc, "batch_put")

    # ------------------------------------------------------------------ daemon side
    def take_completed(self) -> list[L3Job]:
        out = []
        while self.completed:
            out.append(self.completed.popleft())
        return out

    def summary(self) -> dict[str, Any]:
        s = self.settings
        return {"state": self.state, "why": self.why, "online": self.online,
                "stalled": self.stalled(), "master": s.master,
                "metadata": s.metadata, "protocol": s.protocol, "namespaces": self.objects.ns,
                "object_bytes": {k: f.obj_bytes for k, f in self.objects.formats.items()},
                "put_queue_pages": self.put_pages_queued,
                "segment_bytes": s.segment_bytes}

    def drain(self) -> None:
        """The daemon is stopping: jobs not yet taken by a worker complete at once, unrun
        (``misses["stopping"]``); one in a Mooncake call finishes it."""
        self._draining.set()

    def close(self, timeout: float = 5.0) -> None:
        """Stop the threads, waiting for them ``timeout`` s in all, then close the store; not
        when a Mooncake call (a job's or a probe's) still runs: the client stays open under it
        until the process exits."""
        self._draining.set()
        self._stop.set()
        for q in self._queues.values():
            q.put(None)
        end = time.monotonic() + timeout
        threads = list(self._threads)
        with self._lock:
            if self._asking is not None and self._asking.thread is not None:
                threads.append(self._asking.thread)
        for t in threads:
            t.join(max(0.0, end - time.monotonic()))
        if any(t.is_alive() for t in threads):
            # (a warning when the tier found the master hung: that call was expected to stay)
            (log.warning if self.hung() else log.error)(
                "L3: a Mooncake call did not return within %.0f s; not closing the client "
                "under it", timeout)
            return
        if self.store is not None:
            try:
                self.store.close()
            except Exception as e:  # noqa: BLE001 - shutting down anyway
                log.warning("L3: close: %s", e)
            self.store = None
