"""The cache-side storage tier (spec/09) on hand-built cases: restart over a file backend,
stop policies, faults, release-once, backup protection, typed errors leave state as it
was."""

from __future__ import annotations

import time
from pathlib import Path

import pytest
import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import CountingClock, ManualClock, MonotonicClock
from hiradix.conformance.scenario import Scenario
from hiradix.errors import InvalidArgument
from hiradix.keys import RadixKey
from hiradix.storage import (
    BackupResult,
    ControlledBackend,
    Fault,
    FileBackend,
    MemoryBackend,
    PrefetchResult,
    StorageArgumentError,
    StorageBackend,
)
from hiradix.storage.tier import PageRun, StorageTier, TierSettings

P = 2
KEY = RadixKey(tuple(range(1, 9)))  # 4 pages
SETTINGS = TierSettings(prefetch_threshold=2, prefetch_token_limit=1000)


def make(backend: StorageBackend, settings: TierSettings = SETTINGS, batch_pages: int = 4,
         **changes: object) -> tuple[HiRadixCache, StorageTier, ManualClock]:
    clock = ManualClock(1)
    scenario = Scenario(**{"host_pages": 8, "device_pages": 6, **changes})  # type: ignore[arg-type]
    cache = scenario.build(clock, None)
    tier = StorageTier(cache)
    assert tier.attach(backend, "model-a", settings, threaded=False,
                       batch_pages=batch_pages) == "attached"
    return cache, tier, clock


def fill(cache: HiRadixCache, tier: StorageTier, key: RadixKey = KEY, seed: int = 0
         ) -> torch.Tensor:
    """Insert ``key`` with random KV, land its host copy and write it to storage."""
    slots = cache.device_pool.alloc(len(key.tokens))
    assert slots is not None
    values = torch.randn(cache.device_pool.value_shape(len(key.tokens)),
                         generator=torch.Generator().manual_seed(seed)).to(cache.device_pool.dtype)
    cache.device_pool.write(slots, values)
    cache.insert(key, slots)
    cache.engine.complete("d2h", cache.engine.queued("d2h"))  # type: ignore[attr-defined]
    tier.writing_check()
    return values


def settle(tier: StorageTier) -> None:
    assert tier.io is not None
    tier.io.run_pending()
    tier.drain_storage_queues()


def snapshot(cache: HiRadixCache, tier: StorageTier) -> str:
    state = tier.state
    return (cache.dump() + repr(sorted(cache.host_pool.free_slots()))
            + repr(sorted(state.prefetches)) + repr(sorted(state.writes))
            + repr((state.revoke_queue, state.release_queue, state.occupied_tokens,
                    state.loaded_tokens, state.release_log, state.next_id))
            + repr(tier.settings))


def free_host(cache: HiRadixCache) -> int:
    return cache.host_pool.num_free_slots


def test_restart_over_a_file_backend_finds_the_pages_and_the_bytes_match(
        tmp_path: Path) -> None:
    first, tier1, _ = make(FileBackend(tmp_path))
    values = fill(first, tier1)
    assert tier1.state.writes, "the acknowledged host copy must be written to storage"
    settle(tier1)
    assert not tier1.state.writes
    tier1.check()
    tier1.detach()

    second, tier2, _ = make(FileBackend(tmp_path))
    assert tier2.query_storage_hit_length(KEY) == len(KEY.tokens)
    assert tier2.prefetch_from_storage("r", KEY) == len(KEY.tokens)
    assert tier2.io is not None and tier2.io.run_pending() == 1
    assert tier2.check_prefetch_progress("r")
    assert tier2.pop_prefetch_loaded_tokens("r") == len(KEY.tokens)
    assert tier2.pop_prefetch_loaded_tokens("r") == 0
    match = second.match_prefix(KEY)
    assert match.host_hit_length == len(KEY.tokens)
    (node,) = second.nodes()
    assert node.device is None and node.host is not None
    assert torch.equal(second.host_pool.read(node.host), values)
    tier2.drain_storage_queues()
    tier2.check()
    second.check_invariants()
    assert free_host(second) == 16 - len(KEY.tokens)


