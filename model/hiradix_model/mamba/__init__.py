"""The (FULL, MAMBA) cache (spec/13m): state, operations, invariants; the device tier and,
with host slots, the host tier (13m.8b).

One pure function per operation; each returns the new state (and its observation) or
raises ``PreconditionError`` / ``IllegalChoice`` leaving the state as it was.
"""

from hiradix_model.mamba.config import MambaConfig
from hiradix_model.mamba.evict import evict_for_alloc, evict_full, evict_states
from hiradix_model.mamba.host import (
    HOST_MATCH_INVARIANT,
    MambaHostMatch,
    backup,
    evict_host_full,
    evict_host_states,
    host_leaves,
    host_match_problems,
    load_back,
    load_plan,
    match_prefix_host,
    state_backup_needed,
)
from hiradix_model.mamba.insert import insert
from hiradix_model.mamba.invariants import (
    HOST_INVARIANTS,
    MAMBA_INVARIANTS,
    MATCH_INVARIANT,
    check,
    match_problems,
    violations,
)
from hiradix_model.mamba.locks import dec_lock_ref, dec_state_lock, inc_lock_ref
from hiradix_model.mamba.match import MambaMatch, match_prefix
from hiradix_model.mamba.pool import alloc, alloc_state, fork, free, free_state, write_state
from hiradix_model.mamba.state import (
    MambaHostPage,
    MambaPage,
    MambaState,
    host_only,
    initial,
    state_somewhere,
)

__all__ = [
    "HOST_INVARIANTS",
    "HOST_MATCH_INVARIANT",
    "MAMBA_INVARIANTS",
    "MATCH_INVARIANT",
    "MambaConfig",
    "MambaHostMatch",
    "MambaHostPage",
    "MambaMatch",
    "MambaPage",
    "MambaState",
    "alloc",
    "alloc_state",
    "backup",
    "check",
    "dec_lock_ref",
    "dec_state_lock",
    "evict_for_alloc",
    "evict_full",
    "evict_host_full",
    "evict_host_states",
    "evict_states",
    "fork",
    "free",
    "free_state",
    "host_leaves",
    "host_match_problems",
    "host_only",
    "inc_lock_ref",
    "initial",
    "insert",
    "load_back",
    "load_plan",
    "match_prefix",
    "match_prefix_host",
    "match_problems",
    "state_backup_needed",
    "state_somewhere",
    "violations",
    "write_state",
]
