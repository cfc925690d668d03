"""SGLang 0.5.23's (FULL, MAMBA) UnifiedRadixCache with HiCache through
``adapters.sglang_mamba_hicache`` (spec/13m, device tier; spec/13 13.8 for the host tier).

Runs under ``.venv-sglang23`` (``make sglang23-env``). Skipped where SGLang is not installed
or is another version; an SGLang 0.5.23 the adapter cannot drive fails
(``engine_env.require``).

Scripted scenarios (backup, device eviction, re-adoption, a state tombstone with a host
copy, a load back) are checked by hand; bugs planted in SGLang's Mamba host path show in
the view or in ``own_check``; the Mamba machine runs the adapter under both write policies
until some node is host-only.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch
from hybrid_support import bounded, fails_only_when_planted, run_until
from hypothesis import Phase, settings
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test
from test_sglang_mamba import checked, put  # the device-tier adapter's helpers

from hiradix.conformance.mamba.engine import MambaHit, MambaView
from hiradix.conformance.mamba.machine import make_mamba_machine
from hiradix.engines.sglang.mamba_hicache import (
    MAMBA_POLICIES,
    MambaPolicy,
    SglangMambaHiCacheAdapter,
    build_hicache,
)
from hiradix.engines.sglang.unified import radix_key
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

from engine_env import require

ENGINE = "sglang-mamba-hicache-write_through"
K4, K8 = (Key(tuple(range(1, n + 1)), None) for n in (4, 8))
CONFIG = MambaConfig(page_size=1, full_slots=16, state_slots=4)


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


Make = Callable[[MambaPolicy], SglangMambaHiCacheAdapter]


@pytest.fixture
def make() -> Iterator[Make]:
    """``build_hicache(policy)(CONFIG)``; every cache a test builds is closed after it."""
    built: list[SglangMambaHiCacheAdapter] = []

    def tracked(policy: MambaPolicy) -> SglangMambaHiCacheAdapter:
        built.append(build_hicache(policy)(CONFIG))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


def evict_to_host(adapter: SglangMambaHiCacheAdapter, key: Key) -> None:
    """Evict ``key`` (the only thing cached) from the device: write_through backed it up
    at insert, write_back backs it up now; it stays on the host only."""
    assert adapter.evict_full(len(key.tokens)) == len(key.tokens)
    view = checked(adapter)
    assert not view.pages and view.state_free == frozenset(range(CONFIG.state_slots))
    assert adapter.host_only() == [key.tokens]
    assert adapter.node(key).component_data[adapter.mamba_ct].host_value is not None


@pytest.mark.parametrize("policy", MAMBA_POLICIES)
def test_a_backed_up_and_evicted_key_is_gone_from_the_device_view(
        make: Make, policy: MambaPolicy) -> None:
    adapter = make(policy)
    full, state = put(adapter, K4, code=44)
    held = adapter.node(K4).component_data[adapter.mamba_ct].host_value
    assert (held is not None) is (policy == "write_through")  # backed up at insert
    evict_to_host(adapter, K4)
    view = checked(adapter)
    assert set(full) <= view.full_free and state in view.state_free
    assert adapter.match_prefix(K4) == MambaHit((), None, 0)


@pytest.mark.parametrize("policy", MAMBA_POLICIES)
def test_an_insert_over_a_host_only_key_creates_its_pages_from_the_callers_slots(
        make: Make, policy: MambaPolicy, monkeypatch: pytest.MonkeyPatch) -> None:
    """SGLang re-adopts the caller's slots and state for the host-only node (and counts
    the tokens in its prefix_len); on the device nothing was cached: prefix 0, the state
    taken, the pages the caller's."""
    adapter = make(policy)
    put(adapter, K4, code=44)
    evict_to_host(adapter, K4)
    raw = adapter.cache.match_prefix(adapter.m["base"].MatchPrefixParams(
        key=radix_key(adapter.env, K4)))
    # SGLang's match counts the host copy in its full hit; the device part is empty.
    assert (raw.device_prefix_len, raw.host_hit_length, raw.full_kv_hit_length) == (0, 4, 4)
    seen: list[tuple[int, bool]] = []
    insert = adapter.cache.insert

    def spied(params: Any) -> Any:
        result = insert(params)
        seen.append((int(result.prefix_len), bool(result.mamba_exist)))
        return result
    monkeypatch.setattr(adapter.cache, "insert", spied)
    full, state = put(adapter, K4, code=45)  # asserts (0, True)
    assert seen == [(4, False)]  # DEV-H4: SGLang counts the re-adopted host-only tokens
    view = checked(adapter)
    assert {k.tokens: p.full for k, p in view.pages.items()} == {
        K4.tokens[:end]: full[end - 1:end] for end in range(1, 5)}
    assert view.pages[K4].state == state and view.state_kv[state] == 45
    assert adapter.host_only() == []
    assert adapter.match_prefix(K4) == MambaHit(full, K4, 4)


