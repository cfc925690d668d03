"""The storage operations one at a time (spec/09-storage.md).

Each operation's effect on a small state, each illegal report rejected with the state
unchanged, each fault kind, and the release of every reserved slot exactly once when a
prefetch is terminated or its request aborted at any point of its life.
"""

from __future__ import annotations

import copy
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import replace

import pytest

from hiradix_model import (
    Backup,
    Config,
    ConfigError,
    IllegalChoice,
    Key,
    PreconditionError,
    State,
    StorageSettings,
    check,
    choosers,
    initial,
    ops,
    storage_choosers,
    violations,
)
from hiradix_model.keys import page_keys
from hiradix_model.ops.storage import backup_pages
from hiradix_model.storage import Prefetch, timed_out

CONFIG = Config(page_size=2, device_slots=8, host_slots=12, write_policy="write_through",
                eviction="lru", load_back_threshold=0)
SETTINGS = StorageSettings(prefetch_threshold=2, prefetch_policy="best_effort",
                           timeout_base=4, timeout_per_ki_token=1024, timeout_max=10,
                           prefetch_token_limit=100)
IDENTITY = ("model-a", "bf16", "layer_first")
K = Key((1, 2, 3, 4, 5, 6))
PAGES = page_keys(K, 2)  # (1, 2), (1, 2, 3, 4), (1, 2, 3, 4, 5, 6)


def ok(state: State, op: Callable[..., tuple[State, object]], *args: object,
       **kwargs: object) -> tuple[State, object]:
    """Apply ``op``; every invariant must hold afterwards."""
    new, observation = op(state, *args, **kwargs)
    assert check(new) == (), violations(new)
    return new, observation


def rejected(error: type[Exception], state: State, op: Callable[..., object], *args: object,
             argument: str | None = None, **kwargs: object) -> None:
    """``op`` raises ``error`` (naming ``argument``) and leaves ``state`` as it was."""
    before = copy.deepcopy(state)
    with pytest.raises(error) as raised:
        op(state, *args, **kwargs)
    assert state == before
    if argument is not None:
        assert getattr(raised.value, "argument", None) == argument, raised.value


def attached(settings: StorageSettings = SETTINGS, config: Config = CONFIG) -> State:
    return ok(initial(config), ops.attach_storage, "memory", identity=IDENTITY,
              settings=settings)[0]


def stored_then_forgotten(settings: StorageSettings = SETTINGS) -> State:
    """K was computed, backed up to host and to storage, then evicted from both tiers."""
    s = attached(settings)
    slots = tuple(range(6))
    s, _ = ok(s, ops.alloc, K, 0, slots)
    s, _ = ok(s, ops.insert, K, slots, 1, backup=Backup((), slots))
    s, _ = ok(s, ops.writing_check, 1)
    assert s.storage is not None and [w.pages for w in s.storage.writes] == [PAGES]
    s, _ = ok(s, ops.io_storage_write, 3)
    s, _ = ok(s, ops.drain_storage_queues)
    s, _ = ok(s, ops.evict, 6, choosers.choose_evict(s, 6, random.Random(0)))
    s, _ = ok(s, ops.evict_host, 6, choosers.choose_evict_host(s, 6, random.Random(0)))
    assert not s.pages and s.storage is not None and len(s.storage.stored) == 3
    return s


def prefetch(state: State, request: str = "r", key: Key = K, now: int = 2,
             slots: tuple[int, ...] = tuple(range(6)), anchor: Key | None = None) -> State:
    return ok(state, ops.prefetch_from_storage, request, key, anchor, now,
              host_slots=slots)[0]


def only(state: State) -> Prefetch:
    assert state.storage is not None and len(state.storage.prefetches) == 1
    return state.storage.prefetches[0]


def drained(state: State) -> State:
    return ok(state, ops.drain_storage_queues)[0]


# -- attach, detach, clear -----------------------------------------------------------------


def test_attach_sets_the_backend_its_identity_and_settings() -> None:
    s, outcome = ok(initial(CONFIG), ops.attach_storage, "memory", identity=IDENTITY,
                    settings=SETTINGS)
    assert outcome == "attached"
    assert s.storage is not None
    assert (s.storage.backend, s.storage.identity, s.storage.settings) == (
        "memory", IDENTITY, SETTINGS)


def test_attaching_the_same_backend_again_updates_only_the_policy() -> None:
    s = attached()
    other = StorageSettings(prefetch_threshold=64, prefetch_policy="timeout")
    s2, outcome = ok(s, ops.attach_storage, "memory", identity=IDENTITY, settings=other)
    assert outcome == "policies updated"
    assert s2.storage is not None
    assert s2.storage.settings == replace(SETTINGS, prefetch_policy="timeout")
    assert s2.storage.identity == IDENTITY


def test_another_identity_is_refused_until_the_attached_one_is_detached() -> None:
    s = attached()
    rejected(PreconditionError, s, ops.attach_storage, "memory", identity=("other",),
             argument="identity")
    s, _ = ok(s, ops.detach_storage)
    s, outcome = ok(s, ops.attach_storage, "memory", identity=("other",))
    assert outcome == "attached"
    assert s.storage is not None and s.storage.identity == ("other",)


def test_settings_refuse_a_cap_below_the_base_timeout() -> None:
    with pytest.raises(ConfigError) as caught:
        StorageSettings(timeout_base=10, timeout_max=9)
    assert caught.value.field == "timeout_max"
    assert StorageSettings(timeout_base=10, timeout_max=10).timeout_max == 10


