"""The caller's side of both pools (spec/13m, 13m.3): full slots and state slots."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import (
    require,
    require_key,
    require_slots,
    require_whole_pages,
)
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key, content_at
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import MambaState


def alloc(state: MambaState, key: Key, start: int, full: tuple[int, ...]) -> MambaState:
    """Take free full slots and write into slot ``i`` the KV of ``key`` at ``start + i``
    (none past its end).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.held_full == state.held_full | set(full)
    raises: PreconditionError
    """
    require_key(key)
    require_slots(full, "full")
    require_whole_pages(full, state.config.page_size, "full")
    require(set(full) <= state.full_free, "full", "are not all free full slots")
    require(isinstance(start, int) and 0 <= start <= len(key.tokens), "start",
            "must be an int within key")
    full_kv = dict(state.full_kv)
    for offset, slot in enumerate(full):
        if start + offset < len(key.tokens):
            full_kv[slot] = content_at(key, start + offset)
        else:
            full_kv.pop(slot, None)
    return replace(state, full_free=state.full_free - set(full),
                   held_full=state.held_full | set(full), full_kv=full_kv)


def free(state: MambaState, full: tuple[int, ...]) -> MambaState:
    """Return held full slots, whole pages (13m.3).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.full_free == state.full_free | set(full)
    raises: PreconditionError
    """
    require_slots(full, "full")
    require_whole_pages(full, state.config.page_size, "full")
    require(set(full) <= state.held_full, "full", "are not all held by the caller")
    return replace(state, held_full=state.held_full - set(full),
                   full_free=state.full_free | set(full))


def _require_state_slot(slot: object) -> int:
    require(isinstance(slot, int) and not isinstance(slot, bool), "slot", "must be an int")
    assert isinstance(slot, int)
    return slot


def alloc_state(state: MambaState, slot: int, prefix: Key) -> MambaState:
    """Take a free state slot holding the state after ``prefix`` (13m.3).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.held_states == state.held_states | {slot}
    raises: PreconditionError
    """
    _require_state_slot(slot)
    require_key(prefix, "prefix")
    require(slot in state.state_free, "slot", f"state slot {slot} is not free")
    return replace(state, state_free=state.state_free - {slot},
                   held_states=state.held_states | {slot},
                   state_kv={**state.state_kv, slot: prefix})


def write_state(state: MambaState, slot: int, prefix: Key) -> MambaState:
    """The forward pass moved the state in held ``slot`` on to the end of ``prefix``.

    pre: not check(state)
    post: not check(__return__)
    raises: PreconditionError
    """
    _require_state_slot(slot)
    require_key(prefix, "prefix")
    require(slot in state.held_states, "slot", f"state slot {slot} is not held by the caller")
    return replace(state, state_kv={**state.state_kv, slot: prefix})


def free_state(state: MambaState, slot: int) -> MambaState:
    """Return a held state slot (13m.3).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.state_free == state.state_free | {slot}
    raises: PreconditionError
    """
    _require_state_slot(slot)
    require(slot in state.held_states, "slot", f"state slot {slot} is not held by the caller")
    return replace(state, held_states=state.held_states - {slot},
                   state_free=state.state_free | {slot})


def fork(state: MambaState, page: Key, slot: int) -> MambaState:
    """Copy the state cached at ``page`` into free ``slot``, now held (copy on write).

    pre: not check(state)
    post: not check(__return__)
    post: __return__.state_kv[slot] == page
    raises: PreconditionError
    """
    require_key(page, "page")
    record = state.pages.get(page)
    require(record is not None and record.state is not None, "page",
            "is not cached with a state")
    return alloc_state(state, slot, page)
