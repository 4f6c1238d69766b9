"""What an operator's review (CPU mode) found rough: each now refused or reported in one line.

* ``shm_dirs`` that does not exist or is not writable is refused at start-up, before anything
  is allocated (it used to pass, and every engine then lost its shared-memory channel).
* ``--socket tcp://[::1]:PORT`` is refused by the address check (it used to pin the arena, then
  fail "No such device").
* Settings without a flag are named by their TOML key (and where they came from), never as a
  flag that does not exist; a mistyped TOML key or table gets the nearest name; ``serve -h``
  shows ``--write-policy``'s default.
* ``hicache stats`` on an ipc path with no socket reports at once; ``stats -h`` shows the
  timeout's default.
* ``hicache demo``: a busy ``--demo-metrics-port`` and a ``--host-ratio`` of 1 or less (without
  ``--force``) are one usage line.
* ``bench soak``'s report says what it counts; the Grafana Process row filters as the others.
"""
from __future__ import annotations

import json
import os
import re
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from hicache.core import config
from hicache.core.config import check_address, load_config
from hicache.core.errors import UsageError

ROOT = Path(__file__).resolve().parents[1]
ROWS = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4", "host_ratio": "2"}


def _cli(*argv: str, env: dict | None = None, timeout: float = 60
         ) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "hicache.cli", *argv], cwd=str(ROOT), env=e,
                          capture_output=True, text=True, timeout=timeout)


# ----------------------------------------------------------------------- 1. shm_dirs
def test_shm_dirs_that_do_not_exist_or_are_no_folder_are_refused(tmp_path):
    with pytest.raises(UsageError) as e:
        load_config(ROWS, env={"HICACHE_SHM_DIRS": "/nonexistent-hicache"})
    assert str(e.value) == ("shm_dirs: /nonexistent-hicache does not exist: the daemon makes "
                            "its wake-up socket there, and without it engines get no "
                            "shared-memory channel (from HICACHE_SHM_DIRS)")
    f = tmp_path / "file"
    f.write_text("")
    with pytest.raises(UsageError, match=re.escape(f"shm_dirs: {f} is not a folder")):
        load_config(ROWS, env={"HICACHE_SHM_DIRS": f"{f}:{tmp_path}"})  # the first folder
    load_config(ROWS, env={"HICACHE_SHM_DIRS": f"{tmp_path}:/nonexistent-hicache"})  # unused
    toml = tmp_path / "s.toml"
    toml.write_text(f'shm_dirs = ["{tmp_path}/gone"]\n')
    with pytest.raises(UsageError, match=re.escape(f"(from shm_dirs in config file {toml})")):
        load_config(ROWS, str(toml), env={})
    assert load_config(ROWS, env={"HICACHE_SHM_DIRS": str(tmp_path)}).shm_dirs == (
        str(tmp_path),)


def test_a_shm_dir_this_user_cannot_write_is_refused(tmp_path, monkeypatch):
    ro = tmp_path / "ro"
    ro.mkdir()
    real = os.access
    # (root writes anywhere mode bits say it cannot: ask access() the way a plain user would)
    monkeypatch.setattr(config.os, "access",
                        lambda p, m, *a, **k: False if str(p) == str(ro) else real(p, m, *a, **k))
    with pytest.raises(UsageError, match=re.escape(f"shm_dirs: {ro} is not writable by this "
                                                   "user")):
        load_config(ROWS, env={"HICACHE_SHM_DIRS": str(ro)})


def test_serve_refuses_a_bad_shm_dir_before_it_allocates(tmp_path):
    """A host tier larger than any machine: had the arena come first, this would say "cannot
    allocate"; the folder is refused before, in one line, exit 2."""
    r = _cli("serve", "--preset", "dsv4-tiny", "--kv-mem", "64MiB", "--host-mem", "64TiB",
             "--socket", f"ipc://{tmp_path}/d.sock", env={"HICACHE_SHM_DIRS": "/nonexistent"})
    assert r.returncode == 2 and r.stdout == "", (r.stdout, r.stderr)
    assert r.stderr.splitlines() == [
        "hicache serve: error: shm_dirs: /nonexistent does not exist: the daemon makes its "
        "wake-up socket there, and without it engines get no shared-memory channel (from "
        "HICACHE_SHM_DIRS)"]


