"""The state of a (FULL, MAMBA) cache (spec/13m, 13m.2)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass

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
    )


def root_path(state: MambaState, page: Key) -> list[Key]:
    """``page`` and its ancestors, deepest first."""
    return path_to_root(page, state.config.page_size)


def full_leaves(state: MambaState) -> set[Key]:
    """Unlocked cached pages with no cached child: what a full eviction may delete."""
    parents = {parent_page(k, state.config.page_size) for k in state.pages}
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