def test_a_different_backend_is_refused_until_the_attached_one_is_detached() -> None:
    s = attached()
    rejected(PreconditionError, s, ops.attach_storage, "file", argument="backend")
    s, _ = ok(s, ops.detach_storage)
    s, outcome = ok(s, ops.attach_storage, "file")
    assert outcome == "attached"


@pytest.mark.parametrize(("backend", "kwargs", "argument"), [
    ("", {}, "backend"),
    (3, {}, "backend"),
    ("memory", {"identity": ["model"]}, "identity"),
    ("memory", {"settings": {"prefetch_threshold": 1}}, "settings"),
    ("memory", {"retained": "yes"}, "retained"),
])
def test_attach_validates_before_any_effect(backend: object, kwargs: dict[str, object],
                                            argument: str) -> None:
    for state in (initial(CONFIG), attached()):
        rejected(PreconditionError, state, ops.attach_storage, backend, argument=argument,
                 **kwargs)


@pytest.mark.parametrize(("changes", "field"), [
    ({"prefetch_threshold": -1}, "prefetch_threshold"),
    ({"prefetch_policy": "eager"}, "prefetch_policy"),
    ({"timeout_base": 1.5}, "timeout_base"),
    ({"timeout_max": -3}, "timeout_max"),
    ({"timeout_per_ki_token": True}, "timeout_per_ki_token"),
    ({"prefetch_token_limit": "many"}, "prefetch_token_limit"),
])
def test_invalid_settings_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(ConfigError) as raised:
        StorageSettings(**changes)  # type: ignore[arg-type]
    assert raised.value.field == field


def test_detach_releases_every_prefetch_and_write_and_keeps_the_contents() -> None:
    s = stored_then_forgotten()
    s = prefetch(s)
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)
    # A second request's page is on host with its storage write in flight.
    key = Key((9, 9))
    s, _ = ok(s, ops.alloc, key, 0, (6, 7))
    s, _ = ok(s, ops.insert, key, (6, 7), 3, backup=Backup((), (6, 7)))
    s, _ = ok(s, ops.writing_check, 1)
    assert s.storage is not None and len(s.storage.writes) == 1 and s.pages[key].host_protect
    s, _ = ok(s, ops.detach_storage)
    assert s.storage is not None and s.storage.backend is None
    assert s.host_free == frozenset(range(12)) - {6, 7}
    assert s.pages[key].host_protect == 0
    assert Counter(s.storage.release_log) == Counter((0 + 1, slot) for slot in range(6))
    assert len(s.storage.stores["memory"]) == 3  # the backend keeps what was written
    again, _ = ok(s, ops.attach_storage, "memory", identity=IDENTITY, settings=SETTINGS)
    assert again.storage is not None and len(again.storage.stored) == 3
    fresh, _ = ok(s, ops.attach_storage, "memory", identity=IDENTITY, settings=SETTINGS,
                  retained=False)
    assert fresh.storage is not None and not fresh.storage.stored


def test_detach_without_storage_changes_nothing() -> None:
    s = initial(CONFIG)
    assert ops.detach_storage(s)[0] is s


def test_clear_empties_the_backend_and_refuses_when_detached() -> None:
    assert ops.clear_storage(initial(CONFIG)) == (initial(CONFIG), False)
    s = prefetch(stored_then_forgotten())
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, cleared = ok(s, ops.clear_storage)
    assert cleared and s.storage is not None and not s.storage.stored
    # What the hit query promised is gone: a page cannot arrive from an empty backend.
    rejected(IllegalChoice, s, ops.io_prefetch_fetch, "r", 1)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 0, fault="short")
    assert only(s).phase == "stopped"


def test_a_backend_of_another_identity_has_no_hits() -> None:
    s = stored_then_forgotten()
    s, _ = ok(s, ops.detach_storage)
    s, _ = ok(s, ops.attach_storage, "memory", identity=("model-b", "bf16", "layer_first"),
              settings=SETTINGS)
    assert ops.query_storage_hit_length(s, K, None, 0)[1] == 0
    rejected(IllegalChoice, s, ops.query_storage_hit_length, K, None, 1)


# -- query_storage_hit_length ----------------------------------------------------------------


def test_query_reports_the_backends_answer_in_tokens() -> None:
    s = stored_then_forgotten()
    assert ops.query_storage_hit_length(s, K, None, 3) == (s, 6)
    assert ops.query_storage_hit_length(s, K, None, 1) == (s, 2)  # a short answer is legal
    assert ops.query_storage_hit_length(s, K, PAGES[0], 2) == (s, 4)
    rejected(IllegalChoice, s, ops.query_storage_hit_length, K, None, 4)
    rejected(IllegalChoice, s, ops.query_storage_hit_length, K, PAGES[1], 2)
    rejected(PreconditionError, s, ops.query_storage_hit_length, K, Key((7, 7)), 0,
             argument="anchor")


