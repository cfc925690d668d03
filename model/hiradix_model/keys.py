"""Keys: token sequences in a namespace (spec/01-constants.md, "Keys").

A page is named by the key of its *full prefix*: the page holding tokens
``[k*P, (k+1)*P)`` of a request is ``Key(tokens[:(k+1)*P], namespace)``. Two keys in
different namespaces are different keys, so they can never name the same page.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Key:
    """Token ids and the namespace (SGLang's ``extra_key``) they live in."""

    tokens: tuple[int, ...]
    namespace: str | None = None


def page_aligned_length(key: Key, page_size: int) -> int:
    """Tokens of ``key`` that fill whole pages; a partial tail page is never cached."""
    return len(key.tokens) - len(key.tokens) % page_size


def page_keys(key: Key, page_size: int) -> tuple[Key, ...]:
    """The pages along ``key``, root-most first."""
    end = page_aligned_length(key, page_size)
    return tuple(
        Key(key.tokens[:n], key.namespace) for n in range(page_size, end + 1, page_size)
    )


def parent_page(page: Key, page_size: int) -> Key | None:
    """The page before ``page`` on its path, or None for a first page."""
    if len(page.tokens) <= page_size:
        return None
    return Key(page.tokens[:-page_size], page.namespace)


def content_at(key: Key, position: int) -> Key:
    """What the KV at token ``position`` of ``key`` depends on: the prefix up to it."""
    return Key(key.tokens[: position + 1], key.namespace)


def sort_key(key: Key) -> tuple[bool, str, tuple[int, ...]]:
    """A total order on keys, for deterministic iteration (None namespace first)."""
    return (key.namespace is not None, key.namespace or "", key.tokens)
