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

from hiradix.conformance.hybrid.abstraction import Codes, abstract, host_problems, with_host
from hiradix.conformance.hybrid.campaign import hybrid_configs
from hiradix.conformance.hybrid.engine import (
    SwaHostPageView,
    SwaHostView,
    SwaPageView,
    SwaView,
)
from hiradix.conformance.hybrid.machine import make_swa_machine
from hiradix.engines.ours.swa import build
from hiradix.hybrid.cache import SwaCache
from hiradix.hybrid.pools import SwaPools
from hiradix.hybrid.tree import SwaTree
from hiradix_model import Key
from hiradix_model.components import expected_kv
from hiradix_model.hybrid import SwaConfig, SwaState


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


# -- the host view's judge (spec/13 13.8a): what an engine's host tier is held to ----------

def _host_state(full: tuple[int, ...]) -> tuple[SwaState, Key]:
    """A one-page cache whose page has an SWA host copy, and a full host one if ``full``;
    the page's KV written under the machine's codes."""
    config = SwaConfig(page_size=1, full_slots=4, swa_slots=4, window=1)
    key, codes = Key((7,), None), Codes()
    code = codes.code(expected_kv(key, 0, 1))
    view = SwaView(pages={key: SwaPageView(full=(0,), swa=(0,), lock=0, swa_lock=0)},
                   full_free=frozenset({1, 2, 3}), swa_free=frozenset({1, 2, 3}),
                   pairs={0: 0}, full_kv={0: code}, swa_kv={0: code}, own_check=None)
    host = SwaHostView(pages={key: SwaHostPageView(full=full, swa=(1,))}, full_slots=2,
                       swa_slots=2, full_free=frozenset({0, 1}) - set(full),
                       swa_free=frozenset({0}), full_kv={s: code for s in full},
                       swa_kv={1: code})
    return with_host(abstract(view, config, codes), host, codes), key


def test_the_host_judge_passes_a_whole_host_copy_and_names_a_missing_full_one() -> None:
    whole, _ = _host_state((1,))
    assert host_problems(whole, {}) == []
    alone, key = _host_state(())
    assert [p.split(":")[0] for p in host_problems(alone, {})] == [
        "INV-SWA-HOST-ONLY-WITH-FULL"]
    # DEV-H11 exempts that page from that invariant only; a pool is never exempt.
    assert host_problems(alone, {"INV-SWA-HOST-ONLY-WITH-FULL": frozenset({key})}) == []
    with pytest.raises(AssertionError, match="per-page"):
        host_problems(alone, {"INV-SWA-HOST-POOL": frozenset({key})})
