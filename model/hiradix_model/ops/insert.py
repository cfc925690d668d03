"""insert (spec/03-operations.md, "insert")."""

from __future__ import annotations

from dataclasses import dataclass, replace

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.invariants import check  # noqa: F401 (used by the contracts)
from hiradix_model.keys import Key, content_at, page_aligned_length, page_keys
from hiradix_model.ops._draft import (
    Draft,
    require,
    require_key,
    require_slots,
    require_tick,
    require_whole_pages,
)
from hiradix_model.ops.backup import Backup, apply_backup, backup_run
from hiradix_model.state import Page, State


@dataclass(frozen=True)
class InsertResult:
    prefix_tokens: int  # tokens already on device; the caller's slots there are duplicates
    due: tuple[Key, ...]  # pages that reached the backup threshold without a host copy


def insert(
    state: State,
    key: Key,
    slots: tuple[int, ...],
    now: int,
    *,
    priority: int = 0,
    chunked: bool = False,
    counted_from: int = 0,
    backup: Backup | None = None,
) -> tuple[State, InsertResult]:
    """Cache ``key`` whose KV is in ``slots`` (one per token); back up the pages now due.

    ``counted_from`` (tokens, a page multiple up to the page-aligned length) is what this
    request inserted before: pages ending at or before it count no hit and are not due;
    ``chunked`` is ``counted_from`` = the page-aligned length (spec/03 3.5, 07 DEV-25).
    ``backup`` reports the outcome of the backup run (None when no page is due).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1].prefix_tokens % state.config.page_size == 0
    post: __return__[1].prefix_tokens <= len(key.tokens)
    post: ends_past(__return__[1].due, counted_from)
    raises: PreconditionError, IllegalChoice
    """
    require_key(key)
    require_slots(slots, "slots")
    require(len(slots) == len(key.tokens), "slots", "must hold one slot per token of key")
    require(isinstance(priority, int), "priority", "must be an int")
    require(backup is None or isinstance(backup, Backup), "backup", "must be a Backup or None")
    require(isinstance(chunked, bool), "chunked", "must be a bool")
    ps = state.config.page_size
    require_counted_from(counted_from, page_aligned_length(key, ps), ps)
    draft = Draft(state)
    require_tick(draft, now)
    pages = page_keys(key, draft.ps)
    _check_slots(draft, key, slots, len(pages))
    prefix_tokens, due = insert_pages(draft, key, slots, now, priority, chunked, counted_from)
    apply_backup(draft, backup_run(draft, due), backup, "backup")
    return draft.freeze(), InsertResult(prefix_tokens, due)


def ends_past(pages: tuple[Key, ...], length: int) -> bool:
    """Every page of ``pages`` ends past ``length`` tokens (a contract's helper)."""
    return all(len(page.tokens) > length for page in pages)


def require_counted_from(counted_from: object, aligned: int, page_size: int) -> None:
    """``counted_from`` is an int (not a bool), a page multiple, 0 <= it <= ``aligned``."""
    require(isinstance(counted_from, int) and not isinstance(counted_from, bool),
            "counted_from", "must be an int")
    assert isinstance(counted_from, int)
    require(counted_from % page_size == 0, "counted_from",
            f"must be a multiple of the page size {page_size}")
    require(0 <= counted_from <= aligned, "counted_from",
            f"must be between 0 and the page-aligned length {aligned}")


def insert_pages(
    draft: Draft, key: Key, slots: tuple[int, ...], now: int, priority: int, chunked: bool,
    counted_from: int = 0,
) -> tuple[int, tuple[Key, ...]]:
    """insert without the backups: returns the cached prefix and the pages now due.
    ``counted_from`` must be valid (``require_counted_from``)."""
    pages = page_keys(key, draft.ps)
    draft.clock = now
    prefix_tokens = 0
    # Pages ending at or before ``counted`` were counted by this request's earlier insert.
    counted = len(pages) * draft.ps if chunked else counted_from
    for index, page in enumerate(pages):
        own = slots[index * draft.ps : (index + 1) * draft.ps]
        hit = 1 if (index + 1) * draft.ps > counted else 0
        record = draft.pages.get(page)
        if record is None:
            new = Page(device=own, host=None, hits=hit, last_tick=now, insert_tick=now,
                       priority=priority)
        elif record.device is None:
            # Recomputed KV for a page that lives only on host: adopt the new slots. It was
            # not found on device, so it is neither a hit nor part of the cached prefix.
            new = replace(record, device=own, last_tick=now,
                          priority=max(record.priority, priority))
        else:
            prefix_tokens += draft.ps
            draft.set_page(page, replace(record, hits=record.hits + hit, last_tick=now,
                                         priority=max(record.priority, priority)))
            continue
        draft.held.difference_update(own)
        draft.set_page(page, new)
    threshold = draft.config.write_through_threshold
    due: tuple[Key, ...] = ()
    if threshold is not None:
        due = tuple(
            p for p in pages if len(p.tokens) > counted
            and draft.page(p).hits >= threshold and draft.page(p).host is None
        )
    return prefix_tokens, due


def _check_slots(draft: Draft, key: Key, slots: tuple[int, ...], num_pages: int) -> None:
    """Whole pages in order (R7); each slot the tree's own slot for that position or
    holding the caller's KV."""
    require_whole_pages(slots, draft.ps, "slots")
    for position in range(num_pages * draft.ps):
        slot = slots[position]
        record = draft.pages.get(Key(key.tokens[: position - position % draft.ps + draft.ps],
                                     key.namespace))
        where = f"slots[{position}]"
        if record is not None and record.device is not None:
            require(slot == record.device[position % draft.ps] or slot in draft.held, where,
                    f"slot {slot} is neither the cache's slot here nor held by the caller")
            continue
        require(slot in draft.held, where, f"slot {slot} is not held by the caller")
        require(draft.device_kv.get(slot) == content_at(key, position), where,
                f"slot {slot} does not hold the KV of this position")
    for position in range(num_pages * draft.ps, len(slots)):  # the partial tail page
        require(slots[position] in draft.held, f"slots[{position}]",
                f"slot {slots[position]} is not held by the caller")
    assert page_aligned_length(key, draft.ps) == num_pages * draft.ps
