"""``bench transfer`` on the CPU: its arguments, the host-row patterns (random, runs), the byte
check every row passes through (a wrong byte anywhere fails it), and the pattern column of the
JSON and the table. The GPU cases run in ``scripts/gpu_check.sh``."""
from __future__ import annotations

import argparse
import json

import pytest
import torch

from hicache.bench import transfer
from hicache.bench.transfer_rows import (RunsSpec, Write, check, host_rows, mean_run,
                                         parse_runs)
from hicache.bench.transfer_support import table_lines
from hicache.core.errors import UsageError
from hicache.kernels.tables import TokenFormat


def args(*argv: str) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    transfer.add_arguments(p)
    return p.parse_args(list(argv))


# ----------------------------------------------------------------------------- arguments
def test_defaults_and_budgets() -> None:
    a = args()
    transfer.check_args(a)
    assert a.limit_trials == 5 and a.runs == "alloc:32" and a.peer_lib.endswith("common_ops.abi3.so")
    assert transfer.budgets(a) == [1, 2, 4, 8, 16, 0]
    assert transfer.budgets(args("--quick")) == [1, 4, 0]
    assert transfer.budgets(args("--ctas", "2, 4")) == [2, 4]
    assert parse_runs("fixed:8") == RunsSpec("fixed", 8) and str(parse_runs("alloc:16")) == "alloc:16"


@pytest.mark.parametrize("argv, words", [
    (("--layers", "0"), "--layers"), (("--reps", "-1"), "--reps"),
    (("--limit-trials", "4"), "at least 5"), (("--runs", "blocks:4"), "--runs"),
    (("--runs", "fixed:0"), "--runs"), (("--runs", "alloc:x"), "--runs"),
    (("--ctas", "4,x"), "--ctas"), (("--ctas", "-1"), "--ctas"), (("--ctas", ","), "--ctas")])
def test_bad_arguments_refused_in_one_line(argv: tuple, words: str) -> None:
    with pytest.raises(UsageError) as e:
        transfer.run(args(*argv))
    assert words in str(e.value) and "\n" not in str(e.value)


def test_plot_without_matplotlib_is_refused_before_the_run(monkeypatch) -> None:
    """``--plot`` with no matplotlib: one-line refusal from the argument check, before any
    timing (the same ``plotting.check_plot`` serves ``bench e2e``, ``bench hisparse`` and the
    demo's host sweep)."""
    from hicache.core import plotting

    monkeypatch.setattr(plotting, "_load", lambda: None)
    plotting.check_plot(None)  # no --plot: nothing to refuse
    with pytest.raises(UsageError, match=r"--plot needs matplotlib.*pip install 'hicache\[plot\]'"):
        transfer.check_args(args("--plot", "x.png"))
    monkeypatch.setattr(plotting, "_load", lambda: object())
    transfer.check_args(args("--plot", "x.png"))


def test_every_row_case_has_the_peer_on_the_same_patterns() -> None:
    for case in transfer.cases():
        for pattern in case.patterns:
            for both in (False, True):
                im = transfer.impls(case, pattern, both, peer=True)
                assert (transfer.PEER in im) == (case.fmt is None)
                assert im[0] == "auto"  # what the daemon runs, first
                assert im[1] == ("staged" if pattern == "runs" else "zero_copy")
    assert {p for c in transfer.cases() for p in c.patterns} == {"random", "runs"}


def test_one_direction_rows_are_the_backup_half_of_both() -> None:
    """Like for like: a case's one-direction rows are exactly the backup half of its "both"
    rows, and the swap-in half has runs like them (drawn apart, "both" had runs of 93 rows
    where one direction had 21)."""
    case = next(c for c in transfer.cases() if c.both and "runs" in c.patterns)
    units = 2048
    for seed, pattern in enumerate(case.patterns):
        drawn = transfer.case_rows(case, pattern, seed, units, parse_runs("alloc:32"))
        (d1, h1), (d2, h2) = drawn[False], drawn[True]
        assert len(h1) == case.n and len(h2) == 2 * case.n
        assert torch.equal(h1, h2[: case.n]) and torch.equal(d1, d2[: case.n])
        assert len(set(h2.tolist())) == len(set(d2.tolist())) == 2 * case.n  # disjoint halves
        one, back, swap = mean_run(h1), mean_run(h2[: case.n]), mean_run(h2[case.n:])
        assert one == back
        if pattern == "runs":
            assert 0.5 <= swap / one <= 2.0, (one, swap)


# ----------------------------------------------------------------------------- patterns
@pytest.mark.parametrize("pattern,spec", [("random", "alloc:32"), ("runs", "alloc:32"),
                                          ("runs", "alloc:8"), ("runs", "fixed:16")])
def test_host_rows_in_parts_start_with_the_one_part_rows(pattern: str, spec: str) -> None:
    runs = parse_runs(spec)
    one = host_rows(pattern, 2048, 512, 3, runs)
    two = host_rows(pattern, 2048, 512, 3, runs, parts=2)
    assert torch.equal(two[:512], one) and len(set(two.tolist())) == 1024
    assert 0 <= int(two.min()) and int(two.max()) < 2048
    with pytest.raises(UsageError, match="3 x 512 host rows"):
        host_rows(pattern, 1024, 512, 3, runs, parts=3)