def test_another_model_identity_finds_nothing(tmp_path: Path) -> None:
    first, tier1, _ = make(FileBackend(tmp_path))
    fill(first, tier1)
    settle(tier1)
    second = Scenario(host_pages=8).build(ManualClock(1), None)
    tier2 = StorageTier(second)
    tier2.attach(FileBackend(tmp_path), "model-b", SETTINGS, threaded=False)
    assert tier2.query_storage_hit_length(KEY) == 0


def stored_backend() -> ControlledBackend:
    backend = ControlledBackend(MemoryBackend())
    cache, tier, _ = make(backend)
    fill(cache, tier)
    settle(tier)
    tier.detach()
    return backend


@pytest.mark.parametrize(("fault", "landed"), [
    (Fault("short", 2), 2), (Fault("corrupt", 1), 1), (Fault("die", 3), 3),
    (Fault("raise"), 0),
])
def test_a_fetch_fault_inserts_only_the_landed_prefix_and_releases_the_rest_once(
        fault: Fault, landed: int) -> None:
    backend = stored_backend()
    cache, tier, _ = make(backend)
    backend.inject("get", fault)
    assert tier.prefetch_from_storage("r", KEY) == 8
    assert free_host(cache) == 8
    settle(tier)
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == P * landed
    assert cache.match_prefix(KEY).host_hit_length == P * landed
    tier.drain_storage_queues()
    assert free_host(cache) == 16 - P * landed
    assert len(tier.state.release_log) == 8
    tier.check()
    cache.check_invariants()


def test_a_failed_hit_query_revokes() -> None:
    backend = stored_backend()
    cache, tier, _ = make(backend, TierSettings(prefetch_threshold=2,
                                                prefetch_token_limit=1000,
                                                prefetch_policy="wait_complete"))
    backend.inject("exists", Fault("raise"))
    tier.prefetch_from_storage("r", KEY)
    assert tier.io is not None
    tier.io.run_pending()
    assert not tier.check_prefetch_progress("r")  # revoked is never complete
    assert tier.drain_storage_queues() == (1, 0, 8)
    assert tier.check_prefetch_progress("r")  # the drain ended it
    assert free_host(cache) == 16 and tier.state.occupied_tokens == 0
    assert tier.metrics.prefetches_revoked == 1


def test_wait_complete_waits_for_the_io() -> None:
    backend = stored_backend()
    _, tier, _ = make(backend, TierSettings(prefetch_threshold=2,
                                                prefetch_token_limit=1000,
                                                prefetch_policy="wait_complete"))
    tier.prefetch_from_storage("r", KEY)
    assert not tier.check_prefetch_progress("r")
    assert tier.io is not None
    tier.io.run_pending()
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == 8


def test_timeout_is_linear_capped_and_exact() -> None:
    settings = TierSettings(timeout_base=10, timeout_per_ki_token=1024, timeout_max=20)
    assert not settings.timed_out(10, 0) and settings.timed_out(11, 0)
    assert not settings.timed_out(13, 3) and settings.timed_out(14, 3)
    assert not settings.timed_out(20, 10_000) and settings.timed_out(21, 10_000)


def test_timeout_policy_ends_a_slow_prefetch_at_the_boundary() -> None:
    backend = stored_backend()
    cache, tier, clock = make(backend, TierSettings(
        prefetch_threshold=2, prefetch_token_limit=1000, prefetch_policy="timeout",
        timeout_base=5, timeout_per_ki_token=0, timeout_max=100))
    tier.prefetch_from_storage("r", KEY)  # started at tick 1; the I/O is "slow": not run
    clock.advance(5)
    assert not tier.check_prefetch_progress("r")
    clock.advance(1)
    assert tier.check_prefetch_progress("r")
    assert tier.metrics.prefetch_timeouts == 1
    assert tier.pop_prefetch_loaded_tokens("r") == 0
    assert tier.state.io_held  # the I/O still owns the slots it may be writing
    settle(tier)  # the late result hands them back, once
    assert free_host(cache) == 16 and not tier.state.io_held
    tier.check()


