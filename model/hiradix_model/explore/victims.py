"""Every legal victim sequence of an eviction, up to what its outcome can tell apart
(spec/14-exploration.md, 14.3; the rules are spec/03's, in ``ops/_victims.py``).

A sequence is built one victim at a time: each victim an evictable leaf of minimal rank
(every tie is tried), stopping once the target is met or no leaf is left, or going on
with the previous victim's parent (whole-node eviction finishes a chain). Each step is
applied with the model's own operation (a one-victim ``evict``/``evict_host``); the
caller then applies the whole sequence once more, so the model judges it. Branches that
reach the same canonical state with the same last victim and count are merged, since
their continuations are the same.
"""

from __future__ import annotations

from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from hiradix_model.explore.canonical import canonical
from hiradix_model.keys import Key, parent_page
from hiradix_model.ops import Victim, evict, evict_host
from hiradix_model.state import State, device_evictable_leaves, host_evictable_leaves
from hiradix_model.strategies import eviction_key

Item = TypeVar("Item")


@dataclass(frozen=True)
class Run(Generic[Item]):
    """One victim sequence and the state after it."""

    victims: tuple[Item, ...]
    after: State


def lowest_pages(pool: frozenset[int], tokens: int, ps: int) -> tuple[int, ...] | None:
    """Slots for ``tokens`` as the lowest whole free pages of ``pool``, in order, or None
    if too few are free. Free pages are interchangeable (14.2), so one choice stands for
    all of them."""
    pages = sorted(s for s in pool if s % ps == 0 and all(s + o in pool for o in range(ps)))
    need = -(-tokens // ps)
    if len(pages) < need:
        return None
    return tuple(start + offset for start in pages[:need] for offset in range(ps))


def _min_leaves(state: State, leaves: set[Key]) -> list[Key]:
    if not leaves:
        return []
    strategy = state.config.eviction
    best = min(eviction_key(strategy, state.pages[k]) for k in leaves)
    return sorted((k for k in leaves if eviction_key(strategy, state.pages[k]) == best),
                  key=lambda k: (k.namespace or "", k.tokens))


def runs(state: State, target: int, leaves_of: Callable[[State], set[Key]],
         step: Callable[[State, Key], list[tuple[Item, State]]]) -> list[Run[Item]]:
    """Every legal victim sequence towards ``target`` tokens (one ``Run`` per distinct
    outcome and sequence class)."""
    ps = state.config.page_size
    found: list[Run[Item]] = []
    seen: set[Hashable] = set()

    def extend(current: State, victims: tuple[Item, ...], evicted: int,
               previous: Key | None) -> None:
        leaves = leaves_of(current)
        lowest = _min_leaves(current, leaves)
        if evicted >= target or not leaves:
            found.append(Run(victims, current))
            parent = None if previous is None else parent_page(previous, ps)
            lowest = [k for k in lowest if k == parent and evicted >= target]
        for page in lowest:
            for item, after in step(current, page):
                memo = (canonical(after), page, evicted + ps)
                if memo in seen:
                    continue
                seen.add(memo)
                extend(after, (*victims, item), evicted + ps, page)

    extend(state, (), 0, None)
    return found


def host_runs(state: State, target: int) -> list[Run[Key]]:
    """Host victim sequences freeing ``target`` host tokens (evict_host's rules)."""
    ps = state.config.page_size

    def step(current: State, page: Key) -> list[tuple[Key, State]]:
        return [(page, evict_host(current, ps, (page,))[0])]

    return runs(state, target, host_evictable_leaves, step)


def host_room(state: State, need: int) -> Iterator[tuple[tuple[Key, ...], tuple[int, ...] | None]]:
    """Every (host victims, host slots) a backup of ``need`` host tokens may report:
    evict host leaves for the shortfall, then the lowest free pages, or None if the host
    still has no room."""
    shortfall = max(0, need - len(state.host_free))
    for run in host_runs(state, shortfall):
        yield run.victims, lowest_pages(run.after.host_free, need, state.config.page_size)


def device_runs(state: State, target: int) -> list[Run[Victim]]:
    """Device victim sequences freeing ``target`` device tokens (evict's rules; under
    write_back a victim without a host copy is backed up on the way out)."""
    ps = state.config.page_size
    write_back = state.config.write_policy == "write_back"

    def step(current: State, page: Key) -> list[tuple[Victim, State]]:
        if not write_back or current.pages[page].host is not None:
            options = [Victim(page)]
        else:
            options = [Victim(page, victims, slots) for victims, slots in host_room(current, ps)]
        return [(victim, evict(current, ps, (victim,))[0]) for victim in options]

    return runs(state, target, device_evictable_leaves, step)
