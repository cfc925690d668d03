"""load_back, init_load_back and loading_check (spec/03-operations.md)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, parent_page
from hiradix_model.ops._ack import acknowledge
from hiradix_model.ops._draft import Draft, add_lock, choose_whole_pages, require, require_key
from hiradix_model.ops.evict import Victim, evict_in
from hiradix_model.state import State, Transfer, pending_count  # noqa: F401 (contracts)


def load_back(
    state: State,
    page: Key,
    mem_quota: int | None,
    *,
    device_victims: Sequence[Victim] = (),
    device_slots: tuple[int, ...] | None = None,
) -> tuple[State, tuple[int, ...] | None]:
    """Start copying the host-only chain ending at ``page`` back to device, all or nothing.

    ``device_slots`` are the device slots the implementation allocated (None: it could
    not, or it skipped the load); ``device_victims`` what it evicted to make room.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] is None or len(__return__[1]) % state.config.page_size == 0
    raises: PreconditionError, IllegalChoice
    """
    require_key(page, "page")
    record = state.pages.get(page)
    require(record is not None, "page", f"{page} is not cached")
    assert record is not None
    require(record.device is None, "page", f"{page} is already on device")
    require(mem_quota is None or (isinstance(mem_quota, int) and mem_quota >= 0), "mem_quota",
            "must be None or an int >= 0")
    draft = Draft(state)
    plan = plan_load(draft, page, mem_quota)
    chain, tokens, anchor = plan.chain, plan.tokens, plan.anchor
    if plan.skip:
        if device_victims or device_slots is not None:
            raise IllegalChoice("load_back: the load must be skipped (size or quota)")
        return state, None
    _protect(draft, chain, +1)  # host eviction while making room must not take the chain
    # Evict only the shortfall. The anchor's path is locked meanwhile, so the load cannot
    # evict the pages it hangs from.
    if anchor is not None:
        add_lock(draft, anchor, +1)
    evict_in(draft, max(0, tokens - len(draft.device_free)), device_victims, "device_victims")
    if anchor is not None:
        add_lock(draft, anchor, -1)
    if device_slots is None:
        if len(draft.device_free) >= tokens:
            raise IllegalChoice("device_slots: reported no room, but the device has room")
        _protect(draft, chain, -1)
        return draft.freeze(), None
    if (len(device_slots) != tokens or len(set(device_slots)) != tokens
            or not set(device_slots) <= draft.device_free):
        raise IllegalChoice(f"device_slots: not {tokens} distinct free device slots")
    choose_whole_pages(device_slots, draft.ps, "device_slots")
    draft.device_free.difference_update(device_slots)
    for index, key in enumerate(chain):
        own = device_slots[index * draft.ps : (index + 1) * draft.ps]
        draft.set_page(key, replace(draft.page(key), device=own))
    add_lock(draft, page, +1)  # released by loading_check
    source = tuple(s for key in chain for s in draft.page(key).host or ())
    draft.pending.append(Transfer("h2d", tuple(chain), source, device_slots, page))
    return draft.freeze(), device_slots


@dataclass(frozen=True)
class LoadPlan:
    chain: tuple[Key, ...]  # the host-only pages to load, root-most first
    tokens: int
    anchor: Key | None  # the deepest device page above the chain; None: the root
    skip: bool  # below load_back_threshold, or over the memory quota


def plan_load(draft: Draft, page: Key, mem_quota: int | None) -> LoadPlan:
    """What load_back of ``page`` would load, and whether size or quota forbid it."""
    chain = _host_only_chain(draft, page)
    tokens = draft.ps * len(chain)
    anchor = draft.parent(chain[0])
    # Locking the anchor's path takes its unlocked tokens out of what the quota can evict.
    newly_locked = 0 if anchor is None else sum(
        draft.ps for k in draft.path(anchor) if draft.page(k).lock == 0
    )
    too_small = tokens < draft.config.load_back_threshold
    over_quota = mem_quota is not None and tokens > mem_quota - newly_locked
    return LoadPlan(tuple(chain), tokens, anchor, too_small or over_quota)


def _protect(draft: Draft, chain: Sequence[Key], delta: int) -> None:
    for key in chain:
        record = draft.page(key)
        draft.set_page(key, replace(record, host_protect=record.host_protect + delta))


def _host_only_chain(draft: Draft, page: Key) -> list[Key]:
    """``page`` and its ancestors that are not on device, root-most first."""
    chain = []
    cursor: Key | None = page
    while cursor is not None and draft.page(cursor).device is None:
        chain.append(cursor)
        cursor = draft.parent(cursor)
    chain.reverse()
    return chain


def init_load_back(
    state: State,
    page: Key | None,
    mem_quota: int | None,
    *,
    device_victims: Sequence[Victim] = (),
    device_slots: tuple[int, ...] | None = None,
) -> tuple[State, tuple[tuple[int, ...], Key | None]]:
    """Load back ``page`` if it is host-only; return the loaded slots and the page to use.

    If nothing is loaded the page returned is ``page``'s deepest ancestor on device.

    pre: not check(state)
    post: not check(__return__[0])
    raises: PreconditionError, IllegalChoice
    """
    if page is None or (page in state.pages and state.pages[page].device is not None):
        if device_victims or device_slots is not None:
            raise IllegalChoice("init_load_back: nothing to load")
        return state, ((), page)
    new_state, loaded = load_back(
        state, page, mem_quota, device_victims=device_victims, device_slots=device_slots
    )
    if loaded is not None:
        return new_state, (loaded, page)
    cursor: Key | None = page
    while cursor is not None and new_state.pages[cursor].device is None:
        cursor = parent_page(cursor, state.config.page_size)
    return new_state, ((), cursor)


def loading_check(state: State, count: int) -> tuple[State, int]:
    """Acknowledge the oldest ``count`` host-to-device copies: bytes land, protections drop.

    pre: not check(state)
    post: not check(__return__[0])
    post: pending_count(__return__[0], "h2d") == pending_count(state, "h2d") - count
    raises: PreconditionError
    """
    return acknowledge(state, "h2d", count)
