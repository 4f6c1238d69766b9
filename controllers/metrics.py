"""The hicache metric catalog: every Prometheus metric, its labels and the question it answers.

``Metrics()`` holds the whole catalog in plain dicts of its own (never prometheus-client's
global registry, so two daemons, or a daemon and a demo, in one process do not collide). Hot
paths use the small recording methods (``inc``, ``set``, ``observe``: a dict update under one
lock; ``command``, ``transfer``: the record is queued, a ``deque.append``, and applied under the
lock with the others queued at the next ``flush()``). Every reader flushes first
(``exposition`` for ``/metrics``, ``snapshot``, ``value``), and a recording flushes when
``FLUSH_AT`` records wait, so every read is exact and the queue stays small. ``snapshot()``
gives a JSON-able view (used by the daemon's ``stats`` reply), ``exposition()`` the text format
(``core.metrics_text``: the bytes prometheus-client would write, formatted from a copy of the
values; a scrape costs the loop that long), ``serve_http(port)`` the ``/metrics`` endpoint.

Every counter (and every histogram) starts at 0 for every label value known in advance:
directions, statuses, protocol commands, error codes, fallback kinds, copy paths, and the pools
of the layout once the daemon calls ``declare_pools``; so ``increase()`` sees the first event
and a dashboard has a series from start-up. Base units only (bytes, seconds): rates are PromQL's
job. After the catalog come the standard ``process_*`` metrics (prometheus-client's process
collector, in a registry of its own).

docs/metrics.md is generated from ``CATALOG`` (``python -m hicache.controllers.metrics``).
"""
from __future__ import annotations

import math
import sys
import threading
from collections import deque
from typing import Any

from bisect import bisect_left
from typing import Iterable

import platform

from hicache.core.metric_defs import LATENCY_BUCKETS, MetricDef
from hicache.core.metrics_text import Hists, TextFormat, Values
from hicache.core.protocol import COMMANDS, ERROR_CODES
from hicache.core.version import __version__
from hicache.core.metrics_http import MetricsHttp
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest

# label values known in advance (series exist at 0 from start-up)
DIRECTIONS = ("backup", "load", "swap_out", "swap_in", "clear_slot")
STATUSES = ("ok", "error")
OP_STATUSES = (*STATUSES, "cancelled")  # a transfer of a reaped client: neither done nor failed
ERROR_KINDS = (*ERROR_CODES, "transfer", "internal")
FALLBACKS = ("numa_first_touch", "numa_preferred")
# the L3 worker queues whose jobs move data from or to a storage node (prefetch; put; the key
# store's small objects), which a hung node holds while the master answers: they stall
# (``l3_store.MooncakeL3._stall``)
L3_STALLABLE = ("read", "write", "meta")
FLUSH_AT = 1024  # queued command / transfer records applied at once by the recording thread
PATHS = ("numpy", "memmove", "rows_reference", "rows_zero_copy", "rows_staged", "rows_dma",
         "tokens_reference", "tokens_zero_copy", "tokens_staged", "by_layer", "clear")


