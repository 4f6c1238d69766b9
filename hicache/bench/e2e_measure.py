"""The measurements ``bench e2e`` takes of one load, shared by both mirrors (``e2e``,
``e2e_checkpoint``): a timed LOAD through the daemon with the engine's per-layer waits, the same
load by the kernels in-process, and the per-size summary.

* ``timed_load(c, items, stream, cuda) -> LoadTimes`` (``load_into`` appends them to a size's
  figures): seconds from the command to the first, second and last stage layer ready (CUDA
  events on the engine's stream after its waits) and to the ack; CPU mode: the ack for all
  four; and (GPU) the command -> reply time, which ``load_into`` (solo loads only) appends to
  ``REPLY``. The second layer is the first that the
  daemon issues after its reply: when it is ready says whether an engine's forward pass can
  follow the load layer by layer or must wait for the whole issue.
* ``scramble(pools, rows, seed)``: fresh random bytes in those device rows before the run whose
  load is verified, so the comparison cannot pass on rows that already held equal bytes.
* ``layers_checked_load(c, items, stream, compare)`` (GPU, the size's verified run, untimed):
  one more load into rows given fresh bytes, each stage layer's rows compared on the engine's
  stream right after its wait on that layer's event (``layer_compare(...) -> compare``): a
  layer event that fired before its copy ended fails it, which the check after the whole load
  could not see.
* ``untouched(pools, written) -> check``: per-row weighted sums of every device row outside
  ``written`` now; ``check()`` raises if any changed since (a load that wrote stray rows).
* ``command_during_load(c, items) -> seconds`` (``load_into`` appends it too): the round trip
  of a heartbeat sent right after a load's reply, while the daemon issues its later layers:
  how long the engine's next command waits behind a load.
* ``inproc_load(local, layout, items, dev) -> seconds``: the same items copied layer by
  layer by ``dispatch.copy_by_layer`` in this process, on a stream of its own (GPU time); its
  host time goes to ``ISSUE``. ``inproc_into`` appends it to a size's figures and, in the
  size's verified run, fills its source rows in-process from the device first and compares
  every byte it loaded after, as for the daemon's load.
* ``stream_backups(send, k)``: ``k`` backups (``BUSY_BACKUPS``) sent back to back, each with
  its send time. ``load_while_busy(out, c, items, stream, cuda, begun, backups)``: the same
  timed load while those backups stream; its second and last layer go to ``out``, then the
  end of the last backup (every ack awaited).
* ``idle_load(out, c, items, stream, cuda, idle_s)``: the same timed load after ``idle_s``
  with nothing sent (past the daemon's busy-poll window): its first and last layer.
* ``summarize(out, n, nbytes, limit, cuda, verified, waits)``: medians of ``FIGURES`` (and
  the slowest run's second layer), GB/s, ratios to the limit, and (``waits``, GPU) the
  engine's probe steps per kind (``e2e_engine``: ``engine_wait``); empties ``REPLY`` and
  ``ISSUE``.
"""
from __future__ import annotations

import statistics
import time
from typing import Any, Callable, NamedTuple, Optional

import numpy as np
import torch

from hicache.bench.e2e_engine import wait_stats
from hicache.core.layout import Layout
from hicache.engine.acks import Op
from hicache.engine.client import Client
from hicache.kernels.dispatch import copy_by_layer, layer_parts
from hicache.kernels.tables import TokenFormat

INPROC_CTAS = 4  # the daemon's default CTA budget; the in-process copy uses the same
# the in-process copy's stream per GPU: a stream of its own, as an engine's copy stream (the
# legacy default stream takes no copy-engine batches: they would go through a fenced side stream)
_INPROC_STREAMS: dict[int, "torch.cuda.Stream"] = {}
FIGURES = ("backup_ack", "load_first", "load_second", "load_last", "load_ack", "inproc_last",
           "busy_second", "busy_last", "busy_backup_end", "cmd_during_load", "idle_first",
           "idle_last", "idle_reply")
# an idle load waits this much past the daemon's busy-poll window: its loop sleeps in poll
IDLE_MARGIN_S = 0.02
ISSUE: list[float] = []  # host time of the in-process copy_by_layer call (plan + launches)
REPLY: list[float] = []  # command -> reply of each solo timed GPU load (the daemon's issue time)
now = time.perf_counter


