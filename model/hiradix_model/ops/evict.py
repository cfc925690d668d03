"""evict and evict_host (spec/03-operations.md, "evict", "evict_host")."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, replace

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft, choose_whole_pages, require
from hiradix_model.ops._victims import (
    device_leaves,
    drop_device_copy,
    evict_host_page,
    host_leaves,
    make_host_room,
    run_sequence,
)
from hiradix_model.ops.storage._common import is_attached, issue_write
from hiradix_model.state import (  # noqa: F401 (contracts)
    State,
    only_kept_leaves,
    protected_below,
    subtree,
)


@dataclass(frozen=True)
class Victim:
    """One reported device eviction step.

    Under write_back a victim without a host copy is backed up on the way out:
    ``host_slots`` are the host slots it got (after evicting ``host_victims`` on host to
    make room), or None if the host had no room and the page was dropped with its subtree.
    Under the write-through policies both fields stay empty.
    """

    page: Key
    host_victims: tuple[Key, ...] = ()
    host_slots: tuple[int, ...] | None = None


def evict(state: State, num_tokens: int, victims: Sequence[Victim]) -> tuple[State, int]:
    """Free at least ``num_tokens`` device tokens (or all evictable ones) in rank order.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].device_free) - len(state.device_free)
    post: __return__[1] >= num_tokens or only_kept_leaves(__return__[0])
    raises: PreconditionError, IllegalChoice
    """
    require(isinstance(num_tokens, int) and num_tokens >= 0, "num_tokens", "must be an int >= 0")
    draft = Draft(state)
    evicted = evict_in(draft, num_tokens, victims, "victims")
    return draft.freeze(), evicted


def evict_in(draft: Draft, num_tokens: int, victims: Sequence[Victim], what: str) -> int:
    """The body of evict, on a draft (load_back evicts as part of its own step)."""
    write_back = draft.config.write_policy == "write_back"
    kept: set[Key] = set()  # write_back victims that could be neither copied nor dropped

    def evict_one(d: Draft, victim: Victim, where: str) -> int:
        if not write_back or d.page(victim.page).host is not None:
            if victim.host_victims or victim.host_slots is not None:
                raise IllegalChoice(f"{where}: no backup happens on this eviction")
            return drop_device_copy(d, victim.page)
        return _evict_write_back(d, victim, where, kept)

    return run_sequence(draft, victims, num_tokens, lambda v: v.page,
                        lambda d: device_leaves(d) - kept, evict_one, what)


def _evict_write_back(draft: Draft, victim: Victim, where: str, kept: set[Key]) -> int:
    """write_back: copy the page to host as it leaves the device, or drop it if no room.

    A page whose host-only subtree holds a protected page cannot be dropped; it stays on
    device and out of the rest of this eviction (``kept``; spec/09, S-R5). Only storage
    holders protect host-only pages there, so without storage this never happens.
    """
    ps = draft.ps
    make_host_room(draft, victim.host_victims, ps, f"{where}.host_victims")
    record = draft.page(victim.page)
    assert record.device is not None
    if victim.host_slots is None:
        if len(draft.host_free) >= ps:
            raise IllegalChoice(f"{where}: dropped although the host has room")
        if protected_below(draft.view(), victim.page):
            kept.add(victim.page)
            return 0
        return _drop_subtree(draft, victim.page)
    slots = victim.host_slots
    if len(slots) != ps or len(set(slots)) != ps or not set(slots) <= draft.host_free:
        raise IllegalChoice(f"{where}.host_slots: {slots} are not {ps} distinct free host slots")
    choose_whole_pages(slots, ps, f"{where}.host_slots")
    for src, dst in zip(record.device, slots, strict=True):
        content = draft.device_kv.get(src)
        if content is None:
            draft.host_kv.pop(dst, None)
        else:
            draft.host_kv[dst] = content
    draft.host_free.difference_update(slots)
    draft.device_free.update(record.device)
    draft.set_page(victim.page, replace(record, device=None, host=slots))
    if is_attached(draft):
        issue_write(draft, (victim.page,))  # its host copy is complete: back it up (S-R1)
    return ps


def _drop_subtree(draft: Draft, page: Key) -> int:
    """Delete ``page`` and every page below it (all host-only), freeing all their slots."""
    doomed = list(subtree(draft.view(), page))
    assert not any(draft.page(k).host_protect for k in doomed), "dropping a protected page"
    record = draft.page(page)
    assert record.device is not None
    draft.device_free.update(record.device)
    for key in doomed:
        host = draft.page(key).host
        if host is not None:
            draft.host_free.update(host)
        draft.set_page(key, None)
    return draft.ps


def evict_host(state: State, num_tokens: int, victims: Sequence[Key]) -> tuple[State, int]:
    """Free at least ``num_tokens`` host tokens of host-only pages (or all evictable ones).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].host_free) - len(state.host_free)
    raises: PreconditionError, IllegalChoice
    """
    require(isinstance(num_tokens, int) and num_tokens >= 0, "num_tokens", "must be an int >= 0")
    draft = Draft(state)
    evicted = run_sequence(
        draft,
        victims,
        num_tokens,
        lambda page: page,
        host_leaves,
        lambda d, page, where: evict_host_page(d, page),
        "victims",
    )
    return draft.freeze(), evicted
