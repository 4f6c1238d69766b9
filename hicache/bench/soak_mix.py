"""``bench soak --mix all``: one soak client moving every kind of unit, every loaded byte checked.

``mix_client(...)`` is the body of one client process. Per operation it draws a *lane*:

* ``rows`` — whole rows of every pool of the ``page`` space (``c4_kv``, ``c4_indexer``,
  ``c128_kv``): sizes 1..4 rows mostly, 5..32 sometimes, 33..512 pages rarely (512 itself a
  third of those);
* ``swa`` — whole rows of the ``swa_page`` space (``swa_kv`` and the C4 state pools);
* ``tokens`` — token ids of one token-granular pool (``c4_kv``, ``c4_indexer``, ``c128_kv``,
  ``swa_kv``), 1..16 tokens in rows the client holds;
* ``state`` — a request-state swap: ``swap_out`` of a slot, later ``swap_in`` into another
  slot (``release``), the slot's content checked.

and within it an ``alloc``, ``free``, ``backup`` or ``load``. The client keeps, per pool and
host row, what the row must hold: a salt (``Pattern`` content ``base ^ salt``) or zeros (a
token backup into a never-written row: the daemon zeroes it first), plus token overrides
``token -> (salt, source token)``. A load's expectation is taken when it is sent (the daemon
orders it after backups sent before it); its ack's device bytes are compared with it — every
loaded byte, rows and tokens. Rows are loaded only once a backup into them was acked (before,
the daemon refuses them ``not_written``). Device buffers are ``DevicePools`` (shared memory, or
CUDA with ``device="cuda:N"``), read and written through torch.
"""
from __future__ import annotations

import random
from collections import deque
from typing import Any

import numpy as np
import torch

MIX_DEV_ROWS = {"page": 520, "swa_page": 8, "req_slot": 4}  # per client
MIX_QUOTA = {"page": 600, "swa_page": 12, "req_slot": 4}  # host rows per client
LANES = (("rows", 0.45), ("swa", 0.15), ("tokens", 0.3), ("state", 0.1))
ZERO = None  # expectation base of a row first written by a token backup


def pick_size(rng: random.Random) -> int:
    x = rng.random()
    if x < 0.9:
        return rng.randint(1, 4)
    if x < 0.99:
        return rng.randint(5, 32)
    return 512 if rng.random() < 1 / 3 else int(round(2 ** rng.uniform(np.log2(33), 9)))


