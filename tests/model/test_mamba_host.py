"""The host tier of the (FULL, MAMBA) model (spec/13m, 13m.8b): each operation's effect,
each refusal, a failing test for each invariant, and device and host operations together."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace

import pytest
from hypothesis import event, given, settings
from hypothesis import strategies as st
from mamba_mutants import BRANCH, MAMBA_MUTANTS, PATH, deep, healthy, with_host

from hiradix_model import Key
from hiradix_model import mamba as M
from hiradix_model.errors import ConfigError, IllegalChoice, PreconditionError
from hiradix_model.mamba.evict import _delete
from hiradix_model.mamba.state import full_leaves, state_candidates

HOST_IDS = M.HOST_INVARIANTS


def unlocked() -> M.MambaState:
    """``with_host(healthy())`` with PATH's request finished and the held state freed."""
    return M.free_state(M.dec_lock_ref(with_host(healthy()), PATH, False), 3)


def demoted() -> M.MambaState:
    """``unlocked()`` with every device page evicted: the whole tree host-only, host
    states at deep(4), PATH and BRANCH (host slots 0, 1, 2)."""
    s, freed = M.evict_full(unlocked(), 10, [PATH, deep(6), BRANCH, deep(4), deep(2)])
    assert freed == 10 and s.pages == {} and len(s.host) == 5
    return s


def small_host() -> M.MambaState:
    """healthy() unlocked, the held state freed, with 4 empty host full and 2 host state
    slots and nothing backed up."""
    s = M.free_state(M.dec_lock_ref(healthy(), PATH, False), 3)
    config = replace(s.config, host_full_slots=4, host_state_slots=2)
    return replace(s, config=config, host_full_free=frozenset(range(4)),
                   host_state_free=frozenset(range(2)))


# ---- backup ----

def test_backup_copies_the_full_kv_and_the_pages_own_state() -> None:
    s = unlocked()
    assert M.violations(s) == []
    assert {k: p.state for k, p in s.host.items()} == {
        deep(2): None, deep(4): 0, deep(6): None, PATH: 1, BRANCH: 2}
    for key, page in s.host.items():  # the host copies hold what the device slots hold
        assert [s.host_full_kv[h] for h in page.full] == \
            [s.full_kv[d] for d in s.pages[key].full]
    assert s.host_state_kv[1] == s.state_kv[s.pages[PATH].state] == PATH


def test_a_backup_copies_no_other_pages_state() -> None:
    """Backing up PATH alone copies PATH's state only (components/mamba.py:862-884): no
    ancestor's, unlike the SWA window walk (13.8a)."""
    s = M.backup(small_host(), PATH, (0, 1), 0)
    assert s.host == {PATH: M.MambaHostPage(full=(0, 1), state=0)}
    assert s.host_state_kv == {0: PATH} and M.violations(s) == []


def test_a_later_backup_copies_a_state_taken_since_and_nothing_is_no_change() -> None:
    s, _ = M.evict_states(small_host(), 1, [deep(4)])  # deep(4) keeps its full KV, no state
    assert not M.state_backup_needed(s, deep(4))
    s = M.backup(s, deep(4), (0, 1), None)
    assert s.host[deep(4)] == M.MambaHostPage(full=(0, 1), state=None)
    s = M.alloc_state(s, min(s.state_free), deep(4))
    s, _, taken = M.insert(s, deep(4), (0, 1, 2, 3), min(s.held_states))
    assert taken and M.state_backup_needed(s, deep(4))
    s2 = M.backup(s, deep(4), (), 1)  # the incremental backup: the state only
    assert s2.host[deep(4)] == M.MambaHostPage(full=(0, 1), state=1)
    assert s2.host_full_free == s.host_full_free and M.violations(s2) == []
    assert M.backup(s2, deep(4), (), None) == s2  # nothing left to copy


