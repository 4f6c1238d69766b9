"""Host sizing: byte strings, the arena's region plan, and host rows from a budget or a ratio.

Contract (pure arithmetic, no torch):

* ``parse_bytes("16GiB", what) -> int`` is THE byte-size parser of every command, flag, TOML
  key and ``HICACHE_*`` variable. Units are case-insensitive and exact (``Decimal``, floored to
  a byte): binary ``KiB MiB GiB TiB`` and their one-letter forms ``K M G T`` (2^10 ...);
  decimal ``KB MB GB TB`` (10^3 ...); ``B`` or nothing = bytes. So ``100G`` = ``100GiB`` =
  107,374,182,400 B while ``100GB`` = ``100gb`` = 10^11 B (93.13 GiB). Digits may be grouped
  with ``_`` (``1_000MiB``). Negative, fractional-byte-free forms like ``1e9``, and unknown
  units raise ``UsageError`` naming ``what`` (the flag or key), as does a size above
  ``MAX_BYTES`` (1 EiB: no machine's). ``format_bytes(n) -> str``.
* ``plan_regions(layout, rows)``: the arena is **layer-major per pool**: for every pool (in
  ``layout.pools`` order) and every layer it owns (local order), one region of
  ``rows[pool.index] * pool.page_bytes`` bytes, each region starting on a ``REGION_ALIGN``
  (4 KiB) boundary. ``arena_bytes(layout, rows)`` is the end of the last region, so
  ``arena_bytes == sum of region bytes + alignment padding`` with padding < 4 KiB per region.
* ``host_rows(layout, device_rows, host_bytes=None, ratio=None)``: rows per index space,
  proportional to the device rows: from a byte budget (``arena_bytes(rows) <= host_bytes``
  guaranteed) or from a host:device ratio. Too small a budget raises ``CapacityError``.
"""
from __future__ import annotations

import math
import re
from decimal import Decimal, InvalidOperation
from fractions import Fraction
from dataclasses import dataclass
from typing import Mapping, Sequence

from hicache.core.errors import CapacityError, UsageError
from hicache.core.layout import INDEX_SPACES, Layout, LayoutError
from hicache.core.resume import ResumeModel

REGION_ALIGN = 4096  # every layer region starts page-aligned (registration chunks cut there)

_UNITS = {
    "": 1, "b": 1,
    "k": 1 << 10, "kib": 1 << 10, "m": 1 << 20, "mib": 1 << 20,
    "g": 1 << 30, "gib": 1 << 30, "t": 1 << 40, "tib": 1 << 40,
    "kb": 10**3, "mb": 10**6, "gb": 10**9, "tb": 10**12,
}
_SIZE_RE = re.compile(r"^\s*([0-9][0-9_]*(?:\.[0-9_]*)?)\s*([a-zA-Z]*)\s*$")
MAX_BYTES = 1 << 60  # 1 EiB: a size above it is a typo, not a machine
UNITS_HELP = ("bytes, or a number with KiB MiB GiB TiB (= K M G T, 2^10 steps) or KB MB GB TB "
              "(10^3 steps), e.g. 100GiB; 100G = 100GiB, 100GB = 10^11 B")


def parse_bytes(text: str | int, what: str = "size") -> int:
    """``"16GiB"``, ``"1.5G"``, ``"1_000MiB"``, ``"80GB"``, ``"4096"`` -> bytes (see the module
    docstring). Raises ``UsageError`` naming ``what``."""
    if isinstance(text, bool):
        raise UsageError(f"{what}: not a size: {text!r}")
    if isinstance(text, int):
        if text < 0:
            raise UsageError(f"{what} must not be negative, got {text}")
        n, s = text, str(text)
    else:
        n, s = _parse_text(text, what), str(text).strip()
    if n > MAX_BYTES:
        shown = s if len(s) <= 40 else s[:37] + "..."
        raise UsageError(f"{what}: {shown!r} is more than {format_bytes(MAX_BYTES)}, which no "
                         f"machine has")
    return n


