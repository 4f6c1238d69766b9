"""How much memory a daemon may take: light (no torch), so ``serve`` asks before torch loads.

Contract:

* ``available_bytes() -> (bytes, what)``: the smaller of the OS's available memory
  (``MemAvailable``, psutil) and the memory cgroup's room (v2, else v1; ``cgroup_room``), and
  how to say it ("of memory is available", "is left under this container's memory limit").
* ``default_reserve(total)``: what is left to the OS and the serving process, 1/32 of RAM and
  at least 1 GiB.
* ``check_memory_for(nbytes, reserve=None, pinned=True)`` raises ``CapacityError`` (one line:
  the size, what is available, the reserve, the most that fits) when ``nbytes`` does not fit in
  the available memory less the reserve; ``pinned`` words it as pinning, else as allocating
  (CPU mode pins nothing). The arena asks it before it maps, ``serve``'s preflight before
  torch loads (the host tier and the L3 segment together).
"""
from __future__ import annotations

import psutil

from hicache.core.errors import CapacityError
from hicache.core.sizes import format_bytes

GiB = 1 << 30


def default_reserve(total: int) -> int:
    return max(GiB, total // 32)


def cgroup_room(root: str = "/sys/fs/cgroup") -> int | None:
    """Bytes the memory cgroup still allows (v2, else v1), or ``None`` without a limit."""
    for limit_f, usage_f in ((f"{root}/memory.max", f"{root}/memory.current"),
                             (f"{root}/memory/memory.limit_in_bytes",
                              f"{root}/memory/memory.usage_in_bytes")):
        try:
            with open(limit_f, encoding="ascii") as f:
                limit = f.read().strip()
            with open(usage_f, encoding="ascii") as f:
                usage = int(f.read().strip())
        except (OSError, ValueError):
            continue
        if limit == "max" or not limit.isdigit() or int(limit) >= 1 << 60:
            return None
        return max(0, int(limit) - usage)
    return None


def available_bytes() -> tuple[int, str]:
    avail, what = int(psutil.virtual_memory().available), "of memory is available"
    room = cgroup_room()
    if room is not None and room < avail:
        avail, what = room, "is left under this container's memory limit"
    return avail, what


def check_memory_for(nbytes: int, reserve: int | None = None, pinned: bool = True) -> None:
    avail, what = available_bytes()
    reserve = default_reserve(psutil.virtual_memory().total) if reserve is None else reserve
    room = max(0, avail - reserve)
    if nbytes > room:
        verb, done = ("pin", "pinned") if pinned else ("allocate", "allocated")
        raise CapacityError(
            f"cannot {verb} {format_bytes(nbytes)}: {format_bytes(avail)} {what} and "
            f"{format_bytes(reserve)} is kept in reserve, so at most {format_bytes(room)} "
            f"can be {done}"
        )
