"""The host tier of the (FULL, SWA) model (spec/13, 13.8a): each operation's effect, each
refusal, a failing test for each invariant, and device and host operations together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from swa_mutants import PATH, SWA_MUTANTS, healthy, with_host

from hiradix_model import Key
from hiradix_model import hybrid as H
from hiradix_model.errors import ConfigError, IllegalChoice, PreconditionError
from hiradix_model.hybrid.evict import _delete
from hiradix_model.hybrid.state import full_leaves, swa_candidates

HOST_IDS = ("INV-SWA-HOST-TREE-WELL-FORMED", "INV-SWA-HOST-ONLY-WITH-FULL",
            "INV-SWA-HOST-FULL-POOL", "INV-SWA-HOST-POOL", "INV-SWA-HOST-CONTENT")


def deep(n: int) -> Key:
    return Key(PATH.tokens[:n])


def demoted() -> H.SwaState:
    """``with_host(healthy())`` unlocked, the held pair freed, and every device page
    evicted: the whole path host-only, its last 4 pages with SWA host copies."""
    s = H.free(H.dec_lock_ref(with_host(healthy()), PATH, False), (12,))
    s, freed = H.evict_full(s, 12, [deep(n) for n in range(12, 0, -1)])
    assert freed == 12 and s.pages == {} and len(s.host) == 12
    return s


# ---- backup ----

def test_backup_copies_the_window_only_where_a_full_host_copy_is() -> None:
    s = H.dec_lock_ref(with_host(healthy()), PATH, False)
    assert [k for k, p in s.host.items() if p.swa is not None] == [deep(n) for n in (9, 10, 11, 12)]
    assert H.violations(s) == []
    # A backup of the deepest page alone: its ancestors have no host copy, so only its
    # own SWA KV goes (SGLang's write-back copies theirs too: DEV-H11).
    alone = H.free(H.dec_lock_ref(healthy(), PATH, False), (12,))
    alone = replace(alone, config=replace(alone.config, host_full_slots=4, host_swa_slots=4),
                    host_full_free=frozenset(range(4)), host_swa_free=frozenset(range(4)))
    assert H.swa_backup_targets(alone, PATH) == [PATH]
    after = H.backup(alone, PATH, (0,), (1,))
    assert after.host == {PATH: H.SwaHostPage(full=(0,), swa=(1,))}
    assert after.host_full_kv[0] == after.full_kv[11] and after.host_swa_kv[1] == after.swa_kv[3]


def test_backup_stops_at_a_page_without_swa_anywhere() -> None:
    """deep(10)'s window is deep(7..10): deep(8) is a device tombstone without an SWA
    host copy, so the walk stops there (components/swa.py:135-138) and deep(7) is never
    reached; a tombstone has nothing to copy."""
    s = _small_host()
    s = H.backup(s, deep(9), (0,), (0,))
    assert H.swa_backup_targets(s, deep(10)) == [deep(10)]
    assert H.swa_backup_targets(s, deep(8)) == []
    s = H.backup(s, deep(8), (1,), ())
    assert s.host[deep(8)] == H.SwaHostPage(full=(1,), swa=None) and H.violations(s) == []


@pytest.mark.parametrize("call, argument", [
    (lambda s: H.backup(s, Key((*PATH.tokens, 13)), (), ()), "page"),
    (lambda s: H.backup(s, Key((7,)), (), ()), "page"),  # held, not cached
    (lambda s: H.backup(s, PATH, (0, 1), ()), "full"),
    (lambda s: H.backup(s, PATH, (20,), ()), "full"),
    (lambda s: H.backup(s, PATH, (0,), ()), "swa"),  # its SWA target needs a slot
    (lambda s: H.backup(s, PATH, (0,), (9,)), "swa"),
])
def test_bad_backups_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    s = _small_host()
    with pytest.raises(PreconditionError) as error:
        call(s)
    assert error.value.argument == argument
    assert s == _small_host()


def _small_host() -> H.SwaState:
    s = healthy()
    return replace(s, config=replace(s.config, host_full_slots=4, host_swa_slots=4),
                   host_full_free=frozenset(range(4)), host_swa_free=frozenset(range(4)))


# ---- evict_host_full, evict_host_swa ----

def test_host_full_eviction_takes_host_leaves_only() -> None:
    s = demoted()
    assert H.host_leaves(s) == {PATH}
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_host_full(s, 1, [deep(11)])
    s2, freed = H.evict_host_full(s, 2, [PATH, deep(11)])
    assert freed == 2 and set(s2.host) == {deep(n) for n in range(1, 11)}
    assert len(s2.host_swa_free) == len(s.host_swa_free) + 2  # their SWA host copies too
    with pytest.raises(IllegalChoice, match="could still go"):
        H.evict_host_full(s, 2, [PATH])
    assert H.violations(s2) == []


def test_a_device_pages_host_copy_is_a_host_leaf_unless_a_host_only_child_needs_it() -> None:
    s = H.dec_lock_ref(with_host(healthy()), PATH, False)
    s, _ = H.evict_full(s, 1, [PATH])  # PATH host-only now; deep(11) on both tiers
    assert PATH in H.host_leaves(s) and deep(11) not in H.host_leaves(s)
    assert deep(3) in H.host_leaves(s)  # a duplicate of a device page, no host-only child
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_host_full(s, 1, [deep(11)])
    s2, _ = H.evict_host_full(s, 1, [PATH])
    assert deep(11) in H.host_leaves(s2)
    s3, freed = H.evict_host_full(s2, 1, [deep(11)])  # a duplicate of a device page
    assert freed == 1 and deep(11) in s3.pages and deep(11) not in s3.host


def test_host_swa_eviction_tombstones_inner_pages_and_deletes_host_only_leaves() -> None:
    s = demoted()
    s2, freed = H.evict_host_swa(s, 1, [deep(10)])
    assert freed == 1 and s2.host[deep(10)].swa is None and s2.host[deep(10)].full
    s3, freed = H.evict_host_swa(s, 1, [PATH])
    assert freed == 1 and PATH not in s3.host  # a host leaf goes whole
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_host_swa(s, 1, [deep(8)])  # a host tombstone already
    assert H.violations(s2) == [] and H.violations(s3) == []


def alone_demoted() -> H.SwaState:
    """healthy() unlocked with only PATH backed up, then PATH evicted from the device:
    PATH host-only under deep(11), which is on the device without a host copy."""
    s = H.free(H.dec_lock_ref(_small_host(), PATH, False), (12,))
    s, _ = H.evict_full(H.backup(s, PATH, (0,), (1,)), 1, [PATH])
    assert PATH not in s.pages and deep(11) not in s.host
    return s


def test_a_device_page_with_a_host_only_child_and_no_host_copy_is_no_full_leaf() -> None:
    s = alone_demoted()
    assert deep(11) not in full_leaves(s)
    with pytest.raises(IllegalChoice, match="may not be taken"):
        H.evict_full(s, 1, [deep(11)])
    s2, _ = H.evict_host_full(s, 1, [PATH])
    assert deep(11) in full_leaves(s2)
    s3, _ = H.evict_full(s2, 1, [deep(11)])
    assert H.violations(s3) == []


# ---- match_prefix_host, load_back ----

def test_a_host_hit_is_loaded_back_and_then_matched_on_the_device() -> None:
    s = demoted()
    assert H.match_prefix(s, PATH).last_page is None
    m = H.match_prefix_host(s, PATH)
    assert m.last_page == PATH and m.load == tuple(deep(n) for n in range(1, 13))
    assert not list(H.host_match_problems(s, PATH, m.last_page))
    s2 = H.load_back(s, PATH, tuple(range(12)), (4, 5, 6, 7))
    assert H.violations(s2) == []
    assert H.match_prefix(s2, PATH).last_page == PATH
    assert [s2.pages[deep(n)].live for n in range(1, 13)] == [False] * 8 + [True] * 4
    assert s2.host == s.host  # host copies stay


def test_load_back_heals_device_tombstones_in_the_window_from_host() -> None:
    s = H.dec_lock_ref(with_host(healthy()), PATH, False)
    s, _ = H.evict_swa(s, 3, [deep(9), deep(10), deep(11)])  # device tombstones
    assert H.match_prefix(s, PATH).last_page is None
    assert H.match_prefix_host(s, PATH) == H.SwaHostMatch(
        device_slots=tuple(range(12)), load=(), last_page=PATH)
    s2 = H.load_back(s, PATH, (), (0, 1, 2))
    assert H.match_prefix(s2, PATH).last_page == PATH and H.violations(s2) == []


def test_load_back_refuses_a_window_with_no_swa_anywhere() -> None:
    s, _ = H.evict_host_swa(demoted(), 1, [deep(10)])
    assert H.match_prefix_host(s, PATH).last_page is None  # no window has SWA anywhere
    with pytest.raises(PreconditionError, match="SWA KV on no tier") as error:
        H.load_back(s, PATH, tuple(range(12)), (4, 5, 6))
    assert error.value.argument == "page"
    with pytest.raises(PreconditionError, match="nothing to load"):
        H.load_back(H.dec_lock_ref(healthy(), PATH, False), PATH, (), ())


@pytest.mark.parametrize("call, argument", [
    (lambda s: H.load_back(s, Key((*PATH.tokens, 13)), (), ()), "page"),
    (lambda s: H.load_back(s, PATH, tuple(range(11)), (4, 5, 6, 7)), "full"),
    (lambda s: H.load_back(s, PATH, tuple(range(12)), (4, 5, 6)), "swa"),
    (lambda s: H.load_back(s, PATH, tuple(range(12)), (8, 5, 6, 7)), "swa"),
    (lambda s: H.load_back(s, PATH, (*range(11), 11.0), (4, 5, 6, 7)), "full"),
    (lambda s: H.evict_host_full(s, -1, []), "num_tokens"),
    (lambda s: H.evict_host_swa(s, "1", []), "num_tokens"),
    (lambda s: H.match_prefix_host(s, (1, 2)), "key"),
])
def test_bad_loads_and_host_evictions_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    s = demoted()
    with pytest.raises(PreconditionError) as error:
        call(s)
    assert error.value.argument == argument
    assert s == demoted()


def test_host_match_live_fails_on_a_dead_window_and_on_a_short_match() -> None:
    """INV-SWA-HOST-MATCH-LIVE: the two ways an engine's host hit can break it."""
    s = demoted()
    assert H.HOST_MATCH_INVARIANT == "INV-SWA-HOST-MATCH-LIVE"
    assert not list(H.host_match_problems(s, PATH, PATH))
    assert "SWA KV on no tier" in next(H.host_match_problems(s, PATH, deep(8)))
    assert "across its window" in next(H.host_match_problems(s, PATH, None))


