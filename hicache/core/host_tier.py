"""What a host budget caches under each mirror, per plan (``hicache plan --host-mem``).

``host_tier_by_mirror(inputs) -> dict | None``: for ``inputs.host_mem``, per mirror
(``hicache.core.resume.MIRRORS``) the host page rows, checkpoint rows, cached tokens and cached
tokens per host GiB, min over the pipeline stages like the device capacity. A full mirror
stores every pool of every page (paged SWA only); checkpoints store compressed rows per page
plus one checkpoint row per ``inputs.pages_per_checkpoint`` pages, beside the request slots'
rows: the rows ``hicache serve --host-split checkpoints`` makes
(``sizes.checkpoint_host_rows``, the same function; a stage without page pools, which that
split refuses, is left out of this figure). Those figures take the host budget split for the
mirror; ``served_pages`` / ``served_cached_tokens`` are what the daemon ``hicache serve``
starts with the same inputs holds (``plan``'s stage host rows: the device rows' proportions,
or the checkpoints split with ``inputs.host_split``): a full mirror is bounded by its fewer of
``page`` and ``swa_page`` rows, checkpoints by the ``page`` rows and the checkpoint rows beyond
the request slots' times ``pages_per_checkpoint``; a space a stage does not use bounds nothing.
Pure arithmetic.
"""
from __future__ import annotations

from typing import Any

from hicache.core.errors import CapacityError, UsageError
from hicache.core.layout import LayoutError
from hicache.core.planner import PlanInputs, plan, stage_layouts
from hicache.core.resume import MIRRORS, ResumeModel
from hicache.core.sizes import checkpoint_host_rows, used_spaces


def host_tier_by_mirror(inputs: PlanInputs) -> dict[str, Any] | None:
    """Host tier under each mirror for ``inputs.host_mem`` (see the module docstring)."""
    if inputs.host_mem is None:
        return None
    out: dict[str, Any] = {}
    layouts = stage_layouts(inputs, inputs.swa_mode)
    stages = plan(inputs).stages
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
        try:
            tiers = [m.host_tier(inputs.host_mem, mirror, inputs.pages_per_checkpoint)
                     if mirror == "full" else _checkpoint_split(m, st, inputs)
                     for m, st in zip(models, stages)
                     if mirror == "full" or "page" in used_spaces(m.layout)]
        except (CapacityError, UsageError) as e:
            out[mirror] = {"error": str(e)}
            continue
        pages, ckpts = min(t[0] for t in tiers), min(t[1] for t in tiers)
        tokens = pages * inputs.model.page_size
        served = min(_served_pages(m, st, mirror, inputs.pages_per_checkpoint)
                     for m, st in zip(models, stages))
        out[mirror] = {"pages": pages, "checkpoints": ckpts, "cached_tokens": tokens,
                       "cached_tokens_per_host_gib": round(tokens * 2**30 / inputs.host_mem)
                       if inputs.host_mem else 0,
                       "served_pages": served,
                       "served_cached_tokens": served * inputs.model.page_size}
    full, ck = out.get("full", {}), out["checkpoints"]
    if full.get("cached_tokens") and "cached_tokens" in ck:
        out["checkpoints_vs_full"] = round(ck["cached_tokens"] / full["cached_tokens"], 2)
    return out


def _checkpoint_split(model: ResumeModel, stage: Any, inputs: PlanInputs) -> tuple[int, int]:
    """(page rows, checkpoint rows beyond the request slots') of serve's checkpoints split."""
    assert inputs.host_mem is not None
    rows = checkpoint_host_rows(model.layout, stage.device_rows, inputs.host_mem,
                                inputs.pages_per_checkpoint)
    ck = model.checkpoint_space
    slots = stage.device_rows.get("req_slot", 0) if ck == "req_slot" else 0
    return rows["page"], rows[ck] - slots


def _served_pages(model: ResumeModel, stage: Any, mirror: str, pages_per_ckpt: int) -> int:
    """Pages the host rows of ``stage`` (the plan's split) hold under ``mirror``; a space the
    stage does not use bounds nothing (a stage of SWA-only layers has no ``page`` rows). Ring
    SWA: the request slots' own rows (state swaps) are no checkpoint rows."""
    rows, have = stage.host_rows, used_spaces(model.layout)
    if mirror == "full":
        return min(rows[s] for s in ("page", "swa_page") if s in have)
    ck = model.checkpoint_space
    ckpts = rows[ck] - (stage.device_rows.get(ck, 0) if ck == "req_slot" else 0)
    bounds = [max(0, ckpts) * pages_per_ckpt] + ([rows["page"]] if "page" in have else [])
    return min(bounds)
