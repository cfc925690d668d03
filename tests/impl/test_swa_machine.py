"""Our (FULL, SWA) cache through the hybrid machine (spec/13), and bugs planted in it.

The machine must pass on our cache; each planted bug -- a stale full->SWA mapping entry,
an SWA lock one page short of the window, healing that frees the full slots a running
request reads -- must make it fail, naming what broke. The same machine checks SGLang in
tests/engines/test_sglang_swa.py.
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable, Iterator

import pytest
import torch
from hybrid_support import bounded, heal_a_locked_tombstone
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.hybrid.campaign import hybrid_configs
from hiradix.conformance.hybrid.machine import make_swa_machine
from hiradix.engines.ours.swa import build
from hiradix.hybrid.cache import SwaCache
from hiradix.hybrid.pools import SwaPools
from hiradix.hybrid.tree import SwaTree
from hiradix_model.hybrid import SwaConfig


@pytest.mark.parametrize("config", hybrid_configs([1, 2, 4]), ids=str)
def test_our_cache_refines_the_model(config: SwaConfig) -> None:
    reached: Counter[str] = Counter()
    run_state_machine_as_test(make_swa_machine(build, config, reached), settings=bounded(30))
    assert reached["checks"] > reached["examples"]


def test_a_campaign_reaches_every_hybrid_situation() -> None:
    reached: Counter[str] = Counter()
    for config in hybrid_configs([1, 2]):
        run_state_machine_as_test(make_swa_machine(build, config, reached),
                                  settings=bounded(40))
    # Healing under a lock is driven by scripted steps below (a search may miss it).
    for situation in ("healed", "inserted_tombstones", "tombstoned",
                      "evict_full", "evict_swa", "alloc_short", "release_swa", "finish"):
        assert reached[situation], f"never reached: {situation}"


def stale_mapping(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releasing an SWA copy forgets to clear the pair's mapping entry."""
    original = SwaPools.release

    def release(self: SwaPools, full_parts: list[torch.Tensor],
                swa_parts: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        saved = [(full, self.mapping[full].clone()) for full, _ in swa_parts]
        original(self, full_parts, swa_parts)
        for full, entries in saved:
            self.mapping[full] = entries

    monkeypatch.setattr(SwaPools, "release", release)


def short_window(monkeypatch: pytest.MonkeyPatch) -> None:
    """An SWA lock covers one page fewer than the window."""
    original = SwaTree.window

    def window(self: SwaTree, node: object) -> object:
        self.window_pages -= 1
        try:
            return original(self, node)  # type: ignore[arg-type]
        finally:
            self.window_pages += 1

    monkeypatch.setattr(SwaTree, "window", window)


def heal_under_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Healing a locked tombstone frees the full slots its holder reads."""
    original = SwaCache._heal

    def heal(self: SwaCache, node: object, *args: object) -> None:
        saved, node.lock_ref = node.lock_ref, 0  # type: ignore[attr-defined]
        try:
            original(self, node, *args)  # type: ignore[arg-type]
        finally:
            node.lock_ref = saved  # type: ignore[attr-defined]

    monkeypatch.setattr(SwaCache, "_heal", heal)


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "stale mapping": (stale_mapping, "still maps to SWA slot"),
    "short window": (short_window, "swa_lock"),
}


@pytest.fixture(params=sorted(PLANTED))
def planted(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> Iterator[str]:
    plant, expected = PLANTED[request.param]
    plant(monkeypatch)
    yield expected


def test_a_planted_bug_fails_the_machine(planted: str) -> None:
    config = SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=2)
    with pytest.raises(Exception, match=planted):
        run_state_machine_as_test(make_swa_machine(build, config), settings=bounded(300))




def test_healing_a_locked_tombstone_keeps_its_full_slots() -> None:
    reached: Counter[str] = Counter()
    heal_a_locked_tombstone(build, reached)
    assert reached["healed_keeping_full"] == 2


def test_healing_that_frees_a_locked_pages_full_slots_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    heal_under_lock(monkeypatch)
    with pytest.raises(Exception, match="which a running request reads"):
        heal_a_locked_tombstone(build)
