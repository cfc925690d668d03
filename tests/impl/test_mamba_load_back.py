"""The load-back judge of the Mamba machine (``conformance/mamba/load_back.py``, spec/13m
13m.8b ``load_back``, DEV-M14): a load the model makes, with the request's copy, passes;
each way an engine's load can be wrong fails, named. A load short of full slots is judged
with the eviction it makes first (``machine.evicting_load``)."""

from __future__ import annotations

from dataclasses import replace

import pytest
from mamba_mutants import PATH, deep
from test_mamba_host import demoted

from hiradix.conformance.mamba.load_back import evicted_for_load, expected_load, plan_for_key
from hiradix.conformance.mamba.machine import evicting_load
from hiradix_model import Key
from hiradix_model import mamba as M
from hiradix_model.errors import IllegalChoice


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


# ---- a load back short of full slots evicts first (the server's _load_back_transfers) ----

OTHER, SIDE = Key((9,) * 8), Key((8,) * 4)  # paths of their own, four and two pages


def crowded() -> M.MambaState:
    """``demoted()`` with OTHER (full slots 0..7, state slot 0) and SIDE (full slots
    8..11, state slot 3) cached on the device: 4 full slots free, while a load back of
    PATH takes 8."""
    s = demoted()
    for key, full, slot in ((OTHER, tuple(range(8)), 0), (SIDE, tuple(range(8, 12)), 3)):
        s = M.alloc_state(M.alloc(s, key, 0, full), slot, key)
        s, _, taken = M.insert(s, key, full, slot)
        assert taken
    assert len(s.full_free) == 4
    return s


def evicted_then_loaded(s: M.MambaState, victims: list[Key]) -> M.MambaState:
    """The model's eviction of ``victims`` (for 4 full slots), then PATH loaded into the
    8 free full slots with its state in slot 1 and the request's copy in slot 2."""
    s, freed = M.evict_full(s, 4, victims)
    assert freed >= 4
    return M.fork(M.load_back(s, PATH, tuple(sorted(s.full_free))[:8], 1), PATH, 2)


def test_a_load_short_of_full_slots_evicts_the_shortfall_first() -> None:
    before = crowded()
    plan = plan_for_key(before, PATH)
    assert plan.full_short(before) == 4 and plan.states_fit(before) and not plan.fits(before)
    after = evicted_then_loaded(before, [SIDE, Key((8, 8))])
    state, made, victims = evicting_load(before, plan, after)
    assert made == plan and victims == [SIDE, Key((8, 8))]
    assert expected_load(state, made, 8, PATH, 2, after) == (after, [])


def test_a_load_that_evicts_more_than_its_shortfall_fails() -> None:
    """Two pages of SIDE and two of OTHER went, 8 slots: either path alone freed the 4
    the load needed, so no order of them is an eviction of its shortfall."""
    before = crowded()
    s, _ = M.evict_full(before, 8, [SIDE, Key((8, 8)), OTHER, Key((9,) * 6)])
    after = M.fork(M.load_back(s, PATH, tuple(sorted(s.full_free))[:8], 1), PATH, 2)
    with pytest.raises(AssertionError, match="short of 4 full slots: its eviction took"):
        evicting_load(before, plan_for_key(before, PATH), after)


def test_a_load_whose_eviction_cannot_free_enough_is_called_off() -> None:
    locked = crowded()
    for key in (OTHER, SIDE):  # running requests hold both
        locked = M.inc_lock_ref(locked, key, True)
    plan = plan_for_key(locked, PATH)
    state, made, victims = evicting_load(locked, plan, locked)
    assert (state, victims, made.empty) == (locked, [], True)
    assert expected_load(state, made, 0, None, None, locked) == (locked, [])
    _, problems = expected_load(state, made, 8, PATH, 2, locked)
    assert len(problems) == 1 and "nothing to load back" in problems[0]


def test_the_anchors_device_path_is_locked_past_the_device_match() -> None:
    """PATH loaded back, then its last page evicted: deep(2..6) stay on the device
    without a state there, so no match ends on them, but they lie on PATH's path. The
    load locks that path (unified_radix_cache.py:1833), so its eviction may take the
    other key's leaf and not deep(6), a full leaf the device match's lock (none here)
    leaves open."""
    s, _ = M.evict_full(M.load_back(demoted(), PATH, tuple(range(8)), 1), 2, [PATH])
    other = Key((9,) * 10)
    s = M.alloc_state(M.alloc(s, other, 0, tuple(range(6, 16))), 0, other)
    s, _, _ = M.insert(s, other, tuple(range(6, 16)), 0)
    plan = plan_for_key(s, PATH)
    assert (plan.device_end, plan.full, plan.full_short(s)) == (None, (PATH,), 2)
    with pytest.raises(IllegalChoice, match="may not be taken now"):
        evicted_for_load(s, plan, [deep(6)])
    state, enough = evicted_for_load(s, plan, [other])
    assert enough and deep(6) in state.pages and state.pages[deep(6)].lock == 0
