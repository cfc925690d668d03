"""The (FULL, MAMBA) cache on the device tier (spec/13m): state, operations, invariants.

One pure function per operation; each returns the new state (and its observation) or
raises ``PreconditionError`` / ``IllegalChoice`` leaving the state as it was.
"""

from hiradix_model.mamba.config import MambaConfig
from hiradix_model.mamba.evict import evict_for_alloc, evict_full, evict_states
from hiradix_model.mamba.insert import insert
from hiradix_model.mamba.invariants import (
    MAMBA_INVARIANTS,
    MATCH_INVARIANT,
    check,
    match_problems,
    violations,
)
from hiradix_model.mamba.locks import dec_lock_ref, dec_state_lock, inc_lock_ref
from hiradix_model.mamba.match import MambaMatch, match_prefix
from hiradix_model.mamba.pool import alloc, alloc_state, fork, free, free_state, write_state
from hiradix_model.mamba.state import MambaPage, MambaState, initial

__all__ = [
    "MAMBA_INVARIANTS",
    "MATCH_INVARIANT",
    "MambaConfig",
    "MambaMatch",
    "MambaPage",
    "MambaState",
    "alloc",
    "alloc_state",
    "check",
    "dec_lock_ref",
    "dec_state_lock",
    "evict_for_alloc",
    "evict_full",
    "evict_states",
    "fork",
    "free",
    "free_state",
    "inc_lock_ref",
    "initial",
    "insert",
    "match_prefix",
    "match_problems",
    "violations",
    "write_state",
]
