"""DEV-S29: UnifiedRadixCache's hit drain matches a hit result to its prefetch by request
handle, not by operation, so an ended prefetch's result revokes the request's next one
(spec/09 DEV-S29; DEV-S2 and DEV-S19 are its HiRadixCache kin).

Runs under ``.venv-sglang`` (0.5.20) and ``.venv-sglang23`` (0.5.23), e.g.
``PYTHONPATH=impl:model:tests/sglang_env .venv-sglang/bin/python -m pytest -q
tests/engines/test_sglang_unified_stale_hit.py``. Skipped where SGLang is not installed.

The calls are the scheduler's, in its order (lines of 0.5.20's ``scheduler.py``; 0.5.23's
in brackets):

1. a queued request's prefetch is issued (``_add_request_to_queue`` :3203 [3492] →
   ``_prefetch_kvcache`` :3119 [3381] → ``prefetch_from_storage``);
2. the admission loop polls it (``check_prefetch_progress`` :3901 [4241]) before the
   drain met its hit result; ``best_effort`` (0.5.20: also ``timeout``) ends it there:
   terminated, revoked, the retry book armed (``unified_radix_cache.py`` :2102-2105
   [2411-2417]);
3. the request prefetches again under the same handle: at once when its device match
   shrank meanwhile (``_prefetch_after_device_hit_loss`` :3921 → :3190 → :3162 [4262 →
   3452 → 3424]), or from the retry book (``_process_storage_prefetch_retries`` :3559 →
   :3142 → :3162 [3891 → 3404 → 3424]); ``prefetch_from_storage`` only refuses a handle
   that has an entry (:1926 [2106]);
4. the prefetch thread puts every operation on the hit queue, an ended one with no hits
   (``cache_controller.py`` :1228-1248 [1343-1366]);
5. the next pass drains the hit queue (``check_hicache_events`` :3557 [3889] →
   ``_drain_storage_control_queues_impl``), the ended operation's result first.

The campaign reaches it by itself (its issue, hit query, hit drain, poll, abort and
re-issue rules, spec/09 9.10): a bounded, derandomized campaign with the steering lifted
fails naming the revoked prefetch; with the steering (``avoid``) the same campaign goes
on, and with the drain fixed (a private copy) the unsteered one finds nothing.
"""

from __future__ import annotations

import inspect
import textwrap
from collections.abc import Iterator
from typing import Any

import pytest
from hypothesis import Phase, settings
from hypothesis.stateful import invariant, run_state_machine_as_test
from test_sglang_unified_storage import machine_class, policy, sglang_installed, stored_and_evicted

from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix_model import Key

__all__ = ["sglang_installed"]  # the autouse skip where SGLang is missing

KEY = Key((1, 2, 3), None)
# The hit drain's lookup of a result's prefetch (both versions): by handle only.
BY_HANDLE = "info = self.ongoing_prefetch.get(request)"
# The fixed copy's lookup: the entry only if it holds this operation.
BY_OPERATION = ("info = self.ongoing_prefetch.get(request); info = info if info is None "
                "or info.operation is operation else None")


@pytest.fixture(params=("best_effort", "timeout"))
def state(request: pytest.FixtureRequest, sglang_installed: str) -> Iterator[Any]:
    """A fresh machine (page size 1, write_through, lru), storage attached with the
    policy of the parameter (``timeout``: a deadline of 0 ticks), ``KEY`` on storage
    only."""
    machine = machine_class(Scenario(page_size=1))()
    try:
        machine.engine_refines_the_model()
        policy(machine, request.param, base=0)
        stored_and_evicted(machine, KEY.tokens)
        yield machine
    finally:
        machine.teardown()


