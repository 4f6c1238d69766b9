"""Triton launches without the JIT's per-call work: one ``CompiledKernel`` kept per
specialization, launched directly.

A ``kernel[grid](...)`` call binds the arguments, computes Triton's specialization key and looks
it up before it launches: 40-60 µs of host time per launch on the H100 / H200 machines, where a
load issues seven launches (the copy of layer 0 waits for the first) and a backup of DSV4-Flash
seven more. ``CachedKernel`` keeps the ``CompiledKernel`` that call returns and launches it
through ``compiled[grid](*args)`` (the grid padded to three dimensions: the compiled runner
reads all three).

Contract: ``CachedKernel(fn)``; ``launch(grid, args, options, cached)`` runs ``fn`` on the
current stream with ``args`` (every kernel parameter by name, constexprs included: tensors or
scalars) and ``options`` (``num_warps``...). The kept kernel is looked up under ``key(args,
options)``: what Triton specializes on, worked out as Triton does it: each constexpr's value;
each tensor's dtype and whether its address is 16-byte aligned; each int's width (i32, i64,
u64), and for an int the kernel does not mark ``do_not_specialize`` whether it is 1 and whether
16 divides it; the options. The first call per key, every call with ``cached`` False (CPU
interpreter), and every call on a Triton that reorders launcher arguments
(``metadata.runtime_argument_order``) go through the JIT.
"""
from __future__ import annotations

from typing import Any, Mapping

import torch

_CONST, _PLAIN, _SPEC = 0, 1, 2  # how an argument enters the key (see ``key``)


def _width(v: int) -> str:
    """The integer type Triton gives a run-time int argument."""
    if -(1 << 31) <= v < (1 << 31):
        return "i32"
    return "u64" if (1 << 63) <= v < (1 << 64) else "i64"


class CachedKernel:
    """See the module docstring."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        self.names: list[str] = list(fn.arg_names)
        params = {p.name: p for p in getattr(fn, "params", ())}
        self._kinds = [_CONST if getattr(params.get(n), "is_constexpr", False) else
                       _PLAIN if getattr(params.get(n), "do_not_specialize", False) else _SPEC
                       for n in self.names]
        self._plan = list(zip(self.names, self._kinds))
        self._compiled: dict[tuple, Any] = {}
        self.jit_launches = 0  # launches that went through the JIT (tests count them)

    def key(self, args: Mapping[str, Any], options: Mapping[str, Any]) -> tuple:
        """What picks the compiled kernel for ``args`` and ``options`` (module docstring). An
        int subclass other than bool enters by value (a finer key than Triton's: never wrong)."""
        parts: list[Any] = []
        add = parts.append
        for n, kind in self._plan:
            a = args[n]
            if kind == _CONST:
                add(a)
            elif type(a) is int:
                add(_width(a) if kind == _PLAIN else (_width(a), a == 1, a % 16 == 0))
            elif isinstance(a, torch.Tensor):
                add((a.dtype, a.data_ptr() % 16 == 0))
            else:
                add(type(a).__name__ if isinstance(a, float) else a)
        add(tuple(sorted(options.items())))
        return tuple(parts)

    def launch(self, grid: tuple[int, ...], args: Mapping[str, Any],
               options: Mapping[str, Any], cached: bool) -> None:
        key = self.key(args, options) if cached else None
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
