"""The Prometheus text format (0.0.4) of a metric catalog, written straight from its values.

Contract: ``TextFormat(catalog, prefix).render(values, hists)`` returns the text that
prometheus-client's ``generate_latest`` writes for the same families, byte for byte
(``tests/test_metrics_text.py`` holds the two equal), in a fraction of its time. Its input is
the copy ``Metrics`` takes under its lock: ``values`` = {name: [(label values, value)]} for
counters and gauges, ``hists`` = {name: [(label values, counts, sum)]} for histograms, counts
per bucket of ``buckets`` and +Inf last, not cumulative. Series appear in the order given, the
families in the catalog's order; a family without series still gets its HELP and TYPE lines.

Why: a scrape runs on the endpoint's thread, and for as long as it runs Python the daemon's
loop waits for the interpreter (docs/metrics.md, "What a scrape costs"). Here each series'
text is kept with the value it was written for, and written again only when the value
changed: a counter or gauge whose value is the same object as last time (the copy holds the
objects the metrics hold: unchanged means untouched), a histogram whose counts are equal and
whose sum is the same object. The text before the values (name, labels, bucket bounds) is built
once per series. Label values are escaped as Prometheus wants (backslash, quote, newline).
Several threads may render at once (each entry is replaced whole).
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
        # per series: its text before the value, and the last value (the object) with its line
        self._lines: dict[tuple[str, tuple[str, ...]], tuple[str, object, str]] = {}
        # per histogram series: its lines' heads, and the last counts and sum with the block
        self._blocks: dict[tuple[str, tuple[str, ...]], tuple[list[str], str, str, tuple,
                                                              object, str]] = {}

    def _line(self, d: MetricDef, labels: tuple[str, ...], v: float) -> str:
        key = (d.name, labels)
        got = self._lines.get(key)
        if got is not None and got[1] is v:  # the same object: the same text
            return got[2]
        head = got[0] if got is not None else \
            f"{self.prefix}{d.name}{'_total' if d.kind == 'counter' else ''}" \
            f"{_labels(zip(d.labels, labels))} "
        line = head + floatToGoString(v) + "\n"
        self._lines[key] = (head, v, line)
        return line

    def _block(self, d: MetricDef, labels: tuple[str, ...], counts: list[int],
               total: float) -> str:
        key, ints = (d.name, labels), tuple(counts)
        got = self._blocks.get(key)
        if got is not None and got[3] == ints and got[4] is total:
            return got[5]
        if got is None:
            name, pairs = self.prefix + d.name, list(zip(d.labels, labels))
            plain = _labels(pairs)
            heads = ([f"{name}_bucket{_labels(pairs + [('le', le)])} " for le in self._les],
                     f"{name}_count{plain} ", f"{name}_sum{plain} ")
        else:
            heads = got[:3]
        out, cum, num = [], 0, floatToGoString
        for head, n in zip(heads[0], counts):
            cum += n
            out.append(head + num(cum) + "\n")
        out.append(heads[1] + num(cum) + "\n")
        out.append(heads[2] + num(total) + "\n")
        block = "".join(out)
        self._blocks[key] = (*heads, ints, total, block)
        return block

    def render(self, values: Values, hists: Hists) -> str:
        out: list[str] = []
        put = out.append
        for d in self.catalog:
            put(self._heads[d.name])
            if d.kind == "histogram":
                for labels, counts, total in hists.get(d.name, ()):
                    put(self._block(d, labels, counts, total))
            else:
                for labels, v in values.get(d.name, ()):
                    put(self._line(d, labels, v))
        return "".join(out)
