"""Constants of a (FULL, MAMBA) hybrid cache (spec/13m, 13m.1)."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.errors import ConfigError


@dataclass(frozen=True)
class MambaConfig:
    """One (FULL, MAMBA) cache: a full KV pool of tokens, a pool of Mamba states, and
    the host tier's two pools (13m.8b; none by default)."""

    page_size: int = 1
    full_slots: int = 16
    state_slots: int = 4
    # The host tier (13m.8b): 0 slots, the default, is the device-only cache of 13m.1-13m.5.
    host_full_slots: int = 0
    host_state_slots: int = 0

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
        host_full = self.host_full_slots
        if (not isinstance(host_full, int) or isinstance(host_full, bool) or host_full < 0
                or host_full % self.page_size):
            raise ConfigError("host_full_slots", f"must be an int >= 0, a multiple of "
                              f"page_size {self.page_size}, got {host_full!r}")
        host_states = self.host_state_slots
        if not isinstance(host_states, int) or isinstance(host_states, bool) or host_states < 0:
            raise ConfigError("host_state_slots", f"must be an int >= 0, got {host_states!r}")
