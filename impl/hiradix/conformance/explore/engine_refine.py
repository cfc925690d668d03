"""Exhaustive refinement of any engine through its adapter: every request from every
state the engine reaches in a scope (spec/14-exploration.md, 14.8).

The search is ``refine.refine``'s -- breadth first over the states the engine reaches
beside the model, every request the model's explorer offers from each -- with the
engine spoken to through ``hiradix.engines`` (``engine_pair.EnginePair``). A request the
engine cannot take is counted by reason and not followed. An engine cannot be copied, so
each request starts from the empty cache and the path that reached its state: on a fresh
adapter (``restore="fresh"``) or on the same adapter after ``reset()`` (``"reset"``); either
way the replayed state must be the one first reached, or the run stops there (a reset
that does not restore the empty cache, or an engine that is not deterministic, is
reported, not explored past).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from collections.abc import Callable, Hashable, Sequence
from dataclasses import dataclass, field
from typing import Literal

from hiradix.conformance.explore.engine_pair import EnginePair, Skipped, not_expressible, steered
from hiradix.conformance.explore.lockstep import scenario_for
from hiradix.conformance.explore.refine import requests_of, script
from hiradix.engines.catalog import cache_engine
from hiradix.engines.protocol import EngineAdapter
from hiradix_model import Config, State, initial
from hiradix_model.explore import Action, Figures, Scope
from hiradix_model.explore.bfs import Search

Restore = Literal["fresh", "reset"]
RESTORES: tuple[Restore, ...] = ("fresh", "reset")


class EngineScopeError(ValueError):
    """The engine cannot explore this scope (its scenario space or its configuration
    differ, or it is not driven through its adapter alone); the message says why."""


def realised(scope: Scope, name: str, built: Config) -> Scope:
    """``scope`` with the pools the engine built for it (an adapter may size a pool
    otherwise than the scenario asks: SGLang's host pool, from a ratio); every other
    field of the configuration must be the scope's. ``EngineScopeError`` otherwise."""
    ps = scope.page_size
    want = dataclasses.replace(scope.config, device_slots=built.device_slots,
                               host_slots=built.host_slots)
    if built != want or built.device_slots % ps or built.host_slots % ps:
        differ = ", ".join(f"{f.name}={getattr(built, f.name)!r}"
                           for f in dataclasses.fields(Config)
                           if getattr(built, f.name) != getattr(scope.config, f.name))
        raise EngineScopeError(f"--engine {name}: builds {differ} for this scope, which no "
                               "scope of whole pages with its other settings describes")
    return dataclasses.replace(scope, device_pages=built.device_slots // ps,
                               host_pages=built.host_slots // ps)


@dataclass
class Engine:
    """An engine opened for one scope: how to build its adapters, the scope they realise
    (``realised``), the situations to steer around, and one adapter kept open (the one a
    ``reset`` restore drives)."""

    name: str
    version: str
    asked: Scope  # the scope asked for (a reproducer names it)
    scope: Scope  # the scope explored: the asked one with the engine's pools
    make: Callable[[], EngineAdapter]
    steer: dict[str, str]
    beyond_server: bool
    kept: EngineAdapter

    def close(self) -> None:
        self.kept.close()


def open_engine(name: str, scope: Scope, beyond_server: bool = False) -> Engine:
    """The engine ``name`` (as ``hiradix.engines.lookup`` finds it) for ``scope``.
    ``EngineError`` / ``EngineUnavailable`` / ``EngineScopeError`` if it cannot run."""
    record = cache_engine(name)
    if record.machine is not None:
        raise EngineScopeError(f"--engine {name}: its API is driven by a machine of its own, "
                               "not through its adapter alone; it is not explored")
    version = record.probe()
    scenario = scenario_for(scope)
    values = dataclasses.asdict(scenario)
    for axis, taken in record.scenario_space().items():
        if axis in values and values[axis] not in taken:
            raise EngineScopeError(f"--engine {name}: takes {axis} in {list(taken)}, the "
                                   f"scope has {values[axis]!r}")
    make = record.factory(scenario)
    try:
        kept = make()
    except ValueError as bad:  # the adapter's own check of its scenario
        raise EngineScopeError(f"--engine {name}: cannot be built for this scope: "
                               f"{bad}") from bad
    try:
        explored = realised(scope, name, kept.config)
        steer = steered(kept, beyond_server)
    except EngineScopeError:
        kept.close()
        raise
    except ValueError as bad:  # steered: a situation the explorer cannot recognise
        kept.close()
        raise EngineScopeError(f"--engine {name}: {bad}") from bad
    return Engine(name, version, scope, explored, make, steer, beyond_server, kept)


@dataclass(frozen=True)
class EngineMismatch:
    """Where the engine left the model: the shortest request path and why."""

    path: tuple[Action, ...]  # requests from the empty cache; the last one failed
    reason: str

    def reproducer(self, engine: Engine) -> str:
        """A Python script that replays the requests on the engine and fails at the last."""
        return script("replay_engine", (repr(engine.name), repr(engine.asked)), self.path,
                      ", beyond_server=True" if engine.beyond_server else "")


@dataclass
class EngineRefinement:
    scope: Scope
    engine: str
    version: str
    restore: Restore
    figures: Figures
    mismatch: EngineMismatch | None = None
    requests: int = 0  # engine steps taken, replays included
    skipped: Counter[str] = field(default_factory=Counter)  # not expressible, per reason
    examples: dict[str, str] = field(default_factory=dict)  # reason -> the first skipped
    visited: dict[Hashable, int] = field(default_factory=dict)  # canonical form -> index

    def close(self, complete: bool) -> EngineRefinement:
        self.figures.close(complete)
        return self

    def skip(self, skipped: Skipped) -> None:
        self.skipped[skipped.reason] += 1
        self.examples.setdefault(skipped.reason, skipped.detail)

    def not_expressible(self) -> str:
        """One line: the requests skipped, by reason, most first."""
        parts = "; ".join(f"{reason}: {count}" for reason, count in self.skipped.most_common())
        return f"not expressible: {sum(self.skipped.values())}" + (f" ({parts})" if parts else "")


class RestoreError(AssertionError):
    """Replaying a path did not reach the state it reached before."""


class Restorer:
    """Pairs at the states of the search, rebuilt by replaying their paths."""

    def __init__(self, engine: Engine, how: Restore) -> None:
        self.engine, self.how = engine, how
        self.current: EnginePair | None = None

    def at(self, path: Sequence[Action], state: State) -> EnginePair:
        """A pair in ``state``, reached by ``path`` from the empty cache."""
        if self.how == "reset":
            if self.current is None:
                self.current = EnginePair(self.engine.kept, self.engine.steer)
            self.current.restart()
            if self.current.adapter.observe(self.current.model) != self.current.model:
                raise RestoreError("reset() does not restore the empty cache: rerun with "
                                   "--restore fresh (and see the engine's reset)")
        else:
            if self.current is not None:
                self.current.adapter.close()
            self.current = EnginePair(self.engine.make(), self.engine.steer)
        pair = self.current
        try:
            for asked in path:
                pair.issue(asked, check=False)
        except Exception as error:  # whatever it is, the replay is what failed
            raise RestoreError(f"replaying the path ({self.how}) failed where it had passed: "
                               f"{type(error).__name__}: {error}") from error
        if pair.model != state:
            raise RestoreError(f"replaying the path ({self.how}) reached another state than "
                               "the first time: " + ("reset() does not restore a fresh engine"
                                                     if self.how == "reset" else
                                                     "the engine is not deterministic"))
        return pair

    def close(self) -> None:
        if self.how == "fresh" and self.current is not None:
            self.current.adapter.close()


def replay_engine(engine: str, scope: Scope, path: Sequence[Action],
                  beyond_server: bool = False) -> EnginePair:
    """Issue ``path``'s requests to a fresh adapter of ``engine`` (opened for ``scope``,
    as ``open_engine``) beside the model, comparing after each; raises where they part
    (a reproducer's body)."""
    opened = open_engine(engine, scope, beyond_server)
    opened.close()
    pair = EnginePair(opened.make(), opened.steer)
    for asked in path:
        pair.issue(asked)
    return pair


def refine_engine(engine: Engine, *, restore: Restore = "reset",
                  max_states: int | None = None,
                  seconds: float | None = None) -> EngineRefinement:
    """Every reachable state of ``engine`` in its scope, every request from each, checked
    against the model; stops at the first mismatch (at the least depth)."""
    scope = engine.scope
    if restore == "reset" and "reset" not in engine.kept.operations:
        raise EngineScopeError(f"--engine {engine.name} has no reset: restore with fresh "
                               "adapters")
    search = Search(scope)
    figures = search.figures
    result = EngineRefinement(scope, engine.name, engine.version, restore, figures,
                              visited=search.seen)
    restorer = Restorer(engine, restore)
    try:
        first = initial(scope.config)  # the engine's configuration (``open_engine``)
        search.start(first)
        frontier: list[tuple[int, State]] = [(0, first)]
        while frontier:
            following: list[tuple[int, State]] = []
            for index, source in frontier:
                if figures.spent(seconds, max_states):
                    return result.close(False)
                if not _expand(search, result, restorer, index, source, following):
                    return result.close(False)
            figures.add_depth(len(following))
            frontier = following
        return result.close(True)
    finally:
        restorer.close()


def _expand(search: Search, result: EngineRefinement, restorer: Restorer, index: int,
            source: State, following: list[tuple[int, State]]) -> bool:
    """Issue every request from state ``index``; False at a mismatch (recorded)."""
    path = search.graph.path(index)
    for asked in requests_of(source, search.scope):
        skip = not_expressible(restorer.engine.kept, restorer.engine.steer, source, asked)
        if skip is not None:
            result.skip(skip)
            continue
        result.requests += len(path) + 1
        try:
            pair = restorer.at(path, source)
            pair.issue(asked)
        except Skipped as refused:
            result.skip(refused)
            continue
        except Exception as error:
            # Whatever the engine, its adapter or the model raised here is a finding: an
            # engine may fail with any exception of its own.
            result.mismatch = EngineMismatch((*path, asked), f"{type(error).__name__}: {error}")
            return False
        arrival = search.offer(index, asked, pair.model)
        if arrival.problems:
            result.mismatch = EngineMismatch((*path, asked),
                                             f"model invariants: {arrival.problems}")
            return False
        if arrival.new is not None:
            following.append((arrival.new, pair.model))
    return True
