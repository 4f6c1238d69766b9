"""Reliability tooling shared by ``hicache bench fuzz`` / ``bench soak`` and the reliability tests.

* ``DaemonRunner(address, ...)`` — a CPU-mode ``hicache serve`` subprocess on a fixed address
  that can be killed (SIGKILL) and started again on the same address.
* ``run_fuzz(address, messages, seed)`` — victim, attacker and strangers against a live daemon,
  then the checks: every message answered with an error, the daemon alive, host row accounting
  exact, allocator invariants, the victim's rows unchanged byte for byte.
* ``daemon_check(client)`` — the invariant checks through ``stats`` (what any test can ask).

The parts live in their own modules and are re-exported here, so callers import from
``hicache.fuzz.runner`` only: ``hicache.fuzz.peers`` (``ShmBuffers``, ``Pattern``, ``mix64``,
``RawPeer``, ``Victim``), ``hicache.fuzz.messages`` (``Hostile``), ``hicache.fuzz.cases``
(``Case``, ``World``, ``Deferred``).

Nothing here is imported by the daemon; everything talks to it through the wire protocol.
"""
from __future__ import annotations

import os
import random
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Mapping, Sequence

from hicache.engine.daemon_process import DaemonProcess
from hicache.fuzz.cases import Case, Deferred, World
from hicache.fuzz.messages import Hostile
from hicache.fuzz.sparse_attacks import SparseVictim
from hicache.fuzz.peers import ALIGN, Pattern, RawPeer, ShmBuffers, Victim, _space_rows, mix64
from hicache.core.layout import Layout, build_layout, preset

__all__ = ["ALIGN", "ROOT", "Case", "DaemonRunner", "Deferred", "Hostile", "Pattern", "RawPeer",
           "ShmBuffers", "Victim", "World", "daemon_check", "failed_checks", "metric_total", "mix64",
           "private_address", "run_fuzz"]

ROOT = Path(__file__).resolve().parents[2]  # the checkout
SPARSE_FLAGS = ("--sparse-rows", "8", "--min-sparse-prompt-len", "256")  # fuzz daemons: a region


# ----------------------------------------------------------------------------- daemon process
class DaemonRunner(DaemonProcess):
    """``hicache serve --device cpu`` on ``address`` (log level warning, run from the checkout);
    ``start()`` waits until it answers. The shared ``DaemonProcess`` with this module's defaults."""

    def __init__(self, address: str, *, preset_name: str = "dsv4-tiny",
                 device_rows: str = "page=16,swa_page=8,req_slot=4",
                 host: Sequence[str] = ("--host-ratio", "2"), heartbeat_timeout: float = 10.0,
                 extra: Sequence[str] = (), log_path: str | os.PathLike | None = None,
                 env: Mapping[str, str] | None = None, socket_flag: bool = True,
                 client_kw: Mapping[str, Any] | None = None) -> None:
        """``socket_flag=False``: no ``--socket`` (the daemon picks its default, which must be
        ``address``). ``client_kw``: extra ``Client`` arguments of the readiness probe (keys)."""
        super().__init__(address, device="cpu", preset=preset_name, device_rows=device_rows,
                         host=host, heartbeat_timeout=heartbeat_timeout, log_level="warning",
                         extra=extra, env=env, log_path=log_path, socket_flag=socket_flag,
                         cwd=ROOT, ready_timeout=90.0, probe_kw=client_kw)


RELEASE_WAIT_S = 10.0  # how long released rows may take to come back after the unregisters


def private_address(prefix: str = "hcr-") -> tuple[str, str]:
    """(ipc address, its directory): a fresh 0700 directory under /tmp (ipc paths are short)."""
    import tempfile

    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")
    os.chmod(d, 0o700)
    return f"ipc://{d}/d.sock", d



