"""GPU end-to-end: this test process is the engine. It owns real CUDA pools of the DSV4-Flash
layout and shares them with a ``hicache serve --device cuda:0`` subprocess through CUDA IPC.

* backup waits on the engine's interprocess event: the engine writes the KV on its own stream
  behind a long GPU sleep, records the event and sends the backup at once; the host copy must
  hold the new bytes.
* the engine's client talks through a shared-memory channel (a GPU daemon busy-polls, so it
  grants one): every command here, and the replies the per-layer waits follow, go through it.
* load is consumed layer by layer: for each stage layer the engine's stream waits on that
  layer's interprocess event and then copies the layer's destination rows into a scratch
  buffer; every scratch byte must equal what was backed up (a read before the event would see
  the zeros the rows held before the load).

Skipped without CUDA. The daemon is a separate interpreter (subprocess, not fork).
"""
from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.cuda
if not torch.cuda.is_available():
    pytest.skip("needs a CUDA GPU", allow_module_level=True)

from hicache.bench.daemon_times import daemon_times  # noqa: E402
from hicache.engine.device_pools import DevicePools  # noqa: E402
from hicache.kernels.reference import copy_tokens_ref  # noqa: E402
from hicache.kernels.tables import TokenFormat  # noqa: E402
from hicache.core.layout import build_layout, preset  # noqa: E402

ROWS = {"page": 64, "swa_page": 16, "req_slot": 8}
ROWS_ARG = "page=64,swa_page=16,req_slot=8"
FLASH = build_layout(preset("dsv4-flash"))
DEV = torch.device("cuda:0")


@pytest.fixture(scope="module")
def gpu(tmp_path_factory):
    from conftest import load_fill_kernel, start_daemon

    d = start_daemon(tmp_path_factory.mktemp("gpu"), device="cuda:0", device_rows=ROWS_ARG,
                     host=("--host-ratio", "2"), metrics=False, ready_timeout=120)
    torch.cuda.set_device(DEV)
    pools = DevicePools(FLASH, ROWS, device=DEV)
    g = torch.Generator(device=DEV).manual_seed(0)
    for layers in pools.layers.values():
        for t in layers:
            t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=DEV, generator=g))
    load_fill_kernel(DEV)  # (each test's engine stream fills rows after a long sleep)
    c = d.client(timeout=60)
    c.register(pools, events=2)
    yield d, c, pools
    c.close()
    d.stop()
    pools.close()


def test_a_load_waits_for_the_engines_event(gpu):
    """``load(wait_event=k)``: the daemon's copy starts only after the engine's event, as
    SGLang's load fence needs (rows freed under overlap scheduling may still be written by the
    previous forward). The engine's stream writes the destination rows behind a long GPU sleep
    and then records the event: the load's bytes are what stays. (Without the wait the order
    across the two processes is up to the GPU's time slicing, so it is not asserted here; the
    scheduler's wait on ``op.wait_event`` is the one the backup test above proves.) An event
    index the worker did not register is refused."""
    from hicache.engine.client import CommandRefused

    d, c, pools = gpu
    engine = torch.cuda.Stream(DEV)
    moved = [n for n, sp in FLASH.pools.items() if sp.index == "page"]
    src, dst = [0, 1, 2, 3], [40, 41, 42, 43]
    host = c.alloc({"page": 4})["page"]
    torch.cuda.synchronize()
    assert c.wait_ack(c.backup({"page": (src, host)}), timeout=120).ok
    idx = torch.tensor(dst, device=DEV)
    want = {n: [t[torch.tensor(src, device=DEV)].clone() for t in pools.layers[n]] for n in moved}
    with pytest.raises(CommandRefused, match="wait_event 9: the worker registered 2 events"):
        c.load({"page": (host, dst)}, wait_event=9)
    with torch.cuda.stream(engine):
        torch.cuda._sleep(400_000_000)  # ~0.2 s of GPU time
        for n in moved:
            for t in pools.layers[n]:
                t.index_fill_(0, idx, 0xEE)
        c.backup_events[1].record(engine)
    assert not engine.query(), "the engine's writes ended before the load: no wait tested"
    assert c.wait_ack(c.load({"page": (host, dst)}, wait_event=1), timeout=120).ok
    torch.cuda.synchronize()
    for n in moved:
        for li, t in enumerate(pools.layers[n]):
            assert torch.equal(t[idx], want[n][li]), (n, li)
    c.free({"page": host})


