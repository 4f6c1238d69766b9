"""The capacity planner and ``hicache plan``: formulas, PP/DP/TP, host rows, bad inputs."""
from __future__ import annotations

import json
import math
import re
import subprocess
import sys
from fractions import Fraction
from pathlib import Path

import pytest

from hicache.cli import main
from hicache.core.config import ServeConfig, load_config, sizing
from hicache.core.errors import UsageError
from hicache.core.sizes import arena_bytes, checkpoint_host_rows
from hicache.core.layout import build_layout, preset
from hicache.core.planner import (
    PlanInputs, capacity_pages, fixed_bytes_per_request, host_rows, one_request_bytes,
    page_cost, parse_bounds, parse_count, parse_fraction, parse_size, plan, request_slots,
)

FLASH, PRO = preset("dsv4-flash"), preset("dsv4-pro")
GiB = 2**30
FLASH_PAGE = 21 * 37_440 + 21 * 8_448 + 20 * 1_728  # 998,208 B per 256 full tokens
FLASH_SWA_PAGE = 44 * 149_760 + 21 * 131_072 + 21 * 32_768  # SWA + C4 states, MTP ring 16
FLASH_C128 = 20 * 3 * 512 * 4


# --------------------------------------------------------------------------- parsing
@pytest.mark.parametrize("text,expect", [
    ("1024", 1024), ("100GiB", 100 * GiB), ("80GB", 80 * 10**9), ("512MiB", 512 * 2**20),
    ("1.5GiB", 3 * 2**29), ("2 TiB", 2 * 2**40), ("64kb", 64_000), ("1_000", 1000), ("0", 0),
    ("100gib", 100 * GiB), ("7B", 7), ("16G", 16 * GiB), ("512M", 512 * 2**20),
])
def test_parse_size(text, expect):
    assert parse_size(text) == expect


@pytest.mark.parametrize("text", ["", "abc", "10XB", "GiB", "1.2.3GiB", "1e9", "-1GiB", "-5"])
def test_parse_size_refuses(text):
    with pytest.raises(UsageError):
        parse_size(text, "--kv-mem")


def test_parse_other_values():
    assert parse_fraction("0.8", "r") == Fraction(4, 5) and parse_fraction("4:1", "r") == 4
    assert parse_fraction("3/4", "r") == Fraction(3, 4)
    assert parse_bounds("0:22,22:43") == ((0, 22), (22, 43))
    assert parse_count("8", "--tp") == 8
    for bad in (lambda: parse_fraction("x", "r"), lambda: parse_fraction("1:0", "r"),
                lambda: parse_fraction("-1", "r"), lambda: parse_bounds("0-22"),
                lambda: parse_count("2.5", "--tp"), lambda: parse_count("0", "--tp")):
        with pytest.raises(UsageError):
            bad()


# --------------------------------------------------------------------------- formulas
def test_request_slots_decode_doubles():
    assert request_slots(256, "none") == request_slots(256, "prefill") == 256
    assert request_slots(256, "decode") == 512


def test_flash_bytes_per_full_token():
    ring = build_layout(FLASH, swa_mode="ring")
    assert page_cost(ring, Fraction(4, 5)) / 256 == Fraction(389_925, 100)  # 3,899.25
    fp4 = build_layout(FLASH.with_options(indexer_dtype="fp4"), swa_mode="ring")
    assert page_cost(fp4, Fraction(1)) == 21 * 37_440 + 21 * 4_352 + 20 * 1_728
    paged = build_layout(FLASH)
    assert page_cost(paged, Fraction(4, 5)) == FLASH_PAGE + Fraction(4, 5) * FLASH_SWA_PAGE
    assert float(page_cost(paged, Fraction(4, 5)) / 256) == 35_243.25


def test_fixed_bytes_per_request():
    assert fixed_bytes_per_request(build_layout(FLASH)) == FLASH_C128
    assert fixed_bytes_per_request(build_layout(FLASH, swa_mode="ring")) == FLASH_SWA_PAGE + FLASH_C128
    offline = build_layout(FLASH, c128_state="offline")
    assert fixed_bytes_per_request(offline) == 20 * 128 * 2 * 512 * 4
    no_mtp = build_layout(FLASH, swa_mode="ring", mtp=False)  # 43 SWA layers, ring of 8
    assert fixed_bytes_per_request(no_mtp) == 43 * 149_760 + 21 * (65_536 + 16_384) + FLASH_C128


