"""The Prometheus text format (0.0.4) of a metric catalog, written straight from its values.

Contract: ``TextFormat(catalog, prefix).render(values, hists)`` returns the text that
prometheus-client's ``generate_latest`` writes for the same families, byte for byte
(``tests/test_metrics_text.py`` holds the two equal), in a fraction of its time. Its input is
the copy ``Metrics`` takes under its lock: ``values`` = {name: [(label values, value)]} for
counters and gauges, ``hists`` = {name: [(label values, counts, sum)]} for histograms, counts
per bucket of ``buckets`` and +Inf last, not cumulative. Series appear in the order given, the
families in the catalog's order; a family without series still gets its HELP and TYPE lines.

Why: a scrape runs on the endpoint's thread, and for as long as it runs Python the daemon's
loop waits for the interpreter (docs/metrics.md, "What a scrape costs"). Here the text before
each value (name, labels, bucket bound) is built once per series and kept, so a scrape formats
only the numbers. Label values are escaped as Prometheus wants (backslash, quote, newline).
"""
from __future__ import annotations

import math
from typing import Iterable, Sequence

from prometheus_client.utils import floatToGoString

from hicache.core.metric_defs import MetricDef

Values = dict[str, list[tuple[tuple[str, ...], float]]]
Hists = dict[str, list[tuple[tuple[str, ...], list[int], float]]]


def _label_value(v: str) -> str:
    return v.replace("\\", r"\\").replace("\n", r"\n").replace('"', r'\"')


def _labels(pairs: Iterable[tuple[str, str]]) -> str:
    """``{a="x",b="y"}`` with the names sorted (as the reference writes them); '' for none."""
    inner = ",".join(f'{k}="{_label_value(v)}"' for k, v in sorted(pairs))
    return "{" + inner + "}" if inner else ""


class TextFormat:
    """Renders one catalog; keeps the per-series text it built (bounded by the series)."""

    def __init__(self, catalog: Sequence[MetricDef], prefix: str,
                 buckets: Sequence[float]) -> None:
        self.catalog = tuple(catalog)
        self.prefix = prefix
        self._les = [floatToGoString(b) for b in (*buckets, math.inf)]
        self._heads: dict[str, str] = {}
        for d in self.catalog:
            shown = prefix + d.name + ("_total" if d.kind == "counter" else "")
            doc = d.help.replace("\\", r"\\").replace("\n", r"\n")
            self._heads[d.name] = f"# HELP {shown} {doc}\n# TYPE {shown} {d.kind}\n"
        self._series: dict[tuple[str, tuple[str, ...]], str] = {}
        self._hist_series: dict[tuple[str, tuple[str, ...]], tuple[list[str], str, str]] = {}

    def _line_head(self, d: MetricDef, labels: tuple[str, ...]) -> str:
        key = (d.name, labels)
        head = self._series.get(key)
        if head is None:
            name = self.prefix + d.name + ("_total" if d.kind == "counter" else "")
            head = self._series[key] = f"{name}{_labels(zip(d.labels, labels))} "
        return head

    def _hist_heads(self, d: MetricDef, labels: tuple[str, ...]) -> tuple[list[str], str, str]:
        key = (d.name, labels)
        heads = self._hist_series.get(key)
        if heads is None:
            name, pairs = self.prefix + d.name, list(zip(d.labels, labels))
            buckets = [f"{name}_bucket{_labels(pairs + [('le', le)])} " for le in self._les]
            plain = _labels(pairs)
            heads = self._hist_series[key] = (buckets, f"{name}_count{plain} ",
                                              f"{name}_sum{plain} ")
        return heads

    def render(self, values: Values, hists: Hists) -> str:
        out: list[str] = []
        put, num = out.append, floatToGoString
        for d in self.catalog:
            put(self._heads[d.name])
            if d.kind == "histogram":
                for labels, counts, total in hists.get(d.name, ()):
                    buckets, count_head, sum_head = self._hist_heads(d, labels)
                    cum = 0
                    for head, n in zip(buckets, counts):
                        cum += n
                        put(head + num(cum) + "\n")
                    put(count_head + num(cum) + "\n")
                    put(sum_head + num(total) + "\n")
            else:
                for labels, v in values.get(d.name, ()):
                    put(self._line_head(d, labels) + num(v) + "\n")
        return "".join(out)
