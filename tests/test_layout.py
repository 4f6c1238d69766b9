"""The DSV4 layout model: DESIGN section 3 figures, PP-stage maps, config.json parsing."""
from __future__ import annotations

import json
from fractions import Fraction

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from hicache.core.layout import (
    INDEX_SPACES, Layout, LayoutError, ModelSpec, PRESETS, StageMap, all_stages, build_layout,
    check_bounds, load_model, mla_page_bytes, model_from_hf_config, preset, stage_bounds,
)

FLASH, PRO = preset("dsv4-flash"), preset("dsv4-pro")


# --------------------------------------------------------------------------- section 3 figures
def test_mla_token_format_figures():
    lay = build_layout(FLASH)
    swa, c4, c128 = lay.pool("swa_kv"), lay.pool("c4_kv"), lay.pool("c128_kv")
    for p in (swa, c4, c128):
        assert (p.value_bytes, p.scale_bytes, p.token_bytes, p.dtype) == (576, 8, 584, "fp8_mla")
    assert (swa.tokens_per_page, swa.page_bytes, swa.scale_offset) == (256, 149_760, 147_456)
    assert (c4.tokens_per_page, c4.page_bytes, c4.scale_offset) == (64, 37_440, 36_864)
    assert (c128.tokens_per_page, c128.page_bytes, c128.scale_offset) == (2, 1_728, 1_152)


@pytest.mark.parametrize("tokens", [1, 2, 3, 64, 100, 256])
def test_mla_page_bytes_is_values_scales_then_pad_to_576(tokens):
    n = mla_page_bytes(tokens, 576, 8)
    assert n % 576 == 0 and tokens * 584 <= n < tokens * 584 + 576


def test_indexer_figures_fp8_and_fp4():
    fp8 = build_layout(FLASH).pool("c4_indexer")
    fp4 = build_layout(FLASH.with_options(indexer_dtype="fp4")).pool("c4_indexer")
    assert (fp8.tokens_per_page, fp8.page_bytes, fp8.value_bytes, fp8.scale_bytes) == (64, 8_448, 128, 4)
    assert (fp4.tokens_per_page, fp4.page_bytes, fp4.value_bytes, fp4.scale_bytes) == (64, 4_352, 64, 4)
    assert fp8.scale_offset == 64 * 128 and fp4.scale_offset == 64 * 64


def test_compress_state_figures_ring_8_and_16_with_mtp():
    no_mtp = build_layout(FLASH, mtp=False)
    assert no_mtp.pool("c4_state").ring == 8 and no_mtp.pool("c4_state").page_bytes == 65_536
    assert no_mtp.pool("c4_indexer_state").page_bytes == 16_384
    mtp = build_layout(FLASH)
    assert mtp.pool("c4_state").ring == 16 and mtp.pool("c4_state").page_bytes == 2 * 65_536
    assert mtp.pool("c4_indexer_state").page_bytes == 2 * 16_384


def test_c128_state_online_and_offline_per_request_slot():
    online = build_layout(FLASH).pool("c128_state")
    offline = build_layout(FLASH, c128_state="offline").pool("c128_state")
    assert (online.index, online.ring, online.page_bytes) == ("req_slot", 1, 3 * 512 * 4)
    assert (offline.index, offline.ring, offline.page_bytes) == ("req_slot", 128, 128 * 2 * 512 * 4)


def test_flash_compressed_bytes_per_full_token_fp8_is_3899_25():
    lay = build_layout(FLASH)
    expect = Fraction(21 * 37_440 + 21 * 8_448 + 20 * 1_728, 256)
    assert expect == Fraction(389_925, 100)
    assert Fraction(lay.row_bytes("page"), 256) == expect
    assert {p.name for p in lay.space_pools("page")} == {"c4_kv", "c4_indexer", "c128_kv"}


def test_preset_ratio_counts():
    assert (FLASH.compress_ratios.count(4), FLASH.compress_ratios.count(128),
            FLASH.compress_ratios.count(0)) == (21, 20, 2)
    assert FLASH.compress_ratios[:4] == (0, 0, 4, 128)
    assert (PRO.num_layers, PRO.compress_ratios.count(4), PRO.compress_ratios.count(128)) == (61, 31, 30)
    for m in (FLASH, PRO):
        assert m.num_mtp_layers == 1 and m.head_dim == 512 and m.window == 128


