"""The storage tier's operations (spec/09-storage.md): the scheduler's calls and the
reports of the storage I/O."""

from hiradix_model.ops.storage.attach import attach_storage, clear_storage, detach_storage
from hiradix_model.ops.storage.backup import backup_pages
from hiradix_model.ops.storage.io import (
    FETCH_FAULTS,
    WRITE_FAULTS,
    FetchFault,
    WriteFault,
    io_prefetch_fetch,
    io_prefetch_query,
    io_storage_write,
)
from hiradix_model.ops.storage.prefetch import prefetch_from_storage, query_storage_hit_length
from hiradix_model.ops.storage.progress import (
    check_prefetch_progress,
    pop_prefetch_loaded_tokens,
    release_aborted_request,
    terminate_prefetch,
)
from hiradix_model.ops.storage.queues import drain_storage_queues

__all__ = [
    "FETCH_FAULTS",
    "WRITE_FAULTS",
    "FetchFault",
    "WriteFault",
    "attach_storage",
    "backup_pages",
    "check_prefetch_progress",
    "clear_storage",
    "detach_storage",
    "drain_storage_queues",
    "io_prefetch_fetch",
    "io_prefetch_query",
    "io_storage_write",
    "pop_prefetch_loaded_tokens",
    "prefetch_from_storage",
    "query_storage_hit_length",
    "release_aborted_request",
    "terminate_prefetch",
]
