"""The copy kernels' variants compiled and loaded before a copy needs them (GPU daemons).

``warm_pools(st, tables=None) -> (launches, seconds)``: for every pool of the daemon's layout,
the row and token kernel variants of its copies in both directions between ``tables`` (a
registered worker's device ``LayerTable`` s, by pool name) and the daemon's host tables, through
``dispatch.warm_up_copies`` (scratch buffers: no pool byte is touched). With ``tables`` None,
dense device pools of the layout's row sizes stand in: what the daemon assumes at start, before
a worker registers, so that ``register`` finds every variant loaded unless the worker's pools
are aligned otherwise (then ``register`` compiles the difference). At start the launches run
on the scheduler's own ``backup`` and ``load`` streams, so those streams' first uses are paid
there too; at ``register`` on a private stream (other clients' copies may be running on the
daemon's). Then the pointer tables the copies' kernels read are made (``upload_tables``): the
host pools' at start, the worker's pools' at ``register``. Refused (``ValueError``) on a CPU
daemon, which launches no kernel.

Why: a copy's first use of a variant compiled it on the thread that issued the copy, holding
the GIL: on an H100 with Triton's cache empty the first backups of a fresh daemon took 0.1-0.8
s and its loop answered nothing meanwhile (``scripts/first_use_cost.py``; docs/perf.md,
sixty-second session). And a copy's first use of a pool's pointer table made it and waited
for the GPU: with the engine's GPU busy each such wait waited for the daemon's time slice, and
a fresh daemon's first one-page backup took 29-34 ms against 5.4-5.5 ms now (H100, sixty-third
session).
"""
from __future__ import annotations

import time
from typing import Any, Mapping

import torch

from hicache.kernels.dispatch import Pair, warm_up_copies
from hicache.kernels.tables import LayerTable, TokenFormat, upload_tables


def _dense(name: str, row_bytes: int, device: torch.device) -> LayerTable:
    """One layer of one row on ``device``: the alignment a dense device pool of ``row_bytes``
    rows has (its stride the row size, its base as aligned as any allocation)."""
    return LayerTable([torch.empty(1, row_bytes, dtype=torch.uint8, device=device)],
                      f"device:{name}")


def warm_pools(st: Any, tables: Mapping[str, LayerTable] | None = None) -> tuple[int, float]:
    """See the module docstring. ``st``: the ``DaemonState`` (layout, host tables, device)."""
    device = torch.device(st.device)
    if device.type != "cuda":
        raise ValueError(f"warm_pools: a {device.type} daemon launches no copy kernel")
    t0 = time.perf_counter()
    backups: list[Pair] = []
    loads: list[Pair] = []
    for name, spec in st.layout.pools.items():
        host = st.host_tables[name]
        dev = tables[name] if tables is not None else _dense(name, spec.page_bytes, device)
        fmt = TokenFormat.from_spec(spec) if spec.token_granular else None
        backups.append((dev, host, fmt))
        loads.append((host, dev, fmt))
    # at start, on the streams the copies will take (nothing runs there yet); at ``register``
    # on a private one: other clients' copies may be in flight on the daemon's streams
    streams = st.scheduler.streams if tables is None else {}
    launches = warm_up_copies(backups, device, streams.get("backup"))
    launches += warm_up_copies(loads, device, streams.get("load"))
    # the pointer tables the copies' kernels read (the host pools' at start, the worker's at
    # ``register``): made here, one wait for all, not at a copy that each waits for alone
    key = torch.empty(0, device=device).device  # (the tables' key: the device with its index)
    upload_tables([*st.host_tables.values(), *(tables or {}).values()], key)
    return launches, time.perf_counter() - t0
