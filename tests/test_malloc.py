"""The daemon's malloc policy (``hicache.cli.malloc``): a freed 16 MiB block leaves the resident
set with the fixed threshold, and (glibc) stays resident without it, so the test can fail; a
2 MiB block freed and taken again (a command's temporary) stays in the heap with the policy, where
a fixed mmap threshold alone gave its pages back and faulted them in again on every command."""
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


FAULTS = """
import ctypes, resource, sys
from hicache.cli.malloc import M_MMAP_THRESHOLD, MMAP_THRESHOLD, fix_mmap_threshold
libc = ctypes.CDLL(None)
if sys.argv[1] == "policy":
    print(fix_mmap_threshold(), file=sys.stderr)
else:  # the policy before the thirty-second session: the mmap threshold alone
    libc.mallopt.argtypes = [ctypes.c_int, ctypes.c_int]
    assert libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD) == 1
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, [ctypes.c_size_t]
libc.free.argtypes = [ctypes.c_void_p]
n, cycles = 2 << 20, 20
def cycle():
    p = libc.malloc(n)
    ctypes.memset(p, 1, n)
    libc.free(p)
cycle()
before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
for _ in range(cycles):
    cycle()
print((resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before) / cycles)
"""


def _faults_per_cycle(mode: str) -> float:
    out = subprocess.run([sys.executable, "-c", FAULTS, mode], capture_output=True, text=True,
                         check=True, timeout=60)
    return float(out.stdout.strip())


@pytest.mark.skipif(platform.libc_ver()[0] != "glibc", reason="glibc's trim threshold")
def test_a_freed_temporary_under_the_mmap_threshold_stays_in_the_heap():
    pages = (2 << 20) // 4096
    assert _faults_per_cycle("policy") < pages / 20
    # the mmap threshold alone leaves the trim threshold at 128 KiB: every cycle faults again
    assert _faults_per_cycle("mmap-only") > pages / 2
