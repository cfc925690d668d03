"""LMCache's flat CPU and disk tiers (spec/15, 15.5): state, operations, invariants.

One pure function per operation; each returns the new state (and its observation) or
raises ``PreconditionError`` / ``IllegalChoice`` leaving the state as it was.
"""

from hiradix_model.flat.clear import clear
from hiradix_model.flat.config import MAX_OBJECTS, FlatConfig
from hiradix_model.flat.invariants import (
    BYTES_INVARIANT,
    FLAT_INVARIANTS,
    bytes_problems,
    check,
    violations,
)
from hiradix_model.flat.lookup import lookup
from hiradix_model.flat.retrieve import Retrieved, pinned_run, retrieve
from hiradix_model.flat.state import (
    TIERS,
    Entry,
    FlatState,
    Obj,
    Pin,
    Tier,
    chunks,
    holds,
    initial,
    lru,
    objects,
    run,
)
from hiradix_model.flat.store import StoreResult, in_put_order, store, store_plan, store_races
from hiradix_model.flat.unpin import unpin

__all__ = [
    "BYTES_INVARIANT",
    "FLAT_INVARIANTS",
    "MAX_OBJECTS",
    "TIERS",
    "Entry",
    "FlatConfig",
    "FlatState",
    "Obj",
    "Pin",
    "Retrieved",
    "StoreResult",
    "Tier",
    "bytes_problems",
    "check",
    "chunks",
    "clear",
    "holds",
    "in_put_order",
    "initial",
    "lookup",
    "lru",
    "objects",
    "pinned_run",
    "retrieve",
    "run",
    "store",
    "store_plan",
    "store_races",
    "unpin",
    "violations",
]
