"""DSV4 model specs: ``ModelSpec``, the presets and Hugging Face ``config.json`` loading.

Contract (a leaf: standard library only): ``ModelSpec`` describes a model (presets
``dsv4-flash``, ``dsv4-pro``, ``dsv4-tiny``, or a ``config.json``); the compress ratio of each
layer is one of {0, 4, 128}. ``preset(name)``, ``model_from_hf_config(cfg)`` and
``load_model(preset_name, config_path)`` build one; every bad input raises ``LayoutError`` with
a message that names the numbers involved. ``hicache.core.layout`` turns a spec into pools.
"""
from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from typing import Any

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

    @property
    def window_pages(self) -> int:
        """Paged SWA pages one running request needs: those its window can straddle."""
        return -(-self.window // self.page_size) + 1

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
        """A spec from ``to_dict``'s shape, exactly: JSON integers for every count, strings for
        ``name`` and ``indexer_dtype``, lists of integers for the ratios (it parses the wire,
        so ``"4"``, ``4.0`` and ``true`` are refused, not converted)."""
        if not isinstance(d, dict):
            raise LayoutError(f"model spec must be a JSON object, got {brief(d)}")
        known = set(ModelSpec.__dataclass_fields__)
        unknown = set(d) - known
        if unknown:
            raise LayoutError(f"unknown model fields: {brief(sorted(map(str, unknown)))}")
        d = dict(d)
        for k in ("name", "num_layers", "compress_ratios"):
            if k not in d:
                raise LayoutError(f"bad model spec: missing field {k!r}")
        for k, v in d.items():
            if k in ("name", "indexer_dtype"):
                if not isinstance(v, str):
                    raise LayoutError(f"{k} must be a string, got {brief(v)}")
            elif k in ("compress_ratios", "mtp_compress_ratios"):
                if not isinstance(v, (list, tuple)):
                    raise LayoutError(f"{k} must be a list of integers, got {brief(v)}")
                d[k] = tuple(exact_int(x, f"{k}[{i}]") for i, x in enumerate(v))
            else:
                d[k] = exact_int(v, k)
        return ModelSpec(**d)


def brief(v: Any, limit: int = 60) -> str:
    """``repr(v)`` cut to ``limit`` characters: what an error line quotes of a peer's value."""
    s = repr(v)
    return s if len(s) <= limit else s[:limit - 3] + "..."


def exact_int(v: Any, what: str) -> int:
    """``v`` when it is an int (not a bool); anything else is refused, never converted."""
    if type(v) is not int:
        raise LayoutError(f"{what} must be an integer, got {brief(v)}")
    return v


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