@pytest.mark.parametrize("call, argument", [
    (lambda s: M.backup(s, Key((1, 2, 3, 4, 5, 6, 7, 8, 9, 9)), (0, 1), None), "page"),
    (lambda s: M.backup(s, (1, 2), (0, 1), None), "page"),
    (lambda s: M.backup(s, PATH, (0,), 0), "full"),  # not a whole page
    (lambda s: M.backup(s, PATH, (), 0), "full"),  # PATH has no host copy yet
    (lambda s: M.backup(s, PATH, (4, 5), 0), "full"),  # outside the host pool
    (lambda s: M.backup(s, PATH, (1, 0), 0), "full"),  # not in order
    (lambda s: M.backup(s, PATH, (0, 1), None), "slot"),  # PATH's state needs a slot
    (lambda s: M.backup(s, PATH, (0, 1), 2), "slot"),  # not a host state slot
    (lambda s: M.backup(s, PATH, (0, 1), True), "slot"),
    (lambda s: M.backup(s, deep(6), (0, 1), 0), "slot"),  # deep(6) holds no state
])
def test_bad_backups_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    _assert_refused(small_host, call, argument)


def _assert_refused(make: Callable[[], M.MambaState], call: Callable[[M.MambaState], object],
                    argument: str) -> None:
    """``call`` on ``make()`` raises PreconditionError naming ``argument`` and leaves
    the state as it was."""
    s = make()
    with pytest.raises(PreconditionError) as error:
        call(s)
    assert error.value.argument == argument
    assert s == make()


# ---- evict_host_full, evict_host_states ----

def test_host_full_eviction_takes_host_leaves_whole() -> None:
    s = demoted()
    assert M.host_leaves(s) == {PATH, BRANCH}
    with pytest.raises(IllegalChoice, match="may not be taken"):
        M.evict_host_full(s, 2, [deep(6)])
    s2, freed = M.evict_host_full(s, 4, [PATH, deep(6)])
    assert freed == 4 and set(s2.host) == {deep(2), deep(4), BRANCH}
    assert s2.host_state_free == s.host_state_free | {1}  # PATH's host state went too
    with pytest.raises(IllegalChoice, match="could still go"):
        M.evict_host_full(s, 4, [PATH])
    assert M.violations(s2) == []


def test_a_device_pages_host_copy_is_a_host_leaf_unless_a_host_only_child_needs_it() -> None:
    s, _ = M.evict_full(unlocked(), 2, [PATH])  # PATH host-only now, deep(6) on both tiers
    assert PATH in M.host_leaves(s) and deep(6) not in M.host_leaves(s)
    assert deep(2) in M.host_leaves(s)  # a duplicate of a device page, no host-only child
    s2, freed = M.evict_host_full(s, 2, [BRANCH])  # a duplicate of a device page
    assert freed == 2 and BRANCH in s2.pages and BRANCH not in s2.host
    assert s2.host_state_free == s.host_state_free | {2} and M.violations(s2) == []


def test_host_state_eviction_tombstones_inner_pages_and_deletes_host_only_leaves() -> None:
    s = demoted()
    s2, freed = M.evict_host_states(s, 1, [deep(4)])
    assert freed == 1 and s2.host[deep(4)] == M.MambaHostPage(full=(2, 3), state=None)
    s3, freed = M.evict_host_states(s, 1, [PATH])
    assert freed == 1 and PATH not in s3.host  # a host-only host leaf goes whole
    assert len(s3.host_full_free) == len(s.host_full_free) + 2
    with pytest.raises(IllegalChoice, match="may not be taken"):
        M.evict_host_states(s, 1, [deep(6)])  # no host state
    assert M.violations(s2) == [] and M.violations(s3) == []
    # A device page's host state goes alone, even where its host copy is a host leaf.
    s4, freed = M.evict_host_states(unlocked(), 1, [BRANCH])
    assert freed == 1 and s4.host[BRANCH].state is None and M.violations(s4) == []


def alone_demoted() -> M.MambaState:
    """small_host() with only PATH backed up, then PATH evicted from the device: PATH
    host-only under deep(6), which is on the device without a host copy."""
    s, _ = M.evict_full(M.backup(small_host(), PATH, (0, 1), 0), 2, [PATH])
    assert PATH not in s.pages and deep(6) not in s.host
    return s


def test_a_device_page_with_a_host_only_child_and_no_host_copy_is_no_full_leaf() -> None:
    s = alone_demoted()
    assert deep(6) not in full_leaves(s)
    with pytest.raises(IllegalChoice, match="may not be taken"):
        M.evict_full(s, 2, [deep(6)])
    s2, _ = M.evict_host_full(s, 2, [PATH])
    assert deep(6) in full_leaves(s2)
    s3, _ = M.evict_full(s2, 2, [deep(6)])
    assert M.violations(s3) == []


