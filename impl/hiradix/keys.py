"""Radix keys: token ids in a namespace, matched page by page (spec/01, "Keys").

A key keeps its tokens packed as native int64 bytes, for matching: comparing two spans of
packed tokens is one ``memcmp`` without copying either (``bytes.startswith`` at an
offset), where comparing tuples compares ints one by one, tens of times slower on a shared
prefix of 8-32 k tokens (issue 13). The common prefix of two keys is found by binary
search over pages, never token by token.

A scheduler builds a key per request, so building one is on every request's path (issue
29). The packed bytes are the key's one required form, made in a single pass: from a list
or tuple by ``hiradix._tokens`` (C, one pass that also refuses any element that is not an
int in the int64 range) or, where that is not built, by the Python version below. A
contiguous int64 tensor on the CPU or int64 buffer (``array('q')``, SGLang's form of a
request's tokens; a numpy array) is **borrowed**, not copied: the key reads its bytes in
place through a read-only view, the dtype being the range check (a 33 k-token copy was
most of a long prompt's key, issue 29). Other tensors and buffers are copied once. The
tuple of Python ints (``tokens``) is made only when asked for, from whichever form is at
hand; a match reads just the first page of each segment.

Borrowing is a contract with the caller, as SGLang's own key (which keeps the caller's
list) has: the tokens must not change while the key is in use. Python enforces half of
it, refusing to resize an ``array`` that a view exports; the tree never keeps a borrowed
view, it copies the tokens it caches (``RadixKey.packed_span``).
"""

from __future__ import annotations

import operator
import os
from array import array
from typing import Any, NoReturn

import torch

from hiradix.errors import InvalidArgument

try:
    from hiradix import _tokens
except ImportError:  # no C compiler at install time: the Python packing below serves
    _tokens = None  # type: ignore[assignment]

# (namespace, the segment's first page packed): bytes hash and compare in one C call, and
# a key's page is a slice of its packed bytes, with no int objects made to look a child up.
ChildKey = tuple[str | None, bytes]
# What RadixKey accepts: a tuple, list or range of ints, a 1-D integer tensor, or a 1-D
# integer buffer (array('q'), a numpy array, a memoryview: any object with the buffer
# protocol, which typing spells only from Python 3.12 on).
TokenIds = tuple[int, ...] | list[int] | range | torch.Tensor | array | memoryview | Any

INT64_MIN, INT64_MAX = -(2**63), 2**63 - 1
TOKEN_BYTES = 8  # a packed token: a native int64 (array "q")
assert array("q").itemsize == TOKEN_BYTES

# HIRADIX_CORE=python (hiradix._slots) also keeps keys on the Python packing, so that the
# tests run on the torch core check the readable version of this too.
_C_PACK = None if _tokens is None or os.environ.get("HIRADIX_CORE") == "python" \
    else _tokens.pack


def pack(tokens: tuple[int, ...] | list[int]) -> bytes:
    """``tokens`` (ints in the int64 range) as native int64 bytes, for ``common_pages``."""
    return array("q", tokens).tobytes()


_INTEGER_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64})
_SIGNED_FORMATS = frozenset("bhilq")  # buffer formats (struct codes) of signed ints
_UNSIGNED_FORMATS = frozenset("BHILQ")


def _refuse(argument: str, why: str) -> NoReturn:
    raise InvalidArgument(argument, why)


def _packed_sequence(tokens: tuple[Any, ...] | list[Any]) -> tuple[bytes, bool]:
    """A list or tuple of token ids packed, and whether its items were all exact ints (so
    that a tuple of them is a key's ``tokens`` as it is); ``InvalidArgument`` naming
    ``tokens[i]`` for the first that is not an int (a bool is not) in the int64 range.

    The fast path is the C pass (``_C_PACK``); without it, two C-level passes: the set of
    the element types, then packing, which refuses an int outside the int64 range. Either
    falls back on the slow path below, which finds the token to name.
    """
    if _C_PACK is not None:
        packed = _C_PACK(tokens)
        if packed is not None:
            return packed, True
    elif set(map(type, tokens)) <= {int}:
        try:
            return pack(tokens), True
        except OverflowError:
            pass  # the slow path names the token
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
            _refuse(f"tokens[{index}]", f"{value} is outside the int64 range")
        checked.append(value)
    return pack(checked), False


def _borrowed(exporter: object) -> memoryview:
    """The read-only byte view of a C-contiguous int64 buffer, which a key borrows."""
    return memoryview(exporter).cast("B").toreadonly()  # type: ignore[arg-type]


def _packed_tensor(tokens: torch.Tensor) -> bytes | memoryview:
    """A 1-D integer tensor's tokens packed: borrowed where it is a contiguous int64 CPU
    tensor, else one copy of its bytes as int64 on the CPU; every integer dtype torch has
    is in the int64 range."""
    if tokens.dim() != 1 or tokens.dtype not in _INTEGER_DTYPES:
        _refuse("tokens", f"a tensor of tokens must be 1-D with an integer dtype, got a "
                          f"{tokens.dim()}-D {tokens.dtype} tensor")
    if tokens.dtype is torch.int64 and tokens.is_cpu and tokens.is_contiguous():
        return _borrowed(tokens.numpy())
    if tokens.device.type == "meta":
        _refuse("tokens", "a tensor on the meta device holds no values")
    as_int64 = tokens.to(device="cpu", dtype=torch.int64).contiguous()
    return as_int64.numpy().tobytes()


