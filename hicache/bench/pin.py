"""``hicache bench pin``: bring up the pinned host arena, beside torch's pinned allocator.

Times ``PinnedArena`` (mmap + parallel NUMA-placed first touch + chunked ``cudaHostRegister``)
and, in the same run and only with CUDA, ``torch.empty(n, dtype=uint8, pin_memory=True)`` of
the same size; prints GiB/s for each, and the bytes each really pins against the bytes asked
(torch's caching host allocator rounds every block up to a power of two; we report that
rounded size, computed, plus the resident-memory growth we observed).

By default an untimed warm-up touches the size once first, so neither side pays for memory
the machine has never used (some VMs grow RAM on first use); ``--no-warmup`` skips it.
"""
from __future__ import annotations

import argparse
import json
import mmap
import sys
import time
from typing import Any

from hicache.core.errors import UsageError

GiB = 1 << 30


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--size", default="4GiB", help="arena size, e.g. 16GiB (default 4GiB)")
    p.add_argument("--device", default=None,
                   help="cuda:N or cpu (default: cuda:0 when CUDA is available, else cpu)")
    p.add_argument("--touch-threads", type=int, default=None, metavar="N",
                   help="first-touch threads (default: the GPU node's usable CPUs, max 32)")
    p.add_argument("--chunk", default="64GiB",
                   help="largest single cudaHostRegister call (default 64GiB)")
    p.add_argument("--no-warmup", action="store_true",
                   help="skip the untimed first touch of the size before measuring")
    p.add_argument("--skip-memory-check", action="store_true",
                   help="do not refuse sizes above available memory (for VMs whose RAM grows "
                        "on use, where MemTotal starts below the real limit)")
    p.add_argument("--json", action="store_true", help="print one JSON object on stdout")


def _device_index(text: str | None) -> int | None:
    import torch

    have = torch.cuda.is_available()
    if text is None:
        return 0 if have else None
    t = text.strip().lower()
    if t == "cpu":
        return None
    if t == "cuda" or t.startswith("cuda:"):
        idx = t.partition(":")[2] or "0"
        if not idx.isdigit():
            raise UsageError(f"bad device {text!r}; use cuda:N or cpu")
        if not have:
            raise UsageError(f"{text} asked but CUDA is not available here; use --device cpu")
        n = torch.cuda.device_count()
        if int(idx) >= n:
            raise UsageError(f"{text} does not exist; {n} CUDA device(s) visible")
        return int(idx)
    raise UsageError(f"bad device {text!r}; use cuda:N or cpu")


def next_pow2(n: int) -> int:
    """What torch's caching host allocator really takes for an ``n``-byte pinned tensor."""
    return 1 << (n - 1).bit_length() if n > 1 else 1


def _rss() -> int:
    import psutil

    return int(psutil.Process().memory_info().rss)


def _torch_pin(size: int, device_index: int) -> dict[str, Any]:
    import torch

    with torch.cuda.device(device_index):
        torch.cuda.synchronize()
        rss0 = _rss()
        t0 = time.perf_counter()
        x = torch.empty(size, dtype=torch.uint8, pin_memory=True)
        dt = time.perf_counter() - t0
        rss = _rss() - rss0
        pinned = x.is_pinned()
        del x
        empty = getattr(torch._C, "_host_emptyCache", None)
        if empty is not None:
            empty()  # give the cached pinned block back
    return {"torch_pin_seconds": round(dt, 4), "torch_pin_gib_per_s": round(size / GiB / dt, 3),
            "torch_pinned_bytes": next_pow2(size), "torch_rss_delta_bytes": rss,
            "torch_is_pinned": pinned}


