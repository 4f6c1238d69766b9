"""``kernels.hisparse.SwapInLaunch`` bookkeeping on CPU, with the Triton kernel object replaced
by a recorder (the real launches are checked on a GPU in ``test_hisparse_cuda.py``): the first
call of each specialization goes through the JIT with every argument by name; later calls go
straight to that compiled kernel with the fixed arguments in kernel order, tensors as their
addresses; a new batch size makes a new grid, not a new JIT call."""
from __future__ import annotations

import torch

from hicache.kernels import hisparse as H


class _Compiled:
    def __init__(self, log: list) -> None:
        self.log, self.metadata = log, None

    def __getitem__(self, grid):
        return lambda *args: self.log.append(("direct", grid, args))


class _Jit:
    arg_names = H._swap_in_kernel.arg_names

    def __init__(self) -> None:
        self.log: list = []

    def __getitem__(self, grid):
        def run(*args, **kw):
            self.log.append(("jit", grid, args, kw))
            return _Compiled(self.log)
        return run


def _launch(monkeypatch, cuda: bool):
    jit = _Jit()
    monkeypatch.setattr(H, "_swap_in_kernel", jit)
    names = jit.arg_names
    args = {n: (torch.zeros(4, dtype=torch.int64) if n.endswith(("_ptr", "_tab")) else 7)
            for n in names[4:] if n.islower()}
    consts = {n: 3 for n in names if not n.islower()}
    consts["num_warps"] = 8
    out = torch.full((8, 16), -1, dtype=torch.int64)
    return jit, H.SwapInLaunch(args, consts, out, cuda=cuda), args, out


def test_first_call_per_specialization_jit_then_direct(monkeypatch):
    jit, ln, args, out = _launch(monkeypatch, cuda=True)
    req = torch.arange(4)
    topk = torch.zeros(4, 16, dtype=torch.int64)
    assert ln.launch(req, topk).shape == (4, 16)
    ln.launch(req, topk)
    ln.launch(req[:2], topk[:2])  # new batch size: new grid, same compiled kernel
    ln.launch(req, topk.to(torch.int32))  # new specialization: through the JIT again
    kinds = [(e[0], e[1]) for e in jit.log]
    assert kinds == [("jit", (4,)), ("direct", (4, 1, 1)), ("direct", (2, 1, 1)), ("jit", (4,))]
    assert ln.specializations == 2
    _, _, a, kw = jit.log[0]
    assert a[0] is req and a[1] is topk and a[2] == 16 and a[3].data_ptr() == out.data_ptr()
    assert kw["num_warps"] == 8 and all(kw[n] is v for n, v in args.items())
    direct = jit.log[1][2]
    want = [v.data_ptr() if isinstance(v, torch.Tensor) else v
            for v in (dict(args, **{n: 3 for n in jit.arg_names if not n.islower()})[n]
                      for n in jit.arg_names[4:])]
    assert direct[0] is req and direct[2] == 16 and direct[3] == out.data_ptr()
    assert list(direct[4:]) == want


def test_without_a_gpu_or_uncached_every_call_is_a_jit_call(monkeypatch):
    jit, ln, _, _ = _launch(monkeypatch, cuda=False)
    req, topk = torch.arange(3), torch.zeros(3, 16, dtype=torch.int64)
    for _ in range(3):
        ln.launch(req, topk)
    assert [e[0] for e in jit.log] == ["jit"] * 3 and ln.specializations == 0