def test_random_rows_distinct_in_range_and_seeded() -> None:
    spec = parse_runs("alloc:32")
    a = host_rows("random", 2048, 512, 7, spec)
    assert a.dtype == torch.int64 and a.numel() == 512 and a.unique().numel() == 512
    assert 0 <= int(a.min()) and int(a.max()) < 2048
    assert torch.equal(a, host_rows("random", 2048, 512, 7, spec))
    assert mean_run(a) < 1.5


@pytest.mark.parametrize("rows, n", [(2048, 512), (2048, 1024), (512, 256), (256, 64)])
def test_allocator_runs(rows: int, n: int) -> None:
    a = host_rows("runs", rows, n, 1, parse_runs("alloc:32"))
    assert a.numel() == n and a.unique().numel() == n and 0 <= int(a.min()) and int(a.max()) < rows
    assert torch.equal(a, host_rows("runs", rows, n, 1, parse_runs("alloc:32")))
    assert mean_run(a) >= 8  # a run-forming allocator: requests land in runs even after churn


def test_allocator_runs_have_holes() -> None:
    """The churn fills the pool and leaves holes: the rows are not one consecutive block."""
    for seed in range(3):
        assert mean_run(host_rows("runs", 2048, 512, seed, parse_runs("alloc:32"))) < 256


def test_fixed_runs() -> None:
    a = host_rows("runs", 2048, 500, 3, parse_runs("fixed:16"))
    assert a.numel() == 500 and a.unique().numel() == 500
    blocks = a[:496].view(-1, 16)
    assert torch.equal(blocks - blocks[:, :1], torch.arange(16).expand(31, 16))
    assert bool((blocks[:, 0] % 16 == 0).all()) and mean_run(a[:496]) >= 16
    one = host_rows("runs", 2048, 512, 3, parse_runs("fixed:512"))
    assert mean_run(one) == 512.0


def test_patterns_refuse_what_does_not_fit() -> None:
    with pytest.raises(UsageError, match="do not fit"):
        host_rows("runs", 256, 201, 0, parse_runs("fixed:200"))
    with pytest.raises(UsageError, match="pool of 16"):
        host_rows("random", 16, 17, 0, parse_runs("alloc:4"))
    with pytest.raises(UsageError, match="pattern"):
        host_rows("strided", 16, 4, 0, parse_runs("alloc:4"))


# ----------------------------------------------------------------------------- the check
def _copy_case(fmt: TokenFormat | None):
    g = torch.Generator().manual_seed(5)
    rb = fmt.page_bytes if fmt else 96
    sides = {s: [torch.randint(0, 256, (8 * rb,), dtype=torch.uint8, generator=g)
                 for _ in range(2)] for s in ("dev", "host")}
    before = {s: [t.clone() for t in v] for s, v in sides.items()}
    k = fmt.tokens_per_page if fmt else 1
    si, di = torch.tensor([5, 0, 3 * k]), torch.tensor([2, 7 * k - 1, 4])
    w = Write("dev", "host", si, di, rb, fmt)
    for l in range(2):  # the copy, written out independently of the check
        src, dst = sides["dev"][l].view(-1, rb), sides["host"][l].view(-1, rb)
        for a, b in zip(si.tolist(), di.tolist()):
            if fmt is None:
                dst[b] = src[a]
                continue
            P, vb, sb, so = k, fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
            (pa, sa), (pb, sl) = divmod(a, P), divmod(b, P)
            dst[pb, sl * vb:(sl + 1) * vb] = src[pa, sa * vb:(sa + 1) * vb]
            dst[pb, so + sl * sb: so + (sl + 1) * sb] = src[pa, so + sa * sb: so + (sa + 1) * sb]
    return sides, before, w


@pytest.mark.parametrize("fmt", [None, TokenFormat.mla(4)], ids=["rows", "tokens"])
def test_check_passes_the_right_copy_and_fails_any_wrong_byte(fmt) -> None:
    sides, before, w = _copy_case(fmt)

    def after(side: str, l: int) -> torch.Tensor:
        return sides[side][l]

    assert check(before, after, [w]) is None
    rb = w.row_bytes
    if fmt is None:
        copied, untouched = 2 * rb + 17, 3 * rb + 1  # host row 2 was written, row 3 not
    else:  # host token 4 = page 1 slot 0: its value byte 5, and its scale's first byte
        copied, untouched = rb + 5, 3 * rb + 1
        scale = rb + fmt.scale_offset
        sides["host"][1][scale] ^= 1
        assert "host layer 1" in check(before, after, [w])
        sides["host"][1][scale] ^= 1
    for side, layer, byte in (("host", 1, copied), ("host", 0, untouched), ("dev", 1, 7)):
        sides[side][layer][byte] ^= 0x40  # one corrupted byte: a copied one, an untouched one,
        msg = check(before, after, [w])   # or the source
        assert msg == f"{side} layer {layer}: 1 byte(s) differ from the expected copy, " \
                      f"first at byte {byte}"
        sides[side][layer][byte] ^= 0x40
    assert check(before, after, [w]) is None
    assert check(before, after, []) is not None  # a copy that should not have happened


