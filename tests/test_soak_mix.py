"""``--mix all``'s checks can fail: one wrong byte anywhere a load wrote is one corrupted unit.

One ``MixClient`` runs in this process against a real daemon (CPU mode here; ``test_soak_cuda``
runs the same on a GPU). After a clean stretch (nothing corrupted), each acked load, token load
and swap-in gets one byte flipped in its device rows before its check runs (``on_ack``): a byte
of a loaded row or slot, of a loaded token's value or scale, or of the scribbled bytes beside
the loaded tokens. Every flip must count as exactly one corrupted unit, and the first must be
named in the report. Also ``soak_bytes``' views: a pool whose layers are not evenly spaced
views of one buffer is refused; and ``describe`` names where and how a unit differs."""
from __future__ import annotations

import random
from pathlib import Path
from typing import Any

import pytest
import torch

from conftest import start_daemon
from hicache.bench.soak import MIX_DAEMON_ROWS
from hicache.bench.soak_bytes import SCRIBBLE, describe, pool_view
from hicache.bench.soak_mix import MIX_DEV_ROWS, MixClient, Pending
from hicache.core.layout import build_layout, preset


def flip_one_byte(pools: Any, layout: Any, p: Pending, rng: random.Random) -> str:
    """Flip one byte that load ``p`` wrote (or, for a token load, sometimes one beside its
    tokens that it must have left alone) in its device rows; says where."""
    pool, unit, ids = rng.choice(p.loaded)
    spec = layout.pool(pool)
    layer = rng.randrange(spec.num_layers)
    if unit == "rows":
        row, b = rng.choice(ids), rng.randrange(spec.page_bytes)
        where = "row"
    else:
        P, vb, sb = spec.tokens_per_page, spec.value_bytes, spec.scale_bytes
        tok = rng.choice(ids)
        row, pos = tok // P, tok % P
        taken = {(t // P, t % P) for t in ids}
        if rng.random() < 0.3:  # beside the loaded tokens: a value byte of an untouched token
            free = [q for q in range(P) if (row, q) not in taken]
            if free:
                b, where = rng.choice(free) * vb + rng.randrange(vb), "beside"
            else:
                b, where = spec.page_bytes - 1, "beside"  # the padding after the scales
                assert spec.scale_offset + P * sb < spec.page_bytes
        else:
            j = rng.randrange(vb + sb)
            b = pos * vb + j if j < vb else spec.scale_offset + pos * sb + (j - vb)
            where = "token"
    t = pools.layers[pool][layer]
    t[row, b] = t[row, b] ^ 0xFF
    return f"{p.kind} {pool} {where}"


def run_with_wrong_bytes(address: str, device: str, flips: int = 40, seed: int = 3) -> None:
    from hicache.engine.client import Client
    from hicache.engine.device_pools import DevicePools

    layout = build_layout(preset("dsv4-tiny"))
    st: dict[str, Any] = {k: 0 for k in ("ops", "backups", "loads", "frees", "allocs", "swaps",
                                         "lost_acks", "failed_ops", "corrupted_pages",
                                         "verified_pages", "verified_bytes", "refused",
                                         "unreachable")}
    st["first_problem"] = None
    pools = DevicePools(layout, {s: n for s, n in MIX_DEV_ROWS.items()
                                 if layout.space_pools(s)}, device)
    c = Client(address, timeout=60.0, name="mixcheck")
    try:
        m = MixClient(c, pools, layout, 0, seed, st)
        c.register(pools)

        def run(steps: int) -> None:
            for _ in range(steps):
                m.step()
                while len(m.pending) > 4:
                    m.complete()
            while m.pending:
                m.complete()

        run(300)  # clean: every check passes
        assert st["failed_ops"] == 0 and st["lost_acks"] == 0, st["first_problem"]
        assert st["corrupted_pages"] == 0 and st["first_problem"] is None, st["first_problem"]
        assert st["loads"] > 30 and st["verified_bytes"] > 0
        rng = random.Random(seed)
        done: list[str] = []

        def corrupt(p: Pending) -> None:
            if p.loaded and len(done) < flips:
                done.append(flip_one_byte(pools, layout, p, rng))
        m.on_ack = corrupt
        for _ in range(200):
            if len(done) >= flips:
                break
            run(20)
        assert len(done) == flips, done
        where = {d.split()[-1] for d in done}
        assert where == {"row", "token", "beside"}, done  # rows, tokens and beside them hit
        assert st["failed_ops"] == 0 and st["lost_acks"] == 0
        assert st["corrupted_pages"] == flips, (st["corrupted_pages"], done)
        assert "bytes differ in 1 of" in st["first_problem"], st["first_problem"]
        c.unregister(timeout=10)
    finally:
        c.close()
        pools.close()


def test_every_wrong_byte_is_reported(tmp_path: Path) -> None:
    d = start_daemon(tmp_path, preset="dsv4-tiny", device_rows=MIX_DAEMON_ROWS,
                     host=("--host-ratio", "4"), heartbeat_timeout=30.0, metrics=False)
    try:
        run_with_wrong_bytes(d.address, "cpu")
    finally:
        d.close()  # stop, and remove its private socket folder
    assert "Traceback" not in d.output()


def test_pool_view_refuses_layers_not_evenly_spaced() -> None:
    buf = torch.zeros(4096, dtype=torch.uint8)
    ok = [buf[0:1024].view(4, 256), buf[2048:3072].view(4, 256)]
    v = pool_view(ok)
    v[1, 2, 3] = 7
    assert buf[2048 + 2 * 256 + 3] == 7 and v.shape == (2, 4, 256)
    with pytest.raises(ValueError, match="evenly spaced"):
        pool_view(ok + [buf[3072:4096].view(4, 256)])  # step 2048, then 1024
    with pytest.raises(ValueError, match="evenly spaced"):
        pool_view([ok[0], torch.zeros(4, 256, dtype=torch.uint8)])  # another buffer
    with pytest.raises(ValueError, match="overlap"):
        pool_view([buf[0:1024].view(4, 256), buf[512:1536].view(4, 256)])


def test_describe_names_the_layers_the_bytes_and_what_was_found():
    # [layers, units, words]; every byte of word k holds k + 1 (no zero byte anywhere)
    want = (torch.arange(3 * 2 * 8, dtype=torch.int64) + 1).view(3, 2, 8) * 0x0101010101010101
    got = want.clone()
    got[1, 1, 2:4] = 0  # unit 1, layer 1, bytes [16, 32): zeros
    got[2, 1, 5] = 7
    line = describe(got, want, 1)
    assert line.startswith("layers [1, 2] of 3; layer 1: 16 bytes differ in [16, 32) of 64"), line
    assert line.endswith("found zeros"), line
    got = want.clone()
    got[0, 0, 1] = SCRIBBLE
    assert describe(got, want, 0).endswith("found the scribble")
    got = want.clone()
    got[2, 0, 3] = want[0, 0, 3]  # the bytes another layer wants there
    assert describe(got, want, 0).endswith("found the bytes wanted in layer 0")
    assert describe(want, want, 0) == "no difference"
