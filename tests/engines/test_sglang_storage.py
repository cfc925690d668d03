"""SGLang 0.5.20's storage tier (HiRadixCache + HiCacheFile) against the model (spec/09).

Runs under ``.venv-sglang`` (``make sglang-env``), e.g.
``HIRADIX_PROFILE=ci .venv-sglang/bin/python -m pytest -q tests/engines/test_sglang_storage.py``.
Skipped where SGLang 0.5.20 is not installed; an installed SGLang the adapter cannot
drive fails (``engine_env.require``).

Besides the campaign: one reproducer per divergence found (spec/09, DEV-S16 to DEV-S18,
and DEV-S9 still present in 0.5.20), and for each check of the storage comparison a
planted fault (monkeypatched into SGLang for one test) that the check reports.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix_model import Key, StorageSettings, ops

from engine_env import require

ENGINE = "sglang-storage"


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    return require(ENGINE)


def machine_class(scenario: Scenario, tally: Tally | None = None) -> Any:
    from hiradix.engines.sglang.storage_machine import make_machine
    return make_machine(ENGINE, scenario, tally)


@pytest.fixture
def state() -> Iterator[Any]:
    """A fresh machine (page size 1, write_through, lru), storage attached, best_effort."""
    machine = machine_class(Scenario(page_size=1))()
    machine.engine_refines_the_model()
    yield machine
    machine.teardown()


def round_trip(state: Any, tokens: tuple[int, ...], run: bool) -> None:
    """Serve ``tokens``, back them up to storage, evict them, prefetch them back (r0)."""
    state.cycle(request="r0", index=0, fresh=(tokens, None), evict=24, run=run, dt=0)
    state.engine_refines_the_model()


SCENARIOS = [Scenario(page_size=ps, write_policy=policy, eviction=strategy)  # type: ignore[arg-type]
             for ps, policy, strategy in zip(
                 (1, 2, 4, 1, 2, 4),
                 ("write_through", "write_through_selective") * 3,
                 ("lru", "lfu", "fifo", "slru", "mru", "filo"), strict=True)]


def bounded() -> settings:
    """A few examples per scenario: each step drives SGLang and files on disk."""
    current = settings()
    return settings(current, max_examples=max(1, current.max_examples // 40),
                    stateful_step_count=min(current.stateful_step_count, 40))


@pytest.mark.parametrize("scenario", SCENARIOS, ids=lambda s: s.slug())
def test_storage_tier_refines_the_model(scenario: Scenario) -> None:
    run_state_machine_as_test(machine_class(scenario), settings=bounded())


def test_the_campaign_reaches_prefetch_fetch_backup_and_detach() -> None:
    """A run that never fetches, backs up, polls, aborts or detaches would pass vacuously.
    A fixed set of examples (derandomized, its size and length given here): what a reach
    test finds must not depend on the draw (test_sglang_unified_storage's, random, once
    missed the prefetch I/O; 74bb6f4)."""
    tally = Tally()
    run_state_machine_as_test(machine_class(Scenario(page_size=1), tally),
                              settings=settings(max_examples=100, stateful_step_count=40,
                                                derandomize=True))
    for op in ("prefetch_from_storage", "io_prefetch_query", "io_prefetch_fetch",
               "check_prefetch_progress", "io_storage_write", "drain_storage_queues",
               "detach_storage", "attach_storage"):
        assert tally.ops[op] > 0, (op, dict(tally.ops))


def test_a_round_trip_through_storage_agrees(state: Any) -> None:
    round_trip(state, (1, 2, 3), run=True)
    assert state.model.storage.loaded_tokens == {"r0": 3}
    assert state.engine.pop_prefetch_loaded_tokens("r0") == 3


# -- divergences: each a reproducer (spec/09 9.8) ----------------------------------------

def test_dev_s18_detach_leaks_the_slots_of_a_prefetch_ended_before_its_transfer(
        state: Any) -> None:
    """DEV-S18: best_effort ends the prefetch before its transfer ran; the slots past
    the (zero) landed pages wait for the transfer's completion ack, which a detach never
    drains: SGLang never frees them."""
    round_trip(state, (1, 2, 3), run=False)  # polled (best_effort) before any transfer
    assert not state.engine.cache.ongoing_prefetch and state.engine.ended_transfers_queued()
    # What the detach rule steers around: both sides detach with the transfer queued.
    state.engine.detach()
    state.sstep("detach_storage", ops.detach_storage)
    with pytest.raises(AssertionError, match="host_free"):
        state.engine_refines_the_model()
    assert len(state.engine.host_free_list()) == state.model.config.host_slots - 3


def test_dev_s16_a_child_of_a_page_cached_while_detached_is_stored_under_its_own_tokens(
        state: Any) -> None:
    """DEV-S16: pages inserted while no backend is attached get no storage hash; a child
    inserted after attaching chains its hash from the namespace seed, so page (1..6) is
    stored as if it were page (5, 6) -- which a request starting (5, 6) would fetch."""
    state.detach(go=0, drain_first=True)
    state.request((1, 2, 3, 4), None, 0, False, 0, False)
    state.writing_check()
    state.attach(StorageSettings(prefetch_threshold=1, prefetch_token_limit=10 ** 9), 0)
    state.request((1, 2, 3, 4, 5, 6), None, 0, False, 0, False)
    state.writing_check()
    state.backup()
    stored = state.engine.stored_pages()
    state.engine.learn(Key((5, 6), None))
    assert state.engine.stored_pages() != stored  # the unknown hash is page (5, 6)'s
    assert Key((5, 6), None) in state.engine.stored_pages()
    with pytest.raises(AssertionError, match="stored pages"):
        state.engine_refines_the_model()


def test_dev_s19_a_stale_completion_ack_ends_the_next_prefetch_of_the_request(
        state: Any) -> None:
    """DEV-S19: r0's prefetch is ended (best_effort) before its transfer ran; r0
    prefetches again. The drain meets the old transfer's completion ack, finds r0 in
    ongoing_prefetch and ends the *new* prefetch with the old one's (zero) pages: the
    pages the new transfer fetched are freed, never inserted."""
    round_trip(state, (1,), run=False)  # polled (best_effort) before any transfer
    assert state.engine.ended_transfers() == ["r0"]
    state.prefetch("r0", 0, 0)  # what the prefetch rule steers around
    assert "r0" not in state.engine.cache.ongoing_prefetch  # declined: issued by hand
    key, ps = state.seen[0], state.model.config.page_size
    anchor, node, matched = state.anchor_and_tokens(key)
    hits, allocated = state.engine.prefetch(key, node, matched, "r0")
    assert (hits, allocated) == (1, ps)
    state.sstep("prefetch_from_storage", ops.prefetch_from_storage, "r0",
                state.prefetch_key(key, anchor, matched, hits), anchor, state.now,
                host_slots=state.engine.prefetches()["r0"].reserved)
    state.sstep("io_prefetch_query", ops.io_prefetch_query, "r0", 1)
    state.engine_refines_the_model()
    state.engine.pump_fetch()
    state.engine.drain()
    assert not state.engine.cache.ongoing_prefetch  # ended by the stale ack
    assert key not in {state.engine._prefix(n) for n in state.engine._nodes()}
    assert state.engine.loaded_tokens() == {"r0": 0}


def test_dev_s17_a_prefetch_under_the_root_inherits_the_root_priority(state: Any) -> None:
    """DEV-S17: SGLang gives a chain fetched under the root the root's priority."""
    round_trip(state, (1, 2), run=True)
    cache = state.engine.cache
    (node,) = cache.root_node.children.values()
    assert node.value is None and node.priority == cache.root_node.priority < 0


