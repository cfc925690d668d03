"""The implementation's nondeterministic choices, reported for the conformance suite.

The model (spec/03, "Choices") accepts a choice only if it is legal; the conformance
layer turns these records into the model's choice arguments. A cache built without a
recorder records nothing and pays nothing.
"""

from __future__ import annotations

from dataclasses import dataclass, field

PageRef = tuple[str | None, tuple[int, ...]]  # (namespace, full token prefix of the page)


@dataclass(frozen=True)
class DeviceVictim:
    page: PageRef
    host_victims: tuple[PageRef, ...] = ()
    host_slots: tuple[int, ...] | None = None  # write_back only: where the page went


@dataclass(frozen=True)
class BackupDecision:
    host_victims: tuple[PageRef, ...]
    host_slots: tuple[int, ...] | None  # None: no host room


@dataclass(frozen=True)
class LoadDecision:
    device_victims: tuple[DeviceVictim, ...]
    device_slots: tuple[int, ...] | None  # None: skipped or no device room


@dataclass
class Recorder:
    """Collects the decisions of the operations since the last ``take()``."""

    device_victims: list[DeviceVictim] = field(default_factory=list)
    host_victims: list[PageRef] = field(default_factory=list)
    backups: list[BackupDecision] = field(default_factory=list)
    loads: list[LoadDecision] = field(default_factory=list)

    def take(self) -> Recorder:
        taken = Recorder(self.device_victims, self.host_victims, self.backups, self.loads)
        self.device_victims, self.host_victims, self.backups, self.loads = [], [], [], []
        return taken
