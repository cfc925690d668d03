"""hiradix: a two-tier (device + host) radix KV cache with a storage tier below, for
LLM serving engines, checked step by step against an executable spec (``hiradix_model``).

Embedding it takes a few lines (README.md, "Embed it in a scheduler";
``examples/embed.py`` runs the whole loop)::

    from hiradix import HiRadixCache, KVShape, RadixKey

    cache = HiRadixCache.create(device_slots=4096, page_size=16, host_ratio=2.0,
                                kv=KVShape(layers=32, heads=8, head_dim=128))
    match = cache.match_prefix(RadixKey(token_ids))

Every public method checks its arguments before it changes anything: bad input raises an
``InvalidArgument`` subclass naming the argument and leaves the cache as it was.
``check_invariants()`` audits every invariant of spec/05 (and the storage tier's host
slots, spec/09 9.2) and raises ``InvariantViolation`` with the spec ID. ``events=`` takes a
sink for the KV event stream (``KVEvent``, spec/11); ``sync=`` a ``RankSync`` that agrees
every rank-local decision across tensor/pipeline-parallel ranks (``TorchDistributedSync``,
spec/12).
"""

from hiradix.cache import HiRadixCache, MatchResult
from hiradix.clock import Clock, CountingClock, ManualClock
from hiradix.config import CacheConfig, KVShape
from hiradix.device_pool import DeviceKVPool
from hiradix.distributed import LocalSync, RankSync, TorchDistributedSync
from hiradix.errors import (
    ConfigError,
    EventSinkError,
    ForeignNode,
    HiradixError,
    InvalidArgument,
    InvariantViolation,
    NotLocked,
    RankSyncError,
    SlotError,
)
from hiradix.events import EventChannel, EventLog, EventSink, KVEvent
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.policies import STRATEGIES, WRITE_POLICIES, Strategy, WritePolicy
from hiradix.storage.backend import StorageBackend
from hiradix.storage.config import StorageConfig
from hiradix.storage.errors import StorageArgumentError, StorageConfigError, StorageError
from hiradix.storage.file import FileBackend
from hiradix.storage.memory import MemoryBackend
from hiradix.storage.tier import StorageTier, TierSettings
from hiradix.transfer import TransferEngine, make_engine
from hiradix.tree import TreeNode

__version__ = "0.1.0"

__all__ = [
    "STRATEGIES",
    "WRITE_POLICIES",
    "CacheConfig",
    "Clock",
    "ConfigError",
    "CountingClock",
    "DeviceKVPool",
    "EventChannel",
    "EventLog",
    "EventSink",
    "EventSinkError",
    "FileBackend",
    "ForeignNode",
    "HiRadixCache",
    "HiradixError",
    "HostKVPool",
    "InvalidArgument",
    "InvariantViolation",
    "KVEvent",
    "KVShape",
    "LocalSync",
    "ManualClock",
    "MatchResult",
    "MemoryBackend",
    "NotLocked",
    "RadixKey",
    "RankSync",
    "RankSyncError",
    "SlotError",
    "StorageArgumentError",
    "StorageBackend",
    "StorageConfig",
    "StorageConfigError",
    "StorageError",
    "StorageTier",
    "Strategy",
    "TierSettings",
    "TorchDistributedSync",
    "TransferEngine",
    "TreeNode",
    "WritePolicy",
    "__version__",
    "make_engine",
]
