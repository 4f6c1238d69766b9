"""DSV4 device-layout model: per-pool row formats and PP-stage-local layer maps.

Contract (a leaf module: imports nothing of ours, nothing heavier than the standard library):

* ``ModelSpec`` (``hicache.core.model``, re-exported here) describes a model.
* ``StageMap`` owns every global<->local layer translation of one pipeline stage. A layer a
  pool does not own answers ``None``; it is never indexed. MTP draft layers (global ids
  ``num_layers ..``) belong to the last stage and come after its target layers.
* ``Layout`` = model + stage + modes -> one ``PoolSpec`` per device pool, with exact bytes per
  page row per layer (padding included), value/scale offsets of the token format, and the
  layers it owns. Page row ``k`` of every page-indexed pool covers the same 256 full tokens.
* ``Layout.to_dict`` / ``Layout.from_dict`` round-trip through JSON (used on the wire).

Every bad input raises ``LayoutError`` with a message that names the numbers involved.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

from hicache.core.model import (C128_OFFLINE_RING, PAGE_SIZE, PRESETS, STATE_RING, VALID_RATIOS,
                                LayoutError, ModelSpec, brief, exact_int, load_model,
                                model_from_hf_config, preset)

__all__ = ["C128_OFFLINE_RING", "PAGE_SIZE", "PRESETS", "STATE_RING", "VALID_RATIOS", "LayoutError",
           "ModelSpec", "load_model", "model_from_hf_config", "preset", "StageMap", "PoolSpec",
           "Layout", "INDEX_SPACES", "POOL_NAMES", "build_layout", "all_stages", "stage_bounds",
           "check_bounds", "mla_page_bytes"]


def stage_bounds(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Even split of target layers over ``pp_size`` stages; the last ``num_layers % pp_size``
    stages take one layer more each: SGLang's own split (``get_pp_indices`` without
    ``SGLANG_PP_LAYER_PARTITION``), so a daemon's default stage is the one its engine runs."""
    if pp_size <= 0:
        raise LayoutError(f"pp size must be positive, got {pp_size}")
    if pp_size > num_layers:
        raise LayoutError(f"pp size {pp_size} is larger than the {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    bounds, start = [], 0
    for r in range(pp_size):
        end = start + base + (1 if r >= pp_size - extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_bounds(num_layers: int, bounds: Sequence[tuple[int, int]]) -> None:
    """Explicit ``[start, end)`` per stage must tile ``0..num_layers`` with no gap or overlap."""
    expect = 0
    for i, (s, e) in enumerate(bounds):
        if s != expect:
            raise LayoutError(
                f"stage {i} bounds [{s}, {e}) do not continue from layer {expect} "
                "(stages must tile the layers in order, each non-empty)"
            )
        if e <= s:
            raise LayoutError(f"stage {i} bounds [{s}, {e}) hold no layer (stages must tile "
                              "the layers in order, each non-empty)")
        expect = e
    if expect != num_layers:
        raise LayoutError(f"stages cover layers 0..{expect}, model has {num_layers}")


@dataclass(frozen=True)
class StageMap:
    """Global<->local layer ids of one pipeline stage, per pool family.

    Families: ``swa`` (every layer of the stage), ``c4`` (ratio-4 layers: C4 KV, indexer and
    both C4 states), ``c128`` (ratio-128 layers: C128 KV and state).
    """

    model: ModelSpec
    pp_rank: int
    pp_size: int
    start: int
    end: int
    with_mtp: bool = True
    families: dict[str, tuple[int, ...]] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if not 0 <= self.pp_rank < self.pp_size:
            raise LayoutError(f"pp rank {self.pp_rank} is outside 0..{self.pp_size - 1}")
        if not 0 <= self.start < self.end <= self.model.num_layers:
            raise LayoutError(
                f"stage [{self.start}, {self.end}) is not inside 0..{self.model.num_layers}"
            )
        layers = list(range(self.start, self.end))
        if self.with_mtp and self.pp_rank == self.pp_size - 1:
            layers += list(range(self.model.num_layers, self.model.total_layers))
        fam = {
            "swa": tuple(layers),
            "c4": tuple(g for g in layers if self.model.ratio(g) == 4),
            "c128": tuple(g for g in layers if self.model.ratio(g) == 128),
        }
        object.__setattr__(self, "families", fam)

    @staticmethod
    def build(
        model: ModelSpec, pp_size: int = 1, pp_rank: int = 0,
        bounds: Sequence[tuple[int, int]] | None = None, with_mtp: bool = True,
    ) -> "StageMap":
        if bounds is None:
            bounds = stage_bounds(model.num_layers, pp_size)
        else:
            if len(bounds) != pp_size:
                raise LayoutError(f"{len(bounds)} stage bounds given for pp size {pp_size}")
            check_bounds(model.num_layers, bounds)
        if not 0 <= pp_rank < pp_size:
            raise LayoutError(f"pp rank {pp_rank} is outside 0..{pp_size - 1}")
        s, e = bounds[pp_rank]
        return StageMap(model, pp_rank, pp_size, s, e, with_mtp)

    def layers(self, family: str) -> tuple[int, ...]:
        try:
            return self.families[family]
        except KeyError:
            raise LayoutError(f"unknown layer family {family!r}") from None

    def local_id(self, family: str, global_layer: int) -> int | None:
        """Local id of ``global_layer`` in ``family``, or ``None`` when this stage does not own it."""
        ids = self.layers(family)
        try:
            return ids.index(global_layer)
        except ValueError:
            return None

    def global_id(self, family: str, local: int) -> int:
        ids = self.layers(family)
        if not 0 <= local < len(ids):
            raise LayoutError(f"{family} local id {local} is outside 0..{len(ids) - 1}")
        return ids[local]

    def to_dict(self) -> dict[str, Any]:
        return {"pp_rank": self.pp_rank, "pp_size": self.pp_size, "start": self.start,
                "end": self.end, "with_mtp": self.with_mtp}


# --------------------------------------------------------------------------- pool specs
def mla_page_bytes(tokens: int, value_bytes: int, scale_bytes: int) -> int:
    """Values, then scales, then zero padding to a multiple of ``value_bytes``."""
    return math.ceil(tokens * (value_bytes + scale_bytes) / value_bytes) * value_bytes


@dataclass(frozen=True)
class PoolSpec:
    """One device pool: the format of one row (page or slot) of one layer, and its layers.

    ``index`` says what a row id means: ``page`` (full-token page, the anchor), ``swa_page``
    (an SWA page in paged mode, a request slot in ring mode) or ``req_slot``.
    Token-format pools (``value_bytes > 0``) hold ``tokens_per_page`` tokens per row: token t's
    value at ``t * value_bytes`` and its scale at ``scale_offset + t * scale_bytes``.
    """

    name: str
    family: str  # swa | c4 | c128: which StageMap family gives its layers
    ratio: int
    index: str
    dtype: str
    page_bytes: int
    tokens_per_page: int = 0
    value_bytes: int = 0
    scale_bytes: int = 0
    scale_offset: int = 0
    ring: int = 1
    layers: tuple[int, ...] = ()

    @property
    def num_layers(self) -> int:
        return len(self.layers)

    @property
    def token_granular(self) -> bool:
        return self.value_bytes > 0

    @property
    def token_bytes(self) -> int:
        return self.value_bytes + self.scale_bytes

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["layers"] = list(self.layers)
        return d


# Row-id spaces: one allocator each. Pools of one space share row ids, so row k of every pool
# of the "page" space covers the same 256 full tokens.
INDEX_SPACES = ("page", "swa_page", "req_slot")

POOL_NAMES = ("swa_kv", "c4_kv", "c4_indexer", "c128_kv", "c4_state", "c4_indexer_state",
              "c128_state")


@dataclass(frozen=True)
class Layout:
    """Every device pool of one stage of one model, under the chosen modes."""

    model: ModelSpec
    stage: StageMap
    swa_mode: str = "paged"  # "paged" | "ring"
    c128_state: str = "online"  # "online" | "offline"
    pools: dict[str, PoolSpec] = field(init=False, compare=False)

    def __post_init__(self) -> None:
        if self.swa_mode not in ("paged", "ring"):
            raise LayoutError(f"swa_mode must be 'paged' or 'ring', got {self.swa_mode!r}")
        if self.c128_state not in ("online", "offline"):
            raise LayoutError(f"c128_state must be 'online' or 'offline', got {self.c128_state!r}")
        if self.swa_mode == "ring" and self.model.window > self.model.page_size:
            raise LayoutError(
                f"ring SWA mode keeps one {self.model.page_size}-token row per request and layer; "
                f"window {self.model.window} does not fit in it"
            )
        object.__setattr__(self, "pools", self._build())

    @property
    def mtp(self) -> bool:
        return self.stage.with_mtp and self.model.num_mtp_layers > 0

    @property
    def state_ring(self) -> int:
        return STATE_RING * (2 if self.mtp else 1)

    def _build(self) -> dict[str, PoolSpec]:
        m, st, P = self.model, self.stage, self.model.page_size
        v = m.nope_dim + 2 * m.rope_dim
        s = 8 * math.ceil((m.nope_dim // 64) / 8)  # UE8M0 scales padded to 8 B
        side = "swa_page" if self.swa_mode == "paged" else "req_slot"

        def mla(name: str, fam: str, ratio: int, tokens: int, index: str) -> PoolSpec:
            return PoolSpec(name, fam, ratio, index, "fp8_mla", mla_page_bytes(tokens, v, s),
                            tokens, v, s, tokens * v, 1, st.layers(fam))

        iv = m.index_head_dim if m.indexer_dtype == "fp8" else m.index_head_dim // 2
        c4_tok = P // 4
        pools = [
            mla("swa_kv", "swa", 0, P, side),
            mla("c4_kv", "c4", 4, c4_tok, "page"),
            PoolSpec("c4_indexer", "c4", 4, "page", f"{m.indexer_dtype}_indexer",
                     c4_tok * (iv + 4), c4_tok, iv, 4, c4_tok * iv, 1, st.layers("c4")),
            mla("c128_kv", "c128", 128, P // 128, "page"),
            # compress states: ring slots of (kv, score) x overlap 2 x head dim, fp32
            PoolSpec("c4_state", "c4", 4, side, "fp32_state",
                     self.state_ring * 2 * 2 * m.head_dim * 4, ring=self.state_ring,
                     layers=st.layers("c4")),
            PoolSpec("c4_indexer_state", "c4", 4, side, "fp32_state",
                     self.state_ring * 2 * 2 * m.index_head_dim * 4, ring=self.state_ring,
                     layers=st.layers("c4")),
        ]
        if self.c128_state == "online":  # running max, running sum, kv accumulator
            c128 = PoolSpec("c128_state", "c128", 128, "req_slot", "fp32_state",
                            3 * m.head_dim * 4, ring=1, layers=st.layers("c128"))
        else:  # ring of 128 (kv, score) rows
            c128 = PoolSpec("c128_state", "c128", 128, "req_slot", "fp32_state",
                            C128_OFFLINE_RING * 2 * m.head_dim * 4, ring=C128_OFFLINE_RING,
                            layers=st.layers("c128"))
        pools.append(c128)
        return {p.name: p for p in pools if p.num_layers > 0}

    def pool(self, name: str) -> PoolSpec:
        try:
            return self.pools[name]
        except KeyError:
            raise LayoutError(
                f"pool {name!r} is not on this stage; it has {sorted(self.pools)}"
            ) from None

    def local_id(self, pool: str, global_layer: int) -> int | None:
        return self.stage.local_id(self.pool(pool).family, global_layer)

    def space_pools(self, space: str) -> list[PoolSpec]:
        """Pools whose row ids live in index space ``space`` (see ``INDEX_SPACES``)."""
        if space not in INDEX_SPACES:
            raise LayoutError(f"unknown index space {space!r}; spaces are {INDEX_SPACES}")
        return [p for p in self.pools.values() if p.index == space]

    def row_bytes(self, space: str) -> int:
        """Bytes one row id of ``space`` costs across every pool and layer that uses it."""
        return sum(p.page_bytes * p.num_layers for p in self.space_pools(space))

    def check_buffers(self, counts: dict[str, int]) -> None:
        """Raise unless ``counts`` gives exactly one buffer per owned layer for every pool."""
        extra = set(counts) - set(self.pools)
        if extra:
            raise LayoutError(f"buffers given for pools not on this stage: {sorted(extra)}")
        for name, p in self.pools.items():
            got = counts.get(name)
            if got != p.num_layers:
                raise LayoutError(
                    f"pool {name} on stage {self.stage.pp_rank} "
                    f"[{self.stage.start}, {self.stage.end}) owns {p.num_layers} layers "
                    f"but {got if got is not None else 'no'} buffers were given"
                )

    def to_dict(self) -> dict[str, Any]:
        return {"model": self.model.to_dict(), "stage": self.stage.to_dict(),
                "swa_mode": self.swa_mode, "c128_state": self.c128_state}

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "Layout":
        """A layout from ``to_dict``'s shape, exactly (the wire's): unknown fields, and values of
        another JSON type (``"1"`` for 1, ``"false"`` for false), are refused, never converted."""
        if not isinstance(d, dict):
            raise LayoutError("layout must be a JSON object")
        _only(d, ("model", "stage", "swa_mode", "c128_state"), "layout")
        if "model" not in d or "stage" not in d:
            raise LayoutError("bad layout: missing field 'model' or 'stage'")
        model = ModelSpec.from_dict(d["model"])
        sd = d["stage"]
        if not isinstance(sd, dict):
            raise LayoutError(f"stage must be a JSON object, got {brief(sd)}")
        _only(sd, ("pp_rank", "pp_size", "start", "end", "with_mtp"), "stage")
        missing = [k for k in ("pp_rank", "pp_size", "start", "end") if k not in sd]
        if missing:
            raise LayoutError(f"bad layout: stage is missing {missing}")
        with_mtp = sd.get("with_mtp", True)
        if type(with_mtp) is not bool:
            raise LayoutError(f"stage.with_mtp must be true or false, got {brief(with_mtp)}")
        modes = [d.get("swa_mode", "paged"), d.get("c128_state", "online")]
        for k, v in zip(("swa_mode", "c128_state"), modes):
            if not isinstance(v, str):
                raise LayoutError(f"{k} must be a string, got {brief(v)}")
        stage = StageMap(model, *(exact_int(sd[k], f"stage.{k}")
                                  for k in ("pp_rank", "pp_size", "start", "end")), with_mtp)
        return Layout(model, stage, *modes)


def _only(d: dict[str, Any], fields: tuple[str, ...], what: str) -> None:
    unknown = [k for k in d if k not in fields]
    if unknown:
        raise LayoutError(f"unknown {what} fields: {brief(sorted(map(str, unknown)))}")


def build_layout(
    model: ModelSpec, pp_size: int = 1, pp_rank: int = 0,
    bounds: Sequence[tuple[int, int]] | None = None, swa_mode: str = "paged",
    c128_state: str = "online", mtp: bool = True,
) -> Layout:
    return Layout(model, StageMap.build(model, pp_size, pp_rank, bounds, mtp), swa_mode, c128_state)


def all_stages(model: ModelSpec, pp_size: int, **kw: Any) -> list[Layout]:
    return [build_layout(model, pp_size, r, **kw) for r in range(pp_size)]
