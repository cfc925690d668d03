"""alloc, free and reset (spec/03-operations.md, "alloc", "free", "reset").

alloc and free are the caller's side of the device pool: an engine allocates slots for
the tokens it must compute, runs the forward pass that writes their KV, inserts, and
frees what insert did not adopt. Modelling them makes "held by callers" a real term of
pool conservation instead of an unaccounted difference.
"""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, content_at
from hiradix_model.ops._draft import (
    Draft,
    require,
    require_key,
    require_page_set,
    require_slots,
    require_whole_pages,
    take,
)
from hiradix_model.state import State, initial
from hiradix_model.storage import StorageState


def alloc(state: State, key: Key, start: int, slots: tuple[int, ...]) -> tuple[State, None]:
    """Take free device ``slots`` and write into them the KV of ``key`` from ``start`` on.

    ``slots`` are whole pages (R7): a page allocator hands them out so. Their order says
    which slot gets which position's KV (a caller may scatter it; insert then refuses).
    Slots past the end of ``key`` are taken without KV: the unused tail of the last page
    is the caller's until it frees it.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].held == state.held | frozenset(slots)
    raises: PreconditionError
    """
    require_key(key)
    require_slots(slots, "slots")
    require(isinstance(start, int) and start >= 0, "start", "must be an int >= 0")
    require(start <= len(key.tokens), "start", "is past the end of key")
    require_page_set(slots, state.config.page_size, "slots")
    require(set(slots) <= state.device_free, "slots", "are not all free device slots")
    draft = Draft(state)
    take(draft.device_free, slots)
    draft.held.update(slots)
    for offset, slot in enumerate(slots):
        if start + offset < len(key.tokens):
            draft.device_kv[slot] = content_at(key, start + offset)
        else:
            draft.device_kv.pop(slot, None)
    return draft.freeze(), None


def free(state: State, slots: tuple[int, ...]) -> tuple[State, None]:
    """Return device ``slots`` the caller holds to the free pool, as whole pages in any
    page order, each in order (R7).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[0].device_free == state.device_free | frozenset(slots)
    raises: PreconditionError
    """
    require_slots(slots, "slots")
    require_whole_pages(slots, state.config.page_size, "slots", full=True)
    require(set(slots) <= state.held, "slots", "are not all held by the caller")
    draft = Draft(state)
    take(draft.held, slots)
    draft.device_free.update(slots)
    return draft.freeze(), None


def reset(state: State) -> tuple[State, None]:
    """Drop everything: the empty cache of the same configuration.

    An attached backend stays attached, with its settings and its contents; whatever was
    in flight to or from it is forgotten (spec/09, 9.4, "Changes to operations of 03").

    post: __return__[0] == initial(state.config) or state.storage is not None
    post: __return__[0].pages == {} and __return__[0].pending == ()
    """
    fresh = initial(state.config)
    if state.storage is None:
        return fresh, None
    old = state.storage
    kept = StorageState(backend=old.backend, identity=old.identity, settings=old.settings,
                        stores=old.stores, next_id=old.next_id)
    return replace(fresh, storage=kept), None
