"""What makes an engine's cache replay the same way in every run, for the adapters of
every family: a set that iterates in insertion order (an engine's evictable-leaf sets,
whose iteration order breaks eviction ties: spec/07 DEV-20) and a logical clock to stand
in for an engine module's ``time`` (its recency stamps: spec/07 DEV-2)."""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, MutableSet
from typing import Any


class InsertionOrdered(MutableSet[Any]):
    """A set that iterates in insertion order: stands in for an engine's evictable-leaf
    sets so that a tie among leaves is broken the same way in every run (DEV-20)."""

    def __init__(self, items: Iterable[Any] = ()) -> None:
        self._items: dict[Any, None] = dict.fromkeys(items)

    def __contains__(self, item: object) -> bool:
        return item in self._items

    def __iter__(self) -> Iterator[Any]:
        return iter(self._items)

    def __len__(self) -> int:
        return len(self._items)

    def add(self, value: Any) -> None:
        self._items[value] = None

    def discard(self, value: Any) -> None:
        self._items.pop(value, None)

    def clear(self) -> None:
        self._items.clear()


class LogicalTime:
    """Stands in for the ``time`` module inside an engine's cache modules (DEV-2): the
    caller moves ``now``; ``perf_counter`` stays real (engines time their own work)."""

    def __init__(self) -> None:
        self.now = 0

    def monotonic(self) -> float:
        return float(self.now)

    @staticmethod
    def perf_counter() -> float:
        return time.perf_counter()