def matched_by_operation(cache_class: type) -> Any:
    """A private copy of ``_drain_storage_control_queues_impl`` whose hit drain takes a
    result's entry only if the entry holds that operation, as its ack drain does
    (``info.operation is operation``). Built at run time from the installed source, one
    line changed; only the test that installs it (monkeypatch) uses it."""
    method = cache_class._drain_storage_control_queues_impl
    source = textwrap.dedent(inspect.getsource(method))
    at = source.index(BY_HANDLE,
                      source.index("for operation in _drain_queue(cc.prefetch_hit_queue"))
    fixed = source[:at] + BY_OPERATION + source[at + len(BY_HANDLE):]
    namespace: dict[str, Any] = {}
    exec(compile(fixed, inspect.getsourcefile(method) or "<fixed>", "exec"),
         dict(method.__globals__), namespace)
    return namespace["_drain_storage_control_queues_impl"]


def ended_before_its_hit_drain(state: Any) -> Any:
    """Steps 1-2: r0's first prefetch, issued and ended by a poll (one tick later: the
    ``timeout`` deadline of 0 has passed) before its hit query ran. Its operation."""
    engine = state.engine
    _, node, matched = state.anchor_and_tokens(KEY)
    first = engine.issue_prefetch(KEY, node, matched, "r0")
    assert first is not None
    state.tick(1)
    ended = engine.check_prefetch_progress("r0")
    if not ended:  # 0.5.23's timeout starts at this first waiting poll (DEV-S22)
        state.tick(1)
        ended = engine.check_prefetch_progress("r0")
    assert ended and first.is_terminated() and not engine.has_prefetch("r0")
    return first


def stale_hit_meets_the_next_prefetch(state: Any) -> Any:
    """Steps 1-5, the drain taking the first result only (the ended operation's). r0's
    second operation, its own result still queued."""
    engine = state.engine
    first = ended_before_its_hit_drain(state)
    _, node, matched = state.anchor_and_tokens(KEY)
    second = engine.issue_prefetch(KEY, node, matched, "r0")
    assert second is not None and second is not first
    engine.pump_query()
    assert list(engine.controller.prefetch_hit_queue.queue) == [first, second]
    assert first.storage_hit_count == 0 and second.storage_hit_count == len(KEY.tokens)
    engine.drain_hits(1)
    return second


def current_policy(state: Any) -> str:
    return str(state.model.storage.settings.prefetch_policy)


def skip_where_not_reissued(state: Any) -> None:
    """0.5.23 under ``timeout``: no second prefetch (the last test)."""
    if not state.engine.v20 and current_policy(state) == "timeout":
        pytest.skip("0.5.23 issues nothing for a handle past its deadline (DEV-S22): "
                    "test_dev_s29_0_5_23_timeout_issues_no_second_prefetch")


def test_dev_s29_a_stale_hit_result_revokes_the_next_prefetch(state: Any) -> None:
    """DEV-S29: the ended operation's result finds the entry of r0's new prefetch and,
    being terminated, revokes it while the new one's own result waits (its operation not
    terminated); that result then finds no entry and is dropped: the 3 stored tokens
    are never fetched, the request is admitted without them."""
    skip_where_not_reissued(state)
    engine = state.engine
    second = stale_hit_meets_the_next_prefetch(state)
    assert not engine.has_prefetch("r0") and not second.is_terminated()
    engine.drain_hits(1)
    engine.pump_fetch()
    engine.drain()
    assert engine.check_prefetch_progress("r0")
    assert second.host_indices is None and engine.loaded_tokens() == {}


