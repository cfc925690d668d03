"""The differential suite: the model beside any engine, through its adapter.

The same rules as the implementation's conformance machine (``machine.py``), spoken
through ``EngineAdapter`` only: requests that match, load back, lock, allocate, insert
and unlock; returning requests; caller locks; eviction on both tiers; acknowledgements;
reset. A rule whose operation the engine lacks is skipped by its precondition. The
engine's choices are inferred from its state (``infer``); the model validates them.
After every step the engine's abstract state must equal the model's (with the adapter's
declared adoptions), and every invariant must hold on both.

Caller buffers reused (issue 17): every slot sequence the suite hands an adapter
(``write_kv``, ``insert``, ``free``) is a fresh list that is overwritten right after the
call, as a scheduler reuses its buffer for the next batch, before the comparison. The
adapter protocol (``adapters/base.py``) passes and returns tuples of slot ids, never
tensors: each adapter builds the engine's tensor from the sequence itself, and what it
returns (``alloc``'s slots, a match's device slots, a load's slots) is an immutable
tuple. So the scribble here reaches an adapter that keeps the caller's sequence, not an
engine that keeps the tensor its adapter made; the engine's own buffers are scribbled
only where the conformance machine drives our cache directly (``machine.scribble``).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance import infer
from hiradix.conformance.coverage import tally_states
from hiradix.conformance.infer import left_device, left_host
from hiradix.conformance.machine import EXERCISED, describe_difference
from hiradix.conformance.recording import Recording
from hiradix.conformance.tally import Tally
from hiradix.engines.protocol import EngineAdapter
from hiradix_model import Key, State, initial, ops, trace, violations
from hiradix_model.keys import content_at, page_keys, sort_key
from hiradix_model.ops._draft import Draft
from hiradix_model.ops.backup import backup_run
from hiradix_model.ops.insert import insert_pages

tokens = st.lists(st.integers(1, 3), max_size=14).map(tuple)
namespaces = st.sampled_from([None, None, "b"])
Result = TypeVar("Result")


def handed(call: Callable[[list[int]], Result], slots: Sequence[int]) -> Result:
    """``call`` with a fresh list of ``slots``, overwritten in place once it returns
    (the caller reuses its buffer, issue 17): each entry becomes another slot id, so an
    adapter that kept the list now holds slots it was never given."""
    buffer = list(slots)
    result = call(buffer)
    buffer[:] = [slot + 1 for slot in buffer]
    return result


def engine_values(model: State, engine: State, fields: frozenset[str]) -> dict[Key, dict[str, int]]:
    """The adopted fields where the engine's value differs from the model's."""
    changes: dict[Key, dict[str, int]] = {}
    for key, page in model.pages.items():
        seen = engine.pages.get(key)
        if seen is None:
            continue
        differ = {f: getattr(seen, f) for f in fields if getattr(seen, f) != getattr(page, f)}
        if differ:
            changes[key] = differ
    return changes


def deepest_on_device(state: State, page: Key) -> Key | None:
    """The deepest page on ``page``'s root path that is on device (None: the root)."""
    found = None
    for key in page_keys(page, state.config.page_size):
        record = state.pages.get(key)
        if record is None or record.device is None:
            break
        found = key
    return found


def chain_tokens(state: State, page: Key) -> int:
    """Tokens of the host-only chain ending at ``page``."""
    return state.config.page_size * sum(
        state.pages[k].device is None for k in page_keys(page, state.config.page_size))


