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

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Protocol

from hiradix_model import Key, State
from hiradix_model.flat import FlatConfig, Obj, Pin
from hiradix_model.keys import content_at


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


# -- a device radix tree over the flat tiers (spec/15 15.9) --------------------------------

@dataclass(frozen=True, slots=True)
class RadixConfig:
    """One cache: a device tree of ``device_pages`` pages of ``page_size`` tokens over
    flat tiers of ``flat`` (chunk size, layers, capacities in objects)."""

    flat: FlatConfig
    page_size: int = 1
    device_pages: int = 16

    def __post_init__(self) -> None:
        for name, value in (("page_size", self.page_size),
                            ("device_pages", self.device_pages)):
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        if self.flat.chunk_tokens % self.page_size:
            # A device hit is page-aligned and the flat tiers skip only whole chunks of it
            # (15.9): a chunk must be whole pages.
            raise ValueError(f"flat: chunk of {self.flat.chunk_tokens} tokens is not a "
                             f"multiple of page_size {self.page_size}")

    @property
    def device_slots(self) -> int:
        return self.device_pages * self.page_size


@dataclass(frozen=True)
class Served:
    """What one request's match gave: the device slots of its prefix (device hit, then
    what the tiers loaded), and how many of them the tiers loaded."""

    device_hit: int  # tokens the device tree held before the match
    loaded: int  # tokens the tiers loaded into fresh device slots
    slots: tuple[int, ...]  # the engine's slot ids of the whole prefix


def codes_of(key: Key, layers: int, code: Callable[[Key, int], int]
             ) -> tuple[tuple[int, ...], ...]:
    """Per layer, the code of each position of ``key`` (``code``: the machine's
    codebook, by a position's content and the layer)."""
    return tuple(tuple(code(content_at(key, p), layer) for p in range(len(key.tokens)))
                 for layer in range(layers))


class RadixEngine(Protocol):
    """A device radix tree over flat tiers under test (SGLang's ``LMCRadixCache``), driven
    request by request as its scheduler drives it (15.9)."""

    name: str
    version: str
    config: RadixConfig
    avoid: Mapping[str, str]  # situations the machine steers clear of -> the known bug
    loads_started: int  # loads the tiers started (a match past the device hit)
    disk_orders: Sequence[tuple[Obj, ...]]  # per layer, the disk tier after the last store

    def device_hit(self, tokens: Sequence[int]) -> int:
        """The tokens of ``tokens`` the device tree holds, with nothing changed."""

    def device_available(self) -> int:
        """Device slots free for an allocation."""

    def evict(self, tokens: int) -> int:
        """The device tree's eviction of ``tokens``; the tokens freed."""

    def live_lookups(self) -> frozenset[str]:
        """The ids of the tiers' lookups whose pins are held."""

    def match_prefix(self, tokens: Sequence[int]) -> tuple[Served, object]:
        """The scheduler's match: the device hit, then a load from the tiers past it into
        fresh device slots; and the node the request locks (opaque)."""

    def forward(self) -> None:
        """The forward pass: each layer's reads finish the load and release its pins."""

    def read(self, slots: Sequence[int], contents: Callable[[int, int], Key | None]
             ) -> list[Key | None]:
        """What each device slot holds at every layer (by ``contents``: a code and a
        layer to a prefix), None where the layers disagree or hold no code."""

    def finish(self, tokens: Sequence[int], served: Served, node: object,
               codes: Sequence[Sequence[int]]) -> bool:
        """The request's KV written (``codes[l][p]``), then its finish (insert into the
        tree, the tiers' store); False if the device had no room for it."""

    def tiers(self) -> FlatView:
        """The flat tiers now."""

    def device_state(self, contents: Callable[[int, int], Key | None],
                     arriving: Mapping[int, Key] | None) -> State:
        """The device tree as the model's state of a device-only cache (``arriving``:
        slots of a load in flight, counted as landed)."""

    def close(self) -> None:
        """Release what the engine holds."""