# ----------------------------------------------------------------------- 2. IPv6 tcp
@pytest.mark.parametrize("addr", ["tcp://[::1]:5599", "tcp://[fe80::1]:5599", "tcp://::1:5599"])
def test_ipv6_tcp_addresses_are_refused_naming_127_0_0_1(addr):
    with pytest.raises(UsageError, match=re.escape("IPv6 addresses are not supported; use "
                                                   "tcp://127.0.0.1:PORT")):
        check_address(addr, allow_remote=True, curve=True)
    with pytest.raises(UsageError, match="IPv6"):
        load_config({**ROWS, "socket": addr}, env={})
    assert check_address("tcp://127.0.0.1:5599") == "tcp"


def test_serve_refuses_ipv6_before_it_allocates(tmp_path):
    r = _cli("serve", "--preset", "dsv4-tiny", "--kv-mem", "64MiB", "--host-mem", "64TiB",
             "--socket", "tcp://[::1]:19461")
    assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r.stderr
    assert "IPv6 addresses are not supported; use tcp://127.0.0.1:PORT" in r.stderr


# ----------------------------------------------------------------------- 3. names
@pytest.mark.parametrize("name, value", [("max_clients", "0"), ("ack_retention", "-1"),
                                         ("load_event_sets", "0")])
def test_a_setting_without_a_flag_is_named_by_its_key_and_source(name, value, tmp_path):
    env = f"HICACHE_{name.upper()}"
    with pytest.raises(UsageError) as e:
        load_config(ROWS, env={env: value})
    assert str(e.value) == f"{name} must be positive, got {value} (from {env})"
    f = tmp_path / "s.toml"
    f.write_text(f"{name} = {value}\n")
    with pytest.raises(UsageError) as e:
        load_config(ROWS, str(f), env={})
    assert str(e.value) == f"{name} must be positive, got {value} (from {name} in config file {f})"
    assert "--" + name.replace("_", "-") not in str(e.value)


def test_sparse_clients_names_max_clients_by_its_key():
    with pytest.raises(UsageError) as e:
        load_config({**ROWS, "sparse_rows": "4", "sparse_clients": "9"},
                    env={"HICACHE_MAX_CLIENTS": "8"})
    assert str(e.value) == ("--sparse-clients must be 1..8 (max_clients), got 9 (from "
                            "HICACHE_MAX_CLIENTS)")


@pytest.mark.parametrize("text, msg", [
    ('host_mme = "1GiB"\n', "unknown setting 'host_mme' (did you mean 'host_mem'?); "
                            "docs/config.md lists the settings"),
    ('[serve]\nhost-mme = "1GiB"\n', "unknown setting 'host-mme' (did you mean 'host_mem'?)"),
    ('[server]\nhost_mem = "1GiB"\n', "unknown table [server] (did you mean [serve]?); "
                                      "settings go at the top level or under [serve]"),
    ('[device_row]\npage = 8\n', "unknown table [device_row] (did you mean 'device_rows'?)"),
    ('zzqx = 1\n', "unknown setting 'zzqx'; docs/config.md lists the settings"),
])
def test_a_mistyped_toml_key_or_table_gets_the_nearest_name(text, msg, tmp_path):
    f = tmp_path / "s.toml"
    f.write_text(text)
    with pytest.raises(UsageError) as e:
        load_config(ROWS, str(f), env={})
    assert msg in str(e.value) and "host_ratio, " not in str(e.value), str(e.value)  # no dump


def test_serve_help_shows_the_write_policy_default(capsys):
    from hicache.cli import main

    with pytest.raises(SystemExit):
        main(["serve", "-h"])
    out = " ".join(capsys.readouterr().out.split())
    m = re.search(r"--write-policy POLICY (.*?)(--|$)", out)
    assert m and "(default: write_through)" in m.group(1), out


