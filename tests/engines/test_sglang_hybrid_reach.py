"""The hybrid machines reach SGLang 0.5.23's request-level cache paths (issue #28).

SGLang's scheduler never calls ``insert`` for a request: it publishes each prefill chunk
with ``checkpoint`` (common.py:278), slides a decoding request's window with
``evict_sliding_windows`` (allocation.py:633 ``maybe_evict_swa``), and releases a request
with ``release_kv_cache`` -- with a last checkpoint when it finishes (common.py:431), without
one when it is aborted (scheduler.py:3819) or retracted (schedule_batch.py:2389). The
hybrid machine drives those calls through ``ScheduledSwaEngine`` beside its older rules;
these tests show the campaigns reach them, that the machine's judgement of each holds on
SGLang as shipped, and that each new observation fails on a bug planted in a private copy.

Runs under ``.venv-sglang23``; skipped or failed as tests/engines/test_sglang_swa.py is.
"""

from __future__ import annotations

import importlib
import math
import re
from collections import Counter
from collections.abc import Callable
from typing import Any

import pytest
from hybrid_support import seeded_failure

from hiradix.conformance.hybrid.campaign import run_campaign
from hiradix.conformance.hybrid.machine import Build, make_swa_machine
from hiradix.conformance.mamba import campaign as mamba_campaign
from hiradix.conformance.mamba.machine import make_mamba_machine
from hiradix.engines.sglang import mamba
from hiradix.engines.sglang.swa import build, build_hicache
from hiradix_model.hybrid import SwaConfig
from hiradix_model.mamba import MambaConfig

from engine_env import require

ENGINE = "sglang-swa"
# What a seeded campaign of 200 examples reaches on the request-level rules: a floor
# well under what it counted when this test was written (chunks 155, chunk_tombstones 14,
# aborted_in_prefill 80, retracted 7, finished_requests 42, healed 11, window_slides 6).
REACH_FLOORS = {"chunks": 50, "chunk_tombstones": 4, "aborted_in_prefill": 25,
                "retracted": 2, "finished_requests": 14, "healed": 3, "window_slides": 2}


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


def campaign(build_with: Build, examples: int) -> Counter[str]:
    """A seeded campaign of ``examples`` examples over P in 1, 2, 4; what it reached.
    Fails with the shrunk example on a divergence."""
    result = run_campaign(ENGINE, build_with, [1, 2, 4], until=math.inf, examples=examples,
                          seeded=0)
    assert result.failure is None, result.failure
    return result.reached


def test_the_campaign_reaches_chunked_prefill_abort_retraction_and_finish() -> None:
    reached = campaign(build, 200)
    short = {name: reached[name] for name, floor in REACH_FLOORS.items()
             if reached[name] < floor}
    assert not short, f"reached only {short} of {REACH_FLOORS}"


def test_the_write_back_campaign_reaches_them_with_a_host_tier() -> None:
    reached = campaign(build_hicache("write_back"), 60)
    assert reached["chunks"] > 0 and reached["aborted_in_prefill"] > 0, reached
    assert reached["finished_requests"] > 0, reached


CONFIG = SwaConfig(page_size=2, full_slots=40, swa_slots=20, window=3)


def chunked_then_dropped(reached: Counter[str]) -> None:
    """A 10-token prompt prefilled in chunks of 8 and 2 (the first past the window, so
    its checkpoint frees SWA halves and inserts tombstones); a second request sharing its
    first two pages, which checkpoints one chunk, computes another and is aborted before
    publishing it; then the first decodes seven tokens past its window and finishes
    (its last, partial page freed, not inserted)."""
    machine = make_swa_machine(build, CONFIG, reached)()
    try:
        machine.admit((1, 2, 3, 1, 2, 3, 1, 2, 3, 1), (2,) * 7)
        first = machine.scheduled[0]
        for end in (8, 10):
            assert machine.grow(first, end)
            machine.publish(first, finish=False)
        machine.admit((1, 2, 3, 1, 3, 3, 3, 3), ())
        second = machine.scheduled[1]
        assert machine.grow(second, 4)
        machine.publish(second, finish=False)
        assert machine.grow(second, 7)
        machine.drop(1, "aborted")
        for _ in range(7):
            machine.slide(first, first.end)
            assert machine.grow(first, first.end + 1)
        machine.publish(machine.scheduled.pop(0), finish=True)
    finally:
        machine.teardown()


