"""Errors raised by the host pools; each carries a one-line message fit to print as is.

* ``PoolError`` — base: a bad argument or a refused operation; state is unchanged by it.
* ``PoolExhausted`` — not enough free rows in an index space (a normal, retryable refusal).
* ``RowRangeError`` — row ids out of range or duplicated; ``NotOwnerError`` — rows not
  allocated to the caller.
* ``ArenaError`` — mapping, registration or use of a closed arena.
* ``CapacityError`` — a size the machine cannot hold: ``hicache.core.errors.CapacityError``
  (a ``UsageError``), re-exported here because the arena raises it.
* ``InvariantError`` — bookkeeping found inconsistent by ``check_invariants`` (a bug, not input).
"""
from __future__ import annotations

from hicache.core.errors import CapacityError, HicacheError

__all__ = ["PoolError", "PoolExhausted", "RowRangeError", "NotOwnerError", "ArenaError",
           "CapacityError", "InvariantError"]


class PoolError(HicacheError):
    """A host-pool operation was refused; nothing was changed."""


class PoolExhausted(PoolError):
    """An index space has fewer free rows than asked for."""


class RowRangeError(PoolError):
    """Row ids outside the space, or listed twice where each must be distinct."""


class NotOwnerError(PoolError):
    """Rows not allocated, or allocated to another owner."""


class ArenaError(PoolError):
    """The pinned arena could not be mapped, registered or used."""


class InvariantError(PoolError):
    """Allocator bookkeeping is inconsistent (free and used rows disagree)."""
