"""The operations' effects on small hand-built cases, one behaviour per test."""

from __future__ import annotations

import random

import pytest

from hiradix_model import (
    Backup,
    Config,
    ConfigError,
    IllegalChoice,
    Key,
    PreconditionError,
    State,
    Victim,
    check,
    choosers,
    initial,
    ops,
)
from hiradix_model.strategies import eviction_key


def put(state: State, key: Key, now: int, *, chunked: bool = False,
        priority: int = 0, counted_from: int = 0) -> tuple[State, ops.InsertResult]:
    """A request's alloc + insert + free, with the reference backup choices."""
    state, match = ops.match_prefix(state, key, now)
    new = tuple(sorted(state.device_free)[: len(key.tokens) - len(match.device_slots)])
    state, _ = ops.alloc(state, key, len(match.device_slots), new)
    slots = match.device_slots + new
    backup = choosers.choose_insert_backup(state, key, slots, now, random.Random(0),
                                           priority=priority, chunked=chunked,
                                           counted_from=counted_from)
    state, result = ops.insert(state, key, slots, now, priority=priority, chunked=chunked,
                               counted_from=counted_from, backup=backup)
    state, _ = ops.free(state, tuple(s for s in new if s in state.held))
    assert check(state) == ()
    return state, result


def config(**changes: object) -> Config:
    base: dict[str, object] = dict(page_size=1, device_slots=8, host_slots=8,
                                   load_back_threshold=0)
    base.update(changes)
    return Config(**base)  # type: ignore[arg-type]


def test_empty_key_matches_and_caches_nothing() -> None:
    state, result = put(initial(config()), Key(()), 1)
    assert result.prefix_tokens == 0 and state.pages == {}
    _, match = ops.match_prefix(state, Key(()), 2)
    assert match == ops.MatchResult((), None, None, 0)


def test_partial_tail_page_is_not_cached_and_its_slot_stays_with_the_caller() -> None:
    state = initial(config(page_size=2))
    state, _ = ops.alloc(state, Key((1, 2, 3)), 0, (0, 1, 2, 3))  # whole pages (R7)
    state, result = ops.insert(state, Key((1, 2, 3)), (0, 1, 2), 1, backup=Backup((), (0, 1)))
    assert set(state.pages) == {Key((1, 2))}
    assert state.held == {2, 3}
    assert result.prefix_tokens == 0


def test_namespaces_never_share_pages() -> None:
    state, _ = put(initial(config()), Key((1, 2), "a"), 1)
    _, match = ops.match_prefix(state, Key((1, 2), "b"), 2)
    assert match.device_slots == () and match.last_device_page is None
    _, match = ops.match_prefix(state, Key((1, 2), "a"), 2)
    assert len(match.device_slots) == 2


def test_insert_reports_the_cached_prefix_and_leaves_duplicates_held() -> None:
    state, _ = put(initial(config()), Key((1, 2)), 1)
    state, _ = ops.alloc(state, Key((1, 2, 3)), 0, (5, 6, 7))
    backup = choosers.choose_insert_backup(state, Key((1, 2, 3)), (5, 6, 7), 2,
                                           random.Random(0))
    state, result = ops.insert(state, Key((1, 2, 3)), (5, 6, 7), 2, backup=backup)
    assert result.prefix_tokens == 2
    assert state.held == {5, 6}  # duplicates of the cached prefix: the caller frees them


@pytest.mark.parametrize(("policy", "due_after"), [
    ("write_through", [1, 0]), ("write_through_selective", [0, 1]), ("write_back", [0, 0]),
])
def test_write_policies_back_up_on_their_hit(policy: str, due_after: list[int]) -> None:
    state = initial(config(write_policy=policy))
    for now, expected in enumerate(due_after, 1):
        state, result = put(state, Key((1,)), now)
        assert len(result.due) == expected
        state, _ = ops.writing_check(state, len(result.due))


