"""The daemon's own handling times, read from its ``stats``: how long its server thread took per
command, from the request to the reply (its ``hicache_command_seconds`` histogram).

Contract: ``command_times(metrics) -> {command: (count, seconds)}`` from a ``stats`` reply's
``metrics``; ``mean_ms(before, after, command)`` is the mean handling time in ms of the
commands of that name between two such readings (None when there were none). Benches use it
to split what the engine waits for into the daemon's handling and the rest (transport, client).
"""
from __future__ import annotations

from typing import Any, Mapping

Times = dict[str, tuple[int, float]]


def command_times(metrics: Mapping[str, Any]) -> Times:
    sums = {x["labels"]["command"]: x["value"] or 0.0
            for x in metrics.get("hicache_command_seconds_sum", [])}
    return {x["labels"]["command"]: (int(x["value"] or 0), float(sums.get(x["labels"]["command"], 0.0)))
            for x in metrics.get("hicache_command_seconds_count", [])}


def mean_ms(before: Times, after: Times, command: str) -> float | None:
    n0, s0 = before.get(command, (0, 0.0))
    n1, s1 = after.get(command, (0, 0.0))
    return (s1 - s0) / (n1 - n0) * 1e3 if n1 > n0 else None