def test_query_is_skipped_detached_short_or_rate_limited() -> None:
    assert ops.query_storage_hit_length(initial(CONFIG), K, None, 0)[1] == 0
    rejected(IllegalChoice, initial(CONFIG), ops.query_storage_hit_length, K, None, 1)
    long = stored_then_forgotten(replace(SETTINGS, prefetch_threshold=8))
    rejected(IllegalChoice, long, ops.query_storage_hit_length, K, None, 3)
    limited = stored_then_forgotten(replace(SETTINGS, prefetch_token_limit=6))
    limited = prefetch(limited, "other", Key((8, 8, 8, 8)), slots=(6, 7, 8, 9))
    assert limited.storage is not None and limited.storage.occupied_tokens == 4
    assert ops.query_storage_hit_length(limited, K, None, 3)[1] == 6  # 4 < 6: not limited
    limited = prefetch(limited, "third", Key((8, 7)), slots=(10, 11))
    rejected(IllegalChoice, limited, ops.query_storage_hit_length, K, None, 3)


# -- prefetch_from_storage ------------------------------------------------------------------------


def test_prefetch_reserves_host_slots_and_protects_its_anchor() -> None:
    s = stored_then_forgotten()
    s, reserved = ok(s, ops.prefetch_from_storage, "r", K, None, 2, host_slots=tuple(range(6)))
    assert reserved == 6
    p = only(s)
    assert (p.pages, p.reserved, p.slots, p.phase, p.start) == (
        PAGES, tuple(range(6)), tuple(range(6)), "querying", 2)
    assert s.storage is not None and s.storage.occupied_tokens == 6 and s.clock == 2
    assert s.host_free == frozenset(range(6, 12))


def test_prefetch_below_an_anchor_fetches_only_the_pages_past_it() -> None:
    s = attached()
    s, _ = ok(s, ops.alloc, Key((1, 2)), 0, (0, 1))
    s, _ = ok(s, ops.insert, Key((1, 2)), (0, 1), 1, backup=Backup((), (0, 1)))
    s, _ = ok(s, ops.prefetch_from_storage, "r", K, PAGES[0], 2, host_slots=(2, 3, 4, 5))
    assert only(s).pages == PAGES[1:] and s.pages[PAGES[0]].host_protect == 1
    rejected(PreconditionError, attached(), ops.prefetch_from_storage, "r", K, PAGES[0], 2,
             host_slots=(2, 3, 4, 5), argument="anchor")


def test_prefetch_makes_host_room_for_the_shortfall_only() -> None:
    s = stored_then_forgotten()
    # Three host-only pages, already in storage, fill half the host ...
    for index, key in enumerate((Key((7, 1)), Key((7, 2)), Key((7, 3)))):
        slots = (2 * index, 2 * index + 1)
        s, _ = ok(s, ops.alloc, key, 0, slots)
        s, _ = ok(s, ops.insert, key, slots, 2 + index, backup=Backup((), slots))
    s, _ = ok(s, ops.writing_check, 3)
    for _ in range(3):
        s, _ = ok(s, ops.io_storage_write, 1)
    s = drained(s)
    s, _ = ok(s, ops.evict, 6, choosers.choose_evict(s, 6, random.Random(0)))
    # ... and another prefetch holds four slots: two are free, K needs six.
    s = prefetch(s, "hog", Key((8, 8, 8, 8)), now=5, slots=(6, 7, 8, 9))
    assert len(s.host_free) == 2
    victims, slots = storage_choosers.choose_prefetch(s, K, None, random.Random(1))
    assert victims == (Key((7, 1)), Key((7, 2)))  # the two least recently used
    assert slots is not None and len(slots) == 6
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 6,
             host_victims=(Key((7, 2)), Key((7, 1))), host_slots=slots)  # rank order
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 6,
             host_victims=victims[:1], host_slots=slots)  # stops short
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 6,
             host_victims=(*victims, Key((7, 3))), host_slots=slots)  # past the shortfall
    s2, reserved = ok(s, ops.prefetch_from_storage, "r", K, None, 6, host_victims=victims,
                      host_slots=slots)
    assert reserved == 6 and Key((7, 3)) in s2.pages and Key((7, 1)) not in s2.pages


def only_request(state: State, request: str) -> Prefetch:
    assert state.storage is not None
    found = state.storage.prefetch_of(request)
    assert found is not None
    return found


def test_prefetch_shrinks_when_the_host_cannot_hold_every_page() -> None:
    s = stored_then_forgotten()
    s = prefetch(s, "hog", Key((8, 8, 8, 8)), slots=(0, 1, 2, 3))
    s = prefetch(s, "hog2", Key((8, 7, 8, 7)), slots=(4, 5, 6, 7))
    assert len(s.host_free) == 4  # room for two of K's three pages, nothing evictable
    victims, slots = storage_choosers.choose_prefetch(s, K, None, random.Random(0))
    assert victims == () and slots is not None and len(slots) == 4
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 3,
             host_slots=tuple(sorted(s.host_free))[:2])  # must take all that fit
    s, reserved = ok(s, ops.prefetch_from_storage, "r", K, None, 3, host_slots=slots)
    assert reserved == 4 and only_request(s, "r").pages == PAGES[:2]


def test_prefetch_is_dropped_when_what_fits_is_below_the_threshold() -> None:
    s = stored_then_forgotten(replace(SETTINGS, prefetch_threshold=6))
    s = prefetch(s, "hog", Key((8,) * 10), slots=tuple(range(10)))
    assert storage_choosers.choose_prefetch(s, K, None, random.Random(0)) == ((), None)
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 3, host_slots=(10, 11))
    s2, reserved = ok(s, ops.prefetch_from_storage, "r", K, None, 3)
    assert reserved == 0 and s2.storage == s.storage and s2.host_free == s.host_free


