"""``bench e2e --mirror checkpoints``: what a resume loads when the host tier keeps compressed
pages plus one checkpoint per prefix (DESIGN §15), instead of a full mirror of every pool.

``one_size_ckpt(c, pools, layout, n, runs, rng, local, limit, cuda, dev, probe)`` measures one
prefix of ``n`` pages, ``runs`` times (``probe`` False: without the engine's probe steps). Per
run:

* BACKUP: the ``n`` page rows of the ``page`` space (device rows scattered at random) and one
  checkpoint (the boundary page's SWA tail tokens and its C4 / C4-indexer compress-state rows,
  from a random ``swa_page`` device row) into host rows allocated for it; command -> ack;
* LOAD of the same into other device rows, timed as the full mirror's (``e2e.timed_load``:
  first and last stage layer ready from the engine's stream after its per-layer waits, ack);
* the same load by the kernels in-process (``e2e.inproc_into``, byte-checked as the
  daemon's), a load while a backup of the same shape streams, and the engine's probe steps
  while that load, then that backup, runs (``e2e_engine.probe_rounds``, after the size's last
  timed run).

Every loaded byte is verified once per size: the page rows, the tail tokens (value and scale)
and the state rows; on a GPU, in one more untimed load, each stage layer's at that layer's
ready event too (``e2e_measure.layers_checked_load``; with layers this small, a few MB, the
copy has usually ended by the time the engine hears of the layer, so that check catches an
event that fired early only by more than that). Bytes per load:
``ResumeModel.load_bytes(n, "checkpoints")``. The summary has the same keys as the full
mirror's (``e2e.summarize``).
"""
from __future__ import annotations

from typing import Any

import numpy as np
import torch

from hicache.bench import e2e_measure as e2e
from hicache.bench.device_order import device_order
from hicache.bench.transfer_rows import mean_run
from hicache.bench.e2e_engine import new_waits, probe_rounds
from hicache.core.layout import Layout
from hicache.core.resume import ResumeModel
from hicache.engine.client import Client
from hicache.engine.device_pools import DevicePools
from hicache.engine.hooks import ClientHooks
from hicache.kernels.tables import TokenFormat


def one_size_ckpt(c: Client, pools: DevicePools, layout: Layout, n: int, runs: int,
                  rng: np.random.Generator, local: Any, limit: dict[str, Any], cuda: bool,
                  dev: torch.device, probe: bool = True, busy: bool = True,
                  order: str = "random", idle_s: float = 0.0) -> dict[str, Any]:
    resume = ResumeModel(layout)
    if resume.checkpoint_space != "swa_page":
        raise RuntimeError("the checkpoints mirror bench needs paged SWA")
    hooks = ClientHooks(c, ("page",), resume=resume)
    nbytes = resume.load_bytes(n, "checkpoints")
    stream = torch.cuda.current_stream(dev) if cuda else None
    out: dict[str, list[float]] = {k: [] for k in e2e.FIGURES}
    waits = new_waits()
    verified = False
    dev_runs: list[float] = []
    host_runs: list[float] = []  # the mean run of each timed backup's host rows
    for r in range(runs):
        pp = device_order(order, pools.rows["page"], rng)
        sp = device_order(order, pools.rows["swa_page"], rng)
        src, dst = pp[:n].tolist(), pp[n:2 * n].tolist()
        dev_runs.append(mean_run(torch.from_numpy(pp[n:2 * n])))
        check = again = None
        if not verified:  # this run's loads are compared byte for byte, right after each
            ck_rows = [int(sp[0]), int(sp[1])]

            def again() -> None:  # the busy load's destination: fresh bytes again
                e2e.scramble(pools, {**{p.name: dst for p in resume.page_pools},
                                     **{p.name: [int(sp[1])] for p in resume.state_pools},
                                     **({resume.swa_pool.name: [int(sp[1])]}
                                        if resume.swa_pool is not None else {})}, seed=seed + 1)
            seed = int(rng.integers(1 << 30))  # this call's own bytes (e2e.one_size)
            e2e.scramble(pools, {**{p.name: src + dst for p in resume.page_pools},
                                 **{p.name: ck_rows for p in resume.state_pools},
                                 **({resume.swa_pool.name: ck_rows}
                                    if resume.swa_pool is not None else {})}, seed=seed)

            rest = e2e.untouched(pools, {**{p.name: dst for p in resume.page_pools},
                                         **{p.name: [int(sp[1])] for p in resume.state_pools},
                                         **({resume.swa_pool.name: [int(sp[1])]}
                                            if resume.swa_pool is not None else {})})

            def check() -> None:
                if cuda:
                    torch.cuda.synchronize(dev)
                _verify(pools, resume, src, dst, int(sp[0]), int(sp[1]))
                rest()
        host = c.alloc({"page": n, "swa_page": 1})
        host_runs.append(mean_run(torch.tensor(host["page"])))
        ck = host["swa_page"][0]
        items = {"page": (src, host["page"])}
        items.update(hooks.checkpoint_items([(int(sp[0]), ck, n)], to_host=True))
        if cuda:
            torch.cuda.synchronize(dev)
        t0 = e2e.now()
        c.wait_ack(c.backup(items), timeout=120)
        out["backup_ack"].append(e2e.now() - t0)
        load = {"page": (host["page"], dst)}
        load.update(hooks.checkpoint_items([(int(sp[1]), ck, n)], to_host=False))
        e2e.load_into(out, c, load, stream, cuda, check, busy)
        if cuda and check is not None and again is not None:  # each layer at its event
            again()
            e2e.layers_checked_load(c, load, stream, e2e.layer_compare(
                pools, layout, _pairs(resume, src, dst, int(sp[0]), int(sp[1])), dev))
            check()
        verified = True
        if cuda and idle_s:  # the same load once the daemon's loop slept
            e2e.idle_load(out, c, load, stream, cuda, idle_s)
        if local is not None:
            e2e.inproc_into(out, local, layout, load, dev,
                            None if check is None else (items, again, check))
        if cuda and busy:  # a load while backups of the same shape stream
            others = [c.alloc({"page": n, "swa_page": 1}) for _ in range(e2e.BUSY_BACKUPS)]
            bitems = []
            for other in others:
                bitems.append({"page": (src, other["page"])})  # the load's sources: read by all
                bitems[-1].update(hooks.checkpoint_items(
                    [(int(sp[2]), other["swa_page"][0], n)], to_host=True))
            if again is not None:
                again()
            begun = e2e.busy_start(stream, dev)
            todo = iter(bitems)
            sent = e2e.stream_backups(lambda: c.backup(next(todo)))
            e2e.load_while_busy(out, c, load, stream, cuda, begun, sent)
            if check is not None:
                check()
            if probe and r == runs - 1:  # after the timed runs: the engine's own steps
                probe_rounds(waits, c, stream, dev, lambda: c.load(load),
                             lambda: c.backup(bitems[0]), lambda op: None)
            for other in others:
                c.free(other)
        c.free(host)
    summary = e2e.summarize(out, n, nbytes, limit, cuda, verified, waits if cuda else None)
    summary["summary"]["device_mean_run"] = float(np.mean(dev_runs))  # the loads' destinations
    summary["summary"]["host_mean_run"] = float(np.mean(host_runs))  # their sources
    return summary


