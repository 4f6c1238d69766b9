"""The Grafana dashboard queries only metrics (and labels) that the daemon or the demo export."""
from __future__ import annotations

import json
import os
import re

import pytest

from hicache.controllers.metrics import CATALOG, Metrics
from hicache.sim.simulator import DEMO_CATALOG, DemoMetrics

HERE = os.path.dirname(os.path.abspath(__file__))
DASHBOARD = os.path.join(HERE, "..", "grafana", "dashboard.json")
SCRAPE = os.path.join(HERE, "..", "grafana", "prometheus.yml")

SUFFIXES = {"counter": ("_total", "_created"), "gauge": ("",),
            "histogram": ("_bucket", "_sum", "_count", "_created")}
TARGET_LABELS = {"instance", "job"}  # added by Prometheus at scrape time


def exported() -> dict[str, set[str]]:
    """Sample name -> label names, from the live registries (daemon catalog + demo counters)."""
    out: dict[str, set[str]] = {}
    labels = {Metrics.PREFIX + d.name: set(d.labels) for d in CATALOG + DEMO_CATALOG}
    for registry in (Metrics().registry, DemoMetrics().registry):
        for fam in registry.collect():
            base_labels = labels[fam.name]
            for suffix in SUFFIXES[fam.type]:
                out[fam.name + suffix] = base_labels | ({"le"} if suffix == "_bucket" else set())
            for s in fam.samples:  # whatever the client library really emits, too
                out.setdefault(s.name, base_labels | set(s.labels))
    return out


def queries():
    with open(DASHBOARD, encoding="utf-8") as f:
        dash = json.load(f)
    for panel in dash["panels"]:
        for t in panel.get("targets", []):
            yield panel["title"], t["expr"]


STRING = re.compile(r'"(?:[^"\\]|\\.)*"')
METRIC = re.compile(r"\b(hicache_[a-zA-Z0-9_:]*)")
SELECTOR = re.compile(r"\b(hicache_[a-zA-Z0-9_:]*)\s*\{([^}]*)\}")
MATCHER = re.compile(r"([a-zA-Z_][a-zA-Z0-9_]*)\s*(=~|!~|!=|=)\s*\"")
GROUPING = re.compile(r"\b(?:by|without|on|ignoring)\s*\(([^)]*)\)")


def test_dashboard_is_importable_json():
    with open(DASHBOARD, encoding="utf-8") as f:
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
    for want in ("bandwidth", "host pool", "tier", "command latency", "transfer latency",
                 "errors", "in flight"):
        assert want in titles, want


@pytest.mark.parametrize("title, expr", list(queries()))
def test_every_query_names_exported_metrics_and_labels(title, expr):
    names = exported()
    for sel_metric, body in SELECTOR.findall(expr):
        assert sel_metric in names, f"{title}: {sel_metric} is not exported"
        for label, _ in MATCHER.findall(body):
            assert label in names[sel_metric] | TARGET_LABELS, \
                f"{title}: {sel_metric} has no label {label!r}"
    bare = STRING.sub('""', expr)
    used = METRIC.findall(bare)
    assert used, f"{title}: the query names no hicache metric"
    known_labels = set(TARGET_LABELS)
    for m in used:
        assert m in names, f"{title}: {m} is not exported by the daemon or the demo"
        known_labels |= names[m]
    for group in GROUPING.findall(bare):
        for label in filter(None, (x.strip() for x in group.split(","))):
            assert label in known_labels, f"{title}: grouping label {label!r} not on {used}"


def test_scrape_example_names_the_metrics_endpoint():
    with open(SCRAPE, encoding="utf-8") as f:
        text = f.read()
    assert "scrape_configs:" in text and "metrics_path: /metrics" in text
    assert re.search(r"targets:\s*\n?\s*-?\s*\[?\"localhost:\d+\"", text)
