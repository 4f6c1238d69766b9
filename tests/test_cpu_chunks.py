"""The CPU copy worker's chunked copies (``controllers/scheduler.py``, ``run_cpu_item``).

An item of more than ``SMALL_IDS`` ids is copied ``chunk_ids(it)`` ids at a time (about
``CHUNK_BYTES`` over all its layers), through ``dispatch.copy_rows`` (whole rows, ``fmt is
None``) or ``dispatch.copy_tokens`` (tokens of a ``TokenFormat``) on the reference path, and
``stop()`` is asked before every chunk after the first: True raises ``Cancelled``, and the ids
of the chunks before stay copied. Other tests copy at most one chunk (the real ``CHUNK_BYTES``
is 32 MiB) or go through ``copy_few`` (at most ``SMALL_IDS`` ids), so a lost last partial
chunk, a chunk written to the wrong rows, or a stop check that never fires would pass them.

Here ``CHUNK_BYTES`` is patched down to a few ids' worth, and items are built in-process
(``LayerTable`` over plain CPU tensors, no daemon) with shuffled source and destination ids
whose count is not a multiple of the chunk size. Every byte of every layer of the destination
is compared with a naive oracle (rows or tokens named get the source's bytes, everything else,
token-page padding included, keeps its old bytes), and the source must be left unchanged:

* a full copy (``stop`` never True) of rows and of tokens, for several layers; ``stop`` is
  asked once between each pair of chunks;
* a copy whose ``stop`` turns True after the first (or the second) chunk raises ``Cancelled``
  with exactly those chunks' ids copied and nothing else changed.

Seeded generators, no threads, no timing: deterministic and fast.
"""
from __future__ import annotations

from dataclasses import dataclass

import pytest
import torch

from hicache.controllers import scheduler
from hicache.controllers.ops import Ids, Item
from hicache.controllers.scheduler import SMALL_IDS, Cancelled, chunk_ids, run_cpu_item
from hicache.kernels.tables import LayerTable, TokenFormat

LAYERS = 3
ROW_BYTES = 100  # not a multiple of 8: the reference path's word views stay byte-wise too
# values of 24 B, scales of 4 B, 4 tokens a page: 96 B of values, scales at 96..112, padding
# to 120 B (a copy of tokens must leave the padding alone)
FMT = TokenFormat.mla(4, value_bytes=24, scale_bytes=4)
CHUNK = 7  # rows per chunk once ``CHUNK_BYTES`` is patched (tokens: 25, of 28 B, not 100 B)


@dataclass
class Case:
    """An item and the bytes its tables held before the copy."""

    item: Item
    src_before: list[torch.Tensor]
    dst_before: list[torch.Tensor]
    src_ids: list[int]
    dst_ids: list[int]


def _layers(rows: int, row_bytes: int, g: torch.Generator) -> list[torch.Tensor]:
    return [torch.randint(0, 256, (rows, row_bytes), dtype=torch.uint8, generator=g)
            for _ in range(LAYERS)]


