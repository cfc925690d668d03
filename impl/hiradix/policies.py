"""Write policies and eviction strategies (spec/04).

Eviction ranks a node by per-node counters that every page of the node shares (a node
is split wherever an operation touches only part of it), so ranking nodes is ranking
pages. Smaller ranks are evicted first.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable
from operator import attrgetter
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


# A node's eviction key per strategy: its rank (spec/04), then its id, which breaks ties.
# attrgetter builds the tuple in C, where the order pops and requeues most (issue 13).
KEYS: dict[str, Callable[[TreeNode], tuple[int, ...]]] = {
    "lru": attrgetter("last_tick", "id"),
    "lfu": attrgetter("hits", "last_tick", "id"),
    "fifo": attrgetter("insert_tick", "id"),
    "mru": lambda node: (-node.last_tick, node.id),
    "filo": lambda node: (-node.insert_tick, node.id),
    "priority": attrgetter("priority", "last_tick", "id"),
    "slru": lambda node: (int(node.hits >= SLRU_PROTECTED_HITS), node.last_tick, node.id),
}


# Strategies whose rank of a node never decreases while it lives: every field they read
# only grows (ticks come from a clock checked to be monotone, hits and priority only
# rise, insert_tick is fixed). MRU's (-last_tick) falls with every touch.
MONOTONE: frozenset[str] = frozenset({"lru", "lfu", "fifo", "filo", "priority", "slru"})

Entry = tuple[tuple[int, ...], "TreeNode"]


class EvictionOrder:
    """The members of one evictable-leaf set (``members``, which the cache owns) in
    eviction order: smallest ``(rank, id)`` first, exactly the order a heap of every
    member built at each eviction gives (spec/04 4.4; the id breaks ties as before).

    A heap kept across calls instead of one built per call. Each node has at most one
    *live* entry, whose key is recorded in ``_live``; other entries of it are stale and
    dropped when popped. A node gets an entry when it joins ``members`` and has none
    (``joined``); one that leaves keeps its entry until it is popped or the heap is
    rebuilt. For a monotone strategy a live key is never above the node's current key,
    so the first popped entry whose key is current is the minimum over every member
    (a lazy key increase: an outdated entry is pushed again with the current key). For
    MRU, whose keys fall when a node is touched (and the storage tier stamps nodes
    directly), the heap is rebuilt from the members at the start of every eviction.
    """

    def __init__(self, strategy: Strategy, members: set[TreeNode]) -> None:
        self.strategy = strategy
        self.members = members
        self._incremental = strategy in MONOTONE
        self._heap: list[Entry] = []
        self._live: dict[TreeNode, tuple[int, ...]] = {}
        self._key = KEYS[strategy]

    def rebuild(self) -> None:
        """One entry per member, with its current key."""
        self._live = {node: self._key(node) for node in self.members}
        self._heap = [(key, node) for node, key in self._live.items()]
        heapq.heapify(self._heap)

    def joined(self, node: TreeNode) -> None:
        """``node`` has just been added to ``members``."""
        if node in self._live:
            return  # its live entry is still queued, with a key no greater than its own
        key = self._key(node)
        self._live[node] = key
        heapq.heappush(self._heap, (key, node))
        if len(self._heap) > 2 * len(self.members) + 64:  # stale entries: compact
            self.rebuild()

    def begin(self) -> None:
        """Before an eviction pops: MRU rebuilds; others drop stale entries if many."""
        if not self._incremental or len(self._heap) > 2 * len(self.members) + 64:
            self.rebuild()

    def pop(self) -> TreeNode | None:
        """Remove and return the member with the smallest key, or None if none is left.
        The caller evicts it or hands it back with ``push_back``."""
        heap, live = self._heap, self._live
        while heap:
            key, node = heapq.heappop(heap)
            if live.get(node) != key:
                continue  # a stale duplicate
            if node not in self.members:
                del live[node]
                continue
            current = self._key(node)
            if current != key:  # touched since it was queued: requeue at its key
                live[node] = current
                heapq.heappush(heap, (current, node))
                continue
            del live[node]
            return node
        return None

    def push_back(self, node: TreeNode) -> None:
        """Queue again a member ``pop`` returned that was not evicted."""
        key = self._key(node)
        self._live[node] = key
        heapq.heappush(self._heap, (key, node))

    def clear(self) -> None:
        self._heap = []
        self._live = {}
