"""Capacity planner: how many full tokens fit per pipeline stage, and the pool rows that follow.

Contract (pure functions over ``hicache.core.layout`` and ``hicache.core.sizes``; no I/O, no
torch):

* ``plan(PlanInputs) -> Plan``. Every figure is exact integer or ``Fraction`` arithmetic, so the
  same inputs always give the same numbers. ``Plan.warnings``: every stage's warnings (a paged
  SWA pool too small for its request slots' windows), then the other SWA mode's misfit;
  ``StagePlan.warnings``: that stage's own, which ``hicache serve`` prints at start for the
  stage it serves.
* Per stage, device bytes split in two kinds:

  - **token-scaled** bytes per page of 256 full tokens: every pool of index space ``page``
    (C4 KV, C4 indexer, C128 KV), plus in paged SWA mode ``swa_ratio`` x every pool of space
    ``swa_page`` (SWA KV and the two C4 compress states, which live per SWA page);
  - **fixed** bytes per request slot: every pool of space ``req_slot`` (the C128 state; in
    ring SWA mode also the SWA ring row and the C4 state ring rows of each layer).

  ``pages = floor((budget - fixed * request_slots) / token_scaled_bytes_per_page)``;
  ``token_capacity = pages * 256``. A worker's capacity is the minimum over its stages.
* Request slots per DP worker: ``max_running``, doubled on a PD decode worker (slots that are
  pre-allocated for incoming transfers while ``max_running`` requests decode).
* Host rows mirror device rows byte for byte and are proportional to them per index space;
  ``hicache.core.sizes.host_rows`` computes them (the rule the daemon sizes its arena
  with), so a plan and a running daemon agree to the row. With ``host_split="checkpoints"``
  they are ``sizes.checkpoint_host_rows`` instead, as ``serve --host-split checkpoints``.
  ``stage_host_rows`` does both for every stage, and with a host budget in bytes the PP
  stages agree on the smallest stage's rows per index space (``serve`` sizes with it too).
* The host tier by mirror (full vs checkpoints, ``pages_per_checkpoint``) is
  ``hicache.core.host_tier.host_tier_by_mirror``.
* Bad inputs raise ``UsageError`` (or ``LayoutError`` from the layout model) with one line
  that names the numbers involved. Two rules that ``hicache plan`` and ``hicache serve`` share
  live here: ``pp_size_of`` (the pipeline size from ``--pp-size`` or the ``--stage-bounds``
  count) and ``refuse_unused`` (an input given where it does not apply is refused).

MLA has one KV head, so every TP rank holds the full KV pools: the budget is per GPU and TP
changes nothing per rank. PP divides the layers; DP multiplies workers.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any, Sequence

from hicache.core.errors import UsageError
from hicache.core.resume import DEFAULT_PAGES_PER_CKPT
from hicache.core import sizes as host_sizing
from hicache.core.layout import (
    INDEX_SPACES, Layout, LayoutError, ModelSpec, build_layout, check_bounds, stage_bounds,
)

PD_ROLES = ("none", "prefill", "decode")
SWA_MODES = ("paged", "ring")
HOST_SPLITS = ("device", "checkpoints")  # how --host-mem becomes host rows (docs/config.md)
DECODE_SLOT_FACTOR = 2  # a PD decode worker keeps as many slots again for incoming transfers
DEFAULT_MAX_RUNNING = 256
DEFAULT_SWA_RATIO = Fraction(4, 5)



# --------------------------------------------------------------------------- input parsing
def parse_size(text: str, what: str = "size") -> int:
    """Bytes from a size string: ``hicache.core.sizes.parse_bytes`` (the one size parser)."""
    return host_sizing.parse_bytes(str(text), what)


def parse_fraction(text: str, what: str) -> Fraction:
    """A non-negative ratio from ``"0.8"``, ``"4"``, ``"4:1"`` or ``"3/4"``."""
    s = str(text).strip()
    try:
        if ":" in s:
            a, b = s.split(":", 1)
            value = Fraction(a.strip()) / Fraction(b.strip())
        else:
            value = Fraction(s)
    except (ValueError, ZeroDivisionError):
        raise UsageError(f"{what}: cannot read {text!r} as a number or a ratio like 4:1") from None
    if value < 0:
        raise UsageError(f"{what} must not be negative, got {text!r}")
    return value


def parse_count(text: Any, what: str, minimum: int = 1) -> int:
    """An integer >= ``minimum`` from a string or int."""
    try:
        value = int(str(text).strip())
    except ValueError:
        raise UsageError(f"{what} must be an integer, got {text!r}") from None
    if value < minimum:
        kind = "positive" if minimum == 1 else f"at least {minimum}"
        raise UsageError(f"{what} must be {kind}, got {value}")
    return value


def parse_bounds(text: str) -> tuple[tuple[int, int], ...]:
    """Explicit stage bounds ``"0:22,22:43"`` -> ``((0, 22), (22, 43))``."""
    bounds = []
    for part in str(text).split(","):
        try:
            a, b = part.split(":")
            bounds.append((int(a), int(b)))
        except ValueError:
            raise UsageError(
                f"stage bounds: cannot read {part.strip()!r}; give START:END per stage, "
                "comma-separated, e.g. 0:22,22:43"
            ) from None
    return tuple(bounds)


def pp_size_of(bounds: Sequence[tuple[int, int]] | None, pp: int | None) -> int:
    """The pipeline size: ``pp`` where it was given (``--pp-size``), else one stage per
    ``--stage-bounds`` entry (one stage without either). ``hicache plan`` and ``hicache serve``
    both read their flags with it. Refuses bounds whose count is not a given ``pp``."""
    if pp is None:
        return len(bounds) if bounds else 1
    if bounds is not None and len(bounds) != pp:
        raise UsageError(f"--stage-bounds gives {len(bounds)} stages, --pp-size says {pp}")
    return pp


def refuse_unused(swa_mode: str, *, host_mem: bool, swa_ratio: bool,
                  pages_per_checkpoint: bool, host_split: bool = False) -> None:
    """Refuse a planner input that was given (``True``) where it does not apply: the SWA ratio
    with ring SWA, pages per checkpoint or a host split without a host budget (``host_mem``:
    one is given).
    ``hicache plan`` and ``hicache serve`` pass whether the operator set it, even to its
    default; ``PlanInputs`` whether it is off its default."""
    if swa_ratio and swa_mode == "ring":
        raise UsageError("--swa-full-tokens-ratio sizes paged SWA pools; with --swa-mode ring "
                         "each request slot holds its own window, so it does not apply")
    if pages_per_checkpoint and not host_mem:
        raise UsageError("--pages-per-checkpoint splits the host tier of --host-mem between "
                         "pages and checkpoints; give --host-mem too")
    if host_split and not host_mem:
        raise UsageError("--host-split splits --host-mem; give it in bytes (--host-ratio "
                         "scales the device rows, a device split)")


def human_bytes(n: int | float | Fraction) -> str:
    """``107374182400`` -> ``"100.00 GiB"``."""
    v = float(n)
    for unit in ("B", "KiB", "MiB", "GiB"):
        if abs(v) < 1024:
            return f"{v:,.0f} {unit}" if unit == "B" else f"{v:,.2f} {unit}"
        v /= 1024
    return f"{v:,.2f} TiB"


# --------------------------------------------------------------------------- inputs
@dataclass(frozen=True)
class PlanInputs:
    """Everything a plan depends on. ``mtp``/``indexer`` of ``None`` keep the model's own."""

    model: ModelSpec
    kv_mem: int  # KV budget per GPU, bytes
    tp: int = 1
    pp: int = 1
    dp: int = 1
    max_running: int = DEFAULT_MAX_RUNNING  # per DP worker
    pd_role: str = "none"
    swa_mode: str = "paged"
    mtp: bool | None = None
    indexer: str | None = None
    c128_state: str = "online"
    swa_ratio: Fraction = DEFAULT_SWA_RATIO  # paged SWA tokens / full tokens
    host_mem: int | None = None  # host budget per GPU, bytes
    host_ratio: Fraction | None = None  # host rows : device rows
    bounds: tuple[tuple[int, int], ...] | None = None
    pages_per_checkpoint: int = DEFAULT_PAGES_PER_CKPT  # host split, checkpoints mirror
    host_split: str = "device"  # "checkpoints": host rows as serve --host-split checkpoints

    def __post_init__(self) -> None:
        if self.pages_per_checkpoint < 1:
            raise UsageError(f"pages-per-checkpoint must be positive, got "
                             f"{self.pages_per_checkpoint}")
        for name in ("tp", "pp", "dp", "max_running"):
            value = getattr(self, name)
            if value < 1:
                raise UsageError(f"{name.replace('_', '-')} must be positive, got {value}")
        if self.kv_mem < 0:
            raise UsageError(f"kv-mem must not be negative, got {self.kv_mem}")
        if self.pd_role not in PD_ROLES:
            raise UsageError(f"pd-role must be one of {', '.join(PD_ROLES)}, got {self.pd_role!r}")
        if self.swa_mode not in SWA_MODES:
            raise UsageError(f"swa-mode must be paged or ring, got {self.swa_mode!r}")
        if not 0 < self.swa_ratio <= 1:
            raise UsageError(
                f"--swa-full-tokens-ratio must be in (0, 1], got {float(self.swa_ratio)}"
            )
        # built in code, an input "was given" when it is away from its default
        refuse_unused(self.swa_mode, host_mem=self.host_mem is not None,
                      swa_ratio=self.swa_ratio != DEFAULT_SWA_RATIO,
                      pages_per_checkpoint=self.pages_per_checkpoint != DEFAULT_PAGES_PER_CKPT,
                      host_split=self.host_split != "device")
        if self.host_mem is not None and self.host_ratio is not None:
            raise UsageError("give host-mem or host-ratio, not both")
        if self.host_split not in HOST_SPLITS:
            raise UsageError(f"--host-split must be one of {' | '.join(HOST_SPLITS)}, got "
                             f"{self.host_split!r}")
        if self.host_mem is not None and self.host_mem < 0:
            raise UsageError(f"host-mem must not be negative, got {self.host_mem}")
        if self.mtp and self.model.num_mtp_layers == 0:
            raise UsageError(f"--mtp asked for, but model {self.model.name} has no MTP layers")
        pp_size_of(self.bounds, self.pp)  # as many bounds as stages

    @property
    def use_mtp(self) -> bool:
        return self.model.num_mtp_layers > 0 if self.mtp is None else self.mtp

    @property
    def effective_model(self) -> ModelSpec:
        if self.indexer is None or self.indexer == self.model.indexer_dtype:
            return self.model
        return self.model.with_options(indexer_dtype=self.indexer)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model.name, "kv_mem": self.kv_mem, "tp": self.tp, "pp": self.pp,
            "dp": self.dp, "max_running": self.max_running, "pd_role": self.pd_role,
            "swa_mode": self.swa_mode, "mtp": self.use_mtp,
            "indexer": self.effective_model.indexer_dtype, "c128_state": self.c128_state,
            "swa_full_tokens_ratio": float(self.swa_ratio), "host_mem": self.host_mem,
            "host_ratio": None if self.host_ratio is None else float(self.host_ratio),
            "stage_bounds": None if self.bounds is None else [list(b) for b in self.bounds],
            "pages_per_checkpoint": self.pages_per_checkpoint, "host_split": self.host_split,
        }


