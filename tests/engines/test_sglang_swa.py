"""SGLang 0.5.23's (FULL, SWA) UnifiedRadixCache through ``adapters.sglang_swa`` (spec/13).

Runs under ``.venv-sglang23`` (``make sglang23-env``), e.g.
``.venv-sglang23/bin/python -m pytest -q tests/engines/test_sglang_swa.py``. Skipped where
SGLang is not installed or is another version; an SGLang 0.5.23 the adapter cannot drive
fails (as ``engine_env.require`` treats the other engines).
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hybrid_support import (
    bounded,
    fails_only_when_planted,
    heal_a_locked_tombstone,
    interleaved_eviction,
    joint_eviction,
    plant_full_target_misread,
    run_until,
)
from hypothesis.stateful import RuleBasedStateMachine, run_state_machine_as_test

from hiradix.conformance.hybrid.campaign import hybrid_configs
from hiradix.conformance.hybrid.engine import SwaView
from hiradix.conformance.hybrid.machine import make_swa_machine
from hiradix.engines.sglang.swa import (
    WRITE_POLICIES,
    SglangSwaAdapter,
    WritePolicy,
    build,
    build_hicache,
)
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

from engine_env import require

ENGINE = "sglang-swa"
KEY = Key(tuple(range(1, 13)), None)  # 12 tokens


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


Make = Callable[[SwaConfig], SglangSwaAdapter]


MakeHi = Callable[[SwaConfig, WritePolicy], SglangSwaAdapter]


@pytest.fixture
def make_hi() -> Iterator[MakeHi]:
    """``SglangSwaAdapter(config, hicache=policy)``, closed after the test."""
    built: list[SglangSwaAdapter] = []

    def tracked(config: SwaConfig, policy: WritePolicy) -> SglangSwaAdapter:
        built.append(build_hicache(policy)(config))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


@pytest.fixture
def make() -> Iterator[Make]:
    """``build``; every cache a test builds is closed after it."""
    built: list[SglangSwaAdapter] = []

    def tracked(config: SwaConfig) -> SglangSwaAdapter:
        built.append(build(config))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


def checked(view: SwaView) -> SwaView:
    assert view.own_check is None, view.own_check
    return view


def by_length(view: SwaView) -> dict[int, tuple[tuple[int, ...], tuple[int, ...] | None]]:
    return {len(k.tokens): (p.full, p.swa) for k, p in view.pages.items()}


def alloc(adapter: SglangSwaAdapter, num_tokens: int) -> tuple[int, ...]:
    slots = adapter.alloc(num_tokens)
    assert slots is not None
    return slots


def put(adapter: SglangSwaAdapter, key: Key, swa_evicted: int) -> tuple[int, ...]:
    """A request's life up to its insert: alloc, forward pass (codes = positions), free
    of the SWA halves that fell out of the window, insert. Its pairs."""
    slots = alloc(adapter, len(key.tokens))
    adapter.write_kv(slots, list(range(len(slots))))
    if swa_evicted:
        adapter.free_swa(slots[:swa_evicted])
    assert adapter.insert(key, slots, swa_evicted) == 0
    return slots


@pytest.mark.parametrize("ps", [1, 4])
def test_pages_before_swa_evicted_are_tombstones_and_the_key_matches_whole(
        make: Make, ps: int) -> None:
    adapter = make(SwaConfig(page_size=ps, full_slots=32, swa_slots=16, window=4))
    slots = put(adapter, KEY, swa_evicted=8)
    view = checked(adapter.observe())
    pages = by_length(view)
    assert sorted(pages) == list(range(ps, 13, ps))
    assert all(pages[end][1] is None for end in pages if end <= 8)  # tombstones
    for end in (e for e in pages if e > 8):
        full, swa = pages[end]
        assert full == slots[end - ps:end] and swa is not None
        assert [view.swa_kv[s] for s in swa] == [view.full_kv[f] for f in full]
    assert set(view.pairs) == set(slots[8:])  # 0 marks "no SWA half"; no stale entries
    assert view.full_kv == {s: i for i, s in enumerate(slots)}
    assert adapter.match_prefix(KEY) == (slots, KEY)


def test_a_key_whose_window_ends_in_tombstones_matches_shorter(make: Make) -> None:
    """Live (1..4), tombstones (5..8), live (9, 10): the window of (1..10) is 2 live
    tokens, so the match stops at (1..4), whose path from the root is all live."""
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    head = put(adapter, Key(KEY.tokens[:4], None), swa_evicted=0)
    matched, page = adapter.match_prefix(Key(KEY.tokens[:4], None))
    assert matched == head
    fresh = alloc(adapter, 6)
    adapter.write_kv(fresh, [4, 5, 6, 7, 8, 9])
    adapter.free_swa(fresh[:4])
    key = Key(KEY.tokens[:10], None)
    assert adapter.insert(key, head + fresh, swa_evicted=8) == 4
    swa = {end: s for end, (_, s) in by_length(checked(adapter.observe())).items()}
    assert [end for end, s in sorted(swa.items()) if s is None] == [5, 6, 7, 8]
    assert adapter.match_prefix(key) == (head, Key(KEY.tokens[:4], None))
    assert adapter.match_prefix(Key(KEY.tokens[:8], None)) == (head, page)


def test_evict_swa_tombstones_an_internal_node_and_keeps_its_full_kv(make: Make) -> None:
    """SGLang caps a fresh leaf at one window ((1..8) -> (9..12)); SWA eviction takes
    the internal node (1..8) whole: tombstones, full slots kept, the match unchanged."""
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    slots = put(adapter, KEY, swa_evicted=0)
    swa_free = checked(adapter.observe()).swa_free
    assert adapter.evict_swa(1) == 8  # the whole node (lock granularity "node")
    view = checked(adapter.observe())
    pages = by_length(view)
    assert [end for end, (_, s) in sorted(pages.items()) if s is None] == list(range(1, 9))
    assert tuple(f for end in sorted(pages) for f in pages[end][0]) == slots
    assert len(view.swa_free - swa_free) == 8 and set(view.pairs) == set(slots[8:])
    assert adapter.match_prefix(KEY) == (slots, KEY)


def test_lock_release_swa_unlock_round_trips_to_no_locks(make: Make) -> None:
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    put(adapter, KEY, swa_evicted=0)
    _, page = adapter.match_prefix(KEY)
    receipt = adapter.lock(page)
    locks = {len(k.tokens): (p.lock, p.swa_lock)
             for k, p in checked(adapter.observe()).pages.items()}
    # The full lock covers the path; the SWA lock the last node, (9..12) = the window.
    assert locks == {end: (1, int(end > 8)) for end in range(1, 13)}
    assert adapter.evict_swa(16) == 8  # only the unlocked node (1..8)
    adapter.release_swa(receipt)
    locks = {len(k.tokens): (p.lock, p.swa_lock)
             for k, p in checked(adapter.observe()).pages.items()}
    assert locks == {end: (1, 0) for end in range(1, 13)}
    adapter.unlock(receipt, swa_released=True)
    view = checked(adapter.observe())
    assert {(p.lock, p.swa_lock) for p in view.pages.values()} == {(0, 0)}
    assert adapter.evict_full(12) == 12
    assert not checked(adapter.observe()).pages


def test_a_healing_insert_takes_the_new_pairs_and_frees_the_old_full_slots(
        make: Make) -> None:
    """An insert over tombstones with swa_evicted = 0 gives them the caller's pairs and
    frees their old full slots; the duplicates of live pages SGLang frees itself (DEV-24),
    and the caller's free of them is not repeated."""
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    old = put(adapter, KEY, swa_evicted=8)
    new = alloc(adapter, 12)
    adapter.write_kv(new, list(range(12)))
    assert adapter.insert(KEY, new, 0) == 12
    view = adapter.observe()
    pages = by_length(view)
    assert tuple(pages[end][0][0] for end in range(1, 13)) == new[:8] + old[8:]
    assert all(pages[end][1] is not None for end in pages)
    assert set(old[:8]) <= view.full_free and not set(new[8:]) & set(view.pairs)
    adapter.free(new[8:])  # the caller frees what the insert did not take
    view = checked(adapter.observe())
    assert set(new[8:]) <= view.full_free and set(old[:8]) <= view.full_free


