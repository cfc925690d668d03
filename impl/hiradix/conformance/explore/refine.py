"""Exhaustive refinement: every transition of every reachable state, on the
implementation (spec/14-exploration.md, 14.4).

A breadth-first search over the states the implementation reaches beside the model.
From each state, every request the model's explorer offers (its actions less the
choices, ``lockstep.request``) is issued to the implementation in that state -- rebuilt
by replaying the requests that reached it -- and the model steps with the
implementation's choices. The implementation is deterministic, so the states it
reaches are a subset of the model's (the model explorer tries every legal choice; the
implementation makes one).
"""

from __future__ import annotations

from collections.abc import Hashable
from dataclasses import dataclass, field

from hiradix.conformance.explore.lockstep import Pair, request
from hiradix_model import PreconditionError, State
from hiradix_model.explore import Action, Figures, Scope, actions
from hiradix_model.explore.bfs import Search


@dataclass(frozen=True)
class Mismatch:
    """Where the implementation left the model: the shortest request path and why."""

    path: tuple[Action, ...]  # requests from the empty cache; the last one failed
    reason: str

    def reproducer(self, scope: Scope) -> str:
        """A Python script that replays the requests and fails at the last one."""
        return script("replay", (repr(scope),), self.path)


def script(replayer: str, leading: tuple[str, ...], path: tuple[Action, ...],
           trailing: str = "") -> str:
    """A Python script calling ``hiradix.conformance.explore.<replayer>`` with the
    ``leading`` arguments, the requests of ``path`` and then ``trailing`` ones."""
    steps = ",\n    ".join(repr(a) for a in path)
    return "\n".join([
        "from hiradix_model import Key",
        "from hiradix_model.explore import Action, Scope",
        "from hiradix_model.ops import Backup, Victim",
        f"from hiradix.conformance.explore import {replayer}",
        "",
        f"{replayer}({', '.join(leading)}, [\n    {steps},\n]{trailing})",
    ])


@dataclass
class Refinement:
    scope: Scope
    figures: Figures
    mismatch: Mismatch | None = None
    requests: int = 0  # implementation steps taken, replays included
    visited: dict[Hashable, int] = field(default_factory=dict)  # canonical form -> index

    def close(self, complete: bool) -> Refinement:
        self.figures.close(complete)
        return self


def replay(scope: Scope, path: list[Action] | tuple[Action, ...]) -> Pair:
    """Issue ``path``'s requests to a fresh implementation beside the model; raises
    ``Disagreement`` at the first step where they part."""
    pair = Pair.fresh(scope)
    for asked in path:
        pair.step(asked)
    return pair


def requests_of(state: State, scope: Scope) -> list[Action]:
    """The distinct requests of the model's enabled transitions from ``state``."""
    found: dict[Action, None] = {}
    for action in actions(state, scope):
        try:
            action.apply(state)
        except PreconditionError:
            continue
        found.setdefault(request(action), None)
    return list(found)


def refine(scope: Scope, *, max_states: int | None = None,
           seconds: float | None = None) -> Refinement:
    """Every reachable state of the implementation in ``scope``, every request from each,
    checked against the model; stops at the first mismatch (at the least depth)."""
    search = Search(scope)
    figures = search.figures
    result = Refinement(scope, figures, visited=search.seen)
    empty = Pair.fresh(scope)
    search.start(empty.model)  # the empty cache: checked by the model's own exploration
    frontier: list[tuple[int, State]] = [(0, empty.model)]
    while frontier:
        following: list[tuple[int, State]] = []
        for index, source in frontier:
            if figures.spent(seconds, max_states):
                return result.close(False)
            path = search.graph.path(index)
            for asked in requests_of(source, scope):
                # A cache cannot be copied (a deep copy breaks its slot allocator's
                # bookkeeping), so each request starts from a replay of the path.
                pair = replay(scope, path)
                result.requests += len(path) + 1
                try:
                    pair.step(asked)
                except Exception as error:  # the reporting boundary: a disagreement, a
                    # broken invariant or a crash of the implementation is a finding with
                    # its path, as engine_refine reports an engine's
                    result.mismatch = Mismatch((*path, asked), f"{type(error).__name__}: {error}")
                    return result.close(False)
                arrival = search.offer(index, asked, pair.model)
                if arrival.problems:
                    result.mismatch = Mismatch((*path, asked),
                                               f"model invariants: {arrival.problems}")
                    return result.close(False)
                if arrival.new is not None:
                    following.append((arrival.new, pair.model))
        figures.add_depth(len(following))
        frontier = following
    return result.close(True)
