"""Open a worker's device buffers (sealed memfds in CPU mode, CUDA IPC handles on GPU) as tensors.

``open_buffers(layout, device_rows, buffers, mode, device, fds)`` checks every handle
against the layout (one per owned layer, ``rows`` = the worker's rows of the pool's space,
``row_bytes`` = ``page_bytes``) *before* opening anything, then returns ``DeviceBuffers``:
``{pool: [uint8 tensor [rows, page_bytes] per layer]}``. Nothing received is trusted: a CPU handle
names one of the descriptors the worker handed in (``fds``: its place in that list), each of
which must be a regular file of the kernel's shared memory (not hugetlbfs) sealed against
shrinking (``F_SEAL_SHRINK``: a memfd; no process can then cut it under the daemon's mapping,
which would make the daemon's next copy a SIGBUS), every one named by some handle, long enough
for them and with that much allocated (only that much is mapped; a hole punched later reads
as zeros, and the daemon's copy into it allocates the page); CUDA
handles must name the
GPU this daemon serves (by UUID), and the storage a handle claims (its offset and size) must
lie inside the CUDA allocation the handle opens (the driver's ``cuMemGetAddressRange``), so no
layer can reach past the worker's own memory; a GPU layer must start on a 4-byte boundary
(``WORD``); the reference-counter file a CUDA handle names is checked and then not used
(torch gets ``NO_COUNTER``: the daemon never decrements a counter in a file a client names,
which could be another engine's; the engine's shared block then stays out of its caching
allocator once freed, until the engine exits). ``close(handoff)`` drops every mapping the
daemon holds; a mapping still used by an in-flight operation is released when that operation
lets go of it. With ``handoff`` (``background.Unmapper.hand``) the objects that keep the
mappings alive go to it, so the unmapping itself runs off the server thread.
"""
from __future__ import annotations

import ctypes
import fcntl
import mmap
import os
import re
import secrets
import stat
from typing import Any, Callable, Mapping, Sequence

import torch

from hicache.core.ipc import decode_b64, device_uuid
from hicache.core.layout import Layout, LayoutError
from hicache.core.protocol import ProtocolError
from hicache.core.sealed_memfd import on_shmem, seals_of, unallocated


def _bad(msg: str) -> ProtocolError:
    return ProtocolError("bad_handle", msg)


def _int(h: Mapping[str, Any], k: str, where: str) -> int:
    v = h.get(k)
    if type(v) is not int or v < 0:
        raise _bad(f"{where}: {k!r} must be a non-negative int")
    return v


def _handle_bytes(h: Mapping[str, Any], k: str, where: str, optional: bool = False) -> bytes | None:
    v = h.get(k)
    if v is None and optional:
        return None
    try:
        return decode_b64(repr(k), v)
    except ValueError as e:
        raise _bad(f"{where}: {e}") from None


class DeviceBuffers:
    """The opened per-layer device buffers of one registered worker."""

    def __init__(self, layers: dict[str, list[torch.Tensor]], mode: str,
                 keep: Sequence[Any] = ()) -> None:
        self.layers = layers
        self.mode = mode
        self._keep = list(keep)  # mmaps / storages whose lifetime the tensors depend on

    def close(self, handoff: Callable[[list[Any]], None] | None = None) -> None:
        keep, self._keep = self._keep, []
        self.layers = {}
        if handoff is not None:
            handoff(keep)


def check_shapes(layout: Layout, device_rows: Mapping[str, int],
                 buffers: Mapping[str, Any]) -> None:
    if not isinstance(buffers, dict):
        raise ProtocolError("bad_field", "buffers must map pool -> list of handles")
    counts = {}
    for pool, hs in buffers.items():
        if not isinstance(hs, list):
            raise ProtocolError("bad_field", f"buffers[{pool!r}] must be a list of handles")
        counts[pool] = len(hs)
    try:
        layout.check_buffers(counts)
    except LayoutError as e:
        raise ProtocolError("layout_mismatch", str(e)) from None
    for name, spec in layout.pools.items():
        rows = device_rows.get(spec.index)
        if rows is None or rows <= 0:
            raise ProtocolError("bad_field", f"device_rows has no positive row count for space "
                                             f"{spec.index!r} (pool {name})")
        for i, h in enumerate(buffers[name]):
            where = f"buffers[{name}][{i}]"
            if not isinstance(h, dict):
                raise _bad(f"{where} must be an object")
            if type(h.get("rows")) is not int or type(h.get("row_bytes")) is not int or \
                    h["rows"] != rows or h["row_bytes"] != spec.page_bytes:
                raise _bad(f"{where}: shape [{h.get('rows')}, {h.get('row_bytes')}] but pool "
                           f"{name} needs [{rows}, {spec.page_bytes}] (device_rows[{spec.index}] "
                           f"x page_bytes)")