@pytest.mark.parametrize("how", ["terminate", "abort"])
def test_terminate_and_abort_release_everything(how: str) -> None:
    backend = stored_backend()
    cache, tier, _ = make(backend, TierSettings(prefetch_threshold=2,
                                                prefetch_token_limit=1000,
                                                prefetch_policy="wait_complete"))
    tier.prefetch_from_storage("r", KEY)
    if how == "terminate":
        tier.terminate_prefetch("r")
        assert tier.check_prefetch_progress("r")
    else:
        tier.release_aborted_request("r")
    settle(tier)
    assert free_host(cache) == 16 and not tier.state.prefetches
    assert cache.match_prefix(KEY).host_hit_length == 0
    tier.check()


def test_a_page_being_backed_up_is_host_protected_until_the_ack_is_drained() -> None:
    cache, tier, _ = make(MemoryBackend())
    fill(cache, tier)
    cache.evict(len(KEY.tokens))  # device copies go; host copies stay, protected
    assert cache.evict_host(len(KEY.tokens)) == 0
    tier.check()
    settle(tier)
    assert cache.evict_host(len(KEY.tokens)) == len(KEY.tokens)
    assert tier.backend is not None and tier.query_storage_hit_length(KEY) == 8


def test_prefetch_below_an_anchor_protects_it_and_shrinks_to_fit() -> None:
    backend = stored_backend()
    cache, tier, _ = make(backend, host_pages=3)
    head = RadixKey(KEY.tokens[:2])
    fill(cache, tier, head)  # page 0 cached on device and host
    settle(tier)
    anchor = cache.match_prefix(KEY).last_host_node
    assert tier.prefetch_from_storage("r", KEY, anchor) == 4  # 3 pages below, 2 fit
    assert anchor.host_ref == 1
    tier.check()
    settle(tier)
    assert tier.check_prefetch_progress("r")
    assert anchor.host_ref == 0
    assert cache.match_prefix(KEY).host_hit_length == 4
    cache.check_invariants()
    tier.check()


def test_rate_limit_and_threshold() -> None:
    backend = stored_backend()
    _, tier, _ = make(backend, TierSettings(prefetch_threshold=2, prefetch_token_limit=4))
    assert tier.prefetch_from_storage("a", KEY) == 8
    assert tier.prefetch_from_storage("b", RadixKey(KEY.tokens, "ns")) == 0  # limited
    _, strict, _ = make(backend, TierSettings(prefetch_threshold=10,
                                              prefetch_token_limit=100))
    assert strict.prefetch_from_storage("a", KEY) == 0  # 8 tokens < threshold


def test_detach_frees_what_each_prefetch_owns_and_drops_write_protection() -> None:
    backend = stored_backend()
    cache, tier, _ = make(backend)
    tier.prefetch_from_storage("r", KEY)
    other = RadixKey(tuple(range(20, 24)))
    fill(cache, tier, other, seed=1)
    assert tier.state.writes
    tier.detach()
    assert not tier.attached and not tier.state.prefetches and not tier.state.writes
    assert all(node.host_ref == 0 for node in cache.nodes())
    assert free_host(cache) == 16 - len(other.tokens)
    assert len(tier.state.release_log) == len(set(tier.state.release_log))


def test_clear_forgets_the_pages() -> None:
    backend = stored_backend()
    _, tier, _ = make(backend)
    assert tier.query_storage_hit_length(KEY) == 8
    assert tier.clear()
    assert tier.query_storage_hit_length(KEY) == 0


