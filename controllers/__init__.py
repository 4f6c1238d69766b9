"""The per-GPU daemon behind ``hicache serve`` (light: importing this package imports nothing).

Follow one BACKUP from the frame to the kernel (docs/architecture.md walks it):

* ``server``         — ROUTER loop: decode (``hicache.core.protocol``), route by the command
  table, reply, push acks, reap silent clients.
* ``copy_commands``  — backup / load / swap / clear: validate everything, build an ``Operation``.
* ``handlers``       — session and bookkeeping commands; the table's handler lookup; error codes.
* ``state``          — daemon state, named checks, the life of an operation (start -> collect).
* ``scheduler``      — CPU worker / GPU streams, per-layer load events, merging, completion.
* ``ops``            — the data model: ``Ids``, ``Item``, ``Operation``.
* ``row_tracker``    — host rows in flight; frees deferred until their operations end.
* ``registry``       — clients, heartbeats, registered workers, retained acks.
* ``device_buffers`` — opens a worker's sealed memfds / CUDA IPC handles and events.
* ``metrics``        — the daemon's metric catalog.
* ``preflight``      — start-up checks that allocate nothing and load no torch (sizing, address).
* ``daemon``         — assembly: config -> layout -> host pools -> scheduler -> server; shutdown.
* ``l3_handlers``    — ``l3_query`` / ``l3_prefetch`` / ``l3_put`` (``--l3 mooncake``).
* ``l3_store``       — the Mooncake Store client: connection, online state, batched jobs.
* ``l3_format``      — L3 keys, namespaces, object header, a page's bytes in the arena.
"""
