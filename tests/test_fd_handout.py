"""The daemon's descriptor hand-out (``hicache.core.fd_handout``) and its non-dumpable process
(``hicache.core.dumpable``).

* hand-out: the socket is an abstract name (no file anyone could move aside) that a process of
  another uid is closed on by; a descriptor taken is the memory offered (a write through one
  shows in the other) and close-on-exec; each offer is one hand-out; a wrong token, a withdrawn
  offer and a closed hand-out are refused with the reason and change nothing; connections that
  never send their token hold no other back and are closed after ``TOKEN_WAIT_S``; past
  ``MAX_CONNECTIONS`` the oldest silent one makes room (told why); a burst of clients past the
  backlog wait for it, not fail; ``close`` ends the name and every duplicate (an abstract name
  refused says where it is reachable); a memfd that is not sealed against resizing is refused
  by the client.
* daemon: ``hicache serve`` says it is not dumpable, and a process of its uid (without
  ``CAP_SYS_PTRACE``, as the daemon) can neither open its descriptors (a client's channel
  memfd) nor read its memory; with ``--dumpable`` the same process can (the test's own check).
* namespaces: an engine in another pid namespace (its own /proc) gets its channel and its
  HiSparse region, which the daemon's /proc links could never give it.
* error paths: an accept that fails for want of descriptors waits between tries (no busy
  loop) and serves the client once they are free; ``hicache serve`` whose ``PR_SET_DUMPABLE``
  the kernel refuses stops with one line (exit 2); the flag reads back what was set.
"""
from __future__ import annotations

import errno
import fcntl
import json
import mmap
import os
import socket
import subprocess
import sys
import threading
import time

import pytest

from hicache.core import fd_handout as F
from hicache.core.layout import build_layout, preset
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.device_pools import DevicePools

ROWS = {"page": 64, "swa_page": 64, "req_slot": 4}
DEV_ROWS = ",".join(f"{k}={v}" for k, v in ROWS.items())


@pytest.fixture
def handout():
    h = F.FdHandout.create()
    yield h
    h.close()


def _memfd(n: int = 4096) -> tuple[int, mmap.mmap]:
    fd = os.memfd_create("hicache-test", os.MFD_CLOEXEC)
    os.ftruncate(fd, n)
    return fd, mmap.mmap(fd, n)


