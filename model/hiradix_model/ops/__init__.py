"""The operations of the model: one pure function each, ``op(state, ...) -> (state, obs)``."""

from hiradix_model.ops.backup import Backup, write_backup, writing_check
from hiradix_model.ops.evict import Victim, evict, evict_host
from hiradix_model.ops.insert import InsertResult, insert
from hiradix_model.ops.load import init_load_back, load_back, loading_check
from hiradix_model.ops.locks import dec_lock_ref, inc_lock_ref
from hiradix_model.ops.match import MatchResult, match_prefix
from hiradix_model.ops.pool import alloc, free, reset
from hiradix_model.ops.storage import (
    attach_storage,
    check_prefetch_progress,
    clear_storage,
    detach_storage,
    drain_storage_queues,
    io_prefetch_fetch,
    io_prefetch_query,
    io_storage_write,
    pop_prefetch_loaded_tokens,
    prefetch_from_storage,
    query_storage_hit_length,
    release_aborted_request,
    terminate_prefetch,
)

__all__ = [
    "Backup",
    "InsertResult",
    "MatchResult",
    "Victim",
    "alloc",
    "attach_storage",
    "check_prefetch_progress",
    "clear_storage",
    "dec_lock_ref",
    "detach_storage",
    "drain_storage_queues",
    "evict",
    "evict_host",
    "free",
    "inc_lock_ref",
    "init_load_back",
    "insert",
    "io_prefetch_fetch",
    "io_prefetch_query",
    "io_storage_write",
    "load_back",
    "loading_check",
    "match_prefix",
    "pop_prefetch_loaded_tokens",
    "prefetch_from_storage",
    "query_storage_hit_length",
    "release_aborted_request",
    "reset",
    "terminate_prefetch",
    "write_backup",
    "writing_check",
]
