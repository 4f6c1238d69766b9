"""The daemon's own Prometheus text format against prometheus-client's, and the endpoint.

``core.metrics_text.TextFormat`` writes the exposition straight from the metric values; the
reference here builds prometheus-client's metric families from the same values (as the daemon
did before) and has ``generate_latest`` write them. The two must be the same bytes for any
values and label values, and the snapshot (``stats``) the same samples.
"""
from __future__ import annotations

import gzip
import math
import socket
import time
import urllib.error
import urllib.request
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily
from prometheus_client.utils import floatToGoString

from hicache.controllers.metrics import CATALOG, LATENCY_BUCKETS, Metrics
from hicache.core.metric_defs import MetricDef
from hicache.core.metrics_http import MetricsHttp
from hicache.core.metrics_text import TextFormat


def reference_families(catalog: tuple[MetricDef, ...], values: dict, hists: dict) -> list[Any]:
    out = []
    for d in catalog:
        name = "hicache_" + d.name
        if d.kind in ("counter", "gauge"):
            cls = CounterMetricFamily if d.kind == "counter" else GaugeMetricFamily
            fam = cls(name, d.help, labels=d.labels)
            for lab, v in values.get(d.name, ()):
                fam.add_metric(list(lab), v)
        else:
            fam = HistogramMetricFamily(name, d.help, labels=d.labels)
            for lab, counts, total in hists.get(d.name, ()):
                cum, buckets = 0, []
                for le, n in zip((*LATENCY_BUCKETS, math.inf), counts):
                    cum += n
                    buckets.append((floatToGoString(le), cum))
                fam.add_metric(list(lab), buckets, total)
        out.append(fam)
    return out


def reference_text(catalog: tuple[MetricDef, ...], values: dict, hists: dict) -> str:
    class Collector:
        def collect(self) -> list[Any]:
            return reference_families(catalog, values, hists)

    reg = CollectorRegistry()
    reg.register(Collector())
    return generate_latest(reg).decode()


label_text = st.text(st.characters(codec="utf-8", exclude_categories=("Cs",)), max_size=8) | \
    st.sampled_from(['a"b', "a\\b", "a\nb", "\\n", '"', "", "é✓"])
number = st.floats(allow_nan=True, allow_infinity=True) | st.integers(0, 10**15).map(float)


@st.composite
def catalog_values(draw: Any) -> tuple[tuple[MetricDef, ...], dict, dict]:
    """A small catalog of every kind, with and without labels, and values for it."""
    defs = (MetricDef("c_plain", "counter", (), "A counter.\nTwo lines, a \\ too.", "?"),
            MetricDef("c_two", "counter", ("zeta", "alpha"), "Labels out of order.", "?"),
            MetricDef("g_one", "gauge", ("pool",), "A gauge.", "?"),
            MetricDef("h_plain", "histogram", (), "A histogram.", "?"),
            MetricDef("h_lab", "histogram", ("queue",), "Labels after le sort.", "?"),
            MetricDef("empty", "counter", ("x",), "No series yet.", "?"))
    values: dict = {}
    hists: dict = {}
    for d in defs:
        n = 1 if not d.labels else draw(st.integers(0, 4))
        keys = draw(st.lists(st.tuples(*[label_text] * len(d.labels)), min_size=n, max_size=n,
                             unique=True)) if d.labels else [()]
        if d.name == "empty":
            keys = []
        if d.kind == "histogram":
            hists[d.name] = [(k, draw(st.lists(st.integers(0, 10**6),
                                               min_size=len(LATENCY_BUCKETS) + 1,
                                               max_size=len(LATENCY_BUCKETS) + 1)),
                              draw(number)) for k in keys]
        else:
            values[d.name] = [(k, draw(number)) for k in keys]
    return defs, values, hists


