"""`hicache serve` as an operator meets it: sized from a budget like `plan`, the serve line `plan`
prints runs as printed, bad input refused in one line (exit 2) before the host arena exists, one
size parser, one settings table, `--version`, help without a command."""
from __future__ import annotations

import json
import os
import re
import shlex
import signal
import socket
import subprocess
import sys
import tempfile
import time
from typing import Any
from pathlib import Path

import pytest

from hicache.core.config import SETTINGS, WRITE_POLICIES, load_config, markdown, sizing
from hicache.core.errors import UsageError
from hicache.core.planner import parse_size
from hicache.core.sizes import parse_bytes

from conftest import free_port

ROOT = Path(__file__).resolve().parents[1]
TINY = ["--preset", "dsv4-tiny", "--device-rows", "page=8,swa_page=8,req_slot=4"]


def hicache(*args: str, env: dict | None = None, timeout: float = 120) -> subprocess.CompletedProcess:
    e = dict(os.environ, PYTHONPATH=str(ROOT), **(env or {}))
    return subprocess.run([sys.executable, "-m", "hicache.cli", *args], cwd=str(ROOT), env=e,
                          capture_output=True, text=True, timeout=timeout)


def run_until_ready(argv: list[str], env: dict, timeout: float = 180,
                    stderr: Any = subprocess.STDOUT) -> str:
    """Start ``argv``, wait for ``ready``, SIGTERM it; returns its output (must exit 143).
    ``stderr``: where its stderr goes (a file keeps it apart; default: in the output)."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1", **env)
    p = subprocess.Popen(argv, cwd=str(ROOT), env=e, stdout=subprocess.PIPE,
                         stderr=stderr, text=True)
    lines: list[str] = []
    deadline = time.monotonic() + timeout
    try:
        assert p.stdout is not None
        for line in p.stdout:
            lines.append(line)
            if "hicache serve: ready" in line or time.monotonic() > deadline:
                break
        assert any("ready" in x for x in lines), "".join(lines)
        p.send_signal(signal.SIGTERM)
        rest, _ = p.communicate(timeout=60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, "".join(lines) + rest
    return "".join(lines) + rest


# ----------------------------------------------------------------------------- sizing
def test_serve_from_a_kv_budget_starts(tmp_path):
    out = run_until_ready([sys.executable, "-m", "hicache.cli", "serve", "--preset",
                           "dsv4-flash", "--device", "cpu", "--kv-mem", "256MiB", "--host-mem",
                           "512MiB"], {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert "from planner: --kv-mem 256.00 MiB" in out, out
    assert "Traceback" not in out and not (tmp_path / "hicache" / "cpu.sock").exists()


def test_serve_with_a_checkpoints_host_split_starts(tmp_path):
    """``--host-split checkpoints``: the summary names the split, the host rows hold one
    ``swa_page`` row per 32 page rows and the request slots' device count."""
    out = run_until_ready([sys.executable, "-m", "hicache.cli", "serve", "--preset",
                           "dsv4-flash", "--device", "cpu", "--kv-mem", "256MiB", "--host-mem",
                           "512MiB", "--host-split", "checkpoints"],
                          {"XDG_RUNTIME_DIR": str(tmp_path)})
    assert "host split for checkpoints, 1 per 32 pages" in out, out
    m = re.search(r"host rows: page=(\d+), swa_page=(\d+), req_slot=(\d+)", out)
    assert m and int(m.group(2)) == int(m.group(1)) // 32 >= 1, out


def test_the_serve_line_plan_prints_runs_as_printed(tmp_path):
    p = hicache("plan", "--preset", "dsv4-flash", "--kv-mem", "1GiB", "--pp-size", "2",
                "--max-running", "32", "--host-mem", "2GiB", "--json")
    assert p.returncode == 0, p.stderr
    plan = json.loads(p.stdout)
    stage = plan["stages"][1]
    line = stage["serve_command"]
    assert line.startswith("hicache serve ") and "--pp-rank 1" in line
    assert stage["host_token_capacity"] == stage["host_rows"]["page"] * 256
    human = hicache("plan", "--preset", "dsv4-flash", "--kv-mem", "1GiB", "--pp-size", "2",
                    "--max-running", "32", "--host-mem", "2GiB").stdout
    assert f"serve: {line}" in human
    argv = shlex.split(line)
    # pasted on a GPU host it serves a GPU (it used to have no --device: a CPU-mode daemon);
    # this host may have none, so the test runs it on the CPU, as the footer says to edit it
    assert argv[:4] == ["hicache", "serve", "--device", "cuda:0"], line
    assert "change --device cuda:0 to that GPU's index" in human
    argv[3] = "cpu"
    out = run_until_ready([sys.executable, "-m", "hicache.cli", *argv[1:]],
                          {"XDG_RUNTIME_DIR": str(tmp_path)})
    rows = ", ".join(f"{s}={n}" for s, n in stage["host_rows"].items())
    dev = ", ".join(f"{s}={n}" for s, n in stage["device_rows"].items())
    assert f"host rows: {rows} (device rows {dev} from planner" in out, out


def test_host_not_larger_than_device_is_refused_unless_forced():
    base = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4"}
    with pytest.raises(UsageError, match="no larger than the device pools.*--force"):
        sizing(load_config({**base, "host_ratio": "0.25"}, env={}))
    forced = sizing(load_config({**base, "host_ratio": "0.25", "force": True}, env={}))
    assert forced.host_rows == {"page": 2, "swa_page": 2, "req_slot": 1}
    with pytest.raises(UsageError, match="does not apply to --device-rows"):
        load_config({**base, "host_ratio": "2", "max_running": "64"}, env={})
    with pytest.raises(UsageError, match="not both"):
        load_config({**base, "kv_mem": "1GiB", "host_ratio": "2"}, env={})


# ----------------------------------------------------------------------------- bad input
def _busy_port() -> socket.socket:
    s = socket.socket()
    s.bind(("127.0.0.1", 0))
    s.listen(1)
    return s


@pytest.mark.parametrize("case", ["metrics-port", "socket-folder", "socket-file", "socket-long",
                                  "socket-in-a-file", "socket-folder-owner", "touch-threads",
                                  "numa-node", "heartbeat", "parent-pid"])
