"""Register KV buffers the engine allocated itself, then back a page up and load it back.

An engine keeps its own device pools (its allocator, its tensors); the daemon only needs a
handle per pool and layer. This example plays the engine:

1. it allocates every pool of a DSV4 stage as ONE tensor per pool, ``[layers, rows, row_bytes]``
   (on ``cuda:N``, or on CPU inside one sealed memfd, which it hands the daemon to map);
2. it builds the ``register`` handles from per-layer views (``hicache.core.ipc.export_buffers``
   on a GPU; ``{"kind": "memfd", "fd": 0, ...}`` on CPU) and registers them;
3. it writes a pattern into device row 3 of every pool of space ``page``, backs that row up to a
   host row, overwrites the device row, loads the host row into device row 5 and checks every
   byte.

Run: ``python examples/register_engine_buffers.py [--device cpu|cuda:0]`` (it starts its own
``hicache serve`` on a private socket and stops it at the end). Exit status 0 when verified.
"""
from __future__ import annotations

import argparse
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.core.sealed_memfd import new_sealed_mapping  # noqa: E402
from hicache.engine.daemon_process import DaemonProcess  # noqa: E402

ROWS = {"page": 8, "swa_page": 8, "req_slot": 4}  # the engine's device rows per index space


def engine_pools(layout, device: str) -> tuple[dict[str, torch.Tensor], dict, list[int]]:
    """The engine's own allocation: one ``[layers, rows, row_bytes]`` uint8 tensor per pool,
    the ``buffers`` field of ``register`` (one handle per layer) and, on CPU, the descriptor
    ``register`` hands in."""
    pools: dict[str, torch.Tensor] = {}
    if device != "cpu":
        from hicache.core.ipc import export_buffers

        for name, spec in layout.pools.items():
            pools[name] = torch.zeros(spec.num_layers, ROWS[spec.index], spec.page_bytes,
                                      dtype=torch.uint8, device=device)
        return pools, export_buffers({n: list(t.unbind(0)) for n, t in pools.items()}), []
    # CPU mode: the daemon maps the engine's memory from a memfd the engine hands it, sealed
    # so that nobody can cut it under the daemon's mapping (else refused)
    sizes = {n: s.num_layers * ROWS[s.index] * s.page_bytes for n, s in layout.pools.items()}
    offsets, end = {}, 0
    for n, size in sizes.items():
        offsets[n], end = end, (end + size + 4095) // 4096 * 4096
    fd, mm = new_sealed_mapping("example-engine", end)  # memfd_create, size, F_SEAL_SHRINK...
    base = torch.frombuffer(mm, dtype=torch.uint8)
    buffers = {}
    for n, spec in layout.pools.items():
        rows, rb = ROWS[spec.index], spec.page_bytes
        pools[n] = base[offsets[n]: offsets[n] + sizes[n]].view(spec.num_layers, rows, rb)
        buffers[n] = [{"kind": "memfd", "fd": 0, "offset": offsets[n] + i * rows * rb,
                       "rows": rows, "row_bytes": rb} for i in range(spec.num_layers)]
    return pools, buffers, [fd]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--device", default="cpu", help="cpu or cuda:N")
    args = ap.parse_args()
    layout = build_layout(preset("dsv4-tiny"))
    daemon = DaemonProcess(device=args.device, preset="dsv4-tiny", device_rows=ROWS,
                           host=("--host-ratio", "2"))
    pools, buffers, fds = engine_pools(layout, args.device)
    try:
        daemon.start()
        with daemon.client() as c:
            c.register(layout=layout.to_dict(), device_rows=ROWS, buffers=buffers,
                       mode="cpu" if args.device == "cpu" else "cuda", name="example-engine",
                       fds=fds)
            host = c.alloc({"page": 1})["page"]
            page_pools = [n for n, s in layout.pools.items() if s.index == "page"]
            g = torch.Generator().manual_seed(7)
            want = {n: torch.randint(0, 256, pools[n][:, 3].shape, generator=g,
                                     dtype=torch.uint8) for n in page_pools}
            for n in page_pools:
                pools[n][:, 3] = want[n].to(pools[n].device)
            c.wait_ack(c.backup({"page": ([3], host)}))  # every pool and layer of space page
            for n in page_pools:
                pools[n][:, 3] = 0
            c.wait_ack(c.load({"page": (host, [5])}))
            if args.device != "cpu":
                torch.cuda.synchronize(args.device)
            bad = [n for n in page_pools if not torch.equal(pools[n][:, 5].cpu(), want[n])]
            c.free({"page": host})
            c.unregister()
    finally:
        daemon.close()
        for fd in fds:
            os.close(fd)
    nbytes = sum(want[n].numel() for n in want)
    print(f"register_engine_buffers: {len(page_pools)} pools, {nbytes:,} bytes backed up and "
          f"loaded back: {'verified' if not bad else f'MISMATCH in {bad}'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