CATALOG: tuple[MetricDef, ...] = (
    # --- data path
    MetricDef("transfer_bytes", "counter", ("direction", "pool"),
              "Bytes copied between device and host pools.",
              "How much KV did we offload (backup/swap_out) or bring back (load/swap_in), per "
              "pool? (rate() = bytes per second)"),
    MetricDef("transfer_rows", "counter", ("direction", "pool"),
              "Row ids (or token ids for token-granular items) copied.",
              "How many pages / slots moved, and is the mix page-aligned or token-granular?"),
    MetricDef("transfer_path_ops", "counter", ("direction", "path"),
              "Successful operations by the copy path they took (an operation that used "
              "several paths counts once for each).",
              "Which copy paths run: fast kernels, staged, reference or CPU copies?"),
    MetricDef("transfer_busy_seconds", "counter", ("direction",),
              "Seconds successful operations spent executing (queueing excluded: on a GPU, "
              "the wait behind the stream's previous op too; a merged CPU run counts once, "
              "split among its ops by bytes).",
              "Are copies running near the PCIe / memory-copy limit? (rate(transfer_bytes) / "
              "rate(transfer_busy_seconds) = bytes per busy second)"),
    MetricDef("transfer_ops", "counter", ("direction", "status"),
              "Transfer operations completed, by direction and status (ok | error | cancelled: "
              "its client was reaped; not an error).",
              "How many backups, loads, swaps and clears ran, and how many failed?"),
    MetricDef("transfer_seconds", "histogram", ("direction",),
              "Seconds from accepting an operation to its completion (queueing included).",
              "How long does the engine wait for an ack, and does it grow under load?"),
    MetricDef("transfers_in_flight", "gauge", ("direction",),
              "Operations accepted but not yet completed.",
              "Is the transfer engine keeping up, or is work piling up?"),
    MetricDef("fallbacks", "counter", ("what",),
              "Times a fallback path was taken (each is also logged once).",
              "Did the daemon silently run a slower path than configured? (it should not)"),
    # --- host pools
    MetricDef("host_rows", "gauge", ("space", "state"),
              "Host rows per index space by state: used, free, pending_free (freed by the client "
              "while an operation still used them, or held by a client's release until its "
              "copies end; not free yet).",
              "How full is the host tier, and is anything stuck waiting to be freed?"),
    MetricDef("host_free_runs", "gauge", ("space",),
              "Runs of consecutive free host rows per index space (freed rows coalesce).",
              "Is the host tier's free space in a few long runs or many scattered rows?"),
    MetricDef("host_free_run_mean_rows", "gauge", ("space",),
              "Mean length in rows of the free runs of an index space (free rows / runs).",
              "Will a request's host rows come out consecutive (long runs feed the staged DMA "
              "path)?"),
    MetricDef("host_fragmentation_ratio", "gauge", ("space",),
              "1 - longest free run / free rows, per index space (0: all free rows in one run).",
              "How scattered is the free host space?"),
    MetricDef("host_pool_bytes", "gauge", ("pool",),
              "Host bytes reserved for each pool (all layers).",
              "Where does the pinned host memory go?"),
    MetricDef("pinned_bytes", "gauge", (),
              "Bytes of the host arena (pinned on GPU, plain shared memory in CPU mode).",
              "How much host memory does this daemon hold?"),
    MetricDef("pin_seconds", "gauge", (),
              "Seconds spent bringing the host arena up (map, first touch, register).",
              "Why did start-up take so long? (pinned_bytes / pin_seconds = bring-up speed)"),
    MetricDef("numa_node", "gauge", (),
              "NUMA node the host arena was placed on (-1: not placed on a node).",
              "Is the host pool local to its GPU?"),
    MetricDef("daemon_info", "gauge", ("model", "device", "pp_rank", "pp_size", "swa_mode",
                                       "host_split", "socket"),
              "Always 1; the labels say what this daemon serves: the model, the device, the "
              "pipeline stage, the SWA mode, the host split and the socket.",
              "Which model, stage and GPU does each daemon serve (to group or pick daemons by "
              "stage or device)?"),
    MetricDef("build_info", "gauge", ("version", "python", "torch"),
              "Always 1; the labels say which build runs.",
              "Which hicache version does each daemon run?"),
    # --- control plane
    MetricDef("commands", "counter", ("command", "status"),
              "Commands handled, by name and status (ok | error).",
              "What is the engine asking for, and how often is it refused?"),
    MetricDef("command_seconds", "histogram", ("command",),
              "Seconds from receiving a command to sending its reply.",
              "Is the control plane adding latency to the engine's step?"),
    MetricDef("load_issue_seconds", "histogram", (),
              "Seconds the issuer thread spends issuing a GPU LOAD's copies after layer 0, "
              "right after the reply (the server thread answers other commands meanwhile).",
              "Is the host's issue of big loads what the link waits for?"),
    MetricDef("load_issue_cpu_seconds", "counter", (),
              "CPU seconds of the issuer thread in those issues (per issue, against "
              "`load_issue_seconds`: the rest of an issue's time it waited for a core or the "
              "GIL).",
              "Does the issue of later layers wait for other threads of the daemon?"),
    MetricDef("errors", "counter", ("kind",),
              "Errors by kind: protocol error codes for refused commands, 'transfer' for failed "
              "copies, 'internal' for daemon bugs.",
              "What goes wrong, and is it the client or the daemon?"),
    MetricDef("clients_connected", "gauge", (),
              "Clients the daemon currently tracks (seen and not reaped or unregistered; a peer "
              "that only asked for `stats`, such as `hicache stats`, is forgotten as it is "
              "answered; one that only sent heartbeats, such as a launcher's readiness probe, "
              "counts until the heartbeat timeout).",
              "How many engine processes talk to this daemon?"),
    MetricDef("workers_registered", "gauge", (),
              "Clients with registered device pools.",
              "Is the serving worker attached?"),
    MetricDef("channels_open", "gauge", (),
              "Clients whose requests come through a shared-memory channel (a busy-polling "
              "daemon grants one to a local client; docs/protocol.md, `channel`).",
              "Does the engine skip ZMQ's two thread wake-ups per command?"),
    MetricDef("clients_reaped", "counter", (),
              "Clients reaped after missing heartbeats (their rows freed, mappings closed).",
              "Did a worker die or hang without saying goodbye?"),
    MetricDef("release_loop_step_seconds", "gauge", (),
              "Longest single server-loop step while the last client release (reap, or "
              "unregister / reset with rows going back in the background) was under way.",
              "Does giving a dead or departing client's rows back stall other clients?"),
    # --- HiSparse
    MetricDef("hisparse_host_rows", "gauge", ("state",),
              "C4 page rows of the clients' sparse host regions (the bound ones) by state: "
              "used, free.",
              "How full are the HiSparse host regions, and how many more long requests fit?"),
    MetricDef("hisparse_regions", "gauge", ("state",),
              "Sparse host regions (one per client in sparse mode) by state: bound, max "
              "(--sparse-clients).",
              "Can another engine start sparse mode on this daemon?"),
    MetricDef("hisparse_requests", "gauge", (),
              "Requests admitted to sparse mode and not yet freed.",
              "How many long requests run with their C4 KV on the host?"),
    MetricDef("hisparse_lookups", "counter", (),
              "Top-k ids looked up in the engines' hot buffers (reported by sparse_report).",
              "How many C4 tokens does sparse attention read? (hit rate = 1 - swapped / lookups)"),
    MetricDef("hisparse_swapped_in_tokens", "counter", (),
              "Top-k misses the engines' swap-in kernels copied host -> device.",
              "How often does the hot buffer miss?"),
    MetricDef("hisparse_swapped_in_bytes", "counter", (),
              "Bytes of those copies (576 B value + 8 B scale per token).",
              "How much PCIe traffic does sparse decoding cost?"),
    MetricDef("acks_dropped", "counter", (),
              "Acks that could not be pushed (client gone or its queue full) and were then "
              "dropped from the bounded retention before the client polled them.",
              "Did a client lose completion notices?"),
    # --- L3 tier (Mooncake Store)
    MetricDef("l3_online", "gauge", (),
              "1 while the L3 store answers, 0 while it is offline or still connecting.",
              "Is the shared L3 tier usable right now?"),
    MetricDef("l3_transitions", "counter", ("to",),
              "Times the L3 tier went offline or came back online.",
              "How often does the Mooncake master drop out, and does it come back?"),
    MetricDef("l3_pages", "counter", ("result",),
              "L3 objects by result: query_hit, prefetch_hit (read and verified), written, "
              "skipped_existing (another writer stored it first); checkpoint objects "
              "(checkpoints mirror) as ckpt_query_hit, ckpt_prefetch_hit, ckpt_written, "
              "ckpt_skipped_existing; kv_miss: key-store kv_get keys answered 0 after L3 "
              "was consulted (absent or corrupt there, offline, or no free row).",
              "How much of the prefix traffic does L3 serve, and how much do we write?"),
    MetricDef("l3_hit_tokens", "counter", (),
              "Tokens of the pages prefetched from L3 and verified (pages x page tokens); in "
              "the checkpoints mirror an engine drops a prefix whose checkpoint (or a page) "
              "it then cannot read, so this can exceed what it used (rare: both were found "
              "by its query just before).",
              "How many tokens did L3 save from being recomputed?"),
    MetricDef("l3_bytes", "counter", ("direction",),
              "Bytes read from (read) or written to (write) the L3 store, headers included.",
              "How much traffic does this daemon put on the store's network?"),
    MetricDef("l3_seconds", "histogram", ("op",),
              "Seconds from accepting an L3 job (query, prefetch, put, remove, meta: a "
              "key-store epoch read or write) to its completion.",
              "How long does the engine wait for an L3 lookup or prefetch?"),
    MetricDef("l3_batch_seconds", "histogram", ("call",),
              "Seconds of one Mooncake batch call (get, put) of at most 128 pages.",
              "Is the store itself slow, or is the queue in front of it?"),
    MetricDef("l3_errors", "counter", ("kind",),
              "L3 pages (or calls) that failed: offline, corrupt (header, length or checksum "
              "mismatch: a miss, never data; the object is removed), transfer (a read that "
              "failed on its way, e.g. a storage node gone), full (store out of space), error, "
              "epoch (a key-store namespace's epoch object holds no well-formed epoch, or a "
              "write had no epoch to go under: its L3 objects are not used), busy (a "
              "key-store read answered as a miss: 256 queries were already in flight), "
              "stalled (answered at once while a storage node held its worker's call: "
              "l3_stalled).",
              "Is L3 healthy, and did anything try to hand us wrong bytes?"),
    MetricDef("l3_deadline_misses", "counter", ("op",),
              "L3 reads answered as misses because their deadline passed before the store "
              "answered (query, prefetch: pages; meta: key-store epoch reads and clears): a "
              "store that is slow or hangs, or a long queue in front of it.",
              "Are lookups timing out against the L3 store?"),
    MetricDef("l3_stalled", "gauge", ("queue",),
              "1 while an L3 worker (read: prefetches; write: puts and removes; meta: the key "
              "store's epochs) is in a Mooncake call moving data that has not returned for "
              "2 s while the master answers probes (a storage node hangs); its jobs are "
              "answered at once as misses (stalled) meanwhile.",
              "Is a storage node of the L3 store hanging?"),
    MetricDef("l3_put_queue_pages", "gauge", (),
              "Pages queued for writing to L3 and not yet written.",
              "Are L3 writes keeping up with the host tier?"),
)


