"""Clocks (spec/04, "The logical clock"; spec/09, 9.1 "Which clock counts what").

Two kinds, both giving integer ticks that never decrease:

- logical clocks (``CountingClock``, ``ManualClock``): recency in the tree comes from
  ticks, not wall time, so a run replays exactly; tests and trace replay set ticks by
  hand with ``ManualClock``;
- ``MonotonicClock``: wall time read from a monotonic source, in milliseconds by
  default. It is what the storage tier's prefetch timeouts count for an engine (a
  timeout measured in operations would depend on the load, not on how long storage
  takes); tests inject a logical clock instead (``StorageTier(timeout_clock=...)``).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Protocol, runtime_checkable

from hiradix._slots import is_int
from hiradix.errors import InvalidArgument

NANOSECONDS = 1_000_000_000


@runtime_checkable
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
        if not is_int(tick) or tick < 0:
            raise InvalidArgument("tick", f"must be an int >= 0, got {tick!r}")
        self.tick = tick

    def now(self) -> int:
        return self.tick

    def advance(self, ticks: int = 1) -> int:
        if not is_int(ticks) or ticks < 0:
            raise InvalidArgument("ticks", f"a logical clock never goes back; must be an "
                                           f"int >= 0, got {ticks!r}")
        self.tick += ticks
        return self.tick


class MonotonicClock:
    """Wall time as ticks: ``ticks_per_second`` ticks a second (1000: milliseconds, the
    unit ``TierSettings.from_config`` converts seconds to), counted from ``source``, a
    monotonic nanosecond counter (``time.monotonic_ns``; tests inject their own). The
    first tick read is 0, so ticks measure time since the clock was made."""

    def __init__(self, ticks_per_second: int = 1000,
                 source: Callable[[], int] = time.monotonic_ns) -> None:
        if not is_int(ticks_per_second) or not 1 <= ticks_per_second <= NANOSECONDS:
            raise InvalidArgument("ticks_per_second", f"must be an int in [1, {NANOSECONDS}]"
                                                      f", got {ticks_per_second!r}")
        if not callable(source):
            raise InvalidArgument("source", f"must be a callable returning nanoseconds, "
                                            f"got {type(source).__name__}")
        self.ticks_per_second = ticks_per_second
        self._source = source
        self._origin = self._read()
        self._last = 0

    def _read(self) -> int:
        value = self._source()
        if not is_int(value):
            raise InvalidArgument("source", f"returned {value!r}, not an int of nanoseconds")
        return value

    def now(self) -> int:
        elapsed = max(0, self._read() - self._origin)
        # A source that steps back (it should not: it is monotonic) never makes ticks do.
        self._last = max(self._last, elapsed * self.ticks_per_second // NANOSECONDS)
        return self._last
