"""The key store's L3 clears not yet carried out, in a small file that outlives the daemon.

A ``kv_clear`` is an invalidation (new weights, say): its namespace's objects must not come back
from L3. ``KvL3`` keeps a namespace unreadable until a removal of its objects ran; this file
keeps that promise across a stop, a crash or a SIGKILL that comes first: the next daemon with
the same identity reads it and removes those namespaces before it serves their keys.

Contract: ``ClearJournal(folder, identity)`` is the file
``<folder>/hicache-kv-clears-<digest of identity>.json`` (mode 0600). ``identity`` names where
the namespaces were cleared (the L3 master, the key prefix, the daemon's address), so a
restarted daemon with the same finds it and no other does. ``load() -> list[str]``: the
namespaces in it ([] when there is no file; an unreadable or malformed one is logged, naming
the file, and ignored). ``save(namespaces)`` replaces it atomically (a temporary file renamed
over it), or removes it when there are none: a daemon whose removals all ran leaves nothing
behind. A failed write is logged once and not raised: the daemon goes on, and only the window
in which a stop can forget a clear comes back.
"""
from __future__ import annotations

import hashlib
import json
import logging
import os
from typing import Iterable

log = logging.getLogger("hicache.daemon")
PREFIX = "hicache-kv-clears-"


class ClearJournal:
    """One daemon's pending L3 clears on disk (see the module docstring)."""

    def __init__(self, folder: str, identity: str) -> None:
        digest = hashlib.sha256(identity.encode()).hexdigest()[:16]
        self.path = os.path.join(folder, f"{PREFIX}{digest}.json")
        self._saved: list[str] = []
        self._warned = False

    def load(self) -> list[str]:
        try:
            with open(self.path, encoding="utf-8") as f:
                data = json.load(f)
        except FileNotFoundError:
            return []
        except (OSError, ValueError) as e:
            log.warning("L3 clears journal %s cannot be read (%s): ignored", self.path, e)
            return []
        names = data.get("namespaces") if isinstance(data, dict) else None
        if not isinstance(names, list) or not all(isinstance(n, str) for n in names):
            log.warning("L3 clears journal %s holds no namespace list: ignored", self.path)
            return []
        self._saved = list(names)
        return list(names)

    def save(self, namespaces: Iterable[str]) -> None:
        names = sorted(namespaces)
        if names == self._saved:
            return
        try:
            if not names:
                try:
                    os.unlink(self.path)
                except FileNotFoundError:
                    pass  # nothing to remove
            else:
                tmp = f"{self.path}.{os.getpid()}.tmp"
                fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
                with os.fdopen(fd, "w", encoding="utf-8") as f:
                    json.dump({"namespaces": names}, f)
                os.replace(tmp, self.path)
        except OSError as e:
            if not self._warned:
                log.error("L3 clears journal %s cannot be written (%s): a clear whose removal "
                          "has not run when this daemon stops may come back", self.path, e)
                self._warned = True
            return
        self._saved = names