def _case(unit: str, n: int, seed: int) -> Case:
    """An item of ``n`` shuffled ids: whole rows (``unit == "row"``) or tokens of ``FMT``."""
    g = torch.Generator().manual_seed(seed)
    token = unit == "token"
    row_bytes = FMT.page_bytes if token else ROW_BYTES
    src_rows, dst_rows = (n // FMT.tokens_per_page + 9, n // FMT.tokens_per_page + 13) \
        if token else (n + 37, n + 51)
    per_row = FMT.tokens_per_page if token else 1
    src_l, dst_l = _layers(src_rows, row_bytes, g), _layers(dst_rows, row_bytes, g)
    src_ids = torch.randperm(src_rows * per_row, generator=g)[:n].tolist()
    dst_ids = torch.randperm(dst_rows * per_row, generator=g)[:n].tolist()
    unit_bytes = FMT.token_bytes if token else row_bytes
    item = Item("pool", LayerTable(src_l, "source"), LayerTable(dst_l, "destination"),
                Ids.of(src_ids), Ids.of(dst_ids), FMT if token else None,
                tuple(range(LAYERS)), n * unit_bytes * LAYERS)
    return Case(item, [t.clone() for t in src_l], [t.clone() for t in dst_l], src_ids, dst_ids)


def _expected(case: Case, count: int) -> list[torch.Tensor]:
    """The destination after the first ``count`` ids are copied: one id at a time, by byte
    offsets (rows: the whole row; tokens: the value and the scale, never the padding)."""
    exp = [t.clone() for t in case.dst_before]
    fmt = case.item.fmt
    pairs = list(zip(case.src_ids[:count], case.dst_ids[:count]))
    for s, d in zip(case.src_before, exp):
        for a, b in pairs:
            if fmt is None:
                d[b, :] = s[a, :]
                continue
            P, vb, sb, so = fmt.tokens_per_page, fmt.value_bytes, fmt.scale_bytes, \
                fmt.scale_offset
            (ap, asl), (bp, bsl) = divmod(a, P), divmod(b, P)
            d[bp, bsl * vb:(bsl + 1) * vb] = s[ap, asl * vb:(asl + 1) * vb]
            d[bp, so + bsl * sb:so + (bsl + 1) * sb] = s[ap, so + asl * sb:so + (asl + 1) * sb]
    return exp


def _assert_bytes(got: list[torch.Tensor], exp: list[torch.Tensor], what: str) -> None:
    assert len(got) == len(exp) == LAYERS
    for layer, (g, e) in enumerate(zip(got, exp)):
        if not torch.equal(g, e):
            bad = (g != e).any(dim=1).nonzero().flatten().tolist()
            raise AssertionError(f"{what}, layer {layer}: rows {bad} differ")


def _check(case: Case, copied: int) -> None:
    """Exactly the first ``copied`` ids reached the destination; the source is unchanged."""
    _assert_bytes(case.item.dst.layers, _expected(case, copied),
                  f"destination after {copied} of {case.item.n} ids")
    _assert_bytes(case.item.src.layers, case.src_before, "source")


@pytest.fixture
def small_chunks(monkeypatch: pytest.MonkeyPatch) -> None:
    """``CHUNK_BYTES`` of ``CHUNK`` rows (or tokens) of every layer of the items here."""
    monkeypatch.setattr(scheduler, "CHUNK_BYTES", CHUNK * ROW_BYTES * LAYERS)


def _chunk(case: Case) -> int:
    k = chunk_ids(case.item)
    assert 1 < k < case.item.n and case.item.n % k, (k, case.item.n)  # several, last partial
    return k


class Stop:
    """A ``stop`` callable: False for its first ``after - 1`` calls, then True."""

    def __init__(self, after: int | None) -> None:
        self.after, self.calls = after, 0

    def __call__(self) -> bool:
        self.calls += 1
        return self.after is not None and self.calls >= self.after


@pytest.mark.parametrize("n", [SMALL_IDS + 1, 151, 202])
@pytest.mark.parametrize("unit", ["row", "token"])
def test_a_chunked_copy_moves_every_id_and_nothing_else(small_chunks: None, unit: str,
                                                        n: int) -> None:
    case = _case(unit, n, seed=n * 10 + (unit == "token"))
    k = _chunk(case)
    assert k == (CHUNK if unit == "row" else CHUNK * ROW_BYTES // FMT.token_bytes)
    stop = Stop(None)
    path = run_cpu_item(case.item, stop)
    assert path == ("rows_reference" if unit == "row" else "tokens_reference")
    _check(case, n)
    assert stop.calls == -(-n // k) - 1  # asked before every chunk after the first


@pytest.mark.parametrize("unit", ["row", "token"])
def test_a_chunked_copy_without_stop_moves_every_id(small_chunks: None, unit: str) -> None:
    case = _case(unit, 151, seed=7 + (unit == "token"))
    _chunk(case)
    run_cpu_item(case.item)
    _check(case, 151)


@pytest.mark.parametrize("chunks", [1, 2])
@pytest.mark.parametrize("unit", ["row", "token"])
def test_a_stop_between_chunks_cancels_with_the_chunks_before_copied(
        small_chunks: None, unit: str, chunks: int) -> None:
    n = 151
    case = _case(unit, n, seed=100 + chunks * 2 + (unit == "token"))
    k = _chunk(case)
    stop = Stop(chunks)  # True when asked before chunk ``chunks`` (0-based)
    with pytest.raises(Cancelled):
        run_cpu_item(case.item, stop)
    assert stop.calls == chunks
    _check(case, chunks * k)
