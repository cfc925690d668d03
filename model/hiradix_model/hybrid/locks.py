"""inc_lock_ref, inc_path_lock, dec_swa_lock and dec_lock_ref (spec/13, 13.3)."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import require
from hiradix_model.components import require_cached, require_lock_ends_at
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaState, root_path, taken, window, window_live
from hiradix_model.keys import Key


def _require_page(state: SwaState, page: Key | None) -> None:
    require_cached(state.pages, page)


def _shift(state: SwaState, page: Key, lock: int, swa_lock: int, released: int) -> SwaState:
    pages = dict(state.pages)
    for key in root_path(state, page):
        pages[key] = replace(pages[key], lock=pages[key].lock + lock)
    for key in window(state, page):
        pages[key] = replace(pages[key], swa_lock=pages[key].swa_lock + swa_lock)
    counts = dict(state.released)
    counts[page] = counts.get(page, 0) + released
    if not counts[page]:
        del counts[page]
    return replace(state, pages=pages, released=counts)


def _require_window_held(state: SwaState, page: Key) -> None:
    require(taken(state, page) - state.released.get(page, 0) >= 1, "page",
            "has no lock taken there that still holds its window")


def inc_lock_ref(state: SwaState, page: Key | None) -> SwaState:
    """Lock ``page``'s path (full) and its window (SWA); None: the root, a no-op.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    if page is None:
        return state
    require(window_live(state, page), "page", "has a tombstone in its window")
    return _shift(state, page, 1, 1, 0)


def inc_path_lock(state: SwaState, page: Key | None) -> SwaState:
    """Lock ``page``'s path (full) only: a lock taken at ``page`` whose SWA part is
    released from the start, so its window need not be live; None: the root, a no-op.
    Released by ``dec_lock_ref(page, swa_released=True)``.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    if page is None:
        return state
    return _shift(state, page, 1, 0, 1)


def dec_swa_lock(state: SwaState, page: Key | None) -> SwaState:
    """Release only the SWA part of one lock taken at ``page`` (once per lock).

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    if page is None:
        return state
    _require_window_held(state, page)
    return _shift(state, page, 0, -1, 1)


def dec_lock_ref(state: SwaState, page: Key | None, swa_released: bool) -> SwaState:
    """Release one lock taken at ``page``: its path, and its window unless
    ``swa_released`` (then the lock must be one whose SWA part ``dec_swa_lock`` released).

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    require(isinstance(swa_released, bool), "swa_released", "must be a bool")
    if page is None:
        return state
    require(state.pages[page].lock > 0, "page", "is not locked")
    require_lock_ends_at(state.pages, page, state.config.page_size)
    if swa_released:
        require(state.released.get(page, 0) >= 1, "swa_released",
                "no lock taken at the page released its SWA part early")
        return _shift(state, page, -1, 0, -1)
    _require_window_held(state, page)
    return _shift(state, page, -1, -1, 0)
