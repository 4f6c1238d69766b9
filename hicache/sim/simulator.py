"""Simulated DSV4 worker: device pools, a radix tree over them, and the daemon as host tier.

``Worker(cfg, client)`` allocates the device pools of the layout (CUDA tensors on a GPU,
shared-memory CPU tensors otherwise) through ``hicache.engine.device_pools``, registers them with the
daemon, and runs requests through ``hicache.sim.replay.Replay`` (prepare, write, release,
device-only counterfactual, accounting). What it adds is the bytes:

1. every hit is verified before it counts: every pool of every prefix page under a full
   mirror; with checkpoints, the compressed rows of every prefix page plus the boundary's
   checkpoint — the SWA tail tokens (in the page's device row, or at ring positions of the
   request slot in ring SWA mode) and the C4 / C4-indexer state rows. A hit with any byte
   wrong is recomputed (``rejected_hit_tokens``) and the mismatch reported;
2. "prefill" writes the content of every new page (``PageContent``: derived from (page key,
   pool, layer)) into fresh device rows of every page space; in ring mode the request slot's
   SWA ring and state rows get the checkpoint content of the last page it wrote and, when the
   request goes on past that page (a prompt ending mid-page, decode), then its own state, after
   the boundary snapshot (``boundary_snapshots``) or none: a checkpoint read from the slot
   then would not verify;
3. with ``preempt_every=N`` every N-th request's slot state (``req_slot`` pools) is swapped out
   to the host and back into another slot through the daemon, and verified.

Counters live in ``Result`` and, for Prometheus, in ``DemoMetrics`` (``hicache_demo_*``).
"""
from __future__ import annotations

from dataclasses import asdict
from typing import Any, Sequence

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hicache.core.errors import HicacheError
from hicache.core.metric_defs import LATENCY_BUCKETS, MetricDef
from hicache.core.percentiles import percentile
from hicache.engine.device_pools import DevicePools
from hicache.engine.hooks import ClientHooks
from hicache.engine.radix import Prefix
from hicache.sim.page_content import PageContent
from hicache.sim.replay import Replay, Result, WorkerConfig, page_spaces
from hicache.sim.workload import Request

__all__ = ["DEMO_CATALOG", "DemoMetrics", "Result", "Worker", "WorkerConfig", "page_spaces"]

DEMO_CATALOG: tuple[MetricDef, ...] = (
    MetricDef("demo_requests", "counter", (),
              "Requests the simulated worker finished.",
              "How far is the replay?"),
    MetricDef("demo_prefix_tokens", "counter", ("tier",),
              "Input tokens by where their pages came from: device (prefix hit on the device "
              "tier; its checkpoint may have been loaded from the host), host (pages loaded "
              "from the host tier), miss (computed).",
              "How much prefill does each tier save?"),
    MetricDef("demo_device_only_hit_tokens", "counter", (),
              "Prefix-hit tokens the same replay gets with a device-only tree (counterfactual).",
              "What would the hit rate be without the host tier?"),
    MetricDef("demo_tree_pages", "gauge", ("tier",),
              "Pages the simulator's radix tree holds per tier (device, host).",
              "How full are the two tiers of the prefix cache?"),
    MetricDef("demo_op_seconds", "histogram", ("op",),
              "Seconds from the daemon accepting a backup or load to its completion, as acked.",
              "How long does the worker wait for the host tier?"),
    MetricDef("demo_verified_bytes", "counter", (),
              "Bytes of cached pages compared against their expected content before use.",
              "Is every byte read from the cache checked?"),
    MetricDef("demo_mismatched_bytes", "counter", (),
              "Checked bytes that differ from the content the page was written with.",
              "Did any transfer corrupt or misplace KV? (must stay 0)"),
    MetricDef("demo_host_tier_lost", "counter", (),
              "Times the worker lost the host tier (daemon unreachable) and fell back to "
              "recompute.",
              "Is the daemon healthy from the worker's point of view?"),
)


DEMO_KNOWN_LABELS = {"demo_prefix_tokens": ("device", "host", "miss"),
                     "demo_tree_pages": ("device", "host"), "demo_op_seconds": ("backup", "load")}