def run(args: argparse.Namespace) -> int:
    from hicache.host_pools.arena import PinnedArena
    from hicache.host_pools.memory import available_bytes, default_reserve
    from hicache.core.sizes import format_bytes, parse_bytes

    size = parse_bytes(args.size)
    chunk = parse_bytes(args.chunk)
    if size <= 0:
        raise UsageError("--size must be positive")
    if chunk < mmap.PAGESIZE:
        raise UsageError(f"--chunk must be at least one page ({mmap.PAGESIZE} bytes), got "
                         f"{args.chunk}")
    if args.touch_threads is not None and args.touch_threads <= 0:
        raise UsageError("--touch-threads must be positive")
    dev = _device_index(args.device)
    kw = dict(touch_threads=args.touch_threads, progress=True,  # progress goes to stderr
              check_memory=not args.skip_memory_check)
    out: dict[str, Any] = {"device": "cpu" if dev is None else f"cuda:{dev}",
                           "requested_bytes": size, "warmup": not args.no_warmup}
    import psutil

    avail, what = available_bytes()
    reserve = default_reserve(psutil.virtual_memory().total)
    if size > avail - reserve and not args.skip_memory_check:
        raise UsageError(f"--size {format_bytes(size)} does not fit: {format_bytes(avail)} "
                         f"{what}, {format_bytes(reserve)} is kept in reserve, so at most "
                         f"{format_bytes(max(0, avail - reserve))} (--skip-memory-check if this "
                         "machine's memory grows on use)")
    out["available_bytes"] = avail
    if not args.no_warmup:
        with PinnedArena(size, None, **kw) as warm:  # type: ignore[arg-type]
            out["warmup_gib_per_s"] = warm.stats["gib_per_s"]
    rss0 = _rss()
    arena = PinnedArena(size, dev, chunk_bytes=chunk, **kw)  # type: ignore[arg-type]
    with arena:
        st = dict(arena.stats)
        out["arena_rss_delta_bytes"] = _rss() - rss0
        if dev is not None:
            out["arena_is_pinned"] = bool(arena.tensor(0, 1).is_pinned())
            out["device_ptr_is_host_ptr"] = st["device_ptr_is_host_ptr"]
            out["can_use_host_pointer"] = st["can_use_host_pointer"]
    out.update({
        "pinned_bytes": st["pinned_bytes"], "mapped_bytes": st["mapped_bytes"],
        "arena_seconds": st["seconds"], "arena_gib_per_s": st["gib_per_s"],
        "map_s": st["map_s"], "touch_s": st["touch_s"], "register_s": st["register_s"],
        "chunks": st["chunks"], "numa_node": st["numa_node"], "numa_policy": st["numa_policy"],
        "numa_note": st["numa_note"], "touch_threads": st["touch_threads"],
        "hugepages": st["hugepages"],
    })
    if dev is None:
        out.update({"torch_pin_seconds": None, "torch_pin_gib_per_s": None,
                    "torch_pinned_bytes": None, "arena_vs_torch": None,
                    "note": "CPU mode: nothing registered; GPU figures need a GPU"})
    else:
        out.update(_torch_pin(size, dev))
        out["torch_pinned_bytes_note"] = ("torch's caching host allocator rounds each pinned "
                                          "block up to the next power of two")
        out["arena_vs_torch"] = round(out["arena_gib_per_s"] / out["torch_pin_gib_per_s"], 2)
    if args.json:
        print(json.dumps(out, indent=1))
    else:
        _print_text(out, format_bytes)
    return 0


def _print_text(o: dict[str, Any], fb: Any) -> None:
    w = sys.stdout.write
    w(f"hicache bench pin: {fb(o['requested_bytes'])} for {o['device']}"
      f"{' (after an untimed warm-up touch)' if o['warmup'] else ''}\n")
    w(f"  numa      : node {o['numa_node']}, policy {o['numa_policy']} - {o['numa_note']}\n")
    w(f"  touching  : {o['touch_threads']} thread(s), huge pages {o['hugepages']}\n")
    over = o["pinned_bytes"] - o["requested_bytes"]
    pinned = (f"pinned {fb(o['pinned_bytes'])} (+{over} B over requested) in {o['chunks']} "
              "chunk(s)") if o["device"] != "cpu" else f"mapped {fb(o['mapped_bytes'])}, not pinned"
    w(f"  arena     : {o['arena_seconds']:.3f} s = {o['arena_gib_per_s']:.2f} GiB/s  (map "
      f"{o['map_s']:.3f} s, touch {o['touch_s']:.3f} s, register {o['register_s']:.3f} s); "
      f"{pinned}\n")
    if o["torch_pin_gib_per_s"] is None:
        w(f"  torch pin : skipped - {o['note']}\n")
        return
    tover = o["torch_pinned_bytes"] - o["requested_bytes"]
    w(f"  torch pin : {o['torch_pin_seconds']:.3f} s = {o['torch_pin_gib_per_s']:.2f} GiB/s; "
      f"takes {fb(o['torch_pinned_bytes'])} (+{fb(tover)}: power-of-two block)\n")
    w(f"  arena / torch: {o['arena_vs_torch']:.2f}x\n")