@pytest.mark.parametrize("mode", ["paged", "ring"])
@pytest.mark.parametrize("budget", [100 * GiB, 80 * 10**9, 3 * GiB])
def test_capacity_formula_is_tight(mode, budget):
    lay, r = build_layout(FLASH, swa_mode=mode), Fraction(4, 5)
    pages = capacity_pages(lay, budget, 256, r)
    fixed, cost = fixed_bytes_per_request(lay) * 256, page_cost(lay, r)
    assert pages == math.floor((budget - fixed) / cost)
    assert fixed + pages * cost <= budget < fixed + (pages + 1) * cost
    p = plan(PlanInputs(FLASH, budget, swa_mode=mode))
    assert p.token_capacity == pages * 256 and p.token_capacity % 256 == 0
    s = p.stages[0]
    assert s.device_bytes <= budget and s.device_rows["page"] == pages
    assert s.device_rows["req_slot"] == 256
    if mode == "paged":
        assert s.device_rows["swa_page"] == math.floor(pages * r)
    else:
        assert "swa_page" not in s.device_rows


def test_flash_100gib_numbers():
    p = plan(PlanInputs(FLASH, 100 * GiB))
    budget = 100 * GiB
    paged = math.floor((budget - 256 * FLASH_C128) / (FLASH_PAGE + Fraction(4, 5) * FLASH_SWA_PAGE))
    ring = (budget - 256 * (FLASH_SWA_PAGE + FLASH_C128)) // FLASH_PAGE
    assert (p.paged_capacity, p.ring_capacity) == (paged * 256, ring * 256)
    assert p.ring_vs_paged == ring / paged > 1


def test_ring_advantage_shrinks_with_many_requests():
    few = plan(PlanInputs(FLASH, 100 * GiB, max_running=64)).ring_vs_paged
    many = plan(PlanInputs(FLASH, 100 * GiB, max_running=4096)).ring_vs_paged
    assert few > many
    assert plan(PlanInputs(FLASH, 100 * GiB, swa_ratio=Fraction(1, 10))).ring_vs_paged < few


def test_pp_capacity_is_min_over_stages_and_rows_follow_it():
    p = plan(PlanInputs(PRO, 80 * 10**9, pp=4, swa_mode="ring"))
    caps = [s.token_capacity for s in p.stages]
    assert p.token_capacity == min(caps) and len(set(caps)) > 1
    assert all(s.device_rows["page"] * 256 == p.token_capacity for s in p.stages)
    assert all(s.device_bytes <= 80 * 10**9 for s in p.stages)
    assert [s.layout.pool("swa_kv").num_layers for s in p.stages] == [15, 15, 15, 17]  # last: its own and MTP


def test_explicit_bounds_and_swa_only_stage():
    p = plan(PlanInputs(FLASH, 10 * GiB, pp=2, bounds=((0, 2), (2, 43)), swa_mode="ring"))
    assert p.stages[0].token_capacity is None  # no token-scaled pool: SWA rings only
    assert p.token_capacity == p.stages[1].token_capacity
    assert p.stages[0].device_rows == {"req_slot": 256}


def test_tp_changes_nothing_per_rank_dp_multiplies_workers():
    base = plan(PlanInputs(FLASH, 100 * GiB)).to_dict()
    wide = plan(PlanInputs(FLASH, 100 * GiB, tp=8, dp=4)).to_dict()
    assert wide["token_capacity"] == base["token_capacity"]
    assert wide["total_token_capacity"] == 4 * base["token_capacity"] and wide["gpus"] == 32


def test_decode_role_reserves_more_slots():
    none = plan(PlanInputs(FLASH, 100 * GiB, swa_mode="ring"))
    dec = plan(PlanInputs(FLASH, 100 * GiB, swa_mode="ring", pd_role="decode"))
    assert dec.request_slots == 512 and dec.token_capacity < none.token_capacity


