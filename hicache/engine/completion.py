"""Completion of operations on the engine side, as ``Client`` methods (``Completion`` is a mixin
of ``hicache.engine.client.Client``): pushed messages kept (acks, GPU loads' "issued"
notices), ``poll_acks``, ``drain``, ``wait_ack(op)`` and, on GPU, ``wait_layer(op, layer,
stream)``: the wait for one layer of a load. Every wait is bounded by a timeout.

``wait_layer``: the daemon answers a GPU load once layer 0's copy is enqueued (``op.issued``
layers' events are recorded), so a later layer's wait first takes a daemon's "issued" notice
that covers it: a progress notice (``layers``: the first that many are recorded) or the last
one (all of them), or the op's ack. Then the host polls the layer's event until it completes
(``spin_us`` None, the default) or for ``spin_us`` microseconds before it puts a wait on the
stream. The host wait is the default: through the daemon it gave the last layer sooner
(``bench e2e --layer-wait host|stream`` alternated on an H200, fifty-sixth session: 0.6-0.8
ms sooner at 8k-32k; without MPS an engine context with waits queued shares the GPU's time
slices with the daemon's copies), the stream wait the first layer 0.07-0.13 ms sooner and the
engine's thread free; an engine that must not hold its thread sets ``spin_us``. (A stream
wait on another process's event is not itself late: ~12 µs on that H200, no later than the
host poll on an H100, ``scripts/cross_process_wait.py``; an early session's "~1.7 ms late"
did not hold up.)
"""
from __future__ import annotations

import time
from collections import OrderedDict
from typing import Any, Mapping, Sequence

from hicache.core.protocol import DEFAULT_DEADLINE_MS

from .acks import Ack, AckLost, AckTimeout, ClientClosed, CommandRefused, Op, TransferFailed

ACK_KEEP = 65536  # acks kept client-side until consumed
MAX_TIMEOUT_S = 1e6  # ~11.6 days: a longer wait is a mistake (and its milliseconds must fit)
# wait_layer: how long the host polls a layer's event before it puts a wait on the stream;
# None: until the layer is copied (bounded by the timeout), no stream wait at all: the host wait
# gave a load's last layer sooner through the daemon (docs/perf.md, fifty-sixth session).
WAIT_SPIN_US: float | None = None


def check_timeout(t: Any, zero: bool = False) -> float:
    """``t`` as seconds when it is a finite number in (0, ``MAX_TIMEOUT_S``] (0 too with
    ``zero``: a wait that only looks); else ``ValueError`` naming it. Callers check before
    anything is sent: NaN used to spin a core forever, infinity raised ``OverflowError`` after
    the request went out."""
    try:
        f = float(t)
    except (TypeError, ValueError):
        raise ValueError(f"timeout must be a number of seconds, got {t!r}") from None
    if not (0 <= f <= MAX_TIMEOUT_S) or (f == 0 and not zero):  # NaN fails the comparison
        low = "0 <=" if zero else "0 <"
        raise ValueError(f"timeout must be a finite number of seconds, {low} timeout <= "
                         f"{MAX_TIMEOUT_S:g}, got {t!r}")
    return f


