"""inc_lock_ref, dec_state_lock and dec_lock_ref (spec/13m, 13m.3)."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import require
from hiradix_model.components import require_cached, require_lock_ends_at
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import MambaState, root_path


def _require_page(state: MambaState, page: Key | None) -> None:
    require_cached(state.pages, page)


def _shift(state: MambaState, page: Key, lock: int, state_lock: int) -> MambaState:
    pages = dict(state.pages)
    for key in root_path(state, page):
        pages[key] = replace(pages[key], lock=pages[key].lock + lock)
    pages[page] = replace(pages[page], state_lock=pages[page].state_lock + state_lock)
    return replace(state, pages=pages)


def inc_lock_ref(state: MambaState, page: Key | None, with_state: bool) -> MambaState:
    """Lock ``page``'s path and, if ``with_state``, its state; None: the root, a no-op.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    require(isinstance(with_state, bool), "with_state", "must be a bool")
    if page is None:
        return state
    return _shift(state, page, 1, 1 if with_state else 0)


def dec_state_lock(state: MambaState, page: Key | None) -> MambaState:
    """Release only the state part of one lock on ``page``.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    if page is None:
        return state
    require(state.pages[page].state_lock > 0, "page", "holds no state lock")
    return _shift(state, page, 0, -1)


def dec_lock_ref(state: MambaState, page: Key | None, state_released: bool) -> MambaState:
    """Release one lock on ``page``: its path, and its state part unless released.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_page(state, page)
    require(isinstance(state_released, bool), "state_released", "must be a bool")
    if page is None:
        return state
    record = state.pages[page]
    require(record.lock > 0, "page", "is not locked")
    taken = require_lock_ends_at(state.pages, page, state.config.page_size)
    if state_released:
        # Every lock taken at ``page`` beyond its state locks is one without a state part.
        require(taken > record.state_lock, "state_released",
                "every lock taken at page still holds its state part")
    else:
        require(record.state_lock > 0, "page", "holds no state lock")
    return _shift(state, page, -1, 0 if state_released else -1)
