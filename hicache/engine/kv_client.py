"""Engine side of the daemon's key store, as ``Client`` methods (``KVStoreCommands`` is a mixin
of ``hicache.engine.client.Client``; the daemon side is ``controllers/kv_store.py``).

* ``kv_attach(name, namespace, pages=..., pool=..., pid=..., page_bytes=..., layers=[...])``
  maps one host pool held in shared-memory files of this process (``layers``: per layer
  ``{"fd", "offset", "stride"}``), pending proof; a marker pool gives ``space`` instead of
  ``pool`` and maps nothing. ``kv_prove(reply)`` writes the daemon's nonce where it asked (each
  file grows by one page for it, then shrinks back after ``kv_verify``); ``kv_attach_proven``
  does all three. With ``handoff=True`` instead of a pid, ``kv_attach_proven`` hands the files
  in on the daemon's descriptor socket (``fd_handout.send_fds``: any pid namespace, the
  daemon's network namespace), only those its layers name, and the daemon opens nothing of
  this process's.
* ``kv_put / kv_get (name, keys, pages)`` -> one bool per key; ``kv_exists(name, keys)`` ->
  one bool per key. A daemon with L3 answers keys its host rows lack *pending* while it reads
  or asks L3 in the background; ``kv_get`` / ``kv_exists`` then ask again for those keys only
  (sleeping 1 ms doubling to 50 ms between rounds) until none is pending or ``l3_wait`` seconds
  passed (still pending then: False). Every round is one ordinary call, so the daemon's loop
  never waits on L3; ``kv_detach()`` -> pools unmapped. Pages are the pool's page indices (one
  per key).
* ``kv_clear(namespace, deadline_ms=None)`` -> entries dropped. With L3 the daemon answers in
  an op's ack once the namespace's new epoch is in L3 (from then on no daemon on the store
  reads its older objects); when that write fails or the master does not answer by the
  deadline, ``TransferFailed`` with the daemon's one line of why, and nothing was cleared.
"""
from __future__ import annotations

import mmap
import os
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from hicache.core.fd_handout import send_fds
from hicache.core.protocol import as_index, pack_index

L3_WAIT = 5.0  # s: how long kv_get / kv_exists keep asking about keys the daemon has pending


