"""What a host budget caches under each mirror, per plan (``hicache plan --host-mem``).

``host_tier_by_mirror(inputs) -> dict | None``: for ``inputs.host_mem``, per mirror
(``hicache.core.resume.MIRRORS``) the host page rows, checkpoint rows, cached tokens and cached
tokens per host GiB, min over the pipeline stages like the device capacity. A full mirror
stores every pool of every page (paged SWA only); checkpoints store compressed rows per page
plus one checkpoint row per ``inputs.pages_per_checkpoint`` pages. Those figures take the host
budget split for the mirror; ``served_pages`` / ``served_cached_tokens`` are what the daemon
``hicache serve`` starts with the same inputs holds, whose host rows follow the device rows'
proportions (``plan``'s stage host rows): a full mirror is bounded by its fewer of ``page`` and
``swa_page`` rows, checkpoints by the ``page`` rows and the checkpoint space's rows times
``pages_per_checkpoint``. Pure arithmetic.
"""
from __future__ import annotations

from typing import Any

from hicache.core.layout import LayoutError
from hicache.core.planner import PlanInputs, plan, stage_layouts
from hicache.core.resume import MIRRORS, ResumeModel


def host_tier_by_mirror(inputs: PlanInputs) -> dict[str, Any] | None:
    """Host tier under each mirror for ``inputs.host_mem`` (see the module docstring)."""
    if inputs.host_mem is None:
        return None
    out: dict[str, Any] = {}
    layouts = stage_layouts(inputs, inputs.swa_mode)
    served_rows = [st.host_rows for st in plan(inputs).stages]
    for mirror in MIRRORS:
        if mirror == "full" and inputs.swa_mode != "paged":
            out[mirror] = {"error": "a full mirror needs paged SWA (ring mode pages have no "
                                    "SWA rows; their hits are not resumable)"}
            continue
        try:
            models = [ResumeModel(lay) for lay in layouts]
        except LayoutError as e:  # what a resume needs cannot be cut from these pages
            out[mirror] = {"error": str(e)}
            continue
        tiers = [m.host_tier(inputs.host_mem, mirror, inputs.pages_per_checkpoint)
                 for m in models]
        pages, ckpts = min(t[0] for t in tiers), min(t[1] for t in tiers)
        tokens = pages * inputs.model.page_size
        served = min(_served_pages(m, rows, mirror, inputs.pages_per_checkpoint)
                     for m, rows in zip(models, served_rows))
        out[mirror] = {"pages": pages, "checkpoints": ckpts, "cached_tokens": tokens,
                       "cached_tokens_per_host_gib": round(tokens * 2**30 / inputs.host_mem)
                       if inputs.host_mem else 0,
                       "served_pages": served,
                       "served_cached_tokens": served * inputs.model.page_size}
    full, ck = out.get("full", {}), out["checkpoints"]
    if full.get("cached_tokens") and "cached_tokens" in ck:
        out["checkpoints_vs_full"] = round(ck["cached_tokens"] / full["cached_tokens"], 2)
    return out


def _served_pages(model: ResumeModel, rows: dict[str, int], mirror: str,
                  pages_per_ckpt: int) -> int:
    """Pages a host tier of ``rows`` (per index space) holds under ``mirror``."""
    if mirror == "full":
        return min(rows.get("page", 0), rows.get("swa_page", 0))
    return min(rows.get("page", 0), rows.get(model.checkpoint_space, 0) * pages_per_ckpt)
