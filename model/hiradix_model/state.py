"""The abstract state (spec/02-state.md).

The state does not mirror a radix tree. It is a map from page keys (full prefix plus
namespace) to per-page records, two slot pools, the KV content of every slot, and the
list of copies in flight. Node boundaries of an implementation are invisible here.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from typing import Literal, get_args

from hiradix_model.config import Config
from hiradix_model.keys import Key, content_at, parent_page
from hiradix_model.storage import StorageState

Direction = Literal["d2h", "h2d"]
Tier = Literal["device", "host", "storage"]  # the media of KV events (spec/11)
TIERS: tuple[Tier, ...] = get_args(Tier)
EventKind = Literal["stored", "removed", "cleared"]


@dataclass(frozen=True)
class Page:
    """One cached page. ``device``/``host`` are its slots on each tier, None if absent."""

    device: tuple[int, ...] | None
    host: tuple[int, ...] | None
    lock: int = 0  # locks held on this page or on a page below it
    host_protect: int = 0  # holders that forbid freeing the host copy
    hits: int = 0  # non-chunked inserts past their counted_from that found (or created) it
    last_tick: int = 0  # logical time of the last match or insert that touched it
    insert_tick: int = 0  # logical time the page entered the cache
    priority: int = 0  # the highest priority of the inserts that touched it


@dataclass(frozen=True)
class Transfer:
    """A copy in flight. ``dst`` already belongs to the pages; its bytes are not there yet."""

    direction: Direction  # d2h: backup to host; h2d: load back to device
    pages: tuple[Key, ...]  # root-most first; src/dst are their slots concatenated
    src: tuple[int, ...]
    dst: tuple[int, ...]
    lock: Key  # the root path of this page stays locked until the copy is acknowledged


@dataclass(frozen=True)
class Event:
    """One KV event (spec/11, 11.1); ``page`` is None exactly for ``cleared``."""

    kind: EventKind
    tier: Tier
    page: Key | None = None


@dataclass(frozen=True)
class State:
    """The whole abstract cache. Treat every field as immutable."""

    config: Config
    pages: Mapping[Key, Page]
    device_free: frozenset[int]
    host_free: frozenset[int]
    held: frozenset[int]  # device slots allocated by callers and not owned by any page
    device_kv: Mapping[int, Key]  # whose KV each device slot holds (absent: garbage)
    host_kv: Mapping[int, Key]
    pending: tuple[Transfer, ...]  # issue order; FIFO within a direction
    clock: int  # the latest logical tick an operation was given
    evictable_tokens: int  # kept incrementally, as engines do; INV-ACCOUNTING audits it
    protected_tokens: int
    # The storage tier (spec/09); None: no backend was ever attached, the state of 02.
    storage: StorageState | None = None
    # The KV event stream since the initial state (spec/11); None: no stream is kept,
    # and INV-EVENTS-REPLAY has nothing to check. Operations leave it as it is;
    # ``events.record`` extends it.
    events: tuple[Event, ...] | None = None


def initial(config: Config) -> State:
    """The empty cache: every slot free, nothing cached, nothing in flight."""
    return State(
        config=config,
        pages={},
        device_free=frozenset(range(config.device_slots)),
        host_free=frozenset(range(config.host_slots)),
        held=frozenset(),
        device_kv={},
        host_kv={},
        pending=(),
        clock=0,
        evictable_tokens=0,
        protected_tokens=0,
    )


def expected_content(page: Key, offset: int, page_size: int) -> Key:
    """The KV identity that slot ``offset`` of ``page`` must hold."""
    return content_at(page, len(page.tokens) - page_size + offset)


def parent_of(state: State, page: Key) -> Key | None:
    return parent_page(page, state.config.page_size)


def children_of(state: State, page: Key) -> Iterator[Key]:
    ps = state.config.page_size
    for key in state.pages:
        if parent_page(key, ps) == page:
            yield key


def root_path(state: State, page: Key) -> Iterator[Key]:
    """``page`` and its ancestors, deepest first."""
    cursor: Key | None = page
    while cursor is not None:
        yield cursor
        cursor = parent_of(state, cursor)


def device_evictable_leaves(state: State) -> set[Key]:
    """Unlocked device pages with no child on device (spec: INV-DEVICE-EVICTABLE-LEAVES)."""
    leaves = {k for k, p in state.pages.items() if p.device is not None and p.lock == 0}
    for key, page in state.pages.items():
        parent = parent_of(state, key)
        if page.device is not None and parent in leaves:
            leaves.discard(parent)
    return leaves


def host_evictable_leaves(state: State) -> set[Key]:
    """Host-only, unprotected pages with no children (spec: INV-HOST-EVICTABLE-LEAVES)."""
    leaves = {
        k
        for k, p in state.pages.items()
        if p.device is None and p.host is not None and p.host_protect == 0 and p.lock == 0
    }
    for key in state.pages:
        parent = parent_of(state, key)
        if parent is not None:
            leaves.discard(parent)
    return leaves


def in_flight(state: State, direction: Direction) -> frozenset[int]:
    """Destination slots of pending copies in ``direction``: owned, but not yet valid."""
    return frozenset(s for t in state.pending if t.direction == direction for s in t.dst)


def locks_taken_at(state: State, page: Key) -> int:
    """The ``inc_lock_ref`` calls outstanding at ``page`` (spec/03 3.7): its locks less
    its cached children's and less the copies in flight locked at it."""
    below = sum(state.pages[child].lock for child in children_of(state, page))
    return state.pages[page].lock - below - sum(t.lock == page for t in state.pending)


def transfer_locks(state: State, page: Key) -> int:
    """Locks on ``page`` that pending copies hold (each locks its ``lock`` page's root path)."""
    return sum(page in root_path(state, t.lock) for t in state.pending)


def pending_count(state: State, direction: Direction) -> int:
    """Copies in flight in ``direction``."""
    return sum(t.direction == direction for t in state.pending)


def storage_slots(state: State) -> tuple[list[int], list[int]]:
    """Host slots the storage tier owns: (reserved by prefetches, queued for release)."""
    if state.storage is None:
        return [], []
    reserved = [s for p in state.storage.prefetches for s in p.slots]
    return reserved, list(state.storage.release_queue)


def protect_holders(state: State, page: Key) -> int:
    """What holds ``page``'s host copy (spec/09, INV-HOST-PROTECT-HOLDERS): pending loads
    reading it, unreleased storage writes of it, and ongoing prefetches anchored at it."""
    loads = sum(t.direction == "h2d" and page in t.pages for t in state.pending)
    if state.storage is None:
        return loads
    writes = sum(page in w.pages for w in state.storage.writes)
    anchors = sum(p.anchor == page for p in state.storage.prefetches)
    return loads + writes + anchors


def subtree(state: State, page: Key) -> Iterator[Key]:
    """``page`` and every cached page below it."""
    depth = len(page.tokens)
    for key in state.pages:
        if key.namespace == page.namespace and key.tokens[:depth] == page.tokens:
            yield key


def protected_below(state: State, page: Key) -> bool:
    """Whether a page of ``page``'s subtree is host-protected."""
    return any(state.pages[k].host_protect for k in subtree(state, page))


def only_kept_leaves(state: State) -> bool:
    """Every device-evictable leaf has a protected page below it: a write_back eviction
    that found no host room had to keep them all (spec/09, S-R5). True when DL is empty."""
    return all(protected_below(state, k) for k in device_evictable_leaves(state))


def has_prefetch(state: State, request: str) -> bool:
    """Whether ``request`` has an ongoing prefetch (spec/09)."""
    return state.storage is not None and state.storage.prefetch_of(request) is not None