# --------------------------------------------------------------------------- per-stage rules
def request_slots(max_running: int, pd_role: str) -> int:
    """Request slots per DP worker: ``max_running``, x2 on a PD decode worker."""
    return max_running * (DECODE_SLOT_FACTOR if pd_role == "decode" else 1)


def page_cost(layout: Layout, swa_ratio: Fraction) -> Fraction:
    """Token-scaled device bytes per page of 256 full tokens."""
    return layout.row_bytes("page") + swa_ratio * layout.row_bytes("swa_page")


def fixed_bytes_per_request(layout: Layout) -> int:
    """Device bytes one request slot costs whatever its length (rings and C128 state)."""
    return layout.row_bytes("req_slot")


def _least_pages(layout: Layout, slots: int, swa_ratio: Fraction) -> int:
    """Full-token pages whose paged SWA share (``floor(pages x swa_ratio)``) holds the window
    pages of ``slots`` running requests; one page without a paged SWA pool."""
    if not layout.space_pools("swa_page"):
        return 1
    return math.ceil(slots * layout.model.window_pages / swa_ratio)


def one_request_bytes(layout: Layout, swa_ratio: Fraction = DEFAULT_SWA_RATIO) -> int:
    """Smallest budget that runs one request: its fixed bytes, and the pages whose paged SWA
    share holds its window's pages (``ModelSpec.window_pages``) at ``swa_ratio``."""
    cost = page_cost(layout, swa_ratio)
    return fixed_bytes_per_request(layout) + math.ceil(_least_pages(layout, 1, swa_ratio) * cost)


