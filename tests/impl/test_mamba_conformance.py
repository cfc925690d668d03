"""Our (FULL, MAMBA) cache through the Mamba machine (spec/13m), and bugs planted in it.

A small seeded campaign must run clean and reach every situation the campaign names
(forks, hits past the state, state tombstones and their refill, both evictions, short
pools, early state releases); each planted bug -- a fork that copies no bytes, a state
eviction that ignores state locks, a split that leaves the state on the upper part --
must make it fail, naming what broke.
"""

from __future__ import annotations

import math
from collections.abc import Callable

import pytest
from hypothesis import HealthCheck, Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.mamba.campaign import REACH, MambaCampaign, run_campaign
from hiradix.conformance.mamba.machine import make_mamba_machine
from hiradix.engines.ours.mamba import build
from hiradix.mamba import evict, tree
from hiradix.mamba.node import MambaNode, split
from hiradix.mamba.pools import StatePool
from hiradix_model.mamba import MambaConfig


def campaign(examples: int) -> MambaCampaign:
    """A seeded campaign of ``examples`` examples over page sizes 1 and 2 (no deadline:
    the example count ends it)."""
    return run_campaign("ours-mamba", build, [1, 2], until=math.inf, examples=examples,
                        seeded=1)


def test_a_seeded_campaign_runs_clean_and_reaches_every_situation() -> None:
    result = campaign(40)
    assert result.failure is None, result.failure
    assert result.reached["examples"] >= 40
    assert result.reached["checks"] > result.reached["examples"]
    missed = [name for name in REACH if not result.reached[name]]
    assert not missed, result.describe()


def fork_without_copy(monkeypatch: pytest.MonkeyPatch) -> None:
    """``fork`` hands out a fresh slot but copies no bytes into it."""
    monkeypatch.setattr(StatePool, "fork", lambda self, source: self.alloc())


def evict_locked_states(monkeypatch: pytest.MonkeyPatch) -> None:
    """``evict_states`` forgets state locks: a running request's state may go."""
    original = evict.evict_states

    def forgetful(the_tree: tree.MambaTree, *args: object) -> int:
        saved = {n: n.state_lock_ref for n in the_tree.nodes()}
        for node in saved:
            node.state_lock_ref = 0
        try:
            return original(the_tree, *args)  # type: ignore[arg-type]
        finally:
            for node, count in saved.items():
                node.state_lock_ref = count

    monkeypatch.setattr("hiradix.mamba.cache.evict_states", forgetful)


def split_state_upward(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split hands the state to the new upper part (13m.8: it stays on the lower)."""
    def wrong(node: MambaNode, at: int, page_size: int, node_id: int) -> MambaNode:
        upper = split(node, at, page_size, node_id)
        upper.state, node.state = node.state, None
        upper.state_digest, node.state_digest = node.state_digest, None
        return upper

    monkeypatch.setattr(tree, "split", wrong)


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "fork without copy": (fork_without_copy, r"after fork\(.*\n +state_kv: model"),
    "evict locked states": (evict_locked_states, r"evict_states\(.* may not be taken now"),
    # Either the insert's answer (it sees no state where the model has one) or, where the
    # draw reaches it first, the upper page's state holding the lower page's content.
    "state split upward": (split_state_upward, r"insert\(.*\) returned \(\d+, False\), "
                                               r"the model \(\d+, True\)|"
                                               r"engine INV-MAMBA-CONTENT: .* holds the state "
                                               r"after"),
}


def no_shrinking(examples: int) -> settings:
    """A derandomized run of ``examples`` examples that stops at the first failure
    (shrinking it would take most of the test's time)."""
    return settings(max_examples=examples, stateful_step_count=30, deadline=None,
                    database=None, derandomize=True, phases=[Phase.generate],
                    suppress_health_check=list(HealthCheck))


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_planted_bug_fails_the_machine(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, expected = PLANTED[name]
    plant(monkeypatch)
    config = MambaConfig(page_size=1, full_slots=10, state_slots=3)
    with pytest.raises(AssertionError, match=expected):
        run_state_machine_as_test(make_mamba_machine(build, config), settings=no_shrinking(300))


def test_a_planted_bug_fails_the_campaign(monkeypatch: pytest.MonkeyPatch) -> None:
    fork_without_copy(monkeypatch)
    result = campaign(200)
    assert result.failure is not None, result.describe()
    assert "state_kv: model" in result.failure, result.failure
