"""The conformance state machine of the storage tier (spec/09): impl and model in step.

It extends the two-tier machine (``machine.make_machine``) with a ``StorageTier`` over a
``ControlledBackend`` (a memory backend with injected faults) and a ``StorageIO`` that is
synchronous, or, in a third of the examples (the swarm's ``threaded`` draw), threaded
behind the backend's gate: the I/O threads run, but each backend call waits until the
machine lets it through, so the machine still decides when I/O happens and when results
become visible to the tier's polls (``run_threaded``, ``settle_io``). Every wait is
bounded and fails naming what it waited for. Every storage rule issues the
operation to the tier, turns the tier's choices (reserved slots, host victims, hit
counts, pages landed or written, faults) into the model's choice arguments, and applies
the model step. After every step the abstraction of cache and tier (``abstraction`` and
``storage_abstraction``) must equal the model state, and ``violations`` must be empty on
the model, ``check_invariants`` and ``StorageTier.check`` on the implementation.

Every write policy: under ``write_back`` the cache calls the tier back after each
eviction's host copy (``on_write_back``), S-R1's second case. ``reset`` runs with
storage attached and with prefetches and writes in flight (the cache calls the tier's
``on_reset`` first, 9.4).
"""

from __future__ import annotations

import dataclasses
import random
import shutil
import tempfile
import time
from collections import Counter
from collections.abc import Callable

from hypothesis import strategies as st
from hypothesis.stateful import (
    RuleBasedStateMachine,
    invariant,
    precondition,
    rule,
)

from hiradix.checker import failures
from hiradix.conformance import machine
from hiradix.conformance.abstraction import abstract
from hiradix.conformance.coverage import THREADED_IO_STEP, tally_states
from hiradix.conformance.machine import (
    SWARM_RULES,
    describe_difference,
    gate,
    make_machine,
    to_key,
)
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.storage_abstraction import abstract_storage, settings_of
from hiradix.conformance.tally import Tally
from hiradix.errors import ForeignNode
from hiradix.keys import RadixKey
from hiradix.storage import ControlledBackend, Fault, MemoryBackend, StorageArgumentError
from hiradix.storage.backend import StorageBackend
from hiradix.storage.controlled import InjectedInterrupt, Operation
from hiradix.storage.file import FileBackend
from hiradix.storage.hashing import page_hashes
from hiradix.storage.io import KINDS, BackupResult, Kind, PrefetchResult
from hiradix.storage.tier import PageRun, StorageTier, TierSettings
from hiradix.transfer import ControlledCopyEngine
from hiradix.tree import TreeNode
from hiradix_model import Key, PreconditionError, State, ops, violations
from hiradix_model.ops import storage as storage_ops

REQUESTS = ("r0", "r1", "r2")
FAULTS: dict[str, tuple[str, ...]] = {
    "exists": ("raise", "short"),
    "get": ("raise", "short", "corrupt", "die"),
    "set": ("raise", "short", "die"),
}
# What a broken backend raises instead of a StorageError (#17), injected into every
# operation: the batch call restates such an Exception as a StorageError after its leading
# pages (an interrupt goes through it: interrupt_io).
FOREIGN_FAULTS = ("runtime_error", "os_error", "memory_error")
# Short timeouts (a few ticks), so that they fire while the I/O runs; the cap at or
# above the base (a cap below it is refused as a typo).
settings_strategy = st.tuples(st.integers(0, 4), st.integers(0, 4)).flatmap(
    lambda base_extra: st.builds(
        TierSettings,
        prefetch_threshold=st.sampled_from([0, 2, 4]),
        prefetch_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        timeout_base=st.just(base_extra[0]),
        timeout_per_ki_token=st.sampled_from([0, 512, 4096]),
        timeout_max=st.just(sum(base_extra)),
        prefetch_token_limit=st.sampled_from([None, 4, 100])))



def first_settings(rng: random.Random) -> TierSettings:
    """The first attachment of an example: the roomy one the machine always had, one
    time in four; else short timeouts (a few ticks, so that they fire while the I/O
    runs), small thresholds and token limits (re-attaching changes only the policy, 9.4)."""
    if rng.random() < 0.25:
        return TierSettings(prefetch_threshold=0, prefetch_token_limit=100)
    base = rng.randint(0, 4)
    return TierSettings(prefetch_threshold=rng.choice([0, 2, 4]),
                        prefetch_policy=rng.choice(["best_effort", "wait_complete",
                                                    "timeout", "timeout"]),
                        timeout_base=base, timeout_per_ki_token=rng.choice([0, 512, 4096]),
                        timeout_max=base + rng.randint(0, 4),
                        prefetch_token_limit=rng.choice([None, 4, 100]))