def _parse_text(text: str, what: str) -> int:
    s = str(text).strip()
    if s.startswith("-"):
        raise UsageError(f"{what} must not be negative, got {text!r}")
    m = _SIZE_RE.match(s)
    unit = m.group(2).lower() if m else ""
    if not m or unit not in _UNITS or m.group(1).endswith("_"):
        raise UsageError(f"{what}: cannot read {text!r} as a size; use {UNITS_HELP}")
    try:
        value = Decimal(m.group(1).replace("_", ""))
    except InvalidOperation:
        raise UsageError(f"{what}: cannot read {text!r} as a size") from None
    return int(value * _UNITS[unit])


def format_bytes(n: int | float) -> str:
    """Human-readable binary size, e.g. ``16.00 GiB``."""
    if abs(n) < 1024:
        return f"{int(n)} B"
    x = float(n)
    for unit in ("KiB", "MiB", "GiB", "TiB"):
        x /= 1024
        if abs(x) < 1024 or unit == "TiB":
            break
    return f"{x:.2f} {unit}"


def align_up(n: int, a: int = REGION_ALIGN) -> int:
    return (n + a - 1) // a * a


SPARSE_ALIGN = 4096  # a HiSparse region's layer stride and its token page


def sparse_layers_bytes(layers: int, rows: int, page_bytes: int) -> int:
    """A HiSparse region's C4 layers (each ``rows`` pages, aligned): its memfd holds one
    ``SPARSE_ALIGN`` token page more, at this offset (``hicache.core.sparse_shm``)."""
    return max(SPARSE_ALIGN, layers * align_up(rows * page_bytes, SPARSE_ALIGN))


def sparse_region_bytes(layout: Layout, rows: int) -> int:
    """The memory one client's HiSparse region of ``rows`` C4 rows takes (0 without C4)."""
    c4 = layout.pools.get("c4_kv")
    if c4 is None or rows <= 0:
        return 0
    return sparse_layers_bytes(c4.num_layers, rows, c4.page_bytes) + SPARSE_ALIGN


@dataclass(frozen=True)
class Region:
    """One layer of one pool in the arena: ``nbytes = rows * item_bytes`` at ``offset``."""

    pool: str
    layer: int  # local layer id within the pool
    offset: int
    nbytes: int
    item_bytes: int  # bytes of one row (page_bytes)


def used_spaces(layout: Layout) -> list[str]:
    """Index spaces that at least one pool of this stage uses, in ``INDEX_SPACES`` order."""
    return [s for s in INDEX_SPACES if layout.space_pools(s)]


def check_rows(layout: Layout, rows: Mapping[str, int]) -> dict[str, int]:
    """Rows given for exactly the spaces this layout uses, each a positive int."""
    if not isinstance(rows, Mapping):
        raise UsageError(f"rows must map index space -> row count, got {type(rows).__name__}")
    want = used_spaces(layout)
    unknown = sorted(set(rows) - set(INDEX_SPACES))
    if unknown:
        raise UsageError(f"unknown index spaces {unknown}; spaces are {list(INDEX_SPACES)}")
    extra = sorted(set(rows) - set(want))
    missing = [s for s in want if s not in rows]
    if extra or missing:
        st = layout.stage
        raise UsageError(
            f"rows must be given for the spaces this stage uses {want}"
            + (f"; missing {missing}" if missing else "")
            + (f"; stage {st.pp_rank} (layers [{st.start}, {st.end})) has no pool of "
               f"{' or '.join(extra)}: drop {'it' if len(extra) == 1 else 'them'}"
               if extra else "")
        )
    out = {}
    for s in want:
        n = rows[s]
        if isinstance(n, bool) or not isinstance(n, int) or n <= 0:
            raise UsageError(f"rows for space {s!r} must be a positive int, got {n!r}")
        out[s] = n
    return out


def plan_regions(layout: Layout, rows: Mapping[str, int]) -> list[Region]:
    """The arena's regions, in address order (see the module docstring)."""
    rows = check_rows(layout, rows)
    regions, end = [], 0
    for spec in layout.pools.values():
        n = rows[spec.index] * spec.page_bytes
        for local in range(spec.num_layers):
            off = align_up(end)
            regions.append(Region(spec.name, local, off, n, spec.page_bytes))
            end = off + n
    return regions


