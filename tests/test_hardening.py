"""Endpoint hardening. Each test pins one rule and fails when that rule is removed:
socket directory 0700 / socket 0600, one daemon per socket, TCP only on loopback unless allowed
and then only with CURVE, CURVE refusing clients without an allowed key, frame size caps,
CPU pools only as sealed memfds handed in, a bounded client table, no pickle / eval."""
from __future__ import annotations

import fcntl
import json
import os
import re
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import torch
import zmq

from hicache.core import protocol as P
from hicache.engine.client import Client, DaemonUnreachable
from hicache.core.config import check_address
from hicache.core.errors import UsageError
from hicache.core.fd_handout import send_fds
from hicache.fuzz.runner import DaemonRunner, RawPeer, ShmBuffers, private_address
from hicache.core.layout import build_layout, preset

ROOT = Path(__file__).resolve().parents[1]
DEV = {"page": 8, "swa_page": 4, "req_slot": 4}
MAX_CLIENTS = 24  # the shared daemon's client table


def _serve(*args: str, env: dict | None = None, timeout: float = 60) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT))
    e.update(env or {})
    return subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu",
                           "--preset", "dsv4-tiny", "--device-rows", "page=8,swa_page=4,req_slot=4",
                           "--host-ratio", "2", *args], cwd=str(ROOT), env=e,
                          capture_output=True, text=True, timeout=timeout)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def shared():
    """One daemon for the tests that only send messages to it."""
    addr, d = private_address("hch-")
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0,
                     env={"HICACHE_MAX_CLIENTS": str(MAX_CLIENTS)})
    r.start()
    yield r
    r.stop()
    shutil.rmtree(d, ignore_errors=True)


def _alive(r: DaemonRunner) -> bool:
    with Client(r.address, timeout=5) as c:
        return bool(c.heartbeat()["t"]) and r.alive()


# ----------------------------------------------------------------------------- unix socket
def test_socket_directory_0700_and_socket_0600():
    base = tempfile.mkdtemp(prefix="hch-", dir="/tmp")
    sub = os.path.join(base, "run", "hicache")  # the daemon creates both levels
    addr = f"ipc://{sub}/d.sock"
    r = DaemonRunner(addr, log_path=os.path.join(base, "daemon.log"))
    try:
        old = os.umask(0o022)  # a permissive umask must not leak into the modes
        try:
            r.start()
        finally:
            os.umask(old)
        assert stat.S_IMODE(os.stat(sub).st_mode) == 0o700
        st = os.stat(f"{sub}/d.sock")
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600
    finally:
        r.stop()
        gone = not os.path.exists(f"{sub}/d.sock")
        shutil.rmtree(base, ignore_errors=True)
    assert gone  # removed on shutdown


def test_default_socket_lives_in_a_private_runtime_dir():
    xdg = tempfile.mkdtemp(prefix="hch-xdg-", dir="/tmp")
    addr = f"ipc://{xdg}/hicache/cpu.sock"
    r = DaemonRunner(addr, socket_flag=False, env={"XDG_RUNTIME_DIR": xdg},
                     log_path=os.path.join(xdg, "daemon.log"))
    try:
        r.start()
        assert stat.S_IMODE(os.stat(f"{xdg}/hicache").st_mode) == 0o700
        assert stat.S_IMODE(os.stat(f"{xdg}/hicache/cpu.sock").st_mode) == 0o600
        p = _serve("--socket", addr, timeout=60)  # a second daemon on a live socket
        assert p.returncode == 2 and "already serves" in p.stderr, p.stderr
        assert _alive(r)
    finally:
        r.stop()
        shutil.rmtree(xdg, ignore_errors=True)


# ----------------------------------------------------------------------------- TCP and CURVE
@pytest.mark.parametrize("addr", ["tcp://0.0.0.0:5577", "tcp://10.1.2.3:5577",
                                  "tcp://example.com:5577", "tcp://*:5577"])
def test_non_loopback_tcp_needs_allow_remote_and_curve(addr):
    with pytest.raises(UsageError):
        check_address(addr)
    with pytest.raises(UsageError, match="CURVE"):
        check_address(addr, allow_remote=True)
    assert check_address(addr, allow_remote=True, curve=True) == "tcp"
    assert check_address("tcp://127.0.0.1:5577") == "tcp"
    for v6 in ("tcp://[::1]:5577", "tcp://[::]:5577"):  # IPv6 is off on the ZMQ sockets
        with pytest.raises(UsageError, match="IPv6 addresses are not supported"):
            check_address(v6, allow_remote=True, curve=True)