def test_reattach_updates_only_the_policy() -> None:
    backend = MemoryBackend()
    _, tier, _ = make(backend)
    update = TierSettings(prefetch_threshold=99, prefetch_policy="timeout")
    assert tier.attach(backend, "model-a", update, threaded=False,
                       batch_pages=4) == "policies updated"
    assert tier.settings == TierSettings(prefetch_threshold=2, prefetch_token_limit=1000,
                                         prefetch_policy="timeout")


@pytest.mark.parametrize(("changes", "argument"), [
    ({"model_identity": "model-b"}, "model_identity"),  # before: "policies updated",
    ({"threaded": True}, "threaded"),  # the change silently ignored
    ({"batch_pages": 1}, "batch_pages"),
])
def test_reattach_that_changes_more_than_the_policy_is_rejected(
        changes: dict[str, object], argument: str) -> None:
    """spec/09 9.4: a re-attach may change the prefetch policy only; another model
    identity (its pages would be hashed apart) or I/O shape is a typed error."""
    backend = MemoryBackend()
    cache, tier, _ = make(backend)
    before = snapshot(cache, tier)
    identity = tier.identity
    call = {"model_identity": "model-a", "threaded": False, "batch_pages": 4, **changes}
    with pytest.raises(StorageArgumentError) as caught:
        tier.attach(backend, call.pop("model_identity"),  # type: ignore[arg-type]
                    TierSettings(prefetch_policy="timeout"), **call)  # type: ignore[arg-type]
    assert caught.value.argument == argument
    assert snapshot(cache, tier) == before and tier.identity == identity


@pytest.mark.parametrize(("fields", "argument"), [
    ({"timeout_base": 10, "timeout_max": 9}, "timeout_max"),  # before: accepted
    ({"timeout_base": True}, "timeout_base"),
    ({"prefetch_threshold": -1}, "prefetch_threshold"),
    ({"prefetch_policy": "never"}, "prefetch_policy"),
    ({"prefetch_token_limit": 1.5}, "prefetch_token_limit"),
])
def test_invalid_tier_settings_are_typed_errors(fields: dict[str, object],
                                                argument: str) -> None:
    with pytest.raises(StorageArgumentError) as caught:
        TierSettings(**fields)  # type: ignore[arg-type]
    assert caught.value.argument == argument


