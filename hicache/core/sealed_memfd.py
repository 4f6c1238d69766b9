"""Memory the daemon shares with one client whose size no process can change: an anonymous sealed
memfd the daemon makes and maps, and hands the client over its descriptor socket
(``core.fd_handout``). The one way hicache makes such memory (``core.channel``,
``core.sparse_shm``, and a CPU worker's device pools, ``engine.device_pools``, which the worker
hands the daemon the other way).

Why: a mapping of a shared file whose size another process may cut (``ftruncate``) is a SIGBUS
at the mapper's next touch of a page past the new end. For the daemon that is every client's
work lost; a client of the same uid could do it to a ``/dev/shm`` file both mapped.

Contract:
- ``new_sealed_fd(name, nbytes)``: the memfd alone, made as below (no mapping, no token); its
  descriptor is the caller's. ``new_sealed_mapping(name, nbytes)``: the same, mapped read-write
  (descriptor and mapping). ``on_shmem(fd)``: whether a descriptor is the kernel's shared
  memory (not hugetlbfs, whose missing page is a SIGBUS); with ``seals_of`` and
  ``unallocated(stat, need)`` (a sparse file's reason, else None) what a receiver checks before
  it maps memory someone else made. ``seals_of(fd)``: the seals a descriptor carries (0 for a file
  that cannot carry any): what a receiver checks before it maps memory someone else made.
- ``create_sealed(name, nbytes, token_at)`` (the daemon): refuses ``nbytes`` beyond the memory
  the kernel reports available now (``OSError`` ENOMEM: unlike a tmpfs, a memfd has no size cap
  of its own, and reserving more than fits would end in the OOM killer, not in an error); makes
  a memfd (``MFD_CLOEXEC | MFD_ALLOW_SEALING``; ``name`` shows in /proc links), mode 0600,
  sized ``nbytes``, its pages reserved (``posix_fallocate``: memory that runs out meanwhile is
  an ``OSError`` here, not a fault at a first touch), sealed with ``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL`` (a truncate or growth through any descriptor of it, a client's
  included, fails with EPERM, and no seal can be added or removed), mapped read-write, with a
  random non-zero u64 token written little-endian at byte ``token_at``. Returns a ``Sealed``
  (descriptor, mapping, token). On any failure nothing stays open. A hole punched in it
  (``FALLOC_FL_PUNCH_HOLE``) reads as zeros, never a fault.
- ``Sealed.offer(handout)``: offers the descriptor once on the daemon's ``FdHandout`` and
  returns what the client needs to take it (``{"fds": socket path, "token": token}``);
  ``Sealed.close()`` withdraws an offer not taken and closes the descriptor (the memory itself
  lives until the last mapping goes too; Python's ``mmap`` keeps a descriptor of its own while
  it lives). Only a process that was handed the token (in its own reply) can take the
  descriptor.
- ``open_sealed(fds, token, nbytes, token_at, what)`` (the client): takes the descriptor from
  the socket ``fds`` (``fd_handout.fetch_fd``), checks it is sealed as above (no one who
  handed it over can cut it under the client's mapping), its size is ``nbytes`` and the u64
  at ``token_at`` is ``token`` (the memory is the one the reply named), maps it and closes the
  descriptor. A descriptor it cannot get is an ``OSError`` saying why; a wrong size or token is
  a ``ValueError`` naming ``what``.
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import mmap
import os
import secrets
import struct
from typing import Any

from .fd_handout import FdHandout, fetch_fd
from .sizes import format_bytes

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_TMPFS_MAGIC = 0x01021994
_libc = ctypes.CDLL(None, use_errno=True)
_TOKEN = struct.Struct("<Q")


class Sealed:
    """A memfd ``create_sealed`` made: its descriptor, mapping and token (see the module
    docstring)."""

    def __init__(self, fd: int, mm: mmap.mmap, token: int) -> None:
        self.fd, self.mm, self.token = fd, mm, token
        self._handout: FdHandout | None = None

    def offer(self, handout: FdHandout) -> dict[str, Any]:
        """Offer the descriptor once on ``handout``; what the client needs to take it."""
        if self.fd < 0:
            raise ValueError("this sealed memfd is closed")
        handout.offer(self.fd, self.token)
        self._handout = handout
        return {"fds": handout.path, "token": self.token}

    def close(self) -> None:
        """Withdraw an offer not taken and close the descriptor (the mappings stay)."""
        if self._handout is not None:
            self._handout.withdraw(self.token)
            self._handout = None
        if self.fd >= 0:
            os.close(self.fd)
            self.fd = -1


def memory_available() -> int | None:
    """Bytes the kernel estimates can be allocated without swapping (``MemAvailable``), or None
    when /proc/meminfo does not say."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def _check_room(nbytes: int) -> None:
    have = memory_available()
    if have is not None and nbytes > have:
        raise OSError(errno.ENOMEM, f"{format_bytes(nbytes)} needed, {format_bytes(have)} "
                                    f"available (MemAvailable)")


