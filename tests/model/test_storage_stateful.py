"""The model with a storage tier under random operation sequences (spec/09).

Requests wait for their prefetch as SGLang's scheduler makes them wait: prefetch from
storage, poll ``check_prefetch_progress``, then compute on what the tree holds. Between
them the storage I/O answers hit queries, fetches and writes pages, and injects every
fault kind spec/09 admits; the scheduler drains the control queues, terminates or aborts
requests, and attaches, detaches and clears backends. Every step checks every invariant.
Illegal reports are perturbed from legal ones and must be rejected with the state
untouched. ``STORAGE_RUNS`` tallies rules and faults; conftest prints it.
"""

from __future__ import annotations

import random
from dataclasses import replace

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from hiradix_model import (
    PREFETCH_POLICIES,
    STRATEGIES,
    WRITE_POLICIES,
    Config,
    IllegalChoice,
    Key,
    MatchResult,
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
from hiradix_model.ops.storage.io import FETCH_FAULTS
from hiradix_model.ops.storage.prefetch import pages_below, worth_prefetching
from hiradix_model.storage import Prefetch, stored_run

from stats import STORAGE_RUNS, Stepping

keys = st.builds(
    Key,
    st.lists(st.integers(1, 2), min_size=1, max_size=6).map(tuple),
    st.sampled_from([None, None, "b"]),
)
seeds = st.integers(0, 2**16)
BACKENDS = ("memory", "file")
IDENTITIES = (("model-a", "bf16", "layer_first"), ("model-b", "bf16", "layer_first"))


class StorageMachine(Stepping, RuleBasedStateMachine):
    tally = STORAGE_RUNS
    state: State

    def __init__(self) -> None:
        super().__init__()
        self.now = 0
        self.waiting: dict[str, Key] = {}  # requests that asked for a prefetch
        self.issued = 0  # request ids
        self.seen: list[Key] = []
        STORAGE_RUNS["examples"] += 1

    @initialize(
        page_size=st.sampled_from([1, 2]),
        policy=st.sampled_from(WRITE_POLICIES),
        strategy=st.sampled_from(STRATEGIES),
        device_pages=st.integers(3, 8),
        host_pages=st.integers(2, 12),
        threshold_pages=st.integers(0, 2),
        prefetch_policy=st.sampled_from(PREFETCH_POLICIES),
        # None is SGLang's 80% of (host - device) slots, often 0 here: always limited.
        limit=st.sampled_from([64, None, 6, 64]),
        backend=st.sampled_from(BACKENDS),
    )
    def start(self, page_size: int, policy: str, strategy: str, device_pages: int,
              host_pages: int, threshold_pages: int, prefetch_policy: str, limit: int | None,
              backend: str) -> None:
        config = Config(
            page_size=page_size, device_slots=device_pages * page_size,
            host_slots=host_pages * page_size, write_policy=policy,  # type: ignore[arg-type]
            eviction=strategy, load_back_threshold=0,  # type: ignore[arg-type]
        )
        self.settings = StorageSettings(
            prefetch_threshold=threshold_pages * page_size,
            prefetch_policy=prefetch_policy,  # type: ignore[arg-type]
            timeout_base=3, timeout_per_ki_token=512, timeout_max=8,
            prefetch_token_limit=limit)
        self.state = initial(config)
        self.apply("attach_storage", ops.attach_storage, backend, identity=IDENTITIES[0],
                   settings=self.settings)

    # -- helpers ---------------------------------------------------------------------

    def fault(self, kind: str) -> None:
        STORAGE_RUNS[f"fault {kind}"] += 1

    def tick(self, dt: int) -> int:
        self.now += dt
        return self.now

    def prefetches(self, phase: str) -> list[Prefetch]:
        storage = self.state.storage
        return [] if storage is None else [p for p in storage.prefetches if p.phase == phase]

    # -- requests ---------------------------------------------------------------------

    @rule(key=keys, dt=st.integers(0, 2), seed=seeds, gate=st.booleans())
    def request(self, key: Key, dt: int, seed: int, gate: bool) -> None:
        self.start_request(key, dt, seed, gate)

    def start_request(self, key: Key, dt: int, seed: int, gate: bool) -> str | None:
        """A new request: match, ask storage how much it holds, prefetch what is missing.

        With ``gate`` the scheduler skips the prefetch when the query found no hit.
        Returns the request's id if it waits for a prefetch.
        """
        rng = random.Random(seed)
        self.seen.append(key)
        self.issued += 1
        request = f"r{self.issued}"
        match = self.apply("match_prefix", ops.match_prefix, key, self.tick(dt))
        assert isinstance(match, MatchResult)
        deepest = match.last_host_page if match.host_hit_tokens else match.last_device_page
        if deepest is not None and self.state.pages[deepest].host is None:
            self.compute(key, rng)  # SGLang prefetches only from a backed-up match
            return None
        pages = pages_below(self.state, key, deepest)
        hits = 0
        if worth_prefetching(self.state, pages):
            assert self.state.storage is not None
            hits = rng.randint(0, stored_run(self.state.storage, pages))
        tokens = self.apply("query_storage_hit_length", ops.query_storage_hit_length, key,
                            deepest, hits)
        assert tokens == self.state.config.page_size * hits
        if gate and not tokens:
            self.compute(key, rng)
            return None
        victims, slots = storage_choosers.choose_prefetch(self.state, key, deepest, rng)
        reserved = self.apply("prefetch_from_storage", ops.prefetch_from_storage, request,
                              key, deepest, self.tick(dt), host_victims=victims,
                              host_slots=slots)
        STORAGE_RUNS["prefetches started"] += bool(reserved)
        if reserved:
            self.waiting[request] = key
            return request
        self.compute(key, rng)
        return None

    @precondition(lambda self: bool(self.seen))
    @rule(index=st.integers(0, 63), seed=seeds, then=st.sampled_from(
        ["drive", "wait", "terminate", "abort", "raise", "short", "corrupt", "slow", "dead"]))
    def returning(self, index: int, seed: int, then: str) -> None:
        """A request served before comes back after its pages reached storage and left the
        cache: what makes storage hits, and so fetches, frequent. ``then`` is what happens
        to its prefetch: it runs to the end, waits for the other rules, is terminated or
        aborted part way, or its fetch meets a fault."""
        rng = random.Random(seed)
        key = self.seen[index % len(self.seen)]
        self.compute(key, rng)  # it was served: its pages are cached, and due for backup
        pages = page_keys(key, self.state.config.page_size)
        if pages and pages[-1] in self.state.pages and self.state.pages[pages[-1]].host is None:
            report = choosers.choose_write_backup(self.state, pages[-1], rng)
            self.apply("write_backup", ops.write_backup, pages[-1], report)
        queued = sum(t.direction == "d2h" for t in self.state.pending)
        self.apply("writing_check", ops.writing_check, queued)
        while (left := storage_choosers.running_write(self.state)) is not None:
            self.apply("io_storage_write", ops.io_storage_write, left)
        self.apply("drain_storage_queues", ops.drain_storage_queues)
        total = self.state.config.device_slots
        self.apply("evict", ops.evict, total, choosers.choose_evict(self.state, total, rng))
        total = self.state.config.host_slots
        self.apply("evict_host", ops.evict_host, total,
                   choosers.choose_evict_host(self.state, total, rng))
        request = self.start_request(key, 1, seed, gate=False)
        STORAGE_RUNS["returning requests that prefetched"] += request is not None
        if request is not None and then != "wait":
            self.follow(request, then, rng)

    def follow(self, request: str, then: str, rng: random.Random) -> None:
        """Drive ``request``'s prefetch: answer its query, fetch, and end it by ``then``;
        a terminate or an abort comes before the query, after it, or after the fetch."""
        point = rng.randrange(3)
        if self.end_early(request, then, point == 0):
            return
        assert self.state.storage is not None
        prefetch = self.state.storage.prefetch_of(request)
        if prefetch is not None and prefetch.phase == "querying":
            hits = storage_choosers.hits_available(self.state, request)
            self.apply("io_prefetch_query", ops.io_prefetch_query, request, hits)
        if self.end_early(request, then, point == 1):
            return
        prefetch = self.state.storage.prefetch_of(request)
        if prefetch is not None and prefetch.phase == "fetching":
            remaining, available = storage_choosers.pages_to_fetch(self.state, request)
            assert remaining == available  # nothing cleared storage since the query
            if then in FETCH_FAULTS:
                count = 0 if then in ("raise", "slow") else rng.randint(0, remaining - 1)
                self.fault(f"fetch {then}")
                self.apply("io_prefetch_fetch", ops.io_prefetch_fetch, request, count,
                           fault=then)
            else:
                count = remaining if then == "drive" else rng.randint(1, remaining)
                self.apply("io_prefetch_fetch", ops.io_prefetch_fetch, request, count)
        if not self.end_early(request, then, True):
            self.poll_one(request, rng.randint(0, 9), rng.randrange(2**16))

    def end_early(self, request: str, then: str, now: bool) -> bool:
        """Terminate (the request stays, to be polled) or abort (it is gone: True)."""
        if now and then == "terminate":
            self.apply("terminate_prefetch", ops.terminate_prefetch, request)
        if now and then == "abort":
            self.apply("release_aborted_request", ops.release_aborted_request, request)
            del self.waiting[request]
            return True
        return False

    def compute(self, key: Key, rng: random.Random) -> None:
        """The rest of a request's life (spec/03, 3.17): load back, compute, insert."""
        match = self.serve(key, rng, (1, 0, 1))
        self.apply("dec_lock_ref", ops.dec_lock_ref, match.last_device_page)

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data(), dt=st.integers(0, 4), seed=seeds)
    def poll(self, data: st.DataObject, dt: int, seed: int) -> None:
        """check_prefetch_progress; once it says done, the request is computed."""
        self.poll_one(data.draw(st.sampled_from(sorted(self.waiting))), dt, seed)

    def poll_one(self, request: str, dt: int, seed: int) -> None:
        done = self.apply("check_prefetch_progress", ops.check_prefetch_progress, request,
                          self.tick(dt))
        if done:
            loaded = self.apply("pop_prefetch_loaded_tokens", ops.pop_prefetch_loaded_tokens,
                                request)
            assert isinstance(loaded, int) and loaded % self.state.config.page_size == 0
            STORAGE_RUNS["tokens loaded from storage"] += loaded
            self.compute(self.waiting.pop(request), random.Random(seed))
        else:
            STORAGE_RUNS["polls that waited"] += 1

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def terminate(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.waiting)))
        self.apply("terminate_prefetch", ops.terminate_prefetch, request)

    @precondition(lambda self: bool(self.waiting))
    @rule(data=st.data())
    def abort(self, data: st.DataObject) -> None:
        request = data.draw(st.sampled_from(sorted(self.waiting)))
        self.apply("release_aborted_request", ops.release_aborted_request, request)
        del self.waiting[request]

    # -- the storage I/O, with faults -------------------------------------------------------

    @precondition(lambda self: bool(self.prefetches("querying")))
    @rule(data=st.data(), short=st.sampled_from([None, "raise", "short"]))
    def io_query(self, data: st.DataObject, short: str | None) -> None:
        prefetch = data.draw(st.sampled_from(self.prefetches("querying")))
        most = storage_choosers.hits_available(self.state, prefetch.request)
        hits = most
        if short == "raise" and most:
            hits = 0
        elif short == "short" and most:
            hits = data.draw(st.integers(0, most - 1))
        if hits < most:
            self.fault(f"query {short}")
        revoked = self.apply("io_prefetch_query", ops.io_prefetch_query, prefetch.request, hits)
        STORAGE_RUNS["revoked"] += bool(revoked)
        self.rejects(PreconditionError, ops.io_prefetch_query, prefetch.request, hits)

    @precondition(lambda self: bool(self.prefetches("fetching")))
    @rule(data=st.data(), fault=st.sampled_from([None, None, None, "raise", "short", "corrupt",
                                                 "slow", "dead"]))
    def io_fetch(self, data: st.DataObject, fault: str | None) -> None:
        prefetch = data.draw(st.sampled_from(self.prefetches("fetching")))
        remaining, available = storage_choosers.pages_to_fetch(self.state, prefetch.request)
        if fault is None and available == 0:
            fault = "short"  # the backend lost them (cleared): it returns nothing
        if fault is None:
            count = data.draw(st.integers(1, available))
            if count < remaining and available < remaining and data.draw(st.booleans()):
                fault = "short"
        elif fault in ("raise", "slow"):
            count = 0
        elif fault == "corrupt" and available == 0:
            fault, count = "short", 0  # nothing stored to be damaged: a miss
        else:
            # A corrupt page is one the backend holds, so it is within what is stored.
            most = available - 1 if fault == "corrupt" else available
            count = data.draw(st.integers(0, min(most, remaining - 1)))
        if fault is not None:
            self.fault(f"fetch {fault}")
        if available < remaining:  # a page past what storage holds can never arrive
            self.rejects(IllegalChoice, ops.io_prefetch_fetch, prefetch.request,
                         available + 1, fault=None if available + 1 == remaining else "short")
        self.apply("io_prefetch_fetch", ops.io_prefetch_fetch, prefetch.request, count,
                   fault=fault)

    @precondition(lambda self: storage_choosers.running_write(self.state) is not None)
    @rule(data=st.data(), fault=st.sampled_from([None, None, None, "raise", "short", "slow",
                                                 "dead"]))
    def io_write(self, data: st.DataObject, fault: str | None) -> None:
        remaining = storage_choosers.running_write(self.state)
        assert remaining is not None
        if fault is None:
            count = data.draw(st.integers(1, remaining))
        elif fault in ("raise", "slow"):
            count = 0
        else:
            count = data.draw(st.integers(0, remaining - 1))
        if fault is not None:
            self.fault(f"write {fault}")
        self.rejects(IllegalChoice, ops.io_storage_write, remaining + 1, fault=fault)
        self.apply("io_storage_write", ops.io_storage_write, count, fault=fault)

    @rule(data=st.data())
    def drain(self, data: st.DataObject) -> None:
        storage = self.state.storage
        if storage is None or data.draw(st.booleans()):
            self.apply("drain_storage_queues", ops.drain_storage_queues)
            return
        acked = sum(w.phase == "acked" for w in storage.writes)
        self.apply("drain_storage_queues", ops.drain_storage_queues,
                   revokes=data.draw(st.integers(0, len(storage.revoke_queue))),
                   acks=data.draw(st.integers(0, acked)),
                   releases=data.draw(st.integers(0, len(storage.release_queue))))

    # -- attach, detach, clear ---------------------------------------------------------------

    @rule(backend=st.sampled_from(BACKENDS), policy=st.sampled_from(PREFETCH_POLICIES),
          identity=st.sampled_from(IDENTITIES), retained=st.booleans())
    def attach(self, backend: str, policy: str, identity: tuple[str, ...],
               retained: bool) -> None:
        settings = replace(self.settings, prefetch_policy=policy)  # type: ignore[arg-type]
        current = None if self.state.storage is None else self.state.storage.backend
        if current is not None and current != backend:
            self.rejects(PreconditionError, ops.attach_storage, backend, settings=settings)
            return
        if current is not None and self.state.storage.identity != identity:
            self.rejects(PreconditionError, ops.attach_storage, backend, identity=identity,
                         settings=settings)
            return
        outcome = self.apply("attach_storage", ops.attach_storage, backend, identity=identity,
                             settings=settings, retained=retained)
        assert outcome == ("attached" if current is None else "policies updated")
        assert self.state.storage is not None
        assert self.state.storage.settings.prefetch_policy == policy

    @rule(seed=seeds)
    def detach(self, seed: int) -> None:
        if random.Random(seed).random() < 0.1:
            self.apply("detach_storage", ops.detach_storage)
            # The requests waiting on a prefetch are served from what the tree holds.
            for request in sorted(self.waiting):
                done = self.apply("check_prefetch_progress", ops.check_prefetch_progress,
                                  request, self.tick(0))
                assert done
            self.waiting.clear()

    @rule(seed=seeds)
    def clear(self, seed: int) -> None:
        if random.Random(seed).random() < 0.1:
            attached = self.state.storage is not None and self.state.storage.backend is not None
            assert self.apply("clear_storage", ops.clear_storage) == attached

    # -- the base operations the storage tier interacts with -------------------------------

    @rule(data=st.data())
    def writing_check(self, data: st.DataObject) -> None:
        queued = sum(t.direction == "d2h" for t in self.state.pending)
        self.apply("writing_check", ops.writing_check, data.draw(st.integers(0, queued)))

    @rule(data=st.data())
    def loading_check(self, data: st.DataObject) -> None:
        queued = sum(t.direction == "h2d" for t in self.state.pending)
        self.apply("loading_check", ops.loading_check, data.draw(st.integers(0, queued)))

    @rule(num_tokens=st.integers(0, 8), seed=seeds)
    def evict(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict(self.state, num_tokens, random.Random(seed))
        self.apply("evict", ops.evict, num_tokens, victims)

    @rule(num_tokens=st.integers(0, 8), seed=seeds)
    def evict_host(self, num_tokens: int, seed: int) -> None:
        victims = choosers.choose_evict_host(self.state, num_tokens, random.Random(seed))
        self.apply("evict_host", ops.evict_host, num_tokens, victims)

    @rule(data=st.data(), seed=seeds)
    def write_backup(self, data: st.DataObject, seed: int) -> None:
        candidates = sorted((k for k, p in self.state.pages.items()
                             if p.device is not None and p.host is None), key=repr)
        if candidates:
            page = data.draw(st.sampled_from(candidates))
            report = choosers.choose_write_backup(self.state, page, random.Random(seed))
            self.apply("write_backup", ops.write_backup, page, report)

    @rule(seed=seeds)
    def reset(self, seed: int) -> None:
        if random.Random(seed).random() < 0.05:
            self.apply("reset", ops.reset)
            self.waiting.clear()

    # -- illegal reports -------------------------------------------------------------------

    @rule(key=keys, seed=seeds)
    def illegal_prefetch_report(self, key: Key, seed: int) -> None:
        victims, slots = storage_choosers.choose_prefetch(self.state, key, None,
                                                          random.Random(seed))
        request = "illegal"
        if slots is None:
            taken = tuple(sorted(self.state.host_free))[: self.state.config.page_size]
            if taken:
                self.rejects(IllegalChoice, ops.prefetch_from_storage, request, key, None,
                             self.now, host_victims=victims, host_slots=(*taken, -1))
            return
        # A slot of a page that stays cached is not free: reserving it is illegal.
        owned = [s for k, p in self.state.pages.items() if k not in victims
                 for s in p.host or ()]
        if owned:
            self.rejects(IllegalChoice, ops.prefetch_from_storage, request, key, None,
                         self.now, host_victims=victims, host_slots=(owned[0], *slots[1:]))
        self.rejects(IllegalChoice, ops.prefetch_from_storage, request, key, None, self.now,
                     host_victims=victims, host_slots=slots[:-1])

    @precondition(lambda self: bool(self.prefetches("querying")))
    @rule(data=st.data())
    def illegal_hits(self, data: st.DataObject) -> None:
        prefetch = data.draw(st.sampled_from(self.prefetches("querying")))
        most = storage_choosers.hits_available(self.state, prefetch.request)
        self.rejects(IllegalChoice, ops.io_prefetch_query, prefetch.request, most + 1)

    @invariant()
    def invariants_hold(self) -> None:
        if hasattr(self, "state"):
            assert check(self.state) == (), violations(self.state)


TestStorageModel = StorageMachine.TestCase
