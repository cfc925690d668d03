"""Faults of every kind, on every thread (#17): RuntimeError, OSError, MemoryError and a
BaseException that is not an Exception, injected into every backend call the storage tier
makes (the I/O's hit query, its fetch and its write; the scheduler's own hit query and
its "already stored?" check), with the synchronous I/O and the threaded one. After each,
every host slot is in exactly one place, every protection is released once the queues
are drained, and detach leaves nothing behind (spec/09, DEV-S13; INV-RELEASE-ONCE,
INV-HOST-PROTECT-HOLDERS).

Expected outcomes, per the contracts of backend.py and io.py: an ``Exception`` at page k
of a batch is a ``StorageError`` after k leading pages (a prefetch inserts k pages, a
backup stores k); an interrupt is reported with the pages of the batches finished before
it (0 here: one batch), and reaches the caller of ``run_pending`` or ends the I/O thread.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest
import torch
from test_storage_threads import conserved, settle

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.scenario import Scenario
from hiradix.keys import RadixKey
from hiradix.storage import (
    ControlledBackend,
    Fault,
    InjectedInterrupt,
    MemoryBackend,
    StorageBackend,
)
from hiradix.storage.controlled import FOREIGN
from hiradix.storage.tier import StorageTier, TierSettings

P = 2
PAGES = 4
KEY = RadixKey(tuple(range(1, 1 + PAGES * P)))
SETTINGS = TierSettings(prefetch_threshold=P, prefetch_token_limit=1000)
KINDS = ["runtime_error", "os_error", "memory_error", "interrupt"]
WAIT_S = 30.0  # a safety net only

pytestmark = pytest.mark.filterwarnings(
    "ignore::pytest.PytestUnhandledThreadExceptionWarning")  # an interrupt ends a thread


class CheckFails(MemoryBackend):
    """A backend whose page check (``has_page``) raises ``error`` while ``armed``."""

    def __init__(self, error: type[BaseException]) -> None:
        super().__init__()
        self.error = error
        self.armed = False

    def has_page(self, page_hash: str) -> bool:
        if self.armed:
            raise self.error("injected into has_page")
        return super().has_page(page_hash)


def build(backend: StorageBackend, threaded: bool) -> tuple[HiRadixCache, StorageTier]:
    cache = Scenario(host_pages=8, device_pages=6).build(ManualClock(1), None)
    tier = StorageTier(cache)
    assert tier.attach(backend, "model-a", SETTINGS, threaded=threaded,
                       batch_pages=PAGES) == "attached"
    return cache, tier


def run_io(tier: StorageTier, kind: str) -> None:
    """Let the I/O do what is queued: ``run_pending`` (which re-raises an interrupt), or
    wait for the threads' results. Then drain."""
    io = tier.io
    assert io is not None
    if not io.threaded:
        try:
            io.run_pending()
        except InjectedInterrupt:
            assert kind == "interrupt"
    settle(tier)


def insert(cache: HiRadixCache, tier: StorageTier) -> None:
    """KEY into the tree with its host copy landed; the tier backs it up."""
    slots = cache.device_pool.alloc(len(KEY.tokens))
    assert slots is not None
    values = torch.randn(cache.device_pool.value_shape(len(KEY.tokens)),
                         generator=torch.Generator().manual_seed(1))
    cache.device_pool.write(slots, values.to(cache.device_pool.dtype))
    cache.insert(KEY, slots)
    cache.engine.complete("d2h", cache.engine.queued("d2h"))  # type: ignore[attr-defined]
    tier.writing_check()


def stored_only(backend: ControlledBackend, threaded: bool
                ) -> tuple[HiRadixCache, StorageTier]:
    """A tier whose storage holds KEY, which is no longer in the tree."""
    cache, tier = build(backend, threaded)
    insert(cache, tier)
    run_io(tier, "")
    cache.evict(len(KEY.tokens))
    cache.evict_host(len(KEY.tokens))
    assert not cache.nodes() and tier.query_storage_hit_length(KEY) == len(KEY.tokens)
    return cache, tier


def finish(cache: HiRadixCache, tier: StorageTier) -> None:
    """Everything conserved and unprotected now, and again after detach."""
    conserved(cache, tier)
    assert not any(node.host_ref for node in cache.nodes()), "a protection was left"
    tier.detach()
    conserved(cache, tier)
    assert not any(node.host_ref for node in cache.nodes())
    cache.check_invariants()


