"""Exhaustive exploration of the model's reachable states (spec/14-exploration.md)."""

from hiradix_model.explore.actions import Action, actions, within
from hiradix_model.explore.bfs import Exploration, Figures, Finding, Graph, explore
from hiradix_model.explore.canonical import canonical
from hiradix_model.explore.scope import Scope, ScopeError

__all__ = ["Action", "Exploration", "Figures", "Finding", "Graph", "Scope", "ScopeError",
           "actions", "canonical", "explore", "within"]
