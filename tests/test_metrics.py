"""The metric catalog: exposition, snapshot, registry isolation, docs coverage, and a live
daemon's /metrics endpoint fetched over HTTP."""
from __future__ import annotations

import re
import urllib.request
from pathlib import Path

from prometheus_client.parser import text_string_to_metric_families

from hicache.engine.device_pools import DevicePools
from hicache.core.layout import build_layout, preset
from hicache.controllers.metrics import CATALOG, LATENCY_BUCKETS, Metrics, markdown

DOCS = Path(__file__).resolve().parents[1] / "docs" / "metrics.md"


def exported_name(d) -> str:
    return "hicache_" + d.name + ("_total" if d.kind == "counter" else "")


def test_catalog_names_are_prefixed_unique_and_documented():
    names = [d.name for d in CATALOG]
    assert len(names) == len(set(names))
    text = DOCS.read_text()
    for d in CATALOG:
        assert re.fullmatch(r"[a-z][a-z0-9_]*", d.name)
        assert d.question.strip() and d.help.strip()
        assert f"`{exported_name(d)}`" in text, f"docs/metrics.md misses {exported_name(d)}"
    assert markdown().count("\n") == len(CATALOG) + 1
    # the table is generated from the catalog (its HELP lines): the docs hold it verbatim
    assert markdown().strip() in text, "regenerate docs/metrics.md's table from markdown()"


def test_recording_and_exposition_round_trip():
    m = Metrics()
    m.command("backup", True, 3e-5)
    m.command("backup", False, 2e-3, "bad_rows")
    m.transfer("load", "ok", 0.01, 0.004, {"c4_kv": (4, 4 << 20), "c128_kv": (4, 8192)}, "numpy")
    m.transfer("backup", "error", 0.01, 0.01, {"c4_kv": (1, 10)}, "numpy")
    m.transfer("backup", "cancelled", 0.5, 0.5, {"c4_kv": (9, 90)}, "numpy")  # a reaped client's
    m.set("host_rows", 7, "page", "used")
    m.in_flight("load", 2)
    m.in_flight("load", -1)
    m.fallback("numa_first_touch")
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition())}
    cmds = {(s.labels["command"], s.labels["status"]): s.value
            for s in fams["hicache_commands"].samples if s.name.endswith("_total") and s.value}
    assert cmds == {("backup", "ok"): 1.0, ("backup", "error"): 1.0}
    errs = {s.labels["kind"]: s.value for s in fams["hicache_errors"].samples
            if s.name.endswith("_total") and s.value}
    assert errs == {"bad_rows": 1.0, "transfer": 1.0}  # a cancelled op is no error
    ops = {(s.labels["direction"], s.labels["status"]): s.value
           for s in fams["hicache_transfer_ops"].samples if s.name.endswith("_total") and s.value}
    assert ops == {("load", "ok"): 1.0, ("backup", "error"): 1.0, ("backup", "cancelled"): 1.0}
    xfer = {s.labels["direction"]: s.value for s in fams["hicache_transfer_seconds"].samples
            if s.name.endswith("_count")}
    assert xfer["load"] == 1.0 and xfer["backup"] == 1.0  # nor a latency
    by_pool = {s.labels["pool"]: s.value for s in fams["hicache_transfer_bytes"].samples
               if s.name.endswith("_total")}
    assert by_pool == {"c4_kv": float(4 << 20), "c128_kv": 8192.0}
    paths = {(s.labels["direction"], s.labels["path"]): s.value
             for s in fams["hicache_transfer_path_ops"].samples
             if s.name.endswith("_total") and s.value}
    assert paths == {("load", "numpy"): 1.0}
    busy = {s.labels["direction"]: s.value for s in fams["hicache_transfer_busy_seconds"].samples
            if s.name.endswith("_total")}
    assert busy["load"] == 0.004 and busy["backup"] == 0.0  # failed ops are not busy time
    hist = [s for s in fams["hicache_command_seconds"].samples
            if s.name.endswith("_bucket") and s.labels["command"] == "backup"]
    assert len(hist) == len(LATENCY_BUCKETS) + 1
    counts = [s.value for s in hist]
    assert counts == sorted(counts) and counts[-1] == 2.0  # cumulative, +Inf = count
    le_3e5 = next(s.value for s in hist if s.labels["le"] == "5e-05")
    assert le_3e5 == 1.0
    flying = {s.labels["direction"]: s.value for s in fams["hicache_transfers_in_flight"].samples}
    assert flying["load"] == 1.0 and sum(flying.values()) == 1.0
    snap = m.snapshot()
    assert snap["hicache_host_rows"] == [{"labels": {"space": "page", "state": "used"},
                                          "value": 7.0}]
    counts = {e["labels"]["command"]: e["value"] for e in snap["hicache_command_seconds_count"]}
    assert counts["backup"] == 2.0 and sum(counts.values()) == 2.0


