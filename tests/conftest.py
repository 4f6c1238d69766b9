"""Shared fixtures.

``start_daemon(tmp_path, **options) -> DaemonProcess`` starts a real ``hicache serve`` subprocess
(CPU mode unless ``device="cuda:N"``) on a private ipc socket and waits until it answers a heartbeat; ``daemon`` is a
function-scoped fixture with the defaults below, ``daemon_factory`` lets a test pick options
(every daemon it starts is stopped at teardown). Defaults: the DSV4-Flash layout with scaled-down
device rows ``page=8, swa_page=4, req_slot=4`` and host rows twice that (``--host-ratio 2``),
heartbeat timeout 10 s, metrics on a free loopback port.

``shared_daemon`` is the same default daemon shared by a whole test module.

The long subprocess runs of three tests (the SGLang adapter's inner suite, two L3 demos) start
in one process of their own once collection selected those tests (and none is skipped), and run
beside the main suite (``tests/background_jobs.py``); the session's end stops what is left.
Under pytest-xdist (``make test`` runs two workers) the controller owns that one lane: the
workers announce the jobs their collection selected and read the results from its folder.

``sparse_memfds()`` counts the sparse regions whose memory this process still holds (an
in-process ``SparseRegions``'s regions: a region's memfd, or the mapping of a closed one that a
tensor view still keeps; garbage is collected first); ``region_held(info)`` says whether the
region a ``sparse_region`` reply names is still offered by its daemon: it takes one of the
hand-outs the replies naming the region made (``core.fd_handout``), so a test that asks it
about a region it expects closed keeps a hand-out untaken for that question (else the answer
would be False whatever the daemon did).

``DaemonProcess`` is ``hicache.engine.daemon_process.DaemonProcess``: ``.address``, ``.metrics_port``,
``.proc``, ``.output()`` (stdout+stderr so far), ``.client(**kw)`` (a ``hicache.engine.client.Client``),
``.stop(sig=SIGTERM) -> returncode``.
"""
from __future__ import annotations

import os
import socket
import tempfile
from pathlib import Path
from typing import Any, Callable, Iterator

import pytest

from hicache.engine.daemon_process import DaemonProcess, DaemonRefused

ROOT = Path(__file__).resolve().parents[1]
DEFAULT_ROWS = "page=8,swa_page=4,req_slot=4"


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def start_daemon(tmp: Path, *, device: str = "cpu", preset: str = "dsv4-flash",
                 device_rows: str = DEFAULT_ROWS,
                 host: tuple[str, str] = ("--host-ratio", "2"), heartbeat_timeout: float = 10.0,
                 metrics: bool = True, extra: tuple[str, ...] = (),
                 env: dict[str, str] | None = None, ready_timeout: float = 60.0,
                 fault: str | None = None) -> DaemonProcess:
    for attempt in range(3):
        fd, log = tempfile.mkstemp(prefix="daemon-", suffix=".log", dir=tmp)
        os.close(fd)
        d = DaemonProcess(device=device, preset=preset, device_rows=device_rows, host=host,
                          heartbeat_timeout=heartbeat_timeout,
                          metrics_port=free_port() if metrics else 0, extra=extra, env=env,
                          log_path=log, cwd=ROOT, ready_timeout=ready_timeout)
        if fault is not None:  # ``tests/fault_daemon.py``
            from fault_daemon import inject
            inject(d, fault)
        try:
            return d.start()
        except DaemonRefused as e:
            d.close()
            # the free port picked for its metrics was taken meanwhile (the other xdist
            # worker's daemon): another port; any other refusal is the test's to see
            if not (metrics and "--metrics-port" in str(e) and "in use" in str(e)) or \
                    attempt == 2:
                raise
        except BaseException:
            d.close()
            raise
    raise AssertionError("unreachable")


def load_fill_kernel(device: Any) -> None:
    """Launch the uint8 ``index_fill_`` kernel once on ``device``. A kernel's first launch
    loads its module, which waits for the GPU to go idle: a test whose engine stream sleeps
    and then fills rows, to prove that the daemon waits for its event, would otherwise see the
    sleep end before the event is even recorded, and pass without the wait."""
    import torch

    torch.zeros(1, 8, dtype=torch.uint8, device=device).index_fill_(
        0, torch.zeros(1, dtype=torch.int64, device=device), 1)


BACKGROUND = {"test_sglang_adapter.py::test_sglang_adapter_against_sglang_classes": "sglang",
              "test_l3_mooncake.py::test_demo_two_instances_and_bench_l3": "l3_demo",
              "test_l3_ckpt.py::test_demo_trace_two_instances_checkpoints": "l3_ckpt_demo",
              "test_bench_control.py::test_short_run_reports_rows_echo_and_ratios":
                  "bench_control",
              "test_bench_e2e.py::test_functional_run_on_cpu_verifies_every_loaded_byte":
                  "bench_e2e_cpu",
              "test_demo.py::test_small_generated_demo_verifies_every_byte": "demo_small"}


