"""A mutable working copy of a State, private to one operation.

Operations are pure: each copies the state into a Draft, edits the copy and freezes it.
Every page edit goes through ``set_page`` so the evictable/protected token counters are
kept the way an engine keeps them (incrementally), which is what INV-ACCOUNTING audits.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import replace

from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.keys import Key, parent_page
from hiradix_model.state import Page, State, Transfer


class Draft:
    def __init__(self, state: State) -> None:
        self.config = state.config
        self.ps = state.config.page_size
        self.pages: dict[Key, Page] = dict(state.pages)
        self.device_free: set[int] = set(state.device_free)
        self.host_free: set[int] = set(state.host_free)
        self.held: set[int] = set(state.held)
        self.device_kv: dict[int, Key] = dict(state.device_kv)
        self.host_kv: dict[int, Key] = dict(state.host_kv)
        self.pending: list[Transfer] = list(state.pending)
        self.clock = state.clock
        self.evictable_tokens = state.evictable_tokens
        self.protected_tokens = state.protected_tokens
        # Frozen: storage edits replace it whole (ops/storage/_common.py).
        self.storage = state.storage

    def freeze(self) -> State:
        """The finished state. The draft must not be edited afterwards."""
        return self._state(self.pages)

    def view(self) -> State:
        """A snapshot of the draft so far, for the read-only queries in state.py."""
        return self._state(dict(self.pages))

    def _state(self, pages: dict[Key, Page]) -> State:
        return State(
            config=self.config,
            pages=pages,
            device_free=frozenset(self.device_free),
            host_free=frozenset(self.host_free),
            held=frozenset(self.held),
            device_kv=self.device_kv,
            host_kv=self.host_kv,
            pending=tuple(self.pending),
            clock=self.clock,
            evictable_tokens=self.evictable_tokens,
            protected_tokens=self.protected_tokens,
            storage=self.storage,
        )

    def _count(self, page: Page | None, sign: int) -> None:
        if page is None or page.device is None:
            return
        if page.lock == 0:
            self.evictable_tokens += sign * self.ps
        else:
            self.protected_tokens += sign * self.ps

    def set_page(self, key: Key, page: Page | None) -> None:
        """Replace (or, with None, delete) one page record, keeping the counters."""
        self._count(self.pages.get(key), -1)
        self._count(page, +1)
        if page is None:
            del self.pages[key]
        else:
            self.pages[key] = page

    def page(self, key: Key) -> Page:
        return self.pages[key]

    def parent(self, key: Key) -> Key | None:
        return parent_page(key, self.ps)

    def path(self, key: Key) -> list[Key]:
        """``key`` and its ancestors, deepest first."""
        path: list[Key] = []
        cursor: Key | None = key
        while cursor is not None:
            path.append(cursor)
            cursor = parent_page(cursor, self.ps)
        return path


def require(condition: bool, argument: str, reason: str) -> None:
    """Raise PreconditionError(argument, reason) unless ``condition``."""
    if not condition:
        raise PreconditionError(argument, reason)


def require_slots(slots: Sequence[int], argument: str) -> None:
    require(isinstance(slots, tuple), argument, "must be a tuple of ints")
    require(all(isinstance(s, int) for s in slots), argument, "must hold only ints")
    require(len(set(slots)) == len(slots), argument, "holds a slot twice")


def page_fault(slots: Sequence[int], ps: int) -> tuple[int, str] | None:
    """spec/03, R7 (whole pages): the first position of ``slots`` where cutting it into
    runs of ``ps`` (the last may be shorter) does not give one page's slots in order,
    with the reason; None if every run is one page's first slots, in order."""
    for start in range(0, len(slots), ps):
        first = slots[start]
        if first % ps:
            return start, f"starts a page run at slot {first}, not at a page start"
        for offset, slot in enumerate(slots[start : start + ps]):
            if slot != first + offset:
                return start + offset, (f"is slot {slot}, not {first + offset}: the run from "
                                        f"position {start} is not one page's slots in order")
    return None


def require_whole_pages(slots: tuple[int, ...], ps: int, argument: str, *,
                        full: bool = False) -> None:
    """A caller's slots must be whole pages in order (R7); with ``full`` also a whole
    number of pages (what an allocator hands out and takes back)."""
    if full:
        require(len(slots) % ps == 0, argument, f"{len(slots)} slots are not whole pages of {ps}")
    fault = page_fault(slots, ps)
    if fault is not None:
        raise PreconditionError(f"{argument}[{fault[0]}]", f"{fault[1]} (R7)")


def require_page_set(slots: tuple[int, ...], ps: int, argument: str) -> None:
    """``slots`` are, as a set, whole pages (in any order: the order only says which slot
    gets which position's KV). What an allocator hands out (R7)."""
    taken = set(slots)
    for slot in slots:
        start = slot - slot % ps
        missing = next((s for s in range(start, start + ps) if s not in taken), None)
        require(missing is None, argument,
                f"slot {slot} without slot {missing} of its page: not whole pages (R7)")


def choose_whole_pages(slots: tuple[int, ...], ps: int, what: str) -> None:
    """A reported choice of slots must be whole pages in order (R7): allocators hand out
    pages, and the tree's copies and frees work on pages."""
    fault = page_fault(slots, ps)
    if fault is not None:
        raise IllegalChoice(f"{what}[{fault[0]}]: {fault[1]} (R7)")


def require_tick(draft: Draft, now: int) -> None:
    require(isinstance(now, int), "now", "must be an int")
    require(now >= draft.clock, "now", f"logical clock went backwards ({now} < {draft.clock})")


def require_key(key: Key, argument: str = "key") -> None:
    require(isinstance(key, Key), argument, "must be a Key")
    require(isinstance(key.tokens, tuple), argument, "tokens must be a tuple of ints")
    require(all(isinstance(t, int) for t in key.tokens), argument, "tokens must be ints")


def add_lock(draft: Draft, key: Key, delta: int) -> int:
    """Add ``delta`` to the lock count of ``key``'s root path; return the evictable change."""
    before = draft.evictable_tokens
    for k in draft.path(key):
        old = draft.page(k)
        draft.set_page(k, replace(old, lock=old.lock + delta))
    return draft.evictable_tokens - before


def take(pool: set[int], slots: Iterable[int]) -> None:
    for s in slots:
        pool.remove(s)