def test_backup_waits_for_engine_event_and_load_is_per_layer(gpu):
    d, c, pools = gpu
    assert c.uses_channel and c.stats()["channels"] == 1, c.channel_refused
    engine = torch.cuda.Stream(DEV)
    host = c.alloc({"page": 32, "swa_page": 8})
    src = {"page": list(range(0, 64, 2)), "swa_page": list(range(0, 16, 2))}
    dst = {"page": list(range(1, 64, 2)), "swa_page": list(range(1, 16, 2))}
    moved = {n: s for n, s in FLASH.pools.items() if s.index in src}
    # (ids made before the sleep: a pageable copy to the device syncs its stream first, which
    # would end the sleep before the event is recorded and leave its wait unproven)
    idx_of = {s: torch.tensor(ids, device=DEV) for s, ids in src.items()}
    torch.cuda.synchronize()
    # 1) the engine writes new KV behind a long GPU sleep, records its event, backs up at once
    with torch.cuda.stream(engine):
        torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU time
        for name, spec in moved.items():
            idx = idx_of[spec.index]
            for li, t in enumerate(pools.layers[name]):
                t.index_fill_(0, idx, (li * 7 + len(name)) % 251 + 1)
        c.backup_events[0].record(engine)
    assert not engine.query(), "the engine's writes ended before the backup: no wait tested"
    op = c.backup({"page": (src["page"], host["page"]),
                   "swa_page": (src["swa_page"], host["swa_page"])}, wait_event=0)
    assert c.wait_ack(op, timeout=120).ok
    engine.synchronize()
    expect = {name: [t[torch.tensor(src[spec.index], device=DEV)].clone()
                     for t in pools.layers[name]] for name, spec in moved.items()}
    # 2) destination rows hold zeros; load them back; read each layer after its event only.
    #    Odd rows (scattered) and a block of consecutive rows: one launch per stage layer.
    block = {"page": list(range(32, 64)), "swa_page": list(range(8, 16))}
    issues = daemon_times(c.stats()["metrics"])["load_issue"][0]
    for dst in (dst, block):
        for name, spec in moved.items():
            for t in pools.layers[name]:
                t[torch.tensor(dst[spec.index], device=DEV)] = 0
        torch.cuda.synchronize()
        op = c.load({"page": (host["page"], dst["page"]),
                     "swa_page": (host["swa_page"], dst["swa_page"])})
        assert op.event_set is not None
        assert op.issued == 1  # the reply left once layer 0's copy was enqueued
        scratch = {}
        with torch.cuda.stream(engine):
            for layer in c.stage_layers:
                c.wait_layer(op, layer, engine)
                for name, spec in moved.items():
                    if layer in spec.layers:
                        li = spec.layers.index(layer)
                        idx = torch.tensor(dst[spec.index], device=DEV)
                        scratch[(name, li)] = pools.layers[name][li].index_select(0, idx)
        engine.synchronize()
        assert op.issued is None  # the "issued" notice (or the ack) came before later waits
        ack = c.wait_ack(op, timeout=120)
        assert ack.ok and ack.path == "by_layer"
        # the issue of the later layers after the reply is timed, once per load
        issues, before = daemon_times(c.stats()["metrics"])["load_issue"][0], issues
        assert issues == before + 1
        for name, spec in moved.items():
            for li in range(spec.num_layers):
                assert torch.equal(scratch[(name, li)], expect[name][li]), (name, li)
    c.free(host)


