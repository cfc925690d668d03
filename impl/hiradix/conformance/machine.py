"""The conformance state machine: the implementation and the model, step by step.

One rule per public operation of the cache (plus rules that finish copies in flight, in
an order the test picks). Every rule issues the operation to the implementation, turns
the implementation's recorded choices into the model's choice arguments, and applies
the model step, which rejects an illegal choice. After every step: the abstraction of
the implementation equals the model state, every invariant holds on both, and every
cached slot holds the KV bytes of its own prefix (INV-KV-INTEGRITY via the abstraction).
"""

from __future__ import annotations

import dataclasses
import functools
import math
import random
from collections import Counter
from collections.abc import Callable
from dataclasses import fields, replace

import torch
from hypothesis import strategies as st
from hypothesis import target
from hypothesis.control import currently_in_test_context
from hypothesis.stateful import (
    RULE_MARKER,
    RuleBasedStateMachine,
    initialize,
    invariant,
    precondition,
    rule,
)

from hiradix.cache import HiRadixCache, MatchResult
from hiradix.clock import ManualClock
from hiradix.conformance.abstraction import abstract, page_keys
from hiradix.conformance.coverage import tally_states
from hiradix.conformance.events import EventWatch
from hiradix.conformance.kv import patterns
from hiradix.conformance.recording import Recording
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.decisions import DeviceVictim, PageRef, Recorder
from hiradix.errors import EventSinkError, ForeignNode, InvalidArgument, NotLocked
from hiradix.events import EventLog, KVEvent
from hiradix.keys import RadixKey
from hiradix.transfer import ControlledCopyEngine, SyncCopyEngine
from hiradix.tree import TreeNode
from hiradix_model import (
    Backup,
    Config,
    Key,
    PreconditionError,
    State,
    Victim,
    check,
    choosers,
    initial,
    ops,
    trace,
    violations,
)
from hiradix_model.events import device_resident, host_resident, storage_may
from hiradix_model.keys import content_at

# Swarm testing (Groce et al., ISSTA 2012). Hypothesis already switches rules off per
# example (its FeatureFlags, lazily, one shared probability); on top of that each example
# draws, in its ``swarm`` initialize step, a set of rules switched off for the whole
# example (each with one odds drawn per example) and the host size, so that long runs of
# one kind happen (only loads, only evictions under a full host). Everything comes from
# one drawn integer through ``random.Random``: Hypothesis's generation favours the
# simplest choices and mutates earlier examples, which left nine examples in ten on the
# default host when each knob was drawn by itself. A seed replays it, and a reproducer
# prints it as ``state.swarm(seed=...)``. ``request`` stays on.
SWARM_RULES: tuple[str, ...] = (
    "request_again", "grow_branches", "lock", "unlock", "hold", "release", "evict",
    "evict_host", "write_backup", "finish_copies", "writing_check", "loading_check",
    "load_back", "reset", "scrambled_insert_slots", "misuse", "sink_raises")
SWARM_SEEDS = st.integers(0, 2**32 - 1)


def rules_off(rng: random.Random, rules: tuple[str, ...]) -> frozenset[str]:
    """Rules switched off for one example: none two times in five, else each one off
    with odds drawn for this example."""
    if rng.random() < 0.4:
        return frozenset()
    odds = rng.random()
    return frozenset(r for r in rules if rng.random() < odds)


def host_size(rng: random.Random, scenario: Scenario) -> int:
    """Host pages for one example: the scenario's two times in five; else 2 or 3 pages
    (host full, every host page protected: S-R5, write_back's "host full" path) or one
    page fewer than the device (issue 17: a host smaller than the device)."""
    return rng.choice([scenario.host_pages, scenario.host_pages, 2, 3,
                       scenario.device_pages - 1])


def gate(machine: type[RuleBasedStateMachine], rules: tuple[str, ...],
         counts: Counter[str], swarmed: bool = True) -> None:
    """Count each of ``rules`` of ``machine`` in ``counts`` when it runs (the summary's
    per-rule figures) and, if ``swarmed``, give it the precondition that the example's
    swarm left it on. Hypothesis runs a rule's recorded function, not the class
    attribute, so the counting wrapper goes into the rule's record."""
    for name in rules:
        function = getattr(machine, name)
        if swarmed:
            function = precondition(lambda self, name=name: name not in self.off)(function)
        recorded = getattr(function, RULE_MARKER)
        inner = recorded.function

        @functools.wraps(inner)
        def counting(self: object, *args: object, _inner: Callable[..., None] = inner,
                     _name: str = name, **kwargs: object) -> None:
            counts[_name] += 1
            _inner(self, *args, **kwargs)
        setattr(function, RULE_MARKER, dataclasses.replace(recorded, function=counting))
        setattr(machine, name, function)


def scribble(*tensors: torch.Tensor | None) -> None:
    """Overwrite, in place, tensors the caller handed to the cache or got from it (issue
    17): a cache that kept the caller's buffer, or handed out its own, now holds other
    valid slot numbers, and the next comparison with the model fails."""
    for tensor in tensors:
        if tensor is not None and tensor.numel():
            tensor.add_(1)

