"""Breadth-first search over every reachable state of a scope (spec/14-exploration.md).

Each state is reduced to its canonical form (``canonical.py``) before it is stored, so
the search visits one state per class. Every invariant is checked on every new state;
the first violation found is at the least depth (breadth first), and its path of
actions from the initial state is a runnable reproducer. A model operation that rejects
a choice the explorer built (``IllegalChoice``) or fails an internal assertion is a
finding too, with its path.
"""

from __future__ import annotations

import resource
import sys
import time
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.explore.actions import Action, actions, within
from hiradix_model.explore.canonical import canonical
from hiradix_model.explore.scope import Scope
from hiradix_model.invariants import violations
from hiradix_model.state import State, initial


@dataclass(frozen=True)
class Finding:
    """What went wrong, where: the shortest path of actions and what it broke."""

    path: tuple[Action, ...]
    problems: dict[str, list[str]]  # invariant ID (or "model error") -> descriptions

    def reproducer(self, scope: Scope) -> str:
        """A Python script that replays the path and fails where the exploration did."""
        lines = ["from hiradix_model import Key, check, initial, ops, violations",
                 "from hiradix_model.config import Config",
                 "from hiradix_model.ops import Backup, Victim",
                 "",
                 f"s = initial({scope.config!r})"]
        for step in self.path[:-1]:
            lines.append(f"s, _ = {step.call()}")
        if self.path and "model error" in self.problems:
            lines.append(f"s, _ = {self.path[-1].call()}  # the model rejects this step")
        elif self.path:
            lines.append(f"s, _ = {self.path[-1].call()}")
        lines.append("assert not check(s), violations(s)")
        return "\n".join(lines)


@dataclass
class Figures:
    """What one exploration did (14.5)."""

    states: int = 0  # distinct canonical states reached
    transitions: int = 0  # enabled (operation, arguments, choice) steps taken
    cut: int = 0  # transitions whose target leaves a state constraint
    refused: int = 0  # candidate steps the model's preconditions refused
    depth: int = 0  # depth of the deepest state
    per_depth: list[int] = field(default_factory=list)
    seconds: float = 0.0
    peak_mb: float = 0.0  # the process's peak resident memory, the interpreter included
    start_mb: float = 0.0  # ... as it was when the search began
    complete: bool = False  # every state of the scope was expanded
    started: float = field(default_factory=time.monotonic)

    def spent(self, seconds: float | None, max_states: int | None) -> bool:
        """Whether a budget (seconds since ``started``, or states) is used up."""
        return (seconds is not None and time.monotonic() - self.started > seconds) or (
            max_states is not None and self.states >= max_states)

    def close(self, complete: bool) -> None:
        """Record the time, the peak memory and whether the search was complete."""
        self.seconds = time.monotonic() - self.started
        self.peak_mb = peak_mb()
        self.complete = complete

    def add_depth(self, states: int) -> None:
        """One more level of the search, holding ``states`` new states."""
        if states:
            self.per_depth.append(states)
            self.depth = len(self.per_depth) - 1

    @property
    def states_per_second(self) -> float:
        return self.states / self.seconds if self.seconds > 0 else 0.0

    def summary(self, stopped: bool = False) -> str:
        status = ("stopped at a finding" if stopped else "complete" if self.complete
                  else "INCOMPLETE (budget ran out)")
        return (f"states: {self.states}  transitions: {self.transitions}  cut: {self.cut}  "
                f"depth: {self.depth}  time: {self.seconds:.1f}s  "
                f"states/s: {self.states_per_second:.0f}  "
                f"peak: {self.peak_mb:.0f} MB (from {self.start_mb:.0f})  "
                f"{status}")