def test_chunked_inserts_are_not_hits() -> None:
    state, result = put(initial(config(write_policy="write_through")), Key((1,)), 1,
                        chunked=True)
    assert result.due == () and state.pages[Key((1,))].hits == 0


def hits(state: State) -> dict[tuple[int, ...], int]:
    return {k.tokens: p.hits for k, p in state.pages.items()}


def test_counted_from_counts_hits_only_past_it() -> None:
    """spec/03 3.5: pages ending at or before counted_from keep their hits; each page
    past it gains one, as in a plain insert (07 DEV-25: the next chunk of a prefill)."""
    state = initial(config(page_size=2, device_slots=16, write_policy="write_back"))
    state, _ = put(state, Key((1, 2, 3, 4)), 1)
    state, _ = put(state, Key((1, 2, 3, 4, 5, 6, 7, 8)), 2, counted_from=4)
    assert hits(state) == {(1, 2): 1, (1, 2, 3, 4): 1, (1, 2, 3, 4, 5, 6): 1,
                           (1, 2, 3, 4, 5, 6, 7, 8): 1}
    state, _ = put(state, Key((1, 2, 3, 4, 5, 6, 7, 8)), 3, counted_from=2)
    assert hits(state) == {(1, 2): 1, (1, 2, 3, 4): 2, (1, 2, 3, 4, 5, 6): 2,
                           (1, 2, 3, 4, 5, 6, 7, 8): 2}


def test_counted_from_inside_new_pages_counts_from_there() -> None:
    state = initial(config(page_size=2, write_policy="write_back"))
    state, _ = put(state, Key((1, 2, 3, 4, 5, 6)), 1, counted_from=2)
    assert hits(state) == {(1, 2): 0, (1, 2, 3, 4): 1, (1, 2, 3, 4, 5, 6): 1}


def test_only_pages_past_counted_from_are_due() -> None:
    state = initial(config(page_size=2, write_policy="write_through"))
    state, result = put(state, Key((1, 2, 3, 4)), 1, counted_from=2)
    assert result.due == (Key((1, 2, 3, 4)),)
    # R5 (DEV-30): the due page goes with its uncounted parent, one copy, one lock.
    assert [t.pages for t in state.pending] == [(Key((1, 2)), Key((1, 2, 3, 4)))]
    assert all(state.pages[k].host is not None for k in (Key((1, 2)), Key((1, 2, 3, 4))))
    assert state.pages[Key((1, 2))].hits == 0  # copied, but still not counted


def test_a_gap_in_the_due_pages_is_copied_with_them() -> None:
    """R5: due pages with an undue page between them are one run, the gap included."""
    state = initial(config(write_policy="write_through_selective"))  # threshold 2
    state, _ = put(state, Key((1,)), 1)
    state, _ = put(state, Key((1, 2)), 2, chunked=True)  # (1, 2) counts no hit
    state, _ = put(state, Key((1, 2, 3)), 3, counted_from=2)
    assert hits(state) == {(1,): 1, (1, 2): 0, (1, 2, 3): 1}
    state, result = put(state, Key((1, 2, 3)), 4)
    assert result.due == (Key((1,)), Key((1, 2, 3)))
    assert [t.pages for t in state.pending] == [(Key((1,)), Key((1, 2)), Key((1, 2, 3)))]


def test_counted_from_the_aligned_length_is_chunked() -> None:
    base = initial(config(page_size=2, write_policy="write_through"))
    base, _ = put(base, Key((1, 2)), 1)
    base, _ = ops.writing_check(base, 1)
    chunked, c_result = put(base, Key((1, 2, 3, 4)), 2, chunked=True)
    counted, n_result = put(base, Key((1, 2, 3, 4)), 2, counted_from=4)
    assert chunked == counted and c_result == n_result
    both, b_result = put(base, Key((1, 2, 3, 4)), 2, chunked=True, counted_from=2)
    assert both == chunked and b_result == c_result  # chunked wins


