"""The Grafana dashboards query only metrics (and labels) their exporters export: the daemon
dashboard what `hicache serve` exports (catalog + process_*), the demo dashboard the demo's
worker metrics and its daemon's. A freshly started idle daemon already exports a series for
every metric (and every label matcher) the daemon dashboard reads."""
from __future__ import annotations

import json
import os
import re
import urllib.request

import pytest
from prometheus_client.parser import text_string_to_metric_families

from hicache.controllers.metrics import Metrics
from hicache.sim.simulator import DemoMetrics

HERE = os.path.dirname(os.path.abspath(__file__))
GRAFANA = os.path.join(HERE, "..", "grafana")
SCRAPE = os.path.join(GRAFANA, "prometheus.yml")
DASHBOARDS = {"daemon.json": ("daemon",), "demo.json": ("daemon", "demo")}

SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",), "unknown": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time


def exported(kinds: tuple[str, ...]) -> dict[str, set[str]]:
    """Sample name -> label names, from the live registries of the exporters named."""
    texts = {"daemon": lambda: Metrics().exposition(),
             "demo": lambda: __import__("prometheus_client").generate_latest(
                 DemoMetrics().registry).decode()}
    out: dict[str, set[str]] = {}
    for kind in kinds:
        fams = text_string_to_metric_families(texts[kind]())
        for fam in fams:
            base: set[str] = set()
            for s in fam.samples:
                base |= set(s.labels) - {"le"}
            for suffix in SUFFIXES.get(fam.type, ("",)):
                out.setdefault(fam.name + suffix, set()).update(
                    base | ({"le"} if suffix == "_bucket" else set()))
            for s in fam.samples:
                out.setdefault(s.name, set()).update(s.labels)
    # labelled families declared by the catalogs but with no sample until a pool is declared
    from hicache.controllers.metrics import CATALOG
    from hicache.sim.simulator import DEMO_CATALOG

    for d in CATALOG + (DEMO_CATALOG if "demo" in kinds else ()):
        for suffix in SUFFIXES[d.kind]:
            out.setdefault("hicache_" + d.name + suffix, set()).update(
                set(d.labels) | ({"le"} if suffix == "_bucket" else set()))
    return out


