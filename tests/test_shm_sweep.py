"""``core.shm_file.sweep_stale``: a killed process's file of a swept prefix goes; a live
process's file, a fresh file and other names stay; a socket goes when nobody listens on it."""
from __future__ import annotations

import os
import subprocess
import sys
import time

from hicache.core.shm_file import STALE_AFTER_S, sweep_stale

SHM_PREFIX = "hicache-dev-"  # the device-pool files of earlier versions


def _dead_pid() -> int:
    p = subprocess.Popen([sys.executable, "-c", "pass"])
    p.wait()
    return p.pid


def _touch(folder, name: str, age: float) -> str:
    path = os.path.join(folder, name)
    with open(path, "wb") as f:
        f.write(b"x")
    t = time.time() - age
    os.utime(path, (t, t))
    return path


def test_stale_files_of_dead_processes_go_and_nothing_else(tmp_path):
    dead = _dead_pid()
    old = STALE_AFTER_S + 5
    gone = _touch(tmp_path, f"{SHM_PREFIX}{dead}-0a1b2c", old)
    gone_tagged = _touch(tmp_path, f"{SHM_PREFIX}sglang-{dead}-0a1b2d", old)
    live = _touch(tmp_path, f"{SHM_PREFIX}{os.getpid()}-0a1b2e", old)
    young = _touch(tmp_path, f"{SHM_PREFIX}{dead}-0a1b2f", 1.0)
    other = _touch(tmp_path, f"something-{dead}-0a1b30", old)
    assert sweep_stale(str(tmp_path), (SHM_PREFIX,)) == 2
    assert not os.path.exists(gone) and not os.path.exists(gone_tagged)
    assert all(os.path.exists(p) for p in (live, young, other))
    assert sweep_stale(str(tmp_path), (SHM_PREFIX,)) == 0  # nothing left to remove


def test_a_socket_goes_when_nobody_listens_whatever_its_pid(tmp_path):
    """A socket named with a pid that is nobody's here stays while something listens on it (a
    live daemon in another pid namespace), of either kind; one nobody listens on goes, even
    named with a live pid (that pid was reused)."""
    import socket

    dead, old = _dead_pid(), STALE_AFTER_S + 5
    held = []
    paths = {}
    for name, kind, listen in (("dgram", socket.SOCK_DGRAM, True),
                               ("stream", socket.SOCK_STREAM, True),
                               ("orphan", socket.SOCK_DGRAM, False)):
        pid = os.getpid() if name == "orphan" else dead
        path = str(tmp_path / f"hicache-wake-{pid}-{name.encode().hex()}")
        s = socket.socket(socket.AF_UNIX, kind)
        s.bind(path)
        if kind == socket.SOCK_STREAM:
            s.listen(1)
        if listen:
            held.append(s)
        else:
            s.close()  # the file stays, nobody bound to it
        t = time.time() - old
        os.utime(path, (t, t))
        paths[name] = path
    try:
        assert sweep_stale(str(tmp_path), ("hicache-wake-",)) == 1
        assert os.path.exists(paths["dgram"]) and os.path.exists(paths["stream"])
        assert not os.path.exists(paths["orphan"])
    finally:
        for s in held:
            s.close()


def test_a_socket_whose_backlog_is_full_is_live_and_does_not_hang_the_sweep(tmp_path):
    import socket

    path = str(tmp_path / f"hicache-wake-{_dead_pid()}-0f")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(0)
    filled = []
    while True:  # connects nobody accepts, until the backlog is full
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            c.connect(path)
        except BlockingIOError:
            c.close()
            break
        filled.append(c)
    t = time.time() - STALE_AFTER_S - 5
    os.utime(path, (t, t))
    try:
        t0 = time.monotonic()
        assert sweep_stale(str(tmp_path), ("hicache-wake-",)) == 0
        assert time.monotonic() - t0 < 1.0 and os.path.exists(path)
    finally:
        for c in filled:
            c.close()
        srv.close()
