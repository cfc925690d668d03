"""check_prefetch_progress, terminate_prefetch, release_aborted_request and
pop_prefetch_loaded_tokens (spec/09-storage.md, 9.4 and 9.6)."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.ops._draft import Draft, require_tick
from hiradix_model.ops.storage._common import (
    end_prefetch,
    give_up,
    put,
    require_request,
    storage_of,
    update,
)
from hiradix_model.state import Page, State, has_prefetch  # noqa: F401 (contracts)
from hiradix_model.storage import Prefetch, StorageSettings, timed_out


def can_end(settings: StorageSettings, prefetch: Prefetch, now: int, page_size: int) -> bool:
    """Whether the stop policy lets ``prefetch`` end at tick ``now`` (spec/09, 9.6)."""
    if prefetch.terminated or settings.prefetch_policy == "best_effort":
        return True
    hits = prefetch.hit_pages
    complete = hits is not None and hits > 0 and prefetch.landed == hits
    if settings.prefetch_policy == "wait_complete":
        return complete
    return complete or timed_out(settings, now - prefetch.start, page_size * (hits or 0))


def check_prefetch_progress(state: State, request: str, now: int) -> tuple[State, bool]:
    """End ``request``'s prefetch if its policy allows; True when none is ongoing now.

    On ending, the landed pages join the tree as host-only pages (S-R4), every other
    slot the prefetch owns goes to the release queue, and the request's count of tokens
    loaded from storage is set.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == (not has_prefetch(__return__[0], request))
    raises: PreconditionError
    """
    require_request(request)
    draft = Draft(state)
    require_tick(draft, now)
    draft.clock = now
    prefetch = None if state.storage is None else state.storage.prefetch_of(request)
    if prefetch is None:
        return draft.freeze(), True
    assert state.storage is not None
    if not can_end(state.storage.settings, prefetch, now, draft.ps):
        return draft.freeze(), False
    inserted, rest = _insert_landed(draft, prefetch, now)
    end_prefetch(draft, give_up(draft, rest, 0, "queue"))
    loaded = {**storage_of(draft).loaded_tokens, request: draft.ps * inserted}
    update(draft, loaded_tokens=loaded)
    return draft.freeze(), True


def _insert_landed(draft: Draft, prefetch: Prefetch, now: int) -> tuple[int, Prefetch]:
    """S-R4: walk the landed pages below the anchor; return how many became new pages
    and the prefetch without their slots.

    A landed page already cached with a host copy is stamped and its fetched copy
    freed; at the first one cached without a host copy the walk stops and the rest are
    freed (a host page below it would break backup contiguity); from the first uncached
    one on, every landed page is inserted, host-only, with the slots it was fetched into.
    """
    ps = draft.ps
    slots = prefetch.slots
    mode = "walk"
    inserted = 0
    for index, page in enumerate(prefetch.pages[: prefetch.landed]):
        own = slots[index * ps:(index + 1) * ps]
        record = draft.pages.get(page)
        if mode == "walk" and record is not None and record.host is not None:
            draft.set_page(page, replace(record, last_tick=now))
            draft.host_free.update(own)
            continue
        if mode == "walk":
            mode = "insert" if record is None else "drop"
        if mode == "drop":
            draft.host_free.update(own)
            continue
        assert record is None, "an uncached page's descendant is cached"
        parent = draft.parent(page)
        priority = 0 if parent is None else draft.page(parent).priority
        draft.set_page(page, Page(device=None, host=own, last_tick=now, insert_tick=now,
                                  priority=priority))
        inserted += 1
    # One log entry per landed slot, whichever way it went: free list or tree.
    landed_slots = slots[: prefetch.landed * ps]
    rest = replace(prefetch, slots=slots[len(landed_slots):])
    put(draft, rest)
    log = storage_of(draft).release_log + tuple((prefetch.id, s) for s in landed_slots)
    update(draft, release_log=log)
    return inserted, rest


def terminate_prefetch(state: State, request: str) -> tuple[State, None]:
    """Ask ``request``'s prefetch to stop: no more pages land (SGLang ``mark_terminate``).

    The I/O's reaction is part of the step: it releases every slot past the landed
    pages. The prefetch stays ongoing until check_prefetch_progress ends it.

    pre: not check(state)
    post: not check(__return__[0])
    raises: PreconditionError
    """
    require_request(request)
    prefetch = None if state.storage is None else state.storage.prefetch_of(request)
    if prefetch is None or prefetch.terminated:
        return state, None
    draft = Draft(state)
    flagged = replace(prefetch, terminated=True)
    put(draft, flagged)
    if prefetch.phase in ("querying", "fetching"):
        put(draft, replace(give_up(draft, flagged, prefetch.landed, "queue"), phase="stopped"))
    return draft.freeze(), None


def release_aborted_request(state: State, request: str) -> tuple[State, None]:
    """The request is aborted: end its prefetch without inserting anything.

    Every slot the prefetch owns, landed or not, goes to the release queue; the count of
    tokens it loaded from storage is forgotten.

    pre: not check(state)
    post: not check(__return__[0])
    post: not has_prefetch(__return__[0], request)
    raises: PreconditionError
    """
    require_request(request)
    if state.storage is None:
        return state, None
    draft = Draft(state)
    loaded = dict(state.storage.loaded_tokens)
    loaded.pop(request, None)
    update(draft, loaded_tokens=loaded)
    prefetch = state.storage.prefetch_of(request)
    if prefetch is not None:
        end_prefetch(draft, give_up(draft, prefetch, 0, "queue"))
    return draft.freeze(), None


def pop_prefetch_loaded_tokens(state: State, request: str) -> tuple[State, int]:
    """Tokens the request's last ended prefetch added to the tree (0 if none); forget it.

    pre: not check(state)
    post: not check(__return__[0]) and __return__[1] >= 0
    raises: PreconditionError
    """
    require_request(request)
    if state.storage is None or request not in state.storage.loaded_tokens:
        return state, 0
    loaded = dict(state.storage.loaded_tokens)
    tokens = loaded.pop(request)
    return replace(state, storage=replace(state.storage, loaded_tokens=loaded)), tokens