def test_host_rows_by_ratio_and_by_bytes():
    lay = build_layout(FLASH)
    dev = {"page": 1000, "swa_page": 800, "req_slot": 256}
    assert host_rows(lay, dev, ratio=Fraction(4)) == {"page": 4000, "swa_page": 3200, "req_slot": 1024}
    assert host_rows(lay, dev) == {}
    p = plan(PlanInputs(FLASH, 100 * GiB, host_mem=400 * GiB))
    s = p.stages[0]
    assert s.host_bytes == arena_bytes(s.layout, s.host_rows) <= 400 * GiB
    k = Fraction(400 * GiB, s.device_bytes)  # proportional, a little under for region alignment
    for space, n in s.host_rows.items():
        assert 0.999 * s.device_rows[space] * k <= n <= s.device_rows[space] * k
    assert plan(PlanInputs(FLASH, 100 * GiB, host_ratio=Fraction(2))).stages[0].host_rows == {
        space: 2 * n for space, n in s.device_rows.items()}


def test_host_budget_too_small_is_a_usage_error():
    with pytest.raises(UsageError, match="host budget"):
        plan(PlanInputs(FLASH, 100 * GiB, host_mem=2**20))


def test_budget_errors_name_the_numbers():
    lay = build_layout(FLASH)
    need = one_request_bytes(lay)
    # its fixed bytes, and the pages whose SWA share (0.8) holds its window's 2 SWA pages: 3
    assert need == FLASH_C128 + math.ceil(3 * (FLASH_PAGE + Fraction(4, 5) * FLASH_SWA_PAGE))
    with pytest.raises(UsageError, match=f"one request needs {need:,} B"):
        plan(PlanInputs(FLASH, need - 1, max_running=1))
    pl = plan(PlanInputs(FLASH, need, max_running=1))
    assert pl.stages[0].device_rows["swa_page"] == 2 and not pl.warnings[:-1]
    # the serve line it prints sizes a daemon (it used to plan 0 SWA rows, which serve refused)
    sizing(ServeConfig(preset="dsv4-flash", kv_mem=need, max_running=1, host_ratio=2.0))
    # more slots on few pages: no SWA page row at all is refused, naming the budget it needs
    with pytest.raises(UsageError, match=r"no SWA page .* needs at least [\d,]+ B"):
        plan(PlanInputs(FLASH, need, max_running=100))  # 1 page: floor(0.8) SWA rows
    for swa, bounds in (("ring", None), ("paged", None), ("ring", ((0, 2), (2, 43)))):
        # the most that fit on every stage (one stage's own figure was refused in turn: by
        # paged SWA's first page, or by another stage; planner review)
        budget = GiB if swa == "ring" else 100 << 20
        kw = dict(swa_mode=swa, bounds=bounds, pp=2 if bounds else 1)
        with pytest.raises(UsageError, match=r"at most (\d+) request slots fit on every") as e:
            plan(PlanInputs(FLASH, budget, max_running=4000, **kw))
        most = int(e.value.args[0].rsplit("at most ", 1)[1].split()[0])
        plan(PlanInputs(FLASH, budget, max_running=most, **kw))
        with pytest.raises(UsageError, match=f"at most {most} request slots fit on every"):
            plan(PlanInputs(FLASH, budget, max_running=most + 1, **kw))


def test_other_mode_that_does_not_fit_is_a_warning():
    p = plan(PlanInputs(FLASH, GiB, swa_mode="paged", max_running=1000))
    assert p.ring_capacity is None and p.ring_vs_paged is None
    assert any("ring SWA mode does not fit" in w for w in p.warnings)


def test_small_paged_swa_pool_warns():
    p = plan(PlanInputs(FLASH, 2 * GiB, max_running=256, swa_ratio=Fraction(1, 10)))
    assert any("paged SWA pool has" in w for w in p.warnings)


@pytest.mark.parametrize("kw,msg", [
    ({"tp": 0}, "tp must be positive"), ({"max_running": -1}, "max-running must be positive"),
    ({"kv_mem": -1}, "must not be negative"), ({"pd_role": "both"}, "pd-role"),
    ({"swa_ratio": Fraction(0)}, r"in \(0, 1\]"), ({"host_mem": 1, "host_ratio": Fraction(1)}, "not both"),
    ({"bounds": ((0, 43),), "pp": 2}, "--stage-bounds gives 1 stages, --pp-size says 2"),
])
def test_plan_inputs_validation(kw, msg):
    with pytest.raises(UsageError, match=msg):
        PlanInputs(**{"model": FLASH, "kv_mem": GiB, **kw})


