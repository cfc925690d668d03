"""The invariants of spec/13, 13.5, one named predicate per spec ID.

As in ``hiradix_model.invariants``: each predicate yields a description of every
violation; ``check`` returns the failing IDs, ``violations`` the descriptions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from hiradix_model.components import Invariants, badly_formed, expected_kv, partition
from hiradix_model.hybrid.state import (
    SwaState,
    owned_full,
    owned_swa,
    window,
    window_live,
)
from hiradix_model.keys import Key, page_keys, parent_page

_REGISTRY: Invariants[SwaState] = Invariants()
swa_invariant = _REGISTRY
SWA_INVARIANTS = _REGISTRY.predicates


@swa_invariant("INV-SWA-TREE-WELL-FORMED")
def tree_well_formed(state: SwaState) -> Iterator[str]:
    for key, page in state.pages.items():
        yield from badly_formed(key, state.config.page_size,
                                (("full", page.full), ("swa", page.swa)),
                                (state.pages,), "is not cached")


@swa_invariant("INV-SWA-ONLY-WITH-FULL")
def only_with_full(state: SwaState) -> Iterator[str]:
    for key, page in state.pages.items():
        if not page.full:
            yield f"{key}: cached without full KV (swa {page.swa})"


@swa_invariant("INV-SWA-FULL-POOL")
def full_pool(state: SwaState) -> Iterator[str]:
    yield from partition("full", state.config.full_slots, (
        ("free", state.full_free), ("held", state.held), ("owned", owned_full(state))))


@swa_invariant("INV-SWA-SWA-POOL")
def swa_pool(state: SwaState) -> Iterator[str]:
    halves = (s for s in state.held.values() if s is not None)
    yield from partition("swa", state.config.swa_slots, (
        ("free", state.swa_free), ("held", halves), ("owned", owned_swa(state))))


@swa_invariant("INV-SWA-CONTENT")
def content(state: SwaState) -> Iterator[str]:
    for key, page in state.pages.items():
        yield from _wrong_kv(state, key, (("full", page.full, state.full_kv),
                                          ("swa", page.swa, state.swa_kv)))


Copy = tuple[str, "tuple[int, ...] | None", Mapping[int, Key]]


def _wrong_kv(state: SwaState, key: Key, copies: tuple[Copy, ...]) -> Iterator[str]:
    """Each slot of each (pool, slots, KV map) copy of ``key`` that does not hold its KV."""
    for pool, slots, kv in copies:
        for offset, slot in enumerate(slots or ()):
            want = expected_kv(key, offset, state.config.page_size)
            if kv.get(slot) != want:
                yield f"{key}: {pool} slot {slot} holds {kv.get(slot)}, not {want}"


@swa_invariant("INV-SWA-LOCKS")
def locks(state: SwaState) -> Iterator[str]:
    ps = state.config.page_size
    for key, page in state.pages.items():
        if page.lock < 0 or page.swa_lock < 0:
            yield f"{key}: negative lock count ({page.lock}, swa {page.swa_lock})"
        parent = parent_page(key, ps)
        if parent is not None and parent in state.pages and state.pages[parent].lock < page.lock:
            yield f"{key}: locked {page.lock} times, its parent only {state.pages[parent].lock}"
        if page.swa_lock > 0 and not page.live:
            yield f"{key}: a tombstone inside a locked window (swa_lock {page.swa_lock})"


@swa_invariant("INV-SWA-WINDOW-COUNT")
def window_count(state: SwaState) -> Iterator[str]:
    ps = state.config.page_size
    below: dict[Key, int] = {}
    for key, page in state.pages.items():
        parent = parent_page(key, ps)
        if parent is not None:
            below[parent] = below.get(parent, 0) + page.lock
    holding: dict[Key, int] = {key: 0 for key in state.pages}
    for key, page in state.pages.items():
        taken_here, released = page.lock - below.get(key, 0), state.released.get(key, 0)
        if not 0 <= released <= taken_here:
            yield f"{key}: {released} locks released their window, {taken_here} taken"
        for covered in window(state, key):
            if covered in holding:
                holding[covered] += taken_here - released
    for key in state.released:
        if key not in state.pages:
            yield f"{key}: released locks counted at a page not cached"
    for key, page in state.pages.items():
        if page.swa_lock != holding[key]:
            yield (f"{key}: swa_lock {page.swa_lock}, but {holding[key]} locks hold a "
                   "window covering it")


# The host tier (13.8a). Without host slots these have nothing to check.


@swa_invariant("INV-SWA-HOST-TREE-WELL-FORMED")
def host_tree_well_formed(state: SwaState) -> Iterator[str]:
    for key, page in state.host.items():
        yield from badly_formed(key, state.config.page_size,
                                (("host full", page.full), ("host swa", page.swa)),
                                (state.pages, state.host), "is on no tier")


@swa_invariant("INV-SWA-HOST-ONLY-WITH-FULL")
def host_only_with_full(state: SwaState) -> Iterator[str]:
    for key, page in state.host.items():
        if not page.full:
            yield f"{key}: a host copy without full host KV (host swa {page.swa})"


@swa_invariant("INV-SWA-HOST-FULL-POOL")
def host_full_pool(state: SwaState) -> Iterator[str]:
    owned = (s for page in state.host.values() for s in page.full)
    yield from partition("host full", state.config.host_full_slots, (
        ("free", state.host_full_free), ("owned", owned)))


@swa_invariant("INV-SWA-HOST-POOL")
def host_swa_pool(state: SwaState) -> Iterator[str]:
    owned = (s for page in state.host.values() for s in page.swa or ())
    yield from partition("host swa", state.config.host_swa_slots, (
        ("free", state.host_swa_free), ("owned", owned)))


@swa_invariant("INV-SWA-HOST-CONTENT")
def host_content(state: SwaState) -> Iterator[str]:
    for key, page in state.host.items():
        yield from _wrong_kv(state, key, (("host full", page.full, state.host_full_kv),
                                          ("host swa", page.swa, state.host_swa_kv)))


HOST_INVARIANTS = ("INV-SWA-HOST-TREE-WELL-FORMED", "INV-SWA-HOST-ONLY-WITH-FULL",
                   "INV-SWA-HOST-FULL-POOL", "INV-SWA-HOST-POOL", "INV-SWA-HOST-CONTENT")
"""The host tier's invariants (13.8a), what a machine over an engine's host tier judges."""


def check(state: SwaState) -> list[str]:
    """The IDs of the invariants ``state`` violates, in spec order."""
    return _REGISTRY.check(state)


def violations(state: SwaState) -> list[str]:
    """Every violation, prefixed with its ID."""
    return _REGISTRY.violations(state)


def match_problems(state: SwaState, key: Key, page: Key | None) -> Iterator[str]:
    """INV-SWA-MATCH-LIVE (13.5): what is wrong with ``page`` as the end of a match of
    ``key``: its window must be live, and no deeper cached page of the key may have one."""
    if page is not None and not window_live(state, page):
        yield f"the match of {key} ends at {page}, whose window is not live"
    depth = 0 if page is None else len(page.tokens)
    for deeper in page_keys(key, state.config.page_size):
        if deeper not in state.pages:
            break
        if len(deeper.tokens) > depth and window_live(state, deeper):
            yield f"the match of {key} ends at {page}, but {deeper} is cached with a live window"
            break


MATCH_INVARIANT = "INV-SWA-MATCH-LIVE"
