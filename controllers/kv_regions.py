"""Engine host pools the daemon maps for its key store: shared-memory files named (pid, fd).

An engine that keeps its host pool in shared memory (SGLang with ``"allocator": "shm"``: one
``memfd`` per buffer, or an unlinked ``/dev/shm`` file) attaches it with ``kv_attach``; the
daemon then copies pages between that memory and its own host rows (``kv_store``). Such a file
has no name another process can open, so the daemon opens it through ``/proc/<pid>/fd/<fd>``:
same user (checked), same PID namespace, and the engine process dumpable (the kernel's
ptrace-read rule).

Contract:

* ``EnginePool.open(...)`` validates the geometry and maps every distinct file once (read and
  write, shared). Only regular files whose link reads ``/memfd:...`` or ``/dev/shm/...`` are
  accepted (opened ``O_PATH`` first and checked, so naming a pipe or a device has no effect),
  and never the daemon's own files (``pid`` naming the daemon, or a thread of it, is refused).
  Each layer is a ``[pages, page_bytes]`` strided view:
  page ``p`` of layer ``l`` starts at byte ``offset_l + p * stride_l`` of its file. Any
  failure raises ``ValueError`` with one line and leaves nothing mapped.
* A fresh pool is *pending*: naming (pid, fd) proves nothing, since any local client could name
  another engine's file. ``open`` draws a random nonce and, per file, a proof offset (the
  file's size when mapped, i.e. past the engine's data). The client must write the nonce there
  (grow the file, ``pwrite`` it) and call ``kv_verify``: ``check_proof()`` reads it back
  through the daemon's own descriptor, ``commit()`` then enables the pool. Only a process able
  to write that file can pass, and it could read and write those bytes without the daemon
  anyway. Pending pools move no byte.
* A marker pool (no ``pool``) maps nothing: it records which keys an index-only anchor (SGLang's
  ``LogicalHostPool`` for DSV4) has written; it needs no proof.
* Each file must be the kernel's shared memory (not hugetlbfs, where a missing page is a
  SIGBUS) with at least as many bytes of pages allocated as its layers need
  (``sealed_memfd.unallocated``): a copy into a missing page of a full tmpfs is a SIGBUS.
  SGLang prefaults its pools.
* ``damaged()``: whether a file got shorter than its layers need since it was mapped, or lost
  pages below that (a hole punched), read through a descriptor of the daemon's own (one line
  saying which, else None); the key store refuses such a pool before it copies a byte.
* ``files``: how many engine files the pool maps (two of the daemon's descriptors each); the
  key store refuses an attach ``busy`` past ``file_budget()`` files over all clients
  (``MAX_FILES``, and at most an eighth of the open-file limit, so their descriptors take at
  most a quarter of it: libzmq aborts the daemon when descriptors run out).
* ``close()`` drops the views and unmaps (idempotent).

Trust: the files must belong to a process of the daemon's own user, and the proof must be
written into them, so only such a process (or one able to write its memory) can attach; it can
already signal the daemon, so the one harm it could add, shrinking its file after the proof so
that a copy faults (SIGBUS), gives it nothing it did not have. An engine that shrinks a file by
mistake is caught: every command that copies checks the sizes and allocations first
(``damaged``), so only a shrink or a punch racing that check (microseconds) could still fault
(SGLang's files cannot be sealed, so nothing stronger is possible without copying through
``pread``/``pwrite``), or a hole hidden behind pages allocated past the layers' end. SGLang
never shrinks its pools; our client restores the size it grew.
"""
from __future__ import annotations

import mmap
import os
import resource
import secrets
import stat
from typing import Any, Callable

import torch

from hicache.core.sealed_memfd import on_shmem, unallocated

PROOF_BYTES = 16
ALLOWED_TARGETS = ("/memfd:", "/dev/shm/")
MAX_POOLS_PER_CLIENT = 64
MAX_FILES = 4096  # engine files all clients' pools may map at once (``file_budget``)


