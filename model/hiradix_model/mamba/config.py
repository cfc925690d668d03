"""Constants of a (FULL, MAMBA) hybrid cache (spec/13m, 13m.1)."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.errors import ConfigError


@dataclass(frozen=True)
class MambaConfig:
    """One (FULL, MAMBA) cache: a full KV pool of tokens and a pool of Mamba states."""

    page_size: int = 1
    full_slots: int = 16
    state_slots: int = 4

    def __post_init__(self) -> None:
        if not isinstance(self.page_size, int) or self.page_size < 1:
            raise ConfigError("page_size", f"must be an int >= 1, got {self.page_size!r}")
        full = self.full_slots
        if not isinstance(full, int) or full < self.page_size:
            raise ConfigError("full_slots", f"must be an int >= page_size, got {full!r}")
        if full % self.page_size:
            raise ConfigError("full_slots", f"{full} is not a multiple of page_size "
                              f"{self.page_size}")
        if not isinstance(self.state_slots, int) or self.state_slots < 1:
            raise ConfigError("state_slots", f"must be an int >= 1, got {self.state_slots!r}")
