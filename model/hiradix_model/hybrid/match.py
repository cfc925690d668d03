"""match_prefix (spec/13, 13.3): the deepest cached page whose window is live."""

from __future__ import annotations

from dataclasses import dataclass

from hiradix_model.component_args import require_key
from hiradix_model.components import cached_run
from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.hybrid.invariants import check  # noqa: F401 (contracts)
from hiradix_model.hybrid.state import SwaState, window_live
from hiradix_model.keys import Key


@dataclass(frozen=True)
class SwaMatch:
    full_slots: tuple[int, ...]  # the full slots of the matched pages, root first
    last_page: Key | None  # the deepest matched page; None: the root


def match_prefix(state: SwaState, key: Key) -> SwaMatch:
    """The longest prefix of ``key`` a request can resume after: cached, and ending in a
    page whose whole window is live. Changes nothing.

    pre: not check(state)
    post: __return__.last_page is None or window_live(state, __return__.last_page)
    post: len(__return__.full_slots) % state.config.page_size == 0
    raises: PreconditionError
    """
    require_key(key)
    cached = cached_run(state.pages, key, state.config.page_size)
    while cached and not window_live(state, cached[-1]):
        cached.pop()
    slots = tuple(s for page in cached for s in state.pages[page].full)
    return SwaMatch(full_slots=slots, last_page=cached[-1] if cached else None)
