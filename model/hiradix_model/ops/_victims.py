"""Legality of reported eviction sequences, shared by evict, evict_host, backup and load.

An implementation reports the pages it evicted, in order. The spec allows exactly the
sequences in which every victim, at its turn, is an evictable leaf of minimal rank
(ties are free), that stop once the target is met -- except to finish the chain of the
previous victim (whole-node eviction overshoots that way) -- and that do not stop short
while evictable leaves remain.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import TypeVar

from hiradix_model.errors import IllegalChoice
from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft
from hiradix_model.state import device_evictable_leaves, host_evictable_leaves
from hiradix_model.strategies import eviction_key

Item = TypeVar("Item")


def device_leaves(draft: Draft) -> set[Key]:
    return device_evictable_leaves(draft.view())


def host_leaves(draft: Draft) -> set[Key]:
    return host_evictable_leaves(draft.view())


def check_min_leaf(
    draft: Draft, page: Key, leaves_of: Callable[[Draft], set[Key]], where: str
) -> None:
    """Reject ``page`` unless it is an evictable leaf of minimal rank right now."""
    leaves = leaves_of(draft)
    if page not in leaves:
        raise IllegalChoice(f"{where}: {page} is not an evictable leaf")
    strategy = draft.config.eviction
    rank = eviction_key(strategy, draft.page(page))
    best = min(eviction_key(strategy, draft.page(leaf)) for leaf in leaves)
    if rank > best:
        raise IllegalChoice(f"{where}: {page} ranks {rank} but a leaf ranks {best} ({strategy})")


def run_sequence(
    draft: Draft,
    items: Sequence[Item],
    target_tokens: int,
    page_of: Callable[[Item], Key],
    leaves_of: Callable[[Draft], set[Key]],
    evict_one: Callable[[Draft, Item, str], int],
    what: str,
) -> int:
    """Apply a reported victim sequence after checking each step; return tokens evicted."""
    evicted = 0
    previous: Key | None = None
    for index, item in enumerate(items):
        page = page_of(item)
        where = f"{what}[{index}]"
        if evicted >= target_tokens and (previous is None or draft.parent(previous) != page):
            raise IllegalChoice(
                f"{where}: {page} evicted after the target of {target_tokens} tokens was met;"
                " only the rest of the previous victim's chain may follow"
            )
        check_min_leaf(draft, page, leaves_of, where)
        evicted += evict_one(draft, item, where)
        previous = page
    if evicted < target_tokens and leaves_of(draft):
        raise IllegalChoice(
            f"{what}: stopped at {evicted} of {target_tokens} tokens while evictable pages remain"
        )
    return evicted


def evict_host_page(draft: Draft, page: Key) -> int:
    """Remove a host-only page from the cache and free its host slots."""
    record = draft.page(page)
    assert record.host is not None and record.device is None
    draft.host_free.update(record.host)
    draft.set_page(page, None)
    return draft.ps


def make_host_room(draft: Draft, victims: Sequence[Key], need_slots: int, what: str) -> None:
    """Evict host pages, by the victim rules, until ``need_slots`` host slots are free.

    The target is the shortfall, so reporting victims when the host already has room is
    illegal, and so is stopping short while evictable host leaves remain.
    """
    shortfall = max(0, need_slots - len(draft.host_free))
    run_sequence(draft, victims, shortfall, lambda page: page, host_leaves,
                 lambda d, page, where: evict_host_page(d, page), what)


def drop_device_copy(draft: Draft, page: Key) -> int:
    """Free a device leaf's slots: keep the page host-only if backed up, else delete it."""
    record = draft.page(page)
    assert record.device is not None and record.lock == 0
    draft.device_free.update(record.device)
    if record.host is not None:
        draft.set_page(page, replace(record, device=None))
    else:
        assert not any(draft.parent(k) == page for k in draft.pages), "leaf with children"
        draft.set_page(page, None)
    return draft.ps