# ---- each host invariant: a hand-built bad state and planted bugs ----

def _bare(**host: object) -> H.SwaState:
    """A host tier alone, built by hand: P = 1, 2 host slots per pool, the page (5,)."""
    config = H.SwaConfig(page_size=1, full_slots=4, swa_slots=4, window=2,
                         host_full_slots=2, host_swa_slots=2)
    fields: dict[str, object] = {
        "host": {Key((5,)): H.SwaHostPage(full=(0,), swa=(0,))},
        "host_full_free": frozenset({1}), "host_swa_free": frozenset({1}),
        "host_full_kv": {0: Key((5,))}, "host_swa_kv": {0: Key((5,))}, **host}
    return H.SwaState(config=config, pages={}, full_free=frozenset(range(4)),
                      swa_free=frozenset(range(4)), held={}, full_kv={}, swa_kv={},
                      **fields)  # type: ignore[arg-type]


HAND_BUILT = {
    "INV-SWA-HOST-TREE-WELL-FORMED": {"host": {Key((5, 6)): H.SwaHostPage(full=(0,), swa=(0,))},
                                      "host_full_kv": {0: Key((5, 6))},
                                      "host_swa_kv": {0: Key((5, 6))}},
    "INV-SWA-HOST-ONLY-WITH-FULL": {"host": {Key((5,)): H.SwaHostPage(full=(), swa=(0,))},
                                    "host_full_free": frozenset({0, 1})},
    "INV-SWA-HOST-FULL-POOL": {"host_full_free": frozenset({0, 1})},
    "INV-SWA-HOST-POOL": {"host_swa_free": frozenset()},
    "INV-SWA-HOST-CONTENT": {"host_full_kv": {0: Key((6,))}},
}


