"""Every invariant predicate can fail: each corruption of a valid state trips its own ID."""

from __future__ import annotations

import pytest

from hiradix_model import INVARIANTS, check, violations

import scenario
from mutants import MUTANTS


def test_the_scenario_state_satisfies_every_invariant() -> None:
    assert violations(scenario.build()) == {}


@pytest.mark.parametrize("spec_id", sorted(MUTANTS))
def test_corruption_is_caught(spec_id: str) -> None:
    corrupted = MUTANTS[spec_id](scenario.build())
    assert spec_id in check(corrupted), violations(corrupted)
    assert violations(corrupted)[spec_id], "a failing predicate must say what it found"


def test_every_predicate_carries_its_spec_id() -> None:
    for spec_id, predicate in INVARIANTS.items():
        assert predicate.spec_id == spec_id  # type: ignore[attr-defined]
