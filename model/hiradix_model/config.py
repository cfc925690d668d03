"""Configuration constants of the abstract cache (spec/01-constants.md)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal, get_args

from hiradix_model.errors import ConfigError

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
Strategy = Literal["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]

WRITE_POLICIES: tuple[WritePolicy, ...] = get_args(WritePolicy)
STRATEGIES: tuple[Strategy, ...] = get_args(Strategy)


@dataclass(frozen=True)
class Config:
    """The constants of one cache instance. Capacities are in slots (one slot = one token)."""

    page_size: int = 1
    device_slots: int = 16
    host_slots: int = 32
    write_policy: WritePolicy = "write_through"
    eviction: Strategy = "lru"
    load_back_threshold: int = 10  # tokens; smaller host hits are recomputed, not loaded

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError("page_size", f"must be an int >= 1, got {self.page_size!r}")
        for name in ("device_slots", "host_slots"):
            value = getattr(self, name)
            # host_slots == 0: no host tier (a device-only radix cache, spec/01).
            low = 0 if name == "host_slots" else self.page_size
            if not isinstance(value, int) or value < low:
                raise ConfigError(name, f"must be an int >= {low}, got {value!r}")
            if value % self.page_size:
                raise ConfigError(name, f"{value} is not a multiple of page_size {self.page_size}")
        if self.write_policy not in WRITE_POLICIES:
            raise ConfigError("write_policy", f"must be one of {WRITE_POLICIES}")
        if self.eviction not in STRATEGIES:
            raise ConfigError("eviction", f"must be one of {STRATEGIES}")
        if not isinstance(self.load_back_threshold, int) or self.load_back_threshold < 0:
            raise ConfigError("load_back_threshold", "must be an int >= 0")

    @property
    def write_through_threshold(self) -> int | None:
        """Hits after which a page is backed up; None when backup waits for eviction or
        there is no host tier."""
        if self.host_slots == 0:
            return None
        if self.write_policy == "write_through":
            return 1
        if self.write_policy == "write_through_selective":
            return 2
        return None