@pytest.mark.parametrize("why", ["detached", "short", "rate limited", "no pages"])
def test_a_prefetch_not_worth_starting_reports_nothing(why: str) -> None:
    key = Key((1,)) if why == "no pages" else K
    if why == "short":
        s = stored_then_forgotten(replace(SETTINGS, prefetch_threshold=8))
    elif why == "rate limited":
        s = stored_then_forgotten(replace(SETTINGS, prefetch_token_limit=2))
        s = prefetch(s, "hog", Key((8, 8)), slots=(0, 1))
    else:
        s = stored_then_forgotten()
    if why == "detached":
        s = ok(s, ops.detach_storage)[0]
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", key, None, 3,
             host_slots=(10, 11))
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", key, None, 3,
             host_victims=(PAGES[0],))
    s2, reserved = ok(s, ops.prefetch_from_storage, "r", key, None, 3)
    assert reserved == 0 and s2.storage == s.storage and s2.host_free == s.host_free


def test_prefetch_preconditions_name_the_argument() -> None:
    s = prefetch(stored_then_forgotten())
    rejected(PreconditionError, s, ops.prefetch_from_storage, "r", K, None, 3,
             argument="request")  # already prefetching
    rejected(PreconditionError, s, ops.prefetch_from_storage, "", K, None, 3,
             argument="request")
    rejected(PreconditionError, s, ops.prefetch_from_storage, "q", K, None, 1, argument="now")
    rejected(PreconditionError, s, ops.prefetch_from_storage, "q", (1, 2), None, 3,
             argument="key")
    rejected(PreconditionError, s, ops.prefetch_from_storage, "q", K, Key((1, 2), "ns"), 3,
             argument="anchor")


@pytest.mark.parametrize("bad", ["taken", "count", "repeat", "foreign"])
def test_illegal_reserved_slots_are_rejected(bad: str) -> None:
    s = stored_then_forgotten()
    s = prefetch(s, "hog", Key((8, 8)), slots=(0, 1))
    slots = {"taken": (1, 2, 3, 4, 5, 6), "count": (2, 3, 4, 5), "repeat": (2, 2, 3, 4, 5, 6),
             "foreign": (2, 3, 4, 5, 6, 12)}[bad]
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 3, host_slots=slots)
    rejected(IllegalChoice, s, ops.prefetch_from_storage, "r", K, None, 3, host_slots=None)


# -- the hit query and the fetch ---------------------------------------------------------


def test_query_below_the_threshold_revokes_and_queues_every_slot() -> None:
    s = prefetch(stored_then_forgotten(replace(SETTINGS, prefetch_threshold=4)))
    s, revoked = ok(s, ops.io_prefetch_query, "r", 1)
    assert revoked
    p = only(s)
    assert (p.phase, p.slots, p.hit_pages) == ("revoked", (), 0)
    assert s.storage is not None and s.storage.revoke_queue == (p.id,)
    assert sorted(s.storage.release_queue) == list(range(6))
    s, counts = ok(s, ops.drain_storage_queues)
    assert counts == (1, 0, 6)
    assert s.storage is not None and not s.storage.prefetches
    assert s.host_free == frozenset(range(12)) and s.storage.occupied_tokens == 0


def test_query_with_fewer_hits_releases_the_pages_past_them() -> None:
    s = prefetch(stored_then_forgotten())
    s, revoked = ok(s, ops.io_prefetch_query, "r", 2)
    assert not revoked
    p = only(s)
    assert (p.phase, p.slots, p.hit_pages) == ("fetching", (0, 1, 2, 3), 2)
    assert s.storage is not None and s.storage.release_queue == (4, 5)
    rejected(IllegalChoice, prefetch(stored_then_forgotten()), ops.io_prefetch_query, "r", 4)
    rejected(PreconditionError, s, ops.io_prefetch_query, "r", 2, argument="request")


def test_fetched_pages_land_with_their_stored_bytes() -> None:
    s = prefetch(stored_then_forgotten())
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, landed = ok(s, ops.io_prefetch_fetch, "r", 2)
    assert landed == 2 and only(s).landed == 2 and only(s).phase == "fetching"
    assert [s.host_kv[slot] for slot in (2, 3)] == [Key((1, 2, 3)), Key((1, 2, 3, 4))]
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)
    assert only(s).phase == "stopped" and only(s).slots == tuple(range(6))


FAULTS = {
    # fault: (pages landed in the faulty step, phase after, slots the I/O gives back)
    "raise": (0, "stopped", (2, 3, 4, 5)),
    "short": (1, "stopped", (4, 5)),
    "corrupt": (1, "stopped", (4, 5)),
    "slow": (0, "fetching", ()),
    "dead": (1, "dead", ()),
}


@pytest.mark.parametrize("fault", sorted(FAULTS))
def test_each_fetch_fault(fault: str) -> None:
    s = prefetch(stored_then_forgotten())
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)
    count, phase, released = FAULTS[fault]
    s, _ = ok(s, ops.io_prefetch_fetch, "r", count, fault=fault)
    p = only(s)
    assert (p.landed, p.phase) == (1 + count, phase)
    assert s.storage is not None and s.storage.release_queue == released
    if fault == "corrupt":
        assert 4 not in s.host_kv and 5 not in s.host_kv  # garbage, and never inserted
        assert s.storage is not None
        assert s.storage.sid(PAGES[2]) not in s.storage.stored  # discarded (DEV-S11)
        assert s.storage.sid(PAGES[1]) in s.storage.stored
    s, done = ok(s, ops.check_prefetch_progress, "r", 3)
    assert done
    assert set(s.pages) == set(PAGES[: 1 + count])
    assert all(s.pages[k].device is None and s.pages[k].host for k in PAGES[: 1 + count])
    s = drained(s)
    assert len(s.host_free) == 12 - 2 * (1 + count)


