"""The DSV4 worker simulator, workloads and traces, page content and ``hicache demo``.
Imports ``hicache.engine`` and ``hicache.core`` only. Importing this package imports nothing.
"""
