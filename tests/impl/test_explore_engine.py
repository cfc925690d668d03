"""Exhaustive refinement of an engine through its adapter (spec/14-exploration.md, 14.8),
on our cache's adapter (engine ``ours``): a small scope agrees with the model on every
transition and visits exactly what the refinement of the implementation visits once the
one request the protocol lacks is withheld from it; bugs planted in private subclasses
of the adapter are found with their shortest path and a reproducer that replays; what an
engine cannot express is counted by reason, never issued and never a finding, and a
failure dressed as a refusal is still a finding."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping
from dataclasses import replace
from pathlib import Path

import pytest

from hiradix.conformance.explore import (
    EngineRefinement,
    open_engine,
    refine,
    refine_engine,
)
from hiradix.conformance.explore.cli import explore_main
from hiradix.conformance.scenario import Scenario
from hiradix.engines import CacheEngine, EngineUnavailable
from hiradix.engines.ours.cache import OursAdapter
from hiradix_model import Key, State
from hiradix_model.explore import Action, Scope, explore
from hiradix_model.state import device_evictable_leaves

TINY = Scope(device_pages=1, host_pages=1, max_key_tokens=1)
PROTOCOL_LACKS = "no write_backup in the adapter protocol"


def record(adapter: Callable[[Scenario], OursAdapter], name: str = "planted",
           space: dict[str, tuple[object, ...]] | None = None) -> CacheEngine:
    """An engine record for an adapter class of this module (``--engine module:NAME``)."""
    return CacheEngine(name, "test", lambda: "hiradix", lambda scenario: lambda: adapter(scenario),
                       lambda: space or {})


def run(engine: str, scope: Scope = TINY, **options: object) -> EngineRefinement:
    beyond = bool(options.pop("beyond_server", False))
    opened = open_engine(engine, scope, beyond)
    try:
        return refine_engine(opened, **options)  # type: ignore[arg-type]
    finally:
        opened.close()


def test_a_small_scope_agrees_on_every_transition() -> None:
    result = run("ours")
    assert result.mismatch is None and result.figures.complete
    assert 1 < result.figures.states < result.figures.transitions
    # The only request our adapter cannot take: the protocol has no write_backup.
    assert set(result.skipped) == {PROTOCOL_LACKS} and result.skipped[PROTOCOL_LACKS] > 0
    # Same cache: it reaches a subset of what the implementation's refinement reaches.
    assert set(result.visited) < set(refine(TINY).visited)


@pytest.mark.parametrize("scope", [
    TINY,
    Scope(device_pages=2, host_pages=1, max_key_tokens=1, alphabet=(1,),
          write_policy="write_back"),
], ids=["write_through", "write_back"])
def test_without_write_backup_the_implementation_refinement_visits_the_same(
        scope: Scope, monkeypatch: pytest.MonkeyPatch) -> None:
    """Where they are comparable -- the implementation refined without the one request
    the protocol lacks -- both searches visit the same states by the same transitions."""
    engine = run("ours", scope)
    module = importlib.import_module("hiradix.conformance.explore.refine")
    offered = module.requests_of
    monkeypatch.setattr(module, "requests_of", lambda state, scope: [
        a for a in offered(state, scope) if a.name != "write_backup"])
    impl = refine(scope)
    assert engine.mismatch is None and impl.mismatch is None
    assert set(engine.visited) == set(impl.visited)
    assert (engine.figures.states, engine.figures.transitions, engine.figures.cut) == (
        impl.figures.states, impl.figures.transitions, impl.figures.cut)


def test_restoring_by_reset_and_by_a_fresh_adapter_explore_the_same() -> None:
    by_reset, fresh = run("ours", restore="reset"), run("ours", restore="fresh")
    assert set(by_reset.visited) == set(fresh.visited)
    assert by_reset.figures.transitions == fresh.figures.transitions
    assert by_reset.requests == fresh.requests


# -- bugs planted in private subclasses of the adapter --------------------------------------


class EvictCountsOneMore(OursAdapter):
    """A planted bug: evict reports one token more than it evicted."""

    def evict(self, num_tokens: int) -> int:
        return super().evict(num_tokens) + 1


class ObserveDropsALock(OursAdapter):
    """A planted bug: the observation loses one lock of every locked page."""

    def observe(self, model: State) -> State:
        seen = super().observe(model)
        return replace(seen, pages={k: p if p.lock == 0 else replace(p, lock=p.lock - 1)
                                    for k, p in seen.pages.items()})


EVICT_COUNT = record(EvictCountsOneMore)
DROPPED_LOCK = record(ObserveDropsALock)


def least_depth(reaches: Callable[[State], bool], scope: Scope = TINY) -> int:
    """How few steps the model needs to reach a state where ``reaches`` holds."""
    sources: list[int] = []

    def watch(index: int, state: State, action: object, target: State) -> None:
        if reaches(target):
            sources.append(index)

    graph = explore(scope, watch=watch).graph
    return min(len(graph.path(index)) + 1 for index in sources)


def test_a_wrong_eviction_count_is_found_at_its_least_depth() -> None:
    result = run(f"{__name__}:EVICT_COUNT")
    mismatch = result.mismatch
    assert mismatch is not None and "evict:" in mismatch.reason
    assert mismatch.path[-1].name == "evict"
    # The first eviction that takes a page: one step past the least state with a leaf.
    assert len(mismatch.path) == least_depth(lambda s: bool(device_evictable_leaves(s))) + 1


def test_a_dropped_lock_is_found_at_its_least_depth_and_its_reproducer_replays() -> None:
    result = run(f"{__name__}:DROPPED_LOCK")
    mismatch = result.mismatch
    assert mismatch is not None and "lock=" in mismatch.reason
    assert len(mismatch.path) == least_depth(
        lambda s: any(p.lock for p in s.pages.values()))
    opened = open_engine(f"{__name__}:DROPPED_LOCK", TINY)
    script = mismatch.reproducer(opened)
    opened.close()
    assert "replay_engine(" in script
    with pytest.raises(AssertionError, match="disagree"):
        exec(compile(script, "<reproducer>", "exec"), {})
    # The same requests on the real adapter agree.
    exec(compile(script.replace(f"{__name__}:DROPPED_LOCK", "ours"), "<reproducer>", "exec"),
         {})


class ResetKeepsTheCache(OursAdapter):
    """A planted bug: reset() forgets to drop anything."""

    def reset(self) -> None:
        pass


RESET_KEEPS = record(ResetKeepsTheCache)


def test_a_reset_that_does_not_empty_the_cache_stops_a_restore_by_reset() -> None:
    result = run(f"{__name__}:RESET_KEEPS", restore="reset")
    assert result.mismatch is not None
    assert "RestoreError: reset() does not restore the empty cache" in result.mismatch.reason


# -- what an engine cannot express -------------------------------------------------------------


class RefusesTwo(OursAdapter):
    """Has no node ending at (2,) to lock: refuses, changing nothing."""

    def inc_lock_ref(self, page: Key | None) -> int:
        if page == Key((2,)):
            raise KeyError(f"no node ends at {page}")
        return super().inc_lock_ref(page)


class LocksThenFails(OursAdapter):
    """A planted bug dressed as a refusal: locks (2,), then raises KeyError."""

    def inc_lock_ref(self, page: Key | None) -> int:
        delta = super().inc_lock_ref(page)
        if page == Key((2,)):
            raise KeyError(f"no node ends at {page}")
        return delta


class GuardedReset(OursAdapter):
    guards: Mapping[str, str] = {"reset_with_copies_in_flight": "a test's server guard"}


class CannotCountInside(OursAdapter):
    inexpressible: Mapping[str, str] = {"counted_from_inside": "a test's engine"}


class TakesOnlyALeadingRunOfItsSlots(OursAdapter):
    inexpressible: Mapping[str, str] = {"insert_cache_slot_after_caller_slot": "DEV-24"}


class CannotExpressTheUnknown(OursAdapter):
    inexpressible: Mapping[str, str] = {"negative_priorities": "a test's engine"}


class AvoidsTheUnknown(OursAdapter):
    avoid: Mapping[str, str] = {"page_aligned_keys": "a situation the explorer does not know"}


REFUSES = record(RefusesTwo)
FAILS_AS_REFUSAL = record(LocksThenFails)
GUARDED = record(GuardedReset)
CANNOT_COUNT_INSIDE = record(CannotCountInside)
LEADING_RUN_ONLY = record(TakesOnlyALeadingRunOfItsSlots)
CANNOT_EXPRESS_THE_UNKNOWN = record(CannotExpressTheUnknown)
AVOIDS_THE_UNKNOWN = record(AvoidsTheUnknown)
LRU_ONLY = record(OursAdapter, space={"eviction": ("lru",)})


def _unavailable() -> str:
    raise EngineUnavailable("absent: not installed here (make absent-env)", "missing")


ABSENT = CacheEngine("absent", "test", _unavailable, lambda scenario: lambda: OursAdapter(scenario))


def test_a_refusal_is_counted_not_issued_and_a_failure_dressed_as_one_is_found() -> None:
    refused = run(f"{__name__}:REFUSES")
    assert refused.mismatch is None and refused.figures.complete
    reason = "refused by the adapter (KeyError)"
    assert refused.skipped[reason] > 0 and "(2,)" in refused.examples[reason]
    assert refused.figures.states < run("ours").figures.states
    failed = run(f"{__name__}:FAILS_AS_REFUSAL")
    assert failed.mismatch is not None and "KeyError" in failed.mismatch.reason
    assert failed.mismatch.path[-1] == Action("inc_lock_ref", (Key((2,)),))


def test_guards_are_steered_around_unless_beyond_the_server() -> None:
    scope = Scope(device_pages=1, host_pages=1, max_key_tokens=1, alphabet=(1,))
    guard = "guard: reset_with_copies_in_flight"
    inside = run(f"{__name__}:GUARDED", scope)
    beyond = run(f"{__name__}:GUARDED", scope, beyond_server=True)
    assert inside.mismatch is None and beyond.mismatch is None
    assert inside.skipped[guard] > 0 and guard not in beyond.skipped
    assert beyond.figures.transitions == inside.figures.transitions + inside.skipped[guard]


@pytest.mark.parametrize("engine, argument, example", [
    ("CANNOT_COUNT_INSIDE", "counted_from_inside", "counted_from=1"),
    # (1,) and (1, 1) allocated apart (slots 0; 1, 2), (1, 1) cached in 0, 2; then an
    # insert of (1, 1) passing the held duplicate 1 before the cache's own slot 2.
    ("LEADING_RUN_ONLY", "insert_cache_slot_after_caller_slot", ", (1, 2), 0,"),
])
def test_an_inexpressible_argument_is_skipped(engine: str, argument: str,
                                              example: str) -> None:
    scope = Scope(device_pages=3, host_pages=1, max_key_tokens=2, alphabet=(1,),
                  max_locks=0, max_in_flight=0)
    plain, limited = run("ours", scope), run(f"{__name__}:{engine}", scope)
    reason = f"inexpressible: {argument}"
    assert plain.mismatch is None and limited.mismatch is None
    assert reason not in plain.skipped and limited.skipped[reason] > 0
    assert example in limited.examples[reason]


def test_copies_acknowledged_only_in_part_are_not_expressible() -> None:
    scope = Scope(device_pages=2, host_pages=2, max_key_tokens=2, alphabet=(1,),
                  partial_inserts=False, max_locks=0, max_held_pages=1)
    result = run("ours", scope)
    assert result.mismatch is None and result.figures.complete
    partial = [r for r in result.skipped if r.startswith("acknowledges only some")]
    assert partial and "writing_check(s, 1)" in result.examples[partial[0]]


# -- the command line -------------------------------------------------------------------------


TINY_ARGS = ["--device-pages", "1", "--host-pages", "1", "--max-key-tokens", "1"]


def test_the_cli_prints_engine_figures_and_a_reproducer(
        capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    assert explore_main([*TINY_ARGS, "--engine", "ours"]) == 0
    out = capsys.readouterr().out
    assert "engine ours hiradix: states:" in out and "complete" in out
    assert "not expressible: " in out and PROTOCOL_LACKS in out
    written = tmp_path / "reproducer.py"
    assert explore_main([*TINY_ARGS, "--engine", f"{__name__}:EVICT_COUNT",
                         "--restore", "fresh", "--reproducer", str(written)]) == 1
    out = capsys.readouterr().out
    assert f"FINDING (engine {__name__}:EVICT_COUNT)" in out and "replay_engine(" in out
    with pytest.raises(AssertionError, match="evict"):
        exec(compile(written.read_text(), str(written), "exec"), {})


@pytest.mark.parametrize("argv, words", [
    (["--engine", "ours-swa"], "component campaign"),
    (["--engine", "vllm"], "machine of its own"),
    (["--engine", "nope"], "unknown engine"),
    (["--restore", "fresh"], "need --engine NAME"),
    (["--engine", "ours", "--restore", "sometimes"], "--restore"),
    (["--engine", f"{__name__}:LRU_ONLY", "--strategies", "lfu"], "takes eviction in"),
    (["--engine", f"{__name__}:AVOIDS_THE_UNKNOWN"], "page_aligned_keys"),
    (["--engine", f"{__name__}:CANNOT_EXPRESS_THE_UNKNOWN"], "negative_priorities"),
    (["--engine", "ours", "--host-pages", "0"], "cannot be built for this scope"),
    (["--engine", f"{__name__}:ABSENT"], "not installed here"),
])
def test_an_engine_that_cannot_run_the_scope_is_one_line_and_exit_2(
        argv: list[str], words: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert explore_main([*TINY_ARGS, *argv]) == 2
    captured = capsys.readouterr()
    assert words in captured.err and captured.err.count("\n") == 1 and not captured.out
