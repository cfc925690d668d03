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
from hiradix.storage.hashing import page_hashes
from hiradix_model import Key

from stats import SUMMARY

SCENARIOS = [
    Scenario(),
    Scenario(write_policy="write_through_selective", page_size=1, host_pages=10),
    Scenario(write_policy="write_back", host_pages=6),
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
    # Issue 15: the rare states the swarm, the small hosts and the short timeouts reach.
    for state in ("host full", "host pages all protected", "prefetch in flight",
                  "storage write in flight", "branching host-only subtree"):
        assert TALLY.states[state] > 0, (state, dict(TALLY.states))
    SUMMARY.append(f"impl storage conformance: {TALLY.examples} examples, {TALLY.steps} "
                   f"steps, {TALLY.checks} checks; faults "
                   f"{dict(sorted(FAULTS.items()))}; ops {dict(sorted(TALLY.ops.items()))}; "
                   f"states {dict(sorted(TALLY.states.items()))}; "
                   f"swarm {dict(sorted(TALLY.swarm.items()))}")


TOKENS = (1, 2, 3, 1, 2, 3, 1, 2)


@pytest.mark.parametrize("fault", ["corrupt", "short", "raise"])
def test_a_faulty_fetch_is_a_step_of_the_machine(fault: str) -> None:
    """One round trip, driven by hand, whose fetch takes ``fault`` at its first page: the
    machine reports it to the model as that fault and both agree afterwards (with
    ``corrupt``, the page is discarded on both sides)."""
    seen: Counter[str] = Counter()
    machine = make_storage_machine(Scenario(), None, seen)()
    machine.cycle(request="r0", index=0, evict=24, use_anchor=False, dt=0, run=True,
                  fresh=(TOKENS, None), fetch_fault=(fault, 0))
    machine.refines_the_model()
    assert seen[f"fetch reported:{fault}"] == 1, dict(seen)
    storage, identity = machine.model.storage, machine.tier.identity
    assert storage is not None and identity is not None
    first_page = Key(TOKENS[:2])
    first_hash = page_hashes(list(TOKENS[:2]), 2, identity, None)[0]
    kept = fault != "corrupt"  # a corrupt page is discarded, on both sides
    assert (storage.sid(first_page) in storage.stored) is kept
    assert machine.backend.inner.has_page(first_hash) is kept
    assert machine.backend.metrics.corrupt == (not kept)
    machine.teardown()
