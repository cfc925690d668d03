"""SGLang 0.5.23's (FULL, MAMBA) UnifiedRadixCache through ``adapters.sglang_mamba``
(spec/13m).

Runs under ``.venv-sglang23`` (``make sglang23-env``), e.g.
``.venv-sglang23/bin/python -m pytest -q tests/engines/test_sglang_mamba.py``. Skipped where
SGLang is not installed or is another version; an SGLang 0.5.23 the adapter cannot drive
fails (``engine_env.require``).

Scripted scenarios check ``observe()`` against hand-computed pages (13m.8); bugs planted
in SGLang's Mamba component show in the view or in ``own_check``; the Mamba machine
(``hiradix.conformance.mamba.machine``) runs the adapter beside the model.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter
from collections.abc import Callable, Iterator
from typing import Any

import pytest
from hybrid_support import bounded, run_until, seeded_failure
from hypothesis import Phase, settings
from hypothesis.stateful import run_state_machine_as_test

from hiradix.conformance.mamba.engine import MambaHit, MambaView
from hiradix.conformance.mamba.machine import make_mamba_machine
from hiradix.engines.sglang.mamba import SglangMambaAdapter, build
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

from engine_env import require

ENGINE = "sglang-mamba"
K2, K4, K8 = (Key(tuple(range(1, n + 1)), None) for n in (2, 4, 8))


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but does not probe."""
    return require(ENGINE)


Make = Callable[..., SglangMambaAdapter]


@pytest.fixture
def make() -> Iterator[Make]:
    """``build(MambaConfig(...))``; every cache a test builds is closed after it."""
    built: list[SglangMambaAdapter] = []

    def tracked(page_size: int = 1, full_slots: int = 16,
                state_slots: int = 4) -> SglangMambaAdapter:
        built.append(build(MambaConfig(page_size=page_size, full_slots=full_slots * page_size,
                                       state_slots=state_slots)))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


def checked(adapter: SglangMambaAdapter) -> MambaView:
    view = adapter.observe()
    assert view.own_check is None, view.own_check
    return view


def alloc(adapter: SglangMambaAdapter, num_tokens: int) -> tuple[int, ...]:
    slots = adapter.alloc(num_tokens)
    assert slots is not None
    return slots


def put(adapter: SglangMambaAdapter, key: Key, code: int) -> tuple[tuple[int, ...], int]:
    """A request's life up to its insert, without locks: match, fresh full slots for the
    rest (KV codes = positions), a fresh state holding ``code``, insert. The key's full
    slots and the state slot; the insert must cache the rest and take the state."""
    hit = adapter.match_prefix(key)
    fresh = alloc(adapter, len(key.tokens) - len(hit.full))
    adapter.write_kv(fresh, list(range(len(hit.full), len(key.tokens))))
    state = adapter.alloc_state()
    assert state is not None
    adapter.write_state(state, code)
    assert adapter.insert(key, hit.full + fresh, state) == (len(hit.full), True)
    return hit.full + fresh, state


def states(view: MambaView) -> dict[int, int | None]:
    """Page length -> its state slot."""
    return {len(k.tokens): p.state for k, p in view.pages.items()}


def locks(view: MambaView) -> dict[int, tuple[int, int]]:
    """Page length -> (lock, state_lock)."""
    return {len(k.tokens): (p.lock, p.state_lock) for k, p in view.pages.items()}


@pytest.mark.parametrize("ps", [1, 2])
def test_a_state_sits_on_the_last_page_and_full_slots_split_per_page(make: Make,
                                                                     ps: int) -> None:
    adapter = make(ps)
    full, state = put(adapter, K8, code=100)
    view = checked(adapter)
    assert sorted(states(view)) == list(range(ps, 9, ps))
    assert states(view) == {end: (state if end == 8 else None) for end in range(ps, 9, ps)}
    assert {len(k.tokens): p.full for k, p in view.pages.items()} == {
        end: full[end - ps:end] for end in range(ps, 9, ps)}
    assert set(locks(view).values()) == {(0, 0)}
    assert view.full_kv == {s: i for i, s in enumerate(full)}
    assert view.state_kv == {state: 100}
    assert view.full_free == frozenset(range(16 * ps)) - set(full)
    assert view.state_free == frozenset(range(4)) - {state}
    assert adapter.match_prefix(Key(K8.tokens + (9,) * ps, None)) == MambaHit(full, K8, 8)
    # (1, 2, 3, 9): the full KV hits 3 tokens (whole pages), no state on the way.
    assert adapter.match_prefix(Key((1, 2, 3, 9), None)) == MambaHit((), None, 3 - 3 % ps)


