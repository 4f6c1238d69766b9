"""Workloads for the simulator: a built-in multi-turn generator and a Mooncake trace reader.

Both give a list of ``Request``: the page keys of the request's full 256-token input pages
(equal keys = equal content, and a key stands for its whole prefix, as in a hash chain), the
pages the request leaves in the cache when it finishes, and its token counts.

* ``multi_turn(...)`` — sessions that start from one of a few shared system prompts and run
  several turns; each turn's input is the previous turn's input and answer plus a new user
  message, so prefix reuse happens within a session (the history) and across sessions (the
  system prompt). Sessions interleave, so a session's next turn often finds its history
  evicted from the device tier.
* ``read_trace(path)`` — the Mooncake FAST'25 trace format: one JSON object per line with
  ``timestamp`` (ms), ``input_length``, ``output_length`` (tokens) and ``hash_ids`` (one id per
  512-token block of the input). A 512-token block is two pages: block ``b`` gives page keys
  ``2b`` and ``2b + 1``. Only full pages are cached; the output is not (its blocks appear as new
  ids in the next turn's ``hash_ids``). A malformed line raises ``UsageError`` naming the file
  and line number.
"""
from __future__ import annotations

import json
import math
import random
from dataclasses import dataclass
from typing import Iterator

from hicache.core.errors import UsageError

PAGE_TOKENS = 256
TRACE_BLOCK_TOKENS = 512
PAGES_PER_BLOCK = TRACE_BLOCK_TOKENS // PAGE_TOKENS


@dataclass(frozen=True)
class Request:
    rid: int
    arrival_s: float
    input_tokens: int
    output_tokens: int
    pages: tuple[int, ...]  # keys of the full input pages, in order
    cache_pages: tuple[int, ...]  # keys of the pages cached at release (input, then output)
    session: int = -1

    @property
    def max_prefix_pages(self) -> int:
        """Pages a prefix hit may cover: at least one input token is always computed."""
        return min(len(self.pages), (self.input_tokens - 1) // PAGE_TOKENS)

    @property
    def total_pages(self) -> int:
        """Device page rows the request holds while it runs (input, output, partial tail)."""
        return math.ceil((self.input_tokens + self.output_tokens) / PAGE_TOKENS)


# ------------------------------------------------------------------------------ generator
def multi_turn(
    num_requests: int,
    seed: int = 0,
    *,
    system_prompts: int = 4,
    system_pages: tuple[int, int] = (4, 16),
    user_pages: tuple[int, int] = (1, 4),
    answer_pages: tuple[int, int] = (1, 2),
    turns: tuple[int, int] = (2, 8),
    active_sessions: int = 16,
    max_pages: int = 96,
) -> list[Request]:
    """``num_requests`` turns of interleaved chat sessions (see the module docstring).

    Page keys are unique ints; a session ends after its last turn or when its history would
    exceed ``max_pages``.
    """
    if num_requests < 0:
        raise UsageError(f"number of requests must be >= 0, got {num_requests}")
    rnd = random.Random(seed)
    next_key = 0

    def fresh(n: int) -> list[int]:
        nonlocal next_key
        keys = list(range(next_key, next_key + n))
        next_key += n
        return keys

    prompts = [fresh(rnd.randint(*system_pages)) for _ in range(system_prompts)]
    sessions: list[dict] = []
    session_id = 0
    out: list[Request] = []
    clock = 0.0
    while len(out) < num_requests:
        while len(sessions) < active_sessions:
            sessions.append({"id": session_id, "history": list(rnd.choice(prompts)),
                             "turns": rnd.randint(*turns)})
            session_id += 1
        s = rnd.choice(sessions)
        pages = s["history"] + fresh(rnd.randint(*user_pages))
        answer = fresh(rnd.randint(*answer_pages))
        clock += rnd.expovariate(4.0)
        out.append(Request(len(out), clock, len(pages) * PAGE_TOKENS, len(answer) * PAGE_TOKENS,
                           tuple(pages), tuple(pages + answer), s["id"]))
        s["history"] = pages + answer
        s["turns"] -= 1
        if s["turns"] <= 0 or len(s["history"]) + user_pages[1] + answer_pages[1] > max_pages:
            sessions.remove(s)
    return out


# ------------------------------------------------------------------------------ traces
def _bad(path: str, lineno: int, msg: str) -> UsageError:
    return UsageError(f"{path}:{lineno}: {msg}")


def _int_field(obj: dict, name: str, path: str, lineno: int, minimum: int) -> int:
    if name not in obj:
        raise _bad(path, lineno, f"missing field {name!r}")
    v = obj[name]
    if type(v) is not int or v < minimum:
        raise _bad(path, lineno, f"{name} must be an integer >= {minimum}, got {v!r}")
    return v


def parse_trace_line(line: str, rid: int, path: str = "<trace>", lineno: int = 0) -> Request:
    """One trace line as a ``Request``; raises UsageError with ``path:lineno``."""
    try:
        obj = json.loads(line)
    except json.JSONDecodeError as e:
        raise _bad(path, lineno, f"not valid JSON ({e.msg} at column {e.colno})") from None
    if not isinstance(obj, dict):
        raise _bad(path, lineno, "each line must be a JSON object")
    ts = obj.get("timestamp", 0)
    if type(ts) not in (int, float) or not math.isfinite(ts) or ts < 0:
        raise _bad(path, lineno, f"timestamp must be a number >= 0 (ms), got {ts!r}")
    n_in = _int_field(obj, "input_length", path, lineno, 1)
    n_out = _int_field(obj, "output_length", path, lineno, 0)
    if "hash_ids" not in obj:
        raise _bad(path, lineno, "missing field 'hash_ids'")
    ids = obj["hash_ids"]
    if not isinstance(ids, list) or not all(type(b) is int and b >= 0 for b in ids):
        raise _bad(path, lineno, "hash_ids must be a list of integers >= 0")
    blocks = math.ceil(n_in / TRACE_BLOCK_TOKENS)
    if len(ids) != blocks:
        raise _bad(path, lineno, f"hash_ids has {len(ids)} blocks but input_length {n_in} "
                                 f"spans {blocks} blocks of {TRACE_BLOCK_TOKENS} tokens")
    full = n_in // PAGE_TOKENS
    pages = tuple(PAGES_PER_BLOCK * ids[p // PAGES_PER_BLOCK] + p % PAGES_PER_BLOCK
                  for p in range(full))
    return Request(rid, float(ts) / 1000.0, n_in, n_out, pages, pages)


def iter_trace(path: str) -> Iterator[Request]:
    try:
        f = open(path, encoding="utf-8")
    except OSError as e:
        raise UsageError(f"cannot read trace {path}: {e.strerror}") from None
    with f:
        rid = 0
        try:
            for lineno, line in enumerate(f, 1):
                if not line.strip():
                    continue
                yield parse_trace_line(line, rid, path, lineno)
                rid += 1
        except UnicodeDecodeError:
            raise UsageError(f"{path}: not a UTF-8 text file") from None


def read_trace(path: str, limit: int | None = None) -> list[Request]:
    """Requests of a Mooncake-format trace (the first ``limit`` when given)."""
    out: list[Request] = []
    for req in iter_trace(path):
        if limit is not None and len(out) >= limit:
            break
        out.append(req)
    if not out:
        raise UsageError(f"{path}: the trace holds no requests")
    return out
