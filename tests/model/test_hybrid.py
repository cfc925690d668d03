"""The (FULL, SWA) model of spec/13: each operation's effect, each refusal, each invariant."""

from __future__ import annotations

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from swa_mutants import CONFIG, PATH, SWA_MUTANTS, healthy

from hiradix_model import Key
from hiradix_model import hybrid as H
from hiradix_model.errors import ConfigError, IllegalChoice, PreconditionError


def deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def test_the_healthy_state_breaks_nothing() -> None:
    assert H.violations(healthy()) == []


@pytest.mark.parametrize("spec_id", sorted(SWA_MUTANTS))
def test_each_corruption_fails_its_invariant(spec_id: str) -> None:
    assert spec_id in H.check(SWA_MUTANTS[spec_id](healthy()))


def test_every_invariant_has_a_corruption() -> None:
    assert set(SWA_MUTANTS) == set(H.SWA_INVARIANTS)


def test_insert_makes_tombstones_before_swa_evicted() -> None:
    s = healthy()
    assert [s.pages[deep(n)].live for n in range(1, 13)] == [False] * 8 + [True] * 4
    assert s.pages[deep(9)].swa_lock == 1 and s.pages[deep(8)].swa_lock == 0
    assert all(s.pages[deep(n)].lock == 1 for n in range(1, 13))


def test_match_ends_where_the_window_is_live() -> None:
    s = healthy()
    assert H.match_prefix(s, PATH).last_page == deep(12)
    # 10 tokens: the last 4 include tombstones 7 and 8; no shorter live window either.
    assert H.match_prefix(s, deep(10)).last_page is None
    assert H.match_prefix(s, Key((1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13))).full_slots \
        == tuple(range(12))


def test_a_short_path_needs_only_its_own_pages_live() -> None:
    s = H.initial(CONFIG)
    s = H.alloc(s, Key((5, 6)), 0, (0, 1), (0, 1))
    s, prefix = H.insert(s, Key((5, 6)), (0, 1), 0)
    assert prefix == 0 and H.match_prefix(s, Key((5, 6, 7))).last_page == Key((5, 6))


def test_healing_takes_the_callers_pair_and_frees_the_old_full_slots() -> None:
    s = H.dec_lock_ref(healthy(), PATH, False)
    key = deep(8)
    s = H.alloc(s, key, 5, (13, 14, 15), (5, 6, 7))
    # positions 0..4 are the cache's own slots; 5..7 are fresh pairs with SWA halves
    s2, prefix = H.insert(s, key, (0, 1, 2, 3, 4, 13, 14, 15), 5)
    assert prefix == 8
    assert [s2.pages[deep(n)].full for n in (6, 7, 8)] == [(13,), (14,), (15,)]
    assert [s2.pages[deep(n)].swa for n in (6, 7, 8)] == [(5,), (6,), (7,)]
    assert {5, 6, 7} <= s2.full_free and not {13, 14, 15} & set(s2.held)
    assert H.violations(s2) == []
    assert H.match_prefix(s2, PATH).last_page == deep(12)


def test_a_duplicate_stays_the_callers() -> None:
    s = H.alloc(healthy(), PATH, 8, (13, 14, 15), (5, 6, 7))
    s2, prefix = H.insert(s, deep(11), (*range(8), 13, 14, 15), 8)
    assert prefix == 11 and {13, 14, 15} <= set(s2.held)


def test_swa_eviction_tombstones_internal_pages_and_deletes_leaves() -> None:
    s = H.dec_lock_ref(healthy(), PATH, False)
    s2, freed = H.evict_swa(s, 1, [deep(12)])
    assert freed == 1 and deep(12) not in s2.pages  # a leaf goes whole
    s3, freed = H.evict_swa(s, 1, [deep(10)])
    assert freed == 1 and not s3.pages[deep(10)].live and s3.pages[deep(10)].full == (9,)
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_swa(healthy(), 1, [deep(12)])  # inside a locked window
    with pytest.raises(IllegalChoice, match="could still go"):
        H.evict_swa(s, 2, [deep(10)])


def test_full_eviction_lets_the_node_and_a_tombstone_chain_follow() -> None:
    s = H.dec_lock_ref(healthy(), PATH, False)
    s2, freed = H.evict_full(s, 1, [deep(n) for n in range(12, 0, -1)])
    assert freed == 12 and s2.pages == {}
    s, _ = H.insert(s, Key((7,)), (12,), 0)  # a second live leaf, on its own branch
    with pytest.raises(IllegalChoice, match="after 1 were freed"):
        H.evict_full(s, 1, [deep(12), Key((7,))])
    s3, freed = H.evict_full(s, 2, [deep(12), Key((7,))])
    assert freed == 2 and Key((7,)) not in s3.pages


