"""What a resume at a page boundary needs, per pool, derived from a ``Layout`` (DESIGN §15).

Contract (a leaf module: imports only ``hicache.core.layout``). After a cached prefix of ``b``
full pages (``b * P`` tokens, ``P`` = page size), the next tokens' attention reads:

* **every prefix page** of the ``page`` space pools (C4 KV, C4 indexer K, C128 KV): page rows;
* **the SWA KV of the last ``window`` tokens**: tokens ``[P - window, P)`` of the boundary page, a
  token range (a token's 576 B value and 8 B scale are not one byte range), copied token-granular;
* **the C4 and C4-indexer compress state at the boundary**: the state ring row of the boundary
  page's SWA row (paged SWA mode) or of the request slot (ring SWA mode);
* **no C128 state**: ``P`` is a multiple of 128, so every C128 group is complete at a boundary
  (a model whose page size is not raises ``LayoutError``: its resumes would need that state).

A *checkpoint* is the boundary part (SWA tail + states). Assumption made an option,
``state_slots``: ``"ring"`` (default) restores the whole state ring row; ``"overlap"`` says only
the slots of the last ``ratio`` tokens (the group the next C4 group overlaps) are read. The
overlap option changes the byte model only; no copy path moves part of a ring row, so a copying
replay refuses it (``copyable``).

Ring SWA mode: the SWA tail goes to ring positions ``pos % window`` of the request slot's row.
Byte figures: ``page_bytes`` (compressed rows of one page), ``checkpoint_bytes`` (bytes a
checkpoint moves), ``checkpoint_host_bytes`` (what it occupies on the host: one host row of its
space, since host pools mirror device rows), ``full_page_bytes`` (a full mirror of one page).
``host_tier(host_bytes, mirror, pages_per_ckpt)`` splits a host budget into page rows and
checkpoint rows (one checkpoint row per ``pages_per_ckpt`` page rows; the daemon's arena has
fixed regions per space, so the split is chosen up front; alignment padding, < 4 KiB per
layer region, is left out).
"""
from __future__ import annotations

from dataclasses import dataclass, field

from hicache.core.layout import Layout, LayoutError, PoolSpec

STATE_SLOTS = ("ring", "overlap")
MIRRORS = ("full", "checkpoints")
C4_RATIO = 4
DEFAULT_PAGES_PER_CKPT = 32  # host tier split: one checkpoint row per this many page rows