def test_index_spaces_by_swa_mode():
    paged, ring = build_layout(FLASH), build_layout(FLASH, swa_mode="ring")
    assert {p.name for p in paged.space_pools("swa_page")} == {"swa_kv", "c4_state", "c4_indexer_state"}
    assert {p.name for p in paged.space_pools("req_slot")} == {"c128_state"}
    assert ring.space_pools("swa_page") == []
    assert {p.name for p in ring.space_pools("req_slot")} == {
        "swa_kv", "c4_state", "c4_indexer_state", "c128_state"}
    assert ring.row_bytes("req_slot") == 44 * 149_760 + 21 * (131_072 + 32_768) + 20 * 6_144
    with pytest.raises(LayoutError, match="unknown index space"):
        paged.row_bytes("tokens")


def test_ring_mode_refuses_a_window_larger_than_a_page():
    wide = FLASH.with_options(window=512)
    build_layout(wide)  # paged is fine
    with pytest.raises(LayoutError, match="window 512"):
        build_layout(wide, swa_mode="ring")


# --------------------------------------------------------------------------- stage maps
def _check_stage(model: ModelSpec, lay: Layout, last: bool, mtp: bool = True) -> None:
    sm, (s, e) = lay.stage, (lay.stage.start, lay.stage.end)
    extra = model.num_mtp_layers if (last and mtp) else 0
    assert lay.pool("swa_kv").num_layers == e - s + extra
    for g in range(s, e):
        assert sm.local_id("swa", g) == g - s
    for k in range(extra):
        assert sm.local_id("swa", model.num_layers + k) == e - s + k  # MTP appended
    for fam, ratio in (("c4", 4), ("c128", 128)):
        mine = [g for g in range(s, e) if model.ratio(g) == ratio]
        mine += [g for g in range(model.num_layers, model.num_layers + extra)
                 if model.ratio(g) == ratio]
        assert [sm.local_id(fam, g) for g in mine] == list(range(len(mine)))
        assert [sm.global_id(fam, i) for i in range(len(mine))] == mine
        others = [g for g in range(model.total_layers) if g not in mine]
        assert all(sm.local_id(fam, g) is None for g in others)
    for g in range(model.total_layers):
        if not s <= g < e and not (g >= model.num_layers and extra):
            assert sm.local_id("swa", g) is None and lay.local_id("swa_kv", g) is None
    counts = {name: p.num_layers for name, p in lay.pools.items()}
    lay.check_buffers(counts)


@pytest.mark.parametrize("model", [FLASH, PRO], ids=lambda m: m.name)
@pytest.mark.parametrize("pp", [1, 2, 4])
def test_even_pp_split(model, pp):
    stages = all_stages(model, pp)
    assert [(l.stage.start, l.stage.end) for l in stages] == stage_bounds(model.num_layers, pp)
    for r, lay in enumerate(stages):
        _check_stage(model, lay, last=r == pp - 1)
    assert sum(l.pool("swa_kv").num_layers for l in stages) == model.total_layers
    assert sum(l.pool("c4_kv").num_layers for l in stages) == model.compress_ratios.count(4)


def test_even_split_later_stages_take_the_remainder_as_sglang_does():
    """SGLang's ``get_pp_indices`` gives the last ``layers % pp`` stages a layer more; ours gave
    it to the first ones, so a daemon's default stage was not its SGLang worker's for 43 or 61
    layers (tests/sglang checks the two against each other)."""
    assert stage_bounds(43, 4) == [(0, 10), (10, 21), (21, 32), (32, 43)]
    assert stage_bounds(43, 2) == [(0, 21), (21, 43)]
    assert stage_bounds(61, 4) == [(0, 15), (15, 30), (30, 45), (45, 61)]


@pytest.mark.parametrize("model,bounds", [
    (FLASH, [(0, 5), (5, 30), (30, 43)]),
    (PRO, [(0, 10), (10, 11), (11, 40), (40, 61)]),
], ids=["flash-3", "pro-4"])
@pytest.mark.parametrize("mtp", [True, False])
def test_uneven_explicit_split(model, bounds, mtp):
    for r in range(len(bounds)):
        lay = build_layout(model, len(bounds), r, bounds=bounds, mtp=mtp)
        assert (lay.stage.start, lay.stage.end) == bounds[r]
        _check_stage(model, lay, last=r == len(bounds) - 1, mtp=mtp)


def test_flash_stage_of_swa_only_layers_has_only_swa_pools():
    lay = build_layout(FLASH, 2, 0, bounds=[(0, 2), (2, 43)])
    assert set(lay.pools) == {"swa_kv"}
    with pytest.raises(LayoutError, match="not on this stage"):
        lay.pool("c4_kv")


