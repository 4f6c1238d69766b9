"""Host tier of hicache: a pinned arena mirroring a GPU's DSV4 KV pools row for row.

Light on purpose (nothing is imported here). The modules, bottom up:

* ``errors``      — ``PoolError`` and its kinds.
* ``sizing``      — byte parsing, the arena's region plan, host rows from a budget or ratio.
* ``numa_node``   — the GPU's NUMA node (sysfs) and how touching threads bind to it.
* ``cuda_host``   — ``cudaHostRegister`` / unregister / device pointer for one device.
* ``arena``       — ``PinnedArena``: exact-size mmap, parallel first touch, chunked registration.
* ``allocator``   — ``RowAllocator``: one free-list per index space, owners recorded on alloc.
* ``paged_pool``  — ``PagedHostPool``: per-layer ``[rows, page_bytes]`` views of one device pool.
* ``group``       — ``HostPoolGroup``: every pool of a stage, all-or-nothing alloc, buffer infos.

See ``docs/host_pools.md``.
"""
