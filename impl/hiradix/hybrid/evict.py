"""evict_full and evict_swa (spec/13, 13.3): least recently used first, and exactly
"enough": a node bigger than what is still missing is split, and only the pages needed
are taken, so that no page is taken after ``n`` is reached (the spec allows only
tombstone full leaves then, DEV-H2; this cache takes none)."""

from __future__ import annotations

import heapq

import torch

from hiradix.hybrid.node import SwaNode
from hiradix.hybrid.pools import SwaPools
from hiradix.hybrid.tree import SwaTree

Entry = tuple[int, int, SwaNode]  # (last tick, node id, node): ids are unique, so no tie


def _entry(node: SwaNode) -> Entry:
    return (node.last_tick, node.id, node)


def _full_leaf(node: SwaNode) -> bool:
    """What evict_full may delete (spec/13 13.3): unlocked, no cached child."""
    return node.lock_ref == 0 and not node.children


def _pages_needed(missing: int, page_size: int) -> int:
    return -(-missing // page_size)


def _take_lower(tree: SwaTree, node: SwaNode, pages: int) -> None:
    """Leave only ``node``'s last ``pages`` pages in ``node`` (the upper part splits off)."""
    keep = len(node.tokens) // tree.page_size - pages
    if keep > 0:
        tree.split(node, keep * tree.page_size)


def _delete(tree: SwaTree, node: SwaNode, full_parts: list[torch.Tensor],
            swa_parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
    tree.detach(node)
    full_parts.append(node.full)
    if node.swa is not None:
        swa_parts.append((node.full, node.swa))


def evict_full(tree: SwaTree, pools: SwaPools, num_tokens: int) -> int:
    """Delete full leaves until ``num_tokens`` full tokens are freed or none is left;
    a deleted live leaf frees its SWA copy too. Returns the full tokens freed."""
    heap = [_entry(n) for n in tree.nodes() if _full_leaf(n)]
    heapq.heapify(heap)
    full_parts: list[torch.Tensor] = []
    swa_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    freed = 0
    while freed < num_tokens and heap:
        node = heapq.heappop(heap)[2]
        _take_lower(tree, node, _pages_needed(num_tokens - freed, tree.page_size))
        parent = node.parent
        assert parent is not None
        _delete(tree, node, full_parts, swa_parts)
        freed += len(node.tokens)
        if parent is not tree.root and _full_leaf(parent):
            heapq.heappush(heap, _entry(parent))
    pools.release(full_parts, swa_parts)
    return freed


def evict_swa(tree: SwaTree, pools: SwaPools, num_tokens: int) -> int:
    """Take live pages outside every SWA lock until ``num_tokens`` SWA tokens are freed
    or none is left: a full leaf is deleted (both copies, its last pages first), any other
    node becomes a tombstone (its first pages first: the pages nearest the leaves keep
    their windows longest). Returns the SWA tokens freed."""
    heap = [_entry(n) for n in tree.nodes() if n.live and n.swa_lock_ref == 0]
    heapq.heapify(heap)
    full_parts: list[torch.Tensor] = []
    swa_parts: list[tuple[torch.Tensor, torch.Tensor]] = []
    freed = 0
    while freed < num_tokens and heap:
        node = heapq.heappop(heap)[2]
        # Only the popped node is ever deleted or tombstoned, and a split happens only on
        # the last step: every entry still names a live node of the tree.
        assert node.attached and node.swa is not None, node
        pages = _pages_needed(num_tokens - freed, tree.page_size)
        if _full_leaf(node):
            _take_lower(tree, node, pages)
            _delete(tree, node, full_parts, swa_parts)
        else:
            if len(node.tokens) > pages * tree.page_size:
                node = tree.split(node, pages * tree.page_size)
            assert node.swa is not None  # a split keeps both parts live
            swa_parts.append((node.full, node.swa))
            node.swa = None
        freed += len(node.tokens)
    pools.release(full_parts, swa_parts)
    return freed
