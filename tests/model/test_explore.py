"""Exhaustive exploration of the model (spec/14-exploration.md): exact counts on tiny
scopes, planted model mutants found with their shortest path, every reduction of the
canonical form shown to merge only states that behave alike, and every legal victim
choice enumerated."""

from __future__ import annotations

import itertools
from collections.abc import Callable, Hashable
from dataclasses import replace

import pytest

from hiradix_model import Key, Page, State, Victim, initial, ops, violations
from hiradix_model.errors import IllegalChoice, PreconditionError
from hiradix_model.explore import Scope, ScopeError, actions, canonical, explore, within
from hiradix_model.explore.actions import OPERATIONS
from hiradix_model.explore.victims import device_runs
from hiradix_model.state import device_evictable_leaves

TINY = Scope(device_pages=1, host_pages=1, max_key_tokens=1)
SMALL = Scope(device_pages=2, host_pages=1, max_key_tokens=2, alphabet=(1,))
# The counts these scopes have (recorded when the explorer was written; a change of the
# model or of the explorer that changes them must say why).
TINY_STATES, SMALL_STATES = 107, 189


def reached(scope: Scope) -> list[State]:
    """Every transition target of a complete exploration of ``scope``."""
    targets: list[State] = []
    result = explore(scope, watch=lambda i, s, a, t: targets.append(t))
    assert result.figures.complete and result.finding is None
    return targets


def test_tiny_scopes_are_explored_to_a_known_count() -> None:
    for scope, count in ((TINY, TINY_STATES), (SMALL, SMALL_STATES)):
        result = explore(scope)
        figures = result.figures
        assert result.finding is None and figures.complete
        assert figures.states == count == sum(figures.per_depth)
        assert figures.transitions > figures.states and figures.depth == len(figures.per_depth) - 1


def test_a_budget_leaves_the_exploration_incomplete() -> None:
    result = explore(SMALL, max_states=20)
    assert not result.figures.complete and result.figures.states <= 20 + 40


def _lazy_match(state: State, key: Key, now: int) -> tuple[State, object]:
    """A mutant: match_prefix that does not stamp the pages it matches (LRU forgets)."""
    after, result = ops.match_prefix(state, key, now)
    return replace(after, pages=state.pages), result


REAL_UNLOCK = ops.dec_lock_ref


def _shallow_unlock(state: State, page: Key | None) -> tuple[State, object]:
    """A mutant: dec_lock_ref that releases the ancestors' locks but not the page's own
    (an off-by-one in the walk up the root path)."""
    after, delta = REAL_UNLOCK(state, page)
    if page is None:
        return after, delta
    record = after.pages[page]
    moved = state.config.page_size if record.lock == 0 else 0
    return replace(after, pages={**after.pages, page: replace(record, lock=record.lock + 1)},
                   evictable_tokens=after.evictable_tokens - moved,
                   protected_tokens=after.protected_tokens + moved), delta


def test_a_mutant_that_breaks_nothing_changes_the_count(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OPERATIONS, "match_prefix", _lazy_match)
    result = explore(SMALL)
    assert result.finding is None and result.figures.complete
    assert result.figures.states != SMALL_STATES


