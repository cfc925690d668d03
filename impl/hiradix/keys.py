"""Radix keys: token ids in a namespace, matched page by page (spec/01, "Keys").

Tokens are kept as tuples so that comparing two spans is one C-level comparison; the
common prefix of two keys is found by binary search over pages, never token by token.
"""

from __future__ import annotations

from dataclasses import dataclass

ChildKey = tuple[str | None, tuple[int, ...]]  # (namespace, first page of the segment)


@dataclass(frozen=True, slots=True)
class RadixKey:
    """A request's token ids and namespace (SGLang's ``extra_key``)."""

    tokens: tuple[int, ...]
    namespace: str | None = None

    def aligned_length(self, page_size: int) -> int:
        """Tokens that fill whole pages; the partial tail page is never cached."""
        return len(self.tokens) - len(self.tokens) % page_size


def child_key(namespace: str | None, tokens: tuple[int, ...], start: int,
              page_size: int) -> ChildKey:
    """The key under which a segment starting at ``tokens[start]`` hangs from its parent.

    The namespace is part of it, so two namespaces never share a child slot.
    """
    return (namespace, tokens[start:start + page_size])


def common_pages(segment: tuple[int, ...], tokens: tuple[int, ...], start: int,
                 page_size: int) -> int:
    """Tokens (a multiple of ``page_size``) that ``segment`` shares with ``tokens[start:]``.

    O(log pages) slice comparisons, each done in C.
    """
    limit = min(len(segment), len(tokens) - start)
    limit -= limit % page_size
    if tokens[start:start + limit] == segment[:limit]:
        return limit
    low, high = 0, limit // page_size - 1  # pages known equal / an upper bound that differs
    while low < high:
        middle = (low + high + 1) // 2
        end = middle * page_size
        if tokens[start:start + end] == segment[:end]:
            low = middle
        else:
            high = middle - 1
    return low * page_size