@pytest.mark.parametrize(("call", "argument"), [
    (lambda t, c: t.attach("nope", "m"), "backend"),  # type: ignore[arg-type]
    (lambda t, c: t.attach(MemoryBackend(), "m"), "backend"),  # another while attached
    (lambda t, c: t.prefetch_from_storage("", KEY), "request"),
    (lambda t, c: t.prefetch_from_storage("r", (1, 2)), "key"),  # type: ignore[arg-type]
    (lambda t, c: t.prefetch_from_storage("a", KEY), "request"),  # a is ongoing
    (lambda t, c: t.prefetch_from_storage("r", KEY, "node"), "anchor"),  # type: ignore[arg-type]
    (lambda t, c: t.prefetch_from_storage("r", RadixKey((7, 7, 7, 7)), c.nodes()[0]),
     "anchor"),
    (lambda t, c: t.query_storage_hit_length(KEY, c.nodes()[0]), "anchor"),  # no host copy
    (lambda t, c: t.check_prefetch_progress(3), "request"),  # type: ignore[arg-type]
    (lambda t, c: t.terminate_prefetch(None), "request"),  # type: ignore[arg-type]
    (lambda t, c: t.release_aborted_request(""), "request"),
    (lambda t, c: TierSettings(timeout_base=-1), "timeout_base"),
    (lambda t, c: TierSettings(prefetch_policy="eager"), "prefetch_policy"),  # type: ignore[arg-type]
    (lambda t, c: t.backup_pages(None), "run"),  # type: ignore[arg-type]
    (lambda t, c: t.backup_pages(PageRun((1, 2), 0, 1)), "run"),  # type: ignore[arg-type]
    (lambda t, c: t.backup_pages(PageRun(RadixKey((1, 2, 3, 4)), 0, 2)), "run"),  # no host copy
    (lambda t, c: t.backup_pages(PageRun(KEY, 0, 4)), "run"),  # not cached
    (lambda t, c: t.backup_pages(PageRun(RadixKey((1, 2, 3, 4)), 0, 3)), "run"),  # past the key
    (lambda t, c: t.backup_pages(PageRun(RadixKey((1, 2, 3, 4)), 1, 1)), "run"),  # empty
    (lambda t, c: t.backup_pages(PageRun(RadixKey((1, 2, 3, 4)), True, 2)), "run"),
    (lambda t, c: t.accept(None, []), "prefetches"),  # type: ignore[arg-type]
    (lambda t, c: t.accept([], [("write", 1)]), "backups"),  # type: ignore[list-item]
    (lambda t, c: t.accept([], [BackupResult(99, 1)]), "backups"),  # no such write
    (lambda t, c: t.accept([PrefetchResult(999, 0, 0)], []), "prefetches"),  # never issued
    (lambda t, c: t.accept([PrefetchResult(0, -1, 0)], []), "prefetches"),  # malformed
    (lambda t, c: t.accept([PrefetchResult(0, 1, 0), PrefetchResult(0, 1, 0)], []),
     "prefetches"),  # one operation answered twice
])
def test_misuse_raises_a_typed_error_naming_the_argument_and_changes_nothing(
        call, argument: str) -> None:  # type: ignore[no-untyped-def]
    backend = stored_backend()
    cache, tier, _ = make(backend, write_policy="write_back")
    slots = cache.device_pool.alloc(4)
    assert slots is not None
    cache.insert(RadixKey((1, 2, 3, 4)), slots)  # device only: no host copy
    tier.prefetch_from_storage("a", RadixKey(KEY.tokens, "ns2"))
    before = snapshot(cache, tier)
    with pytest.raises(InvalidArgument) as caught:  # StorageArgumentError or ForeignNode
        call(tier, cache)
    assert caught.value.argument == argument
    assert snapshot(cache, tier) == before


def test_detached_prefetch_is_an_error_and_detach_twice_is_fine() -> None:
    cache = Scenario().build(ManualClock(1), None)
    tier = StorageTier(cache)
    with pytest.raises(StorageArgumentError):
        tier.prefetch_from_storage("r", KEY)
    tier.detach()
    assert not tier.clear()
    assert tier.query_storage_hit_length(KEY) == 0
    assert tier.check_prefetch_progress("r")


def test_backup_pages_skips_what_storage_has() -> None:
    cache, tier, _ = make(MemoryBackend())
    fill(cache, tier)
    settle(tier)
    assert not tier.backup_pages(PageRun(KEY, 0, 4))


def test_threaded_io_backs_up_and_prefetches(tmp_path: Path) -> None:
    """The same round trip with real I/O threads (polled, never waited on by the tier)."""
    deadline = time.monotonic() + 30.0  # a safety net only
    clock = ManualClock(1)
    first = Scenario(host_pages=8).build(clock, None)
    tier1 = StorageTier(first)
    tier1.attach(FileBackend(tmp_path), "model-a", SETTINGS)
    values = fill(first, tier1)
    while tier1.state.writes:
        assert time.monotonic() < deadline
        tier1.drain_storage_queues()
        time.sleep(0.001)
    tier1.detach()
    second = Scenario(host_pages=8).build(ManualClock(1), None)
    tier2 = StorageTier(second)
    tier2.attach(FileBackend(tmp_path), "model-a", TierSettings(
        prefetch_threshold=2, prefetch_token_limit=1000, prefetch_policy="wait_complete"))
    assert tier2.prefetch_from_storage("r", KEY) == 8
    while not tier2.check_prefetch_progress("r"):
        assert time.monotonic() < deadline
        time.sleep(0.001)
    (node,) = second.nodes()
    assert node.host is not None and torch.equal(second.host_pool.read(node.host), values)
    tier2.detach()
    tier2.check()