# modules whose tests run real Mooncake processes (a master, a storage member, daemons with
# ``--l3``): under xdist they all go to one worker (``make test`` passes ``--dist loadgroup``).
# Spread over two workers, one run before the port check in ``l3_master`` and a fresh-clone
# CI run after it each failed a test that hangs its own master or member (SIGSTOP) and found
# the call answered all the same: likely some other store's process took it (not proven).
# Mooncake picks some of its listening ports itself (e.g. 15000-17000); two stores started at
# once may meet there.
MOONCAKE_MODULES = {"test_kv_epochs.py", "test_kv_l3.py", "test_l3_ckpt.py",
                    "test_l3_format.py", "test_l3_loopback.py", "test_l3_mooncake.py"}


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Mark the tests of ``MOONCAKE_MODULES`` as one xdist group."""
    for item in items:
        if item.path.name in MOONCAKE_MODULES:
            item.add_marker(pytest.mark.xdist_group("mooncake"))


def pytest_configure(config: pytest.Config) -> None:
    """Under xdist, one background lane for the whole run: the controller's folder, which each
    worker joins (``tests/background_jobs.py``)."""
    if hasattr(config, "workerinput") and "hicache_lane" in config.workerinput:
        import background_jobs

        background_jobs.join(config.workerinput["hicache_lane"])


@pytest.hookimpl(optionalhook=True)
def pytest_configure_node(node: Any) -> None:
    """(xdist controller) Give each worker the lane's folder."""
    import background_jobs

    node.workerinput["hicache_lane"] = background_jobs.share()


@pytest.hookimpl(optionalhook=True)
def pytest_xdist_node_collection_finished(node: Any, ids: list[str]) -> None:
    """(xdist controller) A worker has collected, and announced the jobs its tests need."""
    import background_jobs

    background_jobs.start_announced()


@pytest.hookimpl(tryfirst=True)  # (under xdist: before the worker reports its collection)
def pytest_collection_finish(session: pytest.Session) -> None:
    """Start the background jobs of the selected tests that no ``skipif`` skips; an xdist
    worker announces them to its controller instead, which starts the one lane."""
    names = []
    for item in session.items:
        job = BACKGROUND.get(item.nodeid.rpartition("/")[2])
        if job is not None and not any(m.args and m.args[0]
                                       for m in item.iter_markers("skipif")):
            names.append(job)
    if names:
        import background_jobs

        if hasattr(session.config, "workerinput"):
            background_jobs.announce(names)
        else:
            background_jobs.start(names)


def pytest_sessionfinish(session: pytest.Session) -> None:
    import background_jobs

    background_jobs.stop()  # (a worker started none: nothing to stop)


@pytest.fixture
def daemon_factory(tmp_path: Path) -> Iterator[Callable[..., DaemonProcess]]:
    started: list[DaemonProcess] = []

    def make(**kw: Any) -> DaemonProcess:
        d = start_daemon(tmp_path, **kw)
        started.append(d)
        return d

    yield make
    close_all(started)


@pytest.fixture
def short_tmp() -> Iterator[Path]:
    """A private folder with a short path (/tmp/hc-t-XXXXXXXX), removed after the test: for
    Unix sockets, whose paths are limited to 107 bytes (``tmp_path`` under an xdist worker,
    /tmp/pytest-of-USER/pytest-NNN/popen-gwN/<test name>, came to more)."""
    import shutil

    d = tempfile.mkdtemp(prefix="hc-t-")
    try:
        yield Path(d)
    finally:
        shutil.rmtree(d, ignore_errors=True)


def close_all(daemons: list[DaemonProcess]) -> None:
    """Stop ``daemons`` together: SIGTERM to each first, then each waited for and closed (an
    L3 daemon's stop takes ~1 s in Mooncake's ``close``; one after another, they added up)."""
    for d in daemons:
        d.signal_stop()
    for d in reversed(daemons):
        d.close()


@pytest.fixture
def daemon(daemon_factory: Callable[..., DaemonProcess]) -> DaemonProcess:
    return daemon_factory()


@pytest.fixture(scope="module")
def shared_daemon(tmp_path_factory: pytest.TempPathFactory) -> Iterator[DaemonProcess]:
    """One default daemon for a whole test module (tests isolate themselves by client)."""
    d = start_daemon(tmp_path_factory.mktemp("daemon"))
    yield d
    d.close()


def sparse_memfds() -> int:
    import gc

    from hicache.core.sparse_shm import SPARSE_PREFIX

    gc.collect()
    inodes = set()  # a mapping keeps a descriptor of its own (``mmap`` dups it)
    for name in os.listdir("/proc/self/fd"):
        path = f"/proc/self/fd/{name}"
        try:
            if os.readlink(path).startswith(f"/memfd:{SPARSE_PREFIX}"):
                inodes.add(os.stat(path).st_ino)
        except OSError:
            pass
    return len(inodes)


def region_held(info: dict[str, Any]) -> bool:
    from hicache.core.sparse_shm import SparseShm

    try:
        SparseShm.open(info).close()
    except (OSError, ValueError):
        return False
    return True