def test_a_page_storage_lacks_cannot_arrive_corrupt() -> None:
    s = prefetch(stored_then_forgotten())
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)
    s, _ = ok(s, ops.clear_storage)
    rejected(IllegalChoice, s, ops.io_prefetch_fetch, "r", 0, fault="corrupt")
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 0, fault="short")  # a miss instead
    assert only(s).phase == "stopped"


@pytest.mark.parametrize(("count", "fault"), [
    (0, None), (1, "raise"), (1, "slow"), (2, "short"), (2, "corrupt"), (2, "dead"), (3, None),
    (-1, "short"),
])
def test_impossible_fetch_reports_are_rejected(count: int, fault: str | None) -> None:
    s = prefetch(stored_then_forgotten())
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)  # two pages left
    rejected(IllegalChoice, s, ops.io_prefetch_fetch, "r", count, fault=fault)


def test_fetch_preconditions() -> None:
    s = prefetch(stored_then_forgotten())
    rejected(PreconditionError, s, ops.io_prefetch_fetch, "r", 1, argument="request")
    rejected(PreconditionError, s, ops.io_prefetch_fetch, "nobody", 1, argument="request")
    s, _ = ok(s, ops.io_prefetch_query, "r", 3)
    rejected(PreconditionError, s, ops.io_prefetch_fetch, "r", 1, fault="lost",
             argument="fault")


# -- check_prefetch_progress: policies and insertion -----------------------------------------------


def queried(policy: str, hits: int = 3, landed: int = 0) -> State:
    s = prefetch(stored_then_forgotten(replace(SETTINGS, prefetch_policy=policy)))  # type: ignore[arg-type]
    s, _ = ok(s, ops.io_prefetch_query, "r", hits)
    if landed:
        s, _ = ok(s, ops.io_prefetch_fetch, "r", landed)
    return s


def test_best_effort_ends_at_once_with_what_has_landed() -> None:
    s, done = ok(queried("best_effort", landed=1), ops.check_prefetch_progress, "r", 2)
    assert done and set(s.pages) == {PAGES[0]}
    assert s.storage is not None and s.storage.release_queue == (2, 3, 4, 5)
    assert s.storage.loaded_tokens == {"r": 2}
    s, tokens = ok(s, ops.pop_prefetch_loaded_tokens, "r")
    assert tokens == 2 and ops.pop_prefetch_loaded_tokens(s, "r")[1] == 0


def test_wait_complete_waits_for_every_hit_page() -> None:
    s = queried("wait_complete", landed=2)
    s, done = ok(s, ops.check_prefetch_progress, "r", 1000)
    assert not done and only(s).landed == 2
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 1)
    s, done = ok(s, ops.check_prefetch_progress, "r", 1000)
    assert done and set(s.pages) == set(PAGES)
    assert s.storage is not None and s.storage.loaded_tokens == {"r": 6}


def test_wait_complete_waits_on_a_dead_io_until_terminated() -> None:
    s = queried("wait_complete", landed=1)
    s, _ = ok(s, ops.io_prefetch_fetch, "r", 0, fault="dead")
    assert not ok(s, ops.check_prefetch_progress, "r", 10**6)[1]
    s, _ = ok(s, ops.terminate_prefetch, "r")
    s, done = ok(s, ops.check_prefetch_progress, "r", 10**6)
    assert done and set(s.pages) == {PAGES[0]}


def test_timeout_ends_a_prefetch_only_past_its_linear_deadline() -> None:
    # base 4 ticks + 1 tick per token, at most 10: three pages (6 tokens) get 10 ticks.
    s = queried("timeout", landed=1)
    assert only(s).start == 2
    s, done = ok(s, ops.check_prefetch_progress, "r", 12)
    assert not done
    s, done = ok(s, ops.check_prefetch_progress, "r", 13)
    assert done and set(s.pages) == {PAGES[0]}
    # One hit page (2 tokens): 6 ticks. Complete before then: it ends at once.
    short = queried("timeout", hits=1)
    assert not ok(short, ops.check_prefetch_progress, "r", 8)[1]
    assert ok(short, ops.check_prefetch_progress, "r", 9)[1]
    complete = ok(short, ops.io_prefetch_fetch, "r", 1)[0]
    assert ok(complete, ops.check_prefetch_progress, "r", 2)[1]


def test_timeout_formula_is_exact_and_capped() -> None:
    settings = StorageSettings(timeout_base=2000, timeout_per_ki_token=100, timeout_max=30000)
    assert not timed_out(settings, 2100, 1024) and timed_out(settings, 2101, 1024)
    assert not timed_out(settings, 2000, 0) and timed_out(settings, 2001, 0)
    assert timed_out(settings, 30001, 10**9) and not timed_out(settings, 30000, 10**9)
    assert not timed_out(settings, 2000, 5)  # 2000.49 ticks: not yet past at 2000
    assert timed_out(settings, 2001, 5)


