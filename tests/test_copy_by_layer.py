"""``dispatch.copy_by_layer``: every pool of a layer in one launch, layer by layer, byte-exact.

Runs the Triton segment kernel under ``TRITON_INTERPRET=1`` on CPU (every destination byte
checked against a plain copy, every other byte and the sources unchanged, ``on_layer`` called
once per layer in order) and on a GPU when there is one (device rows scattered, pinned host
rows, both directions, a DSV4 token format with its split value/scale).
"""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from hicache.kernels import by_layer
from hicache.kernels.dispatch import copy_by_layer, issue_by_layer, layer_parts
from hicache.kernels.segments import SegmentPart, token_offsets
from hicache.kernels.tables import LayerTable, TokenFormat, TransferError

ROOT = Path(__file__).resolve().parents[1]
FMT = TokenFormat(8, 576, 8, 8 * 576, 8 * 576 + 64)  # a small page of the DSV4 token format
FMT4 = TokenFormat(4, 128, 4, 4 * 128, 4 * 128 + 16)  # 128-B values with 4-B scales
TMLA = TokenFormat.mla(128)  # DSV4's token format on 128-token pages
# how the later layers' copies are issued (``_lead``)
LEADS = ["default", "none", "split", "first-layer"]


def _expect_rows(src, dst, s, d):
    out = [t.clone() for t in dst]
    for o, t in zip(out, src):
        o[torch.from_numpy(d)] = t[torch.from_numpy(s)]
    return out


def _expect_tokens(src, dst, s, d, fmt):
    out = [t.clone() for t in dst]
    P, vb, sb, so = fmt.tokens_per_page, fmt.value_bytes, fmt.scale_bytes, fmt.scale_offset
    for o, t in zip(out, src):
        for a, b in zip(s.tolist(), d.tolist()):
            (ap, asl), (bp, bsl) = divmod(a, P), divmod(b, P)
            o[bp, bsl * vb:(bsl + 1) * vb] = t[ap, asl * vb:(asl + 1) * vb]
            o[bp, so + bsl * sb:so + (bsl + 1) * sb] = t[ap, so + asl * sb:so + (asl + 1) * sb]
    return out


