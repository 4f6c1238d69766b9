"""The daemon's key store: pages of engine host pools kept in daemon host rows, by page key.

An engine (SGLang's ``dynamic`` storage backend, ``hicache.engine.sglang.storage``) attaches
its shared-memory host pools (``kv_attach`` + ``kv_verify``, see ``kv_regions``), then moves
pages by key: ``kv_put`` copies engine pages into daemon host rows, ``kv_get`` copies them back,
``kv_exists`` says which keys are held. Only keys and page indices cross the socket.

* An entry is ``(namespace, key)`` in one index space: one host row of that space, holding the
  page of every pool of the space that was put under the key (``Entry.slots``). The namespace
  is the client's (model, parallel rank, ...) prefixed with its CURVE key name, so a client
  reads only what was stored under its own namespace (without CURVE the prefix is empty: clients
  naming the same namespace share it); entries outlive the client that stored
  them (an engine restart finds them).
* Store rows belong to ``OWNER``, whose id starts with a zero byte: no client's id does
  (``registry.client_id``), so no client can free, load or overwrite them through the row
  commands.
* Room: a put takes free rows, evicting the least recently used entries of the space (never the
  call's own keys); keys that do not fit report 0. A call's keys are marked used in reverse
  (``touch``): an engine's batch is a prefix chain, whose head is evicted last. A client ``alloc``
  that finds no free rows evicts store entries first (``make_room_for``, called by
  ``DaemonState.alloc_rows``).
* Every check passes before a row is allocated or a byte moves; a refusal is one line.
  Copies run inline on the server thread (host memory to host memory).
* With an L3 tier (``--l3 mooncake``), ``kv_l3.KvL3`` sits behind the store: a put writes
  what it stored through to L3 (rows pinned, never evicted, until that write ends), and a
  ``kv_get`` / ``kv_exists`` of a key the host rows lack asks L3 asynchronously and answers it
  *pending* (``pending``: positions in ``keys``; their ``found`` / ``present`` is 0) until the
  answer is in; the client asks again (``kv_client``, bounded wait). ``kv_clear`` then
  answers in an op's ack, once the namespace's new epoch is in L3 (its old objects unreachable
  from then on, for every daemon on the store) or with an error saying why it could not be
  written; its host entries are dropped only then. Without L3, ``pending`` is always empty
  and ``kv_clear`` drops the entries and answers at once.
"""
from __future__ import annotations

import itertools
import secrets
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import Any, Mapping, Sequence

import numpy as np
import torch

from hicache.core.id_sets import has_duplicates
from hicache.core.protocol import MAX_KV_KEY_LEN, MAX_KV_NS_LEN, ProtocolError

from .copy_commands import Reply
from .kv_l3 import KvL3
from .kv_regions import MAX_POOLS_PER_CLIENT, ClientPools, EnginePool, file_budget
from .l3_handlers import deadline_ms
from .ops import Ids
from .registry import ClientState
from .state import DaemonState

OWNER = ("\x00kvstore", None)


@dataclass(eq=False)
class Entry:
    """One stored key: its host row and the pools (slots) of the space written into it."""

    row: int
    slots: set[str] = field(default_factory=set)
    pins: int = 0  # L3 writes reading the row now: never evicted while > 0


