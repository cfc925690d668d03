"""One explicit configuration object for a cache and its pools (spec/01, "Constants")."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hiradix.errors import ConfigError
from hiradix.policies import STRATEGIES, WRITE_POLICIES, Strategy, WritePolicy


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Policies of the tree. Capacities live in the pools, which the cache is given."""

    page_size: int = 1
    write_policy: WritePolicy = "write_through"
    eviction: Strategy = "lru"
    load_back_threshold: int = 10  # tokens; shorter host hits are recomputed

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError("page_size", f"must be an int >= 1, got {self.page_size!r}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError("write_policy", f"must be one of {WRITE_POLICIES}, "
                                              f"got {self.write_policy!r}")
        if self.eviction not in STRATEGIES:
            raise ConfigError("eviction", f"must be one of {STRATEGIES}, got {self.eviction!r}")
        if not isinstance(self.load_back_threshold, int) or self.load_back_threshold < 0:
            raise ConfigError("load_back_threshold", "must be an int >= 0")


@dataclass(frozen=True, slots=True)
class PoolConfig:
    """Shapes and sizes of the two KV pools."""

    device_slots: int = 64
    layers: int = 2
    layout: Literal["mha", "mla"] = "mha"
    heads: int = 1
    head_dim: int = 4
    latent_dim: int = 8
    dtype: torch.dtype = torch.float32
    host_ratio: float | None = 2.0
    host_bytes: int | None = None
    host_layout: Literal["layer_first", "page_first"] = "layer_first"
