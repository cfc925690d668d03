"""SGLang 0.5.20's RadixCache and HiRadixCache against the model (skipped without SGLang).

Run from the SGLang environment: ``make sglang-env``, then
``.venv-sglang/bin/python -m pytest tests/engines``.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
import torch
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.cli import main
from hiradix.conformance.abstraction import CORRUPT
from hiradix.conformance.differential import make_differential
from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix.engines.sglang.radix import SglangAdapter
from hiradix_model import Key, initial, trace

from engine_env import require
from fixed_runs import drive


@pytest.fixture(autouse=True)
def sglang_0_5_20() -> None:
    """HiRadixCache and RadixCache of SGLang 0.5.20 (skip or fail: see conftest)."""
    require("sglang")

SCENARIOS = [Scenario(page_size=ps, write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for ps, policy, strategy in [
                 (1, "write_through", "lru"), (2, "write_through_selective", "lfu"),
                 (4, "write_through", "fifo"), (1, "write_through_selective", "slru"),
                 (2, "write_through", "priority"), (4, "write_through", "mru"),
                 (1, "write_through", "filo")]]


def bounded() -> settings:
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // 15))


@pytest.mark.parametrize("engine", ["sglang-radix", "sglang"])
@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_sglang_refines_the_model(engine: str, scenario: Scenario) -> None:
    run_state_machine_as_test(make_differential(factory(engine, scenario)), settings=bounded())


def test_dev19_reset_keeps_stale_write_acks() -> None:
    """spec/07 DEV-19, reproduced: a reset with a backup in flight leaves the backup's
    acknowledgement entry behind, and restarts node ids so a new node reuses its id.
    If this test fails, SGLang fixed it: update DEV-19 and drop the adapter's `avoid`."""
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=True)
    model = initial(adapter.config)
    slots = adapter.alloc(2)
    assert slots is not None
    adapter.insert(Key((1, 2)), slots, priority=0, chunked=False)  # write_through: backup
    assert adapter.cache.ongoing_write_through, "the insert issued no backup"
    adapter.reset()
    stale = dict(adapter.cache.ongoing_write_through)
    assert stale, "reset cleared the pending backup: DEV-19 is fixed upstream"
    seen = adapter.observe(model)
    assert seen.pending and not seen.pages, "the abstraction must show the stale copy"
    adapter.close()


def test_a_trace_recorded_from_sglang_replays_clean(tmp_path: Path) -> None:
    """spec/08: SGLang's run as a trace, adopt directives included, that the model accepts."""
    path = tmp_path / "sglang.jsonl"
    assert main(["check", "--engine", "sglang", "--examples", "8", "--steps", "30",
                 "--page-sizes", "1", "--record", str(path)]) == 0
    lines = path.read_text().splitlines()
    assert '"engine": "sglang 0.5.20"' in lines[0]
    applied, finding = trace.replay(lines)
    assert finding is None, finding
    assert applied == len(lines) - 1


def test_a_fixed_sglang_run_replays_clean() -> None:
    lines = drive(Scenario(page_size=1), "sglang")
    assert trace.replay(lines) == (len(lines) - 1, None)


def _survivors_of_a_tie(hierarchical: bool, tier: str) -> tuple[tuple[int, ...], ...]:
    """Three leaves inserted at one tick (a tie in every rank), then one evicted from
    ``tier``: the leaves still on that tier."""
    adapter = SglangAdapter(Scenario(page_size=1, eviction="fifo"), hierarchical=hierarchical)
    adapter.set_time(0)
    for tokens in [(1,), (2,), (3,)]:
        slots = adapter.alloc(1)
        assert slots is not None
        adapter.insert(Key(tokens), slots, priority=0, chunked=False)
    if hierarchical:
        adapter.writing_check()  # the backups' locks released
    if tier == "host":
        assert adapter.evict(3) == 3
        assert adapter.evict_host(1) == 1
    else:
        assert adapter.evict(1) == 1
    pages = adapter.observe(initial(adapter.config)).pages
    kept = tuple(sorted(k.tokens for k, p in pages.items()
                        if (p.host if tier == "host" else p.device) is not None))
    adapter.close()
    return kept


@pytest.mark.parametrize("hierarchical, tier", [(False, "device"), (True, "device"),
                                                (True, "host")])
def test_a_tie_among_leaves_is_broken_the_same_way_in_every_run(hierarchical: bool,
                                                                 tier: str) -> None:
    """spec/07 DEV-20: SGLang keeps evictable leaves in a set hashed by object address;
    the adapter orders it, so that an example replays (Hypothesis needs that to shrink).
    Other objects are kept alive between runs so that the caches' addresses differ."""
    ballast: list[object] = []
    seen = set()
    for run in range(30):
        seen.add(_survivors_of_a_tie(hierarchical, tier))
        ballast.append([object() for _ in range(7 * run)])
    assert len(seen) == 1, f"one tie, {len(seen)} outcomes: {sorted(seen)}"
    assert len(next(iter(seen))) == 2


