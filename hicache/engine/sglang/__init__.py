"""SGLang adapter: the hicache daemon as SGLang 0.5.23's L2 host tier for DeepSeek-V4.

``install(model, address=..., pp_size=...)`` (``assembler_patch.py``) patches SGLang's DSV4 HiCache
assembler so that its host pools forward to the daemon (``host_pools.py``) after SGLang's device
pools are mapped onto our layout and registered (``stage_map.py``, ``link.py``).
``storage.HicacheStorage`` is SGLang's ``dynamic`` storage backend on the daemon's key store
(SGLang imports it by name). Only ``sglang==0.5.23`` is accepted (``version.py``). See
docs/sglang.md.

Importing this package does not import SGLang; ``install`` does.
"""
from typing import Any

from hicache.engine.sglang.version import SUPPORTED_SGLANG, UnsupportedSglang, check_sglang_version

__all__ = ["SUPPORTED_SGLANG", "UnsupportedSglang", "check_sglang_version", "install"]


def install(*args: Any, **kwargs: Any) -> Any:
    """``assembler_patch.install`` (imported here only when called: it imports SGLang)."""
    from hicache.engine.sglang.assembler_patch import install as _install

    return _install(*args, **kwargs)
