"""The conformance suite: the implementation refines the model, step by step (spec/06).

Parametrised over page size, write policy, eviction strategy, host layout and MHA/MLA;
the full cross product runs in `hiradix check`, CI runs a spread of it here.
"""

from __future__ import annotations

import itertools

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.machine import make_machine
from hiradix.conformance.scenario import Scenario
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