def test_a_chunked_request_its_abort_and_its_finish_refine_the_model() -> None:
    reached: Counter[str] = Counter()
    chunked_then_dropped(reached)
    assert reached["chunk_tombstones"] == 1 and reached["aborted"] == 1, reached
    assert reached["window_slides"] >= 1 and reached["finished_requests"] == 1, reached
    assert reached["healed"] == 1, reached  # the second prompt heals the first's tombstone


def sglang(module: str) -> Any:
    return importlib.import_module(f"sglang.srt.mem_cache.{module}")


def insert_told_the_old_cursor(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint's out-of-window free frees the SWA halves but the insert is told the
    cursor from before it (the SWA boundary of an unfinished request lost)."""
    swa = sglang("unified_cache.components.swa").SWAComponent
    original = swa.free_out_of_window_slots

    def free_out_of_window_slots(self: Any, req: Any, pre_len: int, params: Any) -> None:
        cursor = req.kv.get_evicted_seqlen(self.component_type)
        original(self, req, pre_len, params)
        params.set_evicted_seqlen(self.component_type, cursor)

    monkeypatch.setattr(swa, "free_out_of_window_slots", free_out_of_window_slots)


def protected_len_not_advanced(monkeypatch: pytest.MonkeyPatch) -> None:
    """A checkpoint moves the request's lock but leaves ``cache_protected_len`` where it
    was: a later release would free slots the tree owns."""
    cache = sglang("unified_radix_cache").UnifiedRadixCache
    original = cache.checkpoint_into_tree

    def checkpoint_into_tree(self: Any, req: Any, *, up_to: int, **kwargs: Any) -> None:
        protected = req.kv.cache_protected_len
        original(self, req, up_to=up_to, **kwargs)
        req.kv.cache_protected_len = protected

    monkeypatch.setattr(cache, "checkpoint_into_tree", checkpoint_into_tree)


def release_keeps_the_swa_halves(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releasing a request's row frees every pair as if its SWA half were gone already:
    the SWA halves of the live pairs leak."""
    base = sglang("base_prefix_cache").BasePrefixCache
    common = sglang("common")

    def free_kv_row(self: Any, kv: Any, ranges: list[tuple[int, int]]) -> None:
        row = self.req_to_token_pool.req_to_token[kv.req_pool_idx]
        self.token_to_kv_pool_allocator.free_full_segments(
            [(row[start:end], start) for start, end in common.coalesce_ranges(ranges)])

    monkeypatch.setattr(base, "free_kv_row", free_kv_row)


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "insert told the old cursor": (insert_told_the_old_cursor, r"swa_free: model"),
    "protected length not advanced": (protected_len_not_advanced, r"protected 0"),
    "release keeps the SWA halves": (release_keeps_the_swa_halves,
                                     r"(?s)release\(.*checkpoint=False.*swa pool balance"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_a_request_path_fails_the_machine(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, expected = PLANTED[name]
    plant(monkeypatch)
    with pytest.raises(AssertionError, match=expected):
        chunked_then_dropped(Counter())


def test_the_machine_finds_a_lost_swa_boundary_by_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not scripted: the machine's own search meets the planted bug (unshrunk, to keep
    the test short; ``hiradix check`` shrinks). Up to 12 seeded batches: which of them
    meet it moves with what ran before in the process (SGLang's node ids are global, and
    break its LRU ties), and with the machine's rules (the load-back rule's arrival left
    the first four batches without it after the engine tests before this one; alone, 7
    of the first 12 meet it, each in about a second)."""
    insert_told_the_old_cursor(monkeypatch)
    config = SwaConfig(page_size=2, full_slots=20, swa_slots=10, window=3)
    found = seeded_failure(make_swa_machine(build, config), batches=12)
    assert re.search(r"(?s)after checkpoint\(.*swa_free: model", found), found or "not found"


# -- (FULL, MAMBA): the same paths, where a checkpoint offers the tree a state -----------

MAMBA_CONFIG = MambaConfig(page_size=1, full_slots=20, state_slots=6)
# As REACH_FLOORS, for 150 examples at page size 1 (counted: chunks 63, states_published
# 67, states_already_cached 26, admitted_on_a_copy 31, aborted_in_prefill 50,
# finished_requests 30).
MAMBA_FLOORS = {"chunks": 20, "states_published": 20, "states_already_cached": 8,
                "admitted_on_a_copy": 10, "aborted_in_prefill": 15, "finished_requests": 10}


def test_the_mamba_campaign_reaches_chunked_prefill_copies_abort_and_finish() -> None:
    result = mamba_campaign.run_campaign("sglang-mamba", mamba.build, [1], until=math.inf,
                                         examples=150, seeded=0)
    assert result.failure is None, result.failure
    short = {name: result.reached[name] for name, floor in MAMBA_FLOORS.items()
             if result.reached[name] < floor}
    assert not short, f"reached only {short} of {MAMBA_FLOORS}"


def branched_then_dropped(reached: Counter[str]) -> None:
    """A 5-token prompt prefilled in chunks of 3 and 2 (each publishing a copy of its
    state); a second request branching off the first's state at 3 (its state a copy),
    publishing a chunk and aborted after computing another; the first decodes two tokens
    and finishes (the tree takes its own state); a third request with the first's whole
    sequence as prompt matches it all and finishes at once (its state is the one cached
    there already, so the release frees it)."""
    machine = make_mamba_machine(mamba.build, MAMBA_CONFIG, reached)()
    try:
        machine.admit((1, 2, 3, 1, 2), (3, 3))
        first = machine.scheduled[0]
        for end in (3, 5):
            assert machine.grow(first, end) and machine.state_room()
            machine.publish(first, finish=False)
        machine.admit((1, 2, 3, 1), (2, 2))
        second = machine.scheduled[1]
        assert machine.grow(second, 4) and machine.state_room()
        machine.publish(second, finish=False)
        assert machine.grow(second, 5)
        machine.drop(1, "aborted")
        for _ in range(2):
            assert machine.grow(first, first.end + 1)
        machine.publish(machine.scheduled.pop(0), finish=True)
        machine.admit((1, 2, 3, 1, 2, 3, 3), ())
        machine.publish(machine.scheduled.pop(0), finish=True)
    finally:
        machine.teardown()


def test_a_branch_its_abort_and_two_finishes_refine_the_model() -> None:
    reached: Counter[str] = Counter()
    branched_then_dropped(reached)
    assert reached["admitted_on_a_copy"] == 2 and reached["aborted"] == 1, reached
    assert reached["states_published"] == 4 and reached["states_already_cached"] == 1, reached


def mamba_component() -> Any:
    return sglang("unified_cache.components.mamba").MambaComponent


def chunk_offers_the_requests_own_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A chunk's checkpoint offers the tree the request's own state slot instead of a
    copy: the tree and the still-running request share one state (ownership lost)."""
    component = mamba_component()
    original = component.prepare_for_caching_req

    def prepare(self: Any, req: Any, insert_params: Any, token_ids_len: int,
                is_finished: bool) -> Any:
        if is_finished:
            return original(self, req, insert_params, token_ids_len, is_finished)
        insert_params.mamba_value = req.kv.mamba_pool_idx.unsqueeze(-1).clone()
        return token_ids_len

    monkeypatch.setattr(component, "prepare_for_caching_req", prepare)


def finish_keeps_an_unused_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """A finished request whose state the tree already had keeps it: a state leaks."""
    component = mamba_component()
    original = component.cleanup_after_caching_req

    def cleanup(self: Any, req: Any, is_finished: bool, insert_result: Any = None,
                insert_params: Any = None) -> None:
        if is_finished and insert_result is not None and insert_result.mamba_exist:
            return
        original(self, req, is_finished, insert_result, insert_params)

    monkeypatch.setattr(component, "cleanup_after_caching_req", cleanup)


def abort_keeps_the_requests_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """Releasing a request without a checkpoint runs no component cleanup: its state
    is never freed."""
    cache = sglang("unified_radix_cache").UnifiedRadixCache
    monkeypatch.setattr(cache, "on_release",
                        lambda self, req, *, checkpointed: None)


def admission_copies_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """A match with copy on write records no source: the request starts from a fresh
    state although its match ended on a cached one."""
    monkeypatch.setattr(mamba_component(), "finalize_match_result_in_cache",
                        lambda self, params, result: result)


MAMBA_PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "chunk offers the request's own state": (chunk_offers_the_requests_own_state,
                                             r"not a copy"),
    "finish keeps an unused state": (finish_keeps_an_unused_state,
                                     r"(?s)release\(.*state_free: model only model"),
    "abort keeps the request's state": (abort_keeps_the_requests_state,
                                        r"still holds state"),
    "admission copies nothing": (admission_copies_nothing, r"is not a copy"),
}