# --------------------------------------------------------------------------- CLI
def _json(capsys, *argv):
    assert main(["plan", *argv, "--json"]) == 0
    return json.loads(capsys.readouterr().out)


def test_cli_json_flash_100gib_ring_beats_paged(capsys):
    d = _json(capsys, "--preset", "dsv4-flash", "--kv-mem", "100GiB")
    assert d["ring_vs_paged_capacity_ratio"] > 1
    assert d["request_slots"] == 256 and d["inputs"]["max_running"] == 256
    (s,) = d["stages"]
    assert (s["start_layer"], s["end_layer"], s["bytes_per_full_token"]) == (0, 43, 35_243.25)
    assert s["fixed_bytes_per_request"] == FLASH_C128 and s["token_capacity"] == d["token_capacity"]
    pools = {p["name"]: p for p in s["pools"]}
    assert pools["swa_kv"]["num_layers"] == 44 and pools["c4_kv"]["page_bytes"] == 37_440
    for p in s["pools"]:
        assert {"name", "tokens_per_page", "page_bytes", "num_layers"} <= set(p)
    assert d["ring_vs_paged_capacity_ratio"] == d["ring_token_capacity"] / d["paged_token_capacity"]


def test_cli_json_ring_mode_3899_25_and_options(capsys):
    d = _json(capsys, "--preset", "dsv4-flash", "--kv-mem", "80GB", "--swa-mode", "ring",
              "--no-mtp", "--indexer", "fp4", "--c128-state", "offline", "--pp", "2",
              "--tp", "8", "--dp", "2", "--pd-role", "decode", "--host-ratio", "2:1")
    assert d["inputs"]["mtp"] is False and d["inputs"]["indexer"] == "fp4" and d["request_slots"] == 512
    assert [(s["start_layer"], s["end_layer"]) for s in d["stages"]] == [(0, 21), (21, 43)]
    assert all(s["host_rows"]["page"] == 2 * s["device_rows"]["page"] for s in d["stages"])
    d = _json(capsys, "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--swa-mode", "ring")
    assert d["stages"][0]["bytes_per_full_token"] == 3_899.25


def test_cli_stage_bounds_and_config(capsys, tmp_path):
    d = _json(capsys, "--preset", "dsv4-pro", "--kv-mem", "80GB", "--stage-bounds", "0:10,10:61")
    assert [len(s["pools"][0]["layers"]) for s in d["stages"]] == [10, 52]
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4],
                               "num_nextn_predict_layers": 0}))
    d = _json(capsys, "--config", str(cfg), "--kv-mem", "1GiB")
    assert d["model"]["num_mtp_layers"] == 0 and d["inputs"]["mtp"] is False


def test_cli_human_table(capsys):
    assert main(["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--host-mem", "200GiB"]) == 0
    out = capsys.readouterr().out
    for text in ("stage 0: layers [0, 43) + 1 MTP", "bytes per full token     35,243.25",
                 "swa_kv", "c128_state", "host rows", "ring/paged ="):
        assert text in out


def _bad_config(tmp_path):
    p = tmp_path / "bad.json"
    p.write_text(json.dumps({"num_hidden_layers": 3, "compress_ratios": [0, 4, 16]}))
    return str(p)