# ---- match_prefix_host, load_back ----

def test_a_host_hit_is_loaded_back_and_then_matched_on_the_device() -> None:
    s = demoted()
    assert M.match_prefix(s, PATH).last_page is None
    m = M.match_prefix_host(s, PATH)
    assert m == M.MambaHostMatch(device_slots=(), load=tuple(deep(n) for n in (2, 4, 6, 8)),
                                 last_page=PATH, load_state=True, full_hit=8)
    assert not list(M.host_match_problems(s, PATH, m.last_page, m.full_hit))
    s2 = M.load_back(s, PATH, tuple(range(8)), 3)
    assert M.violations(s2) == [] and s2.host == s.host  # host copies stay
    assert M.match_prefix(s2, PATH).last_page == PATH
    assert s2.state_kv[3] == PATH
    # Only the matched page's state is loaded: deep(4)'s stays on the host.
    assert [s2.pages[deep(n)].state for n in (2, 4, 6, 8)] == [None, None, None, 3]
    # The request's copy is a fork after the load (13m.8b, DEV-M14).
    assert M.fork(s2, PATH, 0).state_kv[0] == PATH


def test_a_host_hit_may_end_short_of_the_run_and_on_a_device_page() -> None:
    s = demoted()
    key = Key((1, 2, 3, 4, 5, 6, 9, 9))  # deep(6) then no page: the run ends at 6 tokens
    m = M.match_prefix_host(s, key)
    assert (m.last_page, m.full_hit, m.load) == (deep(4), 6, (deep(2), deep(4)))
    # A device page whose device state was evicted but whose host state is kept: a load
    # of the state alone (SGLang's match sets mamba_host_hit_length, mamba.py:187-192).
    dev, _ = M.evict_states(unlocked(), 1, [deep(4)])
    m = M.match_prefix_host(dev, deep(4))
    assert (m.last_page, m.load, m.load_state) == (deep(4), (), True)
    assert M.match_prefix(dev, deep(4)).last_page is None
    dev2 = M.load_back(dev, deep(4), (), 0)
    assert M.match_prefix(dev2, deep(4)).last_page == deep(4) and M.violations(dev2) == []
    assert dev2.state_kv[0] == deep(4)


def test_load_back_refuses_a_page_with_no_state_anywhere_and_nothing_to_load() -> None:
    s = demoted()
    with pytest.raises(PreconditionError, match="state on no tier") as error:
        M.load_back(s, deep(6), tuple(range(6)), None)
    assert error.value.argument == "page"
    with pytest.raises(PreconditionError, match="nothing to load") as error:
        M.load_back(unlocked(), PATH, (), None)
    assert error.value.argument == "page"


@pytest.mark.parametrize("call, argument", [
    (lambda s: M.load_back(s, Key((1, 2, 3, 4, 5, 6, 7, 8, 9, 9)), (), None), "page"),
    (lambda s: M.load_back(s, Key(()), (), None), "page"),
    (lambda s: M.load_back(s, PATH, tuple(range(6)), 3), "full"),
    (lambda s: M.load_back(s, PATH, (*range(6), 7, 6), 3), "full"),
    (lambda s: M.load_back(s, PATH, tuple(range(14, 22)), 3), "full"),
    (lambda s: M.load_back(s, PATH, tuple(range(8)), None), "slot"),
    (lambda s: M.load_back(s, PATH, tuple(range(8)), 4), "slot"),
    (lambda s: M.evict_host_full(s, -1, []), "target"),
    (lambda s: M.evict_host_states(s, "1", []), "target"),
    (lambda s: M.match_prefix_host(s, (1, 2)), "key"),
])
def test_bad_loads_and_host_evictions_name_the_argument(call, argument) -> None:  # type: ignore[no-untyped-def]
    _assert_refused(demoted, call, argument)


