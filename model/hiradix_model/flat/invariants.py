"""The invariants of spec/15, 15.5.4, one named predicate per spec ID.

As in ``hiradix_model.invariants``: each predicate yields a description of every
violation; ``check`` returns the failing IDs, ``violations`` the descriptions.
``bytes_problems`` is INV-FLAT-BYTES, over what a retrieve served.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator, Mapping

from hiradix_model.components import Invariants
from hiradix_model.flat.state import TIERS, FlatState, Pin, tier_of
from hiradix_model.keys import Key, content_at

_REGISTRY: Invariants[FlatState] = Invariants()
flat_invariant = _REGISTRY
FLAT_INVARIANTS = _REGISTRY.predicates
BYTES_INVARIANT = "INV-FLAT-BYTES"


@flat_invariant("INV-FLAT-WELL-FORMED")
def well_formed(state: FlatState) -> Iterator[str]:
    size, layers = state.config.chunk_tokens, state.config.layers
    for tier in TIERS:
        entries = tier_of(state, tier)
        ticks = Counter(entry.tick for entry in entries.values())
        for obj, entry in entries.items():
            if not obj.chunk.tokens or len(obj.chunk.tokens) % size:
                yield f"{tier} {obj}: not a full chunk of {size} tokens"
            if not 0 <= obj.layer < layers:
                yield f"{tier} {obj}: layer outside 0..{layers - 1}"
            if entry.pins < 0:
                yield f"{tier} {obj}: {entry.pins} pins"
            if not 0 <= entry.tick < state.clock or ticks[entry.tick] > 1:
                yield f"{tier} {obj}: tick {entry.tick} repeated or not below {state.clock}"


@flat_invariant("INV-FLAT-CAPACITY")
def capacity(state: FlatState) -> Iterator[str]:
    for tier, limit in (("cpu", state.config.cpu_objects),
                        ("disk", state.config.disk_objects)):
        held = len(state.cpu if tier == "cpu" else state.disk)
        if held > limit:
            yield f"the {tier} tier holds {held} objects, its capacity is {limit}"


def _held(lookups: Mapping[str, tuple[Pin, ...]]) -> Counter[Pin]:
    return Counter(pin for pins in lookups.values() for pin in pins)


@flat_invariant("INV-FLAT-PINS-HELD")
def pins_held(state: FlatState) -> Iterator[str]:
    held = _held(state.lookups)
    for tier in TIERS:
        for obj, entry in tier_of(state, tier).items():
            want = held[Pin(tier, obj)]
            if entry.pins != want:
                yield f"{tier} {obj}: {entry.pins} pins, live lookups hold {want}"


@flat_invariant("INV-FLAT-PINS-RESIDENT")
def pins_resident(state: FlatState) -> Iterator[str]:
    for lookup_id, pins in state.lookups.items():
        for pin in pins:
            if pin.obj not in tier_of(state, pin.tier):
                yield f"lookup {lookup_id!r} pins {pin.obj} on the {pin.tier} tier, which " \
                      "does not hold it"


@flat_invariant("INV-FLAT-ALLOCATIONS")
def allocations(state: FlatState) -> Iterator[str]:
    # Between operations no staging buffer is live: every allocation is a CPU object.
    if state.allocations != len(state.cpu):
        yield (f"{state.allocations} active CPU allocations, {len(state.cpu)} objects on "
               "the CPU tier and no operation live")


@flat_invariant("INV-FLAT-CONTENT")
def content(state: FlatState) -> Iterator[str]:
    for tier in TIERS:
        for obj, entry in tier_of(state, tier).items():
            if entry.content != obj.chunk:
                yield f"{tier} {obj}: holds the KV of {entry.content}"


def check(state: FlatState) -> list[str]:
    """The IDs of the invariants ``state`` violates, in spec order."""
    return _REGISTRY.check(state)


def violations(state: FlatState) -> list[str]:
    """Every violation, prefixed with its ID."""
    return _REGISTRY.violations(state)


def bytes_problems(key: Key, layers: int, expected_tokens: int, tokens: int,
                   served: Mapping[tuple[int, int], Key | None]) -> Iterator[str]:
    """INV-FLAT-BYTES (15.5.4): a retrieve of ``key`` reports the ``expected_tokens``
    its lookup counted, and ``served[(layer, position)]`` -- whose KV landed at that
    position of that layer -- is ``key``'s own for every layer and served position."""
    if tokens != expected_tokens:
        yield f"the retrieve of {key} served {tokens} tokens, its lookup counted " \
              f"{expected_tokens}"
    for layer in range(layers):
        for position in range(min(tokens, len(key.tokens))):
            want, got = content_at(key, position), served.get((layer, position))
            if got != want:
                yield f"layer {layer} position {position}: served the KV of {got}, not {want}"
