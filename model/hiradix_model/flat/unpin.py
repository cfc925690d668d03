"""unpin (spec/15, 15.5.3): release every pin a lookup holds."""

from __future__ import annotations

from dataclasses import replace

from hiradix_model.errors import PreconditionError  # noqa: F401 (contracts)
from hiradix_model.flat.args import require_live
from hiradix_model.flat.invariants import check  # noqa: F401 (contracts)
from hiradix_model.flat.state import FlatState
from hiradix_model.flat.touch import pinned


def unpin(state: FlatState, lookup_id: str) -> FlatState:
    """Release the pins of the live lookup ``lookup_id`` and forget it
    (cache_engine.py:1573-1577). With every lookup released, every pin is zero.

    pre: not check(state)
    post: not check(__return__)
    post: lookup_id not in __return__.lookups
    raises: PreconditionError
    """
    name = require_live(state, lookup_id)
    after = pinned(state, state.lookups[name], -1)
    return replace(after, lookups={k: v for k, v in state.lookups.items() if k != name})
