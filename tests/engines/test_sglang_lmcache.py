"""SGLang 0.5.20's ``LMCRadixCache`` in-process over LMCache 0.5.6's CPU and disk tiers
(spec/15 15.9; issue 31; skipped without them).

Run from its environment: ``make sglang-lmcache-env``, then
``.venv-lmcache/bin/python -m pytest -q tests/engines/test_sglang_lmcache.py``.

Each test builds a fresh cache (two layers, chunks of 4 tokens, page size 1): a request
of 8 tokens is 2 chunks, 4 objects per LMCache tier. Round trips through each tier, the
DEV-L1 reproducer through LMCRadixCache as shipped, a seeded campaign, and bugs planted
in private copies (monkeypatched in this process) that the checks catch.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
from typing import Any

import pytest
import torch

from hiradix.conformance.flat.abstraction import LayerCodes
from hiradix.conformance.flat.engine import RadixConfig, Served, codes_of
from hiradix.engines.lmcache import env as lmcache_env
from hiradix.engines.lmcache import sglang_radix
from hiradix.engines.lmcache.sglang_radix import LMCRadix
from hiradix_model import Key
from hiradix_model.flat import FlatConfig
from hiradix_model.keys import content_at

from engine_env import require

CONFIG = RadixConfig(FlatConfig(chunk_tokens=4, layers=2, cpu_objects=8, disk_objects=16),
                     page_size=1, device_pages=24)
TOKENS = (1, 2, 3, 4, 5, 6, 7, 8)
OBJECTS = 4  # 2 chunks x 2 layers


@pytest.fixture
def cache() -> Iterator[LMCRadix]:
    require("sglang-lmcache")
    made = sglang_radix.build(CONFIG)
    try:
        yield made
    finally:
        made.close()


def request(cache: LMCRadix, codes: LayerCodes, tokens: tuple[int, ...] = TOKENS) -> Served:
    """One request to its end (match, forward, cache_finished_req); what its match got."""
    served, node = cache.match(tokens)
    assert cache.finish(tokens, served, node, codes_of(Key(tokens), 2, codes.code))
    lmcache_env.wait_for_disk_puts(cache.rig)
    return served


def assert_own_kv(cache: LMCRadix, codes: LayerCodes, served: Served,
                  tokens: tuple[int, ...] = TOKENS) -> None:
    """LMC-BYTES: each slot of the match holds its own prefix's KV at every layer."""
    want = [content_at(Key(tokens), p) for p in range(len(served.slots))]
    assert cache.read(served.slots, codes.content) == want



def test_device_hit_is_served_from_the_tree(cache: LMCRadix) -> None:
    codes = LayerCodes()
    assert request(cache, codes) == Served(0, 0, ())
    served = request(cache, codes)
    assert (served.device_hit, served.loaded) == (8, 0)
    assert_own_kv(cache, codes, served)
    assert lmcache_env.balance(cache.rig) == lmcache_env.Balance(OBJECTS, OBJECTS, OBJECTS,
                                                                 0, 0)


def test_cpu_tier_hit_is_loaded_back_with_its_bytes(cache: LMCRadix) -> None:
    codes = LayerCodes()
    request(cache, codes)
    assert cache.evict(100) == 8  # the device tree is empty; LMCache keeps both chunks
    served = request(cache, codes)
    assert (served.device_hit, served.loaded) == (0, 8)
    assert_own_kv(cache, codes, served)
    balance = lmcache_env.balance(cache.rig)
    assert (balance.staging, balance.cpu_pins, balance.disk_pins) == (0, 0, 0)


def test_partial_device_hit_loads_only_the_rest(cache: LMCRadix) -> None:
    codes = LayerCodes()
    request(cache, codes)
    cache.evict(100)
    request(cache, codes, TOKENS[:4])  # the device holds the first chunk again
    served = request(cache, codes)
    assert (served.device_hit, served.loaded) == (4, 4)
    assert_own_kv(cache, codes, served)
    assert lmcache_env.balance(cache.rig).staging == 0


def disk_hit(cache: LMCRadix, codes: LayerCodes) -> Served:
    """TOKENS stored, dropped from the device tree and from LMCache's CPU tier, then
    requested: served from the disk tier."""
    request(cache, codes)
    cache.evict(100)
    assert lmcache_env.evict_cpu_tier(cache.rig) == OBJECTS
    return request(cache, codes)


def test_dev_l1_a_disk_hit_through_lmcradixcache_leaks_staging_in_0_5_6(
        cache: LMCRadix) -> None:
    """spec/15 DEV-L1 through SGLang's own LMCRadixCache (in-process, as shipped but for
    the two CPU patches): the disk hit serves the right bytes, and leaves one staging
    buffer per chunk and layer allocated. The fix makes staging 0."""
    codes = LayerCodes()
    served = disk_hit(cache, codes)
    assert (served.device_hit, served.loaded) == (0, 8)
    assert_own_kv(cache, codes, served)
    balance = lmcache_env.balance(cache.rig)
    assert (balance.cpu_pins, balance.disk_pins) == (0, 0)
    assert balance.staging == OBJECTS  # LMC-STAGING fails: the leak
    cache.evict(100)
    disk_hit_again = request(cache, codes)  # CPU tier empty again: a second disk load
    assert disk_hit_again.loaded == 8
    assert lmcache_env.balance(cache.rig).staging == 2 * OBJECTS