@pytest.fixture(params=[False, True], ids=["sync", "threaded"])
def threaded(request: pytest.FixtureRequest) -> Iterator[bool]:
    yield request.param


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("operation", ["exists", "get"])
@pytest.mark.parametrize("at_page", [0, 2])
def test_a_fault_on_the_prefetch_path_releases_every_slot(kind: str, operation: str,
                                                         at_page: int,
                                                         threaded: bool) -> None:
    backend = ControlledBackend(MemoryBackend())
    cache, tier = stored_only(backend, threaded)
    backend.inject(operation, Fault(kind, at_page))  # type: ignore[arg-type]
    assert tier.prefetch_from_storage("r", KEY) == len(KEY.tokens)
    run_io(tier, kind)
    conserved(cache, tier)
    assert tier.check_prefetch_progress("r")  # best_effort: ends with what landed
    landed = at_page if operation == "get" and kind != "interrupt" else 0
    assert tier.pop_prefetch_loaded_tokens("r") == P * landed
    assert tier.metrics.prefetch_errors == 1
    settle(tier)
    assert cache.match_prefix(KEY).host_hit_length == P * landed
    finish(cache, tier)


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("at_page", [0, 2])
def test_a_fault_on_the_backup_path_releases_every_protection(kind: str, at_page: int,
                                                              threaded: bool) -> None:
    backend = ControlledBackend(MemoryBackend())
    cache, tier = build(backend, threaded)
    backend.inject("set", Fault(kind, at_page))  # type: ignore[arg-type]
    insert(cache, tier)
    assert tier.state.writes and all(node.host_ref for node in cache.nodes())
    run_io(tier, kind)
    assert not tier.state.writes, "the failed write was not released"
    assert tier.metrics.write_errors == 1
    # The pages before the fault were stored (an interrupt reports none of them).
    assert backend.exists(tier._hashes(KEY, tier.identity)) == at_page  # type: ignore[arg-type]
    finish(cache, tier)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_the_schedulers_hit_query_answers_0_or_interrupts(
        kind: str, threaded: bool) -> None:
    """``query_storage_hit_length`` runs on the scheduler's thread: an Exception answers
    0 (before: only a StorageError did; an OSError or MemoryError escaped), an interrupt
    reaches the caller; the tier is unchanged either way."""
    backend = ControlledBackend(MemoryBackend())
    cache, tier = stored_only(backend, threaded)
    backend.inject("exists", Fault(kind, 1))  # type: ignore[arg-type]
    if kind == "interrupt":
        with pytest.raises(InjectedInterrupt):
            tier.query_storage_hit_length(KEY)
    else:
        assert tier.query_storage_hit_length(KEY) == 0
        assert tier.metrics.hit_query_errors == 1
    assert tier.query_storage_hit_length(KEY) == len(KEY.tokens)  # one fault, one call
    finish(cache, tier)


@pytest.mark.parametrize("kind", KINDS)
def test_a_fault_in_the_stored_check_of_a_backup_still_releases(kind: str,
                                                                threaded: bool) -> None:
    """``backup_pages`` asks the backend which pages it lacks, on the scheduler's thread.
    An Exception there counts as lacking (the write is issued; the I/O's write fails
    the same way and its protection is released when drained). An interrupt reaches the
    caller before the write is issued, so nothing is protected."""
    backend = CheckFails(FOREIGN[kind])  # type: ignore[index]
    cache, tier = build(backend, threaded)
    backend.armed = True
    if kind == "interrupt":
        with pytest.raises(InjectedInterrupt):
            insert(cache, tier)
        assert not tier.state.writes
    else:
        insert(cache, tier)
        assert tier.metrics.stored_check_errors == PAGES and tier.state.writes
        run_io(tier, kind)
        assert not tier.state.writes and tier.metrics.write_errors == 1
    backend.armed = False
    assert backend.exists(tier._hashes(KEY, tier.identity)) == 0  # type: ignore[arg-type]
    finish(cache, tier)


def test_the_tier_works_again_after_an_io_thread_died() -> None:
    """An interrupt ends the prefetch thread; a later prefetch fails at once (revoked,
    its slots released), and a detach and re-attach start a live I/O again."""
    backend = ControlledBackend(MemoryBackend())
    cache, tier = stored_only(backend, True)
    backend.inject("get", Fault("interrupt", 0))
    assert tier.prefetch_from_storage("r", KEY)
    run_io(tier, "interrupt")
    assert tier.check_prefetch_progress("r")
    io = tier.io
    assert io is not None
    deadline = time.monotonic() + WAIT_S
    while io.dead("prefetch") is None:
        assert time.monotonic() < deadline
        time.sleep(0.001)
    assert tier.prefetch_from_storage("s", KEY)
    settle(tier)
    assert tier.check_prefetch_progress("s") and tier.pop_prefetch_loaded_tokens("s") == 0
    settle(tier)
    conserved(cache, tier)
    tier.detach()
    assert tier.attach(backend, "model-a", SETTINGS, threaded=True) == "attached"
    assert tier.prefetch_from_storage("t", KEY)
    settle(tier)
    assert tier.check_prefetch_progress("t")
    assert tier.pop_prefetch_loaded_tokens("t") == len(KEY.tokens)
    finish(cache, tier)
