"""Radix tree nodes and the one structural edit that needs care: splitting.

A node holds a segment of tokens (a whole number of pages) and, per tier, an int64
tensor of slots (one per token) or None. The segment is kept packed only (native int64
bytes, what matching compares): a tuple of ints beside it cost 8 B a token and, for a key
built from a buffer, an int object per token, 40 B in all, and an insert's time to make
them (issue 29); ``tokens`` decodes the bytes when a reader asks. Slot tensors are never
written in place (only read, released and replaced), so nodes cut from one tensor keep
views of it. Counters are per node; every page of a node shares them, which is what makes
the abstraction to per-page state exact (spec/06).
"""

from __future__ import annotations

import itertools

import torch

from hiradix.keys import TOKEN_BYTES, ChildKey, child_key

_ids = itertools.count(1)


class TreeNode:
    __slots__ = (
        "anchored_locks",
        "children",
        "device",
        "hits",
        "host",
        "host_ref",
        "id",
        "insert_tick",
        "last_tick",
        "length",
        "lock_ref",
        "namespace",
        "owner",
        "packed",
        "parent",
        "priority",
    )

    def __init__(self, owner: object, namespace: str | None, packed: bytes,
                 parent: TreeNode | None, tick: int = 0, priority: int = 0) -> None:
        self.owner = owner  # the cache this node belongs to (foreign-node checks)
        self.namespace = namespace
        # This node's segment packed (keys.pack), a whole number of pages: bytes of its
        # own, never a view of a caller's buffer (RadixKey.packed_span).
        self.packed = packed
        self.length = len(packed) // TOKEN_BYTES  # tokens in the segment
        self.parent = parent
        self.children: dict[ChildKey, TreeNode] = {}
        self.device: torch.Tensor | None = None  # int64 device slots, one per token
        self.host: torch.Tensor | None = None  # int64 host slots, one per token
        self.lock_ref = 0  # locks on this node or below it (INV-LOCK-MONOTONE)
        # Caller locks taken *at* this node (inc_lock_ref(node), not yet released): what
        # dec_lock_ref(node) may release, in O(1) (spec/03 3.7).
        self.anchored_locks = 0
        self.host_ref = 0  # holders forbidding the host copy's release (INV-HOST-PROTECT)
        self.hits = 0
        self.last_tick = tick
        self.insert_tick = tick
        self.priority = priority
        self.id = next(_ids)

    def __repr__(self) -> str:
        tiers = ("D" if self.device is not None else "-") + ("H" if self.host is not None else "-")
        return (f"Node#{self.id}({self.namespace!r}, {list(self.tokens)}, {tiers}, "
                f"lock={self.lock_ref}, host_ref={self.host_ref}, hits={self.hits})")

    @property
    def tokens(self) -> tuple[int, ...]:
        """The segment's token ids, decoded from ``packed`` on each call."""
        return tuple(memoryview(self.packed).cast("q"))

    @property
    def on_device(self) -> bool:
        return self.device is not None

    @property
    def on_host(self) -> bool:
        return self.host is not None

    def path(self) -> list[TreeNode]:
        """This node and its ancestors below the root, deepest first."""
        nodes = []
        node: TreeNode | None = self
        while node is not None and node.parent is not None:
            nodes.append(node)
            node = node.parent
        return nodes

    def child_key(self, page_size: int) -> ChildKey:
        """The key under which this node hangs from its parent (``keys.child_key``)."""
        return child_key(self.namespace, self.packed, 0, page_size)

    def prefix(self) -> tuple[int, ...]:
        """The full token prefix that ends with this node."""
        return tuple(memoryview(b"".join([n.packed for n in reversed(self.path())])).cast("q"))


def split(node: TreeNode, at: int, page_size: int) -> TreeNode:
    """Cut ``node`` after ``at`` tokens (a page multiple) and return the new upper part.

    The original object keeps the *lower* part, so handles to the deepest node of an
    in-flight copy (its lock node) stay valid and still mark the copy's end. Both parts
    keep every counter: a lock, a host protection or a hit on the node was one on each of
    its pages. Except ``anchored_locks``: a lock taken at the node was taken at its last
    page, which the lower part (this object) keeps, so the upper part starts with none
    (its lock count is then exactly its child's, spec/03 3.7).
    """
    assert 0 < at < node.length and at % page_size == 0, (at, node.length)
    parent = node.parent
    assert parent is not None
    cut = at * TOKEN_BYTES
    upper = TreeNode(node.owner, node.namespace, node.packed[:cut], parent)
    upper.lock_ref = node.lock_ref
    upper.host_ref = node.host_ref
    upper.hits = node.hits
    upper.last_tick = node.last_tick
    upper.insert_tick = node.insert_tick
    upper.priority = node.priority
    # Views, not copies (issue 13: four clones were most of a split): slot tensors are
    # never written in place, only read, released and replaced, so two nodes may share
    # one tensor's storage. Its memory is freed when the last part goes.
    if node.device is not None:
        upper.device = node.device[:at]
        node.device = node.device[at:]
    if node.host is not None:
        upper.host = node.host[:at]
        node.host = node.host[at:]
    parent.children[upper.child_key(page_size)] = upper
    node.packed = node.packed[cut:]
    node.length -= at
    node.parent = upper
    upper.children[node.child_key(page_size)] = node
    return upper
