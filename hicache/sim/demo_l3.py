"""``hicache demo --l3 mooncake``: two simulated workers sharing prefixes through Mooncake Store.

Starts a local Mooncake Store (``mooncake_master`` with its embedded HTTP metadata server and
one storage member, every listener on 127.0.0.1: see ``hicache.engine.l3_master``), then runs
the workload twice with the same routing, side by side:

* **independent**: two daemons without L3, two workers; requests alternate between them (a
  router without prefix affinity, so every conversation's turns land on both instances);
* **l3**: the same, each daemon with ``--l3 mooncake``: a worker whose tree misses a prefix
  asks L3 for the pages after it; pages the other worker computed come back (cross-instance
  hits).

In both runs worker A's daemon is killed (SIGKILL) halfway and started again, and A restarts
with a fresh tree and fresh device pools: with L3 its prefixes come back from the store.
Every page loaded, from the host tier or from L3, is verified byte for byte against the
content it was written with. The JSON adds ``l3_hit_tokens``, ``l3_bytes_read`` /
``l3_bytes_written``, ``l3_errors``, ``cross_instance_hit_tokens``, ``restart_hit_tokens`` and
the listeners found (all must be loopback).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any

from hicache.core.errors import UsageError
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.radix import PAGE_TOKENS

SUM_KEYS = ("requests", "input_tokens", "device_hit_tokens", "host_hit_tokens", "miss_tokens",
            "verified_bytes", "mismatched_bytes", "l3_hit_tokens", "l3_bytes_read",
            "l3_bytes_written", "l3_errors", "l3_pages_written", "l3_pages_skipped",
            "host_tier_lost")


def _err(msg: str) -> None:
    print(f"[demo l3] {msg}", file=sys.stderr, flush=True)


def _daemon(cfg: Any, store: Any) -> DaemonProcess:
    from hicache.engine.l3_master import loopback_env

    ratio = (cfg.host_pages + 0.5) / cfg.device_pages
    extra: tuple[str, ...] = ("--swa-mode", cfg.swa_mode)
    if store is not None:
        extra += ("--l3", "mooncake", "--l3-master", store.master_addr,
                  "--l3-metadata", store.metadata_url)
    return DaemonProcess(device=cfg.device, preset=cfg.preset, device_rows=cfg.device_rows(),
                         host=("--host-ratio", repr(ratio)), heartbeat_timeout=60,
                         extra=extra, env=loopback_env() if store is not None else None,
                         new_session=True, ready_timeout=180)


class Instance:
    """One daemon and the worker on it; ``restart()`` kills the daemon and starts both anew."""

    def __init__(self, name: str, cfg: Any, store: Any) -> None:
        self.name, self.cfg, self.store = name, cfg, store
        self.daemon = _daemon(cfg, store)
        self.incarnation = 0
        self.worker: Any = None
        self.finished: list[dict[str, Any]] = []  # summaries of earlier incarnations
        self.daemon.start()
        self._attach()

    @property
    def tag(self) -> str:
        return f"{self.name}{self.incarnation}"

    def _attach(self) -> None:
        from hicache.engine.client import Client
        from hicache.sim.simulator import Worker

        client = Client(self.daemon.address, timeout=self.cfg.timeout, name=self.tag)
        if self.store is not None:
            deadline = time.monotonic() + 30
            while not client.stats()["l3"]["online"]:
                if time.monotonic() > deadline:
                    raise RuntimeError(f"{self.tag}: the daemon's L3 client is not online")
                time.sleep(0.1)
        self.worker = Worker(self.cfg, client)
        if self.worker.hooks is not None and self.cfg.l3:
            self.worker.hooks.l3_put_log = []

    def restart(self) -> None:
        self.worker.tree.drain()
        if self.worker.hooks is not None and self.cfg.l3:
            self.worker.hooks.l3_settle(self.cfg.timeout)
        self.finished.append(self.worker.summary())
        self.daemon.kill()  # a crash: nothing is shut down cleanly
        self.worker.client.close()
        self.worker.pools.close()
        self.daemon.start()
        self.incarnation += 1
        self._attach()

    def close(self) -> list[dict[str, Any]]:
        self.worker.tree.drain()
        if self.worker.hooks is not None and self.cfg.l3:
            self.worker.hooks.l3_settle(self.cfg.timeout)
        out = self.finished + [self.worker.summary()]
        self.worker.close()
        self.worker.client.close()
        self.daemon.close()
        return out


def _replay(reqs: list, cfg: Any, store: Any, label: str, progress_s: float) -> dict[str, Any]:
    """Both instances over ``reqs`` (alternating), A restarted halfway; the merged figures."""
    a = Instance("A", cfg, store)
    b = Instance("B", cfg, store)
    writer: dict[Any, str] = {}  # page key -> tag of the incarnation that first wrote it
    cross = restart_hits = 0
    t0 = time.monotonic()
    last = t0
    pids: list[int] = []
    try:
        for i, req in enumerate(reqs):
            if i == len(reqs) // 2:
                _err(f"{label}: killing A's daemon (SIGKILL) and starting it again")
                a.restart()
            inst = (a, b)[i % 2]
            w = inst.worker
            w.run_request(req)
            for k in w.last_l3_keys:
                src = writer.get(k)
                if src is not None and src[0] != inst.name:
                    cross += PAGE_TOKENS
                elif src is not None and src != inst.tag:
                    restart_hits += PAGE_TOKENS
            if w.hooks is not None and w.hooks.l3_put_log:
                for k in w.hooks.l3_put_log:
                    writer.setdefault(k, inst.tag)
                w.hooks.l3_put_log.clear()
            now = time.monotonic()
            if progress_s and now - last >= progress_s:
                last = now
                _err(f"{label}: {i + 1}/{len(reqs)} requests, {now - t0:.0f} s")
        pids = [p for p in (a.daemon.pid, b.daemon.pid) if p is not None]
        found = _listeners(store, pids)
    finally:
        parts = a.close() + b.close()
    out: dict[str, Any] = {k: sum(p.get(k, 0) for p in parts) for k in SUM_KEYS}
    out["cached_tokens"] = out["device_hit_tokens"] + out["host_hit_tokens"]
    out["verified"] = out["mismatched_bytes"] == 0 and all(p["verified"] for p in parts)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if store is not None:
        out["cross_instance_hit_tokens"] = cross
        out["restart_hit_tokens"] = restart_hits
        out["listeners"] = [a for _, a in found]
    return out


def _listeners(store: Any, daemon_pids: list[int]) -> list[tuple[int, str]]:
    if store is None:
        return []
    from hicache.engine.l3_master import listeners, non_loopback

    found = listeners(store.pids() + daemon_pids)
    bad = non_loopback(found)
    if bad:
        raise RuntimeError(f"listeners off loopback: {bad}")
    return found


def run_l3(args: argparse.Namespace, reqs: list, cfg: Any, what: str) -> int:
    from hicache.engine.l3_master import LocalStore, mooncake_dir

    if mooncake_dir() is None:
        raise UsageError("--l3 mooncake needs the Mooncake client: pip install 'hicache[l3]' "
                         "(and the system libibverbs1)")
    if cfg.device != "cpu":
        raise UsageError("--l3 mooncake runs the two simulated workers in CPU mode here; "
                         "add --device cpu")
    page_bytes = sum(cfg.layout().row_bytes(s) for s in ("page", "swa_page")
                     if cfg.layout().space_pools(s))
    pages = sum(len(r.cache_pages) for r in reqs)
    segment = max(256 << 20, int(page_bytes * pages * 1.2) + (64 << 20))
    _err(f"{what}; two instances, {cfg.preset} swa={cfg.swa_mode}, {cfg.device_pages} device "
         f"pages and {cfg.host_pages} host pages each; store segment {segment >> 20} MiB")
    base = _replay(reqs, dataclasses.replace(cfg, l3=False), None, "independent",
                   args.progress_seconds)
    with LocalStore(segment=str(segment)) as store:
        _err(f"Mooncake master {store.master_addr}, metadata {store.metadata_url}")
        l3 = _replay(reqs, dataclasses.replace(cfg, l3=True), store, "l3",
                     args.progress_seconds)
    tot = max(1, l3["input_tokens"])
    out = {"workload": what, "instances": 2, "routing": "alternate requests",
           "restart": "instance A's daemon SIGKILLed and restarted halfway",
           "independent": base, "l3": l3,
           "l3_hit_tokens": l3["l3_hit_tokens"], "l3_bytes_read": l3["l3_bytes_read"],
           "l3_bytes_written": l3["l3_bytes_written"], "l3_errors": l3["l3_errors"],
           "cross_instance_hit_tokens": l3["cross_instance_hit_tokens"],
           "restart_hit_tokens": l3["restart_hit_tokens"],
           "cached_tokens_gain": l3["cached_tokens"] - base["cached_tokens"],
           "verified": base["verified"] and l3["verified"]}
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        def pct(n: int) -> str:
            return f"{n:>12,} tokens ({100 * n / tot:5.1f}%)"

        print("\n".join([
            f"hicache demo --l3 mooncake: {what}, two instances, A restarted halfway",
            f"  {'':24}{'independent':>28}{'with L3':>28}",
            f"  {'cached (device+host)':24}{pct(base['cached_tokens']):>28}"
            f"{pct(l3['cached_tokens']):>28}",
            f"  {'  of which from L3':24}{'':>28}{pct(l3['l3_hit_tokens']):>28}",
            f"  {'  cross-instance':24}{'':>28}{pct(l3['cross_instance_hit_tokens']):>28}",
            f"  {'  after the restart':24}{'':>28}{pct(l3['restart_hit_tokens']):>28}",
            f"  L3 bytes read {l3['l3_bytes_read'] / 2**30:.2f} GiB, written "
            f"{l3['l3_bytes_written'] / 2**30:.2f} GiB, errors {l3['l3_errors']}",
            f"  verified: {out['verified']} ({(base['verified_bytes'] + l3['verified_bytes']) / 2**30:.2f}"
            f" GiB checked, {base['mismatched_bytes'] + l3['mismatched_bytes']} bytes differ); "
            f"listeners all on loopback: {', '.join(l3['listeners'][:8])}",
        ]), flush=True)
    return 0 if out["verified"] else 1
