"""``swap_in`` with ``release``: the host row goes back only when the copy succeeded.

The request's saved state (``swap_out``) lives in one ``req_slot`` host row. ``swap_in`` with
``release`` used to defer the row's free before the copy ran, so a copy that failed (say a GPU
launch error) still freed it: the request's only saved state was gone, and a retry was refused
``not_owner`` (forty-fifth session's review). Now a failed copy keeps the row, owned as before;
a successful one frees it as before. In-process daemon state driven through the handlers, a
copy failure injected at the CPU copy worker; inline (the ack in the reply) and submitted.
"""
from __future__ import annotations

import time
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest
import torch

from hicache.controllers import scheduler as sched_mod
from hicache.controllers.handlers import HANDLERS
from hicache.controllers.metrics import Metrics
from hicache.controllers.registry import RegisteredWorker, Registry
from hicache.controllers.scheduler import Scheduler
from hicache.controllers.state import DaemonState
from hicache.core.layout import build_layout, preset
from hicache.host_pools.group import HostPoolGroup
from hicache.kernels.tables import LayerTable

DEVICE_ROWS = {"page": 8, "swa_page": 4, "req_slot": 4}


def _state(inline: bool) -> DaemonState:
    lay = build_layout(preset("dsv4-tiny"))
    g = HostPoolGroup(lay, {"page": 16, "swa_page": 8, "req_slot": 8})
    sch = Scheduler(torch.device("cpu"), lambda: None, inline_max_bytes=1 << 30 if inline else 0)
    return DaemonState(lay, g, sch, Registry(8, 64), Metrics(process_metrics=False),
                       torch.device("cpu"), heartbeat_timeout=60, load_event_sets=1,
                       shm_dirs=("/dev/shm",))


def _engine(st: DaemonState) -> Any:
    """A registered client whose device pools are plain tensors (slot 1 holds 0x5A)."""
    c = st.registry.touch(b"engine", time.monotonic())
    layers = {name: [torch.zeros((DEVICE_ROWS[spec.index], spec.page_bytes), dtype=torch.uint8)
                     for _ in range(spec.num_layers)] for name, spec in st.layout.pools.items()}
    for name, spec in st.layout.pools.items():
        if spec.index == "req_slot":
            for t in layers[name]:
                t[1] = 0x5A
    tables = {k: LayerTable(v, f"device:{k}") for k, v in layers.items()}
    c.worker = RegisteredWorker("engine", 0, dict(DEVICE_ROWS),
                                SimpleNamespace(layers=layers, close=lambda fn=None: None),
                                tables, [], [])
    c.layers = layers
    return c


def _run(st: DaemonState, c: Any, cmd: str, fields: dict) -> dict:
    """A command as the server runs it (reply, then the after-reply work), its ack awaited."""
    reply, _ = HANDLERS[cmd](st, c, {"v": 1, "cmd": cmd, "id": 1, **fields}, [])
    if st.post:
        st.after_reply()
    ack = reply.get("ack")
    deadline = time.monotonic() + 10
    while ack is None:
        st.collect()
        done = [a for cc, a in st.outbox if a["op"] == reply["op"]]
        if done:
            ack = done[0]
        assert time.monotonic() < deadline, "the op never completed"
        time.sleep(0.002)
    st.collect()
    return {**reply, "ack": ack}


@pytest.mark.parametrize("inline", [True, False], ids=["inline", "submitted"])
def test_a_failed_swap_in_keeps_the_saved_state_and_a_retry_takes_it(
        monkeypatch: pytest.MonkeyPatch, inline: bool) -> None:
    st = _state(inline)
    try:
        c = _engine(st)
        out = _run(st, c, "swap_out", {"slot": 1, "request": "r1"})
        row = out["host_row"]
        assert out["ack"]["status"] == "ok"
        assert st.owner_of("req_slot", row) == (c.cid, "r1")
        real = sched_mod.run_cpu_item

        def failing(*a: Any, **kw: Any) -> Any:
            raise RuntimeError("injected copy failure")

        monkeypatch.setattr(sched_mod, "run_cpu_item", failing)
        bad = _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                      "request": "r1"})
        assert bad["ack"]["status"] == "error" and "injected" in bad["ack"]["error"]["message"]
        # the state is where it was: owned as before, not pending a free, its bytes intact
        assert st.owner_of("req_slot", row) == (c.cid, "r1")
        assert not st.tracker.busy("req_slot", [row]) and not st.tracker.deferred
        monkeypatch.setattr(sched_mod, "run_cpu_item", real)
        good = _run(st, c, "swap_in", {"host_row": row, "slot": 2, "release": True,
                                       "request": "r1"})
        assert good["ack"]["status"] == "ok"
        for name, spec in st.layout.pools.items():
            if spec.index == "req_slot":
                assert all(bool((t[2] == 0x5A).all()) for t in c.layers[name])
        assert st.owner_of("req_slot", row) is None  # released after the good copy
        assert st.report(True)["invariants"] == "ok"
    finally:
        st.group.close()


def test_a_failed_swap_in_of_a_client_being_released_leaves_the_row_to_that_release() -> None:
    """Once the client's rows are being given back, the release skipped the row whose free was
    pending: the deferred free stands, so the row still goes back (no leak)."""
    st = _state(inline=False)
    try:
        c = _engine(st)
        row = _run(st, c, "swap_out", {"slot": 1, "request": "r1"})["host_row"]
        rows = np.array([row])
        from hicache.controllers.ops import Operation

        op = Operation(st.next_op_id(), c.cid, "swap_in", [], [("req_slot", rows, False)])
        op.release = ({"req_slot": rows}, (c.cid, "r1"))
        st.free_after_use(*op.release)
        st.releaser.pending.append(SimpleNamespace(c=c))  # its release has started
        op.ok = False
        st.keep_on_failure(op)
        assert st.tracker.deferred and st.tracker.busy("req_slot", [row])  # still pending
        st.releaser.pending.clear()
        st.keep_on_failure(op)
        assert not st.tracker.deferred and not st.tracker.busy("req_slot", [row])
    finally:
        st.group.close()
