"""The explicit configuration objects of a cache (spec/01, "Constants").

``CacheConfig`` holds the tree's policies; ``KVShape`` the geometry of one token's KV,
which ``HiRadixCache.create`` turns into the two pools. Capacities live in the pools.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import torch

from hiradix._slots import is_int
from hiradix.errors import ConfigError
from hiradix.policies import STRATEGIES, WRITE_POLICIES, Strategy, WritePolicy


def _check_count(value: object, argument: str, minimum: int) -> None:
    # ``is_int``: True is no page size (a bool is an int to isinstance).
    if not is_int(value) or value < minimum:  # type: ignore[operator]
        raise ConfigError(argument, f"must be an int >= {minimum}, got {value!r}")


@dataclass(frozen=True, slots=True)
class CacheConfig:
    """Policies of the tree. Capacities live in the pools, which the cache is given."""

    page_size: int = 1
    write_policy: WritePolicy = "write_through"
    eviction: Strategy = "lru"
    load_back_threshold: int = 10  # tokens; shorter host hits are recomputed

    def __post_init__(self) -> None:
        _check_count(self.page_size, "page_size", 1)
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError("write_policy", f"must be one of {WRITE_POLICIES}, "
                                              f"got {self.write_policy!r}")
        if self.eviction not in STRATEGIES:
            raise ConfigError("eviction", f"must be one of {STRATEGIES}, got {self.eviction!r}")
        _check_count(self.load_back_threshold, "load_back_threshold", 0)


@dataclass(frozen=True, slots=True)
class KVShape:
    """One token's KV, as the model's attention layers store it (SGLang's
    ``MHATokenToKVPool`` / ``MLATokenToKVPool`` arguments): ``layers`` x K and V of
    ``heads`` x ``head_dim`` (``mha``), or ``layers`` x one latent of ``latent_dim``
    (``mla``), in ``dtype``."""

    layers: int = 2
    heads: int = 1
    head_dim: int = 8
    layout: Literal["mha", "mla"] = "mha"
    latent_dim: int = 16
    dtype: torch.dtype = torch.float16

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "latent_dim"):
            _check_count(getattr(self, name), f"kv.{name}", 1)
        if self.layout not in ("mha", "mla"):
            raise ConfigError("kv.layout", f"must be 'mha' or 'mla', got {self.layout!r}")
        if not isinstance(self.dtype, torch.dtype) or not self.dtype.is_floating_point:
            raise ConfigError("kv.dtype", f"must be a floating-point torch.dtype, got "
                                          f"{self.dtype!r}")
