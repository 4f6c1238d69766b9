"""Tier sizes of a replay from bytes, as a user sizes a server (``--kv-mem`` / ``--host-mem``).

* ``planned_device_pages(preset, kv_mem, swa)``: radix pages a device KV budget holds, through
  the capacity planner (``hicache.core.planner``); a radix page holds one row of every page
  space, so paged SWA takes the smaller of the ``page`` and ``swa_page`` rows.
* ``host_tier_rows(preset, host_mem, swa, mirror, pages_per_ckpt, req_slots, device_pages)``:
  host page rows and, with checkpoints, checkpoint rows
  (``hicache.core.resume.ResumeModel.host_tier``), beside the request-slot rows the demo's
  daemon keeps, so its arena stays within ``host_mem`` (but for its alignment).
Bad sizes raise ``UsageError``.
"""
from __future__ import annotations

from hicache.core.errors import UsageError
from hicache.core.resume import ResumeModel


def planned_device_pages(preset_name: str, kv_mem: str, swa: str) -> int:
    """Radix pages a device of ``kv_mem`` holds, as the planner sizes it: one row of every page
    space per radix page (paged SWA: min of page and SWA page rows)."""
    from hicache.core.layout import preset
    from hicache.core.planner import PlanInputs, parse_size, plan

    pl = plan(PlanInputs(preset(preset_name), parse_size(kv_mem, "--kv-mem"), swa_mode=swa))
    rows = pl.stages[0].device_rows
    return min(n for s, n in rows.items() if s in ("page", "swa_page"))


def host_tier_rows(preset_name: str, host_mem: str, swa: str, mirror: str,
                   pages_per_ckpt: int, req_slots: int = 0,
                   device_pages: int = 0) -> tuple[int, int | None]:
    """(host page rows, host checkpoint rows) of ``host_mem`` under ``mirror``, beside the
    ``req_slot`` rows a demo daemon keeps for ``req_slots`` request slots (state swaps):
    ``req_slots`` of them with checkpoints; with a full mirror, whose daemon scales every
    space by host / device pages, ``floor(req_slots x (pages + 0.5) / device_pages)``."""
    from hicache.core.layout import LayoutError, build_layout, preset
    from hicache.core.planner import parse_size

    r = ResumeModel(build_layout(preset(preset_name), swa_mode=swa))
    budget = parse_size(host_mem, "--host-mem")
    slot = r.layout.row_bytes("req_slot")
    try:
        if mirror == "checkpoints" or not (req_slots and device_pages and slot):
            pages, ckpts = r.host_tier(max(0, budget - req_slots * slot), mirror,
                                       pages_per_ckpt)
        else:  # the slot rows grow with the pages: the most pages whose rows fit
            pages, ckpts = r.host_tier(budget, mirror, pages_per_ckpt)
            while pages > 0 and (pages * r.full_page_bytes + slot
                                 * int(req_slots * (pages + 0.5) / device_pages)) > budget:
                pages -= 1
    except LayoutError as e:
        raise UsageError(str(e)) from None
    return pages, (ckpts if mirror == "checkpoints" else None)
