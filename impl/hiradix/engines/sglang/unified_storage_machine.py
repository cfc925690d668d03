"""The differential suite with the storage tier of SGLang's ``UnifiedRadixCache`` (0.5.20 and
0.5.23, Python tree core) + ``HiCacheFile`` (spec/09 9.10).

The storage steps are those of the HiRadixCache storage machine
(``sglang_storage_machine``, spec/09 9.8-9.9). Its rules and checks that reach SGLang only
through the adapter's storage calls are taken from that machine's class as they are
(``_SHARED``: the comparison after every step, attach / detach / clear / query / abort /
pop / backup / reset, the host-room and protection mappings); the rules that read
SGLang's prefetch bookkeeping, which UnifiedRadixCache keeps apart, are this module's:

- ``prefetch``: issue, hit query, hit drain. The hit drain allocates what the host holds
  after its eviction (DEV-S21): the model is asked for a prefetch of the pages allocated.
- ``drain``: the transfers, then ``drain_storage_control_queues``; the acknowledgements
  are matched to ``_OngoingPrefetch`` entries by handle and operation.
- ``progress``: under ``timeout`` the deadline runs from the first poll that waits
  (DEV-S22): the model's prefetch start is moved to that poll; a per-token term is not
  driven (SGLang counts requested pages, uncapped).
- ``writing_check`` and ``serve``: as the HiRadixCache machine's (DEV-S20, DEV-7).
- ``cycle``: a request's round trip, as in that machine.
"""

from __future__ import annotations

import dataclasses
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, precondition, rule

from hiradix.conformance import infer
from hiradix.conformance.differential import make_differential, namespaces, tokens
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines.sglang import storage_machine as sglang_storage_machine
from hiradix.engines.sglang.storage_machine import REQUESTS, settings_strategy
from hiradix.engines.sglang.unified_storage import (
    NO_LIMIT,
    SglangUnifiedStorageAdapter,
    factory,
)
from hiradix_model import Key, State, StorageSettings, ops
from hiradix_model.keys import parent_page

# The HiRadixCache storage machine's members that see SGLang through the adapter only.
_SHARED = ("sstep", "storage", "attached", "anchor_and_tokens", "protect", "prefetch_key",
           "host_room", "attach", "clear", "query",
           "pop_loaded", "backup", "drainable", "hung_below_device_only", "reset", "mapped",
           "storage_differences", "engine_refines_the_model")


def unified_settings(page_size: int) -> st.SearchStrategy[StorageSettings]:
    """The HiRadixCache machine's settings; under ``timeout`` without the per-token term
    (DEV-S22: SGLang's counts requested pages, uncapped)."""
    return settings_strategy(page_size).map(
        lambda s: dataclasses.replace(s, timeout_per_ki_token=0)
        if s.prefetch_policy == "timeout" else s)


