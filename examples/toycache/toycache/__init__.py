"""toycache: a small device-only prefix cache, the kind a serving engine keeps.

A radix tree over token ids whose edges are whole pages of ``page_size`` tokens, beside a
slot allocator over a fixed pool of ``num_slots`` KV slots (one slot per token) and the
KV pool itself (``kv``: one opaque entry per slot, written by the forward pass). A
scheduler serves a request like this:

1. ``slots, node = cache.match_prefix(tokens)``: the cached whole-page prefix;
2. ``cache.inc_lock_ref(node)``: nothing on that path may be evicted while it runs;
3. ``new = cache.allocator.alloc(n)``, after ``cache.evict(n - free)`` if the pool is short;
   the forward pass writes the new tokens' KV into ``cache.kv[new[i]]``;
4. ``done = cache.insert(tokens, slots + new)``: the tree takes the slots of the pages it
   did not have. The caller keeps -- and frees -- its slots of the first ``done`` tokens
   (duplicates of what was cached) and of the partial last page;
5. ``cache.dec_lock_ref(node)``.

Eviction removes unlocked leaves, least recently used first (``clock`` stamps every match
and insert), and goes on to a parent once its last child is gone.

KNOWN BUG (toycache 0.1.0, as shipped; ``ToyCache(..., fixed=True)`` runs the fix):
when an eviction removes a node's last child it queues the parent as a new leaf without
checking the parent's lock count. A request whose matched prefix ends at an inner node
(it shares part of a longer cached prompt) holds a lock there; if its allocation evicts
the longer prompt's tail, the locked prefix is evicted next: its slots go back to the
allocator -- often straight to the same request, whose KV then overwrites the prefix it
is still reading -- and its later ``dec_lock_ref`` walks a detached node.
"""

from __future__ import annotations

import heapq
import itertools
import time
from collections.abc import Callable, Iterator, Sequence

__version__ = "0.1.0"
ChildKey = tuple[str | None, tuple[int, ...]]  # (namespace, the edge's first page)


