"""KV events (spec/11-kv-events.md): what is cached where, told as a stream.

An event says that a page became resident on a tier (``stored``), stopped being
resident there (``removed``), or that a tier was emptied (``cleared``). A page is named
by its ``Key`` (namespace and full token prefix), the model's page identity.

Residency is a function of the state (11.2): on device, a page with device slots; on
host, a page whose host copy has landed (no pending backup writes its slots); in
storage, a page the attached backend holds under this cache's identity. The reference
stream of a step is the residency difference between the states before and after it
(``step_events``); INV-EVENTS-REPLAY (``residency_problems``) says what any stream,
replayed from the start, must give.
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace

from hiradix_model.keys import Key
from hiradix_model.state import TIERS, Event, EventKind, State, Tier, in_flight

__all__ = ["NOTHING", "TIERS", "Event", "EventKind", "Resident", "Tier", "apply",
           "device_resident", "host_resident", "record", "replay", "residency_problems",
           "step_events", "storage_may", "storage_must"]

Resident = Mapping[Tier, frozenset[Key]]
NOTHING: Resident = {tier: frozenset() for tier in TIERS}

# -- Residency (11.2) ------------------------------------------------------------------


def device_resident(state: State) -> frozenset[Key]:
    """Pages with a device copy (loads in flight included: their slots are theirs)."""
    return frozenset(k for k, p in state.pages.items() if p.device is not None)


def host_resident(state: State) -> frozenset[Key]:
    """Pages whose host copy has landed: a backup in flight is not yet on host."""
    arriving = in_flight(state, "d2h")
    return frozenset(k for k, p in state.pages.items()
                     if p.host is not None and not set(p.host) & arriving)


def storage_may(state: State) -> frozenset[Key]:
    """Pages the attached backend holds under this cache's identity (none if detached)."""
    storage = state.storage
    if storage is None:
        return frozenset()
    return frozenset(sid.page for sid in storage.stored if sid.identity == storage.identity)


def storage_must(state: State) -> frozenset[Key]:
    """Pages a storage write of this cache has handled and not yet released, that the
    backend still holds: this cache knows they are stored (11.3, storage backup)."""
    if state.storage is None:
        return frozenset()
    handled = {k for w in state.storage.writes for k in w.pages[: w.done]}
    return frozenset(handled) & storage_may(state)


# -- Replay (11.4) ---------------------------------------------------------------------


def apply(resident: Resident, event: Event) -> tuple[Resident, str | None]:
    """``resident`` after ``event``, and the problem it shows (None: none).

    On device and host a page is stored only when absent and removed only when present
    (a duplicate or a phantom is a bookkeeping error). Storage is shared with other
    caches, so there both are idempotent (11.4)."""
    pages = resident[event.tier]
    if event.kind == "cleared":
        return {**resident, event.tier: frozenset()}, None
    assert event.page is not None, event
    present = event.page in pages
    problem = None
    if event.tier != "storage" and present == (event.kind == "stored"):
        problem = (f"{event.kind} {event.page} on {event.tier}, where it was "
                   f"{'already' if present else 'not'} resident")
    changed = pages | {event.page} if event.kind == "stored" else pages - {event.page}
    return {**resident, event.tier: changed}, problem


def replay(events: Iterable[Event], start: Resident = NOTHING) -> tuple[Resident, list[str]]:
    """Residency after ``events`` from ``start``, and every problem met on the way."""
    resident, problems = start, []
    for event in events:
        resident, problem = apply(resident, event)
        if problem is not None:
            problems.append(problem)
    return resident, problems


def residency_problems(state: State, resident: Resident) -> Iterator[str]:
    """How a replayed ``resident`` differs from ``state``: exactly the residency of
    device and host; on storage, between what this cache knows and what is there."""
    for tier, actual in (("device", device_resident(state)), ("host", host_resident(state))):
        told = resident[tier]  # type: ignore[index]
        for page in sorted(actual - told, key=_order):
            yield f"{page} is on {tier} but the stream never said so"
        for page in sorted(told - actual, key=_order):
            yield f"{page} is not on {tier} but the stream says it is"
    for page in sorted(storage_must(state) - resident["storage"], key=_order):
        yield f"{page} was written to storage but the stream never said so"
    for page in sorted(resident["storage"] - storage_may(state), key=_order):
        yield f"{page} is not in storage but the stream says it is"


def _order(page: Key) -> tuple[str, int, tuple[int, ...]]:
    return (page.namespace or "", len(page.tokens), page.tokens)


# -- The reference stream (11.3) ---------------------------------------------------------


def _difference(tier: Tier, before: frozenset[Key], after: frozenset[Key]) -> list[Event]:
    gone = [Event("removed", tier, k) for k in sorted(before - after, key=_order)]
    return gone + [Event("stored", tier, k) for k in sorted(after - before, key=_order)]


def step_events(before: State, after: State) -> tuple[Event, ...]:
    """The reference stream of one step: the residency difference, tier by tier."""
    return (*_difference("device", device_resident(before), device_resident(after)),
            *_difference("host", host_resident(before), host_resident(after)),
            *_difference("storage", storage_may(before), storage_may(after)))


def record(before: State, after: State) -> State:
    """``after`` with ``before``'s stream extended by the step's reference events; as
    ``after`` when ``before`` keeps no stream."""
    if before.events is None:
        return after
    return replace(after, events=(*before.events, *step_events(before, after)))
