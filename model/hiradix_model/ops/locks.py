"""inc_lock_ref and dec_lock_ref (spec/03-operations.md, "inc_lock_ref", "dec_lock_ref")."""

from __future__ import annotations

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft, add_lock, require, require_key
from hiradix_model.state import State, locks_taken_at


def inc_lock_ref(state: State, page: Key | None) -> tuple[State, int]:
    """Lock ``page`` and its ancestors against eviction; return the evictable-token change.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].evictable_tokens - state.evictable_tokens == __return__[1] <= 0
    raises: PreconditionError
    """
    if page is None:  # the root: nothing to lock
        return state, 0
    require_key(page, "page")
    record = state.pages.get(page)
    require(record is not None, "page", f"{page} is not cached")
    assert record is not None
    require(record.device is not None, "page", f"{page} is not on device; load it back first")
    draft = Draft(state)
    delta = add_lock(draft, page, +1)
    return draft.freeze(), delta


def dec_lock_ref(state: State, page: Key | None) -> tuple[State, int]:
    """Release one lock taken by inc_lock_ref on ``page``; return the evictable-token change.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].evictable_tokens - state.evictable_tokens == __return__[1] >= 0
    raises: PreconditionError
    """
    if page is None:
        return state, 0
    require_key(page, "page")
    record = state.pages.get(page)
    require(record is not None, "page", f"{page} is not cached")
    assert record is not None
    # The lock released must have been taken at ``page`` by a caller: not below it, not
    # by a copy in flight (spec/03 3.7).
    require(locks_taken_at(state, page) >= 1, "page",
            f"{page}: no lock taken at page to release (its locks are its children's "
            "and its copies')")
    draft = Draft(state)
    delta = add_lock(draft, page, -1)
    return draft.freeze(), delta
