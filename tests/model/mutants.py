"""One corruption per invariant: a function that breaks exactly what the ID forbids.

Used by test_invariants.py (each corruption must make its own ID fail) and by the
traceability test (every spec ID must have one).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

from hiradix_model import Event, Key, Page, State, initial, ops
from hiradix_model.events import step_events
from hiradix_model.storage import StorageWrite

from scenario import BACKING_UP, HOST_ONLY, IDENTITY, LOADED, STORAGE, build_storage

PARENT = Key((1, 2))


def _page(state: State, key: Key, **changes: object) -> State:
    pages = dict(state.pages)
    pages[key] = replace(pages[key], **changes)  # type: ignore[arg-type]
    return replace(state, pages=pages)


def orphan_page(s: State) -> State:
    pages = dict(s.pages)
    pages[Key((9, 9, 9, 9))] = Page(device=None, host=tuple(sorted(s.host_free)[:2]))
    return replace(s, pages=pages, host_free=s.host_free - set(sorted(s.host_free)[:2]))


def nowhere(s: State) -> State:
    host = s.pages[HOST_ONLY].host or ()
    return replace(_page(s, HOST_ONLY, host=None), host_free=s.host_free | set(host))


def evicted_mid_backup(s: State) -> State:
    device = s.pages[BACKING_UP].device or ()
    state = _page(s, BACKING_UP, device=None, lock=0)
    return replace(state, device_free=s.device_free | set(device),
                   protected_tokens=s.protected_tokens - 2)


def device_hole(s: State) -> State:
    # The parent gives its device copy up while the child keeps one.
    device = s.pages[PARENT].device or ()
    state = _page(s, PARENT, device=None, lock=0, host_protect=0)
    return replace(state, device_free=s.device_free | set(device),
                   protected_tokens=s.protected_tokens - 2)


def backup_gap(s: State) -> State:
    host = s.pages[PARENT].host or ()
    return replace(_page(s, PARENT, host=None, host_protect=0),
                   host_free=s.host_free | set(host))


def locked_on_host(s: State) -> State:
    return _page(s, HOST_ONLY, lock=1)


def child_outlocks_parent(s: State) -> State:
    return replace(_page(s, LOADED, lock=s.pages[PARENT].lock + 1))


def counter_drift(s: State) -> State:
    return replace(s, evictable_tokens=s.evictable_tokens + 2)


def lost_device_slot(s: State) -> State:
    return replace(s, device_free=s.device_free - {min(s.device_free)})


def host_slot_owned_twice(s: State) -> State:
    return replace(s, host_free=s.host_free | {(s.pages[HOST_ONLY].host or ())[0]})


def evictable_but_no_leaf(s: State) -> State:
    return replace(s, evictable_tokens=s.evictable_tokens + 2)


def host_leaf_stuck(s: State) -> State:
    return _page(s, HOST_ONLY, lock=1)


def protected_without_copy(s: State) -> State:
    return _page(s, HOST_ONLY, host_protect=1, host=None)


def source_moved(s: State) -> State:
    # The backup's source page loses its lock while its copy is in flight.
    return _page(s, BACKING_UP, lock=0)


def wrong_bytes(s: State) -> State:
    slot = (s.pages[HOST_ONLY].host or ())[0]
    return replace(s, host_kv={**s.host_kv, slot: Key((7, 9))})


def foreign_namespace(s: State) -> State:
    slot = (s.pages[HOST_ONLY].host or ())[0]
    return replace(s, host_kv={**s.host_kv, slot: Key((7,), "other")})


def tick_from_future(s: State) -> State:
    return _page(s, HOST_ONLY, last_tick=s.clock + 1)


def protected_for_nobody(s: State) -> State:
    # A protection no load, storage write or prefetch holds: the page could never be
    # host-evicted again (a forgotten release_host).
    return _page(s, HOST_ONLY, host_protect=1)


# -- Storage tier: each starts from build_storage(s) (scenario.py) --------------------------


def _storage(s: State, **changes: object) -> State:
    state = build_storage(s)
    assert state.storage is not None
    return replace(state, storage=replace(state.storage, **changes))  # type: ignore[arg-type]


def _prefetch(s: State, index: int, **changes: object) -> State:
    state = build_storage(s)
    assert state.storage is not None
    prefetches = list(state.storage.prefetches)
    prefetches[index] = replace(prefetches[index], **changes)  # type: ignore[arg-type]
    return replace(state, storage=replace(state.storage, prefetches=tuple(prefetches)))


def prefetch_owns_half_a_page(s: State) -> State:
    # The landed prefetch gives one slot of its page back to the free list: the pool
    # still balances, but the prefetch no longer owns whole pages.
    state = _prefetch(s, 0, slots=(8,))
    return replace(state, host_free=state.host_free | {9})


def released_twice(s: State) -> State:
    # The revoked prefetch's slot 10 is released a second time (a drained queue entry
    # and a force-release both freeing it, as SGLang's detach does).
    state = build_storage(s)
    assert state.storage is not None
    log = (*state.storage.release_log, (2, 10))
    return replace(state, storage=replace(state.storage, release_log=log))


def write_unprotected(s: State) -> State:
    # BACKING_UP's storage write is unreleased but its protection was dropped.
    state = build_storage(s)
    return _page(state, BACKING_UP, host_protect=state.pages[BACKING_UP].host_protect - 2)


def write_from_copy_in_flight(s: State) -> State:
    # The zero-page bug of issue 34: a storage write scheduled for BACKING_UP while its
    # d2h copy is still in flight (its host slots hold nothing yet).
    state, _ = ops.attach_storage(s, "memory", identity=IDENTITY, settings=STORAGE)
    assert state.storage is not None
    write = StorageWrite(state.storage.next_id, (BACKING_UP,))
    storage = replace(state.storage, writes=(write,), next_id=write.id + 1)
    state = _page(state, BACKING_UP, host_protect=state.pages[BACKING_UP].host_protect + 1)
    return replace(state, storage=storage)


def stored_wrong_bytes(s: State) -> State:
    state = build_storage(s)
    assert state.storage is not None
    store = dict(state.storage.stored)
    sid = state.storage.sid(BACKING_UP)
    store[sid] = (Key((5,)), Key((5, 7)))
    stores = {**state.storage.stores, "memory": store}
    return replace(state, storage=replace(state.storage, stores=stores))


def prefetch_off_its_anchor(s: State) -> State:
    # The revoked prefetch's page (5, 6, 9, 9) is said to hang from HOST_ONLY.
    state = _prefetch(s, 1, anchor=HOST_ONLY)
    state = _page(state, BACKING_UP, host_protect=1)
    return _page(state, HOST_ONLY, host_protect=1)


def landed_corrupt(s: State) -> State:
    # A corrupt page counted as landed: its slot holds garbage.
    state = build_storage(s)
    kv = dict(state.host_kv)
    kv.pop(8)
    return replace(state, host_kv=kv)


def occupancy_drift(s: State) -> State:
    state = build_storage(s)
    assert state.storage is not None
    return _storage(s, occupied_tokens=state.storage.occupied_tokens + 2)


def detached_with_prefetches(s: State) -> State:
    return _storage(s, backend=None)


def forgotten_host_store(s: State) -> State:
    # The stream from the empty cache, less the host BlockStored of HOST_ONLY: a path
    # that gives a page a host copy and forgets to say so.
    stream = step_events(initial(s.config), s)
    return replace(s, events=tuple(e for e in stream
                                   if e != Event("stored", "host", HOST_ONLY)))


MUTANTS: dict[str, Callable[[State], State]] = {
    "INV-TREE-WELL-FORMED": orphan_page,
    "INV-RESIDENT": nowhere,
    "INV-EVICTED-HAS-HOST": evicted_mid_backup,
    "INV-DEVICE-PREFIX-CLOSED": device_hole,
    "INV-BACKUP-CONTIGUOUS": backup_gap,
    "INV-LOCK-ON-DEVICE": locked_on_host,
    "INV-LOCK-MONOTONE": child_outlocks_parent,
    "INV-ACCOUNTING": counter_drift,
    "INV-DEVICE-POOL-CONSERVATION": lost_device_slot,
    "INV-HOST-POOL-CONSERVATION": host_slot_owned_twice,
    "INV-DEVICE-EVICTABLE-LEAVES": evictable_but_no_leaf,
    "INV-HOST-EVICTABLE-LEAVES": host_leaf_stuck,
    "INV-HOST-PROTECT": protected_without_copy,
    "INV-TRANSFER-PINNED": source_moved,
    "INV-KV-INTEGRITY": wrong_bytes,
    "INV-NAMESPACE-ISOLATION": foreign_namespace,
    "INV-CLOCK-MONOTONE": tick_from_future,
    "INV-HOST-PROTECT-HOLDERS": protected_for_nobody,
    "INV-PREFETCH-SLOT-OWNERSHIP": prefetch_owns_half_a_page,
    "INV-RELEASE-ONCE": released_twice,
    "INV-STORAGE-WRITE-PROTECT": write_unprotected,
    "INV-STORAGE-WRITE-SOURCE": write_from_copy_in_flight,
    "INV-STORAGE-INTEGRITY": stored_wrong_bytes,
    "INV-PREFETCH-CONTIGUOUS": prefetch_off_its_anchor,
    "INV-PREFETCH-INTEGRITY": landed_corrupt,
    "INV-PREFETCH-ACCOUNTING": occupancy_drift,
    "INV-STORAGE-DETACHED-IDLE": detached_with_prefetches,
    "INV-EVENTS-REPLAY": forgotten_host_store,
}
