"""What one L3 object is: its Mooncake key, its header, and where its bytes lie in the arena.

Contract:

* ``namespace(layout, mirror)`` -> ``"hc1/<model>/<fingerprint>/<mirror>/pp<rank>of<size>"``:
  the layout fingerprint is a digest of the stage's layout (pools, layers, row sizes), so two
  models, two PP stages, two layout versions or two mirror modes never share an object.
* ``object_key(ns, page_key)``: the engine's chained prefix key of one page (1..128 characters
  of ``[A-Za-z0-9_.:-]``, checked by ``check_page_key``) under the namespace.
* ``PageFormat(layout, group)``: the page-indexed spaces of the stage (``page``, plus
  ``swa_page`` in paged SWA mode); ``pieces(rows)`` gives the (address, size) list of one page
  (every pool of every space, layer by layer, straight from the host arena: zero copy);
  ``checksum(rows)``: per pool and layer the 64-bit wrap-around sum of the page's 8-byte
  words, times an odd multiplier that depends on the position, all summed (a change of any
  single word, and so any bit flip, always changes it; truncation is caught by the length); ``payload_bytes`` is the object's size without its header.
* ``pack_header(buf, key, payload_bytes, checksum)`` writes a ``HEADER_BYTES`` header (magic,
  format version, payload length, checksum, key digest) into ``buf``; ``check_header`` returns
  ``None`` when a read header matches what the reader expects, else the reason. A mismatch is a
  miss, never data handed to the engine.
"""
from __future__ import annotations

import hashlib
import json
import re
import struct
from typing import Any, Sequence

import numpy as np

from hicache.core.layout import Layout

FORMAT_VERSION = 1
MAGIC = b"HCL3"
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHQQ16s")  # magic, version, reserved, payload, checksum, key digest
PAGE_SPACES = ("page", "swa_page")  # index spaces addressed by a radix page (req_slot is not)
MIRRORS = ("full", "checkpoint")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_MIX = np.uint64(0x9E3779B97F4A7C15)


def layout_fingerprint(layout: Layout) -> str:
    d = layout.to_dict()
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def namespace(layout: Layout, mirror: str = "full") -> str:
    if mirror not in MIRRORS:
        raise ValueError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", layout.model.name)[:48]
    st = layout.stage
    return f"hc{FORMAT_VERSION}/{name}/{layout_fingerprint(layout)}/{mirror}/" \
           f"pp{st.pp_rank}of{st.pp_size}"


def check_page_key(k: Any) -> str | None:
    """None when ``k`` is a usable page key, else why not."""
    if not isinstance(k, str) or not _KEY_RE.match(k):
        return f"page key {str(k)[:40]!r} must be 1..128 characters of [A-Za-z0-9_.:-]"
    return None


def object_key(ns: str, page_key: str) -> str:
    return f"{ns}/{page_key}"


def key_digest(key: str) -> bytes:
    return hashlib.blake2b(key.encode(), digest_size=16).digest()


def pack_header(buf: memoryview, key: str, payload_bytes: int, checksum: int) -> None:
    _HEADER.pack_into(buf, 0, MAGIC, FORMAT_VERSION, 0, payload_bytes, checksum, key_digest(key))


def check_header(buf: memoryview, key: str, payload_bytes: int) -> str | None:
    """None when the header says: our format, this key, this length; else the mismatch."""
    magic, ver, _, n, _, digest = _HEADER.unpack_from(buf, 0)
    if magic != MAGIC:
        return "not a hicache object"
    if ver != FORMAT_VERSION:
        return f"format version {ver}, reader speaks {FORMAT_VERSION}"
    if digest != key_digest(key):
        return "header names another key"
    if n != payload_bytes:
        return f"payload of {n} bytes, layout needs {payload_bytes}"
    return None


def header_checksum(buf: memoryview) -> int:
    return _HEADER.unpack_from(buf, 0)[4]


class PageFormat:
    """Where the bytes of one page lie in the host arena, and their checksum."""

    def __init__(self, layout: Layout, group: Any) -> None:
        self.spaces = tuple(s for s in PAGE_SPACES if layout.space_pools(s))
        self.pools = [(s, group.pools[p.name]) for s in self.spaces for p in layout.space_pools(s)]
        base = group.arena.ptr
        self.payload_bytes = 0
        self.page_tokens = max((p.spec.tokens_per_page for _, p in self.pools), default=0) or 256
        self._views: list[tuple[str, int, int, int, np.ndarray]] = []
        arena_np = np.frombuffer(_arena_buffer(group.arena), dtype=np.uint8)
        for space, pool in self.pools:
            spec = pool.spec
            self.payload_bytes += spec.page_bytes * spec.num_layers
            if spec.page_bytes % 8:
                raise ValueError(f"pool {spec.name}: page of {spec.page_bytes} B is not a "
                                 f"multiple of 8 bytes")
            start = base + pool.offset
            words = np.lib.stride_tricks.as_strided(
                arena_np[pool.offset:].view(np.uint64),
                shape=(spec.num_layers, pool.num_rows, spec.page_bytes // 8),
                strides=(pool.stride, spec.page_bytes, 8), writeable=False)
            self._views.append((space, start, pool.stride, spec.page_bytes, words))

    def pieces(self, rows: dict[str, int]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of one page whose row in each space is ``rows[space]``."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for space, start, stride, pb, words in self._views:
            a = start + rows[space] * pb
            n = words.shape[0]
            ptrs.extend(range(a, a + n * stride, stride))
            sizes.extend([pb] * n)
        return ptrs, sizes

    def checksum(self, rows: dict[str, int]) -> int:
        total = np.uint64(0)
        with np.errstate(over="ignore"):
            for i, (space, _, _, _, words) in enumerate(self._views):
                v = words[:, rows[space], :]
                s = v.sum(axis=1, dtype=np.uint64)  # one sum per layer
                # odd multipliers: a bijection mod 2^64, so no change in a layer's sum is lost
                k = (np.arange(1, s.size + 1, dtype=np.uint64) * _MIX + np.uint64(2 * i)) | \
                    np.uint64(1)
                total = total + (s * k).sum(dtype=np.uint64)
        return int(total)


def _arena_buffer(arena: Any) -> Any:
    """The whole arena as a writable uint8 buffer (a torch tensor's memory through numpy)."""
    return arena.tensor(0, arena.nbytes).numpy()


def rows_of(spaces: Sequence[str], arrays: dict[str, Sequence[int]], i: int) -> dict[str, int]:
    return {s: int(arrays[s][i]) for s in spaces}
