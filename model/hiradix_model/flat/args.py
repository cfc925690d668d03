"""Argument checks of the flat-tier operations; each raises PreconditionError."""

from __future__ import annotations

from hiradix_model.component_args import require
from hiradix_model.flat.state import FlatState


def require_id(lookup_id: object, argument: str = "lookup_id") -> str:
    require(isinstance(lookup_id, str) and lookup_id != "", argument,
            "must be a non-empty str")
    assert isinstance(lookup_id, str)
    return lookup_id


def require_live(state: FlatState, lookup_id: object) -> str:
    """``lookup_id`` names a live lookup."""
    name = require_id(lookup_id)
    require(name in state.lookups, "lookup_id", f"{name!r} is not a live lookup")
    return name