@pytest.mark.parametrize("bad", [-2, 1, 6, True, 2.0, None])
def test_bad_counted_from_is_rejected_and_changes_nothing(bad: object) -> None:
    state = initial(config(page_size=2))
    state, _ = ops.alloc(state, Key((1, 2, 3, 4)), 0, (0, 1, 2, 3))
    with pytest.raises(PreconditionError, match="counted_from"):
        ops.insert(state, Key((1, 2, 3, 4, 5)), (0, 1, 2, 3, 4), 1,
                   counted_from=bad)  # type: ignore[arg-type]
    state, _ = ops.alloc(initial(config(page_size=2)), Key((1, 2, 3, 4)), 0, (0, 1, 2, 3))
    before = state
    with pytest.raises(PreconditionError, match="counted_from"):
        ops.insert(state, Key((1, 2, 3, 4)), (0, 1, 2, 3), 1,
                   counted_from=bad)  # type: ignore[arg-type]
    assert state == before


def test_backup_waits_for_the_parent_copy() -> None:
    state = initial(config(write_policy="write_through_selective"))
    state, _ = put(state, Key((1,)), 1)
    state, _ = put(state, Key((1, 2)), 2)  # (1,) now has two hits, (1, 2) one
    state, _ = ops.writing_check(state, 1)
    assert state.pages[Key((1,))].host is not None
    fresh = initial(config(write_policy="write_through_selective"))
    fresh, _ = put(fresh, Key((1, 2)), 1)  # one hit each: nothing is due yet
    assert fresh.pending == ()
    with pytest.raises(IllegalChoice, match="not 2 distinct"):
        ops.write_backup(fresh, Key((1, 2)), Backup((), (0,)))
    fresh, issued = ops.write_backup(fresh, Key((1, 2)), Backup((), (0, 1)))
    assert issued and fresh.pages[Key((1,))].host == (0,)  # the parent comes along


def test_backup_locks_the_source_until_acknowledged() -> None:
    state, _ = put(initial(config()), Key((1,)), 1)
    assert state.pages[Key((1,))].lock == 1 and state.pending
    assert ops.evict(state, 1, ())[1] == 0  # nothing is evictable while the copy runs
    with pytest.raises(PreconditionError, match="page"):
        ops.dec_lock_ref(state, Key((1,)))  # the copy's lock is not the caller's
    state, _ = ops.writing_check(state, 1)
    assert state.pages[Key((1,))].lock == 0 and state.host_kv


def test_writing_check_acknowledges_oldest_first() -> None:
    state, _ = put(initial(config()), Key((1,)), 1)
    state, _ = put(state, Key((2,)), 2)
    state, _ = ops.writing_check(state, 1)
    assert [t.pages for t in state.pending] == [(Key((2,)),)]


@pytest.mark.parametrize(("strategy", "first"), [
    ("lru", Key((1,))), ("mru", Key((2,))), ("fifo", Key((1,))), ("filo", Key((2,))),
    ("lfu", Key((2,))), ("priority", Key((2,))), ("slru", Key((2,))),
])
def test_eviction_strategies_rank_pages(strategy: str, first: Key) -> None:
    # (1,) is older, hit twice and of higher priority; (2,) is newer, hit once.
    state = initial(config(eviction=strategy, write_policy="write_back"))
    state, _ = put(state, Key((1,)), 1, priority=1)
    state, _ = put(state, Key((1,)), 2, priority=1)
    state, _ = put(state, Key((2,)), 3)
    state, _ = ops.match_prefix(state, Key((1,)), 3)
    if strategy in ("lru", "mru"):
        state, _ = ops.match_prefix(state, Key((2,)), 4)
    other = Key((2,)) if first == Key((1,)) else Key((1,))
    assert eviction_key(strategy, state.pages[first]) < eviction_key(strategy,  # type: ignore[arg-type]
                                                                     state.pages[other])
    with pytest.raises(IllegalChoice, match="ranks"):
        ops.evict(state, 1, (Victim(other, (), (0,)),))
    assert ops.evict(state, 1, (Victim(first, (), (0,)),))[1] == 1