class EnginePool:
    """One attached engine host pool (see the module docstring)."""

    def __init__(self, name: str, ns: str, pool: str | None, space: str, pages: int) -> None:
        self.name = name
        self.ns = ns
        self.pool = pool  # the daemon pool its bytes go to; None: a marker pool
        self.space = space
        self.pages = pages
        # its tag in a store entry and in its L3 objects' keys: a byte pool's fixes its space;
        # a marker's names its space too (two markers of one name in two spaces are two pools)
        self.slot = pool if pool is not None else f"@{space}/{name}"
        self.layers: list[torch.Tensor] = []
        self.nonce = b""
        self.proofs: list[tuple[int, int, int]] = []  # (engine fd, our fd, proof offset)
        self.verified = pool is None
        self._maps: list[mmap.mmap] = []
        self._ends: list[tuple[int, int, int]] = []  # (our descriptor, engine fd, bytes needed)
        self._specs: list[tuple[int, int, int]] = []  # (engine fd, offset, stride) per layer
        self._page_bytes = 0
        self.wanted: list[int] = []  # a handed-in pool: the engine fds still to come, in order
        self.token: int | None = None  # ... and its intake's token on the descriptor socket
        self.on_close: Callable[[], None] | None = None  # withdraws that intake

    @classmethod
    def open(cls, name: str, ns: str, pool: str | None, space: str, pages: int, *,
             pid: int | None = None, page_bytes: int = 0, num_layers: int = 0,
             layers: list[Any] | None = None, handed: bool = False) -> "EnginePool":
        """``handed``: the engine hands its descriptors in (``take_fds``) instead of naming a
        ``pid``; the pool maps nothing until they came."""
        if not 0 < pages <= 1 << 40:
            raise ValueError(f"pages must be positive, got {pages}")
        ep = cls(name, ns, pool, space, pages)
        if pool is None:
            extra = [k for k, v in (("layers", layers), ("handoff", handed or None),
                                    ("pid", pid), ("page_bytes", page_bytes or None))
                     if v is not None]
            if extra:
                raise ValueError(f"a marker pool (no 'pool') maps no memory: "
                                 f"{', '.join(extra)} does not apply to it")
            return ep
        if handed:
            if pid is not None:
                raise ValueError("give 'pid' (the daemon opens the engine's files) or "
                                 "'handoff' (the engine hands them in), not both")
        elif pid is None or pid <= 0:
            raise ValueError("'pid' must name the engine process that holds the files")
        elif _process_of(pid) == os.getpid():  # a thread id of ours reads our fd table too
            raise ValueError("'pid' names the daemon itself")
        if not isinstance(layers, list) or len(layers) != num_layers:
            raise ValueError(f"pool {pool} has {num_layers} layers on this stage; 'layers' "
                             f"gives {len(layers) if isinstance(layers, list) else 'none'}")
        ep._specs = [_layer_spec(i, x, page_bytes) for i, x in enumerate(layers)]
        ep._page_bytes = page_bytes
        if handed:
            ep.wanted = ep.wanted_of_specs()
            return ep
        files: dict[int, tuple[int, int]] = {}
        try:
            for fd in ep.wanted_of_specs():
                files[fd] = _open_shared(pid, fd)
            ep._map(files, f"of process {pid}")
            # the proof is read through the descriptors ``damaged`` keeps: two per file
            ends = {fd: ours for ours, fd, _ in ep._ends}
            ep.proofs = [(fd, ends[fd], size) for fd, (_, size) in files.items()]
        except BaseException:
            ep.close()
            raise
        finally:
            for ours, _ in files.values():
                os.close(ours)
        ep.nonce = secrets.token_bytes(PROOF_BYTES)
        return ep

    @property
    def files(self) -> int:
        """The engine files this pool maps, or will once handed in (each holds two of the
        daemon's descriptors: the mapping's and the one ``damaged`` reads)."""
        return len(self.wanted_of_specs())

    def wanted_of_specs(self) -> list[int]:
        """The engine's distinct descriptors, in the order its layers first name them."""
        return list(dict.fromkeys(fd for fd, _, _ in self._specs))

    def take_fds(self, fds: list[int]) -> None:
        """Map the descriptors the engine handed in, in ``wanted`` order (ours now: closed here
        either way); each must be a shared-memory file long enough for its layers. ``ValueError``
        (one line) leaves the pool pending, mapping nothing."""
        ours: dict[int, tuple[int, int]] = {}
        try:
            if len(fds) != len(self.wanted):
                raise ValueError(f"{len(fds)} descriptors came for the {len(self.wanted)} "
                                 f"files the layers name")
            for want, fd in zip(self.wanted, fds):
                ours[want] = (fd, _shared_size(fd, f"handed-in fd (its fd {want})"))
            self._map(ours, "handed in")
        except BaseException:
            self.close()
            raise
        finally:
            for fd in fds:
                os.close(fd)
        self.wanted = []  # mapped; ``commit`` (kv_verify, with the client's other pools) enables

    def _map(self, files_in: dict[int, tuple[int, int]], whose: str) -> None:
        """Map each engine file (engine fd -> (our descriptor, size)) and lay the layers over
        them (the descriptors stay the caller's)."""
        files: dict[int, tuple[int, torch.Tensor, mmap.mmap]] = {}
        for fd, (ours, size) in files_in.items():
            try:
                mm = mmap.mmap(ours, size, mmap.MAP_SHARED, mmap.PROT_READ | mmap.PROT_WRITE)
            except OSError as e:  # e.g. a memfd sealed against writes: the engine's
                raise ValueError(f"cannot map fd {fd} {whose} shared and writable: "
                                 f"{e.strerror}") from None
            self._maps.append(mm)
            files[fd] = (size, torch.frombuffer(mm, dtype=torch.uint8), mm)
        need: dict[int, int] = {}
        for i, (fd, off, stride) in enumerate(self._specs):
            size = files[fd][0]
            end = off + (self.pages - 1) * stride + self._page_bytes
            if end > size:
                raise ValueError(f"layers[{i}]: {self.pages} pages of stride {stride} from "
                                 f"offset {off} end at byte {end}, past the file's {size}")
            need[fd] = max(need.get(fd, 0), end)
        for fd, end in need.items():
            why = unallocated(os.fstat(files_in[fd][0]), end)
            if why is not None:
                raise ValueError(f"fd {fd} {whose}: {why}")
        for fd, off, stride in self._specs:
            self.layers.append(files[fd][1].as_strided((self.pages, self._page_bytes),
                                                       (stride, 1), off))
        for fd, end in need.items():  # our own descriptor of each file, for ``damaged``
            self._ends.append((os.dup(files_in[fd][0]), fd, end))

    def damaged(self) -> str | None:
        """None while every file is still as long as its layers need, with that many bytes of
        pages allocated, else which is not (one line): a copy past a file's end, or into a
        missing page of a full tmpfs, would be a SIGBUS, ending the daemon."""
        for ours, fd, end in self._ends:
            st = os.fstat(ours)
            if st.st_size < end:
                return (f"engine pool {self.name[:64]!r}: its file (fd {fd}) is {st.st_size} "
                        f"bytes now, shorter than the {end} its layers need (kv_detach it)")
            why = unallocated(st, end)
            if why is not None:
                return (f"engine pool {self.name[:64]!r}: its file (fd {fd}) has holes now: "
                        f"{why} (kv_detach it)")
        return None

    def proof_request(self) -> list[list[int]]:
        """[[engine fd, offset], ...]: where the engine must write the nonce."""
        return [[fd, off] for fd, _, off in self.proofs]

    def check_proof(self) -> str | None:
        """None when every file holds the nonce at its proof offset, else what failed (one
        line). Changes nothing."""
        for fd, ours, off in self.proofs:
            try:
                got = os.pread(ours, PROOF_BYTES, off)
            except OSError as e:
                return f"pool {self.name[:64]!r}: fd {fd}: {e.strerror}"
            if got != self.nonce:
                return (f"pool {self.name[:64]!r}: the nonce is not at offset {off} of fd "
                        f"{fd} (this client did not show it can write that file)")
        return None

    def commit(self) -> None:
        """The proof held: the pool is usable."""
        self.proofs = []
        self.verified = True

    def close(self) -> None:
        done, self.on_close = self.on_close, None
        if done is not None:
            done()
        self.layers = []
        self.proofs = []  # (their descriptors are ``_ends``')
        for ours, _, _ in self._ends:
            os.close(ours)
        self._ends = []
        maps, self._maps = self._maps, []
        for mm in maps:
            try:
                mm.close()
            except BufferError:  # a view is still referenced somewhere: unmapped when freed
                pass