def test_a_state_evicted_from_the_device_but_backed_up_is_a_tombstone_the_match_passes(
        make: Make) -> None:
    """(1..4)'s state is backed up (write_through) and evicted from the device while
    (1..8) holds the path: SGLang's match accepts the host copy (a hit a load back would
    restore); on the device tier the page has no state and the match ends at the root."""
    adapter = make("write_through")
    put(adapter, K4, code=4)
    put(adapter, K8, code=8)
    receipt = adapter.lock(K8, True)
    assert adapter.evict_states(1) == 1
    adapter.unlock(receipt, False)
    view = checked(adapter)
    assert view.pages[K4].state is None and view.pages[K8].state is not None
    tombstone = adapter.node(K4).component_data[adapter.mamba_ct]
    assert tombstone.value is None and tombstone.host_value is not None
    key = Key((*K4.tokens, 9), None)
    raw = adapter.cache.match_prefix(adapter.m["base"].MatchPrefixParams(
        key=radix_key(adapter.env, key)))
    assert raw.best_match_node == adapter.node(K4).id  # SGLang: a host state hit
    assert adapter.match_prefix(key) == MambaHit((), None, 4)


def load_back(adapter: SglangMambaHiCacheAdapter, key: Key) -> None:
    """SGLang's load back of the host-only node ending at ``key`` (the scheduler's
    ``init_load_back`` for a request, then the start of the loading step)."""
    assert adapter.cache.load_back(adapter.node(key).id, mem_quota=None, req=None)
    adapter.cache.ready_to_load_host_cache()


@pytest.mark.parametrize("policy", MAMBA_POLICIES)
def test_a_load_back_restores_the_pages_and_the_state_into_fresh_slots(
        make: Make, policy: MambaPolicy) -> None:
    adapter = make(policy)
    put(adapter, K4, code=44)
    evict_to_host(adapter, K4)
    before = checked(adapter)
    load_back(adapter, K4)
    view = checked(adapter)
    assert sorted(len(k.tokens) for k in view.pages) == [1, 2, 3, 4]
    slots = tuple(view.pages[Key(K4.tokens[:end], None)].full[0] for end in range(1, 5))
    assert set(slots) <= before.full_free and [view.full_kv[s] for s in slots] == [0, 1, 2, 3]
    state = view.pages[K4].state
    assert state is not None and state in before.state_free and view.state_kv[state] == 44


@pytest.mark.parametrize("policy", MAMBA_POLICIES)
def test_a_load_back_as_the_scheduler_makes_it_hands_the_request_a_copy(
        make: Make, policy: MambaPolicy) -> None:
    """The adapter's ``load_back`` (the scheduler's ``init_load_back`` after a match with
    host hits): the path's full KV and the node's state come back, and the request gets
    a state slot of its own holding the same state (DEV-M14), which it then holds."""
    adapter = make(policy)
    put(adapter, K4, code=44)
    evict_to_host(adapter, K4)
    before = checked(adapter)
    assert adapter.match_prefix(K4) == MambaHit((), None, 0)
    assert adapter.last_host_match() == K4
    loaded, page, mine = adapter.load_back()
    view = checked(adapter)
    assert (loaded, page) == (4, K4) and mine is not None
    node = view.pages[K4].state
    assert node is not None and {node, mine} <= before.state_free and node != mine
    assert view.state_kv[node] == view.state_kv[mine] == 44 and mine not in view.state_free
    assert adapter.held_states == {mine}  # the request's, owned by no page
    assert adapter.match_prefix(K4).page == K4


