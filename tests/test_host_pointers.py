"""Device pointers (issue 17, item 4): the daemon's pointer tables of the host pools use the
arena's device addresses wherever they differ from the host ones (a fake registrar whose
``cuMemHostGetDevicePointer`` answers shifted addresses, one shift per chunk)."""
from __future__ import annotations

import torch

from hicache.controllers.host_access import host_table
from hicache.core.layout import build_layout, preset
from hicache.host_pools.group import HostPoolGroup
from test_host_arena import FakeRegistrar

ROWS = {"page": 12, "swa_page": 6, "req_slot": 4}
SHIFT = 1 << 40


def test_pointer_tables_use_device_addresses_where_they_differ():
    lay = build_layout(preset("dsv4-tiny"))
    reg = FakeRegistrar(dev_shift=SHIFT)
    with HostPoolGroup(lay, ROWS, arena_options={"registrar": reg,
                                                 "chunk_bytes": 2 << 20}) as g:
        assert g.arena.stats["device_ptr_is_host_ptr"] is False
        for name, pool in g.pools.items():
            host, dev = pool.layer_ptrs(), pool.device_ptrs()
            assert all(d - h >= SHIFT for h, d in zip(host, dev))  # really different
            t = host_table(pool)
            assert t.ptrs == dev, name
            assert t.table(torch.device("cpu")).tolist() == dev  # what a kernel would read
            assert [x.data_ptr() for x in t.layers] == host  # CPU access stays on host memory


def test_pointer_tables_equal_host_addresses_under_uva():
    lay = build_layout(preset("dsv4-tiny"))
    with HostPoolGroup(lay, ROWS, arena_options={"registrar": FakeRegistrar()}) as g:
        for pool in g.pools.values():
            assert host_table(pool).ptrs == pool.layer_ptrs() == pool.device_ptrs()
