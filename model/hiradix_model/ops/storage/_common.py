"""Draft-level steps shared by the storage operations (spec/09-storage.md, 9.3).

Every change of a prefetch's slots goes through ``give_up``, which appends one entry per
slot to the release log: that is what makes a double release a visible state
(INV-RELEASE-ONCE) instead of a no-op on a set.
"""

from __future__ import annotations

from dataclasses import replace
from typing import Literal

from hiradix_model.keys import Key
from hiradix_model.ops._draft import Draft, require
from hiradix_model.storage import Prefetch, StorageState, StorageWrite

Destination = Literal["free", "queue", "tree"]


def storage_of(draft: Draft) -> StorageState:
    assert draft.storage is not None, "a storage step on a state without storage"
    return draft.storage


def update(draft: Draft, **changes: object) -> None:
    draft.storage = replace(storage_of(draft), **changes)  # type: ignore[arg-type]


def is_attached(draft: Draft) -> bool:
    return draft.storage is not None and draft.storage.backend is not None


def protect(draft: Draft, page: Key, delta: int) -> None:
    record = draft.page(page)
    draft.set_page(page, replace(record, host_protect=record.host_protect + delta))


def put(draft: Draft, prefetch: Prefetch) -> None:
    """Replace the ongoing prefetch with ``prefetch.id`` by ``prefetch``."""
    storage = storage_of(draft)
    update(draft, prefetches=tuple(prefetch if p.id == prefetch.id else p
                                   for p in storage.prefetches))


def give_up(draft: Draft, prefetch: Prefetch, keep_pages: int, to: Destination) -> Prefetch:
    """``prefetch`` releases the slots of its pages from ``keep_pages`` on, to ``to``."""
    keep = prefetch.slots[: keep_pages * draft.ps]
    gone = prefetch.slots[keep_pages * draft.ps:]
    storage = storage_of(draft)
    log = storage.release_log + tuple((prefetch.id, slot) for slot in gone)
    if to == "free":
        draft.host_free.update(gone)
    queue = storage.release_queue + (gone if to == "queue" else ())
    update(draft, release_log=log, release_queue=queue)
    smaller = replace(prefetch, slots=keep)
    put(draft, smaller)
    return smaller


def end_prefetch(draft: Draft, prefetch: Prefetch) -> None:
    """Forget an ongoing prefetch that owns no slot: its anchor and its tokens are free."""
    assert not prefetch.slots, "end_prefetch would leak slots"
    storage = storage_of(draft)
    if prefetch.anchor is not None:
        protect(draft, prefetch.anchor, -1)
    update(draft, prefetches=tuple(p for p in storage.prefetches if p.id != prefetch.id),
           occupied_tokens=storage.occupied_tokens - len(prefetch.reserved))


def issue_write(draft: Draft, pages: tuple[Key, ...]) -> None:
    """Back up to storage the pages of ``pages`` the backend lacks (spec/09, S-R1).

    Each of them stays host-protected until its write is drained from the ack queue
    (INV-STORAGE-WRITE-PROTECT). Nothing is issued when the backend has them all.
    """
    storage = storage_of(draft)
    lacking = tuple(k for k in pages if storage.sid(k) not in storage.stored)
    if not lacking:
        return
    for page in lacking:
        protect(draft, page, +1)
    update(draft, writes=(*storage.writes, StorageWrite(storage.next_id, lacking)),
           next_id=storage.next_id + 1)


def release_write(draft: Draft, write: StorageWrite) -> None:
    """Drop a write's host protection and forget it (ack drained, or detach)."""
    for page in write.pages:
        protect(draft, page, -1)
    storage = storage_of(draft)
    update(draft, writes=tuple(w for w in storage.writes if w.id != write.id))


def require_request(request: str) -> None:
    require(isinstance(request, str) and request != "", "request", "must be a non-empty str")
