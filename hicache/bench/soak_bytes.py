"""Bytes of the ``--mix all`` soak on the pools' own device: row content, expectations, checks.

One code path for both devices (torch on ``cpu`` or ``cuda:N``); nothing here goes through the
host on a GPU except the small id lists of an operation (one pinned upload) and the verdict of
a check (one host sync for all the pools of an operation).

* ``pool_view(layers)`` — a pool's per-layer ``[rows, row_bytes]`` uint8 tensors as one
  ``[layers, rows, row_bytes]`` view. They must be evenly spaced views of one buffer, as
  ``DevicePools`` makes them on both devices (CUDA: one allocation per pool; CPU: 4 KiB-aligned
  regions of one sealed memfd, a pool's layers back to back); anything else is refused.
* ``Rows(u8, spec)`` — such a view with its int64 word view ``w`` ``[L, R, B/8]`` and, for a
  token-granular pool, its per-token views ``val`` ``[L, R, P, value_bytes]`` and ``sc``
  ``[L, R, P, scale_bytes]`` (what a token unit moves: its value and its scale).
* ``Content(layout, seed, device)`` — per pool a random ``base`` ``[L, B/8]`` (int64, on the
  device); the row of salt ``s`` is ``base ^ s``: ``rows(pool, salts)`` makes every layer of
  every row of one write in one XOR.
* ``Shadow(layout, slots, device)`` — what the host rows a client holds must contain, per pool, on
  the device (``Rows`` of ``slots[space]`` rows; ``slot_of`` maps a held host row to its slot).
  A row backup copies the rows it wrote into their slots, a token backup its tokens' value and
  scale (into a zeroed slot when the host row was never written: the daemon zeroes it first). A
  load takes a copy of the slots it expects when it is sent (the daemon orders it after every
  backup sent before it and before every one sent after it).
* ``differs(pairs)`` — for each (got, want) pair whether any byte differs: one host sync for
  all of them on a GPU (``torch.equal`` on the CPU, the fastest there). ``bad_units(got, want)``
  — per unit (dim 1) whether it differs, to name what was wrong once a pair differs;
  ``describe(got, want, unit)`` — where and how one differing unit differs (layers, byte range,
  and whether the bytes found are zeros, the scribble or the wanted bytes of another layer).
"""
from __future__ import annotations

from typing import Any, Sequence

import numpy as np
import torch

SCRIBBLE = 0x5A5A5A5A5A5A5A5A  # what a load's device rows hold before it (as int64 words)


def pool_view(layers: Sequence[torch.Tensor]) -> torch.Tensor:
    """``[L, R, B]`` uint8 view of a pool's layers (see the module docstring)."""
    t0 = layers[0]
    if t0.dim() != 2 or t0.dtype != torch.uint8:
        raise ValueError(f"pool layers must be 2-d uint8 tensors, got {t0.dtype} {tuple(t0.shape)}")
    R, B = t0.shape
    step = layers[1].storage_offset() - t0.storage_offset() if len(layers) > 1 else R * B
    ptr = t0.untyped_storage().data_ptr()
    for i, t in enumerate(layers):
        if (t.shape != t0.shape or t.dtype != t0.dtype or not t.is_contiguous()
                or t.untyped_storage().data_ptr() != ptr
                or t.storage_offset() != t0.storage_offset() + i * step):
            raise ValueError("pool layers are not evenly spaced views of one buffer")
    if step < R * B or B % 8 or t0.storage_offset() % 8 or step % 8:
        raise ValueError(f"pool layers overlap or are not 8-byte aligned (step {step}, row {B})")
    return t0.as_strided((len(layers), R, B), (step, B, 1))


class Rows:
    """A pool's rows as word and token views (see the module docstring)."""

    def __init__(self, u8: torch.Tensor, spec: Any) -> None:
        L, R, B = u8.shape
        s0, s1, _ = u8.stride()
        self.u8 = u8
        self.w = u8.view(torch.int64)
        self.val: torch.Tensor | None = None
        self.sc: torch.Tensor | None = None
        if spec.token_granular:
            P, vb, sb = spec.tokens_per_page, spec.value_bytes, spec.scale_bytes
            self.val = u8.as_strided((L, R, P, vb), (s0, s1, vb, 1))
            if sb:
                self.sc = u8.as_strided((L, R, P, sb), (s0, s1, sb, 1),
                                        u8.storage_offset() + spec.scale_offset)

    def tokens(self, rows: torch.Tensor, pos: torch.Tensor) -> torch.Tensor:
        """Copies of the value and scale of token ``pos[i]`` of row ``rows[i]``, side by side:
        ``[L, k, value_bytes + scale_bytes]``."""
        assert self.val is not None
        if self.sc is None:
            return self.val[:, rows, pos]
        return torch.cat([self.val[:, rows, pos], self.sc[:, rows, pos]], dim=2)

    def put_tokens(self, rows: torch.Tensor, pos: torch.Tensor, parts: torch.Tensor) -> None:
        """Token ``pos[i]`` of row ``rows[i]`` := ``parts`` (as ``tokens`` returns them)."""
        assert self.val is not None
        vb = self.val.shape[3]
        self.val[:, rows, pos] = parts[:, :, :vb]
        if self.sc is not None:
            self.sc[:, rows, pos] = parts[:, :, vb:]


