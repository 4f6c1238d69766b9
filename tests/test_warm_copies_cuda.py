"""The copy kernels' warm-up on a GPU (``dispatch.warm_up_copies``, ``controllers/warm_copies``).

* In process: after the warm-up for the DSV4-Flash pools' shapes (dense device pools, pinned
  host pools), row and token copies of any length in both directions compile no variant
  (``dispatch.kernel_variants`` unchanged), the warm-up itself changed no byte of the pools,
  and every copy is byte-exact against the naive oracle.
* Through a daemon: a fresh ``hicache serve`` reports its variants in ``stats``
  (``kernel_variants``) right after ``register``; backups and loads of 1 to 33 pages, by row
  and by token, leave that count unchanged (without the warm-up each new pool and direction
  compiled on its first copy: 0.1-0.8 s with Triton's cache empty, the daemon's loop held).
* A warm-up that fails at ``register`` (``tests/fault_daemon.py``'s ``warm_fails_at_register``)
  is refused as an internal error and registers nothing; the daemon serves on.

Skipped without CUDA.
"""
from __future__ import annotations

import os
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from test_kernels_ref import assert_same, expected_rows, expected_tokens, layers  # noqa: E402

from hicache.core.layout import build_layout, preset  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402
from hicache.kernels import dispatch  # noqa: E402
from hicache.kernels.tables import LayerTable, TokenFormat  # noqa: E402

FLASH = build_layout(preset("dsv4-flash"))
DEV = torch.device("cuda:0")
ROWS = 80  # rows per test pool (room for 2 x the longest copy) (token ids: ROWS * tokens_per_page)
LENGTHS = (1, 2, 3, 5, 16, 17, 33)


def _pools() -> list[tuple[str, list, list, TokenFormat | None]]:
    """(name, device layers, pinned host layers, token format) of each DSV4-Flash pool shape,
    two layers each (the layer count is a run-time argument)."""
    out = []
    for i, (name, spec) in enumerate(FLASH.pools.items()):
        dev = layers(2, ROWS, spec.page_bytes, 10 + i, device=DEV)
        host = layers(2, ROWS, spec.page_bytes, 50 + i, pin=True)
        out.append((name, dev, host, TokenFormat.from_spec(spec) if spec.token_granular
                    else None))
    return out


def _ids(n: int, units: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    perm = torch.randperm(units, generator=g)
    return perm[:n].clone(), perm[n:2 * n].flip(0).clone()


def test_no_copy_compiles_after_the_warm_up():
    torch.cuda.set_device(DEV)
    pools = _pools()
    pairs = []
    for _, dev, host, fmt in pools:
        d, h = LayerTable(dev), LayerTable(host)
        pairs += [(d, h, fmt), (h, d, fmt)]
    before = {name: ([t.clone() for t in dev], [t.clone() for t in host])
              for name, dev, host, _ in pools}
    assert dispatch.warm_up_copies(pairs, DEV) >= len(pairs)
    for name, dev, host, _ in pools:  # the warm-up ran on scratch buffers only
        assert_same(dev, [t.cpu() for t in before[name][0]], f"{name} device after warm-up")
        assert_same(host, before[name][1], f"{name} host after warm-up")
    held = dispatch.kernel_variants()
    assert held["rows"] > 0 and held["tokens"] > 0, held
    for k, n in enumerate(LENGTHS):
        for name, dev, host, fmt in pools:
            for src, dst in ((dev, host), (host, dev)):
                s, d = _ids(n, ROWS, k)
                want = expected_rows(src, dst, s, d)
                dispatch.copy_rows(src, dst, s, d)
                torch.cuda.synchronize()
                assert_same(dst, want, f"{name} rows n={n}")
                if fmt is None:
                    continue
                s, d = _ids(n, ROWS * fmt.tokens_per_page, 100 + k)
                want = expected_tokens(src, dst, s, d, fmt)
                dispatch.copy_tokens(src, dst, s, d, fmt)
                torch.cuda.synchronize()
                assert_same(dst, want, f"{name} tokens n={n}")
    assert dispatch.kernel_variants() == held, "a copy compiled a variant after the warm-up"


def test_a_fresh_daemons_first_copies_compile_nothing(tmp_path):
    from conftest import start_daemon

    rows = {"page": 80, "swa_page": 80, "req_slot": 8}
    d = start_daemon(tmp_path, device="cuda:0", metrics=False, ready_timeout=180,
                     device_rows=",".join(f"{k}={v}" for k, v in rows.items()),
                     host=("--host-ratio", "2"))
    torch.cuda.set_device(DEV)
    pools = DevicePools(FLASH, rows, device=DEV)
    try:
        g = torch.Generator(device=DEV).manual_seed(3)
        for ts in pools.layers.values():
            for t in ts:
                t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEV,
                                      generator=g))
        c = d.client(timeout=120)
        c.register(pools)
        held = c.stats()["kernel_variants"]
        assert held["rows"] > 0 and held["tokens"] > 0 and held["segments"] > 0, held
        token_pools = [n for n, sp in FLASH.pools.items() if sp.index == "page"
                       and sp.token_granular]
        for k, n in enumerate(LENGTHS):
            perm = torch.randperm(rows["page"], generator=torch.Generator().manual_seed(k))
            src = {sp: perm[:n].tolist() for sp in ("page", "swa_page")}
            dst = {sp: perm[n:2 * n].tolist() for sp in ("page", "swa_page")}
            torch.cuda.synchronize()
            op = c.backup_new(src)
            assert c.wait_ack(op, timeout=120).ok
            lop = c.load({sp: (op.rows[sp], dst[sp]) for sp in op.rows})
            assert c.wait_ack(lop, timeout=120).ok
            torch.cuda.synchronize()
            for name, spec in FLASH.pools.items():
                if spec.index not in src:
                    continue
                s = torch.tensor(src[spec.index], device=DEV)
                t = torch.tensor(dst[spec.index], device=DEV)
                for layer in pools.layers[name]:
                    assert torch.equal(layer[s], layer[t]), f"{name}: {n} pages differ"
            # one token of each token pool, out and back (the token kernel, both ways)
            host = c.alloc({"page": 1})["page"][0]
            hp, sp_, dp = int(op.rows["page"][0]), int(src["page"][0]), int(dst["page"][0])
            tpp = {p: FLASH.pools[p].tokens_per_page for p in token_pools}
            out = {p: ([sp_ * P + P - 1], [host * P], "token") for p, P in tpp.items()}
            assert c.wait_ack(c.backup(out), timeout=120).ok
            back = {p: ([hp * P], [dp * P + P - 1], "token") for p, P in tpp.items()}
            assert c.wait_ack(c.load(back), timeout=120).ok
            c.free({"page": [host]})
            c.free(op.rows)
        assert c.stats()["kernel_variants"] == held, \
            "a copy compiled a kernel variant after register"
        c.unregister()
        c.close()
    finally:
        d.stop()
        pools.close()


