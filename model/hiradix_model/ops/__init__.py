"""The operations of the model: one pure function each, ``op(state, ...) -> (state, obs)``."""

from hiradix_model.ops.backup import Backup, write_backup, writing_check
from hiradix_model.ops.evict import Victim, evict, evict_host
from hiradix_model.ops.insert import InsertResult, insert
from hiradix_model.ops.load import init_load_back, load_back, loading_check
from hiradix_model.ops.locks import dec_lock_ref, inc_lock_ref
from hiradix_model.ops.match import MatchResult, match_prefix
from hiradix_model.ops.pool import alloc, free, reset

__all__ = [
    "Backup",
    "InsertResult",
    "MatchResult",
    "Victim",
    "alloc",
    "dec_lock_ref",
    "evict",
    "evict_host",
    "free",
    "inc_lock_ref",
    "init_load_back",
    "insert",
    "load_back",
    "loading_check",
    "match_prefix",
    "reset",
    "write_backup",
    "writing_check",
]
