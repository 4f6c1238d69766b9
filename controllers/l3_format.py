"""What one L3 object is: its Mooncake key, its header, and where its bytes lie in the arena.

Contract:

* Three kinds of object (``KINDS``): ``full`` (a full-mirror page: every pool of every page
  space, ``page`` plus ``swa_page`` in paged SWA mode), ``page`` (a checkpoints-mirror page: the
  ``page`` space's compressed rows) and ``ckpt`` (a resume checkpoint, DESIGN §15: the SWA tail
  tokens of ``swa_kv`` plus the C4 / C4-indexer state rows, in one row of the checkpoint space,
  ``swa_page`` in paged SWA mode or ``req_slot`` in ring mode). ``kind_of(mirror, ckpt)`` maps
  the command's fields to a kind, or raises ``ValueError`` with the reason.
* ``namespace(layout, scope, mirror)`` -> ``"hc2/<model>/<fingerprint>/w-<digest of
  scope>/<mirror>/pp<rank>of<size>"``: the layout fingerprint is a digest of the stage's layout
  (pools, layers, row sizes, SWA mode), so two architectures, two PP stages, two layout versions or
  two mirror modes never share an object; the layout says nothing of the weights, so ``scope``
  (``--l3-scope``, the served weights' name and revision, required with L3) does: two scopes never
  share an object, and one scope is the operator's word that its daemons serve the same weights.
  ``object_key(ns, page_key, kind)``: the engine's chained prefix key of one page (1..128 characters
  of ``[A-Za-z0-9_.:-]``, checked by ``check_page_key``) under the namespace; a checkpoint lives
  beside its page under ``<ns>/ck/<page key>`` (a page key holds no ``/``, so the two never
  collide). ``tenant``: the client's CURVE key (its public key, ``DaemonState.tenant``), whose
  objects go under ``<ns>/t-<digest of it>/...``: under CURVE, a client key never reads nor writes
  another key's page objects through the daemon (equal prefixes are then stored once per key;
  without CURVE, every client of the daemon shares them).
* ``ObjectFormat``: the byte ranges (``Segment``: pool, offset in the row, length) one object holds
  of one row per space. ``pieces(rows)`` gives its (address, size) list, layer by layer, straight
  from the host arena (zero copy); ``checksum(rows)``: per segment and layer the 64-bit wrap-around
  sum of its 8-byte words each times an odd multiplier of its place in the layer, times an odd
  multiplier of the layer and segment, all summed (a change of any single word, and so any bit flip,
  always changes it; words moved within a layer change it unless their weights happen to collide;
  truncation is caught by the length); ``payload_bytes`` is the object's size without its header,
  ``obj_bytes`` with it. ``page_format(layout, group, spaces)`` and ``ckpt_format(layout, group)``
  build the two shapes; ``Objects(layout, group, scope)`` holds every kind this stage can store,
  with its namespace.
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
from dataclasses import dataclass
from typing import Any, Sequence

import numpy as np

from hicache.core.layout import Layout, LayoutError
from hicache.core.resume import MIRRORS, ResumeModel

FORMAT_VERSION = 2  # 2: words weighted by their place in a layer (1 summed them)
MAGIC = b"HCL3"
HEADER_BYTES = 64
_HEADER = struct.Struct("<4sHHQQ16s")  # magic, version, reserved, payload, checksum, key digest
PAGE_SPACES = ("page", "swa_page")  # index spaces addressed by a radix page (req_slot is not)
KINDS = ("full", "page", "ckpt")
_KEY_RE = re.compile(r"^[A-Za-z0-9_.:\-]{1,128}$")
_MIX = np.uint64(0x9E3779B97F4A7C15)
_MIX2 = np.uint64(0xD6E8FEB86659FD93)


def layout_fingerprint(layout: Layout) -> str:
    d = layout.to_dict()
    blob = json.dumps(d, sort_keys=True, separators=(",", ":")).encode()
    return hashlib.blake2b(blob, digest_size=8).hexdigest()


def namespace(layout: Layout, scope: str, mirror: str = "full") -> str:
    if mirror not in MIRRORS:
        raise ValueError(f"mirror must be one of {MIRRORS}, got {mirror!r}")
    if not scope:
        raise ValueError("an L3 namespace needs the served weights' scope")
    name = re.sub(r"[^A-Za-z0-9_.\-]", "_", layout.model.name)[:48]
    weights = hashlib.blake2b(scope.encode(), digest_size=8).hexdigest()
    st = layout.stage
    return f"hc{FORMAT_VERSION}/{name}/{layout_fingerprint(layout)}/w-{weights}/{mirror}/" \
           f"pp{st.pp_rank}of{st.pp_size}"


def kind_of(mirror: str, ckpt: bool) -> str:
    """The object kind a command names with ``mirror`` and ``ckpt`` (ValueError: why not)."""
    if mirror not in MIRRORS:
        raise ValueError(f"mirror must be one of {list(MIRRORS)}, got {str(mirror)[:40]!r}")
    if mirror == "full":
        if ckpt:
            raise ValueError("ckpt applies to mirror 'checkpoints' (a full mirror's pages "
                             "carry their own SWA rows and states)")
        return "full"
    return "ckpt" if ckpt else "page"


def check_page_key(k: Any) -> str | None:
    """None when ``k`` is a usable page key, else why not."""
    if not isinstance(k, str) or not _KEY_RE.fullmatch(k):  # ($ alone lets a final "\n" by)
        return f"page key {str(k)[:40]!r} must be 1..128 characters of [A-Za-z0-9_.:-]"
    return None


def object_key(ns: str, page_key: str, kind: str = "full", tenant: str | None = None) -> str:
    if tenant is not None:  # a CURVE client key's own objects (see the module docstring)
        ns = f"{ns}/t-{hashlib.blake2b(tenant.encode(), digest_size=8).hexdigest()}"
    return f"{ns}/ck/{page_key}" if kind == "ckpt" else f"{ns}/{page_key}"


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


@dataclass(frozen=True)
class Segment:
    """Bytes ``[offset, offset + length)`` of every layer's row of ``pool`` (space ``space``)."""

    space: str
    pool: str
    offset: int
    length: int


