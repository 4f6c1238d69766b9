"""The daemon's malloc policy (``hicache.cli.malloc``): a freed 16 MiB block leaves the resident
set with the fixed threshold, and (glibc) stays resident without it, so the test can fail."""
from __future__ import annotations

import platform
import subprocess
import sys

import pytest

CHILD = """
import ctypes, os, sys
from hicache.cli.malloc import fix_mmap_threshold
if sys.argv[1] == "fixed":
    print(fix_mmap_threshold(), file=sys.stderr)
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
def rss():
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
n = 16 << 20
for _ in range(3):  # the first free raises glibc's dynamic threshold; later blocks use the heap
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    base = rss()
    libc.free(p)
print(base - rss())
"""


def _returned(mode: str) -> int:
    out = subprocess.run([sys.executable, "-c", CHILD, mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return int(out.stdout.strip())


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc/self/statm")
def test_freed_big_blocks_leave_the_resident_set():
    assert _returned("fixed") >= 15 << 20
    if platform.libc_ver()[0] == "glibc":
        assert _returned("default") < 1 << 20  # glibc's default keeps the freed block resident
