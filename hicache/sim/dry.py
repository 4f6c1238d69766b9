"""Dry replay: the radix tree, both tiers and the byte accounting, without pools, daemon or copies.

``DryHooks`` is a ``TierHooks`` whose host tier is two free lists (page handles, checkpoint
handles) of the sizes it is given; every backup and load completes at once and only counts the
bytes the daemon would have moved (from ``hicache.core.resume.ResumeModel``: a page's
compressed rows, or its full mirror; a checkpoint's SWA tail and states). ``DryReplay`` runs the
same ``Replay`` (tree rules, checkpoints, counterfactual, accounting) as the verified worker, so
the two agree on hits for the same configuration when the worker's backups complete before its
next request (``lockstep``; the live demo's run beside the next requests, so a page still being
backed up at a release gets no checkpoint there); only ``verified`` is absent (nothing moves).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

from hicache.core.resume import ResumeModel
from hicache.engine.hooks import Checkpoint, HostExhausted
from hicache.sim.replay import Replay, WorkerConfig


class DryHooks:
    """Host tier of ``pages`` page handles and ``ckpts`` checkpoint handles; copies only counted."""

    def __init__(self, resume: ResumeModel, mirror: str, pages: int, ckpts: int) -> None:
        self.page_bytes = resume.page_bytes if mirror == "checkpoints" else resume.full_page_bytes
        self.ckpt_bytes = resume.checkpoint_bytes
        self._free = {"page": list(range(pages - 1, -1, -1)),
                      "ckpt": list(range(ckpts - 1, -1, -1))}
        self.bytes = {"backup": 0, "load": 0}
        self.ops = {"backup": 0, "load": 0}
        self.pages = {"backup": 0, "load": 0}
        self.ckpts = {"backup": 0, "load": 0}

    def host_alloc(self, n: int, kind: str = "page") -> list[Any]:
        free = self._free[kind]
        if n > len(free):
            raise HostExhausted(f"dry host tier: {n} {kind} rows asked, {len(free)} free")
        out = free[len(free) - n:]
        del free[len(free) - n:]
        return out

    def host_free(self, handles: Sequence[Any], kind: str = "page") -> None:
        self._free[kind].extend(handles)

    def _count(self, kind: str, pages: int, ckpts: int) -> str:
        self.ops[kind] += 1
        self.pages[kind] += pages
        self.ckpts[kind] += ckpts
        self.bytes[kind] += pages * self.page_bytes + ckpts * self.ckpt_bytes
        return kind

    def backup(self, device_rows: Sequence[int], handles: Sequence[Any],
               ckpts: Sequence[Checkpoint] = ()) -> str:
        return self._count("backup", len(device_rows), len(ckpts))

    def load(self, handles: Sequence[Any], device_rows: Sequence[int],
             ckpts: Sequence[Checkpoint] = ()) -> str:
        return self._count("load", len(device_rows), len(ckpts))

    def wait(self, ticket: Any) -> None:
        pass

    def done(self, ticket: Any) -> bool:
        return True

    def row_epoch(self) -> int:
        return 0  # its host tier never goes away

    def copies_running(self, tickets: Any) -> bool:
        return False  # its copies are done when they return


class DryReplay(Replay):
    """``Replay`` over ``DryHooks`` (``host=False``: device-only, no host tier at all)."""

    def __init__(self, cfg: WorkerConfig, host: bool = True) -> None:
        cfg.check()
        resume = cfg.resume()
        self.hooks = DryHooks(resume, cfg.mirror, cfg.host_pages,
                              cfg.ckpt_rows if cfg.mirror == "checkpoints" else 0) if host else None
        super().__init__(cfg, self.hooks)

    def summary(self) -> dict[str, Any]:
        out = self.tree_summary()
        h = self.hooks
        out.update({
            "dry": True,
            "verified": None,
            "bytes_backed_up": h.bytes["backup"] if h else 0,
            "bytes_loaded": h.bytes["load"] if h else 0,
            "pages_backed_up": self.tree.stats.backed_up_pages,
            "pages_loaded": self.tree.stats.loaded_pages,
            "backup_ops": h.ops["backup"] if h else 0,
            "load_ops": h.ops["load"] if h else 0,
            "seconds": round(self.result.seconds, 3),
            "config": asdict(self.cfg),
        })
        return out
