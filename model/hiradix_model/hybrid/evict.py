"""evict_full and evict_swa (spec/13, 13.3): validate the victims an engine reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hiradix_model.component_args import require
from hiradix_model.components import run_victims
from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaState, full_leaves, swa_candidates
from hiradix_model.keys import Key


def _delete(state: SwaState, page: Key) -> SwaState:
    record = state.pages[page]
    pages = {k: p for k, p in state.pages.items() if k != page}
    return replace(state, pages=pages, full_free=state.full_free | set(record.full),
                   swa_free=state.swa_free | set(record.swa or ()))


def _tombstone(state: SwaState, page: Key) -> SwaState:
    record = state.pages[page]
    assert record.swa is not None
    pages = {**state.pages, page: replace(record, swa=None)}
    return replace(state, pages=pages, swa_free=state.swa_free | set(record.swa))


def _full_freed(before: SwaState, after: SwaState) -> int:
    return len(after.full_free) - len(before.full_free)


def _swa_freed(before: SwaState, after: SwaState) -> int:
    return len(after.swa_free) - len(before.swa_free)


def evict_full(state: SwaState, num_tokens: int, victims: Sequence[Key]) -> tuple[SwaState, int]:
    """Delete full leaves, in the reported order, until ``num_tokens`` full tokens are free.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].full_free) - len(state.full_free)
    raises: PreconditionError, IllegalChoice
    """
    return run_victims(state, num_tokens, victims, argument="num_tokens",
                       page_size=state.config.page_size, allowed=full_leaves, take=_delete,
                       freed=_full_freed, enough=True)


def _take_swa(state: SwaState, page: Key) -> SwaState:
    """A full leaf goes whole; any other page becomes a tombstone."""
    return _delete(state, page) if page in full_leaves(state) else _tombstone(state, page)


def evict_swa(state: SwaState, num_tokens: int, victims: Sequence[Key],
              *, enough: bool = True) -> tuple[SwaState, int]:
    """Take live pages' SWA copies, in the reported order, until ``num_tokens`` SWA tokens
    are free. ``enough=False`` drops the rule that a short eviction left nothing to take:
    for an engine whose SWA locks cover whole nodes (DEV-H1) the machine checks the
    engine's own evictable count instead.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].swa_free) - len(state.swa_free)
    raises: PreconditionError, IllegalChoice
    """
    require(isinstance(enough, bool), "enough", "must be a bool")
    return run_victims(state, num_tokens, victims, argument="num_tokens",
                       page_size=state.config.page_size, allowed=swa_candidates,
                       take=_take_swa, freed=_swa_freed, enough=enough)


def evict_for_alloc(state: SwaState, full_need: int, swa_need: int, victims: Sequence[Key],
                    split: int, *, enough: bool = True) -> tuple[SwaState, int]:
    """An allocation's eviction: the first ``split`` victims as ``evict_full(full_need)``,
    the rest as ``evict_swa`` of what the SWA pool still lacks of ``|swa_free| + swa_need``
    (the target fixed at the call). Returns the state and the full tokens freed (13.3).

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].full_free) - len(state.full_free)
    raises: PreconditionError, IllegalChoice
    """
    require(isinstance(full_need, int) and full_need >= 0, "full_need", "must be an int >= 0")
    require(isinstance(swa_need, int) and swa_need >= 0, "swa_need", "must be an int >= 0")
    require(isinstance(split, int) and 0 <= split <= len(victims), "split",
            f"must be an int in [0, {len(victims)}]")
    swa_target = len(state.swa_free) + swa_need
    after_full, _ = evict_full(state, full_need, victims[:split])
    short = max(0, swa_target - len(after_full.swa_free))
    after, _ = evict_swa(after_full, short, victims[split:], enough=enough)
    return after, len(after.full_free) - len(state.full_free)
