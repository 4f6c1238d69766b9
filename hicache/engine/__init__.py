"""What a serving engine imports: the daemon client, tier hooks, the reference radix tree,
device-pool helpers and the daemon launcher. Imports ``hicache.core`` (and engine-side kernels),
never the daemon (``hicache.controllers``). Importing this package imports nothing.
"""
