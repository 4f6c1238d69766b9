"""Simulated DSV4 worker: device pools, a radix tree over them, and the daemon as host tier.

``Worker(cfg, client)`` allocates the device pools of the layout (CUDA tensors on a GPU,
shared-memory CPU tensors otherwise) through ``hicache.engine.device_pools``, registers them with the
daemon, and runs requests (``run_request`` / ``run``):

1. match the prefix in the radix tree: device hits, then host hits, which the tree loads into
   fresh device rows (``ClientHooks`` -> daemon LOAD) and waits for;
2. verify every byte of every page the request reads from the cache, loaded or not, against
   the content it was written with (``PageContent``: derived from (page key, pool, layer));
3. "prefill" the rest: write the content of every new page into fresh device rows, every pool
   and layer of each index space a page uses (``page``, plus ``swa_page`` in paged SWA mode);
   the decode output occupies rows as well, and is cached when the workload says so;
4. release: insert the new pages, unlock the prefix, let the write policy back pages up.

The same requests also run through a device-only tree of the same size (no host tier, no
copies): the counterfactual for "prefill tokens saved". With ``preempt_every=N`` every N-th
request's request-slot state (``req_slot`` pools) is swapped out to the host and back into
another slot through the daemon, and verified. Counters live in ``Result`` and, for Prometheus,
in ``DemoMetrics`` (``hicache_demo_*``: the daemon's catalog has no tier-hit metrics).
"""
from __future__ import annotations

import time
from dataclasses import asdict, dataclass
from typing import Any, Callable, Iterable, Sequence

import torch
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from hicache.engine.device_pools import DevicePools
from hicache.core.errors import HicacheError
from hicache.engine.hooks import ClientHooks
from hicache.core.layout import Layout, build_layout, preset
from hicache.core.metric_defs import LATENCY_BUCKETS, MetricDef
from hicache.sim.page_content import PageContent
from hicache.engine.radix import PAGE_TOKENS, RadixTree
from hicache.sim.workload import Request

DEMO_CATALOG: tuple[MetricDef, ...] = (
    MetricDef("demo_requests", "counter", (),
              "Requests the simulated worker finished.",
              "How far is the replay?"),
    MetricDef("demo_prefix_tokens", "counter", ("tier",),
              "Input tokens by where their KV came from: device (prefix hit on the device "
              "tier), host (prefix hit loaded from the host tier), miss (computed).",
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

    def serve_http(self, port: int, addr: str = "127.0.0.1") -> int:
        from prometheus_client import start_http_server

        res = start_http_server(port, addr=addr, registry=self.registry)
        server = res[0] if isinstance(res, tuple) else None
        return int(server.server_port) if server is not None else port


@dataclass
class WorkerConfig:
    preset: str = "dsv4-tiny"
    swa_mode: str = "paged"
    device_pages: int = 128  # device rows per page space (page, and swa_page when paged)
    host_pages: int = 1024  # host pages the tree may use (the daemon is sized to match)
    req_slots: int = 4
    policy: str = "write_through"
    seed: int = 0
    device: str = "cpu"
    verify_hits: bool = True  # also verify device hits, not only loaded pages
    preempt_every: int = 0  # swap a request's slot state out and back every N requests
    timeout: float = 30.0  # per daemon call / transfer

    def layout(self) -> Layout:
        return build_layout(preset(self.preset), swa_mode=self.swa_mode)

    def device_rows(self, layout: Layout | None = None) -> dict[str, int]:
        layout = layout or self.layout()
        rows = {"page": self.device_pages, "swa_page": self.device_pages,
                "req_slot": self.req_slots}
        return {s: n for s, n in rows.items() if layout.space_pools(s)}


def page_spaces(layout: Layout) -> list[str]:
    """Index spaces one radix page uses: ``page``, and ``swa_page`` in paged SWA mode."""
    return [s for s in ("page", "swa_page") if layout.space_pools(s)]


def percentile(xs: Sequence[float], q: float) -> float:
    if not xs:
        return 0.0
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q / 100 * (len(s) - 1))))]


@dataclass
class Result:
    requests: int = 0
    input_tokens: int = 0
    device_hit_tokens: int = 0
    host_hit_tokens: int = 0
    miss_tokens: int = 0
    device_only_hit_tokens: int = 0
    verified_bytes: int = 0
    mismatched_bytes: int = 0
    mismatched_pages: int = 0
    state_swaps: int = 0
    state_swap_failures: int = 0
    seconds: float = 0.0
    first_mismatch: str | None = None

    @property
    def prefill_tokens_saved(self) -> int:
        """Tokens not computed thanks to the host tier (vs the device-only replay)."""
        return self.device_hit_tokens + self.host_hit_tokens - self.device_only_hit_tokens


