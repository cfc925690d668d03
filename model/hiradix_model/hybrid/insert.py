"""insert (spec/13, 13.3): cache a key from the caller's pairs; heal tombstones."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.component_args import (
    require,
    require_key,
    require_slots,
    require_whole_pages,
)
from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaPage, SwaState
from hiradix_model.keys import Key, page_keys


def insert(state: SwaState, key: Key, full: tuple[int, ...], swa_evicted: int,
           kept_full: frozenset[Key] = frozenset()) -> tuple[SwaState, int]:
    """Cache ``key`` whose KV is in ``full``: held pairs, or at a cached page the page's
    own slots (what a match gave the caller). Held pairs before ``swa_evicted`` have no
    SWA half. ``kept_full`` (the implementation's choice) are the healed tombstones that
    kept their own full slots and took only the caller's SWA halves. Returns the new
    state and the tokens cached before.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] % state.config.page_size == 0
    post: set(__return__[0].pages) >= set(state.pages)
    raises: PreconditionError, IllegalChoice
    """
    require_key(key)
    require_slots(full, "full")
    require(isinstance(kept_full, frozenset), "kept_full", "must be a frozenset of keys")
    ps = state.config.page_size
    require(len(full) == len(key.tokens), "full", "must hold one slot per token of key")
    require(isinstance(swa_evicted, int) and 0 <= swa_evicted <= len(key.tokens)
            and swa_evicted % ps == 0, "swa_evicted", f"must be a multiple of {ps} within key")
    for position, slot in enumerate(full):
        if slot in state.held:
            has_half = state.held[slot] is not None
            require(has_half == (position >= swa_evicted), "full",
                    f"pair {slot} at position {position} "
                    + ("has an SWA half before swa_evicted" if has_half
                       else "has no SWA half at or after swa_evicted"))
        else:
            require(slot == _cached_slot(state, key, position), "full",
                    f"slot {slot} at position {position} is neither held by the caller "
                    "nor the cached page's own slot there")
    for index in range(len(key.tokens) // ps):
        mine = full[index * ps:(index + 1) * ps]
        owned = [slot in state.held for slot in mine]
        require(all(owned) or not any(owned), "full",
                f"page {index} mixes held slots with the cached page's own")
        if all(owned):
            require_whole_pages(mine, ps, "full")
    pages = dict(state.pages)
    held = dict(state.held)
    full_free = set(state.full_free)
    healed: set[Key] = set()
    prefix = 0
    for index, page in enumerate(page_keys(key, ps)):
        start = index * ps
        mine = full[start:start + ps]
        record = pages.get(page)
        if any(slot not in held for slot in mine):  # the page's own slots: nothing to do
            prefix = start + ps
            continue
        halves = tuple(held[f] for f in mine)
        swa = None if start < swa_evicted else tuple(s for s in halves if s is not None)
        if record is None:
            pages[page] = SwaPage(full=mine, swa=swa)
        elif record.live or swa is None:
            prefix = start + ps  # a duplicate: the caller keeps its pair
            continue
        else:
            prefix = start + ps
            healed.add(page)
            if page in kept_full:  # the tombstone takes the SWA halves only
                pages[page] = replace(record, swa=swa)
                held.update(dict.fromkeys(mine))
                continue
            if record.lock:
                raise IllegalChoice(f"kept_full: healing locked {page} freed its full slots "
                                    f"{record.full}, which a running request reads")
            full_free.update(record.full)  # the tombstone takes the caller's whole pairs
            pages[page] = replace(record, full=mine, swa=swa)
        for slot in mine:
            del held[slot]
    if not kept_full <= healed:
        raise IllegalChoice(f"kept_full: {sorted(k.tokens for k in kept_full - healed)} "
                            "were not healed by this insert")
    return replace(state, pages=pages, held=held, full_free=frozenset(full_free)), prefix


def _cached_slot(state: SwaState, key: Key, position: int) -> int | None:
    """The full slot the cached page at ``position`` of ``key`` holds there, if cached."""
    ps = state.config.page_size
    end = (position // ps + 1) * ps
    if end > len(key.tokens):
        return None
    record = state.pages.get(Key(key.tokens[:end], key.namespace))
    return None if record is None else record.full[position % ps]