def test_a_failed_warm_up_at_register_registers_nothing_and_the_daemon_serves_on(tmp_path):
    """``register``'s warm-up raising (a compile error): one ``internal`` refusal naming it,
    no worker registered, the daemon still serving, the traceback in its log; a later
    ``register`` of the same client gets the same refusal, not ``already_registered``."""
    from conftest import start_daemon

    from hicache.engine.acks import CommandRefused

    rows = {"page": 16, "swa_page": 16, "req_slot": 8}
    d = start_daemon(tmp_path, device="cuda:0", metrics=False, ready_timeout=180,
                     device_rows=",".join(f"{k}={v}" for k, v in rows.items()),
                     fault="warm_fails_at_register")
    torch.cuda.set_device(DEV)
    pools = DevicePools(FLASH, rows, device=DEV)
    try:
        c = d.client(timeout=60)
        for _ in range(2):
            with pytest.raises(CommandRefused) as e:
                c.register(pools)
            assert e.value.code == "internal", e.value
            assert "failed to compile" in str(e.value), e.value
            st = c.stats()
            assert st["workers"] == 0, st
        with pytest.raises(CommandRefused) as e:  # no worker: a copy is refused, not run
            c.backup_new({"page": [0]})
        assert e.value.code != "internal", e.value
        assert c.heartbeat() is not None
        c.close()
        log = d.log_path.read_text(errors="replace")
        assert "injected: the copy kernels failed to compile" in log
    finally:
        d.stop()
        pools.close()


def test_upload_tables_makes_the_gpu_tables_with_one_wait():
    """``upload_tables`` on the GPU: device and pinned host tables' pointer tables made on the
    device, each holding its layers' addresses; ``table()`` then makes nothing."""
    from hicache.kernels.tables import upload_tables

    dev = LayerTable(layers(3, 4, 64, 1, device=DEV), "dev")
    host = LayerTable(layers(2, 4, 64, 2, pin=True), "host")
    assert upload_tables([dev, host, dev], DEV) == 2
    assert upload_tables([dev, host], DEV) == 0
    for t in (dev, host):
        made = t.table(DEV)
        assert made.device == DEV and made.cpu().tolist() == t.ptrs, t


