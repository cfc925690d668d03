"""The protocol a (FULL, MAMBA) cache speaks to the Mamba machine (spec/13m, 13m.8).

A Mamba (recurrent, SSM) layer keeps no per-token KV: after a prefix it holds one
fixed-size *state*. A cache of such a model keeps, beside each cached page's full
attention KV, optionally the state after that page's root path, in a state pool. A request
resumes only where a state is cached; the state it resumes from is copied into a slot of
its own (copy on write), evolves there, and is handed to ``insert`` at the end of the key.

An adapter drives one engine's cache in these terms and reads it back as a ``MambaView``;
``hiradix.conformance.mamba.abstraction`` turns the view into the model's ``MambaState``
and the machine compares them after every step. Slot ids are the engine's own.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol, runtime_checkable

from hiradix_model import Key
from hiradix_model.mamba import MambaConfig


@dataclass(frozen=True)
class MambaPageView:
    """One cached page as the engine holds it."""

    full: tuple[int, ...]  # its full-pool slots, one per token
    state: int | None  # the state slot after this page's path; None: no state here
    lock: int  # full locks on this page (a path lock counts on every page of the path)
    state_lock: int  # state locks on this page (counted whether or not it holds a state)


@dataclass(frozen=True)
class MambaHostPageView:
    """One page's host copies as the engine holds them (spec/13m, 13m.8b)."""

    full: tuple[int, ...]  # its full host slots; () where it has none (DEV-M13)
    state: int | None  # the host state slot after its path (a node's last page); None: none


@dataclass(frozen=True)
class MambaHostView:
    """The engine's host tier (13m.8b), held to the host invariants after every step, and
    to 13m.8b's ``load_back`` where the machine drives one (``HostLoadingMambaEngine``);
    backups and host evictions happen inside the engine's calls, so only their results
    are judged."""

    pages: Mapping[Key, MambaHostPageView]  # every page with a host copy of either kind
    full_slots: int  # the host full pool's size
    state_slots: int  # the host state pool's size
    full_free: frozenset[int]  # host slots an allocation could hand out
    state_free: frozenset[int]
    full_kv: Mapping[int, int]  # host full slot held by a page -> the code it holds
    state_kv: Mapping[int, int]  # host state slot held by a page -> the code it holds
    # Pages a labelled deviation exempts from a per-page host invariant, by its ID
    # (INV-MAMBA-HOST-ONLY-WITH-FULL under write_back, DEV-M13): counted, not failed.
    exempt: Mapping[str, frozenset[Key]] = field(default_factory=dict)


@dataclass(frozen=True)
class MambaView:
    """Everything of the engine's cache the abstraction reads."""

    pages: Mapping[Key, MambaPageView]
    full_free: frozenset[int]  # full slots an allocation could hand out
    state_free: frozenset[int]  # state slots an allocation could hand out
    full_kv: Mapping[int, int]  # full slot -> the code last written into it
    state_kv: Mapping[int, int]  # state slot -> the code last written into it
    own_check: str | None  # the engine's own consistency check: None if it passed, else why
    host: MambaHostView | None = None  # the host tier, where the engine has one (13m.8b)


@dataclass(frozen=True)
class MambaHit:
    """What ``match_prefix`` answered."""

    full: tuple[int, ...]  # full slots from the root to ``page``
    page: Key | None  # the deepest matched page holding a state (None: the root)
    full_hit: int  # tokens of the key whose full KV is cached (at least ``len(full)``)


class MambaEngine(Protocol):
    """One (FULL, MAMBA) cache under test. Receipts are opaque to the machine."""

    name: str
    version: str
    config: MambaConfig

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        """``num_tokens`` fresh full slots (whole pages), or None if out of room."""

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        """Write ``codes[i]`` as the KV of full slot ``full_slots[i]``."""

    def free(self, full_slots: Sequence[int]) -> None:
        """Return caller-held full slots."""

    def alloc_state(self) -> int | None:
        """One fresh state slot for a request, or None if out of room."""

    def write_state(self, slot: int, code: int) -> None:
        """Write ``code`` as the state held in a caller-held state slot (the forward pass)."""

    def free_state(self, slot: int) -> None:
        """Return a caller-held state slot."""

    def match_prefix(self, key: Key) -> MambaHit:
        """The longest prefix of ``key`` a request can resume from. Changes nothing the
        model reads (recency aside)."""

    def fork(self, page: Key) -> int | None:
        """Copy the state cached at ``page`` into a fresh caller-held slot (copy on
        write); None if the pool has no room."""

    def insert(self, key: Key, full_slots: Sequence[int], state: int) -> tuple[int, bool]:
        """Cache ``key`` from these full slots with ``state`` (a caller-held slot holding
        the state after ``key``) at its end. Returns the tokens already cached (their
        slots stay the caller's) and whether the cache took ``state``."""

    def lock(self, page: Key | None, with_state: bool) -> object:
        """Lock the path of ``page`` (full) and, if ``with_state``, its state; a receipt."""

    def release_state(self, receipt: object) -> None:
        """Release only the state part of the lock behind ``receipt``."""

    def unlock(self, receipt: object, state_released: bool) -> None:
        """Release the lock behind ``receipt`` (its state part too unless released)."""

    def evict_full(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` full tokens by deleting leaves; full tokens freed."""

    def evict_states(self, num_states: int) -> int:
        """Free at least ``num_states`` cached states; the number of state slots freed."""

    def observe(self) -> MambaView:
        """The engine's state now."""

    def close(self) -> None:
        """Release what the engine holds."""


@runtime_checkable
class AllocEvictingMambaEngine(Protocol):
    """A ``MambaEngine`` whose allocators evict for themselves when a pool is short: the
    call the server makes (spec/13m 13m.3 ``evict_for_alloc``), driven where an engine has
    it."""

    def evict_for_alloc(self, full_need: int, state_need: int) -> tuple[int, int]:
        """Evict until the full pool has ``full_need`` more free tokens and the state pool
        ``state_need`` more free slots than now; the full tokens and the states freed."""


@runtime_checkable
class HostMatchingMambaEngine(Protocol):
    """A ``MambaEngine`` with a host tier whose match also walks host-only pages: where
    its last ``match_prefix`` ended on either tier, held to 13m.8b's
    ``match_prefix_host``."""

    def last_host_match(self) -> Key | None:
        """Of the last ``match_prefix``: the deepest page it accepted on either tier (None:
        the root)."""


@runtime_checkable
class HostLoadingMambaEngine(Protocol):
    """A ``HostMatchingMambaEngine`` that acts on a match's host hit as its server does: it
    loads the match's host-only KV and state back (13m.8b ``load_back``), the copies
    issued and acknowledged before it returns."""

    def load_back(self) -> tuple[int, Key | None, int | None]:
        """Load back the last ``match_prefix``'s host hit; the full tokens past the device
        match that the request now has on the device, the page its prefix ends at (None:
        the root), and the state slot the load gave the request (DEV-M14: a copy of the
        loaded state, which the caller now holds), or None."""