# ----------------------------------------------------------------------- 4. stats
def test_stats_on_a_missing_ipc_socket_says_so_at_once(tmp_path, capsys):
    from hicache.cli import main

    t0 = time.monotonic()
    assert main(["stats", "--socket", f"ipc://{tmp_path}/none.sock", "--timeout", "5"]) == 1
    assert time.monotonic() - t0 < 2.0  # not the 5 s timeout
    assert capsys.readouterr().err.splitlines() == [
        f"hicache stats: no socket at {tmp_path}/none.sock (is the daemon running?)"]
    f = tmp_path / "plain"
    f.write_text("")
    assert main(["stats", "--socket", f"ipc://{f}", "--timeout", "5"]) == 1
    assert capsys.readouterr().err.strip() == f"hicache stats: {f} is not a socket (no daemon " \
                                              "serves it)"
    # a daemon holds the socket's lock but its socket file is gone (a /tmp cleaner): said so,
    # not "is the daemon running?" while a start is refused "another daemon already serves"
    import fcntl

    lock = os.open(f"{tmp_path}/gone.sock.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(lock, fcntl.LOCK_EX)  # as the daemon's ``SocketLock`` holds it
        assert main(["stats", "--socket", f"ipc://{tmp_path}/gone.sock", "--timeout", "5"]) == 1
        err = capsys.readouterr().err
        assert f"but a daemon holds its lock {tmp_path}/gone.sock.lock" in err and \
            "restart it" in err, err
    finally:
        os.close(lock)


def _said(d, line: str, times: int = 1, timeout: float = 10.0) -> None:
    """Wait until the daemon's output holds ``line`` ``times`` times."""
    deadline = time.monotonic() + timeout
    while d.output().count(line) < times and time.monotonic() < deadline:
        time.sleep(0.1)
    assert d.output().count(line) >= times, d.output()[-2000:]


def test_a_daemon_whose_socket_file_is_removed_binds_it_again(daemon_factory):
    """A /tmp cleaner removes a running daemon's socket file: no new client could connect until
    a restart (operator review; it was logged from the forty-second session on). The daemon
    holds the socket's lock, so no other daemon can have taken the path: its housekeeping binds
    the file again (0600), logged once per removal, and new clients connect; one connected
    before never noticed. A lock file removed with it is taken again first."""
    import fcntl
    import os
    import stat

    from hicache.engine.client import Client

    d = daemon_factory(preset="dsv4-tiny", device_rows="page=8,swa_page=8,req_slot=4",
                       metrics=False)
    path = d.address[len("ipc://"):]
    line = f"the socket file {path} was removed while this daemon ran (a /tmp cleaner?): " \
           f"bound it again; new clients can connect"
    with Client(d.address, timeout=5.0, name="before", channel=False) as before:
        assert before.heartbeat()["pid"] == d.pid
        ino = os.lstat(path).st_ino
        os.unlink(path)
        _said(d, line)
        st = os.lstat(path)
        assert stat.S_ISSOCK(st.st_mode) and stat.S_IMODE(st.st_mode) == 0o600, oct(st.st_mode)
        assert st.st_ino != ino
        with Client(d.address, timeout=5.0, name="after", channel=False) as after:
            assert after.heartbeat()["pid"] == d.pid
        assert before.heartbeat()["pid"] == d.pid
        # the socket and its lock both removed: the lock is taken again, then the socket bound
        os.unlink(path)
        os.unlink(path + ".lock")
        _said(d, line, 2)
        assert os.path.exists(path + ".lock")
        fd = os.open(path + ".lock", os.O_RDONLY)
        try:  # held by the daemon again: a second daemon is refused, as at its start
            try:
                fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
                raise AssertionError("the new lock file is not held")
            except BlockingIOError:
                pass
        finally:
            os.close(fd)
        with Client(d.address, timeout=5.0, name="again", channel=False) as again:
            assert again.heartbeat()["pid"] == d.pid
    time.sleep(1.2)  # two more housekeeping passes: said once per removal, not at each
    assert d.output().count(line) == 2, d.output()[-2000:]
    assert "restart the daemon" not in d.output()


def test_a_daemon_whose_socket_path_was_taken_leaves_it_and_says_so(daemon_factory):
    """The socket file replaced by another process's socket, or removed with its lock while
    another process locked the path: not bound again (the path is not the daemon's to take);
    each logged once, the other file left as it was. (The daemon is stopped while the path
    changes, so its housekeeping cannot run in between.)"""
    import fcntl
    import os
    import signal

    d = daemon_factory(preset="dsv4-tiny", device_rows="page=8,swa_page=8,req_slot=4",
                       metrics=False)
    path = d.address[len("ipc://"):]
    os.kill(d.pid, signal.SIGSTOP)
    os.unlink(path)
    other = socket.socket(socket.AF_UNIX)
    other.bind(path)  # another process's socket at the path
    os.kill(d.pid, signal.SIGCONT)
    replaced = f"the socket file {path} was replaced while this daemon ran: no new client " \
               f"can connect"
    try:
        ino = os.lstat(path).st_ino
        _said(d, replaced)
        time.sleep(1.2)  # more housekeeping passes: left alone, said once
        assert os.lstat(path).st_ino == ino and d.output().count(replaced) == 1
    finally:
        other.close()
    os.unlink(path)  # the other one's file goes: removed now, and the path is the daemon's
    _said(d, "bound it again; new clients can connect")
    os.kill(d.pid, signal.SIGSTOP)
    os.unlink(path)
    os.unlink(path + ".lock")
    lock = os.open(path + ".lock", os.O_RDWR | os.O_CREAT, 0o600)
    fcntl.flock(lock, fcntl.LOCK_EX)  # another daemon's lock on the path now
    os.kill(d.pid, signal.SIGCONT)
    try:
        removed = f"the socket file {path} was removed and cannot be bound again while " \
                  f"this daemon ran: no new client can connect"
        _said(d, removed)
        time.sleep(1.2)
        assert not os.path.exists(path) and d.output().count(removed) == 1, d.output()[-2000:]
    finally:
        os.close(lock)


def _stats_took(address: str, timeout: str) -> float:
    """Seconds ``hicache stats`` took to exit 1 on ``address``."""
    from hicache.cli import main

    t0 = time.monotonic()
    assert main(["stats", "--socket", address, "--timeout", timeout]) == 1
    return time.monotonic() - t0


def test_stats_on_a_socket_that_does_not_answer_still_waits(tmp_path, capsys):
    """A socket that accepts but never answers (a hung daemon's) is waited for; one nothing
    listens on (a killed daemon's) is named at once; a loopback tcp port too (it waited the
    whole timeout for a port that refused at once: operator review, fiftieth session)."""
    path = tmp_path / "mute.sock"
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))
    s.listen(8)  # a hung daemon: connections are taken, nothing is ever answered
    try:
        assert _stats_took(f"ipc://{path}", "0.5") >= 0.45
    finally:
        s.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hicache stats: no daemon answered on ipc://{path} within 0.5 s"]
    path.unlink()
    s = socket.socket(socket.AF_UNIX)
    s.bind(str(path))  # a socket file nothing listens on: a killed daemon's
    try:
        assert _stats_took(f"ipc://{path}", "5") < 2
    finally:
        s.close()
    err = capsys.readouterr().err.splitlines()
    assert err == [f"hicache stats: no daemon on ipc://{path}: its socket refuses connections: "
                   f"the daemon that made it is gone"]
    s = socket.socket()
    s.bind(("127.0.0.1", 0))  # bound, not listening: the port refuses
    port = s.getsockname()[1]
    try:
        assert _stats_took(f"tcp://127.0.0.1:{port}", "5") < 2
        s.listen(8)
        assert _stats_took(f"tcp://127.0.0.1:{port}", "0.5") >= 0.45
    finally:
        s.close()
    err = capsys.readouterr().err.splitlines()
    assert err[0] == f"hicache stats: no daemon on tcp://127.0.0.1:{port}: nothing listens on " \
                     f"port {port}: no daemon runs there", err
    assert err[1].startswith(f"hicache stats: no daemon answered on tcp://127.0.0.1:{port} "
                             f"within 0.5 s"), err


