"""``hicache plan --hisparse``: dense vs sparse concurrency of long requests, term by term."""
from __future__ import annotations

import json
import subprocess
import sys

import pytest

from hicache.core.hisparse_plan import hisparse_plan
from hicache.core.layout import build_layout, preset

GiB = 1 << 30


def _flash(swa_mode="paged", pp=1):
    m = preset("dsv4-flash")
    return [build_layout(m, pp, r, swa_mode=swa_mode, mtp=True) for r in range(pp)]


def test_flash_100gib_128k_is_at_least_3x():
    for mode in ("paged", "ring"):
        p = hisparse_plan(_flash(mode), 100 * GiB, 131072)
        assert p.ratio >= 3.0, (mode, p.ratio)


def test_terms_by_hand():
    lay = _flash("ring")[0]
    p = hisparse_plan([lay], 100 * GiB, 131072)
    s = p.stages[0]
    page = 21 * 37_440 + 21 * 8_448 + 20 * 1_728  # C4 KV, C4 indexer (fp8), C128 KV
    assert s.page_bytes_dense == page and s.page_bytes_sparse == page - 21 * 37_440
    assert s.pages == 512 and s.swa_bytes == 0
    assert s.hot_buffer_bytes == 21 * 1025 * 585  # 37,440 / 64 B per slot
    assert s.dense == 512 * page + lay.row_bytes("req_slot")
    assert p.concurrent("dense") == 100 * GiB // s.dense
    assert p.concurrent("sparse") == 100 * GiB // s.sparse
    assert s.host_c4_bytes == 512 * 21 * 37_440


def test_pipeline_stages_take_the_minimum():
    p = hisparse_plan(_flash("paged", pp=2), 100 * GiB, 131072)
    assert len(p.stages) == 2
    assert p.concurrent("sparse") == min(100 * GiB // s.sparse for s in p.stages)


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "hicache.cli", "plan", *args],
                          capture_output=True, text=True, timeout=60)


def test_cli_json_key_and_text():
    r = _cli("--preset", "dsv4-flash", "--kv-mem", "100GiB", "--hisparse", "--json")
    assert r.returncode == 0, r.stderr
    d = json.loads(r.stdout)
    assert d["hisparse_concurrency_ratio"] >= 3.0
    assert d["hisparse"]["sparse_concurrent_requests"] > 3 * d["hisparse"]["dense_concurrent_requests"]
    t = _cli("--preset", "dsv4-flash", "--kv-mem", "100GiB", "--hisparse")
    assert "concurrent per GPU: dense" in t.stdout and "hot buffers 21 x 1025" in t.stdout


@pytest.mark.parametrize("args, msg", [
    (("--hot-slots", "100", "--hisparse"), "below the model's index_topk"),
    (("--hot-slots", "2048"), "only with --hisparse"),
    (("--request-tokens", "0", "--hisparse"), "--request-tokens"),
])
def test_cli_refuses(args, msg):
    r = _cli("--preset", "dsv4-flash", "--kv-mem", "100GiB", *args)
    assert r.returncode == 2 and msg in r.stderr, r.stderr
