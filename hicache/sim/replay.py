"""One request replay through a radix tree and its device-only counterfactual, shared by the
verified worker (``hicache.sim.simulator.Worker``: pools, daemon, every byte checked) and the
dry replay (``hicache.sim.dry.DryReplay``: no pools, no daemon, no copies).

``Replay.run_request(req)``: ``prepare`` the resumable prefix (loads included), let the
subclass check it (``_check_hit`` -> bytes that differ; a hit whose pages or checkpoint differ
counts as a miss), ``_write`` the new pages, ``release`` them (checkpoints, write policy),
replay the same request through a device-only tree of the same rules (``shadow``), account.

``WorkerConfig.mirror``: ``checkpoints`` (pages carry compressed rows; a checkpoint — SWA tail +
boundary states — at the last page a request wrote and every ``checkpoint_every`` pages) or
``full`` (every pool of every page, SGLang HiCache's way; paged SWA only: in ring mode pages
have no SWA rows, and hits without a restored window are not resumable).
"""
from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any, Callable, Iterable

from hicache.core.errors import UsageError
from hicache.core.layout import Layout, build_layout, preset
from hicache.core.resume import MIRRORS, ResumeModel
from hicache.engine.radix import PAGE_TOKENS, Prefix, RadixTree
from hicache.sim.workload import Request


@dataclass
class WorkerConfig:
    preset: str = "dsv4-tiny"
    swa_mode: str = "paged"
    device_pages: int = 128  # device rows per page space (page, and swa_page when paged)
    host_pages: int = 1024  # host pages the tree may use (the daemon is sized to match)
    req_slots: int = 4
    policy: str = "write_through"
    seed: int = 0
    device: str = "cpu"
    verify_hits: bool = True  # also verify device hits, not only loaded pages
    preempt_every: int = 0  # swap a request's slot state out and back every N requests
    timeout: float = 30.0  # per daemon call / transfer
    mirror: str = "checkpoints"  # "checkpoints" | "full"
    checkpoint_every: int = 0  # also checkpoint every N pages a request writes (paged SWA)
    checkpoint_branch: bool = True  # also where a request left cached pages (paged SWA)
    host_ckpts: int | None = None  # host checkpoint rows (checkpoints mirror); None: host_pages
    state_slots: str = "ring"  # resume model option, see hicache.core.resume
    l3: bool = False  # the daemon serves an L3 tier: the tree fetches from and writes to it
    lockstep: bool = False  # wait for every backup before the next request (as a dry replay
    #                         does by construction): a daemon replay then has the same hits
    boundary_snapshots: bool = True  # ring SWA: a request that writes on past its last cached
    #                         page stops there for a snapshot_slot (else it checkpoints nothing)

    def layout(self) -> Layout:
        return build_layout(preset(self.preset), swa_mode=self.swa_mode)

    @property
    def ckpt_rows(self) -> int:
        """Host checkpoint rows of the tier (checkpoints mirror)."""
        return self.host_pages if self.host_ckpts is None else self.host_ckpts

    def resume(self, layout: Layout | None = None) -> ResumeModel:
        return ResumeModel(layout or self.layout(), self.state_slots)

    def check(self) -> None:
        """One ``UsageError`` line for a combination that cannot run."""
        if self.mirror not in MIRRORS:
            raise UsageError(f"mirror must be one of {MIRRORS}, got {self.mirror!r}")
        if self.mirror == "full" and self.swa_mode != "paged":
            raise UsageError("--mirror full needs paged SWA: in ring mode a page has no SWA rows "
                             "to mirror, and a hit without its window restored is not resumable; "
                             "use --mirror checkpoints")
        if self.mirror == "full" and (self.checkpoint_every or self.host_ckpts is not None):
            raise UsageError("--checkpoint-every and host checkpoint rows apply to "
                             "--mirror checkpoints only (a full mirror resumes at every page)")
        if self.checkpoint_every and self.swa_mode != "paged":
            raise UsageError("--checkpoint-every needs paged SWA: a ring holds one window per "
                             "request, so only the last page a request wrote is checkpointed")
        if self.checkpoint_every < 0:
            raise UsageError(f"--checkpoint-every must be >= 0, got {self.checkpoint_every}")
        if not self.boundary_snapshots and (self.swa_mode != "ring"
                                            or self.mirror != "checkpoints"):
            raise UsageError("--no-boundary-snapshots applies to ring SWA with --mirror "
                             "checkpoints only (paged SWA keeps every boundary in its page row)")

    def device_rows(self, layout: Layout | None = None) -> dict[str, int]:
        layout = layout or self.layout()
        rows = {"page": self.device_pages, "swa_page": self.device_pages,
                "req_slot": self.req_slots}
        return {s: n for s, n in rows.items() if layout.space_pools(s)}


def page_spaces(layout: Layout) -> list[str]:
    """Index spaces one radix page uses: ``page``, and ``swa_page`` in paged SWA mode."""
    return [s for s in ("page", "swa_page") if layout.space_pools(s)]