def test_pro_stage_2_of_4_local_ids():
    bounds = [(0, 16), (16, 31), (31, 46), (46, 61)]
    lay = build_layout(PRO, 4, 2, bounds=bounds)  # layers [31, 46): 31 is ratio 128, 32 ratio 4
    assert lay.local_id("swa_kv", 31) == 0 and lay.local_id("swa_kv", 45) == 14
    assert lay.local_id("c4_kv", 32) == 0 and lay.local_id("c4_kv", 44) == 6
    assert lay.local_id("c128_kv", 31) == 0 and lay.local_id("c128_state", 45) == 7
    assert lay.local_id("c4_kv", 31) is None and lay.local_id("swa_kv", 30) is None
    assert lay.local_id("swa_kv", 61) is None  # MTP lives on the last stage


def test_buffer_count_check_names_both_numbers():
    lay = build_layout(FLASH, 4, 1)  # [10, 21)
    counts = {name: p.num_layers for name, p in lay.pools.items()}
    with pytest.raises(LayoutError, match=r"swa_kv on stage 1 \[10, 21\) owns 11 layers but 43"):
        lay.check_buffers({**counts, "swa_kv": 43})
    with pytest.raises(LayoutError, match="but no buffers"):
        lay.check_buffers({k: v for k, v in counts.items() if k != "c4_kv"})
    with pytest.raises(LayoutError, match="not on this stage"):
        build_layout(FLASH, 2, 0, bounds=[(0, 2), (2, 43)]).check_buffers({"swa_kv": 2, "c4_kv": 0})


@pytest.mark.parametrize("n,pp,msg", [(43, 44, "larger than the 43 layers"), (43, 0, "positive"),
                                      (43, -1, "positive")])
def test_stage_bounds_errors(n, pp, msg):
    with pytest.raises(LayoutError, match=msg):
        stage_bounds(n, pp)


@pytest.mark.parametrize("bounds,msg", [
    ([(0, 10), (11, 43)], "do not continue from layer 10"),
    ([(0, 10), (9, 43)], "do not continue"),
    ([(0, 0), (0, 43)], "each non-empty"),
    ([(0, 10), (10, 40)], "cover layers 0..40, model has 43"),
])
def test_check_bounds_errors(bounds, msg):
    with pytest.raises(LayoutError, match=msg):
        check_bounds(43, bounds)
    with pytest.raises(LayoutError):
        build_layout(FLASH, 2, 0, bounds=bounds)


def test_stage_map_rank_and_family_errors():
    with pytest.raises(LayoutError, match="pp rank 4 is outside 0..3"):
        build_layout(FLASH, 4, 4)
    with pytest.raises(LayoutError, match="2 stage bounds given for pp size 3"):
        StageMap.build(FLASH, 3, 0, bounds=[(0, 20), (20, 43)])
    sm = StageMap.build(FLASH)
    with pytest.raises(LayoutError, match="unknown layer family"):
        sm.local_id("c8", 0)
    with pytest.raises(LayoutError, match="outside 0..20"):
        sm.global_id("c4", 21)


@st.composite
def _stage_setups(draw):
    n = draw(st.integers(1, 80))
    ratios = tuple(draw(st.lists(st.sampled_from([0, 4, 128]), min_size=n, max_size=n)))
    n_mtp = draw(st.integers(0, 2))
    mtp_ratios = tuple(draw(st.lists(st.sampled_from([0, 4, 128]), min_size=n_mtp, max_size=n_mtp)))
    pp = draw(st.integers(1, min(n, 9)))
    bounds = None
    if draw(st.booleans()):
        cuts = sorted(draw(st.sets(st.integers(1, n - 1), min_size=pp - 1, max_size=pp - 1))) if pp > 1 else []
        edges = [0, *cuts, n]
        bounds = list(zip(edges, edges[1:]))
    model = ModelSpec("rand", n, ratios, n_mtp, mtp_ratios)
    return model, pp, bounds, draw(st.booleans())


