"""A GPU load's layers waited for where SGLang's forward reads them, not in the submission.

SGLang 0.5.23's ``HiCacheController.start_loading`` advances its ``LayerDoneCounter``'s
producer index, then submits the load (every layer, every pool); the forward then calls the
counter's ``wait_until(t)`` before it reads stage layer ``t`` (DSV4's pool accessors; the
prefill graph runner calls it for the last layer before a full replay), with the batch's
producer index as the counter's consumer. The blocking adapter waits for every layer inside
the submission, so the forward starts only once the whole load is in; here the forward's
first layers run while the later ones still copy. (SGLang launches the forward from the
scheduler thread too, so that thread still waits, in the forward's launch, layer by layer.)
``LayerWaits`` holds each deferred load under its producer index:

* ``attach(counter)`` wraps ``wait_until`` of that one counter instance (the assembler patch
  attaches the controller's counter when installed with ``forward_waits``, off by default;
  attaching a second counter, or one already wrapped, is refused); ``detach()`` restores it
  (the link's ``close``). Nothing attached: every load waits in its calls, as before.
* ``retire()``: before the submission's load is sent, an op still kept under the counter's
  current producer index (its forward never reached the last layer: a batch dropped after its
  load) is finished: its ack is waited for and checked (``TransferFailed``, a note naming the
  index; a timeout leaves it kept).
* ``keep(op)``: once the daemon took the load, ``op`` is kept under that index. False (nothing
  kept: the caller waits for every layer itself, as before) with no counter attached or no
  producer index.
* The forward's ``wait_until(t)`` while a kept op's index is the consumer: the host polls the
  daemon's event of stage layer ``t`` until it is copied (``Client.wait_layer``; a layer found
  copied is not polled again); at the stage's last layer it then waits for the op's ack and
  checks it, and the op is dropped. A failed load raises ``TransferFailed`` before the
  forward's last layer is launched, so nothing the forward computes from it can reach an
  output; the exception leaves SGLang's scheduler as the blocking adapter's did
  (docs/sglang.md). Any other exception (a timeout) leaves the op kept. SGLang's own wait (on
  its events) runs after ours.
* Every client call holds the link's lock (its heartbeat thread shares the client).

The adapter's submission puts one stream wait, for the load's last layer, on SGLang's H2D
stream (``host_pools``): the completion event SGLang records there after the calls completes
only once the daemon's copies did. SGLang reads that event, its per-layer event of the last
layer, to know the load is over (the radix cache's ``is_load_back_event_done``, the device
allocator, which orders page moves and frees after it, and the producer index's reuse); its
per-layer events of earlier layers complete before their copies and are read only through
``wait_until``, which this wraps. The stream wait needs the last layer's event recorded, so
the submission waits for the daemon to *issue* the last layer (not to copy it): on H100s
2.2-3.3 / 6.3-6.7 / 9.6-14.2 ms of loads whose last layer took 2.8-3.5 / 7.8-8.3 /
23.5-24.9 ms (8 / 32 / 128 DSV4-Flash pages). Behind a load fence it returned while the fence
held once the daemon's load kernel was warm (docs/sglang.md).

What it trades (hence off by default): a load whose batch never reaches the forward's last
layer has its ack checked only when its producer index comes round again, so a failed load of
such a batch is found that much later, where the blocking path raised in ``start_loading``.
A PD decode server reads its local restores' loads from the completion event alone, with no
forward wait, so the assembler patch refuses ``forward_waits`` there.
"""
from __future__ import annotations

import threading
from typing import Any

from hicache.engine.acks import TransferFailed
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
        self._original: Any = None
        self._kept: dict[int, _Kept] = {}

    def attach(self, counter: Any) -> None:
        """Wrap ``counter.wait_until`` (see the module docstring)."""
        if self.counter is not None:
            raise RuntimeError("this link's loads are already waited for through a layer "
                               "counter")
        if getattr(counter.wait_until, "__hicache__", False):
            raise RuntimeError("this layer counter already waits for hicache loads")
        original = counter.wait_until

        def wait_until(threshold: int) -> None:
            self.wait(counter.consumer_index, threshold)
            original(threshold)

        wait_until.__hicache__ = True  # type: ignore[attr-defined]
        counter.wait_until = wait_until
        self.counter, self._original = counter, original

    def detach(self) -> None:
        """Give the counter its own ``wait_until`` back; forget what is kept."""
        with self.lock:
            if self.counter is not None:
                self.counter.wait_until = self._original
            self.counter = self._original = None
            self._kept.clear()

    def pending(self) -> dict[int, Op]:
        """The ops kept now, by producer index."""
        with self.lock:
            return {i: k.op for i, k in self._kept.items()}

    def retire(self) -> None:
        """Finish the op kept under the counter's current producer index, if any (see the
        module docstring)."""
        counter = self.counter
        if counter is None:
            return
        with self.lock:
            old = self._kept.pop(counter.producer_index, None)
            if old is None:
                return
            try:
                self.client.wait_ack(old.op, check=True)
            except TransferFailed as e:
                e.add_note(f"hicache: the load kept under SGLang's producer index "
                           f"{counter.producer_index}, which no forward waited for")
                raise
            except BaseException:  # (a timeout: its outcome is still to be checked)
                self._kept.setdefault(counter.producer_index, old)
                raise

    def keep(self, op: Op) -> bool:
        """Keep ``op`` under the counter's current producer index (see the module
        docstring)."""
        counter = self.counter
        if counter is None or counter.producer_index < 0:
            return False
        with self.lock:
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
                    c.wait_ack(kept.op, check=True)
                    del self._kept[consumer]
            except TransferFailed:  # (the exception is SGLang's to take)
                self._kept.pop(consumer, None)
                raise
