"""The load-back judge of the hybrid machine (``conformance/hybrid/load_back.py``, spec/13
13.8a ``load_back``, DEV-H12): a load the model makes passes; each way an engine's load
can be wrong fails, named. A load short of free slots is judged with the evictions it
makes first (``machine.evicting_load``)."""

from __future__ import annotations

from dataclasses import replace

import pytest

from hiradix.conformance.hybrid.load_back import (
    dev_h12_pages,
    evicted_for_load,
    expected_load,
    plan_for_key,
    window_held_past_match,
)
from hiradix.conformance.hybrid.machine import evicting_load
from hiradix_model import Key
from hiradix_model import hybrid as H
from hiradix_model.errors import IllegalChoice

PATH = Key(tuple(range(1, 13)))
CONFIG = H.SwaConfig(page_size=1, full_slots=16, swa_slots=16, window=4,
                     host_full_slots=16, host_swa_slots=16)


def deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def hosted(config: H.SwaConfig = CONFIG) -> H.SwaState:
    """PATH cached live on every page, backed up root first (so every page has both host
    copies), then evicted from the device: the whole path host-only."""
    s = H.alloc(H.initial(config), PATH, 0, tuple(range(12)), tuple(range(12)))
    s, _ = H.insert(s, PATH, tuple(range(12)), 0)
    for n in range(1, 13):
        targets = H.swa_backup_targets(s, deep(n))
        s = H.backup(s, deep(n), (n - 1,), tuple(sorted(s.host_swa_free))[:len(targets)])
    s, freed = H.evict_full(s, 12, [deep(n) for n in range(12, 0, -1)])
    assert freed == 12 and not s.pages and all(p.swa for p in s.host.values())
    return s


def loaded(s: H.SwaState) -> H.SwaState:
    """The model's load back of PATH: full KV into slots 0..11, the window's SWA KV into
    SWA slots 0..3."""
    return H.load_back(s, PATH, tuple(range(12)), (0, 1, 2, 3))


def test_the_models_own_load_passes() -> None:
    before = hosted()
    plan = plan_for_key(before, PATH)
    assert plan.anchor == PATH and plan.device_end is None and plan.hit_tokens == 12
    assert plan.full == tuple(deep(n) for n in range(1, 13))
    assert plan.swa == tuple(deep(n) for n in range(9, 13)) and plan.fits(before)
    assert plan.beyond == tuple(deep(n) for n in range(8, 0, -1))  # DEV-H12's most
    after = loaded(before)
    assert expected_load(before, plan, 12, PATH, after) == (after, [])


def test_a_wrong_report_fails() -> None:
    before = hosted()
    _, problems = expected_load(before, plan_for_key(before, PATH), 8, deep(8), loaded(before))
    assert len(problems) == 1 and "the model 12 tokens" in problems[0]


def test_a_window_page_left_dead_fails() -> None:
    before = hosted()
    after = loaded(before)
    dead = replace(after, pages={**after.pages, deep(9): replace(after.pages[deep(9)],
                                                                swa=None)},
                   swa_free=after.swa_free | {0})
    _, problems = expected_load(before, plan_for_key(before, PATH), 12, PATH, dead)
    assert len(problems) == 1 and "are not on the device after it" in problems[0]
    assert f"pages [{deep(9).tokens}]" in problems[0]


def test_a_load_fits_only_with_room_for_whole_nodes() -> None:
    """12 full slots and the window's 4 SWA slots free, but not the 8 more SGLang's
    whole-node load may take (DEV-H12): the machine does not make that load."""
    before = replace(hosted(), swa_free=frozenset(range(11)))
    assert not plan_for_key(before, PATH).fits(before)
    assert plan_for_key(hosted(), PATH).fits(hosted())


def test_slots_that_were_not_free_fail() -> None:
    before = replace(hosted(), full_free=frozenset(range(1, 16)))  # slot 0 taken
    _, problems = expected_load(before, plan_for_key(before, PATH), 12, PATH, loaded(hosted()))
    assert len(problems) == 1 and "the model refuses it" in problems[0]


