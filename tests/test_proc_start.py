"""``hicache.core.proc_start``: the start time that tells one process from another."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from hicache.core.proc_start import own_start, process_start


def _state(pid: int) -> bytes:
    with open(f"/proc/{pid}/stat", "rb") as f:
        return f.read().rsplit(b")", 1)[1].split()[0]


def test_a_process_that_exited_has_no_start_even_before_it_is_reaped() -> None:
    """A killed daemon that its parent has not reaped yet is a zombie: its pid still has a
    /proc entry, but nothing can copy any more, so the fence must take it for gone."""
    assert process_start(None) is None and process_start(0) is None
    child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(60)"])
    try:
        start = process_start(child.pid)
        assert start is not None and start == process_start(child.pid)
        assert start >= own_start()  # (clock ticks after boot: the child came later)
        child.kill()
        deadline = time.monotonic() + 10
        while _state(child.pid) != b"Z":  # killed, not reaped: a zombie
            assert time.monotonic() < deadline
            time.sleep(0.01)
        assert process_start(child.pid) is None
    finally:
        child.kill()
        child.wait()
    assert process_start(child.pid) is None


def test_a_forked_child_reports_its_own_start() -> None:
    """``own_start`` is read once per pid: a child forked after its parent read its own must
    report the child's start (the heartbeat's ``pid_start``), not the parent's."""
    parent = own_start()
    assert parent is not None and parent == process_start(os.getpid())
    time.sleep(0.05)  # (a few clock ticks: the child's start differs from the parent's)
    r, w = os.pipe()
    go_r, go_w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: report, then wait until the parent has read our start
        try:
            os.write(w, str(own_start()).encode())
            os.read(go_r, 1)
        finally:
            os._exit(0)
    try:
        os.close(w)
        said = int(os.read(r, 64))
        assert said == process_start(pid) and said != parent
    finally:
        os.write(go_w, b"x")
        os.waitpid(pid, 0)
        for fd in (r, go_r, go_w):
            os.close(fd)
