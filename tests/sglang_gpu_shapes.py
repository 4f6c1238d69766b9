"""SGLang-shaped DSV4 device pools on a GPU, and SGLang's host-pool calls, without SGLang.

The lent GPU machine has no SGLang CUDA build (``scripts/gpu_sglang.sh`` says what it needs),
so the adapter's GPU path is driven with stand-ins of what SGLang 0.5.23 hands it:

* ``sglang_stage(layout, rows, extra_rows, device)``: per pool and layer a tensor of its own, as
  SGLang allocates them (KV in fp8, compress states in fp32), viewed as byte rows the way
  ``stage_map.map_stage`` views SGLang's; random bytes. ``extra_rows`` gives a pool more rows
  than its space shares (SGLang sizes each buffer of a space apart).
* ``Pool(link, sglang_name)``: one of SGLang's DSV4 host pools as ``bind_host_pools`` builds it,
  minus SGLang's base class (which adds nothing to the copy calls).
* ``tokens(rows)``: SGLang's token indices of whole pages.
* ``backup_all(pools, ids)`` and ``load_layer_by_layer(pools, ids, stream, after_layer)``:
  SGLang's ``L2TransferEngine.submit_device_to_host`` (each pool's backup call) and
  ``submit_host_to_device`` (every stage layer in order, each pool that has it, from
  ``stream``; ``after_layer(pool, local_layer)`` runs after each call), inside the adapter's
  ``submission`` as the assembler patch installs it around them (``grouped=False``: without
  it, each pool sends its own command).
  ``defer=True``: the load as SGLang's ``start_loading`` submits it (the forward waits for its
  layers through the link's ``layer_waits``).
* ``LayerCounter``: SGLang's ``LayerDoneCounter`` as far as the adapter reads it (producer and
  consumer index, ``wait_until``; SGLang's own wait, a stream wait on events the adapter's
  calls record at once, is left out).
* ``commands_sent(link, cmd)``: the pools of every ``load`` / ``backup`` a link's client sends
  meanwhile (also used by ``tests/sglang/check_dsv4_l2.py`` with SGLang's own classes).

Used by ``tests/test_sglang_adapter_cuda.py`` and ``scripts/sglang_adapter_gpu_time.py``.
"""
from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator, NamedTuple

import torch

from hicache.core.layout import Layout
from hicache.engine.sglang.host_pools import _DaemonPoolMixin, submission
from hicache.engine.sglang.link import DaemonLink
from hicache.engine.sglang.stage_map import StageBuffers


class Pool(_DaemonPoolMixin):
    """See the module docstring."""

    def __init__(self, link: DaemonLink, sglang_name: str) -> None:
        self.link, self.page_size = link, link.layout.model.page_size
        self._init_daemon(sglang_name)


def sglang_stage(layout: Layout, rows: dict[str, int], extra_rows: dict[str, int],
                 device: torch.device, seed: int = 7) -> StageBuffers:
    """See the module docstring."""
    g = torch.Generator(device=device).manual_seed(seed)
    layers: dict[str, list[torch.Tensor]] = {}
    owners: dict[str, list[torch.Tensor]] = {}
    for name, spec in layout.pools.items():
        n = rows[spec.index] + extra_rows.get(name, 0)
        dtype = torch.float32 if spec.ring > 1 or name == "c128_state" else torch.float8_e4m3fn
        own, views = [], []
        for _ in range(spec.num_layers):
            raw = torch.randint(0, 256, (n * spec.page_bytes,), dtype=torch.uint8,
                                device=device, generator=g)
            t = raw.view(dtype)  # the owner SGLang holds (its own dtype)
            own.append(t)
            views.append(t.view(torch.uint8).reshape(n, spec.page_bytes))
        layers[name], owners[name] = views, own
    return StageBuffers(layout, layers, dict(rows), owners)


def tokens(rows: list[int], page: int, device: Any = "cpu") -> torch.Tensor:
    """SGLang's token indices of whole pages ``rows``."""
    r = torch.tensor(rows, dtype=torch.int64)
    return (r[:, None] * page + torch.arange(page)).reshape(-1).to(device)


class Transfer(NamedTuple):
    """The fields of SGLang's ``L2Transfer`` that the adapter reads."""

    host_pool: Any
    host_indices: torch.Tensor
    device_indices: torch.Tensor
    is_draft: bool = False


def _transfers(pools: dict[str, Pool], ids: dict[str, tuple[torch.Tensor, torch.Tensor]]
               ) -> list[Transfer]:
    """One per pool; the pools of one index space share its index tensors, as in SGLang."""
    return [Transfer(p, *ids[p.space]) for p in pools.values()]


class LayerCounter:
    """See the module docstring."""

    def __init__(self, counters: int = 3) -> None:
        self.counters = counters
        self.producer_index = self.consumer_index = -1

    def update_producer(self) -> int:
        """What ``start_loading`` does before it submits a load."""
        self.producer_index = (self.producer_index + 1) % self.counters
        return self.producer_index

    def wait_until(self, threshold: int) -> None:
        pass


def _submitting(pools: dict[str, Pool], kind: str, transfers: list[Transfer],
                grouped: bool, defer: bool = False) -> Any:
    link = next(iter(pools.values())).link
    return submission(link, kind, transfers, defer) if grouped else contextlib.nullcontext()


def backup_all(pools: dict[str, Pool], ids: dict[str, tuple[torch.Tensor, torch.Tensor]],
               grouped: bool = True) -> None:
    """SGLang's ``submit_device_to_host``: each pool's ``backup_from_device_all_layer`` from
    the current stream; ``grouped``: inside the adapter's ``submission`` (as installed)."""
    transfers = _transfers(pools, ids)
    with _submitting(pools, "backups", transfers, grouped):
        for t in transfers:
            t.host_pool.backup_from_device_all_layer(None, t.host_indices, t.device_indices,
                                                     "direct")


def load_layer_by_layer(pools: dict[str, Pool], ids: dict[str, tuple[torch.Tensor, torch.Tensor]],
                        stream: Any, after_layer: Callable[[str, int], None] | None = None,
                        grouped: bool = True, defer: bool = False) -> int:
    """See the module docstring; ``ids``: (host, device) token ids per index space;
    ``grouped``: inside the adapter's ``submission`` (as installed). Returns how many calls it
    made."""
    layout = next(iter(pools.values())).link.layout
    transfers = _transfers(pools, ids)
    calls = 0
    local = [{g: i for i, g in enumerate(layout.pools[t.host_pool.ours].layers)}
             for t in transfers]  # (SGLang's layer mappers)
    with _submitting(pools, "loads", transfers, grouped, defer), torch.cuda.stream(stream):
        for g in sorted({g for p in pools.values() for g in layout.pools[p.ours].layers}):
            for t, to_local in zip(transfers, local):
                li = to_local.get(g)
                if li is None:
                    continue
                t.host_pool.load_to_device_per_layer(None, t.host_indices, t.device_indices, li,
                                                     "direct")
                calls += 1
                if after_layer is not None:
                    after_layer(t.host_pool.ours, li)
    return calls


@contextlib.contextmanager
def commands_sent(link: DaemonLink, cmd: str) -> Iterator[list[list[str]]]:
    """See the module docstring."""
    sent: list[list[str]] = []
    real = getattr(link.client, cmd)

    def counted(items: Any, **kw: Any) -> Any:
        sent.append(sorted(items))
        return real(items, **kw)

    setattr(link.client, cmd, counted)
    try:
        yield sent
    finally:
        delattr(link.client, cmd)  # the class's method again