class KeyStore:
    """Entries per index space, least recently used first."""

    owner_id = OWNER[0]
    owner = OWNER

    def __init__(self, st: DaemonState) -> None:
        self.st = st
        self.entries: dict[str, OrderedDict[tuple[str, str], Entry]] = {
            s: OrderedDict() for s in st.host_rows}
        self.evicted = 0
        self.l3 = KvL3(st, self) if st.l3 is not None else None

    @staticmethod
    def new_entry(row: int, slot: str) -> Entry:
        return Entry(int(row), {slot})

    def rows_held(self, space: str) -> int:
        return len(self.entries[space])

    def summary(self) -> dict[str, Any]:
        out: dict[str, Any] = {"entries": {s: len(e) for s, e in self.entries.items()},
                               "evicted": self.evicted}
        if self.l3 is not None:
            out["l3"] = self.l3.summary()
        return out

    def _evict(self, space: str, n: int, keep: set[tuple[str, str]] = frozenset()) -> int:
        """Evict up to ``n`` unpinned entries of ``space`` (none of ``keep``), least recently
        used first. The walk stops at the ``n``-th: it used to copy the whole table first,
        so every put into a full store cost time in proportion to the store (15 ms a
        128-key put at 50,000 rows, against 0.7 ms into an empty one)."""
        od = self.entries[space]
        victims = []
        for k, e in od.items():  # (popped after the walk: no change while iterating)
            if len(victims) >= n:
                break
            if k not in keep and not e.pins:
                victims.append(k)
        rows = [od.pop(k).row for k in victims]
        if rows:
            self.st.group.free({space: np.asarray(rows, dtype=np.int64)}, OWNER)
            self.evicted += len(rows)
        return len(rows)

    def make_room_for(self, counts: Mapping[str, int]) -> bool:
        """Evict entries so that ``counts`` rows are free in each space; False (nothing
        evicted) when even evicting every entry would not be enough."""
        short = {}
        for s, n in counts.items():
            a = self.st.group.allocators.get(s)
            if a is None or s not in self.entries:
                return False
            need = int(n) - a.free_rows
            if need > 0:
                unpinned = (e for e in self.entries[s].values() if not e.pins)
                if sum(1 for _ in itertools.islice(unpinned, need)) < need:  # (counts to need)
                    return False
                short[s] = need
        for s, need in short.items():
            self._evict(s, need)
        return bool(short)

    def put(self, ep: EnginePool, keys: list[str], pages: np.ndarray) -> list[int]:
        od, space = self.entries[ep.space], ep.space
        ids = [(ep.ns, k) for k in keys]
        new = list(dict.fromkeys(i for i in ids if i not in od))
        if new:
            rows = self.take_rows(space, len(new), set(ids))
            for i, r in zip(new, rows):
                od[i] = Entry(int(r))
        src, dst, fresh = [], [], []
        self.touch(space, ids)
        for j, i in enumerate(ids):
            e = od.get(i)
            if e is None:
                continue
            if ep.slot not in e.slots:
                e.slots.add(ep.slot)
                fresh.append((i[1], e))
                src.append(int(pages[j]))
                dst.append(e.row)
        if ep.pool is not None and src:
            _copy(ep.layers, self.st.group.pools[ep.pool].layers, src, dst, to_engine=False)
        if self.l3 is not None:
            self.l3.write(ep, fresh)
        return [int(i in od and ep.slot in od[i].slots) for i in ids]

    def touch(self, space: str, ids: list[tuple[str, str]]) -> None:
        """Mark the entries of ``ids`` used, the first one last: an engine's batch is a prefix
        chain in order, and its hits count from the chain's start, so its first page must be
        evicted last (marked in order, the head went first, and a whole chain of pages the
        store still held became unreachable; SGLang storage review)."""
        od = self.entries[space]
        for i in reversed(ids):
            if i in od:
                od.move_to_end(i)

    def take_rows(self, space: str, n: int, keep: set[tuple[str, str]]) -> list[int]:
        """Up to ``n`` free rows of ``space`` for the store, evicting unpinned entries (least
        recently used first, none of ``keep``) as needed. The caller records every row it gets
        (as an entry, or in the read it starts)."""
        alloc = self.st.group.allocators[space]
        if alloc.free_rows < n:
            self._evict(space, n - alloc.free_rows, keep=keep)
        take = min(n, alloc.free_rows)
        return self.st.group.alloc({space: take}, OWNER)[space].tolist() if take else []

    def get(self, ep: EnginePool, keys: list[str], pages: np.ndarray) -> tuple[list[int],
                                                                               list[int]]:
        """(found 1/0 per key, positions pending in L3)."""
        od = self.entries[ep.space]
        found, src, dst, missing = [], [], [], []
        for j, k in enumerate(keys):
            e = od.get((ep.ns, k))
            hit = e is not None and ep.slot in e.slots
            found.append(int(hit))
            if hit:
                src.append(e.row)
                dst.append(int(pages[j]))
            else:
                missing.append((j, k))
        self.touch(ep.space, [(ep.ns, k) for k, hit in zip(keys, found) if hit])
        if ep.pool is not None and src:
            _copy(ep.layers, self.st.group.pools[ep.pool].layers, dst, src, to_engine=True)
        if self.l3 is None:
            return found, []
        if not missing:
            self.l3.touch(ep.ns)
            return found, []
        return found, self.l3.fetch(ep, missing, {(ep.ns, k) for k in keys})

    def exists(self, ep: EnginePool, keys: list[str]) -> tuple[list[int], list[int]]:
        """(present 1/0 per key, positions pending in L3)."""
        od = self.entries[ep.space]
        present = [int((e := od.get((ep.ns, k))) is not None and ep.slot in e.slots)
                   for k in keys]
        missing = [(j, k) for j, k in enumerate(keys) if not present[j]]
        if self.l3 is None:
            return present, []
        if not missing:
            self.l3.touch(ep.ns)
            return present, []
        there, pending = self.l3.exists(ep, missing)
        for j in there:
            present[j] = 1
        return present, pending

    def drop(self, ns: str) -> int:
        """Drop every entry of ``ns`` (a row an L3 write still reads is freed when it ends);
        how many."""
        n = 0
        for space, od in self.entries.items():
            rows = [od.pop(k).row for k in [k for k in od if k[0] == ns]]
            if rows:
                self.st.free_rows({space: np.asarray(rows, dtype=np.int64)}, OWNER)
                n += len(rows)
        return n


