"""One node of the (FULL, MAMBA) radix tree and the structural edits on nodes (spec/13m,
13m.2 and 13m.8).

A node holds a segment of tokens (a whole number of pages), its full slots (an int64
tensor, one per token) and at most one state slot: the state after the node's whole
root path, i.e. at its **last** page (13m.8). Lock counts are per node: ``lock_ref`` is
on every page of the node, ``state_lock_ref`` on its last page only. Slot tensors are
never written in place, so the parts of a split node may keep views of one tensor.
"""

from __future__ import annotations

import torch

PageKey = tuple[int, ...]  # a node's first page of tokens: its key in its parent's children


class MambaNode:
    """A radix node: ``tokens`` (a page multiple), ``full`` slots, ``state`` (a state slot
    or None: no state, a state tombstone), ``lock_ref`` (path locks on it or below, 13m.2
    ``lock``), ``state_lock_ref`` (locks taken on its last page's state, counted
    whether or not it holds one, 13m.2 ``state_lock``) and ``anchored_locks`` (locks
    taken at it, with or without a state part: what ``dec_lock_ref`` may release, in
    O(1), 13m.3)."""

    __slots__ = (
        "anchored_locks",
        "attached",
        "children",
        "full",
        "full_digest",
        "id",
        "last_tick",
        "lock_ref",
        "owner",
        "parent",
        "state",
        "state_digest",
        "state_lock_ref",
        "tokens",
    )

    def __init__(self, owner: object, node_id: int, tokens: tuple[int, ...],
                 full: torch.Tensor, parent: MambaNode | None, tick: int) -> None:
        self.owner = owner  # the cache this node belongs to (foreign-node checks)
        self.id = node_id  # creation order: the LRU tie-break
        self.tokens = tokens
        self.full = full
        # Per page, a checksum of its full KV taken when the tree adopted it; the
        # checker compares (INV-MAMBA-CONTENT: nobody writes a cached page's KV). None:
        # the cache takes no checksums.
        self.full_digest: torch.Tensor | None = None
        self.state: int | None = None
        # The checksum of the state's bytes taken when the node took it (the same check).
        self.state_digest: torch.Tensor | None = None
        self.parent = parent
        self.children: dict[PageKey, MambaNode] = {}
        self.lock_ref = 0
        self.state_lock_ref = 0
        self.anchored_locks = 0
        self.last_tick = tick
        # False once deleted: a caller's handle to it is then refused (ForeignNode).
        self.attached = True

    def __repr__(self) -> str:
        return (f"MambaNode#{self.id}({list(self.tokens)}, state={self.state}, "
                f"lock={self.lock_ref}, state_lock={self.state_lock_ref}, "
                f"tick={self.last_tick})")

    def path(self) -> list[MambaNode]:
        """This node and its ancestors below the root, deepest first."""
        nodes: list[MambaNode] = []
        node: MambaNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes

    def prefix(self) -> tuple[int, ...]:
        """The whole token prefix that ends with this node (empty for the root)."""
        return tuple(t for node in reversed(self.path()) for t in node.tokens)


def split(node: MambaNode, at: int, page_size: int, node_id: int) -> MambaNode:
    """Cut ``node`` after ``at`` tokens (a page multiple, inside it) and return the new
    upper part, which takes ``node_id``.

    The original object keeps the *lower* part, so a caller's handle (a locked match)
    keeps naming the same last page, and with it the state, the state locks and the
    locks taken at the node (``anchored_locks``, all taken at its last page): a state is
    the state after the node's whole key (13m.8), so the new upper part has none, no
    state lock and no lock taken at it. Both parts keep the path lock count: it was on
    each of the pages.
    """
    assert 0 < at < len(node.tokens) and at % page_size == 0, (at, len(node.tokens))
    parent = node.parent
    assert parent is not None
    upper = MambaNode(node.owner, node_id, node.tokens[:at], node.full[:at], parent,
                      node.last_tick)
    upper.lock_ref = node.lock_ref
    digest = node.full_digest
    if digest is not None:
        upper.full_digest = digest[:at // page_size]
        node.full_digest = digest[at // page_size:]
    parent.children[node.tokens[:page_size]] = upper
    node.tokens = node.tokens[at:]
    node.full = node.full[at:]
    node.parent = upper
    upper.children[node.tokens[:page_size]] = node
    return upper


def detach(node: MambaNode, page_size: int) -> None:
    """Take a childless node out of the tree (its slots are the caller's to release)."""
    assert not node.children and node.parent is not None, node
    del node.parent.children[node.tokens[:page_size]]
    node.attached = False