def file_budget() -> int:
    """Engine files all clients' key-store pools may map at once (see the module docstring)."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return MAX_FILES if soft == resource.RLIM_INFINITY else min(MAX_FILES, soft // 8)


def _layer_spec(i: int, x: Any, page_bytes: int) -> tuple[int, int, int]:
    if not isinstance(x, dict) or set(x) != {"fd", "offset", "stride"}:
        raise ValueError(f"layers[{i}] must be an object with exactly fd, offset, stride")
    fd, off, stride = x["fd"], x["offset"], x["stride"]
    for k, v in (("fd", fd), ("offset", off), ("stride", stride)):
        if type(v) is not int or v < 0 or v > 1 << 48:
            raise ValueError(f"layers[{i}].{k} must be a non-negative int")
    if stride < page_bytes:
        raise ValueError(f"layers[{i}].stride {stride} is smaller than a page ({page_bytes} B)")
    return fd, off, stride


def _process_of(pid: int) -> int:
    """The process (thread group) that task ``pid`` belongs to; ``pid`` itself for a process.
    ``/proc/<tid>/fd`` is its process's descriptor table, so a thread id stands for it."""
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith("Tgid:"):
                    return int(line.split()[1])
    except (OSError, ValueError, IndexError):
        pass
    raise ValueError(f"no process {pid} visible to the daemon")