# ----------------------------------------------------------------------------- invariants
def daemon_check(client: Any, expect_used: Mapping[str, int] | None = None) -> dict[str, Any]:
    """Invariant checks through ``stats``: per space used + free = rows and (when given) used =
    ``expect_used``; nothing pending a free; ``stats`` with ``check`` runs the pool group's
    ``check_invariants`` (free and owned rows partition each space, owner counts exact) when
    the daemon offers it. Returns {"ok": bool, "problems": [...], "spaces": ..., "deep": ...}."""
    from hicache.engine.client import CommandRefused

    problems: list[str] = []
    deep: Any = "unavailable"
    try:
        h, _ = client.call("stats", {"check": True})
        deep = h.get("invariants", "unavailable")
        if deep not in ("ok", "unavailable"):
            problems.append(f"check_invariants: {deep}")
    except CommandRefused as e:
        if e.code != "bad_field":  # an older daemon without the check field
            raise
        h, _ = client.call("stats")
    spaces = h["host"]["spaces"]
    for s, st in spaces.items():
        if st["used"] + st["free"] != st["rows"]:
            problems.append(f"space {s}: used {st['used']} + free {st['free']} != {st['rows']}")
        if expect_used is not None and st["used"] != expect_used.get(s, 0):
            problems.append(f"space {s}: {st['used']} rows used, expected "
                            f"{expect_used.get(s, 0)}")
    for s, n in h.get("pending_free", {}).items():
        if n:
            problems.append(f"space {s}: {n} rows still pending a free")
    return {"ok": not problems, "problems": problems, "deep": deep,
            "spaces": {s: {k: st[k] for k in ("rows", "used", "free")} for s, st in spaces.items()},
            "workers": h.get("workers"), "clients": h.get("clients"), "stats": h}


def metric_total(stats: Mapping[str, Any], sample: str, **labels: str) -> float:
    """Sum of a metric sample in a ``stats`` reply, over entries matching ``labels``."""
    total = 0.0
    for e in stats.get("metrics", {}).get(sample, []):
        if all(e["labels"].get(k) == v for k, v in labels.items()):
            total += e["value"] or 0.0
    return total



def failed_checks(rep: Mapping[str, Any], messages: int) -> list[str]:
    """Every check of a fuzz report that did not hold (empty: the run passed)."""
    checks = [
        ("daemon alive", rep["daemon_alive"]), ("invariants hold", rep["invariants_ok"]),
        ("victim rows intact", rep["victim_rows_corrupted"] == 0),
        ("no rows left used", rep["leaked_rows"] == 0),
        ("victim sparse rows intact", rep.get("sparse_rows_corrupted", 0) == 0),
        ("sparse region clean", rep.get("sparse_region_clean", True)),
        ("every message answered", rep["unanswered"] == 0),
        ("no hostile message accepted", rep["ok_replies"] == 0),
        ("no internal error", rep["internal_errors"] == 0),
        ("every set-up step succeeded", rep["setup_failures"] == 0),
        ("only the expected error codes", rep["unexpected_codes"] == 0),
        ("errors metric counted every refusal", rep["metrics_match"]),
        ("every message sent", rep["messages"] >= messages),
    ]
    return [name for name, ok in checks if not ok]


