"""A new shared-memory file, mapped: the one way hicache makes one; and the sweep of files a
killed process left behind.

Contract: ``new_mapped_file(path, nbytes)`` creates ``path`` (mode 0600, exclusive: an existing
file is an error), sizes it to ``nbytes`` and maps it read-write; on any failure the file is
removed and the error raised, so nothing is left behind. Naming and unlinking are the callers'
(``core.ipc``, the fuzzer's peers; memory a client must not resize is a sealed memfd,
``core.sealed_memfd``, instead).
``sweep_stale(shm_dir, prefixes)`` removes this user's files named ``<prefix>...<pid>-<hex>``
whose creating process is gone and that were not modified for ``STALE_AFTER_S``.
"""
from __future__ import annotations

import mmap
import os
import re
import time
from typing import Sequence

STALE_AFTER_S = 60.0  # a stale file is also this old (a just-made one may not be mapped yet)
_CREATOR = re.compile(r"(\d+)-[0-9a-f]+$")  # the creating pid before the random suffix


def new_mapped_file(path: str, nbytes: int) -> mmap.mmap:
    """Make ``path`` (0600, exclusive) of ``nbytes`` and map it."""
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


def sweep_stale(shm_dir: str, prefixes: Sequence[str]) -> int:
    """Remove this user's files in ``shm_dir`` named with one of ``prefixes`` whose creating
    process no longer exists (killed before it could unlink them) and that were not modified
    for ``STALE_AFTER_S``; returns how many. Mappings other processes hold stay valid."""
    n, uid, now = 0, os.getuid(), time.time()
    try:
        names = [e for e in os.listdir(shm_dir) if e.startswith(tuple(prefixes))]
    except OSError:
        return 0
    for name in names:
        m = _CREATOR.search(name)
        if m is None:
            continue
        path = os.path.join(shm_dir, name)
        try:
            st = os.stat(path)
            if st.st_uid != uid or now - st.st_mtime < STALE_AFTER_S:
                continue
            os.kill(int(m.group(1)), 0)
            continue  # alive (or the pid was reused): keep it
        except ProcessLookupError:
            pass
        except (OSError, OverflowError):
            continue  # gone already, or another user's process
        try:
            os.unlink(path)
            n += 1
        except OSError:
            pass
    return n
