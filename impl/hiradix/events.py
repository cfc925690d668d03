"""KV events (spec/11): the cache tells an injected sink what became resident where.

A ``HiRadixCache`` given a sink (``HiRadixCache.create(..., events=sink)``, the
constructor's ``events``, or ``cache.events = sink``) calls it with one ``KVEvent`` per
page whose residency changes, synchronously, in the operation that changes it (spec/11,
11.3). Without a sink nothing is built. A KV-aware router turns the stream into its
index of what each engine caches on which medium; ``EventLog`` keeps it in a list.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal

Medium = Literal["device", "host", "storage"]  # SGLang: GPU, CPU_PINNED, DISK/EXTERNAL
EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True, slots=True)
class KVEvent:
    """One page's residency change on ``medium``, or (``cleared``) the whole medium's.
    A page is named by its namespace and its full token prefix (spec/01, "Pages")."""

    kind: EventKind
    medium: Medium
    namespace: str | None = None
    tokens: tuple[int, ...] = ()  # the page's whole prefix; () for ``cleared``


EventSink = Callable[[KVEvent], None]


class EventLog:
    """A sink that keeps the events in order; ``take`` hands over those not yet taken."""

    def __init__(self) -> None:
        self.events: list[KVEvent] = []

    def __call__(self, event: KVEvent) -> None:
        self.events.append(event)

    def take(self) -> list[KVEvent]:
        taken, self.events = self.events, []
        return taken