class EngineSteps(Recording):
    """What the differential machines share (this one and ``vllm_machine``'s): reading
    the engine's state with the adapter's adoptions, the engine's clock, and the check
    after every step. The machine sets ``engine``, ``adopted``, ``why`` and ``now``
    beside what ``Recording`` needs."""

    engine: Any
    adopted: frozenset[str]
    why: str
    now: int
    caller_locks: list[Key | None]

    def observe(self, adopt: bool = True) -> State:
        """The engine's state. Between operations (``adopt``) the model first takes the
        adapter's adopted fields from it, so that choices are judged on the engine's own
        ranks; never between an engine call and its model step, whose state the model has
        not reached yet."""
        seen: State = self.engine.observe(self.model)
        changes = engine_values(self.model, seen, self.adopted) if adopt else {}
        if changes:
            self.model = trace.adopt(self.model, changes)
            self.trace.append(trace.adopt_step(changes, self.why))
        return seen

    def tick(self, dt: int) -> int:
        self.now += dt
        self.engine.set_time(self.now)
        return self.now

    def compare(self, seen: State) -> None:
        """After a step: the model's invariants, the engine's state equal to the model's,
        and the invariants on the engine's state."""
        found = violations(self.model)
        assert not found, f"the model broke its own invariants: {found}"
        if seen != self.model:
            raise AssertionError(f"{self.engine.name} and the model disagree:\n"
                                 + describe_difference(seen, self.model))
        broken = violations(seen)
        assert not broken, f"{self.engine.name} breaks {broken}"

    def do_reset(self) -> None:
        """The reset rule's body (the machines differ only in when reset is allowed)."""
        self.engine.reset()
        self.step("reset", ops.reset)
        self.caller_locks.clear()

    def tally_step(self) -> None:
        """Count a checked step: per invariant with work, per coverage state."""
        self.counts.checks += 1
        tally_states(self.counts.states, self.model)
        for spec_id, busy in EXERCISED.items():
            if busy(self.model):
                self.counts.exercised[spec_id] += 1

    # -- calls to both, the engine's choices inferred (the differential machine's rules
    # and the exhaustive exploration of an engine, explore/engine_pair.py, share them) --

    def has(self, operation: str) -> bool:
        return operation in self.engine.operations

    def evict_both(self, num_tokens: int) -> None:
        before = self.observe()
        evicted = self.engine.evict(num_tokens)
        chosen = infer.device_victims(self.model, before, self.observe(adopt=False),
                                       num_tokens)
        self.agree(evicted, self.step("evict", ops.evict, num_tokens, chosen))
        self.keep_write_back_room()

    def evict_host_both(self, num_tokens: int) -> None:
        before = self.observe()
        evicted = self.engine.evict_host(num_tokens)
        chosen = infer.host_victims(self.model, before, self.observe(adopt=False), num_tokens)
        self.agree(evicted, self.step("evict_host", ops.evict_host, num_tokens, chosen))

    def keep_write_back_room(self) -> None:
        """DEV-32 steering: an engine that writes back whole nodes (room for the node
        first, dropped whole) cannot be judged page by page where a write-back victim
        needs host room. After each device eviction and load, host pages are evicted
        until every device page has a free host page, so no victim needs room (R2)
        and the rest of write-back eviction is compared step by step."""
        if ("write_back_host_room_per_node" not in self.engine.mapped
                or self.model.config.write_policy != "write_back"):
            return
        need = self.model.config.device_slots - len(self.model.host_free)
        if need > 0:
            self.counts.ops["host room kept for write-back (DEV-32)"] += 1
            self.evict_host_both(need)

    def load_both(self, page: Key, quota: int | None = None) -> None:
        before = self.observe()
        loaded, last = self.engine.init_load_back(page, quota)
        after = self.observe(adopt=False)
        slots = infer.loaded_slots(before, after, page)
        if "evict_for_whole_load" in self.engine.mapped and left_device(before, after):
            # DEV-8: the engine evicted for the whole load, not the shortfall, with the
            # chain's anchor locked. The model takes exactly those steps, then the load.
            anchor = deepest_on_device(self.model, page)
            self.step("inc_lock_ref", ops.inc_lock_ref, anchor)
            tokens = len(slots) if slots else chain_tokens(self.model, page)
            victims = infer.device_victims(self.model, before, after, tokens)
            self.step("evict", ops.evict, tokens, victims)
            self.step("dec_lock_ref", ops.dec_lock_ref, anchor)
            before = after
        # The load's target is the whole chain, whether or not room was found.
        shortfall = chain_tokens(self.model, page) - len(self.model.device_free)
        # The load evicts with its anchor's path locked (spec/03, init_load_back): a
        # victim need only outrank the leaves evictable then, not the anchor itself.
        anchor = deepest_on_device(self.model, page)
        locked = self.model if anchor is None else ops.inc_lock_ref(self.model, anchor)[0]
        victims = infer.device_victims(locked, before, after, max(0, shortfall))
        result = self.step("init_load_back", ops.init_load_back, page, quota,
                           device_victims=victims, device_slots=slots)
        self.agree((loaded, last), result)
        self.keep_write_back_room()

    def insert_both(self, key: Key, slots: tuple[int, ...], now: int, priority: int,
                    chunked: bool, counted: int, mine: Sequence[int]) -> None:
        """Insert ``key`` with its KV in ``slots`` on both, the engine's backup inferred
        (and its DEV-8 host eviction for a whole node taken first); then the caller frees
        the slots of ``mine`` it still holds (a duplicate the cache did not take, the
        unused tail of the last page), as a scheduler does after the insert (DEV-24)."""
        draft = Draft(self.model)
        _, due = insert_pages(draft, key, slots, now, priority, chunked, counted)
        run = backup_run(draft, due)
        before = self.observe()
        prefix = handed(lambda given: self.engine.insert(
            key, given, priority=priority, chunked=chunked, counted_from=counted),
            slots)
        after = self.observe(adopt=False)
        if "evict_host_for_whole_node" in self.engine.mapped and left_host(before, after):
            # DEV-8: the engine made host room for a whole node, not the shortfall;
            # under write-through the order does not matter (DEV-15).
            tokens = sum(self.model.config.page_size for k in left_host(before, after))
            self.step("evict_host", ops.evict_host, tokens,
                      infer.host_victims(self.model, before, after, tokens))
            before = replace(before, pages={k: p for k, p in before.pages.items()
                                            if k not in left_host(before, after)})
        report = infer.backup(self.model, before, after, run)
        result = self.step("insert", ops.insert, key, slots, now, priority=priority,
                           chunked=chunked, counted_from=counted, backup=report)
        assert isinstance(result, ops.InsertResult)
        self.agree(ops.InsertResult(prefix, result.due), result)
        leftover = tuple(s for s in mine if s in self.model.held)
        if leftover:
            handed(self.engine.free, leftover)
            self.step("free", ops.free, leftover)


