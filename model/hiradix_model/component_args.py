"""Argument checks shared by the component models (hybrid, mamba); each raises PreconditionError."""

from __future__ import annotations

from collections.abc import Sequence

from hiradix_model.errors import PreconditionError
from hiradix_model.keys import Key


def require(condition: bool, argument: str, reason: str) -> None:
    if not condition:
        raise PreconditionError(argument, reason)


def require_key(key: object, argument: str = "key") -> None:
    require(isinstance(key, Key) and isinstance(key.tokens, tuple), argument, "must be a Key")
    assert isinstance(key, Key)
    require(all(isinstance(t, int) for t in key.tokens), argument, "tokens must be ints")


def require_slots(slots: object, argument: str) -> Sequence[int]:
    require(isinstance(slots, tuple) and all(isinstance(s, int) for s in slots), argument,
            "must be a tuple of ints")
    assert isinstance(slots, tuple)
    require(len(set(slots)) == len(slots), argument, "must be distinct")
    return slots


def require_whole_pages(slots: Sequence[int], page_size: int, argument: str) -> None:
    """Whole pages of a page allocator, each in order (R7 of spec/03)."""
    require(len(slots) % page_size == 0, argument, f"must be whole pages of {page_size}")
    for start in range(0, len(slots), page_size):
        first = slots[start]
        page = slots[start:start + page_size]
        require(first % page_size == 0 and all(s == first + i for i, s in enumerate(page)),
                argument, f"{tuple(page)} is not one page in order")


def require_free(slots: object, free: frozenset[int], count: int, argument: str,
                 page_size: int) -> None:
    """``slots`` are ``count`` distinct slots of ``free``, whole pages in order (R7)."""
    checked = require_slots(slots, argument)
    require(len(checked) == count, argument, f"must be {count} slots")
    require_whole_pages(checked, page_size, argument)
    require(set(checked) <= free, argument, "are not all free slots of their pool")


def require_optional_slot(slot: object, free: frozenset[int], needed: bool,
                          argument: str) -> None:
    """``slot`` is a slot of ``free`` where one is ``needed``, else None."""
    if not needed:
        require(slot is None, argument, "must be None: there is nothing to put in it")
        return
    require(isinstance(slot, int) and not isinstance(slot, bool), argument, "must be an int")
    require(slot in free, argument, f"slot {slot!r} is not a free slot of its pool")