def test_early_swa_release_then_full_release() -> None:
    s = H.dec_swa_lock(healthy(), PATH)
    assert all(p.swa_lock == 0 for p in s.pages.values()) and s.released == {PATH: 1}
    with pytest.raises(PreconditionError, match="still holds its window"):
        H.dec_swa_lock(s, PATH)
    with pytest.raises(PreconditionError, match="still holds its window"):
        H.dec_lock_ref(s, PATH, False)
    s = H.dec_lock_ref(s, PATH, True)
    assert all(p.lock == 0 for p in s.pages.values()) and s.released == {}


def test_a_path_lock_holds_the_path_and_not_the_window() -> None:
    """13.3 inc_path_lock: a lock whose SWA part is released from the start, so it may sit
    on a page whose window holds tombstones (inc_lock_ref refuses that); the full walk
    cannot delete its path, the SWA walk may still tombstone its window; only
    dec_lock_ref(swa_released=True) releases it."""
    s = H.dec_lock_ref(healthy(), PATH, False)
    with pytest.raises(PreconditionError, match="tombstone in its window"):
        H.inc_lock_ref(s, deep(10))
    locked = H.inc_path_lock(s, deep(10))
    assert H.violations(locked) == [] and locked.released == {deep(10): 1}
    assert [locked.pages[deep(n)].lock for n in (1, 10, 11)] == [1, 1, 0]
    assert all(p.swa_lock == 0 for p in locked.pages.values())
    leaves_first = [deep(12), deep(11), deep(10)]
    assert H.evict_full(s, 3, leaves_first)[1] == 3
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_full(locked, 3, leaves_first)
    tombstoned, freed = H.evict_swa(locked, 1, [deep(10)])
    assert freed == 1 and not tombstoned.pages[deep(10)].live
    with pytest.raises(PreconditionError, match="still holds its window"):
        H.dec_lock_ref(locked, deep(10), False)
    assert H.dec_lock_ref(locked, deep(10), True) == s
    with pytest.raises(PreconditionError):
        H.inc_path_lock(s, Key((9, 9)))


def test_a_lock_releases_its_window_once_even_beside_another() -> None:
    """Two locks at one page: releasing one's window early twice would take the other's
    window count (13.3); the second release is refused, and so is releasing the lock
    that kept its window as if it had not."""
    s = H.inc_lock_ref(healthy(), PATH)
    assert s.pages[deep(12)].swa_lock == 2
    s = H.dec_swa_lock(s, PATH)
    s = H.dec_swa_lock(s, PATH)  # the second lock's window: fine, each once
    with pytest.raises(PreconditionError) as error:
        H.dec_swa_lock(s, PATH)
    assert error.value.argument == "page"
    s = H.dec_lock_ref(s, PATH, True)
    s = H.dec_lock_ref(s, PATH, True)
    assert s.released == {} and all(p.lock == 0 for p in s.pages.values())


def test_a_lock_that_kept_its_window_cannot_be_released_as_if_it_had_not() -> None:
    """dec_lock_ref(swa_released=True) of a lock that never released its window early
    would leave that window locked for good (13.3): refused, the state unchanged."""
    s = healthy()
    with pytest.raises(PreconditionError) as error:
        H.dec_lock_ref(s, PATH, True)
    assert error.value.argument == "swa_released"
    assert H.violations(s) == [] and s.pages[deep(12)].swa_lock == 1


def two_paths() -> H.SwaState:
    """Two unlocked live leaves, (1, 2) and (3,), nothing held."""
    s = H.initial(CONFIG)
    s = H.alloc(s, Key((1, 2)), 0, (0, 1), (0, 1))
    s, _ = H.insert(s, Key((1, 2)), (0, 1), 0)
    s = H.alloc(s, Key((3,)), 0, (2,), (2,))
    s, _ = H.insert(s, Key((3,)), (2,), 0)
    return s


def test_an_allocations_eviction_runs_full_then_what_swa_still_lacks() -> None:
    """13.3 evict_for_alloc: deleting the full leaf (3,) frees its SWA slot too, which
    is all the SWA pool lacked: no SWA victim may follow, and a split that puts (3,) in
    the SWA phase (a full phase short while a leaf was left) is refused."""
    s = two_paths()
    free_swa = len(s.swa_free)
    after, freed = H.evict_for_alloc(s, 1, 1, [Key((3,))], 1)
    assert freed == 1 and len(after.swa_free) == free_swa + 1 and Key((3,)) not in after.pages
    with pytest.raises(IllegalChoice, match="after 0 were freed"):
        H.evict_for_alloc(s, 1, 1, [Key((3,)), Key((1, 2))], 1)
    with pytest.raises(IllegalChoice):
        H.evict_for_alloc(s, 1, 1, [Key((3,))], 0)
    # Only SWA short: tombstone the inner page or take a leaf; nothing from the full phase.
    after, freed = H.evict_for_alloc(s, 0, 1, [Key((1,))], 0)
    assert freed == 0 and not after.pages[Key((1,))].live