def test_host_match_state_fails_on_a_stateless_end_a_short_match_and_a_wrong_full_hit() -> None:
    """INV-MAMBA-HOST-MATCH-STATE: the three ways an engine's host hit can break it."""
    s = demoted()
    assert M.HOST_MATCH_INVARIANT == "INV-MAMBA-HOST-MATCH-STATE"
    assert not list(M.host_match_problems(s, PATH, PATH, 8))
    assert "state on no tier" in next(M.host_match_problems(s, PATH, deep(6)))
    assert "holds a state" in next(M.host_match_problems(s, PATH, deep(4)))
    assert "full hit" in next(M.host_match_problems(s, PATH, PATH, 6))


# ---- each host invariant: a hand-built bad state, a corruption, a planted bug ----

def _bare(**host: object) -> M.MambaState:
    """A host tier alone, built by hand: P = 1, 2 host slots per pool, the page (5,)."""
    config = M.MambaConfig(page_size=1, full_slots=4, state_slots=2, host_full_slots=2,
                           host_state_slots=2)
    fields: dict[str, object] = {
        "host": {Key((5,)): M.MambaHostPage(full=(0,), state=0)},
        "host_full_free": frozenset({1}), "host_state_free": frozenset({1}),
        "host_full_kv": {0: Key((5,))}, "host_state_kv": {0: Key((5,))}, **host}
    return M.MambaState(config=config, pages={}, full_free=frozenset(range(4)),
                        state_free=frozenset(range(2)), held_full=frozenset(),
                        held_states=frozenset(), full_kv={}, state_kv={},
                        **fields)  # type: ignore[arg-type]


HAND_BUILT = {
    "INV-MAMBA-HOST-TREE-WELL-FORMED": {
        "host": {Key((5, 6)): M.MambaHostPage(full=(0,), state=0)},
        "host_full_kv": {0: Key((5, 6))}, "host_state_kv": {0: Key((5, 6))}},
    "INV-MAMBA-HOST-ONLY-WITH-FULL": {"host": {Key((5,)): M.MambaHostPage(full=(), state=0)},
                                      "host_full_free": frozenset({0, 1})},
    "INV-MAMBA-HOST-FULL-POOL": {"host_full_free": frozenset({0, 1})},
    "INV-MAMBA-HOST-POOL": {"host_state_free": frozenset()},
    "INV-MAMBA-HOST-CONTENT": {"host_state_kv": {0: Key((6,))}},
}


def test_the_hand_built_host_is_healthy() -> None:
    assert M.violations(_bare()) == []


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_a_hand_built_bad_host_fails_exactly_its_invariant(spec_id: str) -> None:
    assert M.check(_bare(**HAND_BUILT[spec_id])) == [spec_id]


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_each_host_corruption_fails_exactly_its_invariant(spec_id: str) -> None:
    assert M.check(MAMBA_MUTANTS[spec_id](healthy())) == [spec_id]


def test_the_host_invariants_are_the_registered_host_ones() -> None:
    assert set(HOST_IDS) == {i for i in M.MAMBA_INVARIANTS if "-HOST-" in i}


def _evict_ignoring_host_children(s: M.MambaState) -> M.MambaState:
    # evict_full without 13m.8b's rule: deep(6) deleted under its host-only child PATH.
    return _delete(alone_demoted(), deep(6))


def _reclaim_full_host_keeping_state(s: M.MambaState) -> M.MambaState:
    # SGLang's write-back duplicate reclaim (DEV-M13): the full host copy of a device
    # page freed, its host state kept.
    s = unlocked()
    record = s.host[BRANCH]
    return replace(s, host={**s.host, BRANCH: replace(record, full=())},
                   host_full_free=s.host_full_free | set(record.full))


def _backup_forgetting_the_free_set(s: M.MambaState) -> M.MambaState:
    before = small_host()
    return replace(M.backup(before, PATH, (0, 1), 0), host_full_free=before.host_full_free)


def _host_tombstone_without_free(s: M.MambaState) -> M.MambaState:
    s = demoted()
    return replace(s, host={**s.host, deep(4): replace(s.host[deep(4)], state=None)})


def _backup_from_the_wrong_device_state(s: M.MambaState) -> M.MambaState:
    before = small_host()
    after = M.backup(before, PATH, (0, 1), 0)
    return replace(after, host_state_kv={0: before.state_kv[0]})  # deep(4)'s state