def _median(xs: list[float]) -> float:
    return float(statistics.median(xs)) if xs else float("nan")


def summarize(out: dict[str, list[float]], n: int, nbytes: int, limit: dict[str, Any],
              cuda: bool, verified: bool,
              waits: Optional[dict[str, list[float]]] = None) -> dict[str, Any]:
    """Medians of one size's runs (``FIGURES``), GB/s and ratios to the limit; the engine's
    probe steps (``waits``) as p50 / p99 / max per kind, None where none were taken."""
    med = {k: _median(v) for k, v in out.items()}
    reply_ms = _median(REPLY) * 1e3 if REPLY else None
    issue_ms = _median(ISSUE) * 1e3 if ISSUE else None
    REPLY.clear()
    ISSUE.clear()
    summary = {
        "pages": n, "bytes": nbytes,
        "load_first_ms": med["load_first"] * 1e3, "load_second_ms": med["load_second"] * 1e3,
        # the slowest run's second layer: a median hides a layer 1 that comes only with the
        # last layer in a minority of the loads (seen at 8k tokens on an H200)
        "load_second_max_ms": max(out["load_second"], default=float("nan")) * 1e3,
        "load_last_ms": med["load_last"] * 1e3,
        "load_ack_ms": med["load_ack"] * 1e3, "backup_ack_ms": med["backup_ack"] * 1e3,
        "load_reply_ms": reply_ms, "inproc_issue_ms": issue_ms,
        "load_gbps": nbytes / med["load_last"] / 1e9,
        "backup_gbps": nbytes / med["backup_ack"] / 1e9,
        "load_ratio": nbytes / med["load_last"] / 1e9 / limit["h2d"] if cuda else None,
        "backup_ratio": nbytes / med["backup_ack"] / 1e9 / limit["d2h"] if cuda else None,
        "daemon_vs_inproc": med["load_last"] / med["inproc_last"] if out["inproc_last"] else None,
        "busy_vs_solo": med["load_last"] / med["busy_last"] if out["busy_last"] else None,
        # the second layer of a load while a backup streams: a layer's event held back by the
        # backup stream's copies shows here, not in the last layer's rate
        "busy_second_ms": med["busy_second"] * 1e3 if out["busy_second"] else None,
        # whether the backup still streamed when the busy load's last layer was ready: its
        # end (the daemon's time from its command to its completion) against that layer's
        # time, in each run; below 1, some busy loads ended beside an idle backup stream
        "busy_backup_end_ms": med["busy_backup_end"] * 1e3 if out["busy_backup_end"] else None,
        "busy_covered": (sum(b >= t for b, t in zip(out["busy_backup_end"], out["busy_last"]))
                         / len(out["busy_backup_end"])) if out["busy_backup_end"] else None,
        "load_cmd_ms": med["cmd_during_load"] * 1e3 if out["cmd_during_load"] else None,
        # a load sent once the daemon's loop had slept past its busy-poll window (``idle_load``)
        "idle_first_ms": med["idle_first"] * 1e3 if out["idle_first"] else None,
        "idle_last_ms": med["idle_last"] * 1e3 if out["idle_last"] else None,
        # its command -> reply (layer 0 is issued before the reply): against ``load_reply_ms``,
        # whether the quiet spell's extra time comes before the daemon's reply or after it
        "idle_reply_ms": med["idle_reply"] * 1e3 if out["idle_reply"] else None,
        "verified": verified,
        "engine_wait": {k: wait_stats(v) for k, v in waits.items()} if waits else None,
    }
    return {"summary": summary, "runs": out}


def load_into(out: dict[str, list[float]], c: Client, items: dict[str, tuple], stream: Any,
              cuda: bool, check: Optional[Callable[[], None]] = None,
              busy: bool = True) -> None:
    """``timed_load`` of ``items``, its four times appended to ``out`` (``FIGURES``) and its
    reply time to ``REPLY``; ``check()`` (the byte comparison) right after it, before
    ``command_during_load`` (with ``busy``; not in the solo runs the daemon's handling times
    are read over, where its second LOAD doubled their count) loads the same items again."""
    t = timed_load(c, items, stream, cuda)
    out["load_first"].append(t.first)
    out["load_second"].append(t.second)
    out["load_last"].append(t.last)
    out["load_ack"].append(t.ack)
    if t.reply is not None:
        REPLY.append(t.reply)
    if check is not None:
        check()
    if busy:
        out["cmd_during_load"].append(command_during_load(c, items))


