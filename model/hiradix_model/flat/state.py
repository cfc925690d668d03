"""The state of LMCache's flat tiers (spec/15, 15.5.2): two maps object -> entry.

An *object* is one chunk's KV of one layer; a chunk is named by its full prefix (as a
page is, spec/01). A tier *holds* a chunk when it has all of the chunk's layers. Recency
is a tick per entry: the least recently used entry has the lowest tick.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from hiradix_model.flat.config import FlatConfig
from hiradix_model.keys import Key, page_keys

Tier = Literal["cpu", "disk"]
TIERS: tuple[Tier, ...] = ("cpu", "disk")


@dataclass(frozen=True)
class Obj:
    """One stored object: the KV of ``chunk`` at ``layer``."""

    chunk: Key
    layer: int


@dataclass(frozen=True)
class Entry:
    """An object as a tier holds it."""

    tick: int  # recency: higher is more recent
    pins: int = 0  # pins live lookups hold on it
    content: Key | None = None  # the chunk whose KV (at this layer) it holds; None: none


@dataclass(frozen=True)
class Pin:
    """One pin a lookup holds: on ``obj`` in ``tier``."""

    tier: Tier
    obj: Obj


@dataclass(frozen=True)
class FlatState:
    """The whole abstract pair of tiers. Treat every field as immutable."""

    config: FlatConfig
    cpu: Mapping[Obj, Entry]
    disk: Mapping[Obj, Entry]
    lookups: Mapping[str, tuple[Pin, ...]]  # live lookup id -> the pins it holds
    allocations: int  # the CPU allocator's active allocations (objects)
    clock: int  # the next tick


def initial(config: FlatConfig) -> FlatState:
    """Both tiers empty, no lookup live, nothing allocated."""
    return FlatState(config=config, cpu={}, disk={}, lookups={}, allocations=0, clock=0)


def tier_of(state: FlatState, tier: Tier) -> Mapping[Obj, Entry]:
    return state.cpu if tier == "cpu" else state.disk


def chunks(state: FlatState, key: Key) -> tuple[Key, ...]:
    """The full chunks of ``key``, first first (a partial tail is never stored)."""
    return page_keys(key, state.config.chunk_tokens)


def objects(state: FlatState, chunk: Key) -> tuple[Obj, ...]:
    """``chunk``'s objects, layer 0 first."""
    return tuple(Obj(chunk, layer) for layer in range(state.config.layers))


def holds(state: FlatState, tier: Tier, chunk: Key) -> bool:
    """``tier`` has every layer of ``chunk``."""
    entries = tier_of(state, tier)
    return all(obj in entries for obj in objects(state, chunk))


def run(state: FlatState, key: Key) -> tuple[tuple[Key, Tier], ...]:
    """The leading chunks of ``key`` each held whole by one tier, with that tier (the CPU
    tier where both hold it): what a lookup counts."""
    found: list[tuple[Key, Tier]] = []
    for chunk in chunks(state, key):
        holder = next((tier for tier in TIERS if holds(state, tier, chunk)), None)
        if holder is None:
            break
        found.append((chunk, holder))
    return tuple(found)


def lru(entries: Mapping[Obj, Entry]) -> list[Obj]:
    """The objects of one tier, least recently used first."""
    return sorted(entries, key=lambda obj: entries[obj].tick)
