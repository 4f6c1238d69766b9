"""How late an engine's CUDA stream sees a layer that another process (the daemon) copied.

A measurement, not part of the product (GPU only): ``python scripts/cross_process_wait.py``.
Process A (the daemon's stand-in) copies ``--layers`` chunks of ``--mib`` MiB host to device on
its stream and, after each, signals "layer ready" one of three ways; process B (the engine's
stand-in) waits for each layer on its own stream and then stamps the GPU's global timer
(``%globaltimer``: one clock for every context of the GPU). A stamps the same clock once before
its copies and times each copy's end with a CUDA event from there (a kernel of A's between the
copies would make B's stamps wait for A's time slice). Per mode, the lateness of each layer is
B's stamp minus A's copy end, and the span is B's last stamp minus A's start. Modes:

- ``event``: A records an interprocess event per layer; once all are recorded B's host is told
  and B's stream waits on each (``cudaStreamWaitEvent``): B's thread does not block.
- ``poll``: as ``event``, but B's host polls each event and launches its stamp once the event is
  done (what ``Client.wait_layer`` does today): B's thread blocks until the last layer.
- ``value_host`` / ``value_dev``: A writes a 32-bit counter after each layer with
  ``cuStreamWriteValue32`` (a fence before the write), into a page of shared pinned host memory
  or into device memory shared by CUDA IPC; B's stream waits with ``cuStreamWaitValue32`` (GEQ)
  for every layer, all enqueued before A starts: B's thread does not block and needs no word
  from A.

Each mode runs with B's GPU idle, then busy with ``--busy-iters`` matmuls on another stream
meanwhile (an engine's forward). Prints one JSON line per (mode, busy) with the median over
trials. The shared page (in /dev/shm) is removed and B stopped on the way out, whatever happens.
"""
from __future__ import annotations

import argparse
import ctypes
import json
import mmap
import os
import statistics
import sys
import tempfile
import time
from typing import Any

import torch
import torch.multiprocessing as mp
import triton
import triton.language as tl

MODES = ("event", "poll", "value_host", "value_dev")


@triton.jit
def _stamp_kernel(out_ptr, idx):
    dummy = tl.full([1], 0, tl.int32)
    t = tl.inline_asm_elementwise("mov.u64 $0, %globaltimer;", "=l,r", [dummy],
                                  dtype=tl.int64, is_pure=False, pack=1)
    tl.store(out_ptr + idx + tl.arange(0, 1), t)


def stamp(out: torch.Tensor, idx: int) -> None:
    _stamp_kernel[(1,)](out, idx)


class Driver:
    def __init__(self) -> None:
        lib = ctypes.CDLL("libcuda.so.1")
        vp, u64, u32 = ctypes.c_void_p, ctypes.c_uint64, ctypes.c_uint32
        self.wait = lib.cuStreamWaitValue32_v2
        self.wait.argtypes = [vp, u64, u32, ctypes.c_uint]
        self.write = lib.cuStreamWriteValue32_v2
        self.write.argtypes = [vp, u64, u32, ctypes.c_uint]
        self.reg = lib.cuMemHostRegister_v2
        self.reg.argtypes = [vp, ctypes.c_size_t, ctypes.c_uint]
        self.devptr = lib.cuMemHostGetDevicePointer_v2
        self.devptr.argtypes = [ctypes.POINTER(u64), vp, ctypes.c_uint]
        for f in (self.wait, self.write, self.reg, self.devptr):
            f.restype = ctypes.c_int

    def check(self, rc: int, what: str) -> None:
        if rc != 0:
            raise RuntimeError(f"{what}: CUresult {rc}")


def host_flags(path: str, drv: Driver) -> tuple[mmap.mmap, int]:
    """The shared page, mapped and registered in this process: (map, device address)."""
    fd = os.open(path, os.O_RDWR)
    m = mmap.mmap(fd, 4096)
    os.close(fd)
    addr = ctypes.addressof(ctypes.c_char.from_buffer(m))
    drv.check(drv.reg(addr, 4096, 3), "cuMemHostRegister")  # PORTABLE | DEVICEMAP
    d = ctypes.c_uint64(0)
    drv.check(drv.devptr(ctypes.byref(d), addr, 0), "cuMemHostGetDevicePointer")
    return m, d.value


