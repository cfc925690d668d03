"""The invariants of spec/05-invariants.md, one named predicate per spec ID.

Each predicate yields a description of every violation it finds (nothing when the
invariant holds). ``check(state)`` returns the IDs that fail; ``violations(state)`` the
descriptions, for error messages.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

from hiradix_model.events import replay, residency_problems
from hiradix_model.keys import Key, parent_page
from hiradix_model.state import (
    State,
    device_evictable_leaves,
    expected_content,
    host_evictable_leaves,
    in_flight,
    protect_holders,
    storage_slots,
    transfer_locks,
)
from hiradix_model.storage import Prefetch

Predicate = Callable[[State], Iterator[str]]
INVARIANTS: dict[str, Predicate] = {}


def invariant(spec_id: str) -> Callable[[Predicate], Predicate]:
    def register(predicate: Predicate) -> Predicate:
        assert spec_id not in INVARIANTS, spec_id
        INVARIANTS[spec_id] = predicate
        predicate.spec_id = spec_id  # type: ignore[attr-defined]
        return predicate

    return register


def _parent(state: State, page: Key) -> Key | None:
    return parent_page(page, state.config.page_size)


@invariant("INV-TREE-WELL-FORMED")
def tree_well_formed(state: State) -> Iterator[str]:
    ps = state.config.page_size
    for key, page in state.pages.items():
        if not key.tokens or len(key.tokens) % ps:
            yield f"{key}: length {len(key.tokens)} is not a positive multiple of {ps}"
        parent = _parent(state, key)
        if parent is not None and parent not in state.pages:
            yield f"{key}: its parent page {parent} is not cached"
        for tier, slots in (("device", page.device), ("host", page.host)):
            if slots is not None and (len(slots) != ps or len(set(slots)) != ps):
                yield f"{key}: {tier} slots {slots} are not {ps} distinct slots"
            elif slots is not None and (slots[0] % ps or any(
                    s != slots[0] + offset for offset, s in enumerate(slots))):
                yield f"{key}: {tier} slots {slots} are not one page's slots in order (R7)"


@invariant("INV-RESIDENT")
def resident(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        if page.device is None and page.host is None:
            yield f"{key}: cached but on neither tier"


@invariant("INV-EVICTED-HAS-HOST")
def evicted_has_host(state: State) -> Iterator[str]:
    arriving = in_flight(state, "d2h")
    for key, page in state.pages.items():
        if page.device is None and page.host is not None and set(page.host) & arriving:
            yield f"{key}: evicted from device while its host copy is still in flight"


@invariant("INV-DEVICE-PREFIX-CLOSED")
def device_prefix_closed(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        parent = _parent(state, key)
        above = state.pages.get(parent) if parent is not None else None
        if page.device is not None and above is not None and above.device is None:
            yield f"{key}: on device but its parent {parent} is not"


@invariant("INV-BACKUP-CONTIGUOUS")
def backup_contiguous(state: State) -> Iterator[str]:
    if state.config.write_policy == "write_back":
        return
    for key, page in state.pages.items():
        parent = _parent(state, key)
        above = state.pages.get(parent) if parent is not None else None
        if page.host is not None and above is not None and above.host is None:
            yield f"{key}: backed up but its parent {parent} is not"


@invariant("INV-LOCK-ON-DEVICE")
def lock_on_device(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        if page.lock > 0 and page.device is None:
            yield f"{key}: locked ({page.lock}) but not on device"


@invariant("INV-LOCK-MONOTONE")
def lock_monotone(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        if page.lock < 0 or page.host_protect < 0:
            yield f"{key}: negative count (lock {page.lock}, host_protect {page.host_protect})"
        parent = _parent(state, key)
        if parent is not None and parent in state.pages and state.pages[parent].lock < page.lock:
            yield f"{key}: lock {page.lock} exceeds its parent's {state.pages[parent].lock}"


@invariant("INV-ACCOUNTING")
def accounting(state: State) -> Iterator[str]:
    ps = state.config.page_size
    on_device = [p for p in state.pages.values() if p.device is not None]
    unlocked = ps * sum(p.lock == 0 for p in on_device)
    locked = ps * sum(p.lock > 0 for p in on_device)
    if state.evictable_tokens != unlocked:
        yield f"evictable_tokens is {state.evictable_tokens}, unlocked device tokens {unlocked}"
    if state.protected_tokens != locked:
        yield f"protected_tokens is {state.protected_tokens}, locked device tokens {locked}"


def _conservation(
    capacity: int, parts: dict[str, list[int]]
) -> Iterator[str]:
    counts = Counter(s for slots in parts.values() for s in slots)
    for slot, n in sorted(counts.items()):
        if n > 1:
            owners = [name for name, slots in parts.items() if slot in slots]
            yield f"slot {slot} is owned {n} times ({', '.join(owners)})"
    missing = set(range(capacity)) - counts.keys()
    if missing:
        yield f"slots {sorted(missing)} are owned by nobody"
    foreign = counts.keys() - set(range(capacity))
    if foreign:
        yield f"slots {sorted(foreign)} are outside the pool"


@invariant("INV-DEVICE-POOL-CONSERVATION")
def device_pool_conservation(state: State) -> Iterator[str]:
    arriving = in_flight(state, "h2d")
    owned = [s for p in state.pages.values() for s in p.device or ()]
    yield from _conservation(state.config.device_slots, {
        "free": list(state.device_free),
        "tree": [s for s in owned if s not in arriving],
        "in flight": [s for s in owned if s in arriving],
        "held by callers": list(state.held),
    })


@invariant("INV-HOST-POOL-CONSERVATION")
def host_pool_conservation(state: State) -> Iterator[str]:
    arriving = in_flight(state, "d2h")
    owned = [s for p in state.pages.values() for s in p.host or ()]
    reserved, releasing = storage_slots(state)  # both empty without storage (spec/09)
    yield from _conservation(state.config.host_slots, {
        "free": list(state.host_free),
        "tree": [s for s in owned if s not in arriving],
        "in flight": [s for s in owned if s in arriving],
        "reserved by a prefetch": reserved,
        "queued for release": releasing,
    })


@invariant("INV-DEVICE-EVICTABLE-LEAVES")
def device_evictable_leaves_exist(state: State) -> Iterator[str]:
    if state.evictable_tokens > 0 and not device_evictable_leaves(state):
        yield f"{state.evictable_tokens} tokens counted evictable but no device leaf is"


@invariant("INV-HOST-EVICTABLE-LEAVES")
def host_evictable_leaves_exist(state: State) -> Iterator[str]:
    leaves = host_evictable_leaves(state)
    below: dict[Key, set[Key]] = {k: set() for k in state.pages}
    for key in state.pages:
        cursor = _parent(state, key)
        while cursor is not None and cursor in below:
            below[cursor].add(key)
            cursor = _parent(state, cursor)
    for key, page in state.pages.items():
        if page.device is not None or page.host is None:
            continue
        subtree = below[key] | {key}
        if any(state.pages[k].host_protect for k in subtree):
            continue
        if not subtree & leaves:
            yield f"{key}: host-only and unprotected, but no host leaf below it is evictable"


@invariant("INV-HOST-PROTECT")
def host_protect(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        if page.host_protect > 0 and page.host is None:
            yield f"{key}: host-protected without a host copy"
        if page.host_protect > 0 and page.host is not None and set(page.host) & state.host_free:
            yield f"{key}: host-protected copy's slots are on the free list"


@invariant("INV-TRANSFER-PINNED")
def transfer_pinned(state: State) -> Iterator[str]:
    for t in state.pending:
        records = [state.pages.get(k) for k in t.pages]
        if any(r is None for r in records):
            yield f"{t.direction} copy of {t.pages}: a page is no longer cached"
            continue
        device = tuple(s for r in records if r is not None for s in r.device or ())
        host = tuple(s for r in records if r is not None for s in r.host or ())
        src, dst = (device, host) if t.direction == "d2h" else (host, device)
        if (t.src, t.dst) != (src, dst):
            yield f"{t.direction} copy of {t.pages}: slots moved while in flight"
        if t.direction == "h2d" and any(r is not None and r.host_protect < 1 for r in records):
            yield f"h2d copy of {t.pages}: a source host copy is not protected"
    for key, page in state.pages.items():
        if page.lock < transfer_locks(state, key):
            yield f"{key}: lock {page.lock} is below the locks its copies in flight hold"


def _integrity(state: State, check_namespace_only: bool) -> Iterator[str]:
    ps = state.config.page_size
    for tier, kv, arriving in (
        ("device", state.device_kv, in_flight(state, "h2d")),
        ("host", state.host_kv, in_flight(state, "d2h")),
    ):
        for key, page in state.pages.items():
            slots = page.device if tier == "device" else page.host
            for offset, slot in enumerate(slots or ()):
                if slot in arriving:
                    continue
                have = kv.get(slot)
                if check_namespace_only:
                    if have is not None and have.namespace != key.namespace:
                        yield f"{key}: {tier} slot {slot} holds KV of namespace {have.namespace!r}"
                elif have != expected_content(key, offset, ps):
                    yield f"{key}: {tier} slot {slot} holds {have}, not its KV"


@invariant("INV-KV-INTEGRITY")
def kv_integrity(state: State) -> Iterator[str]:
    yield from _integrity(state, check_namespace_only=False)


@invariant("INV-NAMESPACE-ISOLATION")
def namespace_isolation(state: State) -> Iterator[str]:
    yield from _integrity(state, check_namespace_only=True)


@invariant("INV-CLOCK-MONOTONE")
def clock_monotone(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        if not page.insert_tick <= page.last_tick <= state.clock:
            yield (f"{key}: ticks out of order (inserted {page.insert_tick}, last "
                   f"{page.last_tick}, clock {state.clock})")


@invariant("INV-HOST-PROTECT-HOLDERS")
def host_protect_holders(state: State) -> Iterator[str]:
    for key, page in state.pages.items():
        holders = protect_holders(state, key)
        if page.host_protect != holders:
            yield f"{key}: host_protect is {page.host_protect}, but {holders} holders hold it"


# -- The storage tier (spec/05, "Storage tier"; spec/09) ----------------------------------
# Each predicate checks nothing when the state has no storage.


def _prefetches(state: State) -> tuple[Prefetch, ...]:
    return () if state.storage is None else state.storage.prefetches


def _owned_pages(prefetch: Prefetch, ps: int) -> int | None:
    """How many leading pages a prefetch in its phase must own slots for (None: any)."""
    if prefetch.phase == "querying":
        return len(prefetch.pages)
    if prefetch.phase in ("fetching", "dead"):
        return prefetch.hit_pages
    if prefetch.phase == "stopped":
        return prefetch.landed
    return 0  # revoked


@invariant("INV-PREFETCH-SLOT-OWNERSHIP")
def prefetch_slot_ownership(state: State) -> Iterator[str]:
    ps = state.config.page_size
    elsewhere = Counter(s for p in state.pages.values() for s in p.host or ())
    elsewhere.update(state.host_free)
    if state.storage is not None:
        elsewhere.update(state.storage.release_queue)
    mine = Counter(s for p in _prefetches(state) for s in p.slots)
    for prefetch in _prefetches(state):
        name = f"prefetch {prefetch.id} ({prefetch.request!r})"
        if len(prefetch.reserved) != ps * len(prefetch.pages):
            yield f"{name}: reserved {len(prefetch.reserved)} slots for {len(prefetch.pages)} pages"
        if prefetch.slots != prefetch.reserved[: len(prefetch.slots)] or len(prefetch.slots) % ps:
            yield f"{name}: owns {prefetch.slots}, not whole pages leading its reservation"
        owned = len(prefetch.slots) // ps
        if owned != _owned_pages(prefetch, ps) or not prefetch.landed <= owned:
            yield f"{name}: owns {owned} pages in phase {prefetch.phase} (landed {prefetch.landed})"
        for slot in prefetch.slots:
            if elsewhere[slot] or mine[slot] > 1:
                yield f"{name}: its slot {slot} is owned elsewhere too"


@invariant("INV-RELEASE-ONCE")
def release_once(state: State) -> Iterator[str]:
    if state.storage is None:
        return
    storage = state.storage
    for (prefetch_id, slot), n in Counter(storage.release_log).items():
        if n > 1:
            yield f"prefetch {prefetch_id} released slot {slot} {n} times"
        if prefetch_id >= storage.next_id:
            yield f"slot {slot} released by prefetch {prefetch_id}, which was never issued"
    for prefetch in storage.prefetches:
        released = {s for i, s in storage.release_log if i == prefetch.id}
        if released & set(prefetch.slots):
            twice = sorted(released & set(prefetch.slots))
            yield f"prefetch {prefetch.id} still owns slots it released: {twice}"
        if released | set(prefetch.slots) != set(prefetch.reserved):
            yield f"prefetch {prefetch.id}: reserved slots neither owned nor released once"
    for slot, n in Counter(storage.release_queue).items():
        if n > 1 or slot in state.host_free:
            yield f"slot {slot} is queued for release {n} times (free: {slot in state.host_free})"


@invariant("INV-STORAGE-WRITE-PROTECT")
def storage_write_protect(state: State) -> Iterator[str]:
    if state.storage is None:
        return
    reserved, releasing = storage_slots(state)
    unsafe = state.host_free | set(reserved) | set(releasing)
    for write in state.storage.writes:
        if not write.pages or not 0 <= write.done <= len(write.pages):
            yield f"write {write.id}: {write.done} of {len(write.pages)} pages done"
        for key in write.pages:
            page = state.pages.get(key)
            if page is None or page.host is None:
                yield f"write {write.id}: {key} is being written but has no host copy"
            elif page.host_protect < 1:
                yield f"write {write.id}: {key} is being written but not host-protected"
            elif set(page.host) & unsafe:
                yield f"write {write.id}: {key}'s host slots are free or owned by storage"


@invariant("INV-STORAGE-WRITE-SOURCE")
def storage_write_source(state: State) -> Iterator[str]:
    if state.storage is None:
        return
    arriving = in_flight(state, "d2h")
    for write in state.storage.writes:
        if write.phase == "acked":
            continue
        for key in write.pages[write.done:]:
            page = state.pages.get(key)
            if page is not None and page.host is not None and set(page.host) & arriving:
                yield (f"write {write.id}: {key} is to be written from a host copy whose "
                       "d2h copy is still in flight")


@invariant("INV-STORAGE-INTEGRITY")
def storage_integrity(state: State) -> Iterator[str]:
    if state.storage is None:
        return
    ps = state.config.page_size
    for backend, store in state.storage.stores.items():
        for sid, content in store.items():
            tokens = sid.page.tokens
            if not tokens or len(tokens) % ps:
                yield f"{backend}: stored {sid.page} is not a whole page"
                continue
            expected = tuple(expected_content(sid.page, o, ps) for o in range(ps))
            if content != expected:
                yield f"{backend}: {sid.page} holds {content}, not its KV"


@invariant("INV-PREFETCH-CONTIGUOUS")
def prefetch_contiguous(state: State) -> Iterator[str]:
    for prefetch in _prefetches(state):
        name = f"prefetch {prefetch.id}"
        above = prefetch.anchor
        if above is not None and (above not in state.pages or state.pages[above].host is None):
            yield f"{name}: its anchor {above} is not cached with a host copy"
        if not prefetch.pages:
            yield f"{name}: has no pages"
        for page in prefetch.pages:
            if _parent(state, page) != above:
                yield f"{name}: {page} does not hang from {above}"
            above = page


@invariant("INV-PREFETCH-INTEGRITY")
def prefetch_integrity(state: State) -> Iterator[str]:
    ps = state.config.page_size
    for prefetch in _prefetches(state):
        for index, page in enumerate(prefetch.pages[: prefetch.landed]):
            for offset, slot in enumerate(prefetch.slots[index * ps:(index + 1) * ps]):
                have = state.host_kv.get(slot)
                if have != expected_content(page, offset, ps):
                    yield f"prefetch {prefetch.id}: landed {page} slot {slot} holds {have}"


@invariant("INV-PREFETCH-ACCOUNTING")
def prefetch_accounting(state: State) -> Iterator[str]:
    if state.storage is None:
        return
    storage = state.storage
    counted = sum(len(p.reserved) for p in storage.prefetches)
    if storage.occupied_tokens != counted:
        yield f"occupied_tokens is {storage.occupied_tokens}, ongoing prefetches hold {counted}"
    for request, n in Counter(p.request for p in storage.prefetches).items():
        if n > 1:
            yield f"request {request!r} has {n} ongoing prefetches"
    ids = [p.id for p in storage.prefetches] + [w.id for w in storage.writes]
    if len(set(ids)) != len(ids) or any(i >= storage.next_id for i in ids):
        yield f"prefetch and write ids {ids} are not distinct and below {storage.next_id}"


@invariant("INV-STORAGE-DETACHED-IDLE")
def storage_detached_idle(state: State) -> Iterator[str]:
    storage = state.storage
    if storage is None or storage.backend is not None:
        return
    busy = {"prefetches": len(storage.prefetches), "writes": len(storage.writes),
            "revokes queued": len(storage.revoke_queue),
            "slots queued for release": len(storage.release_queue),
            "occupied tokens": storage.occupied_tokens}
    for what, n in busy.items():
        if n:
            yield f"detached, but {n} {what} remain"


# -- KV events (spec/05 5.10; spec/11) ----------------------------------------------------


@invariant("INV-EVENTS-REPLAY")
def events_replay(state: State) -> Iterator[str]:
    if state.events is None:
        return
    resident, problems = replay(state.events)
    yield from problems
    yield from residency_problems(state, resident)


def violations(state: State) -> dict[str, list[str]]:
    """Every failing invariant ID with the descriptions of its violations."""
    found = {spec_id: list(predicate(state)) for spec_id, predicate in INVARIANTS.items()}
    return {spec_id: problems for spec_id, problems in found.items() if problems}


def check(state: State) -> tuple[str, ...]:
    """The IDs of the invariants that ``state`` violates; empty when all hold."""
    return tuple(spec_id for spec_id, predicate in INVARIANTS.items() if any(predicate(state)))