def with_swa(s: H.SwaState, key: Key, slot: int, host_state: H.SwaState) -> H.SwaState:
    """``s`` with device SWA slot ``slot`` given to ``key``, holding its SWA host KV."""
    source = host_state.host[key].swa
    assert source is not None
    return replace(s, pages={**s.pages, key: replace(s.pages[key], swa=(slot,))},
                   swa_free=s.swa_free - {slot},
                   swa_kv={**s.swa_kv, slot: host_state.host_swa_kv[source[0]]})


def test_swa_kv_for_the_rest_of_the_windows_top_node_is_dev_h12() -> None:
    """SGLang loads the SWA KV of the whole node covering the window's top: pages right
    above the window, accepted and expected in the state."""
    before = hosted()
    plan = plan_for_key(before, PATH)
    after = with_swa(with_swa(loaded(before), deep(8), 4, before), deep(7), 5, before)
    assert dev_h12_pages(before, plan, after) == [deep(7), deep(8)]
    assert expected_load(before, plan, 12, PATH, after) == (after, [])


def test_swa_kv_loaded_elsewhere_fails() -> None:
    """A page above the window that does not continue it (page 7 without page 8) is no
    node's rest: named."""
    before = hosted()
    after = with_swa(loaded(before), deep(7), 4, before)
    _, problems = expected_load(before, plan_for_key(before, PATH), 12, PATH, after)
    assert len(problems) == 1 and "DEV-H12" in problems[0]


def test_with_nothing_to_load_nothing_may_change() -> None:
    before = loaded(hosted())
    plan = plan_for_key(before, PATH)
    assert plan.empty and plan.device_end == PATH
    assert expected_load(before, plan, 0, PATH, before) == (before, [])
    _, problems = expected_load(before, plan, 4, PATH, before)
    assert len(problems) == 1 and "nothing to load back" in problems[0]


# ---- a load back short of free slots evicts first (the server's _load_back_transfers) ----

OTHER, SIDE = Key((20,) * 5), Key((21,) * 5)  # paths of their own, one-token pages


def other(n: int) -> Key:
    return Key(OTHER.tokens[:n])


def side(n: int) -> Key:
    return Key(SIDE.tokens[:n])


def crowded(config: H.SwaConfig = CONFIG, pages: int = 4) -> H.SwaState:
    """``hosted(config)`` with ``pages`` pages each of OTHER and SIDE cached live on the
    device, in the lowest free slots of both pools."""
    s = hosted(config)
    for key in (other(pages), side(pages)):
        full, swa = tuple(sorted(s.full_free)[:pages]), tuple(sorted(s.swa_free)[:pages])
        s, _ = H.insert(H.alloc(s, key, 0, full, swa), key, full, 0)
    return s


def evicted_then_loaded(s: H.SwaState, victims: list[Key], need: int) -> H.SwaState:
    """The model's eviction of ``victims`` (for ``need`` slots of either pool, both
    freed alike here), then PATH loaded into the lowest free slots: full KV for its 12
    pages, SWA KV for its window's 4."""
    s, _ = H.evict_full(s, need, victims)
    return H.load_back(s, PATH, tuple(sorted(s.full_free)[:12]),
                       tuple(sorted(s.swa_free)[:4]))


def test_a_load_short_of_full_slots_evicts_the_shortfall_first() -> None:
    before = crowded()
    plan = plan_for_key(before, PATH)
    assert plan.full_short(before) == 4 and not plan.fits(before)
    victims = [side(n) for n in (4, 3, 2, 1)]
    after = evicted_then_loaded(before, victims, 4)
    state, made, taken = evicting_load(before, plan, after, True, False)
    assert made == plan and taken == victims
    assert expected_load(state, made, 12, PATH, after) == (after, [])