@pytest.mark.parametrize("ps", [1, 4])
def test_alloc_returns_none_when_either_pool_is_exhausted(make: Make, ps: int) -> None:
    adapter = make(SwaConfig(page_size=ps, full_slots=16, swa_slots=8, window=4))
    assert adapter.alloc(8 + ps) is None  # more than the SWA pool
    got: list[int] = []
    while (pages := adapter.alloc(ps)) is not None:
        got.extend(pages)
    assert len(got) == 8  # the SWA pool ran out first
    view = checked(adapter.observe())
    assert not view.swa_free and len(view.full_free) == 8 and set(view.pairs) == set(got)
    adapter.free_swa(got[:ps])  # a pair without its SWA half still holds a full slot
    more = alloc(adapter, ps)
    assert len(checked(adapter.observe()).full_free) == 8 - ps
    adapter.free([*got, *more])
    view = checked(adapter.observe())
    assert len(view.full_free) == 16 and len(view.swa_free) == 8 and not view.pairs


def test_a_tombstone_a_deletion_uncovers_stays_as_a_full_leaf(make: Make) -> None:
    """Device tier only, ``_iteratively_delete_tombstone_ancestors`` keys on the Full
    value: the tombstone node (1..8) that deleting the leaf (9..12) leaves childless
    keeps its full KV as a leaf; nothing past the target is deleted (spec/13 13.3)."""
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    slots = put(adapter, KEY, swa_evicted=8)
    assert adapter.evict_full(1) == 4
    pages = by_length(checked(adapter.observe()))
    assert pages == {end: ((slots[end - 1],), None) for end in range(1, 9)}
    assert adapter.match_prefix(KEY) == ((), None)
    assert adapter.evict_full(1) == 8  # then the tombstone leaf, as one node