@settings(max_examples=300, deadline=None)
@given(catalog_values(), st.data())
def test_the_text_is_prometheus_clients_byte_for_byte(case: tuple, data: Any) -> None:
    defs, values, hists = case
    fmt = TextFormat(defs, "hicache_", LATENCY_BUCKETS)
    want = reference_text(defs, values, hists)
    assert fmt.render(values, hists) == want
    assert fmt.render(values, hists) == want  # again, from the text it kept
    # some values move (new objects, as a recording makes them: -0.0 after 0.0 included),
    # some counts and sums too: the kept text must not outlive its value
    moved = {k: [(lab, data.draw(number | st.just(-0.0)) if data.draw(st.booleans()) else v)
                 for lab, v in series] for k, series in values.items()}
    moved_h = {k: [(lab, [n + data.draw(st.integers(0, 2)) for n in counts]
                    if data.draw(st.booleans()) else list(counts),
                    data.draw(number | st.just(-0.0)) if data.draw(st.booleans()) else total)
                   for lab, counts, total in series] for k, series in hists.items()}
    assert fmt.render(moved, moved_h) == reference_text(defs, moved, moved_h)


def _busy_metrics() -> Metrics:
    m = Metrics(process_metrics=False)
    m.declare_pools(["c4_kv", "swa_kv", "c128_kv"])
    for i in range(500):
        m.command(("alloc", "load", "backup")[i % 3], i % 7 != 0, (i % 13) * 1e-4, "bad_rows")
        m.transfer(("load", "backup")[i % 2], ("ok", "error", "cancelled")[i % 3], 1e-3, 5e-4,
                   {"c4_kv": (2, 4096)}, "numpy+memmove")
    m.set("l3_stalled", 1.0, "read")
    m.set("host_rows", float("nan"), "page", "free")
    m.observe("l3_seconds", 0.3, "query")
    return m


def test_the_daemons_catalog_is_written_as_the_reference_writes_it_and_snapshot_agrees() -> None:
    m = _busy_metrics()
    values, hists = m._copy()
    assert m.exposition() == reference_text(CATALOG, values, hists)  # no process_* here
    # the stats view: every sample of the reference but buckets, in its order, NaN as None
    want: dict = {}
    for fam in reference_families(CATALOG, values, hists):
        for s in fam.samples:
            if not s.name.endswith("_bucket"):
                v = s.value
                want.setdefault(s.name, []).append(
                    {"labels": dict(s.labels), "value": v if math.isfinite(v) else None})
    assert m.snapshot() == want
    assert want["hicache_host_rows"] == [{"labels": {"space": "page", "state": "free"},
                                          "value": None}]


def test_a_scrape_costs_a_fraction_of_prometheus_clients() -> None:
    """Why the text is written here (docs/metrics.md, "What a scrape costs"): while a scrape
    formats, the daemon's loop waits for the interpreter. Best of 5 each, a loose bound (about
    12x on the 2-core VM)."""
    m = _busy_metrics()

    def best(f: Any) -> float:
        times = []
        for _ in range(5):
            t = time.perf_counter()
            f()
            times.append(time.perf_counter() - t)
        return min(times)

    ours = best(m.exposition)
    theirs = best(lambda: reference_text(CATALOG, *m._copy()))
    assert ours * 3 < theirs, (ours, theirs)


def _raw(port: int, data: bytes) -> bytes:
    with socket.create_connection(("127.0.0.1", port), timeout=10) as s:
        s.sendall(data)
        out = b""
        while chunk := s.recv(65536):
            out += chunk
    return out


