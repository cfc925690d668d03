"""The hybrid radix tree: its root, node creation, splits and the window walk (spec/13,
13.2 ``window``). No pool bookkeeping here: the operations release what a node gave up."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from typing import NamedTuple

import torch

from hiradix.hybrid.node import SwaNode, detach, split


class Segment(NamedTuple):
    """Part of a key's cached run: ``node``'s first ``matched`` tokens are the key's
    ``[start, start + matched)`` (only the run's last node may match partly)."""

    node: SwaNode
    start: int
    matched: int


class SwaTree:
    """Nodes of one cache (``owner``) over pages of ``page_size`` tokens, with a window
    of ``window_pages`` pages (spec/13, 13.1 ``WP``)."""

    def __init__(self, owner: object, page_size: int, window_pages: int) -> None:
        self.owner = owner
        self.page_size = page_size
        self.window_pages = window_pages
        self._ids = itertools.count(1)  # node ids, per tree: the LRU tie-break
        empty = torch.empty(0, dtype=torch.int64)
        self.root = SwaNode(owner, 0, (), empty, empty, None, 0)

    def owns(self, node: object) -> bool:
        """Whether ``node`` is a node of this tree now (the root included)."""
        return isinstance(node, SwaNode) and node.owner is self.owner and node.attached

    def add(self, parent: SwaNode, tokens: tuple[int, ...], full: torch.Tensor,
            swa: torch.Tensor | None, tick: int) -> SwaNode:
        """A new childless node under ``parent`` (no child of it starts with its page)."""
        node = SwaNode(self.owner, next(self._ids), tokens, full, swa, parent, tick)
        key = tokens[:self.page_size]
        assert key not in parent.children, (parent, key)
        parent.children[key] = node
        return node

    def split(self, node: SwaNode, at: int) -> SwaNode:
        """Cut ``node`` after ``at`` tokens; the new upper part (``node`` keeps the lower)."""
        return split(node, at, self.page_size, next(self._ids))

    def detach(self, node: SwaNode) -> None:
        """Take a childless node out of the tree."""
        detach(node, self.page_size)

    def nodes(self) -> Iterator[SwaNode]:
        """Every node but the root, parents before children."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def common_tokens(self, node: SwaNode, key: tuple[int, ...], start: int, end: int) -> int:
        """How many tokens of ``node``'s segment equal ``key[start:end]``, whole pages
        only; its first page is known to match (the children lookup found it)."""
        limit = min(len(node.tokens), end - start)
        if node.tokens[:limit] == key[start:start + limit]:  # the common case, one compare
            return limit
        ps = self.page_size
        matched = ps
        while matched < limit and (node.tokens[matched:matched + ps]
                                   == key[start + matched:start + matched + ps]):
            matched += ps
        return matched

    def cached_run(self, key: tuple[int, ...], end: int) -> list[Segment]:
        """The cached pages along ``key[:end]`` (``end`` a page multiple), root first, as
        node segments; changes nothing."""
        segments: list[Segment] = []
        node, pos = self.root, 0
        while pos < end:
            child = node.children.get(key[pos:pos + self.page_size])
            if child is None:
                break
            matched = self.common_tokens(child, key, pos, end)
            segments.append(Segment(child, pos, matched))
            pos += matched
            if matched < len(child.tokens):
                break
            node = child
        return segments

    def window(self, node: SwaNode) -> tuple[list[SwaNode], int]:
        """The nodes holding ``window(k)`` of ``node``'s last page ``k`` (spec/13, 13.2:
        its last ``min(WP, depth(k))`` pages), deepest first, and how many leading tokens
        of the topmost one lie outside the window (0: all of it is inside)."""
        nodes: list[SwaNode] = []
        need = self.window_pages
        cursor = node
        while need > 0 and cursor.parent is not None:
            pages = len(cursor.tokens) // self.page_size
            nodes.append(cursor)
            if pages >= need:
                return nodes, (pages - need) * self.page_size
            need -= pages
            cursor = cursor.parent
        return nodes, 0

    def window_exact(self, node: SwaNode) -> list[SwaNode]:
        """``window`` with its topmost node split at the window's edge, so that the nodes
        returned hold exactly the window's pages (the split is invisible to spec/13)."""
        nodes, outside = self.window(node)
        if outside:
            self.split(nodes[-1], outside)  # nodes[-1] keeps the lower part: the window's
        return nodes
