"""Which NUMA node a GPU sits on, and how the arena's touching threads are placed there.

Contract:

* ``gpu_numa_node(device_index) -> (node | None, reason)``: the node from sysfs
  (``/sys/bus/pci/devices/<bus id>/numa_node``) for the GPU's PCI bus id (from torch's device
  properties, else the CUDA driver). ``None`` when unknown (``-1``, no sysfs entry, no id).
  Never creates a CUDA context.
* ``plan_placement(device_index, numa_node, nbytes) -> Placement``: ``numa_node`` is
  ``"auto"`` (the GPU's node), an int (that node) or ``None`` (no placement).
* ``Placement.enter_thread()`` runs first in every touching thread: pins the thread to the
  node's CPUs and, with the ``numa`` module, sets the thread's memory policy (``bind`` when the
  node has room, else ``preferred``). Without ``numa`` pages land where the pinned threads
  first touch them (``first-touch``). Every fallback is said in ``Placement.note`` and logged.
"""
from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import Any

from .errors import ArenaError

log = logging.getLogger("hicache.host_pools")
SYSFS = "/sys"


def parse_cpulist(text: str) -> set[int]:
    """``"0-3,8,10-11"`` -> {0, 1, 2, 3, 8, 10, 11}."""
    out: set[int] = set()
    for part in text.strip().split(","):
        if not part:
            continue
        lo, _, hi = part.partition("-")
        out.update(range(int(lo), int(hi or lo) + 1))
    return out


def _read(path: str) -> str | None:
    try:
        with open(path, encoding="ascii") as f:
            return f.read().strip()
    except OSError:
        return None


def online_nodes(sysfs: str = SYSFS) -> set[int]:
    text = _read(f"{sysfs}/devices/system/node/online")
    return parse_cpulist(text) if text else set()


def node_cpus(node: int, sysfs: str = SYSFS) -> set[int]:
    """CPUs of ``node`` this process may run on (empty when unknown)."""
    text = _read(f"{sysfs}/devices/system/node/node{node}/cpulist")
    return parse_cpulist(text) & os.sched_getaffinity(0) if text else set()


def node_free_bytes(node: int, sysfs: str = SYSFS) -> int | None:
    text = _read(f"{sysfs}/devices/system/node/node{node}/meminfo")
    for line in (text or "").splitlines():
        if "MemFree:" in line:
            return int(line.split()[-2]) * 1024
    return None


def normalize_bus_id(bus_id: str) -> str:
    """``"00000000:3B:00.0"`` or ``"0000:3b:00.0"`` -> ``"0000:3b:00.0"`` (sysfs form)."""
    dom, bus, rest = bus_id.strip().lower().split(":")
    return f"{int(dom, 16):04x}:{int(bus, 16):02x}:{rest}"


def gpu_pci_bus_id(device_index: int) -> str | None:
    """The GPU's PCI bus id in sysfs form, without creating a CUDA context."""
    import torch

    props: Any = torch.cuda.get_device_properties(device_index)
    parts = [getattr(props, k, None) for k in ("pci_domain_id", "pci_bus_id", "pci_device_id")]
    if all(isinstance(p, int) for p in parts):
        return f"{parts[0]:04x}:{parts[1]:02x}:{parts[2]:02x}.0"
    from .cuda_host import driver_pci_bus_id

    text = driver_pci_bus_id(device_index)
    return normalize_bus_id(text) if text else None


