"""What the benches' command lines share: comma-separated flag values and progress lines.

Contract:

* ``parse_list(text, flag, conv, ok, want)``: the comma-separated values of ``flag`` (blank
  entries skipped), each converted by ``conv`` and accepted by ``ok``, in the order given;
  one ``UsageError`` line ("``flag`` wants ``want``, got ...", naming the first value that does
  not convert or is refused) when one fails, or when none is given.
* ``say(msg)``: one progress line on stderr, flushed (stdout holds the report or the JSON).
"""
from __future__ import annotations

import sys
from typing import Callable, TypeVar

from hicache.core.errors import UsageError

T = TypeVar("T")


def parse_list(text: str, flag: str, conv: Callable[[str], T], ok: Callable[[T], bool],
               want: str) -> list[T]:
    out: list[T] = []
    for part in (x.strip() for x in str(text).split(",")):
        if not part:
            continue
        try:
            v = conv(part)
        except ValueError:
            v = None
        if v is None or not ok(v):
            raise UsageError(f"{flag} wants {want}, got {part!r}")
        out.append(v)
    if not out:
        raise UsageError(f"{flag} wants {want}, got {text!r}")
    return out


def say(msg: str) -> None:
    print(msg, file=sys.stderr, flush=True)