class Content:
    """Row content of a salt per pool: ``base[pool] ^ salt`` (see the module docstring)."""

    def __init__(self, layout: Any, seed: int, device: torch.device) -> None:
        self.base: dict[str, torch.Tensor] = {}
        for i, (name, spec) in enumerate(layout.pools.items()):
            g = np.random.default_rng([seed, i, 77])
            b = g.integers(0, 1 << 63, size=(spec.num_layers, spec.page_bytes // 8),
                           dtype=np.uint64)
            self.base[name] = torch.from_numpy(b.view(np.int64)).to(device)

    def rows(self, pool: str, salts: torch.Tensor) -> torch.Tensor:
        """``[L, n, B/8]`` int64: row ``i`` holds salt ``salts[i]``'s content."""
        b = self.base[pool]
        return b[:, None, :] ^ salts[None, :, None]


class Shadow:
    """The expected bytes of a client's host rows, on the device (see the module docstring)."""

    def __init__(self, layout: Any, slots: dict[str, int], device: torch.device) -> None:
        self.pools: dict[str, Rows] = {}
        for spec in layout.pools.values():
            if spec.index in slots:
                u8 = torch.zeros(spec.num_layers, slots[spec.index], spec.page_bytes,
                                 dtype=torch.uint8, device=device)
                self.pools[spec.name] = Rows(u8, spec)
        self.slot_of: dict[str, dict[int, int]] = {s: {} for s in slots}
        self._free: dict[str, list[int]] = {s: list(range(n - 1, -1, -1)) for s, n in slots.items()}

    def take(self, space: str, host_rows: Sequence[int]) -> None:
        """Give each newly allocated host row a slot."""
        m, free = self.slot_of[space], self._free[space]
        for h in host_rows:
            if h in m:
                raise RuntimeError(f"host row {h} of {space} allocated twice")
            m[h] = free.pop()

    def give_back(self, space: str, host_rows: Sequence[int]) -> None:
        m, free = self.slot_of[space], self._free[space]
        for h in host_rows:
            free.append(m.pop(h))

    def slots(self, space: str, host_rows: Sequence[int]) -> list[int]:
        m = self.slot_of[space]
        return [m[h] for h in host_rows]


def differs(pairs: Sequence[tuple[torch.Tensor, torch.Tensor]]) -> list[bool]:
    """Whether ``got`` differs from ``want`` in any byte, per pair (see the module docstring)."""
    if not pairs:
        return []
    if pairs[0][0].device.type == "cpu":
        return [not torch.equal(g, w) for g, w in pairs]
    return torch.stack([torch.ne(g, w).any() for g, w in pairs]).tolist()


def bad_units(got: torch.Tensor, want: torch.Tensor) -> list[int]:
    """Indices along dim 1 (rows, tokens) where ``got`` and ``want`` differ."""
    ne = torch.ne(got, want).transpose(0, 1).reshape(got.shape[1], -1).any(1)
    return torch.nonzero(ne).flatten().tolist()


def describe(got: torch.Tensor, want: torch.Tensor, unit: int) -> str:
    """One line on how unit ``unit`` (dim 1) of ``got`` differs from ``want``: the layers, the
    differing byte range of the first such layer, and what its bytes look like."""
    g = got[:, unit].contiguous().view(got.shape[0], -1).view(torch.uint8).cpu()
    w = want[:, unit].contiguous().view(want.shape[0], -1).view(torch.uint8).cpu()
    ne = g != w
    layers = torch.nonzero(ne.any(1)).flatten().tolist()
    if not layers:
        return "no difference"
    k = layers[0]
    at = torch.nonzero(ne[k]).flatten()
    a, b = int(at[0]), int(at[-1]) + 1
    seen = g[k, a:b]
    if not bool(seen.any()):
        what = "zeros"
    elif bool((seen.view(-1) == 0x5A).all()):
        what = "the scribble"
    else:
        other = [j for j in range(w.shape[0]) if j != k and torch.equal(w[j, a:b], seen)]
        what = f"the bytes wanted in layer {other[0]}" if other else "other bytes"
    return (f"layers {layers} of {g.shape[0]}; layer {k}: {int(at.numel())} bytes differ in "
            f"[{a}, {b}) of {g.shape[1]}; found {what}")