@pytest.mark.parametrize("hierarchical", [False, True])
def test_adopted_fields_are_adoptable_and_each_names_a_deviation(hierarchical: bool) -> None:
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=hierarchical)
    assert set(adapter.adopted) <= set(trace.ADOPTABLE)
    assert all("DEV-" in why for why in adapter.adopted.values())
    adapter.close()


@pytest.mark.parametrize("hierarchical", [False, True])
def test_dev25_counted_from_inside_the_key_is_refused_not_approximated(
        hierarchical: bool) -> None:
    """spec/07 DEV-25: 0.5.20's insert takes only ``chunked``. counted_from = the aligned
    length is chunked; inside the key it has no counterpart: declared inexpressible (the
    differential suite never asks) and refused by the adapter, the cache untouched."""
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=hierarchical)
    assert "counted_from_inside" in adapter.inexpressible
    slots = adapter.alloc(2)
    assert slots is not None
    with pytest.raises(ValueError, match="DEV-25"):
        adapter.insert(Key((1, 2)), slots, priority=0, chunked=False, counted_from=1)
    assert adapter.observe(initial(adapter.config)).pages == {}
    adapter.insert(Key((1, 2)), slots, priority=0, chunked=False, counted_from=2)
    assert {p.hits for p in adapter.observe(initial(adapter.config)).pages.values()} == {0}
    adapter.close()


# MLA pools and the page_first host layout (SGLang's page_first_direct), spec/07 7.1.
LAYOUT_SCENARIOS = [Scenario(page_size=2, kv_layout="mla"),
                    Scenario(page_size=2, host_layout="page_first", eviction="lfu"),
                    Scenario(page_size=1, kv_layout="mla", host_layout="page_first",
                             eviction="fifo")]


@pytest.mark.parametrize("scenario", LAYOUT_SCENARIOS, ids=lambda s: s.slug())
def test_hiradix_cache_with_mla_or_page_first_refines_the_model(scenario: Scenario) -> None:
    run_state_machine_as_test(make_differential(factory("sglang", scenario)),
                              settings=bounded())