def test_known_labels_start_at_zero_and_build_info():
    """Counters exist at 0 for every known label value before any event; build and process
    metrics are exported; declared pools get their byte and row series."""
    from hicache.controllers.metrics import DIRECTIONS, ERROR_KINDS, FALLBACKS
    from hicache.core.protocol import COMMANDS
    from hicache.core.version import __version__

    m = Metrics()
    m.declare_pools(["c4_kv", "swa_kv"])
    fams = {f.name: f for f in text_string_to_metric_families(m.exposition())}

    def keys(name, *labels):
        return {tuple(s.labels[x] for x in labels) for s in fams[name].samples
                if s.name.endswith("_total") and s.value == 0}

    assert keys("hicache_errors", "kind") == {(k,) for k in ERROR_KINDS}
    assert keys("hicache_fallbacks", "what") == {(k,) for k in FALLBACKS}
    assert {(c, "error") for c in COMMANDS} <= keys("hicache_commands", "command", "status")
    assert keys("hicache_transfer_bytes", "direction", "pool") == {
        (d, p) for d in DIRECTIONS for p in ("c4_kv", "swa_kv")}
    info = fams["hicache_build_info"].samples[0]
    assert info.value == 1.0 and info.labels["version"] == __version__
    assert fams["hicache_numa_node"].samples[0].value == -1.0
    issue = {s.name: s.value for s in fams["hicache_load_issue_seconds"].samples}
    assert issue["hicache_load_issue_seconds_count"] == 0.0  # unlabelled histogram: from start
    assert "process_resident_memory_bytes" in m.exposition()
    assert not any(n.endswith(("gbps", "gibps")) for n in fams)


def test_each_metrics_has_its_own_registry():
    a, b = Metrics(), Metrics()
    a.inc("clients_reaped")
    assert a.value("clients_reaped") == 1.0 and b.value("clients_reaped") == 0.0
    assert "hicache_clients_reaped_total 0.0" in b.exposition()


