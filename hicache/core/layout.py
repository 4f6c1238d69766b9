"""DSV4 device-layout model: model specs, per-pool row formats and PP-stage-local layer maps.

Contract (a leaf module: imports nothing of ours, nothing heavier than the standard library):

* ``ModelSpec`` describes a model (presets ``dsv4-flash``, ``dsv4-pro``, ``dsv4-tiny`` or a
  Hugging Face style ``config.json``). Compress ratio per layer is one of {0, 4, 128}.
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

import json
import math
from dataclasses import asdict, dataclass, field
from typing import Any, Sequence

PAGE_SIZE = 256  # full tokens per page, every pool
VALID_RATIOS = (0, 4, 128)
STATE_RING = 8  # C4 compress-state ring slots per SWA page (16 with MTP)
C128_OFFLINE_RING = 128


class LayoutError(ValueError):
    """A model, stage or buffer set that cannot describe a valid device layout."""


# --------------------------------------------------------------------------- model spec
@dataclass(frozen=True)
class ModelSpec:
    """The layout-relevant facts of one model."""

    name: str
    num_layers: int
    compress_ratios: tuple[int, ...]  # one per target layer
    num_mtp_layers: int = 0
    mtp_compress_ratios: tuple[int, ...] = ()
    hidden_size: int = 4096
    num_heads: int = 64
    nope_dim: int = 448  # fp8 bytes per token
    rope_dim: int = 64  # bf16 elements per token
    window: int = 128
    index_n_heads: int = 64
    index_head_dim: int = 128
    index_topk: int = 512
    indexer_dtype: str = "fp8"  # "fp8" or "fp4"
    page_size: int = PAGE_SIZE

    def __post_init__(self) -> None:
        if self.num_layers <= 0:
            raise LayoutError(f"num_layers must be positive, got {self.num_layers}")
        if self.num_mtp_layers < 0:
            raise LayoutError(f"num_mtp_layers must not be negative, got {self.num_mtp_layers}")
        for dim in ("hidden_size", "num_heads", "nope_dim", "rope_dim", "window",
                    "index_n_heads", "index_head_dim", "index_topk"):
            if getattr(self, dim) <= 0:
                raise LayoutError(f"{dim} must be positive, got {getattr(self, dim)}")
        if self.index_head_dim % 2:
            raise LayoutError(f"index_head_dim {self.index_head_dim} must be even (fp4 packs two)")
        if len(self.compress_ratios) != self.num_layers:
            raise LayoutError(
                f"compress_ratios has {len(self.compress_ratios)} entries, "
                f"model has {self.num_layers} layers"
            )
        if len(self.mtp_compress_ratios) != self.num_mtp_layers:
            raise LayoutError(
                f"mtp_compress_ratios has {len(self.mtp_compress_ratios)} entries, "
                f"model has {self.num_mtp_layers} MTP layers"
            )
        for i, r in enumerate(self.compress_ratios + self.mtp_compress_ratios):
            if r not in VALID_RATIOS:
                where = f" (MTP layer {i - self.num_layers})" if i >= self.num_layers else ""
                raise LayoutError(
                    f"layer {i}{where}: compress ratio {r} is not one of {VALID_RATIOS}"
                )
        if self.indexer_dtype not in ("fp8", "fp4"):
            raise LayoutError(f"indexer_dtype must be 'fp8' or 'fp4', got {self.indexer_dtype!r}")
        if self.nope_dim % 64:
            raise LayoutError(f"nope_dim {self.nope_dim} is not a multiple of 64 (one scale per 64)")
        if self.page_size <= 0 or self.page_size % 128:
            raise LayoutError(f"page_size {self.page_size} must be a positive multiple of 128")

    @property
    def head_dim(self) -> int:
        return self.nope_dim + self.rope_dim

    @property
    def total_layers(self) -> int:
        return self.num_layers + self.num_mtp_layers

    def ratio(self, global_layer: int) -> int:
        if 0 <= global_layer < self.num_layers:
            return self.compress_ratios[global_layer]
        if self.num_layers <= global_layer < self.total_layers:
            return self.mtp_compress_ratios[global_layer - self.num_layers]
        raise LayoutError(f"layer {global_layer} is outside 0..{self.total_layers - 1}")

    def with_options(self, **changes: Any) -> "ModelSpec":
        d = asdict(self)
        d.update(changes)
        return ModelSpec.from_dict(d)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["compress_ratios"] = list(self.compress_ratios)
        d["mtp_compress_ratios"] = list(self.mtp_compress_ratios)
        return d

    @staticmethod
    def from_dict(d: dict[str, Any]) -> "ModelSpec":
        known = set(ModelSpec.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown model fields: {sorted(unknown)}")
        try:
            d = dict(d)
            d["compress_ratios"] = _int_tuple(d["compress_ratios"], "compress_ratios")
            d["mtp_compress_ratios"] = _int_tuple(d.get("mtp_compress_ratios", ()),
                                                  "mtp_compress_ratios")
            for k, v in d.items():
                if k not in ("name", "indexer_dtype") and not isinstance(v, tuple):
                    d[k] = _as_int(v, k)
            return ModelSpec(**d)
        except KeyError as e:
            raise LayoutError(f"bad model spec: missing field {e}") from None
        except TypeError as e:
            raise LayoutError(f"bad model spec: {e}") from None


def _as_int(v: Any, what: str) -> int:
    """``v`` as an int; bools, fractions and non-numeric strings are refused."""
    if isinstance(v, bool) or not isinstance(v, (int, str)) and not (
        isinstance(v, float) and v.is_integer()
    ):
        raise LayoutError(f"{what} must be an integer, got {v!r}")
    try:
        return int(v)
    except ValueError:
        raise LayoutError(f"{what} must be an integer, got {v!r}") from None


def _int_tuple(v: Any, what: str) -> tuple[int, ...]:
    if not isinstance(v, (list, tuple)):
        raise LayoutError(f"{what} must be a list of integers, got {v!r}")
    return tuple(_as_int(x, f"{what}[{i}]") for i, x in enumerate(v))


def _flash_ratios(n: int) -> tuple[int, ...]:
    return tuple(0 if i < 2 else (4 if i % 2 == 0 else 128) for i in range(n))


def _pro_ratios(n: int) -> tuple[int, ...]:
    return tuple(4 if i % 2 == 0 else 128 for i in range(n))


PRESETS: dict[str, ModelSpec] = {
    "dsv4-flash": ModelSpec(
        name="dsv4-flash", num_layers=43, compress_ratios=_flash_ratios(43),
        num_mtp_layers=1, mtp_compress_ratios=(0,), hidden_size=4096, num_heads=64,
    ),
    "dsv4-pro": ModelSpec(
        name="dsv4-pro", num_layers=61, compress_ratios=_pro_ratios(61),
        num_mtp_layers=1, mtp_compress_ratios=(0,), hidden_size=7168, num_heads=128,
    ),
    # The DSV4 pool formats with a handful of layers: every pool kind present, for CPU demos.
    "dsv4-tiny": ModelSpec(
        name="dsv4-tiny", num_layers=6, compress_ratios=(0, 4, 128, 4, 128, 4),
        num_mtp_layers=1, mtp_compress_ratios=(0,), hidden_size=1024, num_heads=8,
    ),
}


def preset(name: str) -> ModelSpec:
    try:
        return PRESETS[name]
    except KeyError:
        raise LayoutError(f"unknown preset {name!r}; choose one of {sorted(PRESETS)}") from None


def model_from_hf_config(cfg: dict[str, Any], name: str = "custom") -> ModelSpec:
    """Build a ModelSpec from a Hugging Face style config.json dict."""

    def pick(*keys: str, default: Any = None) -> Any:
        for k in keys:
            if k in cfg and cfg[k] is not None:
                return cfg[k]
        if default is None:
            raise LayoutError(f"config has none of {keys}")
        return default

    def pick_int(*keys: str, default: Any = None) -> int:
        return _as_int(pick(*keys, default=default), keys[0])

    n = pick_int("num_hidden_layers", "num_layers")
    n_mtp = pick_int("num_nextn_predict_layers", "num_mtp_layers", default=0)
    if n <= 0 or n_mtp < 0:
        raise LayoutError(f"config has {n} layers and {n_mtp} MTP layers")
    ratios = list(_int_tuple(pick("compress_ratios"), "compress_ratios"))
    if len(ratios) == n + n_mtp:
        target, mtp = ratios[:n], ratios[n:]
    elif len(ratios) == n:
        target, mtp = ratios, [0] * n_mtp
    else:
        raise LayoutError(
            f"compress_ratios has {len(ratios)} entries; expected {n} layers"
            + (f" or {n + n_mtp} with MTP" if n_mtp else "")
        )
    rope = pick_int("qk_rope_head_dim", "rope_head_dim", default=64)
    head_dim = pick_int("head_dim", "kv_lora_rank", default=512)
    idx_dtype = str(pick("index_dtype", "indexer_dtype", default="fp8"))
    return ModelSpec(
        name=str(cfg.get("name", name)), num_layers=n, compress_ratios=tuple(target),
        num_mtp_layers=n_mtp, mtp_compress_ratios=tuple(mtp),
        hidden_size=pick_int("hidden_size", default=4096),
        num_heads=pick_int("num_attention_heads", default=64),
        nope_dim=head_dim - rope, rope_dim=rope,
        window=pick_int("sliding_window", "window_size", default=128),
        index_n_heads=pick_int("index_n_heads", default=64),
        index_head_dim=pick_int("index_head_dim", default=128),
        index_topk=pick_int("index_topk", default=512),
        indexer_dtype=idx_dtype,
    )


def load_model(preset_name: str | None = None, config_path: str | None = None) -> ModelSpec:
    """A preset by name, or a config.json file; exactly one of them."""
    if (preset_name is None) == (config_path is None):
        raise LayoutError("give exactly one of a preset name or a config file")
    if preset_name is not None:
        return preset(preset_name)
    try:
        with open(config_path, encoding="utf-8") as f:  # type: ignore[arg-type]
            cfg = json.load(f)
    except OSError as e:
        raise LayoutError(f"cannot read config {config_path}: {e.strerror}") from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise LayoutError(f"config {config_path} is not valid JSON: {e}") from None
    if not isinstance(cfg, dict):
        raise LayoutError(f"config {config_path} must hold a JSON object")
    return model_from_hf_config(cfg, name=str(config_path))


# --------------------------------------------------------------------------- stage maps
def stage_bounds(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """Even split of target layers over ``pp_size`` stages; earlier stages take the remainder."""
    if pp_size <= 0:
        raise LayoutError(f"pp size must be positive, got {pp_size}")
    if pp_size > num_layers:
        raise LayoutError(f"pp size {pp_size} is larger than the {num_layers} layers")
    base, extra = divmod(num_layers, pp_size)
    bounds, start = [], 0
    for r in range(pp_size):
        end = start + base + (1 if r < extra else 0)
        bounds.append((start, end))
        start = end
    return bounds


def check_bounds(num_layers: int, bounds: Sequence[tuple[int, int]]) -> None:
    """Explicit ``[start, end)`` per stage must tile ``0..num_layers`` with no gap or overlap."""
    expect = 0
    for i, (s, e) in enumerate(bounds):
        if s != expect or e <= s:
            raise LayoutError(
                f"stage {i} bounds [{s}, {e}) do not continue from layer {expect} "
                "(stages must tile the layers in order, each non-empty)"
            )
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
        if not isinstance(d, dict):
            raise LayoutError("layout must be a JSON object")
        try:
            model = ModelSpec.from_dict(d["model"])
            sd = d["stage"]
            stage = StageMap(model, int(sd["pp_rank"]), int(sd["pp_size"]), int(sd["start"]),
                             int(sd["end"]), bool(sd.get("with_mtp", True)))
            return Layout(model, stage, str(d.get("swa_mode", "paged")),
                          str(d.get("c128_state", "online")))
        except (KeyError, TypeError, AttributeError) as e:
            raise LayoutError(f"bad layout: missing or mistyped field {e}") from None


def build_layout(
    model: ModelSpec, pp_size: int = 1, pp_rank: int = 0,
    bounds: Sequence[tuple[int, int]] | None = None, swa_mode: str = "paged",
    c128_state: str = "online", mtp: bool = True,
) -> Layout:
    return Layout(model, StageMap.build(model, pp_size, pp_rank, bounds, mtp), swa_mode, c128_state)


def all_stages(model: ModelSpec, pp_size: int, **kw: Any) -> list[Layout]:
    return [build_layout(model, pp_size, r, **kw) for r in range(pp_size)]