@pytest.mark.parametrize("ps", [1, 2])
def test_a_match_ends_at_the_deepest_state_of_its_full_hit(make: Make, ps: int) -> None:
    adapter = make(ps)
    head, a = put(adapter, K4, code=4)
    full, b = put(adapter, K8, code=8)
    assert full[:4] == head
    before = checked(adapter)
    assert states(before) == {end: {4: a, 8: b}.get(end) for end in range(ps, 9, ps)}
    # The full KV hits 6 tokens; the deepest state on the way is after 4.
    assert adapter.match_prefix(Key((*K8.tokens[:6], 9, 9), None)) == MambaHit(head, K4, 6)
    # That match split SGLang's node after 6 tokens: the pages stay as they were.
    assert checked(adapter).pages == before.pages
    assert adapter.match_prefix(K8) == MambaHit(full, K8, 8)
    assert adapter.match_prefix(K2) == MambaHit((), None, 2)


def test_fork_copies_the_cached_state_into_a_slot_of_the_callers(make: Make) -> None:
    adapter = make(state_slots=2)
    _, a = put(adapter, K4, code=4)
    copy = adapter.fork(K4)
    assert copy is not None and copy != a
    view = checked(adapter)
    assert view.state_kv == {a: 4, copy: 4}
    assert view.state_free == frozenset()  # the copy is held, the cached state owned
    assert states(view)[4] == a
    adapter.write_state(copy, 5)  # the request's copy moves on, the cached one stays
    assert checked(adapter).state_kv == {a: 4, copy: 5}
    # The pool is empty: no fork (SGLang would evict a state for it; the adapter asks not).
    before = checked(adapter)
    assert adapter.fork(K4) is None
    assert checked(adapter) == before
    with pytest.raises(ValueError, match="holds no cached state"):
        adapter.fork(Key((1, 2, 3), None))


@pytest.mark.parametrize("ps", [1, 2])
def test_lock_release_state_unlock_round_trips(make: Make, ps: int) -> None:
    adapter = make(ps)
    put(adapter, K4, code=4)
    put(adapter, K8, code=8)
    receipt = adapter.lock(K8, True)
    assert locks(checked(adapter)) == {end: (1, int(end == 8)) for end in range(ps, 9, ps)}
    adapter.release_state(receipt)
    assert locks(checked(adapter)) == {end: (1, 0) for end in range(ps, 9, ps)}
    adapter.unlock(receipt, True)
    assert set(locks(checked(adapter)).values()) == {(0, 0)}
    without = adapter.lock(K4, False)
    assert locks(checked(adapter)) == {end: (int(end <= 4), 0) for end in range(ps, 9, ps)}
    before = checked(adapter)
    with pytest.raises(ValueError, match="state_released=False"):
        adapter.unlock(without, False)  # it holds no state lock to release
    with pytest.raises(ValueError, match="holds no state lock"):
        adapter.release_state(without)
    assert checked(adapter) == before
    adapter.unlock(without, True)
    assert set(locks(checked(adapter)).values()) == {(0, 0)}
    with pytest.raises(ValueError, match="not a live lock"):
        adapter.unlock(without, True)


def test_a_lock_inside_a_node_counts_its_state_lock_on_a_page_without_state(
        make: Make) -> None:
    adapter = make()
    _, a = put(adapter, K4, code=4)
    receipt = adapter.lock(K2, True)  # SGLang splits its node after 2 tokens
    view = checked(adapter)
    assert locks(view) == {1: (1, 0), 2: (1, 1), 3: (0, 0), 4: (0, 0)}
    assert states(view) == {1: None, 2: None, 3: None, 4: a}
    adapter.unlock(receipt, False)
    assert set(locks(checked(adapter)).values()) == {(0, 0)}


def tombstone_after_four(adapter: SglangMambaAdapter) -> tuple[tuple[int, ...], int, int]:
    """(1..4) and (1..8) cached with states, then the state after (1..4) evicted while
    (1..8)'s is locked. The full slots of (1..4), the two states."""
    head, a = put(adapter, K4, code=4)
    _, b = put(adapter, K8, code=8)
    receipt = adapter.lock(K8, True)
    assert adapter.evict_states(1) == 1
    adapter.unlock(receipt, False)
    return head, a, b