def test_token_granular_and_request_swap_on_gpu(gpu):
    d, c, pools = gpu
    spec = FLASH.pool("c4_kv")
    fmt = TokenFormat.from_spec(spec)
    P = spec.tokens_per_page
    pages = c.alloc({"page": 2})["page"]
    dev_tok = torch.tensor([5, 70, 133, 200, 255], dtype=torch.int64)
    host_tok = torch.tensor([pages[0] * P + 1, pages[0] * P + 9, pages[1] * P,
                             pages[1] * P + 33, pages[1] * P + 63], dtype=torch.int64)
    back = torch.tensor([300, 301, 17, 64, 511], dtype=torch.int64)
    torch.cuda.synchronize()
    before = [t.clone() for t in pools.layers["c4_kv"]]
    c.wait_ack(c.backup({"c4_kv": (dev_tok, host_tok, "token")}), timeout=60)
    op = c.load({"c4_kv": (host_tok, back, "token")})
    c.wait_ack(op, timeout=60)
    torch.cuda.synchronize()
    cpu_expect = [t.cpu().clone() for t in before]
    copy_tokens_ref([t.cpu() for t in before], cpu_expect, dev_tok, back, fmt)
    for t, e in zip(pools.layers["c4_kv"], cpu_expect):
        assert torch.equal(t.cpu(), e)
    c.free({"page": pages})
    # request state: swap slot 2 out, clear it, swap it into slot 5
    state = [p.name for p in FLASH.space_pools("req_slot")]
    old = {n: [t[2].clone() for t in pools.layers[n]] for n in state}
    out = c.swap_out(2, request="r")
    c.wait_ack(out, timeout=60)
    c.wait_ack(c.clear_slot([2]), timeout=60)
    torch.cuda.synchronize()
    assert all(not t[2].any() for n in state for t in pools.layers[n])
    c.wait_ack(c.swap_in(out.host_row, 5, request="r"), timeout=60)
    torch.cuda.synchronize()
    for n in state:
        for t, o in zip(pools.layers[n], old[n]):
            assert torch.equal(t[5], o)


def test_a_handle_claiming_more_than_its_allocation_is_refused(gpu):
    """The storage a CUDA IPC handle claims (its offset and size, both sent by the client) must
    lie inside the allocation the handle opens: a claim past its end, with a layer placed in
    the claimed part, would let copies reach memory that is not the worker's."""
    from hicache.engine.client import CommandRefused

    d, c, pools = gpu
    name = next(iter(FLASH.pools))  # the first handle the daemon opens
    real = pools.handles()[name][0]
    past = real["storage_bytes"] + (1 << 30)
    for change in ({"storage_bytes": past},
                   {"storage_bytes": past, "offset": past - real["rows"] * real["row_bytes"]},
                   {"storage_offset": real["storage_offset"] + (1 << 30)}):
        h = pools.handles()
        h[name][0] = dict(real, **change)
        with d.client(timeout=60) as o:
            with pytest.raises(CommandRefused) as e:
                o.register(layout=FLASH.to_dict(), device_rows=dict(pools.rows), buffers=h,
                           mode="cuda")
            assert e.value.code == "bad_handle" and "runs past" in e.value.message, e.value
            assert not o.heartbeat()["registered"]
    with d.client(timeout=60) as o:  # the real handles still register
        o.register(pools)
        o.unregister()


def test_descriptors_do_not_apply_to_cuda_pools(gpu):
    """CUDA pools go by their IPC handles: ``hand_in`` is refused on a GPU daemon, and so is a
    ``register`` naming an ``fd_token`` (an option that does not apply, not ignored)."""
    from hicache.engine.client import CommandRefused

    d, c, pools = gpu
    with d.client(timeout=60) as o:
        with pytest.raises(CommandRefused) as e:
            o.call("hand_in", {"count": 1})
        assert e.value.code == "unsupported" and "CUDA IPC" in e.value.message, e.value
        with pytest.raises(CommandRefused) as e:
            o.call("register", {"layout": FLASH.to_dict(), "device_rows": dict(pools.rows),
                                "buffers": pools.handles(), "mode": "cuda", "fd_token": 3})
        assert e.value.code == "bad_field" and "fd_token" in e.value.message, e.value
        assert not o.heartbeat()["registered"]


def test_expandable_segments_are_refused_clearly():
    code = ("import torch; from hicache.engine.device_pools import DevicePools; "
            "from hicache.core.layout import build_layout, preset; "
            "DevicePools(build_layout(preset('dsv4-tiny')), "
            "{'page': 2, 'swa_page': 2, 'req_slot': 2}, device='cuda:0')")
    env = dict(os.environ, PYTORCH_CUDA_ALLOC_CONF="expandable_segments:True")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env,
                       timeout=120, cwd=os.path.dirname(os.path.dirname(__file__)))
    assert r.returncode != 0 and "expandable_segments" in r.stderr