def test_a_revoked_prefetch_under_timeout_ends_after_the_base_time() -> None:
    s = prefetch(stored_then_forgotten(replace(SETTINGS, prefetch_policy="timeout")))
    s, _ = ok(s, ops.io_prefetch_query, "r", 0)
    assert not ok(s, ops.check_prefetch_progress, "r", 6)[1]
    s, done = ok(s, ops.check_prefetch_progress, "r", 7)
    assert done and not s.pages
    s, counts = ok(s, ops.drain_storage_queues)  # the revoke finds nothing left to end
    assert counts == (1, 0, 6) and s.host_free == frozenset(range(12))


def test_landed_pages_already_cached_are_freed_and_the_rest_inserted() -> None:
    s = queried("best_effort", landed=3)
    # Meanwhile another request computed the first page again and backed it up.
    first = PAGES[0]
    s, _ = ok(s, ops.alloc, first, 0, (0, 1))
    s, _ = ok(s, ops.insert, first, (0, 1), 5, backup=Backup((), (6, 7)))
    s, done = ok(s, ops.check_prefetch_progress, "r", 6)
    assert done
    assert s.pages[first].host == (6, 7)  # kept its own copy; the fetched one is freed
    assert {s.pages[k].host for k in PAGES[1:]} == {(2, 3), (4, 5)}
    assert all(s.pages[k].device is None and s.pages[k].insert_tick == 6 for k in PAGES[1:])
    assert s.storage is not None and s.storage.loaded_tokens == {"r": 4}
    assert {0, 1} <= s.host_free


def test_insertion_stops_at_a_cached_page_without_a_host_copy() -> None:
    s = queried("best_effort", landed=3)
    s = prefetch(s, "hog", Key((8, 8, 8, 8, 8, 8)), slots=tuple(range(6, 12)))
    # Another request computed the first page, and its backup found no host room: it is
    # cached on device only. A host-only page below it would break backup contiguity.
    first = PAGES[0]
    s, _ = ok(s, ops.alloc, first, 0, (0, 1))
    s, _ = ok(s, ops.insert, first, (0, 1), 5, backup=Backup((), None))
    assert s.pages[first].host is None
    s, done = ok(s, ops.check_prefetch_progress, "r", 6)
    assert done and set(s.pages) == {first}
    assert s.storage is not None and s.storage.loaded_tokens == {"r": 0}
    assert s.host_free == frozenset(range(6))  # every fetched copy freed at once


def test_a_request_without_a_prefetch_is_done_at_once() -> None:
    for s in (initial(CONFIG), attached()):
        s2, done = ok(s, ops.check_prefetch_progress, "r", 4)
        assert done and s2.clock == 4
    rejected(PreconditionError, replace(attached(), clock=5), ops.check_prefetch_progress,
             "r", 4, argument="now")


# -- terminate and abort at every point of a prefetch's life --------------------------------


def life_points() -> dict[str, Callable[[State], State]]:
    def q(s: State, hits: int = 3) -> State:
        return ok(s, ops.io_prefetch_query, "r", hits)[0]

    def f(s: State, n: int, fault: str | None = None) -> State:
        return ok(s, ops.io_prefetch_fetch, "r", n, fault=fault)[0]

    return {
        "querying": lambda s: s,
        "revoked": lambda s: q(s, 0),
        "revoked and drained": lambda s: drained(q(s, 0)),
        "fetching, none landed": lambda s: q(s),
        "fetching, one landed": lambda s: f(q(s), 1),
        "fetching, fewer hits": lambda s: f(q(s, 2), 1),
        "slow": lambda s: f(f(q(s), 1), 0, "slow"),
        "stopped by a raise": lambda s: f(f(q(s), 1), 0, "raise"),
        "stopped short": lambda s: f(q(s), 1, "short"),
        "stopped by corruption": lambda s: f(q(s), 1, "corrupt"),
        "dead": lambda s: f(q(s), 1, "dead"),
        "complete": lambda s: f(q(s), 3),
        "complete and drained": lambda s: drained(f(q(s), 3)),
    }


def _released_exactly_once(state: State, prefetch_id: int) -> None:
    assert state.storage is not None
    log = Counter(slot for i, slot in state.storage.release_log if i == prefetch_id)
    assert log == Counter(range(6)), log  # every reserved slot, once
    owned = {s for p in state.pages.values() for s in p.host or ()}
    assert owned | state.host_free == set(range(12))
    assert not owned & state.host_free


@pytest.mark.parametrize("point", sorted(life_points()))
@pytest.mark.parametrize("end", ["terminate", "abort", "detach"])
def test_ending_at_any_point_releases_every_reserved_slot_once(point: str, end: str) -> None:
    s = life_points()[point](prefetch(stored_then_forgotten()))
    prefetch_id = 1
    assert s.storage is not None
    if end == "terminate":
        s, _ = ok(s, ops.terminate_prefetch, "r")
        s, _ = ok(s, ops.terminate_prefetch, "r")  # twice: the second is a no-op
        if s.storage is not None and s.storage.prefetch_of("r") is not None:
            assert only(s).terminated
            rejected(PreconditionError, s, ops.io_prefetch_fetch, "r", 1)
        s, done = ok(s, ops.check_prefetch_progress, "r", 100)
        assert done
    elif end == "abort":
        s, _ = ok(s, ops.release_aborted_request, "r")
        assert s.storage is not None and "r" not in s.storage.loaded_tokens
        assert not any(p.host for p in s.pages.values())  # an aborted fetch inserts nothing
    else:
        s, _ = ok(s, ops.detach_storage)
    s = drained(s)
    assert s.storage is not None and not s.storage.prefetches
    assert s.storage.occupied_tokens == 0
    _released_exactly_once(s, prefetch_id)
    # Ending again, by any route, releases nothing more.
    for again in (ops.terminate_prefetch, ops.release_aborted_request):
        s2 = drained(ok(s, again, "r")[0])
        assert s2.storage is not None and s2.storage.release_log == s.storage.release_log


