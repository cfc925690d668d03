"""One node of the hybrid radix tree, and the structural edits on nodes (spec/13, 13.2).

A node holds a segment of tokens (a whole number of pages), its full slots (an int64
tensor, one per token) and, unless it is a tombstone, its SWA slots. Lock counts are per
node; every page of a node shares them, which is what makes the abstraction to per-page
state exact (spec/13, 13.8). Slot tensors are never written in place (only read,
released and replaced), so the parts of a split node may keep views of one tensor.
"""

from __future__ import annotations

import torch

PageKey = tuple[int, ...]  # a node's first page of tokens: its key in its parent's children


class SwaNode:
    """A radix node: ``tokens`` (a page multiple), ``full`` slots, ``swa`` slots or None
    (a tombstone), ``lock_ref`` (path locks on it or below, spec/13 13.2 ``lock``),
    ``swa_lock_ref`` (locks whose window covers it, ``swa_lock``), ``anchored_locks``
    (locks taken at it: what ``dec_lock_ref`` may release, in O(1), 13.3) and
    ``released_locks`` (those of them whose window ``dec_swa_lock`` released, 13.2
    ``released``)."""

    __slots__ = (
        "anchored_locks",
        "attached",
        "children",
        "full",
        "id",
        "last_tick",
        "lock_ref",
        "owner",
        "parent",
        "released_locks",
        "swa",
        "swa_lock_ref",
        "tokens",
    )

    def __init__(self, owner: object, node_id: int, tokens: tuple[int, ...],
                 full: torch.Tensor, swa: torch.Tensor | None, parent: SwaNode | None,
                 tick: int) -> None:
        self.owner = owner  # the cache this node belongs to (foreign-node checks)
        self.id = node_id  # creation order: the LRU tie-break
        self.tokens = tokens
        self.full = full
        self.swa = swa
        self.parent = parent
        self.children: dict[PageKey, SwaNode] = {}
        self.lock_ref = 0
        self.swa_lock_ref = 0
        self.anchored_locks = 0
        self.released_locks = 0
        self.last_tick = tick
        # False once deleted: a caller's handle to it is then refused (ForeignNode).
        self.attached = True

    def __repr__(self) -> str:
        kind = "live" if self.swa is not None else "tombstone"
        return (f"SwaNode#{self.id}({list(self.tokens)}, {kind}, lock={self.lock_ref}, "
                f"swa_lock={self.swa_lock_ref}, tick={self.last_tick})")

    @property
    def live(self) -> bool:
        """Whether the node still has its SWA copy (not a tombstone)."""
        return self.swa is not None

    def path(self) -> list[SwaNode]:
        """This node and its ancestors below the root, deepest first."""
        nodes: list[SwaNode] = []
        node: SwaNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes

    def prefix(self) -> tuple[int, ...]:
        """The whole token prefix that ends with this node (empty for the root)."""
        parts = [n.tokens for n in reversed(self.path())]
        return tuple(t for part in parts for t in part)


def split(node: SwaNode, at: int, page_size: int, node_id: int) -> SwaNode:
    """Cut ``node`` after ``at`` tokens (a page multiple, inside it) and return the new
    upper part, which takes ``node_id``.

    The original object keeps the *lower* part, so a caller's handle to a node (a locked
    match) keeps naming the same last page. Both parts keep every counter: a lock on the
    node was one on each of its pages, and so is each part's. Except ``anchored_locks``
    and ``released_locks``: a lock taken at the node was taken at its last page, which
    the lower part keeps, so the upper part starts with none (its lock count is exactly
    its child's).
    """
    assert 0 < at < len(node.tokens) and at % page_size == 0, (at, len(node.tokens))
    parent = node.parent
    assert parent is not None
    upper = SwaNode(node.owner, node_id, node.tokens[:at], node.full[:at],
                    None if node.swa is None else node.swa[:at], parent, node.last_tick)
    upper.lock_ref = node.lock_ref
    upper.swa_lock_ref = node.swa_lock_ref
    parent.children[node.tokens[:page_size]] = upper
    node.tokens = node.tokens[at:]
    node.full = node.full[at:]
    node.swa = None if node.swa is None else node.swa[at:]
    node.parent = upper
    upper.children[node.tokens[:page_size]] = node
    return upper


def detach(node: SwaNode, page_size: int) -> None:
    """Take a childless node out of the tree (its slots are the caller's to release)."""
    assert not node.children and node.parent is not None, node
    del node.parent.children[node.tokens[:page_size]]
    node.attached = False
