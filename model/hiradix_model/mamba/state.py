"""The state of a (FULL, MAMBA) cache (spec/13m, 13m.2)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hiradix_model.components import path_to_root
from hiradix_model.keys import Key, parent_page
from hiradix_model.mamba.config import MambaConfig


@dataclass(frozen=True)
class MambaPage:
    """One cached page: its full slots, the state slot after its path (or None), locks."""

    full: tuple[int, ...]
    state: int | None = None
    lock: int = 0  # path locks held on this page or a page below it
    state_lock: int = 0  # locks taken on this page's state


@dataclass(frozen=True)
class MambaHostPage:
    """One page's host copies (13m.8b): its P host full slots, and the host state slot
    holding the state after its root path, or None. Host copies hold no locks: the
    model's load back is atomic."""

    full: tuple[int, ...]
    state: int | None = None


@dataclass(frozen=True)
class MambaState:
    """The whole abstract (FULL, MAMBA) cache. Treat every field as immutable."""

    config: MambaConfig
    pages: Mapping[Key, MambaPage]
    full_free: frozenset[int]
    state_free: frozenset[int]
    held_full: frozenset[int]  # full slots a caller holds, owned by no page
    held_states: frozenset[int]  # state slots a caller holds, owned by no page
    full_kv: Mapping[int, Key]  # whose KV each full slot holds (absent: garbage)
    state_kv: Mapping[int, Key]  # the prefix whose state each state slot holds
    # The host tier (13m.8b); empty without host slots, so a device-only cache is as before.
    host: Mapping[Key, MambaHostPage] = field(default_factory=dict)
    host_full_free: frozenset[int] = frozenset()
    host_state_free: frozenset[int] = frozenset()
    host_full_kv: Mapping[int, Key] = field(default_factory=dict)  # host full slot -> KV
    host_state_kv: Mapping[int, Key] = field(default_factory=dict)  # host state slot -> prefix


def initial(config: MambaConfig) -> MambaState:
    """The empty cache: every slot of both pools free, nothing cached or held."""
    return MambaState(
        config=config,
        pages={},
        full_free=frozenset(range(config.full_slots)),
        state_free=frozenset(range(config.state_slots)),
        held_full=frozenset(),
        held_states=frozenset(),
        full_kv={},
        state_kv={},
        host_full_free=frozenset(range(config.host_full_slots)),
        host_state_free=frozenset(range(config.host_state_slots)),
    )


def root_path(state: MambaState, page: Key) -> list[Key]:
    """``page`` and its ancestors, deepest first."""
    return path_to_root(page, state.config.page_size)


def full_leaves(state: MambaState) -> set[Key]:
    """Unlocked cached pages with no cached child: what a full eviction may delete. A
    page without a host copy whose host-only child needs it as a parent is none
    (13m.8b: deleting it would orphan the child's host copy)."""
    parents = {parent_page(k, state.config.page_size) for k in state.pages}
    parents |= {parent_page(k, state.config.page_size) for k in host_only(state)} - set(state.host)
    return {k for k, p in state.pages.items()
            if p.lock == 0 and p.state_lock == 0 and k not in parents}


def state_candidates(state: MambaState) -> set[Key]:
    """Pages holding a state with no state lock: what a state eviction may take."""
    return {k for k, p in state.pages.items() if p.state is not None and p.state_lock == 0}


def owned_full(state: MambaState) -> Iterator[int]:
    for page in state.pages.values():
        yield from page.full


def owned_states(state: MambaState) -> Iterator[int]:
    for page in state.pages.values():
        if page.state is not None:
            yield page.state


def host_only(state: MambaState) -> set[Key]:
    """Pages with a host copy and no device copy (13m.8b)."""
    return set(state.host) - set(state.pages)


def state_somewhere(state: MambaState, page: Key) -> bool:
    """Whether the state after ``page`` is cached on the device or on the host (13m.8b)."""
    device, host = state.pages.get(page), state.host.get(page)
    return (device is not None and device.state is not None) or \
        (host is not None and host.state is not None)


def owned_host_full(state: MambaState) -> Iterator[int]:
    for page in state.host.values():
        yield from page.full


def owned_host_states(state: MambaState) -> Iterator[int]:
    for page in state.host.values():
        if page.state is not None:
            yield page.state