# -- backup to storage -------------------------------------------------------------------------


def backed_up(policy: str = "write_through") -> State:
    config = replace(CONFIG, write_policy=policy)  # type: ignore[arg-type]
    s = attached(config=config)
    slots = tuple(range(6))
    s, _ = ok(s, ops.alloc, K, 0, slots)
    if policy == "write_back":
        s, _ = ok(s, ops.insert, K, slots, 1)
        return ok(s, ops.write_backup, PAGES[-1], Backup((), slots))[0]
    return ok(s, ops.insert, K, slots, 1, backup=Backup((), slots))[0]


@pytest.mark.parametrize("policy", ["write_through", "write_back"])
def test_an_acknowledged_host_copy_is_written_to_storage(policy: str) -> None:
    s = backed_up(policy)
    assert s.storage is not None and not s.storage.writes  # not before the copy lands
    s, _ = ok(s, ops.writing_check, 1)
    assert s.storage is not None and [(w.pages, w.phase) for w in s.storage.writes] == [
        (PAGES, "running")]
    assert all(s.pages[k].host_protect == 1 for k in PAGES)
    s, _ = ok(s, ops.io_storage_write, 2)
    assert s.storage is not None and len(s.storage.stored) == 2
    s, _ = ok(s, ops.io_storage_write, 1)
    assert s.storage is not None and s.storage.writes[0].phase == "acked"
    assert all(s.pages[k].host_protect == 1 for k in PAGES)  # until the ack is drained
    s, counts = ok(s, ops.drain_storage_queues)
    assert counts == (0, 1, 0) and all(s.pages[k].host_protect == 0 for k in PAGES)
    assert s.storage is not None and s.storage.stored[s.storage.sid(PAGES[1])] == (
        Key((1, 2, 3)), Key((1, 2, 3, 4)))


def test_only_pages_the_backend_lacks_are_written() -> None:
    s = stored_then_forgotten()
    s, _ = ok(s, ops.alloc, K, 0, tuple(range(6)))
    s, _ = ok(s, ops.insert, K, tuple(range(6)), 5, backup=Backup((), tuple(range(6))))
    s, _ = ok(s, ops.writing_check, 1)
    assert s.storage is not None and not s.storage.writes  # every page is stored already
    assert all(s.pages[k].host_protect == 0 for k in PAGES)
    longer = Key((*K.tokens, 7, 8))
    s, _ = ok(s, ops.alloc, longer, 6, (6, 7))
    s, _ = ok(s, ops.insert, longer, (*range(6), 6, 7), 6, backup=Backup((), (6, 7)))
    s, _ = ok(s, ops.writing_check, 1)
    assert s.storage is not None and [w.pages for w in s.storage.writes] == [(longer,)]


WRITE_FAULTS = {"raise": (0, "acked"), "short": (1, "acked"), "slow": (0, "running"),
                "dead": (2, "dead")}


@pytest.mark.parametrize("fault", sorted(WRITE_FAULTS))
def test_each_write_fault(fault: str) -> None:
    s = ok(backed_up(), ops.writing_check, 1)[0]
    count, phase = WRITE_FAULTS[fault]
    s, _ = ok(s, ops.io_storage_write, count, fault=fault)
    assert s.storage is not None and s.storage.writes[0].phase == phase
    assert len(s.storage.stored) == count
    s = drained(s)
    protected = phase in ("running", "dead")
    assert all(bool(s.pages[k].host_protect) == protected for k in PAGES)
    if fault == "dead":
        rejected(PreconditionError, s, ops.io_storage_write, 1, argument="pages")
        s, _ = ok(s, ops.detach_storage)  # only detach releases a dead write
        assert all(s.pages[k].host_protect == 0 for k in PAGES)


def test_impossible_write_reports_are_rejected() -> None:
    s = ok(backed_up(), ops.writing_check, 1)[0]
    for count, fault in ((0, None), (4, None), (1, "raise"), (3, "short"), (3, "dead")):
        rejected(IllegalChoice, s, ops.io_storage_write, count, fault=fault)
    rejected(PreconditionError, s, ops.io_storage_write, 1, fault="corrupt", argument="fault")
    rejected(PreconditionError, attached(), ops.io_storage_write, 1, argument="pages")


def test_a_page_being_written_cannot_be_host_evicted() -> None:
    s = ok(backed_up(), ops.writing_check, 1)[0]
    s, _ = ok(s, ops.evict, 6, choosers.choose_evict(s, 6, random.Random(0)))
    assert all(s.pages[k].device is None for k in PAGES)
    rejected(IllegalChoice, s, ops.evict_host, 2, (PAGES[-1],))
    assert ops.evict_host(s, 2, ())[1] == 0
    s, _ = ok(s, ops.io_storage_write, 3)
    s = drained(s)
    s, freed = ok(s, ops.evict_host, 2, (PAGES[-1],))
    assert freed == 2