BAD = [
    (["--preset", "dsv4-huge", "--kv-mem", "1GiB"], "unknown preset 'dsv4-huge'"),
    (["--preset", "dsv4-flash", "--kv-mem", "8MiB"], "one request needs 27,189,696 B"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--swa-mode", "ring", "--max-running", "999"],
     "at most 105 request slots fit on every stage"),
    (["--preset", "dsv4-flash", "--kv-mem", "100GiB", "--pp", "44"], "--pp-size: pp size 44 is larger than the 43"),
    (["--config", "BAD", "--kv-mem", "1GiB"], "layer 2: compress ratio 16 is not one of"),
    (["--config", "MISSING", "--kv-mem", "1GiB"], "cannot read config"),
    (["--preset", "dsv4-flash", "--kv-mem", "100 gigs"], "cannot read '100 gigs' as a size"),
    (["--preset", "dsv4-flash", "--kv-mem", "-5GiB"], "must not be negative"),
    (["--preset", "dsv4-flash", "--kv-mem=-5GiB"], "must not be negative"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--tp", "-1"], "--tp-size must be positive"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--max-running", "-3"], "--max-running must be positive"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--dp", "two"], "--dp-size must be an integer"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--host-mem", "-1GiB"], "--host-mem must not be negative"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--swa-full-tokens-ratio", "1.5"], r"in (0, 1]"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--swa-mode", "sliding"], "--swa-mode must be one of"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--indexer", "int4"], "--indexer must be one of"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--stage-bounds", "0:10,11:43"], "do not continue"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--stage-bounds", "0:43", "--pp", "2"],
     "--stage-bounds gives 1 stages, --pp-size says 2"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--host-mem", "1GiB", "--host-ratio", "2"], "not both"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--host-mem", "1MiB"], "host budget 1.00 MiB is too small"),
    (["--preset", "dsv4-flash"], "--kv-mem is required"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--pages-per-checkpoint", "7"],
     "--pages-per-checkpoint splits the host tier of --host-mem"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--host-ratio", "2",
      "--pages-per-checkpoint", "7"], "--pages-per-checkpoint splits the host tier of --host-mem"),
    (["--preset", "dsv4-flash", "--kv-mem", "1GiB", "--swa-mode", "ring",
      "--swa-full-tokens-ratio", "0.5"], "swa-full-tokens-ratio sizes paged SWA pools"),
    (["--kv-mem", "1GiB"], "exactly one of --preset NAME or --model-config FILE"),
]


@pytest.mark.parametrize("argv,msg", BAD, ids=[m for _, m in BAD])
def test_cli_bad_inputs_one_line_exit_2(capsys, tmp_path, argv, msg):
    argv = [_bad_config(tmp_path) if a == "BAD" else str(tmp_path / "nope.json") if a == "MISSING"
            else a for a in argv]
    assert main(["plan", *argv]) == 2
    cap = capsys.readouterr()
    assert cap.out == ""
    lines = cap.err.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("hicache plan: error: ")
    assert msg in lines[0]


def test_mtp_on_a_model_without_mtp_is_refused(capsys, tmp_path):
    cfg = tmp_path / "c.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 2, "compress_ratios": [4, 128]}))
    assert main(["plan", "--config", str(cfg), "--kv-mem", "1GiB", "--mtp"]) == 2
    assert "has no MTP layers" in capsys.readouterr().err


def _hicache_exe() -> list[str]:
    exe = Path(sys.executable).parent / "hicache"
    return [str(exe)] if exe.exists() else [sys.executable, "-m", "hicache.cli"]


def test_subprocess_plan_no_traceback(tmp_path):
    bad = subprocess.run([*_hicache_exe(), "plan", "--config", _bad_config(tmp_path), "--kv-mem",
                          "1GiB"], capture_output=True, text=True, timeout=60)
    assert bad.returncode == 2 and bad.stdout == ""
    assert "Traceback" not in bad.stderr and len(bad.stderr.strip().splitlines()) == 1
    assert "compress ratio 16" in bad.stderr
    ok = subprocess.run([*_hicache_exe(), "plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB",
                         "--json"], capture_output=True, text=True, timeout=60)
    assert ok.returncode == 0, ok.stderr
    assert json.loads(ok.stdout)["ring_vs_paged_capacity_ratio"] > 1


