"""The state of a (FULL, SWA) hybrid cache (spec/13, 13.2)."""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from dataclasses import dataclass, field

from hiradix_model.components import locks_taken_at, path_to_root
from hiradix_model.hybrid.config import SwaConfig
from hiradix_model.keys import Key, parent_page


@dataclass(frozen=True)
class SwaPage:
    """One cached page: its full slots, its SWA slots (None: a tombstone), its locks."""

    full: tuple[int, ...]
    swa: tuple[int, ...] | None
    lock: int = 0  # path locks held on this page or a page below it
    swa_lock: int = 0  # locks whose window covers this page

    @property
    def live(self) -> bool:
        return self.swa is not None


@dataclass(frozen=True)
class SwaHostPage:
    """One page's host copies (13.8a): its full host slots, its SWA host slots (None: a
    host tombstone). Host copies hold no locks: the model's load back is atomic."""

    full: tuple[int, ...]
    swa: tuple[int, ...] | None


@dataclass(frozen=True)
class SwaState:
    """The whole abstract hybrid cache. Treat every field as immutable."""

    config: SwaConfig
    pages: Mapping[Key, SwaPage]
    full_free: frozenset[int]
    swa_free: frozenset[int]
    held: Mapping[int, int | None]  # caller-held pairs: full slot -> its SWA half or None
    full_kv: Mapping[int, Key]  # whose KV each full slot holds (absent: garbage)
    swa_kv: Mapping[int, Key]
    # locks taken at a page whose SWA part was released early (absent: none), 13.2
    released: Mapping[Key, int] = field(default_factory=dict)
    # The host tier (13.8a); empty without host slots, so a device-only cache is as before.
    host: Mapping[Key, SwaHostPage] = field(default_factory=dict)
    host_full_free: frozenset[int] = frozenset()
    host_swa_free: frozenset[int] = frozenset()
    host_full_kv: Mapping[int, Key] = field(default_factory=dict)
    host_swa_kv: Mapping[int, Key] = field(default_factory=dict)


def initial(config: SwaConfig) -> SwaState:
    """The empty cache: every slot of both pools free, nothing cached or held."""
    return SwaState(
        config=config,
        pages={},
        full_free=frozenset(range(config.full_slots)),
        swa_free=frozenset(range(config.swa_slots)),
        held={},
        full_kv={},
        swa_kv={},
        host_full_free=frozenset(range(config.host_full_slots)),
        host_swa_free=frozenset(range(config.host_swa_slots)),
    )


def root_path(state: SwaState, page: Key) -> list[Key]:
    """``page`` and its ancestors, deepest first."""
    return path_to_root(page, state.config.page_size)


def taken(state: SwaState, page: Key) -> int:
    """The locks taken at ``page``: its lock count less its cached children's (13.2)."""
    return locks_taken_at(state.pages, page, state.config.page_size)


def window(state: SwaState, page: Key) -> list[Key]:
    """The pages covering the last W tokens of ``page``'s path, deepest first (13.2)."""
    return root_path(state, page)[: state.config.window_pages]


def window_live(state: SwaState, page: Key) -> bool:
    """Whether every page of ``page``'s window is cached and live."""
    return all(k in state.pages and state.pages[k].live for k in window(state, page))


def full_leaves(state: SwaState) -> set[Key]:
    """Unlocked cached pages with no cached child: what a full eviction may delete.
    With a host tier, not a page whose host-only child would lose its parent (13.8a)."""
    parents = {parent_page(k, state.config.page_size) for k in state.pages}
    parents |= {parent_page(k, state.config.page_size) for k in host_only(state)} - set(state.host)
    return {k for k, p in state.pages.items() if p.lock == 0 and k not in parents}


def host_only(state: SwaState) -> set[Key]:
    """Pages with a host copy and no device copy (13.8a)."""
    return set(state.host) - set(state.pages)


def swa_somewhere(state: SwaState, page: Key) -> bool:
    """Whether ``page`` has SWA KV on the device or on the host (13.8a)."""
    device, host = state.pages.get(page), state.host.get(page)
    return (device is not None and device.live) or (host is not None and host.swa is not None)


def window_somewhere(state: SwaState, page: Key) -> bool:
    """Whether every page of ``page``'s window has SWA KV on some tier (13.8a)."""
    return all(swa_somewhere(state, k) for k in window(state, page))


def swa_candidates(state: SwaState) -> set[Key]:
    """Live pages with no SWA lock: what an SWA eviction may take."""
    return {k for k, p in state.pages.items() if p.live and p.swa_lock == 0}


def owned_full(state: SwaState) -> Iterator[int]:
    for page in state.pages.values():
        yield from page.full


def owned_swa(state: SwaState) -> Iterator[int]:
    for page in state.pages.values():
        yield from page.swa or ()
