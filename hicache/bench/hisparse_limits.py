"""The H2D limits `hicache bench hisparse` sets its swap-in against (GPU only).

* ``contiguous_h2d(arena, device)``: a contiguous pinned copy of up to 1 GiB, best of 5 (GB/s):
  the limit of the target.
* ``random_tokens_h2d(arena, layers, rows, fmt, device)``: 4,096 isolated random tokens per
  layer, every layer in one ``copy_tokens`` launch on every SM, host rows of ``fmt`` laid over
  the same pinned arena, best of 6 (GB/s of the format's token bytes); then every byte of the
  device rows is checked against the reference copy (``RuntimeError`` if one differs).
  ``sequential=True`` takes tokens 0..4,095 of each layer instead (values back to back in their
  pages), ``ctas`` a CTA count instead of every SM.
* ``layout_probes(...)``: the same for three host layouts of one C4 token, to show what the
  layout costs on the link: ``page_584`` (the C4 page format: 576-B value, 8-B scale elsewhere in
  the page), ``value_576`` (the value alone), ``record_640`` (value and scale together, padded to
  five whole 128-B lines). Each also as GB/s of the 584 useful bytes of a C4 token.
* ``read_sweep(...)``: ``random_tokens_h2d`` of the C4 page format, random and sequential, at
  each of ``SWEEP_CTAS`` (0: every SM): whether the isolated-token rate is bound by the launch's
  parallelism (it grows with CTAs), by scattered host addresses (random below sequential), or
  by the token read itself (flat, random = sequential).
"""
from __future__ import annotations

from typing import Any, Callable

P = 64


def _timed(torch: Any, fn: Callable[[], Any]) -> float:
    a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.synchronize()
    a.record()
    fn()
    b.record()
    b.synchronize()
    return a.elapsed_time(b) / 1e3


def contiguous_h2d(arena: Any, device: Any) -> float:
    import torch

    n = min(arena.numel(), 1 << 30)
    h, d = arena[:n], torch.empty(n, dtype=torch.uint8, device=device)
    return max(n / _timed(torch, lambda: d.copy_(h, non_blocking=True)) / 1e9 for _ in range(5))


def random_tokens_h2d(arena: Any, layers: int, rows_584: int, fmt: Any, device: Any, *,
                      sequential: bool = False, ctas: int = 0) -> float:
    import torch

    from hicache.kernels.dispatch import copy_tokens
    from hicache.kernels.tables import LayerTable

    per = arena.numel() // layers
    rows = min(per // fmt.page_bytes, rows_584)
    host = LayerTable([arena[l * per: l * per + rows * fmt.page_bytes].view(rows, fmt.page_bytes)
                       for l in range(layers)], "host")
    n = 4096
    dev = LayerTable([torch.empty(n // P, fmt.page_bytes, dtype=torch.uint8, device=device)
                      for _ in range(layers)], "device")
    g = torch.Generator().manual_seed(1)
    src = torch.arange(n) if sequential else torch.randperm(rows * P, generator=g)[:n]
    dst = torch.randperm(n, generator=g)
    k = ctas or torch.cuda.get_device_properties(device).multi_processor_count
    for t in dev.layers:
        t.zero_()
    best = max(n * layers * fmt.token_bytes
               / _timed(torch, lambda: copy_tokens(host, dev, src, dst, fmt, ctas=k)) / 1e9
               for _ in range(6))
    _check(host, dev, src, dst, fmt)
    return best


def _check(host: Any, dev: Any, src: Any, dst: Any, fmt: Any) -> None:
    """Every byte of the device rows is what the reference copy of the same tokens into zeroed
    rows gives (the copied tokens, zeros elsewhere); else the probe's figure is not reported."""
    import torch

    from hicache.kernels.reference import copy_tokens_ref

    want = [torch.zeros(t.shape, dtype=t.dtype) for t in dev.layers]
    copy_tokens_ref(host.layers, want, src, dst, fmt)
    for l, (t, w) in enumerate(zip(dev.layers, want)):
        if not torch.equal(t.cpu(), w):
            raise RuntimeError(f"token read probe: layer {l} of the device rows differs from "
                               f"the reference copy")


def layout_probes(arena: Any, layers: int, rows_584: int, device: Any) -> dict[str, Any]:
    from hicache.kernels.tables import TokenFormat

    fmts = {"page_584": TokenFormat.mla(P),
            "value_576": TokenFormat(P, 576, 0, P * 576, P * 576),
            "record_640": TokenFormat(P, 640, 0, P * 640, P * 640)}
    out = {}
    for name, f in fmts.items():
        gbps = random_tokens_h2d(arena, layers, rows_584, f, device)
        out[name] = {"gbps": round(gbps, 2),
                     "c4_token_gbps": round(gbps * 584 / f.token_bytes, 2)}
    return out


SWEEP_CTAS = (4, 16, 32, 64, 0)  # 0: every SM


def read_sweep(arena: Any, layers: int, rows_584: int, device: Any) -> list[dict[str, Any]]:
    from hicache.kernels.tables import TokenFormat

    fmt = TokenFormat.mla(P)
    return [{"pattern": "sequential" if seq else "random", "ctas": k or "all",
             "gbps": round(random_tokens_h2d(arena, layers, rows_584, fmt, device,
                                             sequential=seq, ctas=k), 2)}
            for seq in (False, True) for k in SWEEP_CTAS]
