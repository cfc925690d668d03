"""lookup (spec/15, 15.5.3): the leading run of chunks held; with ``pin``, pinned."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import require, require_key
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.flat.args import require_id
from hiradix_model.flat.invariants import check  # noqa: F401 (contracts)
from hiradix_model.flat.state import TIERS, FlatState, Pin, objects, run
from hiradix_model.flat.touch import pinned, touched
from hiradix_model.keys import Key


def lookup(state: FlatState, key: Key, pin: bool,
           lookup_id: str | None = None) -> tuple[FlatState, int]:
    """The tokens of ``key``'s leading chunks each held whole by one tier (the CPU tier
    first; cache_engine.py:1219-1243). With ``pin``: each of their objects is pinned in
    the tier that holds it, under the fresh ``lookup_id``, and each tier's pinned
    objects are touched in reverse pin order, so a run's first chunk and a chunk's layer
    0 end most recent (local_cpu_backend.py:88-91, 137-142). Without: nothing changes.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] % state.config.chunk_tokens == 0
    post: pin or __return__[0] == state
    raises: PreconditionError
    """
    require_key(key)
    require(isinstance(pin, bool), "pin", "must be a bool")
    found = run(state, key)
    tokens = len(found) * state.config.chunk_tokens
    if not pin:
        return state, tokens
    name = require_id(lookup_id)
    require(name not in state.lookups, "lookup_id", f"{name!r} is live already")
    pins = tuple(Pin(tier, obj) for chunk, tier in found for obj in objects(state, chunk))
    after = pinned(state, pins, +1)
    for tier in TIERS:
        after = touched(after, tier, [p.obj for p in reversed(pins) if p.tier == tier])
    return replace(after, lookups={**state.lookups, name: pins}), tokens