def test_live_daemon_serves_metrics_over_http(shared_daemon):
    lay = build_layout(preset("dsv4-flash"))
    with DevicePools(lay, {"page": 8, "swa_page": 4, "req_slot": 4}) as pools, \
            shared_daemon.client() as c:
        c.register(pools)
        url = f"http://127.0.0.1:{shared_daemon.metrics_port}/metrics"
        # the shared daemon serves other tests too: counters are compared before and after
        was = urllib.request.urlopen(url, timeout=10).read().decode()
        rows = c.alloc({"page": 1})["page"]
        c.wait_ack(c.backup({"c128_kv": ([0], rows)}))
        c.stats()  # refreshes the gauges
        body = urllib.request.urlopen(url, timeout=10).read().decode()
        c.free({"page": rows})
        c.unregister()
    fams = {f.name: f for f in text_string_to_metric_families(body)}
    before = {f.name: f for f in text_string_to_metric_families(was)}

    def moved(fam: str, **labels: str) -> float:
        def val(fs: dict) -> float:
            return sum(x.value for x in fs[fam].samples if x.name.endswith("_total") and
                       all(x.labels.get(k) == v for k, v in labels.items()))
        return val(fams) - val(before)

    c128 = lay.pools["c128_kv"]  # one row of every C128 layer: 20 x 1,728 bytes
    assert moved("hicache_transfer_bytes", direction="backup", pool="c128_kv") == \
        c128.page_bytes * len(c128.layers)
    assert moved("hicache_transfer_rows", direction="backup", pool="c128_kv") == 1
    assert moved("hicache_transfer_bytes", direction="backup", pool="c4_kv") == 0
    assert moved("hicache_transfer_ops", direction="backup", status="ok") == 1
    used = [x.value for x in fams["hicache_host_rows"].samples
            if x.labels.get("space") == "page" and x.labels.get("state") == "used"]
    assert used and used[0] >= 1
    for d in CATALOG:
        assert "hicache_" + d.name in fams, d.name
    ops = {(s.labels["direction"], s.labels["status"]): s.value
           for s in fams["hicache_transfer_ops"].samples if s.name.endswith("_total")}
    assert ops[("backup", "ok")] >= 1
    assert "hicache_transfer_bytes_total{direction=\"backup\"" in body
    assert any(s.labels.get("space") == "page" for s in fams["hicache_host_rows"].samples)
    assert fams["hicache_pinned_bytes"].samples[0].value > 0


def test_a_merged_cpu_run_counts_its_time_once_in_busy_seconds(daemon_factory):
    """The one CPU copy thread merges queued one-row backups into one copy: its time goes into
    ``transfer_busy_seconds`` once, split among the merged ops (each op used to add the whole
    run: busy seconds reached 8-22x the wall time, and bytes per busy second came out as
    many times too low)."""
    import time

    d = daemon_factory(device_rows="page=64,swa_page=4,req_slot=4",
                       env={"HICACHE_INLINE_MAX_BYTES": "1"})  # every op to the copy thread
    rows = {"page": 64, "swa_page": 4, "req_slot": 4}
    with DevicePools(build_layout(preset("dsv4-flash")), rows) as pools, d.client() as c:
        c.register(pools)
        host = c.alloc({"page": 128})["page"]
        t0 = time.monotonic()
        for rnd in range(6):
            ops = [c.backup({"page": ([i], [host[(rnd % 2) * 64 + i]])}) for i in range(64)]
            for op in ops:
                assert c.wait_ack(op, timeout=60).ok
        wall = time.monotonic() - t0
        s = c.stats()
        busy = next(x["value"] for x in s["metrics"]["hicache_transfer_busy_seconds_total"]
                    if x["labels"].get("direction") == "backup")
        assert s["merged_ops"] > 0 and 0 < busy <= wall, (s["merged_ops"], busy, wall)
        c.unregister()


def test_a_known_command_refused_for_its_fields_is_counted_as_itself(shared_daemon):
    """An ``alloc`` with a field missing or of the wrong type was counted under
    ``command="invalid"`` (the field check ran before the name was taken; metrics review): the
    by-command panels could not show which command an engine sends malformed. A message whose
    command is not known is still ``invalid``."""
    import pytest

    from hicache.engine.client import CommandRefused

    def errors(c, command: str) -> float:
        return sum(s["value"] for s in c.stats()["metrics"]["hicache_commands_total"]
                   if s["labels"] == {"command": command, "status": "error"})

    with shared_daemon.client() as c:
        alloc, invalid = errors(c, "alloc"), errors(c, "invalid")
        for fields in ({}, {"counts": "page"}, {"counts": {"page": -1}}):
            with pytest.raises(CommandRefused):
                c.call("alloc", fields)
        with pytest.raises(CommandRefused, match="unknown command"):
            c.call("allocate", {})
        assert errors(c, "alloc") == alloc + 3
        assert errors(c, "invalid") == invalid + 1
