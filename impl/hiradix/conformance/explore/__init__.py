"""Exhaustive refinement of the implementation, and of any engine through its adapter,
against the model (spec/14, 14.4 and 14.8)."""

from hiradix.conformance.explore.engine_pair import EnginePair, Refused, Skipped
from hiradix.conformance.explore.engine_refine import (
    EngineMismatch,
    EngineRefinement,
    EngineScopeError,
    open_engine,
    refine_engine,
    replay_engine,
)
from hiradix.conformance.explore.lockstep import Disagreement, Pair, request
from hiradix.conformance.explore.refine import Mismatch, Refinement, refine, replay

__all__ = ["Disagreement", "EngineMismatch", "EnginePair", "EngineRefinement",
           "EngineScopeError", "Mismatch", "Pair", "Refinement", "Refused", "Skipped",
           "open_engine", "refine", "refine_engine", "replay", "replay_engine", "request"]
