"""The sweep of files a killed process left in a shared-memory folder (hicache makes no shared
memory files any more: shared memory is a sealed memfd, ``core.sealed_memfd``, which goes with
its last holder; what is left to sweep are the daemon's wake-up sockets there, and the channel
and sparse-region files of earlier versions).

Contract: ``sweep_stale(shm_dir, prefixes)`` removes this user's files named ``<prefix>...<pid>-<hex>``
whose creating process is gone and that were not modified for ``STALE_AFTER_S``. A socket is
gone when nobody listens on it (a connect is refused); other files when no process has their
pid here. (A socket of a live daemon in another pid namespace has a pid that is nobody's here,
or another process's: its connect tells, where the pid cannot.)
"""
from __future__ import annotations

import errno
import os
import re
import socket
import stat
import time
from typing import Sequence

STALE_AFTER_S = 60.0  # a stale file is also this old (a just-made one may not be mapped yet)
_CREATOR = re.compile(r"(\d+)-[0-9a-f]+$")  # the creating pid before the random suffix


def _listened(path: str) -> bool:
    """Whether some process has a socket bound at ``path`` (a connect of either kind is not
    refused; anything but a refusal counts as bound, so nothing live is removed). The connect
    never waits: a listener whose backlog is full (``EAGAIN``) is bound, not a hang."""
    for kind in (socket.SOCK_DGRAM, socket.SOCK_STREAM):
        s = socket.socket(socket.AF_UNIX, kind | socket.SOCK_NONBLOCK)
        try:
            s.connect(path)
            return True
        except OSError as e:
            if e.errno == errno.EPROTOTYPE:  # bound, as the other kind
                continue
            if e.errno != errno.ECONNREFUSED:
                return True
        finally:
            s.close()
    return False


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
            if stat.S_ISSOCK(st.st_mode):
                if _listened(path):
                    continue
            else:
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
