"""Checkpoint objects in L3 on a real Mooncake Store (loopback master + storage member, real
daemons): instance A backs up pages and a resume checkpoint (SWA tail + C4 / C4-indexer state
rows) and puts them to L3 as checkpoints-mirror objects; instance B, another daemon, fetches
them into its host tier and LOADs them like host hits. Every byte B's device pools hold
afterwards is compared: the prefix pages and the checkpoint equal A's, everything else (the
SWA head of the boundary row, C128 state, other rows) is as it was. Skipped without the
Mooncake wheel (``pip install 'hicache[l3]'``).
"""
from __future__ import annotations

import json

import pytest
import torch

from hicache.core.layout import build_layout, preset
from hicache.core.resume import ResumeModel
from hicache.engine import l3_master
from hicache.engine.device_pools import DevicePools
from hicache.engine.hooks import ClientHooks

import background_jobs
from conftest import start_daemon
from test_l3_mooncake import SCOPE, store, wait_online  # noqa: F401 - store: the fixture

pytestmark = pytest.mark.skipif(l3_master.mooncake_dir() is None,
                                reason="Mooncake wheel not installed (pip install 'hicache[l3]')")
TRACE = background_jobs.TRACE


def _rows(swa: str) -> dict[str, int]:
    return {"page": 8, "swa_page": 8, "req_slot": 4} if swa == "paged" else \
        {"page": 8, "req_slot": 4}


class Side:
    """One instance: a daemon with L3, random device pools, checkpoint-mirror hooks."""

    def __init__(self, tmp_path, store, swa: str, seed: int) -> None:  # noqa: F811
        self.lay = build_layout(preset("dsv4-tiny"), swa_mode=swa)
        rows = _rows(swa)
        flag = ",".join(f"{k}={v}" for k, v in rows.items())
        self.d = start_daemon(tmp_path, preset="dsv4-tiny", device_rows=flag,
                              extra=("--swa-mode", swa, "--l3", "mooncake", "--l3-master",
                                     store.master_addr, "--l3-metadata", store.metadata_url,
                                     "--l3-scope", SCOPE),
                              env=l3_master.loopback_env(), heartbeat_timeout=300)
        self.pools = DevicePools(self.lay, rows)
        g = torch.Generator().manual_seed(seed)
        for layers in self.pools.layers.values():
            for t in layers:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, generator=g))
        self.c = self.d.client(name=f"ck{seed}")
        self.c.register(self.pools)
        wait_online(self.c)
        self.r = ResumeModel(self.lay)
        self.h = ClientHooks(self.c, ["page"], timeout=30, resume=self.r, l3=True)

    def snapshot(self) -> dict[str, list[torch.Tensor]]:
        return {n: [t.clone() for t in ls] for n, ls in self.pools.layers.items()}

    def close(self) -> None:
        try:
            self.c.unregister(timeout=5)
        except Exception:  # noqa: BLE001 - the assertion that failed says more
            pass
        finally:
            self.c.close()
            self.pools.close()
            self.d.close()


def _tail(spec, row: torch.Tensor, pos: list[int]) -> list[torch.Tensor]:
    a, b = min(pos), max(pos) + 1
    return [row[a * spec.value_bytes:b * spec.value_bytes],
            row[spec.scale_offset + a * spec.scale_bytes:spec.scale_offset + b * spec.scale_bytes]]


