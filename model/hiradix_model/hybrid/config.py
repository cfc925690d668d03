"""Constants of a (FULL, SWA) hybrid cache (spec/13, 13.1)."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.errors import ConfigError


@dataclass(frozen=True)
class SwaConfig:
    """One hybrid cache: a full pool, an SWA pool, the sliding window in tokens, and
    the host tier's two pools (13.8a; none by default)."""

    page_size: int = 1
    full_slots: int = 16
    swa_slots: int = 8
    window: int = 4  # W: a match must end W tokens deep in SWA-live KV (or at the root)
    # The host tier (13.8a): 0 slots, the default, is the device-only cache of 13.1-13.5.
    host_full_slots: int = 0
    host_swa_slots: int = 0

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError("page_size", f"must be an int >= 1, got {self.page_size!r}")
        for name in ("full_slots", "swa_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < self.page_size:
                raise ConfigError(name, f"must be an int >= page_size, got {value!r}")
            if value % self.page_size:
                raise ConfigError(name, f"{value} is not a multiple of page_size {self.page_size}")
        for name in ("host_full_slots", "host_swa_slots"):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 0 or value % self.page_size:
                raise ConfigError(name, f"must be an int >= 0, a multiple of page_size "
                                  f"{self.page_size}, got {value!r}")
        if not isinstance(self.window, int) or self.window < 1:
            raise ConfigError("window", f"must be an int >= 1, got {self.window!r}")

    @property
    def window_pages(self) -> int:
        """Pages that cover the last W tokens of a page-aligned path."""
        return -(-self.window // self.page_size)
