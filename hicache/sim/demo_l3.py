"""``hicache demo --l3 mooncake``: two simulated workers sharing prefixes through Mooncake Store.

Starts a local Mooncake Store (``mooncake_master`` with its embedded HTTP metadata server and
one storage member, every listener on 127.0.0.1: see ``hicache.engine.l3_master``), then runs
the workload (the built-in generator or a trace, e.g. ``--trace
../shared/data/synthetic_trace.jsonl``) twice with the same routing, side by side:

* **independent**: two daemons without L3, two workers;
* **l3**: the same, each daemon with ``--l3 mooncake``: a worker whose tree misses a prefix
  (or holds it past its last checkpoint) asks L3 for the pages after it and, in the
  checkpoints mirror, for the deepest boundary checkpoint; what the other worker computed
  comes back (cross-instance hits), and so do pages the worker's own host tier evicted.

Routing (``--l3-routing``): ``conversation`` (default: a router with session affinity; each
conversation's turns run on one instance, new conversations alternate; ``conversations``
finds a trace's conversations) or ``alternate`` (request by request: a conversation's turns
land on both instances). ``--l3-conversations N`` keeps the first N conversations with two
turns or more (a bounded multi-turn sample of a trace).

In both runs worker A's daemon is killed (SIGKILL) halfway and started again, and A restarts
with a fresh tree and fresh device pools: with L3 its prefixes come back from the store.
Every page and checkpoint loaded, from the host tier or from L3, is verified byte for byte
against the content it was written with. The JSON adds ``l3_hit_tokens``, ``l3_bytes_read`` /
``l3_bytes_written``, ``l3_errors`` (by reason in ``l3_error_kinds``),
``cross_instance_hit_tokens``, ``restart_hit_tokens``,
``own_l3_hit_tokens`` (pages the instance itself wrote, evicted from its host tier since),
``l3_checkpoints`` (checkpoints L3 supplied) and the listeners found (all must be loopback).
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import sys
import time
from typing import Any, Callable

from hicache.core.errors import UsageError
from hicache.engine.daemon_process import DaemonProcess
from hicache.engine.radix import PAGE_TOKENS

SUM_KEYS = ("requests", "input_tokens", "device_hit_tokens", "host_hit_tokens", "miss_tokens",
            "unresumable_tokens", "verified_bytes", "mismatched_bytes", "l3_hit_tokens",
            "l3_bytes_read", "l3_bytes_written", "l3_errors", "l3_pages_written",
            "l3_pages_skipped", "l3_checkpoints", "host_tier_lost")


SEGMENT_CAP = 6 << 30


def _err(msg: str) -> None:
    print(f"[demo l3] {msg}", file=sys.stderr, flush=True)


def _daemon(plain: Callable[..., DaemonProcess], cfg: Any, store: Any) -> DaemonProcess:
    """The plain demo's daemon (``plain``: same host sizing per mirror), with ``--l3
    mooncake`` when there is a store."""
    from hicache.engine.l3_master import loopback_env

    if store is None:
        return plain(cfg, None)
    return plain(cfg, None, ("--l3", "mooncake", "--l3-master", store.master_addr,
                             "--l3-metadata", store.metadata_url,
                             "--l3-scope", f"hicache-demo/{cfg.preset}"), loopback_env())


def conversations(reqs: list) -> list[int]:
    """A conversation id per request, numbered in order of first appearance. Generated
    requests carry their session. A trace request continues the conversation of the latest
    earlier request whose whole input, or all of it but its last (partial) 512-token block,
    leads its own input; otherwise it starts a new conversation."""
    if all(r.session >= 0 for r in reqs):
        ids: dict[int, int] = {}
        return [ids.setdefault(r.session, len(ids)) for r in reqs]
    ends: dict[tuple, int] = {}
    out: list[int] = []
    n = 0
    for r in reqs:
        p = tuple(r.pages)
        c = next((ends[p[:k]] for k in range(len(p), 0, -1) if p[:k] in ends), None)
        if c is None:
            c, n = n, n + 1
        out.append(c)
        ends[p] = c
        if len(p) > 2:
            ends[p[:-2]] = c
    return out


def multi_turn_sample(reqs: list, conv: list[int], n: int) -> tuple[list, list[int]]:
    """The requests (and their conversation ids) of the first ``n`` conversations with two
    turns or more, in workload order."""
    turns: dict[int, int] = {}
    for c in conv:
        turns[c] = turns.get(c, 0) + 1
    keep: list[int] = []
    for c in conv:
        if turns[c] >= 2 and c not in keep and len(keep) < n:
            keep.append(c)
    chosen = set(keep)
    pairs = [(r, c) for r, c in zip(reqs, conv) if c in chosen]
    return [r for r, _ in pairs], [c for _, c in pairs]


class Instance:
    """One daemon and the worker on it; ``restart()`` kills the daemon and starts both anew."""

    def __init__(self, name: str, cfg: Any, store: Any,
                 plain: Callable[..., DaemonProcess]) -> None:
        self.name, self.cfg, self.store = name, cfg, store
        self.daemon = _daemon(plain, cfg, store)
        self.incarnation = 0
        self.worker: Any = None
        self.finished: list[dict[str, Any]] = []  # summaries of earlier incarnations
        try:
            self.daemon.start()
            self._attach()
        except BaseException:  # an interrupt or a refusal here leaves nothing running
            self.abandon()
            raise

    @property
    def tag(self) -> str:
        return f"{self.name}{self.incarnation}"

    def _attach(self) -> None:
        from hicache.engine.client import Client
        from hicache.sim.simulator import Worker

        client = Client(self.daemon.address, timeout=self.cfg.timeout, name=self.tag)
        try:
            if self.store is not None:
                deadline = time.monotonic() + 30
                while not client.stats()["l3"]["online"]:
                    if time.monotonic() > deadline:
                        raise RuntimeError(f"{self.tag}: the daemon's L3 client is not online")
                    time.sleep(0.1)
            self.worker = Worker(self.cfg, client)
        except BaseException:
            client.close()
            raise
        if self.worker.hooks is not None and self.cfg.l3:
            self.worker.hooks.l3_put_log = []

    def _summary(self) -> dict[str, Any]:
        return {**self.worker.summary(),
                "l3_checkpoints": self.worker.tree.stats.l3_hit_checkpoints}

    def abandon(self) -> None:
        """Close what is open, without summaries (a start, a restart or a run that failed);
        the daemon is stopped and its private directory removed whatever else fails."""
        w, self.worker = self.worker, None
        try:
            if w is not None:
                try:
                    w.close()
                finally:
                    w.client.close()
        finally:
            self.daemon.close()

    def restart(self) -> list[Any]:
        """Drain, then kill the daemon (a crash) and start it again; returns the page keys the
        drain's L3 puts wrote (the caller records them as this incarnation's: they went with
        the old worker, and later hits on them were counted in no category)."""
        self.worker.tree.drain()
        drained: list[Any] = []
        if self.worker.hooks is not None and self.cfg.l3:
            self.worker.hooks.l3_settle(self.cfg.timeout)
            drained = list(self.worker.hooks.l3_put_log)
        self.finished.append(self._summary())
        self.daemon.kill()  # a crash: nothing is shut down cleanly
        w, self.worker = self.worker, None
        w.client.close()
        w.pools.close()
        self.daemon.start()
        self.incarnation += 1
        self._attach()
        return drained

    def close(self) -> list[dict[str, Any]]:
        """The summaries of every incarnation; everything closed, also when that fails."""
        try:
            self.worker.tree.drain()
            if self.worker.hooks is not None and self.cfg.l3:
                self.worker.hooks.l3_settle(self.cfg.timeout)
            out = self.finished + [self._summary()]
        finally:
            self.abandon()
        return out


def _each(insts: list[Instance], close: Callable[[Instance], Any]) -> list[dict[str, Any]]:
    """``close`` every instance, the later ones also when an earlier one fails (its error is
    raised once all ran); the summaries they return, in order."""
    out: list[dict[str, Any]] = []
    err: BaseException | None = None
    for inst in insts:
        try:
            out += close(inst) or []
        except BaseException as e:  # noqa: BLE001 - raised below, after the others closed
            err = err or e
    if err is not None:
        raise err
    return out


def _replay(reqs: list, route: list[int], cfg: Any, store: Any, label: str,
            progress_s: float, plain: Callable[..., DaemonProcess]) -> dict[str, Any]:
    """Both instances over ``reqs`` (request i on instance ``route[i]``), A restarted halfway;
    the merged figures."""
    writer: dict[Any, str] = {}  # page key -> tag of the incarnation that first wrote it
    cross = restart_hits = own = 0
    t0 = time.monotonic()
    last = t0
    pids: list[int] = []
    insts: list[Instance] = []
    try:
        for name in "AB":
            insts.append(Instance(name, cfg, store, plain))
        a, b = insts
        for i, req in enumerate(reqs):
            if i == len(reqs) // 2:
                _err(f"{label}: killing A's daemon (SIGKILL) and starting it again")
                tag = a.tag
                for k in a.restart():  # (its drain's L3 puts)
                    writer.setdefault(k, tag)
            inst = (a, b)[route[i]]
            w = inst.worker
            w.run_request(req)
            for k in w.last_l3_keys:
                src = writer.get(k)
                if src is not None and src[0] != inst.name:
                    cross += PAGE_TOKENS
                elif src is not None and src != inst.tag:
                    restart_hits += PAGE_TOKENS
                elif src is not None:
                    own += PAGE_TOKENS
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
    except BaseException:  # an interrupt or a failure: every instance still goes
        _each(insts, Instance.abandon)
        raise
    parts = _each(insts, Instance.close)
    out: dict[str, Any] = {k: sum(p.get(k, 0) for p in parts) for k in SUM_KEYS}
    kinds: dict[str, int] = {}
    for p in parts:
        for why, n in p.get("l3_error_kinds", {}).items():
            kinds[why] = kinds.get(why, 0) + n
    out["l3_error_kinds"] = dict(sorted(kinds.items()))
    out["cached_tokens"] = out["device_hit_tokens"] + out["host_hit_tokens"]
    out["verified"] = out["mismatched_bytes"] == 0 and all(p["verified"] for p in parts)
    out["seconds"] = round(time.monotonic() - t0, 1)
    if store is not None:
        out["cross_instance_hit_tokens"] = cross
        out["restart_hit_tokens"] = restart_hits
        out["own_l3_hit_tokens"] = own
        out["listeners"] = [a for _, a in found]
    return out


def _segment_bytes(reqs: list, cfg: Any) -> int:
    """A store segment that holds every distinct page and every checkpoint the replay can
    write (capped at ``SEGMENT_CAP``: past it Mooncake evicts, and evicted objects are
    misses)."""
    from hicache.core.resume import ResumeModel

    lay = cfg.layout()
    r = ResumeModel(lay)
    keys = {k for q in reqs for k in q.cache_pages}
    if cfg.mirror == "full":
        need = len(keys) * (r.full_page_bytes + 64)
    else:
        per_req = 2 + (max(len(q.cache_pages) for q in reqs) // cfg.checkpoint_every
                       if cfg.checkpoint_every else 0)
        need = len(keys) * (r.page_bytes + 64) + len(reqs) * per_req * (r.checkpoint_bytes + 64)
    return min(SEGMENT_CAP, max(256 << 20, int(need * 1.2) + (64 << 20)))


def _listeners(store: Any, daemon_pids: list[int]) -> list[tuple[int, str]]:
    if store is None:
        return []
    from hicache.engine.l3_master import listeners, non_loopback

    found = listeners(store.pids() + daemon_pids)
    bad = non_loopback(found)
    if bad:
        raise RuntimeError(f"listeners off loopback: {bad}")
    return found


def run_l3(args: argparse.Namespace, reqs: list, cfg: Any, what: str,
           plain_daemon: Callable[..., DaemonProcess]) -> int:
    """The demo (module docstring); ``plain_daemon(cfg, metrics_port, extra, env)`` makes the
    plain demo's daemon (``hicache.sim.demo._daemon``)."""
    from hicache.engine.l3_master import LocalStore, mooncake_dir

    if mooncake_dir() is None:
        raise UsageError("--l3 mooncake needs the Mooncake client: pip install 'hicache[l3]' "
                         "(and the system libibverbs1)")
    if cfg.device != "cpu":
        raise UsageError("--l3 mooncake runs the two simulated workers in CPU mode here; "
                         "add --device cpu")
    conv = conversations(reqs)
    if args.l3_conversations:
        reqs, conv = multi_turn_sample(reqs, conv, args.l3_conversations)
        if not reqs:
            raise UsageError("--l3-conversations: the workload has no conversation with two "
                             "turns or more")
        what += f", the {len(set(conv))} first multi-turn conversations ({len(reqs)} requests)"
    route = [c % 2 for c in conv] if args.l3_routing == "conversation" else \
        [i % 2 for i in range(len(reqs))]
    segment = _segment_bytes(reqs, cfg)
    _err(f"{what}; two instances, {cfg.preset} swa={cfg.swa_mode} mirror {cfg.mirror}, "
         f"{cfg.device_pages} device pages and {cfg.host_pages} host pages each; routing "
         f"{args.l3_routing}; store segment {segment >> 20} MiB")
    base = _replay(reqs, route, dataclasses.replace(cfg, l3=False), None, "independent",
                   args.progress_seconds, plain_daemon)
    with LocalStore(segment=str(segment)) as store:
        _err(f"Mooncake master {store.master_addr}, metadata {store.metadata_url}")
        l3 = _replay(reqs, route, dataclasses.replace(cfg, l3=True), store, "l3",
                     args.progress_seconds, plain_daemon)
    tot = max(1, l3["input_tokens"])
    routing = {"conversation": "by conversation (each conversation on one instance)",
               "alternate": "alternate requests"}[args.l3_routing]
    out = {"workload": what, "instances": 2, "routing": routing, "mirror": cfg.mirror,
           "conversations": len(set(conv)),
           "restart": "instance A's daemon SIGKILLed and restarted halfway",
           "independent": base, "l3": l3,
           "l3_hit_tokens": l3["l3_hit_tokens"], "l3_bytes_read": l3["l3_bytes_read"],
           "l3_bytes_written": l3["l3_bytes_written"], "l3_errors": l3["l3_errors"],
           "l3_error_kinds": l3["l3_error_kinds"],
           "cross_instance_hit_tokens": l3["cross_instance_hit_tokens"],
           "restart_hit_tokens": l3["restart_hit_tokens"],
           "own_l3_hit_tokens": l3["own_l3_hit_tokens"], "l3_checkpoints": l3["l3_checkpoints"],
           "mismatched_bytes": base["mismatched_bytes"] + l3["mismatched_bytes"],
           "cached_tokens_gain": l3["cached_tokens"] - base["cached_tokens"],
           "verified": base["verified"] and l3["verified"]}
    if args.json:
        print(json.dumps(out), flush=True)
    else:
        checked = base["verified_bytes"] + l3["verified_bytes"]

        def pct(n: int) -> str:
            return f"{n:>12,} tokens ({100 * n / tot:5.1f}%)"

        print("\n".join([
            f"hicache demo --l3 mooncake: {what}, two instances (routing {routing}, mirror "
            f"{cfg.mirror}), A restarted halfway",
            f"  {'':24}{'independent':>28}{'with L3':>28}",
            f"  {'cached (device+host)':24}{pct(base['cached_tokens']):>28}"
            f"{pct(l3['cached_tokens']):>28}",
            f"  {'  of which from L3':24}{'':>28}{pct(l3['l3_hit_tokens']):>28}",
            f"  {'  cross-instance':24}{'':>28}{pct(l3['cross_instance_hit_tokens']):>28}",
            f"  {'  after the restart':24}{'':>28}{pct(l3['restart_hit_tokens']):>28}",
            f"  {'  own, evicted on host':24}{'':>28}{pct(l3['own_l3_hit_tokens']):>28}",
            f"  {'missed (computed)':24}{pct(base['miss_tokens']):>28}"
            f"{pct(l3['miss_tokens']):>28}",
            f"  L3 checkpoints loaded {l3['l3_checkpoints']:,}; L3 bytes read "
            f"{l3['l3_bytes_read'] / 2**30:.2f} GiB, written "
            f"{l3['l3_bytes_written'] / 2**30:.2f} GiB, errors {l3['l3_errors']}"
            + (f" ({', '.join(f'{k} {v}' for k, v in l3['l3_error_kinds'].items())})"
               if l3["l3_error_kinds"] else ""),
            f"  verified: {out['verified']} ({checked / 2**30:.2f} GiB checked, "
            f"{out['mismatched_bytes']} bytes differ); listeners all on loopback: "
            f"{', '.join(l3['listeners'][:8])}",
        ]), flush=True)
    return 0 if out["verified"] else 1
