"""Inferring what an engine's eviction took, for the component machines (spec/13, 13m).

An engine reports how much an eviction freed, not which pages. The machines compare the
pages before and after, cut the pages taken into chains the engine takes in one go (a
page, then up its root path each parent taken the same way with no other taken child:
the pages of one radix node, or a node and the parents its deletion uncovered), and ask
the model to accept some order of those chains (the engine's order is its policy's,
which the model does not check).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Callable, Iterable, Iterator
from typing import TypeVar

from hiradix_model import Key
from hiradix_model.errors import IllegalChoice
from hiradix_model.keys import parent_page

S = TypeVar("S")

# Orders of chains tried before giving up: every permutation up to this many chains.
MAX_PERMUTED = 6
# Interleavings of single pages tried after the chain orders, where the chains have at
# most this many (the multinomial of their lengths: 8 pages in chains of 1, 4 and 3 have
# 280; 9 pages in chains of 3, 1, 2, 2 and 1, 15,120, which CI's SWA write_back campaign
# met and could not judge under the former cap of 5,040; one chain of each of 8 pages,
# 40,320).
MAX_INTERLEAVINGS = 20160


def victim_chains(taken: Iterable[set[Key]], page_size: int) -> list[list[Key]]:
    """Each set of pages taken the same way (say, tombstoned; deleted), cut into chains,
    deepest chains first within each set."""
    chains: list[list[Key]] = []
    for group in taken:
        pages = set(group)
        while pages:
            cursor: Key | None = max(pages, key=lambda k: (len(k.tokens), k.tokens))
            chain = []
            while cursor in pages and not any(parent_page(k, page_size) == cursor
                                              for k in pages):
                chain.append(cursor)
                pages.discard(cursor)
                cursor = parent_page(cursor, page_size)
            chains.append(chain)
    return chains


def victim_orders(chains: list[list[Key]]) -> Iterator[list[Key]]:
    """Candidate victim sequences: the chains as found, then every other permutation
    (up to ``MAX_PERMUTED`` chains)."""
    yield [k for chain in chains for k in chain]
    if len(chains) <= MAX_PERMUTED:
        for order in itertools.islice(itertools.permutations(chains), 1, None):
            yield [k for chain in order for k in chain]


def interleaved_orders(chains: list[list[Key]]) -> Iterator[list[Key]]:
    """``victim_orders``, then (where there are at most ``MAX_INTERLEAVINGS``) every order
    of the single pages in which each chain's pages keep their order: what an engine
    walking two components one after the other takes, where the second walk reaches a
    parent its first walk's deletion uncovered between pages of another chain."""
    seen: set[tuple[Key, ...]] = set()
    for order in victim_orders(chains):
        seen.add(tuple(order))
        yield order
    if interleavings(chains) > MAX_INTERLEAVINGS:
        return
    for merged in _merges(chains, (0,) * len(chains)):
        if tuple(merged) not in seen:
            yield merged


def interleavings(chains: list[list[Key]]) -> int:
    """How many orders of the chains' pages keep each chain's order (a multinomial)."""
    count, placed = 1, 0
    for chain in chains:
        placed += len(chain)
        count *= math.comb(placed, len(chain))
    return count


def _merges(chains: list[list[Key]], taken: tuple[int, ...]) -> Iterator[list[Key]]:
    """Every order of the pages left (chain ``c`` from page ``taken[c]`` on) that keeps
    each chain's order: the next page from each chain with one left, then the rest."""
    if all(index == len(chain) for index, chain in zip(taken, chains, strict=True)):
        yield []
        return
    for c, chain in enumerate(chains):
        if taken[c] < len(chain):
            rest = (*taken[:c], taken[c] + 1, *taken[c + 1:])
            for tail in _merges(chains, rest):
                yield [chain[taken[c]], *tail]


# Steps ``guided_orders`` walks before giving up: each tries one page next.
MAX_GUIDED_STEPS = 100_000


def guided_orders(chains: list[list[Key]], start: S,
                  step: Callable[[S, Key, list[list[Key]], tuple[int, ...]], Iterable[S]],
                  ) -> Iterator[list[Key]]:
    """The orders of the chains' pages (each chain's order kept) that ``step`` admits
    page by page, depth first: ``step(state, page, chains, taken)`` gives the states the
    engine may be in once it took ``page`` next (none: ``page`` may not come next;
    ``taken[c]``: the pages of chain ``c`` taken before it). Where the interleavings are
    too many to try (``MAX_INTERLEAVINGS``), a step that knows the eviction's rules cuts
    them to the few it could have taken; at most ``MAX_GUIDED_STEPS`` steps in all."""
    budget = MAX_GUIDED_STEPS
    order: list[Key] = []

    def walk(state: S, taken: tuple[int, ...]) -> Iterator[list[Key]]:
        nonlocal budget
        if all(index == len(chain) for index, chain in zip(taken, chains, strict=True)):
            yield list(order)
            return
        for c, chain in enumerate(chains):
            if taken[c] == len(chain):
                continue
            page, rest = chain[taken[c]], (*taken[:c], taken[c] + 1, *taken[c + 1:])
            for following in step(state, page, chains, taken):
                budget -= 1
                if budget < 0:
                    return
                order.append(page)
                yield from walk(following, rest)
                order.pop()

    yield from walk(start, (0,) * len(chains))


class NoOrder(AssertionError):
    """No order of the chains is one the model accepts and that leaves what the engine
    left: the eviction took what it may not, or too little, or too much."""


def accepted_order(chains: list[list[Key]], evict: Callable[[list[Key]], tuple[S, int]],
                   same: Callable[[S], bool],
                   orders: Callable[[list[list[Key]]], Iterator[list[Key]]] = victim_orders,
                   ) -> tuple[S, int, list[Key]]:
    """The first order of ``chains`` that ``evict`` (the model's eviction with those
    victims) accepts and whose result is ``same`` as the engine's: the model's state, what
    it freed, the victims. Else ``NoOrder`` with the model's objection to the chains as
    found."""
    objection: IllegalChoice | None = None
    for victims in orders(chains):
        try:
            state, freed = evict(victims)
        except IllegalChoice as illegal:
            objection = objection or illegal
            continue
        if same(state):
            return state, freed, victims
    taken = [[k.tokens for k in chain] for chain in chains]
    raise NoOrder(f"took {taken}: {objection or 'no order leaves the pages it left'}")


def diff(mine: object, theirs: object) -> str:
    """A short account of how two values of a state field differ."""
    if isinstance(mine, (set, frozenset)) and isinstance(theirs, (set, frozenset)):
        return f"only model {sorted(mine - theirs)}, only engine {sorted(theirs - mine)}"
    if isinstance(mine, dict) and isinstance(theirs, dict):
        keys = {k for k in mine.keys() | theirs.keys() if mine.get(k) != theirs.get(k)}
        return "; ".join(f"{k}: {mine.get(k)} vs {theirs.get(k)}" for k in sorted(keys)[:6])
    return f"{mine} vs {theirs}"
