"""``bench soak --mix all``: one soak client moving every kind of unit, every loaded byte checked.

``MixClient(...)`` is the state of one client process (``soak_load._mix_client`` drives it).
Per operation it draws a *lane*:

* ``rows`` — whole rows of every pool of the ``page`` space (``c4_kv``, ``c4_indexer``,
  ``c128_kv``): sizes 1..4 rows mostly, 5..32 sometimes, 33..512 pages rarely (512 itself a
  third of those);
* ``swa`` — whole rows of the ``swa_page`` space (``swa_kv`` and the C4 state pools);
* ``tokens`` — token ids of one token-granular pool (``c4_kv``, ``c4_indexer``, ``c128_kv``,
  ``swa_kv``), 1..16 tokens in rows the client holds;
* ``state`` — a request-state swap: ``swap_out`` of a slot, later ``swap_in`` into another
  slot (``release``), the slot's content checked.

and within it an ``alloc``, ``free``, ``backup`` or ``load``. Bytes live on the pools' device
(``soak_bytes``; the same torch code on ``cpu`` and ``cuda:N``): a backup writes rows of a salt's
content (``base ^ salt``) into its device rows and the same bytes into the *shadow* of the host
rows it targets (a token backup: its tokens' value and scale, into a zeroed shadow row when the
host row was never written: the daemon zeroes it first). A load first scribbles its device
rows, takes a copy of the shadow rows it expects when it is sent (the daemon orders it after
backups sent before it), and on its ack compares on the device: every loaded byte of rows,
tokens (value and scale) and slots, and for a token load also that the rest of its device rows
still holds the scribble. Only the verdict comes back to the host (one sync per check); a
differing row or token counts as one corrupted unit and the first is named. Rows are loaded
only once a backup into them was acked (before, the daemon refuses them ``not_written``).

GPU ordering: the client writes on its own CUDA stream and waits for that stream (not the
device) before each command, since the daemon's copy streams cannot wait on it; a GPU op is
acked only after the daemon's completion event for it has completed (``controllers/scheduler``),
so the check, enqueued after the ack, reads the copied bytes.
"""
from __future__ import annotations

import math
import random
import time
from collections import deque
from typing import Any, Callable, Sequence

import torch

from hicache.bench.soak_bytes import (SCRIBBLE, Content, Rows, Shadow, bad_units, describe,
                                      differs, pool_view)

MIX_DEV_ROWS = {"page": 520, "swa_page": 8, "req_slot": 4}  # per client
MIX_QUOTA = {"page": 600, "swa_page": 12, "req_slot": 4}  # host rows per client
SHADOW_SPACES = ("page", "swa_page")  # host rows the client allocates (req_slot: swap_out does)
LANES = (("rows", 0.45), ("swa", 0.15), ("tokens", 0.3), ("state", 0.1))


def pick_size(rng: random.Random) -> int:
    x = rng.random()
    if x < 0.9:
        return rng.randint(1, 4)
    if x < 0.99:
        return rng.randint(5, 32)
    return 512 if rng.random() < 1 / 3 else int(round(2 ** rng.uniform(math.log2(33), 9)))


PROBLEM_LOG = 8  # problems a client keeps word of (the count covers them all)


class Pending:
    """One operation in flight: its ``Op``, what it is, the device rows it holds, what to run
    on its ack, and (loads) what it loaded: ``[(pool, "rows" | "tokens", device ids)]``."""

    __slots__ = ("op", "kind", "space", "drows", "then", "loaded")

    def __init__(self, op: Any, kind: str, space: str, drows: list[int],
                 then: Callable[[], None] | None, loaded: list[tuple[str, str, list[int]]]
                 ) -> None:
        self.op, self.kind, self.space, self.drows = op, kind, space, drows
        self.then, self.loaded = then, loaded