def _packed_buffer(tokens: object) -> bytes | memoryview:
    """A 1-D integer buffer's tokens packed: borrowed where it holds native int64s
    contiguously, one copy where they are strided, else through its values (unsigned
    64-bit ones range-checked)."""
    view = memoryview(tokens)  # type: ignore[arg-type]
    code = view.format.lstrip("@=")
    if view.ndim != 1 or code not in _SIGNED_FORMATS | _UNSIGNED_FORMATS:
        _refuse("tokens", f"a buffer of tokens must be 1-D of integers, got {view.ndim}-D "
                          f"with format {view.format!r}")
    if code in "lq" and view.itemsize == TOKEN_BYTES:
        return _borrowed(view) if view.c_contiguous else view.tobytes()
    values = view.tolist()
    if code in "LQ" and values and max(values) > INT64_MAX:
        index = next(i for i, v in enumerate(values) if v > INT64_MAX)
        _refuse(f"tokens[{index}]", f"{values[index]} is outside the int64 range")
    return pack(values)


def _checked(tokens: object) -> tuple[tuple[int, ...] | None, bytes | memoryview]:
    """``tokens`` packed (``pack``), with the tuple of ints where it shares the caller's
    int objects (a tuple or list of exact ints: the tuple itself, or a copy of the list's
    pointers, so the tree's segments hold no int objects of their own); raise
    ``InvalidArgument`` naming ``tokens`` (or ``tokens[i]``) for anything else. From a
    tensor or buffer the tuple is made only when asked for (``tokens``, ``span``)."""
    if type(tokens) is tuple:
        packed, exact = _packed_sequence(tokens)  # type: ignore[arg-type]
        return (tokens if exact else None), packed  # type: ignore[return-value]
    if type(tokens) is list:
        packed, exact = _packed_sequence(tokens)
        return (tuple(tokens) if exact else None), packed
    if isinstance(tokens, torch.Tensor):
        return None, _packed_tensor(tokens)
    if isinstance(tokens, range):
        if tokens and not (min(tokens) >= INT64_MIN and max(tokens) <= INT64_MAX):
            _refuse("tokens", f"{tokens!r} leaves the int64 range")
        return None, pack(tokens)  # type: ignore[arg-type]
    if isinstance(tokens, tuple | list):  # subclasses: their items go through the checks
        return None, _packed_sequence(tokens)[0]
    if not isinstance(tokens, str | bytes | bytearray):  # text and bytes are no token ids
        try:
            memoryview(tokens)  # type: ignore[arg-type]
        except TypeError:
            pass
        else:
            return None, _packed_buffer(tokens)
    _refuse("tokens", f"must be a tuple, list, range, 1-D integer tensor or 1-D integer "
                      f"buffer of token ids, got {type(tokens).__name__}")