def test_a_descriptor_taken_is_the_memory_offered_once_per_offer(handout) -> None:
    assert handout.path.startswith(f"@{F.FDS_PREFIX}{os.getpid()}-")
    assert not os.path.exists(handout.path)  # no file: nothing to rename or replace
    fd, mm = _memfd()
    handout.offer(fd, 11)
    handout.offer(fd, 11)  # two replies named it: two hand-outs
    os.close(fd)  # the owner may close its own: the hand-out keeps a duplicate
    assert handout.pending == 2
    got = [F.fetch_fd(handout.path, 11, "test memory") for _ in range(2)]
    assert handout.pending == 0
    with pytest.raises(OSError, match="test memory .* no memory is offered for this token"):
        F.fetch_fd(handout.path, 11, "test memory")
    for g in got:
        assert fcntl.fcntl(g, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        m = mmap.mmap(g, 4096)
        mm[100:104] = b"abcd"
        assert m[100:104] == b"abcd"  # one memory
        m.close()
        os.close(g)
    mm.close()


def _open_fds(name: str) -> int:
    """This process's descriptors of memfds named ``name`` (other tests' objects may close
    unrelated descriptors meanwhile: only these are counted)."""
    n = 0
    for fd in os.listdir("/proc/self/fd"):
        try:
            n += os.readlink(f"/proc/self/fd/{fd}").startswith(f"/memfd:{name} ")
        except OSError:  # closed meanwhile (the listing's own descriptor, say)
            pass
    return n


def test_an_intake_takes_the_descriptors_handed_in_once(handout) -> None:
    """``expect`` / ``send_fds`` / ``take``: the same files come in, close-on-exec, once; a
    wrong count, an unknown token, descriptors sent for an offer's token, and a second hand-in
    are refused with a reason and leave nothing open; ``withdraw`` and ``close`` close what
    came in and was not taken."""
    def memfd(name: str) -> tuple[int, mmap.mmap]:
        fd = os.memfd_create(name, os.MFD_CLOEXEC)
        os.ftruncate(fd, 4096)
        return fd, mmap.mmap(fd, 4096)

    a, ma = memfd("intake-test")
    b, mb = memfd("intake-test")
    base = _open_fds("intake-test")
    with pytest.raises(ValueError, match="1 to 64"):
        handout.expect(1, 0)
    with pytest.raises(ValueError, match="1 to 64"):
        handout.expect(1, F.MAX_INTAKE_FDS + 1)
    handout.expect(21, 2)
    with pytest.raises(ValueError, match="in use"):
        handout.expect(21, 1)
    assert handout.awaiting == 1 and handout.take(21) is None  # nothing came yet
    with pytest.raises(OSError, match="1 descriptors came, 2 expected"):
        F.send_fds(handout.path, 21, [a], "pool files")
    with pytest.raises(OSError, match="no intake is open for this token"):
        F.send_fds(handout.path, 22, [a, b], "pool files")
    handout.offer(a, 23)
    with pytest.raises(OSError, match="no intake is open for this token"):
        F.send_fds(handout.path, 23, [b], "pool files")  # an offer's token takes nothing in
    assert handout.pending == 1  # ... and the offer is still there
    handout.withdraw(23)
    F.send_fds(handout.path, 21, [a, b], "pool files")
    with pytest.raises(OSError, match="already handed in"):
        F.send_fds(handout.path, 21, [a, b], "pool files")
    got = handout.take(21)
    assert got is not None and len(got) == 2 and handout.awaiting == 0
    for g, (fd, m) in zip(got, ((a, ma), (b, mb))):
        assert fcntl.fcntl(g, fcntl.F_GETFD) & fcntl.FD_CLOEXEC
        assert os.fstat(g).st_ino == os.fstat(fd).st_ino  # the very file handed in
        os.close(g)
    assert handout.take(21) is None
    deadline = time.monotonic() + 5  # (the hand-out thread closes what a refused connection
    while _open_fds("intake-test") != base and time.monotonic() < deadline:  # sent after it
        time.sleep(0.01)  # answered)
    assert _open_fds("intake-test") == base
    handout.expect(24, 1)  # withdrawn after it came: closed
    F.send_fds(handout.path, 24, [a], "pool files")
    handout.withdraw(24)
    assert _open_fds("intake-test") == base and handout.take(24) is None
    handout.expect(25, 1)  # came, never taken: close() closes it
    F.send_fds(handout.path, 25, [b], "pool files")
    handout.close()
    assert _open_fds("intake-test") == base
    with pytest.raises(ValueError, match="closed"):
        handout.expect(26, 1)
    for fd, m in ((a, ma), (b, mb)):
        m.close()
        os.close(fd)


def test_an_offer_whose_duplicate_cannot_be_made_stands_and_says_why(handout,
                                                                     monkeypatch) -> None:
    """No descriptor left for the duplicate of an offer that has more than one hand-out left:
    the client is told why, and the offer is not spent (it was: the count went down first, and
    the client read "the daemon sent no descriptor")."""
    fd, mm = _memfd()
    handout.offer(fd, 31)
    handout.offer(fd, 31)
    real = os.dup
    calls = []

    def no_fd_left(x: int) -> int:
        calls.append(x)
        raise OSError(errno.EMFILE, "Too many open files")

    monkeypatch.setattr(F.os, "dup", no_fd_left)
    with pytest.raises(OSError, match="no descriptor left to hand out .* the offer stands"):
        F.fetch_fd(handout.path, 31, "test memory")
    monkeypatch.setattr(F.os, "dup", real)
    assert calls and handout.pending == 2
    for _ in range(2):
        os.close(F.fetch_fd(handout.path, 31, "test memory"))
    assert handout.pending == 0
    os.close(fd)
    mm.close()


def test_refusals_name_the_reason_and_change_nothing(handout) -> None:
    fd, mm = _memfd()
    handout.offer(fd, 5)
    with pytest.raises(OSError, match="no memory is offered for this token"):
        F.fetch_fd(handout.path, 6, "test memory")
    assert handout.pending == 1  # the right token still gets it
    g = F.fetch_fd(handout.path, 5, "test memory")
    os.close(g)
    handout.offer(fd, 7)
    handout.withdraw(7)
    handout.withdraw(8)  # nothing offered: nothing to do
    assert handout.pending == 0
    with pytest.raises(OSError, match="no memory is offered for this token"):
        F.fetch_fd(handout.path, 7, "test memory")
    with pytest.raises(OSError, match=r"cannot get the test memory from the daemon's socket .*"
                                      r"Connection refused"):
        F.fetch_fd(handout.path + "-nobody", 5, "test memory")
    os.close(fd)
    mm.close()


def test_silent_connections_hold_no_other_back_and_are_closed_after_the_token_wait(
        handout, monkeypatch) -> None:
    monkeypatch.setattr(F, "TOKEN_WAIT_S", 1.0)
    fd, mm = _memfd()
    handout.offer(fd, 9)
    silent = []
    for _ in range(5):  # connections that never send their token
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(F._address(handout.path))
        silent.append(c)
    half = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    half.connect(F._address(handout.path))
    half.sendall(b"\1\2\3")  # part of a token, then gone
    half.close()
    time.sleep(0.1)
    t = time.monotonic()
    g = F.fetch_fd(handout.path, 9, "test memory")
    # served beside them, not after them (after them: at least the 1 s token wait)
    assert time.monotonic() - t < 0.9
    for c in silent:
        c.settimeout(3.0)
        assert c.recv(1) == b""  # closed on after the token wait
        c.close()
    os.close(g)
    os.close(fd)
    mm.close()


def test_descriptors_sent_ahead_of_the_whole_token_are_closed_at_once(handout) -> None:
    """A peer that sent descriptors with each byte of a token it never finished had up to 64
    held per read, ~450 per connection, for the whole token wait (1,796 for 4 connections in
    the forty-third session's review; libzmq aborts the daemon when it runs out of
    descriptors). ``send_fds`` sends them with the whole token, in one message: a connection
    that sends them ahead of it is refused at once, its descriptors closed."""
    r, w = os.pipe()
    base = len(os.listdir("/proc/self/fd"))
    c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    c.connect(F._address(handout.path))
    socket.send_fds(c, [b"\1"], [r] * 64)  # 1 of the token's 8 bytes, 64 descriptors
    c.settimeout(3.0)
    got = c.recv(300)
    assert got.startswith(b"\0descriptors came before the whole token"), got
    assert c.recv(1) == b""  # then closed
    c.close()
    deadline = time.monotonic() + 2
    while len(os.listdir("/proc/self/fd")) > base and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(os.listdir("/proc/self/fd")) == base  # the 64 are closed, and the socket
    fd, mm = _memfd()  # the hand-out serves on
    handout.offer(fd, 7)
    g = F.fetch_fd(handout.path, 7, "test memory")
    os.close(g)
    os.close(fd)
    mm.close()
    os.close(r)
    os.close(w)


def test_past_the_bound_the_oldest_silent_connection_makes_room(handout, monkeypatch) -> None:
    monkeypatch.setattr(F, "MAX_CONNECTIONS", 3)
    fd, mm = _memfd()
    handout.offer(fd, 1)
    held = []
    for _ in range(3):
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        c.connect(F._address(handout.path))
        held.append(c)
        time.sleep(0.05)  # (accepted in this order)
    os.close(F.fetch_fd(handout.path, 1, "test memory"))  # a client still gets through
    held[0].settimeout(2.0)
    assert held[0].recv(200).startswith(b"\0" + b"3 connections sent no token in time")
    for c in held:
        c.close()
    os.close(fd)
    mm.close()


def test_a_client_waits_out_a_full_backlog() -> None:
    """A burst of clients past the listen backlog: a client's connect waits (bounded by the
    kernel's timeouts) where a non-blocking one failed at once with EAGAIN."""
    name = f"@hicache-test-{os.getpid()}-{time.monotonic_ns()}"
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(F._address(name))
    srv.listen(0)
    filled = []
    while True:  # connects nobody accepts yet, until the backlog is full
        c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_NONBLOCK)
        try:
            c.connect(F._address(name))
        except BlockingIOError:
            c.close()
            break
        filled.append(c)
    got: list = []

    def take() -> None:
        try:
            got.append(F.fetch_fd(name, 1, "test memory"))
        except OSError as e:
            got.append(e)

    t = threading.Thread(target=take)
    t.start()
    time.sleep(0.3)
    assert t.is_alive() and not got, got  # waiting, not failed
    fd, mm = _memfd()
    srv.settimeout(5.0)
    while t.is_alive():  # the server comes back: the filled connections first, then it
        conn, _ = srv.accept()
        conn.settimeout(0.2)
        try:
            if conn.recv(8):
                socket.send_fds(conn, [b"\1"], [fd])
        except OSError:
            pass
        conn.close()
        t.join(0.05)
    assert len(got) == 1 and isinstance(got[0], int), got
    os.close(got[0])
    for c in filled:
        c.close()
    srv.close()
    os.close(fd)
    mm.close()


