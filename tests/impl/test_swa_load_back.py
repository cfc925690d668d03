"""The load-back judge of the hybrid machine (``conformance/hybrid/load_back.py``, spec/13
13.8a ``load_back``, DEV-H12): a load the model makes passes; each way an engine's load
can be wrong fails, named."""

from __future__ import annotations

from dataclasses import replace

from hiradix.conformance.hybrid.load_back import dev_h12_pages, expected_load, plan_for_key
from hiradix_model import Key
from hiradix_model import hybrid as H

PATH = Key(tuple(range(1, 13)))
CONFIG = H.SwaConfig(page_size=1, full_slots=16, swa_slots=16, window=4,
                     host_full_slots=16, host_swa_slots=16)


def deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def hosted() -> H.SwaState:
    """PATH cached live on every page, backed up root first (so every page has both host
    copies), then evicted from the device: the whole path host-only."""
    s = H.alloc(H.initial(CONFIG), PATH, 0, tuple(range(12)), tuple(range(12)))
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
