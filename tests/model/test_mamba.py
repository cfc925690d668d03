"""The (FULL, MAMBA) model (spec/13m): operations, invariants and their failing tests."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from mamba_mutants import BRANCH, MAMBA_MUTANTS, PATH, deep, healthy

from hiradix_model import Key
from hiradix_model import mamba as M
from hiradix_model.errors import ConfigError, IllegalChoice, PreconditionError


def test_the_healthy_state_breaks_nothing() -> None:
    assert M.violations(healthy()) == []


@pytest.mark.parametrize("spec_id", sorted(MAMBA_MUTANTS))
def test_each_corruption_fails_its_invariant(spec_id: str) -> None:
    assert M.check(MAMBA_MUTANTS[spec_id](healthy())) == [spec_id]


def test_every_invariant_has_a_corruption() -> None:
    assert set(MAMBA_MUTANTS) == set(M.MAMBA_INVARIANTS)


def test_insert_puts_the_state_at_the_last_page_only() -> None:
    s = healthy()
    assert s.pages[PATH].state == 1 and s.pages[deep(6)].state is None
    assert s.pages[deep(4)].state == 0 and s.pages[BRANCH].state == 2
    assert s.pages[deep(2)].state is None


def test_a_second_state_for_a_cached_end_stays_the_callers() -> None:
    s = M.write_state(healthy(), 3, PATH)
    s2, prefix, taken = M.insert(s, PATH, s.pages[deep(2)].full + s.pages[deep(4)].full
                                 + s.pages[deep(6)].full + s.pages[PATH].full, 3)
    assert (prefix, taken) == (8, False) and 3 in s2.held_states


def test_a_state_tombstone_takes_the_next_insert() -> None:
    s = healthy()
    s, freed = M.evict_states(s, 1, [deep(4)])
    assert freed == 1 and s.pages[deep(4)].state is None and deep(4) in s.pages
    s = M.write_state(s, 3, deep(4))
    full = s.pages[deep(2)].full + s.pages[deep(4)].full
    s, prefix, taken = M.insert(s, deep(4), full, 3)
    assert (prefix, taken) == (4, True) and s.pages[deep(4)].state == 3


def test_match_ends_at_the_deepest_state_and_reports_the_full_hit() -> None:
    s = healthy()
    m = M.match_prefix(s, Key((*PATH.tokens, 0, 0)))
    assert (m.last_page, m.full_hit, len(m.full_slots)) == (PATH, 8, 8)
    s, _ = M.evict_states(s, 1, [BRANCH])  # a leaf: deleted whole
    assert BRANCH not in s.pages
    m = M.match_prefix(s, BRANCH)
    assert (m.last_page, m.full_hit) == (deep(4), 4)
    s, _ = M.evict_states(s, 1, [deep(4)])  # internal: a state tombstone
    m = M.match_prefix(s, BRANCH)
    assert (m.last_page, m.full_hit, m.full_slots) == (None, 4, ())


def test_a_locked_state_is_not_evicted() -> None:
    s = healthy()
    with pytest.raises(IllegalChoice):
        M.evict_states(s, 1, [PATH])
    # The two unlocked states go; the locked one is why no third can.
    _, freed = M.evict_states(s, 3, [BRANCH, deep(4)])
    assert freed == 2
    with pytest.raises(IllegalChoice):
        M.evict_states(s, 3, [BRANCH])  # short, while deep(4) could still go


def test_full_eviction_deletes_a_leaf_node_with_its_state() -> None:
    s = M.dec_lock_ref(healthy(), PATH, False)
    s, freed = M.evict_full(s, 4, [PATH, deep(6)])
    assert freed == 4 and 1 in s.state_free and deep(6) not in s.pages
    with pytest.raises(IllegalChoice):
        M.evict_full(s, 2, [deep(4)])  # it has a child left
    s, freed = M.evict_full(s, 2, [BRANCH, deep(4)])  # the rest of the node may follow
    assert freed == 4 and set(s.pages) == {deep(2)}


def test_state_eviction_takes_the_rest_of_a_leaf_node() -> None:
    s = M.dec_lock_ref(healthy(), PATH, False)
    s, freed = M.evict_states(s, 1, [PATH, deep(6)])
    assert freed == 1 and deep(6) not in s.pages and PATH not in s.pages


def test_an_allocations_eviction_is_the_eviction_of_its_one_short_pool() -> None:
    s = M.dec_lock_ref(healthy(), PATH, False)
    assert M.evict_for_alloc(s, 4, 0, [PATH, deep(6)]) == M.evict_full(s, 4, [PATH, deep(6)])
    assert M.evict_for_alloc(s, 0, 1, [BRANCH]) == M.evict_states(s, 1, [BRANCH])
    with pytest.raises(IllegalChoice):
        M.evict_for_alloc(s, 0, 1, [BRANCH, PATH])  # one state was enough


@pytest.mark.parametrize("full_need, state_need, argument", [
    (0, 0, "full_need"), (2, 1, "full_need"), (-1, 1, "full_need"), (True, 0, "full_need"),
    (0, 1.0, "state_need"),
])
def test_an_allocations_eviction_names_a_bad_need(full_need: object, state_need: object,
                                                  argument: str) -> None:
    with pytest.raises(PreconditionError) as refused:
        M.evict_for_alloc(healthy(), full_need, state_need, [])  # type: ignore[arg-type]
    assert refused.value.argument == argument


def test_fork_copies_a_cached_state_into_a_held_slot() -> None:
    s = M.free_state(healthy(), 3)
    s = M.fork(s, deep(4), 3)
    assert s.state_kv[3] == deep(4) and 3 in s.held_states and s.pages[deep(4)].state == 0


def test_locks_with_and_without_the_state_part() -> None:
    s = M.inc_lock_ref(healthy(), deep(4), False)
    assert s.pages[deep(4)].state_lock == 0 and s.pages[deep(4)].lock == 2
    s = M.dec_lock_ref(s, deep(4), True)
    s = M.dec_state_lock(s, PATH)
    s = M.dec_lock_ref(s, PATH, True)
    assert all(p.lock == 0 and p.state_lock == 0 for p in s.pages.values())
    with pytest.raises(PreconditionError) as error:
        M.dec_lock_ref(M.inc_lock_ref(s, PATH, True), PATH, True)
    assert error.value.argument == "state_released"


@pytest.mark.parametrize("call, argument", [
    (lambda s: M.alloc(s, PATH, 0, (0, 1)), "full"),
    (lambda s: M.alloc(s, PATH, 0, (9, 10)), "full"),
    (lambda s: M.alloc(s, PATH, 9, (10, 11)), "start"),
    (lambda s: M.free(s, (0, 1)), "full"),
    (lambda s: M.alloc_state(s, 0, PATH), "slot"),
    (lambda s: M.write_state(s, 0, PATH), "slot"),
    (lambda s: M.free_state(s, 2), "slot"),
    (lambda s: M.fork(s, deep(6), 3), "page"),
    (lambda s: M.insert(s, Key((5,)), (10,), 3), "key"),
    (lambda s: M.insert(s, Key((5, 5)), (10, 11), 3), "slot"),
    (lambda s: M.insert(s, Key(()), (), 3), "key"),
    (lambda s: M.inc_lock_ref(s, Key((9, 9)), True), "page"),
    (lambda s: M.inc_lock_ref(s, PATH, 1), "with_state"),
    (lambda s: M.dec_state_lock(s, deep(4)), "page"),
    (lambda s: M.evict_full(s, -1, []), "target"),
    (lambda s: M.match_prefix(s, (1, 2)), "key"),
])
def test_bad_calls_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    s = healthy()
    with pytest.raises(PreconditionError) as error:
        call(s)
    assert error.value.argument == argument
    assert s == healthy()


def test_config_refuses_bad_fields() -> None:
    cases = (({"state_slots": 0}, "state_slots"), ({"full_slots": 3, "page_size": 2},
                                                   "full_slots"))
    for fields, name in cases:
        with pytest.raises(ConfigError) as error:
            M.MambaConfig(**fields)  # type: ignore[arg-type]
        assert error.value.field == name


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=5),
                          st.integers(0, 2), st.booleans()), max_size=8))
def test_random_requests_keep_every_invariant(requests) -> None:  # type: ignore[no-untyped-def]
    """Requests served as 13m.4 says, by a caller that takes the lowest free slots."""
    s = M.initial(M.MambaConfig(page_size=2, full_slots=24, state_slots=4))
    for pages, evict, release_early in requests:
        key = Key(tuple(t for p in pages for t in (p, p + 1)))
        if not s.state_free:
            s, _ = M.evict_states(s, 1, sorted(M.state.state_candidates(s), key=str)[:1])
        if not s.state_free:
            continue
        m = M.match_prefix(s, key)
        slot = min(s.state_free)
        s = (M.fork(s, m.last_page, slot) if m.last_page is not None
             else M.alloc_state(s, slot, Key((), key.namespace)))
        s = M.inc_lock_ref(s, m.last_page, True)
        need = len(key.tokens) - len(m.full_slots)
        if need > len(s.full_free):
            s = M.dec_lock_ref(s, m.last_page, False)
            s = M.free_state(s, slot)
            continue
        full = tuple(sorted(s.full_free)[:need])
        s = M.alloc(s, key, len(m.full_slots), full)
        s = M.write_state(s, slot, key)
        state_released = release_early and m.last_page is not None
        if state_released:
            s = M.dec_state_lock(s, m.last_page)
        s, _, taken = M.insert(s, key, m.full_slots + full, slot)
        s = M.free(s, tuple(f for f in full if f in s.held_full))
        if not taken:
            s = M.free_state(s, slot)
        s = M.dec_lock_ref(s, m.last_page, state_released)
        victims = sorted(M.state.state_candidates(s), key=lambda k: -len(k.tokens))[:evict]
        for victim in victims:
            if victim in s.pages and victim in M.state.state_candidates(s):
                s, _ = M.evict_states(s, 1, [victim])
        assert M.violations(s) == []
        hit = M.match_prefix(s, key)
        assert not list(M.match_problems(s, key, hit.last_page, hit.full_hit))


def test_match_state_fails_on_a_stateless_end_a_short_match_and_a_wrong_full_hit() -> None:
    """INV-MAMBA-MATCH-STATE: the three ways an engine's match can break it."""
    s = healthy()
    assert M.MATCH_INVARIANT == "INV-MAMBA-MATCH-STATE"
    assert not list(M.match_problems(s, PATH, PATH, 8))
    assert "holds no state" in next(M.match_problems(s, PATH, deep(6), 8))
    assert "holds a state" in next(M.match_problems(s, PATH, deep(4), 8))
    assert "full hit" in next(M.match_problems(s, PATH, PATH, 6))


def test_a_release_must_release_a_lock_taken_at_that_page() -> None:
    """PATH is locked at its last page: releasing at its parent is refused (INV-MAMBA-LOCKS)."""
    s = healthy()
    with pytest.raises(PreconditionError) as error:
        M.dec_lock_ref(s, deep(6), True)
    assert error.value.argument == "page"
