"""The storage tier below the host tier (spec/09): page hashes, backends, background I/O.

- ``hashing``: the chained page hash that names a page in storage;
- ``backend``: the batch interface (``exists``/``get``/``set``), integrity checks, metrics;
- ``memory``, ``file``, ``mooncake``: the backends (Mooncake's distributed store, spec/09m);
  ``controlled``: a fault-injecting wrapper;
- ``io``: the prefetch and backup threads (or their synchronous stand-in);
- ``config``: the configuration, from JSON, TOML or YAML.
"""

from hiradix.storage.backend import Fetched, PageRead, StorageBackend, StorageMetrics, checksum
from hiradix.storage.config import (
    StorageConfig,
    config_from_mapping,
    make_backend,
    page_identity,
    parse_storage_config,
    prefetch_timeout,
)
from hiradix.storage.controlled import (
    FAULT_KINDS,
    ControlledBackend,
    Fault,
    FaultKind,
    InjectedInterrupt,
)
from hiradix.storage.errors import StorageArgumentError, StorageConfigError, StorageError
from hiradix.storage.file import FileBackend
from hiradix.storage.hashing import PageIdentity, check_hashes, page_hashes
from hiradix.storage.io import BackupResult, PrefetchResult, StorageIO
from hiradix.storage.memory import MemoryBackend
from hiradix.storage.mooncake import MooncakeBackend, MooncakeClient, MooncakeUnavailable

__all__ = [
    "FAULT_KINDS",
    "BackupResult",
    "ControlledBackend",
    "Fault",
    "FaultKind",
    "Fetched",
    "FileBackend",
    "InjectedInterrupt",
    "MemoryBackend",
    "MooncakeBackend",
    "MooncakeClient",
    "MooncakeUnavailable",
    "PageIdentity",
    "PageRead",
    "PrefetchResult",
    "StorageArgumentError",
    "StorageBackend",
    "StorageConfig",
    "StorageConfigError",
    "StorageError",
    "StorageIO",
    "StorageMetrics",
    "check_hashes",
    "checksum",
    "config_from_mapping",
    "make_backend",
    "page_hashes",
    "page_identity",
    "parse_storage_config",
    "prefetch_timeout",
]