def _tail_spans(resume: ResumeModel) -> list[tuple[int, int]]:
    """The byte ranges of a paged-SWA row that a checkpoint's tail tokens occupy: their
    values, then their scales (consecutive slots)."""
    assert resume.swa_pool is not None
    fmt = TokenFormat.from_spec(resume.swa_pool)
    vb, sb, so = fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
    a, b = resume.tail_offsets.start, resume.tail_offsets.stop
    return [(a * vb, b * vb), (so + a * sb, so + b * sb)]


def _pairs(resume: ResumeModel, src: list[int], dst: list[int], ck_src: int,
           ck_dst: int) -> e2e.Pairs:
    """What a checkpoints load writes, for ``e2e_measure.layer_compare``: the page rows, the
    checkpoint's state rows, and its SWA row's tail tokens."""
    out: e2e.Pairs = {p.name: (src, dst, None) for p in resume.page_pools}
    out.update({p.name: ([ck_src], [ck_dst], None) for p in resume.state_pools})
    if resume.swa_pool is not None:
        out[resume.swa_pool.name] = ([ck_src], [ck_dst], _tail_spans(resume))
    return out


def _verify(pools: DevicePools, resume: ResumeModel, src: list[int], dst: list[int],
            ck_src: int, ck_dst: int) -> None:
    """Raise unless every loaded byte equals its source: page rows, tail tokens, state rows."""
    for spec in resume.page_pools:
        dev = pools.layers[spec.name][0].device
        s_i, d_i = torch.tensor(src, device=dev), torch.tensor(dst, device=dev)
        for t in pools.layers[spec.name]:
            if not torch.equal(t.index_select(0, s_i), t.index_select(0, d_i)):
                raise RuntimeError(f"checkpoints load of {len(src)} pages: pool {spec.name} "
                                   f"differs")
    for spec in resume.state_pools:
        for t in pools.layers[spec.name]:
            if not torch.equal(t[ck_src], t[ck_dst]):
                raise RuntimeError(f"checkpoint state pool {spec.name} differs")
    if resume.swa_pool is not None:
        a, b = resume.tail_offsets.start, resume.tail_offsets.stop
        for t in pools.layers[resume.swa_pool.name]:
            for x, y in _tail_spans(resume):
                if not torch.equal(t[ck_src, x:y], t[ck_dst, x:y]):
                    raise RuntimeError(f"checkpoint SWA tail tokens [{a}, {b}) differ")
