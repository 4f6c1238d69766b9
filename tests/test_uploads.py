"""``kernels.uploads.upload``: the bytes arrive, and a staging buffer a copy may still read is
never written again (CUDA), so no upload can change another's bytes."""
from __future__ import annotations

import threading
from typing import Any, Callable

import numpy as np
import pytest
import torch

from hicache.kernels import uploads
from hicache.kernels.uploads import upload

cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_cpu_upload_is_the_concatenation() -> None:
    a, b = np.arange(5, dtype=np.int64), np.array([7, -1], dtype=np.int64)
    t = upload([a, b], torch.device("cpu"))
    assert t.dtype == torch.int64 and t.tolist() == [0, 1, 2, 3, 4, 7, -1]


def _in_fresh_thread(body: Callable[[], None]) -> None:
    """Run ``body`` on a new thread (its own, empty staging buffers); re-raise what it raised."""
    err: list[BaseException] = []

    def run() -> None:
        try:
            body()
        except BaseException as e:  # noqa: BLE001 - handed to the test's thread
            err.append(e)

    th = threading.Thread(target=run)
    th.start()
    th.join()
    if err:
        raise err[0]


@cuda
@pytest.mark.cuda
def test_a_buffer_a_copy_may_still_read_is_not_written_again() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    rng = np.random.default_rng(1)

    def body() -> None:
        torch.cuda.set_device(dev)
        s = torch.cuda.Stream(dev)
        sent: list[tuple[np.ndarray, Any]] = []
        with torch.cuda.stream(s):
            torch.cuda._sleep(300_000_000)  # the copies below wait behind this
            a = rng.integers(-2**40, 2**40, 1000)
            sent.append((a, upload([a[:600], a[600:]], dev)))
            b1 = uploads._STAGING.buffers[0]
            b = rng.integers(-2**40, 2**40, 1000)
            sent.append((b, upload([b], dev)))  # the first copy has not run: another buffer
            assert len(uploads._STAGING.buffers) == 2
        s.synchronize()
        with torch.cuda.stream(s):
            c = np.arange(3000, dtype=np.int64)
            sent.append((c, upload([c], dev)))  # both done: the first buffer again
            assert len(uploads._STAGING.buffers) == 2 and uploads._STAGING.buffers[-1] is b1
            big = np.arange(b1.view.size + 1, dtype=np.int64)
            sent.append((big, upload([big], dev)))  # larger than both: a new one
            assert uploads._STAGING.buffers[-1].view.size >= big.size
            torch.cuda._sleep(300_000_000)
            for k in range(uploads.MAX_BUFFERS + 2):  # all busy: past the cap, the oldest waits
                x = rng.integers(0, 2**40, 2000 + k)
                sent.append((x, upload([x], dev)))
            assert len(uploads._STAGING.buffers) <= uploads.MAX_BUFFERS
        s.synchronize()
        for arr, t in sent:
            assert t.device == dev and torch.equal(t.cpu(), torch.from_numpy(arr))

    _in_fresh_thread(body)


@cuda
@pytest.mark.cuda
def test_an_empty_upload_is_an_empty_tensor() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    t = upload([np.zeros(0, dtype=np.int64)], dev)
    assert t.numel() == 0 and t.device == dev


@cuda
@pytest.mark.cuda
def test_a_thread_that_ends_before_its_copy_ran_does_not_give_its_buffer_away() -> None:
    dev = torch.device("cuda", torch.cuda.current_device())
    s = torch.cuda.Stream(dev)
    arr = np.arange(5000, dtype=np.int64) * 7 + 3
    got: list[torch.Tensor] = []

    def body() -> None:
        torch.cuda.set_device(dev)
        with torch.cuda.stream(s):
            torch.cuda._sleep(300_000_000)
            got.append(upload([arr], dev))  # queued behind the sleep; the thread ends now

    _in_fresh_thread(body)
    # pinned blocks handed out now would be the dropped buffer's if nobody had waited
    junk = [torch.full((8192,), -1, dtype=torch.int64, pin_memory=True) for _ in range(8)]
    s.synchronize()
    assert torch.equal(got[0].cpu(), torch.from_numpy(arr))
    del junk


class _Driver:
    """A driver whose calls return the CUresults given (``fail``: call name -> code; the rest
    succeed) and that records the calls made, by name, in ``calls`` (and the events they
    named, in ``events``). ``done``: events whose query says done when ``query`` is not set."""

    def __init__(self, done: Any = None, **fail: int) -> None:
        self.fail, self.calls, self.events, self.done = fail, [], [], done

    def _call(self, name: str, event: Any = None) -> int:
        self.calls.append(name)
        self.events.append(event)
        return self.fail.get(name, 0)

    def query(self, event: Any) -> int:
        rc = self._call("query", event)
        if "query" in self.fail or self.done is None:
            return rc
        return 0 if event in self.done else uploads._CUDA_ERROR_NOT_READY

    def sync(self, event: Any) -> int:
        return self._call("sync", event)

    def destroy(self, event: Any) -> int:
        return self._call("destroy", event)

    def create(self, out: Any, flags: int) -> int:
        return self._call("create")

    def record(self, event: Any, stream: Any) -> int:
        return self._call("record", event)


