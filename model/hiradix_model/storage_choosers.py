"""Reference choices for the storage operations (spec/09-storage.md), like choosers.py.

They make one legal resolution of each report the storage I/O gives, ties broken by a
caller's ``random.Random``; tests perturb them to inject faults.
"""

from __future__ import annotations

import random

from hiradix_model.choosers import _host_room, _slots
from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft
from hiradix_model.ops.storage._common import protect
from hiradix_model.ops.storage.prefetch import pages_below, worth_prefetching
from hiradix_model.state import State
from hiradix_model.storage import stored_run


def choose_prefetch(
    state: State, key: Key, anchor: Key | None, rng: random.Random
) -> tuple[tuple[Key, ...], tuple[int, ...] | None]:
    """``(host_victims, host_slots)`` for ``prefetch_from_storage(state, _, key, anchor, ..)``."""
    pages = pages_below(state, key, anchor)
    if not worth_prefetching(state, pages):
        return (), None
    assert state.storage is not None
    draft = Draft(state)
    if anchor is not None:
        protect(draft, anchor, +1)  # as prefetch_from_storage does before making room
    victims = _host_room(draft, draft.ps * len(pages), rng)
    fit = min(len(pages), len(draft.host_free) // draft.ps)
    if fit == 0 or draft.ps * fit < state.storage.settings.prefetch_threshold:
        return victims, None
    return victims, _slots(draft.host_free, draft.ps * fit, rng, draft.ps)


def hits_available(state: State, request: str) -> int:
    """The most hit pages ``io_prefetch_query`` may report for ``request`` now."""
    assert state.storage is not None
    prefetch = state.storage.prefetch_of(request)
    assert prefetch is not None
    return stored_run(state.storage, prefetch.pages)


def pages_to_fetch(state: State, request: str) -> tuple[int, int]:
    """``(remaining, in_storage)``: pages the fetch has left, and how many of them, in
    order, the backend still holds (only those can land)."""
    assert state.storage is not None
    prefetch = state.storage.prefetch_of(request)
    assert prefetch is not None and prefetch.hit_pages is not None
    rest = prefetch.pages[prefetch.landed: prefetch.hit_pages]
    return len(rest), stored_run(state.storage, rest)


def running_write(state: State) -> int | None:
    """Pages the oldest running storage write has left (None: no write is running)."""
    if state.storage is None:
        return None
    running = [w for w in state.storage.writes if w.phase == "running"]
    return len(running[0].pages) - running[0].done if running else None
