"""evict_full and evict_swa (spec/13, 13.3): validate the victims an engine reports."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import replace

from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid._args import require
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaState, full_leaves, swa_candidates
from hiradix_model.keys import Key, parent_page


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


def _run(state: SwaState, num_tokens: int, victims: Sequence[Key],
         allowed: Callable[[SwaState], set[Key]], take: Callable[[SwaState, Key], SwaState],
         freed: Callable[[SwaState, SwaState], int], enough: bool) -> tuple[SwaState, int]:
    require(isinstance(num_tokens, int) and num_tokens >= 0, "num_tokens", "must be an int >= 0")
    done = 0
    previous: Key | None = None
    for index, victim in enumerate(victims):
        # Past the target only the rest of the previous victim's node may follow.
        rest = previous is not None and parent_page(previous, state.config.page_size) == victim
        if done >= num_tokens and not rest:
            raise IllegalChoice(f"victims[{index}]: {victim} taken after {num_tokens} were "
                                "freed; only the rest of the previous victim's node may follow")
        if victim not in allowed(state):
            raise IllegalChoice(f"victims[{index}]: {victim} may not be taken now")
        after = take(state, victim)
        done += freed(state, after)
        state = after
        previous = victim
    if enough and done < num_tokens and allowed(state):
        raise IllegalChoice(f"victims: freed {done} < {num_tokens} while "
                            f"{len(allowed(state))} pages could still go")
    return state, done


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
    return _run(state, num_tokens, victims, full_leaves, _delete, _full_freed, True)


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
    return _run(state, num_tokens, victims, swa_candidates, _take_swa, _swa_freed, enough)