def _open_shared(pid: int, fd: int) -> tuple[int, int]:
    """Our read-write descriptor of the engine's shared-memory file and its size."""
    try:
        if os.stat(f"/proc/{pid}").st_uid != os.getuid():
            raise ValueError(f"process {pid} does not run as the daemon's user")
    except OSError as e:
        raise ValueError(f"no process {pid} visible to the daemon: {e.strerror}") from None
    try:
        path_fd = os.open(f"/proc/{pid}/fd/{fd}", os.O_PATH | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot open fd {fd} of process {pid}: {e.strerror} (same user and "
                         f"PID namespace needed)") from None
    try:
        _shared_size(path_fd, f"fd {fd} of process {pid}")
        ours = os.open(f"/proc/self/fd/{path_fd}", os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise ValueError(f"cannot open fd {fd} of process {pid}: {e.strerror}") from None
    finally:
        os.close(path_fd)
    try:
        return ours, _shared_size(ours, f"fd {fd} of process {pid}")
    except ValueError:
        os.close(ours)
        raise


def _shared_size(fd: int, what: str) -> int:
    """The size of our descriptor ``fd`` (``O_PATH`` will do) when it is a non-empty memfd or
    ``/dev/shm`` file; else ``ValueError`` naming ``what``."""
    try:
        target = os.readlink(f"/proc/self/fd/{fd}")
        st = os.fstat(fd)
    except OSError as e:
        raise ValueError(f"cannot inspect {what}: {e.strerror}") from None
    if not stat.S_ISREG(st.st_mode) or not target.startswith(ALLOWED_TARGETS):
        raise ValueError(f"{what} is not a shared-memory file ({target[:80]!r}); memfd or "
                         f"/dev/shm files only")
    if not on_shmem(fd):
        raise ValueError(f"{what} is not the kernel's shared memory (a hugetlbfs memfd or "
                         f"file is refused: a page missing there is a SIGBUS)")
    if st.st_size <= 0:
        raise ValueError(f"{what} is empty")
    return st.st_size


class ClientPools:
    """The engine pools one client attached, by name (``ClientState.kv``)."""

    def __init__(self) -> None:
        self.pools: dict[str, EnginePool] = {}

    def close(self) -> int:
        n = len(self.pools)
        for p in self.pools.values():
            p.close()
        self.pools = {}
        return n
