"""Hostile-input tooling behind ``hicache bench fuzz`` and the soak's crash modes: message
cases, row attacks, raw peers and the runner. A tool layer: may import everything below it.
"""