@dataclass(frozen=True)
class ResumeModel:
    """The resume needs of one stage's layout (see the module docstring)."""

    layout: Layout
    state_slots: str = "ring"
    swa_pool: PoolSpec | None = field(init=False, compare=False)
    state_pools: tuple[PoolSpec, ...] = field(init=False, compare=False)
    page_pools: tuple[PoolSpec, ...] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.state_slots not in STATE_SLOTS:
            raise LayoutError(f"state_slots must be one of {STATE_SLOTS}, got {self.state_slots!r}")
        m = self.layout.model
        if m.page_size % 128:
            raise LayoutError(f"page size {m.page_size} is not a multiple of 128: a resume would "
                              "need the C128 compress state, which the checkpoint model omits")
        if m.window > m.page_size:
            raise LayoutError(f"window {m.window} is longer than a page ({m.page_size}): the "
                              "SWA tail would span two pages")
        pools = self.layout.pools
        object.__setattr__(self, "swa_pool", pools.get("swa_kv"))
        object.__setattr__(self, "state_pools", tuple(
            pools[n] for n in ("c4_state", "c4_indexer_state") if n in pools))
        object.__setattr__(self, "page_pools", tuple(self.layout.space_pools("page")))

    # ------------------------------------------------------------------ token ranges
    @property
    def window(self) -> int:
        return self.layout.model.window

    @property
    def page_size(self) -> int:
        return self.layout.model.page_size

    @property
    def tail_offsets(self) -> range:
        """Token offsets, inside the boundary page, of the SWA tail a resume reads."""
        return range(self.page_size - self.window, self.page_size)

    def ring_positions(self, boundary_pages: int) -> list[int]:
        """Ring SWA mode: positions ``pos % window`` of the tail tokens, in tail order."""
        end = boundary_pages * self.page_size
        return [(end - self.window + i) % self.window for i in range(self.window)]

    @property
    def checkpoint_space(self) -> str:
        """Host index space a checkpoint occupies one row of: ``swa_page`` or ``req_slot``."""
        return "swa_page" if self.layout.swa_mode == "paged" else "req_slot"

    @property
    def copyable(self) -> str | None:
        """``None`` when the copy path can move a checkpoint, else the reason it cannot."""
        if self.state_slots == "overlap" and self.state_pools:
            return ("state_slots 'overlap' restores part of a state ring row; the daemon copies "
                    "whole rows (or tokens of token-format pools), so only the byte model uses it")
        return None

    # ------------------------------------------------------------------ bytes
    @property
    def page_bytes(self) -> int:
        """Compressed rows of one page, every pool and layer (what every cached page carries)."""
        return self.layout.row_bytes("page")

    @property
    def swa_tail_bytes(self) -> int:
        p = self.swa_pool
        return 0 if p is None else self.window * p.token_bytes * p.num_layers

    def state_bytes_of(self, spec: PoolSpec) -> int:
        """Bytes of one state pool a checkpoint needs (all layers)."""
        if self.state_slots == "ring":
            return spec.page_bytes * spec.num_layers
        return spec.page_bytes // spec.ring * min(C4_RATIO, spec.ring) * spec.num_layers

    @property
    def state_bytes(self) -> int:
        return sum(self.state_bytes_of(p) for p in self.state_pools)

    @property
    def checkpoint_bytes(self) -> int:
        """Bytes one checkpoint moves (SWA tail tokens + boundary states)."""
        return self.swa_tail_bytes + self.state_bytes

    @property
    def checkpoint_host_bytes(self) -> int:
        """Host bytes one checkpoint occupies: a whole host row of its space."""
        return self.layout.row_bytes(self.checkpoint_space)

    @property
    def full_page_bytes(self) -> int:
        """One page mirrored in full (paged SWA): its ``page`` and ``swa_page`` rows."""
        return self.layout.row_bytes("page") + self.layout.row_bytes("swa_page")

    def load_bytes(self, pages: int, mirror: str) -> int:
        """Bytes a LOAD of a ``pages``-page resumable prefix moves under ``mirror``."""
        if mirror not in MIRRORS:
            raise LayoutError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
        if mirror == "full":
            if self.layout.swa_mode != "paged":
                raise LayoutError("a full mirror needs paged SWA (ring mode keeps no SWA rows "
                                  "per page)")
            return pages * self.full_page_bytes
        return pages * self.page_bytes + (self.checkpoint_bytes if pages else 0)

    def to_dict(self) -> dict[str, object]:
        return {
            "state_slots": self.state_slots, "swa_mode": self.layout.swa_mode,
            "every_page": [p.name for p in self.page_pools],
            "swa_tail": None if self.swa_pool is None else {
                "pool": self.swa_pool.name,
                "tokens": [self.tail_offsets.start, self.tail_offsets.stop]},
            "boundary_state": [p.name for p in self.state_pools],
            "c128_state": "none (every C128 group is complete at a page boundary)",
            "page_bytes": self.page_bytes, "checkpoint_bytes": self.checkpoint_bytes,
            "checkpoint_host_bytes": self.checkpoint_host_bytes,
        }

    def host_tier(self, host_bytes: int, mirror: str,
                  pages_per_ckpt: int = DEFAULT_PAGES_PER_CKPT) -> tuple[int, int]:
        """(page rows, checkpoint rows) that ``host_bytes`` of host tier holds under ``mirror``."""
        if mirror not in MIRRORS:
            raise LayoutError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
        if pages_per_ckpt < 1:
            raise LayoutError(f"pages per checkpoint must be >= 1, got {pages_per_ckpt}")
        if mirror == "full":
            self.load_bytes(1, "full")  # refuses ring mode with its reason
            return host_bytes // self.full_page_bytes, 0
        K = pages_per_ckpt
        pages = host_bytes * K // (K * self.page_bytes + self.checkpoint_host_bytes)
        if pages >= K:
            return pages, pages // K
        rest = host_bytes - self.checkpoint_host_bytes  # a small tier: one checkpoint row
        return (rest // self.page_bytes, 1) if rest >= self.page_bytes else (0, 0)
