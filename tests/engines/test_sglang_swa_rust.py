"""SGLang 0.5.23's (FULL, SWA) UnifiedRadixCache on its Rust tree core, through
``adapters.sglang_swa_rust`` (spec/13; the Rust core's limits as in spec/07r).

Runs under ``.venv-sglang23`` (``make sglang23-env``), e.g.
``.venv-sglang23/bin/python -m pytest -q tests/engines/test_sglang_swa_rust.py``. Skipped
where SGLang is not installed or is another version; an SGLang 0.5.23 the adapter cannot
drive fails.
"""

from __future__ import annotations

import importlib
import importlib.util
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hybrid_support import bounded, joint_eviction, plant_full_target_misread
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.hybrid.campaign import hybrid_configs
from hiradix.conformance.hybrid.engine import SwaView
from hiradix.conformance.hybrid.machine import make_swa_machine
from hiradix.engines.sglang.rust_reference import Parted
from hiradix.engines.sglang.swa_rust import SglangSwaRustAdapter, build
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

from engine_env import require

ENGINE = "sglang-swa-rust"
KEY = Key(tuple(range(1, 13)), None)  # 12 tokens


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


Make = Callable[[SwaConfig], SglangSwaRustAdapter]


@pytest.fixture
def make() -> Iterator[Make]:
    """``build``; every cache a test builds is closed after it."""
    built: list[SglangSwaRustAdapter] = []

    def tracked(config: SwaConfig) -> SglangSwaRustAdapter:
        built.append(build(config))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


def checked(view: SwaView) -> SwaView:
    assert view.own_check is None, view.own_check
    return view


def put(adapter: SglangSwaRustAdapter, key: Key, swa_evicted: int) -> tuple[int, ...]:
    """Alloc, forward pass (codes = positions), free of the SWA halves out of the
    window, insert. Its pairs."""
    slots = adapter.alloc(len(key.tokens))
    assert slots is not None
    adapter.write_kv(slots, list(range(len(slots))))
    if swa_evicted:
        adapter.free_swa(slots[:swa_evicted])
    assert adapter.insert(key, slots, swa_evicted) == 0
    return slots


def test_the_registry_keeps_the_rust_core_for_full_and_swa(make: Make) -> None:
    """``_rust_fallback_reason`` falls back to Python only for components outside
    {FULL, SWA, MAMBA} (and sessions, custom components, platform): (FULL, SWA) stays
    on Rust, so this is the core a hybrid SWA server builds by default."""
    adapter = make(SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=4))
    rust = importlib.import_module("sglang.srt.mem_cache.rust_tree_core.adapter")
    assert type(adapter.tree) is rust.RustUnifiedTreeCore
    registry = importlib.import_module(
        "sglang.srt.mem_cache.unified_cache.tree_core_registry")
    assert adapter.tree.tree_components == (adapter.full_ct, adapter.swa_ct)
    assert registry.resolve_tree_core_backend("rust", _params_of(adapter)) == "rust"


def _params_of(adapter: SglangSwaRustAdapter) -> Any:
    """The CacheInitParams the adapter built its cache with, rebuilt for the registry."""
    m = adapter.m
    return m["params"].CacheInitParams(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=adapter.allocator,
        page_size=adapter.ps, eviction_policy="lru", tp_cache_group=adapter.env.group,
        tree_components=(adapter.full_ct, adapter.swa_ct),
        sliding_window_size=adapter.config.window, tree_core_backend="rust")


@pytest.mark.parametrize("ps", [1, 4])
def test_tombstones_and_the_match_read_through_the_binding(make: Make, ps: int) -> None:
    adapter = make(SwaConfig(page_size=ps, full_slots=32, swa_slots=16, window=4))
    slots = put(adapter, KEY, swa_evicted=8)
    view = checked(adapter.observe())
    pages = {len(k.tokens): (p.full, p.swa) for k, p in view.pages.items()}
    assert sorted(pages) == list(range(ps, 13, ps))
    assert all(pages[end][1] is None for end in pages if end <= 8)
    assert all(pages[end][0] == slots[end - ps:end] for end in pages)
    assert set(view.pairs) == set(slots[8:])
    assert adapter.match_prefix(KEY) == (slots, KEY)


def test_swa_lock_counts_come_from_the_reference_and_agree_on_zero(make: Make) -> None:
    """Two locks on one window: the binding shows only that the last node's SWA lock is
    positive (walk_for_kv_canary); the count, 2, is the Python reference's."""
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    put(adapter, KEY, swa_evicted=0)
    _, page = adapter.match_prefix(KEY)
    first, second = adapter.lock(page), adapter.lock(page)
    locks = {len(k.tokens): (p.lock, p.swa_lock)
             for k, p in checked(adapter.observe()).pages.items()}
    assert locks == {end: (2, 2 * int(end > 8)) for end in range(1, 13)}
    assert adapter.evict_swa(16) == 8  # only the unlocked node (1..8), on both cores
    adapter.release_swa(first)
    adapter.unlock(first, swa_released=True)
    adapter.unlock(second, swa_released=False)
    view = checked(adapter.observe())
    assert {(p.lock, p.swa_lock) for p in view.pages.values()} == {(0, 0)}
    assert adapter.evict_full(12) == 12
    assert not checked(adapter.observe()).pages


def test_a_rust_core_that_parts_from_its_reference_is_caught(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    """A bug planted in the Python core's SWA component (SWA slots leaked on
    tombstoning) reaches only the reference: the adapter reports the two cores apart."""
    swa = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.swa")
    original = swa.SWAComponent.evict_component

    def evict_component(self: Any, node: Any, device_frees: Any, *args: Any,
                        **kwargs: Any) -> Any:
        return original(self, node, defaultdict(list), *args, **kwargs)

    monkeypatch.setattr(swa.SWAComponent, "evict_component", evict_component)
    adapter = make(SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4))
    put(adapter, KEY, swa_evicted=0)
    adapter.evict_swa(1)
    with pytest.raises(Parted, match="swa_free"):
        adapter.observe()




@pytest.mark.parametrize("config", hybrid_configs([1, 2, 4]), ids=str)
def test_the_rust_core_refines_the_model(config: SwaConfig) -> None:
    reached: Counter[str] = Counter()
    run_state_machine_as_test(make_swa_machine(build, config, reached), settings=bounded(15))
    assert reached["checks"] > reached["examples"]


def test_an_allocations_eviction_on_the_rust_core_stops_each_pool_at_its_target() -> None:
    """The server allocator's eviction (spec/13 13.3) through the Rust core, the
    reference core given the same call and agreeing."""
    reached: Counter[str] = Counter()
    joint_eviction(build, reached)
    assert reached["evict_for_alloc"] == 1


def test_a_planted_target_misread_fails_the_rust_core_too(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The misread is Python shared by both cores, so they agree; the model refuses it."""
    plant_full_target_misread(monkeypatch)
    with pytest.raises(AssertionError, match=r"evict_for_alloc\(1, 1\) = 4 took"):
        joint_eviction(build, Counter())