def test_dev_s29_fixed_copy_keeps_the_next_prefetch(state: Any,
                                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """The observation can pass: on a private copy whose hit drain matches a result to
    its operation, the stale result is passed over and r0's new prefetch allocates its
    3 slots, fetches and lands its 3 tokens."""
    skip_where_not_reissued(state)
    engine = state.engine
    monkeypatch.setattr(type(engine.cache), "_drain_storage_control_queues_impl",
                        matched_by_operation(type(engine.cache)))
    second = stale_hit_meets_the_next_prefetch(state)
    assert engine.entry("r0").operation is second
    engine.drain_hits(1)
    assert second.host_indices is not None and len(second.host_indices) == 3
    engine.pump_fetch()
    engine.drain()
    assert engine.check_prefetch_progress("r0")
    assert engine.loaded_tokens() == {"r0": 3}


@pytest.mark.parametrize("state", ["timeout"], indirect=True)
def test_dev_s29_0_5_23_timeout_issues_no_second_prefetch(state: Any) -> None:
    """Where DEV-S29 does not reach: a 0.5.23 ``timeout`` poll marks the deadline
    expired and ``prefetch_from_storage`` issues nothing more for that handle
    (``unified_radix_cache.py`` 0.5.23 :2098-2100), so no prefetch is there for the ended
    one's result to revoke. 0.5.20 issues it."""
    engine = state.engine
    ended_before_its_hit_drain(state)
    _, node, matched = state.anchor_and_tokens(KEY)
    second = engine.issue_prefetch(KEY, node, matched, "r0")
    assert (second is not None) is engine.v20


# -- the campaign finds it, then steers around it ----------------------------------------

# The adapter's name for DEV-S29 in ``avoid``, and the machine's counts around it.
AVOID = "reprefetch_with_an_ended_result_queued"
STEERED = "prefetch not issued: a hit query or result of its ended prefetch is queued (DEV-S29)"
RACE = "hit result of an ended prefetch drained while the request's next one awaits its own"


def campaign(examples: int) -> settings:
    """A fixed draw (derandomized; it still depends on the Hypothesis runs made before in
    the process), no shrinking: bounded."""
    return settings(max_examples=examples, stateful_step_count=40, derandomize=True,
                    database=None, deadline=None, phases=[Phase.generate])


class RaceReached(Exception):
    """The campaign met DEV-S29's race as often as wanted, with nothing failing."""


def campaign_machine(tally: Tally, steer: bool, stop_after: int | None = None) -> Any:
    """The ``sglang-unified-storage`` campaign's machine (page size 1), with DEV-S29's
    steering lifted unless ``steer``; with ``stop_after``, the run stops (``RaceReached``)
    once the race was met that often and every check after it held."""
    base = machine_class(Scenario(page_size=1), tally)

    class Campaign(base):  # type: ignore[misc, valid-type]
        def __init__(self) -> None:
            super().__init__()
            assert AVOID in self.engine.avoid and "DEV-S29" in self.engine.avoid[AVOID]
            if not steer:
                self.steered = self.steered - {AVOID}
            self.races_before = tally.ops[RACE]  # counted in this example only

        @invariant()
        def stop_once_the_race_was_met(self) -> None:
            met = tally.ops[RACE] - self.races_before
            if stop_after is not None and met >= stop_after:
                self.engine_refines_the_model()  # the checks after the race, first
                raise RaceReached(met)
    return Campaign


def test_dev_s29_a_bounded_campaign_finds_it() -> None:
    """Unsteered, the campaign issues, polls and re-issues until an ended prefetch's
    result revokes the next one; the failure names the revoked prefetch."""
    tally = Tally()
    with pytest.raises(AssertionError,
                       match=r"issued prefetch of r\d revoked by SGLang: no poll, abort"):
        run_state_machine_as_test(campaign_machine(tally, steer=False),
                                  settings=campaign(800))
    assert tally.ops["issued prefetch ended by a poll before its hit drain"]


def test_dev_s29_the_campaign_steers_around_it() -> None:
    """Steered (``avoid``): the campaign issues no prefetch for a request while a hit
    query or result of its ended prefetch is queued, never meets the race, and goes on."""
    tally = Tally()
    run_state_machine_as_test(campaign_machine(tally, steer=True), settings=campaign(150))
    assert tally.ops[STEERED] > 0 and tally.ops[RACE] == 0


def test_dev_s29_the_unsteered_campaign_passes_on_the_fixed_drain(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """On a private copy of the drain whose hit drain matches a result to its operation,
    the unsteered campaign meets the race and every check after it holds: what it found
    is DEV-S29's lookup alone."""
    from hiradix.engines.sglang.unified_storage import prepare_storage  # imports SGLang
    cache_class = prepare_storage().unified.modules["uni"].UnifiedRadixCache
    monkeypatch.setattr(cache_class, "_drain_storage_control_queues_impl",
                        matched_by_operation(cache_class))
    tally = Tally()
    with pytest.raises(RaceReached):
        run_state_machine_as_test(campaign_machine(tally, steer=False, stop_after=1),
                                  settings=campaign(800))
