"""The invariants of spec/13m, 13m.5, one named predicate per spec ID.

As in ``hiradix_model.invariants``: each predicate yields a description of every
violation; ``check`` returns the failing IDs, ``violations`` the descriptions.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping

from hiradix_model.components import Invariants, badly_formed, expected_kv, one_page, partition
from hiradix_model.keys import Key, page_keys, parent_page
from hiradix_model.mamba.state import (
    MambaState,
    owned_full,
    owned_host_full,
    owned_host_states,
    owned_states,
)

_REGISTRY: Invariants[MambaState] = Invariants()
mamba_invariant = _REGISTRY
MAMBA_INVARIANTS = _REGISTRY.predicates


@mamba_invariant("INV-MAMBA-TREE-WELL-FORMED")
def tree_well_formed(state: MambaState) -> Iterator[str]:
    ps = state.config.page_size
    for key, page in state.pages.items():
        if not key.tokens or len(key.tokens) % ps:
            yield f"{key}: length {len(key.tokens)} is not a positive multiple of {ps}"
        parent = parent_page(key, ps)
        if parent is not None and parent not in state.pages:
            yield f"{key}: its parent page {parent} is not cached"
        if not one_page(page.full, ps):
            yield f"{key}: full slots {page.full} are not the {ps} slots of one page in order"


@mamba_invariant("INV-MAMBA-FULL-POOL")
def full_pool(state: MambaState) -> Iterator[str]:
    yield from partition("full", state.config.full_slots, (
        ("free", state.full_free), ("held", state.held_full), ("owned", owned_full(state))))


@mamba_invariant("INV-MAMBA-STATE-POOL")
def state_pool(state: MambaState) -> Iterator[str]:
    yield from partition("state", state.config.state_slots, (
        ("free", state.state_free), ("held", state.held_states),
        ("owned", owned_states(state))))


@mamba_invariant("INV-MAMBA-CONTENT")
def content(state: MambaState) -> Iterator[str]:
    for key, page in state.pages.items():
        yield from _wrong_content(state, key, "", (page.full, state.full_kv),
                                  (page.state, state.state_kv))


def _wrong_content(state: MambaState, key: Key, tier: str,
                   full: tuple[tuple[int, ...], Mapping[int, Key]],
                   held: tuple[int | None, Mapping[int, Key]]) -> Iterator[str]:
    """Each full slot of ``key`` (slots, KV map) not holding its position's KV, and its
    state slot (slot or None, content map) not holding the state after ``key``
    (INV-MAMBA-CONTENT, INV-MAMBA-HOST-CONTENT)."""
    slots, kv = full
    for offset, slot in enumerate(slots):
        want = expected_kv(key, offset, state.config.page_size)
        if kv.get(slot) != want:
            yield f"{key}: {tier}full slot {slot} holds {kv.get(slot)}, not {want}"
    state_slot, contents = held
    if state_slot is not None and contents.get(state_slot) != key:
        yield (f"{key}: {tier}state slot {state_slot} holds the state after "
               f"{contents.get(state_slot)}")


@mamba_invariant("INV-MAMBA-LOCKS")
def locks(state: MambaState) -> Iterator[str]:
    ps = state.config.page_size
    for key, page in state.pages.items():
        if page.lock < 0 or page.state_lock < 0:
            yield f"{key}: negative lock count ({page.lock}, state {page.state_lock})"
        parent = parent_page(key, ps)
        if parent is not None and parent in state.pages and state.pages[parent].lock < page.lock:
            yield f"{key}: locked {page.lock} times, its parent only {state.pages[parent].lock}"
        if page.state_lock > page.lock:
            yield f"{key}: {page.state_lock} state locks but only {page.lock} path locks"


# The host tier (13m.8b). Without host slots these have nothing to check.


@mamba_invariant("INV-MAMBA-HOST-TREE-WELL-FORMED")
def host_tree_well_formed(state: MambaState) -> Iterator[str]:
    for key, page in state.host.items():
        yield from badly_formed(key, state.config.page_size, (("host full", page.full),),
                                (state.pages, state.host), "is on no tier")


@mamba_invariant("INV-MAMBA-HOST-ONLY-WITH-FULL")
def host_only_with_full(state: MambaState) -> Iterator[str]:
    for key, page in state.host.items():
        if not page.full:
            yield f"{key}: a host copy without full host KV (host state {page.state})"


@mamba_invariant("INV-MAMBA-HOST-FULL-POOL")
def host_full_pool(state: MambaState) -> Iterator[str]:
    yield from partition("host full", state.config.host_full_slots, (
        ("free", state.host_full_free), ("owned", owned_host_full(state))))


@mamba_invariant("INV-MAMBA-HOST-POOL")
def host_state_pool(state: MambaState) -> Iterator[str]:
    yield from partition("host state", state.config.host_state_slots, (
        ("free", state.host_state_free), ("owned", owned_host_states(state))))


@mamba_invariant("INV-MAMBA-HOST-CONTENT")
def host_content(state: MambaState) -> Iterator[str]:
    for key, page in state.host.items():
        yield from _wrong_content(state, key, "host ", (page.full, state.host_full_kv),
                                  (page.state, state.host_state_kv))


HOST_INVARIANTS = ("INV-MAMBA-HOST-TREE-WELL-FORMED", "INV-MAMBA-HOST-ONLY-WITH-FULL",
                   "INV-MAMBA-HOST-FULL-POOL", "INV-MAMBA-HOST-POOL", "INV-MAMBA-HOST-CONTENT")
"""The host tier's invariants (13m.8b), what a machine over an engine's host tier judges."""


def check(state: MambaState) -> list[str]:
    """The IDs of the invariants ``state`` violates, in spec order."""
    return _REGISTRY.check(state)


def violations(state: MambaState) -> list[str]:
    """Every violation, prefixed with its ID."""
    return _REGISTRY.violations(state)


def match_problems(state: MambaState, key: Key, page: Key | None,
                   full_hit: int) -> Iterator[str]:
    """INV-MAMBA-MATCH-STATE (13m.5): ``page`` must hold a state, no deeper cached page
    of ``key`` may hold one, and ``full_hit`` must be the longest cached run."""
    if page is not None and (page not in state.pages or state.pages[page].state is None):
        yield f"the match of {key} ends at {page}, which holds no state"
    cached = []
    for deeper in page_keys(key, state.config.page_size):
        if deeper not in state.pages:
            break
        cached.append(deeper)
    depth = 0 if page is None else len(page.tokens)
    for deeper in cached:
        if len(deeper.tokens) > depth and state.pages[deeper].state is not None:
            yield f"the match of {key} ends at {page}, but {deeper} holds a state"
            break
    longest = len(cached) * state.config.page_size
    if full_hit != longest:
        yield f"the match of {key} reports a full hit of {full_hit}, the cache holds {longest}"


MATCH_INVARIANT = "INV-MAMBA-MATCH-STATE"
