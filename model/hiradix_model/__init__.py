"""hiradix_model: the executable spec of a two-tier (device + host) radix KV cache.

Pure Python, standard library only. See spec/ for the prose this code transcribes.
"""

from hiradix_model.config import STRATEGIES, WRITE_POLICIES, Config
from hiradix_model.errors import ConfigError, IllegalChoice, ModelError, PreconditionError
from hiradix_model.invariants import INVARIANTS, check, violations
from hiradix_model.keys import Key
from hiradix_model.ops import *  # noqa: F403
from hiradix_model.ops import __all__ as _ops
from hiradix_model.state import Event, Page, State, Transfer, initial
from hiradix_model.storage import PREFETCH_POLICIES, StorageId, StorageSettings, StorageState

__all__ = [
    "INVARIANTS",
    "PREFETCH_POLICIES",
    "STRATEGIES",
    "WRITE_POLICIES",
    "Config",
    "ConfigError",
    "Event",
    "IllegalChoice",
    "Key",
    "ModelError",
    "Page",
    "PreconditionError",
    "State",
    "StorageId",
    "StorageSettings",
    "StorageState",
    "Transfer",
    "check",
    "initial",
    "violations",
    *_ops,
]