def test_the_hand_built_host_is_healthy() -> None:
    assert H.violations(_bare()) == []


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_a_hand_built_bad_host_fails_exactly_its_invariant(spec_id: str) -> None:
    assert H.check(_bare(**HAND_BUILT[spec_id])) == [spec_id]


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_each_host_corruption_fails_exactly_its_invariant(spec_id: str) -> None:
    assert H.check(SWA_MUTANTS[spec_id](healthy())) == [spec_id]


def _evict_ignoring_host_children(s: H.SwaState) -> H.SwaState:
    # evict_full without 13.8a's rule: deep(11) deleted under its host-only child PATH.
    return _delete(alone_demoted(), deep(11))


def _reclaim_full_host_keeping_swa(s: H.SwaState) -> H.SwaState:
    # SGLang's write-back duplicate reclaim (DEV-H11): the full host copy of a device
    # page freed, its SWA host copy kept.
    s = with_host(healthy())
    record = s.host[PATH]
    return replace(s, host={**s.host, PATH: replace(record, full=())},
                   host_full_free=s.host_full_free | set(record.full))


def _backup_forgetting_the_free_set(s: H.SwaState) -> H.SwaState:
    s = _small_host()
    after = H.backup(s, PATH, (0,), (1,))
    return replace(after, host_full_free=s.host_full_free)