class TooManySlots(UsageError):
    """``capacity_pages``: ``slots`` request slots leave the stage no room (fewer might);
    ``stage_pages`` says how many fit on every stage."""


def capacity_pages(layout: Layout, budget: int, slots: int, swa_ratio: Fraction) -> int | None:
    """Full-token pages that fit beside ``slots`` request slots; ``None`` = no token-scaled pool."""
    need = one_request_bytes(layout, swa_ratio)
    where = f"stage {layout.stage.pp_rank} [{layout.stage.start}, {layout.stage.end})"
    if budget < need:
        raise UsageError(
            f"KV budget (--kv-mem) {budget:,} B is too small for one request on {where} "
            f"({layout.swa_mode} SWA): one request needs {need:,} B"
        )
    cost = page_cost(layout, swa_ratio)
    fixed = fixed_bytes_per_request(layout) * slots
    if budget - fixed < max(cost, 1):  # fixed > 0 here: one request fits, so slots > 1
        what = "leaves no token page after" if cost else "cannot hold"
        raise TooManySlots(
            f"KV budget (--kv-mem) {budget:,} B on {where} ({layout.swa_mode} SWA) {what} "
            f"the fixed state of {slots} request slots ({fixed:,} B)")
    if cost == 0:
        return None
    pages = math.floor((budget - fixed) / cost)
    if layout.space_pools("swa_page") and math.floor(pages * swa_ratio) < 1:  # (the daemon
        least = fixed + math.ceil(_least_pages(layout, 1, swa_ratio) * cost)  # refuses 0 rows)
        raise TooManySlots(
            f"KV budget (--kv-mem) {budget:,} B on {where} (paged SWA) gives {pages} pages and no SWA "
            f"page at {float(swa_ratio):g} SWA tokens per full token; with {slots} request "
            f"slots it needs at least {least:,} B")
    return pages