def test_a_seeded_campaign_passes_steering_round_dev_l1_l3_l4() -> None:
    require("sglang-lmcache")
    from hiradix.conformance.flat.radix_campaign import run_campaign
    campaign = run_campaign("sglang-lmcache", sglang_radix.build, [1, 2],
                            until=time.monotonic() + 25, examples=6, seeded=0)
    assert campaign.failure is None, campaign.failure
    assert campaign.reached["examples"] >= 6 and campaign.reached["checks"] > 20


def machine() -> Any:
    from hiradix.conformance.flat.radix_machine import make_radix_machine
    return make_radix_machine(sglang_radix.build, CONFIG)()


def test_planted_load_into_swapped_slots_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of LMCRadixCache whose in-process load hands LMCache the fresh
    slots in reverse order: each loaded token's KV lands in another token's slot. The
    bytes check (LMC-BYTES) catches it; the tiers themselves stay right."""
    require("sglang-lmcache")
    lmc = sglang_radix._modules()["lmc"].LMCRadixCache
    shipped = lmc._ip_load_back

    def swapped(self: Any, *, token_ids: list[int], value_numel: int,
                slot_mapping: torch.Tensor, prefix_pad: int) -> int:
        mapping = slot_mapping.clone()
        mapping[value_numel:] = mapping[value_numel:].flip(0)
        loaded: int = shipped(self, token_ids=token_ids, value_numel=value_numel,
                              slot_mapping=mapping, prefix_pad=prefix_pad)
        return loaded

    monkeypatch.setattr(lmc, "_ip_load_back", swapped)
    state = machine()
    try:
        state.request(TOKENS)
        state.evict(16)
        with pytest.raises(AssertionError, match="served the wrong KV"):
            state.request(TOKENS)
    finally:
        state.teardown()


def test_planted_unpin_that_forgets_is_caught(monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy of LMCache's engine whose ``lookup_unpin`` does nothing: the store's
    lookup keeps its pins. The tiers' comparison with the flat model catches it
    (INV-FLAT-PINS-HELD, issue 31's LMC-PINS)."""
    require("sglang-lmcache")
    engine_cls = lmcache_env._modules()["engine"].LMCacheEngine
    monkeypatch.setattr(engine_cls, "lookup_unpin", lambda self, lookup_id: None)
    state = machine()
    try:
        with pytest.raises(AssertionError, match="lookups: model"):
            state.request(TOKENS)
            state.request(TOKENS)
    finally:
        state.teardown()


def test_a_missing_sglang_is_one_line_naming_the_setup(monkeypatch: pytest.MonkeyPatch
                                                      ) -> None:
    import importlib.metadata

    from hiradix.engines.protocol import EngineUnavailable
    require("lmcache")
    real = importlib.metadata.version

    def version(package: str) -> str:
        if package == "sglang":
            raise importlib.metadata.PackageNotFoundError(package)
        return real(package)

    monkeypatch.setattr(importlib.metadata, "version", version)
    with pytest.raises(EngineUnavailable) as missing:
        sglang_radix.probe()
    assert str(missing.value) == ("sglang-lmcache: sglang is not installed here "
                                  "(make sglang-lmcache-env, then run "
                                  ".venv-lmcache/bin/hiradix)")


def test_dev_l5_a_load_evicts_its_own_match_in_0_5_20(cache: LMCRadix) -> None:
    """spec/15 DEV-L5, found by the campaign: LMCRadixCache's load evicts for its slots
    (lmc_radix_cache.py:346-347) while the match's last node is not yet locked (the
    scheduler locks it after match_prefix returns, schedule_policy.py:1094). With the
    rest of the device locked by a running request, the victim is the match's own
    prefix: its slots are freed and handed straight back to the load, the loaded node
    hangs under the detached prefix, and the request is served one slot twice."""
    codes = LayerCodes()
    key = (5, 5, 6, 6, 7, 7, 8, 8)
    request(cache, codes, key)
    cache.evict(100)
    request(cache, codes, key[:4])  # the device holds the first 4 tokens again
    running = tuple(range(10, 29))  # 19 tokens; with 4 cached, 1 slot free
    request(cache, codes, running)
    cache.match(running)  # a running request locks it
    assert cache.allocator.available_size() == 1
    served, node = cache.match(key)
    assert (served.device_hit, served.loaded) == (4, 4)
    assert len(set(served.slots)) < len(served.slots)  # one slot served twice
    prefix = node.parent
    assert prefix not in prefix.parent.children.values()  # the match's prefix was evicted
    assert cache.read(served.slots, codes.content) != [
        content_at(Key(key), p) for p in range(8)]