def _host_tombstone_without_free(s: H.SwaState) -> H.SwaState:
    s = demoted()
    return replace(s, host={**s.host, deep(10): replace(s.host[deep(10)], swa=None)})


def _backup_from_the_wrong_device_slot(s: H.SwaState) -> H.SwaState:
    s = _small_host()
    after = H.backup(s, PATH, (0,), (1,))
    return replace(after, host_swa_kv={1: s.swa_kv[2]})  # deep(11)'s SWA KV


OP_BUGS: dict[str, Callable[[H.SwaState], H.SwaState]] = {
    "INV-SWA-HOST-TREE-WELL-FORMED": _evict_ignoring_host_children,
    "INV-SWA-HOST-ONLY-WITH-FULL": _reclaim_full_host_keeping_swa,
    "INV-SWA-HOST-FULL-POOL": _backup_forgetting_the_free_set,
    "INV-SWA-HOST-POOL": _host_tombstone_without_free,
    "INV-SWA-HOST-CONTENT": _backup_from_the_wrong_device_slot,
}


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_each_planted_operation_bug_is_caught_by_its_invariant(spec_id: str) -> None:
    assert spec_id in H.check(OP_BUGS[spec_id](healthy()))


# ---- the device-only cache is unchanged ----

def test_host_slots_are_validated() -> None:
    for fields, name in (({"host_full_slots": -1}, "host_full_slots"),
                         ({"host_swa_slots": 3, "page_size": 2, "full_slots": 4,
                           "swa_slots": 4}, "host_swa_slots")):
        with pytest.raises(ConfigError) as error:
            H.SwaConfig(**fields)  # type: ignore[arg-type]
        assert error.value.field == name


def test_a_device_only_state_is_the_state_without_host_fields() -> None:
    """initial() without host slots equals the state built from 13.2's fields alone."""
    config = H.SwaConfig()
    assert H.initial(config) == H.SwaState(
        config=config, pages={}, full_free=frozenset(range(16)), swa_free=frozenset(range(8)),
        held={}, full_kv={}, swa_kv={})


REQUESTS = st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=7),
                              st.integers(0, 7), st.integers(0, 3)), max_size=6)


def _serve(s: H.SwaState, ids: list[int], past: int, evict: int) -> H.SwaState:
    """One request as 13.4 says (test_hybrid's driver), then an SWA eviction."""
    key = Key(tuple(ids))
    m = H.match_prefix(s, key)
    s = H.inc_lock_ref(s, m.last_page)
    need = len(ids) - len(m.full_slots)
    if need <= min(len(s.full_free), len(s.swa_free)):
        full, swa = tuple(sorted(s.full_free)[:need]), tuple(sorted(s.swa_free)[:need])
        s = H.alloc(s, key, len(m.full_slots), full, swa)
        evicted = max(len(m.full_slots), min(past, len(ids)))
        if full[:evicted - len(m.full_slots)]:
            s = H.free_swa(s, full[:evicted - len(m.full_slots)])
        s, _ = H.insert(s, key, m.full_slots + full, evicted)
        s = H.free(s, tuple(f for f in full if f in s.held))
    s = H.dec_lock_ref(s, m.last_page, False)
    victims = sorted(swa_candidates(s), key=lambda k: (-len(k.tokens), k.tokens))[:evict]
    s, _ = H.evict_swa(s, len(victims), victims)
    return s