def test_a_window_wider_than_a_page_plans_paged_and_says_ring_does_not_fit(tmp_path):
    """Paged SWA takes a window wider than a page; ring SWA (one page-sized row per request)
    and the resume model (the SWA tail within one page) do not. The paged plan, its serve
    sizing and the host tier by mirror say so instead of failing (the comparison with ring
    mode raised LayoutError, so `hicache plan` and `serve --kv-mem` refused the model)."""
    from hicache.core.host_tier import host_tier_by_mirror
    from hicache.core.model import ModelSpec

    wide = ModelSpec(name="wide", num_layers=4, compress_ratios=(0, 4, 128, 4), window=512)
    pl = plan(PlanInputs(wide, 10 * GiB, host_mem=40 * GiB))
    assert pl.paged_capacity and pl.ring_capacity is None and pl.unfit == ("ring",)
    assert pl.to_dict()["swa_modes_that_do_not_fit"] == ["ring"]
    assert any(w.startswith("ring SWA mode does not fit") for w in pl.warnings)
    tiers = host_tier_by_mirror(pl.inputs)
    assert tiers is not None and "checkpoints_vs_full" not in tiers
    assert all("longer than a page" in tiers[m]["error"] for m in ("full", "checkpoints"))
    cfg = tmp_path / "config.json"
    cfg.write_text(json.dumps({"num_hidden_layers": 4, "compress_ratios": [0, 4, 128, 4],
                               "sliding_window": 512}))
    sizing(ServeConfig(model_config=str(cfg), kv_mem=10 * GiB, host_ratio=2.0))
    assert main(["plan", "--model-config", str(cfg), "--kv-mem", "10GiB"]) == 0


def test_a_host_budget_too_small_names_the_least_that_works(capsys):
    """The refusal quoted one row of each space (11.29 MiB) as the minimum of a 300 MiB budget
    it refused; rows in proportion need 400.62 MiB here (planner review). The figure it names
    plans; one byte less does not."""
    base = ["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--force", "--host-mem"]
    assert main(base + ["300MiB"]) == 2
    err = capsys.readouterr().err
    assert "give no req_slot row; at least 400.62 MiB (420,076,278 B with alignment)" in err
    assert main(base + ["420076278"]) == 0
    capsys.readouterr()
    assert main(base + ["420076277"]) == 2


def test_serve_names_the_tokens_its_own_device_rows_hold():
    """A stage other than the one that limits the worker printed its own capacity (127,744
    device tokens) beside rows that hold 116,224 (planner review)."""
    for rank in (0, 1):
        cfg = ServeConfig(preset="dsv4-flash", kv_mem=2 * GiB, pp_size=2, pp_rank=rank,
                          max_running=16, host_ratio=2.0)
        s = sizing(cfg)
        assert s.device_rows["page"] == 454
        assert "116224 device tokens" in s.source, s.source


@pytest.mark.parametrize("split", ["device", "checkpoints"])
def test_pp_stages_sized_by_host_mem_agree_on_the_smallest_stage(split):
    """Each stage sized its host rows alone from --host-mem: DSV4-Flash at PP 2 gave stage 0
    1,997 page rows and stage 1 1,819 (its layers take more bytes per row), so a prefix could
    fit one stage and not the other, and SGLang's PP ranks could disagree on an alloc."""
    ranks = [sizing(ServeConfig(preset="dsv4-flash", kv_mem=2 * GiB, max_running=16,
                                host_mem=8 * GiB, host_split=split, pp_size=2, pp_rank=r))
             for r in (0, 1)]
    assert ranks[0].host_rows == ranks[1].host_rows
    assert "host rows agreed over the 2 PP stages" in ranks[0].source
    for r in ranks:
        assert arena_bytes(r.layout, r.host_rows) <= 8 * GiB
    # each stage alone would hold more rows on one stage than on the other, in every space
    # but the request slots' (a checkpoints split keeps the device's count of those)
    by_stage = [_rows_alone(r, split) for r in ranks]
    assert by_stage[0] != by_stage[1]
    for space, n in ranks[0].host_rows.items():
        assert n == min(b[space] for b in by_stage)
    # the plan gives the same rows
    pl = plan(PlanInputs(FLASH, 2 * GiB, pp=2, max_running=16, host_mem=8 * GiB,
                         host_split=split))
    assert [s.host_rows for s in pl.stages] == [r.host_rows for r in ranks]
    # a host ratio follows the device rows, which the stages share: not "agreed"
    ratio = [sizing(ServeConfig(preset="dsv4-flash", kv_mem=2 * GiB, max_running=16,
                                host_ratio=2.0, pp_size=2, pp_rank=r)) for r in (0, 1)]
    assert ratio[0].host_rows == ratio[1].host_rows and "agreed" not in ratio[0].source