def idle_load(out: dict[str, list[float]], c: Client, items: dict[str, tuple], stream: Any,
              cuda: bool, idle_s: float) -> None:
    """``timed_load`` of ``items`` after ``idle_s`` with nothing sent (the daemon's busy-poll
    window and ``IDLE_MARGIN_S``): what an engine's first load after a quiet spell sees, whose
    request wakes a sleeping loop. Its first and last layer, and (GPU) its reply, go to
    ``out``."""
    if cuda:
        stream.synchronize()
    time.sleep(idle_s)
    t = timed_load(c, items, stream, cuda)
    out["idle_first"].append(t.first)
    out["idle_last"].append(t.last)
    if t.reply is not None:
        out["idle_reply"].append(t.reply)


Pairs = dict[str, tuple[list[int], list[int], Optional[list[tuple[int, int]]]]]


def layer_compare(pools: Any, layout: Layout, pairs: Pairs,
                  dev: torch.device) -> Callable[[int], torch.Tensor]:
    """``compare(g)``, enqueued on the current stream: how many destination rows of stage
    layer ``g`` differ from their source rows, as a 0-dim GPU tensor (no host wait).
    ``pairs``: {pool name: (source rows, destination rows, byte ranges of a row that the load
    writes, or None for the whole row)}; a pool without layer ``g`` is not read."""
    idx = {m: (torch.tensor(s_rows, device=dev), torch.tensor(d_rows, device=dev), spans)
           for m, (s_rows, d_rows, spans) in pairs.items()}

    def compare(g: int) -> torch.Tensor:
        bad = torch.zeros((), dtype=torch.int64, device=dev)
        for m, (s_i, d_i, spans) in idx.items():
            local = layout.local_id(m, g)
            if local is None:
                continue
            t = pools.layers[m][local]
            a, b = t.index_select(0, s_i), t.index_select(0, d_i)
            if spans is None:
                bad += (a != b).flatten(1).any(1).sum()
            else:
                bad += torch.stack([(a[:, x:y] != b[:, x:y]).any(1) for x, y in spans]).any(0).sum()
        return bad
    return compare


def layers_checked_load(c: Client, items: dict[str, tuple], stream: Any,
                        compare: Callable[[int], torch.Tensor]) -> None:
    """LOAD ``items`` (GPU, untimed) and compare each stage layer's bytes on the engine's
    stream right after its wait on that layer's event (``compare``, ``layer_compare``): a
    layer whose event fired before its copy ended would find rows not yet written (its
    destination holds other bytes first). The byte check after a whole load cannot see that:
    by then every layer has landed. The engine hears of a layer once the daemon issued it, so
    this catches an event that fired early by more than that (a copy still running when the
    engine looks). Raises ``RuntimeError`` naming the layers that were not in place."""
    if stream is not None:  # the destination's fresh bytes (queued writes) land first
        stream.synchronize()
    op = c.load(items)
    bad = []
    for g in c.stage_layers:
        c.wait_layer(op, g, stream)
        with torch.cuda.stream(stream):
            bad.append(compare(g))
    c.wait_ack(op, timeout=120)
    counts = torch.stack(bad).tolist()  # (waits for the stream)
    late = {g: k for g, k in zip(c.stage_layers, counts) if k}
    if late:
        raise RuntimeError(f"rows not yet loaded at their layer's ready event "
                           f"({{stage layer: rows}}): {late}")


def scramble(pools: Any, rows: dict[str, list[int]], seed: int) -> None:
    """Fresh random bytes in ``rows`` ({pool name: device rows}) of every layer, so a byte
    comparison after a load can only pass if the load moved them (rows that earlier runs
    copied onto each other could hold equal bytes already)."""
    for name, ids in rows.items():
        for k, t in enumerate(pools.layers[name]):
            g = torch.Generator(device=t.device).manual_seed(seed * 1009 + k)
            idx = torch.tensor(sorted(set(ids)), device=t.device)
            t.index_copy_(0, idx, torch.randint(0, 256, (len(idx), *t.shape[1:]),
                                                dtype=t.dtype, generator=g, device=t.device))