def test_serve_refuses_non_loopback_tcp_quickly():
    port = _free_port()
    t = time.monotonic()
    p = _serve("--socket", f"tcp://0.0.0.0:{port}")
    assert p.returncode == 2 and "not a loopback address" in p.stderr, p.stderr
    p2 = _serve("--socket", f"tcp://0.0.0.0:{port}", "--allow-remote")
    assert p2.returncode == 2 and "CURVE" in p2.stderr, p2.stderr
    assert time.monotonic() - t < 60
    assert len([x for x in p2.stderr.splitlines() if x.strip()]) == 1


@pytest.fixture(scope="module")
def keys():
    import zmq.auth

    d = Path(tempfile.mkdtemp(prefix="hch-keys-", dir="/tmp"))
    os.chmod(d, 0o700)
    for sub in ("server", "clients", "allowed", "stranger"):
        (d / sub).mkdir(mode=0o700)
    zmq.auth.create_certificates(d / "server", "server")
    zmq.auth.create_certificates(d / "clients", "worker")
    zmq.auth.create_certificates(d / "stranger", "stranger")
    shutil.copy(d / "clients" / "worker.key", d / "allowed" / "worker.key")
    for f in d.rglob("*.key_secret"):
        os.chmod(f, 0o600)
    yield d
    shutil.rmtree(d, ignore_errors=True)


def test_curve_daemon_accepts_only_allowed_client_keys(keys):
    port = _free_port()
    addr = f"tcp://127.0.0.1:{port}"
    good = {"curve_server_key": str(keys / "server" / "server.key"),
            "curve_secret_key": str(keys / "clients" / "worker.key_secret")}
    r = DaemonRunner(addr, extra=("--curve-secret-key", str(keys / "server" / "server.key_secret"),
                                  "--curve-clients", str(keys / "allowed")),
                     client_kw=good, log_path=str(keys / "daemon.log"))
    try:
        r.start(ready_timeout=45)
        with Client(addr, timeout=5, **good) as c:
            assert c.heartbeat()["registered"] is False
        with Client(addr, timeout=0.5) as c:  # no keys at all
            with pytest.raises(DaemonUnreachable):
                c.heartbeat()
        stranger = {"curve_server_key": str(keys / "server" / "server.key"),
                    "curve_secret_key": str(keys / "stranger" / "stranger.key_secret")}
        with Client(addr, timeout=0.5, **stranger) as c:  # a key the daemon does not list
            with pytest.raises(DaemonUnreachable):
                c.heartbeat()
        raw = zmq.Context.instance().socket(zmq.DEALER)  # plain ZMTP, raw bytes
        raw.setsockopt(zmq.LINGER, 0)
        raw.connect(addr)
        raw.send_multipart(P.encode_request("stats", 1))
        assert raw.poll(500, zmq.POLLIN) == 0
        raw.close(0)
        with Client(addr, timeout=5, **good) as c:
            assert c.stats()["clients"] >= 1
    finally:
        r.stop()


def test_curve_secret_key_must_be_private(keys, tmp_path):
    loose = tmp_path / "server.key_secret"
    shutil.copy(keys / "server" / "server.key_secret", loose)
    os.chmod(loose, 0o644)
    p = _serve("--socket", f"tcp://127.0.0.1:{_free_port()}", "--curve-secret-key", str(loose),
               "--curve-clients", str(keys / "allowed"))
    assert p.returncode == 2 and "readable by other users" in p.stderr, p.stderr
    p2 = _serve("--socket", f"tcp://127.0.0.1:{_free_port()}", "--curve-secret-key",
                str(keys / "server" / "server.key_secret"))  # keys without an allow list
    assert p2.returncode == 2 and "curve" in p2.stderr.lower(), p2.stderr


# ----------------------------------------------------------------------------- frame caps
def _reply(peer: RawPeer, frames: list[bytes], timeout: float = 10.0) -> dict | None:
    peer.send(frames)
    return peer.reply(timeout)


