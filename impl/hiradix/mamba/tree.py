"""The (FULL, MAMBA) radix tree: its root, node creation, splits and the walk along a
key (spec/13m, 13m.2). No pool bookkeeping here: the operations release what a node
gave up."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import torch

from hiradix.mamba.node import MambaNode, detach, split


class Step(NamedTuple):
    """A node on a key's cached run: its first ``matched`` tokens are the key's
    ``[start, start + matched)``; only the run's last node may match partly."""

    node: MambaNode
    start: int
    matched: int

    @property
    def whole(self) -> bool:
        """Whether the key covers the node to its last page (where its state sits)."""
        return self.matched == len(self.node.tokens)


class MambaTree:
    """The nodes of one cache (``owner``) over pages of ``page_size`` tokens."""

    def __init__(self, owner: object, page_size: int) -> None:
        self.owner = owner
        self.page_size = page_size
        self._ids = itertools.count(1)  # node ids, per tree: the LRU tie-break
        self.root = MambaNode(owner, 0, (), torch.empty(0, dtype=torch.int64), None, 0)

    def owns(self, node: object) -> bool:
        """Whether ``node`` is a node of this tree now (the root included)."""
        return isinstance(node, MambaNode) and node.owner is self.owner and node.attached

    def add(self, parent: MambaNode, tokens: tuple[int, ...], full: torch.Tensor,
            tick: int) -> MambaNode:
        """A new childless node without a state under ``parent`` (no child of it starts
        with the same page)."""
        node = MambaNode(self.owner, next(self._ids), tokens, full, parent, tick)
        first = tokens[:self.page_size]
        assert first not in parent.children, (parent, first)
        parent.children[first] = node
        return node

    def split(self, node: MambaNode, at: int) -> MambaNode:
        """Cut ``node`` after ``at`` tokens; the new upper part (``node`` keeps the lower,
        its state and its state locks)."""
        return split(node, at, self.page_size, next(self._ids))

    def detach(self, node: MambaNode) -> None:
        """Take a childless node out of the tree."""
        detach(node, self.page_size)

    def nodes(self) -> Iterator[MambaNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def walk(self, key: tuple[int, ...]) -> list[Step]:
        """The cached pages along ``key``'s whole pages, root first, as node steps (the
        full hit of 13m.3 ``match_prefix``); changes nothing. O(pages of the hit)."""
        ps = self.page_size
        end = len(key) - len(key) % ps
        steps: list[Step] = []
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(key[pos:pos + ps])
            if child is None:
                break
            span = min(len(child.tokens), end - pos)
            matched = ps  # the children lookup matched the first page
            if child.tokens[:span] == key[pos:pos + span]:
                matched = span
            else:  # diverges inside: count the equal pages one by one
                while child.tokens[matched:matched + ps] == key[pos + matched:pos + matched + ps]:
                    matched += ps
            steps.append(Step(child, pos, matched))
            pos += matched
            if matched < len(child.tokens):
                break
            node = child
        return steps