# ----------------------------------------------------------------------------- the fuzz run
@dataclass
class _Tally:
    """What the hostile messages got: reply counters, error codes, kinds sent, first examples."""

    counts: dict[str, int] = field(default_factory=lambda: {
        "messages": 0, "setup_messages": 0, "error_replies": 0, "ok_replies": 0,
        "unanswered": 0, "internal_errors": 0, "unexpected_codes": 0, "setup_failures": 0})
    codes: dict[str, int] = field(default_factory=dict)
    kinds: dict[str, int] = field(default_factory=dict)
    examples: list[dict[str, Any]] = field(default_factory=list)
    seen: dict[tuple[str, str], int] = field(default_factory=dict)
    stopped_early: bool = False

    def note(self, kind: str, case: Case, h: dict[str, Any] | None) -> None:
        """Keep the reply as an example (at most 40, two per problem and case)."""
        k = (kind, case.name)
        self.seen[k] = self.seen.get(k, 0) + 1
        if len(self.examples) < 40 and self.seen[k] <= 2:
            self.examples.append({"problem": kind, "case": case.name, "peer": case.peer,
                                  "expected": sorted(case.expect),
                                  "reply": None if h is None else
                                  {k: v for k, v in h.items() if k != "_arrays"}})

    def setup_reply(self, case: Case, h: dict[str, Any] | None) -> bool:
        """Count a set-up step's reply and record what it returned; False: it failed."""
        self.counts["setup_messages"] += 1
        if h is None or not h.get("ok"):
            self.counts["setup_failures"] += 1
            self.counts["unanswered"] += h is None
            self.note("setup step failed", case, h)
            return False
        if case.on_ok is not None:
            case.on_ok(h)
        return True

    def hostile_reply(self, case: Case, h: dict[str, Any] | None) -> None:
        """Count a hostile message's reply: none, accepted, or refused with which code."""
        counts = self.counts
        counts["messages"] += 1
        self.kinds[case.name] = self.kinds.get(case.name, 0) + 1
        if h is None:
            counts["unanswered"] += 1
            self.note("no reply", case, h)
        elif h.get("ok"):
            counts["ok_replies"] += 1
            self.note("hostile message accepted", case, h)
        else:
            code = str((h.get("error") or {}).get("code"))
            counts["error_replies"] += 1
            self.codes[code] = self.codes.get(code, 0) + 1
            if code == "internal":
                counts["internal_errors"] += 1
                self.note("internal error", case, h)
            elif case.expect and code not in case.expect:
                counts["unexpected_codes"] += 1
                self.note("unexpected error code", case, h)


def _set_up_peers(address: str, peers: dict[str, RawPeer], abufs: ShmBuffers,
                  gbufs: ShmBuffers, nbufs: ShmBuffers, host_rows: Mapping[str, int],
                  vcount: Mapping[str, int], dev_rows: Mapping[str, int], channel: bool
                  ) -> tuple[dict[str, list[int]], Any]:
    """Connect the attacker (registered, holds rows), the ghost (unregistered) and the stranger
    into ``peers``; returns (the attacker's host rows, the stranger's intake token)."""
    for name in ("attacker", "ghost", "anon"):
        peers[name] = RawPeer(address, "fuzz-" + name)
    att = peers["attacker"]
    att.register(abufs)
    arows_h = att.call("alloc", {"counts": {s: min(3, host_rows[s] - vcount[s] - 1)
                                            for s in dev_rows}})
    arows = {s: [int(x) for x in arows_h["_arrays"][i]] for s, i in arows_h["rows"].items()}
    peers["ghost"].register(gbufs)
    peers["ghost"].call("unregister")
    # the stranger's near-miss registrations name pools it really handed in, so each is
    # refused by the check for its own fault (a refusal keeps the intake for the next)
    anon_token = peers["anon"].hand_in(nbufs)
    if channel:
        att.open_channel()
        peers["anon"].open_channel()
    return arows, anon_token


def _send_hostile(gen: Hostile, peers: Mapping[str, RawPeer], victim: Any, messages: int,
                  reply_timeout: float, time_limit: float | None, t_start: float,
                  progress: Callable[[int, dict[str, Any]], None] | None) -> _Tally:
    """Send ``gen``'s messages until ``messages`` hostile ones went (or ``time_limit``),
    keeping the victim and attacker alive; returns what their replies were."""
    tally = _Tally()
    counts, att = tally.counts, peers["attacker"]
    next_beat = time.monotonic() + 0.5
    while counts["messages"] < messages:
        now = time.monotonic()
        if time_limit is not None and now - t_start > time_limit:
            tally.stopped_early = True
            break
        if now >= next_beat:  # keep the victim and attacker alive (reaper)
            victim.heartbeat()
            att.call("heartbeat")
            counts["setup_messages"] += 1
            next_beat = now + 0.5
        for case in gen.next():
            if isinstance(case, Deferred):
                case = case.resolve()
            peer = peers[case.peer]
            peer.send(case.frames)
            h = peer.reply(reply_timeout, case.rid if case.rid is not None else "any")
            if case.setup:
                if not tally.setup_reply(case, h):
                    break
                continue
            tally.hostile_reply(case, h)
            if progress is not None and counts["messages"] % 1000 == 0:
                progress(counts["messages"], counts)
    return tally