@pytest.mark.parametrize("swa", ["paged", "ring"])
def test_checkpoint_objects_round_trip_between_instances(tmp_path, store, swa):  # noqa: F811
    a = Side(tmp_path, store, swa, 11)
    b = Side(tmp_path, store, swa, 12)
    try:
        keys = [f"ck-{swa}-{i}" for i in range(3)]
        depth = 3  # the boundary is the third page: its checkpoint resumes the prefix
        src, a_loc = [1, 2, 3], (3 if swa == "paged" else 2)  # boundary: device row or slot
        pages = a.h.host_alloc(3)
        ck = a.h.host_alloc(1, kind="ckpt")
        a.h.wait(a.h.backup(src, pages, ckpts=[(a_loc, ck[0], depth)]))
        a.h.l3_put(keys, pages)
        a.h.l3_ckpt_put(keys[-1:], ck)
        assert a.h.l3_settle(30) == 0
        assert a.h.l3_stats["written"] == 4 and a.h.l3_stats["errors"] == 0
        # B: the pages and the boundary checkpoint come from L3 ...
        assert b.h.l3_query(keys) == 3
        assert b.h.l3_ckpt_present(keys) == [0, 0, 1]
        before = b.snapshot()
        hp = b.h.host_alloc(3)
        hc = b.h.host_alloc(1, kind="ckpt")
        assert b.h.l3_prefetch(keys, hp) == 3
        assert b.h.l3_ckpt_prefetch(keys[-1:], hc) == 1
        dst, b_loc = [5, 6, 7], (7 if swa == "paged" else 1)
        b.h.wait(b.h.load(hp, dst, ckpts=[(b_loc, hc[0], depth)]))
        # ... and B's pools now hold exactly A's prefix and checkpoint, nothing else moved
        r = b.r
        pos = list(r.tail_offsets) if swa == "paged" else r.ring_positions(depth)
        want = {n: [t.clone() for t in ls] for n, ls in before.items()}
        for p in b.lay.space_pools("page"):
            for i in range(p.num_layers):
                for s, d in zip(src, dst):
                    want[p.name][i][d] = a.pools.layers[p.name][i][s]
        for p in r.state_pools:
            for i in range(p.num_layers):
                want[p.name][i][b_loc] = a.pools.layers[p.name][i][a_loc]
        sp = r.swa_pool
        for i in range(sp.num_layers):
            for w, x in zip(_tail(sp, want[sp.name][i][b_loc], pos),
                            _tail(sp, a.pools.layers[sp.name][i][a_loc], pos)):
                w.copy_(x)
        for n, ls in b.pools.layers.items():
            for i, t in enumerate(ls):
                assert torch.equal(t, want[n][i]), f"pool {n} layer {i} differs"
        # the host checkpoint row holds only what the object carried: the SWA head was zeroed
        # (no earlier owner's bytes), pools outside the object are not readable
        head = [t for t in range(r.layout.model.page_size) if t not in set(pos)][:4]
        tok = [hc[0] * sp.tokens_per_page + t for t in head]
        out = [b_loc * sp.tokens_per_page + t for t in head]
        b.c.wait_ack(b.c.load({sp.name: (tok, out, "token")}))
        for i in range(sp.num_layers):
            row = b.pools.layers[sp.name][i][b_loc]
            for t in head:
                assert not row[t * sp.value_bytes:(t + 1) * sp.value_bytes].any()
        if "c128_state" in [p.name for p in b.lay.space_pools(r.checkpoint_space)]:
            with pytest.raises(Exception, match="not_written|holds nothing"):
                b.c.wait_ack(b.c.load({"c128_state": ([hc[0]], [b_loc])}))
        # a kind this stage cannot store, and ckpt with a full mirror, are refused
        if swa == "ring":
            with pytest.raises(Exception, match="paged SWA"):
                b.c.l3_query(keys, timeout=10)
        with pytest.raises(Exception, match="ckpt applies"):
            b.c.l3_query(keys, timeout=10, mirror="full", ckpt=True)
    finally:
        a.close()
        b.close()


@pytest.mark.skipif(not TRACE.exists(), reason="shared trace not beside the checkout")
def test_demo_trace_two_instances_checkpoints():
    """The synthetic trace's first two multi-turn conversations (19 requests), split by
    conversation over two instances, checkpoints mirror: with L3 the instances cache more
    than the same two without it, A's prefixes come back after its daemon is killed, a
    checkpoint object resumes them, and 0 bytes differ."""
    run = background_jobs.result("l3_ckpt_demo")  # (run beside the main suite: conftest)
    assert len(run.steps) == 1, run.notes
    r = run.steps[0]
    assert r.rc == 0, (run.notes, r.err[-1500:])
    out = json.loads(r.out.strip().splitlines()[-1])
    assert out["mirror"] == "checkpoints" and out["l3"]["requests"] == 19
    assert out["routing"].startswith("by conversation") and out["conversations"] == 2
    assert out["verified"] and out["mismatched_bytes"] == 0, out
    assert out["l3_errors"] == 0, (out["l3_error_kinds"], run.notes, r.err[-1500:])
    assert out["l3"]["cached_tokens"] > out["independent"]["cached_tokens"]
    assert out["restart_hit_tokens"] > 0 and out["l3_checkpoints"] >= 1
    assert out["l3_hit_tokens"] == out["cross_instance_hit_tokens"] + \
        out["restart_hit_tokens"] + out["own_l3_hit_tokens"]
    assert out["l3"]["listeners"] and all(a.startswith(("127.", "[::ffff:127."))
                                          for a in out["l3"]["listeners"])