def make_machine(engine: str, scenario: Scenario,
                 tally: Tally | None = None) -> type[RuleBasedStateMachine]:
    """The storage differential machine of ``engine`` for one scenario."""
    counts = tally if tally is not None else Tally()
    Base = make_differential(factory(engine, scenario), counts)
    # Only the class: no HiRadixCache is built until an instance is (none is). Its
    # members count into the same tally.
    hiradix = sglang_storage_machine.make_machine("sglang-storage", scenario, counts)
    shared = {name: hiradix.__dict__[name] for name in _SHARED}
    release_aborted = hiradix.__dict__["abort"]

    class SglangUnifiedStorage(Base):  # type: ignore[misc, valid-type]
        engine: SglangUnifiedStorageAdapter

        def __init__(self) -> None:
            super().__init__()  # the differential machine's (self.counts is the tally)
            # Attached from the start (DEV-S16), best effort, no rate limit (DEV-S14).
            first = StorageSettings(prefetch_threshold=scenario.page_size,
                                    prefetch_token_limit=NO_LIMIT)
            self.attach(first, 0)

        @rule(settings=unified_settings(scenario.page_size), go=st.integers(0, 3))
        def attach_rule(self, settings: StorageSettings, go: int) -> None:
            if go:
                return  # no DEV-S16 here: attach backfills the hashes of cached nodes
            self.attach(settings, 0)

        @precondition(lambda self: self.attached())
        @rule(go=st.integers(0, 7), drain_first=st.booleans())
        def detach(self, go: int, drain_first: bool) -> None:
            """As the HiRadixCache machine's (drained first where an ended prefetch's
            transfer is queued, DEV-S18), after the live prefetches are aborted
            (DEV-S26); and the tokens loaded for requests popped before the detach:
            UnifiedRadixCache's detach forgets them (DEV-S25; its scheduler detaches only
            when no request is queued, so none is left to pop them)."""
            if go:
                return
            for request in sorted(self.engine.prefetches()):
                # DEV-S26: detach frees only the pages a live prefetch has landed; its
                # scheduler refuses a detach while one is live. Aborted first.
                counts.ops["prefetch aborted before a detach (DEV-S26)"] += 1
                self.abort(request)
                self.engine_refines_the_model()
            ended = self.engine.ended_transfers_queued()
            counts.ops["detach drained first: an ended prefetch's transfer queued "
                       "(DEV-S18)"] += int(ended and not drain_first)
            if (drain_first or ended) and self.drainable():
                self.drain()
                self.engine_refines_the_model()
            for request in sorted(self.engine.loaded_tokens()):
                counts.ops["loaded tokens popped before a detach (DEV-S25)"] += 1
                self.pop_loaded(request)
                self.engine_refines_the_model()
            self.engine.detach()
            self.sstep("detach_storage", ops.detach_storage)

        @precondition(lambda self: bool(self.engine.cache.ongoing_prefetch)
                      or bool(self.engine.loaded_tokens()))
        @rule(request=st.sampled_from(REQUESTS))
        def abort(self, request: str) -> None:
            """``release_aborted_request``; on 0.5.20 the request's loaded tokens are
            popped first: its abort drops them under the wrong key and keeps them
            (DEV-S27)."""
            if self.engine.v20 and request in self.engine.loaded_tokens():
                counts.ops["loaded tokens popped before an abort (DEV-S27)"] += 1
                self.pop_loaded(request)
                self.engine_refines_the_model()
            release_aborted(self, request)

        def serve(self, key: Key, dt: int, chunked: bool, priority: int, keep_lock: bool,
                  counted_from: Key | None = None) -> None:
            """As the HiRadixCache machine's: not served where the backup run may fit
            the host in part (DEV-7)."""
            if self.backup_may_fit_in_part(key):
                counts.ops["request not served: host room short of its backup run "
                           "(DEV-7)"] += 1
                return
            super().serve(key, dt, chunked, priority, keep_lock, counted_from)

        def backup_may_fit_in_part(self, key: Key) -> bool:
            """Whether ``key`` fits the device (so it is inserted and backed up) while
            the host room, eviction included, is short of its pages lacking a copy."""
            config, pages = self.model.config, self.model.pages
            run = [Key(key.tokens[:n], key.namespace)
                   for n in range(config.page_size, len(key.tokens) + 1, config.page_size)]

            def lacking(tier: str) -> int:
                return config.page_size * sum(
                    page not in pages or getattr(pages[page], tier) is None for page in run)
            return (lacking("device") <= config.device_slots
                    and self.host_room(run) < lacking("host"))

        @precondition(lambda self: any(t.direction == "d2h" for t in self.model.pending))
        @rule()
        def writing_check(self) -> None:
            """The acknowledgements; backups SGLang issued for pages all stored run and
            are acknowledged at once (DEV-S20)."""
            super().writing_check()
            unmatched = len(self.engine.cache.ongoing_backup) - len(self.storage().writes) \
                if self.attached() else 0
            if unmatched > 0:
                counts.ops["backups of stored pages run and acknowledged at once "
                           "(DEV-S20)"] += 1
                for step in (self.engine_refines_the_model, self.backup,
                             self.engine_refines_the_model, self.engine.drain_backup_acks):
                    step()
                self.sstep("drain_storage_queues", ops.drain_storage_queues, revokes=0,
                           releases=0)

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63), dt=st.integers(0, 2))
        def prefetch(self, request: str, index: int, dt: int) -> None:
            engine = self.engine
            # No DEV-S19 here (acks are matched by operation): a request
            # whose ended transfer is queued may prefetch again.
            why = ("one is tracked for the request (DEV-S3)" if engine.has_prefetch(request)
                   else "the request's deadline expired (DEV-S22)"
                   if engine.deadline_expired(request) else None)
            if why is not None:
                counts.ops["prefetch not issued: " + why] += 1
                return
            self.tick(dt)
            key = self.seen[index % len(self.seen)]
            anchor, node, matched = self.anchor_and_tokens(key)
            before = self.observe()
            hits, allocated = engine.prefetch(key, node, matched, request)
            ps = self.model.config.page_size
            self.made_host_room(before, anchor, hits * ps)
            if 0 < allocated < hits * ps:
                counts.ops["hit drain allocated part of the hits (DEV-S21)"] += 1
            pages = allocated // ps if allocated else hits
            pkey = self.prefetch_key(key, anchor, matched, pages)
            engine.learn(pkey)
            view = engine.prefetches().get(request)
            got = self.sstep("prefetch_from_storage", ops.prefetch_from_storage, request,
                             pkey, anchor, self.now,
                             host_slots=view.reserved if allocated and view else None)
            assert got == allocated, f"prefetch_from_storage: SGLang {allocated}, model {got}"
            if got:
                assert not self.sstep("io_prefetch_query", ops.io_prefetch_query, request,
                                      pages)

        def hung_on_the_walk(self) -> list[str]:
            """DEV-S5's prefetches; on 0.5.23 under the write-through policies also those
            whose last page is cached without a host copy: 0.5.23 makes the fetched
            slots that page's host copy, the spec frees them (DEV-S28)."""
            if self.engine.v20 or self.model.config.write_policy == "write_back":
                return shared["hung_below_device_only"](self)  # type: ignore[no-any-return]
            pages = self.model.pages
            return [request for request, view in self.engine.prefetches().items()
                    if any(k in pages and pages[k].host is None for k in view.pages)]

        @precondition(lambda self: self.attached() and self.drainable())
        @rule()
        def drain(self) -> None:
            """What a scheduler pass does: the transfers run (after the DEV-S5 aborts),
            every control queue is drained, the prefetches whose transfer finished end."""
            hung = self.hung_on_the_walk()
            counts.ops["prefetch aborted before the drain: its pages run below a "
                       "device-only page, or (0.5.23) end on one (DEV-S5, DEV-S28)"] += len(hung)
            for request in hung:
                self.abort(request)
                self.engine_refines_the_model()
            self.engine.pump_fetch()
            acks = self.engine.current_acks()
            self.land([ack for ack in acks if ack.completed_tokens is not None])
            self.engine.drain()
            if self.engine.releases_queued():
                # DEV-S24: the drain counts each queue before it starts; the slots an
                # acknowledgement releases wait for the next drain, which runs now.
                counts.ops["releases queued by the drain freed by the next (DEV-S24)"] += 1
                self.engine.drain_releases()
            for request in [ack.rid for ack in acks if ack.completed_req]:
                if not ops.check_prefetch_progress(self.model, request, self.now)[1]:
                    counts.ops["ended by the drain where the policy waits (DEV-S15)"] += 1
                    self.sstep("terminate_prefetch", ops.terminate_prefetch, request)
                assert self.end_prefetch(request)
            self.sstep("drain_storage_queues", ops.drain_storage_queues)

        def land(self, acks: list[Any]) -> None:
            """The model's ``io_prefetch_fetch`` for each progress acknowledgement: the
            pages landed since the last, short where fewer than the hits."""
            ps = self.model.config.page_size
            for ack in acks:
                fetch = self.storage().prefetch_of(ack.rid)
                assert fetch is not None and fetch.phase == "fetching", (ack.rid, fetch)
                total = ack.completed_tokens // ps
                self.sstep("io_prefetch_fetch", ops.io_prefetch_fetch, ack.rid,
                           total - fetch.landed,
                           fault="short" if total != fetch.hit_pages else None)

        @precondition(lambda self: self.attached() and bool(self.engine.cache.ongoing_prefetch))
        @rule(request=st.sampled_from(REQUESTS), dt=st.integers(0, 4))
        def progress(self, request: str, dt: int) -> None:
            self.tick(dt)
            waited = self.engine.waiting_since(request)
            got = self.engine.check_prefetch_progress(request)
            since = self.engine.waiting_since(request)
            if waited is None and since is not None:
                # DEV-S22: the deadline starts at this poll; the model's start moves here.
                counts.ops["timeout started at the first waiting poll (DEV-S22)"] += 1
                self.restart(request, since)
            want = self.end_prefetch(request)
            assert got == want, f"check_prefetch_progress: SGLang {got}, model {want}"

        def made_host_room(self, before: State, anchor: Key | None, tokens: int) -> None:
            """DEV-S7: the hit drain evicted host pages for all the hits (``tokens``),
            with the anchor protected since issue (DEV-S14): the model evicts the same
            pages, the anchor's protection counted for that step only."""
            after = self.observe(adopt=False)
            if not infer.left_host(before, after):
                return
            victims = infer.host_victims(self.model, before, after, tokens)
            self.protect(anchor, +1)
            self.step("evict_host", ops.evict_host, tokens, victims)
            self.protect(anchor, -1)

        def end_prefetch(self, request: str) -> bool:
            """The model's ``check_prefetch_progress``. A run of new pages hung under the
            root takes the root's priority, as SGLang's do (DEV-S17, UnifiedRadixCache
            form); a run hung under a cached page inherits that page's priority, in both
            (the walk can reach a page cached since the prefetch was issued)."""
            p = self.storage().prefetch_of(request)
            cached = set(self.model.pages)
            ended = bool(self.sstep("check_prefetch_progress", ops.check_prefetch_progress,
                                   request, self.now))
            if not ended or p is None:
                return ended
            new = [k for k in p.pages if k in self.model.pages and k not in cached]
            if new and parent_page(new[0], self.model.config.page_size) is None:
                priority = self.engine.root_priority()
                pages = self.model.pages
                self.model = dataclasses.replace(self.model, pages={
                    **pages, **{k: dataclasses.replace(pages[k], priority=priority)
                                for k in new}})
            return ended

        def restart(self, request: str, tick: int) -> None:
            storage = self.storage()
            self.model = dataclasses.replace(self.model, storage=dataclasses.replace(
                storage, prefetches=tuple(dataclasses.replace(p, start=tick)
                                          if p.request == request else p
                                          for p in storage.prefetches)))

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), run=st.booleans(), dt=st.integers(0, 4),
              evict=st.integers(0, 24), index=st.integers(0, 63),
              fresh=st.none() | st.tuples(tokens, namespaces))
        def cycle(self, request: str, run: bool, dt: int, evict: int, index: int,
                  fresh: tuple[tuple[int, ...], str | None] | None) -> None:
            """A request's round trip, each step checked: served (a fresh one, or one
            seen), its copies settled to host and storage, evicted from both tiers,
            prefetched back, fetched (``run``) and polled."""
            if fresh is not None:
                self.request(*fresh, dt=0, chunked=False, priority=0, keep_lock=False)
                self.engine_refines_the_model()
                index = len(self.seen) - 1
            self.settle()
            if evict:
                for evict_tier in (self.evict_both, self.evict_host):
                    evict_tier(evict)
                self.engine_refines_the_model()
            if not self.engine.has_prefetch(request):
                self.prefetch(request, index, 0)
                self.follow(request, run, dt)

        def settle(self) -> None:
            """Every pending host copy acknowledged, backups to storage run, the control
            queues drained: each where it has something to do, checked after."""
            for ready, step in ((lambda: bool(self.model.pending) and any(
                    t.direction == "d2h" for t in self.model.pending), self.writing_check),
                    (lambda: not self.engine.controller.backup_queue.empty(), self.backup),
                    (self.drainable, self.drain)):
                if ready():
                    step()
                    self.engine_refines_the_model()

        def follow(self, request: str, run: bool, dt: int) -> None:
            """After a prefetch was issued: the drain (``run``), then a poll."""
            if not self.engine.has_prefetch(request):
                return
            self.engine_refines_the_model()
            if run and self.drainable():
                self.drain()
                self.engine_refines_the_model()
            if self.engine.has_prefetch(request):
                self.progress(request, dt)

    for name, member in shared.items():
        setattr(SglangUnifiedStorage, name, member)
    SglangUnifiedStorage.__name__ = f"SglangUnifiedStorage_{scenario.slug()}"
    return SglangUnifiedStorage


__all__ = ["make_machine", "unified_settings"]
