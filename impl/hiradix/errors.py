"""Typed errors of the implementation.

Caller misuse raises an ``InvalidArgument`` subclass whose message names the argument;
the cache is unchanged after it. ``InvariantViolation`` is different: it means the cache
itself is broken, and carries the spec ID that failed.
"""

from __future__ import annotations


class HiradixError(Exception):
    """Base class of every error hiradix raises."""


class InvalidArgument(HiradixError, ValueError):
    """An argument is invalid; ``argument`` names it."""

    def __init__(self, argument: str, reason: str) -> None:
        super().__init__(f"{argument}: {reason}")
        self.argument = argument
        self.reason = reason


class SlotError(InvalidArgument):
    """Caller misuse of a pool, an allocator or a copy engine (bad slot tensors, double
    free, over-acknowledging copies). The object raising it is unchanged."""


class ForeignNode(InvalidArgument):
    """A node handle that does not belong to this cache, or was removed from it."""


class NotLocked(InvalidArgument):
    """dec_lock_ref on a node the caller holds no lock on."""


class ConfigError(InvalidArgument):
    """A configuration field is invalid."""


class InvariantViolation(HiradixError, AssertionError):
    """check_invariants() found a broken invariant; ``spec_id`` names it (spec/05)."""

    def __init__(self, spec_id: str, details: list[str], dump: str) -> None:
        shown = "\n  ".join(details[:10])
        super().__init__(f"{spec_id} violated:\n  {shown}\n--- cache state ---\n{dump}")
        self.spec_id = spec_id
        self.details = details

