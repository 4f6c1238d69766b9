"""``install(...)``: make the hicache daemon SGLang 0.5.23's L2 host tier for DSV4.

SGLang has no hook to register an outside host pool, so ``install`` wraps the one function that
builds the DSV4 HiCache stack, ``hybrid_pool_assembler.build_deepseek_v4_hicache_stack``
(called by the DSV4 stack strategy when ``--enable-hierarchical-cache`` is on). For each worker
the wrapper:

1. finds the worker's PP stage from its device pool (``kvcache.start_layer/end_layer``), builds
   our ``Layout`` for it (``model``, ``pp_size``/``bounds``; paged SWA, offline C128 state, no
   MTP) and opens a ``Client`` to ``address`` (a string, or a function of the PP rank);
2. maps SGLang's device pools onto that layout byte for byte and registers them with the daemon
   (``DaemonLink.connect``; refused with one line on any mismatch);
3. runs SGLang's own builder with ``LogicalHostPool``, ``DeepSeekV4PagedHostPool`` and
   ``DeepSeekV4StateHostPool`` replaced, for that call only, by the daemon-backed classes of
   ``host_pools.bind_host_pools``;
4. wraps the built controller's ``L2TransferEngine.submit_device_to_host`` /
   ``submit_host_to_device`` in ``host_pools.submission``, so that one submission's transfers
   reach the daemon as one ``backup`` / ``load`` of every pool;
5. with ``forward_waits``, attaches the controller's layer counter to the link's
   ``layer_waits``: SGLang's forward, not the submission, waits for the layers of the GPU
   loads ``start_loading`` submits (refused on a PD decode server, whose restores no forward
   waits for).

A storage backend is refused, at build time (``--hicache-storage-backend``) and at SGLang's
runtime attach (the built controller's ``attach_storage_backend`` raises; SGLang answers the
attach request with that line and changes nothing): the host bytes are in the daemon, where no
SGLang storage backend can read them. Everything else (tree, controller, transfer engine,
layer counters) is SGLang's. ``install``
refuses any SGLang other than 0.5.23 (``version.check_sglang_version``) and returns an
``Installation`` whose ``links`` are the workers connected so far and whose ``uninstall()``
restores the original builder.
"""
from __future__ import annotations

import functools
import threading
from dataclasses import dataclass, field
from typing import Any, Callable, Sequence

from hicache.core.layout import LayoutError, ModelSpec, build_layout, preset
from hicache.engine.client import Client
from hicache.engine.sglang.host_pools import bind_host_pools, submission
from hicache.engine.sglang.link import DaemonLink
from hicache.engine.sglang.version import check_sglang_version

_PATCH_LOCK = threading.Lock()
_BUILD_LOCK = threading.RLock()  # held while SGLang's builder sees our pool classes


@dataclass
class Installation:
    module: Any
    original: Callable[..., Any]
    links: list[DaemonLink] = field(default_factory=list)

    def uninstall(self, close: bool = True) -> None:
        """Restore SGLang's builder; with ``close``, unregister every connected worker."""
        self.module.build_deepseek_v4_hicache_stack = self.original
        if close:
            links, self.links = list(self.links), []
            first: BaseException | None = None
            for link in links:  # every link is closed, whatever one of them raises
                try:
                    link.close()
                except Exception as e:  # noqa: BLE001 - re-raised after the others
                    first = first or e
            if first is not None:
                raise first


def sglang_stages(num_layers: int, pp_size: int) -> list[tuple[int, int]]:
    """The stages SGLang itself runs (``get_pp_indices``: its even split, or the partition in
    ``SGLANG_PP_LAYER_PARTITION``), so ``install`` finds the stage of any SGLang worker. A
    daemon's default (``layout.stage_bounds``) is the same even split; with a partition set,
    start the daemons with the same ``--stage-bounds``."""
    from sglang.srt.distributed.utils import get_pp_indices

    return [tuple(get_pp_indices(num_layers, r, pp_size)) for r in range(pp_size)]


def _pp_rank(model: ModelSpec, bounds: Sequence[tuple[int, int]], start: int, end: int) -> int:
    for r, (s, e) in enumerate(bounds):
        if (s, e) == (start, end):
            return r
    raise LayoutError(f"SGLang stage [{start}, {end}) is none of the hicache stages {list(bounds)}")


def _pd_decode() -> bool:
    """Whether this SGLang process is a PD decode server (``--disaggregation-mode decode``).
    A process that published no serving config (SGLang's test kit builds caches without one)
    runs no disaggregation."""
    from sglang.srt.runtime_context import get_disagg

    try:
        mode = get_disagg().disaggregation_mode
    except ValueError:  # "config namespace 'disagg' not published"
        return False
    return mode == "decode"


def _storage_refused(what: str, todo: str) -> ValueError:
    return ValueError(f"hicache's SGLang adapter keeps the host tier in its daemon: {what} "
                      f"cannot read its bytes; {todo} (the daemon's L3 is --l3 on hicache "
                      f"serve)")