def stage_pages(layouts: list[Layout], budget: int, slots: int, swa_ratio: Fraction,
                per_running: int = 1) -> list[int | None]:
    """``capacity_pages`` of every stage; slots that leave a stage no room are refused with
    the most that fit on every stage (one stage's own figure, quoted before, was refused in
    turn: by the next stage, or by paged SWA's first page), and the ``--max-running`` that
    gives them (``per_running`` slots per running request: 2 on a PD decode worker)."""
    try:
        return [capacity_pages(lay, budget, slots, swa_ratio) for lay in layouts]
    except TooManySlots as e:
        for lay in layouts:  # a stage that cannot hold one request says so (not "at most 0")
            try:
                capacity_pages(lay, budget, per_running, swa_ratio)
            except TooManySlots as one:  # (per_running > 1: one slot would fit, not one request)
                raise UsageError(f"{one}; no --max-running fits: a PD decode worker holds "
                                 f"{per_running} request slots per running request (one for "
                                 f"its incoming transfer)") from None
        lo, hi = per_running, slots - 1  # the most slots that fit everywhere: in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            try:
                for lay in layouts:
                    capacity_pages(lay, budget, mid, swa_ratio)
                lo = mid
            except UsageError:
                hi = mid - 1
        raise UsageError(f"{e}; at most {lo} request slots fit on every stage (--max-running "
                         f"{lo // per_running})") from None


