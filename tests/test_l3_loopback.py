"""``hicache serve --l3 mooncake`` keeps Mooncake's listeners on loopback by itself when
``--l3-local-host`` is loopback (the default): Mooncake binds its client's handshake and data
listeners to 0.0.0.0 / [::] whatever it is told, so the daemon executes itself again under the
bind shim (``bind_shim.daemon_exec_env``), which rewrites only Mooncake's binds. Real
``mooncake_master`` and storage member on 127.0.0.1; the daemon gets no ``loopback_env()``.
The summary says where Mooncake listens."""
from __future__ import annotations

import time

import pytest

from hicache.core import bind_shim
from hicache.engine import l3_master

from conftest import start_daemon
from test_l3_mooncake import SCOPE

pytestmark = pytest.mark.skipif(l3_master.mooncake_dir() is None,
                                reason="Mooncake wheel not installed (pip install 'hicache[l3]')")
ROWS_FLAG = "page=8,swa_page=8,req_slot=4"


@pytest.fixture(scope="module")
def store():
    s = l3_master.LocalStore(segment="64MB").start()
    yield s
    s.close()


def _online(d, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    with d.client(name="probe", timeout=5) as c:
        while time.monotonic() < deadline:
            if c.stats()["l3"]["online"]:
                return
            time.sleep(0.1)
    raise AssertionError(f"L3 never came online\n{d.output(tail=4000)}")


def _daemon(tmp_path, store, *extra: str):
    return start_daemon(tmp_path, preset="dsv4-tiny", device_rows=ROWS_FLAG,
                        extra=("--l3", "mooncake", "--l3-master", store.master_addr,
                               "--l3-metadata", store.metadata_url, "--l3-scope", SCOPE,
                               *extra),
                        env={"LD_PRELOAD": "", "HICACHE_BIND_ADDR": ""})


def test_the_daemon_binds_mooncake_to_loopback_by_itself(tmp_path, store):
    store.wait_mounted()
    d = _daemon(tmp_path, store)
    try:
        _online(d)
        found = l3_master.listeners([d.pid])
        out = d.output()
        metrics = [a for _, a in found if a.endswith(f":{d.metrics_port}")]
        assert len(found) >= len(metrics) + 2, (found, out)  # Mooncake's handshake and data
        assert l3_master.non_loopback(found) == [], (found, out)
        assert "Mooncake listens on 127.0.0.1 only (loopback bind shim)" in out, out
        assert "L3: Mooncake listens on 127.0.0.1:" in out, out  # the ports, once set up
    finally:
        d.close()


def test_the_shim_leaves_the_daemons_own_listeners_as_asked(tmp_path, store):
    """``--metrics-addr 0.0.0.0`` is the operator's choice: only Mooncake's binds move."""
    store.wait_mounted()
    d = _daemon(tmp_path, store, "--metrics-addr", "0.0.0.0")
    try:
        _online(d)
        found = [a for _, a in l3_master.listeners([d.pid])]
        assert f"0.0.0.0:{d.metrics_port}" in found, found
        rest = [(d.pid, a) for a in found if not a.endswith(f":{d.metrics_port}")]
        assert len(rest) >= 2 and l3_master.non_loopback(rest) == [], found
    finally:
        d.close()


def test_a_non_loopback_local_host_keeps_mooncakes_binding_and_says_so():
    assert bind_shim.daemon_exec_env("10.0.0.7", {}) is None
    note = bind_shim.listen_note("10.0.0.7")
    assert note.startswith("Mooncake listens on all interfaces") and "10.0.0.7" in note, note
    # not under the shim (this test process): a loopback host says why it is not applied
    assert "although --l3-local-host 127.0.0.1 is loopback" in bind_shim.listen_note("127.0.0.1")


def test_the_shim_is_applied_at_most_once_and_never_fails_the_start(tmp_path, monkeypatch):
    """``daemon_exec_env`` gives None, with the reason for the summary, where an execution
    would not help: inside the execution it asked for (no second one, whatever LD_PRELOAD
    holds), a cache folder where the shim cannot be built (an OSError, not a traceback at
    start), or a shim path LD_PRELOAD would split."""
    monkeypatch.setattr(bind_shim, "shim_problem", None)
    assert bind_shim.daemon_exec_env("127.0.0.1", {bind_shim.EXECUTED: "1"}) is None
    assert "did not load" in bind_shim.shim_problem
    monkeypatch.setenv("XDG_CACHE_HOME", "/proc/no-such-folder")
    assert bind_shim.daemon_exec_env("127.0.0.1", {}) is None
    assert "cannot be built" in bind_shim.shim_problem
    spaced = tmp_path / "a b"
    monkeypatch.setenv("XDG_CACHE_HOME", str(spaced))
    assert bind_shim.daemon_exec_env("127.0.0.1", {}) is None
    assert "separator" in bind_shim.shim_problem
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "ok"))
    env = bind_shim.daemon_exec_env("127.0.0.1", {})
    assert env is not None and env[bind_shim.EXECUTED] == "1"
    assert env["HICACHE_BIND_ADDR"].startswith("127.0.0.1@")


def test_serve_executes_itself_again_only_from_its_own_command_line(tmp_path, monkeypatch):
    """The execution replays the interpreter's arguments: only when they are serve's own
    (``-m hicache.cli`` or the ``hicache`` script), never for a ``main([...])`` call in a
    process of its own (it would replace that process) or ``-c``, nor with a settings file
    that cannot be read twice."""
    import hicache.cli
    from hicache.cli.serve import _own_command_line

    monkeypatch.setattr(hicache.cli, "from_command_line", True)  # as main() sets it
    args = ["serve", "--l3", "mooncake"]
    monkeypatch.setattr("sys.orig_argv", ["python3", "-m", "hicache.cli", *args])
    monkeypatch.setattr("sys.argv", ["/x/hicache/cli/__main__.py", *args])
    assert _own_command_line(None) == (["-m", "hicache.cli", *args], "")
    script = tmp_path / "hicache"
    script.write_text("")
    monkeypatch.setattr("sys.orig_argv", ["python3", str(script), *args])
    monkeypatch.setattr("sys.argv", [str(script), *args])
    assert _own_command_line(None)[0] == [str(script), *args]
    import os
    fifo = tmp_path / "settings.fifo"
    os.mkfifo(fifo)
    assert _own_command_line(str(fifo))[0] is None
    assert "not a regular file" in _own_command_line(str(fifo))[1]
    monkeypatch.setattr("sys.orig_argv", ["python3", "-c", "...", *args])
    monkeypatch.setattr("sys.argv", ["-c", *args])
    assert _own_command_line(None)[0] is None
    monkeypatch.setattr("sys.orig_argv", ["python3", "-m", "hicache.cli", *args])
    monkeypatch.setattr("sys.argv", ["/x/hicache/cli/__main__.py", *args])
    monkeypatch.setattr(hicache.cli, "from_command_line", False)  # main([...]) in-process
    assert _own_command_line(None) == (None, "serve was not started from its own command "
                                             "line (called in-process)")