class ObjectFormat:
    """Where the bytes of one object lie in the host arena, and their checksum."""

    def __init__(self, kind: str, group: Any, segments: Sequence[Segment]) -> None:
        if not segments:
            raise ValueError(f"{kind} objects: this stage has no pool to store in them")
        self.kind = kind
        self.segments = tuple(segments)
        self.spaces = tuple(dict.fromkeys(s.space for s in segments))
        base = group.arena.ptr
        arena_np = np.frombuffer(_arena_buffer(group.arena), dtype=np.uint8)
        self.payload_bytes = 0
        self.page_tokens = 0  # tokens one object stands for (pages; 0 for checkpoints)
        self._row: list[int] = []
        self._views: list[tuple[str, int, int, int, np.ndarray]] = []
        self._weights: list[np.ndarray] = []
        for seg in segments:
            pool = group.pools[seg.pool]
            spec = pool.spec
            if seg.offset % 8 or seg.length % 8 or spec.page_bytes % 8:
                raise ValueError(f"pool {spec.name}: bytes {seg.offset}+{seg.length} of a "
                                 f"{spec.page_bytes} B row are not 8-byte aligned")
            self._row.append(spec.page_bytes)
            self.payload_bytes += seg.length * spec.num_layers
            at = pool.offset + seg.offset
            words = np.lib.stride_tricks.as_strided(
                arena_np[at:].view(np.uint64),
                shape=(spec.num_layers, pool.num_rows, seg.length // 8),
                strides=(pool.stride, spec.page_bytes, 8), writeable=False)
            self._views.append((seg.space, base + at, pool.stride, spec.page_bytes, words))
            # odd weight per word of a layer: a word moved within the layer changes the sum
            self._weights.append((np.arange(seg.length // 8, dtype=np.uint64) * _MIX2
                                  + _MIX) | np.uint64(1))
        self.obj_bytes = HEADER_BYTES + self.payload_bytes
        self.pieces_per_object = sum(w.shape[0] for *_, w in self._views)

    def pools(self) -> dict[str, dict[str, bool]]:
        """Per space, the pools an object covers: name -> True when it holds only part of a
        row (the rest of a freshly filled row must be zeroed)."""
        out: dict[str, dict[str, bool]] = {}
        for seg, row in zip(self.segments, self._row):
            covered = sum(s.length for s in self.segments if s.pool == seg.pool)
            out.setdefault(seg.space, {})[seg.pool] = covered != row
        return out

    def pieces(self, rows: dict[str, int]) -> tuple[list[int], list[int]]:
        """(addresses, sizes) of one object whose row in each space is ``rows[space]``."""
        ptrs: list[int] = []
        sizes: list[int] = []
        for (space, start, stride, pb, words), seg in zip(self._views, self.segments):
            a = start + rows[space] * pb
            n = words.shape[0]
            ptrs.extend(range(a, a + n * stride, stride))
            sizes.extend([seg.length] * n)
        return ptrs, sizes

    def checksum(self, rows: dict[str, int]) -> int:
        total = np.uint64(0)
        with np.errstate(over="ignore"):
            for i, ((space, _, _, _, words), w) in enumerate(zip(self._views, self._weights)):
                v = words[:, rows[space], :]
                s = np.dot(v, w)  # one weighted sum per layer (wraps mod 2^64, ~2x a sum)
                # odd multipliers: a bijection mod 2^64, so no change in a layer's sum is lost
                k = (np.arange(1, s.size + 1, dtype=np.uint64) * _MIX + np.uint64(2 * i)) | \
                    np.uint64(1)
                total = total + (s * k).sum(dtype=np.uint64)
        return int(total)


def page_format(layout: Layout, group: Any, spaces: Sequence[str],
                kind: str = "full") -> ObjectFormat:
    """Whole rows of every pool of ``spaces`` (a full-mirror or a checkpoints-mirror page)."""
    segs = [Segment(s, p.name, 0, p.page_bytes) for s in spaces for p in layout.space_pools(s)]
    fmt = ObjectFormat(kind, group, segs)
    fmt.page_tokens = layout.model.page_size
    return fmt


def ckpt_format(layout: Layout, group: Any) -> ObjectFormat:
    """A resume checkpoint: the SWA tail tokens (value and scale ranges) and the whole C4 /
    C4-indexer state rows, in one row of the checkpoint space (``hicache.core.resume``)."""
    r = ResumeModel(layout)  # LayoutError when a boundary would need more (C128 state)
    space = r.checkpoint_space
    segs: list[Segment] = []
    if r.swa_pool is not None:
        p = r.swa_pool
        pos = sorted(set(r.tail_offsets if space == "swa_page" else r.ring_positions(1)))
        a, b = pos[0], pos[-1] + 1
        if b - a != len(pos):
            raise ValueError(f"the SWA tail of {p.name} is not one token range")
        segs.append(Segment(space, p.name, a * p.value_bytes, (b - a) * p.value_bytes))
        if p.scale_bytes:
            segs.append(Segment(space, p.name, p.scale_offset + a * p.scale_bytes,
                                (b - a) * p.scale_bytes))
    segs += [Segment(space, p.name, 0, p.page_bytes) for p in r.state_pools]
    return ObjectFormat("ckpt", group, segs)


class Objects:
    """Every object kind this stage can store (``formats``), why the others cannot be
    (``refused``), and the namespace of each mirror."""

    def __init__(self, layout: Layout, group: Any, scope: str) -> None:
        self.formats: dict[str, ObjectFormat] = {}
        self.refused: dict[str, str] = {}
        spaces = [s for s in PAGE_SPACES if layout.space_pools(s)]
        builders = {
            "full": lambda: page_format(layout, group, spaces, "full") if
            layout.swa_mode == "paged" else _refuse("a full mirror needs paged SWA (in ring "
                                                    "mode a page has no SWA rows)"),
            "page": lambda: page_format(layout, group, ["page"], "page"),
            "ckpt": lambda: ckpt_format(layout, group),
        }
        for kind, build in builders.items():
            try:
                self.formats[kind] = build()
            except (ValueError, LayoutError) as e:
                self.refused[kind] = str(e)
        self.ns = {m: namespace(layout, scope, m) for m in MIRRORS}

    def get(self, kind: str) -> ObjectFormat:
        if kind not in self.formats:
            raise ValueError(f"{kind} objects cannot be stored for this stage: "
                             f"{self.refused.get(kind, 'unknown kind')}")
        return self.formats[kind]

    def key(self, page_key: str, kind: str, tenant: str | None = None) -> str:
        return object_key(self.ns["full" if kind == "full" else "checkpoints"], page_key, kind,
                          tenant)

    def describe(self) -> str:
        return ", ".join(f"{k} {f.obj_bytes:,} B" for k, f in self.formats.items())


def _refuse(why: str) -> ObjectFormat:
    raise ValueError(why)


def _arena_buffer(arena: Any) -> Any:
    """The whole arena as a writable uint8 buffer (a torch tensor's memory through numpy)."""
    return arena.tensor(0, arena.nbytes).numpy()