@settings(max_examples=200, deadline=None, derandomize=True)
@given(_stage_setups())
def test_every_layer_in_exactly_one_stage_and_local_ids_dense(setup):
    model, pp, bounds, mtp = setup
    stages = [build_layout(model, pp, r, bounds=bounds, mtp=mtp) for r in range(pp)]
    owners: dict[int, int] = {}
    for r, lay in enumerate(stages):
        for g in lay.stage.layers("swa"):
            assert g not in owners, f"layer {g} on stages {owners[g]} and {r}"
            owners[g] = r
        for fam in ("swa", "c4", "c128"):
            ids = lay.stage.layers(fam)
            assert [lay.stage.local_id(fam, g) for g in ids] == list(range(len(ids)))
        for p in lay.pools.values():
            assert [lay.local_id(p.name, g) for g in p.layers] == list(range(p.num_layers))
            assert all(model.ratio(g) == p.ratio for g in p.layers if p.family != "swa")
        lay.check_buffers({name: p.num_layers for name, p in lay.pools.items()})
    expect = model.total_layers if mtp else model.num_layers
    assert sorted(owners) == list(range(expect))
    for fam, ratio in (("c4", 4), ("c128", 128)):
        got = sorted(g for lay in stages for g in lay.stage.layers(fam))
        assert got == [g for g in range(expect) if model.ratio(g) == ratio]


# --------------------------------------------------------------------------- config.json
def _dsv4_config(**over):
    n = 43
    cfg = {
        "model_type": "deepseek_v4", "num_hidden_layers": n, "num_attention_heads": 64,
        "num_key_value_heads": 1, "head_dim": 512, "hidden_size": 4096, "qk_rope_head_dim": 64,
        "compress_ratios": list(FLASH.compress_ratios) + [0], "sliding_window": 128,
        "num_nextn_predict_layers": 1, "index_n_heads": 64, "index_head_dim": 128,
        "index_topk": 512,
    }
    cfg.update(over)
    return cfg


def _write(tmp_path, cfg, name="config.json"):
    p = tmp_path / name
    p.write_text(json.dumps(cfg) if not isinstance(cfg, str) else cfg)
    return str(p)


def test_config_json_matches_flash_preset(tmp_path):
    m = load_model(config_path=_write(tmp_path, _dsv4_config()))
    assert m.compress_ratios == FLASH.compress_ratios and m.mtp_compress_ratios == (0,)
    assert (m.num_layers, m.num_mtp_layers, m.nope_dim, m.rope_dim, m.window) == (43, 1, 448, 64, 128)
    assert (m.index_n_heads, m.index_head_dim, m.index_topk, m.indexer_dtype) == (64, 128, 512, "fp8")
    a, b = build_layout(m), build_layout(FLASH)
    assert {k: p.to_dict() for k, p in a.pools.items()} == {k: p.to_dict() for k, p in b.pools.items()}


def test_config_mtp_ratios_from_the_list_or_zero(tmp_path):
    m = model_from_hf_config(_dsv4_config(num_nextn_predict_layers=2,
                                          compress_ratios=list(FLASH.compress_ratios) + [4, 128]))
    assert m.mtp_compress_ratios == (4, 128)
    lay = build_layout(m, 2, 1)
    assert lay.local_id("c4_kv", 43) == lay.pool("c4_kv").num_layers - 1
    assert lay.local_id("c128_kv", 44) == lay.pool("c128_kv").num_layers - 1
    m = model_from_hf_config(_dsv4_config(compress_ratios=list(FLASH.compress_ratios)))
    assert m.mtp_compress_ratios == (0,)
    m = model_from_hf_config(_dsv4_config(num_nextn_predict_layers=0,
                                          compress_ratios=list(FLASH.compress_ratios)))
    assert m.num_mtp_layers == 0 and m.total_layers == 43


def test_config_fp4_indexer_and_head_dims(tmp_path):
    m = model_from_hf_config(_dsv4_config(index_dtype="fp4", head_dim=576, qk_rope_head_dim=64))
    assert m.indexer_dtype == "fp4" and m.nope_dim == 512
    assert build_layout(m).pool("c4_indexer").page_bytes == 4_352


@pytest.mark.parametrize("over,msg", [
    ({"compress_ratios": [0, 64] + [4] * 42}, r"layer 1: compress ratio 64 is not one of"),
    ({"compress_ratios": list(FLASH.compress_ratios) + [8]}, r"layer 43 \(MTP layer 0\): compress ratio 8"),
    ({"compress_ratios": [4] * 40}, "compress_ratios has 40 entries; expected 43 layers or 44"),
    ({"compress_ratios": ["x"] * 44}, r"compress_ratios\[0\] must be an integer"),
    ({"compress_ratios": 4}, "must be a list"),
    ({"compress_ratios": None}, "config has none of"),
    ({"num_hidden_layers": "many"}, "num_hidden_layers must be an integer"),
    ({"num_hidden_layers": 0}, "0 layers"),
    ({"num_nextn_predict_layers": -1}, "-1 MTP layers"),
    ({"index_dtype": "int4"}, "indexer_dtype must be 'fp8' or 'fp4'"),
    ({"sliding_window": -128}, "window must be positive"),
    ({"head_dim": 64}, "nope_dim must be positive"),
    ({"head_dim": 500}, "not a multiple of 64"),
])
def test_bad_configs(tmp_path, over, msg):
    with pytest.raises(LayoutError, match=msg):
        load_model(config_path=_write(tmp_path, _dsv4_config(**over)))