def gpu_numa_node(device_index: int, sysfs: str = SYSFS,
                  bus_id: str | None = None) -> tuple[int | None, str]:
    """``(node, reason)``; node is ``None`` when the platform does not say."""
    try:
        bus_id = bus_id or gpu_pci_bus_id(device_index)
    except Exception as e:  # noqa: BLE001 - any failure here only loses locality
        return None, f"cannot read the PCI bus id of cuda:{device_index} ({e})"
    if not bus_id:
        return None, f"no PCI bus id for cuda:{device_index}"
    text = _read(f"{sysfs}/bus/pci/devices/{bus_id}/numa_node")
    if text is None:
        return None, f"no sysfs numa_node for cuda:{device_index} at {bus_id}"
    node = int(text)
    if node < 0:
        return None, f"cuda:{device_index} at {bus_id} reports NUMA node {node} (no affinity)"
    return node, f"cuda:{device_index} at {bus_id} is on NUMA node {node}"


def _numa_module() -> Any | None:
    try:
        import numa  # type: ignore[import-not-found]
    except ImportError:
        return None
    try:
        return numa if numa.available() else None
    except Exception:  # noqa: BLE001 - an unusable libnuma is the same as none
        return None


@dataclass(frozen=True)
class Placement:
    """Where touching threads run and which memory policy they set."""

    node: int | None
    cpus: frozenset[int]
    policy: str  # "bind" | "preferred" | "first-touch" | "none"
    note: str
    numa: Any = field(default=None, repr=False, compare=False)

    def enter_thread(self) -> None:
        """Pin the calling thread to ``cpus`` and set its memory policy (thread-local)."""
        try:
            if self.cpus:
                os.sched_setaffinity(0, self.cpus)  # pid 0: this thread only
            if self.policy == "bind":
                self.numa.set_membind({self.node})
            elif self.policy == "preferred":
                self.numa.set_preferred(self.node)
        except Exception as e:  # noqa: BLE001
            raise ArenaError(f"cannot place a touching thread on NUMA node {self.node}: {e}") \
                from None


def plan_placement(device_index: int | None, numa_node: int | str | None = "auto",
                   nbytes: int = 0, sysfs: str = SYSFS) -> Placement:
    """Decide the node, CPUs and policy for touching ``nbytes``; logs any fallback."""
    anywhere = frozenset(os.sched_getaffinity(0))
    if numa_node is None:
        return Placement(None, anywhere, "none", "NUMA placement disabled")
    if numa_node == "auto":
        if device_index is None:
            return Placement(None, anywhere, "none", "CPU mode: no GPU to be local to")
        node, why = gpu_numa_node(device_index, sysfs)
        if node is None:
            log.info("host arena: %s; memory not bound", why)
            return Placement(None, anywhere, "none", why + "; memory not bound")
    elif isinstance(numa_node, int) and not isinstance(numa_node, bool):
        node, why = numa_node, f"NUMA node {numa_node} as configured"
        nodes = online_nodes(sysfs)
        if nodes and node not in nodes:
            raise ArenaError(f"NUMA node {node} is not online; online nodes: {sorted(nodes)}")
    else:
        raise ArenaError(f"numa_node must be 'auto', an int or None, got {numa_node!r}")
    cpus = frozenset(node_cpus(node, sysfs))
    if not cpus:
        why += f"; node {node} has no CPUs this process may use, threads not pinned"
        cpus = anywhere
    mod = _numa_module()
    if len(online_nodes(sysfs)) <= 1:
        note = why + "; single NUMA node, nothing to bind" + \
            ("" if mod else " (numa module not available)")
        log.info("host arena: %s", note)
        return Placement(node, cpus, "none", note)
    if mod is None:
        note = (f"{why}; numa module or libnuma not available: pages placed by first touch "
                f"from node {node}'s CPUs, not bound")
        log.warning("host arena: %s", note)
        return Placement(node, cpus, "first-touch", note)
    free = node_free_bytes(node, sysfs)
    if free is not None and free < nbytes:
        note = (f"{why}; node {node} has {free >> 20} MiB free < {nbytes >> 20} MiB asked: "
                "preferred (may spill to other nodes), not bound")
        log.warning("host arena: %s", note)
        return Placement(node, cpus, "preferred", note, mod)
    return Placement(node, cpus, "bind", why + f"; memory bound to node {node}", mod)
