"""Deterministic content of a page row per (content id, pool, layer), to verify every byte.

Row content is ``base[pool, layer] XOR salt(id, pool, layer)``: ``base`` is a seeded random
row of words (so a row copied to a shifted offset, or a page of another pool or layer, does not
match), ``salt`` is one mixed word per row (so a row of another page does not match). Filling
and checking ``n`` rows is one broadcast op over ``[n, words]``, on whatever device the
buffer lives, never a Python loop over bytes. Words are 8 bytes when the row length allows
(4, 2 or 1 otherwise).

* ``fill(pool, layer, buf, rows, ids)`` writes rows ``rows`` of one per-layer buffer.
* ``mismatches(pool, layer, buf, rows, ids)`` counts the bytes that differ from the expected
  content (0 when everything matches).
* ``fill_tokens`` / ``token_mismatches`` do the same for some tokens of a token-format row
  (value and scale bytes of each): token ``src[i]`` of page ``id``'s content at token position
  ``dst[i]`` of the row (the SWA tail of a checkpoint: the same offsets in a page row, ring
  positions ``pos % window`` in a request slot's row).
"""
from __future__ import annotations

import torch

from hicache.core.layout import Layout

_WORD = {8: torch.int64, 4: torch.int32, 2: torch.int16, 1: torch.uint8}
_M1 = -7046029254386353131  # 0x9E3779B97F4A7C15 as int64
_M2 = -4658895280553007687  # 0xBF58476D1CE4E5B9 as int64
_M3 = -7723592293110705685  # 0x94D049BB133111EB as int64


def _word_bytes(row_bytes: int) -> int:
    for w in (8, 4, 2, 1):
        if row_bytes % w == 0:
            return w
    return 1


def _mix(x: torch.Tensor) -> torch.Tensor:
    """splitmix64-style finaliser on int64 (wrapping arithmetic, arithmetic shifts)."""
    x = x * _M2
    x = x ^ (x >> 29)
    x = x * _M3
    return x ^ (x >> 32)


class PageContent:
    """Expected bytes of every page row of a layout (see the module docstring)."""

    def __init__(self, layout: Layout, seed: int = 0) -> None:
        self.layout = layout
        self.seed = seed
        self._pool_index = {name: i for i, name in enumerate(sorted(layout.pools))}
        self._base: dict[tuple[str, int, str], torch.Tensor] = {}

    def _key(self, pool: str, layer: int) -> int:
        return self._pool_index[pool] * 4096 + layer

    def base(self, pool: str, layer: int, device: torch.device) -> torch.Tensor:
        """The seeded base row (``[words]`` of the word dtype) of one pool and layer."""
        k = (pool, layer, str(device))
        t = self._base.get(k)
        if t is None:
            row_bytes = self.layout.pool(pool).page_bytes
            w = _word_bytes(row_bytes)
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + self._key(pool, layer))
            raw = torch.randint(0, 256, (row_bytes,), dtype=torch.uint8, generator=g)
            t = raw.view(_WORD[w]).to(device)
            self._base[k] = t
        return t

    def salt(self, pool: str, layer: int, ids: torch.Tensor) -> torch.Tensor:
        """One int64 per id: the word XORed into every word of that row."""
        c = ((self._key(pool, layer) + 1) * _M2 + self.seed) & (2**64 - 1)
        c = c - 2**64 if c >= 2**63 else c  # the same wrap as int64 arithmetic
        return _mix(ids.to(torch.int64) * _M1 + c)

    def expected(self, pool: str, layer: int, ids: torch.Tensor,
                 device: torch.device | str = "cpu") -> torch.Tensor:
        """``[len(ids), words]`` expected rows in the word dtype."""
        device = torch.device(device)
        base = self.base(pool, layer, device)
        salt = self.salt(pool, layer, ids.to(device)).to(base.dtype)
        return base.unsqueeze(0) ^ salt.unsqueeze(1)

    def _words(self, buf: torch.Tensor) -> torch.Tensor:
        return buf.view(_WORD[_word_bytes(buf.shape[1])])

    def fill(self, pool: str, layer: int, buf: torch.Tensor, rows: torch.Tensor,
             ids: torch.Tensor) -> None:
        """Write the content of pages ``ids`` into rows ``rows`` of ``buf`` ([rows, bytes])."""
        if len(rows) == 0:
            return
        rows = rows.to(buf.device)
        self._words(buf).index_copy_(0, rows, self.expected(pool, layer, ids, buf.device))

    def mismatches(self, pool: str, layer: int, buf: torch.Tensor, rows: torch.Tensor,
                   ids: torch.Tensor) -> int:
        """Bytes of rows ``rows`` of ``buf`` that differ from the content of pages ``ids``."""
        if len(rows) == 0:
            return 0
        rows = rows.to(buf.device)
        got = self._words(buf).index_select(0, rows)
        want = self.expected(pool, layer, ids, buf.device)
        if torch.equal(got, want):
            return 0
        return int((got.view(torch.uint8) != want.view(torch.uint8)).sum().item())

    def _token_bytes(self, pool: str, tokens: list[int], device: torch.device) -> torch.Tensor:
        """Byte offsets of the values and scales of ``tokens`` in a row of ``pool``."""
        spec = self.layout.pool(pool)
        if not spec.token_granular:
            raise ValueError(f"pool {pool} has no token format")
        t = torch.tensor(tokens, dtype=torch.int64)
        val = (t * spec.value_bytes).unsqueeze(1) + torch.arange(spec.value_bytes)
        sc = (spec.scale_offset + t * spec.scale_bytes).unsqueeze(1) + torch.arange(spec.scale_bytes)
        return torch.cat([val.reshape(-1), sc.reshape(-1)]).to(device)

    def _token_pair(self, pool: str, layer: int, buf: torch.Tensor, rows: torch.Tensor,
                    ids: torch.Tensor, src: list[int], dst: list[int]
                    ) -> tuple[tuple[torch.Tensor, torch.Tensor], torch.Tensor]:
        if len(src) != len(dst):
            raise ValueError(f"{len(src)} source tokens but {len(dst)} destination tokens")
        s_idx = self._token_bytes(pool, src, buf.device)
        d_idx = self._token_bytes(pool, dst, buf.device)
        want = self.expected(pool, layer, ids, buf.device).view(torch.uint8)[:, s_idx]
        return (rows.to(buf.device).unsqueeze(1), d_idx.unsqueeze(0)), want

    def fill_tokens(self, pool: str, layer: int, buf: torch.Tensor, rows: torch.Tensor,
                    ids: torch.Tensor, src: list[int], dst: list[int]) -> None:
        """Write tokens ``src`` of pages ``ids`` at token positions ``dst`` of rows ``rows``."""
        where, want = self._token_pair(pool, layer, buf, rows, ids, src, dst)
        buf.view(torch.uint8)[where] = want

    def token_mismatches(self, pool: str, layer: int, buf: torch.Tensor, rows: torch.Tensor,
                         ids: torch.Tensor, src: list[int], dst: list[int]) -> int:
        """Bytes of tokens ``dst`` of rows ``rows`` that differ from tokens ``src`` of ``ids``."""
        where, want = self._token_pair(pool, layer, buf, rows, ids, src, dst)
        return int((buf.view(torch.uint8)[where] != want).sum().item())

