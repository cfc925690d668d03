"""The victim orders the component machines try (hiradix.conformance.victims)."""

from __future__ import annotations

from hiradix.conformance.victims import (
    MAX_INTERLEAVINGS,
    interleaved_orders,
    interleavings,
    victim_orders,
)
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


def test_interleavings_are_merged_not_filtered_so_eight_pages_are_tried() -> None:
    """Chains of 1, 4 and 3 pages (what SGLang 0.5.23's evict_for_alloc took in a campaign:
    a full walk's leaves, then the SWA walk's tombstone, then the rest of a node): 280
    orders keep every chain's order, each once, all tried."""
    chains = [[k(3, 1)], [k(3, 1, 1, 1, 1, 1, 1, 1, 1, 1), k(3, 1, 1, 1, 1, 1, 1, 1),
                          k(3, 1, 1, 1, 1, 1), k(3, 1, 1, 1)],
              [k(1, 1, 1, 1, 1, 1), k(1, 1, 1, 1), k(1, 1)]]
    assert interleavings(chains) == 280
    orders = [tuple(o) for o in interleaved_orders(chains)]
    assert len(orders) == len(set(orders)) == 280
    wanted = (*chains[2], chains[1][0], chains[0][0], *chains[1][1:])
    assert wanted in orders


def test_too_many_interleavings_stop_at_the_chain_orders() -> None:
    chains = [[k(i)] for i in range(1, 9)]  # 8! orders of single pages
    assert interleavings(chains) == 40320 > MAX_INTERLEAVINGS
    assert sum(1 for _ in interleaved_orders(chains)) == 1  # 8 chains: none permuted


def test_nine_pages_in_five_chains_are_all_interleaved() -> None:
    """CI's SWA write_back campaign met an allocation's eviction over chains of 3, 1, 2, 2
    and 1 pages that the former cap (5,040) left unjudged: its 15,120 orders are tried."""
    chains = [[k(1, 1, 1), k(1, 1), k(1)], [k(2)], [k(3, 3), k(3)], [k(4, 4), k(4)], [k(5)]]
    assert interleavings(chains) == 15120 <= MAX_INTERLEAVINGS
    orders = {tuple(o) for o in interleaved_orders(chains)}
    assert len(orders) == 15120
