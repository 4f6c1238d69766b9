"""Triton launches without the JIT's per-call work: one ``CompiledKernel`` kept per
specialization, launched directly.

A ``kernel[grid](...)`` call binds the arguments, computes Triton's specialization key and looks
it up before it launches: 40-60 µs of host time per launch on the H200 machine, where a load
issues seven launches and the copy of layer 0 waits for the first. ``CachedKernel`` keeps the
``CompiledKernel`` that call returns and launches it through ``compiled[grid](*args)`` (the
grid padded to three dimensions: the compiled runner reads all three).

Contract: ``CachedKernel(fn)``; ``launch(grid, key, args, options, cached)`` runs ``fn`` on the
current stream with ``args`` (every kernel parameter by name, constexprs included: tensors or
scalars) and ``options`` (``num_warps``...). ``key`` must hold everything Triton specializes on
that can change between calls: the constexpr values and the 16-byte alignment of each pointer
argument (int arguments the kernel marks ``do_not_specialize`` need nothing). The first call per
key, every call with ``cached`` False (CPU interpreter), and every call on a Triton that
reorders launcher arguments (``metadata.runtime_argument_order``) go through the JIT.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch


class CachedKernel:
    """See the module docstring."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names: list[str] = list(fn.arg_names)
        self._compiled: dict[tuple, Any] = {}
        self.jit_launches = 0  # launches that went through the JIT (tests count them)

    def launch(self, grid: tuple[int, ...], key: tuple, args: Mapping[str, Any],
               options: Mapping[str, Any], cached: bool) -> None:
        ck = self._compiled.get(key) if cached else None
        if ck is not None:
            ck[tuple(grid) + (1,) * (3 - len(grid))](*[a.data_ptr() if isinstance(a, torch.Tensor) else a
                       for a in (args[n] for n in self.names)])
            return
        self.jit_launches += 1
        ck = self.fn[grid](**args, **options)
        if not cached or ck is None:
            return
        if hasattr(ck, "result"):  # a Triton that compiles asynchronously returns a future
            ck = ck.result()
        order = getattr(getattr(ck, "metadata", None), "runtime_argument_order", None)
        if order and list(order) != self.names:
            return  # this Triton reorders launcher arguments: stay on the JIT
        self._compiled[key] = ck

    @property
    def specializations(self) -> int:
        return len(self._compiled)