def _refuse_attach(*args: Any, **kw: Any) -> None:
    """The controller's ``attach_storage_backend`` while the adapter holds the host tier."""
    name = kw.get("storage_backend", args[0] if args else "")
    raise _storage_refused(f"storage backend {name or '(unnamed)'}",
                           "attach none to this server")


def _one_command_per_submission(engine: Any, link: DaemonLink) -> None:
    """Wrap this worker's ``L2TransferEngine`` submissions (``host_pools.submission``): the
    transfers of one submission reach the daemon as one ``load`` or one ``backup``."""
    for method, kind in (("submit_host_to_device", "loads"),
                         ("submit_device_to_host", "backups")):
        original = getattr(engine, method)

        def submit(transfers: Any, *args: Any, _original: Any = original, _kind: str = kind,
                   **kw: Any) -> Any:
            # ``start_loading``'s loads (those with per-layer events for the forward) are
            # waited for by the forward (``layer_waits``); any other load, by its calls
            defer = _kind == "loads" and kw.get("on_layer_done") is not None
            with submission(link, _kind, transfers, defer):
                return _original(transfers, *args, **kw)

        setattr(engine, method, functools.wraps(original)(submit))


def install(model: ModelSpec | str, *, address: str | Callable[[int], str] | None = None,
            pp_size: int = 1, bounds: Sequence[tuple[int, int]] | None = None,
            timeout: float = 5.0, forward_waits: bool = False) -> Installation:
    """Patch SGLang's DSV4 HiCache assembler (see the module docstring). ``forward_waits``:
    SGLang's forward waits for a GPU load's layers, not the submission (``layer_waits``; off
    by default, docs/sglang.md says what it trades)."""
    check_sglang_version()
    from sglang.srt.mem_cache.hybrid_cache import hybrid_pool_assembler as A

    spec = preset(model) if isinstance(model, str) else model
    stage_list = list(bounds) if bounds is not None else sglang_stages(spec.num_layers, pp_size)
    if len(stage_list) != pp_size:
        raise LayoutError(f"{len(stage_list)} stage bounds given for pp size {pp_size}")
    with _PATCH_LOCK:
        original = A.build_deepseek_v4_hicache_stack
        if getattr(original, "__hicache__", False):
            raise RuntimeError("hicache.engine.sglang.install() is already in effect")
        inst = Installation(A, original)

        @functools.wraps(original)
        def build(*args: Any, **kw: Any) -> Any:
            if kw.get("storage_backend"):
                raise _storage_refused(f"--hicache-storage-backend {kw['storage_backend']}",
                                       "launch without it")
            kvcache = kw["kvcache"]
            rank = _pp_rank(spec, stage_list, kvcache.start_layer, kvcache.end_layer)
            layout = build_layout(spec, pp_size, rank, stage_list, swa_mode="paged",
                                  c128_state="offline", mtp=False)
            addr = address(rank) if callable(address) else address
            drafts = getattr(kw.get("params"), "mtp_draft_device_pools", ())
            if drafts:
                raise ValueError("hicache's SGLang adapter does not map MTP draft pools; "
                                 "launch without speculative decoding")
            if forward_waits and _pd_decode():
                raise ValueError("hicache's forward_waits does not apply to a PD decode server: "
                                 "its local restores are read from the load's completion "
                                 "event, with no forward wait to check the load's ack; launch "
                                 "without HICACHE_SGLANG_FORWARD_WAITS")
            client = Client(addr, timeout=timeout, name=f"sglang-pp{rank}")
            try:
                link = DaemonLink.connect(kvcache, layout, client)
            except BaseException:
                client.close()
                raise
            # the builder's module names are swapped for this build only: one build at a
            # time, so two builds in one process cannot wire one worker to the other's link
            with _BUILD_LOCK:
                saved = (A.LogicalHostPool, A.DeepSeekV4PagedHostPool, A.DeepSeekV4StateHostPool)
                try:
                    A.LogicalHostPool, A.DeepSeekV4PagedHostPool, A.DeepSeekV4StateHostPool = \
                        bind_host_pools(link)
                    stack = original(*args, **kw)
                    _one_command_per_submission(stack[1].l2_transfer_engine, link)
                    if forward_waits:
                        link.layer_waits.attach(stack[1].layer_done_counter)
                    # SGLang's runtime attach (``/attach_hicache_storage_backend``) is refused as
                    # the flag is at build time: SGLang turns the raise into a failed reply
                    stack[1].attach_storage_backend = _refuse_attach
                except BaseException:  # SGLang's builder refused: the worker is not left registered
                    try:
                        link.close()
                    except Exception:  # noqa: BLE001 - the builder's error is the one to report
                        pass
                    raise
                finally:
                    A.LogicalHostPool, A.DeepSeekV4PagedHostPool, A.DeepSeekV4StateHostPool = saved
            inst.links.append(link)
            return stack

        build.__hicache__ = True  # type: ignore[attr-defined]
        A.build_deepseek_v4_hicache_stack = build
    return inst