def test_evict_may_not_stop_short_or_run_past_the_target() -> None:
    state = initial(config(write_policy="write_back"))
    state, _ = put(state, Key((1,)), 1)
    state, _ = put(state, Key((2,)), 2)
    with pytest.raises(IllegalChoice, match="stopped"):
        ops.evict(state, 1, ())
    with pytest.raises(IllegalChoice, match="target"):
        ops.evict(state, 1, (Victim(Key((1,)), (), (0,)), Victim(Key((2,)), (), (1,))))


def test_overshoot_may_finish_the_victims_chain() -> None:
    state = initial(config(write_policy="write_back"))
    state, _ = put(state, Key((1, 2)), 1)
    victims = (Victim(Key((1, 2)), (), (0,)), Victim(Key((1,)), (), (1,)))
    state, evicted = ops.evict(state, 1, victims)
    assert evicted == 2 and all(p.device is None for p in state.pages.values())


def test_write_back_drops_a_page_only_when_the_host_is_full() -> None:
    state = initial(config(write_policy="write_back", host_slots=1))
    state, _ = put(state, Key((1,)), 1)
    state, _ = put(state, Key((2,)), 2)
    state, _ = ops.evict(state, 1, (Victim(Key((1,)), (), (0,)),))
    with pytest.raises(IllegalChoice, match="evictable pages remain"):
        ops.evict(state, 1, (Victim(Key((2,))),))
    state, _ = ops.evict(state, 1, (Victim(Key((2,)), (Key((1,)),), (0,)),))
    assert set(state.pages) == {Key((2,))} and state.pages[Key((2,))].device is None


def evicted_chain(**changes: object) -> State:
    state, _ = put(initial(config(**changes)), Key((1, 2, 3, 4)), 1)
    state, _ = ops.writing_check(state, len(state.pending))
    victims = choosers.choose_evict(state, 4, random.Random(0), overshoot=False)
    return ops.evict(state, 4, victims)[0]


def test_load_back_is_all_or_nothing_and_pins_its_source() -> None:
    state = evicted_chain()
    state, loaded = ops.load_back(state, Key((1, 2, 3, 4)), None, device_slots=(4, 5, 6, 7))
    assert loaded == (4, 5, 6, 7)
    assert all(p.host_protect == 1 and p.lock == 1 for p in state.pages.values())
    assert ops.evict_host(state, 4, ())[1] == 0  # protected: nothing to evict on host
    state, _ = ops.loading_check(state, 1)
    assert all(p.host_protect == 0 and p.lock == 0 for p in state.pages.values())
    assert [state.device_kv[s] for s in loaded] == [Key((1,)), Key((1, 2)), Key((1, 2, 3)),
                                                    Key((1, 2, 3, 4))]


def test_load_back_skips_small_loads_and_loads_over_quota() -> None:
    state = evicted_chain(load_back_threshold=5)
    assert ops.load_back(state, Key((1, 2, 3, 4)), None)[1] is None
    with pytest.raises(IllegalChoice, match="skipped"):
        ops.load_back(state, Key((1, 2, 3, 4)), None, device_slots=(4, 5, 6, 7))
    state = evicted_chain()
    assert ops.load_back(state, Key((1, 2, 3, 4)), 3)[1] is None
    _, (slots, page) = ops.init_load_back(state, Key((1, 2, 3, 4)), 3)
    assert slots == () and page is None  # the deepest device ancestor: the root


def test_evict_host_takes_host_only_leaves_in_rank_order() -> None:
    state = evicted_chain()
    with pytest.raises(IllegalChoice, match="not an evictable leaf"):
        ops.evict_host(state, 1, (Key((1,)),))
    state, evicted = ops.evict_host(state, 1, (Key((1, 2, 3, 4)),))
    assert evicted == 1 and Key((1, 2, 3, 4)) not in state.pages