def load_back_evicts_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load back short of full slots asks for one token less than its shortfall
    (``_load_back_transfers``' ``evict_for_alloc``, unified_radix_cache.py:1904): the pool
    stays short, and the load is called off while a leaf could have gone."""
    uni = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache").UnifiedRadixCache
    transfers, evict = uni._load_back_transfers, uni.evict_for_alloc
    loading: list[bool] = []

    def load(self: Any, **kwargs: Any) -> Any:
        loading.append(True)
        try:
            return transfers(self, **kwargs)
        finally:
            loading.pop()

    def one_short(self: Any, params: Any) -> Any:
        if loading:
            params = dataclasses.replace(params, num_tokens=params.num_tokens - 1)
        return evict(self, params)
    monkeypatch.setattr(uni, "_load_back_transfers", load)
    monkeypatch.setattr(uni, "evict_for_alloc", one_short)


def test_a_load_back_that_evicts_too_little_fails_the_load_back_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load back short of device slots is judged with the eviction it makes first
    (``mamba.machine.evicting_load``): one that evicts less than its shortfall, and so
    calls the load off, is caught; unplanted, the same seeded run passes."""
    fails_only_when_planted(crowded_host_tier_machine, load_back_evicts_short,
                            monkeypatch, r"short of \d+ full slots: its eviction took",
                            examples=150)


def crowded_host_tier_machine() -> type[RuleBasedStateMachine]:
    """``host_tier_machine`` over a device pool of four full slots: most load backs find
    it short (38 of 150 examples made one, measured)."""
    return make_mamba_machine(build_hicache("write_through"),
                              MambaConfig(page_size=1, full_slots=4, state_slots=4))


def load_back_skips_the_node(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba load-back transfer restores the request's copy but not the node's state
    (its restore left out of the transfers)."""
    component = _mamba_module().MambaComponent
    original = component.build_hicache_transfers

    def transfers(self: Any, node: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        built = original(self, node, phase, *args, **kwargs)
        if phase.name != "LOAD_BACK" or not built:
            return built
        kept = [x for x in built if not x.nodes_to_load]
        return kept or None
    monkeypatch.setattr(component, "build_hicache_transfers", transfers)


def test_a_planted_load_back_bug_fails_the_load_back_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The load back (spec/13m 13m.8b ``load_back``) can fail: a load whose node restore
    is lost is caught by the transition check (SGLang then hands the node the request's
    slot: one slot owned twice, which the model refuses, or the node's state stays on the
    host only); unplanted, the same seeded run passes."""
    fails_only_when_planted(host_tier_machine, load_back_skips_the_node, monkeypatch,
                            r"load back to .*(the model refuses it|are not on the device "
                            "after it)", examples=150)


# -- bugs planted in SGLang's Mamba host path ---------------------------------------------


def _mamba_module() -> Any:
    return importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")


def _host_module() -> Any:
    return importlib.import_module("sglang.srt.mem_cache.pool_host.mamba")


def backup_not_recorded(monkeypatch: pytest.MonkeyPatch) -> None:
    """A backup's Mamba host slot never lands on its node (the copy is made, the slot
    allocated, the host value not set)."""
    component = _mamba_module().MambaComponent
    original = component.commit_hicache_transfer

    def commit(self: Any, node: Any, phase: Any, *args: Any, **kwargs: Any) -> None:
        if phase.name == "BACKUP_HOST":
            return
        original(self, node, phase, *args, **kwargs)
    monkeypatch.setattr(component, "commit_hicache_transfer", commit)


def host_slot_not_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """Host eviction drops a node's Mamba host value but its slot is never freed."""
    monkeypatch.setattr(_host_module().MambaPoolHost, "free",
                        lambda self, indices: len(indices))


def load_forgets_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load back gives the node a device state slot but copies nothing into it."""
    monkeypatch.setattr(_host_module().MambaPoolHost, "load_to_device_per_layer",
                        lambda self, *args, **kwargs: None)


def backed_up(adapter: SglangMambaHiCacheAdapter) -> MambaView:
    put(adapter, K4, code=44)
    return adapter.observe()


def host_evicted(adapter: SglangMambaHiCacheAdapter) -> MambaView:
    put(adapter, K4, code=44)
    assert adapter.evict_full(4) == 4
    adapter.cache.evict_host(4, adapter.mamba_ct)
    return adapter.observe()


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None],
                         Callable[[SglangMambaHiCacheAdapter], MambaView], str]] = {
    "backup not recorded": (backup_not_recorded, backed_up,
                            "MAMBA host slots neither free nor held"),
    "host slot not freed": (host_slot_not_freed, host_evicted,
                            "MAMBA host slots neither free nor held"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_the_mamba_host_path_shows_in_own_check(
        name: str, make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, scenario, own = PLANTED[name]
    without = scenario(make("write_through"))
    assert without.own_check is None, without.own_check
    plant(monkeypatch)
    view = scenario(make("write_through"))
    assert view.own_check is not None and re.search(own, view.own_check), view.own_check


def test_a_load_back_that_forgets_the_state_shows_in_the_view(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """The loaded page's state slot holds the backed-up code; with the copy planted away
    it holds nothing (``state_kv`` leaves out a slot never written)."""
    def loaded_code(adapter: SglangMambaHiCacheAdapter) -> int | None:
        put(adapter, K4, code=44)
        assert adapter.evict_full(4) == 4
        load_back(adapter, K4)
        view = checked(adapter)
        state = view.pages[K4].state
        assert state is not None
        return view.state_kv.get(state)
    assert loaded_code(make("write_through")) == 44
    load_forgets_the_state(monkeypatch)
    assert loaded_code(make("write_through")) != 44


def backup_reads_a_neighbour(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba backup's transfer reads the device state slot before the node's (an index
    off by one): the host slot is allocated and recorded as usual, the host pool's
    partition and SGLang's sanity_check hold, only the state under the host slot is
    another one's (or none)."""
    component = _mamba_module().MambaComponent
    original = component.build_hicache_transfers

    def build(self: Any, node: Any, phase: Any, **kwargs: Any) -> Any:
        transfers = original(self, node, phase, **kwargs)
        if phase.name == "BACKUP_HOST" and transfers:
            value = transfers[0].device_indices
            shifted = torch.where(value > 1, value - 1, value + 1)
            transfers = [dataclasses.replace(transfers[0], device_indices=shifted)]
        return transfers
    monkeypatch.setattr(component, "build_hicache_transfers", build)


def test_a_planted_backup_of_the_wrong_state_fails_the_host_invariants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host view (spec/13m 13m.8b) can fail: a backup of a neighbouring state breaks
    INV-MAMBA-HOST-CONTENT while SGLang's own checks pass; unplanted, the same seeded run
    passes."""
    fails_only_when_planted(host_tier_machine, backup_reads_a_neighbour, monkeypatch,
                            "INV-MAMBA-HOST-CONTENT", examples=150)


def host_tier_machine() -> type[RuleBasedStateMachine]:
    """A fresh machine over SGLang's Mamba cache with write-through HiCache."""
    return make_mamba_machine(build_hicache("write_through"),
                              MambaConfig(page_size=1, full_slots=16, state_slots=4))


def host_state_ignored_by_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The Mamba match validator with host hits accepts every node (the device-only one
    is right): a match with host hits may end at a page with no state on any tier."""
    component = _mamba_module().MambaComponent
    original = component.create_match_validator

    def validator(self: Any, match_device_only: bool = False) -> Any:
        return original(self, match_device_only=True) if match_device_only \
            else (lambda node: True)
    monkeypatch.setattr(component, "create_match_validator", validator)


def test_a_planted_host_match_bug_fails_the_host_match_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host match (spec/13m 13m.8b ``match_prefix_host``) can fail: SGLang's match with
    host hits ending at a page with no state breaks INV-MAMBA-HOST-MATCH-STATE."""
    fails_only_when_planted(host_tier_machine, host_state_ignored_by_match, monkeypatch,
                            "with host hits", examples=150)


@pytest.mark.parametrize("policy", MAMBA_POLICIES)
def test_sglang_with_hicache_refines_the_model(policy: MambaPolicy) -> None:
    reached: Counter[str] = Counter()
    hicache = build_hicache(policy)

    def build_counting(config: MambaConfig) -> SglangMambaHiCacheAdapter:
        """The adapter, counting the views in which some node was host-only: the
        examples must reach the states the device view leaves out."""
        adapter = hicache(config)
        observe = adapter.observe

        def counted() -> MambaView:
            reached["host-only"] += bool(adapter.host_only())
            return observe()
        adapter.observe = counted  # type: ignore[method-assign]
        return adapter

    config = MambaConfig(page_size=1, full_slots=10, state_slots=3)
    run_until(make_mamba_machine(build_counting, config, reached), reached, "host-only")
    assert reached["checks"] > reached["examples"] and reached["host-only"]
    assert reached["state_tombstones"] and reached["forks"]


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_the_mamba_host_path_fails_the_machine(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, _, own = PLANTED[name]
    plant(monkeypatch)
    config = MambaConfig(page_size=1, full_slots=10, state_slots=3)
    # No shrinking: the first failing example is enough to show the bug is seen.
    quick = settings(bounded(50), phases=(Phase.explicit, Phase.generate))
    with pytest.raises(AssertionError, match=own):
        run_state_machine_as_test(make_mamba_machine(build_hicache("write_through"), config),
                                  settings=quick)