def queries(name: str):
    with open(os.path.join(GRAFANA, name), encoding="utf-8") as f:
        dash = json.load(f)
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
METRIC = re.compile(r"\b((?:hicache|process)_[a-zA-Z0-9_:]*)")
SELECTOR = re.compile(r"\b((?:hicache|process)_[a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"((?:[^\"\\]|\\.)*)\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_dashboard_is_importable_json(name):
    with open(os.path.join(GRAFANA, name), encoding="utf-8") as f:
        dash = json.load(f)
    assert dash["title"] and dash["uid"]
    assert any(i["pluginId"] == "prometheus" for i in dash["__inputs"])
    ids = [p["id"] for p in dash["panels"]]
    assert len(ids) == len(set(ids))
    for p in dash["panels"]:
        assert set(p["gridPos"]) == {"h", "w", "x", "y"}
        if p["type"] != "row":
            assert p["targets"], p["title"]
    titles = " ".join(p["title"].lower() for p in dash["panels"])
    wants = {"daemon.json": ("bandwidth", "host pool", "command latency", "transfer latency",
                             "errors", "in flight", "numa", "build", "memory"),
             "demo.json": ("tier", "bandwidth", "verification")}[name]
    for want in wants:
        assert want in titles, want


def test_daemon_dashboard_reads_no_demo_metric():
    for title, expr in queries("daemon.json"):
        assert "hicache_demo_" not in expr, title
        assert not re.search(r"_g(i)?bps\b", expr), title


@pytest.mark.parametrize("name, title, expr",
                         [(n, t, e) for n in DASHBOARDS for t, e in queries(n)])
def test_every_query_names_exported_metrics_and_labels(name, title, expr):
    names = exported(DASHBOARDS[name])
    for sel_metric, body in SELECTOR.findall(expr):
        assert sel_metric in names, f"{title}: {sel_metric} is not exported"
        for label, _, _ in MATCHER.findall(body):
            assert label in names[sel_metric] | TARGET_LABELS, \
                f"{title}: {sel_metric} has no label {label!r}"
    bare = STRING.sub('""', expr)
    used = METRIC.findall(bare)
    assert used, f"{title}: the query names no metric"
    known_labels = set(TARGET_LABELS)
    for m in used:
        assert m in names, f"{title}: {m} is not exported by {DASHBOARDS[name]}"
        known_labels |= names[m]
    for group in GROUPING.findall(bare):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in known_labels, f"{title}: grouping label {label!r} not on {used}"


def test_idle_daemon_exports_every_series_the_daemon_dashboard_reads(daemon):
    """No client has connected: every metric of the daemon dashboard already has a sample, and
    so does every equality matcher (e.g. ``status="error"``)."""
    body = urllib.request.urlopen(f"http://127.0.0.1:{daemon.metrics_port}/metrics",
                                  timeout=10).read().decode()
    samples = [s for f in text_string_to_metric_families(body) for s in f.samples]
    for title, expr in queries("daemon.json"):
        bare = STRING.sub('""', expr)
        for m in set(METRIC.findall(bare)):
            assert any(s.name == m for s in samples), f"{title}: idle daemon has no {m}"
        for metric, body_ in SELECTOR.findall(expr):
            for label, op, value in MATCHER.findall(body_):
                if op != "=" or label in TARGET_LABELS:
                    continue
                assert any(s.name == metric and s.labels.get(label) == value
                           for s in samples), f"{title}: no {metric}{{{label}={value!r}}}"


def test_scrape_example_names_the_metrics_endpoint():
    with open(SCRAPE, encoding="utf-8") as f:
        text = f.read()
    assert "scrape_configs:" in text and "metrics_path: /metrics" in text
    assert re.search(r"targets:\s*\n?\s*-?\s*\[?\"localhost:\d+\"", text)


@pytest.mark.parametrize("name", list(DASHBOARDS))
def test_counts_are_never_drawn_on_a_byte_axis(name):
    """A query of a count (errors, ops, pages) in a panel whose unit is bytes has an override
    giving it its own unit (L3 errors per second showed as B/s)."""
    with open(os.path.join(GRAFANA, name), encoding="utf-8") as f:
        dash = json.load(f)
    for panel in dash["panels"]:
        cfg = panel.get("fieldConfig", {})
        if cfg.get("defaults", {}).get("unit") not in ("Bps", "bytes", "decbytes", "binBps"):
            continue
        own = {o["matcher"]["options"] for o in cfg.get("overrides", [])
               if o["matcher"]["id"] == "byFrameRefID"
               and any(p["id"] == "unit" for p in o["properties"])}
        for t in panel.get("targets", []):
            names = METRIC.findall(STRING.sub('""', t["expr"]))
            if names and not any("bytes" in n for n in names):
                assert t["refId"] in own, (panel["title"], t["expr"])


def dashboard(name: str) -> dict:
    with open(os.path.join(GRAFANA, name), encoding="utf-8") as f:
        return json.load(f)


EVERY_SELECTOR = re.compile(r"\b((?:hicache|process)_[a-zA-Z0-9_:]*)(\{[^}]*\})?")
DEMO_VARIABLES = {"worker": "hicache_demo_requests_total", "daemon": "hicache_build_info"}


def test_demo_dashboard_selects_the_demo_targets_only():
    """Every selector of the demo dashboard names its target: ``instance=~"$worker"`` on the
    worker's hicache_demo_* series, ``instance=~"$daemon"`` on its daemon's, so a Prometheus that
    also scrapes other daemons (as prometheus.yml does) adds nothing of theirs to a panel."""
    dash = dashboard("demo.json")
    variables = {v["name"]: v for v in dash["templating"]["list"]}
    for name, metric in DEMO_VARIABLES.items():
        v = variables[name]
        assert v["type"] == "query" and v["definition"] == f"label_values({metric}, instance)"
        assert v["query"]["query"] == v["definition"]
        assert not v["includeAll"] and not v["multi"], name  # one demo: one target each
    kinds = {"worker": ("demo",), "daemon": ("daemon",)}
    seen = 0
    for title, expr in queries("demo.json"):
        for metric, body in EVERY_SELECTOR.findall(expr):
            seen += 1
            var = "worker" if metric.startswith("hicache_demo_") else "daemon"
            assert metric in exported(kinds[var]), (title, metric)
            matchers = {(label, op, value) for label, op, value in MATCHER.findall(body)}
            assert ("instance", "=~", f"${var}") in matchers, (title, metric, body)
    assert seen >= 19


FREE_ROWS = re.compile(r'^1 - sum by \(space\) \(hicache_host_rows\{(?P<sel>[^}]*),state="free"\}\)'
                       r' / sum by \(space\) \(hicache_host_rows\{(?P<all>[^}]*)\}\)$')


@pytest.mark.parametrize("name, target", [("daemon.json", 'instance=~"$instance"'),
                                          ("demo.json", 'instance=~"$daemon"')])
def test_host_usage_counts_every_row_that_is_not_free(name, target):
    """Rows ``pending_free`` are not free (allocations are refused ``no_space`` with every row
    pending): usage is 1 - free / all, not used / all, which read 0 on a full tier."""
    (panel,) = [p for p in dashboard(name)["panels"] if p["title"] == "Host pool usage by space"]
    (t,) = panel["targets"]
    m = FREE_ROWS.match(" ".join(t["expr"].split()))
    assert m, t["expr"]
    assert m["sel"] == m["all"] == target, t["expr"]
    assert panel["fieldConfig"]["defaults"]["unit"] == "percentunit"


def test_copy_path_operations_are_not_stacked():
    """An operation that used several copy paths counts once for each: a stack of the paths
    would overstate operations per second."""
    panels = [p for p in dashboard("daemon.json")["panels"]
              if any("hicache_transfer_path_ops_total" in t["expr"] for t in p.get("targets", []))]
    assert panels
    for p in panels:
        assert p["fieldConfig"]["defaults"]["custom"]["stacking"]["mode"] == "none", p["title"]
        assert "once for each" in p["description"], p["title"]


def test_demo_verification_draws_bytes_per_second_apart_from_the_mismatch_count():
    (panel,) = [p for p in dashboard("demo.json")["panels"] if p["title"] == "Verification"]
    cfg = panel["fieldConfig"]
    by_ref = {t["refId"]: t["expr"] for t in panel["targets"]}
    assert "rate(hicache_demo_verified_bytes_total" in by_ref["A"]
    assert "hicache_demo_mismatched_bytes_total" in by_ref["B"]
    assert cfg["defaults"]["unit"] == "Bps"
    (own,) = [o for o in cfg["overrides"] if o["matcher"] == {"id": "byFrameRefID", "options": "B"}]
    props = {p["id"]: p["value"] for p in own["properties"]}
    assert props["unit"] == "bytes" and props["custom.axisPlacement"] == "right"
