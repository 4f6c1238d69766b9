"""A new shared-memory file, mapped: the one way hicache makes one.

Contract: ``new_mapped_file(path, nbytes)`` creates ``path`` (mode 0600, exclusive: an existing
file is an error), sizes it to ``nbytes`` and maps it read-write; on any failure the file is
removed and the error raised, so nothing is left behind. Naming, sweeping and unlinking are the
callers' (``core.ipc``, ``core.sparse_shm``, ``core.channel``, the fuzzer's peers).
"""
from __future__ import annotations

import mmap
import os


def new_mapped_file(path: str, nbytes: int) -> mmap.mmap:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
    try:
        os.ftruncate(fd, nbytes)
        return mmap.mmap(fd, nbytes)
    except BaseException:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        raise
    finally:
        os.close(fd)
