"""Clean exits: SIGINT (to the process group, as Ctrl-C), SIGTERM and SIGHUP (to the command
alone) stop `demo`, `bench soak` and `serve` the same way: one line, exit 128 + signal, no
traceback, and no process, /dev/shm file, socket or private folder left behind. A SIGKILLed
demo's daemon exits within 5 s (parent-death signal / watchdog)."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
SIGNALS = [signal.SIGINT, signal.SIGTERM, signal.SIGHUP]
DEMO = ["--device", "cpu", "--progress-seconds", "0", "--requests", "200", "--device-pages", "64",
        "--host-pages", "256"]
TINY = ["--preset", "dsv4-tiny", "--device-rows", "page=8,swa_page=8,req_slot=4",
        "--host-ratio", "2"]


def launch(tmp: Path, *args: str) -> tuple[subprocess.Popen, Path]:
    """``hicache ARGS`` in its own session (so a group signal reaches only it and its children);
    stdout and stderr go to one file."""
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    out = tmp / "out.txt"
    with open(out, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "hicache.cli", *args], stdout=f,
                             stderr=subprocess.STDOUT, cwd=str(ROOT), env=env,
                             start_new_session=True)
    return p, out


def wait_for(p: subprocess.Popen, out: Path, pattern: str, timeout: float = 120) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if re.search(pattern, out.read_text(errors="replace")):
            return
        if p.poll() is not None:
            break
        time.sleep(0.2)
    p.kill()
    pytest.fail(f"never saw {pattern!r}:\n{out.read_text(errors='replace')[-3000:]}")


def _memfds(pid: int, prefix: str) -> set[str]:
    """The memfds named ``prefix...`` process ``pid`` has open."""
    out = set()
    try:
        for fd in os.listdir(f"/proc/{pid}/fd"):
            try:
                link = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if link.startswith(f"/memfd:{prefix}"):
                out.add(link)
    except OSError:
        pass
    return out


def leftovers(pid: int) -> tuple[list[psutil.Process], list[str], list[str]]:
    """The command's process tree, the /dev/shm files its processes created (``hicache-*``
    named by pid: the daemon's sockets there; pools are memfds, which go with their last
    holder), and the private folders / socket files named on their command lines."""
    procs = [psutil.Process(pid)]
    procs += procs[0].children(recursive=True)
    pids = {p.pid for p in procs}
    shm = [f"/dev/shm/{n}" for n in os.listdir("/dev/shm")
           if n.startswith("hicache-") and any(f"-{x}-" in n for x in pids)]
    paths = []
    for p in procs:
        for a in p.cmdline():
            m = re.match(r"ipc://(/tmp/[^/]+)/(d\.sock)$", a)
            if m:
                paths += [m.group(1), m.group(1) + "/" + m.group(2)]
    return procs, shm, paths


def gone(procs: list[psutil.Process], timeout: float) -> list[int]:
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    return [p.pid for p in alive if p.status() != psutil.STATUS_ZOMBIE]


def interrupt_and_check(p: subprocess.Popen, out: Path, sig: int, line: str) -> str:
    procs, shm, paths = leftovers(p.pid)
    if sig == signal.SIGINT:
        os.killpg(p.pid, sig)  # Ctrl-C: the whole foreground group
    else:
        os.kill(p.pid, sig)
    try:
        rc = p.wait(90)
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        pytest.fail(f"still running 90 s after {sig!r}:\n{out.read_text()[-3000:]}")
    text = out.read_text(errors="replace")
    assert rc == 128 + sig, (rc, text[-3000:])
    assert "Traceback" not in text, text[-5000:]
    assert text.count(line) == 1, text[-3000:]
    assert not gone(procs, 10), (procs, text[-3000:])
    assert [f for f in shm if os.path.exists(f)] == [], text[-3000:]
    assert [x for x in paths if os.path.exists(x)] == [], text[-3000:]
    return text


@pytest.mark.parametrize("sig", SIGNALS, ids=lambda s: signal.Signals(s).name)
def test_serve_stops_cleanly(tmp_path, sig):
    sock = tmp_path / "s" / "d.sock"
    p, out = launch(tmp_path, "serve", *TINY, "--socket", f"ipc://{sock}")
    wait_for(p, out, "hicache serve: ready")
    assert sock.exists()
    name = signal.Signals(sig).name
    interrupt_and_check(p, out, sig, f"hicache serve: stopped by {name}")
    assert not sock.exists() and not sock.parent.exists()  # the folder it made goes too


# demo and soak share serve's signal path (``cli.main``), which every signal above exercises:
# one signal each keeps the suite short
@pytest.mark.parametrize("sig", [signal.SIGINT], ids=lambda s: signal.Signals(s).name)
def test_demo_stops_cleanly(tmp_path, sig):
    p, out = launch(tmp_path, "demo", *DEMO)
    wait_for(p, out, r"\[demo\] replaying")
    time.sleep(1.0)  # mid-replay: transfers in flight
    interrupt_and_check(p, out, sig, f"hicache demo: interrupted by {signal.Signals(sig).name}")


@pytest.mark.parametrize("sig", [signal.SIGTERM], ids=lambda s: signal.Signals(s).name)
def test_bench_soak_stops_cleanly(tmp_path, sig):
    p, out = launch(tmp_path, "bench", "soak", "--clients", "2", "--ops", "1000000")
    deadline = time.monotonic() + 120
    while time.monotonic() < deadline:  # both workers have their pools (memfds)
        kids = psutil.Process(p.pid).children(recursive=True)
        # (the daemon holds them too, once registered: the pools are counted, not holders)
        if len(set().union(*(_memfds(k.pid, "hicache-dev-soak") for k in kids))) == 2:
            break
        time.sleep(0.3)
    else:
        p.kill()
        pytest.fail(out.read_text()[-3000:])
    time.sleep(1.0)
    interrupt_and_check(p, out, sig,
                        f"hicache bench soak: interrupted by {signal.Signals(sig).name}")


def test_sigkilled_demo_takes_its_daemon_down(tmp_path):
    p, out = launch(tmp_path, "demo", *DEMO)
    wait_for(p, out, r"\[demo\] replaying")
    procs, shm, paths = leftovers(p.pid)
    daemons = [x for x in procs if "serve" in x.cmdline()]
    assert len(daemons) == 1
    try:
        os.kill(p.pid, signal.SIGKILL)
        p.wait(10)
        t0 = time.monotonic()
        assert not gone(daemons, 5.0), out.read_text()[-3000:]
        assert time.monotonic() - t0 < 5.0
    finally:  # what only the killed demo could have removed: its shm file and private folder
        for x in procs:
            if x.is_running():
                x.kill()
        for f in shm:
            if os.path.exists(f):
                os.unlink(f)
        import shutil
        for d in paths[::2]:
            shutil.rmtree(d, ignore_errors=True)


def test_a_daemon_whose_parent_died_says_so(tmp_path):
    """``--parent-pid``: a daemon stopped because its launcher died said "stopped by SIGTERM",
    as if an operator had sent it (forty-eighth session's operator review); now the line names
    the parent that exited."""
    out = tmp_path / "serve.txt"
    out.write_text("")
    serve = " ".join([sys.executable, "-m", "hicache.cli", "serve", "--device", "cpu", *TINY,
                      "--socket", f"ipc://{tmp_path}/p.sock", "--parent-pid", "$$"])
    p = subprocess.Popen(["bash", "-c", f"{serve} > {out} 2>&1 & wait"], cwd=str(ROOT),
                         env=dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1"),
                         start_new_session=True)
    try:
        wait_for(p, out, r"hicache serve: ready")
        daemons = psutil.Process(p.pid).children()
        assert len(daemons) == 1
        p.kill()
        p.wait(10)
        assert not gone(daemons, 10.0), out.read_text()[-3000:]
        assert f"hicache serve: stopped by SIGTERM: its parent process {p.pid} exited" in \
            out.read_text(), out.read_text()[-3000:]
    finally:
        for x in psutil.Process(p.pid).children() if p.poll() is None else []:
            x.kill()
        p.kill()


def test_a_second_signal_while_serve_drains_does_not_cut_its_clean_up():
    """SIGTERM with ~300 CPU copies queued, then SIGTERM again while ``close`` drains them (a
    launcher's death signal after a Ctrl-C, a supervisor repeating itself): the daemon still
    finishes its clean-up (the socket and its lock go) and names the first signal. The second
    one used to raise inside ``close``: both files stayed, and it said "interrupted"."""
    from hicache.core.layout import build_layout, preset
    from hicache.engine.daemon_process import DaemonProcess
    from hicache.engine.device_pools import DevicePools

    d = DaemonProcess(pipe=True, metrics_port=0, exit_with_parent=False,
                      env={"HICACHE_INLINE_MAX_BYTES": "1"})  # every copy queued
    d.start()
    sock = d.address[len("ipc://"):]
    pools = DevicePools(build_layout(preset("dsv4-flash")), {"page": 8, "swa_page": 4,
                                                               "req_slot": 4})
    c = d.client(name="worker")
    try:
        c.register(pools)
        host = c.alloc({"swa_page": 4})["swa_page"]
        for _ in range(300):  # ~40 MB each
            c.backup({"swa_page": ([0, 1, 2, 3], host)})
        assert c.stats()["in_flight"] > 0
        d.proc.send_signal(signal.SIGTERM)
        time.sleep(0.15)
        assert d.proc.poll() is None  # still draining
        d.proc.send_signal(signal.SIGTERM)
        assert d.proc.wait(60) == 128 + signal.SIGTERM
        out = d.output()
        assert "hicache serve: stopped by SIGTERM" in out and "interrupted" not in out, out
        assert not os.path.lexists(sock) and not os.path.lexists(sock + ".lock"), out
    finally:
        c.close()
        pools.close()
        d.close()


def test_serve_started_under_nohup_outlives_a_hang_up(tmp_path):
    """``nohup hicache serve &``: a process that starts with SIGHUP ignored keeps it ignored
    (the operator asked to outlive the terminal); SIGTERM still stops it in order."""
    sock = tmp_path / "d.sock"
    env = dict(os.environ, PYTHONPATH=str(ROOT), PYTHONUNBUFFERED="1")
    out = tmp_path / "out.txt"
    with open(out, "wb") as f:
        p = subprocess.Popen([sys.executable, "-m", "hicache.cli", "serve", *TINY, "--socket",
                              f"ipc://{sock}"], stdout=f, stderr=subprocess.STDOUT,
                             cwd=str(ROOT), env=env, start_new_session=True,
                             preexec_fn=lambda: signal.signal(signal.SIGHUP, signal.SIG_IGN))
    wait_for(p, out, r"hicache serve: ready")
    os.kill(p.pid, signal.SIGHUP)
    time.sleep(1.0)
    assert p.poll() is None, out.read_text(errors="replace")[-2000:]
    os.kill(p.pid, signal.SIGTERM)
    assert p.wait(90) == 128 + signal.SIGTERM
    assert "stopped by SIGTERM" in out.read_text(errors="replace")
    assert not sock.exists()


def _signal_self(sig: int = signal.SIGTERM) -> None:
    os.kill(os.getpid(), sig)
    time.sleep(0.5)  # the handler runs in here


def test_a_signal_whose_interrupt_c_code_cleared_does_not_mute_the_next():
    """``import torch`` imports numpy from C code that clears an exception raised there: a stop
    signal during ``serve``'s start-up raised ``Interrupted`` there, nothing propagated, and
    every later signal was ignored (taken for the first one's clean-up), so the daemon went on
    to serve. Now a signal is ignored only while an ``Interrupted`` is being handled, and
    ``on_signals`` (``serve``'s orderly stop) hands a cleared one to its handler at once."""
    from hicache.cli import lifecycle

    old = lifecycle.install()
    try:
        try:
            _signal_self()
        except lifecycle.Interrupted:
            pass  # as the C code did: cleared
        with pytest.raises(lifecycle.Interrupted):  # the next one still stops the command
            _signal_self()
        got: list[int] = []
        with lifecycle.on_signals(got.append):
            assert got == [signal.SIGTERM]  # the cleared one, handed over on entry
        lifecycle.restore(old)
        old = lifecycle.install()
        with pytest.raises(lifecycle.Interrupted) as e:
            try:
                _signal_self(signal.SIGINT)
            finally:  # clean-up of the one raised: a second signal does not cut it short
                try:
                    _signal_self(signal.SIGTERM)
                except OSError:
                    pass  # (an exception raised and caught in clean-up changes nothing)
                _signal_self(signal.SIGTERM)
        assert e.value.signum == signal.SIGINT
    finally:
        lifecycle.restore(old)


def test_a_signal_while_the_command_module_loads_is_one_line():
    """``main`` builds its parser by importing the command's module (a bench's imports torch,
    ~2 s); a Ctrl-C then printed a traceback and the process died by the signal, as the stop
    signals were routed only after that. The stand-in parser build signals itself."""
    code = ("import os, signal, sys, time\n"
            "import hicache.cli as cli\n"
            "real = cli.build_parser\n"
            "def slow(argv):\n"
            "    os.kill(os.getpid(), signal.SIGINT)\n"
            "    time.sleep(1)\n"
            "    return real(argv)\n"
            "cli.build_parser = slow\n"
            "sys.exit(cli.main(['bench', 'pin']))\n")
    p = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=str(ROOT), env=dict(os.environ, PYTHONPATH=str(ROOT)))
    assert p.returncode == 130, (p.returncode, p.stderr)
    assert p.stderr.strip() == "hicache: interrupted by SIGINT", p.stderr
