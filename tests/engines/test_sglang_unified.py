"""SGLang's UnifiedRadixCache (HiCache, Python tree core) against the model.

Runs under whichever SGLang the running environment has: ``.venv-sglang`` (0.5.20,
``make sglang-env``) or ``.venv-sglang23`` (0.5.23, ``make sglang23-env``), e.g.
``HIRADIX_PROFILE=ci .venv-sglang23/bin/python -m pytest -q tests/engines/test_sglang_unified.py``.
Skipped where SGLang is not installed; an installed SGLang the adapter cannot drive fails.
"""

from __future__ import annotations

import importlib.util
import random
from pathlib import Path
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.cli import main
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines import factory, probe
from hiradix_model import Key, initial, trace

ENGINE = "sglang-unified"


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang; an installed SGLang that does not probe fails the test."""
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed here (make sglang-env / make sglang23-env)")
    return probe(ENGINE)


# One scenario per strategy, page sizes and write policies interleaved.
SCENARIOS = [Scenario(page_size=ps, write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for ps, policy, strategy in zip(
                 (1, 2, 4, 1, 2, 4, 1),
                 ("write_through", "write_through_selective") * 3 + ("write_through",),
                 ("lru", "lfu", "fifo", "slru", "priority", "mru", "filo"), strict=True)]


def bounded() -> settings:
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // 15))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_unified_radix_cache_refines_the_model(scenario: Scenario) -> None:
    run_state_machine_as_test(make_differential(factory(ENGINE, scenario)), settings=bounded())


def test_the_campaign_reaches_loads_backups_and_both_evictions() -> None:
    """A differential run that never loads, backs up or evicts would pass vacuously.
    A fixed set of examples (derandomized, its size and length given here, not the
    profile's): what a reach test finds must not depend on the draw. On 0.5.20 its 60
    examples made 33 loads, 21 load acknowledgements, 160 backup acknowledgements; an
    older machine's fixed 40 held a single load, hence more examples than the
    campaign's."""
    tally = Tally()
    scenario = Scenario(page_size=1, eviction="lru")
    run_state_machine_as_test(make_differential(factory(ENGINE, scenario), tally),
                              settings=settings(max_examples=60, stateful_step_count=60,
                                                derandomize=True))
    for op in ("init_load_back", "loading_check", "writing_check", "evict", "evict_host",
               "insert", "dec_lock_ref"):
        assert tally.ops[op] > 0, f"no {op} in {dict(tally.ops)}"


def test_a_trace_recorded_from_the_unified_cache_replays_clean(tmp_path: Path,
                                                               sglang_installed: str) -> None:
    """spec/08: the run as a trace, adopt directives included, that the model accepts."""
    path = tmp_path / "unified.jsonl"
    assert main(["check", "--engine", ENGINE, "--examples", "8", "--steps", "30",
                 "--page-sizes", "1", "--record", str(path)]) == 0
    lines = path.read_text().splitlines()
    assert f'"engine": "{ENGINE} {sglang_installed}"' in lines[0]
    applied, finding = trace.replay(lines)
    assert finding is None, finding
    assert applied == len(lines) - 1


def test_the_python_tree_core_is_the_one_under_test() -> None:
    from hiradix.engines.sglang.unified import SglangUnifiedAdapter, prepare
    adapter = SglangUnifiedAdapter(Scenario(page_size=1))
    assert type(adapter.cache.tree_core) is prepare().modules["core"].UnifiedTreeCore
    adapter.close()


def unified(scenario: Scenario | None = None) -> Any:
    from hiradix.engines.sglang.unified import SglangUnifiedAdapter
    return SglangUnifiedAdapter(scenario or Scenario(page_size=1))


def put(adapter: Any, *keys: tuple[int, ...], chunked: bool = False,
        counted_from: int = 0) -> None:
    """Insert each key with fresh slots, as a request that matched nothing."""
    for tokens in keys:
        slots = adapter.alloc(len(tokens))
        assert slots is not None
        adapter.insert(Key(tokens), slots, priority=0, chunked=chunked,
                       counted_from=counted_from)


def pages_of(adapter: Any) -> dict[tuple[int, ...], Any]:
    return {k.tokens: p for k, p in adapter.observe(initial(adapter.config)).pages.items()}


def test_dev21_a_match_stamps_each_level_apart_within_one_tick() -> None:
    """spec/07 DEV-21: SGLang stamps a match's path from one counter read, less 1e-5
    per level up; the adapter maps every stamp of the tick back to the tick."""
    adapter = unified()
    adapter.set_time(1)
    put(adapter, (1,), (1, 2), (1, 2, 3))
    adapter.set_time(5)
    adapter.match_prefix(Key((1, 2, 3)))
    stamps = [adapter._node(Key(t)).last_access_time for t in [(1,), (1, 2), (1, 2, 3)]]
    assert stamps == sorted(stamps) and len(set(stamps)) == 3, stamps
    assert {p.last_tick for p in pages_of(adapter).values()} == {5}
    adapter.close()


def test_dev23_last_host_node_is_the_best_match_even_without_a_host_copy() -> None:
    """spec/07 DEV-23: SGLang's match returns the best match as last_host_node; the
    spec's last_host_page is the deepest matched page with a host copy (none here)."""
    adapter = unified(Scenario(page_size=1, write_policy="write_through_selective"))
    put(adapter, (1, 2))  # one hit: below the selective threshold, no backup
    m = adapter.m["base"]
    from hiradix.engines.sglang.unified import radix_key
    raw = adapter.cache.match_prefix(m.MatchPrefixParams(key=radix_key(adapter.uenv,
                                                                       Key((1, 2)))))
    node = adapter._node(Key((1, 2)))
    assert raw.last_host_node == node.id and node.component_data[adapter.full].host_value is None
    assert adapter.match_prefix(Key((1, 2))).last_host_page is None
    adapter.close()


def _host_only(adapter: Any, *keys: tuple[int, ...]) -> None:
    put(adapter, *keys)
    adapter.writing_check()
    assert adapter.evict(sum(len(k) for k in keys)) > 0


def test_dev22_a_load_host_locks_its_anchor_and_the_spec_protects_the_chain() -> None:
    """spec/07 DEV-22: a load in flight holds one host lock, on its anchor node; the
    abstraction shows each page of the chain protected until the ack (DEV-5)."""
    adapter = unified()
    put(adapter, (1,), (1, 2))  # two nodes, both backed up
    adapter.writing_check()
    assert adapter.evict(2) == 2
    adapter.match_prefix(Key((1, 2)))
    loaded, last = adapter.init_load_back(Key((1, 2)), None)
    assert len(loaded) == 2 and last == Key((1, 2))
    raw = {t: adapter._node(Key(t)).component_data[adapter.full].host_lock_ref
           for t in [(1,), (1, 2)]}
    assert raw == {(1,): 0, (1, 2): 1}, raw
    assert [pages_of(adapter)[t].host_protect for t in [(1,), (1, 2)]] == [1, 1]
    assert adapter.loading_check() == 1
    assert [pages_of(adapter)[t].host_protect for t in [(1,), (1, 2)]] == [0, 0]
    adapter.close()


def test_dev24_insert_frees_the_callers_duplicate_slots_itself() -> None:
    """spec/07 DEV-24: past prev_prefix_len, the tree frees the caller's slots for
    positions already cached; the adapter's free() does not free them again."""
    adapter = unified()
    put(adapter, (1, 2))
    duplicate = adapter.alloc(2)
    assert duplicate is not None
    free_before = adapter.num_free_slots()
    assert adapter.insert(Key((1, 2)), duplicate, priority=0, chunked=False) == 2
    assert adapter.num_free_slots() == free_before + 2
    adapter.free(duplicate)
    assert adapter.num_free_slots() == free_before + 2
    adapter.close()


@pytest.mark.parametrize("chunked", [False, True])
def test_dev25_chunked_is_inserted_len_at_either_end(chunked: bool) -> None:
    """spec/07 DEV-25: inserted_len = len(key) counts no hit and backs up nothing, as a
    chunked insert; inserted_len = 0 counts a hit everywhere, as a plain insert."""
    adapter = unified()
    put(adapter, (1, 2), chunked=chunked)
    page = pages_of(adapter)[(1, 2)]
    assert page.hits == (0 if chunked else 1)
    assert bool(adapter.cache.ongoing_write_through) is not chunked
    adapter.close()


def test_dev25_inserted_len_inside_a_node_counts_the_whole_node() -> None:
    """spec/07 DEV-25 (0.5.23): SGLang does not split at inserted_len; a node that ends
    past it counts a hit on all its pages, those before inserted_len too, where the
    model's counted_from counts only the pages past it."""
    adapter = unified()
    if adapter.v20:
        pytest.skip("0.5.20's insert takes chunked, not inserted_len")
    put(adapter, (1, 2, 3, 4))
    from hiradix.engines.sglang.unified import radix_key, to_engine
    slots = adapter.alloc(2)
    value = to_engine(adapter._device_prefix(Key((1, 2, 3, 4))) + slots, 1)
    adapter.cache.insert(adapter.m["base"].InsertParams(
        key=radix_key(adapter.uenv, Key((1, 2, 3, 4, 5, 6))), value=value,
        prev_prefix_len=4, inserted_len=2))
    ends = {len(adapter._prefix(n).tokens): n.hit_count for n in adapter._nodes()}
    assert ends == {4: 2, 6: 1}  # no node ends at 2; pages (1,) and (1, 2) counted again
    adapter.close()


def test_dev25_counted_from_at_a_node_end_is_inserted_len() -> None:
    """Where a node ends at counted_from, inserted_len = counted_from is exact; inside a
    node the adapter refuses it (and 0.5.20, with chunked only, refuses it anywhere)."""
    adapter = unified(Scenario(page_size=1, device_pages=16))
    put(adapter, (1, 2))
    if adapter.v20:
        assert "counted_from_inside" in adapter.inexpressible
        with pytest.raises(ValueError, match="DEV-25"):
            put(adapter, (1, 2, 3, 4), counted_from=2)
        adapter.close()
        return
    assert "counted_from_inside" not in adapter.inexpressible
    put(adapter, (1, 2, 3, 4), counted_from=2)
    assert {k: p.hits for k, p in pages_of(adapter).items()} == {
        (1,): 1, (1, 2): 1, (1, 2, 3): 1, (1, 2, 3, 4): 1}
    with pytest.raises(ValueError, match="DEV-25"):
        put(adapter, (1, 2, 3, 4, 5), counted_from=3)  # inside the node (1, 2, 3, 4)
    adapter.close()


def test_dev26_an_insert_queues_its_backups_until_flushed() -> None:
    """spec/07 DEV-26 (0.5.23): an insert queues its backup; writing_check acknowledges
    nothing until flush_pending_backups() issues it."""
    adapter = unified()
    if adapter.v20:
        pytest.skip("0.5.20 issues each backup at once")
    from hiradix.engines.sglang.unified import radix_key, to_engine
    slots = adapter.alloc(2)
    adapter.cache.insert(adapter.m["base"].InsertParams(
        key=radix_key(adapter.uenv, Key((1, 2))), value=to_engine(slots, 1)))
    adapter.cache.writing_check()
    assert adapter.cache.ongoing_write_through and adapter.cache.cache_controller.write_queue
    adapter.cache.flush_pending_backups()
    adapter.cache.writing_check()
    assert not adapter.cache.ongoing_write_through
    adapter.close()


def test_dev8_a_load_evicts_only_its_shortfall() -> None:
    """spec/07 DEV-8, resolved upstream: UnifiedRadixCache's load evicts for what the
    allocator lacks, not for the whole load (HiRadixCache evicted len(host_indices))."""
    adapter = unified()  # six device slots
    _host_only(adapter, (1, 2))
    put(adapter, (3,), (4,), (5,), (6,), (7,))
    adapter.writing_check()
    assert adapter.num_free_slots() == 1
    on_device = {t for t, p in pages_of(adapter).items() if p.device is not None}
    adapter.match_prefix(Key((1, 2)))
    loaded, _ = adapter.init_load_back(Key((1, 2)), None)
    assert len(loaded) == 2
    after = {t for t, p in pages_of(adapter).items() if p.device is not None}
    assert len(on_device - after) == 1, on_device - after
    adapter.close()


def test_dev19_is_fixed_reset_leaves_no_copy_in_flight() -> None:
    """spec/07 DEV-19 (HiRadixCache) does not recur: UnifiedRadixCache.reset drops the
    pending acknowledgements with the tree."""
    adapter = unified()
    put(adapter, (1, 2))
    assert adapter.cache.ongoing_write_through, "the insert issued no backup"
    adapter.reset()
    assert not adapter.cache.ongoing_write_through and not adapter.cache.ongoing_load_back
    seen = adapter.observe(initial(adapter.config))
    assert not seen.pending and not seen.pages
    put(adapter, (3, 4))
    assert adapter.writing_check() == 1
    adapter.close()


def test_touch_prefix_changes_what_a_match_changes() -> None:
    """0.5.23's touch_prefix (a waiting request's prefix kept warm) is a match without
    a result: after either, at one tick, the abstract states are equal."""
    states = []
    for touch in (False, True):
        adapter = unified()
        if adapter.v20:
            pytest.skip("0.5.20 has no touch_prefix")
        adapter.set_time(1)
        put(adapter, (1, 2, 3), (1, 4))
        adapter.set_time(3)
        if touch:
            from hiradix.engines.sglang.unified import radix_key
            adapter.cache.touch_prefix(radix_key(adapter.uenv, Key((1, 2))))
        else:
            adapter.match_prefix(Key((1, 2)))
        states.append(adapter.observe(initial(adapter.config)))
        adapter.close()
    assert states[0] == states[1]
    assert {k.tokens: p.last_tick for k, p in states[0].pages.items()}[(1, 2)] == 3


def test_tlru_is_outside_the_model_and_refused() -> None:
    """spec/07 DEV-28: 0.5.23's tlru strategy has no counterpart in the model."""
    adapter = unified()
    if not adapter.v20:
        from sglang.srt.mem_cache.utils import get_eviction_strategy
        assert type(get_eviction_strategy("tlru", None)).__name__ == "TLRUStrategy"
    adapter.close()
    with pytest.raises(ValueError, match="DEV-28"):
        unified(Scenario(page_size=1, eviction="tlru"))  # type: ignore[arg-type]


def _survivors_of_a_tie(tier: str) -> tuple[tuple[int, ...], ...]:
    adapter = unified(Scenario(page_size=1, eviction="fifo"))
    adapter.set_time(0)
    put(adapter, (1,), (2,), (3,))
    adapter.writing_check()
    if tier == "host":
        assert adapter.evict(3) == 3
        assert adapter.evict_host(1) == 1
    else:
        assert adapter.evict(1) == 1
    kept = tuple(sorted(t for t, p in pages_of(adapter).items()
                        if (p.host if tier == "host" else p.device) is not None))
    adapter.close()
    return kept


@pytest.mark.parametrize("tier", ["device", "host"])
def test_dev20_a_tie_among_leaves_is_broken_the_same_way_in_every_run(tier: str) -> None:
    """spec/07 DEV-20: the tree core's leaf sets are ordered by the adapter (after every
    reset too), so that an example replays. Ballast moves the caches' addresses."""
    ballast: list[object] = []
    seen = set()
    for run in range(20):
        seen.add(_survivors_of_a_tie(tier))
        ballast.append([object() for _ in range(7 * run)])
    assert len(seen) == 1, f"one tie, {len(seen)} outcomes: {sorted(seen)}"


def test_adopted_fields_name_a_deviation() -> None:
    from hiradix_model import trace
    adapter = unified()
    assert set(adapter.adopted) <= set(trace.ADOPTABLE)
    assert all("DEV-" in why for why in adapter.adopted.values())
    adapter.close()


def test_dev1_a_split_by_a_match_stamps_the_unmatched_suffix() -> None:
    """spec/07 DEV-1, still so in UnifiedRadixCache: a match that ends inside a node
    splits it and stamps the unmatched lower part with a fresh tick; the spec stamps only
    the matched pages (the adapter adopts last_tick for that)."""
    adapter = unified()
    adapter.set_time(0)
    put(adapter, (1, 1))
    adapter.set_time(1)
    adapter.match_prefix(Key((1,)))
    ticks = {t: p.last_tick for t, p in pages_of(adapter).items()}
    assert ticks == {(1,): 1, (1, 1): 1}, ticks  # the spec: {(1,): 1, (1, 1): 0}
    adapter.close()


def test_dev4_is_fixed_a_split_keeps_the_creation_tick() -> None:
    """spec/07 DEV-4 does not recur: UnifiedRadixCache's split copies creation_time to
    the upper part, so insert_tick needs no adoption (HiRadixCache's split did not)."""
    adapter = unified(Scenario(page_size=1, eviction="fifo"))
    adapter.set_time(0)
    put(adapter, (1, 2))
    adapter.set_time(4)
    adapter.match_prefix(Key((1,)))
    assert adapter._node(Key((1,))) is not adapter._node(Key((1, 2))), "no split"
    assert {p.insert_tick for p in pages_of(adapter).values()} == {0}
    assert "insert_tick" not in adapter.adopted
    adapter.close()


def test_dev18_a_split_of_a_loading_anchor_and_its_host_lock() -> None:
    """spec/07 DEV-18: 0.5.20's split leaves the upper part of a loading anchor without
    its host lock (host_lock_ref 0); 0.5.23 copies the lock and moves the lock's segment
    boundary up, so the ack releases both parts."""
    adapter = unified()
    _host_only(adapter, (1, 2))
    adapter.match_prefix(Key((1, 2)))
    loaded, _ = adapter.init_load_back(Key((1, 2)), None)
    assert len(loaded) == 2
    adapter.match_prefix(Key((1,)))  # splits the anchor while its load is in flight
    upper = adapter._node(Key((1,))).component_data[adapter.full].host_lock_ref
    assert upper == (0 if adapter.v20 else 1)
    assert [p.host_protect for p in pages_of(adapter).values()] == [1, 1]
    assert adapter.loading_check() == 1
    assert {t: adapter._node(Key(t)).component_data[adapter.full].host_lock_ref
            for t in [(1,), (1, 2)]} == {(1,): 0, (1, 2): 0}
    adapter.close()


# MLA pools and the page_first host layout (SGLang's page_first_direct), spec/07 7.1.
LAYOUT_SCENARIOS = [Scenario(page_size=2, kv_layout="mla", eviction="lru"),
                    Scenario(page_size=2, host_layout="page_first", eviction="lfu"),
                    Scenario(page_size=1, kv_layout="mla", host_layout="page_first",
                             eviction="fifo")]


@pytest.mark.parametrize("scenario", LAYOUT_SCENARIOS, ids=lambda s: s.slug())
def test_unified_radix_cache_with_mla_or_page_first_refines_the_model(
        scenario: Scenario) -> None:
    run_state_machine_as_test(make_differential(factory(ENGINE, scenario)), settings=bounded())


@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_host_kv_is_read_through_sglangs_page_first_layout(kv_layout: str) -> None:
    from test_sglang_adapters import tamper_with_host_kv
    scenario = Scenario(page_size=2, kv_layout=kv_layout, host_layout="page_first")  # type: ignore[arg-type]
    machine = make_differential(factory(ENGINE, scenario))()
    kind = "MLA" if kv_layout == "mla" else "MHA"
    assert type(machine.engine.host).__name__ == f"{kind}TokenToKVPoolHost"
    assert type(machine.engine.kv).__name__ == f"{kind}TokenToKVPool"
    tamper_with_host_kv(machine, machine.engine.host, kv_layout)
    machine.teardown()


def test_dev3_dev14_write_back_counts_no_hits_and_backs_up_nothing_on_insert() -> None:
    """spec/07 DEV-3 and DEV-14 in UnifiedRadixCache, run: under write_back a key
    inserted twice keeps zero hits and nothing is backed up on insert; the unused
    threshold is still 2. The adapter adopts hits under write_back for this reason."""
    from test_sglang_adapters import _put
    adapter = factory(ENGINE, Scenario(page_size=1, write_policy="write_back"))()
    assert "hits" in adapter.adopted
    _put(adapter, (1, 2), 1)
    _put(adapter, (1, 2), 2)
    pages = adapter.observe(initial(adapter.config)).pages
    assert {p.hits for p in pages.values()} == {0}
    assert all(p.host is None for p in pages.values())
    assert not adapter.cache.ongoing_write_through
    assert adapter.cache.write_through_threshold == 2
    adapter.close()


def test_dev30_write_through_backs_up_a_due_pages_uncounted_ancestors() -> None:
    """spec/07 DEV-30 (adopted: R5 changed), run on 0.5.23: A = (1, 2) is inserted with
    nothing counted (chunked), then (1, 2, 3, 1) with inserted_len = 2. Only (1, 2, 3),
    (1, 2, 3, 1) are counted and due; A is device-only and not due. SGLang backs up A with
    them, and so does the spec now: the engine's state equals the model's."""
    adapter = factory(ENGINE, Scenario(page_size=1))()
    if adapter.v20:
        adapter.close()
        pytest.skip("0.5.20 takes chunked only (DEV-25)")
    assert "backup_of_uncounted_ancestors" not in adapter.avoid
    from hiradix_model import choosers, ops
    from hiradix_model.keys import content_at
    model = initial(adapter.config)
    rng = random.Random(0)
    short, key = Key((1, 2)), Key((1, 2, 3, 1))
    slots = adapter.alloc(2)
    more = adapter.alloc(2)
    model, _ = ops.alloc(model, short, 0, tuple(slots))
    adapter.write_kv(slots, [content_at(short, i) for i in range(2)])
    adapter.insert(short, slots, priority=0, chunked=True)
    model, _ = ops.insert(model, short, tuple(slots), 0, chunked=True)
    model, _ = ops.alloc(model, key, 2, tuple(more))
    adapter.write_kv(more, [content_at(key, i) for i in range(2, 4)])
    adapter.insert(key, slots + more, priority=0, chunked=False, counted_from=2)
    report = choosers.choose_insert_backup(model, key, tuple(slots + more), 0, rng,
                                           counted_from=2)
    model, _ = ops.insert(model, key, tuple(slots + more), 0, counted_from=2, backup=report)
    pages = adapter.observe(model).pages
    assert {k.tokens: p.hits for k, p in pages.items()} == {
        (1,): 0, (1, 2): 0, (1, 2, 3): 1, (1, 2, 3, 1): 1}
    assert all(p.host is not None for p in pages.values()), "SGLang backed up A as well"
    assert all(p.host is not None for p in model.pages.values()), "so does the spec (R5)"
    assert len(model.pending) == 1 and len(model.pending[0].pages) == 4
    adapter.close()

