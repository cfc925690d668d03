"""SGLang's write-back eviction against the spec (spec/03 3.8, R2; spec/07 DEV-31, DEV-32).

Runs under ``.venv-sglang`` (0.5.20: HiRadixCache and UnifiedRadixCache) or
``.venv-sglang23`` (0.5.23: UnifiedRadixCache), e.g.
``.venv-sglang/bin/python -m pytest -q tests/engines/test_sglang_write_back.py``.
Skipped where SGLang is not installed.
"""

from __future__ import annotations

import importlib.util
import os
from typing import Any

import pytest
from test_sglang_adapters import _put

from hiradix.conformance.scenario import Scenario
from hiradix.engines import factory
from hiradix_model import Key, Victim, initial, ops

HIRADIX = "sglang"  # HiRadixCache, 0.5.20 only (removed in 0.5.22)
UNIFIED = "sglang-unified"


def engines() -> list[str]:
    if importlib.util.find_spec("sglang") is None:
        return []
    from importlib.metadata import version
    return [HIRADIX, UNIFIED] if version("sglang") == "0.5.20" else [UNIFIED]


@pytest.fixture(autouse=True)
def sglang_installed() -> None:
    if importlib.util.find_spec("sglang") is None:
        pytest.skip("SGLang is not installed here (make sglang-env / make sglang23-env)")


def _one_free_host_slot(engine: str) -> Any:
    """A write-back cache at page size 1 whose host has exactly one free slot and no
    host-evictable page: (3,) is evicted to host, loaded back (on both tiers now) and
    locked."""
    adapter = factory(engine, Scenario(page_size=1, write_policy="write_back",
                                       device_pages=4, host_pages=1))()
    assert adapter.config.host_slots == 2  # SGLang's smallest host pool here
    _put(adapter, (3,), 1)
    assert adapter.evict(1) == 1
    adapter.match_prefix(Key((3,)))
    adapter.init_load_back(Key((3,)), None)
    adapter.loading_check()
    adapter.inc_lock_ref(Key((3,)))
    return adapter


@pytest.mark.parametrize("engine", engines())
def test_dev32_a_node_the_host_cannot_hold_is_dropped_whole(
        engine: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """spec/07 DEV-32, run: (1, 2) is one node of two pages; the host has one free slot
    and nothing it may evict. SGLang backs a node up as one copy or not at all, so
    evict(2) drops the whole node. The spec backs up page by page: (1, 2) takes the free
    slot, then (1,) makes room by evicting (1, 2) from host (R2) and takes it; (1,) stays
    cached on host. (UnifiedRadixCache would first reclaim the host copy of (3,), DEV-31:
    switched off here, as a campaign would.)"""
    monkeypatch.setenv("SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM", "1")
    adapter = _one_free_host_slot(engine)
    _put(adapter, (1, 2), 2)
    model = initial(adapter.config)
    state = adapter.observe(model)
    assert len(state.host_free) == 1
    slot = min(state.host_free)
    assert adapter.evict(2) == 2
    after = adapter.observe(model)
    assert Key((1,)) not in after.pages and Key((1, 2)) not in after.pages
    # The spec's only legal outcome from the same state keeps (1,) on host.
    spec, evicted = ops.evict(state, 2, (Victim(Key((1, 2)), (), (slot,)),
                                         Victim(Key((1,)), (Key((1, 2)),), (slot,))))
    assert evicted == 2 and spec.pages[Key((1,))].host == (slot,)
    adapter.close()


@pytest.mark.parametrize("engine", engines())
def test_dev32_a_node_gets_host_room_first_and_its_slots_root_most_first(engine: str) -> None:
    """spec/07 DEV-32, run: a two-slot host holds (4,), host-only, and has one free slot.
    SGLang makes room for the whole node (1, 2) first -- evicting (4,) -- and copies the
    node root-most first. The spec evicts page by page, leaf first: (1, 2) must take the
    free slot (no host victim is legal while a slot is free, R2), and (1,) then evicts
    (4,) and takes its slot. SGLang puts (1,) where the spec puts (1, 2)."""
    adapter = factory(engine, Scenario(page_size=1, write_policy="write_back",
                                       device_pages=4, host_pages=1))()
    assert adapter.config.host_slots == 2
    _put(adapter, (4,), 1)
    assert adapter.evict(1) == 1
    _put(adapter, (1, 2), 2)
    state = adapter.observe(initial(adapter.config))
    (free,) = state.host_free
    assert adapter.evict(2) == 2
    after = adapter.observe(initial(adapter.config))
    assert Key((4,)) not in after.pages
    spec, _ = ops.evict(state, 2, (Victim(Key((1, 2)), (), (free,)),
                                   Victim(Key((1,)), (Key((4,)),),
                                          state.pages[Key((4,))].host)))
    assert spec.pages[Key((1, 2))].host == (free,)
    assert after.pages[Key((1,))].host == (free,)
    assert after.pages[Key((1, 2))].host == state.pages[Key((4,))].host
    adapter.close()


def test_dev31_write_back_host_eviction_reclaims_a_device_pages_host_copy(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """spec/07 DEV-31, run: under write_back, UnifiedRadixCache's host eviction frees the
    host copy of a page also on device ((3,), loaded back), where the spec evicts
    host-only pages only and here has none. SGLang's switch
    SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM=1 (read at each host eviction) turns it
    off: the mapping a write-back campaign would set."""
    monkeypatch.delenv("SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM", raising=False)
    adapter = _one_free_host_slot(UNIFIED)
    page = Key((3,))
    adapter.dec_lock_ref(page)
    assert adapter.skip_duplicate_reclaim  # the adapter sets the switch under write_back
    assert adapter.evict_host(1) == 0  # as the spec: nothing host-only to evict
    assert "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM" not in os.environ  # set per call
    adapter.skip_duplicate_reclaim = False  # SGLang's default
    before = adapter.observe(initial(adapter.config)).pages[page]
    assert before.device is not None and before.host is not None
    assert adapter.evict_host(1) == 1
    after = adapter.observe(initial(adapter.config)).pages[page]
    assert after.device == before.device and after.host is None
    adapter.close()
