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
* ``gate(op, stream=None)``: the submission's last call. SGLang records its completion event on
  ``stream`` (its H2D stream) right after; its radix cache and device allocator read that
  event to know the load is over (the allocator orders page moves and frees after it), so it
  must not complete before the daemon's copies. A ``core.stream_gate.StreamGate`` wait is put
  on ``stream``: it exists before the daemon has issued any later layer, so the thread waits
  for nothing. The gate opens once the load's ack says it succeeded, whoever sees it first:
  the forward's last ``wait_until``, ``begin`` of a later load, or the gate thread, which
  reads the acks that arrived every ``GATE_POLL_S`` while a gate is closed (a load whose
  forward never waits still completes). A failed load's gate stays closed: its completion
  event never comes (the failure is raised where the ack is checked, and stops SGLang's
  scheduler).
* The forward's ``wait_until(t)`` while a kept op's index is the consumer: the host polls the
  daemon's event of stage layer ``t`` until it is copied (``Client.wait_layer``; a layer found
  copied is not polled again); at the stage's last layer it then waits for the op's ack and
  checks it, and the op is dropped. A failed load raises ``TransferFailed`` before the
  forward's last layer is launched, so nothing the forward computes from it can reach an
  output; the exception leaves SGLang's scheduler as the blocking adapter's did
  (docs/sglang.md). SGLang's own wait (on its events) runs after ours.
* Every client call holds the link's lock (its heartbeat thread shares the client); ``stop()``
  ends the gate thread (the link's ``close``).

What it trades (hence off by default): a load whose batch never reaches the forward's last
layer has its ack checked only when its producer index comes round again, so a failed load of
such a batch is found that much later, where the blocking path raised in ``start_loading``.
"""
from __future__ import annotations

import logging
import threading
from typing import Any, Callable

from hicache.engine.client import Client, Op

log = logging.getLogger("hicache.sglang")
GATE_POLL_S = 0.5e-3  # how often the gate thread reads arrived acks while a gate is closed
GATE_ERROR_S = 0.5  # its pause after a failed read (a daemon gone: the next call says so)


class _Kept:
    __slots__ = ("op", "seen", "seq", "open")

    def __init__(self, op: Op) -> None:
        self.op = op
        self.seen: set[int] = set()  # stage layer positions found copied
        self.seq: int | None = None  # its gate's number, once closed
        self.open = False


class LayerWaits:
    """See the module docstring. ``make_gate``: the gate's factory (tests give a stand-in)."""

    def __init__(self, client: Client, lock: threading.RLock,
                 make_gate: Callable[[], Any] | None = None) -> None:
        self.client = client
        self.lock = lock
        self.counter: Any = None
        self._kept: dict[int, _Kept] = {}
        self._make_gate = make_gate
        self._gate: Any = None
        self._closed: list[_Kept] = []  # kept ops whose gate is closed, in gate order
        self._wake = threading.Condition(lock)
        self._thread: threading.Thread | None = None
        self._stop = False

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

    def closed_gates(self) -> int:
        """How many kept ops' gates are still closed."""
        with self.lock:
            return len(self._closed)

    def begin(self, op: Op) -> bool:
        counter = self.counter
        if counter is None or counter.producer_index < 0:
            return False
        with self.lock:
            old = self._kept.pop(counter.producer_index, None)
            if old is not None:
                self.client.wait_ack(old.op, check=True)
                self._open(old)
            self._kept[counter.producer_index] = _Kept(op)
        return True

    def gate(self, op: Op, stream: Any = None) -> None:
        """Put the gate of kept ``op`` on ``stream`` (default: the current stream; see the
        module docstring)."""
        with self.lock:
            kept = next((k for k in self._kept.values() if k.op is op), None)
            if kept is None:
                raise RuntimeError(f"op {op.op_id} is not kept: its gate cannot be put")
            if self._gate is None:
                if self._make_gate is None:
                    from hicache.core.stream_gate import StreamGate
                    self._make_gate = StreamGate
                self._gate = self._make_gate()
            kept.seq = self._gate.close(stream)
            self._closed.append(kept)
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="hicache-load-gates",
                                                daemon=True)
                self._thread.start()
            self._wake.notify()

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
                    self._open(kept)
            except BaseException:  # (a failed load: the exception is SGLang's to take; its
                self._kept.pop(consumer, None)  # gate stays closed)
                if kept in self._closed:
                    self._closed.remove(kept)
                raise

    def _open(self, kept: _Kept) -> None:
        """(lock held) ``kept``'s load succeeded: its gate may open."""
        if kept.seq is None or kept.open:
            return
        kept.open = True
        self._gate.open(kept.seq)
        self._closed.remove(kept)

    def _run(self) -> None:
        """The gate thread: opens the gates of loads whose ack came and says they succeeded."""
        with self.lock:
            while not self._stop:
                if not self._closed:
                    self._wake.wait()
                    continue
                try:
                    for kept in list(self._closed):
                        a = self.client.ack_if_in(kept.op)
                        if a is not None and a.ok:
                            self._open(kept)
                        elif a is not None:  # failed: raised where its ack is checked; the
                            self._closed.remove(kept)  # gate stays closed
                except Exception as e:  # noqa: BLE001 - the forward's waits meet it too
                    log.warning("hicache: the load gate thread could not read acks: %s", e)
                    self._wake.wait(GATE_ERROR_S)
                    continue
                self._wake.wait(GATE_POLL_S)

    def stop(self) -> None:
        with self.lock:
            self._stop = True
            self._wake.notify_all()
        t = self._thread
        if t is not None and t is not threading.current_thread():
            t.join(timeout=5)
