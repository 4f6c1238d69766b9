"""hicache: host-offload daemon for hierarchical KV caches (DeepSeek-V4 hybrid layout first).

Importing the package is light: it pulls in neither the daemon, torch nor Triton.

The sub-packages ``hicache.host_pools``, ``hicache.controllers`` and ``hicache.kernels`` live in
top-level folders of the source tree (``pyproject.toml`` maps them). When the package is used
straight from a checkout (``PYTHONPATH=<checkout>``, no install, as on a bare GPU machine) the
checkout root is added to this package's search path so those names still resolve.
"""
import os as _os

from hicache.core.version import __version__  # noqa: F401

_root = _os.path.dirname(_os.path.dirname(_os.path.abspath(__file__)))
if _os.path.isfile(_os.path.join(_root, "pyproject.toml")) and _os.path.isdir(
    _os.path.join(_root, "host_pools")
):
    __path__.append(_root)  # type: ignore[name-defined]  # noqa: F821
