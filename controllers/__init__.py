"""The per-GPU daemon behind ``hicache serve`` (light: importing this package imports nothing).

Follow one BACKUP from the frame to the kernel:

* ``server``          — ROUTER loop: decode (``hicache.core.protocol``), dispatch, reply, push acks,
  reap silent clients.
* ``handlers``        — one function per command; validates everything, then acts.
* ``state``           — daemon state and the life of an operation (start -> finish -> ack).
* ``transfer_engine`` — CPU worker / GPU streams, per-layer load events, merging, completion.
* ``row_tracker``     — host rows in flight; frees deferred until their operations end.
* ``registry``        — clients, heartbeats, registered workers, retained acks.
* ``device_buffers``  — opens a worker's shm files / CUDA IPC handles and events.
* ``daemon``          — assembly: config -> layout -> host pools -> engine -> server; shutdown.
"""
