"""INV-EVENTS-REPLAY against the implementation (spec/11, 11.5).

``EventWatch`` attaches an ``EventLog`` to a cache and, after every step of a
conformance machine, folds what the cache emitted since the last step onto the residency
replayed so far (the model's ``replay``), then compares it with the model state
(``residency_problems``): exactly on device and host, within the bounds of spec/11 11.2
on storage. Folding only the new events keeps each check linear in the step's events.
"""

from __future__ import annotations

from hiradix.cache import HiRadixCache
from hiradix.events import EventLog, KVEvent
from hiradix_model import Event, Key, State
from hiradix_model.events import NOTHING, Resident, replay, residency_problems


def to_model(event: KVEvent) -> Event:
    """The implementation's event as the model's (a page is its Key)."""
    page = None if event.kind == "cleared" else Key(event.tokens, event.namespace)
    return Event(event.kind, event.medium, page)


class EventWatch:
    """The stream of one cache, replayed step by step."""

    def __init__(self, cache: HiRadixCache) -> None:
        self.log = EventLog()
        cache.events = self.log
        self.resident: Resident = NOTHING
        self.total = 0  # events replayed so far

    def check(self, model: State) -> bool:
        """Replay the new events; AssertionError naming INV-EVENTS-REPLAY if the stream
        and ``model`` disagree. True if anything is resident (the check had work)."""
        new = [to_model(e) for e in self.log.take()]
        self.total += len(new)
        self.resident, problems = replay(new, self.resident)
        problems += residency_problems(model, self.resident)
        if problems:
            raise AssertionError("INV-EVENTS-REPLAY: the cache's KV events disagree with "
                                 "the model:\n  " + "\n  ".join(problems[:8])
                                 + "\n  this step's events: "
                                 + ", ".join(_show(e) for e in new[:16]))
        return any(self.resident.values())


def _show(event: Event) -> str:
    page = "" if event.page is None else f" {event.page}"
    return f"{event.kind} {event.tier}{page}"