def test_a_write_back_eviction_backs_the_page_up_to_storage() -> None:
    """S-R1's second case: under write_back the host copy is made by the eviction, and
    each page copied is written to storage; after detach the cache no longer calls back."""
    backend = MemoryBackend()
    cache, tier, _ = make(backend, write_policy="write_back")
    slots = cache.device_pool.alloc(len(KEY.tokens))
    assert slots is not None
    values = torch.randn(cache.device_pool.value_shape(len(KEY.tokens)),
                         generator=torch.Generator().manual_seed(3)).to(cache.device_pool.dtype)
    cache.device_pool.write(slots, values)
    cache.insert(KEY, slots)
    assert not tier.state.writes  # write_back: no host copy yet, nothing to store
    assert cache.evict(len(KEY.tokens)) == len(KEY.tokens)
    assert len(tier.state.writes) == 4 and tier.metrics.write_pages_issued == 4
    assert all(node.host_ref for node in cache.nodes())  # protected until acknowledged
    settle(tier)
    assert not tier.state.writes and not any(node.host_ref for node in cache.nodes())
    assert tier.query_storage_hit_length(KEY) == len(KEY.tokens)
    assert backend.metrics.pages_backed_up == 4
    tier.check()
    cache.check_invariants()
    tier.detach()
    assert cache.on_write_back is None
    other = RadixKey((7, 7, 7, 7))
    more = cache.device_pool.alloc(4)
    assert more is not None
    cache.insert(other, more)
    cache.evict(4)
    assert not tier.state.writes and backend.metrics.pages_backed_up == 4


@pytest.mark.parametrize("threaded", [False, True])
def test_reset_with_storage_in_flight_stops_the_io_and_keeps_the_stored_pages(
        threaded: bool) -> None:
    """9.4 reset: a prefetch and a write in flight are dropped with the tree (neither
    moves a page afterwards), the stored pages and the id counter stay, and the tier
    works again on the new tree."""
    backend = ControlledBackend(MemoryBackend())
    cache, tier, _ = make(backend)
    fill(cache, tier)
    settle(tier)  # KEY is stored
    other = RadixKey((5, 6, 5, 6))
    if threaded:
        tier.detach()
        assert tier.attach(backend, "model-a", SETTINGS, threaded=True) == "attached"
        backend.inject("set", "slow")  # the write waits at its first page
    cache.evict(len(KEY.tokens))
    cache.evict_host(len(KEY.tokens))
    fill(cache, tier, other, seed=1)  # a write of ``other`` is in flight
    assert tier.prefetch_from_storage("r", KEY) == len(KEY.tokens)
    assert tier.state.prefetches and tier.state.writes
    if threaded:
        assert backend.wait_held(1)
        backend.release()  # the held page goes on; reset then waits for the thread
    next_id = tier.state.next_id
    cache.reset()
    assert not tier.state.prefetches and not tier.state.writes
    assert not tier.state.release_queue and not tier.state.loaded_tokens
    assert tier.state.next_id == next_id and tier.attached
    assert free_host(cache) == cache.host_pool.num_slots
    assert tier.query_storage_hit_length(KEY) == len(KEY.tokens)  # still stored
    if not threaded:
        assert tier.query_storage_hit_length(other) == 0  # its write never ran
    tier.check()
    cache.check_invariants()
    io = tier.io
    assert io is not None and not io.closed
    if threaded:
        assert all(thread.is_alive() for thread in io.threads)
        tier.detach()
        return
    assert tier.prefetch_from_storage("r", KEY) == len(KEY.tokens)
    assert io.run_pending() == 1
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == len(KEY.tokens)
    assert cache.match_prefix(KEY).host_hit_length == len(KEY.tokens)
    tier.drain_storage_queues()
    tier.check()
    cache.check_invariants()


