"""What the hybrid machine's tests share, for ours and for each SGLang engine."""

from __future__ import annotations

import importlib
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hypothesis import HealthCheck, Phase, seed, settings
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    run_state_machine_as_test,
)
from pytest import MonkeyPatch

from hiradix.conformance.hybrid.machine import Build, make_swa_machine
from hiradix_model.hybrid import SwaConfig


def bounded(examples: int) -> settings:
    """A fixed, derandomized run of ``examples`` examples of 30 steps."""
    return settings(max_examples=examples, stateful_step_count=30, deadline=None,
                    database=None, derandomize=True, suppress_health_check=list(HealthCheck))


def run_until(machine: type[RuleBasedStateMachine], reached: Counter[str], goal: str, *,
              examples: int = 15, batches: int = 4) -> None:
    """Seeded batches of ``examples`` examples of ``machine`` until ``reached[goal]`` is
    counted or ``batches`` ran. The seeds are fixed, so a run replays; unlike
    ``derandomize`` they do not change with the machine's source, which would let an
    unrelated edit move a rare state out of reach."""
    options = settings(bounded(examples), derandomize=False)
    for index in range(batches):
        if reached[goal]:
            return
        seed(index)(get_state_machine_test(machine, settings=options))()


def seeded_failure(machine: type[RuleBasedStateMachine], *, examples: int = 50,
                   batches: int = 4) -> str:
    """The first failure of seeded, unshrunk batches of ``examples`` examples of
    ``machine`` (at most ``batches``), or "". Fixed seeds, as ``run_until``: an edit to
    the machine's source does not move what a planted-bug test finds."""
    options = settings(bounded(examples), derandomize=False, phases=[Phase.generate])
    for index in range(batches):
        try:
            seed(index)(get_state_machine_test(machine, settings=options))()
        except AssertionError as failure:
            return str(failure)
    return ""


def heal_a_locked_tombstone(build: Build, reached: Counter[str] | None = None) -> None:
    """The machine's steps that heal tombstones a running request holds: a request
    decodes past the window of (1, 1, 1, 1) and runs on; a second one, (1, 1), finds its
    pages dead and inserts them live again (a search may miss this, so it is scripted)."""
    config = SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=2)
    state = make_swa_machine(build, config, reached)()
    try:
        state.run_request((1, 1, 1, 1), past=2, keep=True)
        state.run_request((1, 1), past=0, keep=False)
    finally:
        state.teardown()


def joint_eviction(build: Build, reached: Counter[str]) -> None:
    """The server allocator's eviction (spec/13 13.3), scripted: two cached live leaves,
    (1, 2) and (3, 4) at page size 1; the allocator is short of one full and one SWA
    token. Deleting one leaf frees a slot of each pool, which meets both targets: the SWA
    phase must take nothing."""
    config = SwaConfig(page_size=1, full_slots=6, swa_slots=4, window=2)
    state = make_swa_machine(build, config, reached)()
    try:
        state.run_request((1, 2), past=0, keep=False)
        state.run_request((3, 4), past=0, keep=False)
        swa_free = len(state.model.swa_free)
        state.evict_joint(1, 1)
        assert len(state.model.pages) == 2, state.model.pages  # one leaf of two pages went
        assert len(state.model.swa_free) == swa_free + 2
    finally:
        state.teardown()


def plant_full_target_misread(monkeypatch: MonkeyPatch) -> None:
    """A private copy of SGLang 0.5.23 whose allocation eviction reads the full pool's
    available size as 0 (Python, above either tree core): the full walk never sees its
    target met and takes every evictable leaf."""
    urc = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    available = urc.UnifiedRadixCache._component_available_size
    full = urc.ComponentType.FULL

    def misread(self: Any, component_type: Any) -> int:
        return 0 if component_type == full else int(available(self, component_type))

    monkeypatch.setattr(urc.UnifiedRadixCache, "_component_available_size", misread)


def interleaved_eviction(build: Build) -> Counter[str]:
    """A request whose allocation makes SGLang 0.5.23's evict_for_alloc take 8 pages in
    three chains, one of them split around another: the full walk deletes a tombstone
    node and the first page of a live one, the SWA walk tombstones that node's parent (an
    internal node then), then deletes the rest of the node. Shrunk from a campaign whose
    machine tried only up to 7 interleaved pages and reported it."""
    reached: Counter[str] = Counter()
    config = SwaConfig(page_size=2, full_slots=20, swa_slots=10, window=1)
    state = make_swa_machine(build, config, reached)()
    try:
        state.run_request((3, 1), past=0, keep=False)
        state.run_request((1, 1, 1, 1, 1, 1), past=3, keep=False)
        state.run_request((3, 1, 1, 1, 1, 1, 1, 1, 1, 1), past=0, keep=False)
        state.run_request((1,) * 11, past=0, keep=False)
    finally:
        state.teardown()
    return reached


def fails_only_when_planted(machine: Callable[[], type[RuleBasedStateMachine]],
                            plant: Callable[[MonkeyPatch], None], monkeypatch: MonkeyPatch,
                            expected: str, examples: int = 200) -> None:
    """A seeded run of a fresh ``machine()`` passes, then fails with ``expected`` once
    ``plant`` is in the engine: the observation the plant targets can fail."""
    run_state_machine_as_test(machine(), settings=bounded(examples))
    plant(monkeypatch)
    unshrunk = settings(bounded(examples), phases=[Phase.generate])  # no shrinking
    with pytest.raises(AssertionError, match=expected):
        run_state_machine_as_test(machine(), settings=unshrunk)
