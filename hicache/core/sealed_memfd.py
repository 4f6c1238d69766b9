"""Memory the daemon shares with one client whose size no process can change: an anonymous sealed
memfd the daemon makes and maps, and the client opens through the daemon's /proc fd link. The
one way hicache makes such memory (``core.channel``, ``core.sparse_shm``).

Why: a mapping of a shared file whose size another process may cut (``ftruncate``) is a SIGBUS
at the mapper's next touch of a page past the new end. For the daemon that is every client's
work lost; a client of the same uid could do it to a ``/dev/shm`` file both mapped.

Contract:
- ``create_sealed(name, nbytes, token_at)`` (the daemon): refuses ``nbytes`` beyond the memory
  the kernel reports available now (``OSError`` ENOMEM: unlike a tmpfs, a memfd has no size cap
  of its own, and reserving more than fits would end in the OOM killer, not in an error); makes
  a memfd (``MFD_CLOEXEC | MFD_ALLOW_SEALING``; ``name`` shows in /proc links), mode 0600,
  sized ``nbytes``, its pages reserved (``posix_fallocate``: memory that runs out meanwhile is
  an ``OSError`` here, not a fault at a first touch), sealed with ``F_SEAL_SHRINK |
  F_SEAL_GROW | F_SEAL_SEAL`` (a truncate or growth through any descriptor of it, a client's
  included, fails with EPERM, and no seal can be added or removed), mapped read-write, with a
  random non-zero u64 token written little-endian at byte ``token_at``. Returns ``Sealed(path,
  fd, mm, token)``: ``path`` is ``/proc/<pid>/fd/<fd>``, valid while the caller keeps ``fd``
  open (it closes it when the client may no longer open the memory; the memory itself lives
  until the last mapping goes too, and Python's ``mmap`` keeps a descriptor of its own while
  it lives). On any failure nothing stays open. A hole punched in it
  (``FALLOC_FL_PUNCH_HOLE``) reads as zeros, never a fault.
- ``open_sealed(path, nbytes, token, token_at, what)`` (the client): opens ``path`` read-write,
  checks its size is ``nbytes`` and the u64 at ``token_at`` is ``token`` (so a descriptor
  number the daemon reused for other memory is never taken for this one), maps it and closes
  the descriptor. A path it cannot open is an ``OSError`` saying why (only a process of the
  daemon's uid, in its pid namespace, where /proc is not restricted, can open it); a wrong size
  or token is a ``ValueError`` naming ``what``.
"""
from __future__ import annotations

import errno
import fcntl
import mmap
import os
import secrets
import struct
from typing import NamedTuple

from .sizes import format_bytes

_SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_SEAL
_TOKEN = struct.Struct("<Q")


class Sealed(NamedTuple):
    """A memfd ``create_sealed`` made: its /proc path, descriptor, mapping and token."""

    path: str
    fd: int
    mm: mmap.mmap
    token: int


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


def create_sealed(name: str, nbytes: int, token_at: int) -> Sealed:
    """A new sealed, reserved, mapped memfd holding a token (see the module docstring)."""
    if nbytes <= 0 or not 0 <= token_at <= nbytes - _TOKEN.size:
        raise ValueError(f"a sealed memfd of {nbytes} bytes cannot hold a token at {token_at}")
    _check_room(nbytes)
    fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
    try:
        os.fchmod(fd, 0o600)
        os.ftruncate(fd, nbytes)
        os.posix_fallocate(fd, 0, nbytes)  # pages now: an OSError, not a SIGBUS at a touch
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # nobody changes its size from here on
        mm = mmap.mmap(fd, nbytes)
    except BaseException:
        os.close(fd)
        raise
    token = secrets.randbits(64) | 1
    _TOKEN.pack_into(mm, token_at, token)
    return Sealed(f"/proc/{os.getpid()}/fd/{fd}", fd, mm, token)


def open_sealed(path: str, nbytes: int, token: int, token_at: int, what: str) -> mmap.mmap:
    """Map the memfd ``path`` names after checking its size and token (see the module
    docstring); ``what`` names it in errors."""
    try:
        fd = os.open(path, os.O_RDWR | os.O_CLOEXEC)
    except OSError as e:
        raise OSError(e.errno, f"cannot open {path} ({e.strerror}): the {what} is the daemon's "
                               f"memfd, open to a process of its uid, in its pid namespace, "
                               f"where /proc is not restricted") from None
    try:
        size = os.fstat(fd).st_size
        if size != nbytes:
            raise ValueError(f"{what} {path} has {size} bytes, expected {nbytes}")
        mm = mmap.mmap(fd, nbytes)
    finally:
        os.close(fd)
    if 0 <= token_at <= nbytes - _TOKEN.size and _TOKEN.unpack_from(mm, token_at)[0] == token:
        return mm
    mm.close()
    raise ValueError(f"{path} is not this hicache {what}")
