"""Exceptions a user can meet: each carries a one-line message fit to print without a traceback."""


class HicacheError(Exception):
    """Base of every error hicache raises on purpose."""


class UsageError(HicacheError, ValueError):
    """Bad command-line input or configuration; the CLI prints it as one line and exits 2."""


class CapacityError(UsageError):
    """A requested size does not fit the memory or budget available (the user fixes it)."""
