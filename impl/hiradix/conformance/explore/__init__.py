"""Exhaustive refinement of the implementation against the model (spec/14, 14.4)."""

from hiradix.conformance.explore.lockstep import Disagreement, Pair, request
from hiradix.conformance.explore.refine import Mismatch, Refinement, refine, replay

__all__ = ["Disagreement", "Mismatch", "Pair", "Refinement", "refine", "replay", "request"]
