"""retrieve (spec/15, 15.5.3): serve the chunks a lookup pinned, each from its tier."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hiradix_model.component_args import require, require_key
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.flat.args import require_live
from hiradix_model.flat.invariants import check  # noqa: F401 (contracts)
from hiradix_model.flat.state import FlatState, Obj, Tier, chunks, lru
from hiradix_model.flat.touch import touched
from hiradix_model.keys import Key


@dataclass(frozen=True)
class Retrieved:
    """What a retrieve served."""

    tokens: int  # tokens of the key served, from its first
    sources: tuple[tuple[Key, Tier], ...]  # each chunk served and the tier it came from
    cpu_victims: tuple[Obj, ...] = ()  # CPU objects evicted to make room for staging


def pinned_run(state: FlatState, lookup_id: str) -> tuple[tuple[Key, Tier], ...]:
    """The chunks ``lookup_id`` pins, in pin order, with the tier of their pins."""
    seen: dict[Key, Tier] = {}
    for pin in state.lookups[lookup_id]:
        seen.setdefault(pin.obj.chunk, pin.tier)
    return tuple(seen.items())


def retrieve(state: FlatState, key: Key, lookup_id: str) -> tuple[FlatState, Retrieved]:
    """Serve ``key``, whose full chunks must be exactly the chunks the live lookup
    ``lookup_id`` pinned, each from the tier it is pinned in (the server retrieves what
    its lookup counted: sglang_adapter.py:310-346). Each object served from the disk
    tier goes through a staging allocation of the CPU allocator; where none is free, the
    CPU tier's least recently used unpinned *object* is evicted for it
    (local_cpu_backend.py:682-746; where none is left, not yet specified). The disk
    objects are touched layer by layer (local_disk_backend.py:641), and the staging is
    freed by the end. The CPU tier is neither touched nor given the chunks: no promotion
    on the layerwise path.

    pre: not check(state)
    post: not check(__return__[0])
    post: set(__return__[0].cpu) <= set(state.cpu)
    post: __return__[0].allocations == state.allocations - len(__return__[1].cpu_victims)
    raises: PreconditionError
    """
    require_key(key)
    name = require_live(state, lookup_id)
    served = pinned_run(state, name)
    size = state.config.chunk_tokens
    require(chunks(state, key) == tuple(chunk for chunk, _ in served)
            and len(key.tokens) == size * len(served), "key",
            f"must be the {len(served)} chunks {lookup_id!r} pinned, no more, no less")
    from_disk = [chunk for chunk, tier in served if tier == "disk"]
    cpu = dict(state.cpu)
    victims: list[Obj] = []
    free = state.config.cpu_objects - state.allocations
    for _ in range(len(from_disk) * state.config.layers - free):
        candidates = [obj for obj in lru(cpu) if cpu[obj].pins == 0]
        require(bool(candidates), "key", "no free CPU allocation and no unpinned CPU "
                "object left for a staging buffer: not yet specified (spec/15 15.5.3)")
        del cpu[candidates[0]]
        victims.append(candidates[0])
    order = [Obj(chunk, layer) for layer in range(state.config.layers) for chunk in from_disk]
    after = replace(state, cpu=cpu, allocations=state.allocations - len(victims))
    return (touched(after, "disk", order),
            Retrieved(size * len(served), served, tuple(victims)))