# For the summary: a step exercises an invariant when the state gives it something to
# check (a lock for the lock invariants, a copy in flight for INV-TRANSFER-PINNED, ...).
EXERCISED: dict[str, Callable[[State], bool]] = {
    "INV-TREE-WELL-FORMED": lambda s: any(len(k.tokens) > s.config.page_size for k in s.pages),
    "INV-RESIDENT": lambda s: bool(s.pages),
    "INV-EVICTED-HAS-HOST": lambda s: any(p.device is None for p in s.pages.values()),
    "INV-DEVICE-PREFIX-CLOSED": lambda s: any(p.device is not None for p in s.pages.values()),
    "INV-BACKUP-CONTIGUOUS": lambda s: s.config.write_policy != "write_back"
    and any(p.host is not None for p in s.pages.values()),
    "INV-LOCK-ON-DEVICE": lambda s: any(p.lock for p in s.pages.values()),
    "INV-LOCK-MONOTONE": lambda s: any(p.lock for p in s.pages.values()),
    "INV-ACCOUNTING": lambda s: s.evictable_tokens + s.protected_tokens > 0,
    "INV-DEVICE-POOL-CONSERVATION": lambda s: bool(s.held) or bool(s.pages),
    "INV-HOST-POOL-CONSERVATION": lambda s: any(p.host is not None for p in s.pages.values()),
    "INV-DEVICE-EVICTABLE-LEAVES": lambda s: s.evictable_tokens > 0,
    "INV-HOST-EVICTABLE-LEAVES": lambda s: any(p.device is None for p in s.pages.values()),
    "INV-HOST-PROTECT": lambda s: any(p.host_protect for p in s.pages.values()),
    "INV-TRANSFER-PINNED": lambda s: bool(s.pending),
    "INV-KV-INTEGRITY": lambda s: bool(s.pages),
    "INV-NAMESPACE-ISOLATION": lambda s: len({k.namespace for k in s.pages}) > 1,
    "INV-CLOCK-MONOTONE": lambda s: bool(s.pages),
    "INV-HOST-PROTECT-HOLDERS": lambda s: any(p.host_protect for p in s.pages.values()),
    # The storage tier's (spec/09): each has something to check only in the states its
    # rule speaks of, not merely once a backend is attached.
    "INV-PREFETCH-SLOT-OWNERSHIP": lambda s: s.storage is not None and (
        any(p.slots for p in s.storage.prefetches) or bool(s.storage.release_queue)),
    "INV-RELEASE-ONCE": lambda s: s.storage is not None and bool(s.storage.release_log),
    "INV-STORAGE-WRITE-PROTECT": lambda s: s.storage is not None and any(
        w.phase == "running" for w in s.storage.writes),
    "INV-STORAGE-WRITE-SOURCE": lambda s: s.storage is not None and any(
        w.phase != "acked" for w in s.storage.writes)
    and any(t.direction == "d2h" for t in s.pending),
    "INV-STORAGE-INTEGRITY": lambda s: s.storage is not None and bool(s.storage.stored),
    "INV-PREFETCH-CONTIGUOUS": lambda s: s.storage is not None and any(
        p.landed for p in s.storage.prefetches),
    "INV-PREFETCH-INTEGRITY": lambda s: s.storage is not None and any(
        p.landed for p in s.storage.prefetches),
    "INV-PREFETCH-ACCOUNTING": lambda s: s.storage is not None and bool(
        s.storage.prefetches),
    "INV-STORAGE-DETACHED-IDLE": lambda s: s.storage is not None
    and s.storage.backend is None,
    # Machines keep the stream beside the model (EventWatch) and count this one there.
    "INV-EVENTS-REPLAY": lambda s: bool(s.events),
}


def to_key(ref: PageRef) -> Key:
    return Key(ref[1], ref[0])


def victims(decisions: list[DeviceVictim]) -> tuple[Victim, ...]:
    return tuple(Victim(to_key(d.page), tuple(map(to_key, d.host_victims)), d.host_slots)
                 for d in decisions)


def describe_difference(impl: State, model: State) -> str:
    lines = []
    for f in fields(State):
        a, b = getattr(impl, f.name), getattr(model, f.name)
        if a == b:
            continue
        if isinstance(a, dict) and isinstance(b, dict):
            for k in sorted(set(a) | set(b), key=repr):
                if a.get(k) != b.get(k):
                    lines.append(f"{f.name}[{k!r}]: impl {a.get(k)!r} != model {b.get(k)!r}")
        else:
            lines.append(f"{f.name}: impl {a!r} != model {b!r}")
    return "\n".join(lines[:20])


# What a sink raises in ``sink_raises`` (issue 34): a router publisher's errors, a bug in
# it, and the BaseExceptions that are no errors of its own.
SINK_ERRORS: tuple[type[BaseException], ...] = (
    RuntimeError, ConnectionResetError, OSError, ValueError, KeyError, TypeError,
    KeyboardInterrupt, SystemExit)