# -- which clock counts timeouts (spec/09 9.1) ----------------------------------------------


class FakeNanoseconds:
    """A monotonic nanosecond source the test moves."""

    def __init__(self) -> None:
        self.value = 5_000_000_000

    def __call__(self) -> int:
        return self.value


def test_monotonic_clock_counts_milliseconds_since_it_was_made_and_never_goes_back() -> None:
    source = FakeNanoseconds()
    clock = MonotonicClock(source=source)
    assert clock.now() == 0
    source.value += 1_999_999
    assert clock.now() == 1
    source.value += 1
    assert clock.now() == 2
    source.value -= 10_000_000  # a broken source steps back: ticks do not
    assert clock.now() == 2
    assert MonotonicClock(ticks_per_second=1).now() == 0
    real = MonotonicClock()
    first = real.now()
    assert real.now() >= first >= 0


@pytest.mark.parametrize(("make", "argument"), [
    (lambda: MonotonicClock(ticks_per_second=0), "ticks_per_second"),
    (lambda: MonotonicClock(ticks_per_second=True), "ticks_per_second"),
    (lambda: MonotonicClock(source=5), "source"),  # type: ignore[arg-type]
    (lambda: MonotonicClock(source=lambda: 1.5), "source"),  # type: ignore[arg-type, return-value]
    (lambda: ManualClock(-1), "tick"),
    (lambda: ManualClock().advance(-1), "ticks"),
    (lambda: StorageTier(Scenario().build(ManualClock(1), None), timeout_clock=3),  # type: ignore[arg-type]
     "timeout_clock"),
])
def test_bad_clock_arguments_are_typed_errors(make: object, argument: str) -> None:
    with pytest.raises(InvalidArgument) as caught:
        make()  # type: ignore[operator]
    assert caught.value.argument == argument


def test_the_default_timeout_clock_is_logical_in_tests_and_wall_time_for_engines() -> None:
    manual = ManualClock(1)
    assert StorageTier(Scenario().build(manual, None)).timeout_clock is manual
    engine = Scenario().build(CountingClock(), None)  # type: ignore[arg-type]
    assert isinstance(StorageTier(engine).timeout_clock, MonotonicClock)


def test_a_timeout_counts_the_wall_clock_not_the_caches_ticks() -> None:
    """Before, timeouts counted the cache's clock, which for an engine (CountingClock)
    counts operations: a prefetch timed out after so many calls, whatever the time."""
    source = FakeNanoseconds()
    backend = ControlledBackend(MemoryBackend())
    cache = Scenario(host_pages=8, device_pages=6).build(CountingClock(), None)  # type: ignore[arg-type]
    tier = StorageTier(cache, timeout_clock=MonotonicClock(source=source))
    settings = TierSettings(prefetch_threshold=2, prefetch_token_limit=1000,
                            prefetch_policy="timeout", timeout_base=100,
                            timeout_per_ki_token=0, timeout_max=100)
    tier.attach(backend, "model-a", settings, threaded=False)
    fill(cache, tier)
    settle(tier)
    cache.evict(len(KEY.tokens))
    cache.evict_host(len(KEY.tokens))
    assert tier.prefetch_from_storage("r", KEY) == len(KEY.tokens)  # never run: no progress
    for _ in range(50):  # many operations, no time: no timeout
        assert not tier.check_prefetch_progress("r")
    source.value += 100_000_000  # 100 ms: at the limit, not past it
    assert not tier.check_prefetch_progress("r")
    source.value += 1_000_000
    assert tier.check_prefetch_progress("r") and tier.metrics.prefetch_timeouts == 1
    settle(tier)
    tier.check()
    cache.check_invariants()