def test_close_ends_the_name_and_every_duplicate() -> None:
    h = F.FdHandout.create()
    fd, mm = _memfd()
    before = set(os.listdir("/proc/self/fd"))
    for token in (1, 2, 3):
        h.offer(fd, token)
    assert len(set(os.listdir("/proc/self/fd")) - before) == 3
    h.close()
    assert set(os.listdir("/proc/self/fd")) <= before
    assert not any(t.name == "hicache-fd-handout" for t in threading.enumerate())
    with pytest.raises(OSError, match="Connection refused; the name is reachable only from the "
                                      "daemon's network namespace"):
        F.fetch_fd(h.path, 1, "test memory")
    with pytest.raises(ValueError, match="closed"):  # no duplicate made that nobody closes
        h.offer(fd, 4)
    os.close(fd)
    mm.close()


@pytest.mark.skipif(os.geteuid() != 0, reason="needs root to run a process of another uid")
def test_a_process_of_another_uid_is_closed_on(handout) -> None:
    fd, mm = _memfd()
    handout.offer(fd, 3)
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: uid nobody, the right token
        try:
            os.setgid(65534)
            os.setuid(65534)
            try:
                F.fetch_fd(handout.path, 3, "test memory")
                os.write(w, b"got it")
            except OSError as e:
                os.write(w, str(e).encode()[:500])
        finally:
            os._exit(0)
    os.close(w)
    os.waitpid(pid, 0)
    said = os.read(r, 1000).decode()
    os.close(r)
    assert "got it" not in said, said
    assert "serves processes of the daemon's uid" in said or "reset" in said, said
    assert handout.pending == 1  # its offer is still there for the client
    os.close(F.fetch_fd(handout.path, 3, "test memory"))
    os.close(fd)
    mm.close()


