"""Engine side of HiSparse's control plane: typed calls for the daemon's sparse commands, and
the engine's own mapping of the sparse host region.

``SparseSession(client)``:

* ``region() -> dict``: the region's file, layers, rows, page bytes, ``min_sparse_prompt_len``.
* ``map_region(device) -> SparseShm``: maps that file; on a GPU it page-locks the mapping for
  ``device`` (``cudaHostRegister``), so the swap-in kernel reads it directly. Its ``layers`` go
  to ``HotBuffer(host=...)``.
* ``admit(request, prompt_tokens, device_rows=None) -> list[int]`` host page rows (the prompt's
  C4 KV is backed up from the worker's ``c4_kv`` device rows when given);
  ``extend(request, tokens, device_tokens=None, first=None) -> list[int]`` all page rows after
  growing (new decode tokens backed up from device token locations); ``free(request)``;
  ``report(lookups, swapped_in)`` adds hot-buffer counts to the daemon's metrics.

Refusals raise ``CommandRefused`` with the daemon's code and one-line message.
"""
from __future__ import annotations

from typing import Any, Optional, Sequence

import torch

from hicache.core.sparse_shm import SparseShm


class SparseSession:
    """HiSparse commands over one ``hicache.engine.client.Client``."""

    def __init__(self, client: Any) -> None:
        self.client = client
        self._registered: list[int] = []

    def region(self) -> dict[str, Any]:
        h, _ = self.client.call("sparse_region")
        return {k: v for k, v in h.items() if k not in ("v", "k", "id", "ok")}

    def map_region(self, device: str | torch.device = "cpu") -> SparseShm:
        shm = SparseShm.open(self.region())
        device = torch.device(device)
        if device.type == "cuda":
            with torch.cuda.device(device):
                rc = torch.cuda.cudart().cudaHostRegister(shm.base_ptr, shm.nbytes, 0)
            if int(rc) != 0:
                raise RuntimeError(f"cudaHostRegister of the sparse region failed ({int(rc)})")
            self._registered.append(shm.base_ptr)
        return shm

    def admit(self, request: str, prompt_tokens: int,
              device_rows: Optional[Sequence[int]] = None) -> list[int]:
        fields: dict[str, Any] = {"request": request, "prompt_tokens": prompt_tokens}
        arrays: list[Any] = []
        if device_rows is not None:
            fields["device_rows"] = 0
            arrays.append(list(device_rows))
        _, arr = self.client.call("sparse_admit", fields, arrays)
        return [int(x) for x in arr[0]] if arr else []

    def extend(self, request: str, tokens: int, device_tokens: Optional[Sequence[int]] = None,
               first: Optional[int] = None) -> list[int]:
        fields: dict[str, Any] = {"request": request, "tokens": tokens}
        arrays: list[Any] = []
        if device_tokens is not None:
            fields["device_tokens"] = 0
            arrays.append(list(device_tokens))
        if first is not None:
            fields["first"] = first
        _, arr = self.client.call("sparse_extend", fields, arrays)
        return [int(x) for x in arr[0]] if arr else []

    def free(self, request: str) -> int:
        h, _ = self.client.call("sparse_free", {"request": request})
        return int(h["freed_rows"])

    def report(self, lookups: int, swapped_in: int) -> None:
        self.client.call("sparse_report", {"lookups": lookups, "swapped_in": swapped_in})
