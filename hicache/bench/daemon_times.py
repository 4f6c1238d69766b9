"""The daemon's own handling times, read from its ``stats``: how long its server thread took per
command, from the request to the reply (its ``hicache_command_seconds`` histogram).

Contract: ``command_times(metrics) -> {command: (count, seconds)}`` from a ``stats`` reply's
``metrics``; ``daemon_times(metrics)`` the same plus the key ``load_issue``: the issuer thread's
issue of GPU loads' later layers after their replies (its ``hicache_load_issue_seconds``
histogram), and ``load_issue_cpu``: the issuer's CPU time in them (its
``hicache_load_issue_cpu_seconds`` counter, with the issues' count); ``mean_ms(before, after, key)`` is the mean time in ms of that key's commands (or
issues) between two such readings (None when there were none). Benches use it to split what the
engine waits for into the daemon's handling and the rest (transport, client), and to show how
long the daemon's host work after the reply lasts.
"""
from __future__ import annotations

from typing import Any, Mapping

Times = dict[str, tuple[int, float]]


def command_times(metrics: Mapping[str, Any]) -> Times:
    return _histogram(metrics, "command_seconds", "command")


def daemon_times(metrics: Mapping[str, Any]) -> Times:
    out = command_times(metrics)
    issue = _histogram(metrics, "load_issue_seconds", None).get("")
    if issue is not None:
        out["load_issue"] = issue
        cpu = _counter(metrics, "load_issue_cpu_seconds")
        if cpu is not None:  # its count: the issues'
            out["load_issue_cpu"] = (issue[0], cpu)
    return out


def _counter(metrics: Mapping[str, Any], name: str) -> float | None:
    """The value of unlabelled counter ``hicache_<name>`` (None when absent)."""
    xs = metrics.get(f"hicache_{name}_total", metrics.get(f"hicache_{name}", []))
    return float(xs[0]["value"] or 0.0) if xs else None


def _histogram(metrics: Mapping[str, Any], name: str, label: str | None) -> Times:
    """{label value ("" when unlabelled): (count, seconds)} of histogram ``hicache_<name>``."""
    def key(x: Mapping[str, Any]) -> str:
        return x["labels"][label] if label else ""
    sums = {key(x): x["value"] or 0.0 for x in metrics.get(f"hicache_{name}_sum", [])}
    return {key(x): (int(x["value"] or 0), float(sums.get(key(x), 0.0)))
            for x in metrics.get(f"hicache_{name}_count", [])}


def mean_ms(before: Times, after: Times, command: str) -> float | None:
    n0, s0 = before.get(command, (0, 0.0))
    n1, s1 = after.get(command, (0, 0.0))
    return (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else None