def device_rows(layout: Layout, pages: int, slots: int, swa_ratio: Fraction) -> dict[str, int]:
    """Rows per index space present on this stage, for ``pages`` full-token pages."""
    rows = {"page": pages, "swa_page": math.floor(pages * swa_ratio), "req_slot": slots}
    return {s: rows[s] for s in INDEX_SPACES if layout.space_pools(s)}


def rows_bytes(layout: Layout, rows: dict[str, int]) -> int:
    """Bytes of ``rows`` row ids per index space, over every pool and layer."""
    return sum(n * layout.row_bytes(space) for space, n in rows.items())


def host_rows(
    layout: Layout, device: dict[str, int],
    host_bytes: int | None = None, ratio: Fraction | float | None = None,
) -> dict[str, int]:
    """Host rows per space, proportional to the device rows; ``{}`` when no host size is given."""
    if host_bytes is None and ratio is None:
        return {}
    if ratio is not None and ratio > host_sizing.MAX_HOST_RATIO:  # (before float() overflows)
        raise UsageError(f"--host-ratio is over {host_sizing.MAX_HOST_RATIO}: a host tier that "
                         f"size is no machine's (give --host-mem in bytes)")
    return host_sizing.host_rows(layout, device, host_bytes=host_bytes,
                                 ratio=None if ratio is None else float(ratio))


def stage_host_rows(layouts: Sequence[Layout], devices: Sequence[dict[str, int]],
                    host_mem: int | None, host_ratio: Fraction | float | None, host_split: str,
                    pages_per_checkpoint: int) -> list[dict[str, int]]:
    """Host rows of every stage (``sizes.host_rows``, or ``sizes.checkpoint_host_rows`` with
    ``host_split="checkpoints"``). With ``host_mem`` and more than one stage the stages agree
    on the smallest, as they do on device pages: each index space gets, on every stage that
    uses it, the fewest rows any stage's budget gives it (stages of more layers hold fewer
    rows in the same bytes), so a prefix fits on every stage or on none. ``host_ratio`` rows
    follow the device rows, which the stages share already. A stage's refusal is led by its
    rank when there are several."""
    if host_mem is None and host_ratio is None:
        return [{} for _ in layouts]
    out = []
    for lay, dev in zip(layouts, devices):
        try:
            if host_split == "checkpoints":
                assert host_mem is not None
                out.append(host_sizing.checkpoint_host_rows(lay, dev, host_mem,
                                                            pages_per_checkpoint))
            else:
                out.append(host_rows(lay, dev, host_mem, host_ratio))
        except UsageError as e:
            if len(layouts) == 1:
                raise
            raise type(e)(f"stage {lay.stage.pp_rank}: {e}") from None
    if host_mem is None or len(out) == 1:
        return out
    least: dict[str, int] = {}
    for rows in out:
        for space, n in rows.items():
            least[space] = min(n, least.get(space, n))
    return [{space: least[space] for space in rows} for rows in out]


