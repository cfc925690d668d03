"""The model alone under random operation sequences (tests/ of issue #2).

Small alphabets so prefixes collide, small capacities so both tiers fill up. Every step
checks every invariant; every nondeterministic choice comes from the reference choosers
(legal), and dedicated rules perturb a legal choice into an illegal one and require the
model to reject it without touching its state.
"""

from __future__ import annotations

import copy
import random
from collections.abc import Callable

import pytest
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hiradix_model import (
    STRATEGIES,
    WRITE_POLICIES,
    Backup,
    Config,
    IllegalChoice,
    Key,
    MatchResult,
    PreconditionError,
    State,
    Victim,
    check,
    choosers,
    initial,
    ops,
    violations,
)
from hiradix_model.keys import parent_page
from hiradix_model.state import device_evictable_leaves, host_evictable_leaves, transfer_locks
from hiradix_model.strategies import eviction_key

from stats import RUNS, Stepping

keys = st.builds(
    Key,
    st.lists(st.integers(1, 3), max_size=12).map(tuple),
    st.sampled_from([None, None, "b"]),
)
seeds = st.integers(0, 2**16)


class ModelMachine(Stepping, RuleBasedStateMachine):
    tally = RUNS
    state: State

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.caller_locks: list[Key | None] = []
        self.holdings: list[tuple[int, ...]] = []
        self.seen: list[Key] = []
        RUNS["examples"] += 1

    @initialize(
        page_size=st.sampled_from([1, 2, 4]),
        policy=st.sampled_from(WRITE_POLICIES),
        strategy=st.sampled_from(STRATEGIES),
        device_pages=st.integers(2, 6),
        host_pages=st.integers(1, 8),
        threshold_pages=st.integers(0, 3),
    )
    def start(self, page_size: int, policy: str, strategy: str, device_pages: int,
              host_pages: int, threshold_pages: int) -> None:
        self.state = initial(Config(
            page_size=page_size, device_slots=device_pages * page_size,
            host_slots=host_pages * page_size, write_policy=policy,  # type: ignore[arg-type]
            eviction=strategy, load_back_threshold=threshold_pages * page_size,  # type: ignore[arg-type]
        ))

    # -- helpers ---------------------------------------------------------------------

    def tick(self, dt: int) -> int:
        self.now += dt
        return self.now

    def pages(self, want: Callable[[object], bool]) -> list[Key]:
        return sorted((k for k, p in self.state.pages.items() if want(p)), key=repr)

    # -- legal operations ------------------------------------------------------------

    @rule(key=keys, dt=st.integers(0, 2))
    def match(self, key: Key, dt: int) -> None:
        result = self.apply("match_prefix", ops.match_prefix, key, self.tick(dt))
        assert isinstance(result, MatchResult)
        assert len(result.device_slots) % self.state.config.page_size == 0

    @rule(batch=st.lists(keys, min_size=1, max_size=3), dt=st.integers(0, 2), seed=seeds,
          chunked=st.booleans(), priority=st.integers(0, 2), keep_lock=st.booleans(),
          counted_pages=st.one_of(st.just(0), st.just(0), st.integers(1, 6)))
    def requests(self, batch: list[Key], dt: int, seed: int, chunked: bool, priority: int,
                 keep_lock: bool, counted_pages: int) -> None:
        for key in batch:
            self.request(key, dt, random.Random(seed), chunked, priority, keep_lock,
                         counted_pages)

    # A returning request after its backups landed and the device filled up: what makes
    # host hits and copying load-backs frequent (a random key rarely repeats a prefix).
    @precondition(lambda self: bool(self.seen))
    @rule(index=st.integers(0, 63), evict_first=st.integers(1, 24), seed=seeds)
    def request_again(self, index: int, evict_first: int, seed: int) -> None:
        rng = random.Random(seed)
        queued = sum(t.direction == "d2h" for t in self.state.pending)
        self.apply("writing_check", ops.writing_check, queued)
        victims = choosers.choose_evict(self.state, evict_first, rng)
        self.apply("evict", ops.evict, evict_first, victims)
        self.request(self.seen[index % len(self.seen)], 1, rng, False, 0, False)

    def request(self, key: Key, dt: int, rng: random.Random, chunked: bool, priority: int,
                keep_lock: bool, counted_pages: int = 0) -> None:
        self.seen.append(key)
        match = self.serve(key, rng, (dt, dt, dt), priority=priority, chunked=chunked,
                           counted_pages=counted_pages)
        if keep_lock:
            self.caller_locks.append(match.last_device_page)
        else:
            self.apply("dec_lock_ref", ops.dec_lock_ref, match.last_device_page)

    @rule(data=st.data())
    def lock(self, data: st.DataObject) -> None:
        candidates = self.pages(lambda p: p.device is not None)
        if candidates:
            page = data.draw(st.sampled_from(candidates))
            self.apply("inc_lock_ref", ops.inc_lock_ref, page)
            self.caller_locks.append(page)

    @precondition(lambda self: bool(self.caller_locks))
    @rule(data=st.data())
    def unlock(self, data: st.DataObject) -> None:
        index = data.draw(st.integers(0, len(self.caller_locks) - 1))
        self.apply("dec_lock_ref", ops.dec_lock_ref, self.caller_locks.pop(index))

    @rule(key=keys, seed=seeds)
    def hold(self, key: Key, seed: int) -> None:
        ps = self.state.config.page_size
        count = min(len(key.tokens), len(self.state.device_free)) // ps * ps
        slots = choosers.free_pages(self.state.device_free, count, random.Random(seed), ps)
        self.apply("alloc", ops.alloc, key, 0, slots)
        self.holdings.append(slots)

    @precondition(lambda self: bool(self.holdings))
    @rule()
    def release(self) -> None:
        self.apply("free", ops.free, self.holdings.pop())

    @rule(num_tokens=st.integers(0, 12), seed=seeds)
    def evict(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict(self.state, num_tokens, random.Random(seed))
        before = len(self.state.device_free)
        evicted = self.apply("evict", ops.evict, num_tokens, victims)
        assert evicted == len(self.state.device_free) - before

    @rule(num_tokens=st.integers(0, 12), seed=seeds)
    def evict_host(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict_host(self.state, num_tokens, random.Random(seed))
        self.apply("evict_host", ops.evict_host, num_tokens, victims)

    @rule(data=st.data(), seed=seeds)
    def write_backup(self, data: st.DataObject, seed: int) -> None:
        candidates = self.pages(lambda p: p.device is not None and p.host is None)
        if candidates:
            page = data.draw(st.sampled_from(candidates))
            report = choosers.choose_write_backup(self.state, page, random.Random(seed))
            self.apply("write_backup", ops.write_backup, page, report)

    @rule(data=st.data())
    def writing_check(self, data: st.DataObject) -> None:
        queued = sum(t.direction == "d2h" for t in self.state.pending)
        self.apply("writing_check", ops.writing_check, data.draw(st.integers(0, queued)))

    @rule(data=st.data())
    def loading_check(self, data: st.DataObject) -> None:
        queued = sum(t.direction == "h2d" for t in self.state.pending)
        self.apply("loading_check", ops.loading_check, data.draw(st.integers(0, queued)))

    @rule(data=st.data(), quota=st.none() | st.integers(0, 16), seed=seeds)
    def load_back(self, data: st.DataObject, quota: int | None, seed: int) -> None:
        candidates = self.pages(lambda p: p.device is None)
        if candidates:
            self.load(data.draw(st.sampled_from(candidates)), quota, random.Random(seed))

    @rule(go=st.integers(0, 9))
    def reset(self, go: int) -> None:
        if go == 0:
            self.apply("reset", ops.reset)
            self.caller_locks.clear()
            self.holdings.clear()

    # -- illegal choices and bad arguments: rejected, state untouched -------------------

    def _rank(self, state: State, page: Key) -> tuple[int, ...]:
        return eviction_key(state.config.eviction, state.pages[page])

    @rule(num_tokens=st.integers(1, 12), seed=seeds)
    def illegal_evict_order(self, num_tokens: int, seed: int) -> None:
        leaves = device_evictable_leaves(self.state)
        if not leaves:
            return
        best = min(self._rank(self.state, k) for k in leaves)
        worse = sorted((k for k in leaves if self._rank(self.state, k) > best), key=repr)
        if worse:
            self.rejects(IllegalChoice, ops.evict, num_tokens, (Victim(worse[0]),))

    @rule(num_tokens=st.integers(1, 12), seed=seeds)
    def illegal_evict_short(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict(self.state, num_tokens, random.Random(seed),
                                        overshoot=False)
        if victims and self.state.config.page_size * (len(victims) - 1) < num_tokens:
            self.rejects(IllegalChoice, ops.evict, num_tokens, victims[:-1])

    @rule(num_tokens=st.integers(0, 12), seed=seeds)
    def illegal_evict_extra(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict(self.state, num_tokens, random.Random(seed),
                                        overshoot=False)
        after, evicted = ops.evict(self.state, num_tokens, victims)
        if evicted < num_tokens:
            return
        last = victims[-1].page if victims else None
        chain = None if last is None else parent_page(last, self.state.config.page_size)
        extra = sorted((k for k in device_evictable_leaves(after) if k != chain), key=repr)
        if extra and after.config.write_policy != "write_back":
            self.rejects(IllegalChoice, ops.evict, num_tokens, (*victims, Victim(extra[0])))

    @rule(num_tokens=st.integers(1, 12))
    def illegal_evict_host_order(self, num_tokens: int) -> None:
        leaves = host_evictable_leaves(self.state)
        if not leaves:
            return
        best = min(self._rank(self.state, k) for k in leaves)
        worse = sorted((k for k in leaves if self._rank(self.state, k) > best), key=repr)
        if worse:
            self.rejects(IllegalChoice, ops.evict_host, num_tokens, (worse[0],))

    @rule(key=keys, seed=seeds, mutation=st.sampled_from(["omit", "foreign", "fail", "extra"]))
    def illegal_backup_report(self, key: Key, seed: int, mutation: str) -> None:
        match = ops.match_prefix(self.state, key, self.now)[1]
        need = len(key.tokens) - len(match.device_slots)
        new = choosers.free_pages(self.state.device_free, need, random.Random(seed),
                                  self.state.config.page_size)
        if len(new) < need:
            return
        state, _ = ops.alloc(self.state, key, len(match.device_slots), new)
        slots = match.device_slots + new[:need]
        report = choosers.choose_insert_backup(state, key, slots, self.now,
                                               random.Random(seed))
        if report is None:
            if mutation != "extra":
                return
            bad: Backup | None = Backup((), tuple(sorted(state.host_free)[:1]))
        elif mutation == "omit":
            bad = None
        elif mutation == "foreign" and report.host_slots is not None:
            bad = Backup(report.host_victims, (state.config.host_slots,) * len(report.host_slots))
        elif mutation == "fail" and report.host_slots is not None:
            bad = Backup(report.host_victims, None)  # claims no room where there was room
        else:
            return
        before = copy.deepcopy(state)
        with pytest.raises(IllegalChoice):
            ops.insert(state, key, slots, self.now, backup=bad)
        assert state == before
        RUNS["rejected"] += 1

    @rule(data=st.data(), seed=seeds, mutation=st.sampled_from(["taken", "fail", "skip"]))
    def illegal_load(self, data: st.DataObject, seed: int, mutation: str) -> None:
        candidates = self.pages(lambda p: p.device is None)
        if not candidates:
            return
        page = data.draw(st.sampled_from(candidates))
        victims, slots = choosers.choose_load(self.state, page, None, random.Random(seed))
        if slots is None:
            if mutation == "skip" and not victims:
                # Reporting a load the spec forbids (too small, or no room).
                taken = tuple(sorted(self.state.device_free))
                self.rejects(IllegalChoice, ops.load_back, page, None,
                             device_slots=taken or (0,))
            return
        if mutation == "taken":
            # Slots of pages that stay on device: a victim's slots are free for the load.
            leaving = {v.page for v in victims}
            owned = [s for k, p in self.state.pages.items() if k not in leaving
                     for s in p.device or ()]
            if owned:
                bad = (owned[0], *slots[1:])
                self.rejects(IllegalChoice, ops.load_back, page, None,
                             device_victims=victims, device_slots=bad)
        elif mutation == "fail" and not victims:
            self.rejects(IllegalChoice, ops.load_back, page, None, device_slots=None)

    @rule(key=keys, seed=seeds, how=st.sampled_from(choosers.LAYOUTS))
    def scrambled_insert_slots(self, key: Key, seed: int, how: str) -> None:
        """spec/03, R7: caller slots laid out other than whole pages in order are
        refused, state unchanged; whole pages in any page order are cached (issue 16)."""
        ps, rng = self.state.config.page_size, random.Random(seed)
        if how == "tail" and ps > 1 and len(key.tokens) % ps == 0:
            key = Key(key.tokens[:-1], key.namespace)  # so that there is a partial tail
        count = len(key.tokens)
        pages = choosers.free_pages(self.state.device_free, count, rng, ps)
        if not count or len(pages) < count:
            return
        laid = choosers.scramble(pages, count, ps, how)
        # The forward pass wrote position i's KV into laid[i]; the rest of the pages are
        # the caller's, without KV.
        self.apply("alloc", ops.alloc, key, 0, laid + tuple(s for s in pages if s not in laid))
        now = self.tick(0)
        if choosers.page_fault(laid, ps) is not None:
            self.rejects(PreconditionError, ops.insert, key, laid, now)
            RUNS[f"R7 slots refused (P={ps})"] += 1
        else:
            backup = choosers.choose_insert_backup(self.state, key, laid, now, rng)
            self.apply("insert", ops.insert, key, laid, now, backup=backup)
            RUNS[f"R7 slots accepted (P={ps})"] += 1
        self.apply("free", ops.free, tuple(s for s in pages if s in self.state.held))

    @rule()
    def bad_arguments(self) -> None:
        pending = len(self.state.pending)
        self.rejects(PreconditionError, ops.writing_check, pending + 1)
        self.rejects(PreconditionError, ops.loading_check, -1)
        self.rejects(PreconditionError, ops.evict, -1, ())
        self.rejects(PreconditionError, ops.match_prefix, Key((1,)), self.state.clock - 1)
        free_slot = sorted(self.state.device_free)[:1]
        if free_slot:
            self.rejects(PreconditionError, ops.free, tuple(free_slot))
            self.rejects(PreconditionError, ops.insert, Key((1,)), tuple(free_slot), self.now)
        for counted_from in (-1, 1 + self.state.config.page_size, True):
            self.rejects(PreconditionError, ops.insert, Key(()), (), self.now,
                         counted_from=counted_from)
        for key, page in self.state.pages.items():
            if page.lock == transfer_locks(self.state, key) and key not in self.caller_locks:
                self.rejects(PreconditionError, ops.dec_lock_ref, key)
                break

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "state"):
            assert check(self.state) == (), violations(self.state)


TestModel = ModelMachine.TestCase