# -- the hybrid machine, and bugs planted in SGLang ----------------------------------------




@pytest.mark.parametrize("config", hybrid_configs([1, 2, 4]), ids=str)
def test_sglang_refines_the_model(config: SwaConfig) -> None:
    reached: Counter[str] = Counter()
    run_state_machine_as_test(make_swa_machine(build, config, reached), settings=bounded(15))
    assert reached["checks"] > reached["examples"]


def swa_component() -> Any:
    return importlib.import_module("sglang.srt.mem_cache.unified_cache.components.swa")


def leak_on_tombstone(monkeypatch: pytest.MonkeyPatch) -> None:
    """Tombstoning drops the SWA slots without freeing them (the shape of PR #27586's
    SWA pool leak): the evicted value never reaches the pool."""
    swa = swa_component()
    original = swa.SWAComponent.evict_component

    def evict_component(self: Any, node: Any, device_frees: Any, *args: Any,
                        **kwargs: Any) -> Any:
        return original(self, node, defaultdict(list), *args, **kwargs)

    monkeypatch.setattr(swa.SWAComponent, "evict_component", evict_component)


def heal_ignoring_the_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """Healing a full-locked tombstone replaces (and frees) its full slots."""
    swa = swa_component()
    original = swa.SWAComponent._recover_from_incoming

    def recover(self: Any, *, node: Any, **kwargs: Any) -> Any:
        full = node.component_data[swa.BASE_COMPONENT_TYPE]
        saved, full.lock_ref = full.lock_ref, 0
        try:
            return original(self, node=node, **kwargs)
        finally:
            full.lock_ref = saved

    monkeypatch.setattr(swa.SWAComponent, "_recover_from_incoming", recover)


