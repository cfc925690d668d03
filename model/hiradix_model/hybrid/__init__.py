"""The (FULL, SWA) hybrid cache on the device tier (spec/13): state, operations, invariants.

One pure function per operation; each returns the new state (and its observation) or
raises ``PreconditionError`` / ``IllegalChoice`` leaving the state as it was.
"""

from hiradix_model.hybrid.config import SwaConfig
from hiradix_model.hybrid.evict import evict_for_alloc, evict_full, evict_swa
from hiradix_model.hybrid.insert import insert
from hiradix_model.hybrid.invariants import (
    MATCH_INVARIANT,
    SWA_INVARIANTS,
    check,
    match_problems,
    violations,
)
from hiradix_model.hybrid.locks import dec_lock_ref, dec_swa_lock, inc_lock_ref
from hiradix_model.hybrid.match import SwaMatch, match_prefix
from hiradix_model.hybrid.pool import alloc, free, free_swa
from hiradix_model.hybrid.state import SwaPage, SwaState, initial, window, window_live

__all__ = [
    "MATCH_INVARIANT",
    "SWA_INVARIANTS",
    "SwaConfig",
    "SwaMatch",
    "SwaPage",
    "SwaState",
    "alloc",
    "check",
    "dec_lock_ref",
    "dec_swa_lock",
    "evict_for_alloc",
    "evict_full",
    "evict_swa",
    "free",
    "free_swa",
    "inc_lock_ref",
    "initial",
    "insert",
    "match_prefix",
    "match_problems",
    "violations",
    "window",
    "window_live",
]
