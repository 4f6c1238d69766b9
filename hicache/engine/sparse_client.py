"""Engine side of HiSparse's control plane: the daemon's sparse commands as ``Client`` methods
(``SparseCommands`` is a mixin of ``hicache.engine.client.Client``), and the engine's own
mapping of the sparse host region.

* ``sparse_region() -> dict``: where to take the region (``fds``, the daemon's descriptor
  socket) and its token, layers, rows, page bytes, ``min_sparse_prompt_len``.
* ``map_sparse_region(device) -> SparseShm``: takes the region's sealed memfd from that socket
  (``SCM_RIGHTS``, to the token its own reply carries: any pid namespace that shares the
  daemon's network namespace; else an ``OSError`` says why), checks its size and token and
  maps it; on a GPU it page-locks the mapping
  for ``device`` (``cudaHostRegister``), so the swap-in kernel reads it directly; its
  ``close()`` unpins it (call it once the engine's kernels no longer read it). Its ``layers``
  go to ``HotBuffer(host=...)``.
* ``sparse_admit(request, prompt_tokens, device_rows=None, host_rows=None) -> list[int]`` host
  page rows. ``host_rows``: this client's host-tier ``c4_kv`` rows of the prompt's first pages
  (prefix hits; the daemon fills those pages from host memory, nothing is read from the
  device); ``device_rows``: the worker's ``c4_kv`` device rows of the remaining pages;
  ``sparse_extend(request, tokens, device_tokens=None, first=None) -> list[int]`` all page rows
  after growing (new decode tokens backed up from device token locations);
  ``sparse_free(request) -> int``; ``sparse_report(lookups, swapped_in)`` adds hot-buffer
  counts to the daemon's metrics.

When a command copies, the daemon runs the copy in the background and the method returns after
its ack (``TransferFailed`` if the copy failed). Refusals raise ``CommandRefused`` with the
daemon's code and one-line message.
"""
from __future__ import annotations

from typing import TYPE_CHECKING, Any, Optional, Sequence

if TYPE_CHECKING:  # torch and the region's mapping load at ``map_sparse_region``: the client
    import torch  # stays light for ``hicache stats`` (see ``hicache.engine.client``)

    from hicache.core.sparse_shm import SparseShm

_REPLY_KEYS = ("v", "k", "id", "ok")


class SparseCommands:
    """The HiSparse commands; the class using it provides ``call(cmd, fields, arrays)``
    (``Client.call``)."""

    def _sparse(self, cmd: str, fields: dict[str, Any],
                frames: dict[str, Optional[Sequence[int]]]) -> list[int]:
        arrays: list[Any] = []
        for key, ids in frames.items():
            if ids is not None:
                fields[key] = len(arrays)
                arrays.append(list(ids))
        h, arr = self.call(cmd, fields, arrays)
        if "op" in h:  # the daemon copies in the background: the rows are filled at the ack
            self.wait_ack(self._op(cmd, h))
        return [int(x) for x in arr[0]] if arr else []

    def sparse_region(self) -> dict[str, Any]:
        h, _ = self.call("sparse_region")
        return {k: v for k, v in h.items() if k not in _REPLY_KEYS}

    def map_sparse_region(self, device: str | torch.device = "cpu") -> SparseShm:
        import torch

        from hicache.core.sparse_shm import SparseShm

        shm = SparseShm.open(self.sparse_region())
        device = torch.device(device)
        if device.type == "cuda":
            try:
                shm.pin(device)  # unpinned by shm.close()
            except BaseException:
                shm.close()
                raise
        return shm

    def sparse_admit(self, request: str, prompt_tokens: int,
                     device_rows: Optional[Sequence[int]] = None,
                     host_rows: Optional[Sequence[int]] = None) -> list[int]:
        return self._sparse("sparse_admit", {"request": request, "prompt_tokens": prompt_tokens},
                            {"host_rows": host_rows, "device_rows": device_rows})

    def sparse_extend(self, request: str, tokens: int,
                      device_tokens: Optional[Sequence[int]] = None,
                      first: Optional[int] = None) -> list[int]:
        fields: dict[str, Any] = {"request": request, "tokens": tokens}
        if first is not None:
            fields["first"] = first
        return self._sparse("sparse_extend", fields, {"device_tokens": device_tokens})

    def sparse_free(self, request: str) -> int:
        h, _ = self.call("sparse_free", {"request": request})
        return int(h["freed_rows"])

    def sparse_report(self, lookups: int, swapped_in: int) -> None:
        self.call("sparse_report", {"lookups": lookups, "swapped_in": swapped_in})