def arena_bytes(layout: Layout, rows: Mapping[str, int]) -> int:
    """Exact arena size for ``rows``: sum of regions plus < 4 KiB alignment each."""
    regions = plan_regions(layout, rows)
    return regions[-1].offset + regions[-1].nbytes if regions else 0


MAX_HOST_RATIO = 4096  # host rows per device row, at most (--host-ratio)

def host_rows(
    layout: Layout, device_rows: Mapping[str, int], host_bytes: int | None = None,
    ratio: float | None = None,
) -> dict[str, int]:
    """Host rows per used space, proportional to ``device_rows``; exactly one of the two limits.

    Spaces in ``device_rows`` that no pool of this stage uses are ignored.
    """
    if (host_bytes is None) == (ratio is None):
        raise UsageError("give exactly one of host_bytes or ratio")
    unknown = sorted(set(device_rows) - set(INDEX_SPACES))
    if unknown:
        raise UsageError(f"unknown index spaces {unknown}; spaces are {list(INDEX_SPACES)}")
    want = used_spaces(layout)
    dev = check_rows(layout, {s: device_rows[s] for s in want if s in device_rows})
    if ratio is not None:
        if isinstance(ratio, bool) or not isinstance(ratio, (int, float)) or not ratio > 0 \
                or not math.isfinite(ratio):
            raise UsageError(f"host:device ratio must be a positive number, got {ratio!r}")
        if ratio > MAX_HOST_RATIO:
            raise UsageError(f"host:device ratio {ratio:g} is over {MAX_HOST_RATIO}: a host "
                             f"tier that size is no machine's (give --host-mem in bytes)")
        # the ratio its text meant (1.15: 23/20, 1:3: 1/3): in floats 100 x 1.15 is 114.999...
        exact = Fraction(ratio).limit_denominator(10**6)
        rows = {s: math.floor(dev[s] * exact) for s in want}
        small = [s for s in want if rows[s] < 1]
        if small:
            raise CapacityError(f"ratio {ratio} leaves no host rows in spaces {small}")
        return rows
    if isinstance(host_bytes, bool) or not isinstance(host_bytes, int) or host_bytes <= 0:
        raise UsageError(f"the host memory (--host-mem) must be positive, got {host_bytes!r}")
    n_regions = sum(p.num_layers for p in layout.pools.values())
    per_unit = sum(dev[s] * layout.row_bytes(s) for s in want)  # bytes of one device-sized set
    budget = host_bytes - n_regions * (REGION_ALIGN - 1)  # worst-case alignment padding
    rows = {s: max(0, budget) * dev[s] // per_unit for s in want}
    if any(r < 1 for r in rows.values()):
        # one row of space s takes per_unit / dev[s] of the budget, in proportion
        least = max(-(-per_unit // dev[s]) for s in want) + n_regions * (REGION_ALIGN - 1)
        none = [s for s in want if rows[s] < 1]
        raise CapacityError(
            f"host budget {format_bytes(host_bytes)} is too small for this stage: rows in "
            f"proportion to the device pools give no {', '.join(none)} row; at least "
            f"{format_bytes(least)} ({least:,} B with alignment) gives one of each"
        )
    assert arena_bytes(layout, rows) <= host_bytes
    return rows


def checkpoint_host_rows(layout: Layout, device_rows: Mapping[str, int], host_bytes: int,
                         pages_per_ckpt: int) -> dict[str, int]:
    """Host rows for a checkpoints mirror (``--host-split checkpoints``): the request slots'
    rows as on the device (request-state swaps), and the rest of ``host_bytes`` in page rows
    plus one checkpoint row (``ResumeModel.checkpoint_space``: ``swa_page`` in paged SWA mode,
    an extra ``req_slot`` row in ring mode) per ``pages_per_ckpt`` page rows, at least one;
    the arena fits in ``host_bytes`` with its alignment."""
    if pages_per_ckpt < 1:
        raise UsageError(f"--pages-per-checkpoint must be >= 1, got {pages_per_ckpt}")
    try:
        ck = ResumeModel(layout).checkpoint_space
    except LayoutError as e:
        raise UsageError(f"--host-split checkpoints: {e}") from None
    want = used_spaces(layout)
    if "page" not in want:
        raise UsageError(f"--host-split checkpoints: this stage has no page pools (layers "
                         f"[{layout.stage.start}, {layout.stage.end}) hold SWA only), so it has "
                         f"no pages to checkpoint; serve it with the device split")
    dev = check_rows(layout, {s: device_rows[s] for s in want if s in device_rows})
    rows = {s: dev[s] if s == "req_slot" else 0 for s in want}
    n_regions = sum(p.num_layers for p in layout.pools.values())
    budget = host_bytes - n_regions * (REGION_ALIGN - 1) - \
        sum(n * layout.row_bytes(s) for s, n in rows.items())
    page_b, ck_b, k = layout.row_bytes("page"), layout.row_bytes(ck), pages_per_ckpt
    pages = max(0, budget) * k // (k * page_b + ck_b)
    while pages > 0 and pages * page_b + max(1, pages // k) * ck_b > budget:
        pages -= 1  # (fewer than k pages still take a whole checkpoint row)
    if pages < 1:
        least = host_bytes - budget + page_b + ck_b  # one page row and one checkpoint row
        raise CapacityError(f"host budget {format_bytes(host_bytes)} is too small for a "
                            f"checkpoints split of this stage: not one page row and one "
                            f"checkpoint row beside the request slots' rows (at least "
                            f"{format_bytes(least)} with alignment)")
    rows["page"] = pages
    rows[ck] += max(1, pages // k)
    assert arena_bytes(layout, rows) <= host_bytes
    return rows


def checkpoint_host_bytes(layout: Layout, device_rows: Mapping[str, int], pages: int,
                          ckpts: int, pages_per_ckpt: int) -> int:
    """The fewest host bytes whose ``checkpoint_host_rows`` split holds at least ``pages`` page
    rows and ``ckpts`` checkpoint rows (beyond the request slots' rows in ring mode): what a
    caller that sized its tier in rows (the demo) gives ``serve --host-split checkpoints``."""
    if pages < 1 or ckpts < 0 or pages_per_ckpt < 1:
        raise UsageError(f"a checkpoints split needs pages >= 1, checkpoints >= 0 and pages "
                         f"per checkpoint >= 1, got {pages}, {ckpts} and {pages_per_ckpt}")
    ck = ResumeModel(layout).checkpoint_space
    slots = device_rows.get("req_slot", 0) if ck == "req_slot" else 0

    def holds(nbytes: int) -> bool:
        try:
            rows = checkpoint_host_rows(layout, device_rows, nbytes, pages_per_ckpt)
        except CapacityError:
            return False
        return rows["page"] >= pages and rows[ck] - slots >= ckpts

    slot_bytes = device_rows.get("req_slot", 0) * layout.row_bytes("req_slot") \
        if "req_slot" in used_spaces(layout) else 0
    lo, hi = 0, slot_bytes + (pages + 1) * layout.row_bytes("page") + \
        (ckpts + 1) * layout.row_bytes(ck) + \
        sum(p.num_layers for p in layout.pools.values()) * REGION_ALIGN
    while not holds(hi):  # (that estimate holds already; doubling keeps this total)
        hi *= 2
    while lo + 1 < hi:  # holds(hi), not holds(lo): more bytes never hold fewer rows
        mid = (lo + hi) // 2
        lo, hi = (lo, mid) if holds(mid) else (mid, hi)
    return hi


def check_host_larger(layout: Layout, device_rows: Mapping[str, int],
                      host: Mapping[str, int], what: str,
                      spaces: Sequence[str] | None = None) -> None:
    """Refuse a host tier that is not larger than the device pools in some index space (of
    ``spaces``; default every one the stage uses): it could only hold pages the device already
    has (``what`` names the host setting)."""
    small = [s for s in (spaces or used_spaces(layout))
             if host.get(s, 0) <= device_rows.get(s, 0)]
    if small:
        detail = ", ".join(f"{s} {host.get(s, 0)} host <= {device_rows.get(s, 0)} device"
                           for s in small)
        more = "a larger --host-ratio" if what.startswith("--host-ratio") else \
            "more host memory"
        raise UsageError(f"{what} gives a host tier no larger than the device pools ({detail} "
                         f"rows): it could only keep pages the device already holds; give "
                         f"{more}, or --force to run it anyway")