def refill_four(adapter: SglangMambaAdapter) -> tuple[tuple[int, ...], int]:
    """A request recomputes (1..4) into fresh slots and a fresh state, and inserts it:
    all of it is cached, the state is taken. Its full slots and state."""
    fresh = alloc(adapter, 4)
    state = adapter.alloc_state()
    assert state is not None
    adapter.write_state(state, 40)
    assert adapter.insert(K4, fresh, state) == (4, True)
    return fresh, state


def test_evicting_an_internal_state_leaves_a_state_tombstone_that_an_insert_refills(
        make: Make) -> None:
    adapter = make()
    head, a, b = tombstone_after_four(adapter)
    view = checked(adapter)
    assert states(view) == {end: {8: b}.get(end) for end in range(1, 9)}
    assert view.pages[K4].full == head[3:]  # the full KV stays
    assert a in view.state_free
    # The full KV hits 4 tokens, but no state ends there: resume from the root.
    assert adapter.match_prefix(K4) == MambaHit((), None, 4)
    fresh, c = refill_four(adapter)  # refills the state only
    view = checked(adapter)
    assert states(view)[4] == c and view.pages[K4].full == head[3:]
    assert not set(fresh) & view.full_free  # the duplicates stay the caller's
    adapter.free(fresh)
    assert set(fresh) <= checked(adapter).full_free


def test_evicting_a_leafs_state_deletes_the_leaf(make: Make) -> None:
    adapter = make()
    put(adapter, K4, code=4)
    assert adapter.evict_states(1) == 1
    view = checked(adapter)
    assert view.pages == {}
    assert view.full_free == frozenset(range(16)) and view.state_free == frozenset(range(4))


def test_evict_full_deletes_whole_leaf_nodes_and_their_states(make: Make) -> None:
    adapter = make()
    _, a = put(adapter, K4, code=4)
    _, b = put(adapter, K8, code=8)
    assert adapter.evict_full(1) == 4  # SGLang frees the whole leaf node (5..8)
    view = checked(adapter)
    assert states(view) == {1: None, 2: None, 3: None, 4: a}
    assert b in view.state_free


def test_a_locked_state_is_not_evicted_but_a_full_lock_alone_does_not_keep_it(
        make: Make) -> None:
    adapter = make()
    _, a = put(adapter, K4, code=4)
    with_state = adapter.lock(K4, True)
    before = checked(adapter)
    assert adapter.evict_states(4) == 0
    assert adapter.evict_full(16) == 0
    assert checked(adapter) == before
    adapter.unlock(with_state, False)
    full_only = adapter.lock(K4, False)
    assert adapter.evict_states(1) == 1  # the locked leaf loses its state only
    view = checked(adapter)
    assert states(view) == {1: None, 2: None, 3: None, 4: None} and a in view.state_free
    assert adapter.evict_full(16) == 0
    adapter.unlock(full_only, True)
    assert adapter.evict_full(16) == 4
    assert checked(adapter).pages == {}


def test_an_insert_onto_a_cached_state_keeps_the_callers_state_and_slots(
        make: Make) -> None:
    adapter = make()
    head, a = put(adapter, K4, code=4)
    copy = adapter.fork(K4)
    assert copy is not None
    assert adapter.insert(K4, head, copy) == (4, False)
    fresh = alloc(adapter, 4)
    assert adapter.insert(K4, fresh, copy) == (4, False)
    view = checked(adapter)  # the pool balance counts copy and fresh as held
    assert states(view)[4] == a and copy not in view.state_free
    assert not set(fresh) & view.full_free and view.pages[K4].full == head[3:]
    adapter.free(fresh)
    adapter.free_state(copy)
    view = checked(adapter)
    assert set(fresh) <= view.full_free and copy in view.state_free