def untouched(pools: Any, written: dict[str, list[int]]) -> Callable[[], None]:
    """A check that every device row of ``pools`` outside ``written`` ({pool name: device
    rows}) still holds what it holds now (per row, a position-weighted sum of its 32-bit
    words, or bytes):
    the byte comparisons cover what a load wrote, this what it must not have."""
    def sums() -> dict[tuple[str, int], torch.Tensor]:
        out = {}
        for name, layers in pools.layers.items():
            for k, t in enumerate(layers):
                keep = torch.ones(t.shape[0], dtype=torch.bool, device=t.device)
                if written.get(name):
                    keep[torch.tensor(written[name], device=t.device)] = False
                rows = t[keep]
                words = (rows.view(torch.int32) if rows.shape[1] % 4 == 0 else rows).long()
                weights = torch.arange(1, words.shape[1] + 1, device=t.device)  # (a swap of
                out[(name, k)] = (words * weights).sum(dim=1)  # two words changes it too)
        return out

    before = sums()

    def check() -> None:
        for (name, k), now_sums in sums().items():
            if not torch.equal(now_sums, before[(name, k)]):
                raise RuntimeError(f"pool {name} layer {k}: rows outside the load's "
                                   f"destination changed")
    return check


def busy_start(stream: Any, dev: torch.device) -> tuple[Any, float]:
    """A start for a load that will run beside a backup, taken before that backup is sent:
    an event recorded on the engine's idle stream, and the host clock. An event recorded
    once the daemon's backup kernels run executes at a GPU time-slice boundary (up to ~1 ms
    late, a large share of a short load), so the busy load is timed from this one, less the
    host time from here to its command (``timed_load``'s ``begun``)."""
    torch.cuda.synchronize(dev)
    ev = torch.cuda.Event(enable_timing=True)
    ev.record(stream)
    return ev, time.perf_counter()


BUSY_BACKUPS = 2  # backups sent back to back beside a busy load: one of the load's size ended
# before that load's tail at 2k and 8k in almost every run (an H200, fifty-sixth session)


def stream_backups(send: Callable[[], Op], k: int = BUSY_BACKUPS) -> list[tuple[Op, float]]:
    """``k`` backups sent back to back (``send()`` sends one): each op with the host clock
    when it was sent, for ``load_while_busy``."""
    sent = []
    for _ in range(k):
        t = time.perf_counter()
        sent.append((send(), t))
    return sent


def load_while_busy(out: dict[str, list[float]], c: Client, items: dict[str, tuple],
                    stream: Any, cuda: bool, begun: tuple[Any, float],
                    backups: list[tuple[Op, float]]) -> None:
    """``timed_load`` of ``items`` while the caller's ``backups`` stream (``stream_backups``;
    ``begun``: its ``busy_start``, taken right before the first was sent): its second and
    last layer appended to ``out`` (``busy_second``, ``busy_last``), then every backup's ack
    awaited and the end of the last to finish appended (``busy_backup_end``: its host send
    time after ``begun`` plus the daemon's seconds from its command to its completion, on the
    same clock as the load's layers up to the host time of one send). A failed backup fails
    the run."""
    t = timed_load(c, items, stream, cuda, begun)
    out["busy_second"].append(t.second)
    out["busy_last"].append(t.last)
    end = 0.0
    for op, sent in backups:
        ack = c.wait_ack(op, timeout=120)
        if not ack.ok:
            raise RuntimeError(f"the busy run's backup failed: {ack.error}")
        end = max(end, sent - begun[1] + ack.seconds)
    out["busy_backup_end"].append(end)


def command_during_load(c: Client, items: dict[str, tuple]) -> float:
    """LOAD ``items``, then at once a heartbeat: its round trip in seconds (the load is
    waited for after it)."""
    op = c.load(items)
    t0 = now()
    c.heartbeat()
    t = now() - t0
    c.wait_ack(op, timeout=120)
    return t