def _contexts() -> dict[int, set[str]] | None:
    """pid -> the UUIDs of the GPUs it holds a context on (nvidia-smi); None without it."""
    try:
        out = subprocess.run(["nvidia-smi", "--query-compute-apps=pid,gpu_uuid",
                              "--format=csv,noheader"], capture_output=True, text=True,
                             timeout=60).stdout
    except (OSError, subprocess.SubprocessError):
        return None
    seen: dict[int, set[str]] = {}
    for line in out.splitlines():
        pid, _, uuid = line.partition(",")
        if pid.strip().isdigit():
            seen.setdefault(int(pid), set()).add(uuid.strip().removeprefix("GPU-"))
    return seen


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_daemon_on_the_second_gpu_holds_no_context_on_the_first(tmp_path):
    """A daemon serving cuda:1 moves KV (a backup and a per-layer load, whose completions its
    worker threads wait for) and never binds a context on cuda:0, another engine's GPU."""
    from conftest import start_daemon

    dev = torch.device("cuda:1")
    tiny = build_layout(preset("dsv4-tiny"))
    rows = {"page": 8, "swa_page": 8, "req_slot": 2}
    d = start_daemon(tmp_path, device="cuda:1", preset="dsv4-tiny",
                     device_rows="page=8,swa_page=8,req_slot=2", metrics=False,
                     ready_timeout=120)
    with torch.cuda.device(dev):
        pools = DevicePools(tiny, rows, device=dev)
        try:
            for layers in pools.layers.values():
                for t in layers:
                    t.copy_(torch.randint(0, 256, t.shape, dtype=torch.uint8, device=dev))
            c = d.client(timeout=60)
            c.register(pools, events=1)
            op = c.backup_new({"page": [0, 1], "swa_page": [0, 1]})
            assert c.wait_ack(op, timeout=120).ok
            load = c.load({s: (op.rows[s], [2, 3]) for s in op.rows})
            assert c.wait_ack(load, timeout=120).ok
            seen = _contexts()
            mine = str(torch.cuda.get_device_properties(1).uuid)
            if not seen or mine not in seen.get(d.pid, set()):
                pytest.skip("nvidia-smi does not list this machine's processes")
            other = str(torch.cuda.get_device_properties(0).uuid)
            assert other not in seen[d.pid], "the cuda:1 daemon holds a context on cuda:0"
            c.unregister()
            c.close()
        finally:
            d.stop()
            pools.close()


_EXPORTER = """
import json, sys, torch
from hicache.core.ipc import export_buffer
x = torch.zeros(1024, 4096, dtype=torch.uint8, device="cuda")
print(json.dumps(export_buffer(x)), flush=True)
sys.stdin.read()
"""


def test_a_client_naming_another_engines_counter_file_changes_nothing_in_it() -> None:
    """A GPU ``register`` handle whose ``ref_counter`` names another engine's torch counter
    file (a name of the right form, any process of the uid can list them): opening and closing
    the storage leaves every counter in that file as it was (torch decremented the named slot:
    the other engine's allocator could then reuse memory still mapped elsewhere)."""
    import base64
    import gc
    import json
    import types

    import numpy as np

    from hicache.controllers.device_buffers import _open_cuda

    def exporter() -> tuple[subprocess.Popen, dict]:
        p = subprocess.Popen([sys.executable, "-c", _EXPORTER], stdin=subprocess.PIPE,
                             stdout=subprocess.PIPE, text=True,
                             env=dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path)))
        return p, json.loads(p.stdout.readline())

    victim, hv = exporter()
    attacker, ha = exporter()
    try:
        name = base64.b64decode(hv["ref_counter"]).decode()
        path = "/dev/shm" + name
        before = np.fromfile(path, dtype=np.int64)
        h = dict(ha, ref_counter=hv["ref_counter"], ref_counter_offset=hv["ref_counter_offset"])
        bufs = _open_cuda(types.SimpleNamespace(pools={"p": 0}), {"p": [h]}, DEV)
        assert bufs.layers["p"][0].shape == (1024, 4096)  # the attacker's own memory opened
        bufs.close()
        del bufs
        gc.collect()
        torch.cuda.synchronize()
        after = np.fromfile(path, dtype=np.int64)
        assert np.array_equal(before, after), [(int(i), int(before[i]), int(after[i]))
                                               for i in np.flatnonzero(before != after)]
    finally:
        for p in (victim, attacker):
            p.stdin.close()
            p.wait(timeout=60)
