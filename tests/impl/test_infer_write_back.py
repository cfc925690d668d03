"""Choice inference under write_back (``infer.WriteBack``; spec/03 3.8, R1, R2).

A write-back eviction backs a victim without a host copy up as it leaves, after making
host room, or drops it with its subtree when there is none; a page may be backed up and
leave the host again within one call. The model states below are built with the model's
own operations; each eviction is one the spec allows, and the inference must find a
report the model accepts that ends in the same state. The differential runs check the
same on our engine, where the victims come from the implementation.
"""

from __future__ import annotations

from dataclasses import replace

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance import infer
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix.policies import STRATEGIES
from hiradix_model import Config, Key, State, Victim, initial, ops
from hiradix_model.errors import IllegalChoice

WRITE_BACK = [Scenario(page_size=(1, 2, 4)[i % 3], write_policy="write_back",
                       eviction=strategy)  # type: ignore[arg-type]
              for i, strategy in enumerate(STRATEGIES)]


@pytest.mark.parametrize("scenario", WRITE_BACK, ids=lambda s: s.slug())
def test_ours_passes_the_differential_suite_under_write_back(scenario: Scenario) -> None:
    current = settings()
    bounded = settings(current, max_examples=max(1, current.max_examples // 20))
    run_state_machine_as_test(make_differential(factory("ours", scenario)), settings=bounded)


def _cache(host_slots: int) -> State:
    return initial(Config(page_size=1, device_slots=4, host_slots=host_slots,
                          write_policy="write_back", eviction="lru", load_back_threshold=1))


def _insert(state: State, tokens: tuple[int, ...], now: int) -> State:
    key = Key(tokens)
    slots = tuple(sorted(state.device_free))[:len(tokens)]
    state, _ = ops.alloc(state, key, 0, slots)
    state, _ = ops.insert(state, key, slots, now)
    return state


def _infers(before: State, target: int, victims: tuple[Victim, ...]) -> tuple[Victim, ...]:
    """Evict with ``victims`` (legal by the spec), infer from the two states, and check
    that the model accepts the inferred report and reaches the same state."""
    after, evicted = ops.evict(before, target, victims)
    found = infer.device_victims(before, before, after, target)
    again, count = ops.evict(before, target, found)
    assert (again, count) == (after, evicted)
    return found


def test_a_page_backed_up_and_host_evicted_in_the_same_call() -> None:
    """Two host slots, the chain (1, 2, 3) on device only: (1, 2, 3) and (1, 2) take the
    free slots, then (1,) evicts (1, 2, 3) from host (the only host leaf) and takes its
    slot. (1, 2, 3) shows nowhere afterwards; its slot is the one (1,) holds."""
    before = _insert(_cache(2), (1, 2, 3), 1)
    found = _infers(before, 3, (Victim(Key((1, 2, 3)), (), (0,)),
                                Victim(Key((1, 2)), (), (1,)),
                                Victim(Key((1,)), (Key((1, 2, 3)),), (0,))))
    assert found[0] == Victim(Key((1, 2, 3)), (), (0,))


def test_a_drop_with_its_subtree_when_the_host_has_no_room() -> None:
    """One host slot, held by (5,) on both tiers (evicted, loaded back, locked): no host
    page may be evicted, so (1,) is dropped (host_slots none)."""
    state = _insert(_cache(1), (5,), 1)
    state, _ = ops.evict(state, 1, (Victim(Key((5,)), (), (0,)),))
    state, _ = ops.init_load_back(state, Key((5,)), None, device_slots=(0,))
    state, _ = ops.loading_check(state, 1)
    state, _ = ops.inc_lock_ref(state, Key((5,)))
    before = _insert(state, (1,), 2)
    assert _infers(before, 1, (Victim(Key((1,)), (), None),)) == (Victim(Key((1,)), (), None),)


def test_a_backed_up_victim_keeps_its_observed_slots_and_host_victims() -> None:
    """A full host of one host-only page (7,): the victim (1,) evicts (7,) first (R2) and
    lands in its slot."""
    state = _insert(_cache(1), (7,), 1)
    state, _ = ops.evict(state, 1, (Victim(Key((7,)), (), (0,)),))
    before = _insert(state, (1,), 2)
    assert _infers(before, 1, (Victim(Key((1,)), (Key((7,)),), (0,)),)) == (
        Victim(Key((1,)), (Key((7,)),), (0,)),)


def test_an_eviction_no_order_explains_is_passed_on_for_the_model_to_reject() -> None:
    """(2,) left the device while (1,), less recently used, stayed (LRU): no R1 order
    explains it, and the inferred report is one the model rejects."""
    state = _insert(_cache(2), (1,), 1)
    state = _insert(state, (2,), 2)
    moved = state.pages[Key((2,))]
    seen = replace(state, pages={**state.pages, Key((2,)): replace(moved, device=None,
                                                                   host=(0,))},
                   device_free=state.device_free | set(moved.device or ()),
                   host_free=state.host_free - {0})
    found = infer.device_victims(state, state, seen, 1)
    assert [v.page for v in found] == [Key((2,))]
    with pytest.raises(IllegalChoice, match="ranks"):
        ops.evict(state, 1, found)
