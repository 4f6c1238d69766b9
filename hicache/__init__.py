"""hicache: host-offload daemon for hierarchical KV caches (DeepSeek-V4 hybrid layout first).

Importing the package is light: it pulls in neither the daemon, torch nor Triton.
"""
__version__ = "0.1.0"