@dataclass
class Result:
    requests: int = 0
    input_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    device_only_hit_tokens: int = 0
    unresumable_tokens: int = 0  # cached past the deepest checkpoint: recomputed
    rejected_hit_tokens: int = 0  # hits whose pages or checkpoint did not verify: recomputed
    verified_bytes: int = 0
    mismatched_bytes: int = 0
    mismatched_pages: int = 0
    state_swaps: int = 0
    state_swap_failures: int = 0
    seconds: float = 0.0
    first_mismatch: str | None = None
    l3_hit_tokens: int = 0  # of host_hit_tokens: pages the L3 tier supplied

    @property
    def resumable_hit_tokens(self) -> int:
        """Hit tokens whose pages and checkpoint were restored (and verified, when verifying)."""
        return self.device_hit_tokens + self.host_hit_tokens

    @property
    def prefill_tokens_saved(self) -> int:
        """Tokens not computed thanks to the host tier (vs the device-only replay)."""
        return self.resumable_hit_tokens - self.device_only_hit_tokens


class Replay:
    """The tree side of a replay (see the module docstring); subclasses move and check bytes."""

    def __init__(self, cfg: WorkerConfig, hooks: Any) -> None:
        cfg.check()
        self.cfg = cfg
        self.last_l3_keys: list[Any] = []  # keys of the pages L3 supplied to the last request
        self.layout = cfg.layout()
        self.resume = cfg.resume(self.layout)
        self.ckpt = cfg.mirror == "checkpoints"
        self.ring_ckpt = self.ckpt and cfg.swa_mode == "ring"  # checkpoints live in slots
        tree_kw: dict[str, Any] = {"mirror": cfg.mirror}
        if self.ckpt:
            paged = cfg.swa_mode == "paged"
            tree_kw.update(device_ckpts=paged, checkpoint_every=cfg.checkpoint_every,
                           checkpoint_branch=cfg.checkpoint_branch and paged)
        host = {}
        if hooks is not None:
            host = {"host_capacity": cfg.host_pages}
            if self.ckpt:
                host["host_ckpt_capacity"] = cfg.ckpt_rows
        self.tree = RadixTree(cfg.device_pages, hooks, policy=cfg.policy, **host, **tree_kw)
        self.shadow = RadixTree(cfg.device_pages, **tree_kw)  # device-only counterfactual
        self.result = Result()

    # ------------------------------------------------------------------ host bytes
    @property
    def host_page_bytes(self) -> int:
        """Host bytes one cached page occupies (its checkpoint not included)."""
        return self.resume.page_bytes if self.ckpt else self.resume.full_page_bytes

    def host_bytes(self) -> int:
        """Host bytes the tree's host tier holds now (pages and checkpoints)."""
        t = self.tree
        ck = t.host_checkpoints * self.resume.checkpoint_host_bytes if self.ckpt else 0
        return t.host_pages * self.host_page_bytes + ck

    # ------------------------------------------------------------------ subclass hooks
    def _before_prepare(self, req: Request, slot: int) -> None:
        """The request slot is about to be restored (ring SWA: a checkpoint load into it)."""

    def _check_hit(self, req: Request, prefix: Prefix, slot: int) -> int:
        """Bytes of the prefix (pages and checkpoint) that differ; 0 = the resume is exact."""
        return 0

    def _write(self, req: Request, keys: list[int], rows: list[int]) -> None:
        """The engine computes (prefills) ``keys`` into device rows ``rows``."""

    def _before_release(self, req: Request, slot: int, wrote: bool) -> None:
        """Last chance to touch the request slot before its checkpoint is backed up."""

    def _past_boundary(self, req: Request, slot: int) -> None:
        """Ring SWA: the request writes on past its last cached page (the slot leaves it)."""

    def _after_release(self, req: Request) -> None:
        """The request left the tree."""

    def _on_account(self, dev: int, host: int, miss: int, dev_only: int) -> None:
        """Per-request counters (metrics)."""

    # ------------------------------------------------------------------ requests
    def _after_run(self) -> None:
        """After the last request's backups settled (the L3 writes of a daemon replay)."""

    def slot(self, req: Request) -> int:
        """The request's slot: ``rid % req_slots``, or the next one the tree does not hold (a
        checkpoint load of unknown outcome may still land in a held one)."""
        n, held = self.cfg.req_slots, self.tree.held_slots
        for k in range(n):
            s = (req.rid + k) % n
            if s not in held:
                return s
        raise RuntimeError(f"all {n} request slots are held by loads of unknown outcome; "
                           f"reset the host tier first")

    def run_request(self, req: Request) -> None:
        keys = list(req.cache_pages[: req.max_prefix_pages])
        slot = self.slot(req)
        if self.cfg.lockstep:
            self.tree.drain()
        self._before_prepare(req, slot)
        prefix = self.tree.prepare(keys, slot=slot)
        if prefix.slot_held:  # the checkpoint load may still land there: move the request
            slot = self.slot(req)
        bad = self._check_hit(req, prefix, slot)
        # L3's share of the hit counts only once the hit verified (a rejected one is recomputed)
        self.last_l3_keys = [n.key for n in prefix.nodes[prefix.pages - prefix.l3_pages:]] \
            if prefix.l3_pages and not bad else []
        self.result.l3_hit_tokens += 0 if bad else prefix.l3_pages * PAGE_TOKENS
        new_keys = list(req.cache_pages[prefix.pages:])
        rows = self.tree.alloc_device(req.total_pages - prefix.pages)
        self._write(req, new_keys, rows[: len(new_keys)])  # prefill (and decode) writes the KV
        self._before_release(req, slot, bool(new_keys))
        end = req.input_tokens + req.output_tokens  # what the slot took in (ring SWA)
        snap = None
        if self.ring_ckpt and new_keys and end != len(req.cache_pages) * PAGE_TOKENS:
            if self.cfg.boundary_snapshots:  # the engine stops at the boundary, then goes on
                snap = self.tree.snapshot_slot(slot, list(req.cache_pages))
            self._past_boundary(req, slot)
        self.tree.release(prefix, list(req.cache_pages), rows[: len(new_keys)], slot=slot,
                          slot_tokens=end, snapshot=snap)
        self.tree.free_device(rows[len(new_keys):])
        self._after_release(req)
        dev_only = self._counterfactual(req, keys, slot)
        dev, host = prefix.device_pages * PAGE_TOKENS, prefix.host_pages * PAGE_TOKENS
        r = self.result
        r.unresumable_tokens += prefix.unresumable_pages * PAGE_TOKENS
        if bad:  # recomputed: the engine cannot resume from bytes that differ
            r.rejected_hit_tokens += dev + host
            dev = host = 0
        self._account(req, dev, host, dev_only)

    def _counterfactual(self, req: Request, keys: list[int], slot: int) -> int:
        sp = self.shadow.prepare(keys, slot=slot)
        n_new = len(req.cache_pages) - sp.pages
        rows = self.shadow.alloc_device(req.total_pages - sp.pages)
        self.shadow.release(sp, list(req.cache_pages), rows[:n_new], slot=slot,
                            slot_tokens=req.input_tokens + req.output_tokens)
        self.shadow.free_device(rows[n_new:])
        return sp.device_pages * PAGE_TOKENS

    def _account(self, req: Request, dev: int, host: int, dev_only: int) -> None:
        r = self.result
        miss = req.input_tokens - dev - host
        r.requests += 1
        r.input_tokens += req.input_tokens
        r.device_hit_tokens += dev
        r.host_hit_tokens += host
        r.miss_tokens += miss
        r.device_only_hit_tokens += dev_only
        self._on_account(dev, host, miss, dev_only)

    def run(self, requests: Iterable[Request],
            progress: Callable[[Any, int], None] | None = None) -> Result:
        t0 = time.perf_counter()
        for i, req in enumerate(requests, 1):
            self.run_request(req)
            self.result.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(self, i)
        self.tree.drain()
        self._after_run()
        self.result.seconds = time.perf_counter() - t0
        return self.result

    # ------------------------------------------------------------------ report
    def tree_summary(self) -> dict[str, Any]:
        """The tree-level figures every replay reports (JSON-able)."""
        r, t = self.result, self.tree
        host_tokens = t.host_pages * PAGE_TOKENS
        hb = self.host_bytes()
        return {
            "mirror": self.cfg.mirror,
            "requests": r.requests,
            "input_tokens": r.input_tokens,
            "device_hit_tokens": r.device_hit_tokens,
            "host_hit_tokens": r.host_hit_tokens,
            "miss_tokens": r.miss_tokens,
            "resumable_hit_tokens": r.resumable_hit_tokens,
            "unresumable_tokens": r.unresumable_tokens,
            "rejected_hit_tokens": r.rejected_hit_tokens,
            "device_only_hit_tokens": r.device_only_hit_tokens,
            "prefill_tokens_saved": r.prefill_tokens_saved,
            "checkpoints": {
                "made": t.stats.checkpoints_made, "backed_up": t.stats.checkpoints_backed_up,
                "loaded": t.stats.checkpoints_loaded, "dropped": t.stats.checkpoints_dropped,
                "on_host": t.host_checkpoints if self.ckpt else t.host_pages,
                "on_device": t.device_checkpoints,
            },
            "host_pages": t.host_pages,
            "host_cached_tokens": host_tokens,
            "host_bytes": hb,
            "host_bytes_per_cached_token": round(hb / host_tokens, 1) if host_tokens else None,
            "host_page_bytes": self.host_page_bytes,
            "checkpoint_bytes": self.resume.checkpoint_bytes if self.ckpt else 0,
            "checkpoint_host_bytes": self.resume.checkpoint_host_bytes if self.ckpt else 0,
            "tree": t.stats.as_dict(),
        }
