"""match_prefix (spec/13m, 13m.3): the deepest cached page holding a state."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.component_args import require_key
from hiradix_model.components import cached_run
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.keys import Key
from hiradix_model.mamba.invariants import check  # noqa: F401 (contracts)
from hiradix_model.mamba.state import MambaState


@dataclass(frozen=True)
class MambaMatch:
    full_slots: tuple[int, ...]  # the full slots of the pages root .. last_page
    last_page: Key | None  # the deepest cached page of the key holding a state; None: root
    full_hit: int  # tokens of the key in the longest run of cached pages


def match_prefix(state: MambaState, key: Key) -> MambaMatch:
    """The longest prefix of ``key`` a request can resume after: cached, and ending at a
    page holding a state. Changes nothing.

    pre: not check(state)
    post: __return__.last_page is None or state.pages[__return__.last_page].state is not None
    post: len(__return__.full_slots) <= __return__.full_hit
    raises: PreconditionError
    """
    require_key(key)
    cached = cached_run(state.pages, key, state.config.page_size)
    full_hit = len(cached) * state.config.page_size
    while cached and state.pages[cached[-1]].state is None:
        cached.pop()
    slots = tuple(s for page in cached for s in state.pages[page].full)
    return MambaMatch(full_slots=slots, last_page=cached[-1] if cached else None,
                      full_hit=full_hit)
