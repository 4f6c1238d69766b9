"""Workload generator and Mooncake trace parsing (malformed lines reported by line number)."""
from __future__ import annotations

import json
import os

import pytest

from hicache.core.errors import UsageError
from hicache.sim.workload import multi_turn, read_trace

TRACE = os.path.join(os.path.dirname(__file__), "..", "..", "shared", "data",
                     "synthetic_trace.jsonl")


def write(tmp_path, lines):
    p = tmp_path / "trace.jsonl"
    p.write_text("\n".join(lines) + "\n")
    return str(p)


def line(**kw):
    d = {"timestamp": 0, "input_length": 1100, "output_length": 5, "hash_ids": [7, 8, 9]}
    d.update(kw)
    return json.dumps(d)


def test_trace_blocks_become_two_pages_each(tmp_path):
    reqs = read_trace(write(tmp_path, [line(), "", line(timestamp=1500, input_length=1024,
                                                        hash_ids=[7, 10])]))
    assert len(reqs) == 2
    a, b = reqs
    # 1100 tokens: 4 full pages (blocks 7, 8), the partial third block is not cached
    assert a.pages == (14, 15, 16, 17) and a.cache_pages == a.pages
    assert a.max_prefix_pages == 4 and a.total_pages == 5
    assert b.pages == (14, 15, 20, 21) and b.arrival_s == 1.5
    assert b.max_prefix_pages == 3  # 1024 tokens: the last page is always computed


@pytest.mark.parametrize("bad, message", [
    ("{not json", "not valid JSON"),
    ("[1, 2]", "must be a JSON object"),
    (line(hash_ids=[1, "2", 3]), "hash_ids must be a list of integers"),
    (line(hash_ids="1,2,3"), "hash_ids must be a list of integers"),
    (line(hash_ids=[1, True, 3]), "hash_ids must be a list of integers"),
    (line(hash_ids=[1, 2]), "hash_ids has 2 blocks but input_length 1100 spans 3"),
    (line(input_length=0), "input_length must be an integer >= 1"),
    (line(input_length=12.5), "input_length must be an integer >= 1"),
    (line(output_length=-1), "output_length must be an integer >= 0"),
    (line(timestamp="soon"), "timestamp must be a number"),
    (json.dumps({"timestamp": 0, "input_length": 10, "output_length": 1}), "missing field 'hash_ids'"),
])
def test_malformed_line_reported_by_number(tmp_path, bad, message):
    path = write(tmp_path, [line(), line(), "", bad, line()])
    with pytest.raises(UsageError) as e:
        read_trace(path)
    assert str(e.value).startswith(f"{path}:4: ")
    assert message in str(e.value)


def test_missing_or_empty_trace(tmp_path):
    with pytest.raises(UsageError, match="cannot read trace"):
        read_trace(str(tmp_path / "nope.jsonl"))
    with pytest.raises(UsageError, match="holds no requests"):
        read_trace(write(tmp_path, ["", "  "]))


def test_multi_turn_reuses_history_and_system_prompts():
    reqs = multi_turn(200, seed=3)
    assert len(reqs) == 200
    assert reqs == multi_turn(200, seed=3)  # deterministic
    by_session: dict[int, list] = {}
    for r in reqs:
        assert r.pages == r.cache_pages[: len(r.pages)]
        assert r.input_tokens == 256 * len(r.pages)
        by_session.setdefault(r.session, []).append(r)
    multi = [s for s in by_session.values() if len(s) > 1]
    assert multi
    for turns in multi:  # the next turn's input starts with the previous input + answer
        for prev, nxt in zip(turns, turns[1:]):
            assert nxt.pages[: len(prev.cache_pages)] == prev.cache_pages
    firsts = {s[0].pages[:4] for s in by_session.values()}
    assert len(firsts) < len(by_session)  # sessions share system prompts


@pytest.mark.skipif(not os.path.exists(TRACE), reason="shared trace not beside the checkout")
def test_reads_the_shared_trace():
    reqs = read_trace(TRACE, limit=50)
    assert len(reqs) == 50
    assert all(len(r.pages) == r.input_tokens // 256 for r in reqs)