class SlotAllocator:
    """Whole pages of a pool of ``num_slots`` slots; page p is slots p*P .. p*P + P - 1."""

    def __init__(self, num_slots: int, page_size: int) -> None:
        if page_size < 1 or num_slots < page_size or num_slots % page_size:
            raise ValueError(f"num_slots={num_slots} must be a positive multiple of "
                             f"page_size={page_size}")
        self.num_slots, self.page_size = num_slots, page_size
        self.free_pages: list[int] = list(range(num_slots // page_size))

    def available(self) -> int:
        """Free slots."""
        return len(self.free_pages) * self.page_size

    def alloc(self, num_tokens: int) -> list[int] | None:
        """Slots for ``num_tokens`` tokens, rounded up to whole pages; None if short."""
        pages = -(-num_tokens // self.page_size)
        if pages > len(self.free_pages):
            return None
        taken, self.free_pages = self.free_pages[:pages], self.free_pages[pages:]
        return [p * self.page_size + i for p in taken for i in range(self.page_size)]

    def free(self, slots: Sequence[int]) -> None:
        """Return whole pages (their slots in order)."""
        self.free_pages.extend(s // self.page_size for s in slots[::self.page_size])

    def reset(self) -> None:
        self.free_pages = list(range(self.num_slots // self.page_size))


class Node:
    """One edge of the tree: ``tokens`` (whole pages) and their device ``slots``."""

    def __init__(self, tokens: tuple[int, ...], slots: list[int], parent: Node | None,
                 namespace: str | None, now: float, priority: int) -> None:
        self.tokens, self.slots, self.parent, self.namespace = tokens, slots, parent, namespace
        self.children: dict[ChildKey, Node] = {}
        self.lock_ref = 0
        self.last_access = self.created = now
        self.priority = priority


class ToyCache:
    """The tree, the allocator and the KV pool. ``evictable_size`` / ``protected_size``:
    cached tokens with no lock / with a lock on them."""

    def __init__(self, num_slots: int, page_size: int = 1, *,
                 clock: Callable[[], float] = time.monotonic, fixed: bool = False) -> None:
        self.page_size, self.clock, self.fixed = page_size, clock, fixed
        self.allocator = SlotAllocator(num_slots, page_size)
        self.kv: list[object] = [None] * num_slots
        self.reset()

    def reset(self) -> None:
        """Drop every node and every slot, the callers' included."""
        self.root = Node((), [], None, None, 0.0, 0)
        self.allocator.reset()
        self.evictable_size = self.protected_size = 0

    def nodes(self) -> Iterator[Node]:
        """Every node but the root."""
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _child_key(self, namespace: str | None, tokens: Sequence[int]) -> ChildKey:
        return namespace, tuple(tokens[:self.page_size])

    def _shared(self, node: Node, tokens: Sequence[int], start: int) -> int:
        """Tokens of whole pages that ``node``'s edge shares with ``tokens[start:]``."""
        ps, shared = self.page_size, 0
        while (shared < len(node.tokens) and start + shared + ps <= len(tokens)
               and tuple(tokens[start + shared:start + shared + ps])
               == node.tokens[shared:shared + ps]):
            shared += ps
        return shared

    def _split(self, node: Node, at: int) -> Node:
        """Cut ``node``'s edge after ``at`` tokens; the new upper node keeps its fields."""
        assert node.parent is not None and 0 < at < len(node.tokens)
        upper = Node(node.tokens[:at], node.slots[:at], node.parent, node.namespace,
                     node.created, node.priority)
        upper.last_access, upper.lock_ref = node.last_access, node.lock_ref
        node.parent.children[self._child_key(node.namespace, upper.tokens)] = upper
        node.tokens, node.slots, node.parent = node.tokens[at:], node.slots[at:], upper
        upper.children[self._child_key(node.namespace, node.tokens)] = node
        return upper

    def _walk(self, tokens: Sequence[int], namespace: str | None,
              now: float) -> tuple[Node, int]:
        """Descend along the cached whole pages of ``tokens``, splitting where the match
        ends inside an edge and stamping every node passed: (deepest node, tokens)."""
        node, done = self.root, 0
        while done + self.page_size <= len(tokens):
            child = node.children.get(self._child_key(namespace, tokens[done:]))
            if child is None:
                break
            shared = self._shared(child, tokens, done)
            if shared < len(child.tokens):
                child = self._split(child, shared)
            child.last_access = now
            node, done = child, done + shared
        return node, done

    def match_prefix(self, tokens: Sequence[int],
                     namespace: str | None = None) -> tuple[list[int], Node]:
        """The slots of the cached whole-page prefix of ``tokens``, and its last node."""
        node, _ = self._walk(tokens, namespace, self.clock())
        found, path = node, []
        while found is not self.root:
            assert found.parent is not None
            path.append(found.slots)
            found = found.parent
        return [s for slots in reversed(path) for s in slots], node

    def insert(self, tokens: Sequence[int], slots: Sequence[int], namespace: str | None = None,
               priority: int = 0) -> int:
        """Cache the whole pages of ``tokens`` whose KV is in ``slots`` (one per token);
        returns the tokens that were cached already. The tree takes only the slots of the
        pages it adds: the caller frees its slots of the first (returned) tokens and of
        the partial last page."""
        now = self.clock()
        aligned = len(tokens) - len(tokens) % self.page_size
        node, done = self._walk(tokens[:aligned], namespace, now)
        cursor: Node | None = node
        while cursor is not None and cursor is not self.root:
            cursor.priority = max(cursor.priority, priority)
            cursor = cursor.parent
        if done < aligned:
            leaf = Node(tuple(tokens[done:aligned]), list(slots[done:aligned]), node,
                        namespace, now, priority)
            node.children[self._child_key(namespace, leaf.tokens)] = leaf
            self.evictable_size += len(leaf.tokens)
        return done

    def inc_lock_ref(self, node: Node) -> int:
        """Lock ``node`` and its ancestors; the change of ``evictable_size``."""
        delta = 0
        while node is not self.root and node.parent is not None:
            if node.lock_ref == 0:
                delta -= len(node.tokens)
            node.lock_ref += 1
            node = node.parent
        self.evictable_size += delta
        self.protected_size -= delta
        return delta

    def dec_lock_ref(self, node: Node) -> int:
        """Release one lock on ``node`` and its ancestors; the change of ``evictable_size``."""
        delta = 0
        while node is not self.root and node.parent is not None:
            node.lock_ref -= 1
            if node.lock_ref == 0:
                delta += len(node.tokens)
            node = node.parent
        self.evictable_size += delta
        self.protected_size -= delta
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free at least ``num_tokens`` slots of unlocked leaves, least recently used
        first, or all there are; returns the tokens freed."""
        order = itertools.count()
        heap = [(n.last_access, next(order), n) for n in self.nodes()
                if not n.children and n.lock_ref == 0]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            assert parent is not None
            self.allocator.free(leaf.slots)
            del parent.children[self._child_key(leaf.namespace, leaf.tokens)]
            self.evictable_size -= len(leaf.tokens)
            evicted += len(leaf.tokens)
            # The known bug: without ``fixed``, a locked parent is queued too.
            if (parent is not self.root and not parent.children
                    and (parent.lock_ref == 0 or not self.fixed)):
                heapq.heappush(heap, (parent.last_access, next(order), parent))
        return evicted