def test_memory_that_is_not_sealed_is_refused(handout) -> None:
    """Whoever hands a client memory it could cut under the client's mapping is refused."""
    from hicache.core.sealed_memfd import create_sealed, open_sealed

    fd, mm = _memfd()
    struct_token = (7).to_bytes(8, "little")
    mm[0:8] = struct_token
    handout.offer(fd, 7)
    with pytest.raises(ValueError, match="not sealed against resizing"):
        open_sealed(handout.path, 7, 4096, 0, "test memory")
    good = create_sealed("hicache-test", 4096, 0)
    handout.offer(good.fd, good.token)
    m = open_sealed(handout.path, good.token, 4096, 0, "test memory")
    m.close()
    good.close()
    good.mm.close()
    os.close(fd)
    mm.close()


# ---------------------------------------------------------------------------- the daemon
# Processes started without CAP_SYS_PTRACE (dropped from the bounding set, then exec: root's
# capabilities come from that set). Root keeps it otherwise, and with it may read any process;
# the daemon runs without it too, so the attacker's capabilities are no subset of the daemon's
# (which the kernel would refuse for that reason alone, dumpable or not). Not root: nothing to
# drop, the same uid already lacks it.
_NO_PTRACE = ("import ctypes, os, sys; ctypes.CDLL(None).prctl(24, 19, 0, 0, 0); "
              "os.execv(sys.executable, [sys.executable] + sys.argv[1:])")