def test_stats_help_shows_the_timeout_default(capsys):
    from hicache.cli import main

    with pytest.raises(SystemExit):
        main(["stats", "-h"])
    assert "(default: 5)" in " ".join(capsys.readouterr().out.split())


# ----------------------------------------------------------------------- 5. demo
def test_demo_refuses_a_busy_demo_metrics_port_in_one_line():
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen(1)
        port = busy.getsockname()[1]
        r = _cli("demo", "--device", "cpu", "--requests", "5", "--progress-seconds", "0",
                 "--demo-metrics-port", str(port), timeout=120)
    assert r.returncode == 2, r.stderr
    assert "Traceback" not in r.stderr and "starting daemon" not in r.stderr, r.stderr
    assert r.stderr.strip().splitlines() == [
        f"hicache demo: error: --demo-metrics-port {port}: cannot listen on 127.0.0.1:{port}: "
        "Address already in use"]


@pytest.mark.parametrize("ratio", ["0.5", "1"])
def test_demo_refuses_a_host_tier_no_larger_than_the_device(ratio, capsys):
    from hicache.cli import main

    assert main(["demo", "--dry", "--requests", "5", "--host-ratio", ratio]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith(
        f"hicache demo: error: --host-ratio {ratio}: the host tier ("), err
    assert "no larger than the device (128 pages)" in err[0] and "--force" in err[0]


def test_demo_host_ratio_below_one_with_force_runs(capsys):
    from hicache.cli import main

    assert main(["demo", "--dry", "--requests", "5", "--host-ratio", "0.5", "--force",
                 "--progress-seconds", "0", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["config"]["host_pages"] == 64


# ----------------------------------------------------------------------- 7. soak's report
def _soak_rep(mix: str) -> dict:
    return {"bench": "soak", "clients": 2, "ops_per_client": 10, "window": 4, "mix": mix,
            "unit": "c128_kv", "max_rows": 4, "device": "cpu", "ops": 20, "seconds": 1.0,
            "ops_per_s": 20.0, "backups": 8, "loads": 6, "verified_pages": 12,
            "verified_bytes": 0 if mix == "page" else 3_000_000_000, "swaps": 0, "frees": 3,
            "allocs": 3, "client_setup_s": 1.2,
            "client_seconds": {} if mix == "page" else {"loop": 0.9, "calls": 0.5},
            "lost_acks": 0, "failed_ops": 0, "corrupted_pages": 0, "refused": 0,
            "rss_warm_mib": 10, "warmup_fraction": 0.2, "rss_end_mib": 10,
            "rss_growth_pct": 0.0, "rss_curve_mib": [10], "daemon_tracebacks": 0, "ok": True}


def test_soak_report_says_what_the_default_mix_does_not_count(capsys):
    from hicache.bench.soak import _print

    _print(_soak_rep("page"))
    out = capsys.readouterr().out
    assert "GB" not in out and "(12 pages verified)" in out, out
    assert re.search(r"a client's time: \S", out), out  # never an empty field
    assert "--mix all" in out
    _print(_soak_rep("all"))
    out = capsys.readouterr().out
    assert "12 pages verified, 3.00 GB" in out and "a client's time: loop 0.9 s, calls 0.5 s" in out


# ----------------------------------------------------------------------- 8. Grafana
def test_grafana_process_panels_filter_only_on_instance():
    with open(ROOT / "grafana" / "daemon.json", encoding="utf-8") as f:
        dash = json.load(f)
    exprs = [t["expr"] for p in dash["panels"] for t in p.get("targets", [])]
    process = [e for e in exprs if "process_" in e]
    assert len(process) == 5
    for e in exprs:
        assert "job=" not in e and 'instance=~"$instance"' in e, e


def test_the_summary_writes_an_ipv6_metrics_address_as_a_url(tmp_path):
    """``--metrics-addr ::`` printed ``metrics: http://:::9479/metrics``, no usable URL."""
    import socket

    from hicache.core.addresses import url_host
    from hicache.engine.daemon_process import DaemonProcess

    assert [url_host(h) for h in ("::", "::1", "[::1]", "127.0.0.1", "node7")] == \
        ["[::]", "[::1]", "[::1]", "127.0.0.1", "node7"]
    try:
        with socket.socket(socket.AF_INET6) as s:
            s.bind(("::1", 0))
            port = s.getsockname()[1]
    except OSError:
        pytest.skip("no IPv6 loopback here")
    with DaemonProcess(device="cpu", preset="dsv4-tiny", device_rows="page=8,swa_page=4,req_slot=4",
                       pipe=True, metrics_port=port, extra=("--metrics-addr", "::1")) as d:
        assert f"metrics: http://[::1]:{port}/metrics" in d.output()


def test_stats_on_a_missing_default_socket_says_where_defaults_come_from(capsys, monkeypatch,
                                                                          tmp_path):
    """The default socket follows XDG_RUNTIME_DIR: a daemon started from a login shell is not
    where ``stats`` run from cron or a unit looks, and the refusal now says so."""
    from hicache.cli import main

    for k in ("HICACHE_SOCKET", "HICACHE_CONFIG_FILE", "HICACHE_DEVICE"):
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("XDG_RUNTIME_DIR", str(tmp_path))
    assert main(["stats", "--device", "cuda:7"]) == 1
    err = capsys.readouterr().err
    assert err.startswith(f"hicache stats: no socket at {tmp_path}/hicache/cuda7.sock (is the "
                          "daemon running?); this is the default socket, which follows "
                          "XDG_RUNTIME_DIR") and "give --socket" in err and err.count("\n") == 1


def test_stats_summary_of_a_reply_without_what_the_daemon_serves():
    """The summary's first line names model, stage and a half-open layer range; a reply
    without ``daemon`` (an older daemon) says so instead of printing None fields."""
    from hicache.cli.stats import summary

    s = {"device": "cpu", "clients": 0, "workers": 0, "in_flight": 0, "channels": 0}
    assert summary(s).splitlines()[0] == \
        "device cpu: (a daemon that does not say what it serves)"
    s["daemon"] = {"model": "m", "stage": [1, 2], "layers": [3, 6], "swa_mode": "paged",
                   "host_split": "device", "pid": 7, "version": "0.1.0", "uptime_s": 1.5}
    assert summary(s).splitlines()[0] == ("device cpu: m stage 1/2 layers [3, 6), swa paged, "
                                          "host split device; pid 7, hicache 0.1.0, up 1.5 s")
    s["l3"] = {"state": "online", "why": None, "master": "127.0.0.1:50051",
               "put_queue_pages": 0, "stalled": {"read": "a prefetch call has not returned"}}
    assert summary(s).splitlines()[-2:] == [
        "  l3: online; master 127.0.0.1:50051, put queue 0 pages",
        "  l3 read worker stalled: a prefetch call has not returned; its jobs are answered as "
        "misses until that call returns"]


@pytest.mark.parametrize("level,printed", [("WARNING", False), ("INFO", True)])
def test_the_arena_progress_lines_follow_the_log_level(level, printed, tmp_path, monkeypatch,
                                                       capsys):
    """The host arena's progress lines are INFO's: ``--log-level warning`` keeps them off
    stderr (they were printed whatever the level), INFO shows them."""
    import logging

    from hicache.controllers import daemon as daemon_mod
    from hicache.core.config import ServeConfig
    from hicache.host_pools import arena as arena_mod

    monkeypatch.setattr(arena_mod, "PROGRESS_MIN", 1)  # every arena is large enough
    logger = logging.getLogger("hicache")
    before = logger.level
    logger.setLevel(level)  # as ``hicache serve --log-level`` does
    try:
        d = daemon_mod.Daemon(ServeConfig(preset="dsv4-tiny",
                                          device_rows={"page": 8, "swa_page": 8, "req_slot": 4},
                                          host_ratio=2.0, socket=f"ipc://{tmp_path}/d.sock",
                                          numa_node="off"))
        d.close()
    finally:
        logger.setLevel(before)
    assert ("hicache: host arena" in capsys.readouterr().err) == printed