class LoadTimes(NamedTuple):
    """Seconds from a LOAD command to its first, second and last stage layer ready, to its
    ack, and (GPU) to its reply."""

    first: float
    second: float
    last: float
    ack: float
    reply: Optional[float] = None


def timed_load(c: Client, items: dict[str, tuple], stream: Any, cuda: bool,
               begun: tuple[Any, float] | None = None) -> LoadTimes:
    """LOAD ``items`` (``Client.load``'s argument) with the engine's per-layer waits: its
    ``LoadTimes``. ``begun`` (GPU): a start event recorded earlier on the idle stream and the
    host clock then (``busy_start``); the layers are timed from it, less the host time
    between it and this command."""
    t0 = time.perf_counter()
    if not cuda:
        op = c.load(items)
        c.wait_ack(op, timeout=120)
        t = time.perf_counter() - t0
        return LoadTimes(t, t, t, t)
    if begun is None:
        start, gap = torch.cuda.Event(enable_timing=True), 0.0
        start.record(stream)
    else:
        start, gap = begun[0], t0 - begun[1]
    op = c.load(items)
    t_reply = time.perf_counter() - t0
    ready = []
    for g in c.stage_layers:
        c.wait_layer(op, g, stream)
        e = torch.cuda.Event(enable_timing=True)
        e.record(stream)
        ready.append(e)
    c.wait_ack(op, timeout=120)
    t_ack = time.perf_counter() - t0
    ready[-1].synchronize()
    at = [start.elapsed_time(e) * 1e-3 - gap for e in (ready[0], ready[min(1, len(ready) - 1)],
                                                        ready[-1])]
    return LoadTimes(at[0], at[1], at[2], t_ack, t_reply)


def inproc_load(local: Any, layout: Layout, items: dict[str, tuple],
                dev: torch.device, to_host: bool = False) -> float:
    """The load ``items`` (as ``Client.load`` takes them: a space's rows, a pool's rows, or a
    pool's tokens; host ids first) by the kernels alone, in this process, layer by layer (GPU
    time). ``to_host``: ``items`` as ``Client.backup`` takes them (device ids first), copied
    from the device into the in-process pool instead (untimed use: its issue time is not kept)."""
    _, tabs = local
    parts = []
    for name, spec in layout.pools.items():
        it = items.get(name, items.get(spec.index))
        if it is None:
            continue
        fmt = TokenFormat.from_spec(spec) if len(it) > 2 and it[2] == "token" else None
        dev_t, host_t = tabs[name]
        src, dst = (dev_t, host_t) if to_host else (host_t, dev_t)
        parts.extend(layer_parts(src, dst, np.asarray(it[0], dtype=np.int64),
                                 np.asarray(it[1], dtype=np.int64), fmt, spec.layers))
    order = layout.stage.layers("swa")
    stream = _INPROC_STREAMS.get(dev.index or 0)
    if stream is None:
        stream = _INPROC_STREAMS[dev.index or 0] = torch.cuda.Stream(dev)
    torch.cuda.synchronize(dev)
    s, e = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    s.record(stream)
    t0 = time.perf_counter()
    copy_by_layer(parts, order, device=dev, ctas=INPROC_CTAS, stream=stream)
    if not to_host:
        ISSUE.append(time.perf_counter() - t0)
    e.record(stream)
    e.synchronize()
    return s.elapsed_time(e) * 1e-3


def inproc_into(out: dict[str, list[float]], local: Any, layout: Layout,
                load: dict[str, tuple], dev: torch.device,
                verify: Optional[tuple[dict[str, tuple], Callable[[], None],
                                       Callable[[], None]]] = None) -> None:
    """The in-process load of ``load``, its GPU time appended to ``out["inproc_last"]``.
    ``verify`` (the size's verified run): ``(backup, fresh, check)``: the in-process pool's
    source rows are first filled from the device by the kernels (``backup``: the items of the
    daemon's backup, device ids first), the load's destination gets fresh bytes (``fresh``),
    and after the load ``check`` compares every loaded byte with its device source: the
    in-process copy is byte-checked as the daemon's is."""
    if verify is not None:
        backup, fresh, check = verify
        inproc_load(local, layout, backup, dev, to_host=True)
        fresh()
    out["inproc_last"].append(inproc_load(local, layout, load, dev))
    if verify is not None:
        check()