def make_differential(factory: Callable[[], EngineAdapter], tally: Tally | None = None,
                      beyond_server: bool = False) -> type[RuleBasedStateMachine]:
    """A state machine class driving the engines ``factory`` builds, one per example.
    It steers clear of the situations each engine ``avoid``s (known bugs) and, unless
    ``beyond_server``, of those its server never creates (``guards``)."""
    counts = tally if tally is not None else Tally()

    class Differential(EngineSteps, RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            counts.begin_example()  # TimeUp once the budget is spent: before any engine
            self.engine = factory()
            self.model = initial(self.engine.config)
            self.adopted = frozenset(self.engine.adopted)
            self.steered = frozenset(self.engine.avoid) | (
                frozenset() if beyond_server else frozenset(self.engine.guards))
            self.why = "; ".join(f"{k}: {v}" for k, v in self.engine.adopted.items())
            self.now = 0
            self.caller_locks: list[Key | None] = []
            self.seen: list[Key] = []
            # Page-aligned keys of earlier inserts: where the engine has a node end (07
            # DEV-25). Kept only while the page stays cached: a node never merges, and a
            # page that left the cache returns only through an insert, which prunes first.
            self.inserted: list[Key] = []
            self.trace: list[trace.Step] = []
            counts.last_trace = self.trace
            counts.last_config = self.engine.config
            self.counts = counts
            self.engine_label = self.engine.name

        def teardown(self) -> None:
            self.engine.close()

        # -- plumbing -----------------------------------------------------------------

        # -- the operations ------------------------------------------------------------

        @rule(tokens=tokens, namespace=namespaces, dt=st.integers(0, 2),
              chunked=st.booleans(), priority=st.integers(0, 2), keep_lock=st.booleans())
        def request(self, tokens: tuple[int, ...], namespace: str | None, dt: int,
                    chunked: bool, priority: int, keep_lock: bool) -> None:
            key = Key(tokens, namespace)
            self.serve(key, dt, chunked, priority, keep_lock)
            self.seen.append(key)

        @precondition(lambda self: bool(self.seen))
        @rule(index=st.integers(0, 63), evict_first=st.integers(0, 24))
        def request_again(self, index: int, evict_first: int) -> None:
            if evict_first and self.has("writing_check") and self.model.pending:
                self.writing_check()
            if evict_first:
                self.evict_both(evict_first)
            self.serve(self.seen[index % len(self.seen)], 1, False, 0, False)

        # The next chunk of a chunked prefill: a request extends what it inserted before
        # and inserts again with counted_from = that length (spec/03 3.5). Engines that
        # count per node agree only where a node ends there (DEV-25), which an earlier
        # insert of that prefix guarantees while its last page stays cached.
        @precondition(lambda self: bool(self.inserted)
                      and "counted_from_inside" not in self.engine.inexpressible)
        @rule(index=st.integers(0, 63), more=tokens, dt=st.integers(0, 2),
              priority=st.integers(0, 2), keep_lock=st.booleans())
        def request_next_chunk(self, index: int, more: tuple[int, ...], dt: int,
                               priority: int, keep_lock: bool) -> None:
            self.prune_inserted()
            if not self.inserted:
                return
            done = self.inserted[index % len(self.inserted)]
            key = Key(done.tokens + more, done.namespace)
            self.serve(key, dt, False, priority, keep_lock, counted_from=done)
            self.seen.append(key)

        def prune_inserted(self) -> None:
            self.inserted = [k for k in self.inserted if k in self.model.pages]

        def serve(self, key: Key, dt: int, chunked: bool, priority: int,
                  keep_lock: bool, counted_from: Key | None = None) -> None:
            now = self.tick(dt)
            got = self.engine.match_prefix(key)
            want = self.step("match_prefix", ops.match_prefix, key, now)
            self.agree(got, want)
            assert isinstance(want, ops.MatchResult)
            if want.host_hit_tokens and self.has("load_back") and want.last_host_page is not None:
                self.load_both(want.last_host_page)
                got = self.engine.match_prefix(key)
                want = self.step("match_prefix", ops.match_prefix, key, now)
                self.agree(got, want)
                assert isinstance(want, ops.MatchResult)
            locked = want.last_device_page
            self.agree(self.engine.inc_lock_ref(locked),
                       self.step("inc_lock_ref", ops.inc_lock_ref, locked))
            cached = len(want.device_slots)
            need = len(key.tokens) - cached
            ps = self.model.config.page_size
            alloc_tokens = math.ceil(need / ps) * ps
            free = self.engine.num_free_slots()
            if alloc_tokens > free:
                self.evict_both(alloc_tokens - free)
            new = self.engine.alloc(alloc_tokens) if alloc_tokens else None
            if new is not None:
                self.step("alloc", ops.alloc, key, cached, new)
                contents = [content_at(key, cached + i) for i in range(need)]
                handed(lambda given: self.engine.write_kv(given, contents), new[:need])
                slots = want.device_slots + new[:need]
                now = self.tick(dt)
                self.prune_inserted()
                # Only at a node end the engine still has (DEV-25); an eviction on the
                # way here may have taken it.
                counted = (len(counted_from.tokens) if counted_from is not None
                           and counted_from in self.inserted else 0)
                if 0 < counted < len(key.tokens) - len(key.tokens) % ps:
                    counts.ops["insert counted_from inside the key"] += 1
                self.insert_both(key, slots, now, priority, chunked, counted, new)
                end = Key(key.tokens[:len(key.tokens) - len(key.tokens) % ps], key.namespace)
                if end.tokens and end not in self.inserted:
                    self.inserted.append(end)
            if keep_lock and locked is not None:
                self.caller_locks.append(locked)
            else:
                self.agree(self.engine.dec_lock_ref(locked),
                           self.step("dec_lock_ref", ops.dec_lock_ref, locked))

        @precondition(lambda self: bool(self.caller_locks))
        @rule(index=st.integers(0, 63))
        def unlock(self, index: int) -> None:
            page = self.caller_locks.pop(index % len(self.caller_locks))
            self.agree(self.engine.dec_lock_ref(page),
                       self.step("dec_lock_ref", ops.dec_lock_ref, page))

        @rule(num_tokens=st.integers(0, 12))
        def evict(self, num_tokens: int) -> None:
            self.evict_both(num_tokens)

        @precondition(lambda self: self.has("evict_host"))
        @rule(num_tokens=st.integers(0, 12))
        def evict_host(self, num_tokens: int) -> None:
            self.evict_host_both(num_tokens)

        @precondition(lambda self: self.has("writing_check")
                      and any(t.direction == "d2h" for t in self.model.pending))
        @rule()
        def writing_check(self) -> None:
            self.step("writing_check", ops.writing_check, self.engine.writing_check())

        @precondition(lambda self: self.has("loading_check")
                      and any(t.direction == "h2d" for t in self.model.pending))
        @rule()
        def loading_check(self) -> None:
            self.step("loading_check", ops.loading_check, self.engine.loading_check())

        @precondition(lambda self: self.has("load_back"))
        @rule(index=st.integers(0, 63))
        def load_back(self, index: int) -> None:
            host_only = sorted((k for k, p in self.model.pages.items() if p.device is None),
                               key=sort_key)
            if not host_only:
                return
            # An engine loads what a match found: matching first puts a node boundary at
            # the page, as serving would.
            page = host_only[index % len(host_only)]
            got = self.engine.match_prefix(page)
            want = self.step("match_prefix", ops.match_prefix, page, self.tick(0))
            self.agree(got, want)
            assert isinstance(want, ops.MatchResult)
            if want.last_host_page is not None and want.host_hit_tokens:
                self.load_both(want.last_host_page)

        @precondition(lambda self: self.has("reset") and not (
            self.model.pending and "reset_with_copies_in_flight" in self.steered))
        @rule(go=st.integers(0, 15))
        def reset(self, go: int) -> None:
            if go == 0:
                self.do_reset()

        # -- after every step -------------------------------------------------------------

        @invariant()
        def engine_refines_the_model(self) -> None:
            self.compare(self.observe())
            self.tally_step()

    return Differential