def _daemon_alive(victim: Any, daemon_pid: int | None) -> bool:
    """Whether the daemon still answers the victim's heartbeat (and its process exists)."""
    alive = True
    try:
        victim.heartbeat()
    except Exception:  # noqa: BLE001 - any failure means not alive
        alive = False
    if daemon_pid is not None:
        try:
            os.kill(daemon_pid, 0)
        except OSError:
            alive = False
    return alive


def _leaked_rows(victim: Any, dev_rows: Mapping[str, int]) -> int:
    """Host rows still used once every peer unregistered (waiting up to ``RELEASE_WAIT_S``)."""
    # an unregister with copies in flight (or many rows) replies at once and gives the
    # rows back as the copies end, a slice per loop turn: a leak is a row still used
    # after RELEASE_WAIT_S
    deadline = time.monotonic() + RELEASE_WAIT_S
    while True:
        after = daemon_check(victim, {s: 0 for s in dev_rows})
        leaked = sum(v["used"] for v in after["spaces"].values())
        if leaked == 0 or time.monotonic() > deadline:
            return leaked
        time.sleep(0.05)


def _check_after(vic: Victim, spv: SparseVictim, att: RawPeer, world: World,
                 arows: Mapping[str, list[int]], dev_rows: Mapping[str, int],
                 err_before: float, daemon_pid: int | None) -> dict[str, Any]:
    """The checks after the messages: alive, accounting, invariants, metrics, the victim's
    bytes; then the victim and attacker unregister and the leak is measured."""
    victim, vcount = vic.client, vic.count
    alive = _daemon_alive(victim, daemon_pid)
    expect_used = {s: vcount[s] + len(arows.get(s, ())) + len(world.spare.get(s, ()))
                   for s in dev_rows}
    out: dict[str, Any] = {"alive": alive, "corrupted": -1, "sparse_corrupted": -1,
                           "sparse_clean": False, "err_delta": -1.0, "leaked": -1,
                           "check": {"ok": False, "problems": ["daemon not alive"]}}
    if alive:
        check = out["check"] = daemon_check(victim, expect_used)
        err_delta = metric_total(check.pop("stats"), "hicache_errors_total") - err_before
        if check["deep"] == "unavailable":
            err_delta -= 1  # daemon_check's own stats {"check": true} was refused
        out["err_delta"] = err_delta
        out["corrupted"] = vic.verify()
        out["sparse_corrupted"], out["sparse_clean"] = spv.verify(), spv.region_clean()
        att.call("unregister")
        victim.unregister()
        out["leaked"] = _leaked_rows(victim, dev_rows)
    return out


def _fuzz_report(report: dict[str, Any], tally: _Tally, after: Mapping[str, Any],
                 vcount: Mapping[str, int], world: World, spv: SparseVictim,
                 peers: Mapping[str, RawPeer], t_start: float, fuzz_seconds: float,
                 messages: int) -> dict[str, Any]:
    """Fill ``report`` with the counters and the checks' results, then its verdict."""
    counts, check, err_delta = tally.counts, after["check"], after["err_delta"]
    report.update(counts)
    report.update({
        "daemon_alive": after["alive"], "invariants_ok": bool(check["ok"]),
        "invariant_problems": check.get("problems", []),
        "deep_check": check.get("deep", "unavailable"),
        "victim_rows_checked": sum(vcount.values()),
        "victim_rows_corrupted": after["corrupted"],
        "leaked_rows": after["leaked"], "metrics_errors_delta": err_delta,
        "sparse_region": world.sparse is not None,
        "sparse_rows_checked": len(spv.snap) if world.sparse else 0,
        "sparse_rows_corrupted": after["sparse_corrupted"],
        "sparse_region_clean": after["sparse_clean"],
        "metrics_match": err_delta == counts["error_replies"],
        "codes": dict(sorted(tally.codes.items())), "kinds": dict(sorted(tally.kinds.items())),
        "stopped_early": tally.stopped_early,
        "channel_messages": sum(p.via_channel for p in peers.values()),
        "seconds": round(time.monotonic() - t_start, 2),
        "fuzz_seconds": round(fuzz_seconds, 2),
        "messages_per_s": round(counts["messages"] / max(fuzz_seconds, 1e-9), 1),
        "examples": tally.examples,
    })
    report["failed_checks"] = failed_checks(report, messages)
    report["ok"] = not report["failed_checks"]
    return report


