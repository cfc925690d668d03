"""Constants of LMCache's flat CPU and disk tiers (spec/15, 15.5.1)."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.errors import ConfigError

# LMCache's CPU tier takes its eviction candidates from its first 64 evictable objects
# (local_cpu_backend.py:805); within 64 objects a tier's every object is a candidate.
MAX_OBJECTS = 64


@dataclass(frozen=True)
class FlatConfig:
    """One pair of flat tiers: chunks of ``chunk_tokens`` tokens, ``layers`` objects per
    chunk (one per layer), and each tier's capacity in objects."""

    chunk_tokens: int = 2
    layers: int = 2
    cpu_objects: int = 6
    disk_objects: int = 8

    def __post_init__(self) -> None:
        for name in ("chunk_tokens", "layers"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ConfigError(name, f"must be an int >= 1, got {value!r}")
        for name in ("cpu_objects", "disk_objects"):
            value = getattr(self, name)
            if type(value) is not int or not 1 <= value <= MAX_OBJECTS:
                raise ConfigError(name, f"must be an int in 1..{MAX_OBJECTS}, got {value!r}")