def window_ignored_by_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA match validator accepts every node: a match may end in a dead window."""
    swa = swa_component()
    monkeypatch.setattr(swa.SWAComponent, "create_match_validator",
                        lambda self, match_device_only=False: (lambda node: True))


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "leak on tombstone": (leak_on_tombstone, "still maps to SWA slot|swa pool balance"),
    "window ignored by match": (window_ignored_by_match, "whose window is not live"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_sglang_fails_the_machine(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    plant, expected = PLANTED[name]
    plant(monkeypatch)
    config = SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=2)
    with pytest.raises(Exception, match=expected):
        run_state_machine_as_test(make_swa_machine(build, config), settings=bounded(300))




def test_healing_a_locked_tombstone_keeps_its_full_slots() -> None:
    reached: Counter[str] = Counter()
    heal_a_locked_tombstone(build, reached)
    assert reached["healed_keeping_full"] == 2


def test_healing_that_frees_a_locked_pages_full_slots_fails(
        monkeypatch: pytest.MonkeyPatch) -> None:
    heal_ignoring_the_lock(monkeypatch)
    with pytest.raises(Exception, match="which a running request reads"):
        heal_a_locked_tombstone(build)


# -- with HiCache: the host tier under each write policy, the device tier observed ---------


def host_only(adapter: SglangSwaAdapter) -> list[tuple[int, ...]]:
    """The keys of the nodes whose full KV is on the host only (backed up, evicted)."""
    found, stack = [], [((), c) for c in adapter.tree.root_node.children.values()]
    while stack:
        prefix, node = stack.pop()
        here = prefix + tuple(node.key.token_ids)
        data = node.component_data[adapter.full_ct]
        if data.value is None and data.host_value is not None:
            found.append(here)
        stack.extend((here, c) for c in node.children.values())
    return sorted(found)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_an_evicted_backed_up_page_is_gone_from_the_device_view(
        make_hi: MakeHi, policy: WritePolicy) -> None:
    """Write-through backs the key up at insert (selective: at its second hit), write_back
    at eviction; either way the eviction leaves the nodes host-only, which the device
    view does not show, and a match finds nothing on the device."""
    adapter = make_hi(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4), policy)
    slots = put(adapter, KEY, swa_evicted=0)
    if policy == "write_through_selective":
        assert adapter.insert(KEY, slots, 0) == 12  # the second hit backs it up
    assert set(by_length(checked(adapter.observe()))) == set(range(1, 13))
    assert adapter.evict_full(12) == 12
    view = checked(adapter.observe())
    assert not view.pages and set(slots) <= view.full_free and not view.pairs
    assert host_only(adapter) and max(map(len, host_only(adapter))) == 12
    assert adapter.match_prefix(KEY) == ((), None)


@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_an_insert_over_host_only_nodes_creates_pages_from_the_callers_pairs(
        make_hi: MakeHi, policy: WritePolicy) -> None:
    """SGLang re-adopts the caller's slots for host-only nodes and counts them in its
    prefix_len; on the device tier nothing was cached: prefix 0, the caller's pairs
    become the pages (the first 4 tokens tombstones, as swa_evicted says)."""
    adapter = make_hi(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4), policy)
    old = put(adapter, KEY, swa_evicted=0)
    if policy == "write_through_selective":
        adapter.insert(KEY, old, 0)
    adapter.evict_full(12)
    assert host_only(adapter)
    new = put(adapter, KEY, swa_evicted=4)  # asserts the insert's prefix is 0
    view = checked(adapter.observe())
    pages = by_length(view)
    assert tuple(pages[end][0][0] for end in range(1, 13)) == new
    assert [end for end, (_, swa) in sorted(pages.items()) if swa is None] == [1, 2, 3, 4]
    assert adapter.match_prefix(KEY) == (new, KEY)


def test_the_host_check_finds_host_slots_nobody_frees(
        make_hi: MakeHi, monkeypatch: pytest.MonkeyPatch) -> None:
    """A host pool whose frees are lost (PR #27586's leak, on the host tier): slots
    neither free nor held by any node's host value."""
    adapter = make_hi(SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=2),
                      "write_through")
    put(adapter, Key((1, 2, 3, 4), None), swa_evicted=0)
    checked(adapter.observe())
    host = type(adapter.cache.full_kv_pool_host)
    monkeypatch.setattr(host, "free", lambda self, indices: len(indices))
    # Host eviction drops host copies; with the pool's free lost, their slots leak.
    adapter.evict_full(4)
    adapter.cache.evict_host(4)
    problem = adapter.observe().own_check
    assert problem is not None and "neither free nor held" in problem


@pytest.mark.parametrize("policy", WRITE_POLICIES)
@pytest.mark.parametrize("config", [SwaConfig(page_size=ps, full_slots=10 * ps,
                                              swa_slots=5 * ps, window=ps + 1)
                                    for ps in (1, 4)], ids=str)
def test_sglang_with_hicache_refines_the_model(config: SwaConfig, policy: WritePolicy) -> None:
    reached: Counter[str] = Counter()
    hicache = build_hicache(policy)

    def build_counting(config: SwaConfig) -> SglangSwaAdapter:
        """The adapter, counting the views in which some node was host-only: the
        examples must reach the states the device view leaves out."""
        adapter = hicache(config)
        observe = adapter.observe

        def counted() -> SwaView:
            reached["host-only"] += bool(host_only(adapter))
            return observe()
        adapter.observe = counted  # type: ignore[method-assign]
        return adapter

    run_until(make_swa_machine(build_counting, config, reached), reached, "host-only",
              batches=8)
    assert reached["checks"] > reached["examples"] and reached["host-only"]