OP_BUGS: dict[str, Callable[[M.MambaState], M.MambaState]] = {
    "INV-MAMBA-HOST-TREE-WELL-FORMED": _evict_ignoring_host_children,
    "INV-MAMBA-HOST-ONLY-WITH-FULL": _reclaim_full_host_keeping_state,
    "INV-MAMBA-HOST-FULL-POOL": _backup_forgetting_the_free_set,
    "INV-MAMBA-HOST-POOL": _host_tombstone_without_free,
    "INV-MAMBA-HOST-CONTENT": _backup_from_the_wrong_device_state,
}


@pytest.mark.parametrize("spec_id", HOST_IDS)
def test_each_planted_operation_bug_is_caught_by_its_invariant(spec_id: str) -> None:
    assert spec_id in M.check(OP_BUGS[spec_id](healthy()))


# ---- the device-only cache is unchanged ----

def test_host_slots_are_validated() -> None:
    cases = (({"host_full_slots": -2}, "host_full_slots"),
             ({"host_full_slots": 3, "page_size": 2}, "host_full_slots"),
             ({"host_state_slots": True}, "host_state_slots"),
             ({"host_state_slots": -1}, "host_state_slots"))
    for fields, name in cases:
        with pytest.raises(ConfigError) as error:
            M.MambaConfig(**fields)  # type: ignore[arg-type]
        assert error.value.field == name


def test_a_device_only_state_is_the_state_without_host_fields() -> None:
    """initial() without host slots equals the state built from 13m.2's fields alone."""
    config = M.MambaConfig()
    assert M.initial(config) == M.MambaState(
        config=config, pages={}, full_free=frozenset(range(16)),
        state_free=frozenset(range(4)), held_full=frozenset(), held_states=frozenset(),
        full_kv={}, state_kv={})


def _key(pages: list[int]) -> Key:
    return Key(tuple(t for p in pages for t in (p, p + 1)))


def _serve(s: M.MambaState, key: Key, evict: int) -> M.MambaState:
    """One request as 13m.4 says (test_mamba's driver), then up to ``evict`` state
    evictions."""
    if not s.state_free and state_candidates(s):
        s, _ = M.evict_states(s, 1, sorted(state_candidates(s), key=str)[:1])
    if not s.state_free:
        return s
    m = M.match_prefix(s, key)
    slot = min(s.state_free)
    s = (M.fork(s, m.last_page, slot) if m.last_page is not None
         else M.alloc_state(s, slot, Key((), key.namespace)))
    s = M.inc_lock_ref(s, m.last_page, True)
    need = len(key.tokens) - len(m.full_slots)
    if need > len(s.full_free):
        return M.free_state(M.dec_lock_ref(s, m.last_page, False), slot)
    full = tuple(sorted(s.full_free)[:need])
    s = M.write_state(M.alloc(s, key, len(m.full_slots), full), slot, key)
    s, _, taken = M.insert(s, key, m.full_slots + full, slot)
    s = M.free(s, tuple(f for f in full if f in s.held_full))
    if not taken:
        s = M.free_state(s, slot)
    s = M.dec_lock_ref(s, m.last_page, False)
    for victim in sorted(state_candidates(s), key=lambda k: (-len(k.tokens), k.tokens))[:evict]:
        if victim in state_candidates(s):
            s, _ = M.evict_states(s, 1, [victim])
    return s


REQUESTS = st.lists(st.tuples(st.lists(st.integers(1, 2), min_size=1, max_size=4),
                              st.integers(0, 2)), max_size=8)


@settings(max_examples=40, deadline=None)
@given(REQUESTS)
def test_host_slots_unused_change_no_device_operation(requests) -> None:  # type: ignore[no-untyped-def]
    """The same device calls with and without host slots give the same device state."""
    device = M.initial(M.MambaConfig(page_size=2, full_slots=16, state_slots=3))
    hosted = M.initial(M.MambaConfig(page_size=2, full_slots=16, state_slots=3,
                                     host_full_slots=8, host_state_slots=2))
    for pages, evict in requests:
        device, hosted = _serve(device, _key(pages), evict), _serve(hosted, _key(pages), evict)
        assert replace(hosted, config=device.config, host_full_free=frozenset(),
                       host_state_free=frozenset()) == device
        assert M.violations(device) == [] and M.violations(hosted) == []