def open_buffers(layout: Layout, device_rows: Mapping[str, int], buffers: Mapping[str, Any],
                 mode: str, device: torch.device,
                 fds: Callable[[], Sequence[int]] | None = None) -> DeviceBuffers:
    """See the module docstring; ``fds`` (CPU): gives the descriptors the worker handed in,
    asked for once the handles passed their own checks (the caller's: they are neither kept
    nor closed here)."""
    check_shapes(layout, device_rows, buffers)
    if mode == "cpu":
        if device.type != "cpu":
            raise ProtocolError("unsupported", f"this daemon serves {device}; register CUDA IPC "
                                               f"handles (mode 'cuda'), not memfds")
        return _open_memfds(layout, buffers, fds or (lambda: []))
    if mode == "cuda":
        if device.type != "cuda":
            raise ProtocolError("unsupported", "this daemon runs in CPU mode; register memfd "
                                               "buffers (mode 'cpu')")
        if fds is not None:
            raise ProtocolError("bad_field", "fd_token: CUDA pools are shared by their IPC "
                                             "handles; nothing is handed in")
        return _open_cuda(layout, buffers, device)
    raise ProtocolError("bad_field", f"mode must be 'cpu' or 'cuda', got {mode[:32]!r}")


# ----------------------------------------------------------------------------- CPU: sealed memfds
def _open_memfds(layout: Layout, buffers: Mapping[str, Any],
                 get_fds: Callable[[], Sequence[int]]) -> DeviceBuffers:
    plan = []
    for name in layout.pools:  # validate every handle and check every descriptor before mapping
        for i, h in enumerate(buffers[name]):
            where = f"buffers[{name}][{i}]"
            if h.get("kind") != "memfd":
                raise _bad(f"{where}: kind must be 'memfd' in CPU mode (a sealed memfd handed in "
                           f"before register; a file named by path could be cut under the "
                           f"daemon's mapping)")
            k = _int(h, "fd", where)
            plan.append((name, k, _int(h, "offset", where), h["rows"], h["row_bytes"], where))
    fds = get_fds()
    ends = [0] * len(fds)
    for name, k, off, rows, rb, where in plan:
        if k >= len(fds):
            raise _bad(f"{where}: 'fd' {k} names none of the {len(fds)} descriptors handed in")
        ends[k] = max(ends[k], off + rows * rb)
    unused = [k for k, e in enumerate(ends) if e == 0]
    if unused:
        raise _bad(f"descriptor {unused[0]} was handed in but no buffer names it")
    for k, fd in enumerate(fds):
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise _bad(f"descriptor {k} is not a regular file")
        if not on_shmem(fd):
            raise _bad(f"descriptor {k} is not shared memory (a memfd; hugetlbfs and other "
                       f"file systems are refused: a page missing there is a SIGBUS)")
        seals = seals_of(fd)
        if not seals & fcntl.F_SEAL_SHRINK:
            raise _bad(f"descriptor {k} is not sealed against shrinking (F_SEAL_SHRINK; seals "
                       f"{seals:#x}): a worker could cut it under the daemon's mapping")
        if ends[k] > st.st_size:
            raise _bad(f"descriptor {k}: the buffers need {ends[k]} bytes, it has {st.st_size}")
        why = unallocated(st, ends[k])
        if why is not None:  # a sparse file: the daemon's copies would allocate
            raise _bad(f"descriptor {k}: {why}")
    maps: list[tuple[mmap.mmap, torch.Tensor]] = []
    try:
        for k, fd in enumerate(fds):
            try:
                mm = mmap.mmap(fd, ends[k])
            except OSError as e:
                raise _bad(f"cannot map descriptor {k} ({ends[k]} bytes): {e.strerror}") from None
            maps.append((mm, torch.frombuffer(mm, dtype=torch.uint8)))
    except BaseException:
        for mm, _ in maps:
            mm.close()
        raise
    layers: dict[str, list[torch.Tensor]] = {}
    for name, k, off, rows, rb, _ in plan:
        layers.setdefault(name, []).append(maps[k][1][off: off + rows * rb].view(rows, rb))
    return DeviceBuffers(layers, "cpu", keep=[m[0] for m in maps])