def test_warm_pools_makes_the_pointer_tables_a_copy_reads():
    """``warm_pools`` at start makes every host pool's pointer table on the daemon's GPU (keyed
    by the device with its index, though the daemon names it ``cuda``), and at ``register`` the
    worker's pools' tables: a copy after it uploads no table (no wait for the GPU at a copy)."""
    from types import SimpleNamespace

    from hicache.controllers.warm_copies import warm_pools
    from hicache.kernels.tables import upload_tables

    torch.cuda.set_device(DEV)
    pools = _pools()
    host = {name: LayerTable(h, f"host:{name}") for name, _, h, _ in pools}
    dev = {name: LayerTable(d, f"device:{name}") for name, d, _, _ in pools}
    st = SimpleNamespace(device="cuda", layout=FLASH, host_tables=host, scheduler=SimpleNamespace(
        streams={"backup": torch.cuda.Stream(DEV), "load": torch.cuda.Stream(DEV)}))
    assert all(DEV not in t._tables for t in (*host.values(), *dev.values()))
    launches, _ = warm_pools(st)
    assert launches >= len(pools)
    assert upload_tables(host.values(), DEV) == 0
    assert all(DEV not in t._tables for t in dev.values())  # not the worker's yet
    warm_pools(st, dev)
    assert upload_tables([*host.values(), *dev.values()], DEV) == 0
    for t in (*host.values(), *dev.values()):
        assert t.table(DEV).cpu().tolist() == t.ptrs, t


_FIRST_SORT = r"""
import sys, time, types, torch
from hicache.kernels import dispatch
from hicache.kernels.tables import LayerTable, TokenFormat
dev = torch.device("cuda:0")
torch.cuda.set_device(dev)
torch.zeros(1, device=dev).add_(1)
torch.cuda.synchronize()
if sys.argv[1] == "warm":
    fmt = TokenFormat(4, 512, 8, 2048, 2080)
    d = LayerTable([torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=dev)])
    h = LayerTable([torch.zeros(2, fmt.page_bytes, dtype=torch.uint8).pin_memory()])
    dispatch.warm_up_copies([(d, h, fmt)], dev, torch.cuda.current_stream())
ids = torch.randperm(2 * dispatch.SORT_MIN_TOKENS, device=dev)
torch.cuda.synchronize()
side = (types.SimpleNamespace(is_cuda=True), types.SimpleNamespace(is_cuda=False))
t0 = time.perf_counter()
dispatch._host_order(ids, ids.clone(), *side)
torch.cuda.synchronize()
print(time.perf_counter() - t0)
"""


def test_the_warm_up_takes_the_host_order_sorts_first_use():
    """A fresh process's first host-order sort of a long token copy (``_host_order``) costs its
    kernels' loading; after ``warm_up_copies`` with a device-host token pair it does not."""
    import subprocess

    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in (root, os.environ.get(
        "PYTHONPATH")) if p))

    def first(mode: str) -> float:
        out = subprocess.run([sys.executable, "-c", _FIRST_SORT, mode], env=env, check=True,
                             capture_output=True, text=True, timeout=120).stdout
        return float(out.strip().splitlines()[-1])

    cold, warm = first("cold"), first("warm")
    print(f"first host-order sort: cold {cold * 1e3:.2f} ms, after the warm-up "
          f"{warm * 1e3:.2f} ms")
    assert warm < cold / 4, (cold, warm)


def test_the_host_order_sort_is_warmed_once_per_device(monkeypatch):
    """``warm_up_copies`` sorts once per device and process, whether the device is named with
    its index or not (the daemon warms twice at start and twice at each ``register``), and
    warms every kernel variant again each time."""
    sorts: list[int] = []
    real = dispatch._host_order

    def counted(s, d, src, dst):
        sorts.append(s.numel())
        return real(s, d, src, dst)

    monkeypatch.setattr(dispatch, "_host_order", counted)
    monkeypatch.setattr(dispatch, "_SORT_WARMED", set())
    torch.cuda.set_device(DEV)
    fmt = TokenFormat(4, 512, 8, 2048, 2080)
    d = LayerTable([torch.zeros(2, fmt.page_bytes, dtype=torch.uint8, device=DEV)])
    h = LayerTable([torch.zeros(2, fmt.page_bytes, dtype=torch.uint8).pin_memory()])
    launches = [dispatch.warm_up_copies([(d, h, fmt), (h, d, fmt)], dev)
                for dev in (torch.device("cuda"), DEV, torch.device("cuda"))]
    assert sorts == [dispatch.SORT_MIN_TOKENS], sorts
    assert dispatch._SORT_WARMED == {DEV}, dispatch._SORT_WARMED
    assert launches == [4, 4, 4], launches
