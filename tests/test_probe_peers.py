"""Which peers the daemon may forget as holding nothing (``DaemonState.is_probe``): ``stats``
forgets such a peer before it reports, and a full client table forgets the least recently
seen one. An ack the peer was never sent (its push failed; ``poll_acks`` still has it) is
something it holds: forgetting it would lose that ack."""
from __future__ import annotations

import numpy as np
import torch

from hicache.controllers.metrics import Metrics
from hicache.controllers.registry import Registry
from hicache.controllers.scheduler import Scheduler
from hicache.controllers.state import DaemonState
from hicache.core.layout import build_layout, preset
from hicache.host_pools.group import HostPoolGroup


def _state() -> tuple[DaemonState, HostPoolGroup, Scheduler]:
    layout = build_layout(preset("dsv4-tiny"))
    group = HostPoolGroup(layout, {"page": 8, "swa_page": 4, "req_slot": 4})
    sched = Scheduler(torch.device("cpu"), lambda: None)
    st = DaemonState(layout, group, sched, Registry(8, 64), Metrics(process_metrics=False),
                     torch.device("cpu"), heartbeat_timeout=60, load_event_sets=1,
                     shm_dirs=("/dev/shm",))
    return st, group, sched


def test_a_peer_is_a_probe_until_it_holds_rows_or_an_unsent_ack():
    st, group, sched = _state()
    try:
        c = st.registry.touch(b"peer", 0.0)
        assert st.is_probe(c)
        st.registry.retain(c, 7, {"op": 7, "ok": True}, pushed=True)
        assert st.is_probe(c)  # it was sent that ack: nothing is lost if it is forgotten
        st.registry.retain(c, 8, {"op": 8, "ok": True}, pushed=False)
        assert not st.is_probe(c) and not st.forget_probe(c)
        assert st.registry.clients[b"peer"] is c and list(c.acks) == [7, 8]
        c.acks.clear()
        rows = group.allocators["page"].alloc(2, (c.cid, None))
        assert not st.is_probe(c) and not st.forget_probe(c)  # it owns host rows
        group.allocators["page"].free(np.asarray(rows), (c.cid, None))
        assert st.forget_probe(c) and b"peer" not in st.registry.clients
        assert not st.forget_probe(c)  # once
    finally:
        sched.close()
        group.close()
