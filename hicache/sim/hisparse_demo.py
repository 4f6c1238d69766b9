"""``hicache demo --hisparse``: long requests decode with their C4 KV in a host region and a
hot buffer per request and C4 layer on the device, every decode step swapping in the top-k ids
of a ``topk_trace``; every top-k location is checked against that token's bytes.

``run_hisparse(args) -> summary`` (small shapes; CPU through the torch reference, or the Triton
kernel under ``TRITON_INTERPRET=1``; a GPU runs the kernel). The host region plays the daemon's
part (it holds every C4 token; a new decode token lands there and, through ``newest_locs``, in
the device buffer, as the engine writes it). Requests get random C4 lengths, some shorter than
the buffer (the fast path), some crossing into sparse mode while they decode; one batch row is
CUDA-graph padding (``-1``). The summary has ``verified`` (every checked location held its
token's 576 + 8 bytes), lookups, tokens and bytes swapped in, and the hit rate.
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from typing import Any

from hicache.core.errors import UsageError
from hicache.core.layout import build_layout, preset

IMPLS = ("auto", "triton", "reference")


def _impl(args: argparse.Namespace) -> tuple[str, str]:
    """(device, impl); sets TRITON_INTERPRET for the kernel on CPU before triton loads."""
    import torch

    device = args.device
    if device == "auto":
        device = "cuda:0" if torch.cuda.is_available() else "cpu"
    elif device != "cpu" and not (device.startswith("cuda:") and device[5:].isdigit()):
        raise UsageError(f"--device must be auto, cpu or cuda:N, got {device!r}")
    elif device != "cpu" and int(device[5:]) >= torch.cuda.device_count():
        raise UsageError(f"--device {device}: this machine has {torch.cuda.device_count()} "
                         f"CUDA devices")
    impl = args.hisparse_impl
    if impl == "auto":
        impl = "triton" if device.startswith("cuda") else "reference"
    if impl == "triton" and device == "cpu":
        if "triton" in sys.modules and os.environ.get("TRITON_INTERPRET") != "1":
            raise UsageError("--hisparse-impl triton on CPU needs the Triton interpreter, and "
                             "triton is already loaded without it: set TRITON_INTERPRET=1")
        os.environ["TRITON_INTERPRET"] = "1"
    return device, impl


def _views(layer: Any, spec: Any) -> tuple[Any, Any]:
    """[rows, P, value words] and [rows, P, scale words] views of one layer's page rows, in
    8-byte words when every offset allows (torch indexes bytes one by one, words fast)."""
    import torch

    P, vb, sb, off = spec.tokens_per_page, spec.value_bytes, spec.scale_bytes, spec.scale_offset
    n, w = layer.shape[0], 1
    if all(x % 8 == 0 for x in (vb, sb, off, layer.shape[1], layer.stride(0))):
        layer, w = layer.view(torch.int64), 8
    return (layer[:, : P * vb // w].view(n, P, vb // w),
            layer[:, off // w: (off + P * sb) // w].view(n, P, sb // w))


class _Demo:
    def __init__(self, args: argparse.Namespace, device: str, impl: str) -> None:
        import torch

        from hicache.engine.hot_buffer import HotBuffer
        from hicache.sim.topk_trace import TopkTrace, TopkTraceConfig

        self.torch, self.args = torch, args
        model = preset(args.preset)
        self.spec = build_layout(model, 1, 0, swa_mode="ring", mtp=False).pool("c4_kv")
        self.L, self.P = self.spec.num_layers, self.spec.tokens_per_page
        self.K = min(model.index_topk, args.hisparse_topk)
        self.S = 2 * self.K
        self.R = args.requests or 6
        self.g = torch.Generator().manual_seed(args.seed)
        lens = torch.randint(5, 4 * self.S, (self.R,), generator=self.g).tolist()
        lens[0] = self.S - 2  # one request crosses from the fast path into sparse mode
        self.lens = {r: n for r, n in enumerate(lens)}
        self.max_tokens = max(lens) + args.hisparse_steps
        rows = sum(-(-(n + args.hisparse_steps) // self.P) for n in lens)
        host = [torch.randint(0, 256, (rows, self.spec.page_bytes), dtype=torch.uint8,
                              generator=self.g) for _ in range(self.L)]
        if device.startswith("cuda"):
            host = [t.pin_memory() for t in host]
        self.host = host
        self.free = list(range(rows))
        self.pages: dict[int, list[int]] = {}
        self.hb = HotBuffer(host, fmt=self.spec, topk=self.K, max_requests=self.R,
                            max_batch=self.R + 1, max_tokens=self.max_tokens, device=device,
                            impl=impl)
        cfg = TopkTraceConfig(topk=self.K, overlap=args.overlap, recent_window=self.S)
        self.traces = [[TopkTrace(cfg, seed=args.seed * 7919 + l * 101 + r)
                        for r in range(self.R)] for l in range(self.L)]
        self.checked = 0
        for r, n in self.lens.items():
            self.pages[r] = [self.free.pop() for _ in range(-(-n // self.P))]
            self.hb.admit(r, n, self.pages[r])

    def _grow(self, r: int) -> None:
        """Request ``r`` made a C4 token: the host region gets it (daemon), the device buffer
        at ``newest_locs`` too (engine)."""
        torch = self.torch
        n = self.lens[r] = self.lens[r] + 1
        if len(self.pages[r]) * self.P < n:
            self.pages[r].append(self.free.pop())
        self.hb.extend(r, n, self.pages[r])
        loc = int(self.hb.newest_locs(torch.tensor([r], device=self.hb.device))[0])
        h = self.pages[r][(n - 1) // self.P] * self.P + (n - 1) % self.P
        for hl, dl in zip(self.host, self.hb.dev.layers):
            hv, hs = _views(hl, self.spec)
            dv, ds = _views(dl, self.spec)
            dv[loc // self.P, loc % self.P] = hv[h // self.P, h % self.P].to(dl.device)
            ds[loc // self.P, loc % self.P] = hs[h // self.P, h % self.P].to(dl.device)

    def _check(self, layer: int, rows: list[int], topk: Any, out: Any) -> bool:
        torch = self.torch
        hv, hs = _views(self.host[layer], self.spec)
        dv, ds = _views(self.hb.dev.layers[layer].cpu(), self.spec)
        out = out.cpu()
        for b, r in enumerate(rows):
            if r < 0:
                if not bool((out[b] == -1).all()):
                    return False
                continue
            ids = topk[b]
            ok = (ids >= 0) & (ids < self.lens[r])
            if not torch.equal(out[b] < 0, ~ok):
                return False
            t, loc = ids[ok], out[b][ok]
            hp = torch.tensor(self.pages[r])[t // self.P] * self.P + t % self.P
            if not (torch.equal(hv[hp // self.P, hp % self.P], dv[loc // self.P, loc % self.P])
                    and torch.equal(hs[hp // self.P, hp % self.P],
                                    ds[loc // self.P, loc % self.P])):
                return False
            self.checked += int(ok.sum())
        return True

    def run(self) -> dict[str, Any]:
        torch = self.torch
        t0 = time.perf_counter()
        verified = True
        for step in range(self.args.hisparse_steps):
            rows = list(range(self.R))
            rows.insert(step % (self.R + 1), -1)  # a padding row, somewhere in the batch
            req = torch.tensor(rows, dtype=torch.int64, device=self.hb.device)
            for layer in range(self.L):
                topk = torch.stack([self.traces[layer][r].step(self.lens[r]) if r >= 0 else
                                    torch.full((self.K,), -1, dtype=torch.int64) for r in rows])
                out = self.hb.swap_in(layer, req, topk.to(self.hb.device))
                verified &= self._check(layer, rows, topk, out)
            for r in range(self.R):
                if (step + r) % 4 == 3:  # one C4 token per 4 decode tokens
                    self._grow(r)
        hits = self.hb.hits()
        looked, copied = sum(h[0] for h in hits), sum(h[1] for h in hits)
        tb = self.spec.value_bytes + self.spec.scale_bytes
        return {
            "mode": "hisparse", "preset": self.args.preset, "device": str(self.hb.device),
            "impl": self.hb.impl, "requests": self.R, "steps": self.args.hisparse_steps,
            "c4_layers": self.L, "topk": self.K, "hot_slots": self.S, "overlap": self.args.overlap,
            "lookups": looked, "tokens_swapped_in": copied, "bytes_swapped_in": copied * tb,
            "hit_rate": round(1 - copied / max(1, looked), 4),
            "sparse_requests_at_end": sum(1 for n in self.lens.values() if n > self.S),
            "checked_locations": self.checked, "verified": bool(verified and self.checked > 0),
            "seconds": round(time.perf_counter() - t0, 2),
        }


def run_hisparse(args: argparse.Namespace) -> dict[str, Any]:
    """The ``--hisparse`` demo (see the module docstring); raises ``UsageError`` on bad input."""
    if args.hisparse_steps <= 0:
        raise UsageError("--hisparse-steps must be positive")
    if args.hisparse_topk < 2:  # its first request starts at 2 x top-k - 2 tokens
        raise UsageError(f"--hisparse-topk must be at least 2, got {args.hisparse_topk}")
    if not 0.0 <= args.overlap <= 1.0:
        raise UsageError(f"--overlap must be in [0, 1], got {args.overlap}")
    if args.requests is not None and args.requests <= 0:
        raise UsageError(f"--requests must be positive, got {args.requests}")
    device, impl = _impl(args)
    return _Demo(args, device, impl).run()


def human(s: dict[str, Any]) -> str:
    return (f"hisparse demo ({s['preset']}, {s['c4_layers']} C4 layers, top-k {s['topk']}, "
            f"{s['hot_slots']} + 1 slots, {s['impl']} on {s['device']}): {s['requests']} "
            f"requests x {s['steps']} steps, {s['lookups']:,} lookups, "
            f"{s['tokens_swapped_in']:,} tokens ({s['bytes_swapped_in']:,} B) swapped in, hit "
            f"rate {s['hit_rate']:.3f}, {s['checked_locations']:,} locations checked: "
            f"{'verified' if s['verified'] else 'MISMATCH'} ({s['seconds']} s)")