@dataclass
class Graph:
    """The search tree: for each state index its parent and the action that reached it."""

    parent: list[int] = field(default_factory=list)
    via: list[Action | None] = field(default_factory=list)

    def path(self, index: int) -> tuple[Action, ...]:
        steps: list[Action] = []
        while index > 0:
            action = self.via[index]
            assert action is not None
            steps.append(action)
            index = self.parent[index]
        return tuple(reversed(steps))

    def replay(self, scope: Scope, index: int) -> State:
        state = initial(scope.config)
        for action in self.path(index):
            state = action.apply(state)
        return state


@dataclass
class Exploration:
    scope: Scope
    figures: Figures
    graph: Graph
    finding: Finding | None = None


@dataclass(frozen=True)
class Arrival:
    """What one transition led to."""

    inside: bool  # the target satisfies the scope's state constraints
    new: int | None = None  # the target's index, if its form was not seen before
    problems: dict[str, list[str]] = field(default_factory=dict)  # its violations, if new


@dataclass
class Search:
    """The visited set of a breadth-first search, shared by the model's and the
    implementation's (spec/14, 14.4)."""

    scope: Scope
    figures: Figures = field(default_factory=lambda: Figures(start_mb=peak_mb()))
    graph: Graph = field(default_factory=Graph)
    seen: dict[Hashable, int] = field(default_factory=dict)

    def start(self, first: State) -> dict[str, list[str]]:
        """Visit the initial state; its violations."""
        self.seen[canonical(first)] = 0
        self.graph.parent.append(0)
        self.graph.via.append(None)
        self.figures.states, self.figures.per_depth = 1, [1]
        return violations(first)

    def offer(self, source: int, action: Action, target: State) -> Arrival:
        """Count the transition ``action`` from state ``source``; visit its target if
        it is in scope and new (every invariant checked on it)."""
        self.figures.transitions += 1
        if not within(target, self.scope):
            self.figures.cut += 1
            return Arrival(False)
        form = canonical(target)
        if form in self.seen:
            return Arrival(True)
        new = len(self.graph.parent)
        self.seen[form] = new
        self.graph.parent.append(source)
        self.graph.via.append(action)
        self.figures.states += 1
        return Arrival(True, new, violations(target))


# Called for every transition taken: (source index, source, action, target).
Watch = Callable[[int, State, Action, State], None]


def peak_mb() -> float:
    """The process's peak resident memory so far, in MiB."""
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (1024 * 1024) if sys.platform == "darwin" else peak / 1024


def explore(scope: Scope, *, max_states: int | None = None, seconds: float | None = None,
            watch: Watch | None = None) -> Exploration:
    """Every reachable state of ``scope``, breadth first, up to the budgets given.

    Stops at the first finding. ``watch`` sees every transition taken (refinement
    against an implementation hangs there; spec/14, 14.4).
    """
    search = Search(scope)
    figures = search.figures
    result = Exploration(scope, figures, search.graph)
    first = initial(scope.config)
    problems = search.start(first)
    if problems:
        result.finding = Finding((), problems)
        return _finish(result, False)
    frontier: list[tuple[int, State]] = [(0, first)]
    while frontier:
        following: list[tuple[int, State]] = []
        for index, state in frontier:
            if figures.spent(seconds, max_states):
                return _finish(result, False)
            for action in actions(state, scope):
                try:
                    target = action.apply(state)
                except PreconditionError:
                    figures.refused += 1
                    continue
                except (IllegalChoice, AssertionError) as error:
                    path = (*search.graph.path(index), action)
                    result.finding = Finding(path, {"model error": [repr(error)]})
                    return _finish(result, False)
                arrival = search.offer(index, action, target)
                if arrival.inside and watch is not None:
                    watch(index, state, action, target)
                if arrival.new is None:
                    continue
                if arrival.problems:
                    result.finding = Finding(search.graph.path(arrival.new), arrival.problems)
                    figures.depth = len(figures.per_depth)
                    return _finish(result, False)
                following.append((arrival.new, target))
        figures.add_depth(len(following))
        frontier = following
    return _finish(result, True)


def _finish(result: Exploration, complete: bool) -> Exploration:
    result.figures.close(complete)
    return result
