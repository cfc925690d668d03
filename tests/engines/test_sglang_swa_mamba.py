"""SGLang 0.5.23's (FULL, SWA, MAMBA) UnifiedRadixCache through
``hiradix.engines.sglang.swa_mamba``, projected onto the (FULL, SWA) view of spec/13 and
the (FULL, MAMBA) view of spec/13m.

Runs under ``.venv-sglang23`` (``make sglang23-env``), e.g.
``HIRADIX_PROFILE=ci .venv-sglang23/bin/python -m pytest -q
tests/engines/test_sglang_swa_mamba.py``.
Skipped where SGLang is not installed or is another version; an SGLang 0.5.23 the
adapter cannot drive fails (``engine_env.require``, for both two-component engines this
adapter builds on).

Scripted scenarios check both projections by hand, the eviction cascade of
``eviction_priority`` (components/base.py:551) included; a state machine drives requests
as a scheduler does and holds every step to SGLang's own checks, both projections' model
invariants and a three-component match rule; a bug planted in a private copy of SGLang
must fail it.
"""

from __future__ import annotations

import importlib
import re
from collections import Counter, defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass, replace
from itertools import takewhile
from typing import Any

import pytest
from hybrid_support import bounded
from hypothesis import Phase, seed, settings
from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    get_state_machine_test,
    initialize,
    invariant,
    precondition,
    rule,
)

from hiradix.conformance.hybrid.abstraction import Codes, mapping_problems
from hiradix.conformance.hybrid.abstraction import abstract as abstract_swa
from hiradix.conformance.mamba.abstraction import abstract as abstract_mamba
from hiradix.conformance.mamba.engine import MambaHit
from hiradix.engines.sglang.swa_mamba import SglangSwaMambaAdapter, SwaMambaView, build
from hiradix_model import Key
from hiradix_model.components import expected_kv
from hiradix_model.hybrid import SWA_INVARIANTS, SwaConfig, SwaState, window, window_live
from hiradix_model.keys import page_keys
from hiradix_model.mamba import MAMBA_INVARIANTS, MambaState

from engine_env import require

K4, K8 = Key((1, 2, 3, 4), None), Key((1, 2, 3, 4, 5, 6, 7, 8), None)
CONFIG = SwaConfig(page_size=1, full_slots=32, swa_slots=16, window=4)
# INV-SWA-WINDOW-COUNT equates each page's SWA lock count with the locks whose window
# (13.2) covers it, given which locks released their window early (``SwaState.released``).
# A view carries no lock history, and SGLang's SWA lock covers whole nodes (DEV-H1), so
# it is not a property of a single projected state: the SWA machine judges it against
# the model's transitions instead. Every other invariant of both models is judged here.
NOT_A_STATE_PROPERTY = frozenset({"INV-SWA-WINDOW-COUNT"})


@pytest.fixture(autouse=True)
def sglang_installed() -> str:
    """Skip without SGLang 0.5.23; fail where it is installed but either adapter this
    one builds on does not probe."""
    require("sglang-mamba")
    return require("sglang-swa")


Make = Callable[..., SglangSwaMambaAdapter]


@pytest.fixture
def make() -> Iterator[Make]:
    """``build(config, state_slots)``; every cache a test builds is closed after it."""
    built: list[SglangSwaMambaAdapter] = []

    def tracked(config: SwaConfig = CONFIG, state_slots: int = 4) -> SglangSwaMambaAdapter:
        built.append(build(config, state_slots))
        return built[-1]

    yield tracked
    for adapter in built:
        adapter.close()


# -- judging the projections -------------------------------------------------------------


