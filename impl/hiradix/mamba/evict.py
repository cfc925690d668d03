"""evict_full and evict_states (spec/13m, 13m.3): least recently used first.

Both take whole radix nodes: a node's state sits on its last page, so deleting only its
lower pages would leave the upper ones a stateless leaf that nothing can resume after.
13m.3 allows that: past the target only the rest of the previous victim's node follows.
"""

from __future__ import annotations

import heapq
from collections.abc import Callable

import torch

from hiradix.mamba.node import MambaNode
from hiradix.mamba.pools import MambaPools
from hiradix.mamba.tree import MambaTree

Entry = tuple[int, int, MambaNode]  # (last tick, node id, node): ids are unique, no tie


def _entry(node: MambaNode) -> Entry:
    return (node.last_tick, node.id, node)


def _lru(tree: MambaTree, candidate: Callable[[MambaNode], bool]) -> list[Entry]:
    """The candidates of the tree as a heap, least recently used first."""
    heap = [_entry(n) for n in tree.nodes() if candidate(n)]
    heapq.heapify(heap)
    return heap


def full_leaf(node: MambaNode) -> bool:
    """What evict_full may delete (13m.3 "full leaf"): no lock, no state lock, no child."""
    return node.lock_ref == 0 and node.state_lock_ref == 0 and not node.children


def _delete(tree: MambaTree, node: MambaNode, full_parts: list[torch.Tensor],
            states: list[int]) -> None:
    """Detach a full leaf; its full slots and its state (if any) go back."""
    tree.detach(node)
    full_parts.append(node.full)
    if node.state is not None:
        states.append(node.state)


def evict_full(tree: MambaTree, pools: MambaPools, num_tokens: int) -> int:
    """Delete full leaves, least recently used first, until ``num_tokens`` full tokens
    are freed or none is left (a parent whose last child went becomes one). O(n log n)
    in the tree's nodes. Returns the full tokens freed."""
    heap = _lru(tree, full_leaf)
    full_parts: list[torch.Tensor] = []
    states: list[int] = []
    freed = 0
    while freed < num_tokens and heap:
        node = heapq.heappop(heap)[2]
        parent = node.parent
        assert parent is not None
        _delete(tree, node, full_parts, states)
        freed += len(node.tokens)
        if parent is not tree.root and full_leaf(parent):
            heapq.heappush(heap, _entry(parent))
    pools.release(full_parts, states)
    return freed


def evict_states(tree: MambaTree, pools: MambaPools, num_states: int) -> int:
    """Take states without a state lock, least recently used first, until
    ``num_states`` are freed or none is left: a node that is a full leaf when its turn
    comes is deleted whole, any other only loses its state (a state tombstone). Returns
    the state slots freed."""
    heap = _lru(tree, lambda n: n.state is not None and n.state_lock_ref == 0)
    full_parts: list[torch.Tensor] = []
    states: list[int] = []
    freed = 0
    while freed < num_states and heap:
        node = heapq.heappop(heap)[2]
        # Only the popped node is ever deleted: every entry still names a node with its
        # state (a deletion can only make a later entry's node a leaf).
        assert node.attached and node.state is not None, node
        if full_leaf(node):
            _delete(tree, node, full_parts, states)
        else:
            states.append(node.state)
            node.state = None
            node.state_digest = None
        freed += 1
    pools.release(full_parts, states)
    return freed