class RadixKey:
    """A request's token ids and namespace (SGLang's ``extra_key``), validated at
    construction (issue 12): ``tokens`` may be a tuple, list or range of ints, a 1-D
    integer tensor or a 1-D integer buffer (``array('q')``, a numpy array), every token in
    the int64 range; ``namespace`` is a str or None. Anything else raises
    ``InvalidArgument`` naming the argument. Immutable: the key copies what it is given,
    except a contiguous int64 buffer or CPU tensor, which it borrows (read in place; the
    caller must not change those tokens while the key is in use, see the module's note).

    ``tokens`` is the tuple of Python ints; ``packed`` the same as native int64 bytes (a
    read-only byte view where borrowed); ``len(key)`` their number. Two keys are equal
    when their tokens and namespaces are."""

    __slots__ = ("_tokens", "_view", "length", "namespace", "packed")

    _tokens: tuple[int, ...] | None
    _view: memoryview | None
    length: int
    namespace: str | None
    packed: bytes | memoryview

    def __init__(self, tokens: TokenIds, namespace: str | None = None) -> None:
        if namespace is not None and not isinstance(namespace, str):
            _refuse("namespace", f"must be a str or None, got {type(namespace).__name__}")
        # The scheduler's case inline (a list of exact ints, packed by the C pass): a key
        # is built per request, and the calls of the general path cost as much again.
        # SGLang's scheduler holds a request's tokens as array('q'): borrowed in place.
        packed: bytes | memoryview | None = (
            _C_PACK(tokens) if type(tokens) is list and _C_PACK is not None else None)
        as_tuple: tuple[int, ...] | None = None
        if packed is not None:
            as_tuple = tuple(tokens)  # type: ignore[arg-type]
        elif type(tokens) is array and tokens.typecode == "q":  # type: ignore[union-attr]
            packed = _borrowed(tokens)
        else:
            as_tuple, packed = _checked(tokens)
        _SET_TOKENS(self, as_tuple)
        _SET_VIEW(self, None)
        _SET_PACKED(self, packed)
        _SET_LENGTH(self, len(packed) // TOKEN_BYTES)
        _SET_NAMESPACE(self, namespace)

    def __setattr__(self, name: str, value: object) -> NoReturn:
        raise AttributeError(f"a RadixKey is immutable: cannot set {name!r}")

    def __delattr__(self, name: str) -> NoReturn:
        raise AttributeError(f"a RadixKey is immutable: cannot delete {name!r}")

    @property
    def tokens(self) -> tuple[int, ...]:
        """The token ids as a tuple of Python ints (made on first use where the key was
        built from a tensor or buffer)."""
        if self._tokens is None:
            _SET_TOKENS(self, tuple(self._ints()))
        return self._tokens  # type: ignore[return-value]

    def _ints(self) -> memoryview:
        """The packed tokens read as int64s, without a copy."""
        if self._view is None:
            _SET_VIEW(self, memoryview(self.packed).cast("q"))
        return self._view  # type: ignore[return-value]

    def span(self, start: int, end: int) -> tuple[int, ...]:
        """``tokens[start:end]``, without making the whole tuple where it is not made."""
        if self._tokens is not None:
            return self._tokens[start:end]
        return tuple(self._ints()[start:end])

    def packed_span(self, start: int, end: int) -> bytes:
        """Tokens ``start:end`` packed, as bytes of their own: what a tree node keeps (a
        borrowed key's view is the caller's memory, never the tree's)."""
        return bytes(self.packed[start * TOKEN_BYTES:end * TOKEN_BYTES])

    def __len__(self) -> int:
        return self.length

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, RadixKey):
            return NotImplemented
        return self.namespace == other.namespace and self.packed == other.packed

    def __hash__(self) -> int:
        return hash((self.namespace, bytes(self.packed)))  # a borrowed view may not hash

    def __repr__(self) -> str:
        return f"RadixKey(tokens={self.tokens!r}, namespace={self.namespace!r})"

    def __reduce__(self) -> tuple[type[RadixKey], tuple[tuple[int, ...], str | None]]:
        return RadixKey, (self.tokens, self.namespace)

    def aligned_length(self, page_size: int) -> int:
        """Tokens that fill whole pages; the partial tail page is never cached."""
        return self.length - self.length % page_size


# The slots' own setters: ``__setattr__`` refuses every assignment after construction.
_SET_TOKENS = RadixKey._tokens.__set__  # type: ignore[attr-defined]
_SET_VIEW = RadixKey._view.__set__  # type: ignore[attr-defined]
_SET_PACKED = RadixKey.packed.__set__  # type: ignore[attr-defined]
_SET_LENGTH = RadixKey.length.__set__  # type: ignore[attr-defined]
_SET_NAMESPACE = RadixKey.namespace.__set__  # type: ignore[attr-defined]


def child_key(namespace: str | None, packed: bytes | memoryview, start: int,
              page_size: int) -> ChildKey:
    """The key under which a segment starting at token ``start`` of the packed tokens
    ``packed`` hangs from its parent: its first page, packed.

    The namespace is part of it, so two namespaces never share a child slot. A borrowed
    key's page is copied out of its view (a view of an unhashable exporter such as an
    ``array`` does not hash); ``bytes`` of a bytes slice is that slice, no second copy.
    """
    return (namespace, bytes(packed[start * TOKEN_BYTES:(start + page_size) * TOKEN_BYTES]))


def holds_at(tokens: bytes | memoryview, offset: int, part: bytes) -> bool:
    """Whether the packed ``tokens`` hold ``part`` from byte ``offset``: one ``memcmp`` in
    place. Bytes compare at an offset (``startswith``); a borrowed view is sliced (a view
    again, no copy) and given to ``part.startswith``, which takes any buffer."""
    if type(tokens) is bytes:
        return tokens.startswith(part, offset)
    width = len(part)
    return len(tokens) - offset >= width and part.startswith(tokens[offset:offset + width])


def common_pages(segment: bytes, tokens: bytes | memoryview, start: int, page_size: int,
                 stop: int | None = None) -> int:
    """Tokens (a multiple of ``page_size``) that the packed ``segment`` shares with the
    packed ``tokens`` from token ``start`` (up to token ``stop``, if given).

    O(log pages) ``memcmp``s (``holds_at``), and a whole segment that matches (the common
    case along a cached path) is compared without a copy.
    """
    width = TOKEN_BYTES
    limit = min(len(segment), (len(tokens) if stop is None else stop * width) - start * width)
    limit //= width
    limit -= limit % page_size
    offset = start * width
    if holds_at(tokens, offset, segment if limit * width == len(segment) else
                segment[:limit * width]):
        return limit
    low, high = 0, limit // page_size - 1  # pages known equal / an upper bound that differs
    while low < high:
        middle = (low + high + 1) // 2
        if holds_at(tokens, offset, segment[:middle * page_size * width]):
            low = middle
        else:
            high = middle - 1
    return low * page_size
