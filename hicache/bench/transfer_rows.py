"""Host-row patterns and the byte check of ``bench transfer``, shared by its GPU and CPU runs.

* ``PATTERNS``: ``random`` (any free host row, uniformly: the zero-copy kernels' case) and
  ``runs`` (host rows as a run-forming allocator hands them out: the staged DMA path's case).
  Every comparison row of the bench names its pattern, and ours and the peer's rows of one
  pattern use the same host rows and device rows.
* ``parse_runs(spec) -> RunsSpec``: how ``runs`` rows are made. ``alloc:R`` (the default,
  ``alloc:32``): ``host_pools``' ``RowAllocator`` over the host rows, churned by ``CHURN_OPS``
  seeded mixed allocs and frees of 1..32 rows that fill the pool up to the rows the case needs
  and then keep it there (a cache at steady state: the free rows are the holes frees left),
  then requests of ``R`` rows until the case has its rows. ``fixed:N``: runs of exactly ``N``
  consecutive rows at random, non-overlapping places. A bad spec raises ``UsageError``.
* ``host_rows(pattern, rows, n, seed, spec, parts=1) -> int64 CPU tensor``: ``parts * n``
  distinct rows of ``[0, rows)``, deterministic for a seed; ``UsageError`` when the pool cannot
  hold them. The first ``n`` are the rows ``parts=1`` gives; with ``alloc:R`` each further
  ``n`` is allocated after random churn allocations were freed to make room for it (a full
  cache evicting), so every part has the runs of a pool at steady state.
* ``mean_run(*idx) -> float``: rows per run of consecutive ids, in the given order (what the
  staged path turns into one DMA per layer).
* ``check(before, after, writes) -> None | str``: every byte of every side (``before``: the
  sides' per-layer flat uint8 layers before the copies; ``after(side, layer)``: that layer now,
  on the same device) must equal the before-state with exactly ``writes`` applied, sources read
  from the before-state: copied rows (or tokens) are right, and nothing else changed, sources
  included. Returns None, or one line naming the side, layer and first differing byte.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable, Mapping, Optional, Sequence

import numpy as np
import torch

from hicache.core.errors import UsageError
from hicache.kernels.tables import TokenFormat

PATTERNS = ("random", "runs")
CHURN_OPS = 2000  # mixed allocs/frees before the bench's rows are allocated
CHURN_MAX = 32  # rows per churn allocation: 1..CHURN_MAX
ALLOC_BIAS = 0.6  # an op allocates (when it fits) with this chance: the pool fills, then churns
DEFAULT_RUNS = "alloc:32"


@dataclass(frozen=True)
class RunsSpec:
    """``kind`` "alloc" (requests of ``size`` rows from a churned allocator) or "fixed"
    (runs of exactly ``size`` rows)."""

    kind: str
    size: int

    def __str__(self) -> str:
        return f"{self.kind}:{self.size}"


def parse_runs(spec: str) -> RunsSpec:
    kind, _, size = spec.partition(":")
    if kind not in ("alloc", "fixed") or not size.isdigit() or int(size) < 1:
        raise UsageError(f"--runs wants alloc:R (requests of R rows from a churned allocator) "
                         f"or fixed:N (runs of N rows), R and N positive integers; got {spec!r}")
    return RunsSpec(kind, int(size))


def host_rows(pattern: str, rows: int, n: int, seed: int, spec: RunsSpec,
              parts: int = 1) -> torch.Tensor:
    if pattern not in PATTERNS:
        raise UsageError(f"row pattern {pattern!r} is not one of {PATTERNS}")
    if parts < 1 or not 0 < n * parts <= rows:
        raise UsageError(f"{parts} x {n} host rows asked of a pool of {rows}")
    if pattern == "random":
        g = torch.Generator().manual_seed(seed)
        return torch.randperm(rows, generator=g)[:n * parts].contiguous()
    if spec.kind == "fixed":
        return _fixed_runs(rows, n * parts, seed, spec.size)
    return _allocated_runs(rows, n, seed, spec.size, parts)


def _fixed_runs(rows: int, n: int, seed: int, size: int) -> torch.Tensor:
    slots, need = rows // size, -(-n // size)
    if need > slots:
        raise UsageError(f"--runs fixed:{size}: {need} runs of {size} rows do not fit in a pool "
                         f"of {rows} rows")
    g = torch.Generator().manual_seed(seed)
    starts = torch.randperm(slots, generator=g)[:need] * size
    return (starts[:, None] + torch.arange(size)).reshape(-1)[:n].contiguous()


def _allocated_runs(rows: int, n: int, seed: int, request: int, parts: int) -> torch.Tensor:
    from hicache.host_pools.allocator import RowAllocator

    alloc = RowAllocator(rows, "bench host rows")
    rng = np.random.default_rng(seed)
    room = rows - n  # rows the churn may leave held, so the bench's n rows still fit
    held: list[tuple[torch.Tensor, tuple[str, str]]] = []
    used = 0
    for op in range(CHURN_OPS):
        k = int(rng.integers(1, CHURN_MAX + 1))
        if held and (rng.random() > ALLOC_BIAS or used + k > room):
            got, owner = held.pop(int(rng.integers(len(held))))
            alloc.free(got, owner)
            used -= got.numel()
        elif used + k <= room:
            owner = ("churn", str(op))
            held.append((alloc.alloc(k, owner), owner))
            used += k
    out: list[torch.Tensor] = []
    for part in range(parts):
        if part:  # the pool is full: churn allocations leave, as a cache evicts, for n more
            free = rows - used - n * part
            while free < n:
                got, owner = held.pop(int(rng.integers(len(held))))
                alloc.free(got, owner)
                used, free = used - got.numel(), free + got.numel()
        left = n
        while left > 0:
            k = min(request, left)
            out.append(alloc.alloc(k, ("bench", f"{part}.{len(out)}")))
            left -= k
    return torch.cat(out)


def mean_run(*idx: torch.Tensor) -> float:
    from hicache.kernels.staged import plan_runs

    runs = sum(plan_runs(i.cpu()).numel() for i in idx)
    return sum(i.numel() for i in idx) / runs if runs else 0.0


@dataclass(frozen=True)
class Write:
    """Rows (``fmt`` None) or tokens ``src_idx[i]`` of side ``src`` copied to ``dst_idx[i]`` of
    side ``dst``, in every layer; layers are viewed as ``[rows, row_bytes]``."""

    src: str
    dst: str
    src_idx: torch.Tensor
    dst_idx: torch.Tensor
    row_bytes: int
    fmt: Optional[TokenFormat] = None


def _rows(flat: torch.Tensor, rb: int) -> torch.Tensor:
    return flat[: flat.numel() // rb * rb].view(-1, rb)


def _apply(out: torch.Tensor, src: torch.Tensor, w: Write) -> None:
    """``out`` (a flat layer) gets ``w``'s rows or tokens from ``src`` (a flat layer)."""
    o, s = _rows(out, w.row_bytes), _rows(src, w.row_bytes)
    si, di = w.src_idx.to(out.device), w.dst_idx.to(out.device)
    if w.fmt is None:
        o[di] = s[si]
        return
    f = w.fmt
    P = f.tokens_per_page
    for off, size in ((0, f.value_bytes), (f.scale_offset, f.scale_bytes)):
        if size:
            ov = o[:, off: off + P * size].view(o.shape[0], P, size)
            sv = s[:, off: off + P * size].view(s.shape[0], P, size)
            ov[di // P, di % P] = sv[si // P, si % P]


def check(before: Mapping[str, Sequence[torch.Tensor]], after: Callable[[str, int], torch.Tensor],
          writes: Sequence[Write]) -> Optional[str]:
    for side, layers in before.items():
        for l, b in enumerate(layers):
            want = b.clone()
            for w in writes:
                if w.dst == side:
                    _apply(want, before[w.src][l], w)
            got = after(side, l)
            if not torch.equal(want, got):
                bad = torch.nonzero(want != got).flatten()
                return (f"{side} layer {l}: {bad.numel()} byte(s) differ from the expected copy, "
                        f"first at byte {int(bad[0])}")
    return None