def test_bad_input_one_line_exit_2_before_the_arena(tmp_path, case):
    """--host-mem 1TiB cannot be mapped here: had the check run after the arena, the arena's
    refusal would be the message instead. A regular file at the socket's path is left as it
    was (it used to be deleted as a stale socket). A socket "folder" that is a file, and one
    another user owns, are refused as such (both passed the check, and the start called the
    first "not writable")."""
    argv = [*TINY, "--host-mem", "1TiB", "--socket", f"ipc://{tmp_path}/s/d.sock"]
    busy = _busy_port()
    keep = tmp_path / "important.conf"
    keep.write_text("data")
    other = tempfile.mkdtemp()
    if case == "socket-folder-owner":
        if os.getuid() != 0:
            pytest.skip("giving a folder to another user needs root")
        os.chown(other, 65534, 65534)
    try:
        extra, want = {
            "metrics-port": (["--metrics-port", str(busy.getsockname()[1])], "--metrics-port"),
            "socket-folder": (["--socket", "ipc:///proc/hicache-nope/d.sock"], "--socket"),
            "socket-file": (["--socket", f"ipc://{keep}"], "exists and is not a socket"),
            "socket-long": (["--socket", f"ipc://{tmp_path}/{'x' * 100}/d.sock"],
                            "over the 107 a Unix socket takes"),
            "socket-in-a-file": (["--socket", f"ipc://{keep}/d.sock"], f"{keep} is not a folder"),
            "socket-folder-owner": (["--socket", f"ipc://{other}/d.sock"],
                                    "belongs to uid 65534, not to this user"),
            "heartbeat": (["--heartbeat-timeout", "inf"], "not a finite number"),
            # a pid that is not the daemon's parent: it used to stop at once, reason unsaid
            "parent-pid": (["--parent-pid", "2"], "is not this process's parent"),
            "touch-threads": (["--touch-threads", "0"], "--touch-threads"),
            "numa-node": (["--numa-node", "7"], "--numa-node 7"),
        }[case]
        p = hicache("serve", *argv, *extra, env={"HICACHE_LOG_LEVEL": "info"})
        if case.startswith("socket-"):  # --check says the same
            c = hicache("serve", *argv, *extra, "--check")
            assert c.returncode == 2 and want in c.stderr, c.stderr
    finally:
        busy.close()
        os.rmdir(other)
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and p.stdout == "", (p.stdout, p.stderr)
    assert len(lines) == 1 and lines[0].startswith("hicache serve: error: "), p.stderr
    assert want in lines[0] and "pin" not in lines[0], lines[0]
    assert not (tmp_path / "s").exists()  # no socket folder left by a refused start
    assert keep.read_text() == "data" and os.listdir(tmp_path) == ["important.conf"]