def _copy(engine: list[torch.Tensor], ours: list[torch.Tensor], pages: list[int],
          rows: list[int], *, to_engine: bool) -> None:
    """Page ``pages[i]`` of every engine layer <-> row ``rows[i]`` of the same daemon layer:
    one numpy row copy per page and layer (torch's ``index_select`` / ``index_copy_`` over
    uint8 rows moved 0.5-0.9 GB/s on the 2-core VM, row copies 3-8 GB/s, and the loop reads
    no other command while a put or get copies)."""
    for e, o in zip(engine, ours):
        en, on = e.numpy(), o.numpy()
        if to_engine:
            for p, r in zip(pages, rows):
                en[p] = on[r]
        else:
            for p, r in zip(pages, rows):
                on[r] = en[p]


# ------------------------------------------------------------------------------- handlers
def store_of(st: DaemonState) -> KeyStore:
    if st.kv_store is None:
        st.kv_store = KeyStore(st)
    return st.kv_store


def _ns(st: DaemonState, c: ClientState, ns: str) -> str:
    """The store's namespace: the client's CURVE key (``DaemonState.tenant``) and its own."""
    if not 0 < len(ns) <= MAX_KV_NS_LEN or not ns.isprintable():
        raise ProtocolError("bad_field", f"namespace must be 1..{MAX_KV_NS_LEN} printable "
                                         f"characters")
    return f"{st.tenant(c) or ''}\x1f{ns}"


def _attached(c: ClientState, name: str, copies: bool = True) -> EnginePool:
    """The client's verified pool ``name``; with ``copies`` (a command that moves its pages)
    also refused when one of its files was cut (``EnginePool.damaged``)."""
    ep = c.kv.pools.get(name) if c.kv is not None else None
    if ep is None:
        raise ProtocolError("not_registered", f"no engine pool {name[:64]!r} is attached by "
                                              f"this client (kv_attach first)")
    if not ep.verified:
        raise ProtocolError("not_registered", f"engine pool {name[:64]!r} is attached but "
                                              f"not verified (kv_verify first)")
    why = ep.damaged() if copies else None
    if why is not None:  # before any byte moves or any entry changes
        raise ProtocolError("bad_handle", why)
    return ep