class Worker:
    """A simulated DSV4 worker (see the module docstring). ``client=None``: device-only."""

    def __init__(self, cfg: WorkerConfig, client: Any = None,
                 metrics: DemoMetrics | None = None) -> None:
        self.cfg = cfg
        self.layout = cfg.layout()
        self.spaces = page_spaces(self.layout)
        self.client = client
        self.metrics = metrics
        self.cuda = cfg.device.startswith("cuda")
        self.pools = DevicePools(self.layout, cfg.device_rows(self.layout), cfg.device)
        self.content = PageContent(self.layout, cfg.seed)
        self.page_bytes = sum(self.layout.row_bytes(s) for s in self.spaces)
        self.slot_pools = self.layout.space_pools("req_slot")
        self.hooks: ClientHooks | None = None
        try:
            if client is not None:
                client.register(self.pools, events=1 if self.cuda else 0, name="hicache-demo",
                                timeout=cfg.timeout)
                self.hooks = ClientHooks(client, self.spaces, timeout=cfg.timeout,
                                         wait_event=0 if self.cuda else None,
                                         on_ack=self._on_ack)
        except BaseException:
            self.pools.close()
            raise
        self.tree = RadixTree(cfg.device_pages, self.hooks, policy=cfg.policy,
                              host_capacity=cfg.host_pages if client is not None else None)
        self.shadow = RadixTree(cfg.device_pages)  # device-only counterfactual, no copies
        self.result = Result()
        self._lost_seen = 0

    # ------------------------------------------------------------------ content
    def _fill(self, keys: Sequence[int], rows: Sequence[int]) -> None:
        if not rows:
            return
        ids = torch.tensor(keys, dtype=torch.int64)
        r = torch.tensor(rows, dtype=torch.int64)
        for space in self.spaces:
            for spec in self.layout.space_pools(space):
                for layer, buf in enumerate(self.pools.layers[spec.name]):
                    self.content.fill(spec.name, layer, buf, r, ids)
        if self.cuda:
            if self.client is not None and self.client.backup_events:
                self.client.backup_events[0].record()  # the daemon's backups wait on it
            else:
                torch.cuda.synchronize()

    def _verify(self, keys: Sequence[int], rows: Sequence[int], what: str) -> None:
        if not rows:
            return
        ids = torch.tensor(keys, dtype=torch.int64)
        r = torch.tensor(rows, dtype=torch.int64)
        bad = 0
        for space in self.spaces:
            for spec in self.layout.space_pools(space):
                for layer, buf in enumerate(self.pools.layers[spec.name]):
                    n = self.content.mismatches(spec.name, layer, buf, r, ids)
                    if n and self.result.first_mismatch is None:
                        self.result.first_mismatch = (
                            f"{what}: {n} bytes differ in pool {spec.name} layer {layer} "
                            f"(pages {list(keys)[:4]}..., device rows {list(rows)[:4]}...)")
                    bad += n
        nbytes = len(rows) * self.page_bytes
        self.result.verified_bytes += nbytes
        self.result.mismatched_bytes += bad
        if bad:
            self.result.mismatched_pages += 1
        if self.metrics is not None:
            self.metrics.m["demo_verified_bytes"].inc(nbytes)
            if bad:
                self.metrics.m["demo_mismatched_bytes"].inc(bad)

    def _on_ack(self, kind: str, ack: Any) -> None:
        if self.metrics is not None:
            self.metrics.m["demo_op_seconds"].labels(kind).observe(float(ack.seconds))

    # ------------------------------------------------------------------ requests
    def run_request(self, req: Request) -> None:
        keys = list(req.cache_pages[: req.max_prefix_pages])
        prefix = self.tree.prepare(keys)
        if self.cfg.verify_hits and prefix.device_pages:
            self._verify(keys[: prefix.device_pages],
                         [n.device for n in prefix.nodes[: prefix.device_pages]],
                         f"request {req.rid} device hit")
        if prefix.loaded:
            self._verify([k for k, _ in prefix.loaded], [r for _, r in prefix.loaded],
                         f"request {req.rid} load")
        new_keys = list(req.cache_pages[prefix.pages:])
        rows = self.tree.alloc_device(req.total_pages - prefix.pages)
        self._fill(new_keys, rows[: len(new_keys)])  # prefill (and decode) writes the KV
        if self.cfg.preempt_every and self.slot_pools and self.tree.host_online \
                and req.rid % self.cfg.preempt_every == 0:
            self._preempt(req)
        self.tree.release(prefix, list(req.cache_pages), rows[: len(new_keys)])
        self.tree.free_device(rows[len(new_keys):])
        dev_only = self._counterfactual(req, keys)
        self._account(req, prefix.device_pages, prefix.host_pages, dev_only)
        if self.client is not None and self.tree.host_online:
            try:
                self.client.maybe_heartbeat()
            except Exception:  # noqa: BLE001 - a dead daemon shows up in the tree's next call
                pass

    def _counterfactual(self, req: Request, keys: list[int]) -> int:
        sp = self.shadow.prepare(keys)
        n_new = len(req.cache_pages) - sp.pages
        rows = self.shadow.alloc_device(req.total_pages - sp.pages)
        self.shadow.release(sp, list(req.cache_pages), rows[:n_new])
        self.shadow.free_device(rows[n_new:])
        return sp.device_pages * PAGE_TOKENS

    def _account(self, req: Request, dev_pages: int, host_pages: int, dev_only: int) -> None:
        r = self.result
        dev, host = dev_pages * PAGE_TOKENS, host_pages * PAGE_TOKENS
        miss = req.input_tokens - dev - host
        r.requests += 1
        r.input_tokens += req.input_tokens
        r.device_hit_tokens += dev
        r.host_hit_tokens += host
        r.miss_tokens += miss
        r.device_only_hit_tokens += dev_only
        if self.metrics is not None:
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
        state_id = -(req.rid + 1)  # content ids of request state never collide with page keys
        ids = torch.tensor([state_id], dtype=torch.int64)
        for spec in self.slot_pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                self.content.fill(spec.name, layer, buf, torch.tensor([src]), ids)
        if self.cuda:
            torch.cuda.synchronize()
        from hicache.engine.acks import AckTimeout, DaemonUnreachable

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
            return
        bad = 0
        for spec in self.slot_pools:
            for layer, buf in enumerate(self.pools.layers[spec.name]):
                bad += self.content.mismatches(spec.name, layer, buf, torch.tensor([dst]), ids)
        nbytes = sum(p.page_bytes * p.num_layers for p in self.slot_pools)
        self.result.verified_bytes += nbytes
        self.result.mismatched_bytes += bad
        if bad and self.result.first_mismatch is None:
            self.result.first_mismatch = f"request {req.rid} state swap: {bad} bytes differ"
        self.result.state_swaps += 1

    def run(self, requests: Iterable[Request],
            progress: Callable[["Worker", int], None] | None = None) -> Result:
        t0 = time.perf_counter()
        for i, req in enumerate(requests, 1):
            self.run_request(req)
            self.result.seconds = time.perf_counter() - t0
            if progress is not None:
                progress(self, i)
        self.tree.drain()
        self.result.seconds = time.perf_counter() - t0
        return self.result

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
            return percentile(hs.latencies[k], q) * 1e3 if hs is not None else 0.0

        out: dict[str, Any] = {
            "requests": r.requests,
            "input_tokens": r.input_tokens,
            "device_hit_tokens": r.device_hit_tokens,
            "host_hit_tokens": r.host_hit_tokens,
            "miss_tokens": r.miss_tokens,
            "device_only_hit_tokens": r.device_only_hit_tokens,
            "prefill_tokens_saved": r.prefill_tokens_saved,
            "bytes_backed_up": hs.bytes["backup"] if hs else 0,
            "bytes_loaded": hs.bytes["load"] if hs else 0,
            "pages_backed_up": t.backed_up_pages,
            "pages_loaded": t.loaded_pages,
            "backup_ops": hs.ops["backup"] if hs else 0,
            "load_ops": hs.ops["load"] if hs else 0,
            "backup_gbps": round(gbps("backup"), 3),
            "load_gbps": round(gbps("load"), 3),
            "backup_latency_ms_p50": round(lat("backup", 50), 3),
            "backup_latency_ms_p99": round(lat("backup", 99), 3),
            "load_latency_ms_p50": round(lat("load", 50), 3),
            "load_latency_ms_p99": round(lat("load", 99), 3),
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
            "tree": t.as_dict(),
        }
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
