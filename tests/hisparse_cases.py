"""Scenarios and checks for the HiSparse hot buffer, shared by the reference, interpreter and
CUDA tests (``run_case(name, impl, device)``; ``lockstep_case`` runs two impls side by side and
compares every table and byte after every swap-in).

Every check is independent of the implementation under test: after every swap-in, each valid
top-k id's device location holds that token's host bytes (value and scale), invalid ids and
padding rows give -1, the LRU order stays a permutation of the non-reserved slots (the reserved
slot is never given away), no token sits in two slots, every held token's slot holds its bytes,
the reserved slot holds the newest token, and tables of request slots outside the batch are
unchanged.
"""
from __future__ import annotations

import torch

from hicache.engine.hot_buffer import HotBuffer
from hicache.kernels.reference import copy_tokens_ref
from hicache.kernels.tables import LayerTable, TokenFormat

FMT = TokenFormat.mla(64)
P = 64
CASES = ["random", "all_hits", "all_misses", "duplicates_newest", "short_requests",
         "masked_rows", "release_reuse", "out_of_range_ids"]


class World:
    """A host region with random bytes, a hot buffer over it, and the engine's side of the
    contract (the newest token written at ``newest_locs``)."""

    def __init__(self, impl: str, device: str = "cpu", *, L: int = 2, R: int = 5, B: int = 4,
                 K: int = 16, S: int = 32, max_tokens: int = 300, host_rows: int = 40,
                 seed: int = 0) -> None:
        g = torch.Generator().manual_seed(seed)
        self.g = g
        layers = [torch.randint(0, 256, (host_rows, FMT.page_bytes), dtype=torch.uint8,
                                generator=g) for _ in range(L)]
        if device != "cpu":
            layers = [t.pin_memory() for t in layers]
        self.host_layers = layers
        self.hb = HotBuffer(LayerTable(layers, "sparse host"), fmt=FMT, topk=K, slots=S,
                            max_requests=R, max_batch=B, max_tokens=max_tokens, device=device,
                            impl=impl)
        self.L, self.R, self.B, self.K, self.S = L, R, B, K, S
        self.device = torch.device(device)
        self.pages: dict[int, list[int]] = {}
        self.lens: dict[int, int] = {}
        self._free_rows = list(torch.randperm(host_rows, generator=g).tolist())

    # ----------------------------------------------------------------- engine side
    def admit(self, r: int, n: int) -> None:
        need = -(-n // P)
        self.pages[r] = [self._free_rows.pop() for _ in range(need)]
        self.lens[r] = n
        self.hb.admit(r, n, self.pages[r])

    def grow(self, r: int, n: int) -> None:
        """Decode produced C4 tokens up to ``n``: host pages as the daemon would add them, the
        newest token written by the engine to its device location."""
        while len(self.pages[r]) * P < n:
            self.pages[r].append(self._free_rows.pop())
        self.lens[r] = n
        self.hb.extend(r, n, self.pages[r])
        loc = int(self.hb.newest_locs(torch.tensor([r], device=self.device))[0])
        src = torch.tensor([self.host_tok(r, n - 1)])
        dev = [t.cpu() for t in self.hb.dev.layers]
        copy_tokens_ref(self.host_layers, dev, src, torch.tensor([loc]), FMT)
        for d, c in zip(self.hb.dev.layers, dev):
            d.copy_(c)

    def release(self, r: int) -> None:
        self._free_rows.extend(self.pages.pop(r))
        del self.lens[r]
        self.hb.release(r)

    def host_tok(self, r: int, t: int) -> int:
        return self.pages[r][t // P] * P + t % P

    # ----------------------------------------------------------------- checks
    def token_bytes(self, layer: int, host_tok: int) -> torch.Tensor:
        row, s = self.host_layers[layer][host_tok // P], host_tok % P
        off = FMT.scale_offset
        return torch.cat([row[s * 576:(s + 1) * 576], row[off + s * 8: off + s * 8 + 8]])

    def dev_bytes(self, dev_layer: torch.Tensor, loc: int) -> torch.Tensor:
        row, s = dev_layer[loc // P], loc % P
        off = FMT.scale_offset
        return torch.cat([row[s * 576:(s + 1) * 576], row[off + s * 8: off + s * 8 + 8]])

    def step(self, layer: int, rows: list[int], topk: torch.Tensor) -> torch.Tensor:
        """One checked swap-in."""
        hb = self.hb
        before = (hb.slot_tok[layer].cpu().clone(), hb.order[layer].cpu().clone())
        out = hb.swap_in(layer, torch.tensor(rows, device=self.device),
                         topk.to(self.device)).cpu().clone()
        self.verify(layer, rows, topk, out, before)
        return out

    def verify(self, layer: int, rows: list[int], topk: torch.Tensor, out: torch.Tensor,
               before: tuple[torch.Tensor, torch.Tensor]) -> None:
        hb, S = self.hb, self.S
        if hb.impl == "triton":  # the kernel's scratch is left as it was found
            from hicache.kernels.hisparse import FIRST_CLEAN
            assert bool((hb._first == FIRST_CLEAN).all()) and not bool(hb._need.any()), \
                "swap-in left its scratch dirty"
        dev = hb.dev.layers[layer].cpu()
        toks, order = hb.slot_tok[layer].cpu(), hb.order[layer].cpu()
        for b, r in enumerate(rows):
            if r < 0:
                assert (out[b] == -1).all(), f"padding row {b} got locations"
                continue
            n = self.lens[r]
            for i, t in enumerate(topk[b].tolist()):
                loc = int(out[b, i])
                if not 0 <= t < n:
                    assert loc == -1, f"row {b}: id {t} outside [0, {n}) got location {loc}"
                    continue
                assert torch.equal(self.dev_bytes(dev, loc), self.token_bytes(layer, self.host_tok(r, t))), \
                    f"layer {layer} row {b} slot {r}: token {t} at {loc} does not hold its bytes"
        for r, n in self.lens.items():
            assert sorted(order[r].tolist()) == list(range(S)), f"slot {r}: order not a permutation"
            held = [t for t in toks[r].tolist() if t >= 0]
            if n > S:
                assert len(held) == len(set(held)), f"slot {r}: a token sits in two slots"
                newest = self.dev_bytes(dev, int(hb.slot_loc[r, S]))
                assert torch.equal(newest, self.token_bytes(layer, self.host_tok(r, n - 1))), \
                    f"slot {r}: the reserved slot lost the newest token"
            for s, t in enumerate(toks[r].tolist()):
                if 0 <= t < n and (n <= S or t < n - 1):
                    assert torch.equal(self.dev_bytes(dev, int(hb.slot_loc[r, s])),
                                       self.token_bytes(layer, self.host_tok(r, t))), \
                        f"slot {r}: slot {s} claims token {t} but holds other bytes"
            if r not in rows:
                assert torch.equal(toks[r], before[0][r]) and torch.equal(order[r], before[1][r]), \
                    f"slot {r} was not in the batch but its tables changed"

    def topk(self, r: int, *, keep: torch.Tensor | None = None, recent: int = 0) -> torch.Tensor:
        """K distinct ids of request ``r``: ``keep`` first, then random (``recent`` from the
        last ``recent`` tokens)."""
        n = self.lens[r]
        ids = [] if keep is None else [t for t in keep.tolist() if 0 <= t < n]
        pool = torch.randperm(n, generator=self.g).tolist()
        if recent:
            pool = list(range(max(0, n - recent), n)) + pool
        for t in pool:
            if len(ids) == self.K:
                break
            if t not in ids:
                ids.append(t)
        ids += [-1] * (self.K - len(ids))
        return torch.tensor(ids, dtype=torch.int64)


def run_case(name: str, impl: str, device: str = "cpu") -> dict:
    """Run one named scenario with every check; returns (lookups, copied) totals."""
    w = World(impl, device, seed=CASES.index(name))
    K, S = w.K, w.S
    if name == "random":
        w.admit(0, 20)
        w.admit(1, 100)
        w.admit(2, 250)
        w.admit(3, 33)
        prev = {r: None for r in range(4)}
        for step in range(8):
            rows = [0, 1, 2, 3] if step % 2 else [3, 1, -1, 2]
            ks = []
            for r in rows:
                if r < 0:
                    ks.append(torch.full((K,), -1, dtype=torch.int64))
                    continue
                keep = None if prev[r] is None else prev[r][torch.randperm(K, generator=w.g)[:K // 2]]
                ks.append(w.topk(r, keep=keep, recent=4))
                prev[r] = ks[-1]
            topk = torch.stack(ks)
            for layer in range(w.L):
                w.step(layer, rows, topk)
            for r in (1, 2, 3):
                w.grow(r, w.lens[r] + 1)
    elif name == "all_hits":
        w.admit(1, 200)
        t = w.topk(1)
        w.step(0, [1], t[None])
        c0 = w.hb.hits()[0][1]
        for _ in range(3):
            w.step(0, [1], t[torch.randperm(K, generator=w.g)][None])
        assert w.hb.hits()[0][1] == c0, "a repeated top-k copied tokens again"
    elif name == "all_misses":
        w.admit(2, 280)
        for step in range(5):  # disjoint id sets: every id misses, the LRU wraps around
            ids = torch.arange(step * K, (step + 1) * K)
            w.step(1, [2], ids[None])
            assert w.hb.hits()[1][1] == (step + 1) * K
    elif name == "duplicates_newest":
        w.admit(0, 150)
        w.admit(1, 150)
        n = 150
        t = torch.tensor([n - 1] * 4 + [5, 5, 7, n - 1, 7, 9, 5, 11, 12, 9, n - 1, 13])
        w.step(0, [0, 1], torch.stack([t, t.flip(0)]))
        assert w.hb.hits()[0][1] == 2 * 6, "each distinct missed id must be copied once"
        w.grow(0, n + 1)  # the old newest id now comes from the host
        w.step(0, [0, 1], torch.stack([t, t.flip(0)]))
    elif name == "short_requests":
        w.admit(0, 5)
        w.admit(1, S - 1)
        for step in range(4):  # request 1 crosses from the fast path into sparse mode
            rows = [0, 1]
            topk = torch.stack([w.topk(0), w.topk(1, recent=3)])
            for layer in range(w.L):
                w.step(layer, rows, topk)
            w.grow(1, w.lens[1] + 1)
            w.grow(0, w.lens[0] + 1)
        assert w.hb.hits()[0][1] > 0 and w.lens[1] > S
    elif name == "masked_rows":
        w.admit(0, 120)
        w.admit(4, 120)
        t = w.topk(0)
        w.step(0, [-1, 0, -1, -1], torch.stack([t, t, t, t]))
        w.step(0, [-1, -1, -1, -1], torch.stack([t, t, t, t]))
        assert w.hb.hits()[0][1] == K - (1 if (t == 119).any() else 0)
    elif name == "release_reuse":
        w.admit(3, 90)
        w.step(0, [3], w.topk(3)[None])
        w.release(3)
        w.admit(3, 70)  # the same slot, new tokens: nothing of the old request may hit
        w.step(0, [3], torch.arange(K)[None])
        w.step(0, [3], w.topk(3)[None])
    elif name == "out_of_range_ids":
        w.admit(0, 100)
        w.admit(1, 10)
        t = torch.tensor([-5, -1, 100, 99, 1000, 0] + list(range(1, K - 5)))
        w.step(0, [0, 1], torch.stack([t, t]))
    else:
        raise KeyError(name)
    return {"hits": w.hb.hits()}


def lockstep_case(seed: int, impl: str, device: str = "cpu", steps: int = 6) -> None:
    """Random steps through ``impl`` and the reference side by side: identical outputs, tables,
    statistics and device bytes after every swap-in (and every check of ``World``)."""
    a, b = World(impl, device, seed=seed), World("reference", "cpu", seed=seed)
    for w in (a, b):
        for r, n in ((0, 40), (1, 31), (2, 200), (4, 33)):
            w.admit(r, n)
    for step in range(steps):
        rows = [2, 0, 4, 1] if step % 2 else [1, -1, 2, 4]
        topk = torch.stack([a.topk(r, recent=5) if r >= 0 else torch.full((a.K,), -1)
                            for r in rows])
        b.g.set_state(a.g.get_state())
        for layer in range(a.L):
            oa, ob = a.step(layer, rows, topk), b.step(layer, rows, topk)
            assert torch.equal(oa, ob), f"step {step} layer {layer}: locations differ"
            ha, hb_ = a.hb, b.hb
            assert torch.equal(ha.slot_tok.cpu(), hb_.slot_tok), f"step {step}: slot tokens differ"
            assert torch.equal(ha.order.cpu(), hb_.order), f"step {step}: LRU order differs"
            assert torch.equal(ha.stats.cpu(), hb_.stats), f"step {step}: statistics differ"
            for x, y in zip(ha.dev.layers, hb_.dev.layers):
                assert torch.equal(x.cpu(), y), f"step {step}: device bytes differ"
        for w in (a, b):
            for r in (1, 2):
                w.grow(r, w.lens[r] + 1)