def test_dev_s9_reset_keeps_an_ongoing_prefetch(state: Any) -> None:
    """DEV-S9 (still in 0.5.20): reset() drops the tree and the host pool, but the
    prefetch entry, its anchor and its host slots stay in ongoing_prefetch."""
    state.request((1, 2, 3), None, 0, False, 0, False)
    state.writing_check()
    state.backup()
    state.drain()
    state.evict_both(24)
    state.evict_host(24)
    state.prefetch("r0", 0, 0)
    assert state.engine.cache.ongoing_prefetch
    state.engine.reset()
    assert state.engine.cache.ongoing_prefetch  # the model's reset drops it (9.4)


# -- each check can fail ------------------------------------------------------------------

def test_a_prefetch_slot_leak_is_caught(state: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """The fetched slots of pages cached meanwhile are never freed (S-R4 step 1)."""
    cache = state.engine.cache
    host_class = type(cache.token_to_kv_pool_host)
    original_free, original_handle = host_class.free, cache._handle_prefetch_result

    def handle(operation: Any) -> None:
        monkeypatch.setattr(host_class, "free", lambda self, indices: 0)
        try:
            original_handle(operation)
        finally:
            monkeypatch.setattr(host_class, "free", original_free)

    monkeypatch.setattr(cache, "_handle_prefetch_result", handle)
    round_trip(state, (1, 2, 3), run=False)  # polled before any transfer: nothing lands
    state.abort("r0")
    state.prefetch("r1", 0, 0)  # again, and (1, 2, 3) is computed again meanwhile
    state.request((1, 2, 3), None, 0, False, 0, False)
    state.writing_check()
    with pytest.raises(AssertionError, match=r"host_free|host slots held"):
        state.drain()
        state.engine_refines_the_model()


def test_an_anchor_protection_never_released_is_caught(state: Any,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefetch revoked for want of hits keeps its anchor protected."""
    cache = state.engine.cache
    monkeypatch.setattr(cache, "_revoke_pending_prefetch",
                        lambda req_id: cache.ongoing_prefetch.pop(req_id, None))
    state.request((1, 2, 3), None, 0, False, 0, False)
    state.request((1, 2, 3, 4), None, 0, False, 0, False)
    state.writing_check()
    state.backup()
    state.drain()  # the backups release their protection
    state.clear(15)  # storage holds nothing
    state.evict_both(1)  # page (1, 2, 3, 4) leaves the device
    state.evict_host(1)  # and the host
    with pytest.raises(AssertionError, match=r"host_protect|occupied"):
        state.prefetch("r0", 1, 0)  # anchor (1, 2, 3), no hit: revoked
        state.engine_refines_the_model()


def test_a_page_never_written_to_storage_is_caught(state: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    backend = type(state.engine.controller.storage_backend)
    monkeypatch.setattr(backend, "set", lambda self, key, value=None, *a, **k: True)
    state.request((1, 2), None, 0, False, 0, False)
    state.writing_check()
    state.backup()
    with pytest.raises(AssertionError, match="stored pages"):
        state.engine_refines_the_model()


def test_occupied_tokens_never_given_back_are_caught(state: Any,
                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    cache = state.engine.cache
    original = cache._handle_prefetch_result

    def handle(operation: Any) -> None:
        original(operation)
        cache.cache_controller.prefetch_tokens_occupied += 1

    monkeypatch.setattr(cache, "_handle_prefetch_result", handle)
    with pytest.raises(AssertionError, match="prefetch_tokens_occupied"):
        round_trip(state, (1, 2, 3), run=True)


def test_a_double_free_of_prefetch_slots_is_caught(state: Any,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """A fetched slot freed though the tree keeps it (SGLang's host pool may assert on
    a double free itself; either that or the comparison reports it)."""
    cache = state.engine.cache
    original = cache._handle_prefetch_result

    def handle(operation: Any) -> None:
        original(operation)
        cache.cache_controller.mem_pool_host.free(operation.host_indices[:1])

    monkeypatch.setattr(cache, "_handle_prefetch_result", handle)
    with pytest.raises(AssertionError, match=r"(?i)double-free|host_free|host"):
        round_trip(state, (1, 2, 3), run=True)


def stored_then_forgotten(state: Any) -> None:
    """Serve (1, 2), store it, then evict it from both tiers: storage holds (1), (1, 2)."""
    state.request((1, 2), None, 0, False, 0, False)
    state.writing_check()
    state.backup()
    state.drain()
    state.evict_both(24)
    state.evict_host(24)
    state.engine_refines_the_model()
    assert not state.model.pages and state.engine.stored_pages() == {
        Key((1,), None), Key((1, 2), None)}


def test_dev_s20_a_backup_queued_across_a_clear_rewrites_pages_stored_at_issue(
        state: Any) -> None:
    """DEV-S20: (1, 2, 3) is computed again; SGLang's backup covers the whole node, the
    spec's write only (1, 2, 3), which storage lacked at issue. A clear before the
    backup runs: SGLang stores all three pages again, the spec one."""
    stored_then_forgotten(state)
    state.request((1, 2, 3), None, 0, False, 0, False)
    state.writing_check()
    assert [w.pages for w in state.model.storage.writes] == [(Key((1, 2, 3), None),)]
    # What the clear rule steers around: both sides clear with the backup queued.
    assert state.engine.clear() == state.sstep("clear_storage", ops.clear_storage)
    state.backup()
    state.engine.learn(Key((1, 2, 3), None))
    assert state.engine.stored_pages() == {Key((1,), None), Key((1, 2), None),
                                           Key((1, 2, 3), None)}
    with pytest.raises(AssertionError, match=r"stored pages: only SGLang \[Key\(tokens=\(1, 2\).*"
                                                r"Key\(tokens=\(1,\).*only model \[\]"):
        state.engine_refines_the_model()


def test_the_clear_rule_runs_queued_backups_first(state: Any) -> None:
    stored_then_forgotten(state)
    state.request((1, 2, 3), None, 0, False, 0, False)
    state.writing_check()
    state.clear(15)
    state.engine_refines_the_model()
    assert state.counts.ops["clear after the queued backups ran (DEV-S20)"] == 1
    assert not state.engine.stored_pages()


def prefetch_over_a_device_only_page(state: Any) -> None:
    """r0 prefetches (1, 2) from the root; meanwhile a chunked request (no backup)
    caches (1,) on device only."""
    stored_then_forgotten(state)
    state.prefetch("r0", 0, 0)
    assert "r0" in state.engine.cache.ongoing_prefetch
    state.request((1, 3), None, 0, True, 0, False)
    state.engine_refines_the_model()
    assert state.model.pages[Key((1,), None)].host is None
    assert state.hung_below_device_only() == ["r0"]


def test_dev_s5_sglang_hangs_fetched_pages_below_a_device_only_page(state: Any) -> None:
    """DEV-S5: the drain that meets r0's finished transfer walks through the device-only
    (1,) and hangs (1, 2) below it as a host-only node; the spec stops at (1,)."""
    prefetch_over_a_device_only_page(state)
    state.engine.pump_fetch()
    state.engine.drain()  # what the drain rule steers around
    (node,) = [n for n in state.engine._nodes()
               if state.engine._prefix(n) == Key((1, 2), None)]
    assert node.value is None and node.host_value is not None
    assert node.parent.host_value is None  # below a page with no host copy


def test_the_drain_rule_aborts_a_prefetch_that_would_hang_below_a_device_only_page(
        state: Any) -> None:
    prefetch_over_a_device_only_page(state)
    state.drain()
    state.engine_refines_the_model()
    assert not state.engine.cache.ongoing_prefetch
    assert Key((1, 2), None) not in state.model.pages
