"""Radix keys: token ids in a namespace, matched page by page (spec/01, "Keys").

Tokens are kept as tuples (child keys, page names, events) and, packed as native int64
bytes, for matching: comparing two spans of packed tokens is one ``memcmp`` without
copying either (``bytes.startswith`` at an offset), where comparing tuples compares ints
one by one, tens of times slower on a shared prefix of 8-32 k tokens (issue 13). The
common prefix of two keys is found by binary search over pages, never token by token.
"""

from __future__ import annotations

import operator
from array import array
from dataclasses import dataclass, field

import torch

from hiradix.errors import InvalidArgument

ChildKey = tuple[str | None, tuple[int, ...]]  # (namespace, first page of the segment)
TokenIds = tuple[int, ...] | list[int] | range | torch.Tensor  # what RadixKey accepts


INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_BYTES = 8  # a packed token: a native int64 (array "q")
assert array("q").itemsize == TOKEN_BYTES


def pack(tokens: tuple[int, ...] | list[int]) -> bytes:
    """``tokens`` (ints in the int64 range) as native int64 bytes, for ``common_pages``."""
    return array("q", tokens).tobytes()


def _checked_tokens(tokens: object) -> tuple[tuple[int, ...], bytes]:
    """``tokens`` as a tuple of Python ints in the int64 range, and packed (``pack``);
    raise ``InvalidArgument`` naming ``tokens`` (or ``tokens[i]``) otherwise.

    The fast path (a tuple or list of plain ints) is two C-level passes: the set of the
    element types, then packing, which refuses an int outside the int64 range. Everything
    else takes the slow path, which also finds the first bad token for the message.
    """
    if isinstance(tokens, torch.Tensor):
        if tokens.dim() != 1 or tokens.dtype not in _INTEGER_DTYPES:
            raise InvalidArgument("tokens", f"a tensor of tokens must be 1-D with an integer "
                                            f"dtype, got a {tokens.dim()}-D {tokens.dtype} "
                                            "tensor")
        if tokens.device.type == "meta":
            raise InvalidArgument("tokens", "a tensor on the meta device holds no values")
        as_tuple = tuple(tokens.tolist())  # an integer dtype is in the int64 range
        return as_tuple, pack(as_tuple)
    if type(tokens) is tuple or type(tokens) is list:
        if not tokens:
            return (), b""
        if set(map(type, tokens)) == {int}:
            try:
                return tuple(tokens), pack(tokens)
            except OverflowError:
                pass  # the slow path names the token
    elif isinstance(tokens, range):
        if tokens and not (min(tokens) >= INT64_MIN and max(tokens) <= INT64_MAX):
            raise InvalidArgument("tokens", f"{tokens!r} leaves the int64 range")
        as_tuple = tuple(tokens)
        return as_tuple, pack(as_tuple)
    elif not isinstance(tokens, tuple | list):
        raise InvalidArgument("tokens", f"must be a tuple, list, range or 1-D integer tensor "
                                        f"of token ids, got {type(tokens).__name__}")
    checked = []
    for index, token in enumerate(tokens):  # the slow path: subclasses, numpy ints, errors
        try:
            if isinstance(token, bool):
                raise TypeError("a bool is no token id")
            value = operator.index(token)  # ints, numpy and 0-d torch integers
        except TypeError as error:  # also a float tensor's own __index__ refusal
            raise InvalidArgument(f"tokens[{index}]", f"must be an int token id, got "
                                                      f"{token!r} ({type(token).__name__})"
                                  ) from error
        if not INT64_MIN <= value <= INT64_MAX:
            raise InvalidArgument(f"tokens[{index}]", f"{value} is outside the int64 range")
        checked.append(value)
    return tuple(checked), pack(checked)


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})


@dataclass(frozen=True, slots=True, init=False)
class RadixKey:
    """A request's token ids and namespace (SGLang's ``extra_key``), validated at
    construction (issue 12): ``tokens`` may be a tuple, list, range or 1-D integer tensor
    and is stored as a tuple of Python ints in the int64 range; ``namespace`` is a str or
    None. Anything else raises ``InvalidArgument`` naming the argument."""

    tokens: tuple[int, ...]
    namespace: str | None = None
    packed: bytes = field(default=b"", compare=False, repr=False)  # pack(tokens)

    def __init__(self, tokens: TokenIds, namespace: str | None = None) -> None:
        if namespace is not None and not isinstance(namespace, str):
            raise InvalidArgument("namespace", f"must be a str or None, got "
                                               f"{type(namespace).__name__}")
        checked, packed = _checked_tokens(tokens)
        object.__setattr__(self, "tokens", checked)
        object.__setattr__(self, "namespace", namespace)
        object.__setattr__(self, "packed", packed)

    def aligned_length(self, page_size: int) -> int:
        """Tokens that fill whole pages; the partial tail page is never cached."""
        return len(self.tokens) - len(self.tokens) % page_size


def child_key(namespace: str | None, tokens: tuple[int, ...], start: int,
              page_size: int) -> ChildKey:
    """The key under which a segment starting at ``tokens[start]`` hangs from its parent.

    The namespace is part of it, so two namespaces never share a child slot.
    """
    return (namespace, tokens[start:start + page_size])


def common_pages(segment: bytes, tokens: bytes, start: int, page_size: int,
                 stop: int | None = None) -> int:
    """Tokens (a multiple of ``page_size``) that the packed ``segment`` shares with the
    packed ``tokens`` from token ``start`` (up to token ``stop``, if given).

    O(log pages) ``memcmp``s: ``startswith`` at an offset compares in place, and a whole
    segment that matches (the common case along a cached path) is compared without a copy.
    """
    width = TOKEN_BYTES
    limit = min(len(segment), (len(tokens) if stop is None else stop * width) - start * width)
    limit //= width
    limit -= limit % page_size
    offset = start * width
    if tokens.startswith(segment if limit * width == len(segment) else
                         segment[:limit * width], offset):
        return limit
    low, high = 0, limit // page_size - 1  # pages known equal / an upper bound that differs
    while low < high:
        middle = (low + high + 1) // 2
        if tokens.startswith(segment[:middle * page_size * width], offset):
            low = middle
        else:
            high = middle - 1
    return low * page_size
