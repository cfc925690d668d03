"""evict_full and evict_states (spec/13m, 13m.3): validate the victims an engine reports."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from hiradix_model.components import run_victims
from hiradix_model.errors import IllegalChoice, PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import MambaState, full_leaves, state_candidates


def _delete(state: MambaState, page: Key) -> MambaState:
    record = state.pages[page]
    pages = {k: p for k, p in state.pages.items() if k != page}
    states = set() if record.state is None else {record.state}
    return replace(state, pages=pages, full_free=state.full_free | set(record.full),
                   state_free=state.state_free | states)


def _drop_state(state: MambaState, page: Key) -> MambaState:
    """A full leaf goes whole; any other page keeps its full KV, loses its state."""
    if page in full_leaves(state):
        return _delete(state, page)
    record = state.pages[page]
    assert record.state is not None
    return replace(state, pages={**state.pages, page: replace(record, state=None)},
                   state_free=state.state_free | {record.state})


def _full_freed(before: MambaState, after: MambaState) -> int:
    return len(after.full_free) - len(before.full_free)


def _states_freed(before: MambaState, after: MambaState) -> int:
    return len(after.state_free) - len(before.state_free)


def evict_full(state: MambaState, target: int,
               victims: Sequence[Key]) -> tuple[MambaState, int]:
    """Delete full leaves, in the reported order, until ``target`` full tokens are free.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].full_free) - len(state.full_free)
    raises: PreconditionError, IllegalChoice
    """
    return run_victims(state, target, victims, argument="target",
                       page_size=state.config.page_size, allowed=full_leaves, take=_delete,
                       freed=_full_freed, enough=True)


def evict_states(state: MambaState, target: int,
                 victims: Sequence[Key]) -> tuple[MambaState, int]:
    """Take unlocked states, in the reported order, until ``target`` states are free.

    pre: not check(state)
    post: not check(__return__[0])
    post: __return__[1] == len(__return__[0].state_free) - len(state.state_free)
    raises: PreconditionError, IllegalChoice
    """
    # The rest of a deleted leaf's node goes with it, state or none.
    return run_victims(state, target, victims, argument="target",
                       page_size=state.config.page_size, allowed=state_candidates,
                       take=_drop_state, freed=_states_freed, enough=True,
                       rest_allowed=lambda s, page: page in full_leaves(s))


def evict_for_alloc(state: MambaState, full_need: int, state_need: int,
                    victims: Sequence[Key]) -> tuple[MambaState, int]:
    """An allocator short of room, one pool per call (13m.3): ``evict_full`` of
    ``full_need`` or ``evict_states`` of ``state_need``; what that pool got back.

    pre: not check(state)
    post: not check(__return__[0])
    raises: PreconditionError, IllegalChoice
    """
    for name, need in (("full_need", full_need), ("state_need", state_need)):
        if isinstance(need, bool) or not isinstance(need, int) or need < 0:
            raise PreconditionError(name, f"must be an int >= 0, got {need!r}")
    if (full_need > 0) == (state_need > 0):
        raise PreconditionError("full_need", f"exactly one pool is short per call, got "
                                             f"{full_need} and state_need={state_need}")
    if full_need:
        return evict_full(state, full_need, victims)
    return evict_states(state, state_need, victims)