def tamper_with_host_kv(machine: Any, host: Any, kv_layout: str) -> None:
    """After a backup of (1, 2, 3, 1) has landed, one element of one layer of page (1, 2)'s
    second host slot is changed in the host pool's own buffer, addressed through its
    layout; the observation must show exactly that slot as corrupt."""
    machine.request(tokens=(1, 2, 3, 1), namespace=None, dt=1, chunked=False, priority=0,
                    keep_lock=False)
    machine.writing_check()
    machine.engine_refines_the_model()
    slot = machine.model.pages[Key((1, 2))].host[1]
    buffer = host.kv_buffer if kv_layout == "mla" else host.k_buffer
    assert host.layout == "page_first_direct"
    buffer[slot // 2, 1, slot % 2] += 1  # [page, layer, offset, ...]
    seen = machine.engine.observe(machine.model)
    assert {s for s, c in seen.host_kv.items() if c != machine.model.host_kv[s]} == {slot}
    assert seen.host_kv[slot] == CORRUPT


@pytest.mark.parametrize("kv_layout", ["mha", "mla"])
def test_host_kv_is_read_through_sglangs_page_first_layout(kv_layout: str) -> None:
    scenario = Scenario(page_size=2, kv_layout=kv_layout, host_layout="page_first")  # type: ignore[arg-type]
    machine = make_differential(factory("sglang", scenario))()
    cache = machine.engine.cache
    kind = "MLA" if kv_layout == "mla" else "MHA"
    assert type(cache.token_to_kv_pool_host).__name__ == f"{kind}TokenToKVPoolHost"
    assert type(machine.engine.kv).__name__ == f"{kind}TokenToKVPool"
    tamper_with_host_kv(machine, cache.token_to_kv_pool_host, kv_layout)
    machine.teardown()


def _put(adapter: Any, tokens: tuple[int, ...], now: int) -> None:
    """A request as a scheduler serves it: match, allocate, write KV, insert."""
    from hiradix_model.keys import content_at
    key = Key(tokens)
    adapter.set_time(now)
    adapter.match_prefix(key)
    slots = adapter.alloc(len(tokens))
    assert slots is not None
    adapter.write_kv(slots, [content_at(key, i) for i in range(len(tokens))])
    adapter.insert(key, slots, priority=0, chunked=False)


def _write_back(device_pages: int = 6) -> SglangAdapter:
    return SglangAdapter(Scenario(page_size=1, write_policy="write_back",
                                  device_pages=device_pages), hierarchical=True)


def test_dev3_dev14_write_back_counts_no_hits_and_backs_up_nothing_on_insert() -> None:
    """spec/07 DEV-3 and DEV-14, run: under write_back a key inserted twice keeps zero
    hits, nothing is backed up on insert, and the unused threshold is 2, not none.
    (The adapter adopts hits under write_back for this reason.)"""
    adapter = _write_back()
    assert "hits" in adapter.adopted
    _put(adapter, (1, 2), 1)
    _put(adapter, (1, 2), 2)
    pages = adapter.observe(initial(adapter.config)).pages
    assert {p.hits for p in pages.values()} == {0}
    assert not adapter.cache.ongoing_write_through
    assert all(p.host is None for p in pages.values())
    assert adapter.cache.write_through_threshold == 2
    adapter.close()


def test_dev6_a_write_back_eviction_is_complete_when_evict_returns() -> None:
    """spec/07 DEV-6, run: evict() under write_back copies the victim to host, waits for
    the copy and frees its device slots in the one call: afterwards nothing is in
    flight, the page is host-only and the host slots hold its KV bytes."""
    from hiradix.conformance.kv import patterns
    from hiradix.engines.sglang.radix import LAYERS, TOKEN_SHAPE, read_host_kv
    from hiradix_model.keys import content_at
    adapter = _write_back()
    _put(adapter, (1, 2), 1)
    assert adapter.evict(2) == 2
    state = adapter.observe(initial(adapter.config))
    assert state.pending == () and not adapter.cache.ongoing_write_through
    key = Key((1, 2))
    pages = [state.pages[Key((1,))], state.pages[key]]
    assert all(p.device is None and p.host is not None for p in pages)
    slots = [s for p in pages for s in p.host or ()]
    want = patterns([content_at(key, 0), content_at(key, 1)], LAYERS, TOKEN_SHAPE,
                    adapter.kv.dtype)
    assert torch.equal(read_host_kv(adapter.cache.token_to_kv_pool_host, slots, "mha"), want)
    assert len(state.device_free) == adapter.config.device_slots
    adapter.close()


def test_dev8_a_write_back_eviction_makes_host_room_for_the_whole_node() -> None:
    """spec/07 DEV-8 on the write-back path, run: a 6-token device node is evicted with 5
    host slots free. The spec copies page by page and evicts host pages for the
    shortfall only (one page: (2, 1, 1, 1)); HiRadixCache asks evict_host for the whole
    node's 6 tokens, and all four host-only pages of (2, 1, 1, 1) go."""
    adapter = SglangAdapter(Scenario(page_size=1, write_policy="write_back", device_pages=6,
                                     host_pages=8), hierarchical=True)
    assert adapter.config.host_slots == 9  # SGLang's host pool: ratio x device, + a page
    _put(adapter, (2, 1, 1, 1), 1)
    assert adapter.evict(4) == 4  # to host: 4 of 9 host slots used
    _put(adapter, (1, 1, 1, 1, 1, 1), 2)
    assert len(adapter.observe(initial(adapter.config)).host_free) == 5
    assert adapter.evict(1) == 6
    pages = adapter.observe(initial(adapter.config)).pages
    assert not [k for k in pages if k.tokens[0] == 2], "the spec keeps (2,) .. (2, 1, 1)"
    assert all(p.host is not None for p in pages.values())
    adapter.close()


def test_dev13_a_host_only_node_can_be_locked() -> None:
    """spec/07 DEV-13, run: HiRadixCache's inc_lock_ref locks a node that is on host only
    (the spec requires the page on device)."""
    adapter = _write_back()
    _put(adapter, (1, 2), 1)
    assert adapter.evict(2) == 2
    node = adapter._node(Key((1, 2)))
    assert node.evicted
    adapter.cache.inc_lock_ref(node)
    assert node.lock_ref == 1
    adapter.close()


def test_dev12_an_extra_release_exposes_a_backup_in_flight() -> None:
    """spec/07 DEV-12, run: write-through, a backup in flight holds the node's only lock;
    a release the caller never took brings it to 0 and an eviction frees the node's
    device slots while the backup is still unacknowledged."""
    adapter = SglangAdapter(Scenario(page_size=1), hierarchical=True)
    _put(adapter, (1, 2), 1)
    node = adapter._node(Key((1, 2)))
    assert node.lock_ref == 1 and adapter.cache.ongoing_write_through
    adapter.cache.dec_lock_ref(node)
    assert node.lock_ref == 0
    assert adapter.evict(2) == 2
    assert node.value is None and node.id in adapter.cache.ongoing_write_through
    adapter.close()