@pytest.mark.parametrize("text,msg", [("{not json", "not valid JSON"), ("[1, 2]", "JSON object")])
def test_bad_config_files(tmp_path, text, msg):
    with pytest.raises(LayoutError, match=msg):
        load_model(config_path=_write(tmp_path, text))
    with pytest.raises(LayoutError, match="cannot read config"):
        load_model(config_path=str(tmp_path / "missing.json"))
    p = tmp_path / "bin.json"
    p.write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(LayoutError, match="not valid JSON"):
        load_model(config_path=str(p))


def test_load_model_needs_exactly_one_source():
    with pytest.raises(LayoutError, match="exactly one"):
        load_model()
    with pytest.raises(LayoutError, match="exactly one"):
        load_model("dsv4-flash", "x.json")
    with pytest.raises(LayoutError, match="unknown preset 'dsv4-max'"):
        load_model("dsv4-max")


# --------------------------------------------------------------------------- round trips
@pytest.mark.parametrize("name", sorted(PRESETS))
def test_layout_dict_round_trip(name):
    for lay in all_stages(PRESETS[name], 2, swa_mode="ring", c128_state="offline", mtp=False):
        back = Layout.from_dict(json.loads(json.dumps(lay.to_dict())))
        assert back == lay and back.pools == lay.pools


def test_model_from_dict_errors():
    d = FLASH.to_dict()
    with pytest.raises(LayoutError, match="unknown model fields"):
        ModelSpec.from_dict({**d, "colour": 1})
    with pytest.raises(LayoutError, match="missing field 'compress_ratios'"):
        ModelSpec.from_dict({k: v for k, v in d.items() if k != "compress_ratios"})
    with pytest.raises(LayoutError, match="window must be an integer"):
        ModelSpec.from_dict({**d, "window": "wide"})
    with pytest.raises(LayoutError, match="bad layout"):
        Layout.from_dict({"model": d})
    with pytest.raises(LayoutError, match="swa_mode must be"):
        Layout.from_dict({**build_layout(FLASH).to_dict(), "swa_mode": "sliding"})


@pytest.mark.parametrize("where,key,value,match", [
    ("model", "window", "128", "window must be an integer, got '128'"),
    ("model", "window", 128.0, "window must be an integer, got 128.0"),
    ("model", "num_layers", True, "num_layers must be an integer, got True"),
    ("model", "name", 7, "name must be a string, got 7"),
    ("model", "compress_ratios", "0,0,4", "compress_ratios must be a list"),
    ("stage", "pp_rank", "0", "stage.pp_rank must be an integer, got '0'"),
    ("stage", "end", 30.5, "stage.end must be an integer, got 30.5"),
    ("stage", "with_mtp", "false", "with_mtp must be true or false, got 'false'"),
    ("stage", "with_mtp", 0, "with_mtp must be true or false, got 0"),
    ("stage", "colour", 1, "unknown stage fields: \\['colour'\\]"),
    ("top", "swa_mode", 1, "swa_mode must be a string, got 1"),
    ("top", "extra", {}, "unknown layout fields: \\['extra'\\]"),
])
def test_layout_from_dict_takes_the_wire_shape_exactly(where, key, value, match):
    """What a peer sends is parsed, not coerced: ``"false"`` is not ``true``, ``30.5`` is not 30."""
    d = build_layout(FLASH, pp_size=2, pp_rank=0).to_dict()
    (d if where == "top" else d[where])[key] = value
    with pytest.raises(LayoutError, match=match):
        Layout.from_dict(json.loads(json.dumps(d)))


def test_layout_from_dict_quotes_a_long_value_briefly():
    d = build_layout(FLASH).to_dict()
    d["model"]["name"] = ["x" * 10_000]
    with pytest.raises(LayoutError) as e:
        Layout.from_dict(d)
    assert len(str(e.value)) < 120


def test_every_space_is_known():
    assert INDEX_SPACES == ("page", "swa_page", "req_slot")
    for lay in (build_layout(FLASH), build_layout(FLASH, swa_mode="ring")):
        assert {p.index for p in lay.pools.values()} <= set(INDEX_SPACES)
