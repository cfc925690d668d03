"""The conformance suite: the implementation refines the model, step by step (spec/06).

Parametrised over page size, write policy, eviction strategy, host layout and MHA/MLA;
the full cross product runs in `hiradix check`, CI runs a spread of it here.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.policies import STRATEGIES, WRITE_POLICIES

PAGE_SIZES = (1, 2, 4, 16)

# Every policy x strategy pair once, page sizes and layouts rotated through them.
SCENARIOS = [
    Scenario(page_size=PAGE_SIZES[i % 4], write_policy=policy, eviction=strategy,  # type: ignore[arg-type]
             host_layout=("layer_first", "page_first")[i % 2],
             kv_layout=("mha", "mla")[(i // 2) % 2])
    for i, (policy, strategy) in enumerate(itertools.product(WRITE_POLICIES, STRATEGIES))
]


def scale(examples: int) -> settings:
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // examples))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_implementation_refines_model(scenario: Scenario) -> None:
    run_state_machine_as_test(make_machine(scenario), settings=scale(10))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_cuda_engine_refines_model(page_size: int, policy: str) -> None:
    scenario = Scenario(page_size=page_size, write_policy=policy,  # type: ignore[arg-type]
                        device="cuda", engine="cuda")
    run_state_machine_as_test(make_machine(scenario), settings=scale(10))


# The fixed set of the sink's reach test (issue 35: what a reach test finds must not
# depend on the draw): derandomized, its size and length here rather than the profile's.
SINK_SETTINGS = settings(max_examples=200, stateful_step_count=40, derandomize=True,
                         deadline=None, database=None)
SINK_OUTCOMES = ("sink raised: EventSinkError with the result",
                 "sink raised: KeyboardInterrupt propagated",
                 "sink raised: SystemExit propagated")


def test_the_fixed_set_reaches_a_raising_sink_on_every_outcome() -> None:
    """``sink_raises`` (issue 34; spec/11 11.7): a sink raising an Exception (the result
    comes back in an EventSinkError), a KeyboardInterrupt and a SystemExit (propagated,
    the state whole), each in the middle of an operation's events and after every step
    compared with the model and the event stream."""
    tally = Tally()
    run_state_machine_as_test(make_machine(Scenario(page_size=2, write_policy="write_through"),
                                           tally), settings=SINK_SETTINGS)
    missing = [outcome for outcome in SINK_OUTCOMES if not tally.ops[outcome]]
    sink = {k: n for k, n in tally.ops.items() if "sink" in k}
    assert not missing, (missing, sink)
    print(f"sink reach, fixed set: {tally.examples} examples; {sink}")
    assert tally.ops["sink armed: raised"] > 0


def test_a_check_that_leaves_a_finished_load_unacknowledged_fails_the_machine() -> None:
    """The machine compares what a check acknowledged with the copies the copy engine
    finished (issue 32: the model takes whatever count it is given). A planted
    loading_check that leaves a lone finished load pending is caught."""
    from impl_mutants import MUTANTS
    mutant = next(m for m in MUTANTS if m.name == "lone_load_left_unacknowledged")
    scenario = Scenario(page_size=1, write_policy="write_back", engine="controlled")
    found = settings(max_examples=300, stateful_step_count=40, derandomize=True,
                     deadline=None, database=None, phases=[Phase.generate])
    with mutant.planted(), pytest.raises(AssertionError, match="had finished"):
        run_state_machine_as_test(make_machine(scenario), settings=found)
