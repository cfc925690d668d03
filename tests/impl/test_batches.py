"""The component campaigns' batch loop (hiradix.conformance.batches): it stops at the first
failure and bounds the shrinking of that failure."""

from __future__ import annotations

from collections import Counter

from hypothesis import strategies as st
from hypothesis.internal.conjecture import engine as hypothesis_engine
from hypothesis.stateful import RuleBasedStateMachine, rule

from hiradix.conformance.batches import run_batches


def failing_machine(seen: list[float]) -> type[RuleBasedStateMachine]:
    """A machine that fails once it draws a number above 5, noting the shrinking bound
    in force at each step."""

    class Failing(RuleBasedStateMachine):
        @rule(n=st.integers(0, 10))
        def step(self, n: int) -> None:
            seen.append(hypothesis_engine.MAX_SHRINKING_SECONDS)
            assert n <= 5, f"drew {n}"

    return Failing


def test_a_failure_stops_the_campaign_and_its_shrinking_is_bounded() -> None:
    seen: list[float] = []
    before = hypothesis_engine.MAX_SHRINKING_SECONDS
    ran = run_batches([None], lambda config: failing_machine(seen), Counter(),
                      until=float("inf"), examples=None, seeded=0, shrink_seconds=7)
    assert ran.failure is not None and "drew 6" in ran.failure  # shrunk to the least
    assert seen and set(seen) == {7}
    assert before == hypothesis_engine.MAX_SHRINKING_SECONDS  # restored