def host_swa_backup_rotated(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA backup's commit hands each node its host slots rotated by one (an offset
    off by one within the transfer): the host pool's partition is intact, and only the
    host KV under each slot is wrong, which SGLang's sanity_check and the pool partition
    (``_host_problems``) cannot see."""
    swa = swa_component()
    original = swa.SWAComponent.commit_hicache_transfer

    def commit(self: Any, node: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        done = original(self, node, phase, *args, **kwargs)
        if phase == swa.CacheTransferPhase.BACKUP_HOST:
            for target in [node, *node.children.values()]:
                value = target.component_data[self.component_type].host_value
                if value is not None and len(value) > 1:
                    target.component_data[self.component_type].host_value = value.roll(1)
        return done

    monkeypatch.setattr(swa.SWAComponent, "commit_hicache_transfer", commit)


def test_a_planted_host_swa_backup_bug_fails_the_host_invariants(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host view (spec/13 13.8a) can fail: rotated SWA host slots break
    INV-SWA-HOST-CONTENT while SGLang's own checks pass; unplanted, the same seeded
    run passes."""
    fails_only_when_planted(host_tier_machine, host_swa_backup_rotated, monkeypatch,
                            "INV-SWA-HOST-CONTENT")


def host_tier_machine() -> type[RuleBasedStateMachine]:
    """A fresh machine over SGLang's SWA cache with write-through HiCache."""
    return make_swa_machine(build_hicache("write_through"),
                            SwaConfig(page_size=1, full_slots=10, swa_slots=5, window=2))


def host_window_ignored_by_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA match validator with host hits accepts every node (the device-only one is
    right): a match with host hits may end where the window has SWA KV on no tier."""
    swa = swa_component()
    original = swa.SWAComponent.create_match_validator

    def validator(self: Any, match_device_only: bool = False) -> Any:
        return original(self, match_device_only=True) if match_device_only \
            else (lambda node: True)
    monkeypatch.setattr(swa.SWAComponent, "create_match_validator", validator)


def test_a_planted_host_match_bug_fails_the_host_match_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The host match (spec/13 13.8a ``match_prefix_host``) can fail: SGLang's match with
    host hits ending in a dead window breaks INV-SWA-HOST-MATCH-LIVE, while its device
    match stays right; unplanted, the same seeded run passes."""
    fails_only_when_planted(host_tier_machine, host_window_ignored_by_match, monkeypatch,
                            "with host hits")


# -- load back: a host hit acted on as the scheduler does (spec/13 13.8a) ---------------------

@pytest.mark.parametrize("policy", WRITE_POLICIES)
def test_a_load_back_brings_the_path_and_its_window_back(make_hi: MakeHi,
                                                         policy: WritePolicy) -> None:
    """An evicted key, matched through the host and loaded back: every page has its full
    KV back (the codes the request wrote), SWA KV on the window's 4 pages only, and the
    request's prefix ends at the key, which the device now matches whole."""
    adapter = make_hi(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4), policy)
    slots = put(adapter, KEY, swa_evicted=0)
    if policy == "write_through_selective":
        adapter.insert(KEY, slots, 0)  # the second hit backs it up
    adapter.evict_full(12)
    assert adapter.match_prefix(KEY) == ((), None)
    assert adapter.load_back() == (12, KEY)
    view = checked(adapter.observe())
    pages = by_length(view)
    assert sorted(pages) == list(range(1, 13))
    assert [end for end, (_, swa) in sorted(pages.items()) if swa is not None] == [9, 10, 11, 12]
    assert [view.full_kv[pages[end][0][0]] for end in range(1, 13)] == list(range(12))
    assert adapter.match_prefix(KEY) == (tuple(pages[end][0][0] for end in range(1, 13)), KEY)


def load_back_window_short(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA load-back walk leaves out the window's top node (a count off by one
    node): the window keeps a tombstone, a state every invariant allows -- only the
    load's transition shows it."""
    swa = swa_component()
    original = swa.SWAComponent.build_hicache_transfers

    def transfers(self: Any, node: Any, phase: Any, *args: Any, **kwargs: Any) -> Any:
        built = original(self, node, phase, *args, **kwargs)
        if phase != swa.CacheTransferPhase.LOAD_BACK or not built:
            return built
        xfer = built[0]
        first = self.tree_core.node_by_id(xfer.nodes_to_load[0])
        size = len(first.component_data[self.component_type].host_value)
        if len(xfer.nodes_to_load) == 1:
            return None
        xfer.nodes_to_load = xfer.nodes_to_load[1:]
        xfer.host_indices = xfer.host_indices[size:]
        return built

    monkeypatch.setattr(swa.SWAComponent, "build_hicache_transfers", transfers)