def test_oversize_header_refused_daemon_keeps_serving(shared):
    p = RawPeer(shared.address, "caps")
    try:
        head = P.encode_request("stats", 9, {"pad": "x" * (P.MAX_HEADER_BYTES + 1)})[0]
        h = _reply(p, [head])
        assert h is not None and h["ok"] is False
        assert h["error"]["code"] == "bad_frame" and str(P.MAX_HEADER_BYTES) in h["error"]["message"]
        assert p.call("heartbeat")["ok"]
    finally:
        p.close()
    assert _alive(shared)


def test_too_many_index_frames_refused(shared):
    p = RawPeer(shared.address, "caps")
    try:
        frames = P.encode_request("stats", 3) + [b"\0" * 8] * (P.MAX_INDEX_FRAMES + 1)
        h = _reply(p, frames)
        assert h is not None and h["error"]["code"] == "bad_frame"
        assert str(P.MAX_INDEX_FRAMES) in h["error"]["message"]
    finally:
        p.close()


def test_index_frame_over_the_protocol_cap_gets_an_error_reply(shared):
    p = RawPeer(shared.address, "caps")
    try:
        big = b"\0" * (P.MAX_INDEX_BYTES + 8)
        items = [{"space": "page", "src": 0, "dst": 1}]
        h = _reply(p, P.encode_request("backup", 4, {"items": items}) + [big, b"\0" * 8])
        assert h is not None, "no reply: the transport dropped a frame the protocol should refuse"
        assert h["error"]["code"] == "bad_frame" and str(P.MAX_INDEX_BYTES) in h["error"]["message"]
    finally:
        p.close()
    assert _alive(shared)


def test_message_over_the_total_cap_refused(shared):
    p = RawPeer(shared.address, "caps")
    try:
        chunk = b"\0" * P.MAX_INDEX_BYTES
        n = P.MAX_MESSAGE_BYTES // P.MAX_INDEX_BYTES + 1
        h = _reply(p, P.encode_request("stats", 5) + [chunk] * n, timeout=30)
        assert h is not None and h["error"]["code"] == "bad_frame"
        assert str(P.MAX_MESSAGE_BYTES) in h["error"]["message"]
    finally:
        p.close()
    assert _alive(shared)


def test_frame_beyond_the_transport_limit_drops_only_that_peer(shared):
    from hicache.controllers.server import TRANSPORT_MAX_FRAME

    bystander = Client(shared.address, timeout=5, name="bystander")
    bystander.heartbeat()
    p = RawPeer(shared.address, "huge")
    try:
        h = _reply(p, P.encode_request("stats", 6) + [b"\0" * (TRANSPORT_MAX_FRAME + 8)],
                   timeout=2.0)
        assert h is None  # the daemon never buffered it: the peer was disconnected
        assert bystander.stats()["ok"]
    finally:
        p.close()
        bystander.close()
    assert _alive(shared)


# ----------------------------------------------------------------------------- registration
def _hand_in(p: RawPeer, fds: list[int]) -> int:
    """Hand ``fds`` in for ``p``'s next register; the token its register names."""
    got = p.call("hand_in", {"count": len(fds)})
    send_fds(got["fd_socket"], got["fd_token"], fds, "test pools")
    return int(got["fd_token"])


def _refused(p: RawPeer, fields: dict, rid: int) -> dict:
    p.send(P.encode_request("register", rid, fields))
    h = p.reply(10)
    assert h is not None and h["ok"] is False, h
    return h["error"]


def _fds_to(pid: int, ino: int) -> int:
    """How many of process ``pid``'s descriptors open the file of inode ``ino``."""
    n = 0
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            n += os.stat(f"/proc/{pid}/fd/{fd}").st_ino == ino
        except OSError:
            pass
    return n


@pytest.mark.parametrize("what", ["unsealed_memfd", "dev_shm_file", "pipe", "hugetlb", "shm_kind",
                                  "no_hand_in", "fd_out_of_range", "unused_fd", "too_short",
                                  "sparse", "too_big_to_map", "write_sealed"])