@dataclass
class Judge:
    """The content codes a test wrote, and the two projections' model states."""

    kv: Codes
    states: Codes

    def project(self, adapter: SglangSwaMambaAdapter,
                view: SwaMambaView) -> tuple[SwaState, MambaState]:
        return (abstract_swa(view.swa, adapter.swa_config, self.kv),
                abstract_mamba(view.mamba, adapter.config, self.kv, self.states))

    def problems(self, adapter: SglangSwaMambaAdapter) -> list[str]:
        """Every problem of the engine's state now: its own check, the SWA mapping, and
        each projection's model invariants."""
        view = adapter.observe()
        swa, mamba = self.project(adapter, view)
        found = [f"engine's own check: {view.swa.own_check}"] if view.swa.own_check else []
        found += mapping_problems(view.swa)
        found += [f"{spec_id}: {v}" for spec_id, predicate in SWA_INVARIANTS.items()
                  if spec_id not in NOT_A_STATE_PROPERTY for v in predicate(swa)]
        found += [f"{spec_id}: {v}" for spec_id, predicate in MAMBA_INVARIANTS.items()
                  for v in predicate(mamba)]
        return found

    def write(self, adapter: SglangSwaMambaAdapter, key: Key, start: int,
              slots: tuple[int, ...]) -> None:
        """The forward pass: the KV of ``key``'s positions from ``start`` into ``slots``."""
        ps = adapter.ps
        adapter.write_kv(slots, [self.kv.code(expected_kv(
            Key(key.tokens[:(i // ps + 1) * ps], None), i % ps, ps))
            for i in range(start, start + len(slots))])


def match_problems(swa: SwaState, mamba: MambaState, key: Key, hit: MambaHit) -> list[str]:
    """The three-component match rule: a request resumes at the deepest cached page of
    ``key`` whose window is live (spec/13 INV-SWA-MATCH-LIVE) and which holds a state
    (spec/13m INV-MAMBA-MATCH-STATE), or at the root; its full slots are that page's
    path, and the full hit is the longest cached run."""
    found = []
    cached = list(takewhile(lambda k: k in swa.pages, page_keys(key, swa.config.page_size)))
    usable = [k for k in cached if window_live(swa, k) and mamba.pages[k].state is not None]
    want = usable[-1] if usable else None
    if hit.page != want:
        found.append(f"the match of {key} ends at {hit.page}, the deepest page with a "
                     f"live window and a state is {want}")
    path = tuple(s for k in cached if want is not None and len(k.tokens) <= len(want.tokens)
                 for s in mamba.pages[k].full)
    if hit.page == want and hit.full != path:
        found.append(f"the match of {key} returned full slots {hit.full}, its path {path}")
    if hit.full_hit != len(cached) * swa.config.page_size:
        found.append(f"the match of {key} reports a full hit of {hit.full_hit}, the cache "
                     f"holds {len(cached) * swa.config.page_size}")
    return found


def fresh_judge() -> Judge:
    return Judge(Codes(), Codes())


def checked(adapter: SglangSwaMambaAdapter, judge: Judge) -> SwaMambaView:
    problems = judge.problems(adapter)
    assert not problems, problems
    return adapter.observe()


def put(adapter: SglangSwaMambaAdapter, judge: Judge, key: Key,
        swa_evicted: int = 0) -> tuple[tuple[int, ...], int]:
    """A request's life up to its insert, without locks: match, fresh pairs for the rest,
    the forward pass, a fresh state after ``key``, the SWA halves before ``swa_evicted``
    dropped, insert. Its full slots and state; the insert must take the state."""
    hit = adapter.match_prefix(key)
    fresh = adapter.alloc(len(key.tokens) - len(hit.full))
    assert fresh is not None
    judge.write(adapter, key, len(hit.full), fresh)
    state = adapter.alloc_state()
    assert state is not None
    adapter.write_state(state, judge.states.code(key))
    if swa_evicted > len(hit.full):
        adapter.free_swa(fresh[:swa_evicted - len(hit.full)])
    assert adapter.insert(key, hit.full + fresh, state, swa_evicted) == (len(hit.full), True)
    return hit.full + fresh, state


def by_length(view: SwaMambaView) -> dict[int, tuple[bool, int | None, int, int, int]]:
    """Page length -> (SWA live, state, full lock, SWA lock, state lock)."""
    return {len(k.tokens): (p.swa is not None, view.mamba.pages[k].state, p.lock, p.swa_lock,
                            view.mamba.pages[k].state_lock)
            for k, p in view.swa.pages.items()}


# -- scripted scenarios -------------------------------------------------------------------


def test_one_insert_gives_live_pages_pairs_and_a_state_at_the_end(make: Make) -> None:
    adapter, judge = make(), fresh_judge()
    full, state = put(adapter, judge, K8)
    view = checked(adapter, judge)
    assert by_length(view) == {n: (True, state if n == 8 else None, 0, 0, 0)
                               for n in range(1, 9)}
    assert view.swa.pairs.keys() == set(full)  # every pair kept its SWA half
    assert view.mamba.state_free == frozenset(range(4)) - {state}
    assert view.swa.full_free == view.mamba.full_free == frozenset(range(32)) - set(full)
    assert adapter.match_prefix(K8) == MambaHit(full, K8, 8)
    assert adapter.match_prefix(K4) == MambaHit((), None, 4)  # no state after (1..4)


def test_a_match_needs_both_a_live_window_and_a_state(make: Make) -> None:
    """(1..4) holds a state but its pages are tombstones: no match ends there."""
    adapter, judge = make(), fresh_judge()
    put(adapter, judge, K4, swa_evicted=4)
    view = checked(adapter, judge)
    assert by_length(view)[4][:2] == (False, 0)
    assert adapter.match_prefix(K4) == MambaHit((), None, 4)


def internal_state_and_locked_leaf(adapter: SglangSwaMambaAdapter,
                                   judge: Judge) -> tuple[int, int, object]:
    """(1..4) with state a, (1..8) with state b, then (1..8) locked with its state: the
    locked window is the leaf node (5..8), so only the internal node (1..4) is
    evictable. The states and the receipt."""
    _, a = put(adapter, judge, K4)
    _, b = put(adapter, judge, K8)
    return a, b, adapter.lock(K8, True)


@pytest.mark.parametrize("ps", [1, 2])
def test_evicting_an_internal_nodes_swa_cascades_to_its_state(make: Make, ps: int) -> None:
    """components/base.py:551: SWA eviction of an internal node cascades to Mamba; the
    full KV stays (a tombstone), and the match falls back to (1..8), still usable.
    Page size 2 builds the Mamba pool and component with the extra buffer."""
    adapter = make(SwaConfig(page_size=ps, full_slots=32, swa_slots=16, window=4))
    judge = fresh_judge()
    a, b, receipt = internal_state_and_locked_leaf(adapter, judge)
    assert adapter.evict_swa(1) == 4
    view = checked(adapter, judge)
    assert {n: p[:2] for n, p in by_length(view).items()} == {
        n: (n > 4, b if n == 8 else None) for n in range(ps, 9, ps)}
    assert a in view.mamba.state_free and b not in view.mamba.state_free
    assert len(view.swa.full_free) == 32 - 8  # the tombstones keep their full KV
    adapter.unlock(receipt, False)
    assert adapter.match_prefix(K4).page is None
    assert adapter.match_prefix(K8).page == K8


def test_evicting_an_internal_nodes_state_keeps_its_swa(make: Make) -> None:
    """Mamba eviction of an internal node cascades to nothing (lowest priority)."""
    adapter, judge = make(), fresh_judge()
    a, b, receipt = internal_state_and_locked_leaf(adapter, judge)
    assert adapter.evict_states(1) == 1
    view = checked(adapter, judge)
    assert {n: p[:2] for n, p in by_length(view).items()} == {
        n: (True, b if n == 8 else None) for n in range(1, 9)}
    assert a in view.mamba.state_free
    adapter.unlock(receipt, False)


@pytest.mark.parametrize("evict", ["full", "swa", "states"])
def test_a_leaf_eviction_drops_all_three(make: Make, evict: str) -> None:
    adapter, judge = make(), fresh_judge()
    put(adapter, judge, K4)
    call = {"full": adapter.evict_full, "swa": adapter.evict_swa,
            "states": adapter.evict_states}[evict]
    assert call(1) >= 1
    view = checked(adapter, judge)
    assert not view.swa.pages and not view.mamba.pages
    assert view.swa.full_free == frozenset(range(32)) and not view.swa.pairs
    assert view.swa.swa_free == frozenset(range(16))
    assert view.mamba.state_free == frozenset(range(4))


def test_an_early_swa_release_takes_the_state_lock_with_it(make: Make) -> None:
    """``dec_swa_lock_only`` drops the lower-priority Mamba lock co-located on the node;
    the Mamba-only release is then refused (SGLang's ``_alloc_mamba_slot`` checks
    ``not lock.swa_released``), and the unlock releases the full lock alone."""
    adapter, judge = make(), fresh_judge()
    put(adapter, judge, K4)
    put(adapter, judge, K8)
    receipt = adapter.lock(K8, True)
    assert {n: p[2:] for n, p in by_length(checked(adapter, judge)).items()} == {
        n: (1, int(n > 4), int(n == 8)) for n in range(1, 9)}
    adapter.release_swa(receipt)
    assert {n: p[2:] for n, p in by_length(checked(adapter, judge)).items()} == {
        n: (1, 0, 0) for n in range(1, 9)}
    with pytest.raises(ValueError, match="released its SWA part"):
        adapter.release_state(receipt)
    with pytest.raises(ValueError, match="holds no state lock"):
        adapter.unlock(receipt, False)  # its state lock went with the SWA release
    adapter.unlock(receipt, True)
    assert {p[2:] for p in by_length(checked(adapter, judge)).values()} == {(0, 0, 0)}


def test_an_early_state_release_keeps_the_swa_lock(make: Make) -> None:
    adapter, judge = make(), fresh_judge()
    put(adapter, judge, K8)
    receipt = adapter.lock(K8, True)
    adapter.release_state(receipt)
    assert {n: p[2:] for n, p in by_length(checked(adapter, judge)).items()} == {
        n: (1, int(n > 4), 0) for n in range(1, 9)}
    assert adapter.evict_states(1) == 1  # the leaf keeps its full and SWA locks
    view = checked(adapter, judge)
    assert len(view.swa.pages) == 8 and by_length(view)[8][1] is None
    adapter.release_swa(receipt)  # the receipt skips Mamba now: no second release
    adapter.unlock(receipt, True)
    assert {p[2:] for p in by_length(checked(adapter, judge)).values()} == {(0, 0, 0)}


def state_behind_a_dead_window(adapter: SglangSwaMambaAdapter, judge: Judge) -> Key:
    """(1, 2) with a state, (1, 2, 3) with a state, then one SWA eviction: it tombstones
    the internal node (1, 2) (the least recent), its state cascading; the leaf (3) keeps
    its state, but its window of 2 tokens now reaches a tombstone. The leaf's key."""
    put(adapter, judge, Key((1, 2), None))
    key = Key((1, 2, 3), None)
    put(adapter, judge, key)
    assert adapter.evict_swa(1) == 2
    return key


def test_a_state_whose_window_died_is_not_matched(make: Make) -> None:
    adapter, judge = make(SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=2)), \
        fresh_judge()
    key = state_behind_a_dead_window(adapter, judge)
    view = checked(adapter, judge)
    assert {n: p[:2] for n, p in by_length(view).items()} == {
        1: (False, None), 2: (False, None), 3: (True, view.mamba.pages[key].state)}
    swa, mamba = judge.project(adapter, view)
    hit = adapter.match_prefix(key)
    assert hit == MambaHit((), None, 3) and not match_problems(swa, mamba, key, hit)


def test_a_healing_insert_brings_tombstones_back_and_frees_the_old_full_slots(
        make: Make) -> None:
    adapter, judge = make(), fresh_judge()
    old, _ = put(adapter, judge, K8, swa_evicted=4)
    new = adapter.alloc(8)
    assert new is not None
    judge.write(adapter, K8, 0, new)
    state = adapter.alloc_state()
    assert state is not None
    adapter.write_state(state, judge.states.code(K8))
    assert adapter.insert(K8, new, state, 0) == (8, False)  # the cached state stays
    view = checked(adapter, judge)
    assert all(live for live, *_ in by_length(view).values())
    assert set(old[:4]) <= view.swa.full_free
    adapter.free([s for s in new if s in adapter.held_full])
    adapter.free_state(state)
    checked(adapter, judge)


# -- the machine --------------------------------------------------------------------------

MACHINE_CONFIG = SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=2)
MACHINE_STATES = 3
# Mostly 1s: keys extend each other, so states end up on internal nodes.
TOKENS = st.lists(st.sampled_from([1, 1, 1, 2]), min_size=1, max_size=6).map(tuple)
MAX_RUNNING = 2


@dataclass
class Request:
    """A running request: its key, the page its match ended at (where it is locked;
    None: the root) and the lock's receipt, its full slots (prefix + fresh), its state
    slot, how far its SWA halves were dropped, its early releases."""

    key: Key
    page: Key | None
    receipt: object
    slots: tuple[int, ...]
    prefix: int
    state: int
    swa_evicted: int = 0
    swa_released: bool = False
    state_released: bool = False


def make_machine(reached: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """A machine over a fresh (FULL, SWA, MAMBA) cache per example."""
    seen = reached if reached is not None else Counter()
    config = MACHINE_CONFIG

    class SwaMambaMachine(RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            self.adapter: SglangSwaMambaAdapter = build(config, MACHINE_STATES)
            self.judge = fresh_judge()
            self.running: list[Request] = []
            seen["examples"] += 1

        def teardown(self) -> None:
            self.adapter.close()

        @initialize()
        def start(self) -> None:
            self.check("the initial state")

        def check(self, step: str) -> None:
            seen["checks"] += 1
            problems = self.judge.problems(self.adapter)
            assert not problems, f"after {step}:\n  " + "\n  ".join(problems)

        def projections(self) -> tuple[SwaState, MambaState]:
            return self.judge.project(self.adapter, self.adapter.observe())

        def match(self, key: Key) -> MambaHit:
            swa, mamba = self.projections()
            hit = self.adapter.match_prefix(key)
            seen["matched"] += hit.page is not None
            # Matches that pass a state SGLang must refuse (its window is dead): where
            # the SWA validator shows.
            seen["matched_past_dead_windows"] += any(
                k in mamba.pages and mamba.pages[k].state is not None and not window_live(swa, k)
                for k in page_keys(key, config.page_size))
            problems = match_problems(swa, mamba, key, hit)
            assert not problems, "\n  ".join(problems)
            return hit

        # -- requests ---------------------------------------------------------------------

        @precondition(lambda self: len(self.running) < MAX_RUNNING)
        @rule(tokens=TOKENS, next_turn=st.booleans())
        def admit(self, tokens: tuple[int, ...], next_turn: bool) -> None:
            """A new request; with ``next_turn`` the next turn of a conversation: it
            continues the deepest cached key holding a state with the first of
            ``tokens``. Turn after turn, earlier turns' states sit on internal nodes
            outside the running turn's locked window, where SWA eviction cascades to
            them (components/base.py:551); a turn shorter than the window reaches back
            into the turn before, so that tombstoning it leaves the later state behind
            a dead window."""
            _, mamba = self.projections()
            turns = [k for k, p in mamba.pages.items() if p.state is not None]
            if next_turn and turns:
                seen["next_turns"] += 1
                deepest = max(turns, key=lambda k: (len(k.tokens), k.tokens))
                tokens = deepest.tokens + tokens[:1]
            self.admit_key(Key(tokens, None))

        def admit_key(self, key: Key) -> None:
            """Admission: match and lock, a state, fresh pairs (the allocators evicting
            when short, as the server's do), the forward pass."""
            tokens = key.tokens
            hit = self.match(key)
            receipt = self.adapter.lock(hit.page, True)
            state = self.alloc_state()
            fresh = None if state is None else self.alloc(len(tokens) - len(hit.full))
            if state is None or fresh is None:
                seen["admit_abandoned"] += 1
                if state is not None:
                    self.adapter.free_state(state)
                self.adapter.unlock(receipt, False)
                self.check(f"an abandoned admission of {tokens}")
                return
            self.judge.write(self.adapter, key, len(hit.full), fresh)
            self.adapter.write_state(state, self.judge.states.code(key))
            self.running.append(Request(key, hit.page, receipt, hit.full + fresh,
                                        len(hit.full), state))
            seen["admitted"] += 1
            self.check(f"admit({tokens}) matched {len(hit.full)}")

        def alloc_state(self) -> int | None:
            state: int | None = self.adapter.alloc_state()
            if state is None:
                seen["evict_for_alloc_states"] += 1
                self.adapter.evict_for_alloc(0, 1)
                self.check("evict_for_alloc(states short 1)")
                state = self.adapter.alloc_state()
            return state

        def alloc(self, need: int) -> tuple[int, ...] | None:
            fresh: tuple[int, ...] | None = self.adapter.alloc(need)
            if fresh is None:
                view = self.adapter.observe().swa
                full_short = max(0, need - len(view.full_free))
                swa_short = max(0, need - len(view.swa_free))
                seen["evict_for_alloc_kv"] += 1
                self.adapter.evict_for_alloc(full_short, 0, swa_short)
                self.check(f"evict_for_alloc(full short {full_short}, swa short {swa_short})")
                fresh = self.adapter.alloc(need)
            return fresh

        @precondition(lambda self: self.running)
        @rule(data=st.data())
        def slide_window(self, data: st.DataObject) -> None:
            """Decode moved past the window: the SWA halves of fresh pairs before a new
            cursor are dropped (``free_swa_out_of_window_slots``)."""
            r = data.draw(st.sampled_from(self.running))
            last = len(r.key.tokens) - config.window
            low = max(r.swa_evicted, r.prefix)
            if last <= low:
                return
            end = data.draw(st.integers(low + 1, last))
            self.adapter.free_swa(r.slots[low:end])
            r.swa_evicted = end
            seen["slid"] += 1
            self.check(f"free_swa of {r.key.tokens} up to {end}")

        @precondition(lambda self: any(not r.swa_released for r in self.running))
        @rule(data=st.data())
        def release_swa(self, data: st.DataObject) -> None:
            r = data.draw(st.sampled_from([r for r in self.running if not r.swa_released]))
            self.adapter.release_swa(r.receipt)
            r.swa_released = True
            seen["release_swa"] += 1
            self.check(f"release_swa of {r.key.tokens}")

        @precondition(lambda self: any(not (r.swa_released or r.state_released)
                                       for r in self.running))
        @rule(data=st.data())
        def release_state(self, data: st.DataObject) -> None:
            r = data.draw(st.sampled_from([r for r in self.running
                                           if not (r.swa_released or r.state_released)]))
            self.adapter.release_state(r.receipt)
            r.state_released = True
            seen["release_state"] += 1
            self.check(f"release_state of {r.key.tokens}")

        @precondition(lambda self: self.running)
        @rule(data=st.data(), abort=st.sampled_from([False, False, True]))
        def finish(self, data: st.DataObject, abort: bool) -> None:
            """The request ends: finished, it inserts its key with its state and frees
            what the tree did not take; aborted, it frees its pairs and state. Then its
            lock is released."""
            r = data.draw(st.sampled_from(self.running))
            self.running.remove(r)
            took = False
            if not abort:
                _, took = self.adapter.insert(r.key, r.slots, r.state, r.swa_evicted)
                seen["insert_took_state" if took else "insert_kept_state"] += 1
            self.adapter.free([s for s in r.slots[r.prefix:] if s in self.adapter.held_full])
            if not took:
                self.adapter.free_state(r.state)
            self.adapter.unlock(r.receipt, r.swa_released or r.state_released)
            self.count_states_on_tombstones()
            self.check(f"{'abort' if abort else 'finish'} of {r.key.tokens}")

        def count_states_on_tombstones(self) -> None:
            """Counted, not judged: a state on a tombstone page is unreachable by any
            match until a heal (no model rule covers three components yet)."""
            swa, mamba = self.projections()
            seen["states_on_tombstones"] += sum(
                1 for k, p in mamba.pages.items() if p.state is not None and not swa.pages[k].live)
            seen["states_with_dead_windows"] += sum(
                1 for k, p in mamba.pages.items() if p.state is not None
                and not window_live(swa, k))

        # -- the cache alone --------------------------------------------------------------

        @rule(tokens=TOKENS)
        def match_only(self, tokens: tuple[int, ...]) -> None:
            self.match(Key(tokens, None))
            self.check(f"match_prefix({tokens})")

        def behind_dead_windows(self) -> list[tuple[int, ...]]:
            """The keys of cached states whose window died (sorted): SGLang must not
            resume from any of them."""
            swa, mamba = self.projections()
            return sorted(k.tokens for k, p in mamba.pages.items()
                          if p.state is not None and not window_live(swa, k))

        @precondition(lambda self: self.behind_dead_windows())
        @rule(data=st.data())
        def repeat_a_prompt_whose_window_died(self, data: st.DataObject) -> None:
            """A prompt seen before whose state is cached but whose window died since
            (an earlier turn's pages tombstoned): its match must stop short of it."""
            tokens = data.draw(st.sampled_from(self.behind_dead_windows()))
            self.match(Key(tokens, None))
            self.check(f"match_prefix({tokens}) of a state behind a dead window")

        def evict(self, component: str, count: int) -> None:
            swa, mamba = self.projections()
            call = {"full": self.adapter.evict_full, "swa": self.adapter.evict_swa,
                    "states": self.adapter.evict_states}[component]
            seen[f"evicted_{component}"] += call(count) > 0
            after, _ = self.projections()
            # SWA tombstoning of pages that held a state: the cascade of base.py:551.
            seen["swa_cascades"] += sum(1 for k, p in mamba.pages.items() if p.state is not None
                                        and swa.pages[k].live and k in after.pages
                                        and not after.pages[k].live)
            self.count_states_on_tombstones()
            self.check(f"evict_{component}({count})")

        @rule(count=st.integers(1, 4))
        def evict_full(self, count: int) -> None:
            self.evict("full", count)

        @rule(count=st.integers(1, 4))
        def evict_swa(self, count: int) -> None:
            self.evict("swa", count)

        @rule(count=st.integers(1, 2))
        def evict_states(self, count: int) -> None:
            self.evict("states", count)

        @invariant()
        def nothing_leaks(self) -> None:
            """The slots the machine's requests hold are exactly the adapter's held."""
            held = {s for r in self.running for s in r.slots[r.prefix:]}
            assert held == self.adapter.held_full, (held, self.adapter.held_full)

        @invariant()
        def locks_are_the_running_requests(self) -> None:
            """Between steps, the locks on the cache are the running requests' (held
            to what the projections' models say of a lock, spec/13 13.2, spec/13m
            13m.2): a page's full lock counts the requests locked at or below it; a
            request holding its SWA part has SWA locks on every page of its window
            (more where SGLang locks whole nodes, DEV-H1) and none is left once no
            request holds one; the state locks are one per request holding its state
            part, on its page."""
            swa, mamba = self.projections()
            locked = [(r.page, r) for r in self.running if r.page is not None]
            for key, page in swa.pages.items():
                below = sum(at.tokens[:len(key.tokens)] == key.tokens for at, _ in locked)
                assert page.lock == below, f"{key}: full lock {page.lock}, {below} requests"
            swa_holders = [at for at, r in locked if not r.swa_released]
            for at in swa_holders:
                short = [k for k in window(swa, at) if swa.pages[k].swa_lock < 1]
                assert not short, f"{at}'s window has pages without SWA lock: {short}"
            if not swa_holders:
                assert all(p.swa_lock == 0 for p in swa.pages.values()), "stray SWA locks"
            state_holders = Counter(at for at, r in locked
                                    if not (r.swa_released or r.state_released))
            state_locks = Counter({k: p.state_lock for k, p in mamba.pages.items()
                                   if p.state_lock})
            assert state_locks == state_holders, (
                f"state locks {dict(state_locks)}, requests holding their state part "
                f"{dict(state_holders)}")

    return SwaMambaMachine


# What the campaign must reach for its checks to mean something.
GOALS = ("matched", "next_turns", "evicted_full", "evicted_swa", "evicted_states",
         "swa_cascades", "matched_past_dead_windows", "evict_for_alloc_kv",
         "evict_for_alloc_states", "release_swa", "release_state", "insert_took_state",
         "slid")
# Fixed seeds, as ``hybrid_support.run_until``: unlike ``derandomize`` they do not change
# with the machine's source, which would let an unrelated edit move the rare states
# (``swa_cascades``, ``matched_past_dead_windows``) out of reach. A run can still differ
# with what the process ran before it (seen: seed 0 caught the planted window bug alone,
# not after three other planted runs in one process); a suspect is SGLang's full
# eviction, which heaps its leaves out of a set of nodes (components/full.py:213) in an
# order that follows their addresses. Hence further seeds where one falls short.
SEEDS = (0, 1, 2)


def run_seeded(machine: type[RuleBasedStateMachine], index: int, *,
               shrink: bool = True) -> None:
    """One run of ``machine`` from ``SEEDS[index]``: 300 examples of up to 50 steps,
    about 10 s here. Without ``shrink`` the first failing example is raised as found."""
    options = settings(bounded(300), stateful_step_count=50, derandomize=False)
    if not shrink:
        options = settings(options, phases=[Phase.generate])
    seed(SEEDS[index])(get_state_machine_test(machine, settings=options))()


def test_sglang_passes_every_check_of_both_projections() -> None:
    reached: Counter[str] = Counter()
    for index in range(len(SEEDS)):
        run_seeded(make_machine(reached), index)
        if all(reached[goal] for goal in GOALS):
            break
    assert reached["checks"] > reached["examples"], reached
    missed = [goal for goal in GOALS if not reached[goal]]
    assert not missed, (missed, reached)


# -- a bug planted in a private copy of SGLang --------------------------------------------


def mamba_component() -> Any:
    return importlib.import_module("sglang.srt.mem_cache.unified_cache.components.mamba")


def cascade_leaks_the_state(monkeypatch: pytest.MonkeyPatch) -> None:
    """SWA eviction of an internal node cascades to its Mamba state, which is dropped
    from the node but never reaches the Mamba allocator (the shape of the SWA pool leak
    of PR #27586, one component down). Only the SWA->Mamba cascade: by the time MAMBA's
    turn comes in ``_cascade_evict`` (components in order FULL, SWA, MAMBA) the SWA
    value is gone; a Mamba eviction of its own finds it there."""
    mamba = mamba_component()
    swa_type = importlib.import_module(
        "sglang.srt.mem_cache.unified_cache.components").ComponentType.SWA
    original = mamba.MambaComponent.evict_component

    def evict_component(self: Any, node: Any, device_frees: Any, *args: Any,
                        **kwargs: Any) -> Any:
        if node.children and node.component_data[swa_type].value is None:
            device_frees = defaultdict(list)
        return original(self, node, device_frees, *args, **kwargs)

    monkeypatch.setattr(mamba.MambaComponent, "evict_component", evict_component)


def test_the_planted_cascade_leak_shows_in_a_scripted_scenario(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    cascade_leaks_the_state(monkeypatch)
    adapter, judge = make(), fresh_judge()
    internal_state_and_locked_leaf(adapter, judge)
    adapter.evict_swa(1)
    problem = adapter.observe().swa.own_check
    assert problem is not None and "mamba pool balance" in problem, problem


def window_ignored_by_match(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA match validator accepts every node: with the Mamba validator still on, a
    match may end at a state whose window is dead."""
    swa = importlib.import_module("sglang.srt.mem_cache.unified_cache.components.swa")
    monkeypatch.setattr(swa.SWAComponent, "create_match_validator",
                        lambda self, match_device_only=False: (lambda node: True))


def leaf_state_freed_twice(monkeypatch: pytest.MonkeyPatch) -> None:
    """Deleting a leaf frees its Mamba state twice (a double free): the slot goes on the
    allocator's free list twice, so two later requests can be handed the same state."""
    mamba = mamba_component()
    original = mamba.MambaComponent.evict_component

    def evict_component(self: Any, node: Any, device_frees: Any, *args: Any,
                        **kwargs: Any) -> Any:
        value = node.component_data[self.component_type].value
        done = original(self, node, device_frees, *args, **kwargs)
        if value is not None and not node.children:
            device_frees[self.component_type].append(value)
        return done

    monkeypatch.setattr(mamba.MambaComponent, "evict_component", evict_component)


def test_the_planted_window_bug_shows_in_a_scripted_scenario(
        make: Make, monkeypatch: pytest.MonkeyPatch) -> None:
    window_ignored_by_match(monkeypatch)
    adapter, judge = make(SwaConfig(page_size=1, full_slots=16, swa_slots=8, window=2)), \
        fresh_judge()
    key = state_behind_a_dead_window(adapter, judge)
    swa, mamba = judge.project(adapter, adapter.observe())
    problems = match_problems(swa, mamba, key, adapter.match_prefix(key))
    assert problems and "the deepest page with a live window and a state is None" in \
        problems[0], problems


def swa_release_keeps_the_state_lock(monkeypatch: pytest.MonkeyPatch) -> None:
    """The SWA early release forgets the lower-priority Mamba lock it must drop with it
    (``dec_swa_lock_only``'s second loop), and the unlock after it skips SWA and below:
    the state lock is never released. SGLang's own checks pass (a locked state is just
    protected); the lock accounting sees it."""
    core = importlib.import_module("sglang.srt.mem_cache.unified_cache.unified_tree_core")
    mamba_type = importlib.import_module(
        "sglang.srt.mem_cache.unified_cache.components").ComponentType.MAMBA
    original = core.UnifiedTreeCore.dec_swa_lock_only

    def dec_swa_lock_only(self: Any, node_id: Any, params: Any) -> Any:
        skipped = (*params.skipped_lock_components, mamba_type)
        return original(self, node_id, replace(params, skipped_lock_components=skipped))

    monkeypatch.setattr(core.UnifiedTreeCore, "dec_swa_lock_only", dec_swa_lock_only)


# Each planted bug, and what the machine must report first.
PLANTED: dict[str, tuple[Callable[[pytest.MonkeyPatch], None], str]] = {
    "SWA->Mamba cascade leaks the state": (cascade_leaks_the_state,
                                           "engine's own check: mamba pool balance"),
    "window ignored by the match": (window_ignored_by_match,
                                    "the deepest page with a live window and a state is"),
    "a leaf's state freed twice": (leaf_state_freed_twice,
                                   "engine's own check: mamba pool balance"),
    "the SWA release keeps the state lock": (swa_release_keeps_the_state_lock,
                                             "requests holding their state part"),
}


@pytest.mark.parametrize("name", sorted(PLANTED))
def test_a_bug_planted_in_sglang_fails_the_machine(name: str,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    """Unshrunk: the first failing example is enough to show the bug is seen. The same
    run passes unplanted (``test_sglang_passes_every_check_of_both_projections``)."""
    plant, expected = PLANTED[name]
    plant(monkeypatch)
    failure = ""
    for index in range(len(SEEDS)):
        try:
            run_seeded(make_machine(), index, shrink=False)
        except AssertionError as failed:
            failure = str(failed)
            break
    assert re.search(expected, failure), failure or "no seed failed"