def test_plan_says_the_stages_host_rows_are_agreed(capsys):
    base = ["plan", "--preset", "dsv4-flash", "--kv-mem", "2GiB", "--max-running", "16",
            "--host-mem", "8GiB"]
    assert main(base + ["--pp", "2"]) == 0
    out = capsys.readouterr().out
    assert out.count("req_slot 64 = 7.28 GiB (agreed over the stages: the fewest per space)") == 1
    assert out.count("req_slot 64 = 8.00 GiB (agreed over the stages") == 1
    assert main(base) == 0
    assert "agreed" not in capsys.readouterr().out


@pytest.mark.parametrize("host", [["--host-mem", "8GiB"], ["--host-ratio", "4"]])
def test_plan_prints_a_stage_of_swa_only_layers_with_host_rows(capsys, host):
    """A stage of DSV4-Flash's two SWA-only layers has no page rows: `plan` with a host size
    ended in a KeyError traceback (an operator review); its full mirror is bounded by its
    swa_page rows alone."""
    assert main(["plan", "--preset", "dsv4-flash", "--stage-bounds", "0:2,2:43",
                 "--kv-mem", "2GiB"] + host) == 0
    out = capsys.readouterr().out
    stage0 = out.split("stage 1:")[0]
    swa = int(re.search(r"host rows +swa_page ([\d,]+) =", stage0).group(1).replace(",", ""))
    assert f"host token capacity      unbounded (page rows x 256); a full mirror caches " \
           f"{swa * 256:,}" in stage0


def test_the_swa_window_warning_names_only_levers_that_help():
    """At --swa-full-tokens-ratio 1 the warning still said to raise it (an operator review);
    fewer running requests, which always helps, was not named."""
    at_max = plan(PlanInputs(FLASH, 2 * GiB, swa_ratio=Fraction(1))).warnings[0]
    assert at_max.endswith("fewer than the 512 that 256 request slots need for their window; "
                           "raise the budget, or lower --max-running (these pages hold the "
                           "windows of 95 request slots)"), at_max
    default = plan(PlanInputs(FLASH, 2 * GiB)).warnings[0]
    assert "raise --swa-full-tokens-ratio (at most 1) or the budget, or lower --max-running " \
           "(these pages hold the windows of 93 request slots)" in default, default
    fits = plan(PlanInputs(FLASH, 2 * GiB, max_running=93))
    assert not [w for w in fits.warnings if "paged SWA pool" in w], fits.warnings