STORAGE_SWARM_RULES: tuple[str, ...] = (
    "attach", "detach", "reattach", "clear", "inject", "interrupt_io", "query", "prefetch",
    "bad_anchor", "store", "cycle", "squeeze", "run_io", "progress", "terminate", "abort",
    "pop_loaded", "drain")
ANCHOR_MISUSE = ("device only", "not on the key", "removed")
# Threaded I/O: the backend calls each I/O thread makes (the gate tells them apart by
# operation), and the bounds on every wait (a thread that never comes fails the step).
GATED: dict[Kind, tuple[Operation, ...]] = {"prefetch": ("exists", "get"),
                                            "backup": ("set",)}
IO_WAIT_S = 10.0
GATE_TIMEOUT_S = 20.0
THREADED_ODDS = 1 / 3


def make_storage_machine(scenario: Scenario, tally: Tally | None = None,
                         faults: Counter[str] | None = None) -> type[RuleBasedStateMachine]:
    """The storage conformance machine for one configuration. ``faults`` tallies the
    faults injected (and taken by a batch call) by kind."""
    Base = make_machine(scenario, tally)
    injected = faults if faults is not None else Counter()

    class StorageConformance(Base):  # type: ignore[misc, valid-type]
        SINK_RAISES = False  # tests/impl/test_events.py raises on the tier's events

        def __init__(self) -> None:
            super().__init__()
            self.tier = StorageTier(self.cache)
            # The file backend writes real files (atomic, checksummed) under a directory
            # of this example's own, removed at teardown.
            self.directory = (tempfile.mkdtemp(prefix="hiradix-check-")
                              if scenario.storage == "file" else None)
            inner: StorageBackend = (MemoryBackend() if self.directory is None
                                     else FileBackend(self.directory))
            self.backend = ControlledBackend(inner, name=scenario.storage or "memory")
            self.identity: tuple[str, ...] = ()
            self.settings: TierSettings | None = None
            self.names: dict[str, Key] = {}
            self.known: list[TreeNode] = []  # nodes seen by bad_anchor, some removed since
            self.threaded = False
            # Threaded I/O: operations issued (tier ids) and not yet answered, by kind;
            # ids below the watermark have been looked at.
            self.outstanding: dict[int, Kind] = {}
            self.watermark = 0
            self.io_reported = False  # a threaded result was reported since the last check
            self.attach(TierSettings(prefetch_threshold=0, prefetch_token_limit=100))

        def configure(self, rng: random.Random) -> None:
            """Rules off, host size and the first attachment's settings: always a fresh
            cache, model and tier."""
            host_pages = self.choose(rng, SWARM_RULES + STORAGE_SWARM_RULES)
            settings = first_settings(rng)
            self.threaded = rng.random() < THREADED_ODDS  # drawn last: older seeds replay
            self.counts.swarm[f"first policy: {settings.prefetch_policy}"] += 1
            self.counts.swarm[f"I/O: {'threaded' if self.threaded else 'synchronous'}"] += 1
            self.tier.detach()
            self.trace.clear()  # the first attachment's step: the trace restarts here
            self.reshape(dataclasses.replace(self.scenario, host_pages=host_pages))
            self.tier = StorageTier(self.cache)
            self.outstanding, self.watermark = {}, self.tier.state.next_id
            if self.threaded:
                self.backend.close_gate(GATE_TIMEOUT_S)
            self.settings = None
            self.attach(settings)

        def teardown(self) -> None:
            if self.threaded:
                self.stop_threads()
            for operation in FAULTS:  # injected but never taken by a batch call
                injected[f"{operation}:untaken"] += self.backend.queued_faults(
                    operation)  # type: ignore[arg-type]
            injected["tokens inserted from storage"] += \
                self.tier.metrics.prefetch_tokens_inserted
            injected["pages written to storage"] += self.backend.metrics.pages_backed_up
            super().teardown()
            if self.directory is not None:
                shutil.rmtree(self.directory)

        # -- plumbing -----------------------------------------------------------------

        def sstep(self, name: str, op: Callable[..., tuple[State, object]], *args: object,
                  **kwargs: object) -> object:
            """A model step of the storage tier, recorded in the trace like every other
            (spec/08): a trace of a run with storage replays from the empty state."""
            return self.step(name, op, *args, **kwargs)

        def learn(self, rkey: RadixKey) -> None:
            """Remember the page of every hash of ``rkey`` (the abstraction's map)."""
            identity = self.tier.identity
            if identity is None:
                return
            size = self.cache.page_size
            aligned = rkey.aligned_length(size)
            hashes = page_hashes(list(rkey.tokens[:aligned]), size, identity, rkey.namespace)
            for index, page_hash in enumerate(hashes):
                self.names[page_hash] = Key(rkey.tokens[:(index + 1) * size], rkey.namespace)

        def learn_tree(self) -> None:
            for node in self.cache.nodes():
                if not node.children:
                    self.learn(RadixKey(node.prefix(), node.namespace))

        def pick(self, index: int) -> RadixKey | None:
            if not self.seen:
                return None
            tokens, namespace = self.seen[index % len(self.seen)]
            return RadixKey(tokens, namespace)

        def stored_first(self, index: int) -> int:
            """``index`` turned towards a seen key whose first page is in storage, if
            there is one: round trips through storage need stored pages. It asks the
            inner backend, which counts nothing and takes no injected fault."""
            identity, size = self.tier.identity, self.cache.page_size
            if identity is None:
                return index
            stored = [i for i, (tokens, namespace) in enumerate(self.seen)
                      if len(tokens) >= size and self.backend.inner.has_page(
                          page_hashes(list(tokens[:size]), size, identity, namespace)[0])]
            return stored[index % len(stored)] if stored else index

        # -- threaded I/O behind the gate ----------------------------------------------

        def stop_threads(self) -> None:
            """Shut the I/O down, its threads joined: the calls waiting at the gate are
            refused (a call refused there has touched no page and taken no fault)."""
            self.backend.refuse(True)
            try:
                io = self.tier.io
                if io is not None:
                    io.shutdown()
            finally:
                self.backend.refuse(False)

        def reset_cache(self) -> None:
            """9.4 reset, which stops the I/O (its results are discarded): threaded, the
            calls waiting at the gate are refused so that the shutdown's join returns,
            as the synchronous I/O's queued operations end before any page."""
            self.backend.refuse(self.threaded)
            try:
                super().reset_cache()
            finally:
                self.backend.refuse(False)
            self.observe()
            self.outstanding.clear()

        def observe(self) -> None:
            """Note the operations issued since the last look: an id the tier gave a
            write is a backup (a write stays until its result is taken), else a prefetch."""
            issued = self.tier.state.next_id
            for op_id in range(self.watermark, issued):
                self.outstanding[op_id] = ("backup" if op_id in self.tier.state.writes
                                           else "prefetch")
            self.watermark = issued

        def pending(self, kind: Kind) -> bool:
            return kind in self.outstanding.values()

        def collect(self) -> int:
            """Report the results the threads posted so far; how many."""
            io = self.tier.io
            assert io is not None
            prefetched, backed_up = io.drain_prefetch(), io.drain_backup()
            if prefetched or backed_up:
                self.report(prefetched, backed_up)
            return len(prefetched) + len(backed_up)

        def await_io(self, kind: Kind) -> int:
            """Wait until the ``kind`` thread posted results (reported; their count is
            returned), waits at the gate, or has nothing left to do (0)."""
            deadline = time.monotonic() + IO_WAIT_S
            operations = GATED[kind]
            while True:
                taken = self.collect()
                if taken:
                    return taken
                if not self.pending(kind) or any(self.backend.waiting(op)
                                                 for op in operations):
                    return 0
                if time.monotonic() > deadline:
                    raise AssertionError(
                        f"threaded I/O: the {kind} thread neither reached the gate nor "
                        f"posted a result within {IO_WAIT_S} s (operations "
                        f"{sorted(i for i, k in self.outstanding.items() if k == kind)} "
                        "outstanding)")
                self.backend.wait_at_gate(operations, 0.002)

        def settle_io(self) -> None:
            """Threaded: each I/O thread with work waits at the gate, and every result
            it posted without a backend call (an operation stopped before it began) is
            reported, so the tier's next poll takes nothing the model has not seen."""
            self.observe()
            for kind in KINDS:
                while self.pending(kind) and not any(self.backend.waiting(op)
                                                     for op in GATED[kind]):
                    self.await_io(kind)

        def run_threaded(self, limit: int) -> None:
            """Let the threads through, call by call (prefetches first, then backups,
            as ``run_pending``), until ``limit`` results (0: all) came; an operation
            begun is run to its result, so no partial progress stays between steps."""
            self.observe()
            taken = 0
            for kind in KINDS:
                while self.pending(kind) and not (limit and taken >= limit):
                    got = self.await_io(kind)
                    taken += got
                    if not got and self.pending(kind):
                        operation = next(op for op in GATED[kind] if self.backend.waiting(op))
                        self.backend.let_through(operation)
            self.settle_io()

        def io_pending(self) -> bool:
            return any(p.io_running for p in self.tier.state.prefetches.values()) or any(
                w.phase == "running" for w in self.tier.state.writes.values())

        # -- the two-tier rules' acknowledgement: S-R1 runs on every acknowledged copy ---

        def acknowledge_writes(self) -> int:
            self.learn_tree()
            return self.tier.writing_check()

        # -- and on every write_back eviction's host copy, in evict and in load_back ---

        def evict_both(self, num_tokens: int) -> None:
            self.learn_tree()  # the victims' pages may be written to storage
            super().evict_both(num_tokens)

        def load_both(self, node: TreeNode, quota: int | None) -> None:
            self.learn_tree()
            super().load_both(node, quota)

        # -- storage rules ------------------------------------------------------------

        @rule(settings=settings_strategy, go=st.integers(0, 3))
        def attach(self, settings: TierSettings, go: int = 0) -> None:
            if go:
                return
            observed = self.tier.attach(self.backend, "model-x", settings,
                                        threaded=self.threaded, batch_pages=8)
            identity = self.tier.identity
            assert identity is not None
            self.identity = (identity.model, identity.dtype, identity.layout)
            self.settings = self.tier.settings
            want = self.sstep("attach_storage", ops.attach_storage, self.backend.name,
                              identity=self.identity, settings=settings_of(settings),
                              retained=True)
            assert observed == want, (observed, want)
            self.learn_tree()
            for tokens, namespace in self.seen:
                self.learn(RadixKey(tokens, namespace))

        @rule(go=st.integers(0, 7))
        def detach(self, go: int) -> None:
            if go:
                return
            self.run_io()
            self.tier.detach()
            self.sstep("detach_storage", ops.detach_storage)

        @rule(go=st.integers(0, 15))
        def clear(self, go: int) -> None:
            if go == 0:
                assert self.tier.clear() == self.sstep("clear_storage", ops.clear_storage)

        @precondition(lambda self: self.tier.attached)
        # Plain integers, not st.data(): a shrunk failure prints them, so its
        # reproducer replays (a data draw prints as ``data(...)``).
        @rule(operation=st.sampled_from(sorted(FAULTS)), kind=st.integers(0, 6),
              at_page=st.integers(0, 3), go=st.integers(0, 2))
        def inject(self, operation: str, kind: int, at_page: int, go: int) -> None:
            if go:
                return
            kinds = FAULTS[operation] + FOREIGN_FAULTS
            if self.backend.queued_faults(operation) < 2:  # type: ignore[arg-type]
                self.queue_fault(operation, kinds[kind % len(kinds)], at_page)

        @precondition(lambda self: not self.threaded and self.io_pending()
                      and not self.backend.queued_faults("get")
                      and not self.backend.queued_faults("set"))
        @rule()
        def interrupt_io(self) -> None:
            """An interrupt at the first page of the next batch call of the I/O queued, and
            the I/O runs: ``run_pending`` re-raises it to ``run_io`` after posting its
            operation's failed result (io.py). Synchronous only: on a thread it ends the
            thread for the rest of the example (test_storage_faults covers that). At the
            first page, as the pages a write did before it are stored but reported not done.
            Never for ``exists``: the scheduler's own hit query would re-raise it to the rule
            that asked."""
            fetching = any(p.io_running for p in self.tier.state.prefetches.values())
            self.queue_fault("get" if fetching else "set", "interrupt", 0)
            self.run_io()

        def queue_fault(self, operation: str, kind: str, at_page: int) -> None:
            """Queue ``kind`` at ``at_page`` (made legal: a raise is at page 0, a die
            after at least one page) for the next ``operation`` batch call."""
            at_page = 0 if kind == "raise" else max(at_page, 1 if kind == "die" else 0)
            self.backend.inject(operation, Fault(kind, at_page))  # type: ignore[arg-type]
            injected[f"{operation}:{kind}"] += 1

        @precondition(lambda self: bool(self.seen))
        @rule(index=st.integers(0, 63))
        def query(self, index: int) -> None:
            rkey = self.pick(index)
            assert rkey is not None
            self.learn(rkey)
            faults_before = self.backend.queued_faults("exists")
            tokens = self.tier.query_storage_hit_length(rkey)
            if self.backend.queued_faults("exists") != faults_before:
                return  # the fault went to this question; the model has no such step
            got = self.sstep("query_storage_hit_length", ops.query_storage_hit_length,
                             Key(rkey.tokens, rkey.namespace), None,
                             tokens // self.cache.page_size)
            assert tokens == got

        @precondition(lambda self: bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63),
              use_anchor=st.booleans(), dt=st.integers(0, 2))
        def prefetch(self, request: str, index: int, use_anchor: bool, dt: int) -> None:
            rkey = self.pick(index)
            assert rkey is not None
            key = Key(rkey.tokens, rkey.namespace)
            self.learn(rkey)
            if not self.tier.attached:  # refused, nothing changed (the check after sees)
                try:
                    self.tier.prefetch_from_storage(request, rkey)
                except StorageArgumentError as error:
                    assert error.argument == "backend", error
                else:
                    raise AssertionError("a prefetch was accepted with no backend attached")
                self.counts.ops["prefetch refused: detached"] += 1
                return
            if request in self.tier.state.prefetches:
                before = abstract(self.cache, self.model)
                try:
                    self.tier.prefetch_from_storage(request, rkey)
                except StorageArgumentError as error:
                    assert error.argument == "request"
                else:
                    raise AssertionError("a second prefetch for a request was accepted")
                assert abstract(self.cache, self.model) == before
                self.counts.ops["misuse rejected"] += 1
                return
            anchor = None
            if use_anchor:
                got = self.cache.match_prefix(rkey)
                want = self.step("match_prefix", ops.match_prefix, key, self.clock.tick)
                self.same_match(got, want)  # type: ignore[arg-type]
                if got.last_host_node is not self.cache.root:
                    anchor = got.last_host_node
            now = self.clock.advance(dt)
            tokens = self.tier.prefetch_from_storage(request, rkey, anchor)
            started = self.tier.state.prefetches.get(request)
            slots = None if started is None else tuple(started.reserved.tolist())
            got_tokens = self.sstep(
                "prefetch_from_storage", ops.prefetch_from_storage, request, key,
                None if anchor is None else self.page_of(anchor), now,
                host_victims=tuple(map(to_key, self.tier.last_host_victims)),
                host_slots=slots)
            assert tokens == got_tokens, (tokens, got_tokens)

        @rule()
        def store(self) -> None:
            """Time passes: host copies land and are acknowledged, the I/O runs."""
            engine = self.cache.engine
            if isinstance(engine, ControlledCopyEngine) and engine.queued("d2h"):
                engine.complete("d2h", engine.queued("d2h"))
            if self.cache.pending["d2h"]:
                self.writing_check()
            if self.io_pending():
                self.run_io()

        @precondition(lambda self: bool(self.seen) or bool(self.cache.pending["d2h"]))
        @rule(index=st.integers(0, 63), start=st.integers(0, 7), length=st.integers(-1, 7),
              in_flight=st.booleans())
        def backup(self, index: int, start: int, length: int, in_flight: bool) -> None:
            """``backup_pages`` in every state, attached or not, over any seen key's pages
            (valid runs or not) and, ``in_flight``, over the pages of a d2h copy still in
            flight: impl and model accept the same runs (a typed error naming the same
            argument otherwise, nothing changed), so a backup that stores a host copy
            before it landed (INV-STORAGE-WRITE-SOURCE) is a disagreement here."""
            size = self.cache.page_size
            copies = self.cache.pending["d2h"]
            if in_flight and copies:
                copy = copies[index % len(copies)]
                prefix = copy.lock_node.prefix()
                rkey = RadixKey(prefix, copy.lock_node.namespace)
                end = len(prefix) // size
                first = end - copy.tokens // size
                start, stop = first + start % (end - first), end
            else:
                picked = self.pick(index)
                if picked is None:
                    return
                rkey, stop = picked, start + length
            self.learn(rkey)
            try:
                issued = self.tier.backup_pages(PageRun(rkey, start, stop))
            except StorageArgumentError as error:
                refused: str | None = error.argument
            else:
                refused = None
            try:
                want = self.sstep("backup_pages", storage_ops.backup_pages,
                                  Key(rkey.tokens, rkey.namespace), start, stop)
            except PreconditionError as error:
                assert refused == error.argument, (
                    f"backup_pages({start}, {stop}) of {rkey}: the model refuses it "
                    f"({error}), the implementation "
                    + ("issued a write" if refused is None else f"refused {refused!r}"))
                self.counts.ops[f"backup refused: {error.argument}"] += 1
                return
            assert refused is None, f"the implementation refused {refused!r}; the model " \
                                    "accepts"
            assert issued == want, (issued, want)
            self.counts.ops["backup issued" if want else "backup: all stored"] += 1

        @precondition(lambda self: self.tier.attached and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63),
              evict=st.integers(0, 24), use_anchor=st.booleans(), dt=st.integers(0, 4),
              run=st.booleans(), fresh=st.none() | st.tuples(machine.tokens, machine.namespaces),
              fetch_fault=st.none() | st.tuples(st.sampled_from(FAULTS["get"]),
                                                st.integers(0, 2)))
        def cycle(self, request: str, index: int, evict: int, use_anchor: bool, dt: int,
                  run: bool, fresh: tuple[tuple[int, ...], str | None] | None,
                  fetch_fault: tuple[str, int] | None) -> None:
            """A request's round trip through storage: its pages are stored, leave the
            cache, are prefetched back and the prefetch is polled (each step checked).
            ``fresh``: a new request is served first and is the one that goes round.
            ``fetch_fault`` goes to this round trip's fetch, where fetches are most
            common (a fault queued by ``inject`` may be taken by any later call)."""
            if fresh is not None:
                self.request(*fresh, dt=0, chunked=False, priority=0, keep_lock=False,
                             quota=None)
                self.refines_the_model()
            self.store()
            self.refines_the_model()
            self.drain()  # the acks release the written pages' protection
            self.refines_the_model()
            if evict:
                self.evict_both(evict)
                self.evict_host(evict)
                self.refines_the_model()
            self.prefetch(request, len(self.seen) - 1 if fresh is not None
                          else self.stored_first(index), use_anchor, 0)
            self.refines_the_model()
            if fetch_fault is not None and not self.backend.queued_faults("get"):
                self.queue_fault("get", *fetch_fault)
            if run and self.io_pending():
                self.run_io()
                self.refines_the_model()
            started = self.tier.state.prefetches.get(request)
            if started is not None and started.io_running:
                # The scheduler polls its other requests while this one's I/O runs: the
                # clock moves past short timeouts before this prefetch is checked.
                other = next(r for r in REQUESTS if r not in self.tier.state.prefetches
                             or r == request)
                self.progress(other, dt)
                self.refines_the_model()
            if request in self.tier.state.prefetches:
                self.progress(request, dt)

        @precondition(lambda self: self.tier.attached)
        @rule(settings=settings_strategy)
        def reattach(self, settings: TierSettings) -> None:
            """Detach and attach again with other constants: re-attaching the attached
            backend changes the policy only (9.4), so this is how timeouts and thresholds
            change mid-run."""
            self.detach(0)
            self.attach(settings)

        @precondition(lambda self: bool(self.seen))
        @rule(index=st.integers(0, 63), kind=st.sampled_from(ANCHOR_MISUSE),
              pick=st.integers(0, 63), request=st.sampled_from(REQUESTS))
        def bad_anchor(self, index: int, kind: str, pick: int, request: str) -> None:
            """A prefetch (and a query) anchored at a node without a host copy, off
            the key, or removed from the tree: a typed error, and nothing changes (the
            comparison after the step sees any change)."""
            rkey = self.pick(index)
            assert rkey is not None
            nodes = list(self.cache.nodes())
            self.known = (self.known + [n for n in nodes if n not in self.known])[-32:]
            live = {id(n) for n in nodes}

            def on_key(node: TreeNode) -> bool:
                prefix = node.prefix()
                return (node.namespace == rkey.namespace
                        and rkey.tokens[:len(prefix)] == prefix
                        and len(prefix) <= rkey.aligned_length(self.cache.page_size))
            if kind == "device only":
                found = [n for n in nodes if on_key(n) and n.host is None]
            elif kind == "not on the key":
                found = [n for n in nodes if not on_key(n)]
            else:
                found = [n for n in self.known if id(n) not in live]
            if not found:
                return
            anchor = found[pick % len(found)]
            for call in (lambda: self.tier.query_storage_hit_length(rkey, anchor),
                         lambda: self.tier.prefetch_from_storage(request, rkey, anchor)):
                try:
                    call()
                except StorageArgumentError as error:
                    assert kind != "removed" and error.argument == "anchor", error
                except ForeignNode as error:
                    assert kind == "removed" and error.argument == "anchor", error
                else:
                    raise AssertionError(f"an anchor {kind} was accepted")
            self.counts.ops[f"anchor refused: {kind}"] += 1

        @precondition(lambda self: any(p.io_running
                                       for p in self.tier.state.prefetches.values()))
        @rule(device=st.integers(0, 24), host=st.integers(0, 24))
        def squeeze(self, device: int, host: int) -> None:
            """Eviction on both tiers while a prefetch's I/O runs: its anchor's path is
            protected on host and must stay."""
            self.evict_both(device)
            self.evict_host(host)
            self.counts.ops["evicted under a running prefetch"] += 1

        @precondition(lambda self: self.tier.attached and self.io_pending())
        @rule(limit=st.integers(0, 2))
        def run_io(self, limit: int = 0) -> None:
            """The I/O runs: every operation queued (synchronous), or, threaded, the
            operations let through the gate until ``limit`` results came (0: all)."""
            io = self.tier.io
            if io is None:
                return
            if self.threaded:
                self.run_threaded(limit)
                return
            while True:
                try:
                    io.run_pending()
                    break
                except InjectedInterrupt:  # its operation's failed result was posted first
                    injected["interrupt:reached run_io"] += 1
            self.report(io.drain_prefetch(), io.drain_backup())

        def report(self, prefetched: list[PrefetchResult],
                   backed_up: list[BackupResult]) -> None:
            """Each I/O result to the model (prefetches first), then to the tier."""
            for result in (*prefetched, *backed_up):
                self.outstanding.pop(result.op_id, None)  # type: ignore[arg-type]
            self.io_reported = self.threaded
            storage = self.model.storage
            assert storage is not None
            for result in prefetched:
                live = next((p for p in self.model.storage.prefetches  # type: ignore[union-attr]
                             if p.id == result.op_id), None)
                if live is None or live.phase != "querying":
                    continue  # ended or stopped before its I/O ran: nothing to report
                revoked = self.sstep("io_prefetch_query", ops.io_prefetch_query,
                                     live.request, result.pages_hit)
                if revoked:
                    continue
                landed, hit = result.pages_done, result.pages_hit
                fault = None if landed == hit else "corrupt" if result.corrupt else (
                    "raise" if result.error is not None and landed == 0 else "short")
                self.sstep("io_prefetch_fetch", ops.io_prefetch_fetch, live.request, landed,
                           fault=fault)
                injected[f"fetch reported:{fault or 'none'}"] += 1
            for backup in backed_up:
                write = self.tier.state.writes[backup.op_id]  # type: ignore[index]
                remaining = len(write.pages)
                fault = None if backup.pages_done == remaining else (
                    "raise" if backup.error is not None and backup.pages_done == 0
                    else "short")
                self.sstep("io_storage_write", ops.io_storage_write, backup.pages_done,
                           fault=fault)
                injected[f"write reported:{fault or 'none'}"] += 1
            self.tier.accept(prefetched, backed_up)

        @rule(request=st.sampled_from(REQUESTS), dt=st.integers(0, 4))
        def progress(self, request: str, dt: int) -> None:
            now = self.clock.advance(dt)
            live = self.tier.state.prefetches.get(request)
            settings = self.tier.settings
            if (live is not None and live.io_running and settings is not None
                    and settings.prefetch_policy == "timeout"
                    and settings.timed_out(now - live.start,
                                           self.cache.page_size * (live.hit_pages or 0))):
                self.counts.ops["progress: timed out while the I/O ran"] += 1
            got = self.tier.check_prefetch_progress(request)
            want = self.sstep("check_prefetch_progress", ops.check_prefetch_progress,
                              request, now)
            assert got == want, (got, want)

        @precondition(lambda self: self.tier.settings is not None
                      and self.tier.settings.prefetch_policy == "timeout"
                      and any(p.io_running for p in self.tier.state.prefetches.values()))
        @rule(pick=st.integers(0, 2), early=st.booleans())
        def expire(self, pick: int, early: bool) -> None:
            """Time runs to a running prefetch's timeout (9.1: the first tick past it, or
            the last one before it, ``early``) and its request is polled: past it, the
            prefetch ends while its I/O still runs. Random clock steps reached that in
            some runs only (a planted bug ignoring such timeouts went unseen)."""
            running = sorted(r for r, p in self.tier.state.prefetches.items() if p.io_running)
            request = running[pick % len(running)]
            live = self.tier.state.prefetches[request]
            settings = self.tier.settings
            assert settings is not None
            tokens = self.cache.page_size * (live.hit_pages or 0)
            limit = min(1024 * settings.timeout_max,
                        1024 * settings.timeout_base + settings.timeout_per_ki_token * tokens)
            due = limit // 1024 + 1  # timed_out: 1024 * elapsed > limit
            self.progress(request, max(0, due - (self.clock.now() - live.start) - early))

        @rule(request=st.sampled_from(REQUESTS))
        def terminate(self, request: str) -> None:
            self.tier.terminate_prefetch(request)
            self.sstep("terminate_prefetch", ops.terminate_prefetch, request)

        @rule(request=st.sampled_from(REQUESTS))
        def abort(self, request: str) -> None:
            self.tier.release_aborted_request(request)
            self.sstep("release_aborted_request", ops.release_aborted_request, request)

        @rule(request=st.sampled_from(REQUESTS))
        def pop_loaded(self, request: str) -> None:
            got = self.tier.pop_prefetch_loaded_tokens(request)
            want = self.sstep("pop_prefetch_loaded_tokens", ops.pop_prefetch_loaded_tokens,
                              request)
            assert got == want, (got, want)

        @rule()
        def drain(self) -> None:
            if self.tier.state.io_held:
                self.run_io()  # a drain never frees slots the I/O may still write
            got = self.tier.drain_storage_queues()
            want = self.sstep("drain_storage_queues", ops.drain_storage_queues)
            assert got == want, (got, want)

        # -- after every step -----------------------------------------------------------

        def check_impl(self) -> None:
            """``check_invariants``, with INV-HOST-POOL-CONSERVATION amended (9.2): the
            host slots neither free nor in the tree are exactly the tier's (reserved by
            a prefetch, or queued for release)."""
            found = failures(self.cache)
            leaked = found.pop("INV-HOST-POOL-CONSERVATION", [])
            pool = self.cache.host_pool
            tree = {s for n in self.cache.nodes() if n.host is not None
                    for s in n.host.tolist()}
            outside = set(range(pool.num_slots)) - pool.free_slots() - tree
            tier_owned = self.tier.host_slots_owned()
            assert sorted(tier_owned) == sorted(outside), (tier_owned, outside)
            others = [p for p in leaked if "leaked" not in p]
            assert not others, others
            assert not found, found

        @invariant()
        def refines_the_model(self) -> None:
            if self.threaded and self.tier.io is not None:
                self.settle_io()
            found = violations(self.model)
            assert not found, f"the model broke its own invariants: {found}"
            self.check_impl()
            self.tier.check()
            seen = abstract(self.cache, self.model)
            storage = abstract_storage(self.tier, self.model,
                                       self.backend if self.settings else None,
                                       self.identity, self.settings, self.names)
            seen = dataclasses.replace(seen, storage=storage)
            if seen != self.model:
                raise AssertionError("implementation and model disagree:\n"
                                     + describe_difference(seen, self.model)
                                     + "\n" + describe_difference_storage(seen, self.model))
            if self.watch.check(self.model):  # INV-EVENTS-REPLAY (spec/11)
                self.counts.exercised["INV-EVENTS-REPLAY"] += 1
            self.counts.checks += 1
            for spec_id, busy in machine.EXERCISED.items():
                if busy(self.model):
                    self.counts.exercised[spec_id] += 1
            tally_states(self.counts.states, self.model)
            if self.io_reported:
                self.counts.states[THREADED_IO_STEP] += 1
                self.io_reported = False
            self.climb_all()

        def climb_all(self) -> None:
            super().climb_all()
            storage = self.model.storage
            if storage is not None:
                self.climb("prefetches in flight", sum(
                    p.phase in ("querying", "fetching") for p in storage.prefetches))
                self.climb("storage writes in flight", sum(
                    w.phase == "running" for w in storage.writes))

    gate(StorageConformance, STORAGE_SWARM_RULES, Base.tally.rules)
    # Not swarmed: appending it to the swarm's rules would change every seed's draws.
    gate(StorageConformance, ("expire", "backup"), Base.tally.rules, swarmed=False)
    StorageConformance.__name__ = f"StorageConformance_{scenario.slug()}"
    return StorageConformance


def describe_difference_storage(impl, model) -> str:  # type: ignore[no-untyped-def]
    a, b = impl.storage, model.storage
    if a is None or b is None:
        return f"storage: impl {a!r} != model {b!r}"
    lines = []
    for f in dataclasses.fields(a):
        x, y = getattr(a, f.name), getattr(b, f.name)
        if x != y:
            lines.append(f"storage.{f.name}: impl {x!r} != model {y!r}")
    return "\n".join(lines)


__all__ = ["FAULTS", "make_storage_machine"]