@pytest.mark.parametrize("name", sorted(MAMBA_PLANTED))
def test_a_bug_planted_in_a_mamba_request_path_fails_the_machine(
        name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, expected = MAMBA_PLANTED[name]
    plant(monkeypatch)
    with pytest.raises(AssertionError, match=expected):
        branched_then_dropped(Counter())


def test_the_mamba_machine_finds_a_shared_state_by_itself(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Not scripted, unshrunk (as the SWA one)."""
    chunk_offers_the_requests_own_state(monkeypatch)
    found = seeded_failure(make_mamba_machine(mamba.build, MAMBA_CONFIG))
    assert "not a copy" in found, found or "not found"


def retracted_for_room(reached: Counter[str]) -> None:
    """Three requests of five tokens, each prefilled to two and published, fill seven of
    ten full slots; the first decodes to its end, the second then finds no room (every
    cached page is a running request's) and is retracted -- ``release_kv_cache`` without
    a checkpoint, schedule_batch.py:2389 -- and admitted again on what it computed. The
    campaign's search rarely gets there (its summary says so), hence the script."""
    config = MambaConfig(page_size=1, full_slots=10, state_slots=8)
    state = make_mamba_machine(mamba.build, config, reached)()
    try:
        for prompt, tail in (((1, 2), (3, 3, 3)), ((2, 1), (1, 1, 1)), ((3, 2), (2, 2, 2))):
            state.admit(prompt, tail)
            request = state.scheduled[-1]
            assert state.grow(request, len(prompt)) and state.state_room()
            state.publish(request, finish=False)
        state.decode_steps(0, 3)
        state.decode_steps(1, 3)
    finally:
        state.teardown()


def test_a_mamba_request_short_of_room_is_retracted_and_admitted_again() -> None:
    reached: Counter[str] = Counter()
    retracted_for_room(reached)
    assert reached["retracted"] == 1 and reached["admitted"] == 4, reached
    assert reached["admitted_on_a_copy"] == 1, reached  # on its own published prefix


def test_a_retraction_that_keeps_the_requests_state_fails_the_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The planted bug of the abort path (the same release call) on the retraction."""
    abort_keeps_the_requests_state(monkeypatch)
    with pytest.raises(AssertionError, match=r"still holds state"):
        retracted_for_room(Counter())