class KVStoreCommands:
    def kv_attach(self, name: str, namespace: str, *, pages: int, pool: str | None = None,
                  space: str | None = None, pid: int | None = None, handoff: bool = False,
                  page_bytes: int = 0, layers: Sequence[Mapping[str, int]] = (),
                  timeout: float | None = None) -> dict[str, Any]:
        f: dict[str, Any] = {"name": name, "namespace": namespace, "pages": int(pages)}
        if pool is not None:
            f.update(pool=pool, page_bytes=int(page_bytes), layers=[dict(x) for x in layers])
            if handoff:
                if pid is not None:
                    raise ValueError("kv_attach: give pid or handoff, not both")
                f["handoff"] = True
            else:
                f["pid"] = int(os.getpid() if pid is None else pid)
        if space is not None:
            f["space"] = space
        return self.call("kv_attach", f, timeout=timeout)[0]

    @staticmethod
    def kv_prove(reply: Mapping[str, Any]) -> list[tuple[int, int]]:
        """Write the nonce of a ``kv_attach`` reply into this process's files at the offsets
        the daemon named. Returns [(fd, original size)] for ``kv_unprove``; a write that fails
        shrinks the files it grew back first."""
        nonce = bytes.fromhex(reply["nonce"])
        done: list[tuple[int, int]] = []
        try:
            for fd, off in reply["proofs"]:
                size = os.fstat(fd).st_size
                os.ftruncate(fd, max(size, off + mmap.PAGESIZE))
                done.append((fd, size))
                if os.pwrite(fd, nonce, off) != len(nonce):
                    raise OSError(f"short write of the proof into fd {fd}")
        except BaseException:  # the files grown so far shrink back: nothing is left changed
            KVStoreCommands.kv_unprove(done)
            raise
        return done

    @staticmethod
    def kv_unprove(done: Sequence[tuple[int, int]]) -> None:
        """Shrink the files back to their size before ``kv_prove``."""
        for fd, size in reversed(done):  # one file named twice ends at its first size
            os.ftruncate(fd, size)

    def kv_verify(self, timeout: float | None = None) -> list[str]:
        return list(self.call("kv_verify", timeout=timeout)[0]["attached"])

    def kv_attach_proven(self, name: str, namespace: str, **kw: Any) -> list[str]:
        """``kv_attach`` + ``kv_prove`` + ``kv_verify`` (the files shrink back either way); with
        ``handoff=True``, ``kv_attach`` + the files handed in + ``kv_verify``."""
        reply = self.kv_attach(name, namespace, **kw)
        if reply.get("fd_token") is not None:
            mine = list(dict.fromkeys(int(x["fd"]) for x in kw.get("layers", ())))
            if reply.get("fds") != mine:  # only the files this call named leave this process
                raise ValueError(f"kv_attach {name}: the daemon asked for descriptors "
                                 f"{str(reply.get('fds'))[:80]}, not the files {mine} named")
            send_fds(str(reply["fd_socket"]), int(reply["fd_token"]), mine,
                     f"engine pool {name}")
            return self.kv_verify()
        done = self.kv_prove(reply) if reply.get("proofs") else []
        try:
            return self.kv_verify()
        finally:
            self.kv_unprove(done)

    def kv_put(self, name: str, keys: Sequence[str], pages: Any,
               timeout: float | None = None) -> list[bool]:
        h, _ = self.call("kv_put", {"name": name, "keys": list(keys), "pages": 0},
                         [as_index(pages)], timeout=timeout)
        return [bool(x) for x in h["stored"]]

    def kv_get(self, name: str, keys: Sequence[str], pages: Any,
               timeout: float | None = None, l3_wait: float = L3_WAIT) -> list[bool]:
        # packed as ``kv_put``'s are (int64s only: a float, a string or a nested list is a
        # TypeError, not a page it was cut to), one page per key
        pages = np.frombuffer(pack_index(as_index(pages)), dtype="<i8").astype(np.int64)
        if len(pages) != len(keys):
            raise ValueError(f"kv_get: {len(keys)} keys but {len(pages)} pages")

        def ask(idx: list[int]) -> tuple[list[int], list[int]]:
            h, _ = self.call("kv_get", {"name": name, "keys": [keys[i] for i in idx],
                                        "pages": 0}, [pages[idx]], timeout=timeout)
            return h["found"], h.get("pending", [])

        return _until_answered(list(keys), ask, l3_wait)

    def kv_exists(self, name: str, keys: Sequence[str], timeout: float | None = None,
                  l3_wait: float = L3_WAIT) -> list[bool]:
        def ask(idx: list[int]) -> tuple[list[int], list[int]]:
            h, _ = self.call("kv_exists", {"name": name, "keys": [keys[i] for i in idx]},
                             timeout=timeout)
            return h["present"], h.get("pending", [])

        return _until_answered(list(keys), ask, l3_wait)

    def kv_clear(self, namespace: str, timeout: float | None = None,
                 deadline_ms: int | None = None) -> int:
        """Entries dropped. With L3 the daemon answers in an ack once the namespace's new epoch
        is in L3, or raises ``TransferFailed`` saying why it is not (nothing was cleared);
        the wait covers the daemon's deadline (``deadline_ms``, its default 5,000)."""
        f: dict[str, Any] = {"namespace": namespace}
        if deadline_ms is not None:
            f["deadline_ms"] = int(deadline_ms)
        h, _ = self.call("kv_clear", f, timeout=timeout)
        if "op" not in h:
            return int(h["dropped"])
        wait = self._deadline_wait(deadline_ms, timeout)
        return int(self.wait_ack(int(h["op"]), timeout=wait).kv["dropped"])

    def kv_detach(self, timeout: float | None = None) -> int:
        return int(self.call("kv_detach", timeout=timeout)[0]["detached"])


def _until_answered(keys: list[str], ask: Callable[[list[int]], tuple[list[int], list[int]]],
                    wait: float) -> list[bool]:
    """One bool per key: ``ask(positions)`` -> (1/0 per asked key, pending positions among
    them), repeated for the pending ones until none is left or ``wait`` seconds passed."""
    out = [False] * len(keys)
    todo = list(range(len(keys)))
    deadline = time.monotonic() + wait
    pause = 0.001
    while True:  # the first call goes out even for no keys (the daemon refuses that)
        got, pending = ask(todo)
        for n, i in enumerate(todo):
            out[i] = bool(got[n])
        todo = [todo[p] for p in sorted(set(pending))]
        if not todo or time.monotonic() + pause > deadline:
            break
        time.sleep(pause)
        pause = min(pause * 2, 0.05)
    return out
