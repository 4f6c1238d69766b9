"""The one SGLang release this adapter is written against, and the check that refuses others.

``check_sglang_version()`` returns the installed version string when it is exactly
``SUPPORTED_SGLANG`` and raises ``UnsupportedSglang`` (one line naming both versions) otherwise,
including when SGLang is not installed. Every patching entry point calls it first: the seams it
patches (``build_deepseek_v4_hicache_stack``, the host-pool classes) are private to SGLang and
change between releases.
"""
from __future__ import annotations

from importlib import metadata

from hicache.core.errors import HicacheError

SUPPORTED_SGLANG = "0.5.23"


class UnsupportedSglang(HicacheError, RuntimeError):
    """The installed SGLang is not the release the adapter was written for."""


def installed_sglang() -> str | None:
    try:
        return metadata.version("sglang")
    except metadata.PackageNotFoundError:
        return None


def check_sglang_version(found: str | None = None) -> str:
    """The installed (or given) SGLang version; ``UnsupportedSglang`` unless it is supported."""
    found = installed_sglang() if found is None else found
    if found != SUPPORTED_SGLANG:
        raise UnsupportedSglang(
            f"hicache.engine.sglang supports sglang=={SUPPORTED_SGLANG} only; "
            f"{'sglang is not installed' if found is None else f'found sglang {found}'}")
    return found