def test_a_load_that_evicts_more_than_its_shortfall_fails() -> None:
    """SIDE and OTHER both went, 8 slots: either alone freed the 4 the load needed, and
    no page of the one is the rest of the other's node (the model knows no nodes, so one
    page more on another path would pass: it could be a node's rest)."""
    before = crowded()
    after = evicted_then_loaded(before, [side(n) for n in (4, 3, 2, 1)]
                                + [other(n) for n in (4, 3, 2, 1)], 8)
    with pytest.raises(AssertionError, match=r"short of 4 full slots .* its eviction took"):
        evicting_load(before, plan_for_key(before, PATH), after, True, False)


def test_a_load_short_of_swa_slots_evicts_the_swa_shortfall_after_allocating() -> None:
    """24 full slots and 12 SWA slots: after 5 pages each of OTHER and SIDE, the full
    pool has room and the SWA pool 2 slots for the window's 4; the SWA transfer's
    allocation evicts 2 SWA slots (hybrid_cache_controller.py:1884-1887). Taking both
    paths whole fails."""
    before = crowded(replace(CONFIG, full_slots=24, swa_slots=12), pages=5)
    plan = plan_for_key(before, PATH)
    assert plan.full_short(before) == 0 and len(before.swa_free) == 2
    after = evicted_then_loaded(before, [side(5), side(4)], 2)
    state, made, taken = evicting_load(before, plan, after, True, False)
    assert made == plan and taken == [side(5), side(4)]
    assert expected_load(state, made, 12, PATH, after) == (after, [])
    greedy = evicted_then_loaded(before, [side(n) for n in range(5, 0, -1)]
                                 + [other(n) for n in range(5, 0, -1)], 10)
    with pytest.raises(AssertionError, match="its eviction took"):
        evicting_load(before, plan, greedy, True, False)


def test_a_load_whose_eviction_cannot_free_enough_is_called_off() -> None:
    locked = H.inc_lock_ref(H.inc_lock_ref(crowded(), other(4)), side(4))  # running requests
    plan = plan_for_key(locked, PATH)
    state, made, taken = evicting_load(locked, plan, locked, False, False)
    assert (state, taken, made.empty) == (locked, [], True)
    assert expected_load(state, made, 0, None, locked) == (locked, [])
    with pytest.raises(AssertionError, match="the engine made the load"):
        evicting_load(locked, plan, locked, True, False)


def partly_loaded() -> H.SwaState:
    """PATH's first 10 pages loaded back (7..10 live), then page 9's SWA KV evicted: the
    device path's windows all hold tombstones, so no device match, while pages 11 and
    12 stay host-only; 6 full slots free."""
    s = H.load_back(hosted(), deep(10), tuple(range(10)), (0, 1, 2, 3))
    s, _ = H.evict_swa(s, 1, [deep(9)])
    key = Key((20,) * 6)
    return H.insert(H.alloc(s, key, 0, tuple(range(10, 16)), tuple(range(4, 10))), key,
                    tuple(range(10, 16)), 0)[0]


def test_the_anchors_device_path_is_locked_past_the_device_match() -> None:
    """Page 10 is a full leaf on the device, past the device match (none) on PATH's path:
    the load's lock of its anchor holds it (unified_radix_cache.py:1833), so its
    eviction may take OTHER's leaf and not page 10."""
    s = replace(partly_loaded(), full_free=frozenset())
    plan = plan_for_key(s, PATH)
    assert (plan.device_end, plan.full, plan.full_short(s)) == (None, (deep(11), PATH), 2)
    with pytest.raises(IllegalChoice, match="may not be taken now"):
        evicted_for_load(s, plan, [deep(10)], 1, 0)
    state, goes_on = evicted_for_load(s, plan, [Key((20,) * 6), Key((20,) * 5)], 2, 0)
    assert goes_on and deep(10) in state.pages and state.pages[deep(10)].lock == 0


def test_a_live_page_of_the_anchors_window_past_the_device_match_is_named() -> None:
    """Page 10 is live in the anchor's window and in no device match's: SGLang's lock of
    the anchor holds its SWA KV, which no lock of the model can; the machine does not
    make such a load short of slots."""
    s = partly_loaded()
    assert window_held_past_match(s, plan_for_key(s, PATH)) == [deep(10)]
    assert window_held_past_match(crowded(), plan_for_key(crowded(), PATH)) == []
