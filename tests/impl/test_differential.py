"""The differential suite on our own engine: adapter protocol, choice inference, mapping.

Ours must pass the engine-generic suite exactly (no adopted fields, no mappings), which
checks that the inference of choices from states is sound: had it guessed a choice the
model rejects, or an order R1 forbids, these runs would fail.
"""

from __future__ import annotations

import itertools
import json
from collections.abc import Sequence
from dataclasses import replace
from pathlib import Path

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.cli import main
from hiradix.conformance import infer
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix.engines.ours.cache import OursAdapter
from hiradix.policies import STRATEGIES
from hiradix_model import Config, Key, Page, State, Victim, initial, ops, trace
from hiradix_model.errors import IllegalChoice

from fixed_runs import drive

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
        factory("lmcache", Scenario())


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


def test_a_recorded_trace_of_ours_replays_clean(tmp_path: Path) -> None:
    """`hiradix check --engine ours --record` writes a trace `hiradix replay` accepts."""
    path = tmp_path / "ours.jsonl"
    assert main(["check", "--engine", "ours", "--examples", "6", "--steps", "25",
                 "--record", str(path)]) == 0
    lines = path.read_text().splitlines()  # the last example may have no steps at all
    assert lines and '"engine": "hiradix"' in lines[0]
    applied, finding = trace.replay(lines)
    assert finding is None and applied == len(lines) - 1


def test_replay_points_at_a_tampered_observation() -> None:
    lines = drive(Scenario(page_size=1), "ours")
    index = next(i for i, line in enumerate(lines) if '"op": "evict"' in line)
    record = json.loads(lines[index])
    record["observed"] = (record["observed"] or 0) + 1
    lines[index] = json.dumps(record)
    _, finding = trace.replay(lines)
    assert finding is not None and finding.line == index + 1 and finding.op == "evict"


def test_a_fixed_run_of_ours_replays_clean() -> None:
    lines = drive(Scenario(page_size=1), "ours")
    assert trace.replay(lines) == (len(lines) - 1, None)


def test_inference_backtracks_when_a_kept_leaf_would_outrank_the_next_victim() -> None:
    """MRU, target 3. The engine evicted (3, 2), and the node (1,)b-(1, 3)b, and kept (3,)
    (tick 2). Taking (3, 2) first would make (3,) the most recent leaf, which must then go
    next: the only legal order takes the other node first, and (3, 2) last."""
    x, y = Key((3,)), Key((3, 2))
    z, w = Key((1,), "b"), Key((1, 3), "b")
    pages = {x: Page((0,), (0,), last_tick=2), y: Page((1,), (1,)), z: Page((2,), (2,)),
             w: Page((3,), (3,))}
    config = Config(page_size=1, device_slots=4, host_slots=4, eviction="mru")
    before = replace(initial(config), pages=pages, device_free=frozenset(), clock=2)
    after = replace(before, pages={k: replace(p, device=None) if k != x else p
                                   for k, p in pages.items()},
                    device_free=frozenset({1, 2, 3}))
    chosen = infer.device_victims(before, before, after, 3)
    assert chosen == (Victim(w), Victim(z), Victim(y))
    ops.evict(before, 3, chosen)  # the model accepts it


def test_the_check_summary_covers_every_invariant() -> None:
    from hiradix.conformance.machine import EXERCISED
    from hiradix_model import INVARIANTS
    assert set(EXERCISED) == set(INVARIANTS)


def test_a_load_infers_its_victims_with_the_anchor_locked() -> None:
    """FIFO: the load's anchor (1,) is the oldest device leaf, but the load locks it while
    it evicts, so the engine evicts the other leaf's node. The inference must rank the
    victims against the leaves evictable then, or it finds no order and the model
    rejects a legal eviction (a shrunk campaign failure, page size 4)."""
    machine = make_differential(factory("ours", Scenario(page_size=1, eviction="fifo")))()
    for tokens in [(1,), (1, 2)]:  # two nodes
        machine.request(tokens=tokens, namespace=None, dt=1, chunked=False, priority=0,
                        keep_lock=False)
    machine.writing_check()
    machine.evict(num_tokens=1)  # (1, 2) goes to host only; (1,) is the oldest leaf
    machine.engine_refines_the_model()
    machine.request(tokens=(3, 4, 5, 6, 7), namespace=None, dt=1, chunked=False,
                    priority=0, keep_lock=False)
    machine.writing_check()
    assert not machine.model.device_free  # the load must evict
    machine.load_back(index=0)  # (1, 2), anchored at (1,)
    machine.engine_refines_the_model()
    assert machine.model.pages[Key((1, 2))].device is not None
    machine.teardown()


class KeepsTheCallersList(OursAdapter):
    """A planted adapter bug (issue 17): it writes KV lazily, at its next look at the
    engine, from the very list the caller handed it."""

    def __init__(self, scenario: Scenario) -> None:
        super().__init__(scenario)
        self.later: tuple[Sequence[int], Sequence[Key]] | None = None

    def write_kv(self, slots: Sequence[int], contents: Sequence[Key]) -> None:
        self.later = (slots, contents)

    def observe(self, model: State) -> State:
        if self.later is not None:
            super().write_kv(*self.later)
            self.later = None
        return super().observe(model)


def test_the_suite_scribbles_over_the_slots_it_hands_an_adapter() -> None:
    """The caller reuses its buffer after each call: an adapter that kept the list it was
    given writes the KV into other slots, and the next comparison fails."""
    machine = make_differential(lambda: KeepsTheCallersList(Scenario()))()
    with pytest.raises(AssertionError, match="disagree"):
        machine.request(tokens=(1, 2, 3, 1), namespace=None, dt=0, chunked=False,
                        priority=0, keep_lock=False)
        machine.engine_refines_the_model()
    machine.teardown()
