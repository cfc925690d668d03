"""The (FULL, SWA) hybrid cache (spec/13): state, operations, invariants; the device tier
and, with host slots, the host tier (13.8a).

One pure function per operation; each returns the new state (and its observation) or
raises ``PreconditionError`` / ``IllegalChoice`` leaving the state as it was.
"""

from hiradix_model.hybrid.config import SwaConfig
from hiradix_model.hybrid.evict import evict_for_alloc, evict_full, evict_swa
from hiradix_model.hybrid.host import (
    HOST_MATCH_INVARIANT,
    SwaHostMatch,
    backup,
    evict_host_full,
    evict_host_swa,
    host_leaves,
    host_match_problems,
    load_back,
    load_plan,
    match_prefix_host,
    swa_backup_targets,
)
from hiradix_model.hybrid.insert import insert
from hiradix_model.hybrid.invariants import (
    HOST_INVARIANTS,
    MATCH_INVARIANT,
    SWA_INVARIANTS,
    check,
    match_problems,
    violations,
)
from hiradix_model.hybrid.locks import dec_lock_ref, dec_swa_lock, inc_lock_ref, inc_path_lock
from hiradix_model.hybrid.match import SwaMatch, match_prefix
from hiradix_model.hybrid.pool import alloc, free, free_swa
from hiradix_model.hybrid.state import (
    SwaHostPage,
    SwaPage,
    SwaState,
    initial,
    window,
    window_live,
    window_somewhere,
)

__all__ = [
    "HOST_INVARIANTS",
    "HOST_MATCH_INVARIANT",
    "MATCH_INVARIANT",
    "SWA_INVARIANTS",
    "SwaConfig",
    "SwaHostMatch",
    "SwaHostPage",
    "SwaMatch",
    "SwaPage",
    "SwaState",
    "alloc",
    "backup",
    "check",
    "dec_lock_ref",
    "dec_swa_lock",
    "evict_for_alloc",
    "evict_full",
    "evict_host_full",
    "evict_host_swa",
    "evict_swa",
    "free",
    "free_swa",
    "host_leaves",
    "host_match_problems",
    "inc_lock_ref",
    "inc_path_lock",
    "initial",
    "insert",
    "load_back",
    "load_plan",
    "match_prefix",
    "match_prefix_host",
    "match_problems",
    "swa_backup_targets",
    "violations",
    "window",
    "window_live",
    "window_somewhere",
]
