"""The storage tier called from several threads at once (spec/09, 9.4 "Threads"): its
public methods are serialised by one re-entrant lock, so 2-4 scheduler threads hammering
one tier (with the threaded I/O running underneath) leave it consistent: every host slot
is in exactly one place, no protection is left behind, every invariant holds."""

from __future__ import annotations

import random
import sys
import threading
import time

import pytest
import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.scenario import Scenario
from hiradix.keys import RadixKey
from hiradix.storage import MemoryBackend
from hiradix.storage.tier import StorageTier, TierSettings

P = 2
KEYS = [RadixKey(tuple([k] * 2 + list(range(10 * k, 10 * k + 6)))) for k in range(1, 7)]
ROUNDS = 200


def conserved(cache: HiRadixCache, tier: StorageTier) -> None:
    """Every host slot is free, in the tree or owned by the tier, exactly once; every
    bookkeeping check of the tier and the cache holds."""
    tree = [slot for node in cache.nodes() if node.host is not None
            for slot in node.host.tolist()]
    places = tree + sorted(cache.host_pool.free_slots()) + tier.host_slots_owned()
    assert sorted(places) == list(range(cache.host_pool.num_slots)), "a host slot leaked"
    tier.check()
    if not tier.host_slots_owned():  # the cache's own check counts the tier's as lost
        cache.check_invariants()


def settle(tier: StorageTier) -> None:
    """Drain until the I/O has reported on every operation (a safety net bounds it)."""
    deadline = time.monotonic() + 30.0
    while tier.state.writes or tier.state.release_queue or any(
            prefetch.io_running for prefetch in tier.state.prefetches.values()):
        assert time.monotonic() < deadline, "the I/O never reported"
        tier.drain_storage_queues()
        time.sleep(0.001)


def stored(tier: StorageTier, cache: HiRadixCache) -> None:
    """Every key of KEYS written to storage, then dropped from the tree."""
    for seed, key in enumerate(KEYS):
        slots = cache.device_pool.alloc(len(key.tokens))
        assert slots is not None
        values = torch.randn(cache.device_pool.value_shape(len(key.tokens)),
                             generator=torch.Generator().manual_seed(seed))
        cache.device_pool.write(slots, values.to(cache.device_pool.dtype))
        cache.insert(key, slots)
        cache.engine.complete("d2h", cache.engine.queued("d2h"))  # type: ignore[attr-defined]
        tier.writing_check()
        while tier.state.writes:
            tier.drain_storage_queues()
        cache.evict(cache.device_pool.num_slots)
        cache.evict_host(cache.host_pool.num_slots)


def hammer(tier: StorageTier, cache: HiRadixCache, worker: int, errors: list[BaseException]
           ) -> None:
    """One scheduler thread: prefetches, polls, terminates, aborts, drains, queries."""
    rng = random.Random(worker)
    try:
        for round_ in range(ROUNDS):
            request = f"w{worker}-{round_}"
            key = rng.choice(KEYS)
            tier.query_storage_hit_length(key)
            tier.prefetch_from_storage(request, key)
            action = rng.randrange(4)
            if action == 0:
                tier.terminate_prefetch(request)
            elif action == 1:
                tier.release_aborted_request(request)
            for _ in range(rng.randrange(3)):
                tier.drain_storage_queues()
            tier.check_prefetch_progress(request)
            tier.pop_prefetch_loaded_tokens(request)
            tier.writing_check()
            if rng.randrange(3) == 0:
                with tier.lock:  # the cache itself is single-threaded: the one lock
                    cache.evict_host(4 * P)
    except BaseException as error:  # reported to the test's thread
        errors.append(error)


@pytest.mark.parametrize("workers", [2, 3, 4])
def test_threads_hammering_one_tier_leave_it_consistent(workers: int) -> None:
    cache = Scenario(host_pages=24, device_pages=8).build(ManualClock(1), None)
    tier = StorageTier(cache)
    settings = TierSettings(prefetch_threshold=P, prefetch_token_limit=10_000)
    tier.attach(MemoryBackend(), "model-a", settings, threaded=True)
    stored(tier, cache)
    errors: list[BaseException] = []
    threads = [threading.Thread(target=hammer, args=(tier, cache, worker, errors))
               for worker in range(workers)]
    interval = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)  # switch threads often: races show up in a short run
    try:
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(timeout=120)
    finally:
        sys.setswitchinterval(interval)
    assert not any(thread.is_alive() for thread in threads)
    assert not errors, errors[:3]
    assert tier.metrics.prefetches_started > 0
    conserved(cache, tier)
    for request in list(tier.state.prefetches):
        tier.terminate_prefetch(request)
        tier.check_prefetch_progress(request)
    settle(tier)
    conserved(cache, tier)
    tier.detach()
    conserved(cache, tier)
    assert not any(node.host_ref for node in cache.nodes()), "a protection was left"
    assert cache.host_pool.num_free_slots + sum(
        len(node.host) for node in cache.nodes() if node.host is not None
    ) == cache.host_pool.num_slots
