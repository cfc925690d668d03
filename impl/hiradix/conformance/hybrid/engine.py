"""The protocol a (FULL, SWA) hybrid cache speaks to the hybrid machine (spec/13).

A hybrid cache keeps, per cached page, full-attention KV in a full pool and, while the
page is inside some path's sliding window, a second copy in an SWA pool; a page whose SWA
copy was dropped is a tombstone. Callers allocate a full slot and an SWA slot per token
(a *pair*), may drop the SWA half of a pair once decode has moved past the window, and
hand pairs to ``insert``. An adapter drives one engine's cache in these terms and reads
it back as an ``SwaView``; ``hiradix.conformance.hybrid.abstraction`` turns the view into
the model's ``SwaState`` (spec/13, 13.8) and the machine compares them after every step.

Slot ids are the engine's own; full slots name pairs (an engine's full->SWA mapping is
what ``SwaView.pairs`` reports, every entry it holds, live or stale).
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Literal, Protocol, runtime_checkable

from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

LockGranularity = Literal["page", "node"]


@dataclass(frozen=True)
class SwaPageView:
    """One cached page as the engine holds it."""

    full: tuple[int, ...]  # its full-pool slots, one per token
    swa: tuple[int, ...] | None  # its SWA-pool slots; None: a tombstone
    lock: int  # full locks on this page (a path lock counts on every page of the path)
    swa_lock: int  # SWA locks on this page


@dataclass(frozen=True)
class SwaHostPageView:
    """One page's host copies as the engine holds them (spec/13, 13.8a)."""

    full: tuple[int, ...]  # its full host slots; () where it has none (DEV-H11)
    swa: tuple[int, ...] | None  # its SWA host slots; None: a host tombstone


@dataclass(frozen=True)
class SwaHostView:
    """The engine's host tier (spec/13, 13.8a), held to the host invariants after every
    step, and to 13.8a's ``load_back`` where the machine drives one
    (``HostLoadingSwaEngine``); backups and host evictions happen inside the engine's
    calls, so only their results are judged."""

    pages: Mapping[Key, SwaHostPageView]  # every page with a host copy of either kind
    full_slots: int  # the host full pool's size
    swa_slots: int  # the host SWA pool's size
    full_free: frozenset[int]  # host full slots an allocation could hand out
    swa_free: frozenset[int]
    full_kv: Mapping[int, int]  # host full slot held by a page -> the code it holds
    swa_kv: Mapping[int, int]
    # Pages a labelled deviation exempts from a per-page host invariant, by its ID (e.g.
    # INV-SWA-HOST-ONLY-WITH-FULL under write_back, DEV-H11: a page still on the device
    # with an SWA host copy and no full one): counted, not failed. Never a pool's.
    exempt: Mapping[str, frozenset[Key]] = field(default_factory=dict)


@dataclass(frozen=True)
class SwaView:
    """Everything of the engine's cache the abstraction reads (spec/13, 13.8)."""

    pages: Mapping[Key, SwaPageView]
    full_free: frozenset[int]  # full slots an allocation could hand out
    swa_free: frozenset[int]  # SWA slots an allocation could hand out
    pairs: Mapping[int, int]  # the engine's full->SWA mapping: every entry it holds
    full_kv: Mapping[int, int]  # full slot -> the code last written into it
    swa_kv: Mapping[int, int]  # SWA slot -> the code last written into it
    own_check: str | None  # the engine's own consistency check: None if it passed, else why
    host: SwaHostView | None = None  # the host tier, where the engine has one (13.8a)


class SwaEngine(Protocol):
    """One (FULL, SWA) cache under test. Receipts are opaque to the machine."""

    name: str
    version: str
    config: SwaConfig
    lock_granularity: LockGranularity  # "node": an SWA lock covers whole radix nodes

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        """Full slots of ``num_tokens`` fresh pairs (whole pages), or None if out of room."""

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        """Write ``codes[i]`` as the KV of pair ``full_slots[i]`` into both halves
        (the SWA half only while the pair has one)."""

    def free_swa(self, full_slots: Sequence[int]) -> None:
        """Drop the SWA half of these caller-held pairs (decode moved past the window)."""

    def free(self, full_slots: Sequence[int]) -> None:
        """Return caller-held pairs (both halves, or the full half if the SWA one is gone)."""

    def match_prefix(self, key: Key) -> tuple[tuple[int, ...], Key | None]:
        """The matched full slots and the deepest matched page (None: the root)."""

    def insert(self, key: Key, full_slots: Sequence[int], swa_evicted: int) -> int:
        """Cache ``key`` from these pairs; the first ``swa_evicted`` tokens' pairs have
        no SWA half. Returns the tokens already cached (their pairs stay the caller's)."""

    def lock(self, page: Key | None) -> object:
        """Lock the path of ``page`` (full) and its window (SWA); a receipt."""

    def release_swa(self, receipt: object) -> None:
        """Release only the SWA part of the lock behind ``receipt``."""

    def unlock(self, receipt: object, swa_released: bool) -> None:
        """Release the lock behind ``receipt`` (its SWA part too unless released)."""

    def evict_full(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` full tokens by evicting leaves; the number freed."""

    def evict_swa(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` SWA tokens; the number of SWA slots freed."""

    def observe(self) -> SwaView:
        """The engine's state now."""

    def close(self) -> None:
        """Release what the engine holds."""


@runtime_checkable
class AllocEvictingSwaEngine(Protocol):
    """An ``SwaEngine`` whose allocator evicts for itself when a pool is short: the call
    the server makes (spec/13 13.3 ``evict_for_alloc``), driven where an engine has it."""

    def evict_for_alloc(self, full_need: int, swa_need: int) -> int:
        """Evict until each pool has ``need`` more free tokens than now, full first; the
        full tokens freed."""


@runtime_checkable
class HostMatchingSwaEngine(Protocol):
    """An ``SwaEngine`` with a host tier whose match also walks host-only pages: what its
    last ``match_prefix`` accepted on either tier, held to 13.8a's ``match_prefix_host``."""

    def last_host_match(self) -> tuple[Key | None, int]:
        """Of the last ``match_prefix``: the deepest page it accepted on either tier (None:
        the root) and the tokens of host-only pages up to it (what a load back loads)."""


@runtime_checkable
class HostLoadingSwaEngine(Protocol):
    """A ``HostMatchingSwaEngine`` that acts on a match's host hit as its server does: it
    loads the match's host-only KV back (13.8a ``load_back``), the copies issued and
    acknowledged before it returns."""

    def load_back(self) -> tuple[int, Key | None]:
        """Load back the last ``match_prefix``'s host hit; the full tokens past the
        device match that the request now has on the device, and the page its prefix
        ends at (None: the root)."""
