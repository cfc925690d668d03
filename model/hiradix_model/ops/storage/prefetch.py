"""query_storage_hit_length and prefetch_from_storage (spec/09-storage.md, 9.4).

Both take the request's key and the anchor: the deepest page of the request's match
that is on host (None: the root). The pages they consider are the key's pages below the
anchor, the request's uncached tail as the scheduler saw it.
"""

from __future__ import annotations

from collections.abc import Sequence

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, page_keys
from hiradix_model.ops._draft import Draft, choose_whole_pages, require, require_key, require_tick
from hiradix_model.ops._victims import make_host_room
from hiradix_model.ops.storage._common import protect, require_request, storage_of, update
from hiradix_model.state import State
from hiradix_model.storage import Prefetch, rate_limited, stored_run


def pages_below(state: State, key: Key, anchor: Key | None) -> tuple[Key, ...]:
    """The pages of ``key`` deeper than ``anchor``, root-most first (Pre: anchor on key)."""
    require_key(key)
    pages = page_keys(key, state.config.page_size)
    if anchor is None:
        return pages
    require_key(anchor, "anchor")
    require(anchor in pages, "anchor", f"{anchor} is not a page of key")
    return pages[pages.index(anchor) + 1:]


def worth_prefetching(state: State, pages: Sequence[Key]) -> bool:
    """Attached, not rate limited, and long enough (spec/09, 9.1)."""
    storage = state.storage
    if storage is None or storage.backend is None or not pages:
        return False
    tokens = state.config.page_size * len(pages)
    return tokens >= storage.settings.prefetch_threshold and not rate_limited(
        state.config, storage)


def query_storage_hit_length(
    state: State, key: Key, anchor: Key | None, hit_pages: int
) -> tuple[State, int]:
    """How many tokens below ``anchor`` storage holds; ``hit_pages`` is the backend's answer.

    pre: not check(state)
    post: __return__ == (state, state.config.page_size * hit_pages)
    raises: PreconditionError, IllegalChoice
    """
    pages = pages_below(state, key, anchor)
    require(isinstance(hit_pages, int) and not isinstance(hit_pages, bool), "hit_pages",
            "must be an int")
    if not worth_prefetching(state, pages):
        if hit_pages != 0:
            raise IllegalChoice("hit_pages: no query is made (detached, short or rate limited)")
        return state, 0
    assert state.storage is not None
    most = stored_run(state.storage, pages)
    if not 0 <= hit_pages <= most:
        raise IllegalChoice(f"hit_pages: {hit_pages} is not in [0, {most}] (pages stored)")
    return state, state.config.page_size * hit_pages


def prefetch_from_storage(
    state: State,
    request: str,
    key: Key,
    anchor: Key | None,
    now: int,
    *,
    host_victims: Sequence[Key] = (),
    host_slots: tuple[int, ...] | None = None,
) -> tuple[State, int]:
    """Reserve host slots for ``key``'s pages below ``anchor`` and start fetching them.

    ``host_victims`` are the host pages evicted to make room (R2, for the shortfall);
    ``host_slots`` the slots reserved, P per page, root-most first: for all the pages or,
    when the host cannot hold them, for as many leading pages as fit (None: no prefetch).
    Returns the tokens reserved (0: not started).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == (0 if host_slots is None else len(host_slots))
    raises: PreconditionError, IllegalChoice
    """
    require_request(request)
    pages = pages_below(state, key, anchor)
    if anchor is not None:
        record = state.pages.get(anchor)
        require(record is not None and record.host is not None, "anchor",
                f"{anchor} is not cached with a host copy")
    require(state.storage is None or state.storage.prefetch_of(request) is None, "request",
            f"{request!r} already has an ongoing prefetch")
    draft = Draft(state)
    require_tick(draft, now)
    draft.clock = now
    if not worth_prefetching(state, pages):
        if host_victims or host_slots is not None:
            raise IllegalChoice("prefetch_from_storage: no prefetch starts (detached, short"
                                " or rate limited)")
        return draft.freeze(), 0
    reserved = _reserve(draft, request, pages, anchor, host_victims, host_slots)
    return draft.freeze(), reserved


def _reserve(draft: Draft, request: str, pages: tuple[Key, ...], anchor: Key | None,
             host_victims: Sequence[Key], host_slots: tuple[int, ...] | None) -> int:
    """Protect the anchor, make host room, and reserve slots for the pages that fit."""
    ps, threshold = draft.ps, storage_of(draft).settings.prefetch_threshold
    if anchor is not None:
        protect(draft, anchor, +1)  # host room must not evict the page the fetch hangs from
    make_host_room(draft, host_victims, ps * len(pages), "host_victims")
    fit = min(len(pages), len(draft.host_free) // ps)
    if fit == 0 or ps * fit < threshold:
        if host_slots is not None:
            raise IllegalChoice(f"host_slots: only {fit} pages fit, below the threshold")
        if anchor is not None:
            protect(draft, anchor, -1)
        return 0
    need = ps * fit
    if (not isinstance(host_slots, tuple) or len(host_slots) != need
            or len(set(host_slots)) != need or not set(host_slots) <= draft.host_free):
        raise IllegalChoice(f"host_slots: {host_slots} are not {need} distinct free host slots")
    choose_whole_pages(host_slots, ps, "host_slots")
    draft.host_free.difference_update(host_slots)
    storage = storage_of(draft)
    prefetch = Prefetch(id=storage.next_id, request=request, anchor=anchor,
                        pages=pages[:fit], reserved=host_slots, slots=host_slots,
                        start=draft.clock)
    update(draft, prefetches=(*storage.prefetches, prefetch), next_id=storage.next_id + 1,
           occupied_tokens=storage.occupied_tokens + need)
    return need
