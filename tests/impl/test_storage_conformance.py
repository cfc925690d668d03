"""The storage tier refines the model (spec/09): the storage conformance machine under
the Hypothesis profile, with faults injected into the backend; faults are tallied here."""

from __future__ import annotations

from collections import Counter

import pytest
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_machine import make_storage_machine
from hiradix.conformance.tally import Tally

SCENARIOS = [
    Scenario(),
    Scenario(write_policy="write_through_selective", page_size=1, host_pages=10),
]
FAULTS: Counter[str] = Counter()
TALLY = Tally()


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_storage_tier_refines_the_model(scenario: Scenario) -> None:
    current = settings()
    machine = make_storage_machine(scenario, TALLY, FAULTS)
    run_state_machine_as_test(machine, settings=settings(
        current, max_examples=max(1, current.max_examples // 2),
        suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
    assert TALLY.examples > 0 and TALLY.checks > 0


def test_the_runs_exercised_storage_and_faults() -> None:
    """After the machine runs (same module, run in order): storage steps and faults."""
    if TALLY.examples == 0:
        pytest.skip("run with the conformance test")
    for name in ("attach_storage", "prefetch_from_storage", "check_prefetch_progress",
                 "io_prefetch_query", "drain_storage_queues"):
        assert TALLY.ops[name] > 0, (name, dict(TALLY.ops))
    assert sum(FAULTS.values()) > 0
    print(f"\nstorage conformance: {TALLY.examples} examples, {TALLY.steps} steps, "
          f"{TALLY.checks} checks; faults injected {dict(sorted(FAULTS.items()))}; "
          f"ops {dict(sorted(TALLY.ops.items()))}")
