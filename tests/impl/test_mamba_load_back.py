"""The load-back judge of the Mamba machine (``conformance/mamba/load_back.py``, spec/13m
13m.8b ``load_back``, DEV-M14): a load the model makes, with the request's copy, passes;
each way an engine's load can be wrong fails, named."""

from __future__ import annotations

from dataclasses import replace

from mamba_mutants import PATH, deep
from test_mamba_host import demoted

from hiradix.conformance.mamba.load_back import expected_load, plan_for_key
from hiradix_model import mamba as M


def loaded(s: M.MambaState) -> M.MambaState:
    """The model's load back of PATH (full KV into slots 0..7, its state into slot 3),
    then the request's copy into slot 0 (DEV-M14)."""
    return M.fork(M.load_back(s, PATH, tuple(range(8)), 3), PATH, 0)


def test_the_models_own_load_with_the_requests_copy_passes() -> None:
    before = demoted()
    plan = plan_for_key(before, PATH)
    assert (plan.anchor, plan.device_end, plan.hit_tokens, plan.state) == (PATH, None, 8, True)
    assert plan.full == tuple(deep(n) for n in (2, 4, 6, 8)) and plan.fits(before)
    after = loaded(before)
    assert expected_load(before, plan, 8, PATH, 0, after) == (after, [])


def test_a_load_without_room_for_the_requests_copy_is_not_made() -> None:
    before = replace(demoted(), state_free=frozenset({3}))
    assert not plan_for_key(before, PATH).fits(before)


def test_a_missing_request_copy_fails() -> None:
    before = demoted()
    after = M.load_back(before, PATH, tuple(range(8)), 3)
    _, problems = expected_load(before, plan_for_key(before, PATH), 8, PATH, None, after)
    assert len(problems) == 1 and "a request state" in problems[0]


def test_a_state_left_on_the_host_fails() -> None:
    before = demoted()
    after = loaded(before)
    tombstone = replace(after, pages={**after.pages, PATH: replace(after.pages[PATH],
                                                                    state=None)},
                        state_free=after.state_free | {3})
    _, problems = expected_load(before, plan_for_key(before, PATH), 8, PATH, 0, tombstone)
    assert len(problems) == 1 and "are not on the device after it" in problems[0]


def test_one_slot_for_the_node_and_the_request_fails() -> None:
    before = demoted()
    _, problems = expected_load(before, plan_for_key(before, PATH), 8, PATH, 3, loaded(before))
    assert len(problems) == 1 and "the model refuses it" in problems[0]


def test_with_nothing_to_load_nothing_may_change() -> None:
    before = M.load_back(demoted(), PATH, tuple(range(8)), 3)
    plan = plan_for_key(before, PATH)
    assert plan.empty and plan.device_end == PATH
    assert expected_load(before, plan, 0, PATH, None, before) == (before, [])
    _, problems = expected_load(before, plan, 0, PATH, 1, before)
    assert len(problems) == 1 and "nothing to load back" in problems[0]
