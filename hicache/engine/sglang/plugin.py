"""SGLang plugin entry point: ``install`` in every SGLang scheduler process, from the environment.

SGLang 0.5.23 calls ``load_plugins()`` in each scheduler process (spawned, so a patch made in the
launching process would not reach them); hicache registers ``load`` under the
``sglang.srt.plugins`` entry-point group (pyproject.toml). ``load()`` reads:

* ``HICACHE_SGLANG_MODEL`` (required to activate): a preset name (``dsv4-flash``, ``dsv4-pro``,
  ``dsv4-tiny``) or a model ``config.json`` path, the same the daemon serves;
* ``HICACHE_SGLANG_PP_SIZE`` (default 1): SGLang's ``--pp-size``;
* ``HICACHE_SGLANG_SOCKET`` (optional): the daemon address; ``{pp_rank}`` and ``{gpu}`` are
  replaced by the worker's PP rank and CUDA device index. Default: the daemon's default socket
  for the worker's device (``hicache serve --device cuda:N`` without ``--socket``);
* ``HICACHE_SGLANG_FORWARD_WAITS`` (``0`` or ``1``, default ``0``): ``install``'s
  ``forward_waits`` (SGLang's forward waits for each layer of a load, not the submission).

Without ``HICACHE_SGLANG_MODEL`` the plugin installs nothing and logs that it is idle; with it,
any error (bad model, other SGLang version, a bad setting) stops the scheduler with one line:
it is raised as ``PluginFailed``, a ``SystemExit``, because SGLang's ``load_plugins`` logs and
goes on past any ``Exception`` a plugin raises, which would leave the scheduler running with
SGLang's own host pools while the operator believes hicache is its host tier.
"""
from __future__ import annotations

import logging
import os
from typing import Any

from hicache.core.config import default_socket
from hicache.core.layout import load_model

log = logging.getLogger("hicache.sglang")
ENV_MODEL, ENV_PP, ENV_SOCKET = "HICACHE_SGLANG_MODEL", "HICACHE_SGLANG_PP_SIZE", "HICACHE_SGLANG_SOCKET"
ENV_TIMEOUT = "HICACHE_SGLANG_TIMEOUT"  # seconds a daemon call, and a copy's host wait, may take
ENV_FORWARD_WAITS = "HICACHE_SGLANG_FORWARD_WAITS"


def _gpu() -> int | None:
    import torch

    return torch.cuda.current_device() if torch.cuda.is_available() else None


def address_for(pp_rank: int, template: str | None = None, gpu: int | None = None) -> str:
    """The daemon address of a worker (see the module docstring)."""
    if template:
        return template.replace("{pp_rank}", str(pp_rank)).replace("{gpu}", str(gpu))
    return default_socket("cpu" if gpu is None else f"cuda:{gpu}")


class PluginFailed(SystemExit):
    """The adapter was asked for (``HICACHE_SGLANG_MODEL``) and could not be installed."""


def load() -> Any:
    """Install the adapter when ``HICACHE_SGLANG_MODEL`` is set; returns the ``Installation``.
    A failure raises ``PluginFailed`` (see the module docstring), its cause chained."""
    model = os.environ.get(ENV_MODEL)
    if not model:
        log.info("hicache SGLang plugin idle: %s is not set", ENV_MODEL)
        return None
    try:
        return _install(model)
    except Exception as e:  # noqa: BLE001 - every failure stops the scheduler (docstring)
        why = f"hicache SGLang plugin: {type(e).__name__}: {e}"
        log.error("%s", why)
        raise PluginFailed(why) from e


def _install(model: str) -> Any:
    from hicache.engine.sglang.assembler_patch import install

    is_file = model.endswith(".json") or os.sep in model
    spec = load_model(config_path=model) if is_file else load_model(preset_name=model)
    try:
        pp_size = int(os.environ.get(ENV_PP, "1"))
    except ValueError:
        raise ValueError(f"{ENV_PP} must be an integer, got {os.environ[ENV_PP]!r}") from None
    template = os.environ.get(ENV_SOCKET)
    raw = os.environ.get(ENV_TIMEOUT, "5")
    try:
        timeout = float(raw)
    except ValueError:
        raise ValueError(f"{ENV_TIMEOUT} must be seconds, got {raw!r}") from None
    if not 0.1 <= timeout <= 3600:
        raise ValueError(f"{ENV_TIMEOUT} must be 0.1..3600 seconds, got {raw!r}")
    waits = os.environ.get(ENV_FORWARD_WAITS, "0")
    if waits not in ("0", "1"):
        raise ValueError(f"{ENV_FORWARD_WAITS} must be 0 or 1, got {waits!r}")
    inst = install(spec, address=lambda rank: address_for(rank, template, _gpu()),
                   pp_size=pp_size, timeout=timeout, forward_waits=waits == "1")
    log.info("hicache SGLang adapter installed: model %s, pp size %d; it takes effect when "
             "SGLang builds a DeepSeek-V4 HiCache stack (--enable-hierarchical-cache)",
             spec.name, pp_size)
    return inst
