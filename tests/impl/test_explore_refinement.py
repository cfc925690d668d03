"""Exhaustive refinement of the implementation (spec/14-exploration.md, 14.4): every
request from every reachable state agrees with the model on a tiny scope, and bugs
planted in the implementation are found with their shortest path."""

from __future__ import annotations

from pathlib import Path

import pytest

from hiradix.cache import HiRadixCache, MatchResult
from hiradix.conformance.explore import Disagreement, refine
from hiradix.conformance.explore.cli import explore_main
from hiradix.keys import RadixKey
from hiradix_model import State
from hiradix_model.explore import Scope, explore
from hiradix_model.state import host_evictable_leaves

TINY = Scope(device_pages=1, host_pages=1, max_key_tokens=1)
TINY_STATES = 107  # the model's count of this scope (tests/model/test_explore.py)


def test_every_transition_of_a_tiny_scope_agrees_with_the_model() -> None:
    result = refine(TINY)
    assert result.mismatch is None and result.figures.complete
    # One page per tier leaves no tie: the implementation reaches every model state.
    assert result.figures.states == TINY_STATES == explore(TINY).figures.states
    assert result.figures.transitions > result.figures.states


def test_write_back_with_ties_agrees_too() -> None:
    scope = Scope(device_pages=2, host_pages=1, max_key_tokens=1, alphabet=(1,),
                  write_policy="write_back")
    result = refine(scope)
    assert result.mismatch is None and result.figures.complete
    assert 1 < result.figures.states <= explore(scope).figures.states


REAL_MATCH = HiRadixCache.match_prefix


def _match_forgets_ticks(self: HiRadixCache, key: RadixKey) -> MatchResult:
    """A planted bug: match_prefix does not stamp the nodes it matched (LRU forgets)."""
    ticks = {id(node): node.last_tick for node in self.nodes()}
    got = REAL_MATCH(self, key)
    for node in self.nodes():
        node.last_tick = ticks.get(id(node), node.last_tick)
    return got


def test_a_planted_tick_bug_is_found_at_its_least_depth(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HiRadixCache, "match_prefix", _match_forgets_ticks)
    mismatch = refine(TINY).mismatch
    assert mismatch is not None and "differs from the model" in mismatch.reason
    # The least: allocate, insert at tick 0, match at tick 1.
    assert [a.name for a in mismatch.path] == ["alloc", "insert", "match_prefix"]
    script = mismatch.reproducer(TINY)
    with pytest.raises(Disagreement):
        exec(compile(script, "<reproducer>", "exec"), {})
    monkeypatch.undo()
    exec(compile(script, "<reproducer>", "exec"), {})  # the real implementation agrees


def test_a_planted_check_that_acknowledges_nothing_is_found(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The count a check acknowledged is compared with the copies that finished: one
    that leaves a finished backup unacknowledged (its lock held, its host copy not yet
    the node's) disagrees at the first writing_check."""
    monkeypatch.setattr(HiRadixCache, "writing_check", lambda self: 0)
    mismatch = refine(TINY).mismatch
    assert mismatch is not None and mismatch.path[-1].name == "writing_check"
    assert "returned 0, the model 1" in mismatch.reason


def _least_depth_with_host_leaves(scope: Scope) -> int:
    """How few steps the model needs to reach a state with an evictable host leaf."""
    sources: list[int] = []

    def watch(index: int, state: State, action: object, target: State) -> None:
        if host_evictable_leaves(target):
            sources.append(index)

    graph = explore(scope, watch=watch).graph
    return min(len(graph.path(index)) + 1 for index in sources)


def test_a_planted_lazy_host_eviction_is_found_with_its_shortest_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(HiRadixCache, "evict_host", lambda self, num_tokens: 0)
    mismatch = refine(TINY).mismatch
    assert mismatch is not None and "forbids" in mismatch.reason
    assert mismatch.path[-1].name == "evict_host"
    assert len(mismatch.path) == _least_depth_with_host_leaves(TINY) + 1


def test_the_cli_prints_figures_and_a_reproducer(
        monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str],
        tmp_path: Path) -> None:
    args = ["--device-pages", "1", "--host-pages", "1", "--max-key-tokens", "1"]
    assert explore_main(args) == 0
    out = capsys.readouterr().out
    assert f"states: {TINY_STATES}" in out and "complete" in out and "implementation:" in out
    monkeypatch.setattr(HiRadixCache, "match_prefix", _match_forgets_ticks)
    assert explore_main(args) == 1
    out = capsys.readouterr().out
    assert "FINDING (implementation)" in out and "replay(Scope(" in out


@pytest.mark.parametrize("argv, field", [
    (["--device-pages", "0"], "scope.device_pages"),
    (["--engine", "sglang"], "--engine sglang"),
    (["--strategies", "random"], "scope.eviction"),
])
def test_a_bad_command_line_is_one_line_and_exit_2(
        argv: list[str], field: str, capsys: pytest.CaptureFixture[str]) -> None:
    assert explore_main(argv) == 2
    err = capsys.readouterr().err
    assert field in err and err.count("\n") == 1


def test_the_report_draws_states_per_depth(tmp_path: Path,
                                           capsys: pytest.CaptureFixture[str]) -> None:
    pytest.importorskip("matplotlib")
    args = ["--device-pages", "1", "--host-pages", "1", "--max-key-tokens", "1",
            "--model-only", "--report", str(tmp_path)]
    assert explore_main(args) == 0
    picture = tmp_path / "explore-depths.png"
    assert picture.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert f"report: {picture}" in capsys.readouterr().out
