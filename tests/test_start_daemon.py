"""``conftest.start_daemon``: a metrics port taken between picking it and the daemon binding it
(the other xdist worker's daemon) starts the daemon again on another port; any other refusal
reaches the test at once, and no refused daemon is left running."""
from __future__ import annotations

import socket
from pathlib import Path
from typing import Iterator

import pytest

import conftest
from hicache.engine.daemon_process import DaemonRefused


@pytest.fixture
def held_port() -> Iterator[int]:
    """A loopback port another socket listens on for the test's length."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        s.listen()
        yield s.getsockname()[1]


def test_a_metrics_port_taken_meanwhile_starts_the_daemon_on_another(
        tmp_path: Path, held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    picked: list[int] = []
    real = conftest.free_port

    def taken_first() -> int:  # the first pick is the held port, as a race would leave it
        port = held_port if not picked else real()
        picked.append(port)
        return port

    monkeypatch.setattr(conftest, "free_port", taken_first)
    d = conftest.start_daemon(tmp_path, preset="dsv4-tiny")
    try:
        assert len(picked) == 2 and picked[0] == held_port
        assert d.metrics_port == picked[1] != held_port
        with d.client() as c:
            assert c.heartbeat()["pid"] == d.proc.pid
    finally:
        d.close()


def test_any_other_refusal_is_not_retried(tmp_path: Path, held_port: int,
                                          monkeypatch: pytest.MonkeyPatch) -> None:
    picked: list[int] = []

    def count() -> int:
        picked.append(held_port)
        return held_port

    monkeypatch.setattr(conftest, "free_port", count)
    # the port is held, but the refusal that comes first is the unknown preset's
    with pytest.raises(DaemonRefused, match="preset") as e:
        conftest.start_daemon(tmp_path, preset="no-such-preset")
    assert "in use" not in str(e.value) and len(picked) == 1


def test_a_port_taken_every_time_fails_after_three_tries(
        tmp_path: Path, held_port: int, monkeypatch: pytest.MonkeyPatch) -> None:
    picked: list[int] = []

    def always() -> int:
        picked.append(held_port)
        return held_port

    monkeypatch.setattr(conftest, "free_port", always)
    with pytest.raises(DaemonRefused, match="in use"):
        conftest.start_daemon(tmp_path, preset="dsv4-tiny")
    assert len(picked) == 3