def test_lock_refs_nest_and_release() -> None:
    state, _ = put(initial(config(write_policy="write_back")), Key((1, 2)), 1)
    state, delta = ops.inc_lock_ref(state, Key((1, 2)))
    assert delta == -2 and state.protected_tokens == 2
    state, delta = ops.inc_lock_ref(state, Key((1,)))
    assert delta == 0 and state.pages[Key((1,))].lock == 2
    state, delta = ops.dec_lock_ref(state, Key((1, 2)))
    assert delta == 1  # (1, 2) is free again; (1,) still holds its own lock
    state, delta = ops.dec_lock_ref(state, Key((1,)))
    assert delta == 1 and state.evictable_tokens == 2
    with pytest.raises(PreconditionError, match="page"):
        ops.dec_lock_ref(state, Key((1,)))


def test_reset_empties_the_cache() -> None:
    state, _ = put(initial(config()), Key((1, 2)), 1)
    assert ops.reset(state)[0] == initial(state.config)


@pytest.mark.parametrize(("changes", "field"), [
    ({"page_size": 0}, "page_size"), ({"device_slots": 3, "page_size": 2}, "device_slots"),
    ({"host_slots": -1}, "host_slots"), ({"host_slots": 1, "page_size": 2}, "host_slots"),
    ({"write_policy": "sometimes"}, "write_policy"),
    ({"eviction": "random"}, "eviction"), ({"load_back_threshold": -1}, "load_back_threshold"),
])
def test_config_errors_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as error:
        config(**changes)
    assert error.value.field == field


def test_no_host_tier_backs_up_nothing_and_drops_on_eviction() -> None:
    """host_slots = 0 (spec/01): a device-only cache, as SGLang's RadixCache."""
    state = initial(config(host_slots=0))
    state, _ = ops.alloc(state, Key((1, 2)), 0, (0, 1))
    state, result = ops.insert(state, Key((1, 2)), (0, 1), 1)
    assert result.due == () and all(p.host is None for p in state.pages.values())
    state, freed = ops.evict(state, 2, (ops.Victim(Key((1, 2))), ops.Victim(Key((1,)))))
    assert freed == 2 and not state.pages and not check(state)


def test_bad_arguments_name_the_argument() -> None:
    state = initial(config())
    with pytest.raises(PreconditionError) as error:
        ops.alloc(state, Key((1,)), 0, (99,))
    assert error.value.argument == "slots"
    with pytest.raises(PreconditionError) as error:
        ops.insert(state, Key((1, 2)), (0,), 1)
    assert error.value.argument == "slots"
    with pytest.raises(PreconditionError) as error:
        ops.load_back(state, Key((1,)), None)
    assert error.value.argument == "page"


# -- spec/03, R7: slots move in whole pages, each in order (issue 16) --------------------

def test_insert_refuses_slots_that_are_not_whole_pages_in_order() -> None:
    state = initial(config(page_size=2))
    key = Key((1, 2, 3, 4))
    state, _ = ops.alloc(state, key, 0, (0, 2, 1, 3))  # pages 0 and 1; the KV scattered
    for bad, position in (((0, 2, 1, 3), 1), ((1, 2, 3, 0), 0), ((1, 0, 3, 2), 0)):
        with pytest.raises(PreconditionError) as caught:
            ops.insert(state, key, bad, 1)
        assert caught.value.argument == f"slots[{position}]"
    state, _ = ops.alloc(state, Key((5, 6, 7)), 0, (4, 5, 6, 7))
    with pytest.raises(PreconditionError) as caught:  # the partial tail must start its page
        ops.insert(state, Key((5, 6, 7)), (4, 5, 7), 1)
    assert caught.value.argument == "slots[2]"
    state, _ = ops.insert(state, Key((5, 6, 7)), (4, 5, 6), 1, backup=Backup((), (0, 1)))
    assert state.pages[Key((5, 6))].device == (4, 5) and state.held == {0, 1, 2, 3, 6, 7}