def engine(q_in: Any, q_out: Any, args: Any) -> None:
    torch.cuda.set_device(0)
    drv = Driver()
    handles, flag_path, dev_flags = q_in.get()
    events = [torch.cuda.Event.from_ipc_handle(torch.device("cuda", 0), h) for h in handles]
    _m, hflag = host_flags(flag_path, drv)
    dflag = dev_flags.data_ptr()
    L = args.layers
    stamps = torch.zeros(L + 8, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    busy_stream = torch.cuda.Stream()
    a = torch.randn(4096, 4096, device="cuda", dtype=torch.bfloat16)
    stamp(stamps, 0)
    torch.cuda.synchronize()
    q_out.put("up")
    while True:
        msg = q_in.get()
        if msg is None:
            return
        mode, busy, gen = msg
        if busy:  # a forward's worth of matmuls queued on another stream (~busy ms)
            with torch.cuda.stream(busy_stream):
                for _ in range(args.busy_iters):
                    a = (a @ a).clamp_(-1, 1)
        t_host = 0.0
        if mode.startswith("value"):
            ptr = hflag if mode == "value_host" else dflag
            t0 = time.perf_counter()
            for i in range(L):
                drv.check(drv.wait(stream.cuda_stream, ptr, gen * 64 + i + 1, 0),
                          "cuStreamWaitValue32")
                with torch.cuda.stream(stream):
                    stamp(stamps, i)
            t_host = time.perf_counter() - t0
            q_out.put("armed")
            q_in.get()  # A finished issuing
        else:
            q_out.put("armed")
            q_in.get()  # A recorded every event
            t0 = time.perf_counter()
            for i in range(L):
                if mode == "event":
                    stream.wait_event(events[i])
                else:
                    while not events[i].query():
                        pass
                with torch.cuda.stream(stream):
                    stamp(stamps, i)
            t_host = time.perf_counter() - t0
        stream.synchronize()
        busy_stream.synchronize()
        q_out.put((stamps[:L].cpu().tolist(), t_host))


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--layers", type=int, default=24)
    p.add_argument("--mib", type=float, default=8.0)
    p.add_argument("--trials", type=int, default=7)
    p.add_argument("--busy-iters", type=int, default=40)
    p.add_argument("--modes", default=",".join(MODES))
    args = p.parse_args()
    torch.cuda.set_device(0)
    drv = Driver()
    L, n = args.layers, int(args.mib * 2**20)
    src = torch.empty(L * n, dtype=torch.uint8, pin_memory=True)
    src.fill_(7)
    dst = torch.empty(L * n, dtype=torch.uint8, device="cuda")
    events = [torch.cuda.Event(interprocess=True, enable_timing=False) for _ in range(L)]
    fd, flag_path = tempfile.mkstemp(prefix="hc-flag-", dir="/dev/shm")
    try:
        os.ftruncate(fd, 4096)
        os.close(fd)
        return _measure(args, drv, src, dst, events, flag_path, n)
    finally:
        os.unlink(flag_path)


def _measure(args: Any, drv: Driver, src: torch.Tensor, dst: torch.Tensor, events: list,
             flag_path: str, n: int) -> int:
    L = args.layers
    _m, hflag = host_flags(flag_path, drv)
    dev_flags = torch.zeros(64, dtype=torch.int32, device="cuda")
    stamps = torch.zeros(L + 8, dtype=torch.int64, device="cuda")
    stream = torch.cuda.Stream()
    t0 = torch.cuda.Event(enable_timing=True)
    done = [torch.cuda.Event(enable_timing=True) for _ in range(L)]
    for e in events:
        e.record(stream)
    stream.synchronize()
    ctx = mp.get_context("spawn")
    q_in, q_out = ctx.Queue(), ctx.Queue()
    proc = ctx.Process(target=engine, args=(q_in, q_out, args))
    proc.start()
    try:
        q_in.put(([e.ipc_handle() for e in events], flag_path, dev_flags))
        assert q_out.get(timeout=120) == "up"
        stamp(stamps, L)
        torch.cuda.synchronize()
        gen = 0
        for busy in (False, True):
            for mode in args.modes.split(","):
                lates, spans, solo, hosts = [], [], [], []
                for t in range(args.trials + 1):
                    gen += 1
                    q_in.put((mode, busy, gen))
                    assert q_out.get(timeout=60) == "armed"
                    with torch.cuda.stream(stream):
                        stamp(stamps, L)  # start: the global clock, then a timing event
                        t0.record(stream)
                        for i in range(L):
                            dst[i * n:(i + 1) * n].copy_(src[i * n:(i + 1) * n], non_blocking=True)
                            if mode.startswith("value"):
                                ptr = hflag if mode == "value_host" else dev_flags.data_ptr()
                                drv.check(drv.write(stream.cuda_stream, ptr, gen * 64 + i + 1, 0),
                                          "cuStreamWriteValue32")
                            else:
                                events[i].record(stream)
                            done[i].record(stream)  # no kernel of A between the copies
                    q_in.put("go")
                    b, t_host = q_out.get(timeout=60)
                    stream.synchronize()
                    start = stamps[L].item()
                    a = [start + t0.elapsed_time(done[i]) * 1e6 for i in range(L)] + [start]
                    if t == 0:
                        continue  # warm-up
                    lates.append(statistics.median(b[i] - a[i] for i in range(L)) / 1e3)
                    spans.append((b[L - 1] - a[L]) / 1e3)
                    solo.append((a[L - 1] - a[L]) / 1e3)
                    hosts.append(t_host * 1e3)
                row = {"mode": mode, "busy": busy, "layers": L, "mib": args.mib,
                       "late_us_median": round(statistics.median(lates), 1),
                       "late_us_max": round(max(lates), 1),
                       "span_ms": round(statistics.median(spans) / 1e3, 3),
                       "copies_ms": round(statistics.median(solo) / 1e3, 3),
                       "engine_host_ms": round(statistics.median(hosts), 3)}
                print(json.dumps(row), flush=True)
    finally:
        q_in.put(None)
        proc.join(30)
        if proc.is_alive():
            proc.terminate()
            proc.join(5)
    return 0


if __name__ == "__main__":
    sys.exit(main())
