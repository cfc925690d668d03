"""The invariants of spec/13 (13.5) on the concrete cache, each by its spec ID.

Held pairs are what the abstraction says they are (spec/13, 13.8): the allocated full
slots the tree does not own, each with its mapping entry as its SWA half. INV-SWA-CONTENT
cannot know whose KV a slot should hold here (the conformance machine checks that); it
checks what the cache can: a live page's SWA copy holds the same bytes as its full copy.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator

import torch

from hiradix.hybrid.node import SwaNode
from hiradix.hybrid.pools import NO_PAIR, SwaPools
from hiradix.hybrid.tree import SwaTree

Violation = tuple[str, str]  # (spec ID, what is wrong)


def _in_page_order(slots: list[int], page_size: int) -> bool:
    return all(slots[i] == slots[i - i % page_size] + i % page_size
               and slots[i - i % page_size] % page_size == 0 for i in range(len(slots)))


def _in_range(slots: torch.Tensor, size: int) -> bool:
    return int(slots.min()) >= 0 and int(slots.max()) < size


def _well_formed(tree: SwaTree) -> Iterator[str]:
    ps = tree.page_size
    stack: list[SwaNode] = [tree.root]
    while stack:
        parent = stack.pop()
        for key, node in parent.children.items():
            stack.append(node)
            size = len(node.tokens)
            if size == 0 or size % ps:
                yield f"{node!r}: length {size} is not a positive multiple of {ps}"
            if node.parent is not parent or key != node.tokens[:ps] or not node.attached:
                yield f"{node!r}: not linked to its parent under its first page"
            for pool, slots in (("full", node.full), ("swa", node.swa)):
                if slots is None:
                    continue
                if slots.dtype != torch.int64 or slots.dim() != 1 or slots.numel() != size:
                    yield f"{node!r}: {pool} slots are not {size} int64 slot ids"
                elif not _in_page_order(slots.tolist(), ps):
                    yield f"{node!r}: {pool} slots {slots.tolist()} are not whole pages in order"


def _partition(pool: str, size: int, parts: Iterable[tuple[str, list[int]]]) -> Iterator[str]:
    """Every slot in exactly one of ``parts`` (spec/13, INV-SWA-FULL-POOL and -SWA-POOL)."""
    seen: Counter[int] = Counter()
    where: dict[int, list[str]] = {}
    for name, slots in parts:
        for slot in slots:
            seen[slot] += 1
            where.setdefault(slot, []).append(name)
    for slot, count in sorted(seen.items()):
        if count > 1:
            yield f"{pool} slot {slot} is in {count} places: {', '.join(where[slot])}"
        if not 0 <= slot < size:
            yield f"{pool} slot {slot} is outside the pool of {size}"
    missing = sorted(set(range(size)) - set(seen))
    if missing:
        yield f"{pool} slots {missing} are neither free, held nor owned (leaked)"


def violations(tree: SwaTree, pools: SwaPools) -> list[Violation]:
    """Every violation found, in spec order of the IDs."""
    found: list[Violation] = [("INV-SWA-TREE-WELL-FORMED", d) for d in _well_formed(tree)]
    nodes = list(tree.nodes())
    live = [n for n in nodes if n.swa is not None]
    tree_full = [s for n in nodes for s in n.full.tolist()]
    tree_full_set = set(tree_full)
    full_free = pools.full.free_slots()
    mapping = pools.mapping.tolist()
    held = [s for s in range(pools.full.num_slots) if s not in full_free and s not in tree_full_set]
    live_full = {s for n in live for s in n.full.tolist()}

    # ONLY-WITH-FULL: a full copy on every page; an SWA half (a mapping entry) only for
    # a slot with full KV that may have one: a live page's or a held pair's.
    for node in nodes:
        if node.full.numel() == 0:
            found.append(("INV-SWA-ONLY-WITH-FULL", f"{node!r} has no full copy"))
    for slot, half in enumerate(mapping):
        if half == NO_PAIR:
            continue
        if slot in full_free:
            found.append(("INV-SWA-ONLY-WITH-FULL",
                          f"free full slot {slot} still maps to SWA slot {half}"))
        elif slot in tree_full_set and slot not in live_full:
            found.append(("INV-SWA-ONLY-WITH-FULL",
                          f"tombstone full slot {slot} still maps to SWA slot {half}"))

    # FULL-POOL: held slots are the rest by definition (13.8), so what can break is a
    # slot owned twice, owned and free, out of the pool, or owned without its flag.
    counts = Counter(tree_full)
    for slot, count in sorted(counts.items()):
        if count > 1:
            found.append(("INV-SWA-FULL-POOL", f"full slot {slot} is owned by {count} pages"))
        if slot in full_free:
            found.append(("INV-SWA-FULL-POOL", f"full slot {slot} is both owned and free"))
        if not 0 <= slot < pools.full.num_slots:
            found.append(("INV-SWA-FULL-POOL", f"full slot {slot} is outside the pool"))
    owned_flags = set(pools.owned.tensor.nonzero().view(-1).tolist())
    if owned_flags != tree_full_set:
        found.append(("INV-SWA-FULL-POOL", f"owned flags {sorted(owned_flags)} are not "
                                           f"the tree's full slots {sorted(tree_full_set)}"))

    # SWA-POOL: live copies, held halves and free slots partition the SWA pool, and a
    # live page's mapping entries are exactly its SWA slots.
    held_halves = [mapping[s] for s in held if mapping[s] != NO_PAIR]
    live_swa: list[int] = []
    for node in live:
        assert node.swa is not None
        live_swa += node.swa.tolist()
    swa_parts = [("free", sorted(pools.swa.free_slots())), ("held", held_halves),
                 ("owned", live_swa)]
    found += [("INV-SWA-SWA-POOL", d) for d in _partition("swa", pools.swa.num_slots, swa_parts)]
    for node in live:
        assert node.swa is not None
        if pools.halves(node.full).tolist() != node.swa.tolist():
            found.append(("INV-SWA-SWA-POOL", f"{node!r}: mapping of its full slots "
                                              f"{pools.halves(node.full).tolist()} is not its "
                                              f"SWA slots {node.swa.tolist()}"))

    # CONTENT: a live page's two copies hold the same KV (both halves of a pair are
    # written together, 13.3 alloc). Only where the slots are in range (else reported).
    for node in live:
        assert node.swa is not None
        if (node.full.numel() == node.swa.numel() > 0
                and _in_range(node.full, pools.full.num_slots)
                and _in_range(node.swa, pools.swa.num_slots)
                and not torch.equal(pools.full.read(node.full), pools.swa.read(node.swa))):
            found.append(("INV-SWA-CONTENT", f"{node!r}: its SWA copy differs from its full"))

    for node in nodes:
        if node.lock_ref < 0 or node.swa_lock_ref < 0:
            found.append(("INV-SWA-LOCKS", f"{node!r}: a negative lock count"))
        parent = node.parent
        if parent is not None and parent is not tree.root and parent.lock_ref < node.lock_ref:
            found.append(("INV-SWA-LOCKS", f"{node!r}: locked more often than its parent"))
        # Every lock is counted at the node it was taken at and on each node above, and
        # only callers lock: a node's lock is the locks taken at it plus its children's.
        below = sum(child.lock_ref for child in node.children.values())
        if node.anchored_locks < 0 or node.lock_ref != node.anchored_locks + below:
            found.append(("INV-SWA-LOCKS", f"{node!r}: lock {node.lock_ref} is not the "
                                           f"locks taken there ({node.anchored_locks}) + "
                                           f"its children's ({below})"))
        if node.swa_lock_ref > 0 and node.swa is None:
            found.append(("INV-SWA-LOCKS", f"{node!r}: a tombstone inside a locked window"))
    found += [("INV-SWA-WINDOW-COUNT", d) for d in _window_counts(tree, nodes)]
    return found


def _window_counts(tree: SwaTree, nodes: list[SwaNode]) -> Iterator[str]:
    """INV-SWA-WINDOW-COUNT: each node's ``swa_lock_ref`` is the number of locks still
    holding a window over it. A lock split its window's edge into a node boundary
    (``window_exact``) and later splits keep it one, so each window is whole nodes."""
    holding: dict[int, int] = {id(node): 0 for node in nodes}
    for node in nodes:
        if not 0 <= node.released_locks <= node.anchored_locks:
            yield (f"{node!r}: {node.released_locks} locks released their window, "
                   f"{node.anchored_locks} taken there")
        held = node.anchored_locks - node.released_locks
        if held <= 0:
            continue
        covered, outside = tree.window(node)
        if outside:
            yield f"{node!r}: its window's edge lies inside {covered[-1]!r}"
        for n in covered:
            holding[id(n)] += held
    for node in nodes:
        if node.swa_lock_ref != holding[id(node)]:
            yield (f"{node!r}: swa_lock {node.swa_lock_ref}, but {holding[id(node)]} locks "
                   "hold a window covering it")