def test_a_planted_violation_is_found_with_its_shortest_path(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(OPERATIONS, "dec_lock_ref", _shallow_unlock)
    result = explore(SMALL)
    finding = result.finding
    assert finding is not None and "INV-LOCK-MONOTONE" in finding.problems
    # The least: alloc two tokens, insert them, lock the deeper page, release it.
    assert [a.name for a in finding.path] == ["alloc", "insert", "inc_lock_ref", "dec_lock_ref"]
    script = finding.reproducer(SMALL)
    assert "ops.dec_lock_ref(s, Key(tokens=(1, 1), namespace=None))" in script
    # The reproducer runs, and fails on the violation, with the mutant in place.
    monkeypatch.setattr(ops, "dec_lock_ref", _shallow_unlock)
    with pytest.raises(AssertionError, match="INV-LOCK-MONOTONE"):
        exec(compile(script, "<reproducer>", "exec"), {})
    monkeypatch.undo()
    exec(compile(script, "<reproducer>", "exec"), {})  # the real model: nothing breaks


def test_a_model_error_is_a_finding(monkeypatch: pytest.MonkeyPatch) -> None:
    def refuses(state: State, count: int) -> tuple[State, int]:
        raise IllegalChoice("planted: writing_check refuses every count")
    monkeypatch.setitem(OPERATIONS, "writing_check", refuses)
    finding = explore(TINY).finding
    assert finding is not None and "model error" in finding.problems
    assert finding.path[-1].name == "writing_check"


# -- every reduction merges only states that behave alike (spec/14, 14.2) ------------------


def behaviour(state: State, scope: Scope) -> tuple[frozenset[str], bool, frozenset[Hashable]]:
    """What the explorer can tell of a state: its violated IDs, whether it is in scope,
    and the canonical forms of its successors."""
    successors = set()
    for action in actions(state, scope):
        try:
            successors.add(canonical(action.apply(state)))
        except PreconditionError:
            continue
    return frozenset(violations(state)), within(state, scope), frozenset(successors)


def rename_slots(state: State) -> State:
    """Swap the device pool's first and last pages (pool symmetry)."""
    last = state.config.device_slots - 1

    def swap(slot: int) -> int:
        return {0: last, last: 0}.get(slot, slot)

    pages = {k: replace(p, device=None if p.device is None else tuple(map(swap, p.device)))
             for k, p in state.pages.items()}
    pending = tuple(replace(t, src=tuple(map(swap, t.src)) if t.direction == "d2h" else t.src,
                            dst=tuple(map(swap, t.dst)) if t.direction == "h2d" else t.dst)
                    for t in state.pending)
    return replace(state, pages=pages, pending=pending,
                   device_free=frozenset(map(swap, state.device_free)),
                   held=frozenset(map(swap, state.held)),
                   device_kv={swap(s): k for s, k in state.device_kv.items()})


def stretch_ticks(state: State) -> State:
    """Every tick doubled plus one: the same order, other values."""
    pages = {k: replace(p, last_tick=2 * p.last_tick + 1, insert_tick=2 * p.insert_tick + 1)
             for k, p in state.pages.items()}
    return replace(state, pages=pages, clock=2 * state.clock + 1)


def saturate(state: State) -> State:
    """Hits raised past every threshold the configuration reads (not LFU)."""
    return replace(state, pages={k: replace(p, hits=p.hits + 5) if p.hits >= 2 else p
                                 for k, p in state.pages.items()})


def scribble_dead(state: State) -> State:
    """Free device and host slots given KV of a foreign key."""
    junk = Key((9,), "junk")
    return replace(state, device_kv={**state.device_kv, **{s: junk for s in state.device_free}},
                   host_kv={**state.host_kv, **{s: junk for s in state.host_free}})


@pytest.mark.parametrize("reduce, eviction", [
    (rename_slots, "lru"), (stretch_ticks, "lru"), (stretch_ticks, "fifo"),
    (saturate, "lru"), (saturate, "slru"), (scribble_dead, "lru")])
def test_each_reduction_merges_only_states_that_behave_alike(
        reduce: Callable[[State], State], eviction: str) -> None:
    scope = replace(SMALL, write_policy="write_through_selective", eviction=eviction)
    changed = 0
    for state in reached(scope)[::29]:
        other = reduce(state)
        if other == state:
            continue
        changed += 1
        assert canonical(other) == canonical(state)
        assert behaviour(other, scope) == behaviour(state, scope)
    assert changed >= 10, "the sample never exercised this reduction"


def test_the_canonical_form_keeps_what_behaviour_reads() -> None:
    scope = SMALL
    states = [s for s in reached(scope) if s.pages][::11]
    for state in states:
        key = sorted(state.pages, key=lambda k: k.tokens)[0]
        record = state.pages[key]
        for change in ({"lock": record.lock + 1}, {"last_tick": record.last_tick + 1}
                       if record.last_tick < state.clock else {"lock": record.lock + 2}):
            other = replace(state, pages={**state.pages, key: replace(record, **change)})
            assert canonical(other) != canonical(state)


# -- every legal choice ---------------------------------------------------------------------


def test_every_legal_device_victim_sequence_is_enumerated() -> None:
    """Brute force: every sequence of up to three cached pages that the model accepts
    reaches a state the enumeration reaches too (and no other)."""
    scope = Scope(device_pages=3, host_pages=0, max_key_tokens=2, alphabet=(1, 2))
    checked = 0
    for state in reached(scope)[::401]:
        if not device_evictable_leaves(state):
            continue
        for tokens in (1, 2):
            listed = {canonical(r.after) for r in device_runs(state, tokens)}
            brute = set()
            for length in range(0, 4):
                for pages in itertools.permutations(sorted(state.pages, key=lambda k: k.tokens),
                                                    length):
                    try:
                        after, _ = ops.evict(state, tokens, tuple(map(Victim, pages)))
                    except IllegalChoice:
                        continue
                    brute.add(canonical(after))
            assert listed == brute
            checked += 1
    assert checked >= 5


def test_a_bad_scope_names_its_field() -> None:
    with pytest.raises(ScopeError, match=r"scope\.device_pages"):
        Scope(device_pages=0)
    with pytest.raises(ScopeError, match=r"scope\.eviction"):
        Scope(eviction="random")  # type: ignore[arg-type]
    with pytest.raises(ScopeError, match=r"scope\.alphabet"):
        Scope(alphabet=(1, 1))


def test_the_initial_state_is_the_first_and_unviolated() -> None:
    first = initial(TINY.config)
    assert canonical(first) == canonical(replace(first, clock=0))
    assert not violations(first)
    assert Page(device=None, host=None).lock == 0


def test_every_legal_write_back_victim_is_enumerated() -> None:
    """Under write_back a victim without a host copy is backed up on its way out (after
    host evictions) or dropped: every eviction of one or two victims the model accepts,
    with every host victim and every host page, reaches a form enumerated (and no other)."""
    scope = Scope(device_pages=2, host_pages=1, max_key_tokens=2, alphabet=(1,),
                  write_policy="write_back")
    checked = 0
    for state in reached(scope)[::23]:
        listed = {canonical(r.after) for r in device_runs(state, 1)}
        brute = set()
        if not device_evictable_leaves(state):
            brute.add(canonical(ops.evict(state, 1, ())[0]))
        pages = sorted(state.pages, key=lambda k: k.tokens)
        options = [Victim(page, victims, slots) for page in pages
                   for victims in [(), *((k,) for k in pages)]
                   for slots in [None, *((s,) for s in range(state.config.host_slots))]]
        for sequence in [*((v,) for v in options), *itertools.permutations(options, 2)]:
            try:
                after, _ = ops.evict(state, 1, sequence)
            except (IllegalChoice, PreconditionError):
                continue
            brute.add(canonical(after))
        assert listed == brute
        checked += bool(brute)
    assert checked >= 5


def test_the_scope_bounds_cut_what_they_say() -> None:
    bounded = replace(SMALL, max_held_pages=1, partial_inserts=False, max_in_flight=1)
    targets: list[State] = []
    result = explore(bounded, watch=lambda i, s, a, t: targets.append(t))
    assert result.figures.complete and result.finding is None
    assert result.figures.cut > 0 and result.figures.states < SMALL_STATES
    assert all(len(t.held) <= 1 and len(t.pending) <= 1 for t in targets)
    assert max(len(t.held) for t in targets) == 1 and max(len(t.pending) for t in targets) == 1
    for scope, offered in ((bounded, {0}), (SMALL, {0, 1, 2})):
        counted = {a.options[2][1] for t in targets[::5] for a in actions(t, scope)
                   if a.name == "insert" and len(a.args[0].tokens) == 2}  # type: ignore[attr-defined]
        assert counted == offered