def token_ids(rng: np.random.Generator, src_tokens: int, dst_tokens: int, P: int,
              n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` token pairs, destinations distinct: runs consecutive on both sides (a whole page
    from even slots, one crossing a page boundary, one from odd slots) between single tokens
    at random, so a load moves blocks of several tokens and single tokens, of both widths."""
    runs = [(P, 2 * P, P), (3 * P + P - 2, 5 * P + P - 2, 4), (6 * P + 1, 9 * P + 3, 2)]
    s_run = [[a + i for i in range(m)] for a, _, m in runs]
    d_run = [[b + i for i in range(m)] for _, b, m in runs]
    k = n - sum(m for _, _, m in runs)
    s_one = rng.choice(sorted(set(range(src_tokens)) - {x for r in s_run for x in r}), k,
                       replace=False).tolist()
    d_one = rng.choice(sorted(set(range(dst_tokens)) - {x for r in d_run for x in r}), k,
                       replace=False).tolist()
    s, d = s_one[:1], d_one[:1]
    for i in range(len(runs)):  # each run listed in one piece, a single token after it
        s += s_run[i] + s_one[1 + i:2 + i]
        d += d_run[i] + d_one[1 + i:2 + i]
    s += s_one[1 + len(runs):]
    d += d_one[1 + len(runs):]
    assert len(s) == len(d) == n and len(set(d)) == n
    return np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)


def row_ids(rng: np.random.Generator, src_rows: int, dst_rows: int,
            n: int) -> tuple[np.ndarray, np.ndarray]:
    """``n`` row pairs, destinations distinct: a run of 4 rows and one of 3 consecutive on both
    sides (one copy per block of 2^k rows: 4, then 2 + 1), and single rows at random; fewer
    than 9 pairs: one run of 4 and singles."""
    lens = [4, 3] if n >= 9 else [min(4, n)]
    s_free, d_free = list(range(src_rows)), list(range(dst_rows))
    s: list[int] = []
    d: list[int] = []
    for m in lens:  # runs at random places not taken yet
        for free, out in ((s_free, s), (d_free, d)):
            ok = [a for a in free if all(a + i in free for i in range(m))]
            a = int(rng.choice(ok))
            out += range(a, a + m)
            for i in range(m):
                free.remove(a + i)
    k = n - len(s)
    s += rng.choice(s_free, k, replace=False).tolist()
    d += rng.choice(d_free, k, replace=False).tolist()
    assert len(set(d)) == n == len(s)
    return np.array(s, dtype=np.int64), np.array(d, dtype=np.int64)


def _case(device: str, src_dev: bool, seed: int = 0):
    """Pools over five global layers (A rows on all, B on odd, C and D tokens with runs, E
    36-B rows; on a GPU also big rows for the copy engines and T, 128-token pages)."""
    g = torch.Generator().manual_seed(seed)
    rng = np.random.default_rng(seed)
    pin = device != "cpu"

    def buf(layers, rows, rb, on_dev, fill):
        dev = device if on_dev else "cpu"
        ts = []
        for _ in layers:
            t = (torch.randint(0, 256, (rows, rb), generator=g, dtype=torch.uint8) if fill
                 else torch.zeros(rows, rb, dtype=torch.uint8))
            t = t.to(dev) if on_dev else (t.pin_memory() if pin else t)
            ts.append(t)
        return ts

    specs = [("A", (0, 1, 2, 3, 4), 40, 4160, None), ("B", (1, 3), 24, 1728, None),
             ("C", (0, 2, 4), 12, FMT.page_bytes, FMT),
             # a 4-byte scale (the indexer's format) and 36-byte rows: 4-byte words
             ("D", (1, 4), 10, FMT4.page_bytes, FMT4), ("E", (0, 3), 12, 36, None)]
    if device != "cpu":  # rows big enough for the copy engines (the SWA / state rows' path)
        specs += [("F", (0, 2, 3), 24, 73_728, None), ("G", (4,), 20, 131_072, None),
                  # few big rows: copy engines for the first layer (4) only, kernel elsewhere
                  ("H", (4, 1), 8, 65_536, None),
                  # 128-token pages: a whole-page run is a 72-KiB block (the copy engines'
                  # share of a token load, as a checkpoint's SWA tail), the rest the kernel's
                  ("T", (0, 3, 4), 8, TMLA.page_bytes, TMLA),
                  # 8448-B rows (the C4 indexer's): their run of 4 rows is a 33-KiB block for
                  # the copy engines, the rest the kernel's
                  ("I", (1, 2), 16, 8448, None)]
    parts, checks = [], []
    for name, layers, rows, rb, fmt in specs:
        src = buf(layers, rows, rb, src_dev, True)
        dst = buf(layers, rows + 3, rb, not src_dev, False)
        k = fmt.tokens_per_page if fmt else 1
        n = (21 if fmt.tokens_per_page < 64 else fmt.tokens_per_page + 12) if fmt is not None \
            else (5 if name == "H" else 16 if rb >= 65536 else 9)
        if fmt is None:
            s, d = row_ids(rng, rows, rows + 3, n)
        else:
            s, d = token_ids(rng, rows * k, (rows + 3) * k, k, n)
        before = [t.cpu().clone() for t in dst]
        S, D = LayerTable(src, f"{name}.src"), LayerTable(dst, f"{name}.dst")
        ps = layer_parts(S, D, s, d, fmt, layers)
        parts += ps
        src_cpu = [t.cpu().clone() for t in src]
        exp = _expect_rows(src_cpu, before, s, d) if fmt is None else \
            _expect_tokens(src_cpu, before, s, d, fmt)
        checks.append((layers, ps, src, src_cpu, dst, exp))
    return parts, checks


def _run_and_check(device: str, src_dev: bool, split: bool = False, fine: bool = True) -> None:
    """``copy_by_layer`` of ``_case``; every byte checked. ``split``: ``issue_by_layer`` given
    the parts holding the first layer of the order, and the others through ``more`` (built
    after the first step), as the daemon's loads do; ``fine`` False: the later layers in one
    launch group, as the daemon's loads that send no progress notice."""
    parts, checks = _case(device, src_dev)
    seen: list[int] = []
    dev = torch.device(device)
    if device != "cpu":  # blocks of MIN_BYTES or more qualify for the copy engines
        from hicache.kernels.copy_engine import MIN_BYTES
        big = [p for p in parts if p.dma]
        assert len(big) == 5 and all(p.dma == ("d2h" if src_dev else "h2d") for p in big)
        assert all(max(r[0] for r in p.ranges) >= MIN_BYTES for p in big)  # (beside scales)
        assert all(r[0] < MIN_BYTES for p in parts if not p.dma for r in p.ranges)
    order = [4, 0, 1, 2, 3]
    if split:
        first = [p for p in parts if order[0] in p.layers]
        later = [p for p in parts if order[0] not in p.layers]
        built: list[int] = []
        steps = issue_by_layer(first, order, seen.append, device=dev, ctas=3,
                               more=lambda: built.append(len(seen)) or later, fine=fine)
        assert next(steps) == 1 and built == []  # layer 0 issued before the rest are built
        # then one step per launch group, each after its layers' on_layer calls
        later = [(n, len(seen)) for n in steps]
        assert [n for n, _ in later] == ([b for _, b in by_layer.layer_groups(len(order))[1:]]
                                         if fine else [len(order)])
        assert all(n == k for n, k in later) and built == [1]
    else:
        path = copy_by_layer(parts, order, seen.append, device=dev, ctas=3)
        assert path == "by_layer"
    assert seen == [0, 1, 2, 3, 4]
    if device != "cpu":
        torch.cuda.synchronize()
    for *_, src, src_cpu, dst, exp in checks:
        for a, b in zip(src, src_cpu):
            assert torch.equal(a.cpu(), b)  # sources untouched
        for a, b in zip(dst, exp):
            assert torch.equal(a.cpu(), b)  # destinations exact, nothing else changed


INTERP = r"""
import sys
sys.path.insert(0, {root!r})
sys.path.insert(0, {tests!r})
import test_copy_by_layer as t
t._run_and_check("cpu", True)
t._run_and_check("cpu", False)
t._run_and_check("cpu", False, split=True)
t._run_and_check("cpu", True, split=True, fine=False)
t.by_layer.SPLIT_COPIES = 0  # the later layers planned in two (layer 1 first), as big loads do
t._run_and_check("cpu", True)
t._run_and_check("cpu", False, split=True)
t.more_naming_the_first_layer_is_refused()
t.token_blocks_marked_for_the_copy_engines_take_the_kernel_without_them()
print("ok")
"""


def token_blocks_marked_for_the_copy_engines_take_the_kernel_without_them() -> None:
    """Where the copy engines cannot run (here: no GPU), a part of token blocks marked for them
    (a value and a scale range per block, as ``layer_parts`` makes on a GPU) is copied by the
    segment kernel, byte-exact, nothing else changed."""
    g = torch.Generator().manual_seed(7)
    layers = (0, 2)
    src = [torch.randint(0, 256, (8, TMLA.page_bytes), generator=g, dtype=torch.uint8)
           for _ in layers]
    dst = [torch.zeros(11, TMLA.page_bytes, dtype=torch.uint8) for _ in layers]
    P = TMLA.tokens_per_page
    s, d = token_ids(np.random.default_rng(7), 8 * P, 11 * P, P, P + 12)
    exp = _expect_tokens(src, dst, s, d, TMLA)
    S, D = LayerTable(src), LayerTable(dst)
    big, rest = token_offsets(S, D, s, d, TMLA, 64 << 10)
    assert [rb for rb, _, _ in big] == [P * TMLA.value_bytes, P * TMLA.scale_bytes]
    parts = [SegmentPart(S.ptrs, D.ptrs, list(layers), big, dma="h2d"),
             SegmentPart(S.ptrs, D.ptrs, list(layers), rest)]
    copy_by_layer(parts, [2, 0], device=torch.device("cpu"), ctas=2)
    for a, b in zip(dst, exp):
        assert torch.equal(a, b)


def more_naming_the_first_layer_is_refused() -> None:
    """Parts built after the first step must not hold the first layer (already issued)."""
    parts, _ = _case("cpu", True)
    first = [p for p in parts if 4 in p.layers]
    steps = issue_by_layer(first, [4, 0, 1, 2, 3], device=torch.device("cpu"), ctas=3,
                           more=lambda: parts)
    assert next(steps) == 1
    with pytest.raises(ValueError, match="holds layer 4, which that step issued"):
        next(steps)


def test_by_layer_under_the_triton_interpreter():
    env = dict(os.environ, TRITON_INTERPRET="1", PYTHONPATH=str(ROOT))
    r = subprocess.run([sys.executable, "-c", INTERP.format(root=str(ROOT), tests=str(ROOT / "tests"))],
                       capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0 and r.stdout.strip().endswith("ok"), r.stderr[-3000:]


def test_layer_parts_refuses_bad_input():
    a = LayerTable([torch.zeros(4, 64, dtype=torch.uint8)] * 2)
    b = LayerTable([torch.zeros(4, 64, dtype=torch.uint8)] * 2)
    with pytest.raises(TransferError, match="layer ids"):
        layer_parts(a, b, np.array([0]), np.array([1]), None, [0])
    with pytest.raises(TransferError, match="out of range"):
        layer_parts(a, b, np.array([0]), np.array([4]), None, [0, 1])
    with pytest.raises(TransferError, match="source ids"):
        layer_parts(a, b, np.array([0, 1]), np.array([1]), None, [0, 1])
    with pytest.raises(ValueError, match="layer order"):
        copy_by_layer(layer_parts(a, b, np.array([0]), np.array([1]), None, [0, 7]), [0, 1],
                      device=torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", LEADS)
@pytest.mark.parametrize("src_dev", [True, False], ids=["d2h", "h2d"])
def test_by_layer_on_gpu(src_dev, lead, monkeypatch):
    """``lead``: the copy-engine copies of the parts holding the first layer issued for the
    later layers right after the first step (``FIRST_LEAD_BYTES``, its floor lowered to this
    case's bytes), and the others' before the segment plan (``LEAD_BYTES``); or only the first
    later layer's that early ("first-layer"); or neither lead (each group's copies with its
    group); or no first lead and the later layers planned in two, layer 1 first
    (``SPLIT_COPIES``: big loads)."""
    _lead(lead, monkeypatch)
    _run_and_check("cuda", src_dev)
    _run_and_check("cuda", src_dev, split=True)
    _run_and_check("cuda", src_dev, split=True, fine=False)


def _lead(lead: str, monkeypatch: Any) -> None:
    monkeypatch.setattr(by_layer, "FIRST_LEAD_MIN_BYTES", 0)  # this case's leads are small
    if lead == "none":
        monkeypatch.setattr(by_layer, "LEAD_BYTES", 0)
        monkeypatch.setattr(by_layer, "FIRST_LEAD_BYTES", 0)
    elif lead == "split":
        monkeypatch.setattr(by_layer, "SPLIT_COPIES", 0)
        monkeypatch.setattr(by_layer, "FIRST_LEAD_BYTES", 0)
    elif lead == "first-layer":  # whole layers up to 1 byte: the first later layer alone
        monkeypatch.setattr(by_layer, "FIRST_LEAD_BYTES", 1)


@pytest.mark.parametrize("fine", [True, False])
@pytest.mark.parametrize("marks", [1, 2])
def test_first_lead_goes_before_more_and_may_mark_layer_1(fine, marks, monkeypatch):
    """The first lead (``_issue_first_lead``) is tried right after layer 0's step, before
    ``more`` builds the other parts, with the layers ``more`` may hold; it may mark layers
    (``on_layer``) only in a load in launch groups (``fine``: the client hears of each), and
    when it marked layer 1, that layer's group is not launched again; a load of one layer has
    none. A later part naming a layer the lead marked, or one not announced, is refused."""
    calls: list[tuple] = []
    built: list[int] = []
    launched: list[list] = []

    def first_lead(parts, order, dev, stream, on_layer, announced):
        calls.append((len(built), on_layer is not None, sorted(announced)))
        return list(parts), marks if on_layer is not None else 1

    monkeypatch.setattr(by_layer, "_issue_first_lead", first_lead)
    real = by_layer._issue_groups
    monkeypatch.setattr(by_layer, "_issue_groups",
                        lambda parts, order, groups, *a, **k: launched.append(list(groups))
                        or real(parts, order, groups, *a))
    steps = issue_by_layer([], [3, 0, 1, 2], lambda i: None, device=torch.device("cpu"),
                           more=lambda: built.append(1) or [], more_layers=[1, 2], fine=fine)
    assert list(steps) == ([1, 2, 4] if fine else [1, 4])
    assert calls == [(0, fine, [1, 2])] and built == [1]
    later = [g for gs in launched[1:] for g in gs]
    assert later == ([(2, 4)] if fine and marks == 2 else [(1, 2), (2, 4)] if fine
                     else [(1, 4)])
    calls.clear()
    assert list(issue_by_layer([], [3], device=torch.device("cpu"), fine=fine)) == [1]
    assert calls == []
    if fine and marks == 2:  # layer 0 (position 1) was marked by the lead
        t = LayerTable([torch.zeros(4, 16, dtype=torch.uint8)] * 4)
        part = layer_parts(t, t, np.array([0]), np.array([1]), None, [3, 0, 1, 2])[0]
        for layers, why in (([0], "which that step issued"), ([2], "more_layers does not")):
            p = by_layer._layers_of([part], set(layers).__contains__)
            steps = issue_by_layer([], [3, 0, 1, 2], lambda i: None, device=torch.device("cpu"),
                                   more=lambda: p, more_layers=[1], fine=True)
            with pytest.raises(ValueError, match=why):
                list(steps)


def test_ranges_below_4_byte_alignment_are_refused():
    a = LayerTable([torch.zeros(4, 18, dtype=torch.uint8)] * 2)
    b = LayerTable([torch.zeros(4, 18, dtype=torch.uint8)] * 2)
    with pytest.raises(ValueError, match="not 4-byte aligned"):
        copy_by_layer(layer_parts(a, b, np.array([1]), np.array([2]), None, [0, 1]), [0, 1],
                      device=torch.device("cpu"))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("lead", LEADS)
def test_each_layer_is_complete_when_its_event_is(lead, monkeypatch):
    """Layer readiness on the copy-engine path: when the event recorded for layer ``i``
    completes, every pool's bytes of that layer are in place (copy-engine batches and kernel
    launches of a layer both come before its event), while later layers may still be copying.
    ``lead`` as in ``test_by_layer_on_gpu``."""
    _lead(lead, monkeypatch)
    parts, checks = _case("cuda", False, seed=3)
    _copy_and_check_each_layer_at_its_event(parts, checks, torch.cuda.Stream())


def _copy_and_check_each_layer_at_its_event(parts, checks, stream) -> None:
    """``copy_by_layer`` on ``stream`` with an event per layer; when layer ``i``'s event
    completes, every pool's bytes of that layer are in place. Every copy of the load runs on
    ``stream`` itself: no other stream is made for it (with copies on a side stream, the
    load stream's own commands ran late)."""
    from hicache.kernels import copy_engine

    key = (stream.device_index, stream.cuda_stream)
    copy_engine._side.pop(key, None)  # torch's pool: an earlier test may have made its side
    order = [4, 0, 1, 2, 3]
    events = [torch.cuda.Event() for _ in order]
    copy_by_layer(parts, order, lambda i: events[i].record(stream), device=torch.device("cuda"),
                  ctas=2, stream=stream)
    assert key not in copy_engine._side
    for i, g in enumerate(order):
        events[i].synchronize()
        for layers, _, src, src_cpu, dst, exp in checks:
            if g in layers:
                k = list(layers).index(g)
                assert torch.equal(dst[k].cpu(), exp[k]), f"layer {g} not ready at its event"
    torch.cuda.synchronize()


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_layer_1_marked_inside_the_first_lead_is_complete_at_its_event(monkeypatch):
    """A load in launch groups whose layer 1 is all in the first lead (here: layer 0, second in
    the order, kept only in pool F's 72-KiB rows, which the parts of the first step hold, and
    named in no later part): its event is recorded before ``more`` builds the other parts, and
    when it completes, F's rows of that layer are in place; every other layer is complete at
    its event, every byte exact, and the rows of layer 0 left out of the other pools are
    untouched."""
    monkeypatch.setattr(by_layer, "FIRST_LEAD_MIN_BYTES", 0)  # this case's lead is small
    parts, checks = _case("cuda", False, seed=5)
    order = [2, 0, 1, 3, 4]
    f_parts = {id(p) for c in checks if tuple(c[0]) == (0, 2, 3) for p in c[1]}  # pool F
    kept = [q for p in parts
            for q in ([p] if id(p) in f_parts else by_layer._layers_of([p], (0).__ne__))]
    first = [p for p in kept if order[0] in p.layers]
    later = [p for p in kept if order[0] not in p.layers]
    assert any(0 in p.layers and p.dma for p in first)
    stream = torch.cuda.Stream()
    events = [torch.cuda.Event() for _ in order]
    log: list[tuple] = []

    def mark(i: int) -> None:
        events[i].record(stream)
        log.append(("layer", i))

    steps = issue_by_layer(first, order, mark, device=torch.device("cuda"), ctas=2,
                           stream=stream, more=lambda: log.append(("more",)) or later,
                           more_layers={g for p in later for g in p.layers}, fine=True)
    assert list(steps)[:2] == [1, 2]
    assert log.index(("layer", 1)) < log.index(("more",))
    for i, g in enumerate(order):
        events[i].synchronize()
        for layers, ps, src, src_cpu, dst, exp in checks:
            if g in layers:
                k = list(layers).index(g)
                want = exp[k] if g != 0 or id(ps[0]) in f_parts else torch.zeros_like(exp[k])
                assert torch.equal(dst[k].cpu(), want), f"layer {g} not ready at its event"
    torch.cuda.synchronize()
    for layers, _, src, src_cpu, *_ in checks:
        assert all(torch.equal(a.cpu(), b) for a, b in zip(src, src_cpu))


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_repeated_loads_launch_the_compiled_kernel_directly():
    """After one load, the same load again launches every group through the kept compiled
    kernels (no JIT call), and its bytes are exact."""
    from hicache.kernels.segments import SEG_KERNEL

    _run_and_check("cuda", False)
    _run_and_check("cuda", True)
    before = SEG_KERNEL.jit_launches
    _run_and_check("cuda", False)
    _run_and_check("cuda", True)
    assert SEG_KERNEL.specializations >= 1
    assert SEG_KERNEL.jit_launches == before


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
@pytest.mark.parametrize("src_dev", [True, False], ids=["d2h", "h2d"])
def test_big_rows_alone_go_on_the_stream_itself(src_dev):
    """Parts that all go to the copy engines (no segment launch, as DSV4-Flash's layer 0):
    their copies run on the caller's stream; each layer is complete at its event, every byte
    exact, the sources untouched."""
    from hicache.kernels import copy_engine

    if not copy_engine.enabled():
        pytest.skip(f"no batched copy-engine DMA here: {copy_engine.status()}")
    _, checks = _case("cuda", src_dev, seed=5)
    checks = [c for c in checks if all(p.dma for p in c[1])]  # pools wholly on the engines
    parts = [p for c in checks for p in c[1]]
    assert len(checks) == 3
    _copy_and_check_each_layer_at_its_event(parts, checks, torch.cuda.Stream())
    for *_, src, src_cpu, dst, exp in checks:
        assert all(torch.equal(a.cpu(), b) for a, b in zip(src, src_cpu))
        assert all(torch.equal(a.cpu(), b) for a, b in zip(dst, exp))


@pytest.mark.parametrize("fine", [True, False])
@pytest.mark.parametrize("how", ["default", "split", "at-launch"])
def test_a_layer_is_marked_after_all_its_copy_engine_copies_on_the_one_stream(fine, how,
                                                                               monkeypatch):
    """The plan-level order behind a load's readiness, without a GPU: the copy-engine copies
    go through ``issue_current`` (the stream the load is issued on, no other stream), each
    exactly once, and every copy of a layer is issued before that layer's ``on_layer``; the
    first lead (one later group only) goes out before ``more`` builds the other parts.
    ``how``: the later layers planned in two ("split", as big loads), or each group's copies
    issued at its own launch ("at-launch": no copies ahead of the segment plan)."""
    from contextlib import nullcontext
    from dataclasses import replace

    from hicache.kernels import copy_engine
    from hicache.kernels.segments import SegmentPlan

    parts, checks = _case("cpu", False)
    # the 4160-B rows of pool A stand for the copy engines' rows (on a GPU: 64 KiB or more)
    parts = [replace(p, dma="h2d") if _row_bytes(p) == 4160 else p for p in parts]
    order = [4, 0, 1, 2, 3]
    # layer 0 (position 1) only in pool A's rows, all on the copy engines: a lead can hold it
    parts = [q for p in parts for q in ([p] if p.dma else by_layer._layers_of([p], (0).__ne__))]
    pos = {g: i for i, g in enumerate(order)}
    want = [0] * len(order)  # copy-engine copies per layer position
    for p in parts:
        if p.dma:
            for g in p.layers:
                want[pos[g]] += sum(so.size for _, so, _ in p.ranges)
    # which layer a copy lands in: pool A's destination buffers
    (layers_a, _, _, _, dst_a, _), = [c for c in checks if _row_bytes(c[1][0]) == 4160]
    spans = [(t.data_ptr(), t.data_ptr() + t.numel(), pos[g]) for g, t in zip(layers_a, dst_a)]
    log: list[tuple] = []
    monkeypatch.setattr(by_layer, "_split", lambda ps, dev: ([p for p in ps if p.dma],
                                                           [p for p in ps if not p.dma]))
    monkeypatch.setattr(by_layer, "on_stream", lambda stream, dev: nullcontext())
    monkeypatch.setattr(by_layer, "launch_segments", lambda plan, lo, hi, ctas: None)
    monkeypatch.setattr(SegmentPlan, "to", lambda self, device: self)
    monkeypatch.setattr(copy_engine, "issue", lambda *a: log.append(("other stream",)))
    ramps: list[bool] = []
    monkeypatch.setattr(copy_engine, "issue_current",
                        lambda plan, lo, hi, dev, ramp=False: log.append(("copies", plan, lo, hi))
                        or ramps.append(ramp))
    monkeypatch.setattr(by_layer, "FIRST_LEAD_MIN_BYTES", 0)
    if how == "split":
        monkeypatch.setattr(by_layer, "SPLIT_COPIES", 0)
    elif how == "at-launch":
        monkeypatch.setattr(by_layer, "LEAD_BYTES", 0)
        monkeypatch.setattr(by_layer, "FIRST_LEAD_BYTES", 0)
    first = [p for p in parts if order[0] in p.layers]
    later = [p for p in parts if order[0] not in p.layers]
    steps = issue_by_layer(first, order, lambda i: log.append(("layer", i)),
                           device=torch.device("cuda", 0),
                           more=lambda: log.append(("more",)) or later,
                           more_layers={g for p in later for g in p.layers}, fine=fine)
    assert list(steps)[-1] == len(order)
    assert ("other stream",) not in log
    issued = [0] * len(order)
    marked: list[int] = []
    for e in log:
        if e[0] == "copies":
            _, plan, lo, hi = e
            for addr in plan.dst[lo:hi].tolist():
                issued[next(i for a, b, i in spans if a <= addr < b)] += 1
        elif e[0] == "layer":
            assert issued[e[1]] == want[e[1]], f"layer position {e[1]} marked before its copies"
            marked.append(e[1])
    assert marked == list(range(len(order))) and issued == want  # each copy once
    # layer 0's copies (the first call; the link idle) ramp up, the copies behind them do not
    assert ramps[0] and not any(ramps[1:])
    if how != "at-launch":
        # the first lead: copies of a later layer go out before the other parts are built;
        # in a load in launch groups, layer 1 (all in the lead here) is marked before too
        k = log.index(("more",))
        early = [addr for e in log[:k] if e[0] == "copies" for addr in e[1].dst[e[2]:e[3]]]
        assert any(next(i for a, b, i in spans if a <= addr < b) > 0 for addr in early)
        assert (("layer", 1) in log[:k]) == fine


def test_layer_parts_find_row_blocks_once_per_id_pair(monkeypatch):
    """With a ``memo``, the pools of one space (same id arrays) cut their runs into blocks
    once, and their parts are those made without it."""
    calls = []
    real = by_layer.row_blocks
    monkeypatch.setattr(by_layer, "row_blocks", lambda s, d: calls.append(1) or real(s, d))
    s, d = np.array([4, 5, 6, 7, 1], dtype=np.int64), np.array([0, 1, 2, 3, 9], dtype=np.int64)
    tabs = [(LayerTable([torch.zeros(12, rb, dtype=torch.uint8)]),
             LayerTable([torch.zeros(12, rb, dtype=torch.uint8)])) for rb in (64, 1728)]
    memo: dict = {}
    for a, b in tabs:
        with_memo = layer_parts(a, b, s, d, None, [0], memo)
        plain = layer_parts(a, b, s, d, None, [0])
        assert [[(n, x.tolist(), y.tolist()) for n, x, y in p.ranges] for p in with_memo] == \
            [[(n, x.tolist(), y.tolist()) for n, x, y in p.ranges] for p in plain]
        assert [n for p in plain for n, _, _ in p.ranges] == [4 * a.row_bytes, a.row_bytes]
    assert len(calls) == 1
    # an entry is used only for its own arrays: other arrays at the same key get their own
    s2, d2 = np.array([0, 1, 2, 3, 5], dtype=np.int64), np.array([8, 9, 10, 11, 4], dtype=np.int64)
    memo[(id(s2), id(d2))] = (s, d, [(2, np.array([1]))])  # as if at a freed array's address
    got = layer_parts(*tabs[0], s2, d2, None, [0], memo)
    want = layer_parts(*tabs[0], s2, d2, None, [0])
    assert [[(n, x.tolist(), y.tolist()) for n, x, y in p.ranges] for p in got] == \
        [[(n, x.tolist(), y.tolist()) for n, x, y in p.ranges] for p in want]
    assert len(calls) == 2 and memo[(id(s2), id(d2))][0] is s2


def _row_bytes(p: SegmentPart) -> int:
    """A row part's row size: its smallest range (its blocks of 2^k rows come first)."""
    return min(r[0] for r in p.ranges)


def test_layer_groups_double():
    """Groups tile [0, n) in order: layer 0 alone, then 1, 2, 4, ... layers (the last one
    what is left); O(log n) groups."""
    assert [b - a for a, b in by_layer.layer_groups(44)] == [1, 1, 2, 4, 8, 16, 12]
    assert by_layer.layer_groups(0) == []
    for n in range(1, 300):
        g = by_layer.layer_groups(n)
        assert g[0] == (0, 1) and g[-1][1] == n
        assert all(g[i][1] == g[i + 1][0] for i in range(len(g) - 1))
        sizes = [b - a for a, b in g]
        assert all(x == 1 << max(0, i - 1) for i, x in enumerate(sizes[:-1]))
        assert 0 < sizes[-1] <= 1 << max(0, len(sizes) - 2)


def test_layer_parts_refuses_ids_that_are_not_int64_and_a_token_format_of_other_rows():
    """``layer_parts`` (the load path's plan) checks what ``dispatch`` checks: int32 ids made
    int32 byte offsets, which wrap past 2 GiB (row 14,400 of a DSV4-Flash SWA layer planned at
    -2,138,423,296); a token format whose pages are not the rows put scale writes into the
    next row, or past the buffer."""
    import numpy as np
    import torch

    from hicache.kernels.by_layer import layer_parts
    from hicache.kernels.tables import LayerTable, TokenFormat, TransferError

    meta = LayerTable([torch.empty((20000, 149760), dtype=torch.uint8, device="meta")])
    ids = np.array([14400, 19999], dtype=np.int32)
    with pytest.raises(TransferError, match="int64"):
        layer_parts(meta, meta, ids, ids, None, [0])
    (p,) = layer_parts(meta, meta, ids.astype(np.int64), ids.astype(np.int64), None, [0])
    assert [int(x) for _, s, _ in p.ranges for x in s] == [14400 * 149760, 19999 * 149760]
    fmt = TokenFormat(4, 16, 8, 64, 96)  # scales at bytes 64..96: beyond a 64-B row
    t = LayerTable([torch.zeros(4, 64, dtype=torch.uint8)])
    with pytest.raises(TransferError, match="token format pages"):
        layer_parts(t, t, np.array([3]), np.array([15]), fmt, [0])