def _keys(keys: list[str]) -> list[str]:
    if not keys:
        raise ProtocolError("bad_field", "keys is empty")
    for k in keys:
        if not 0 < len(k) <= MAX_KV_KEY_LEN or not k.isprintable() or not k.isascii():
            raise ProtocolError("bad_field", f"key {k[:40]!r} must be 1..{MAX_KV_KEY_LEN} "
                                             f"printable ASCII characters")
    return keys


def _pages(ep: EnginePool, keys: list[str], arrays: Sequence, frame: int,
           distinct: bool) -> np.ndarray:
    pages = Ids(arrays[frame]).np()
    if pages.size != len(keys):
        raise ProtocolError("bad_rows", f"pages has {pages.size} ids for {len(keys)} keys")
    if pages.size and (pages.min() < 0 or pages.max() >= ep.pages):
        bad = int(pages[(pages < 0) | (pages >= ep.pages)][0])
        raise ProtocolError("bad_rows", f"page {bad} is out of range for pool {ep.name[:64]!r} "
                                        f"({ep.pages} pages)")
    if distinct and has_duplicates(pages):
        raise ProtocolError("bad_rows", "pages repeats a destination page")
    return pages


def kv_attach(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    store = store_of(st)
    name, pool, space = h["name"], h.get("pool"), h.get("space")
    ns = _ns(st, c, h["namespace"])
    if not name or not name.isprintable():  # it is named in refusals, each one line
        raise ProtocolError("bad_field", f"name must be 1 or more printable characters, got "
                                         f"{name[:64]!r}")
    pools = c.kv.pools if c.kv is not None else {}
    old = pools.get(name)  # one never proven (its proof or hand-in failed) is replaced below
    if old is not None and old.verified:
        raise ProtocolError("already_registered", f"engine pool {name[:64]!r} is already "
                                                  f"attached (kv_detach first)")
    if len(pools) - (old is not None) >= MAX_POOLS_PER_CLIENT:
        raise ProtocolError("bad_field", f"at most {MAX_POOLS_PER_CLIENT} engine pools per "
                                         f"client")
    if pool is not None:
        spec = st.pool_spec(pool)
        if space is not None and space != spec.index:
            raise ProtocolError("bad_field", f"pool {pool} lives in space {spec.index}, not "
                                             f"{space[:32]!r}")
        space = spec.index
        if h.get("page_bytes") != spec.page_bytes:
            raise ProtocolError("layout_mismatch", f"engine pool {name[:64]!r}: pages of "
                                f"{h.get('page_bytes')} B, daemon pool {pool} "
                                f"{spec.page_bytes} B")
    elif space is None:
        raise ProtocolError("bad_field", "give 'pool' (a pool with bytes) or 'space' (a "
                                         "marker pool)")
    st.check_space(space)
    if space not in store.entries:
        raise ProtocolError("bad_field", f"space {space} holds no host rows")
    handed = h.get("handoff", False)
    try:
        ep = EnginePool.open(name, ns, pool, space, h["pages"], pid=h.get("pid"),
                             page_bytes=h.get("page_bytes") or 0,
                             num_layers=st.layout.pool(pool).num_layers if pool else 0,
                             layers=h.get("layers"), handed=handed)
    except ValueError as e:
        raise ProtocolError("bad_handle" if pool else "bad_field", str(e)[:300]) from None
    held = sum(p.files for k in st.registry.clients.values() if k.kv is not None
               for p in k.kv.pools.values() if p is not old)
    budget = file_budget()
    if held + ep.files > budget:
        ep.close()
        raise ProtocolError("busy", f"engine pool {name[:64]!r}: its {ep.files} files and the "
                                    f"{held} all clients' pools map now pass the key store's "
                                    f"{budget}; detach some first")
    out: dict[str, Any] = {"nonce": ep.nonce.hex(), "proofs": ep.proof_request()}
    if handed:  # the engine hands its files in on the descriptor socket (any pid namespace)
        token = secrets.randbits(64)
        try:
            handout = st.handout()
            handout.expect(token, len(ep.wanted))
        except (OSError, ValueError) as e:
            ep.close()
            raise ProtocolError("unsupported", f"kv_attach: cannot take descriptors in on the "
                                               f"descriptor socket ({e})") from None
        ep.on_close = lambda: handout.withdraw(token)
        ep.token = token
        out.update(fd_socket=handout.path, fd_token=token, fds=ep.wanted)
    if old is not None:
        old.close()  # (its token withdrawn: descriptors handed in late are refused)
    if c.kv is None:
        c.kv = ClientPools()
    c.kv.pools[name] = ep
    if store.l3 is not None:
        store.l3.touch(ns)  # its epoch is read while the engine proves the pool
    return out, []


def kv_verify(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    pending = [p for p in (c.kv.pools.values() if c.kv is not None else ()) if not p.verified]
    fails = [why for why in (_handed_in(st, p) if p.wanted else p.check_proof()
                             for p in pending) if why is not None]
    if fails:  # nothing changes: the pools stay pending (attached again, or kv_detach)
        raise ProtocolError("not_owner", f"kv_verify: {fails[0]}" +
                            (f" (and {len(fails) - 1} more)" if len(fails) > 1 else ""))
    for p in pending:
        p.commit()
    return {"attached": sorted(c.kv.pools) if c.kv is not None else []}, []


def _handed_in(st: DaemonState, p: EnginePool) -> str | None:
    """Map the descriptors the engine handed in for pool ``p``; None when they mapped, else
    why not (one line)."""
    fds = st.handout().take(p.token) if p.token is not None else None
    if fds is None:
        return (f"pool {p.name[:64]!r}: its descriptors were not handed in (send them to the "
                f"descriptor socket the kv_attach reply named, with its token)")
    try:
        p.take_fds(fds)
    except ValueError as e:
        return f"pool {p.name[:64]!r}: {e} (attach it again, or kv_detach it)"
    return None


def kv_put(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    ep = _attached(c, h["name"])
    keys = _keys(h["keys"])
    pages = _pages(ep, keys, arrays, h["pages"], distinct=False)
    return {"stored": store_of(st).put(ep, keys, pages)}, []


def kv_get(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    ep = _attached(c, h["name"])
    keys = _keys(h["keys"])
    pages = _pages(ep, keys, arrays, h["pages"], distinct=True)
    found, pending = store_of(st).get(ep, keys, pages)
    return {"found": found, "pending": pending}, []


def kv_exists(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    ep = _attached(c, h["name"], copies=False)  # moves no page: no size check
    present, pending = store_of(st).exists(ep, _keys(h["keys"]))
    return {"present": present, "pending": pending}, []


def kv_clear(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    """Without L3: ``{dropped}``. With L3: ``{op}``, the ack once the namespace's new epoch is
    in L3 (``kv: {dropped}``) or could not be written (status error, and why): ``kv_l3``."""
    ns = _ns(st, c, h["namespace"])
    ms = deadline_ms(h)  # (checked with or without L3: the same command either way)
    store = store_of(st)
    if store.l3 is None:
        return {"dropped": store.drop(ns)}, []
    store.l3.check_clear()
    return {"op": store.l3.clear(ns, c, ms)}, []


def kv_detach(st: DaemonState, c: ClientState, h: dict, arrays: Sequence) -> Reply:
    n = c.kv.close() if c.kv is not None else 0
    c.kv = None
    return {"detached": n}, []
