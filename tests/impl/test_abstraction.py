"""The refinement mapping sees what it must: corrupt bytes, leaked slots, drifted counters."""

from __future__ import annotations

import torch

from hiradix.clock import ManualClock
from hiradix.conformance.abstraction import CORRUPT, abstract
from hiradix.conformance.kv import pattern, patterns
from hiradix.conformance.scenario import Scenario
from hiradix.keys import RadixKey
from hiradix_model import Key, initial, ops
from hiradix_model.keys import content_at


def cached_pair(scenario: Scenario):  # type: ignore[no-untyped-def]
    """A cache and the model after the same insert of four tokens, copy acknowledged."""
    clock = ManualClock(1)
    cache = scenario.build(clock, None)
    model = initial(scenario.model_config())
    key = Key((1, 2, 3, 4))
    slots = cache.device_pool.alloc(4)
    assert slots is not None
    pool = cache.device_pool
    pool.write(slots, patterns([content_at(key, i) for i in range(4)], pool.layers,
                               pool.token_shape, pool.dtype))
    model, _ = ops.alloc(model, key, 0, tuple(slots.tolist()))
    cache.insert(RadixKey(key.tokens), slots)
    host = tuple(cache.nodes()[0].host.tolist())  # type: ignore[union-attr]
    model, _ = ops.insert(model, key, tuple(slots.tolist()), 1, backup=ops.Backup((), host))
    cache.engine.complete("d2h", 1)  # type: ignore[attr-defined]
    model, _ = ops.writing_check(model, cache.writing_check())
    assert abstract(cache, model) == model
    return cache, model


def test_corrupt_device_bytes_break_the_refinement() -> None:
    cache, model = cached_pair(Scenario(page_size=2))
    slot = cache.nodes()[0].device[0:1]  # type: ignore[index]
    pool = cache.device_pool
    pool.write(slot, torch.zeros((pool.layers, 1, *pool.token_shape), dtype=pool.dtype))
    assert abstract(cache, model).device_kv[int(slot)] == CORRUPT


def test_corrupt_host_bytes_break_the_refinement_on_page_first_layout() -> None:
    cache, model = cached_pair(Scenario(page_size=2, host_layout="page_first", kv_layout="mla"))
    slot = cache.nodes()[0].host[3:4]  # type: ignore[index]
    pool = cache.host_pool
    pool.write(slot, torch.zeros((pool.layers, 1, *pool.token_shape), dtype=pool.dtype))
    assert abstract(cache, model).host_kv[int(slot)] == CORRUPT


def test_a_leaked_device_slot_shows_as_held() -> None:
    cache, model = cached_pair(Scenario(page_size=2))
    leaked = cache.device_pool.alloc(2)
    assert leaked is not None
    assert abstract(cache, model).held == frozenset(leaked.tolist()) != model.held


def test_counter_drift_shows() -> None:
    cache, model = cached_pair(Scenario(page_size=2))
    cache.evictable_tokens += 2
    assert abstract(cache, model) != model


def test_patterns_is_pattern_of_each_content_in_each_layer() -> None:
    # patterns computes every (layer, content) pair in one op; pattern is the definition.
    key = Key((5, 6, 7), "n")
    contents = [content_at(key, i) for i in range(3)]
    for dtype in (torch.float16, torch.bfloat16, torch.float32):
        got = patterns(contents, 2, (2, 3), dtype)
        want = torch.stack([torch.stack([pattern(c, layer, (2, 3), dtype) for c in contents])
                            for layer in range(2)])
        assert got.shape == (2, 3, 2, 3) and torch.equal(got, want)
        # Distinct per element, so a transposed or shifted copy shows.
        rows = got.reshape(6, 6).to(torch.float32)
        assert all(torch.unique(row).numel() == 6 for row in rows)
    assert patterns([], 2, (2, 3), torch.float16).shape == (2, 0, 2, 3)
