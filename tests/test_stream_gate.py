"""``core.stream_gate``: gates open in order (CPU), and a stream waits at a closed gate (CUDA)."""
from __future__ import annotations

import time

import pytest
import torch

from hicache.core.stream_gate import StreamGate


def _host_only() -> StreamGate:
    """A gate whose word is ordinary memory: ``open`` / ``opened`` without a GPU."""
    g = object.__new__(StreamGate)
    g.word, g.addr, g.issued, g.value, g._may = torch.zeros(1, dtype=torch.int32), 0, 0, 0, set()
    return g


def test_gates_open_in_order_and_the_numbers_wrap() -> None:
    g = _host_only()
    g.issued = 3
    g.open(2)  # gate 1 may not open yet: the word stays, so neither does 2
    assert int(g.word[0]) == 0 and not g.opened(1) and not g.opened(2)
    g.open(1)
    assert int(g.word[0]) == 2 and g.opened(1) and g.opened(2) and not g.opened(3)
    g.open(3)
    assert int(g.word[0]) == 3
    # around the 32-bit wrap: the word holds the number's two's complement, and ``opened`` is
    # the cyclic comparison the driver's GEQ wait makes
    g = _host_only()
    g.value = g.issued = 0xFFFFFFFE
    g.open(0xFFFFFFFF)
    assert int(g.word[0]) == -1 and g.opened(0xFFFFFFFF) and not g.opened(0)
    g.open(0)
    assert int(g.word[0]) == 0 and g.opened(0) and g.opened(0xFFFFFFFF) and not g.opened(1)


@pytest.mark.cuda
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_a_stream_waits_at_a_closed_gate_until_the_host_opens_it() -> None:
    dev = torch.device("cuda:0")
    torch.cuda.set_device(dev)
    s = torch.cuda.Stream(dev)
    g = StreamGate()
    x = torch.zeros(4, device=dev)
    first = g.close(s)
    second = g.close(s)
    assert (first, second) == (1, 2)
    with torch.cuda.stream(s):
        x.add_(1)  # behind both gates
    done = torch.cuda.Event()
    done.record(s)
    time.sleep(0.05)
    assert not done.query(), "the stream went past a closed gate"
    g.open(second)  # gate 2 may open, gate 1 not yet: the stream still waits
    time.sleep(0.05)
    assert not done.query(), "opening a later gate released an earlier one"
    g.open(first)
    deadline = time.monotonic() + 10
    while not done.query():
        assert time.monotonic() < deadline, "the stream never went past an open gate"
        time.sleep(0.001)
    assert torch.equal(x.cpu(), torch.ones(4))