def test_write_back_eviction_backs_up_to_storage_and_keeps_a_protected_subtree() -> None:
    config = replace(CONFIG, write_policy="write_back", host_slots=4)
    s = attached(config=config)
    parent, child = Key((1, 2)), Key((1, 2, 3, 4))
    s, _ = ok(s, ops.alloc, child, 0, (0, 1, 2, 3))
    s, _ = ok(s, ops.insert, child, (0, 1, 2, 3), 1)
    s, _ = ok(s, ops.evict, 2, (ops.Victim(child, (), (0, 1)),))
    # The evicted child was copied to host and is being written to storage.
    assert s.storage is not None and [w.pages for w in s.storage.writes] == [(child,)]
    assert s.pages[child].host_protect == 1
    filler = Key((5, 5))
    s, _ = ok(s, ops.alloc, filler, 0, (4, 5))
    s, _ = ok(s, ops.insert, filler, (4, 5), 2)
    s, _ = ok(s, ops.write_backup, filler, Backup((), (2, 3)))
    s, _ = ok(s, ops.writing_check, 1)
    s = ok(s, ops.io_storage_write, 1)[0]  # the child's write finishes ...
    assert s.storage is not None and s.storage.writes[0].phase == "acked"  # ... not drained
    # No host room, and the parent's only host-only descendant is protected: the parent
    # can be neither copied nor dropped. It stays; the filler goes (it is on host).
    victims = choosers.choose_evict(s, 4, random.Random(0))
    assert [v.page for v in victims] == [parent, filler]
    s, evicted = ok(s, ops.evict, 4, victims)
    assert evicted == 2 and s.pages[parent].device is not None
    assert s.pages[filler].device is None


# -- queues, reset ---------------------------------------------------------------------------


def test_drain_takes_the_oldest_entries_and_validates_its_counts() -> None:
    s = prefetch(stored_then_forgotten(replace(SETTINGS, prefetch_threshold=6)))
    s, _ = ok(s, ops.io_prefetch_query, "r", 2)  # revoked
    assert s.storage is not None and len(s.storage.release_queue) == 6
    s, counts = ok(s, ops.drain_storage_queues, revokes=0, acks=0, releases=2)
    assert counts == (0, 0, 2) and s.host_free == frozenset(range(6, 12)) | {0, 1}
    for name in ("revokes", "acks", "releases"):
        rejected(PreconditionError, s, ops.drain_storage_queues, argument=name, **{name: 9})
        rejected(PreconditionError, initial(CONFIG), ops.drain_storage_queues,
                 argument=name, **{name: 1})
    assert ops.drain_storage_queues(initial(CONFIG)) == (initial(CONFIG), (0, 0, 0))


def test_reset_keeps_the_backend_and_its_contents_and_forgets_the_rest() -> None:
    s = ok(prefetch(stored_then_forgotten()), ops.io_prefetch_query, "r", 3)[0]
    s, _ = ops.reset(s)
    assert check(s) == ()
    assert s.storage is not None and s.storage.backend == "memory"
    assert len(s.storage.stored) == 3 and not s.storage.prefetches
    assert s.host_free == frozenset(range(12))
    assert ops.reset(initial(CONFIG))[0] == initial(CONFIG)


def test_base_operations_leave_a_state_without_storage_without_storage() -> None:
    s = initial(CONFIG)
    s, _ = ok(s, ops.alloc, K, 0, tuple(range(6)))
    s, _ = ok(s, ops.insert, K, tuple(range(6)), 1, backup=Backup((), tuple(range(6))))
    s, _ = ok(s, ops.writing_check, 1)
    s, _ = ok(s, ops.evict, 6, choosers.choose_evict(s, 6, random.Random(0)))
    assert s.storage is None


# -- backup_pages: only acknowledged host copies are written (INV-STORAGE-WRITE-SOURCE) -----


def test_backup_pages_refuses_a_host_copy_in_flight_and_writes_it_once_landed() -> None:
    s = initial(CONFIG)
    slots = tuple(sorted(s.device_free)[:len(K.tokens)])
    s, _ = ops.alloc(s, K, 0, slots)
    s, _ = ops.insert(s, K, slots, 1, backup=Backup((), (0, 1, 2, 3, 4, 5)))
    rejected(PreconditionError, s, backup_pages, K, 0, 3, argument="backend")
    s, _ = ok(s, ops.attach_storage, "memory", identity=IDENTITY, settings=SETTINGS)
    for start, end in ((0, 3), (2, 3), (1, 2)):  # the copy is in flight: refused
        rejected(PreconditionError, s, backup_pages, K, start, end, argument="run")
    for start, end in ((0, 0), (2, 4), (True, 2), (-1, 1)):
        rejected(PreconditionError, s, backup_pages, K, start, end, argument="run")
    landed, _ = ok(s, ops.writing_check, 1)  # S-R1 issues the write of all three pages
    assert [w.pages for w in landed.storage.writes] == [PAGES]  # type: ignore[union-attr]
    again, issued = ok(landed, backup_pages, K, 1, 3)  # not stored yet: written again
    assert issued and again.storage.writes[-1].pages == PAGES[1:]  # type: ignore[union-attr]
    assert again.pages[PAGES[1]].host_protect == 2
    stored, _ = ok(landed, ops.io_storage_write, 3)
    same, issued = ok(stored, backup_pages, K, 0, 3)
    assert not issued and same == stored  # all stored: nothing to write