def run_fuzz(address: str, messages: int, *, seed: int = 0, layout: Layout | None = None,
             dev_rows: Mapping[str, int] | None = None, reply_timeout: float = 5.0,
             time_limit: float | None = None, daemon_pid: int | None = None,
             kinds: Sequence[str] | None = None, channel: bool = False,
             progress: Callable[[int, dict[str, Any]], None] | None = None) -> dict[str, Any]:
    """Send ``messages`` hostile messages to the daemon at ``address`` and check it afterwards.

    A *victim* registers, allocates host rows in every space, fills its device rows with known
    content and backs them up; an *attacker* registers and holds a few rows; a *ghost*
    registers and unregisters; an *anon* peer never registers. The attacker, ghost and anon
    then send the messages ``Hostile`` draws (set-up steps of sequences are extra and must
    succeed). Afterwards: the daemon answers, every space's used + free = rows and used =
    what the victim and attacker hold, the allocator invariants hold, the daemon counted every
    refusal in its errors metric, and the victim's rows load back byte for byte; finally
    everyone unregisters and no host row stays used. Returns the report (``ok`` sums it up).
    ``channel``: the attacker and the stranger send through shared-memory channels (the daemon
    must busy-poll to grant them), so every hostile message that fits a slot enters there.
    """
    layout = layout or build_layout(preset("dsv4-tiny"))
    dev_rows = _space_rows(layout, dev_rows or {"page": 8, "swa_page": 4, "req_slot": 4})
    rng = random.Random(seed)
    t_start = time.monotonic()
    abufs = ShmBuffers(layout, dev_rows, tag="attacker")
    gbufs = ShmBuffers(layout, dev_rows, tag="ghost")
    nbufs = ShmBuffers(layout, dev_rows, tag="anon")
    peers: dict[str, RawPeer] = {}
    report: dict[str, Any] = {"bench": "fuzz", "seed": seed, "address": address,
                              "channel": channel}
    vic: Victim | None = None
    try:
        # ---- the victim: rows with known content in every space; then the other peers
        vic = Victim(address, layout, dev_rows, seed=seed, timeout=max(10.0, reply_timeout),
                     name="fuzz-victim")
        victim, host_rows, vcount, vrows = vic.client, vic.host_rows, vic.count, vic.rows
        arows, anon_token = _set_up_peers(address, peers, abufs, gbufs, nbufs, host_rows,
                                          vcount, dev_rows, channel)
        spv = SparseVictim(victim, vrows.get("page", []))
        world = World(layout, host_rows, dict(dev_rows), vrows, arows, abufs.register_fields(),
                      sparse=spv.world(), anon_token=anon_token)
        gen = Hostile(world, rng, kinds)
        before = victim.stats()
        err_before = metric_total(before, "hicache_errors_total")
        # ---- the hostile messages, then the checks
        tally = _send_hostile(gen, peers, victim, messages, reply_timeout, time_limit, t_start,
                              progress)
        fuzz_seconds = time.monotonic() - t_start
        after = _check_after(vic, spv, peers["attacker"], world, arows, dev_rows, err_before,
                             daemon_pid)
        return _fuzz_report(report, tally, after, vcount, world, spv, peers, t_start,
                            fuzz_seconds, messages)
    finally:
        for p in peers.values():
            p.close()
        if vic is not None:
            vic.close()
        for b in (abufs, gbufs, nbufs):
            b.close()
