"""Eviction strategies as sort keys on page records (spec/04-policies.md).

Every strategy is a total preorder on pages: the page with the *smallest* key is
evicted first, and pages with equal keys are interchangeable (any of them is a legal
victim). Keys use only the logical clock and per-page counters, never wall time, so the
order is defined by the spec and not by how an implementation splits nodes.
"""

from __future__ import annotations

from hiradix_model.config import Strategy
from hiradix_model.state import Page

SLRU_PROTECTED_HITS = 2  # a page hit this often leaves SLRU's probationary segment


def eviction_key(strategy: Strategy, page: Page) -> tuple[int, ...]:
    """The rank of ``page`` under ``strategy``; smaller is evicted first."""
    if strategy == "lru":
        return (page.last_tick,)
    if strategy == "lfu":
        return (page.hits, page.last_tick)
    if strategy == "fifo":
        return (page.insert_tick,)
    if strategy == "mru":
        return (-page.last_tick,)
    if strategy == "filo":
        return (-page.insert_tick,)
    if strategy == "priority":
        return (page.priority, page.last_tick)
    # slru: probationary pages (few hits) go before protected ones, each segment by LRU.
    return (int(page.hits >= SLRU_PROTECTED_HITS), page.last_tick)