def test_alloc_and_free_take_whole_pages() -> None:
    state = initial(config(page_size=2))
    for bad in ((0,), (0, 2), (1, 2)):
        with pytest.raises(PreconditionError):
            ops.alloc(state, Key((1, 2)), 0, bad)
    state, _ = ops.alloc(state, Key((1, 2)), 0, (1, 0, 2, 3))
    for bad in ((1, 0), (0,), (0, 1, 3, 2)):
        with pytest.raises(PreconditionError):
            ops.free(state, bad)
    state, _ = ops.free(state, (2, 3, 0, 1))  # whole pages in any page order
    assert state.held == set()


def test_reported_slots_must_be_whole_pages_in_order() -> None:
    state = initial(config(page_size=2, write_policy="write_through"))
    state, _ = put(state, Key((1, 2)), 1)
    (copy,) = state.pending
    assert copy.dst[0] % 2 == 0 and copy.dst[1] == copy.dst[0] + 1
    state, _ = ops.writing_check(state, 1)
    state, _ = ops.evict(state, 2, (Victim(Key((1, 2))),))
    _, slots = choosers.choose_load(state, Key((1, 2)), None, random.Random(0))
    assert slots is not None
    with pytest.raises(IllegalChoice, match=r"device_slots\[0\]"):
        ops.load_back(state, Key((1, 2)), None, device_slots=slots[::-1])
    fresh = initial(config(page_size=2, write_policy="write_through"))
    fresh, _ = ops.alloc(fresh, Key((3, 4)), 0, (0, 1))
    with pytest.raises(IllegalChoice, match=r"host_slots\[0\]"):
        ops.insert(fresh, Key((3, 4)), (0, 1), 1, backup=Backup((), (3, 2)))


def test_a_release_must_release_a_lock_taken_at_that_page() -> None:
    """spec/03 3.7: a lock taken at (1, 1) cannot be released at (1,) -- that would leave
    (1, 1) locked more than its parent (INV-LOCK-MONOTONE); found by `hiradix explore`."""
    state, _ = put(initial(config(write_policy="write_back")), Key((1, 1)), 1)
    state, _ = ops.inc_lock_ref(state, Key((1, 1)))
    with pytest.raises(PreconditionError) as error:
        ops.dec_lock_ref(state, Key((1,)))
    assert error.value.argument == "page" and "no lock taken at page" in str(error.value)
    state, _ = ops.dec_lock_ref(state, Key((1, 1)))
    assert all(p.lock == 0 for p in state.pages.values())


def test_a_release_above_two_locked_children_is_refused() -> None:
    """spec/03 3.7: (1,) holds two locks, one from each locked child and none taken at
    it; releasing one there would leave a child locked more than (1,) once that child's
    own release follows (found by the implementation's exact anchor count)."""
    state = initial(config(write_policy="write_back"))
    for key in (Key((1, 1)), Key((1, 2))):
        state, _ = put(state, key, 1)
        state, _ = ops.inc_lock_ref(state, key)
    assert state.pages[Key((1,))].lock == 2
    with pytest.raises(PreconditionError, match="no lock taken at page"):
        ops.dec_lock_ref(state, Key((1,)))
    for key in (Key((1, 1)), Key((1, 2))):
        state, _ = ops.dec_lock_ref(state, key)
    assert all(p.lock == 0 for p in state.pages.values())


def test_a_copy_lock_at_a_page_is_no_caller_lock_there() -> None:
    """spec/03 3.7: a backup in flight locked at (1,) and a caller lock at (1, 1) give
    (1,) two locks, neither a caller's taken at it: a release at (1,) is refused."""
    state = initial(config(write_policy="write_through"))
    state, _ = put(state, Key((1,)), 1)  # write-through: a backup locked at (1,)
    assert any(t.lock == Key((1,)) for t in state.pending)
    state, _ = put(state, Key((1, 1)), 1)
    state, _ = ops.inc_lock_ref(state, Key((1, 1)))
    with pytest.raises(PreconditionError, match="no lock taken at page"):
        ops.dec_lock_ref(state, Key((1,)))
    state, _ = ops.dec_lock_ref(state, Key((1, 1)))