def _fake_buffers(n: int) -> list[uploads._Buffer]:
    """``n`` staging buffers of 16 words on device 0 (CPU memory; event ``i`` stands for the
    driver event of buffer ``i``)."""
    out = []
    for i in range(n):
        host = torch.zeros(16, dtype=torch.int64)
        out.append(uploads._Buffer(host, host.numpy(), host.data_ptr(), 0, i))
    return out


def test_a_reused_buffer_goes_last_so_the_cap_waits_for_the_one_used_longest_ago() -> None:
    """At the cap an upload waits for the copy of the buffer used longest ago, not for the one
    just reused (whose copy is likely the newest in the stream)."""
    def body() -> None:
        held = uploads._STAGING.buffers
        held.extend(_fake_buffers(uploads.MAX_BUFFERS))
        first = list(held)
        got = uploads._free_buffer(_Driver(done={0}), 8, 0)  # type: ignore[arg-type]
        assert got is first[0] and held == first[1:] + first[:1]
        d = _Driver(done=set(), create=1)  # all busy; a new buffer's event cannot be made
        with pytest.raises(uploads.TransferError, match="cuEventCreate failed"):
            uploads._free_buffer(d, 8, 0)  # type: ignore[arg-type]
        waited = [e for c, e in zip(d.calls, d.events) if c == "sync"]
        assert waited == [1]  # the buffer used longest ago, not buffer 0
        assert held == first[2:] + first[:1]
        held.clear()

    _in_fresh_thread(body)


def test_a_buffer_whose_event_was_not_recorded_is_never_used_again() -> None:
    def body() -> None:
        held = uploads._STAGING.buffers
        held.extend(_fake_buffers(2))
        b0, b1 = held
        with pytest.raises(uploads.TransferError, match="cuEventRecord failed with CUresult 3"):
            uploads._record(_Driver(record=3), b0, 0)  # type: ignore[arg-type]
        assert held == [b1] and uploads._ORPHANS[-1] is b0
        uploads._ORPHANS.remove(b0)
        held.clear()

    _in_fresh_thread(body)


def test_a_new_buffers_event_is_destroyed_when_its_memory_cannot_be_pinned(monkeypatch) -> None:
    def no_memory(*a: Any, **k: Any) -> torch.Tensor:
        raise RuntimeError("out of pinned memory")

    def body() -> None:
        d = _Driver()
        monkeypatch.setattr(torch, "empty", no_memory)
        try:
            with pytest.raises(RuntimeError, match="out of pinned memory"):
                uploads._free_buffer(d, 8, 0)  # type: ignore[arg-type]
        finally:
            monkeypatch.undo()
        assert d.calls == ["create", "destroy"] and uploads._STAGING.buffers == []

    _in_fresh_thread(body)


def test_a_failed_event_query_is_an_error_naming_the_call() -> None:
    def body() -> None:
        held = uploads._STAGING.buffers
        held.extend(_fake_buffers(1))
        before = list(held)
        with pytest.raises(uploads.TransferError, match="cuEventQuery failed with CUresult 999"):
            uploads._free_buffer(_Driver(query=999), 8, 0)  # type: ignore[arg-type]
        assert held == before
        held.clear()  # nothing to wait for at this thread's end

    _in_fresh_thread(body)


@pytest.mark.parametrize("fail, message, kept, last_calls", [
    # the wait failed: the copy may still read the oldest buffer, so it stays, held
    ({"sync": 700}, "cuEventSynchronize failed with CUresult 700", slice(None), ["query", "sync"]),
    # the wait passed, the destroy failed: the oldest buffer (its copy done) is gone
    ({"destroy": 4}, "cuEventDestroy failed with CUresult 4", slice(1, None), ["sync", "destroy"]),
])
def test_at_the_cap_a_failed_wait_or_destroy_leaves_only_buffers_no_copy_reads(
        fail: dict, message: str, kept: slice, last_calls: list[str]) -> None:
    def body() -> None:
        held = uploads._STAGING.buffers
        held.extend(_fake_buffers(uploads.MAX_BUFFERS))
        before = list(held)
        d = _Driver(query=uploads._CUDA_ERROR_NOT_READY, **fail)  # every buffer busy
        with pytest.raises(uploads.TransferError, match=message):
            uploads._free_buffer(d, 8, 0)  # type: ignore[arg-type]
        assert held == before[kept]
        assert d.calls[:uploads.MAX_BUFFERS] == ["query"] * uploads.MAX_BUFFERS
        assert d.calls[-2:] == last_calls
        held.clear()

    _in_fresh_thread(body)
