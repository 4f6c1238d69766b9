"""``DaemonProcess`` (how the demo, the benches and the tests start a daemon): ready only when
its own daemon answers, and nothing left behind by a start that fails or is interrupted."""
from __future__ import annotations

import os

import pytest

from hicache.engine.daemon_process import DaemonProcess, DaemonRefused

ROWS = "page=8,swa_page=8,req_slot=4"


def test_start_is_not_fooled_by_another_daemon_on_the_address(tmp_path):
    """Another daemon serves the address: the new one exits, refused, and ``start`` says so
    (it used to take the other daemon's heartbeat for its own and report ready)."""
    with DaemonProcess(device="cpu", preset="dsv4-tiny", device_rows=ROWS) as a:
        b = DaemonProcess(a.address, device="cpu", preset="dsv4-tiny", device_rows=ROWS,
                          log_path=str(tmp_path / "b.log"))
        try:
            with pytest.raises(DaemonRefused, match="^the daemon refused to start: another "
                               "daemon already serves") as e:
                b.start()
            assert isinstance(e.value, RuntimeError) and "\n" not in str(e.value)
            assert "hicache serve: error: another daemon" in e.value.output
        finally:
            b.close()
        assert a.alive()


def test_a_failed_enter_leaves_no_private_directory():
    d = DaemonProcess(device="cpu", preset="dsv4-tiny", extra=("--no-such-flag",))
    assert d.dir and os.path.isdir(d.dir)
    with pytest.raises(RuntimeError):
        with d:
            pass
    assert not os.path.isdir(d.dir)


def test_an_interrupted_start_leaves_no_daemon_and_no_directory(monkeypatch):
    """Ctrl-C while ``start`` waits for the first heartbeat: the daemon it launched is
    stopped and its directory removed (the daemon kept running). The interrupt comes from
    inside the wait, once the daemon is launched and polled: a thread sending SIGINT once the
    process existed ran too late on a loaded machine (``start`` had returned)."""
    d = DaemonProcess(device="cpu", preset="dsv4-tiny", exit_with_parent=False)
    launched: list[int] = []

    def ctrl_c(self: DaemonProcess, timeout: float) -> None:
        assert self.proc is not None and self.proc.poll() is None
        launched.append(self.proc.pid)
        raise KeyboardInterrupt

    monkeypatch.setattr(DaemonProcess, "_wait_ready", ctrl_c)
    try:
        with pytest.raises(KeyboardInterrupt):
            with d:
                pass
        assert launched and not d.alive() and not os.path.isdir(d.dir)
        with pytest.raises(ProcessLookupError):
            os.kill(launched[0], 0)
    finally:
        d.close()


def test_the_callers_exported_settings_do_not_reach_its_daemon(tmp_path, monkeypatch):
    """An operator's exported ``HICACHE_*`` settings or settings file used to reach the
    daemons the demo and the benches start with flags of their own, and refuse them (a file's
    ``pp_size = 4`` made the demo's daemon serve a quarter of the model). Only ``env`` passes
    settings now; variables that something else reads stay."""
    from hicache.core.config import without_serve_settings

    toml = tmp_path / "serve.toml"
    toml.write_text('pp_size = 4\nhost_mem = "10TiB"\n')
    typo = "HICACHE_" + "HOST_MEMM"  # a misspelled setting (spelled apart: a test scans names)
    shell = {"HICACHE_CONFIG_FILE": str(toml), "HICACHE_MAX_RUNNING": "128",
             typo: "1G", "HICACHE_BIND_ADDR": "127.0.0.1", "HOME": "/root"}
    assert without_serve_settings(shell) == {"HICACHE_BIND_ADDR": "127.0.0.1", "HOME": "/root"}
    for k, v in shell.items():
        monkeypatch.setenv(k, v)
    d = DaemonProcess(device="cpu", preset="dsv4-tiny", device_rows=ROWS,
                      env={"HICACHE_INLINE_MAX_BYTES": "1"})
    assert not {"HICACHE_CONFIG_FILE", "HICACHE_MAX_RUNNING", typo} & set(d.env)
    assert d.env["HICACHE_INLINE_MAX_BYTES"] == "1" and d.env["HICACHE_BIND_ADDR"] == "127.0.0.1"
    with d:  # it starts; with the shell's settings it was refused
        c = d.client(name="env")
        try:
            assert c.heartbeat()["pid"] == d.pid
        finally:
            c.close()