# --------------------------------------------------------------------------- results
@dataclass(frozen=True)
class StagePlan:
    """One pipeline stage: its pools, its own capacity and the rows of the worker's capacity."""

    layout: Layout
    budget: int
    slots: int
    swa_ratio: Fraction
    pages: int | None  # what this stage alone could hold; None = unbounded
    device_rows: dict[str, int] = field(default_factory=dict)
    host_rows: dict[str, int] = field(default_factory=dict)
    warnings: tuple[str, ...] = ()  # this stage's (``hicache serve`` prints its stage's)

    @property
    def token_capacity(self) -> int | None:
        return None if self.pages is None else self.pages * self.layout.model.page_size

    @property
    def bytes_per_full_token(self) -> Fraction:
        return page_cost(self.layout, self.swa_ratio) / self.layout.model.page_size

    @property
    def fixed_bytes_per_request(self) -> int:
        return fixed_bytes_per_request(self.layout)

    @property
    def device_bytes(self) -> int:
        return rows_bytes(self.layout, self.device_rows)

    @property
    def host_bytes(self) -> int:
        """Host arena bytes of ``host_rows``, alignment padding included."""
        return host_sizing.arena_bytes(self.layout, self.host_rows) if self.host_rows else 0

    def to_dict(self) -> dict[str, Any]:
        lay, st = self.layout, self.layout.stage
        return {
            "pp_rank": st.pp_rank,
            "start_layer": st.start,
            "end_layer": st.end,
            "mtp_layers": len(st.layers("swa")) - (st.end - st.start),
            "pools": [
                {"name": p.name, "index": p.index, "dtype": p.dtype,
                 "tokens_per_page": p.tokens_per_page, "page_bytes": p.page_bytes,
                 "scale_offset": p.scale_offset, "ring": p.ring, "num_layers": p.num_layers,
                 "layers": list(p.layers)}
                for p in lay.pools.values()
            ],
            "row_bytes": {s: lay.row_bytes(s) for s in INDEX_SPACES if lay.space_pools(s)},
            "bytes_per_full_token": float(self.bytes_per_full_token),
            "fixed_bytes_per_request": self.fixed_bytes_per_request,
            "fixed_bytes": self.fixed_bytes_per_request * self.slots,
            "one_request_bytes": one_request_bytes(lay, self.swa_ratio),
            "token_capacity": self.token_capacity,
            "device_rows": dict(self.device_rows),
            "device_bytes": self.device_bytes,
            "unused_bytes": self.budget - self.device_bytes,
            "host_rows": dict(self.host_rows),
            "host_bytes": self.host_bytes,
        }


@dataclass(frozen=True)
class Plan:
    inputs: PlanInputs
    request_slots: int
    stages: list[StagePlan]
    paged_capacity: int | None  # tokens per DP worker, min over stages
    ring_capacity: int | None
    warnings: list[str]
    unfit: tuple[str, ...] = ()  # the SWA mode compared that does not fit (its capacity: None)

    @property
    def token_capacity(self) -> int | None:
        return self.ring_capacity if self.inputs.swa_mode == "ring" else self.paged_capacity

    @property
    def ring_vs_paged(self) -> float | None:
        if not self.paged_capacity or self.ring_capacity is None:
            return None
        return self.ring_capacity / self.paged_capacity

    def to_dict(self) -> dict[str, Any]:
        i, cap = self.inputs, self.token_capacity
        m = i.effective_model
        return {
            "inputs": i.to_dict(),
            "model": {"name": m.name, "num_layers": m.num_layers,
                      "num_mtp_layers": m.num_mtp_layers,
                      "compress_ratios": list(m.compress_ratios),
                      "mtp_compress_ratios": list(m.mtp_compress_ratios)},
            "gpus": i.tp * i.pp * i.dp,
            "request_slots": self.request_slots,
            "stages": [s.to_dict() for s in self.stages],
            "token_capacity": cap,
            "total_token_capacity": None if cap is None else cap * i.dp,
            "paged_token_capacity": self.paged_capacity,
            "ring_token_capacity": self.ring_capacity,
            "ring_vs_paged_capacity_ratio": self.ring_vs_paged,
            "swa_modes_that_do_not_fit": list(self.unfit),
            "warnings": list(self.warnings),
        }


