"""SGLang 0.5.20's own KV events replayed against the model (spec/11, 11.6; skipped
without SGLang).

The differential machine drives SGLang's HiRadixCache as for test_sglang_adapters, with
its event recorder enabled (``--enable-kv-cache-events``); after every step the events
it recorded are decoded (``SglangEvents``) and must replay to the model's device and
host residency (INV-EVENTS-REPLAY). Requests carry no namespace: SGLang's event hashes
leave it out (DEV-E1, reproduced below).
"""

from __future__ import annotations

from typing import Any

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import invariant, rule, run_state_machine_as_test

from hiradix.conformance.differential import make_differential, tokens
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix.engines.sglang.events import SglangEvents

from engine_env import require


@pytest.fixture(autouse=True)
def sglang_0_5_20() -> None:
    require("sglang")


def with_events(scenario: Scenario) -> type[Any]:
    """The differential machine over SGLang, without namespaces, checking SGLang's
    event stream after every step."""
    base: type[Any] = make_differential(factory("sglang", scenario))

    class WithEvents(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            self.events = SglangEvents(self.engine.cache)

        @rule(tokens=tokens, dt=st.integers(0, 2), chunked=st.booleans(),
              priority=st.integers(0, 2), keep_lock=st.booleans())
        def request(self, tokens: tuple[int, ...], dt: int,  # type: ignore[override]
                    chunked: bool, priority: int, keep_lock: bool,
                    namespace: None = None) -> None:
            super().request(tokens, namespace, dt, chunked, priority, keep_lock)

        @invariant()
        def sglang_events_replay(self) -> None:
            problems = self.events.check(self.model)
            assert not problems, f"INV-EVENTS-REPLAY (SGLang's events): {problems[:6]}"

    return WithEvents


def serve(machine: Any, key: tuple[int, ...], namespace: str | None = None) -> None:
    machine.request(tokens=key, namespace=namespace, dt=1, chunked=False, priority=0,
                    keep_lock=False)
    machine.engine_refines_the_model()


def tour(machine: Any) -> None:
    """Insert, write-through and its acknowledgement, eviction, load back, host
    eviction, reset; checked after every step."""
    steps = [lambda: serve(machine, (1, 2, 3, 4)), lambda: serve(machine, (1, 2, 3, 4)),
             machine.writing_check, lambda: machine.evict(12), lambda: machine.load_back(0),
             machine.loading_check, lambda: machine.evict(12),
             lambda: machine.evict_host(12), lambda: serve(machine, (5, 6, 7, 8)),
             lambda: serve(machine, (5, 6, 7, 8)), machine.writing_check,
             lambda: machine.reset(0)]
    for step in steps:
        step()
        machine.engine_refines_the_model()
        machine.sglang_events_replay()


def test_a_tour_of_every_event_replays_exactly() -> None:
    machine = with_events(Scenario(page_size=2))()
    tour(machine)
    machine.teardown()
    counts = machine.events.counts
    for name in ("stored device", "stored host", "removed device", "removed host",
                 "cleared device"):
        assert counts.get(name), f"the tour saw no {name}: {counts}"


@pytest.mark.parametrize("dropped", ["GPU", "CPU_PINNED"])
def test_a_forgotten_sglang_removal_fails_the_replay(dropped: str) -> None:
    """The check can fail: SGLang's recorder made to forget its removals on one medium
    (as a path that skips ``record_remove`` would) breaks the tour's replay."""
    machine = with_events(Scenario(page_size=2))()
    recorder = machine.engine.cache.kv_events
    remove = recorder.record_remove

    def forgetful(node: Any, medium: Any = None) -> None:
        if (medium or "GPU") != dropped:
            remove(node, medium)

    recorder.record_remove = forgetful
    with pytest.raises(AssertionError, match="INV-EVENTS-REPLAY"):
        tour(machine)
    machine.teardown()


SCENARIOS = [Scenario(page_size=ps, write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for ps, policy, strategy in [(1, "write_through", "lru"),
                                          (2, "write_through_selective", "lfu"),
                                          (4, "write_through", "fifo")]]


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_sglang_events_replay_to_the_model(scenario: Scenario) -> None:
    current = settings()
    run_state_machine_as_test(with_events(scenario), settings=settings(
        current, max_examples=max(1, current.max_examples // 15)))


def test_dev_e1_event_hashes_leave_the_namespace_out() -> None:
    """spec/11 DEV-E1, reproduced: the same tokens cached under two namespaces are
    published under one block hash, so a router cannot tell the pages apart, and the
    removal of one reads as the removal of both. If this fails, SGLang fixed it: update
    DEV-E1 and let the event runs above use namespaces."""
    machine = make_differential(factory("sglang", Scenario(page_size=2)))()
    recorder = machine.engine.cache.kv_events
    recorder.enabled = True
    serve(machine, (1, 2))
    serve(machine, (1, 2), namespace="b")
    stored = [e for e in recorder.take() if type(e).__name__ == "BlockStored"]
    assert len(stored) == 2
    assert stored[0].block_hashes == stored[1].block_hashes
    assert {k.namespace for k in machine.model.pages} == {None, "b"}
    machine.teardown()
