"""An allocation's eviction over more interleavings than the checker tries one by one
(spec/13 13.3 ``evict_for_alloc``; ``conformance/hybrid/machine.py`` ``joint_orders``):
the order SGLang 0.5.23 took, met by CI's SWA write-through campaign, is found; and a
standalone SWA eviction whose walk interleaves its chains (``judged_eviction``)."""

from __future__ import annotations

import pytest

from hiradix.conformance.hybrid.machine import (
    joint_orders,
    judged_eviction,
    same_pages,
    taken_pages,
)
from hiradix.conformance.victims import (
    MAX_INTERLEAVINGS,
    NoOrder,
    accepted_order,
    interleavings,
    victim_chains,
)
from hiradix_model import Key
from hiradix_model import hybrid as H
from hiradix_model.errors import IllegalChoice
from hiradix_model.hybrid import SwaPage, SwaState

CONFIG = H.SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=1)
# The state before it: (tokens, live, lock, SWA lock); no slot free.
PAGES = [((1,), False, 0, 0), ((2,), True, 1, 0), ((2, 1), True, 1, 1), ((3,), True, 0, 0),
         ((3, 2), False, 0, 0), ((3, 3), True, 0, 0), ((3, 3, 2), True, 0, 0),
         ((3, 3, 3), False, 0, 0), ((3, 3, 3, 2), False, 0, 0),
         ((3, 3, 3, 2, 3), False, 0, 0)]


def before() -> SwaState:
    pages, full_kv, swa_kv, swa = {}, {}, {}, 0
    for slot, (tokens, live, lock, swa_lock) in enumerate(PAGES):
        key = Key(tokens)
        mine = (swa,) if live else None
        if live:
            swa_kv[swa], swa = key, swa + 1
        pages[key] = SwaPage(full=(slot,), swa=mine, lock=lock, swa_lock=swa_lock)
        full_kv[slot] = key
    return SwaState(config=CONFIG, pages=pages, full_free=frozenset(), swa_free=frozenset(),
                    held={}, full_kv=full_kv, swa_kv=swa_kv)


def after_sglang(start: SwaState) -> SwaState:
    """What SGLang left: the full walk deleted six leaves, then the SWA walk tombstoned
    (3,) while (3, 3) was still its child, deleted (3, 3) and tombstoned (2,)."""
    order = [Key(t) for t in [(1,), (3, 2), (3, 3, 3, 2, 3), (3, 3, 3, 2), (3, 3, 3),
                              (3, 3, 2), (3,), (3, 3), (2,)]]
    state, freed = H.evict_for_alloc(start, 6, 6, order, 6)
    assert freed == 7
    return state


def test_the_interleaved_order_sglang_took_is_found() -> None:
    start = before()
    assert H.violations(start) == []
    after = after_sglang(start)
    chains = victim_chains(taken_pages(start, after), CONFIG.page_size)
    assert interleavings(chains) > MAX_INTERLEAVINGS  # too many to try one by one

    def evict(victims: list[Key]) -> tuple[SwaState, int]:
        for split in range(len(victims) + 1):
            try:
                state, freed = H.evict_for_alloc(start, 6, 6, victims, split)
            except IllegalChoice:
                continue
            if state.pages == after.pages:
                return state, freed
        raise IllegalChoice("no split")

    state, freed, _ = accepted_order(chains, evict, lambda s: s.pages == after.pages,
                                     lambda c: joint_orders(c, start, after, 6, False))
    assert state == after and freed == 7


def test_a_full_walk_that_ends_inside_a_node_is_found_among_many_orders() -> None:
    """What a write-through campaign met (seed 301, P = 2): ten tombstone pages, no full
    slot free; evict_for_alloc(16, 6) took nine, 18 tokens: the eighth page reached the
    target, the ninth is the rest of its node (the parent of the eighth). Too many
    interleavings to try one by one; the guided walk must admit the node's rest past
    the target."""
    config = H.SwaConfig(page_size=2, full_slots=20, swa_slots=10, window=3)
    tokens = [(1, 1), (1, 2), (1, 3), (2, 1), (2, 1, 3, 2), (2, 3), (2, 3, 2, 2), (3, 1),
              (3, 1, 1, 2), (3, 2)]
    pages = {Key(t): SwaPage(full=(2 * i, 2 * i + 1), swa=None) for i, t in enumerate(tokens)}
    start = SwaState(config=config, pages=pages, full_free=frozenset(),
                     swa_free=frozenset(range(10)), held={},
                     full_kv={s: Key(k.tokens[:len(k.tokens) - 1 + j])
                              for k, p in pages.items() for j, s in enumerate(p.full)},
                     swa_kv={})
    assert H.violations(start) == []
    order = [Key(t) for t in [(1, 1), (1, 2), (1, 3), (3, 2), (2, 3, 2, 2), (2, 1, 3, 2),
                              (2, 1), (3, 1, 1, 2), (3, 1)]]
    after, freed = H.evict_for_alloc(start, 16, 6, order, len(order))
    assert freed == 18 and set(after.pages) == {Key((2, 3))}
    chains = victim_chains(taken_pages(start, after), 2)
    assert interleavings(chains) > MAX_INTERLEAVINGS

    def evict(victims: list[Key]) -> tuple[SwaState, int]:
        return H.evict_for_alloc(start, 16, 6, victims, len(victims))

    state, freed, _ = accepted_order(chains, evict, lambda s: s.pages == after.pages,
                                     lambda c: joint_orders(c, start, after, 16, False))
    assert state == after and freed == 18


# ---- a standalone SWA eviction whose walk deletes a leaf inside a chain of tombstones ----

def walked_into_a_chain() -> tuple[SwaState, SwaState, list[Key]]:
    """What a write-through campaign met (seed 103, W = 3): pages (1,) (a tombstone),
    (1,3), (1,3,1) (one node), (1,3,1,1), (1,3,1,1,1), and (2,) locked; SGLang's SWA walk
    for 3 tokens tombstoned (1,3,1,1) (inner: its child still on the device), deleted
    the leaf (1,3,1,1,1), then tombstoned the node above (inner: the tombstone below
    keeps its full KV). The state before, the engine's after it, its order."""
    config = H.SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=3)
    key, locked = Key((1, 3, 1, 1, 1)), Key((2,))
    s = H.alloc(H.initial(config), key, 0, (0, 1, 2, 3, 4), (0, 1, 2, 3, 4))
    s, _ = H.insert(H.free_swa(s, (0,)), key, (0, 1, 2, 3, 4), 1)
    s = H.alloc(s, locked, 0, (5,), (0,))
    s, _ = H.insert(s, locked, (5,), 0)
    s = H.inc_lock_ref(s, locked)
    order = [Key((1, 3, 1, 1)), key, Key((1, 3, 1)), Key((1, 3))]
    after, freed = H.evict_swa(s, 3, order)
    assert freed == 4 and key not in after.pages and not after.pages[Key((1, 3))].live
    return s, after, order


def test_a_standalone_swa_eviction_may_interleave_its_chains() -> None:
    start, after, order = walked_into_a_chain()
    state, freed, victims = judged_eviction(start, after, "swa", 3, False)
    assert (state, freed, victims) == (after, 4, order)
    chains = victim_chains(taken_pages(start, after), 1)
    with pytest.raises(NoOrder, match="taken after 3 were freed"):  # the chain orders alone
        accepted_order(chains, lambda v: H.evict_swa(start, 3, v),
                       lambda s: same_pages(s, after))