# ---- device and host operations together ----

def _load(s: M.MambaState, key: Key) -> M.MambaState:
    """Load the host hit of ``key`` back where the device pools have room."""
    m = M.match_prefix_host(s, key)
    if m.last_page is None or not (m.load or m.load_state):
        return s
    need = s.config.page_size * len(m.load)
    if need > len(s.full_free) or (m.load_state and not s.state_free):
        return s
    s = M.load_back(s, m.last_page, tuple(sorted(s.full_free)[:need]),
                    min(s.state_free) if m.load_state else None)
    event("load_back")
    assert M.match_prefix(s, key).last_page == m.last_page
    return s


def _backup_path(s: M.MambaState, key: Key) -> M.MambaState:
    """Back up ``key``'s device pages root first, as write-through chains them (13m.8b),
    while the host pools have room."""
    ps = s.config.page_size
    for n in range(ps, len(key.tokens) + 1, ps):
        page = Key(key.tokens[:n])
        if page not in s.pages:
            break
        full_n = 0 if page in s.host else ps
        needed = M.state_backup_needed(s, page)
        if full_n > len(s.host_full_free) or (needed and not s.host_state_free):
            break
        s = M.backup(s, page, tuple(sorted(s.host_full_free)[:full_n]),
                     min(s.host_state_free) if needed else None)
    return s


def _demote(s: M.MambaState, key: Key, pages: int) -> M.MambaState:
    """Back up ``key``'s path, then evict up to ``pages`` of its deepest device pages."""
    s = _backup_path(s, key)
    ps = s.config.page_size
    for n in range(len(key.tokens), 0, -ps)[:pages]:
        page = Key(key.tokens[:n])
        if page in full_leaves(s):
            s, _ = M.evict_full(s, ps, [page])
            event("demoted" if page in s.host else "deleted")
    return s


def _with_host_state(s: M.MambaState) -> set[Key]:
    return {k for k, p in s.host.items() if p.state is not None}


Eviction = Callable[[M.MambaState, int, list[Key]], tuple[M.MambaState, int]]
EVICTIONS: dict[str, tuple[Callable[[M.MambaState], set[Key]], Eviction]] = {
    "evict_full": (full_leaves, M.evict_full),
    "evict_states": (state_candidates, M.evict_states),
    "evict_host_full": (M.host_leaves, M.evict_host_full),
    "evict_host_states": (_with_host_state, M.evict_host_states),
}

OPS = st.lists(st.tuples(st.sampled_from(["serve", "backup", "demote", "round trip", "load",
                                          *EVICTIONS]),
                         st.lists(st.integers(1, 2), min_size=1, max_size=4),
                         st.integers(0, 3)), max_size=16)


@settings(max_examples=150, deadline=None)
@given(OPS)
def test_device_and_host_operations_keep_every_invariant(ops) -> None:  # type: ignore[no-untyped-def]
    config = M.MambaConfig(page_size=2, full_slots=16, state_slots=3, host_full_slots=12,
                           host_state_slots=3)
    s = M.initial(config)
    for op, pages, pick in ops:
        key = _key(pages)
        if op == "serve":
            s = _serve(_load(s, key), key, pick)
        elif op == "load":
            s = _load(s, key)
        elif op == "backup":
            s = _backup_path(s, key)
        elif op == "demote":
            s = _demote(s, key, pick)
        elif op == "round trip":  # to the host and back: the request finds a host hit
            s = _serve(_load(_demote(s, key, pick + 1), key), key, 0)
        else:
            allowed, run = EVICTIONS[op]
            victims = sorted(allowed(s), key=lambda k: (-len(k.tokens), k.tokens))[:pick]
            units = len(victims) * (1 if op.endswith("states") else config.page_size)
            s, _ = run(s, units, victims)
        assert M.violations(s) == [], (op, pages)
        host_hit = M.match_prefix_host(s, key)
        assert not list(M.host_match_problems(s, key, host_hit.last_page, host_hit.full_hit))
        hit = M.match_prefix(s, key)
        assert not list(M.match_problems(s, key, hit.last_page, hit.full_hit))
