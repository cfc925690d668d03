"""insert (spec/13m, 13m.3): cache a key from the caller's full slots, a state at its end."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import (
    require,
    require_key,
    require_slots,
    require_whole_pages,
)
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key, page_keys
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import MambaPage, MambaState


def insert(state: MambaState, key: Key, full: tuple[int, ...],
           slot: int) -> tuple[MambaState, int, bool]:
    """Cache ``key`` whose KV is in ``full`` (held slots, or at a cached page that page's
    own slots), with the held state ``slot`` (the state after ``key``) at its last page
    unless that page has a state already. Returns the new state, the tokens cached
    before, and whether the state was taken.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] % state.config.page_size == 0
    post: set(__return__[0].pages) >= set(state.pages)
    raises: PreconditionError
    """
    require_key(key)
    require_slots(full, "full")
    ps = state.config.page_size
    require(len(key.tokens) > 0 and len(key.tokens) % ps == 0, "key",
            f"must be a positive multiple of {ps} tokens")
    require(len(full) == len(key.tokens), "full", "must hold one slot per token of key")
    require(isinstance(slot, int) and slot in state.held_states, "slot",
            f"state slot {slot!r} is not held by the caller")
    require(state.state_kv.get(slot) == key, "slot",
            f"holds the state after {state.state_kv.get(slot)}, not after {key}")
    pages_of_key = page_keys(key, ps)
    for index, page in enumerate(pages_of_key):
        mine = full[index * ps:(index + 1) * ps]
        record = state.pages.get(page)
        if record is not None and mine == record.full:
            continue
        require(set(mine) <= state.held_full, "full",
                f"page {index}: {mine} are neither held by the caller nor the cached "
                "page's own slots")
        require_whole_pages(mine, ps, "full")
    pages = dict(state.pages)
    held_full = set(state.held_full)
    prefix = 0
    for index, page in enumerate(pages_of_key):
        mine = full[index * ps:(index + 1) * ps]
        if page in pages:
            prefix = (index + 1) * ps  # cached: the caller keeps any held duplicate
            continue
        pages[page] = MambaPage(full=mine)
        held_full -= set(mine)
    end = pages_of_key[-1]
    taken = pages[end].state is None
    if taken:
        pages[end] = replace(pages[end], state=slot)
    return (replace(state, pages=pages, held_full=frozenset(held_full),
                    held_states=state.held_states - {slot} if taken else state.held_states),
            prefix, taken)
