"""Staged row copy between device rows and runs of host rows: a few-CTA gather (or scatter) on
the device side plus copy-engine DMAs on the host side.

Device→host: the ``rows`` kernel gathers a chunk of device rows into a device staging buffer,
then one ``cudaMemcpyAsync`` per run of consecutive host rows (per layer) moves the chunk to the
host. Host→device: the DMAs fill the staging buffer, then the kernel scatters it into device
rows. Each caller stream has a lane: ONE kernel stream (so the SM cost is exactly ``ctas`` CTAs
at any moment: kernels of consecutive chunks never overlap), ``dma_streams`` DMA streams used
round robin, and ``buffers`` staging buffers handed between kernel and DMAs by per-buffer
events. Chunk ``k``'s DMA overlaps the kernel of chunk ``k + 1``; the caller's stream waits for
all of them at the end. Measured on an H200 (C4 rows, 4 CTAs): one DMA stream per lane reached
0.97-0.98 of the link per direction but only ~0.8 with a backup and a swap-in at once; three
reach 0.96-0.98 per direction and 0.95-0.99 of the both-directions limit together; kernels on
several streams (the first design) exceeded the CTA budget and lost 3-5% on H2D. Host issue
time matters when two directions are issued at once, so the loop switches streams directly
and uploads the staging pointer tables before the call (on the caller's stream, before the
event both lane streams wait on). Chunks are balanced (equal rows per chunk) and span several
layers when one layer's rows are smaller than a chunk, to keep the launches per call few.

Worth it only when host rows come in runs (an allocator that hands out consecutive rows):
``plan_runs`` measures that and ``dispatch`` falls back to the zero-copy kernel otherwise.
Host-side work per call: one kernel launch per chunk plus one DMA per (run piece, layer).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from .rows import RowsConfig, launch_rows
from .streams import current_stream
from .tables import LayerTable, _pow2_align


@dataclass(frozen=True)
class StagedConfig:
    """``chunk_bytes`` of staging per buffer, ``buffers`` buffers and ``dma_streams`` DMA
    streams per caller stream, and the launch shape of the gather/scatter kernel."""

    chunk_bytes: int = 32 << 20
    buffers: int = 3
    dma_streams: int = 3
    rows: RowsConfig = RowsConfig(piece_bytes=2048, pieces=64, num_warps=32)


def plan_runs(host_idx: torch.Tensor) -> torch.Tensor:
    """Start positions of runs of consecutive host rows in ``host_idx`` (a CPU int64 tensor)."""
    n = host_idx.numel()
    if n == 0:
        return torch.zeros(0, dtype=torch.int64)
    brk = torch.ones(n, dtype=torch.bool)
    brk[1:] = host_idx[1:] != host_idx[:-1] + 1
    return torch.nonzero(brk).flatten()


class _Lane:
    """Per (device, caller stream, shape): a kernel stream, DMA streams, staging buffers with
    their hand-over events (``filled``: the producer is done; ``free``: the consumer is done)
    and cached pointer tables."""

    def __init__(self, device: torch.device, nbytes: int, buffers: int,
                 dma_streams: int) -> None:
        self.kernel = torch.cuda.Stream(device=device)
        self.dmas = [torch.cuda.Stream(device=device) for _ in range(dma_streams)]
        self.filled = [torch.cuda.Event() for _ in range(buffers)]
        self.free = [torch.cuda.Event() for _ in range(buffers)]
        self.used = [False] * buffers  # whether ``free[b]`` has been recorded yet
        self.bufs = [torch.empty(nbytes, dtype=torch.uint8, device=device) for _ in range(buffers)]
        self.pos = torch.arange(max(1, nbytes // 64), dtype=torch.int64, device=device)
        self._tabs: dict[tuple[int, int, int], torch.Tensor] = {}
        self._views: dict[tuple[int, int, int, int], torch.Tensor] = {}

    def view(self, b: int, start: int, rows: int, rb: int) -> torch.Tensor:
        """[rows, rb] view of buffer ``b`` at byte ``start`` (cached: calls repeat shapes)."""
        key = (b, start, rows, rb)
        v = self._views.get(key)
        if v is None:
            if len(self._views) > 4096:
                self._views.clear()
            v = self._views[key] = self.bufs[b][start: start + rows * rb].view(rows, rb)
        return v

    def table(self, b: int, layers: int, slab: int) -> torch.Tensor:
        """Pointer table of buffer ``b`` cut into ``layers`` slabs of ``slab`` bytes."""
        key = (b, layers, slab)
        t = self._tabs.get(key)
        if t is None:
            base = self.bufs[b].data_ptr()
            t = torch.tensor([base + k * slab for k in range(layers)], dtype=torch.int64)
            t = self._tabs[key] = t.pin_memory().to(self.bufs[b].device, non_blocking=True)
        return t


_LANES: dict[tuple, _Lane] = {}


def _lane(device: torch.device, stream: torch.cuda.Stream, cfg: StagedConfig) -> _Lane:
    key = (device, stream.cuda_stream, cfg.chunk_bytes, cfg.buffers, cfg.dma_streams)
    lane = _LANES.get(key)
    if lane is None:
        lane = _LANES[key] = _Lane(device, cfg.chunk_bytes, cfg.buffers, cfg.dma_streams)
    return lane


def _balanced(total: int, cap: int) -> int:
    """Largest even split of ``total`` into parts of at most ``cap``."""
    parts = -(-total // max(1, cap))
    return -(-total // parts)


def _run_pieces(runs: torch.Tensor, host_idx: torch.Tensor, n: int,
                c: int) -> list[list[tuple[int, int, int]]]:
    """Per item chunk: [(staging position, rows, first host row)] cut from the host runs."""
    starts = runs.tolist() + [n]
    first = host_idx[runs].tolist()
    out: list[list[tuple[int, int, int]]] = []
    r = 0
    for i0 in range(0, n, c):
        i1 = min(n, i0 + c)
        while starts[r + 1] <= i0:
            r += 1
        cur: list[tuple[int, int, int]] = []
        j = r
        while starts[j] < i1:
            a, b = max(starts[j], i0), min(starts[j + 1], i1)
            cur.append((a - i0, b - a, first[j] + (a - starts[j])))
            j += 1
        out.append(cur)
    return out


def copy_rows_staged(src: LayerTable, dst: LayerTable, src_idx: torch.Tensor,
                     dst_idx: torch.Tensor, host_idx: torch.Tensor, runs: torch.Tensor, *,
                     ctas: int, cfg: StagedConfig = StagedConfig()) -> None:
    """Copy rows between a device buffer and a host buffer whose rows are packed.

    The device-side indices must be on the device; ``host_idx`` is the host side's index list
    on the CPU and ``runs`` its run starts (``plan_runs``). Runs on the caller's current stream.
    """
    d2h = src.is_cuda
    dev_tab, host_tab = (src, dst) if d2h else (dst, src)
    dev_idx = src_idx if d2h else dst_idx
    device = dev_tab.device
    L, rb, n = src.num_layers, src.row_bytes, int(dev_idx.numel())
    if n == 0:
        return
    if rb > cfg.chunk_bytes:
        raise ValueError(f"row of {rb} B exceeds the staging chunk of {cfg.chunk_bytes} B")
    caller = current_stream(device)
    lane = _lane(device, caller, cfg)
    c = _balanced(n, min(cfg.chunk_bytes // rb, lane.pos.numel()))
    kl = _balanced(L, cfg.chunk_bytes // (n * rb)) if c == n else 1
    # one layer's slab of a staging buffer: a fixed share of it (512-B aligned) rather than
    # c * rb, so the pointer tables are keyed by (buffer, layers) alone and their cache stays
    # bounded however call sizes vary (cached tables are never freed: a kernel may read them)
    slab = max(c * rb, cfg.chunk_bytes // kl // 512 * 512)
    pieces = _run_pieces(runs, host_idx, n, c)
    pos = lane.pos
    align = min(dev_tab.align, _pow2_align(rb, slab))
    dev_table = dev_tab.table(device)
    host_layers = host_tab.layers
    nb, nd, k = len(lane.bufs), len(lane.dmas), 0
    # staging pointer tables, uploaded (once, then cached) on the caller's stream before
    # ``ready``: the kernel stream must never read a table whose upload it does not wait for
    stabs = {(b, nl): lane.table(b, nl, slab) for b in range(nb) for nl in {kl, L % kl or kl}}
    ready = torch.cuda.Event()
    ready.record(caller)
    ks = lane.kernel
    ks.wait_event(ready)
    for ds in lane.dmas:
        ds.wait_event(ready)
    chunks = [(dev_idx[i0:i0 + c], pos[:min(c, n - i0)]) for i0 in range(0, n, c)]
    set_stream = torch.cuda.set_stream
    try:  # streams are switched directly (a context manager per chunk costs more host time)
        for l0 in range(0, L, kl):
            nl = min(kl, L - l0)
            tab_l = dev_table[l0:l0 + nl]
            for ci, (idx_c, pos_c) in enumerate(chunks):
                b = k % nb
                ds = lane.dmas[k % nd]
                k += 1
                stab = stabs[b, nl]
                # d2h: the kernel fills a buffer, the DMAs empty it; h2d: the other way round
                prod, cons = (ks, ds) if d2h else (ds, ks)
                if lane.used[b]:  # the buffer's last consumer must be done before a refill
                    prod.wait_event(lane.free[b])
                if d2h:
                    set_stream(ks)
                    launch_rows(tab_l, stab, idx_c, pos_c, num_layers=nl, row_bytes=rb,
                                src_stride=dev_tab.stride, dst_stride=rb, align=align,
                                ctas=ctas, cfg=cfg.rows)
                    lane.filled[b].record(ks)
                    ds.wait_event(lane.filled[b])
                set_stream(ds)
                for li in range(nl):
                    host_layer = host_layers[l0 + li]
                    base = li * slab
                    for p, ln, h in pieces[ci]:
                        sv = lane.view(b, base + p * rb, ln, rb)
                        if d2h:
                            host_layer[h: h + ln].copy_(sv, non_blocking=True)
                        else:
                            sv.copy_(host_layer[h: h + ln], non_blocking=True)
                if not d2h:
                    lane.filled[b].record(ds)
                    ks.wait_event(lane.filled[b])
                    set_stream(ks)
                    launch_rows(stab, tab_l, pos_c, idx_c, num_layers=nl, row_bytes=rb,
                                src_stride=rb, dst_stride=dev_tab.stride, align=align,
                                ctas=ctas, cfg=cfg.rows)
                lane.free[b].record(cons)
                lane.used[b] = True
    finally:  # also when a launch failed part way: what went out completes before the caller's
        set_stream(caller)  # next work (its rows are not freed under an orphaned copy)
        caller.wait_stream(ks)
        for ds in lane.dmas:
            caller.wait_stream(ds)