class SinkTrap:
    """The machine's sink: every event to ``log``; once armed, ``error`` raised at the
    ``at``-th event from then (issue 34, spec/11 11.7). ``fired``: the exception raised,
    until the machine has taken the operation's outcome."""

    def __init__(self, log: EventLog) -> None:
        self.log = log
        self.at: int | None = None
        self.error: BaseException | None = None
        self.fired: BaseException | None = None
        self.raised = 0  # how many times it raised

    def arm(self, at: int, error: BaseException) -> None:
        self.at, self.error, self.fired = at, error, None

    def __call__(self, event: KVEvent) -> None:
        self.log(event)
        if self.at is None:
            return
        if self.at > 0:
            self.at -= 1
            return
        self.at, self.fired = None, self.error
        self.raised += 1
        assert self.error is not None
        raise self.error


class Interrupted:
    """An operation's result lost to a BaseException the sink raised (spec/11, 11.7)."""


INTERRUPTED = Interrupted()

tokens = st.lists(st.integers(1, 3), max_size=14).map(tuple)


def keys_for(page_size: int) -> st.SearchStrategy[tuple[int, ...]]:
    """Request tokens that share whole pages at this page size. Up to 14 tokens over
    three values do at small pages; at larger ones a key is up to three pages each drawn
    from three fixed page-long runs, and a tail of up to a page and two tokens, so that
    page size 16 caches, matches, splits and evicts as often as page size 2."""
    if page_size <= 4:
        return tokens
    runs = [tuple((start + i) % 3 + 1 for i in range(page_size)) for start in range(3)]
    return st.tuples(st.lists(st.sampled_from(runs), max_size=3),
                     st.lists(st.integers(1, 3), max_size=page_size + 2)).map(
        lambda parts: tuple(t for run in parts[0] for t in run) + tuple(parts[1]))
namespaces = st.sampled_from([None, None, "b"])
# An insert's counted_from in pages, modulo the key's pages + 1: mostly 0, a plain insert;
# otherwise what a chunked prefill inserted before (spec/03 3.5).
COUNTED_PAGES = st.one_of(st.just(0), st.just(0), st.integers(1, 8))


