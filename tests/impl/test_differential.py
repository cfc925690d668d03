"""The differential suite on our own engine: adapter protocol, choice inference, mapping.

Ours must pass the engine-generic suite exactly (no adopted fields, no mappings), which
checks that the inference of choices from states is sound: had it guessed a choice the
model rejects, or an order R1 forbids, these runs would fail.
"""

from __future__ import annotations

import itertools
from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance import infer
from hiradix.conformance.adapters import factory
from hiradix.conformance.adapters.ours import OursAdapter
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.policies import STRATEGIES
from hiradix_model import Config, Key, Page, State, Victim, initial, ops
from hiradix_model.errors import IllegalChoice

SCENARIOS = [Scenario(page_size=(1, 2, 4)[i % 3], write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for i, (policy, strategy) in enumerate(
                 itertools.product(("write_through", "write_through_selective"), STRATEGIES))]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_ours_passes_the_differential_suite(scenario: Scenario) -> None:
    current = settings()
    bounded = settings(current, max_examples=max(1, current.max_examples // 20))
    run_state_machine_as_test(make_differential(factory("ours", scenario)), settings=bounded)


def test_unknown_engine_is_a_typed_error() -> None:
    with pytest.raises(ValueError, match="engine"):
        factory("vllm", Scenario())


def _state(pages: dict[Key, Page]) -> State:
    used = {s for p in pages.values() for s in p.device or ()}
    return replace(initial(Config(page_size=1, device_slots=4, host_slots=4)), pages=pages,
                   device_free=frozenset(range(4)) - used)


def test_inference_orders_a_whole_node_eviction_by_the_chain() -> None:
    """Three tied pages; the engine evicted the chain (1,)-(1,1) and (2,) for a target of
    2: only the order (2,), (1,1), (1,) is legal (the last one finishes a node)."""
    a, b, c = Key((1,)), Key((1, 1)), Key((2,))
    before = _state({a: Page((0,), (0,)), b: Page((1,), (1,)), c: Page((2,), (2,))})
    after = _state({a: Page(None, (0,)), b: Page(None, (1,)), c: Page(None, (2,))})
    chosen = infer.device_victims(before, before, after, 2)
    assert chosen == (Victim(c), Victim(b), Victim(a))


def test_inference_hands_an_unexplainable_set_to_the_model() -> None:
    """A parent evicted while its child stays on device: no legal order exists, and the
    model rejects what the inference passes on."""
    a, b = Key((1,)), Key((1, 1))
    before = _state({a: Page((0,), (0,)), b: Page((1,), (1,))})
    after = _state({a: Page(None, (0,)), b: Page((1,), (1,))})
    chosen = infer.device_victims(before, before, after, 1)
    with pytest.raises(IllegalChoice):
        ops.evict(before, 1, chosen)


def test_ours_adapter_declares_no_mappings() -> None:
    adapter = OursAdapter(Scenario())
    assert not adapter.adopted and not adapter.mapped and not adapter.avoid
