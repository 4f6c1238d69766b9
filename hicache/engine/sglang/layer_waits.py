"""A GPU load's layers waited for where SGLang's forward reads them, not on its scheduler thread.

SGLang 0.5.23's ``HiCacheController.start_loading`` advances its ``LayerDoneCounter``'s
producer index, then submits the load (every layer, every pool) from the scheduler thread; the
forward then calls the counter's ``wait_until(t)`` before it reads stage layer ``t`` (DSV4's
pool accessors; the prefill graph runner calls it for the last layer before a full replay),
with the batch's producer index as the counter's consumer. ``LayerWaits`` holds each deferred
load under its producer index:

* ``attach(counter)`` wraps ``wait_until`` of that one counter instance (the assembler patch
  attaches the controller's counter when installed with ``forward_waits``, off by default; a
  second attach is refused). Nothing attached: every load waits in its calls, as before.
* ``begin(op)``: the submission's first call, once the daemon took the load: ``op`` is kept
  under the counter's current producer index. False (nothing kept: the caller waits for every
  layer itself, as before) with no counter attached or no producer index. An op still kept
  under that index (its forward never reached the last layer: a batch dropped after its load)
  is finished first: its ack is waited for and checked (``TransferFailed`` raised there).
* The forward's ``wait_until(t)`` while a kept op's index is the consumer: the host polls the
  daemon's event of stage layer ``t`` until it is copied (``Client.wait_layer``; a layer found
  copied is not polled again); at the stage's last layer it then waits for the op's ack and
  checks it, and the op is dropped. A failed load raises ``TransferFailed`` before the forward's
  last layer is launched, so nothing the forward computes from it can reach an output; the
  exception leaves SGLang's scheduler as the blocking adapter's did (docs/sglang.md). SGLang's
  own wait (on its events, which the adapter's calls make no later) runs after ours.
* Every client call holds the link's lock (its heartbeat thread shares the client).

The adapter's submission puts one stream wait, for the load's last layer, on SGLang's H2D
stream (``host_pools``): the completion event SGLang records there after the calls (what its
radix cache and device allocator read to know the load is over; its allocator orders page
moves and frees after it) completes only once the daemon's copies did. That wait needs the
layer's event recorded, so the scheduler thread still waits for the daemon to *issue* the
last layer (not to copy it): on H100s the submission held the thread 2.8-3.3 / 6.3-6.7 /
9.6-14.2 ms of loads whose last layer took 3.3-3.5 / 7.8-8.2 / 23.5-24.9 ms (8 / 32 / 128
DSV4-Flash pages). Behind a load fence it returns while the fence holds, once the daemon's
load kernels are warm (a kernel's first launch waits for the GPU to go idle; docs/sglang.md).

What it trades (hence off by default): a load whose batch never reaches the forward's last
layer has its ack checked only when its producer index comes round again, so a failed load of
such a batch is found that much later, where the blocking path raised in ``start_loading``.
"""
from __future__ import annotations

import threading
from typing import Any

from hicache.engine.client import Client, Op


class _Kept:
    __slots__ = ("op", "seen")

    def __init__(self, op: Op) -> None:
        self.op = op
        self.seen: set[int] = set()  # stage layer positions found copied


class LayerWaits:
    """See the module docstring."""

    def __init__(self, client: Client, lock: threading.RLock) -> None:
        self.client = client
        self.lock = lock
        self.counter: Any = None
        self._kept: dict[int, _Kept] = {}

    def attach(self, counter: Any) -> None:
        if self.counter is not None or getattr(counter.wait_until, "__hicache__", False):
            raise RuntimeError("this layer counter already waits for hicache loads")
        original = counter.wait_until

        def wait_until(threshold: int) -> None:
            self.wait(counter.consumer_index, threshold)
            original(threshold)

        wait_until.__hicache__ = True  # type: ignore[attr-defined]
        counter.wait_until = wait_until
        self.counter = counter

    def pending(self) -> dict[int, Op]:
        """The ops kept now, by producer index."""
        with self.lock:
            return {i: k.op for i, k in self._kept.items()}

    def begin(self, op: Op) -> bool:
        counter = self.counter
        if counter is None or counter.producer_index < 0:
            return False
        with self.lock:
            old = self._kept.pop(counter.producer_index, None)
            if old is not None:
                self.client.wait_ack(old.op, check=True)
            self._kept[counter.producer_index] = _Kept(op)
        return True

    def wait(self, consumer: int, threshold: int) -> None:
        """The forward's wait for stage layer ``threshold`` of the load kept under
        ``consumer`` (nothing kept there: returns at once)."""
        if consumer < 0:
            return
        with self.lock:
            kept = self._kept.get(consumer)
            if kept is None:
                return
            c = self.client
            last = len(c.stage_layers) - 1
            t = min(int(threshold), last)
            try:
                if t >= 0 and t not in kept.seen:
                    c.wait_layer(kept.op, c.stage_layers[t])
                    kept.seen.add(t)
                if t == last:
                    del self._kept[consumer]
                    c.wait_ack(kept.op, check=True)
            except BaseException:  # (a failed load: the exception is SGLang's to take)
                self._kept.pop(consumer, None)
                raise
