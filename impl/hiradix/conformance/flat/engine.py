"""The protocol a pair of flat tiers speaks to the flat machine (spec/15, 15.5).

A flat-tier cache (LMCache's ``LocalCPUBackend`` over its ``LocalDiskBackend``) keeps,
per tier, a map from object -- one chunk's KV of one layer -- to its bytes, with pins and
an LRU order. An adapter drives one engine in the model's vocabulary (keys, chunks named
by their full prefix, lookup ids) and reads it back as a ``FlatView``;
``hiradix.conformance.flat.abstraction`` turns the view into the model's ``FlatState``
and the machine compares them after every step.

KV is written and read as integer *codes*, one per token and layer (the machine's
codebook): every element of a token's K is its code, every element of its V the code's
negation.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hiradix_model import Key
from hiradix_model.flat import FlatConfig, Obj, Pin


@dataclass(frozen=True)
class ObjView:
    """One object as a tier holds it."""

    obj: Obj
    pins: int
    codes: tuple[int | None, ...]  # per token of the chunk: its K code; None: not a code


@dataclass(frozen=True)
class FlatView:
    """Everything of the engine the abstraction reads, with no operation in flight."""

    cpu: tuple[ObjView, ...]  # least recently used first
    disk: tuple[ObjView, ...]  # least recently used first
    lookups: Mapping[str, tuple[Pin, ...]]  # live lookup id -> the pins it holds
    allocations: int  # the CPU allocator's active allocations
    own_check: str | None  # the engine's own bookkeeping: None if it agrees, else why


class FlatEngine(Protocol):
    """One pair of flat tiers under test; keys of 1 to 16 tokens, no namespace."""

    name: str
    version: str
    config: FlatConfig
    avoid: Mapping[str, str]  # situations the machine steers clear of -> the known bug

    def store(self, key: Key, codes: Sequence[Sequence[int]]) -> tuple[tuple[Obj, ...], ...]:
        """Store ``key`` whose KV at layer ``l``, position ``p`` is ``codes[l][p]``. For
        each layer, the disk tier's objects (least recently used first) once that
        layer's writes have finished."""

    def lookup(self, key: Key, pin: bool, lookup_id: str | None) -> int:
        """The tokens of ``key`` the tiers hold as a leading run; with ``pin``, pinned
        under ``lookup_id``."""

    def retrieve(self, key: Key) -> tuple[int, tuple[tuple[int | None, ...], ...]]:
        """Load ``key`` into fresh device slots: the tokens served, and per layer the
        code each position of ``key`` reads back (None: not a code)."""

    def unpin(self, lookup_id: str) -> None:
        """Release the pins of ``lookup_id``."""

    def clear(self) -> None:
        """Drop what the engine's clear drops."""

    def observe(self) -> FlatView:
        """The engine's state now."""

    def close(self) -> None:
        """Release what the engine holds."""
