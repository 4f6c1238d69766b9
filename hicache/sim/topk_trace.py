"""Top-k traces without the model: the C4 token ids an indexer might pick, step after step, for
one request and one layer (HiSparse workloads for tests, the demo and ``bench hisparse``).

``TopkTrace(cfg, seed).step(n) -> [topk]`` int64 ids in ``[0, n)`` (distinct, -1 padded), where
``n`` is the request's C4 length at that step. Knobs (``TopkTraceConfig``):

* ``topk``: ids per step (DSV4-Flash ``index_topk`` 512).
* ``overlap``: fraction of the previous step's ids kept (drawn at random among them); attention
  over consecutive decode steps reads mostly the same tokens. 0 = independent steps.
* ``recency``: of the new ids, the fraction drawn from the last ``recent_window`` tokens (local
  context); the rest are uniform over the whole request (retrieval of old context).
* ``recent_window``: how many of the newest tokens count as recent.
* ``include_newest``: the newest token is always picked (it is the one attention just made).

A request with ``n <= topk`` tokens gets all of them (an indexer keeps every candidate). The
generator is deterministic for a seed.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import torch


@dataclass(frozen=True)
class TopkTraceConfig:
    """Knobs of a trace (see the module docstring)."""

    topk: int = 512
    overlap: float = 0.8
    recency: float = 0.5
    recent_window: int = 1024
    include_newest: bool = True

    def __post_init__(self) -> None:
        if not isinstance(self.topk, int) or self.topk <= 0:
            raise ValueError(f"topk must be a positive int, got {self.topk!r}")
        for name in ("overlap", "recency"):
            v = getattr(self, name)
            if not 0.0 <= float(v) <= 1.0:
                raise ValueError(f"{name} must be in [0, 1], got {v!r}")
        if not isinstance(self.recent_window, int) or self.recent_window <= 0:
            raise ValueError(f"recent_window must be a positive int, got {self.recent_window!r}")


class TopkTrace:
    """Successive top-k id sets of one request at one layer."""

    def __init__(self, cfg: TopkTraceConfig = TopkTraceConfig(), seed: int = 0) -> None:
        self.cfg = cfg
        self.g = torch.Generator().manual_seed(seed)
        self.prev: Optional[torch.Tensor] = None

    def step(self, n: int) -> torch.Tensor:
        """The next step's ids for a request of ``n`` C4 tokens."""
        K = self.cfg.topk
        if n <= K:
            ids = torch.cat([torch.arange(n), torch.full((K - n,), -1)]).to(torch.int64)
            self.prev = ids[:n]
            return ids
        picked: list[int] = [n - 1] if self.cfg.include_newest else []
        if self.prev is not None and self.cfg.overlap > 0:
            old = self.prev[self.prev < n]
            old = old[old != n - 1]
            keep = min(int(round(self.cfg.overlap * K)), old.numel(), K - len(picked))
            picked += old[torch.randperm(old.numel(), generator=self.g)[:keep]].tolist()
        seen = set(picked)
        W = min(self.cfg.recent_window, n)
        while len(picked) < K:
            want = 2 * (K - len(picked)) + 8
            recent = torch.rand(want, generator=self.g) < self.cfg.recency
            draw = torch.where(recent, n - W + torch.randint(W, (want,), generator=self.g),
                               torch.randint(n, (want,), generator=self.g))
            for t in draw.tolist():
                if t not in seen:
                    seen.add(t)
                    picked.append(t)
                    if len(picked) == K:
                        break
        ids = torch.tensor(picked, dtype=torch.int64)
        self.prev = ids
        return ids


def batch_traces(cfg: TopkTraceConfig, lens: list[int], layers: int, steps: int,
                 seed: int = 0, grow_every: int = 0) -> torch.Tensor:
    """``[steps, layers, len(lens), topk]`` ids: one trace per request and layer; with
    ``grow_every`` > 0 every request gains a C4 token every that many steps."""
    traces = [[TopkTrace(cfg, seed=seed * 1_000_003 + l * 1009 + b) for b in range(len(lens))]
              for l in range(layers)]
    out = torch.empty(steps, layers, len(lens), cfg.topk, dtype=torch.int64)
    for s in range(steps):
        grown = s // grow_every if grow_every else 0
        for l in range(layers):
            for b, n in enumerate(lens):
                out[s, l, b] = traces[l][b].step(n + grown)
    return out