class Content:
    """Row bytes of a salt per pool (``base[pool] ^ salt``), token slices, and expectations."""

    def __init__(self, layout: Any, seed: int) -> None:
        self.layout = layout
        self.base: dict[str, np.ndarray] = {}
        for i, (name, spec) in enumerate(layout.pools.items()):
            g = np.random.default_rng([seed, i, 77])
            self.base[name] = g.integers(0, 1 << 63, size=(spec.num_layers, spec.page_bytes // 8),
                                         dtype=np.uint64)

    def row(self, pool: str, salt: int | None) -> np.ndarray:
        if salt is ZERO:
            return np.zeros((len(self.base[pool]), self.base[pool].shape[1] * 8), np.uint8)
        return (self.base[pool] ^ np.uint64(salt)).view(np.uint8)

    def token_slices(self, pool: str, t: int) -> list[slice]:
        s = self.layout.pool(pool)
        out = [slice(t * s.value_bytes, (t + 1) * s.value_bytes)]
        if s.scale_bytes:
            o = s.scale_offset + t * s.scale_bytes
            out.append(slice(o, o + s.scale_bytes))
        return out

    def expected_row(self, pool: str, exp: tuple[Any, dict]) -> np.ndarray:
        base, over = exp
        out = self.row(pool, base).copy()
        for t, (salt, src) in over.items():
            src_row = self.row(pool, salt)
            for a, b in zip(self.token_slices(pool, t), self.token_slices(pool, src)):
                out[:, a] = src_row[:, b]
        return out

    def expected_token(self, pool: str, exp: tuple[Any, dict], t: int) -> np.ndarray:
        base, over = exp
        salt, src = over.get(t, (base, t))
        r = self.row(pool, salt)
        return np.concatenate([r[:, sl] for sl in self.token_slices(pool, src)], axis=1)


class MixClient:
    """State and operations of one ``--mix all`` soak client (see the module docstring)."""

    def __init__(self, client: Any, pools: Any, layout: Any, idx: int, seed: int,
                 stats: dict[str, Any]) -> None:
        from hicache.fuzz.runner import mix64

        self.c, self.pools, self.layout, self.idx = client, pools, layout, idx
        self.mix64 = mix64
        self.rng = random.Random(mix64(seed, idx, 0x51A))
        self.content = Content(layout, seed)
        self.st = stats
        self.cuda = pools.mode == "cuda"
        self.views = {} if self.cuda else {p: [t.numpy() for t in ls]
                                           for p, ls in pools.layers.items()}
        self.held: dict[str, list[int]] = {s: [] for s in MIX_QUOTA}
        self.exp: dict[str, dict[int, tuple[Any, dict]]] = {p: {} for p in layout.pools}
        self.ready: dict[str, set[int]] = {p: set() for p in layout.pools}
        self.busy: dict[str, set[int]] = {s: set() for s in MIX_DEV_ROWS}
        self.pending: deque = deque()
        self.swapped: list[tuple[int, int]] = []  # (host row, salt) of acked swap-outs
        self.swapping = 0  # swap-outs not acked yet
        self.version = 0
        self.token_pools = [p.name for p in layout.pools.values() if p.token_granular]

    # ------------------------------------------------------------------ device rows
    def _write(self, pool: str, rows: list[int], salts: list[int]) -> None:
        data = np.stack([self.content.row(pool, s) for s in salts], axis=1)  # [L, n, B]
        if not self.cuda:  # numpy views of the shared memory: torch's byte indexing is slow
            for layer, v in enumerate(self.views[pool]):
                v[rows] = data[layer]
            return
        idx = torch.tensor(rows, dtype=torch.int64, device=self.pools.device)
        src = torch.from_numpy(data).to(self.pools.device)
        for layer, t in enumerate(self.pools.layers[pool]):
            t[idx] = src[layer]

    def _read(self, pool: str, rows: list[int]) -> np.ndarray:
        if not self.cuda:
            return np.stack([v[rows] for v in self.views[pool]])
        idx = torch.tensor(rows, dtype=torch.int64, device=self.pools.device)
        return np.stack([t[idx].cpu().numpy() for t in self.pools.layers[pool]])

    def _scribble(self, pool: str, rows: list[int]) -> None:
        if not self.cuda:
            for v in self.views[pool]:
                v[rows] = 0x5A
            return
        idx = torch.tensor(rows, dtype=torch.int64, device=self.pools.device)
        for t in self.pools.layers[pool]:
            t[idx] = 0x5A

    def _sync(self) -> None:
        if self.cuda:
            torch.cuda.synchronize()

    def _dev(self, space: str, k: int) -> list[int] | None:
        n = MIX_DEV_ROWS[space]
        while n - len(self.busy[space]) < k and self.pending:
            self.complete()
        free = [r for r in range(n) if r not in self.busy[space]]
        if len(free) < k:
            return None
        rows = self.rng.sample(free, k)
        self.busy[space].update(rows)
        return rows

    def _salt(self, d: int) -> int:
        self.version += 1
        return self.mix64(self.idx, d, self.version) & ((1 << 63) - 1)

    # ------------------------------------------------------------------ completion
    def complete(self) -> None:
        from hicache.engine.client import AckTimeout

        op, kind, space, drows, check = self.pending.popleft()
        if kind == "swap_out":
            self.swapping -= 1
        try:
            ack = self.c.wait_ack(op, timeout=120.0, check=False)
        except AckTimeout:
            self.st["lost_acks"] += 1
            self.problem(f"{kind} op {op.op_id}: no ack within 120 s")
            self.busy[space].difference_update(drows)
            return
        if not ack.ok:
            self.st["failed_ops"] += 1
            self.problem(f"{kind} op {op.op_id} failed: {ack.error}")
        elif check is not None:
            check()
        self.busy[space].difference_update(drows)

    def problem(self, msg: str) -> None:
        if self.st["first_problem"] is None:
            self.st["first_problem"] = f"client {self.idx}: {msg}"

    def _verify(self, what: str, got: np.ndarray, want: np.ndarray, units: int) -> None:
        self.st["verified_bytes"] += int(want.nbytes)
        self.st["verified_pages"] += units
        if not np.array_equal(got, want):
            self.st["corrupted_pages"] += units
            self.problem(f"{what}: loaded bytes differ")

    # ------------------------------------------------------------------ operations
    def step(self) -> None:
        lane = self.rng.choices([n for n, _ in LANES], [w for _, w in LANES])[0]
        space = {"rows": "page", "swa": "swa_page", "state": "req_slot"}.get(lane)
        if lane == "tokens":
            pool = self.rng.choice(self.token_pools)
            space = self.layout.pool(pool).index
        x = self.rng.random()
        held = self.held[space]
        if lane == "state":
            return self.swap()
        k = pick_size(self.rng) if lane == "rows" else self.rng.randint(1, 4)
        if x < 0.1 or not held:
            k = min(k, MIX_QUOTA[space] - len(held))
            if k <= 0:
                return self.free(space, len(held) // 2)
            got = self.c.alloc({space: k})[space]
            held.extend(int(r) for r in got)
            self.st["allocs"] += 1
        elif x < 0.18:
            self.free(space, min(k, len(held)))
        elif lane == "tokens":
            self.tokens(pool, space, backup=x < 0.55)
        elif x < 0.55 or not any(self.ready[p.name] for p in self.layout.space_pools(space)):
            self.backup_rows(space, min(k, len(held)))
        else:
            self.load_rows(space, k)

    def free(self, space: str, k: int) -> None:
        if k <= 0:
            return
        pick = self.rng.sample(self.held[space], k)
        self.c.free({space: pick})
        gone = set(pick)
        self.held[space] = [r for r in self.held[space] if r not in gone]
        for p in self.layout.space_pools(space):
            self.ready[p.name] -= gone
            for r in pick:
                self.exp[p.name].pop(r, None)
        self.st["frees"] += 1

    def backup_rows(self, space: str, k: int) -> None:
        hosts = self.rng.sample(self.held[space], k)
        drows = self._dev(space, k)
        if drows is None:
            return
        salts = [self._salt(d) for d in drows]
        pools = [p.name for p in self.layout.space_pools(space)]
        for p in pools:
            self._write(p, drows, salts)
        self._sync()
        op = self.c.backup({space: (drows, hosts)})
        mine = []
        for p in pools:
            for h, s in zip(hosts, salts):
                e = self.exp[p][h] = (s, {})
                mine.append((p, h, e))

        def acked() -> None:  # unless a later write (or a free) replaced the expectation
            for p, h, e in mine:
                if self.exp[p].get(h) is e:
                    self.ready[p].add(h)
        self.pending.append((op, "backup", space, drows, acked))
        self.st["backups"] += 1

    def load_rows(self, space: str, k: int) -> None:
        pools = [p.name for p in self.layout.space_pools(space)]
        ok = set.intersection(*(self.ready[p] for p in pools))
        if not ok:
            return
        hosts = self.rng.sample(sorted(ok), min(k, len(ok)))
        drows = self._dev(space, len(hosts))
        if drows is None:
            return
        want = {p: np.stack([self.content.expected_row(p, self.exp[p][h]) for h in hosts], 1)
                for p in pools}
        for p in pools:
            self._scribble(p, drows)
        self._sync()
        op = self.c.load({space: (hosts, drows)})

        def check() -> None:
            for p in pools:
                self._verify(f"load of {p} rows {hosts[:4]}", self._read(p, drows), want[p],
                             len(hosts))
        self.pending.append((op, "load", space, drows, check))
        self.st["loads"] += 1

    def tokens(self, pool: str, space: str, backup: bool) -> None:
        P = self.layout.pool(pool).tokens_per_page
        k = self.rng.randint(1, 16)
        src = self.held[space] if backup else sorted(self.ready[pool])
        if not src:
            return
        drows = self._dev(space, 1 + (k - 1) // P)
        if drows is None:
            return
        htoks = self.rng.sample(range(len(src) * P), min(k, len(src) * P))
        htoks = [src[i // P] * P + i % P for i in htoks]
        dtoks = [drows[j // P] * P + j % P for j in range(len(htoks))]
        if backup:
            salts = [self._salt(d) for d in drows]
            self._write(pool, drows, salts)
            self._sync()
            op = self.c.backup({pool: (dtoks, htoks, "token")})
            for h, d in zip(htoks, dtoks):
                row = h // P
                base, over = self.exp[pool].get(row, (ZERO, {}))
                over = dict(over)
                over[h % P] = (salts[drows.index(d // P)], d % P)
                self.exp[pool][row] = (base, over)
            mine = [(r, self.exp[pool][r]) for r in {h // P for h in htoks}]

            def acked() -> None:
                for r, e in mine:
                    if self.exp[pool].get(r) is e:
                        self.ready[pool].add(r)
            self.pending.append((op, "token backup", space, drows, acked))
            self.st["backups"] += 1
            return
        want = [self.content.expected_token(pool, self.exp[pool][h // P], h % P) for h in htoks]
        self._scribble(pool, drows)
        self._sync()
        op = self.c.load({pool: (htoks, dtoks, "token")})

        def check() -> None:
            got = self._read(pool, drows)
            for d, w in zip(dtoks, want):
                r = got[:, drows.index(d // P)]
                g = np.concatenate([r[:, sl] for sl in self.content.token_slices(pool, d % P)], 1)
                self._verify(f"token load of {pool}", g, w, 1)
        self.pending.append((op, "token load", space, drows, check))
        self.st["loads"] += 1

    def swap(self) -> None:
        pools = [p.name for p in self.layout.space_pools("req_slot")]
        if not pools:
            return
        if self.swapped and (self.rng.random() < 0.5 or len(self.held["req_slot"]) == 0):
            row, salt = self.swapped.pop(self.rng.randrange(len(self.swapped)))
            slot = self._dev("req_slot", 1)
            if slot is None:
                self.swapped.append((row, salt))
                return
            for p in pools:
                self._scribble(p, slot)
            self._sync()
            op = self.c.swap_in(row, slot[0], release=True)
            want = {p: self.content.row(p, salt)[:, None, :] for p in pools}

            def check() -> None:
                for p in pools:
                    self._verify(f"swap_in of {p}", self._read(p, slot), want[p], 1)
            self.pending.append((op, "swap_in", "req_slot", slot, check))
            self.st["swaps"] += 1
            return
        if len(self.swapped) + self.swapping >= MIX_QUOTA["req_slot"]:
            return
        slot = self._dev("req_slot", 1)
        if slot is None:
            return
        salt = self._salt(slot[0])
        for p in pools:
            self._write(p, slot, [salt])
        self._sync()
        self.version += 1
        op = self.c.swap_out(slot[0], request=f"s{self.idx}-{self.version}")
        self.swapping += 1

        def acked() -> None:
            self.swapped.append((op.host_row, salt))
        self.pending.append((op, "swap_out", "req_slot", slot, acked))
        self.st["swaps"] += 1
