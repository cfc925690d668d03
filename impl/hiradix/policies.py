"""Write policies and eviction strategies (spec/04).

Eviction ranks a node by per-node counters that every page of the node shares (a node
is split wherever an operation touches only part of it), so ranking nodes is ranking
pages. Smaller ranks are evicted first.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Literal, get_args

if TYPE_CHECKING:
    from hiradix.tree import TreeNode

WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
Strategy = Literal["lru", "lfu", "fifo", "mru", "filo", "priority", "slru"]
WRITE_POLICIES: tuple[str, ...] = get_args(WritePolicy)
STRATEGIES: tuple[str, ...] = get_args(Strategy)

SLRU_PROTECTED_HITS = 2


def backup_threshold(policy: WritePolicy) -> int | None:
    """Hits after which a page is backed up on insert; None: back up on eviction only."""
    return {"write_through": 1, "write_through_selective": 2}.get(policy)


def rank(strategy: Strategy, node: TreeNode) -> tuple[int, ...]:
    if strategy == "lru":
        return (node.last_tick,)
    if strategy == "lfu":
        return (node.hits, node.last_tick)
    if strategy == "fifo":
        return (node.insert_tick,)
    if strategy == "mru":
        return (-node.last_tick,)
    if strategy == "filo":
        return (-node.insert_tick,)
    if strategy == "priority":
        return (node.priority, node.last_tick)
    return (int(node.hits >= SLRU_PROTECTED_HITS), node.last_tick)