# --------------------------------------------------------------------------- planning
def stage_layouts(inputs: PlanInputs, swa_mode: str) -> list[Layout]:
    model = inputs.effective_model
    if inputs.bounds is None:
        bounds: Sequence[tuple[int, int]] = stage_bounds(model.num_layers, inputs.pp)
    else:
        check_bounds(model.num_layers, inputs.bounds)
        bounds = inputs.bounds
    return [
        build_layout(model, inputs.pp, r, bounds=bounds, swa_mode=swa_mode,
                     c128_state=inputs.c128_state, mtp=inputs.use_mtp)
        for r in range(inputs.pp)
    ]


def _min_pages(pages: Sequence[int | None]) -> int | None:
    bounded = [p for p in pages if p is not None]
    return min(bounded) if bounded else None


def mode_capacity(inputs: PlanInputs, swa_mode: str) -> int | None:
    """Tokens per DP worker in ``swa_mode`` (min over stages); raises when nothing fits."""
    slots = request_slots(inputs.max_running, inputs.pd_role)
    pages = _min_pages(stage_pages(stage_layouts(inputs, swa_mode), inputs.kv_mem, slots,
                                   inputs.swa_ratio, request_slots(1, inputs.pd_role)))
    return None if pages is None else pages * inputs.model.page_size


def _swa_warning(layout: Layout, rows: dict[str, int], slots: int,
                 swa_ratio: Fraction) -> str | None:
    """Paged SWA: each running request needs the pages its window can straddle. The advice
    names only the levers that can help: a higher SWA ratio while it is below 1, the budget,
    and fewer request slots (how many the pool's windows hold)."""
    if "swa_page" not in rows:
        return None
    window = layout.model.window_pages
    need = slots * window
    if rows["swa_page"] >= need:
        return None
    levers = (["--swa-full-tokens-ratio (at most 1)"] if swa_ratio < 1 else []) + \
        ["the budget"]
    return (f"stage {layout.stage.pp_rank}: paged SWA pool has {rows['swa_page']} pages, fewer "
            f"than the {need} that {slots} request slots need for their window; raise "
            f"{' or '.join(levers)}, or lower --max-running (these pages hold the windows of "
            f"{rows['swa_page'] // window} request slots)")


def plan(inputs: PlanInputs) -> Plan:
    """The capacity plan of ``inputs`` (see the module docstring)."""
    slots = request_slots(inputs.max_running, inputs.pd_role)
    layouts = stage_layouts(inputs, inputs.swa_mode)
    own = stage_pages(layouts, inputs.kv_mem, slots, inputs.swa_ratio,
                      request_slots(1, inputs.pd_role))
    worker = _min_pages(own)  # the PP ranks agree on the smallest stage
    stages, warnings = [], []
    devs = [device_rows(lay, worker or 0, slots, inputs.swa_ratio) for lay in layouts]
    hosts = stage_host_rows(layouts, devs, inputs.host_mem, inputs.host_ratio,
                            inputs.host_split, inputs.pages_per_checkpoint)  # as serve's
    for lay, pages, dev, host in zip(layouts, own, devs, hosts):
        w = _swa_warning(lay, dev, slots, inputs.swa_ratio)
        stages.append(StagePlan(lay, inputs.kv_mem, slots, inputs.swa_ratio, pages, dev, host,
                                (w,) if w else ()))
        if w:
            warnings.append(w)
    capacity = {inputs.swa_mode: None if worker is None else worker * inputs.model.page_size}
    other = "ring" if inputs.swa_mode == "paged" else "paged"
    unfit: tuple[str, ...] = ()
    try:
        capacity[other] = mode_capacity(inputs, other)
    except (UsageError, LayoutError) as e:  # (ring SWA: a window wider than a page)
        capacity[other], unfit = None, (other,)
        warnings.append(f"{other} SWA mode does not fit these inputs: {e}")
    return Plan(inputs, slots, stages, capacity["paged"], capacity["ring"], warnings, unfit)