def make_machine(scenario: Scenario, tally: Tally | None = None) -> type[RuleBasedStateMachine]:
    """A state machine class for one configuration (page size, policies, layouts)."""
    counts = tally if tally is not None else Tally()

    class Conformance(Recording, RuleBasedStateMachine):
        def __init__(self) -> None:
            super().__init__()
            counts.begin_example()  # TimeUp once the budget is spent: before any engine
            self.recorder = Recorder()
            self.clock = ManualClock()
            self.cache = scenario.build(self.clock, self.recorder)
            self.watch_events()
            self.model = initial(scenario.model_config())
            self.caller_locks: list[TreeNode] = []
            self.holdings: list[torch.Tensor] = []
            self.seen: list[tuple[tuple[int, ...], str | None]] = []
            self.trace: list[trace.Step] = []
            counts.last_trace = self.trace  # after shrinking, the failing example's
            counts.last_config = scenario.model_config()
            self.counts = counts
            self.engine_label = "implementation"
            self.scenario = scenario
            self.off: frozenset[str] = frozenset()
            self.peaks: dict[str, float] = {}
            self.resync_events = False  # a sink's BaseException cut the stream short

        @initialize(seed=SWARM_SEEDS)
        def swarm(self, seed: int) -> None:
            """This example's swarm, before any step (see ``SWARM_RULES``)."""
            self.configure(random.Random(seed))

        def configure(self, rng: random.Random) -> None:
            """Rules off and host size (the cache and model rebuilt if it changed)."""
            host_pages = self.choose(rng, SWARM_RULES)
            if host_pages != self.scenario.host_pages:
                self.reshape(replace(self.scenario, host_pages=host_pages))

        def choose(self, rng: random.Random, rules: tuple[str, ...]) -> int:
            self.off = rules_off(rng, rules)
            host_pages = host_size(rng, self.scenario)
            counts.swarm[f"rules off: {len(self.off) // 4 * 4}+"] += 1
            counts.swarm[f"host pages: {host_pages}"] += 1
            return host_pages

        def reshape(self, shaped: Scenario) -> None:
            """A fresh cache and model for ``shaped``, before the example's first step."""
            assert not self.trace, "reshape before any step"
            self.scenario = shaped
            self.cache = shaped.build(self.clock, self.recorder)
            self.watch_events()
            self.model = initial(shaped.model_config())
            counts.last_config = shaped.model_config()

        def climb(self, label: str, value: float) -> None:
            """Remember the example's peak of ``value``: ``teardown`` hands it to
            Hypothesis's ``target()``, so that examples climb towards those states."""
            if value > self.peaks.get(label, -1.0):
                self.peaks[label] = value

        def teardown(self) -> None:
            if currently_in_test_context():  # not when a test drives the machine by hand
                for label, value in self.peaks.items():
                    target(value, label=label)
            super().teardown()

        # -- plumbing -----------------------------------------------------------------

        def watch_events(self) -> None:
            """The stream replayed after every step (INV-EVENTS-REPLAY), through a sink
            ``sink_raises`` can arm."""
            self.watch = EventWatch(self.cache)
            self.trap = SinkTrap(self.watch.log)
            self.cache.events = self.trap

        def call(self, operation: Callable[..., object], *args: object,
                 **kwargs: object) -> object:
            """``operation`` of the cache, its outcome typed as spec/11 11.7 says when the
            armed sink raised: an Exception as ``EventSinkError`` carrying the result
            (returned here), a BaseException as itself once the state is whole
            (``INTERRUPTED``: the result is lost, and the rest of the operation's events;
            the watch resynchronises from the model after the step, as a router that
            reconnects does). The step's checks then compare state and stream."""
            trap = self.trap
            try:
                result = operation(*args, **kwargs)
            except EventSinkError as error:
                fired, trap.fired = trap.fired, None
                assert isinstance(fired, Exception) and error.__cause__ is fired, (
                    f"EventSinkError caused by {error.__cause__!r}, the sink raised {fired!r}")
                counts.ops["sink raised: EventSinkError with the result"] += 1
                return error.result
            except BaseException as error:
                if trap.fired is None or error is not trap.fired:
                    raise
                assert not isinstance(error, Exception), (
                    f"the sink's {error!r} escaped untyped (spec/11, 11.7: EventSinkError)")
                trap.fired = None
                self.resync_events = True
                counts.ops[f"sink raised: {type(error).__name__} propagated"] += 1
                return INTERRUPTED
            assert trap.fired is None, f"the sink raised {trap.fired!r} and the call returned"
            return result

        def page_of(self, node: TreeNode) -> Key | None:
            if node is self.cache.root:
                return None
            return page_keys(node, self.cache.page_size)[-1]

        def device_nodes(self) -> list[TreeNode]:
            return sorted((n for n in self.cache.nodes() if n.device is not None),
                          key=lambda n: n.id)

        def same_match(self, got: MatchResult, want: ops.MatchResult) -> None:
            seen = ops.MatchResult(tuple(got.device_slots.tolist()),
                                   self.page_of(got.last_device_node),
                                   self.page_of(got.last_host_node), got.host_hit_length)
            self.agree(seen, want)

        def write_kv(self, key: Key, start: int, slots: torch.Tensor) -> None:
            pool = self.cache.device_pool
            contents = [content_at(key, start + i) for i in range(len(slots))]
            pool.write(slots, patterns(contents, pool.layers, pool.token_shape, pool.dtype))

        def evict_both(self, num_tokens: int) -> None:
            evicted = self.call(self.cache.evict, num_tokens)
            chosen = self.recorder.take().device_victims
            model_evicted = self.step("evict", ops.evict, num_tokens, victims(chosen))
            if evicted is not INTERRUPTED:
                self.agree(evicted, model_evicted)

        def load_both(self, node: TreeNode, quota: int | None) -> None:
            got = self.call(self.cache.init_load_back, node, quota)
            decisions = self.recorder.take().loads
            choice = decisions[0] if decisions else None
            result = self.step(
                "init_load_back", ops.init_load_back, self.page_of(node), quota,
                device_victims=victims(list(choice.device_victims)) if choice else (),
                device_slots=choice.device_slots if choice else None)
            if got is INTERRUPTED:
                return
            loaded, used = got  # type: ignore[misc]
            self.agree((tuple(loaded.tolist()), self.page_of(used)), result)
            scribble(loaded)  # the caller's to reuse (issue 17: it was the copy's own)

        # -- the operations ------------------------------------------------------------

        @rule(tokens=keys_for(scenario.page_size), namespace=namespaces, dt=st.integers(0, 2),
              chunked=st.booleans(), priority=st.integers(0, 2), keep_lock=st.booleans(),
              quota=st.none() | st.integers(0, 24), counted_pages=COUNTED_PAGES)
        def request(self, tokens: tuple[int, ...], namespace: str | None, dt: int,
                    chunked: bool, priority: int, keep_lock: bool, quota: int | None,
                    counted_pages: int = 0) -> None:
            ps = self.cache.page_size
            counted_from = counted_pages % (len(tokens) // ps + 1) * ps
            self.serve(tokens, namespace, dt, chunked, priority, keep_lock, quota,
                       counted_from)
            self.seen.append((tokens, namespace))

        # Returning requests are what makes host hits, load-backs and write-through
        # selective backups frequent: a random key rarely repeats a long prefix.
        @precondition(lambda self: bool(self.seen))
        @rule(index=st.integers(0, 63), evict_first=st.integers(0, 24),
              quota=st.none() | st.integers(0, 24), settle=st.booleans())
        def request_again(self, index: int, evict_first: int, quota: int | None,
                          settle: bool = False) -> None:
            tokens, namespace = self.seen[index % len(self.seen)]
            engine = self.cache.engine
            if evict_first and isinstance(engine, ControlledCopyEngine):
                # Time passes: the backups in flight land, then the device fills up.
                engine.complete("d2h", engine.queued("d2h"))
                self.step("writing_check", ops.writing_check, self.acknowledge_writes())
            if evict_first:
                self.evict_both(evict_first)
            self.serve(tokens, namespace, 1, False, 0, False, quota)
            if settle:
                self.settle()

        def settle(self) -> None:
            """Time passes: every copy in flight lands and is acknowledged, as a
            scheduler that waits for its request's load does. Without it a load is
            acknowledged only when separate rules finish the copy and then check, which
            rarely follow each other (a load's lock never released went unseen)."""
            engine = self.cache.engine
            if isinstance(engine, ControlledCopyEngine):
                for direction in ("h2d", "d2h"):
                    engine.complete(direction, engine.queued(direction))  # type: ignore[arg-type]
            if self.cache.pending["h2d"]:
                self.step("loading_check", ops.loading_check, self.cache.loading_check())
            if self.cache.pending["d2h"]:
                self.step("writing_check", ops.writing_check, self.acknowledge_writes())

        # Branching host-only subtrees (issue 17): a shared stem with diverging tails,
        # every page pushed to host, then host eviction under pressure. Random keys over
        # three token values on a six-page device almost never make these shapes.
        @rule(stem_pages=st.integers(1, 2), tails=st.lists(st.integers(1, 3), min_size=2,
                                                          max_size=3, unique=True),
              tail_pages=st.integers(1, 2), namespace=namespaces,
              evict_host_pages=st.integers(0, 3))
        def grow_branches(self, stem_pages: int, tails: list[int], tail_pages: int,
                          namespace: str | None, evict_host_pages: int) -> None:
            ps = self.cache.page_size
            stem = tuple(i % 3 + 1 for i in range(stem_pages * ps))
            for tail in tails:
                tokens = (*stem, tail, *(i % 3 + 1 for i in range(tail_pages * ps - 1)))
                self.serve(tokens, namespace, 1, False, 0, False, None)
                self.seen.append((tokens, namespace))
            engine = self.cache.engine
            if isinstance(engine, ControlledCopyEngine) and engine.queued("d2h"):
                engine.complete("d2h", engine.queued("d2h"))  # the backups land
            if self.cache.pending["d2h"]:
                self.step("writing_check", ops.writing_check, self.acknowledge_writes())
            self.evict_both(self.cache.device_pool.num_slots)
            if evict_host_pages:
                self.evict_host(evict_host_pages * ps)

        def serve(self, tokens: tuple[int, ...], namespace: str | None, dt: int,
                  chunked: bool, priority: int, keep_lock: bool, quota: int | None,
                  counted_from: int = 0) -> None:
            key, rkey = Key(tokens, namespace), RadixKey(tokens, namespace)
            now = self.clock.advance(dt)
            got = self.cache.match_prefix(rkey)
            want = self.step("match_prefix", ops.match_prefix, key, now)
            self.same_match(got, want)  # type: ignore[arg-type]
            self.counts.hits.append((len(tokens), len(want.device_slots),  # type: ignore[attr-defined]
                                     want.host_hit_tokens))  # type: ignore[attr-defined]
            if want.host_hit_tokens and got.last_host_node is not self.cache.root:  # type: ignore[attr-defined]
                self.load_both(got.last_host_node, quota)
                got = self.cache.match_prefix(rkey)
                want = self.step("match_prefix", ops.match_prefix, key, now)
                self.same_match(got, want)  # type: ignore[arg-type]
            cached_slots = got.device_slots.clone()
            scribble(got.device_slots)  # the cache's answer is the caller's to reuse
            locked = got.last_device_node
            engine_delta = self.cache.inc_lock_ref(locked)
            model_delta = self.step("inc_lock_ref", ops.inc_lock_ref, self.page_of(locked))
            self.agree(engine_delta, model_delta)
            cached = len(got.device_slots)
            need = len(tokens) - cached
            ps = self.cache.page_size
            alloc_tokens = math.ceil(need / ps) * ps
            free = self.cache.device_pool.num_free_slots
            if alloc_tokens > free:
                self.evict_both(alloc_tokens - free)
            new = self.allocate(alloc_tokens)
            if new is not None:
                self.step("alloc", ops.alloc, key, cached, tuple(new.tolist()))
                self.write_kv(key, cached, new[:need])
                slots = torch.cat([cached_slots, new[:need]])
                now = self.clock.advance(dt)
                if 0 < counted_from < len(tokens) // ps * ps:
                    counts.ops["insert counted_from inside the key"] += 1
                prefix = self.call(self.cache.insert, rkey, slots, priority=priority,
                                   chunked=chunked, counted_from=counted_from)
                made = self.recorder.take().backups
                backup = Backup(tuple(map(to_key, made[0].host_victims)),
                                made[0].host_slots) if made else None
                result = self.step("insert", ops.insert, key, tuple(slots.tolist()), now,
                                   priority=priority, chunked=chunked,
                                   counted_from=counted_from, backup=backup)
                scribble(slots)  # the caller reuses its buffer for the next batch
                if prefix is not INTERRUPTED:
                    self.agree(ops.InsertResult(prefix, result.due), result)  # type: ignore[attr-defined]
                owned = self.cache._tree_device_slots()
                leftover = [s for s in new.tolist() if s not in owned]
                if leftover:
                    self.cache.free(torch.tensor(leftover, dtype=torch.int64))
                    self.step("free", ops.free, tuple(leftover))
            if keep_lock and locked is not self.cache.root:
                self.caller_locks.append(locked)
            else:
                engine_delta = self.cache.dec_lock_ref(locked)
                model_delta = self.step("dec_lock_ref", ops.dec_lock_ref, self.page_of(locked))
                self.agree(engine_delta, model_delta)

        # Rules pick nodes by an index (not st.data()) so that a shrunk failure prints
        # as a runnable script.
        @rule(index=st.integers(0, 63))
        def lock(self, index: int) -> None:
            nodes = self.device_nodes()
            if nodes:
                node = nodes[index % len(nodes)]
                engine_delta = self.cache.inc_lock_ref(node)
                model_delta = self.step("inc_lock_ref", ops.inc_lock_ref, self.page_of(node))
                self.agree(engine_delta, model_delta)
                self.caller_locks.append(node)

        @precondition(lambda self: bool(self.caller_locks))
        @rule(index=st.integers(0, 63))
        def unlock(self, index: int) -> None:
            node = self.caller_locks.pop(index % len(self.caller_locks))
            engine_delta = self.cache.dec_lock_ref(node)
            model_delta = self.step("dec_lock_ref", ops.dec_lock_ref, self.page_of(node))
            self.agree(engine_delta, model_delta)

        def allocate(self, num_tokens: int) -> torch.Tensor | None:
            """The cache's own ``alloc``, as a scheduler calls it: None only where the
            model has fewer free device slots than asked (3.3)."""
            got = self.cache.alloc(num_tokens)
            free = len(self.model.device_free)
            assert got is not None or num_tokens > free, (
                f"alloc({num_tokens}) refused with {free} device slots free in the model")
            return got

        @rule(pages=st.integers(1, 3), tokens=keys_for(scenario.page_size))
        def hold(self, pages: int, tokens: tuple[int, ...]) -> None:
            slots = self.allocate(pages * self.cache.page_size)
            if slots is None:
                return
            key = Key(tokens)
            self.step("alloc", ops.alloc, key, 0, tuple(slots.tolist()))
            self.write_kv(key, 0, slots[: len(tokens)])
            self.holdings.append(slots)

        @precondition(lambda self: bool(self.holdings))
        @rule()
        def release(self) -> None:
            slots = self.holdings.pop()
            self.cache.free(slots)
            self.step("free", ops.free, tuple(slots.tolist()))

        @rule(num_tokens=st.integers(0, 12))
        def evict(self, num_tokens: int) -> None:
            self.evict_both(num_tokens)

        @rule(num_tokens=st.integers(0, 12))
        def evict_host(self, num_tokens: int) -> None:
            evicted = self.call(self.cache.evict_host, num_tokens)
            chosen = self.recorder.take().host_victims
            model_evicted = self.step("evict_host", ops.evict_host, num_tokens,
                                      tuple(map(to_key, chosen)))
            if evicted is not INTERRUPTED:
                self.agree(evicted, model_evicted)

        @rule(index=st.integers(0, 63))
        def write_backup(self, index: int) -> None:
            nodes = [n for n in self.device_nodes() if n.host is None]
            if not nodes:
                return
            node = nodes[index % len(nodes)]
            issued = self.call(self.cache.write_backup, node)
            made = self.recorder.take().backups
            report = Backup(tuple(map(to_key, made[0].host_victims)), made[0].host_slots)
            model_issued = self.step("write_backup", ops.write_backup, self.page_of(node), report)
            if issued is not INTERRUPTED:
                self.agree(issued, model_issued)

        @precondition(lambda self: isinstance(self.cache.engine, ControlledCopyEngine)
                      and any(self.cache.pending.values()))
        @rule(direction=st.sampled_from(["d2h", "h2d"]), count=st.integers(1, 3))
        def finish_copies(self, direction: str, count: int) -> None:
            engine = self.cache.engine
            assert isinstance(engine, ControlledCopyEngine)
            engine.complete(direction, min(count, engine.queued(direction)))  # type: ignore[arg-type]

        @precondition(lambda self: bool(self.cache.pending["d2h"]))
        @rule()
        def writing_check(self) -> None:
            self.step("writing_check", ops.writing_check, self.acknowledge_writes())

        def acknowledge_writes(self) -> int:
            """The implementation's writing_check; a subclass adds what follows an
            acknowledgement (the storage machine: backup to storage, spec/09 S-R1)."""
            return self.acknowledged("d2h", self.cache.writing_check)

        @precondition(lambda self: bool(self.cache.pending["h2d"]))
        @rule()
        def loading_check(self) -> None:
            acked = self.acknowledged("h2d", self.cache.loading_check)
            self.step("loading_check", ops.loading_check, acked)

        def acknowledged(self, direction: str, check: Callable[[], int]) -> int:
            """``check()``'s count; interrupted by the sink, the copies it took off the
            queue (the state is whole, spec/11 11.7). Where the copy engine says which
            copies finished (ours, the harness's), the count must be those at the head of
            the queue: the model takes the count it is given, so a check that leaves a
            finished copy unacknowledged would otherwise pass for a slower engine."""
            queue = self.cache.pending[direction]  # type: ignore[index]
            before = len(queue)
            engine = self.cache.engine
            finished = (before - engine.queued(direction)  # type: ignore[arg-type]
                        if isinstance(engine, ControlledCopyEngine)
                        else before if isinstance(engine, SyncCopyEngine) else None)
            acked = self.call(check)
            count = before - len(queue) if acked is INTERRUPTED else int(acked)  # type: ignore[call-overload]
            assert finished is None or acked is INTERRUPTED or count == finished, (
                f"the {direction} check acknowledged {count} copies; {finished} had finished")
            return count

        @rule(index=st.integers(0, 63), quota=st.none() | st.integers(0, 24),
              leaf=st.booleans())
        def load_back(self, index: int, quota: int | None, leaf: bool = False) -> None:
            """A host-only node loaded back. ``leaf``: one that host eviction may take (a
            host leaf), so that a load which makes room on a full device (under
            write_back, by copying its victims to a full host) meets its own pages among
            the host victims: they must be protected before it makes room."""
            leaves = self.cache.host_leaves if leaf else None
            nodes = sorted(leaves or (n for n in self.cache.nodes() if n.device is None),
                           key=lambda n: n.id)
            if nodes:
                self.load_both(nodes[index % len(nodes)], quota)

        @rule(go=st.integers(0, 15))
        def reset(self, go: int) -> None:
            if go == 0:
                self.reset_cache()
                self.step("reset", ops.reset)
                self.caller_locks.clear()
                self.holdings.clear()

        def reset_cache(self) -> None:
            """The implementation's reset; the storage machine stops its I/O threads."""
            self.call(self.cache.reset)

        # -- caller slots laid out other than whole pages in order (spec/03, R7) ---------

        @rule(tokens=keys_for(scenario.page_size), namespace=namespaces,
              how=st.sampled_from(choosers.LAYOUTS))
        def scrambled_insert_slots(self, tokens: tuple[int, ...], namespace: str | None,
                                   how: str) -> None:
            """Insert's slots interleaved, shifted, reversed, with the partial tail at the
            end of its page, or whole pages out of page order (issue 16). Where R7 is
            broken both refuse, the cache and the model unchanged; otherwise both cache."""
            ps = self.cache.page_size
            if how == "tail" and ps > 1 and len(tokens) % ps == 0:
                tokens = tokens[:-1]  # so that there is a partial tail
            if not tokens:
                return
            key, rkey = Key(tokens, namespace), RadixKey(tokens, namespace)
            pages = self.allocate(math.ceil(len(tokens) / ps) * ps)
            if pages is None:
                return
            laid = choosers.scramble(tuple(pages.tolist()), len(tokens), ps, how)
            rest = tuple(s for s in pages.tolist() if s not in laid)
            self.step("alloc", ops.alloc, key, 0, laid + rest)
            self.write_kv(key, 0, torch.tensor(laid, dtype=torch.int64))
            now = self.clock.advance(0)
            if choosers.page_fault(laid, ps) is not None:
                before = abstract(self.cache, self.model)
                model_before = self.model
                try:
                    self.cache.insert(rkey, torch.tensor(laid, dtype=torch.int64))
                except InvalidArgument as error:
                    assert "R7" in error.reason, error
                else:
                    raise AssertionError(f"insert accepted {how} slots {laid} at P={ps}")
                try:
                    ops.insert(self.model, key, laid, now)
                except PreconditionError:
                    pass
                else:
                    raise AssertionError(f"the model accepted {how} slots {laid} at P={ps}")
                assert abstract(self.cache, self.model) == before, "the refusal changed the cache"
                assert self.model is model_before
                counts.ops[f"R7 slots refused (P={ps})"] += 1
                self.holdings.append(pages)
                return
            given = torch.tensor(laid, dtype=torch.int64)
            prefix = self.cache.insert(rkey, given)
            scribble(given)
            made = self.recorder.take().backups
            backup = Backup(tuple(map(to_key, made[0].host_victims)),
                            made[0].host_slots) if made else None
            result = self.step("insert", ops.insert, key, laid, now, backup=backup)
            self.agree(ops.InsertResult(prefix, result.due), result)  # type: ignore[attr-defined]
            counts.ops[f"R7 slots accepted (P={ps})"] += 1
            owned = self.cache._tree_device_slots()
            leftover = [s for s in pages.tolist() if s not in owned]
            if leftover:
                self.cache.free(torch.tensor(leftover, dtype=torch.int64))
                self.step("free", ops.free, tuple(leftover))

        # -- misuse: a typed error, and the cache exactly as it was ---------------------

        @rule(kind=st.sampled_from(["unlock", "slots", "negative", "load", "foreign"]))
        def misuse(self, kind: str) -> None:
            before = abstract(self.cache, self.model)
            expect: type[Exception]
            call: Callable[[], object]
            cache = self.cache
            if kind == "unlock":
                # A node on the path of any lock (the caller's or a copy's) holds a lock.
                lockers = self.caller_locks + [c.lock_node for q in cache.pending.values()
                                               for c in q]
                busy = {id(p) for n in lockers for p in n.path()}
                unlockable = [n for n in self.device_nodes() if id(n) not in busy]
                if not unlockable:
                    return
                expect, call = NotLocked, lambda: cache.dec_lock_ref(unlockable[0])
            elif kind == "slots":
                expect, call = InvalidArgument, lambda: cache.insert(
                    RadixKey((1, 2)), torch.tensor([0, 1], dtype=torch.int32))
            elif kind == "negative":
                expect, call = InvalidArgument, lambda: cache.evict(-1)
            elif kind == "load":
                nodes = self.device_nodes()
                if not nodes:
                    return
                expect, call = InvalidArgument, lambda: cache.load_back(nodes[0])
            else:
                stranger = scenario.build(ManualClock(), None)
                expect, call = ForeignNode, lambda: cache.inc_lock_ref(stranger.root)
            try:
                call()
            except expect:
                pass
            else:
                raise AssertionError(f"{kind}: no {expect.__name__} raised")
            assert abstract(cache, self.model) == before, f"{kind} changed the cache"
            counts.ops["misuse rejected"] += 1

        # -- a sink that raises (issue 34; spec/11, 11.7) ------------------------------------

        # Off where a subclass wraps more than ``call`` does (the storage machine: its
        # tier's own events, and its check, which does not resynchronise the watch).
        SINK_RAISES = True

        @precondition(lambda self: self.SINK_RAISES)
        @rule(at=st.integers(0, 3), error=st.sampled_from(SINK_ERRORS),
              then=st.sampled_from(["request", "request_again", "evict", "evict_host",
                                    "write_backup", "writing_check", "loading_check",
                                    "load_back", "reset", "grow_branches"]),
              data=st.data())
        def sink_raises(self, at: int, error: type[BaseException], then: str,
                        data: st.DataObject) -> None:
            """The sink raises ``error`` at the ``at``-th event from now, in the rule
            ``then`` (its arguments drawn as that rule's); the operation's outcome is
            checked in ``call``, the state and the stream by the step's checks. Disarmed
            after. Off in the storage machine, whose tier calls ``call`` does not wrap
            (tests/impl/test_events.py raises on the tier's events)."""
            if then == "request_again" and not self.seen:
                return
            if then in ("writing_check", "loading_check") and not self.cache.pending[
                    "d2h" if then == "writing_check" else "h2d"]:
                return
            wanted = getattr(getattr(type(self), then), RULE_MARKER).arguments
            arguments = {name: data.draw(strategy, label=name)
                         for name, strategy in wanted.items()}
            raised = self.trap.raised
            self.trap.arm(at, error())
            try:
                getattr(self, then)(**arguments)
            finally:
                self.trap.at = None
            counts.ops["sink armed: raised" if self.trap.raised > raised
                       else "sink armed: fewer events than its countdown"] += 1

        # -- after every step -------------------------------------------------------------

        @invariant()
        def refines_the_model(self) -> None:
            found = violations(self.model)
            assert not found, f"the model broke its own invariants: {found}"
            self.cache.check_invariants()
            seen = abstract(self.cache, self.model)
            if seen != self.model:
                raise AssertionError("implementation and model disagree:\n"
                                     + describe_difference(seen, self.model))
            if self.resync_events:  # a router reconnecting after the interrupt
                self.watch.log.take()
                self.watch.resident = {"device": device_resident(self.model),
                                       "host": host_resident(self.model),
                                       "storage": storage_may(self.model)}
                self.resync_events = False
            if self.watch.check(self.model):  # INV-EVENTS-REPLAY (spec/11)
                counts.exercised["INV-EVENTS-REPLAY"] += 1
            counts.checks += 1
            tally_states(counts.states, self.model)
            for spec_id, busy in EXERCISED.items():
                if busy(self.model):
                    counts.exercised[spec_id] += 1
            self.climb_all()

        def climb_all(self) -> None:
            """The quantities that precede cache bugs, for ``target()`` (issue 15)."""
            state = self.model
            config = state.config
            if config.host_slots:
                self.climb("host pool pressure", 1 - len(state.host_free) / config.host_slots)
            self.climb("copies in flight", len(state.pending))
            self.climb("protected host pages", sum(p.host_protect > 0
                                                   for p in state.pages.values()))

    Conformance.tally = counts  # type: ignore[attr-defined]  # subclasses count there too
    gate(Conformance, SWARM_RULES, counts.rules)
    gate(Conformance, ("request",), counts.rules, swarmed=False)
    Conformance.__name__ = f"Conformance_{scenario.slug()}"
    return Conformance


__all__ = ["Config", "HiRadixCache", "Scenario", "Tally", "check", "make_machine"]
