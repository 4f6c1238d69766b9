"""Client identity under CURVE (issue 17, item 6): each client key has a name (its file in the
daemon's clients directory); a client is bound to the key that created it, and another allowed
key presenting the same routing identity is refused and changes nothing."""
from __future__ import annotations

import os
import shutil
import time
import socket
import tempfile
from pathlib import Path

import pytest
import zmq
import zmq.auth

from hicache.controllers.server import key_names
from hicache.core import protocol as P
from hicache.fuzz.runner import DaemonRunner


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def keys():
    d = Path(tempfile.mkdtemp(prefix="hcc-keys-", dir="/tmp"))
    os.chmod(d, 0o700)
    for sub in ("server", "clients", "allowed"):
        (d / sub).mkdir(mode=0o700)
    zmq.auth.create_certificates(d / "server", "server")
    for name in ("alice", "mallory"):
        zmq.auth.create_certificates(d / "clients", name)
        shutil.copy(d / "clients" / f"{name}.key", d / "allowed" / f"{name}.key")
    for f in d.rglob("*.key_secret"):
        os.chmod(f, 0o600)
    yield d
    shutil.rmtree(d, ignore_errors=True)


class Peer:
    """A raw DEALER with a chosen routing identity and CURVE key."""

    def __init__(self, addr: str, keys: Path, who: str, ident: str) -> None:
        server_public, _ = zmq.auth.load_certificate(str(keys / "server" / "server.key"))
        public, secret = zmq.auth.load_certificate(str(keys / "clients" / f"{who}.key_secret"))
        self.s = zmq.Context.instance().socket(zmq.DEALER)
        self.s.setsockopt(zmq.ROUTING_ID, ident.encode())
        self.s.setsockopt(zmq.LINGER, 0)
        self.s.curve_serverkey, self.s.curve_publickey, self.s.curve_secretkey = \
            server_public, public, secret
        self.s.connect(addr)
        self.rid = 0

    def call(self, cmd: str, fields: dict | None = None, arrays=()) -> dict:
        self.rid += 1
        self.s.send_multipart(P.encode_request(cmd, self.rid, fields, arrays))
        assert self.s.poll(30_000, zmq.POLLIN), f"{cmd}: no reply"
        while True:
            h, arrays_ = P.decode_reply(self.s.recv_multipart())
            if h.get("k") == "reply":
                h["_arrays"] = [list(a) for a in arrays_]
                return h

    def close(self) -> None:
        self.s.close(0)


def test_key_names_come_from_the_clients_directory(keys):
    names = key_names(str(keys / "allowed"))
    assert sorted(names.values()) == ["alice", "mallory"]
    pub, _ = zmq.auth.load_certificate(str(keys / "clients" / "alice.key"))
    assert names[pub] == "alice"


def test_a_second_key_cannot_act_for_a_bound_client(keys):
    addr = f"tcp://127.0.0.1:{_free_port()}"
    probe = {"curve_server_key": str(keys / "server" / "server.key"),
             "curve_secret_key": str(keys / "clients" / "alice.key_secret")}
    r = DaemonRunner(addr, extra=("--curve-secret-key", str(keys / "server" / "server.key_secret"),
                                  "--curve-clients", str(keys / "allowed")),
                     client_kw=probe, log_path=str(keys / "daemon.log"), heartbeat_timeout=60)
    r.start(ready_timeout=45)
    try:
        alice = Peer(addr, keys, "alice", "worker-0")
        got = alice.call("alloc", {"counts": {"page": 2}})
        assert got["ok"], got
        rows = got["_arrays"][got["rows"]["page"]]
        alice.close()  # gone from the socket, still a client of the daemon (rows held)
        time.sleep(1.0)  # the ROUTER keeps a routing id until the old connection is torn down

        mallory = Peer(addr, keys, "mallory", "worker-0")  # same routing identity, other key
        for cmd, f, arrays in (("free", {"rows": {"page": 0}}, [rows]), ("reset", {}, []),
                               ("alloc", {"counts": {"page": 1}}, []), ("stats", {}, [])):
            h = mallory.call(cmd, f, arrays)
            assert not h["ok"] and h["error"]["code"] == "not_owner", (cmd, h)
            assert "bound to CURVE key 'alice'" in h["error"]["message"]
        mallory.close()
        time.sleep(1.0)
        own = Peer(addr, keys, "mallory", "mallory-0")  # under its own identity: fine
        assert own.call("stats")["host"]["spaces"]["page"]["used"] == 2  # alice's rows intact
        own.close()
        time.sleep(1.0)
        alice = Peer(addr, keys, "alice", "worker-0")  # the real owner, back again
        h = alice.call("free", {"rows": {"page": 0}}, [rows])
        assert h["ok"] and h["freed"] == 2, h
        alice.close()
    finally:
        r.stop()


def test_stats_reaches_a_curve_daemon_with_its_keys_and_says_why_without(keys):
    """``hicache stats`` gives CURVE keys (a daemon with keys answers no other client): with
    them it reports; without them on loopback TCP it says no daemon answered and why that may
    be; a non-loopback address without keys, or one key alone, is refused in one line (exit 2)."""
    import subprocess
    import sys

    addr = f"tcp://127.0.0.1:{_free_port()}"
    probe = {"curve_server_key": str(keys / "server" / "server.key"),
             "curve_secret_key": str(keys / "clients" / "alice.key_secret")}
    r = DaemonRunner(addr, extra=("--curve-secret-key", str(keys / "server" / "server.key_secret"),
                                  "--curve-clients", str(keys / "allowed")),
                     client_kw=probe, log_path=str(keys / "daemon-stats.log"),
                     heartbeat_timeout=60)
    r.start(ready_timeout=45)

    def stats(*extra: str) -> subprocess.CompletedProcess:
        return subprocess.run([sys.executable, "-m", "hicache.cli", "stats", "--timeout", "2",
                               *extra], capture_output=True, text=True, timeout=60,
                              env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))

    try:
        got = stats("--socket", addr, "--curve-server-key", probe["curve_server_key"],
                    "--curve-secret-key", probe["curve_secret_key"])
        assert got.returncode == 0 and "host page:" in got.stdout, got.stderr
        got = stats("--socket", addr)
        assert got.returncode == 1 and "no daemon answered" in got.stderr
        assert "--curve-server-key and --curve-secret-key" in got.stderr
        got = stats("--socket", "tcp://10.1.2.3:5577")
        assert got.returncode == 2 and "answers CURVE clients only" in got.stderr
        assert len(got.stderr.strip().splitlines()) == 1
        got = stats("--socket", addr, "--curve-server-key", probe["curve_server_key"])
        assert got.returncode == 2 and "needs both" in got.stderr
    finally:
        r.stop()