@pytest.mark.parametrize("call, argument", [
    (lambda s: H.evict_for_alloc(s, -1, 0, [], 0), "full_need"),
    (lambda s: H.evict_for_alloc(s, 0, 1.5, [], 0), "swa_need"),
    (lambda s: H.evict_for_alloc(s, 0, 0, [], 1), "split"),
])
def test_bad_allocation_evictions_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    with pytest.raises(PreconditionError) as error:
        call(two_paths())
    assert error.value.argument == argument


@pytest.mark.parametrize("call, argument", [
    (lambda s: H.alloc(s, PATH, 0, (0,), (5,)), "full"),
    (lambda s: H.alloc(s, PATH, 0, (13,), (5, 6)), "swa"),
    (lambda s: H.free_swa(s, (13,)), "full"),
    (lambda s: H.free(s, (0,)), "full"),
    (lambda s: H.insert(s, Key((7,)), (12,), 2), "swa_evicted"),
    (lambda s: H.insert(s, Key((7,)), (12,), 1), "full"),
    (lambda s: H.insert(s, Key((7,)), (13,), 0), "full"),
    (lambda s: H.inc_lock_ref(s, deep(10)), "page"),
    (lambda s: H.inc_lock_ref(s, Key((9, 9))), "page"),
    (lambda s: H.evict_full(s, -1, []), "num_tokens"),
    (lambda s: H.match_prefix(s, (1, 2)), "key"),  # type: ignore[arg-type]
])
def test_bad_calls_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    s = healthy()
    with pytest.raises(PreconditionError) as error:
        call(s)
    assert error.value.argument == argument
    assert s == healthy()


def test_config_refuses_bad_fields() -> None:
    cases = (({"window": 0}, "window"), ({"swa_slots": 3, "page_size": 2}, "swa_slots"))
    for fields, name in cases:
        with pytest.raises(ConfigError) as error:
            H.SwaConfig(**fields)  # type: ignore[arg-type]
        assert error.value.field == name


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=9),
                          st.integers(0, 9), st.integers(0, 3)), max_size=8))
def test_random_requests_keep_every_invariant(requests) -> None:  # type: ignore[no-untyped-def]
    """Requests served as 13.4 says, by a caller that takes the lowest free slots."""
    config = H.SwaConfig(page_size=1, full_slots=24, swa_slots=10, window=3)
    s = H.initial(config)
    for ids, past, evict in requests:
        key = Key(tuple(ids))
        m = H.match_prefix(s, key)
        s = H.inc_lock_ref(s, m.last_page)
        need = len(ids) - len(m.full_slots)
        if need > len(s.full_free) or need > len(s.swa_free):
            s = H.dec_lock_ref(s, m.last_page, False)
            continue
        full, swa = tuple(sorted(s.full_free)[:need]), tuple(sorted(s.swa_free)[:need])
        s = H.alloc(s, key, len(m.full_slots), full, swa)
        evicted = max(len(m.full_slots), min(past, len(ids)))
        dropped = full[:evicted - len(m.full_slots)]
        if dropped:
            s = H.free_swa(s, dropped)
        s, _ = H.insert(s, key, m.full_slots + full, evicted)
        s = H.free(s, tuple(f for f in full if f in s.held))
        s = H.dec_lock_ref(s, m.last_page, False)
        leaves = sorted(H.state.swa_candidates(s), key=lambda k: -len(k.tokens))[:evict]
        s, _ = H.evict_swa(s, len(leaves), leaves)
        assert H.violations(s) == []
        assert not list(H.match_problems(s, key, H.match_prefix(s, key).last_page))


def test_match_live_fails_on_a_dead_window_and_on_a_short_match() -> None:
    """INV-SWA-MATCH-LIVE: the two ways an engine's match can break it."""
    s = healthy()
    assert H.MATCH_INVARIANT == "INV-SWA-MATCH-LIVE"
    assert not list(H.match_problems(s, PATH, deep(12)))
    assert "not live" in next(H.match_problems(s, PATH, deep(10)))
    assert "is cached with a live window" in next(H.match_problems(s, PATH, None))


def test_a_release_must_release_a_lock_taken_at_that_page() -> None:
    """A lock taken at the 12-token page cannot be released at its parent (INV-SWA-LOCKS)."""
    s = healthy()
    with pytest.raises(PreconditionError) as error:
        H.dec_lock_ref(s, deep(11), True)
    assert error.value.argument == "page"
