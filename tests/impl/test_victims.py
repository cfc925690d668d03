"""The victim orders the component machines try (hiradix.conformance.victims)."""

from __future__ import annotations

from hiradix.conformance.victims import interleaved_orders, victim_orders
from hiradix_model import Key


def k(*tokens: int) -> Key:
    return Key(tokens)


def test_interleavings_keep_each_chains_order_and_come_after_the_chain_orders() -> None:
    deleted, tombstoned = [k(3, 1, 1, 1, 1), k(3, 1, 1, 1)], [k(3, 1, 1)]
    chains = [tombstoned, deleted]
    orders = list(interleaved_orders(chains))
    assert orders[:2] == list(victim_orders(chains))
    # What SGLang's evict_for_alloc does: the full walk's leaf, then the SWA walk's
    # tombstone, then the parent the deletion uncovered (spec/13 13.3).
    assert [k(3, 1, 1, 1, 1), k(3, 1, 1), k(3, 1, 1, 1)] in orders
    assert len(orders) == len({tuple(o) for o in orders}) == 3  # 3 choose 1 placements
    assert all(o.index(k(3, 1, 1, 1, 1)) < o.index(k(3, 1, 1, 1)) for o in orders)
