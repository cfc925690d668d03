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


class EventSinkError(HiradixError):
    """The KV event sink raised (spec/11, 11.7). The operation completed and its state is
    whole; every one of its events was still offered, in order. ``result`` is what the
    operation returned, ``failures`` how many of its ``offered`` events the sink raised
    on; ``__cause__`` is the first exception."""

    def __init__(self, result: object, failures: int, offered: int) -> None:
        super().__init__(f"events: the KV event sink raised on {failures} of {offered} "
                         "events (the operation completed; its result is this error's "
                         "``result``)")
        self.result = result
        self.failures = failures
        self.offered = offered


class RankSyncError(HiradixError):
    """A collective across ranks failed (spec/12, 12.6): a broken or wrong process group,
    a peer gone. ``what`` names the decision; ``__cause__`` is the collective's own
    error. The sync object is unchanged; the cache that issued it is whole, with the
    operation done up to the decision and nothing of what the decision decides."""

    def __init__(self, what: str, reason: str) -> None:
        super().__init__(f"collective {what!r}: {reason}")
        self.what = what
        self.reason = reason
        # An insert whose backup's collective failed is done: its result (12.6).
        self.result: object = None


class InvariantViolation(HiradixError, AssertionError):
    """check_invariants() found a broken invariant; ``spec_id`` names it (spec/05)."""

    def __init__(self, spec_id: str, details: list[str], dump: str) -> None:
        shown = "\n  ".join(details[:10])
        super().__init__(f"{spec_id} violated:\n  {shown}\n--- cache state ---\n{dump}")
        self.spec_id = spec_id
        self.details = details