def new_sealed_fd(name: str, nbytes: int) -> int:
    """A new memfd of ``nbytes`` (mode 0600, close-on-exec, its pages reserved, sealed against
    shrinking and growing, no seal changeable), after ``_check_room``; its descriptor, the
    caller's to close. On any failure nothing stays open. (The daemon's memory for one
    client, ``create_sealed``; a CPU worker's device pools, ``engine.device_pools``.)"""
    if nbytes <= 0:
        raise ValueError(f"a sealed memfd needs a positive size, got {nbytes}")
    _check_room(nbytes)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # pages now: an OSError, not a SIGBUS at a touch
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # nobody changes its size from here on
    except BaseException:
        os.close(fd)
        raise
    return fd


def new_sealed_mapping(name: str, nbytes: int) -> tuple[int, mmap.mmap]:
    """``new_sealed_fd`` and a read-write mapping of all of it: (descriptor, mapping), both the
    caller's; on any failure nothing stays open."""
    fd = new_sealed_fd(name, nbytes)
    try:
        return fd, mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise


def on_shmem(fd: int) -> bool:
    """Whether ``fd`` is a file of the kernel's shared memory (a memfd or tmpfs file,
    ``TMPFS_MAGIC``): a hole in it reads as zeros. A hugetlbfs memfd can carry the same seals,
    but a page of it missing when touched is a SIGBUS."""
    buf = ctypes.create_string_buffer(256)  # struct statfs; f_type (a long) comes first
    if _libc.fstatfs(fd, buf) != 0:
        return False
    return ctypes.c_long.from_buffer(buf).value & 0xFFFFFFFF == _TMPFS_MAGIC


def unallocated(st: os.stat_result, need: int) -> str | None:
    """None when the file of ``st`` has at least ``need`` bytes of pages allocated (its blocks),
    else the refusal's reason: a copy into a missing page of a shared-memory file allocates it,
    and on a full tmpfs that is a SIGBUS. (A hole can hide behind pages allocated elsewhere in
    the file; this catches a file made sparse, not one holed on purpose.)"""
    have = st.st_blocks * 512
    if have >= need:
        return None
    return (f"only {have} of the {need} bytes needed are allocated (a sparse file: reserve "
            f"them first, posix_fallocate, or touch every page)")


def seals_of(fd: int) -> int:
    """The seals on ``fd`` (``F_GET_SEALS``); 0 for a file that cannot carry seals (not a
    memfd)."""
    try:
        return fcntl.fcntl(fd, fcntl.F_GET_SEALS)
    except OSError:  # EINVAL: no memfd, so no seals
        return 0


def create_sealed(name: str, nbytes: int, token_at: int) -> Sealed:
    """A new sealed, reserved, mapped memfd holding a token (see the module docstring)."""
    if nbytes <= 0 or not 0 <= token_at <= nbytes - _TOKEN.size:
        raise ValueError(f"a sealed memfd of {nbytes} bytes cannot hold a token at {token_at}")
    fd, mm = new_sealed_mapping(name, nbytes)
    token = secrets.randbits(64) | 1
    _TOKEN.pack_into(mm, token_at, token)
    return Sealed(fd, mm, token)


def open_sealed(fds: str, token: int, nbytes: int, token_at: int, what: str) -> mmap.mmap:
    """Take the memfd offered for ``token`` on the daemon's socket ``fds`` and map it after
    checking its size and token (see the module docstring); ``what`` names it in errors."""
    fd = fetch_fd(fds, token, what)
    try:
        seals = seals_of(fd)
        if seals & _SEALS != _SEALS:  # else whoever handed it over could cut it under us
            raise ValueError(f"the {what} the daemon handed over is not sealed against "
                             f"resizing (seals {seals:#x})")
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"the {what} the daemon handed over has {size} bytes, expected "
                             f"{nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if 0 <= token_at <= nbytes - _TOKEN.size and _TOKEN.unpack_from(mm, token_at)[0] == token:
        return mm
    mm.close()
    raise ValueError(f"the memory the daemon handed over is not this hicache {what}")