def test_a_planted_load_back_bug_fails_the_load_back_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The load back (spec/13 13.8a ``load_back``) can fail: a load that leaves a window
    page dead is caught by the transition check, where SGLang's own checks and every
    invariant pass; unplanted, the same seeded run passes."""
    fails_only_when_planted(host_tier_machine, load_back_window_short, monkeypatch,
                            "are not on the device after it")


def load_back_evicts_everything(monkeypatch: pytest.MonkeyPatch) -> None:
    """A load back short of full slots asks its eviction for every cached token instead
    of its shortfall (``needed = kv_tokens - avail``, unified_radix_cache.py:1902, read
    as the whole pool): every state after it is one the invariants allow -- only the
    load's transition shows it."""
    unified = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    cache_class = unified.UnifiedRadixCache
    transfers, evict = cache_class._load_back_transfers, cache_class.evict_for_alloc
    loading: list[bool] = []

    def planted_transfers(self: Any, **kwargs: Any) -> Any:
        loading.append(True)
        try:
            return transfers(self, **kwargs)
        finally:
            loading.pop()

    def planted_evict(self: Any, params: Any, **kwargs: Any) -> Any:
        if loading and params.num_tokens:
            params = base.EvictParams(num_tokens=params.num_tokens + 1_000)
        return evict(self, params, **kwargs)

    monkeypatch.setattr(cache_class, "_load_back_transfers", planted_transfers)
    monkeypatch.setattr(cache_class, "evict_for_alloc", planted_evict)


def evicting_load_back() -> Counter[str]:
    """A scripted run of the machine over SGLang's SWA cache with write-through HiCache:
    a 12-token key cached, backed up and evicted; two 4-token keys cached beside, 8 full
    slots left; the key loaded back: 4 full slots short, so the load evicts first
    (spec/13 13.8, ``evicting_load``), judged as every step. Host pools twice the device
    pools (the server's default ``hicache_ratio``, arg_groups/hicache_hook.py:119-122), so
    the host keeps the whole key.
    What the run reached."""
    reached: Counter[str] = Counter()
    machine = make_swa_machine(build_hicache("write_through", 2.0),
                               SwaConfig(page_size=1, full_slots=16, swa_slots=16, window=4),
                               reached)()
    machine.run_request(KEY.tokens, 0, False)
    machine.evict("full", 12)
    for token in (20, 21):
        machine.run_request((token,) * 4, 0, False)
    machine.load_back_of(KEY)
    machine.teardown()
    return reached


def test_a_load_back_short_of_full_slots_evicts_its_shortfall_first() -> None:
    reached = evicting_load_back()
    assert (reached["load_backs"], reached["load_backs_evicting"]) == (1, 1)
    assert (reached["load_back_victims"], reached["load_backs_called_off"]) == (4, 0)


def test_a_planted_over_eviction_in_a_load_back_fails_the_load_back_check(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A load back that must evict first can fail: one whose eviction takes more than
    its shortfall is caught by the transition check, where every state after it is one
    the invariants allow."""
    load_back_evicts_everything(monkeypatch)
    with pytest.raises(AssertionError, match=r"short of 4 full slots .* its eviction took"):
        evicting_load_back()


# -- evict_for_alloc: the eviction the server's allocator makes (spec/13 13.3) ---------------

def test_an_allocations_eviction_stops_each_pool_at_its_target() -> None:
    reached: Counter[str] = Counter()
    joint_eviction(build, reached)
    assert reached["evict_for_alloc"] == 1


def test_an_allocations_eviction_of_eight_interleaved_pages_is_accepted() -> None:
    assert interleaved_eviction(build)["evict_for_alloc"] == 1


def test_a_planted_target_misread_in_evict_for_alloc_fails_the_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The full walk takes every evictable leaf (hybrid_support)."""
    plant_full_target_misread(monkeypatch)
    with pytest.raises(AssertionError, match=r"evict_for_alloc\(1, 1\) = 4 took"):
        joint_eviction(build, Counter())