def test_cpu_pools_must_be_sealed_memfds_handed_in(shared, what):
    """A CPU worker's pools reach the daemon only as descriptors it handed in, each sealed
    against shrinking (else a worker could cut the file under the daemon's mapping and make
    its next copy a SIGBUS: every client's work gone). Each refusal is ``bad_handle`` for the
    rule at hand, registers nothing, keeps the intake for a retry, and a retry with sealed
    pools then registers."""
    lay = build_layout(preset("dsv4-tiny"))
    extra: list[int] = []
    path = None
    with ShmBuffers(lay, DEV, tag="conf") as b:
        fields = json.loads(json.dumps(b.register_fields()))
        size = os.fstat(b.fds()[0]).st_size
        p = RawPeer(shared.address, "conf")
        try:
            if what == "unsealed_memfd":  # a memfd its maker can still truncate
                fd = os.memfd_create("hicache-test", os.MFD_CLOEXEC)
                os.ftruncate(fd, size)
                give, why = [fd], "not sealed against shrinking"
            elif what == "dev_shm_file":  # a tmpfs file by path: it cannot carry seals
                path = f"/dev/shm/hicache-test-unsealed-{os.getpid()}"
                fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
                os.ftruncate(fd, size)
                give, why = [fd], "not sealed against shrinking"
            elif what == "pipe":
                r, w = os.pipe()
                extra.append(w)
                give, why = [r], "is not a regular file"
            elif what == "hugetlb":  # sealable too, but a page missing there is a SIGBUS
                try:
                    fd = os.memfd_create("hicache-test-huge",
                                         os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING | os.MFD_HUGETLB)
                except OSError as e:
                    pytest.skip(f"no hugetlb memfd here ({e})")
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                give, why = [fd], "is not shared memory"
            elif what == "sparse":  # sealed and long enough, but no page of it allocated
                fd = os.memfd_create("hicache-test-sparse", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                give, why = [fd], "are allocated (a sparse file: reserve them first"
            elif what == "shm_kind":  # the path-named handles of earlier versions
                for hs in fields["buffers"].values():
                    for h in hs:
                        h.update(kind="shm", path="/dev/shm/x")
                        del h["fd"]
                give, why = b.fds(), "kind must be 'memfd'"
            elif what == "no_hand_in":
                give, why = [], "handed in first"
            elif what == "fd_out_of_range":
                next(iter(fields["buffers"].values()))[0]["fd"] = 1
                give, why = b.fds(), "names none of the 1 descriptors"
            elif what == "unused_fd":
                give, why = b.fds() * 2, "descriptor 1 was handed in but no buffer names it"
            elif what == "too_short":
                next(iter(fields["buffers"].values()))[-1]["offset"] = size
                give, why = b.fds(), "the buffers need"
            elif what == "write_sealed":  # passes every check, but cannot be mapped writable
                fd = os.memfd_create("hicache-test-ro", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, size)
                os.posix_fallocate(fd, 0, size)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_WRITE)
                give, why = [fd], "cannot map descriptor 0"
            else:  # a sealed 1 PiB sparse memfd, a layer named far into it: never mapped
                fd = os.memfd_create("hicache-test-huge", os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
                os.ftruncate(fd, 1 << 50)
                fcntl.fcntl(fd, fcntl.F_ADD_SEALS, fcntl.F_SEAL_SHRINK)
                for hs in fields["buffers"].values():
                    for h in hs:
                        h["offset"] = (1 << 50) - h["rows"] * h["row_bytes"]
                give, why = [fd], "are allocated (a sparse file: reserve them first"
            extra += [f for f in give if f not in b.fds()]
            if give:
                fields["fd_token"] = _hand_in(p, give)
            err = _refused(p, fields, 8)
            assert err["code"] == "bad_handle" and why in err["message"], err
            assert p.call("heartbeat")["registered"] is False
            # a retry: the refused intake stays until another replaces it
            if what in ("fd_out_of_range", "too_short", "shm_kind"):
                good = dict(b.register_fields(), fd_token=fields["fd_token"])
                assert p.call("register", good)["ok"]  # the same descriptors, right handles
            else:
                p.register(b)
            assert p.call("heartbeat")["registered"] is True
            p.call("unregister")
        finally:
            p.close()
            for f in extra:
                os.close(f)
            if path:
                os.unlink(path)
    assert _alive(shared)


def test_a_worker_cannot_shrink_its_pools_under_the_daemon(shared):
    """The pools a CPU worker registered cannot be truncated by anyone (EPERM), so the
    daemon's copies from and into them go on, byte for byte (before, a worker's /dev/shm file
    cut after register made the daemon's next copy a SIGBUS, ending it for every client)."""
    from hicache.engine.device_pools import DevicePools

    lay = build_layout(preset("dsv4-tiny"))
    with DevicePools(lay, DEV) as pools, Client(shared.address, timeout=10, channel=False) as c:
        c.register(pools)
        fd = pools.fds()[0]
        for n in (0, 4096, os.fstat(fd).st_size + 4096):
            with pytest.raises(PermissionError):
                os.ftruncate(fd, n)
        src = pools.pool("c4_kv")[0]
        src[0].copy_(torch.arange(src.shape[1], dtype=torch.int32).to(torch.uint8))
        host = c.alloc({"page": 1})["page"]
        c.wait_ack(c.backup({"c4_kv": ([0], host)}))
        want = src[0].clone()
        src[1].zero_()
        c.wait_ack(c.load({"c4_kv": (host, [1])}))
        assert torch.equal(src[1], want)
        c.unregister()
    assert _alive(shared)


def test_an_intake_is_its_clients_alone_and_closes(shared):
    """``hand_in``: another client cannot register with a client's token; a registered client
    cannot open one; counts are bounded; what an intake received is closed in the daemon once
    the registration that used it succeeded, and when a new intake replaces it."""
    lay = build_layout(preset("dsv4-tiny"))
    pid = shared.proc.pid
    a, b = RawPeer(shared.address, "owner"), RawPeer(shared.address, "thief")
    try:
        with ShmBuffers(lay, DEV, tag="own") as bufs, ShmBuffers(lay, DEV, tag="own2") as other:
            ino = os.fstat(bufs.fds()[0]).st_ino
            ino2 = os.fstat(other.fds()[0]).st_ino
            for n in (0, -1, 65):
                a.send(P.encode_request("hand_in", 3, {"count": n}))
                h = a.reply(10)
                assert h["ok"] is False and h["error"]["code"] == "bad_field", h
            first = _hand_in(a, other.fds())
            assert _fds_to(pid, ino2) == 1  # held by the intake
            token = _hand_in(a, bufs.fds())  # replaces the first: what it got is closed
            assert _fds_to(pid, ino2) == 0 and _fds_to(pid, ino) == 1
            fields = dict(bufs.register_fields(), fd_token=first)
            assert _refused(a, fields, 4)["code"] == "bad_handle"  # the replaced token
            err = _refused(b, dict(fields, fd_token=token), 5)  # another client's token
            assert err["code"] == "bad_handle" and "handed in first" in err["message"], err
            assert a.call("register", dict(fields, fd_token=token))["ok"]
            # mapped, the intake's descriptor closed: what is left is the one Python's mmap
            # keeps of its own (the intake's too would make it 2)
            assert _fds_to(pid, ino) == 1
            a.send(P.encode_request("hand_in", 6, {"count": 1}))
            h = a.reply(10)
            assert h["ok"] is False and h["error"]["code"] == "already_registered", h
            a.call("unregister")
            end = time.monotonic() + 10
            while _fds_to(pid, ino) and time.monotonic() < end:  # unmapped off the loop
                time.sleep(0.05)
            assert _fds_to(pid, ino) == 0
    finally:
        a.close()
        b.close()
    assert _alive(shared)


def test_a_silent_client_holding_only_an_intake_is_reaped_and_its_descriptors_closed():
    """A peer that handed descriptors in and then went silent is reaped at the heartbeat
    timeout, and what its intake held is closed in the daemon."""
    addr, d = private_address("hci-")
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=1.0)
    r.start()
    try:
        with ShmBuffers(build_layout(preset("dsv4-tiny")), DEV, tag="reap") as b:
            ino = os.fstat(b.fds()[0]).st_ino
            p = RawPeer(r.address, "silent")
            try:
                _hand_in(p, b.fds())
                assert _fds_to(r.proc.pid, ino) == 1
                end = time.monotonic() + 10
                while _fds_to(r.proc.pid, ino) and time.monotonic() < end:
                    time.sleep(0.1)
                assert _fds_to(r.proc.pid, ino) == 0
            finally:
                p.close()
    finally:
        r.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_intakes_are_bounded_and_an_intake_holder_is_never_forgotten_as_a_probe():
    """An open intake holds descriptors, so a full client table never forgets its client as a
    peer that holds nothing (its descriptors would leak and its register fail); all intakes
    together hold at most ``MAX_INTAKE_HELD`` descriptors (``busy`` past it) and one at most
    ``MAX_POOL_FDS``, and the daemon's open-file limit is raised from a low soft limit."""
    from hicache.controllers.handlers import MAX_INTAKE_HELD, MAX_POOL_FDS

    addr, d = private_address("hci-")
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0,
                     env={"HICACHE_MAX_CLIENTS": "3"})
    import resource
    old = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (256, old[1]))  # the daemon inherits it
    try:
        r.start()
    finally:
        resource.setrlimit(resource.RLIMIT_NOFILE, old)
    peers = []
    try:
        with open(f"/proc/{r.proc.pid}/limits") as f:
            soft = int(next(ln for ln in f if ln.startswith("Max open files")).split()[3])
        assert soft > 256, soft
        with ShmBuffers(build_layout(preset("dsv4-tiny")), DEV, tag="full") as b:
            a = RawPeer(r.address, "holder")
            peers.append(a)
            token = _hand_in(a, b.fds())
            for i in range(4):  # more probes than the table holds
                p = RawPeer(r.address, f"probe{i}")
                peers.append(p)
                p.call("heartbeat")
            assert a.call("register", dict(b.register_fields(), fd_token=token))["ok"]
            a.call("unregister")
            a.send(P.encode_request("hand_in", 9, {"count": MAX_POOL_FDS + 1}))
            h = a.reply(10)
            assert h["ok"] is False and h["error"]["code"] == "bad_field", h
    finally:
        for p in peers:
            p.close()
        r.stop()
        shutil.rmtree(d, ignore_errors=True)
    # the budget across clients, on a daemon with room for enough of them
    addr, d = private_address("hci-")
    r = DaemonRunner(addr, log_path=os.path.join(d, "daemon.log"), heartbeat_timeout=60.0)
    r.start()
    peers = []
    try:
        codes = []
        for i in range(MAX_INTAKE_HELD // MAX_POOL_FDS + 1):
            p = RawPeer(r.address, f"many{i}")
            peers.append(p)
            p.send(P.encode_request("hand_in", 2, {"count": MAX_POOL_FDS}))
            h = p.reply(10)
            codes.append("ok" if h["ok"] else h["error"]["code"])
        assert codes == ["ok"] * (MAX_INTAKE_HELD // MAX_POOL_FDS) + ["busy"], codes
        peers[0].call("hand_in", {"count": 1})  # a client replacing its own intake fits
    finally:
        for p in peers:
            p.close()
        r.stop()
        shutil.rmtree(d, ignore_errors=True)


def test_client_table_is_bounded(shared):
    """Peers that hold nothing (heartbeats only) make room for new ones when the table is full
    (the least recently seen is forgotten); the table never grows past its bound."""
    peers = []
    try:
        codes = []
        for i in range(MAX_CLIENTS + 2):
            p = RawPeer(shared.address, f"many{i}")
            peers.append(p)
            p.send(P.encode_request("heartbeat", 1))
            h = p.reply(10)
            assert h is not None
            codes.append("ok" if h["ok"] else h["error"]["code"])
        assert codes == ["ok"] * (MAX_CLIENTS + 2)
        p = RawPeer(shared.address, "counter")
        peers.append(p)
        p.send(P.encode_request("stats", 1))
        h = p.reply(10)
        assert h is not None and h["ok"] and h["clients"] <= MAX_CLIENTS
    finally:
        for p in peers:
            p.close()


def test_a_full_client_table_refuses_when_every_client_holds_something(daemon_factory):
    from hicache.engine.client import CommandRefused

    d = daemon_factory(env={"HICACHE_MAX_CLIENTS": "3"}, metrics=False)
    holders = [d.client(name=f"holder{i}", channel=False) for i in range(3)]
    try:
        for c in holders:
            c.alloc({"page": 1})  # holds a row: never forgotten to make room
        late = d.client(name="late", channel=False)
        with pytest.raises(CommandRefused) as e:
            late.heartbeat()
        assert e.value.code == "too_many_clients"
        late.close()
    finally:
        for c in holders:
            c.close()


def test_nothing_received_is_unpickled_or_evaluated():
    pat = re.compile(r"\b(pickle|marshal|shelve|dill)\b|\beval\(|\bexec\(|yaml\.load\(")
    files = [ROOT / "hicache" / "core" / "protocol.py", ROOT / "hicache" / "engine" / "client.py",
             *sorted((ROOT / "controllers").glob("*.py"))]
    hits = [f"{f.name}:{i + 1}: {line.strip()}" for f in files
            for i, line in enumerate(f.read_text().splitlines()) if pat.search(line)]
    assert not hits, hits


def test_a_gpu_layer_off_a_4_byte_boundary_is_refused_at_register():
    """The segment kernels move 4-byte words at least: a layer a client places 1-3 bytes off
    a word boundary in its allocation is refused when it registers. (Before, the first copy
    whose segment plan held it failed, and for a load's later layers that came after layer
    0's copies had gone out.)"""
    from hicache.controllers.device_buffers import _ipc_record
    from hicache.core.ipc import encode_b64
    from hicache.core.protocol import ProtocolError

    h = {"handle": encode_b64(b"h" * 66), "ref_counter_offset": 0, "storage_bytes": 1 << 20,
         "storage_offset": 512, "offset": 4096, "rows": 4, "row_bytes": 1728}
    assert _ipc_record(h, "buffers[c128_kv][0]")["offset"] == 4096
    assert _ipc_record({**h, "storage_offset": 2, "offset": 2}, "w")["offset"] == 2  # 4 in all
    for so, off in ((0, 1), (512, 4098), (3, 0)):
        with pytest.raises(ProtocolError, match=f"starts {so + off} bytes into its CUDA "
                                                r"allocation, not on a 4-byte boundary") as e:
            _ipc_record({**h, "storage_offset": so, "offset": off}, "buffers[c128_kv][1]")
        assert e.value.code == "bad_handle" and str(e.value).startswith("buffers[c128_kv][1]: ")


def test_cuda_ipc_fields_are_checked_before_torch_opens_them():
    """``register`` in GPU mode: torch decrements ``ref_counter_offset``'s int64 in the mapped
    counter file when a shared storage goes, and opens the counter file the client names. An
    offset past the file's 10,000 slots (it segfaulted the daemon on an H200), a name that is
    not a torch counter file, or handles of the wrong size are refused before torch sees them."""
    from hicache.controllers.device_buffers import _check_ipc_fields
    from hicache.core.ipc import encode_b64
    from hicache.core.protocol import ProtocolError

    good = {"handle": encode_b64(b"h" * 66), "event": encode_b64(b"e" * 64),
            "ref_counter": encode_b64(b"/torch_123_456_7"), "ref_counter_offset": 9_999}
    _check_ipc_fields(good, "buffers[c4_kv][0]")
    _check_ipc_fields({**good, "event": None, "ref_counter": None}, "buffers[c4_kv][0]")
    for k, v, msg in (("ref_counter_offset", 10_000, "outside the counter file"),
                      ("ref_counter_offset", 1 << 40, "outside the counter file"),
                      ("ref_counter_offset", -1, "non-negative"),
                      ("ref_counter", encode_b64(b"/dev/shm/other"), "torch counter file"),
                      ("ref_counter", encode_b64(b"/torch_1_2_3/../x"), "torch counter file"),
                      ("handle", encode_b64(b"h" * 63), "is 63 bytes"),
                      ("handle", encode_b64(b"h" * 1024), "is 1024 bytes"),
                      ("event", encode_b64(b"e" * 65), "is 65 bytes")):
        with pytest.raises(ProtocolError, match=msg) as e:
            _check_ipc_fields({**good, k: v}, "buffers[c4_kv][0]")
        assert str(e.value).startswith("buffers[c4_kv][0]: ") and "\n" not in str(e.value)


@pytest.mark.parametrize("v", [b"true", b"1.0"])
def test_a_protocol_version_of_another_type_is_refused(shared, v):
    """``"v": true`` and ``"v": 1.0`` equal 1 in Python: both are ``bad_version`` (they were
    served as v1)."""
    p = RawPeer(shared.address, "ver")
    try:
        p.send([b'{"v":' + v + b',"cmd":"heartbeat","id":5}'])
        h = p.reply(10.0)
        assert h is not None and h["ok"] is False and h["error"]["code"] == "bad_version", h
    finally:
        p.close()
