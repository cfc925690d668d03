"""Logical clocks (spec/04, "The logical clock"): recency comes from ticks, not wall time."""

from __future__ import annotations

from typing import Protocol


class Clock(Protocol):
    def now(self) -> int:
        """The tick to stamp on the pages an operation touches; never decreases."""
        ...


class CountingClock:
    """The default: every operation that reads the clock gets the next tick."""

    def __init__(self) -> None:
        self._tick = 0

    def now(self) -> int:
        self._tick += 1
        return self._tick


class ManualClock:
    """A clock the caller sets (tests and trace replay)."""

    def __init__(self, tick: int = 0) -> None:
        self.tick = tick

    def now(self) -> int:
        return self.tick

    def advance(self, ticks: int = 1) -> int:
        if ticks < 0:
            raise ValueError("ticks: a logical clock never goes back")
        self.tick += ticks
        return self.tick