@settings(max_examples=40, deadline=None)
@given(REQUESTS)
def test_host_slots_unused_change_no_device_operation(requests) -> None:  # type: ignore[no-untyped-def]
    """The same device calls with and without host slots give the same device state."""
    device = H.initial(H.SwaConfig(full_slots=20, swa_slots=8, window=3))
    hosted = H.initial(H.SwaConfig(full_slots=20, swa_slots=8, window=3,
                                   host_full_slots=8, host_swa_slots=8))
    for ids, past, evict in requests:
        device, hosted = _serve(device, ids, past, evict), _serve(hosted, ids, past, evict)
        assert replace(hosted, config=device.config, host_full_free=frozenset(),
                       host_swa_free=frozenset()) == device
        assert H.violations(device) == [] and H.violations(hosted) == []


# ---- device and host operations together ----

def _load(s: H.SwaState, key: Key) -> H.SwaState:
    """Load the host hit of ``key`` back where the device pools have room."""
    m = H.match_prefix_host(s, key)
    if m.last_page is None:
        return s
    ps = s.config.page_size
    swa_pages = [k for k in H.window(s, m.last_page) if k not in s.pages or not s.pages[k].live]
    full_n, swa_n = ps * len(m.load), ps * len(swa_pages)
    if not (full_n or swa_n) or full_n > len(s.full_free) or swa_n > len(s.swa_free):
        return s
    s = H.load_back(s, m.last_page, tuple(sorted(s.full_free)[:full_n]),
                    tuple(sorted(s.swa_free)[:swa_n]))
    event("load_back")
    assert H.match_prefix(s, key).last_page == m.last_page
    return s


OPS = st.lists(st.tuples(st.sampled_from(["serve", "backup", "demote", "round trip", "evict_full",
                                          "evict_host_full", "evict_host_swa", "load"]),
                         st.lists(st.integers(1, 2), min_size=1, max_size=5),
                         st.integers(0, 3), st.integers(0, 3)), max_size=16)


def _backup_path(s: H.SwaState, key: Key) -> H.SwaState:
    """Back up ``key``'s device pages root first, as write-through chains them (13.8a),
    while the host pools have room."""
    for n in range(1, len(key.tokens) + 1):
        page = Key(key.tokens[:n])
        if page not in s.pages:
            break
        full_n = 0 if page in s.host else 1
        swa_n = len(H.swa_backup_targets(s, page))
        if full_n > len(s.host_full_free) or swa_n > len(s.host_swa_free):
            break
        s = H.backup(s, page, tuple(sorted(s.host_full_free)[:full_n]),
                     tuple(sorted(s.host_swa_free)[:swa_n]))
    return s


def _demote(s: H.SwaState, key: Key, pages: int) -> H.SwaState:
    """Back up ``key``'s path, then evict up to ``pages`` of its deepest device pages."""
    s = _backup_path(s, key)
    for n in range(len(key.tokens), 0, -1)[:pages]:
        page = Key(key.tokens[:n])
        if page in full_leaves(s):
            s, _ = H.evict_full(s, 1, [page])
    return s


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_device_and_host_operations_keep_every_invariant(ops) -> None:  # type: ignore[no-untyped-def]
    config = H.SwaConfig(page_size=1, full_slots=12, swa_slots=8, window=2,
                         host_full_slots=10, host_swa_slots=6)
    s = H.initial(config)
    for op, ids, past, pick in ops:
        key = Key(tuple(ids))
        if op == "serve":
            s = _serve(_load(s, key), ids, past, pick)
        elif op == "load":
            s = _load(s, key)
        elif op == "backup":
            s = _backup_path(s, key)
        elif op == "demote":
            s = _demote(s, key, pick)
        elif op == "round trip":  # to the host and back: the request finds a host hit
            s = _serve(_load(_demote(s, key, pick + 1), key), ids, past, 0)
        else:
            allowed = {"evict_full": full_leaves, "evict_host_full": H.host_leaves,
                       "evict_host_swa": lambda s: {k for k, p in s.host.items() if p.swa}}[op](s)
            victims = sorted(allowed, key=lambda k: (-len(k.tokens), k.tokens))[:pick]
            run = {"evict_full": H.evict_full, "evict_host_full": H.evict_host_full,
                   "evict_host_swa": H.evict_host_swa}[op]
            s, _ = run(s, len(victims), victims)
        assert H.violations(s) == [], (op, ids)
        assert not list(H.host_match_problems(s, key, H.match_prefix_host(s, key).last_page))
        assert not list(H.match_problems(s, key, H.match_prefix(s, key).last_page))