# ----------------------------------------------------------------------------- GPU: CUDA IPC
# every GPU layer starts on this boundary: the segment kernels move 4-byte words at least, and a
# misaligned layer would otherwise be refused only when a copy's segment plan is built, which
# for a load's later layers comes after layer 0's copies went out
WORD = 4


def _open_cuda(layout: Layout, buffers: Mapping[str, Any], device: torch.device) -> DeviceBuffers:
    my_uuid = device_uuid(device.index)
    decoded = []
    for name in layout.pools:
        for i, h in enumerate(buffers[name]):
            where = f"buffers[{name}][{i}]"
            if h.get("kind") != "cuda_ipc":
                raise _bad(f"{where}: kind must be 'cuda_ipc' in GPU mode")
            uuid = h.get("uuid")
            if my_uuid and uuid and uuid != my_uuid:
                raise _bad(f"{where}: buffer is on GPU {uuid}, this daemon serves {my_uuid}")
            decoded.append((name, where, _ipc_record(h, where)))
    storages: dict[tuple[bytes, int], Any] = {}
    layers: dict[str, list[torch.Tensor]] = {}
    with torch.cuda.device(device):
        for name, where, r in decoded:
            key = (r["handle"], r["storage_offset"])
            st = storages.get(key)
            if st is None:
                try:
                    # torch decrements a slot of the counter file named here when the storage
                    # goes; a client could name another engine's file (its form is all the
                    # daemon can check), so torch gets a name no file has (``NO_COUNTER``)
                    st = torch.UntypedStorage._new_shared_cuda(
                        device.index, r["handle"], r["storage_bytes"], r["storage_offset"],
                        NO_COUNTER, 0, r["event"], r["event_sync"])
                except Exception as e:  # noqa: BLE001 - report, never crash the daemon
                    raise _bad(f"{where}: cannot open the CUDA IPC handle ({e}); is the "
                               f"worker's memory from expandable_segments or another GPU?") from None
                _check_within_allocation(st, r, where)
                storages[key] = st
            t = torch.empty(0, dtype=torch.uint8, device=device)
            t.set_(st, r["offset"], (r["rows"], r["row_bytes"]), (r["row_bytes"], 1))
            layers.setdefault(name, []).append(t)
    return DeviceBuffers(layers, "cuda", keep=list(storages.values()))


# a storage's handle: torch sends a version and a kind byte before the 64-byte cudaIpcMemHandle_t
# (torch 2.11); an event's is the 64-byte cudaIpcEventHandle_t
IPC_HANDLE_BYTES = {"handle": (66, 64), "event": (64,)}
REF_COUNTER_SLOTS = 10_000  # torch's CUDA_IPC_REF_COUNTER_FILE_SIZE: int64 counters per file
# the counter file torch is given for every storage the daemon opens: a random name that no file
# has, so the decrement torch makes when the storage goes opens nothing (torch ignores that)
NO_COUNTER = f"/hicache-no-counter-{os.getpid()}-{secrets.token_hex(16)}".encode()
_REF_COUNTER_NAME = re.compile(rb"^/torch_\d+_\d+_\d+$")  # torch names its counter files so