class Metrics:
    """All hicache metrics of one daemon.

    Values live in plain dicts keyed by label tuples; a record takes one uncontended lock and a
    dict update (well under a microsecond, where prometheus-client's own metric objects cost
    1-3 us each). The readers format a copy taken under the lock.
    """

    PREFIX = "hicache_"

    def __init__(self, process_metrics: bool = True) -> None:
        """``process_metrics``: also export ``process_*`` (CPU, memory, file descriptors)."""
        # the process collector's own registry (never the global one): only process_* is in it
        self.registry = CollectorRegistry()
        self._text = TextFormat(CATALOG, self.PREFIX, LATENCY_BUCKETS)
        self.defs = {d.name: d for d in CATALOG}
        self._values: dict[str, dict[tuple[str, ...], float]] = {
            d.name: {} for d in CATALOG if d.kind != "histogram"}
        # histogram: labels -> [count per bucket (non-cumulative, +Inf last), sum]
        self._hist: dict[str, dict[tuple[str, ...], list]] = {
            d.name: {} for d in CATALOG if d.kind == "histogram"}
        for d in CATALOG:  # unlabelled series exist from the start (0), as Prometheus expects
            if d.labels:
                continue
            if d.kind == "histogram":
                self._hist[d.name][()] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0]
            else:
                self._values[d.name][()] = 0.0
        self._values["numa_node"][()] = -1.0
        torch_mod = sys.modules.get("torch")
        self._values["build_info"][(__version__, platform.python_version(),
                                    str(getattr(torch_mod, "__version__", "none")))] = 1.0
        self._lock = threading.Lock()
        # command / transfer records not yet applied (appends and poplefts are atomic)
        self._queue: deque[tuple] = deque()
        self._http: Any = None
        self._zero("transfer_ops", DIRECTIONS, OP_STATUSES)
        self._zero("transfer_path_ops", DIRECTIONS, PATHS)
        self._zero("transfer_busy_seconds", DIRECTIONS)
        self._zero("commands", (*COMMANDS, "invalid"), STATUSES)
        self._zero("errors", ERROR_KINDS)
        self._zero("fallbacks", FALLBACKS)
        self._zero("transfers_in_flight", DIRECTIONS)
        self._zero_hist("transfer_seconds", DIRECTIONS)
        self._zero_hist("command_seconds", (*COMMANDS, "invalid"))
        # the L3 tier's series exist (at 0) on every daemon: an L3-less one shows zeros, not gaps
        self._zero("l3_transitions", ("online", "offline"))
        self._zero("l3_pages", tuple(f"{c}{r}" for c in ("", "ckpt_") for r in (
            "query_hit", "prefetch_hit", "written", "skipped_existing")) + ("kv_miss",))
        self._zero("l3_hit_tokens")
        self._zero("l3_bytes", ("read", "write"))
        self._zero("l3_errors", ("offline", "corrupt", "transfer", "full", "error", "epoch",
                                "busy", "stalled"))
        self._zero("l3_stalled", L3_STALLABLE)
        self._zero("l3_deadline_misses", ("query", "prefetch", "meta"))
        self._zero_hist("l3_seconds", ("query", "prefetch", "put", "remove", "meta"))
        self._zero_hist("l3_batch_seconds", ("get", "put"))
        if process_metrics:
            ProcessCollector(registry=self.registry)

    def _zero(self, name: str, *values: tuple[str, ...]) -> None:
        keys: list[tuple[str, ...]] = [()]
        for vals in values:
            keys = [k + (v,) for k in keys for v in vals]
        for k in keys:
            self._values[name].setdefault(k, 0.0)

    def _zero_hist(self, name: str, values: tuple[str, ...]) -> None:
        for v in values:
            self._hist[name].setdefault((v,), [[0] * (len(LATENCY_BUCKETS) + 1), 0.0])

    def declare_pools(self, pools: Iterable[str]) -> None:
        """Series at 0 for the bytes and rows of every pool of the served layout."""
        pools = tuple(pools)
        with self._lock:
            self._zero("transfer_bytes", DIRECTIONS, pools)
            self._zero("transfer_rows", DIRECTIONS, pools)

    # ---------------------------------------------------------------- recording
    def inc(self, name: str, amount: float = 1, *labels: str) -> None:
        d = self._values[name]
        with self._lock:
            d[labels] = d.get(labels, 0.0) + amount

    def set(self, name: str, value: float, *labels: str) -> None:
        d = self._values[name]
        with self._lock:
            d[labels] = float(value)

    def observe(self, name: str, value: float, *labels: str) -> None:
        d = self._hist[name]
        i = bisect_left(LATENCY_BUCKETS, value)
        with self._lock:
            h = d.get(labels)
            if h is None:
                h = d[labels] = [[0] * (len(LATENCY_BUCKETS) + 1), 0.0]
            h[0][i] += 1
            h[1] += value

    def command(self, cmd: str, ok: bool, seconds: float, code: str | None = None) -> None:
        """One handled command (queued; see ``flush``)."""
        q = self._queue
        q.append((cmd, ok, seconds, code))
        if len(q) >= FLUSH_AT:
            self.flush()

    def transfer(self, direction: str, status: str, seconds: float, exec_seconds: float,
                 per_pool: dict[str, tuple[int, int]], path: str) -> None:
        """One completed op (``status`` one of ``OP_STATUSES``): per_pool = {pool: (rows,
        bytes)}, counted only when it succeeded; a failed one counts as an error, a cancelled
        one only in ``transfer_ops`` (queued; see ``flush``)."""
        q = self._queue
        q.append((direction, status, seconds, exec_seconds, per_pool, path))
        if len(q) >= FLUSH_AT:
            self.flush()

    def flush(self) -> None:
        """Apply every queued ``command`` / ``transfer`` record (any thread)."""
        q = self._queue
        if not q:
            return
        v, hists = self._values, self._hist
        cmds, errs, cmd_h = v["commands"], v["errors"], hists["command_seconds"]
        ops, rows_d, bytes_d = v["transfer_ops"], v["transfer_rows"], v["transfer_bytes"]
        paths, busy, xfer_h = v["transfer_path_ops"], v["transfer_busy_seconds"], \
            hists["transfer_seconds"]
        nb = len(LATENCY_BUCKETS) + 1
        with self._lock:
            while q:
                try:
                    r = q.popleft()
                except IndexError:  # another thread took the last one
                    break
                if len(r) == 4:
                    cmd, ok, seconds, code = r
                    key = (cmd, "ok" if ok else "error")
                    cmds[key] = cmds.get(key, 0.0) + 1
                    hist, hkey = cmd_h, (cmd,)
                    if not ok:
                        ek = (code or "internal",)
                        errs[ek] = errs.get(ek, 0.0) + 1
                else:
                    direction, status, seconds, exec_seconds, per_pool, path = r
                    okey = (direction, status)
                    ops[okey] = ops.get(okey, 0.0) + 1
                    hist, hkey = xfer_h, (direction,)
                    if status == "cancelled":
                        continue  # no latency, no bytes: it did not run to its end
                    if status != "ok":
                        errs[("transfer",)] = errs.get(("transfer",), 0.0) + 1
                    else:
                        for pool, (rows, nbytes) in per_pool.items():
                            k = (direction, pool)
                            rows_d[k] = rows_d.get(k, 0.0) + rows
                            bytes_d[k] = bytes_d.get(k, 0.0) + nbytes
                        for p in filter(None, path.split("+")):
                            pk = (direction, p)
                            paths[pk] = paths.get(pk, 0.0) + 1
                        busy[hkey] = busy.get(hkey, 0.0) + max(0.0, exec_seconds)
                h = hist.get(hkey)
                if h is None:
                    h = hist[hkey] = [[0] * nb, 0.0]
                h[0][bisect_left(LATENCY_BUCKETS, seconds)] += 1
                h[1] += seconds

    def in_flight(self, direction: str, delta: int) -> None:
        self.inc("transfers_in_flight", delta, direction)

    def fallback(self, what: str) -> None:
        self.inc("fallbacks", 1, what)

    def value(self, name: str, *labels: str) -> float:
        """Current value of a counter or gauge sample (0 when never recorded)."""
        self.flush()
        return self._values[name].get(labels, 0.0)

    # ---------------------------------------------------------------- export
    def _copy(self) -> tuple[Values, Hists]:
        """Every value, flushed and copied under the lock (what the readers format)."""
        self.flush()
        with self._lock:
            values = {k: list(v.items()) for k, v in self._values.items()}
            hists = {k: [(lab, list(h[0]), h[1]) for lab, h in v.items()]
                     for k, v in self._hist.items()}
        return values, hists

    def snapshot(self) -> dict[str, list[dict[str, Any]]]:
        """{sample name: [{"labels": {...}, "value": v}]} of the catalog (the exposition's
        samples; NaN and infinities as None); histograms give only _sum and _count (an int)."""
        values, hists = self._copy()
        out: dict[str, list[dict[str, Any]]] = {}

        def add(name: str, d: MetricDef, labels: tuple[str, ...], v: float) -> None:
            out.setdefault(name, []).append({"labels": dict(zip(d.labels, labels)),
                                             "value": v if math.isfinite(v) else None})

        for d in CATALOG:
            name = self.PREFIX + d.name
            if d.kind == "histogram":
                for labels, counts, total in hists[d.name]:
                    add(name + "_count", d, labels, sum(counts))
                    add(name + "_sum", d, labels, total)
            else:
                for labels, v in values[d.name]:
                    add(name + ("_total" if d.kind == "counter" else ""), d, labels, v)
        return out

    def exposition(self) -> str:
        """The Prometheus text format of everything (what /metrics serves): the catalog, then
        the ``process_*`` metrics."""
        return self._text.render(*self._copy()) + generate_latest(self.registry).decode()

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        """Start the /metrics endpoint on a daemon thread; returns the bound port."""
        self._http = MetricsHttp(lambda: self.exposition().encode(), port, addr)
        return self._http.port

    def close(self) -> None:
        if self._http is not None:
            self._http.close()
            self._http = None


def markdown() -> str:
    """The metric table of docs/metrics.md."""
    rows = ["| metric | type | labels | question it answers |", "|---|---|---|---|"]
    for d in CATALOG:
        name = Metrics.PREFIX + d.name + ("_total" if d.kind == "counter" else "")
        cell = f"{d.question} <br>{d.help}".replace("|", "\\|")
        rows.append(f"| `{name}` | {d.kind} | {', '.join(d.labels) or '—'} | {cell} |")
    return "\n".join(rows)


if __name__ == "__main__":
    from hicache.core.stdout import print_all

    sys.exit(print_all(markdown()))