class DemoMetrics:
    """The demo's own metrics (``hicache_demo_*``) in their own registry."""

    PREFIX = "hicache_"

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        self.m: dict[str, Any] = {}
        for d in DEMO_CATALOG:
            name = self.PREFIX + d.name
            if d.kind == "counter":
                self.m[d.name] = Counter(name, d.help, d.labels, registry=self.registry)
            elif d.kind == "gauge":
                self.m[d.name] = Gauge(name, d.help, d.labels, registry=self.registry)
            else:
                self.m[d.name] = Histogram(name, d.help, d.labels, registry=self.registry,
                                           buckets=LATENCY_BUCKETS)
        for name, values in DEMO_KNOWN_LABELS.items():  # series at 0 from the start
            for v in values:
                self.m[name].labels(v)

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        from prometheus_client import generate_latest

        from hicache.core.metrics_http import MetricsHttp

        return MetricsHttp(lambda: generate_latest(self.registry), port, addr).port


class _ScrubbingHooks(ClientHooks):
    """The demo's hooks: ``scrub(device_rows, ckpts)`` (the worker's) runs before each load,
    so a page row or checkpoint the load does not reach holds content of no page."""
    scrub: Any = None

    def load(self, handles: Sequence[Any], device_rows: Sequence[int],
             ckpts: Sequence[Any] = ()) -> Any:
        if self.scrub is not None:
            self.scrub(list(device_rows), list(ckpts))
        return super().load(handles, device_rows, ckpts)


