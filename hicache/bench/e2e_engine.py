"""What the engine's own GPU work waits while the daemon moves KV (``bench e2e``, GPU only).

Without MPS, the daemon's CUDA context and the engine's share the GPU by time slices: while a
kernel of the daemon runs, a kernel the engine launches may wait for the daemon's slice to end
(an H200: 1-2.4 ms once per big transfer, docs/perf.md, eighteenth session). A serving engine
feels that as a late decode step. So ``bench e2e`` times the engine's smallest GPU step, one
``add_`` on a one-element tensor and a host wait for it on the engine's stream, in a loop:

* ``idle_waits(stream, probe, n)``: ``n`` steps with nothing moving (the baseline);
* ``op_waits(c, op, stream, probe)``: steps from right after ``op`` was sent (a LOAD or a
  BACKUP) until its ack arrives (``TransferFailed`` if the op failed, ``AckTimeout`` after
  ``timeout`` seconds); each step's seconds. Every ``POLL_S`` without the ack it asks the
  daemon for it (``poll_acks``: a push that was lost, and a heartbeat).
* ``probe_rounds(waits, c, stream, dev, load, backup, release)``: one size's steps into
  ``waits`` (``new_waits()``: a list per ``KINDS``): the idle baseline, then ``ROUNDS`` times
  while a LOAD (``load()`` sends it) and a BACKUP (``backup()``) run, ``release(op)`` after
  each backup (its host rows are the caller's to free). ``bench e2e`` takes them after a
  size's timed runs, so no timed figure follows a probe;
* ``wait_stats(samples)``: p50 / p99 / max of one size's steps, in ms (None for none).

The probe steps go on the stream the engine's loads are timed on, but in their own phase: the
load and backup figures of ``bench e2e`` are never taken while or after a probe runs. The probe
kernel runs once untimed when its tensor is made, so its first-use cost (8.5-14 ms in one
idle step per run on an H200) is not counted. MPS, which lets the two contexts' kernels run at
once, is the operator's switch (docs/config.md, "Sharing the GPU with the engine"); these
figures say whether a deployment needs it.
"""
from __future__ import annotations

import time
from typing import Any, Callable, Optional

import torch

from hicache.core.percentiles import median, percentile
from hicache.engine.acks import AckTimeout, Op, TransferFailed
from hicache.engine.client import Client

KINDS = ("idle", "load", "backup")  # what the daemon does while the steps are timed
IDLE_STEPS = 200  # steps of the idle baseline, per size
ROUNDS = 3  # loads and backups probed per size
POLL_S = 0.5  # op_waits asks the daemon for an ack this often while it has not come
_PROBES: dict[int, torch.Tensor] = {}  # the probe tensor per GPU


def probe_tensor(dev: torch.device) -> torch.Tensor:
    """The one-element tensor the engine's probe step adds to (one per GPU)."""
    i = dev.index or 0
    t = _PROBES.get(i)
    if t is None:
        t = _PROBES[i] = torch.zeros(1, device=dev)
        t.add_(1)  # the kernel's first use (module load) is not an engine step
        torch.cuda.synchronize(dev)
    return t


def _step(stream: Any, probe: torch.Tensor) -> float:
    """One engine step: launch, then wait on the host; its seconds."""
    t0 = time.perf_counter()
    with torch.cuda.stream(stream):
        probe.add_(1)
    stream.synchronize()
    return time.perf_counter() - t0


def idle_waits(stream: Any, probe: torch.Tensor, n: int = IDLE_STEPS) -> list[float]:
    stream.synchronize()
    return [_step(stream, probe) for _ in range(n)]


def op_waits(c: Client, op: Op, stream: Any, probe: torch.Tensor,
             timeout: float = 120.0) -> list[float]:
    out: list[float] = []
    now = time.monotonic()
    deadline, next_poll = now + timeout, now + POLL_S
    while True:
        out.append(_step(stream, probe))
        c.drain()  # pushed acks that arrived meanwhile
        try:
            c.wait_ack(op, timeout=0)  # no wait: the ack is here, or AckTimeout at once
            return out
        except AckTimeout:
            now = time.monotonic()
            if now >= next_poll:  # ask for it (a push may have been lost); a heartbeat too
                next_poll = now + POLL_S
                got = c.poll_acks([op.op_id])
                if got:
                    if not got[0].ok:
                        raise TransferFailed(got[0]) from None
                    return out
            if now > deadline:
                raise AckTimeout(f"op {op.op_id} did not complete within {timeout:g} s "
                                 f"(bench e2e's engine probe)") from None


def new_waits() -> dict[str, list[float]]:
    return {k: [] for k in KINDS}


def probe_rounds(waits: dict[str, list[float]], c: Client, stream: Any, dev: torch.device,
                 load: Callable[[], Op], backup: Callable[[], Op],
                 release: Callable[[Op], None]) -> None:
    probe = probe_tensor(dev)
    waits["idle"] += idle_waits(stream, probe)
    for _ in range(ROUNDS):
        waits["load"] += op_waits(c, load(), stream, probe)
        bop = backup()
        waits["backup"] += op_waits(c, bop, stream, probe)
        release(bop)


def wait_stats(samples: list[float]) -> Optional[dict[str, float]]:
    if not samples:
        return None
    return {"steps": len(samples), "p50_ms": median(samples) * 1e3,
            "p99_ms": percentile(samples, 0.99) * 1e3, "max_ms": max(samples) * 1e3}