def test_a_host_tier_no_larger_than_the_device_names_the_setting_to_raise(capsys):
    """``--host-ratio 1`` was told to "give more host memory" (an operator review)."""
    base = ["plan", "--preset", "dsv4-flash", "--kv-mem", "2GiB"]
    assert main(base + ["--host-ratio", "1"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "give a larger --host-ratio, or --force to run it anyway")
    assert main(base + ["--host-mem", "2GiB"]) == 2
    assert capsys.readouterr().err.strip().endswith(
        "give more host memory, or --force to run it anyway")


def _rows_alone(s, split: str) -> dict[str, int]:
    """The host rows 8 GiB gives this stage alone (the rule before the stages agreed)."""
    if split == "checkpoints":
        return checkpoint_host_rows(s.layout, s.device_rows, 8 * GiB, 32)
    return host_rows(s.layout, s.device_rows, 8 * GiB)


def test_pp_host_mem_with_device_rows_missing_a_space_of_another_stage_is_refused():
    """Stage 0 of a 2-layer bound in ring mode holds request slots only: its --device-rows
    cannot say how many page rows stage 1's budget would hold."""
    cfg = ServeConfig(preset="dsv4-flash", device_rows={"req_slot": 16}, swa_mode="ring",
                      pp_size=2, pp_rank=0, stage_bounds=((0, 2), (2, 43)),
                      host_mem=8 * GiB)
    with pytest.raises(UsageError, match=r"stage 1 uses index space page, which this stage "
                                         r"has no rows for: give --host-ratio instead"):
        sizing(cfg)
    cfg.host_mem, cfg.host_ratio = None, 2.0
    assert sizing(cfg).host_rows == {"req_slot": 32}


def test_the_most_slots_advice_holds_for_decode_workers_and_tiny_stages():
    """A stage that cannot hold one request is named as such (the search said "at most 0");
    a PD decode worker's advice gives the --max-running that fits (its slots are twice it)
    (diff review)."""
    with pytest.raises(UsageError, match=r"too small for one request on stage 1"):
        plan(PlanInputs(FLASH, 5 << 20, swa_mode="ring", max_running=4000, pp=2,
                        bounds=((0, 2), (2, 43))))
    with pytest.raises(UsageError, match=r"\(--max-running (\d+)\)$") as e:
        plan(PlanInputs(FLASH, GiB, swa_mode="ring", max_running=999, pd_role="decode"))
    running = int(e.value.args[0].rsplit("--max-running ", 1)[1].rstrip(")"))
    plan(PlanInputs(FLASH, GiB, swa_mode="ring", max_running=running, pd_role="decode"))
    with pytest.raises(UsageError):
        plan(PlanInputs(FLASH, GiB, swa_mode="ring", max_running=running + 1, pd_role="decode"))
    # a budget of one slot but not two: no --max-running fits a decode worker, said so (the
    # refusal named "2 request slots" and nothing else)
    budget = one_request_bytes(build_layout(FLASH, swa_mode="ring")) + 1
    plan(PlanInputs(FLASH, budget, swa_mode="ring", max_running=1))
    with pytest.raises(UsageError, match=r"2 request slots .*; no --max-running fits: a PD "
                                         r"decode worker holds 2 request slots per running"):
        plan(PlanInputs(FLASH, budget, swa_mode="ring", max_running=1, pd_role="decode"))


def test_host_ratio_rows_are_exact_and_odd_bounds_are_named(capsys):
    """``--host-ratio 1.15`` of 100 slots gave 114 rows (100 x 1.15 is 114.999... in floats);
    empty stage bounds ``[10, 10)`` were said not to continue from layer 10; ``plan`` planned
    one stage for ``--stage-bounds ""``, which serve refuses (planner review)."""
    pl = plan(PlanInputs(FLASH, 100 * GiB, max_running=100, host_ratio=Fraction(23, 20)))
    assert pl.stages[0].host_rows["req_slot"] == 115
    s = sizing(ServeConfig(preset="dsv4-flash", kv_mem=100 * GiB, max_running=100,
                           host_ratio=1.15))
    assert s.host_rows["req_slot"] == 115
    for text, slots in (("1:3", 7), ("2:3", 14), ("4:3", 28), ("1:7", 3)):  # the first fix
        # read the float of 1:3 as the decimal it printed as, one row short (final review)
        s = sizing(load_config({"preset": "dsv4-flash", "kv_mem": "100GiB", "max_running": "21",
                                "host_ratio": text, "force": True}, env={}))
        assert s.host_rows["req_slot"] == slots, (text, s.host_rows)
    base = ["plan", "--preset", "dsv4-flash", "--kv-mem", "100GiB", "--stage-bounds"]
    assert main(base + ["0:10,10:10,10:43"]) == 2
    assert "stage 1 bounds [10, 10) hold no layer" in capsys.readouterr().err
    assert main(base + [""]) == 2
    assert "cannot read ''" in capsys.readouterr().err


def test_serve_host_mem_of_stages_using_different_spaces_is_the_plans():
    """Stage 0 of a 0:2 bound holds DSV4-Flash's two SWA-only layers (no page rows), stage 1
    the rest: with --kv-mem and --host-mem each rank's serve sizing must take its own stage's
    agreed host rows from the plan (not stage 0's, nor a refusal because this rank's device
    rows lack a space another stage uses)."""
    bounds = ((0, 2), (2, 43))
    pl = plan(PlanInputs(FLASH, 2 * GiB, pp=2, max_running=16, host_mem=8 * GiB,
                         bounds=bounds))
    assert "page" not in pl.stages[0].host_rows and "page" in pl.stages[1].host_rows
    for rank in (0, 1):
        s = sizing(ServeConfig(preset="dsv4-flash", kv_mem=2 * GiB, max_running=16,
                               host_mem=8 * GiB, pp_size=2, pp_rank=rank, stage_bounds=bounds))
        assert s.host_rows == pl.stages[rank].host_rows, (rank, s.host_rows)
        assert "host rows agreed over the 2 PP stages" in s.source
