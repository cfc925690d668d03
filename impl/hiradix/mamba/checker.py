"""The invariants of spec/13m (13m.5) on the concrete cache, each by its spec ID.

Held slots are what the abstraction says they are (13m.8): allocated and owned by no
node. INV-MAMBA-CONTENT cannot know whose KV or state a slot should hold here (the
conformance machine checks that against the model); it checks what the cache can: no
cached page's KV and no cached state changed since the tree took it (the checksums
taken then, ``MambaNode.full_digest`` / ``state_digest``; a cache built without
checksums skips this). INV-MAMBA-MATCH-STATE is a
postcondition of ``match_prefix``, not a property of a state: the tests check it.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import torch

from hiradix.mamba.node import MambaNode
from hiradix.mamba.pools import MambaPools
from hiradix.mamba.tree import MambaTree

Violation = tuple[str, str]  # (spec ID, what is wrong)


def _pages_in_order(slots: list[int], page_size: int) -> bool:
    heads = slots[::page_size]
    return all(head % page_size == 0 and slots[i:i + page_size]
               == list(range(head, head + page_size))
               for i, head in zip(range(0, len(slots), page_size), heads, strict=True))


def _well_formed(tree: MambaTree, pools: MambaPools) -> Iterator[str]:
    ps = tree.page_size
    stack: list[MambaNode] = [tree.root]
    while stack:
        parent = stack.pop()
        for first, node in parent.children.items():
            stack.append(node)
            size = len(node.tokens)
            if size == 0 or size % ps:
                yield f"{node!r}: length {size} is not a positive multiple of {ps}"
            if node.parent is not parent or first != node.tokens[:ps] or not node.attached:
                yield f"{node!r}: not linked to its parent under its first page"
            full = node.full
            if full.dtype != torch.int64 or full.dim() != 1 or full.numel() != size:
                yield f"{node!r}: full slots are not {size} int64 slot ids"
            elif not _pages_in_order(full.tolist(), ps):
                yield f"{node!r}: full slots {full.tolist()} are not whole pages in order"
            if node.state is not None and not 0 <= node.state < pools.states.num_slots:
                yield f"{node!r}: state slot {node.state} is outside the state pool"


def _owned_once(pool: str, owners: list[int], free: frozenset[int], size: int,
                flags: set[int]) -> Iterator[str]:
    """Slots owned by the tree: each by one page, none free, all in the pool, and
    exactly the pool's ownership flags (held slots are the rest by definition, 13m.8)."""
    for slot, count in sorted(Counter(owners).items()):
        if count > 1:
            yield f"{pool} slot {slot} is owned by {count} pages"
        if slot in free:
            yield f"{pool} slot {slot} is both owned and free"
        if not 0 <= slot < size:
            yield f"{pool} slot {slot} is outside the pool of {size}"
    if flags != set(owners):
        yield (f"{pool} ownership flags {sorted(flags)} are not the tree's slots "
               f"{sorted(set(owners))}")


def _content(nodes: list[MambaNode], pools: MambaPools) -> Iterator[str]:
    full_size, state_size = pools.full.num_slots, pools.states.num_slots
    for node in nodes:
        full = node.full
        whole = full.numel() > 0 and full.numel() % pools.page_size == 0
        if whole and int(full.min()) >= 0 and int(full.max()) < full_size:
            now, then = pools.page_checksums(full), node.full_digest
            if then is None or then.shape != now.shape or not torch.equal(now, then):
                yield f"{node!r}: the KV of its full slots changed since it was cached"
        state = node.state
        if state is not None and 0 <= state < state_size and (
                node.state_digest is None
                or not torch.equal(pools.state_checksum(state), node.state_digest)):
            yield f"{node!r}: state slot {state} changed since the node took it"


def _locks(tree: MambaTree, nodes: list[MambaNode]) -> Iterator[str]:
    for node in nodes:
        if node.lock_ref < 0 or node.state_lock_ref < 0:
            yield f"{node!r}: a negative lock count"
        parent = node.parent
        if parent is not None and parent is not tree.root and parent.lock_ref < node.lock_ref:
            yield f"{node!r}: locked more often than its parent"
        # Every lock is counted at the node it was taken at and on each node above, and
        # only callers lock: a node's lock is the locks taken at it plus its children's;
        # a state lock is the state part of a lock taken at the node.
        below = sum(child.lock_ref for child in node.children.values())
        if node.anchored_locks < 0 or node.lock_ref != node.anchored_locks + below:
            yield (f"{node!r}: lock {node.lock_ref} is not the locks taken there "
                   f"({node.anchored_locks}) + its children's ({below})")
        if node.state_lock_ref > node.anchored_locks:
            yield f"{node!r}: more state locks than locks taken there"


def violations(tree: MambaTree, pools: MambaPools, *, checksums: bool) -> list[Violation]:
    """Every violation found, in spec order of the IDs; ``checksums``: whether the
    cache took them (else INV-MAMBA-CONTENT has nothing to compare)."""
    nodes = list(tree.nodes())
    found: list[Violation] = [("INV-MAMBA-TREE-WELL-FORMED", d)
                              for d in _well_formed(tree, pools)]
    full_owners = [s for n in nodes for s in n.full.tolist()]
    full_flags = set(pools.owned.tensor.nonzero().view(-1).tolist())
    found += [("INV-MAMBA-FULL-POOL", d) for d in _owned_once(
        "full", full_owners, pools.full.free_slots(), pools.full.num_slots, full_flags)]
    state_owners = [n.state for n in nodes if n.state is not None]
    found += [("INV-MAMBA-STATE-POOL", d) for d in _owned_once(
        "state", state_owners, pools.states.free_slots(), pools.states.num_slots,
        pools.states.owned)]
    if checksums:
        found += [("INV-MAMBA-CONTENT", d) for d in _content(nodes, pools)]
    found += [("INV-MAMBA-LOCKS", d) for d in _locks(tree, nodes)]
    return found