_ATTACK = """
import json, os, sys
pid, out = int(sys.argv[1]), {"opened": [], "refused": []}
for n in os.listdir(f"/proc/{pid}/fd"):
    try:
        link = os.readlink(f"/proc/{pid}/fd/{n}")
    except OSError as e:
        out["refused"].append(e.strerror)
        continue
    if link.startswith("/memfd:hicache-chan-"):
        try:
            os.close(os.open(f"/proc/{pid}/fd/{n}", os.O_RDWR))
            out["opened"].append(link)
        except OSError as e:
            out["refused"].append(e.strerror)
try:
    os.close(os.open(f"/proc/{pid}/mem", os.O_RDONLY))
    out["mem"] = "read"
except OSError as e:
    out["mem"] = e.strerror
print(json.dumps(out))
"""


@pytest.mark.parametrize("dumpable", [False, True], ids=["default", "dumpable"])
def test_no_other_process_of_the_daemons_uid_opens_its_descriptors_or_memory(tmp_path,
                                                                              dumpable) -> None:
    sock = f"ipc://{tmp_path}/d.sock"
    cmd = [sys.executable, "-c", _NO_PTRACE, "-m", "hicache.cli", "serve", "--device", "cpu",
           "--preset", "dsv4-tiny", "--device-rows", DEV_ROWS, "--host-ratio", "2",
           "--socket", sock, "--spin-us", "2000", "--parent-pid", str(os.getpid())]
    proc = subprocess.Popen(cmd + (["--dumpable"] if dumpable else []), stdout=subprocess.PIPE,
                            stderr=subprocess.STDOUT, text=True,
                            env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    lines: list[str] = []
    try:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.append(line)
            if "hicache serve: ready" in line:
                break
        said = "".join(lines)
        assert "hicache serve: ready" in said, said
        assert ("hicache serve: dumpable (--dumpable)" if dumpable else
                "hicache serve: not dumpable") in said, said
        from hicache.engine.client import Client

        layout = build_layout(preset("dsv4-tiny"))
        with DevicePools(layout, ROWS, device="cpu") as pools:
            c = Client(sock, timeout=10.0)
            try:
                c.register(pools)
                assert c.uses_channel  # its memfd came over the hand-out socket
                r = subprocess.run([sys.executable, "-c", _NO_PTRACE, "-c", _ATTACK,
                                    str(proc.pid)], capture_output=True, text=True, timeout=60)
                assert r.returncode == 0, r.stderr
                got = json.loads(r.stdout)
                assert c.heartbeat()["registered"]
            finally:
                c.close()
    finally:
        proc.terminate()
        proc.wait(30)
    if dumpable:  # what the default prevents: the client's channel, and the daemon's memory
        assert got["opened"] and got["mem"] == "read", got
    else:
        assert not got["opened"] and got["refused"] and got["mem"] == "Permission denied", got


def _can_unshare() -> str | None:
    try:
        r = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc", "true"],
                           capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unshare: {e}"
    return None if r.returncode == 0 else f"unshare refused: {r.stderr.strip()}"


_ENGINE = """
import json, os, sys
from hicache.core.layout import build_layout, preset
from hicache.engine.client import Client
from hicache.engine.device_pools import DevicePools
rows = {"page": 8, "swa_page": 4, "req_slot": 4}
with DevicePools(build_layout(preset("dsv4-flash")), rows, device="cpu") as pools:
    c = Client(sys.argv[1], timeout=10.0)
    c.register(pools)
    shm = c.map_sparse_region()
    shm.layers[0][1].fill_(5)
    print(json.dumps({"pid": os.getpid(), "procs": len([p for p in os.listdir("/proc")
                                                        if p.isdigit()]),
                      "channel": c.uses_channel, "why": c.channel_refused,
                      "rows": shm.rows}))
    c.unregister()
    c.close()
"""


def in_new_pid_namespace(script: str, address: str) -> dict:
    """Run ``script`` (with the daemon's ``address`` as its argument) in a new pid namespace
    with its own /proc (skip where none can be made); the JSON its last line prints."""
    why = _can_unshare()
    if why is not None:
        pytest.skip(f"needs a new pid namespace ({why})")
    r = subprocess.run(["unshare", "--pid", "--fork", "--mount", "--mount-proc",
                        sys.executable, "-c", script, address], capture_output=True,
                       text=True, timeout=120,
                       env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert r.returncode == 0, r.stderr[-3000:]
    return json.loads(r.stdout.strip().splitlines()[-1])


def test_an_engine_in_another_pid_namespace_gets_its_channel_and_region(tmp_path) -> None:
    if _can_unshare() is not None:
        pytest.skip(f"needs a new pid namespace ({_can_unshare()})")
    with DaemonProcess(device="cpu", preset="dsv4-flash", device_rows="page=8,swa_page=4,"
                       "req_slot=4", extra=("--spin-us", "2000", "--sparse-rows", "4",
                                            "--min-sparse-prompt-len", "256")) as d:
        got = in_new_pid_namespace(_ENGINE, d.address)
        assert got["pid"] < 10 and got["procs"] < 10  # its own pid namespace and /proc
        assert not os.path.exists(f"/proc/{d.pid}") or got["pid"] != d.pid
        assert got["channel"], got["why"]
        assert got["rows"] == 4


def test_a_connection_made_room_for_while_its_token_waits_is_skipped(handout, monkeypatch,
                                                                     caplog) -> None:
    """At the bound, the oldest silent connection is closed by the accept of a new one; if
    its token arrived in the same turn, the loop must skip it, not fail (the thread serves
    on)."""
    monkeypatch.setattr(F, "MAX_CONNECTIONS", 1)
    fd, mm = _memfd()
    for _ in range(20):
        handout.offer(fd, 2)
    for _ in range(20):
        old = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        old.connect(F._address(handout.path))
        time.sleep(0.02)  # accepted: it holds the one place
        new = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        new.connect(F._address(handout.path))
        try:  # its token and the new connect in one turn of the loop, as often as not
            old.send((2).to_bytes(8, "little"))
        except OSError:  # closed on already (made room for)
            pass
        new.close()
        old.close()
    time.sleep(0.1)
    assert any(t.name == "hicache-fd-handout" for t in threading.enumerate())
    os.close(F.fetch_fd(handout.path, 2, "test memory"))  # the loop still serves
    assert not [r for r in caplog.records if "serving a connection failed" in r.getMessage()]
    os.close(fd)
    mm.close()


# ----------------------------------------------------------------------------- error paths
_FILL = r'''
import errno, os, resource


def fill_descriptors(leave: int = 0) -> tuple[list[int], tuple[int, int]]:
    """Take every descriptor number this process may open (less ``leave``); the limit before."""
    limits = resource.getrlimit(resource.RLIMIT_NOFILE)
    spare = os.open(os.devnull, os.O_RDONLY)
    resource.setrlimit(resource.RLIMIT_NOFILE,
                       (max(int(x) for x in os.listdir("/proc/self/fd")) + 1, limits[1]))
    fill = [spare]
    while True:
        try:
            fill.append(os.dup(spare))
        except OSError as e:
            if e.errno != errno.EMFILE:
                raise
            break
    for _ in range(leave):
        os.close(fill.pop())
    return fill, limits


def free_descriptors(fill: list[int], limits: tuple[int, int]) -> None:
    for f in fill:
        os.close(f)
    resource.setrlimit(resource.RLIMIT_NOFILE, limits)
'''
_NO_DESCRIPTORS = _FILL + r'''
import socket, time
from hicache.core import fd_handout as F
accepts = []
real = F.FdHandout._accept
F.FdHandout._accept = lambda self, *a: (accepts.append(1), real(self, *a))[1]
h = F.FdHandout.create()
fd = os.memfd_create("t", os.MFD_CLOEXEC)
os.ftruncate(fd, 4096)
h.offer(fd, 3)
c = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
fill, limits = fill_descriptors()
c.connect(F._address(h.path))  # queued in the backlog; the client's socket exists already
c.sendall(F._TOKEN.pack(3))
time.sleep(1.0)
tries = len(accepts)  # accepts that failed (EMFILE) over that second
free_descriptors(fill, limits)
c.settimeout(5.0)
msg, fds = F._receive(c)
print(tries, msg[:1] == b"\1", len(fds), flush=True)
h.close()
'''
_SUBPROCESS_ENV = {k: v for k, v in os.environ.items() if not k.startswith("HICACHE_")}


_ONE_DESCRIPTOR_LEFT = _FILL + r'''
from hicache.core import fd_handout as F
before = sorted(os.listdir("/proc/self/fd"))
fill, limits = fill_descriptors(leave=1)  # one left: the socket gets it, its selector none
try:
    F.FdHandout.create()
    print("created")
except OSError as e:
    print("refused", e.errno)
free_descriptors(fill, limits)
print(sorted(os.listdir("/proc/self/fd")) == before)
'''


def test_a_hand_out_that_cannot_make_its_selector_fails_at_create_and_leaves_nothing_open(
        ) -> None:
    """One descriptor left: the socket takes it and the thread's selector (epoll) finds none.
    ``create`` raises ``EMFILE`` and closes the socket. On the code before, the selector was
    made by the thread, which died of it after ``create`` had returned: every later hand-out
    timed out with nothing said."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _ONE_DESCRIPTOR_LEFT], capture_output=True,
                         text=True, timeout=60, cwd=root, env=_SUBPROCESS_ENV)
    assert out.returncode == 0, out.stderr
    assert out.stdout.split() == ["refused", "24", "True"], out.stdout + out.stderr
    assert "Exception in thread" not in out.stderr


def test_an_accept_without_a_descriptor_left_waits_and_then_serves() -> None:
    """The hand-out thread's accept fails (EMFILE) while the process has no descriptor left:
    it waits between tries (no busy loop: a few dozen tries over a second of it, whatever the
    machine's load) and serves the waiting client once descriptors are free again."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run([sys.executable, "-c", _NO_DESCRIPTORS], capture_output=True, text=True,
                         timeout=60, cwd=root, env=_SUBPROCESS_ENV)
    assert out.returncode == 0, out.stderr
    tries, ok, n = out.stdout.split()
    assert ok == "True" and n == "1", out.stdout
    # it did try (accept failed while descriptors were gone), about every 50 ms, not spinning
    assert 1 <= int(tries) <= 60, f"{tries} accepts in the second without descriptors"


def test_serve_that_cannot_set_dumpable_says_so_in_one_line() -> None:
    """The kernel refusing ``PR_SET_DUMPABLE``: ``hicache serve`` stops before it allocates,
    with one line naming the setting and the error, exit code 2."""
    code = ("import errno, sys\n"
            "import hicache.core.dumpable as d\n"
            "def refuse(on):\n"
            "    raise OSError(errno.EPERM, 'prctl(4): Operation not permitted')\n"
            "d.set_dumpable = refuse\n"
            "from hicache.cli import main\n"
            "sys.exit(main(['serve', '--device', 'cpu', '--preset', 'dsv4-tiny',\n"
            "               '--device-rows', 'page=8,swa_page=8,req_slot=2']))\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                         env=_SUBPROCESS_ENV)
    assert out.returncode == 2, (out.returncode, out.stdout, out.stderr)
    lines = out.stderr.strip().splitlines()
    assert lines == ["hicache serve: error: --dumpable off: cannot set it ([Errno 1] prctl(4): "
                     "Operation not permitted)"], out.stderr
    assert "ready" not in out.stdout


def test_dumpable_round_trips_and_a_bad_prctl_names_its_error() -> None:
    code = ("from hicache.core import dumpable as d\n"
            "d.set_dumpable(False); a = d.is_dumpable()\n"
            "d.set_dumpable(True); b = d.is_dumpable()\n"
            "try:\n"
            "    d._prctl(9999)\n"
            "except OSError as e:\n"
            "    print(a, b, e.errno, e.strerror)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert out.stdout.strip() == "False True 22 prctl(9999): Invalid argument", out


def test_a_hand_out_whose_thread_cannot_start_fails_at_create_and_leaves_nothing_open(
        monkeypatch) -> None:
    """No thread left (``RuntimeError`` from ``Thread.start``): ``create`` raises ``OSError``
    (``EAGAIN``, which the commands turn into a refusal) and closes its socket and selector."""
    def no_thread(self) -> None:
        raise RuntimeError("can't start new thread")

    before = sorted(os.listdir("/proc/self/fd"))
    monkeypatch.setattr(F.threading.Thread, "start", no_thread)
    with pytest.raises(OSError, match=r"cannot start the hand-out thread \(can't start new "
                                      r"thread\)") as e:
        F.FdHandout.create()
    monkeypatch.undo()
    assert e.value.errno == errno.EAGAIN
    assert sorted(os.listdir("/proc/self/fd")) == before