def _ipc_record(h: Mapping[str, Any], where: str) -> dict[str, Any]:
    """One layer's CUDA IPC handle, checked (``_check_ipc_fields``, the layer inside its
    storage and on a ``WORD`` boundary) before anything is opened."""
    _check_ipc_fields(h, where)
    rec = dict(
        handle=_handle_bytes(h, "handle", where), storage_bytes=_int(h, "storage_bytes", where),
        storage_offset=_int(h, "storage_offset", where),
        event=_handle_bytes(h, "event", where, optional=True), event_sync=bool(h.get("event_sync")),
        offset=_int(h, "offset", where), rows=h["rows"], row_bytes=h["row_bytes"])
    if rec["offset"] + rec["rows"] * rec["row_bytes"] > rec["storage_bytes"]:
        raise _bad(f"{where}: layer bytes run past the end of its storage")
    start = rec["storage_offset"] + rec["offset"]  # bytes into its (aligned) allocation
    if start % WORD:
        raise _bad(f"{where}: the layer starts {start} bytes into its CUDA allocation, not on a "
                   f"{WORD}-byte boundary: the copy kernels move {WORD}-byte words")
    return rec


def _check_ipc_fields(h: Mapping[str, Any], where: str) -> None:
    """What torch trusts when it opens a shared CUDA storage: the handles' sizes, the
    reference-counter file's name and the counter's slot in it. torch decrements
    ``counter + ref_counter_offset`` in the mapped counter file when the storage goes: an
    offset past the file wrote (and crashed) outside it, and a name of the right form could
    still be another engine's file. Both are checked as the client's input, but the daemon
    never hands the client's counter to torch (``NO_COUNTER``)."""
    for k, optional in (("handle", False), ("event", True)):
        b = _handle_bytes(h, k, where, optional)
        if b is not None and len(b) not in IPC_HANDLE_BYTES[k]:
            raise _bad(f"{where}: {k} is {len(b)} bytes; a CUDA IPC {k} is "
                       f"{' or '.join(map(str, IPC_HANDLE_BYTES[k]))}")
    name = _handle_bytes(h, "ref_counter", where, optional=True)
    if name is not None and not _REF_COUNTER_NAME.match(name):
        raise _bad(f"{where}: ref_counter must name a torch counter file (/torch_<n>_<n>_<n>)")
    off = _int(h, "ref_counter_offset", where)
    if not 0 <= off < REF_COUNTER_SLOTS:
        raise _bad(f"{where}: ref_counter_offset {off} is outside the counter file's "
                   f"{REF_COUNTER_SLOTS} slots")


def _check_within_allocation(st: Any, r: Mapping[str, Any], where: str) -> None:
    """Refuse a storage the handle's allocation does not hold: it starts
    ``r["storage_offset"]`` bytes into the allocation the IPC handle opened and claims
    ``r["storage_bytes"]``; both come from the client."""
    base = st.data_ptr() - r["storage_offset"]  # where the handle's allocation was mapped
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as e:
        raise _bad(f"{where}: cannot check the handle's allocation: the CUDA driver library "
                   f"could not be loaded ({e})") from None
    start, size = ctypes.c_uint64(0), ctypes.c_size_t(0)
    rc = lib.cuMemGetAddressRange_v2(ctypes.byref(start), ctypes.byref(size),
                                     ctypes.c_uint64(base))
    if rc != 0:
        raise _bad(f"{where}: the CUDA driver cannot say what the handle maps (CUresult {rc})")
    if start.value != base or r["storage_offset"] + r["storage_bytes"] > size.value:
        raise _bad(f"{where}: storage_offset {r['storage_offset']} + storage_bytes "
                   f"{r['storage_bytes']} runs past the {size.value}-byte CUDA allocation the "
                   f"handle opens")


def open_events(handles: Sequence[str], device: torch.device) -> list[Any]:
    """Interprocess CUDA events from base64 handles (the engine records them, we wait)."""
    out = []
    for i, h in enumerate(handles):
        raw = _handle_bytes({"h": h}, "h", f"events[{i}]")
        try:
            out.append(torch.cuda.Event.from_ipc_handle(device, raw))
        except Exception as e:  # noqa: BLE001
            raise _bad(f"events[{i}]: cannot open the IPC event ({e})") from None
    return out