def test_bad_arguments_raise_and_change_nothing(make: Make) -> None:
    adapter = make(2)
    full, state = put(adapter, K4, code=4)
    spare = adapter.alloc_state()
    assert spare is not None
    receipt = adapter.lock(K4, False)
    before = checked(adapter)
    calls: list[tuple[Callable[[], object], str]] = [
        (lambda: adapter.insert(Key((1, 2, 3), None), full[:3], spare), "whole pages"),
        (lambda: adapter.insert(K4, full, 3), "not a state slot the caller holds"),
        (lambda: adapter.insert(Key((5, 6), None), full[:2], spare), "neither held"),
        (lambda: adapter.insert(K4, full[:2], spare), "2 full_slots"),
        (lambda: adapter.lock(Key((9, 9), None), True), "not cached"),
        (lambda: adapter.free(full[:2]), "not all held"),
        (lambda: adapter.write_state(state, 1), "not a state slot the caller holds"),
        (lambda: adapter.write_state(spare, -1), "code must be"),
        (lambda: adapter.evict_full(-1), "int >= 0"),
        (lambda: adapter.alloc(3), "multiple of 2"),
        (lambda: adapter.release_state(receipt), "holds no state lock"),
        (lambda: adapter.unlock(object(), True), "not a live lock"),
    ]
    for call, message in calls:
        with pytest.raises(ValueError, match=message):
            call()
        assert checked(adapter) == before, message


@pytest.mark.parametrize("config", [MambaConfig(page_size=ps, full_slots=10 * ps,
                                                state_slots=3) for ps in (1, 2)],
                         ids=["ps1", "ps2"])
def test_sglang_refines_the_model(config: MambaConfig) -> None:
    run_state_machine_as_test(make_mamba_machine(build, config), settings=bounded(40))


# -- bugs planted in SGLang's Mamba component ---------------------------------------


def mamba_component() -> Any:
    return importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")


def state_left_on_split_parent(monkeypatch: pytest.MonkeyPatch) -> None:
    """A split moves the node's state to the new parent (the key's prefix) instead of
    leaving it on the child that ends where the state was taken."""
    mamba = mamba_component()

    def redistribute(self: Any, new_parent: Any, child: Any) -> None:
        ct = self.component_type
        parent_cd, child_cd = new_parent.component_data[ct], child.component_data[ct]
        parent_cd.value, child_cd.value = child_cd.value, None
        parent_cd.lock_ref = child_cd.lock_ref

    monkeypatch.setattr(mamba.MambaComponent, "redistribute_on_node_split", redistribute)


def refill_dropped(monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert onto a state tombstone reports the state taken but never stores it."""
    mamba = mamba_component()
    original = mamba.MambaComponent.commit_insert_component_data

    def commit(self: Any, node: Any, is_new_leaf: bool, *args: Any, **kwargs: Any) -> None:
        if not is_new_leaf and node.component_data[self.component_type].value is None:
            return
        original(self, node, is_new_leaf, *args, **kwargs)

    monkeypatch.setattr(mamba.MambaComponent, "commit_insert_component_data", commit)


def existing_state_overwritten(monkeypatch: pytest.MonkeyPatch) -> None:
    """An insert onto a node that has a state replaces it with the caller's (reported
    as taken) without freeing the old one."""
    mamba = mamba_component()
    original = mamba.MambaComponent.commit_insert_component_data

    def commit(self: Any, node: Any, is_new_leaf: bool, params: Any, *args: Any,
               **kwargs: Any) -> None:
        cd = node.component_data[self.component_type]
        if not is_new_leaf and cd.value is not None:
            cd.value = params.mamba_value
            return
        original(self, node, is_new_leaf, params, *args, **kwargs)

    monkeypatch.setattr(mamba.MambaComponent, "commit_insert_component_data", commit)


def lock_counted_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Acquiring a state lock counts it twice; its release takes one."""
    mamba = mamba_component()
    original = mamba.MambaComponent.acquire_component_lock

    def acquire(self: Any, node: Any, result: Any, lock_host: bool = False) -> Any:
        original(self, node, result, lock_host)
        return original(self, node, result, lock_host)

    monkeypatch.setattr(mamba.MambaComponent, "acquire_component_lock", acquire)


def split_after_state(adapter: SglangMambaAdapter) -> MambaView:
    _, a = put(adapter, K4, code=4)
    adapter.match_prefix(Key((1, 2, 9, 9), None))  # splits the node after (1, 2)
    view = adapter.observe()
    assert states(view) != {1: None, 2: None, 3: None, 4: a}, "the state stayed put"
    return view


def refill_a_tombstone(adapter: SglangMambaAdapter) -> MambaView:
    tombstone_after_four(adapter)
    _, state = refill_four(adapter)
    view = adapter.observe()
    assert states(view)[4] != state, "the refill stored its state"
    return view


