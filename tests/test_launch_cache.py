"""``kernels.launch_cache.CachedKernel`` on CPU, with the Triton kernel replaced by a recorder
(the real direct launches are checked byte for byte on a GPU by the copy tests): the first
launch of each specialization goes through the JIT with every argument by name, later ones
straight to the kept compiled kernel with the arguments in kernel order, tensors as their
addresses; the key follows what Triton specializes on, and nothing else."""
from __future__ import annotations

from types import SimpleNamespace

import torch

from hicache.kernels.launch_cache import CachedKernel


class _Compiled:
    def __init__(self, log: list) -> None:
        self.log, self.metadata = log, None

    def __getitem__(self, grid: tuple):
        return lambda *args: self.log.append(("direct", grid, args))


class _Jit:
    """A ``@triton.jit`` function's surface: ``arg_names``, ``params``, ``fn[grid](**kw)``."""

    arg_names = ["src", "idx", "n", "stride", "W", "MODE"]

    def __init__(self) -> None:
        self.params = [SimpleNamespace(name=n, is_constexpr=n.isupper(),
                                       do_not_specialize=n == "n") for n in self.arg_names]
        self.log: list = []

    def __getitem__(self, grid: tuple):
        def run(**kw):
            self.log.append(("jit", grid, kw))
            return _Compiled(self.log)
        return run


def _args(**over):
    a = {"src": torch.zeros(8, dtype=torch.int64), "idx": torch.zeros(8, dtype=torch.int64),
         "n": 5, "stride": 48, "W": 8, "MODE": ""}
    a.update(over)
    return a


def test_first_launch_per_key_is_jit_then_direct_in_kernel_order() -> None:
    jit = _Jit()
    k = CachedKernel(jit)
    a = _args()
    k.launch((4,), a, {"num_warps": 8}, cached=True)
    k.launch((4,), a, {"num_warps": 8}, cached=True)
    k.launch((2, 3), _args(n=9), {"num_warps": 8}, cached=True)  # a new length: same kernel
    assert [e[0] for e in jit.log] == ["jit", "direct", "direct"]
    assert jit.log[0][2] == dict(a, num_warps=8)
    assert jit.log[1][1] == (4, 1, 1) and jit.log[2][1] == (2, 3, 1)
    assert jit.log[1][2] == (a["src"].data_ptr(), a["idx"].data_ptr(), 5, 48, 8, "")
    assert jit.log[2][2][2] == 9
    assert k.jit_launches == 1 and k.specializations == 1


def test_the_key_changes_with_what_triton_specializes_on_and_only_that() -> None:
    k = CachedKernel(_Jit())
    base = k.key(_args(), {"num_warps": 8})
    same = [_args(n=1), _args(n=16), _args(n=1 << 20), _args(stride=32), _args(stride=64),
            _args(src=torch.ones(3, dtype=torch.int64))]
    for a in same:  # a do-not-specialize int's value; a specialized int's value past 1 and 16
        assert k.key(a, {"num_warps": 8}) == base, a
    buf = torch.zeros(16, dtype=torch.int64)
    other = [_args(n=1 << 40), _args(stride=1), _args(stride=49), _args(stride=1 << 33),
             _args(idx=torch.zeros(8, dtype=torch.int32)), _args(idx=buf[1:]), _args(W=16),
             _args(MODE=".cg")]
    keys = {k.key(a, {"num_warps": 8}) for a in other}
    assert base not in keys and len(keys) == len(other)
    assert k.key(_args(), {"num_warps": 16}) != base


def test_uncached_every_launch_is_a_jit_launch() -> None:
    jit = _Jit()
    k = CachedKernel(jit)
    for _ in range(3):
        k.launch((4,), _args(), {}, cached=False)
    assert [e[0] for e in jit.log] == ["jit"] * 3 and k.specializations == 0


def test_a_triton_that_reorders_launcher_arguments_stays_on_the_jit() -> None:
    """A compiled kernel whose launcher takes its arguments in another order
    (``metadata.runtime_argument_order``) is not kept: every launch goes through the JIT, which
    knows that order."""
    compiled = _Compiled([])
    compiled.metadata = SimpleNamespace(runtime_argument_order=list(reversed(_Jit.arg_names)))

    class _Reordering(_Jit):
        def __getitem__(self, grid: tuple):
            def run(**kw):
                self.log.append(("jit", grid, kw))
                return compiled
            return run

    r = _Reordering()
    compiled.log = r.log
    k = CachedKernel(r)
    for _ in range(3):
        k.launch((4,), _args(), {}, cached=True)
    assert [e[0] for e in r.log] == ["jit"] * 3 and k.specializations == 0


def test_a_compile_returned_as_a_future_is_kept_once_resolved() -> None:
    """A Triton that compiles asynchronously returns a future from the JIT call: its result
    is the kernel kept and launched directly after."""
    class _Future:
        def __init__(self, ck: _Compiled) -> None:
            self.ck = ck

        def result(self) -> _Compiled:
            return self.ck

    class _Async(_Jit):
        def __getitem__(self, grid: tuple):
            def run(**kw):
                self.log.append(("jit", grid, kw))
                return _Future(_Compiled(self.log))
            return run

    j = _Async()
    k = CachedKernel(j)
    for _ in range(2):
        k.launch((4,), _args(), {}, cached=True)
    assert [e[0] for e in j.log] == ["jit", "direct"] and k.specializations == 1