class MixClient:
    """State and operations of one ``--mix all`` soak client (see the module docstring)."""

    def __init__(self, client: Any, pools: Any, layout: Any, idx: int, seed: int,
                 stats: dict[str, Any]) -> None:
        from hicache.fuzz.runner import mix64

        self.c, self.pools, self.layout, self.idx = client, pools, layout, idx
        self.mix64 = mix64
        self.rng = random.Random(mix64(seed, idx, 0x51A))
        self.dev = pools.device
        self.cuda = pools.mode == "cuda"
        self.content = Content(layout, seed, self.dev)
        self.rows = {p: Rows(pool_view(ls), layout.pool(p)) for p, ls in pools.layers.items()}
        self.shadow = Shadow(layout, {s: MIX_QUOTA[s] for s in SHADOW_SPACES}, self.dev)
        self.st = stats
        for k in ("t_calls", "t_ack_wait", "t_check"):
            self.st.setdefault(k, 0.0)
        call = client.call

        def timed_call(*a: Any, **k: Any) -> Any:  # round trips, for the report's time split
            t = time.perf_counter()
            try:
                return call(*a, **k)
            finally:
                self.st["t_calls"] += time.perf_counter() - t
        client.call = timed_call
        self.held: dict[str, list[int]] = {s: [] for s in MIX_QUOTA}
        # per pool and held host row: a fresh object per backup sent into it (absent: never
        # written since its alloc); a backup's ack makes the row readable if it is still its own
        self.exp: dict[str, dict[int, object]] = {p: {} for p in layout.pools}
        self.ready: dict[str, set[int]] = {p: set() for p in layout.pools}
        self.busy: dict[str, set[int]] = {s: set() for s in MIX_DEV_ROWS}
        self.pending: deque[Pending] = deque()
        self.swapped: list[tuple[int, int]] = []  # (host row, salt) of acked swap-outs
        self.swapping = 0  # swap-outs not acked yet
        self.version = 0
        self.token_pools = [p.name for p in layout.pools.values() if p.token_granular]
        # called with each acked operation before its check (tests inject wrong bytes here)
        self.on_ack: Callable[[Pending], None] | None = None

    # ------------------------------------------------------------------ device rows
    def _up(self, *lists: Sequence[int]) -> list[torch.Tensor]:
        """Small id lists as int64 tensors on the device, in one upload (pinned, no host wait)."""
        t = torch.tensor([x for ls in lists for x in ls], dtype=torch.int64)
        if self.cuda:
            t = t.pin_memory().to(self.dev, non_blocking=True)
        out, i = [], 0
        for ls in lists:
            out.append(t[i: i + len(ls)])
            i += len(ls)
        return out

    def _write(self, pool: str, drows: torch.Tensor, salts: torch.Tensor) -> torch.Tensor:
        """Device rows ``drows`` of every layer of ``pool`` := the salts' content; returns it."""
        data = self.content.rows(pool, salts)
        self.rows[pool].w.index_copy_(1, drows, data)
        return data

    def _scribble(self, pool: str, drows: torch.Tensor) -> None:
        self.rows[pool].w.index_fill_(1, drows, SCRIBBLE)

    def _flush(self) -> None:
        """Before a command: the daemon (another process) must see this client's writes. On a
        GPU, wait for this client's stream only (its writes are all on it)."""
        if self.cuda:
            torch.cuda.current_stream(self.dev).synchronize()

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

        p = self.pending.popleft()
        if p.kind == "swap_out":
            self.swapping -= 1
        t = time.perf_counter()
        try:
            ack = self.c.wait_ack(p.op, timeout=120.0, check=False)
        except AckTimeout:
            self.st["lost_acks"] += 1
            self.problem(f"{p.kind} op {p.op.op_id}: no ack within 120 s")
            self.busy[p.space].difference_update(p.drows)
            return
        finally:
            self.st["t_ack_wait"] += time.perf_counter() - t
        if not ack.ok:
            self.st["failed_ops"] += 1
            self.problem(f"{p.kind} op {p.op.op_id} failed: {ack.error}")
        elif p.then is not None:
            if self.on_ack is not None:
                self.on_ack(p)
            t = time.perf_counter()
            p.then()
            self.st["t_check"] += time.perf_counter() - t
        self.busy[p.space].difference_update(p.drows)

    def problem(self, msg: str) -> None:
        """Record a problem: the first one per client, and up to ``PROBLEM_LOG`` in its log."""
        line = f"client {self.idx} after {self.st.get('ops', 0)} ops: {msg}"
        if self.st["first_problem"] is None:
            self.st["first_problem"] = line
        log = self.st.setdefault("problem_log", [])
        if len(log) < PROBLEM_LOG:
            log.append(line)

    def _verify(self, checks: list[tuple[str, torch.Tensor, torch.Tensor, list[str], bool]]
                ) -> None:
        """``checks``: (what, got, want, the units along dim 1, whether they count as loaded
        bytes); one host sync for all of them. A differing unit counts as one corrupted."""
        for _, _, want, units, loaded in checks:
            if loaded:
                self.st["verified_bytes"] += want.numel() * want.element_size()
                self.st["verified_pages"] += len(units)
        verdict = differs([(g, w) for _, g, w, _, _ in checks])
        for (what, got, want, units, _), bad in zip(checks, verdict):
            if bad:
                idx = bad_units(got, want)
                self.st["corrupted_pages"] += len(idx)
                self.problem(f"{what}: bytes differ in {len(idx)} of {len(units)} "
                             f"(first: {units[idx[0]] if idx else '?'}"
                             f"{': ' + describe(got, want, idx[0]) if idx else ''})")

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
            got = [int(r) for r in self.c.alloc({space: k})[space]]
            self.shadow.take(space, got)
            held.extend(got)
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
        self.shadow.give_back(space, pick)
        for p in self.layout.space_pools(space):
            self.ready[p.name] -= gone
            for r in pick:
                self.exp[p.name].pop(r, None)
        self.st["frees"] += 1

    def _acked(self, mine: list[tuple[str, int, object]]) -> Callable[[], None]:
        def acked() -> None:  # readable now, unless a later backup (or a free) replaced it
            for p, h, e in mine:
                if self.exp[p].get(h) is e:
                    self.ready[p].add(h)
        return acked

    def backup_rows(self, space: str, k: int) -> None:
        hosts = self.rng.sample(self.held[space], k)
        drows = self._dev(space, k)
        if drows is None:
            return
        salts = [self._salt(d) for d in drows]
        d_t, s_t, slot_t = self._up(drows, salts, self.shadow.slots(space, hosts))
        mine = []
        for spec in self.layout.space_pools(space):
            p = spec.name
            self.shadow.pools[p].w.index_copy_(1, slot_t, self._write(p, d_t, s_t))
            for h in hosts:
                e = self.exp[p][h] = object()
                mine.append((p, h, e))
        self._flush()
        op = self.c.backup({space: (drows, hosts)})
        self.pending.append(Pending(op, "backup", space, drows, self._acked(mine), []))
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
        d_t, slot_t = self._up(drows, self.shadow.slots(space, hosts))
        want = {p: self.shadow.pools[p].w[:, slot_t] for p in pools}
        for p in pools:
            self._scribble(p, d_t)
        self._flush()
        op = self.c.load({space: (hosts, drows)})

        def check() -> None:
            self._verify([(f"load of {p} host rows {hosts[:4]}", self.rows[p].w[:, d_t], want[p],
                            [f"host row {h}" for h in hosts], True) for p in pools])
        self.pending.append(Pending(op, "load", space, drows, check,
                                    [(p, "rows", drows) for p in pools]))
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
        hslots = self.shadow.slots(space, [h // P for h in htoks])
        hpos = [h % P for h in htoks]
        di = [j // P for j in range(len(htoks))]  # index into drows of each device token
        dpos = [j % P for j in range(len(htoks))]
        shadow = self.shadow.pools[pool]
        if backup:
            fresh = sorted({h // P for h in htoks} - set(self.exp[pool]))
            salts = [self._salt(d) for d in drows]
            d_t, s_t, hs_t, hp_t, di_t, dp_t, fr_t = self._up(
                drows, salts, hslots, hpos, di, dpos, self.shadow.slots(space, fresh))
            data = self._write(pool, d_t, s_t)
            if fresh:  # never written since its alloc: the daemon zeroes the row first
                shadow.w.index_fill_(1, fr_t, 0)
            spec = self.layout.pool(pool)
            shadow.put_tokens(hs_t, hp_t, Rows(data.view(torch.uint8), spec).tokens(di_t, dp_t))
            mine = []
            for r in {h // P for h in htoks}:
                e = self.exp[pool][r] = object()
                mine.append((pool, r, e))
            self._flush()
            op = self.c.backup({pool: (dtoks, htoks, "token")})
            self.pending.append(Pending(op, "token backup", space, drows, self._acked(mine), []))
            self.st["backups"] += 1
            return
        d_t, hs_t, hp_t, di_t, dp_t = self._up(drows, hslots, hpos, di, dpos)
        want = shadow.tokens(hs_t, hp_t)
        # the device rows after the load: scribble, but for the loaded tokens
        after = torch.full((shadow.w.shape[0], len(drows), shadow.w.shape[2]), SCRIBBLE,
                           dtype=torch.int64, device=self.dev)
        Rows(after.view(torch.uint8), self.layout.pool(pool)).put_tokens(di_t, dp_t, want)
        self._scribble(pool, d_t)
        self._flush()
        op = self.c.load({pool: (htoks, dtoks, "token")})

        def check() -> None:
            rows = self.rows[pool]
            got = rows.tokens(d_t.index_select(0, di_t), dp_t)
            beside = rows.w[:, d_t]  # a copy; its loaded tokens are checked above, not here
            Rows(beside.view(torch.uint8), self.layout.pool(pool)).put_tokens(di_t, dp_t, want)
            self._verify([(f"token load of {pool} (value and scale)", got, want,
                           [f"host token {h}" for h in htoks], True),
                          (f"token load of {pool}: device bytes beside the loaded tokens",
                           beside, after, [f"device row {d}" for d in drows], False)])
        self.pending.append(Pending(op, "token load", space, drows, check,
                                    [(pool, "tokens", dtoks)]))
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
            sl_t, s_t = self._up(slot, [salt])
            for p in pools:
                self._scribble(p, sl_t)
            self._flush()
            op = self.c.swap_in(row, slot[0], release=True)

            def check() -> None:
                self._verify([(f"swap_in of {p} into slot {slot[0]}", self.rows[p].w[:, sl_t],
                                self.content.rows(p, s_t), [f"host row {row}"], True)
                               for p in pools])
            self.pending.append(Pending(op, "swap_in", "req_slot", slot, check,
                                        [(p, "rows", slot) for p in pools]))
            self.st["swaps"] += 1
            return
        if len(self.swapped) + self.swapping >= MIX_QUOTA["req_slot"]:
            return
        slot = self._dev("req_slot", 1)
        if slot is None:
            return
        salt = self._salt(slot[0])
        sl_t, s_t = self._up(slot, [salt])
        for p in pools:
            self._write(p, sl_t, s_t)
        self._flush()
        self.version += 1
        op = self.c.swap_out(slot[0], request=f"s{self.idx}-{self.version}")
        self.swapping += 1

        def acked() -> None:
            self.swapped.append((op.host_row, salt))
        self.pending.append(Pending(op, "swap_out", "req_slot", slot, acked, []))
        self.st["swaps"] += 1