def insert_onto_a_state(adapter: SglangMambaAdapter) -> MambaView:
    head, a = put(adapter, K4, code=4)
    copy = adapter.fork(K4)
    assert copy is not None
    adapter.insert(K4, head, copy)
    view = adapter.observe()
    assert states(view)[4] != a, "the cached state stayed"
    return view


def lock_and_unlock(adapter: SglangMambaAdapter) -> MambaView:
    put(adapter, K4, code=4)
    adapter.unlock(adapter.lock(K4, True), False)
    view = adapter.observe()
    assert view.pages[K4].state_lock == 1 and view.pages[K4].lock == 0
    return view


PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None],
                         Callable[[SglangMambaAdapter], MambaView], str]] = {
    "state left on the split parent": (state_left_on_split_parent, split_after_state,
                                       "mamba device LRU"),
    "refill dropped": (refill_dropped, refill_a_tombstone, "mamba pool balance"),
    "existing state overwritten": (existing_state_overwritten, insert_onto_a_state,
                                   "mamba pool balance"),
    "lock counted twice": (lock_counted_twice, lock_and_unlock, "full_lock=0 <"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_sglang_shows_in_the_view_and_its_own_check(
        name: str, make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    plant, scenario, own = PLANTED[name]
    plant(monkeypatch)
    view = scenario(make())
    assert view.own_check is not None and re.search(own, view.own_check), view.own_check


# What the machine reports first for each planted bug.
MACHINE_SEES = {
    # INV-MAMBA-MATCH-STATE, or the insert of a checkpoint that should have taken the
    # state left behind; which comes first depends on the derandomized draw, which
    # Hypothesis seeds from the machine's source.
    "state left on the split parent": "holds no state|the model's insert took the state",
    "refill dropped": "mamba pool balance",
    # The insert says it took the state the model keeps: seen on insert or on a release.
    "existing state overwritten": (r"returned \(\d+, True\), the model \(\d+, False\)"
                                   r"|taken True: the model's insert took the state: False"),
    "lock counted twice": "INV-MAMBA-LOCKS",
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_sglang_fails_the_machine(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    plant, _, _ = PLANTED[name]
    plant(monkeypatch)
    config = MambaConfig(page_size=1, full_slots=10, state_slots=3)
    # No shrinking: the first failing example is enough to show the bug is seen.
    quick = settings(bounded(100), phases=(Phase.explicit, Phase.generate))
    with pytest.raises(AssertionError, match=MACHINE_SEES[name]):
        run_state_machine_as_test(make_mamba_machine(build, config), settings=quick)


# -- evict_for_alloc: the eviction the server's allocators make (spec/13m 13m.3) ----------

def test_allocations_short_of_room_evict_through_the_servers_call() -> None:
    """A campaign whose allocations come back short evicts each pool's shortfall through
    ``evict_for_alloc``, judged as ``evict_full`` / ``evict_states`` of the shortfall."""
    reached: Counter[str] = Counter()
    machine = make_mamba_machine(build, MambaConfig(page_size=1, full_slots=10,
                                                    state_slots=3), reached)
    run_until(machine, reached, "evict_for_alloc_full", batches=6)
    assert reached["evict_for_alloc_full"] and reached["evict_for_alloc_states"], reached
    assert reached["evict_for_alloc_full"] == reached["alloc_short"]


def test_a_planted_shortfall_off_by_one_fails_the_machine(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """A private copy whose ``evict_for_alloc`` asks the state walk for one state more
    than the allocator's shortfall: a second state goes where one was enough."""
    urc = importlib.import_module("sglang.srt.mem_cache.unified_radix_cache")
    base = importlib.import_module("sglang.srt.mem_cache.base_prefix_cache")
    original = urc.UnifiedRadixCache.evict_for_alloc

    def one_more(self: Any, params: Any, **kwargs: Any) -> Any:
        if params.mamba_num:
            params = base.EvictParams(num_tokens=params.num_tokens,
                                      mamba_num=params.mamba_num + 1)
        return original(self, params, **kwargs)

    monkeypatch.setattr(urc.UnifiedRadixCache, "evict_for_alloc", one_more)
    machine = make_mamba_machine(build, MambaConfig(page_size=1, full_slots=10,
                                                    state_slots=3))
    assert re.search(r"evict_for_alloc\(states short 1\) = 2", seeded_failure(machine))