def test_the_endpoint_serves_gzip_and_refuses_what_it_does_not_offer() -> None:
    body = b"# HELP x X.\n# TYPE x gauge\nx 1.0\n"
    http = MetricsHttp(lambda: body, 0)
    url = f"http://127.0.0.1:{http.port}/metrics"
    idle = socket.create_connection(("127.0.0.1", http.port))  # connects, sends nothing
    try:
        t = time.monotonic()
        with urllib.request.urlopen(url, timeout=10) as r:
            assert r.read() == body
            assert r.headers["Content-Type"] == "text/plain; version=0.0.4; charset=utf-8"
        assert time.monotonic() - t < 5  # the idle connection held nothing up
        req = urllib.request.Request(url, headers={"Accept-Encoding": "deflate, GZIP;q=1.0"})
        with urllib.request.urlopen(req, timeout=10) as r:
            assert r.headers["Content-Encoding"] == "gzip"
            assert gzip.decompress(r.read()) == body
        for req, code, says in (
                (urllib.request.Request(url, method="POST", data=b""), 405, b"use GET"),
                (urllib.request.Request(url, method="HEAD"), 405, b""),
                (urllib.request.Request(url + "?name[]=x"), 400, b"no query parameters")):
            try:
                urllib.request.urlopen(req, timeout=10)
                raise AssertionError(f"{req.full_url} {req.get_method()} was answered 200")
            except urllib.error.HTTPError as e:
                assert e.code == code and says in e.read()
        with urllib.request.urlopen(urllib.request.Request(url, method="OPTIONS"),
                                    timeout=10) as r:
            assert r.status == 200 and r.headers["Allow"] == "OPTIONS,GET"
        # a request in pieces; a head over 16 KiB; a line that is no request line
        with socket.create_connection(("127.0.0.1", http.port), timeout=10) as s:
            for piece in (b"GET /met", b"rics HTTP/1.1\r\nHost: x\r", b"\n\r\n"):
                s.sendall(piece)
                time.sleep(0.05)
            assert s.recv(65536).endswith(b"\r\n\r\n" + body)
        assert _raw(http.port, b"GET / HTTP/1.1\r\nX: " + b"a" * 20000 + b"\r\n\r\n") \
            .startswith(b"HTTP/1.1 431 ")
        assert _raw(http.port, b"GARBAGE\r\n\r\n").startswith(b"HTTP/1.1 400 ")
    finally:
        idle.close()
        t = time.monotonic()
        http.close()
        assert time.monotonic() - t < 1.0
    with pytest.raises(OSError):  # closed: nothing listens
        urllib.request.urlopen(url, timeout=5)


def _scrape_or_nothing(port: int) -> bytes:
    try:
        return _raw(port, b"GET /metrics HTTP/1.1\r\n\r\n")
    except ConnectionResetError:  # closed unanswered while the request was on its way
        return b""


def test_connections_past_the_bound_are_closed_unanswered(monkeypatch: Any) -> None:
    from hicache.core import metrics_http

    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 2)
    http = MetricsHttp(lambda: b"x 1.0\n", 0)
    idle = [socket.create_connection(("127.0.0.1", http.port)) for _ in range(2)]
    try:
        time.sleep(0.2)  # both taken in
        assert _scrape_or_nothing(http.port) == b""
        for s in idle:
            s.close()
        deadline = time.monotonic() + 5
        while (got := _scrape_or_nothing(http.port)) == b"" and time.monotonic() < deadline:
            time.sleep(0.05)  # the idle connections' threads notice their close
        assert got.endswith(b"x 1.0\n")
    finally:
        for s in idle:
            s.close()
        http.close()


def test_a_render_that_fails_is_one_500_and_the_endpoint_stays() -> None:
    calls = []

    def render() -> bytes:
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("boom")
        return b"x 1.0\n"

    http = MetricsHttp(render, 0)
    try:
        out = _raw(http.port, b"GET /metrics HTTP/1.1\r\n\r\n")
        assert out.startswith(b"HTTP/1.1 500 ") and b"RuntimeError" in out
        assert _raw(http.port, b"GET /metrics HTTP/1.1\r\n\r\n").endswith(b"x 1.0\n")
    finally:
        http.close()


def test_a_scrape_with_no_thread_to_serve_it_is_dropped_and_the_next_is_served(
        monkeypatch: Any) -> None:
    import threading
    import types

    from hicache.core import metrics_http

    monkeypatch.setattr(metrics_http, "MAX_CONNECTIONS", 1)  # a slot kept would refuse the next
    http = MetricsHttp(lambda: b"x 1.0\n", 0)
    starts = []

    class NoThreadOnce(threading.Thread):
        def start(self) -> None:
            starts.append(1)
            if len(starts) == 1:
                raise RuntimeError("can't start new thread")
            super().start()

    monkeypatch.setattr(metrics_http, "threading", types.SimpleNamespace(Thread=NoThreadOnce))
    try:
        assert _scrape_or_nothing(http.port) == b""  # closed unanswered
        assert _raw(http.port, b"GET /metrics HTTP/1.1\r\n\r\n").endswith(b"x 1.0\n")
        assert len(starts) == 2
    finally:
        http.close()