class Completion:
    daemon_in_flight: int = 0  # as the last ``poll_acks`` reply said
    timeout: float
    spin_us: float | None
    _acks: OrderedDict[int, Ack]
    _taken: OrderedDict[int, None]  # ops whose ack went to the caller (newest ACK_KEEP)
    _issued: OrderedDict[int, int | None]
    _failing: OrderedDict[int, None]
    _session: str | None  # the daemon's session of this client's registration (register's)
    _op_sessions: OrderedDict[int, str | None]  # the session each op was issued in (newest)
    _load_events: list
    _layer_pos: dict
    stage_layers: list

    def _pushed(self, h: Mapping[str, Any]) -> bool:
        """Keep a pushed message: an ack, or a GPU load's "issued" notice. False for replies
        (read here only when late: their acks are kept, ``_late_reply``)."""
        k = h.get("k")
        if k == "ack":
            self._keep_ack(h)
            return True
        if k == "issued":
            op, n = int(h["op"]), h.get("layers")
            if h.get("failed"):
                self._failing[op] = None
                while len(self._failing) > ACK_KEEP:
                    self._failing.popitem(last=False)
            if n is None:
                self._issued[op] = None
            else:  # a progress notice: it only ever grows, and never undoes the last one
                had = self._issued.get(op, 0)
                if had is not None:
                    self._issued[op] = max(had, int(n))
            while len(self._issued) > ACK_KEEP:
                self._issued.popitem(last=False)
            return True
        self._late_reply(h)
        return False

    def _late_reply(self, h: Mapping[str, Any]) -> None:
        """A reply to a call that timed out: its caller is gone, but the acks it carries (a
        ``poll_acks`` reply's, which the daemon no longer holds; an inline one) are kept."""
        if h.get("ok"):
            for a in h.get("acks", ()):
                self._keep_ack(a)
            if "ack" in h:
                self._keep_ack(h["ack"])

    def _keep_ack(self, h: Mapping[str, Any]) -> Ack:
        """Keep an ack until it is taken; one whose op was handed out already (``_taken``: the
        daemon retains pushed acks, and a later ``poll_acks`` or a late push brings them
        again) is not kept twice."""
        a = Ack.from_wire(h)
        if a.op in self._taken:
            return a
        self._acks[a.op] = a
        while len(self._acks) > ACK_KEEP:
            self._acks.popitem(last=False)
        return a

    def poll_acks(self, ops: Sequence[int] | None = None, max: int = 1024,
                  timeout: float | None = None) -> list[Ack]:
        """Acks the daemon still holds (all, or those of ``ops``), plus any pushed ones; the
        daemon's count of this client's operations still in flight is kept in
        ``daemon_in_flight``."""
        f: dict[str, Any] = {"max": max}
        if ops is not None:
            f["ops"] = [int(o) for o in ops]
        h, _ = self.call("poll_acks", f, timeout=timeout)
        self.daemon_in_flight = int(h.get("in_flight", 0))
        for a in h.get("acks", []):
            self._keep_ack(a)
        self.drain()
        out = list(self._acks.values()) if ops is None else \
            [self._acks[o] for o in ops if o in self._acks]
        for a in out:
            self._acks.pop(a.op, None)
            self._issued.pop(a.op, None)  # its pushes all came before its ack
            self._took(a.op)
        return out

    def _deadline_wait(self, deadline_ms: int | None, timeout: float | None) -> float:
        """How long to wait for the ack of a command the daemon answers by ``deadline_ms``
        (None: its default): past that deadline by a second, and never less than ``timeout``
        (None: the client's). A wait no longer than the deadline timed out just before the
        daemon's answer at the deadline came."""
        ms = DEFAULT_DEADLINE_MS if deadline_ms is None else deadline_ms
        return max(ms / 1000 + 1.0, self.timeout if timeout is None else check_timeout(timeout))

    def _issued_by(self, op_id: int) -> None:
        """``op_id`` was issued by the current registration (its session, for ``wait_ack`` of
        a bare id after the client registered again)."""
        self._op_sessions[op_id] = self._session
        if len(self._op_sessions) > ACK_KEEP:
            self._op_sessions.popitem(last=False)

    def _took(self, op_id: int) -> None:
        """``op_id``'s ack went to the caller: never again (the newest ``ACK_KEEP`` ids)."""
        self._taken[op_id] = None
        while len(self._taken) > ACK_KEEP:
            self._taken.popitem(last=False)

    def drain(self) -> int:
        """Read pushed acks that already arrived (no wait). Returns how many."""
        n = 0
        while True:
            got = self._recv(0)
            if got is None:
                return n
            if got[0].get("k") == "ack":
                n += 1
            self._pushed(got[0])

    def wait_ack(self, op: Op | int, timeout: float | None = None, check: bool = True) -> Ack:
        """Block until ``op`` completed; its ``Ack`` (``TransferFailed`` if it failed and
        ``check``). ``AckTimeout`` if the daemon answers but the op is not done in time;
        ``AckLost`` (one) at the first poll that finds the registration that issued it gone."""
        a = self._await_ack(op, timeout)
        if not (isinstance(op, Op) and op.ack is a):  # not the reply's inline ack: taken now
            self._acks.pop(a.op, None)
            self._issued.pop(a.op, None)  # its pushes all came before its ack
            self._took(a.op)
            if isinstance(op, Op):
                op.issued = None  # done: every layer's event is recorded
        if check and not a.ok:
            raise TransferFailed(a)
        return a

    def _await_ack(self, op: Op | int, timeout: float | None = None) -> Ack:
        """Until ``op``'s ack is in: the reply's inline ack, or one kept (pushed or polled),
        which stays the caller's to take (``wait_ack``, ``poll_acks``): nothing is handed out
        here. ``AckTimeout`` as ``wait_ack``."""
        if isinstance(op, Op) and op.ack is not None:  # completed inline, ack came in the reply
            return op.ack
        if self._sock.closed:  # (before the deadline: a timeout of 0 read "not done yet")
            raise ClientClosed("wait_ack: this Client is closed")
        op_id = op.op_id if isinstance(op, Op) else int(op)
        timeout = self.timeout if timeout is None else check_timeout(timeout, zero=True)
        deadline = time.monotonic() + timeout
        next_poll = time.monotonic() + min(0.5, timeout / 2)
        while True:
            a = self._acks.get(op_id)
            if a is not None:
                return a
            now = time.monotonic()
            if now >= deadline:
                raise AckTimeout(f"op {op_id} did not complete within {timeout:g} s")
            if now >= next_poll:  # a lost push, or a long wait: ask (also a heartbeat)
                try:
                    h, _ = self.call("poll_acks", {"ops": [op_id], "max": 1},
                                     timeout=max(0.1, deadline - now))
                except CommandRefused:  # (a daemon before the fifty-seventh session pushed
                    # its last acks at a stop, then refused the poll ``shutting_down``; a
                    # stopping one answers it now): an ack read before the refusal still counts
                    a = self._acks.get(op_id)
                    if a is not None:
                        return a
                    raise
                for x in h.get("acks", []):
                    self._keep_ack(x)
                if op_id not in self._acks:
                    self._check_session(op, op_id, h)
                next_poll = time.monotonic() + 0.5
                continue
            got = self._recv(max(1, int(min(deadline, next_poll) * 1000 - now * 1000)))
            if got is not None:
                self._pushed(got[0])

    def _check_session(self, op: Op | int, op_id: int, h: Mapping[str, Any]) -> None:
        """``AckLost`` when the poll reply ``h`` comes from another session than the
        registration that issued ``op`` (the ``Op``'s; for a bare id, the one its reply came
        to, or this client's current one for an id it did not see issued): the daemon
        restarted or reaped this client, and the ack went with the state that held it."""
        ours = op.session if isinstance(op, Op) else self._op_sessions.get(op_id, self._session)
        theirs = h.get("session")
        if ours is not None and theirs is not None and theirs != ours:
            raise AckLost(f"op {op_id}: the daemon no longer holds the registration that "
                          f"issued it (it restarted, or reaped this client): its ack will "
                          f"never come, and what it copied is unknown")

    def wait_layer(self, op: Op, layer: int, stream: Any = None,
                   timeout: float | None = None, on_stream: bool = False) -> None:
        """Return once global ``layer`` of load ``op`` is copied (GPU, ``spin_us`` None), or put
        a wait for it on ``stream`` (default: the current stream) after ``spin_us`` (at once
        with ``on_stream``: the host waits only for the layer's copy to be issued). CPU mode (no
        events): waits for the op's ack. The daemon answers a GPU load once layer 0's copy is
        enqueued; a later layer's wait first takes the daemon's "issued" notice (or the op's
        ack), so it never waits on an event the load has not recorded."""
        if timeout is not None:
            timeout = check_timeout(timeout, zero=True)
        if op.event_set is None or not self._load_events:
            self.wait_ack(op, timeout)
            return
        import torch

        pos = self._layer_pos.get(layer)
        if pos is None:
            raise ValueError(f"layer {layer} is not on this stage ({self.stage_layers})")
        self._check_failed(op)
        if op.issued is not None and pos >= op.issued:
            self._wait_issued(op, pos, timeout)
            self._check_failed(op)
        if op.failed or op.op_id in self._failing:  # the layers it did not record hold older
            self._await_ack(op, timeout)  # records: its ack says what failed (the caller's)
            self._check_failed(op)
        ev = self._load_events[op.event_set][pos]
        # The host polls the event (until it completes, or for ``spin_us`` when set) and only
        # then, if ever, the stream waits: an engine stream holding waits on the daemon's
        # events shares time slices with its copies (no MPS; docs/perf.md, fifty-sixth session).
        spin = 0.0 if on_stream else self.spin_us
        if spin is None:
            limit = self.timeout if timeout is None else timeout
        else:
            limit = spin * 1e-6
        end = time.perf_counter() + limit
        while not ev.query():
            if time.perf_counter() >= end:
                if spin is None:
                    raise AckTimeout(f"op {op.op_id}: layer {layer} not copied in time")
                (stream or torch.cuda.current_stream()).wait_event(ev)
                return
        self._check_failed(op)  # a failed load records no events: an old record says done

    def _check_failed(self, op: Op) -> None:
        """``TransferFailed`` when ``op``'s ack is in and says it failed (the ack stays the
        caller's to take)."""
        a = op.ack if op.ack is not None else self._acks.get(op.op_id)
        if a is not None and not a.ok:
            raise TransferFailed(a)

    def _wait_issued(self, op: Op, pos: int, timeout: float | None) -> None:
        """Until a notice covers stage layer position ``pos`` of ``op`` (or its ack is in);
        then ``op.issued`` is what the notices say (None: every layer is recorded)."""
        timeout = self.timeout if timeout is None else timeout
        deadline = time.monotonic() + timeout
        lost = time.monotonic() + min(0.5, timeout / 2)  # the notice follows the reply at once
        op_id = op.op_id

        def covered() -> bool:
            if op.ack is not None or op_id in self._acks:
                return True
            if op_id not in self._issued:
                return False
            n = self._issued[op_id]
            return n is None or n > pos

        while not covered():
            left = min(deadline, lost) - time.monotonic()
            if left <= 0:  # a lost push: the op's ack (pushed or polled, the caller's) says it
                self._await_ack(op, max(0.0, deadline - time.monotonic()))
                break
            got = self._recv(max(1, int(left * 1000)))
            if got is not None:
                self._pushed(got[0])
        n = self._issued.get(op_id)
        if n is not None and op.ack is None and op_id not in self._acks:
            op.issued = n  # later layers may still wait for a further notice
            return
        self._issued.pop(op_id, None)
        op.issued = None  # every layer is recorded: later waits go straight to the event
