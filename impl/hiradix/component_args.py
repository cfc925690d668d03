"""Argument and configuration checks the component caches share (``hiradix.hybrid``,
spec/13; ``hiradix.mamba``, spec/13m). Each raises the typed error naming the argument,
before the caller changes anything."""

from __future__ import annotations

from collections.abc import Callable, Mapping

import torch

from hiradix._slots import is_int
from hiradix.config import KVShape
from hiradix.errors import ConfigError, InvalidArgument, SlotError


def check_tokens(tokens: object, argument: str) -> tuple[int, ...]:
    """A key's token ids: a list or tuple of ints (not bools)."""
    if not isinstance(tokens, list | tuple):
        raise InvalidArgument(argument, f"must be a list or tuple of ints, got "
                                        f"{type(tokens).__name__}")
    for index, token in enumerate(tokens):
        if not is_int(token):
            raise InvalidArgument(argument, f"[{index}] must be an int, got "
                                            f"{type(token).__name__}")
    return tuple(tokens)


def check_count(value: object, argument: str) -> int:
    """A count: an int >= 0."""
    if not is_int(value):
        raise InvalidArgument(argument, f"must be an int, got {type(value).__name__}")
    assert isinstance(value, int)
    if value < 0:
        raise InvalidArgument(argument, f"must be >= 0, got {value}")
    return value


def check_page_runs(slots: torch.Tensor, page_size: int, argument: str) -> None:
    """Each run of ``page_size`` entries is one pool page's slots in order (R7 of spec/03;
    the tree-well-formed invariants need it of every copy a tree takes)."""
    if slots.numel() % page_size:
        raise SlotError(argument, f"length {slots.numel()} is not whole pages of {page_size}")
    if page_size == 1 or slots.numel() == 0:
        return
    groups = slots.view(-1, page_size)
    first = groups[:, 0]
    offsets = torch.arange(page_size, dtype=torch.int64)
    whole = (first % page_size == 0) & (groups == first[:, None] + offsets).all(dim=1)
    if not bool(whole.all()):
        index = int((~whole).nonzero()[0])
        raise SlotError(argument, f"entries [{index * page_size}, {(index + 1) * page_size}) "
                                  f"= {groups[index].tolist()} are not one page's slots in "
                                  "order")


def check_cache_config(page_size: object, paged_pools: Mapping[str, object], clock: object,
                       kv: object) -> None:
    """What every component cache's constructor takes: a page size, pools of whole
    pages (name -> slots), an int clock, an optional ``KVShape``."""
    if not is_int(page_size) or not isinstance(page_size, int) or page_size < 1:
        raise ConfigError("page_size", f"must be an int >= 1, got {page_size!r}")
    for name, value in paged_pools.items():
        if not is_int(value) or not isinstance(value, int) or value < page_size \
                or value % page_size:
            raise ConfigError(name, f"must be a positive multiple of page_size "
                                    f"{page_size}, got {value!r}")
    if not callable(clock):
        raise ConfigError("clock", f"must be a callable returning an int tick, got "
                                   f"{type(clock).__name__}")
    if kv is not None and not isinstance(kv, KVShape):
        raise ConfigError("kv", f"must be a KVShape, got {type(kv).__name__}")


def read_tick(clock: Callable[[], int]) -> int:
    """Read the injected clock (after the arguments are checked, before any change)."""
    tick = clock()
    if not is_int(tick):
        raise ConfigError("clock", f"returned {tick!r}, not an int tick")
    return tick