@pytest.mark.parametrize("case", ["numa-node", "tcp-port", "curve-key"])
def test_address_port_keys_and_numa_are_refused_before_torch_loads(tmp_path, case):
    """A tcp port in use, a CURVE key file that cannot be read and an offline NUMA node are
    refused in one line before the daemon's modules (and torch, ~2 s) load; they used to be
    checked after."""
    busy = _busy_port()
    key = tmp_path / "server.key_secret"
    key.write_text("not a certificate\n")
    key.chmod(0o600)
    try:
        extra = {
            "numa-node": ["--numa-node", "7", "--socket", f"ipc://{tmp_path}/d.sock"],
            "tcp-port": ["--socket", f"tcp://127.0.0.1:{busy.getsockname()[1]}",
                         "--allow-remote"],
            "curve-key": ["--socket", "tcp://127.0.0.1:1", "--allow-remote",
                          "--curve-secret-key", str(key),
                          "--curve-clients", str(tmp_path)],
        }[case]
        argv = [*TINY, "--host-ratio", "2", *extra]
        r = subprocess.run([sys.executable, "-c", "import sys; from hicache.cli import main; "
                            f"rc = main(['serve', *{argv!r}]); "
                            "print(rc, 'torch' in sys.modules)"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    finally:
        busy.close()
    assert r.stdout.splitlines() == ["2 False"], (r.stdout, r.stderr)
    want = {"numa-node": "--numa-node 7", "tcp-port": "cannot bind",
            "curve-key": "curve secret key"}[case]
    lines = r.stderr.strip().splitlines()
    assert len(lines) == 1 and want in lines[0], r.stderr


def test_a_second_daemon_is_refused_while_the_first_cannot_answer(tmp_path):
    """The first daemon is stopped (SIGSTOP), so it cannot answer a probe: the second is
    refused by the socket's lock, and the first's socket survives and serves afterwards."""
    sock = tmp_path / "d.sock"
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    first = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", *TINY,
                              "--host-ratio", "2", "--socket", f"ipc://{sock}"], cwd=str(ROOT),
                             env=e, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        assert first.stdout is not None
        for line in first.stdout:
            if "hicache serve: ready" in line:
                break
        first.send_signal(signal.SIGSTOP)
        p = hicache("serve", *TINY, "--host-ratio", "2", "--socket", f"ipc://{sock}")
        first.send_signal(signal.SIGCONT)
        assert p.returncode == 2 and "another daemon already serves" in p.stderr, p.stderr
        from hicache.engine.client import Client
        with Client(f"ipc://{sock}", timeout=10.0, name="probe", channel=False) as c:
            assert c.heartbeat()["heartbeat_timeout"] > 0  # the first still serves its socket
        first.send_signal(signal.SIGTERM)
        first.communicate(timeout=60)
        assert first.returncode == 143
        assert os.listdir(tmp_path) == []  # socket and lock removed by their daemon
    finally:
        if first.poll() is None:
            first.kill()
            first.wait()


def test_non_finite_numbers_and_ratio_forms():
    with pytest.raises(UsageError, match="not a finite number"):
        load_config({"preset": "dsv4-tiny", "heartbeat_timeout": "inf"}, env={})
    assert load_config({"preset": "dsv4-tiny", "host_ratio": "4:1"}, env={}).host_ratio == 4.0


def test_arena_refusal_is_one_line():
    p = hicache("serve", *TINY, "--host-mem", "1TiB", "--socket", "tcp://127.0.0.1:1",
                env={"HICACHE_LOG_LEVEL": "warning"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1 and "hicache serve: error: " in lines[0], p.stderr


# ----------------------------------------------------------------------------- vocabulary
@pytest.mark.parametrize("text, expect", [
    ("1_000MiB", 1000 << 20), ("100G", 100 << 30), ("100gb", 100 * 10**9), ("1.5GiB", 3 << 29),
    ("4096", 4096), ("2 TiB", 2 << 40),
])
def test_one_size_parser_everywhere(text, expect):
    assert parse_bytes(text) == parse_size(text) == expect
    cfg = load_config({"preset": "dsv4-tiny", "host_mem": text}, env={})
    assert cfg.host_mem == expect
    assert load_config({"preset": "dsv4-tiny"}, env={"HICACHE_KV_MEM": text}).kv_mem == expect


def test_settings_table_is_documented_and_complete():
    text = (ROOT / "docs" / "config.md").read_text()
    assert markdown() in text, "regenerate the table: python -m hicache.core.config"
    example = ROOT / "docs" / "serve.example.toml"
    cfg = load_config(config_file=str(example), env={})
    assert cfg.preset and cfg.kv_mem and cfg.host_mem
    help_text = hicache("serve", "-h").stdout
    for s in SETTINGS:
        if s.option:
            assert s.option in help_text, s.option
    for alias in ("--config ", "--config\n", "--tp ", "--pp ", "--dp "):
        assert alias not in help_text + hicache("plan", "-h").stdout


def test_write_policies_match_the_radix_cache():
    from hicache.engine.radix import POLICIES

    assert tuple(WRITE_POLICIES) == tuple(POLICIES)


def test_version_help_and_quiet_broken_pipe():
    from hicache.core.version import __version__

    v = hicache("--version")
    assert v.returncode == 0 and v.stdout.strip() == f"hicache {__version__}"
    bare = hicache()
    assert bare.returncode == 2 and "COMMAND" in bare.stdout and "serve" in bare.stdout
    env = dict(os.environ, PYTHONPATH=str(ROOT))
    p = subprocess.run(f"{shlex.quote(sys.executable)} -m hicache.cli plan --preset dsv4-flash "
                       "--kv-mem 100GiB --pp-size 8 --json | head -1", shell=True, cwd=str(ROOT),
                       env=env, capture_output=True, text=True, timeout=60)
    assert p.stdout == "{\n" and "Traceback" not in p.stderr and p.stderr == "", p.stderr
    # the two tables' printers (grafana/README.md, docs/config.md): a reader that went away
    # before they print (closed at once) ended in a BrokenPipeError traceback (docs review)
    for module in ("hicache.controllers.metrics", "hicache.core.config"):
        q = subprocess.Popen([sys.executable, "-m", module], cwd=str(ROOT), env=env,
                             stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
        q.stdout.close()
        err = q.stderr.read()
        assert q.wait(60) == 141 and err == "", err
    assert re.search(r"serve lines", hicache("plan", "--preset", "dsv4-flash", "--kv-mem",
                                             "100GiB").stdout)


def test_a_refused_value_names_where_it_came_from(tmp_path):
    """A check after the sources merged names the setting as a flag and, when the value came
    from a HICACHE_* variable or the config file, that place too."""
    base = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4"}
    with pytest.raises(UsageError, match=r"^--swa-mode must be one of paged \| ring, got "
                                         r"'bogus' \(from HICACHE_SWA_MODE\)$"):
        load_config(base, env={"HICACHE_SWA_MODE": "bogus"})
    f = tmp_path / "c.toml"
    f.write_text("[serve]\nheartbeat_timeout = -1\n")
    with pytest.raises(UsageError, match=r"\(from heartbeat_timeout in config file .*c\.toml\)$"):
        load_config(base, config_file=str(f), env={})
    with pytest.raises(UsageError) as e:  # on the command line: the flag says it all
        load_config({**base, "swa_mode": "bogus"}, env={})
    assert "(from" not in str(e.value)
    f.write_text("host_ratio = 2\nspin_us = 0\n[serve]\nhost_ratio = 3\n")  # [serve] won
    with pytest.raises(UsageError, match=r"host_ratio set both at the top level and under "
                                         r"\[serve\]; keep one$"):
        load_config(base, config_file=str(f), env={})


def test_a_start_up_refusal_after_validation_names_where_its_settings_came_from(tmp_path):
    """Model, stage and sizing are checked when the daemon starts, after ``validate``: those
    refusals named no source (and one named a file's ``kv_mem`` that ``--device-rows`` had
    replaced). Each now names the flag and where its value came from."""
    def start(*args: str, env: dict | None = None) -> str:
        r = subprocess.run([sys.executable, "-m", "hicache.cli", "serve", "--socket",
                            f"ipc://{tmp_path}/s.sock", *args], capture_output=True, text=True,
                           timeout=60, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path),
                                    **(env or {})))
        assert r.returncode == 2 and len(r.stderr.strip().splitlines()) == 1, r.stderr
        return r.stderr.strip()

    f = tmp_path / "t.toml"
    f.write_text('preset = "dsv4-tinyy"\nkv_mem = "1G"\nhost_ratio = 2\n')
    assert start("--config-file", str(f)).endswith(f"(from preset in config file {f})")
    f.write_text('preset = "dsv4-tiny"\nkv_mem = "1G"\nhost_mem = "1G"\n')
    assert start("--config-file", str(f)).endswith(f"(from host_mem in config file {f})")
    f.write_text('preset = "dsv4-tiny"\nkv_mem = "1G"\nhost_ratio = 2\n'
                 'swa_full_tokens_ratio = 2\n')
    assert start("--config-file", str(f)).endswith(
        f"(from swa_full_tokens_ratio in config file {f})")
    assert start("--preset", "dsv4-tiny", "--host-mem", "4G",
                 env={"HICACHE_KV_MEM": "1K"}).endswith("(from HICACHE_KV_MEM)")
    # an empty metrics address (a template's unset variable): --check passed it (a bind to ""
    # is every interface) and the start failed naming neither (operator review)
    assert start("--preset", "dsv4-tiny", "--kv-mem", "64MiB", "--host-mem", "256MiB",
                 "--metrics-port", "19450", "--check", env={"HICACHE_METRICS_ADDR": ""}) == \
        ("hicache serve: error: --metrics-addr is empty: give the address the metrics "
         "endpoint binds (default 127.0.0.1) (from HICACHE_METRICS_ADDR)")
    # refused before the daemon's modules load: no torch (a typo is answered at once)
    light = subprocess.run([sys.executable, "-c", "import sys; from hicache.cli import main; "
                            f"rc = main(['serve', '--socket', 'ipc://{tmp_path}/s.sock', "
                            "'--preset', 'dsv4-tinyy', '--kv-mem', '1G', '--host-ratio', '2']); "
                            "print(rc, 'torch' in sys.modules)"], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
    assert light.stdout.splitlines() == ["2 False"], (light.stdout, light.stderr)
    assert "unknown preset 'dsv4-tinyy'" in light.stderr, light.stderr
    f.write_text('preset = "dsv4-tiny"\nkv_mem = "1G"\n')  # replaced by --device-rows
    cfg = load_config({"device_rows": "page=8,swa_page=8,req_slot=4", "host_ratio": "2"},
                      config_file=str(f), env={})
    assert "kv_mem" not in cfg.__dict__["sources"]


@pytest.mark.parametrize("flags, msg", [
    ({"metrics_addr": "0.0.0.0"}, "--metrics-addr applies with --metrics-port"),
    ({"min_sparse_prompt_len": "100"}, "--min-sparse-prompt-len applies with --sparse-rows"),
    ({"sparse_clients": "2"}, "--sparse-clients applies with --sparse-rows"),
    ({"sparse_rows": "4", "sparse_clients": "0"}, r"--sparse-clients must be 1\.\.64"),
    # a prompt of 1-3 tokens has no C4 token and would hold no row: admitted without bound
    ({"sparse_rows": "4", "min_sparse_prompt_len": "3"},
     r"--min-sparse-prompt-len must be at least 4 \(one C4 token"),
    ({"allow_remote": True, "socket": "ipc:///tmp/x/d.sock"}, "--allow-remote applies to a tcp"),
    ({"allow_remote": True}, "--allow-remote applies to a tcp"),
    ({"l3_protocol": "rdma"}, "--l3-protocol given but --l3 is off"),
    ({"l3_local_host": "10.0.0.1"}, "--l3-local-host given but --l3 is off"),
])
def test_options_that_do_not_apply_are_refused(flags, msg):
    base = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4"}
    with pytest.raises(UsageError, match=msg):
        load_config({**base, **flags}, env={})


def _tiny_serving(sock: Path, stderr: Any = subprocess.STDOUT) -> subprocess.Popen:
    """``hicache serve`` of dsv4-tiny on ``sock``, its stdout read up to ``ready``."""
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    p = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", *TINY, "--host-ratio",
                          "2", "--socket", f"ipc://{sock}"], cwd=str(ROOT), env=e,
                         stdout=subprocess.PIPE, stderr=stderr, text=True)
    assert p.stdout is not None
    for line in p.stdout:
        if "hicache serve: ready" in line:
            break
    return p


def test_stats_command_against_a_live_and_a_missing_daemon(tmp_path, monkeypatch, capsys):
    """``hicache stats`` prints a summary (or the reply as JSON, with the invariant check) of
    a running daemon, and one line with exit 1 when nothing answers on the socket."""
    sock = tmp_path / "d.sock"
    e = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    d = _tiny_serving(sock)
    try:
        p = hicache("stats", "--socket", f"ipc://{sock}")
        assert p.returncode == 0, p.stderr
        assert "host page: 0 of 16 rows allocated (of them 0 waiting to be freed), 16 free " \
            "in 1 run (mean 16.0)" in p.stdout, p.stdout
        # it never loads torch (the client's imports are light): 0.3 s, not 1.7
        light = subprocess.run([sys.executable, "-c", "import sys; from hicache.cli import main; "
                                f"rc = main(['stats', '--socket', 'ipc://{sock}']); "
                                "print(rc, 'torch' in sys.modules)"],
                               capture_output=True, text=True, timeout=60, cwd=str(ROOT), env=e)
        assert light.stdout.splitlines()[-1] == "0 False", (light.stdout, light.stderr)
        from hicache.cli import main

        monkeypatch.setenv("HICACHE_SOCKET", f"ipc://{sock}")  # as serve picks it (in-process)
        assert main(["stats"]) == 0 and "host page: 0 of 16" in capsys.readouterr().out
        monkeypatch.delenv("HICACHE_SOCKET")
        j = hicache("stats", "--socket", f"ipc://{sock}", "--json", "--check")
        assert j.returncode == 0 and json.loads(j.stdout)["invariants"] == "ok", j.stderr
    finally:
        d.send_signal(signal.SIGTERM)
        d.communicate(timeout=60)
    gone = hicache("stats", "--socket", f"ipc://{sock}", "--timeout", "0.5")
    lines = gone.stderr.strip().splitlines()  # the daemon removed its socket: said at once
    assert gone.returncode == 1 and lines == [f"hicache stats: no socket at {sock} (is the "
                                              "daemon running?)"]
    assert main(["stats", "--socket", "foo"]) == 2  # a malformed address: one line
    assert capsys.readouterr().err.strip().splitlines() == [
        "hicache stats: error: unsupported socket address 'foo'; use ipc://PATH or "
        "tcp://127.0.0.1:PORT"]


def test_a_later_source_replaces_the_other_of_an_exclusive_pair(tmp_path):
    """One TOML file for every stage, each daemon adding flags: a flag or variable that sets
    one of ``kv_mem`` / ``device_rows``, ``host_mem`` / ``host_ratio`` or ``preset`` /
    ``model_config`` replaces the file's other (it used to be refused as "not both"); both
    in one source are still refused."""
    f = tmp_path / "g.toml"
    f.write_text('preset = "dsv4-tiny"\nkv_mem = "16MiB"\nhost_mem = "64MiB"\n')
    c = load_config({"host_ratio": "3"}, str(f), env={})
    assert (c.host_mem, c.host_ratio) == (None, 3.0)
    c = load_config({"device_rows": "page=8,swa_page=8,req_slot=4"}, str(f), env={})
    assert c.kv_mem is None and c.device_rows["page"] == 8
    c = load_config({}, str(f), env={"HICACHE_HOST_RATIO": "2"})
    assert (c.host_mem, c.host_ratio) == (None, 2.0)
    with pytest.raises(UsageError, match="not both"):
        load_config({"host_ratio": "3", "host_mem": "1GiB"}, str(f), env={})


def test_a_sparse_region_too_big_is_one_line_naming_the_setting(tmp_path):
    p = hicache("serve", *TINY, "--host-ratio", "2", "--sparse-rows", "99999999999",
                "--socket", f"ipc://{tmp_path}/s/d.sock", env={"HICACHE_LOG_LEVEL": "warning"})
    lines = p.stderr.strip().splitlines()
    assert p.returncode == 2 and len(lines) == 1, p.stderr
    # refused by the memory check before anything is made (it counts the regions since the
    # forty-seventh session; the region's own make refused it before)
    assert lines[0].startswith("hicache serve: error: --host-ratio 2 (a host arena of ")
    assert "--sparse-rows 99999999999 x --sparse-clients 1 (HiSparse regions of" in lines[0]
    assert not (tmp_path / "s").exists()


def test_the_socket_lock_is_never_held_twice(tmp_path, monkeypatch):
    """A daemon B that opened the lock file just before a stopping daemon A removed it, and
    locks it just after, must not keep that unnamed file: it takes the new one, and a daemon C
    starting next is refused (both used to hold "the" lock)."""
    import fcntl

    from hicache.controllers import daemon as D

    sock, addr = str(tmp_path / "d.sock"), f"ipc://{tmp_path}/d.sock"
    a = D.SocketLock(sock, addr)
    real = fcntl.flock

    def a_stops_first(fd, op):
        monkeypatch.setattr(fcntl, "flock", real)
        a.release()
        return real(fd, op)

    monkeypatch.setattr(fcntl, "flock", a_stops_first)
    b = D.SocketLock(sock, addr)
    assert os.fstat(b.fd).st_nlink == 1 and os.stat(sock + ".lock").st_ino == \
        os.fstat(b.fd).st_ino
    with pytest.raises(UsageError, match="another daemon already serves"):
        D.SocketLock(sock, addr)
    b.release()
    assert not os.path.exists(sock + ".lock")


def test_every_socket_folder_the_daemon_makes_is_private(tmp_path):
    """``--socket ipc://<new>/<new>/d.sock``: each folder made is 0700 (``os.makedirs`` gave
    the parents the umask's 0755), and a stop takes them all away again."""
    from hicache.controllers.daemon import _prepare_ipc, remove_folders

    old = os.umask(0o022)
    try:
        made, lock = _prepare_ipc(f"ipc://{tmp_path}/a/b/d.sock", [])
    finally:
        os.umask(old)
    try:
        assert sorted(made) == [str(tmp_path / "a"), str(tmp_path / "a" / "b")]
        for f in made:
            assert os.stat(f).st_mode & 0o777 == 0o700, (f, oct(os.stat(f).st_mode))
    finally:
        lock.release()
        remove_folders(made)
    assert os.listdir(tmp_path) == []


def test_a_socket_folder_another_daemon_makes_meanwhile_is_not_ours(tmp_path, monkeypatch):
    """Two daemons with default sockets start at once and race to make the shared folder:
    the loser takes the folder as it is (not "File exists") and never removes it."""
    from hicache.controllers import daemon as D

    real, shared = os.mkdir, str(tmp_path / "hicache")

    def racing_mkdir(p, mode=0o777):
        if p == shared and not os.path.isdir(p):
            real(p, 0o700)  # the other daemon made it just now
        return real(p, mode)

    monkeypatch.setattr(D.os, "mkdir", racing_mkdir)
    said: list[str] = []
    made, lock = D._prepare_ipc(f"ipc://{shared}/cuda1.sock", said)
    lock.release()
    assert made == [] and said == []
    D.remove_folders(made)
    assert os.path.isdir(shared)


def test_settings_that_cannot_apply_or_are_malformed_are_one_line(tmp_path):
    """Found by a review: each of these used to be accepted and ignored, truncated, or failed
    later with a traceback."""
    base = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=8,req_slot=4"}
    with pytest.raises(UsageError, match="swa-full-tokens-ratio sizes paged SWA pools"):
        load_config({"preset": "dsv4-tiny", "kv_mem": "64MiB", "swa_mode": "ring",  # as plan
                     "swa_full_tokens_ratio": "1/2", "host_ratio": "2"}, env={})
    for dirs in ("", ":", "relative/dir"):
        with pytest.raises(UsageError, match=r"shm_dirs must name one or more absolute "
                                             r"folders.*\(from HICACHE_SHM_DIRS\)"):
            load_config(base, env={"HICACHE_SHM_DIRS": dirs})
    f = tmp_path / "rows.toml"
    f.write_text("[serve]\ndevice_rows = {page = 8.9, swa_page = 4, req_slot = 4}\n")
    with pytest.raises(UsageError, match="rows for page must be an int, got 8.9"):
        load_config({"preset": "dsv4-tiny"}, config_file=str(f), env={})
    with pytest.raises(UsageError, match="--device"):  # a final newline slipped by a "$"
        load_config({**base, "device": "cpu\n"}, env={})
    ring = load_config({**base, "swa_mode": "ring", "host_ratio": "2"}, env={})
    with pytest.raises(UsageError, match=r"--device-rows: .*stage 0 \(layers \[0, \d+\)\) has no "
                                         r"pool of swa_page: drop it$"):
        sizing(ring)  # swa_page rows for a stage whose SWA lives in request slots


def test_a_settings_file_given_to_the_model_flag_or_not_utf8_is_one_line(tmp_path):
    """A second review: ``--config serve.toml`` (the old spelling of ``--model-config``) read
    the settings file as a model and said it was not JSON, or first asked for a size it held;
    a settings file that is not UTF-8 gave a traceback."""
    f = tmp_path / "serve.toml"
    f.write_text('preset = "dsv4-tiny"\n')
    with pytest.raises(UsageError, match="a settings file goes to --config-file"):
        load_config({"model_config": str(f), "kv_mem": "1GiB"}, env={})
    bad = tmp_path / "latin1.toml"
    bad.write_bytes(b'# \xb5s\npreset = "dsv4-tiny"\n')
    with pytest.raises(UsageError, match=r"latin1.toml is not UTF-8 \(byte 2"):
        load_config({}, config_file=str(bad), env={})


def test_a_host_tier_no_machine_has_is_refused_at_once(tmp_path):
    """``--host-ratio 1e30`` hung ``serve`` (10^37 arena chunks planned before the memory
    check), and gave ``plan`` a traceback (1e400) or a plan of 10^27 TiB (1e30)."""
    for cmd in (["plan", "--preset", "dsv4-tiny", "--kv-mem", "1GiB", "--host-ratio", "1e400",
                 "--force"],
                ["plan", "--preset", "dsv4-tiny", "--kv-mem", "1GiB", "--host-ratio", "1e30"],
                ["serve", "--preset", "dsv4-tiny", "--kv-mem", "1GiB", "--host-ratio", "1e30",
                 "--socket", f"ipc://{tmp_path}/r.sock"],
                ["serve", "--preset", "dsv4-tiny", "--kv-mem", "1GiB", "--host-mem",
                 "1000000TiB", "--socket", f"ipc://{tmp_path}/m.sock"]):
        r = subprocess.run([sys.executable, "-m", "hicache.cli", *cmd], capture_output=True,
                           text=True, timeout=60, cwd=tmp_path,
                           env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        assert r.returncode == 2, (cmd, r.stderr[-500:])
        assert len(r.stderr.strip().splitlines()) == 1 and "Traceback" not in r.stderr, cmd


def test_a_flag_turns_off_a_boolean_a_file_turned_on(tmp_path):
    """"Flags win": ``--no-force`` / ``--no-dumpable`` / ``--no-zero-on-free`` /
    ``--no-allow-remote`` undo a settings file's ``true`` (only ``--mtp`` had a ``--no-``
    form: the others were "unrecognized arguments")."""
    import argparse

    from hicache.cli import serve as serve_cli
    from hicache.core.config import BOOL_FIELDS, SETTINGS

    def p_has_no_form(flags: list[str]) -> bool:
        a = p.parse_args(flags)
        return a.allow_remote is False and a.mtp is False

    p = argparse.ArgumentParser()
    serve_cli.add_arguments(p)
    f = tmp_path / "on.toml"
    on = [n for n in BOOL_FIELDS if n not in ("mtp", "allow_remote")]  # (that one needs tcp)
    assert p_has_no_form(["--no-allow-remote", "--no-mtp"])
    f.write_text("".join(f"{n} = true\n" for n in on))
    base = ["--config-file", str(f), "--preset", "dsv4-tiny", "--device-rows",
            "page=8,swa_page=8,req_slot=4"]
    for argv, want in ((base, True),
                       (base + [f"--no-{n.replace('_', '-')}" for n in on], False)):
        a = p.parse_args(argv)
        flags = {s.name: getattr(a, s.name, None) for s in SETTINGS}
        cfg = load_config(flags, a.config_file, env={})
        assert all(getattr(cfg, n) is want for n in on), (argv, [getattr(cfg, n) for n in on])


def test_an_argument_the_parser_refuses_is_one_line(capsys):
    """A flag without its value, or a value of the wrong type, printed argparse's usage block
    (about 22 lines) before the error; now one line that points at ``-h``."""
    from hicache.cli import main

    for argv, want in ((["serve", "--kv-mem"], "hicache serve: error: argument --kv-mem: "
                                                "expected one argument (see hicache serve -h)"),
                       (["stats", "--timeout", "abc"], "hicache stats: error: argument "
                                                       "--timeout: invalid float value")):
        with pytest.raises(SystemExit) as e:
            main(argv)
        assert e.value.code == 2
        err = capsys.readouterr().err
        assert err.startswith(want) and len(err.strip().splitlines()) == 1, err


def test_stats_refuses_a_timeout_it_cannot_wait_and_device_with_socket(capsys):
    from hicache.cli import main

    for t in ("inf", "1e300", "nan", "0"):
        assert main(["stats", "--timeout", t]) == 2
        assert "--timeout must be in (0, 3600.0] seconds" in capsys.readouterr().err
    assert main(["stats", "--device", "cuda:0", "--socket", "ipc:///tmp/x.sock"]) == 2
    assert "give one of --socket, --device (its daemon's default socket) and --config-file" in \
        capsys.readouterr().err


def test_a_port_out_of_range_is_named_as_such():
    """``tcp://127.0.0.1:99999`` has a port: it is out of range (the refusal said "needs a
    port")."""
    from hicache.core.addresses import check_address

    for addr, msg in (("tcp://127.0.0.1:99999", "port 99999 is outside 1..65535"),
                      ("tcp://127.0.0.1:0", "port 0 is outside 1..65535"),
                      ("tcp://127.0.0.1:x", "needs a port")):
        with pytest.raises(UsageError, match=msg):
            check_address(addr)


def test_stats_names_a_curve_key_file_it_cannot_read(tmp_path, capsys):
    """A CURVE key file that is missing, or holds no key, is one line (exit 2), before any
    daemon is asked."""
    from hicache.cli import main

    junk = tmp_path / "junk.key"
    junk.write_text("not a key\n")
    for server, secret in ((tmp_path / "missing.key", tmp_path / "missing.key_secret"),
                           (junk, junk)):
        assert main(["stats", "--socket", "tcp://127.0.0.1:5599", "--timeout", "1",
                     "--curve-server-key", str(server), "--curve-secret-key", str(secret)]) == 2
        err = capsys.readouterr().err
        assert err.startswith("hicache stats: error: CURVE key file: ") \
            and len(err.strip().splitlines()) == 1, err


def test_serve_check_validates_without_starting_anything(tmp_path):
    """``serve --check``: an operator rolling out a shared settings file could test it only by
    letting each daemon pin its arena. It runs every check before torch loads, prints what the
    daemon would serve, and exits 0, with nothing created (no socket folder); a refusal is
    the usual one line, exit 2."""
    sock = tmp_path / "sub" / "d.sock"
    base = ("serve", "--device", "cpu", "--preset", "dsv4-tiny", "--device-rows",
            "page=8,swa_page=4,req_slot=4", "--socket", f"ipc://{sock}", "--check")
    r = hicache(*base, "--host-ratio", "2")
    assert r.returncode == 0 and r.stderr == "", r.stderr
    (line,) = r.stdout.splitlines()
    assert line.startswith("hicache serve --check: the settings hold: dsv4-tiny stage 0/1 "
                           "layers [0, 6) on cpu; device rows page=8, swa_page=4, req_slot=4 "
                           "(--device-rows); host rows page=16, swa_page=8, req_slot=8, arena ")
    assert f"socket ipc://{sock}" in line and not (tmp_path / "sub").exists()
    toml = tmp_path / "s.toml"
    toml.write_text('host_ratio = 1\n')
    r = hicache(*base, "--config-file", str(toml))
    assert r.returncode == 2 and r.stdout == "" and len(r.stderr.splitlines()) == 1
    assert "no larger than the device" in r.stderr and f"config file {toml}" in r.stderr


def test_serve_check_refuses_what_a_start_refuses_and_names_a_running_daemon(tmp_path):
    """``--check`` ran only part of the checks before torch: a busy metrics port, a path that
    is no socket and a ``--parent-pid`` that is not the parent passed it and failed the start.
    A daemon already on the socket is named (a start is refused meanwhile), and the memory,
    which that daemon holds, is not held against the settings; a real second start says
    "another daemon already serves", not "cannot allocate" (the memory check came first)."""
    from hicache.engine.daemon_process import DaemonProcess

    sock = tmp_path / "d.sock"
    base = ("serve", "--device", "cpu", "--preset", "dsv4-tiny", "--device-rows",
            "page=8,swa_page=4,req_slot=4")
    busy = _busy_port()
    keep = tmp_path / "plain"
    keep.write_text("x")
    try:
        for extra, want in ((["--metrics-port", str(busy.getsockname()[1])], "--metrics-port"),
                            (["--socket", f"ipc://{keep}"], "exists and is not a socket"),
                            (["--parent-pid", "2"], "is not this process's parent"),
                            # (root may write anywhere access() asks about, but not in /sys:
                            # it passed the check; operator review)
                            (["--socket", "ipc:///sys/x.sock"], "socket folder /sys")):
            r = hicache(*base, "--host-ratio", "2", "--socket", f"ipc://{sock}", *extra,
                        "--check")
            assert r.returncode == 2 and want in r.stderr and len(r.stderr.splitlines()) == 1, r
    finally:
        busy.close()
    port = free_port()
    with DaemonProcess(f"ipc://{sock}", device="cpu", preset="dsv4-tiny",
                       device_rows="page=8,swa_page=4,req_slot=4", metrics_port=port):
        r = hicache(*base, "--socket", f"ipc://{sock}", "--check", "--host-mem", "1TiB")
        assert r.returncode == 0 and "the settings hold" in r.stdout, r
        assert f"warning: another daemon already serves ipc://{sock}" in r.stderr
        assert "the memory was not checked" in r.stderr
        # the running daemon's own settings, its metrics port among them, pass the check
        r = hicache(*base, "--socket", f"ipc://{sock}", "--check", "--host-ratio", "2",
                    "--metrics-port", str(port))
        assert r.returncode == 0 and "the settings hold" in r.stdout, r
        assert f"--metrics-port {port}: cannot listen" in r.stderr and "presumably" in r.stderr
        r = hicache(*base, "--socket", f"ipc://{sock}", "--host-mem", "1TiB")
        assert r.returncode == 2 and "another daemon already serves" in r.stderr, r.stderr
    tcp = f"tcp://127.0.0.1:{free_port()}"
    with DaemonProcess(tcp, device="cpu", preset="dsv4-tiny",
                       device_rows="page=8,swa_page=4,req_slot=4", extra=("--allow-remote",)):
        r = hicache(*base, "--socket", tcp, "--allow-remote", "--check", "--host-ratio", "2")
        assert r.returncode == 0 and "the settings hold" in r.stdout, r
        assert f"--socket {tcp}: cannot bind" in r.stderr
        assert "a hicache daemon serves it" in r.stderr
        # a real second start names the daemon too (it said a bare "Address already in use":
        # operator review, fiftieth session)
        r = hicache(*base, "--socket", tcp, "--allow-remote", "--host-ratio", "2")
        assert r.returncode == 2 and len(r.stderr.splitlines()) == 1, r
        assert f"--socket {tcp}: cannot bind" in r.stderr and "a hicache daemon serves it" \
            in r.stderr, r.stderr
    # a port another program holds fails the check as it fails a start; it passed with a note,
    # the memory unchecked (docs review), and then so did any ZMQ socket (diff review): a daemon
    # is one that answers a heartbeat
    import zmq

    other = socket.socket()
    other.bind(("127.0.0.1", 0))
    other.listen()
    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    try:
        zport = router.bind_to_random_port("tcp://127.0.0.1")
        for held in (f"tcp://127.0.0.1:{other.getsockname()[1]}", f"tcp://127.0.0.1:{zport}"):
            r = hicache(*base, "--socket", held, "--allow-remote", "--check", "--host-ratio",
                        "2")
            assert r.returncode == 2 and f"--socket {held}: cannot bind" in r.stderr, r
            assert "daemon" not in r.stderr and len(r.stderr.splitlines()) == 1, r.stderr
    finally:
        other.close()
        router.close()
    assert keep.read_text() == "x"


def test_a_daemon_whose_stdout_reader_went_away_still_exits_as_its_signal_says(tmp_path):
    """``serve ... | grep -m1 ready``: the reader is gone by the stop, so the "stopped by" line
    cannot be written to stdout; it used to raise there and exit 141 (SIGPIPE's status, a
    failed unit to systemd) after the clean-up. Now the line goes to stderr and the exit is
    143, with the socket gone."""
    sock = tmp_path / "d.sock"
    p = _tiny_serving(sock, stderr=subprocess.PIPE)
    try:
        assert p.stdout is not None and p.stderr is not None
        p.stdout.close()  # the reader goes away
        p.send_signal(signal.SIGTERM)
        err = p.stderr.read()
        p.wait(60)
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    assert p.returncode == 143, err
    assert "hicache serve: stopped by SIGTERM" in err and not sock.exists()


def test_a_relative_ipc_socket_is_served_and_named_by_its_absolute_path(tmp_path, monkeypatch):
    """``--socket ipc://sub/d.sock`` was served and shown (summary, ``hicache_daemon_info``)
    relative to wherever the daemon started, which no engine or ``stats`` elsewhere could
    find; it is the absolute path now."""
    monkeypatch.chdir(tmp_path)
    for given, want in (("ipc://sub/d.sock", f"ipc://{tmp_path}/sub/d.sock"),
                        ("ipc://./d.sock", f"ipc://{tmp_path}/d.sock"),
                        ("ipc:///abs/d.sock", "ipc:///abs/d.sock")):
        assert load_config({"preset": "dsv4-tiny", "socket": given}, env={}).socket == want


def test_a_daemon_that_refuses_the_checks_heartbeat_is_still_a_daemon():
    """A daemon at its client limit (or stopping) answers the check's heartbeat with a
    refusal: still a daemon's answer, so the taken port is a note, not "another program"."""
    import threading

    import zmq

    from hicache.controllers.preflight import _daemon_at
    from hicache.core import protocol as P

    router = zmq.Context.instance().socket(zmq.ROUTER)
    router.setsockopt(zmq.LINGER, 0)
    port = router.bind_to_random_port("tcp://127.0.0.1")

    def answer() -> None:
        if router.poll(5000):
            ident, *frames = router.recv_multipart()
            rid = P.decode_request(frames)[0]["id"]
            router.send_multipart([ident, *P.encode_error(rid, "too_many_clients", "full")])

    t = threading.Thread(target=answer)
    t.start()
    try:
        assert _daemon_at(f"tcp://127.0.0.1:{port}", curve=False) == "a hicache daemon serves it"
    finally:
        t.join(10)
        router.close()


@pytest.mark.parametrize("closed", [">&-", "2>&-", "<&- >&- 2>&-"])
def test_commands_with_closed_standard_descriptors_exit_as_they_would(tmp_path, closed):
    """A supervisor that starts ``hicache`` with stdout (or stderr, or all three) closed: every
    exit path ended in ``AttributeError: 'NoneType' object has no attribute 'flush'`` and status
    1, a refusal included, and the daemon's lock file became its stdout (forty-eighth session's
    operator review). Now /dev/null takes their place: the statuses are the usual ones."""
    hicache = shlex.quote(str(Path(sys.executable).parent / "hicache"))
    sock = f"ipc://{tmp_path}/c.sock"
    cases = [(f"{hicache} plan --preset dsv4-tiny --kv-mem 1GiB", 0),
             (f"{hicache} serve --device cpu --preset dsv4-tiny --kv-mem 64MiB --bogus", 2),
             (f"{hicache} serve --device cpu --preset dsv4-tiny --kv-mem 64MiB "
              f"--host-mem 256MiB --socket {sock} --check", 0)]
    for cmd, want in cases:
        r = subprocess.run(["bash", "-c", f"{cmd} {closed}"], capture_output=True, text=True,
                           timeout=120)
        assert r.returncode == want, (cmd, closed, r.stdout, r.stderr)
        assert "Traceback" not in r.stderr + r.stdout, (cmd, r.stderr)
        if "2>&-" not in closed and want == 2:
            assert r.stderr.count("\n") == 1 and "--bogus" in r.stderr, r.stderr


def test_a_cpu_daemon_by_default_on_a_gpu_host_is_warned(monkeypatch):
    """No ``--device`` on a host whose GPUs are visible: the daemon starts in CPU mode, at a
    socket the engine does not look at, without a word (operator review). Now it warns; an
    explicit ``--device cpu`` or a host without GPUs does not."""
    from hicache.cli import serve
    from hicache.cli.serve import _device_warning

    base = {"preset": "dsv4-tiny", "kv_mem": "64MiB", "host_ratio": "2"}
    monkeypatch.setattr(serve, "visible_gpus", lambda: 2)
    assert _device_warning(load_config(base, env={})) == [
        "--device not given: serving in CPU mode, though 2 CUDA device(s) are visible; a GPU's "
        "daemon takes --device cuda:N"]
    cfg = load_config({**base, "device": "cpu"}, env={})
    cfg.sources["device"] = "--device"  # typed on the command line
    assert _device_warning(cfg) == []
    monkeypatch.setattr(serve, "visible_gpus", lambda: 0)
    assert _device_warning(load_config(base, env={})) == []
    monkeypatch.undo()  # the real count: none here, or hidden by CUDA_VISIBLE_DEVICES
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "")
    assert serve.visible_gpus() == 0


def test_operator_review_fiftieth_session(tmp_path, monkeypatch, capsys):
    """An operator review's points: ``--tp-size`` was accepted and said nowhere (it sizes
    nothing: MLA), so the check line and the summary say it; ``serve --check`` printed no
    warning for a CPU daemon by default on a GPU host, which a start warns of; a space given
    twice in ``--device-rows`` kept the last value; an unspecified ``--l3-local-host``
    (``0.0.0.0``, ``::``), which no peer can connect to, was accepted."""
    from hicache.cli import main, serve

    sock = tmp_path / "d.sock"
    base = ["serve", "--preset", "dsv4-tiny", "--device-rows", "page=8,swa_page=4,req_slot=4",
            "--host-ratio", "2", "--socket", f"ipc://{sock}", "--check"]
    monkeypatch.setattr(serve, "visible_gpus", lambda: 2)
    assert main([*base, "--tp-size", "8"]) == 0
    out, err = capsys.readouterr()
    assert "layers [0, 6) on cpu, TP 8 (one daemon per TP rank's GPU, each with the stage's " \
           "full KV: rows do not depend on it); device rows page=8" in out, out
    assert err == "hicache serve: warning: --device not given: serving in CPU mode, though 2 " \
                  "CUDA device(s) are visible; a GPU's daemon takes --device cuda:N\n", err
    assert main([*base, "--device", "cpu"]) == 0
    out, err = capsys.readouterr()
    assert err == "" and ", TP" not in out
    with pytest.raises(UsageError, match=r"bad value for --device-rows: page given twice "
                                         r"\(8 and 9\)"):
        load_config({"device_rows": "page=8,swa_page=4,page=9"}, env={})
    l3 = {"preset": "dsv4-tiny", "device_rows": "page=8,swa_page=4,req_slot=4",
          "host_ratio": "2", "l3": "mooncake", "l3_scope": "x@1", "l3_master": "127.0.0.1:5",
          "l3_metadata": "P2PHANDSHAKE"}
    for host in ("0.0.0.0", "::", "[::]"):
        with pytest.raises(UsageError, match=f"--l3-local-host {re.escape(host)}: this is the "
                                             f"address the store tells its peers"):
            load_config({**l3, "l3_local_host": host}, env={})
    assert load_config({**l3, "l3_local_host": "10.0.0.7"}, env={}).l3_local_host == "10.0.0.7"
    # a metrics address that cannot be listened on was blamed on --metrics-port alone
    r = hicache("serve", "--device", "cpu", *base[1:], "--metrics-port", str(free_port()),
                "--metrics-addr", "192.0.2.55")  # (TEST-NET-1: no host has it)
    assert r.returncode == 2 and r.stderr.startswith(
        "hicache serve: error: --metrics-addr 192.0.2.55 --metrics-port "), r.stderr
    # shm_dirs were checked with access(), which says yes to root where no file can be made
    from hicache.core import config as C

    def no_file(*a: Any, **k: Any) -> Any:
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(C.tempfile, "mkstemp", no_file)
    with pytest.raises(UsageError, match=f"shm_dirs: {tmp_path} takes no new file "
                                         f"\\(Permission denied\\)"):
        C.check_shm_dirs((str(tmp_path),))
    monkeypatch.undo()
    C.check_shm_dirs((str(tmp_path),))  # a folder that takes files: passes, nothing left
    assert list(tmp_path.iterdir()) == []
    # a help that ends with its default in brackets said it twice ("[auto] (default: auto)")
    import argparse as A

    from hicache.cli.serve import add_arguments
    parser = A.ArgumentParser(prog="serve", formatter_class=lambda prog: A.HelpFormatter(
        prog, width=10_000))
    add_arguments(parser)
    helps = parser.format_help()
    assert "] (default:" not in helps.replace("(0, 1] (default: 0.8)", ""), helps
    assert "[auto]" in helps and "[auto] (default: auto)" not in helps
    assert "(0, 1] (default: 0.8)" in helps  # an interval is no default: it is still said
    if os.geteuid() == 0:  # the real case: root, whom access() tells /sys is writable
        r = hicache("serve", "--device", "cpu", *base[1:], env={"HICACHE_SHM_DIRS": "/sys"})
        assert r.returncode == 2 and "shm_dirs: /sys takes no new file" in r.stderr, r.stderr


def test_the_socket_warnings_are_the_summary_s_warnings(tmp_path):
    """A socket folder open to others was a timestamped log line, unlike every other start-up
    warning (``hicache serve: warning: ...``), and a stale socket file of a killed daemon was
    replaced without a word (operator review, fiftieth session): both are start-up warnings
    now."""
    open_dir = tmp_path / "shared"
    open_dir.mkdir(mode=0o755)
    os.chmod(open_dir, 0o755)
    stale = socket.socket(socket.AF_UNIX)
    stale.bind(str(open_dir / "d.sock"))  # a killed daemon's file: nothing listens
    stale.close()
    out = run_until_ready([sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu",
                           "--preset", "dsv4-tiny", "--device-rows",
                           "page=8,swa_page=4,req_slot=4", "--host-ratio", "2", "--socket",
                           f"ipc://{open_dir}/d.sock"], {})
    assert f"hicache serve: warning: socket directory {open_dir} is accessible by other " \
           f"users (mode 755); the socket itself is 0600\n" in out, out
    assert f"hicache serve: warning: replaced the stale socket file {open_dir}/d.sock (a " \
           f"daemon that did not stop cleanly left it; nothing answered there)\n" in out, out
    assert "WARNING" not in out, out