# ----------------------------------------------------------------------------- output
def test_cpu_run_json_and_table_name_the_pattern(capsys) -> None:
    assert transfer.run(args("--json", "--layers", "2", "--reps", "1")) == 0
    out, err = capsys.readouterr()
    res = json.loads(out)
    assert {r["pattern"] for r in res["rows"]} == {"random", "runs"}
    assert all(r["correct"] is True and r["mean_run_rows"] >= 1 for r in res["rows"])
    assert res["runs"] == "alloc:32" and "reference path" in res["notes"][0]
    head = next(line for line in err.splitlines() if line.startswith("| case"))
    assert head.startswith("| case | pattern | mean run | impl | dir |")
    assert any(line.startswith("| c4 page rows | runs |") for line in err.splitlines())


def test_table_pivots_budgets_and_flags_wrong_rows() -> None:
    base = {"case": "c4 page rows", "pattern": "runs", "mean_run_rows": 20.5, "impl": "staged",
            "direction": "d2h", "bytes": 1}
    rows = [{**base, "ctas": 1, "gbps": 20.0, "ratio_to_limit": 0.4, "correct": True},
            {**base, "ctas": 4, "gbps": 50.0, "ratio_to_limit": 0.9, "correct": True},
            {**base, "impl": "sglang", "ctas": 4, "gbps": 30.0, "ratio_to_limit": 0.5,
             "correct": False, "mismatch": "host layer 0: ..."}]
    lines = table_lines({"rows": rows})
    assert lines[0] == "| case | pattern | mean run | impl | dir | 1 | 4 | GB/s @4 | verified |"
    assert lines[2] == "| c4 page rows | runs | 20.5 | staged | d2h | 0.400 | 0.900 | 50.00 | ok |"
    assert lines[3] == "| c4 page rows | runs | 20.5 | sglang | d2h |  | 0.500 | 30.00 | WRONG (1 of 1) |"
    # a budget's row that raised: named, counted wrong, and no other budget's GB/s stands in
    # for it (the group read "ok" with the 1-CTA figure; forty-eighth session's bench review)
    failed = {**base, "ctas": 4, "gbps": 0.0, "ratio_to_limit": None, "correct": False,
              "error": "RuntimeError: boom"}
    lines = table_lines({"rows": [rows[0], failed]})
    assert lines[2] == ("| c4 page rows | runs | 20.5 | staged | d2h | 0.400 | failed | - | "
                        "WRONG (1 of 2) |")


def test_the_peer_is_named_from_the_library_it_loads(tmp_path) -> None:
    """The peer's row names what was loaded: the version file ``fetch_peer.sh`` writes beside
    the library, else the library's sha256 (it used to print ``sglang-0.4.6`` whatever it
    loaded); a library that is not there is reported, not fatal."""
    import hashlib

    from hicache.kernels import peer_sglang

    lib = tmp_path / "common_ops.abi3.so"
    lib.write_bytes(b"not really a library")
    digest = hashlib.sha256(lib.read_bytes()).hexdigest()[:12]
    assert peer_sglang.describe(str(lib)) == \
        f"sglang transfer_kv_all_layer_mla (common_ops.abi3.so sha256:{digest})"
    (tmp_path / "common_ops.abi3.so.version").write_text("sglang-kernel 9.9.9\n")
    assert peer_sglang.describe(str(lib)) == "sglang-kernel 9.9.9 transfer_kv_all_layer_mla"
    fn, msg, name = peer_sglang.load(str(tmp_path / "missing.so"))
    assert fn is None and name == "" and "fetch_peer.sh" in msg
    fn, msg, name = peer_sglang.load(str(lib))  # not a loadable library: said, not raised
    assert fn is None and "did not load" in msg and name.startswith("sglang-kernel 9.9.9")


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU path's refusals")
@pytest.mark.parametrize("argv, words", [
    (("--tune",), "--tune"), (("--ctas", "4"), "--ctas"), (("--quick",), "--quick"),
    (("--peer-lib", "/nonexistent.so"), "--peer-lib"), (("--limit-trials", "9"), "--limit-trials"),
    (("--quick", "--tune"), "--tune, --quick")])
def test_gpu_options_are_refused_without_a_gpu(argv: tuple, words: str) -> None:
    """Without CUDA the bench times the torch reference path: options of the GPU run are
    refused with the reason (they used to be accepted and ignored, rc 0)."""
    verb = "apply" if "," in words else "applies"
    with pytest.raises(UsageError, match=f"^{words} {verb} on a GPU") as e:
        transfer.run(args(*argv))
    assert "\n" not in str(e.value)