class Worker(Replay):
    """A simulated DSV4 worker (see the module docstring). ``client=None``: device-only."""

    def __init__(self, cfg: WorkerConfig, client: Any = None,
                 metrics: DemoMetrics | None = None) -> None:
        cfg.check()
        layout = cfg.layout()
        self.client = client
        self.metrics = metrics
        self.cuda = cfg.device.startswith("cuda")
        self.spaces = page_spaces(layout)  # what prefill writes: every page space
        self.pools = DevicePools(layout, cfg.device_rows(layout), cfg.device)
        self.content = PageContent(layout, cfg.seed)
        self.slot_pools = layout.space_pools("req_slot")
        self.hooks: ClientHooks | None = None
        ckpt = cfg.mirror == "checkpoints"
        try:
            if client is not None:
                resume = cfg.resume(layout)
                if ckpt and resume.copyable:
                    raise HicacheError(resume.copyable)
                client.register(self.pools, events=1 if self.cuda else 0, name="hicache-demo",
                                timeout=cfg.timeout)
                self.hooks = _ScrubbingHooks(client, ["page"] if ckpt else self.spaces,
                                   timeout=cfg.timeout, wait_event=0 if self.cuda else None,
                                   on_ack=self._on_ack, resume=resume if ckpt else None,
                                   l3=cfg.l3)
            super().__init__(cfg, self.hooks)
        except BaseException:
            self.pools.close()
            raise
        if isinstance(self.hooks, _ScrubbingHooks):
            self.hooks.scrub = self._scrub
        self.page_bytes = sum(layout.row_bytes(s) for s in self.spaces)
        self._lost_seen = 0
        self._scrub_id = -(1 << 40)  # content ids of no page and no request

    # ------------------------------------------------------------------ content
    def _write(self, req: Request, keys: list[int], rows: list[int]) -> None:
        if not rows:
            return
        ids = torch.tensor(keys, dtype=torch.int64)
        r = torch.tensor(rows, dtype=torch.int64)
        for space in self.spaces:
            for spec in self.layout.space_pools(space):
                for layer, buf in enumerate(self.pools.layers[spec.name]):
                    self.content.fill(spec.name, layer, buf, r, ids)
        self._written()

    def _written(self) -> None:
        if self.cuda:
            if self.client is not None and self.client.backup_events:
                self.client.backup_events[0].record()  # the daemon's backups wait on it
            else:
                torch.cuda.synchronize()

    def _tail(self, depth: int) -> tuple[list[int], list[int]]:
        """(token offsets in the page's content, positions in the row) of a checkpoint's tail."""
        src = list(self.resume.tail_offsets)
        return src, (src if self.cfg.swa_mode == "paged" else self.resume.ring_positions(depth))

    def _before_prepare(self, req: Request, slot: int) -> None:
        """Ring SWA with checkpoints: the slot still holds the checkpoint of the last page its
        previous request wrote, which in a multi-turn session is the very page this request
        resumes from, so a checkpoint load that never reached the slot would verify anyway.
        The request's own state content (no page's) goes there first: only a restore matches."""
        if self.ckpt and self.cfg.swa_mode == "ring":
            self._fill_slot(slot, req)
            self._written()

    def _before_release(self, req: Request, slot: int, wrote: bool) -> None:
        """State swap every N requests; in ring mode then the slot's rings get the checkpoint
        of the last page the request wrote."""
        if self.cfg.preempt_every and self.slot_pools and self.tree.host_online \
                and req.rid % self.cfg.preempt_every == 0:
            self._preempt(req)
        if not (self.ckpt and wrote and self.cfg.swa_mode == "ring"):
            return
        key, depth = req.cache_pages[-1], len(req.cache_pages)
        ids, row = torch.tensor([key], dtype=torch.int64), torch.tensor([slot])
        src, dst = self._tail(depth)
        r = self.resume
        if r.swa_pool is not None:
            for layer, buf in enumerate(self.pools.layers[r.swa_pool.name]):
                self.content.fill_tokens(r.swa_pool.name, layer, buf, row, ids, src, dst)
        for spec in r.state_pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                self.content.fill(spec.name, layer, buf, row, ids)
        self._written()

    def _past_boundary(self, req: Request, slot: int) -> None:
        """The slot's rings and states move on to the request's own state (no page's)."""
        self._fill_slot(slot, req)
        self._written()

    def _scrub(self, rows: list[int], ckpts: list[tuple[int, Any, int]]) -> None:
        """Before a load: its destination page rows get content of no page in every pool the
        load writes, and so do its checkpoints' rows (paged SWA), so only the load's copy
        matches the check after it. A row may hold the very bytes already: a row freed
        unwritten keeps an evicted page's, and the free list hands it out again (a review found
        6 of 2,133 loaded pages in such rows), or the node's own checkpoint row."""
        if rows:
            self._scrub_id -= 1
            ids = torch.full((len(rows),), self._scrub_id, dtype=torch.int64)
            r = torch.tensor(rows, dtype=torch.int64)
            for space in self.hooks.spaces:
                for spec in self.layout.space_pools(space):
                    for layer, buf in enumerate(self.pools.layers[spec.name]):
                        self.content.fill(spec.name, layer, buf, r, ids)
            self._written()
        if self.ckpt and self.cfg.swa_mode == "paged":  # (ring: ``_before_prepare``)
            self._scrub_checkpoints(ckpts)

    def _scrub_checkpoints(self, ckpts: list[tuple[int, Any, int]]) -> None:
        """Paged SWA: before a checkpoint load, its destination row's SWA tail and states
        get content of no page (as ring mode fills the slot with the request's own), so only
        a restore matches the check after it. That row may hold the very checkpoint already:
        the node's own row, or a reused row whose SWA no later load wrote (a review found
        loads that would have verified with nothing copied)."""
        r = self.resume
        for dst, _, depth in ckpts:
            self._scrub_id -= 1
            ids, rows = torch.tensor([self._scrub_id]), torch.tensor([dst])
            if r.swa_pool is not None:
                for layer, buf in enumerate(self.pools.layers[r.swa_pool.name]):
                    self.content.fill_tokens(r.swa_pool.name, layer, buf, rows, ids,
                                             *self._tail(depth))
            for spec in r.state_pools:
                for layer, buf in enumerate(self.pools.layers[spec.name]):
                    self.content.fill(spec.name, layer, buf, rows, ids)
        self._written()

    def _fill_slot(self, slot: int, req: Request) -> torch.Tensor:
        """Write request ``req``'s own state content into every pool row of request slot
        ``slot``; returns its content id (ids of request state never collide with page keys)."""
        ids = torch.tensor([-(req.rid + 1)], dtype=torch.int64)
        for spec in self.slot_pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                self.content.fill(spec.name, layer, buf, torch.tensor([slot]), ids)
        return ids

    def _after_release(self, req: Request) -> None:
        if self.ckpt and self.cfg.swa_mode == "ring":
            self.tree.drain()  # the ring backup must read the slot before the next request
        if self.client is not None and self.tree.host_online:
            try:
                self.client.maybe_heartbeat()
            except Exception:  # noqa: BLE001 - a dead daemon shows up in the tree's next call
                pass

    def _compare(self, pools: list[Any], rows: list[int], keys: list[int], what: str,
                 tokens: tuple[list[int], list[int]] | None = None) -> tuple[int, int]:
        """(bytes checked, bytes that differ) of rows ``rows`` against pages ``keys``."""
        ids = torch.tensor(keys, dtype=torch.int64)
        r = torch.tensor(rows, dtype=torch.int64)
        bad = checked = 0
        for spec in pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                if tokens is None:
                    n = self.content.mismatches(spec.name, layer, buf, r, ids)
                    checked += len(rows) * spec.page_bytes
                else:
                    n = self.content.token_mismatches(spec.name, layer, buf, r, ids, *tokens)
                    checked += len(rows) * len(tokens[0]) * spec.token_bytes
                if n and self.result.first_mismatch is None:
                    self.result.first_mismatch = (
                        f"{what}: {n} bytes differ in pool {spec.name} layer {layer} "
                        f"(pages {list(keys)[:4]}..., rows {list(rows)[:4]}...)")
                bad += n
        return checked, bad

    def _check_hit(self, req: Request, prefix: Prefix, slot: int) -> int:
        if not prefix.nodes:
            return 0
        what = f"request {req.rid} prefix"
        keys, rows = [n.key for n in prefix.nodes], prefix.rows
        if not self.cfg.verify_hits:  # loaded pages only
            keys, rows = [k for k, _ in prefix.loaded], [r for _, r in prefix.loaded]
        checked = bad = 0
        pools = [p for s in (["page"] if self.ckpt else self.spaces)
                 for p in self.layout.space_pools(s)]
        if rows:
            checked, bad = self._compare(pools, rows, keys, what)
        if self.ckpt and (self.cfg.verify_hits or prefix.ckpt == "host"):
            end = prefix.nodes[-1]
            loc = end.device if self.cfg.swa_mode == "paged" else slot
            r = self.resume
            c1 = b1 = 0
            if r.swa_pool is not None:
                c1, b1 = self._compare([r.swa_pool], [loc], [end.key], f"{what} SWA tail",
                                       self._tail(end.depth))
            c2, b2 = self._compare(list(r.state_pools), [loc], [end.key], f"{what} states")
            checked, bad = checked + c1 + c2, bad + b1 + b2
        self._verified(checked, bad)
        if bad:
            self.result.mismatched_pages += 1
        return bad

    def _verified(self, checked: int, bad: int) -> None:
        """``checked`` bytes compared, ``bad`` of them wrong: in the result and the metrics."""
        res = self.result
        res.verified_bytes += checked
        res.mismatched_bytes += bad
        if self.metrics is not None:
            self.metrics.m["demo_verified_bytes"].inc(checked)
            if bad:
                self.metrics.m["demo_mismatched_bytes"].inc(bad)

    def _after_run(self) -> None:
        if self.hooks is not None and self.hooks.l3:
            self.hooks.l3_settle(self.cfg.timeout)  # L3 writes acked: final counts

    def _on_ack(self, kind: str, ack: Any) -> None:
        if self.metrics is not None:
            self.metrics.m["demo_op_seconds"].labels(kind).observe(float(ack.seconds))

    # ------------------------------------------------------------------ requests
    def _on_account(self, dev: int, host: int, miss: int, dev_only: int) -> None:
        if self.metrics is None:
            return
        m = self.metrics.m
        m["demo_requests"].inc()
        m["demo_prefix_tokens"].labels("device").inc(dev)
        m["demo_prefix_tokens"].labels("host").inc(host)
        m["demo_prefix_tokens"].labels("miss").inc(miss)
        m["demo_device_only_hit_tokens"].inc(dev_only)
        m["demo_tree_pages"].labels("device").set(self.tree.device_pages)
        m["demo_tree_pages"].labels("host").set(self.tree.host_pages)
        lost = self.tree.stats.host_offline
        if lost > self._lost_seen:
            m["demo_host_tier_lost"].inc(lost - self._lost_seen)
            self._lost_seen = lost

    def _preempt(self, req: Request) -> None:
        """Swap the request's slot state out to the host and back into another slot."""
        assert self.client is not None
        n = self.cfg.req_slots
        src, dst = req.rid % n, (req.rid + 1) % n
        ids = self._fill_slot(src, req)
        before = {p.name: [b.clone() for b in self.pools.layers[p.name]] for p in self.slot_pools}
        if self.cuda:
            torch.cuda.synchronize()
        from hicache.engine.acks import AckTimeout, DaemonUnreachable

        back = None
        try:
            op = self.client.swap_out(src, request=f"r{req.rid}", timeout=self.cfg.timeout)
            self.client.wait_ack(op, self.cfg.timeout)
            self.client.clear_slot([src], timeout=self.cfg.timeout)
            back = self.client.swap_in(op.host_row, dst, release=True, request=f"r{req.rid}",
                                       timeout=self.cfg.timeout)
            self.client.wait_ack(back, self.cfg.timeout)
        except (DaemonUnreachable, AckTimeout):
            self.tree.lose_host_tier()  # same fallback as the page path: recompute from now on
            return
        except HicacheError as e:  # refused or failed: nothing to verify, counted
            self.result.state_swap_failures += 1
            if self.result.first_mismatch is None:
                self.result.first_mismatch = f"request {req.rid} state swap failed: {e}"
            if back is not None:  # a failed swap_in keeps the saved row: the demo gives it back
                try:
                    self.client.free({"req_slot": [op.host_row]}, request=f"r{req.rid}",
                                     timeout=self.cfg.timeout)
                except HicacheError:
                    pass  # counted above; the row goes back with the registration
            return
        # the state arrived in ``dst``; ``src`` was cleared (whole slots: zeros), unless it is
        # ``dst``; every other slot is as it was
        bad = 0
        others = [x for x in range(n) if x not in (src, dst)]
        for spec in self.slot_pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                bad += self.content.mismatches(spec.name, layer, buf, torch.tensor([dst]), ids)
                raw = buf.view(torch.uint8)
                if src != dst:
                    bad += int((raw[src] != 0).sum().item())
                if others:
                    was = before[spec.name][layer].view(torch.uint8)
                    bad += int((raw[others] != was[others]).sum().item())
        slots = 1 + (src != dst) + len(others)
        nbytes = sum(p.page_bytes * p.num_layers for p in self.slot_pools) * slots
        self._verified(nbytes, bad)
        if bad and self.result.first_mismatch is None:
            self.result.first_mismatch = f"request {req.rid} state swap: {bad} bytes differ"
        self.result.state_swaps += 1

    # ------------------------------------------------------------------ report
    def summary(self) -> dict[str, Any]:
        """Everything the demo reports, JSON-able."""
        r, t, h = self.result, self.tree.stats, self.hooks
        hs = h.stats if h is not None else None

        def gbps(k: str) -> float:
            if hs is None or hs.exec_seconds[k] <= 0:
                return 0.0
            return hs.bytes[k] / hs.exec_seconds[k] / 1e9

        def lat(k: str, q: float) -> float:
            v = percentile(hs.latencies[k], q) if hs is not None else None
            return 0.0 if v is None else v * 1e3

        out: dict[str, Any] = self.tree_summary()
        out.update({
            "bytes_backed_up": hs.bytes["backup"] if hs else 0,
            "bytes_loaded": hs.bytes["load"] if hs else 0,
            "pages_backed_up": t.backed_up_pages,
            "pages_loaded": t.loaded_pages,
            "backup_ops": hs.ops["backup"] if hs else 0,
            "load_ops": hs.ops["load"] if hs else 0,
            "backup_gbps": round(gbps("backup"), 3),
            "load_gbps": round(gbps("load"), 3),
            "backup_latency_ms_p50": round(lat("backup", 0.50), 3),
            "backup_latency_ms_p99": round(lat("backup", 0.99), 3),
            "load_latency_ms_p50": round(lat("load", 0.50), 3),
            "load_latency_ms_p99": round(lat("load", 0.99), 3),
            "verified": (r.mismatched_bytes == 0 and t.transfer_failures == 0
                         and r.state_swap_failures == 0),
            "verified_bytes": r.verified_bytes,
            "mismatched_bytes": r.mismatched_bytes,
            "first_mismatch": r.first_mismatch,
            "state_swaps": r.state_swaps,
            "state_swap_failures": r.state_swap_failures,
            "host_tier_lost": t.host_offline,
            "seconds": round(r.seconds, 3),
            "config": asdict(self.cfg),
            "page_bytes": self.page_bytes,
        })
        if h is not None and h.l3:
            ls = h.l3_stats
            out.update(l3_hit_tokens=r.l3_hit_tokens, l3_bytes_read=ls["bytes_read"],
                       l3_bytes_written=ls["bytes_written"], l3_errors=ls["errors"],
                       l3_pages_written=ls["written"], l3_pages_skipped=ls["skipped"],
                       l3_error_kinds=dict(sorted(h.l3_error_kinds.items())))
        return out

    def close(self) -> None:
        """Finish backups in flight, unregister, release the device pools."""
        try:
            self.tree.drain()
            if self.client is not None and self.tree.host_online:
                self.client.unregister(timeout=self.cfg.timeout)
        except Exception:  # noqa: BLE001 - closing: a dead daemon has nothing left to free
            pass
        finally:
            self.pools.close()
