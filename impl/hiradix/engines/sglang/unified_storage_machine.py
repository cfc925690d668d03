"""The differential suite with the storage tier of SGLang's ``UnifiedRadixCache`` (0.5.20 and
0.5.23, Python tree core) + ``HiCacheFile`` (spec/09 9.10).

The storage steps are those of the HiRadixCache storage machine
(``sglang_storage_machine``, spec/09 9.8-9.9). Its rules and checks that reach SGLang only
through the adapter's storage calls are taken from that machine's class as they are
(``_SHARED``: attach / query / pop / backup / reset, the host-room and protection
mappings, the storage comparison); the rules that read SGLang's prefetch bookkeeping,
which UnifiedRadixCache keeps apart, are this module's.

A prefetch's asynchronous part is driven as SGLang's scheduler interleaves it (lines of
0.5.20's ``scheduler.py``; 0.5.23's in brackets), each rule one step:

- ``issue``: a queued request's ``prefetch_from_storage`` (``_add_request_to_queue``
  :3203 [3492] -> ``_prefetch_kvcache`` :3080 [3342] -> :3119 [3381]). Model: no step
  (it reserves at issue, SGLang at the hit drain, DEV-S14); the anchor's protection,
  which SGLang takes here, is carried from now on (``Issued``).
- ``hit_query``: the prefetch thread's hit queries (``cache_controller.py`` :1219-1248
  [1333-1366]), pumped. Model: no step.
- ``hit_drain``: the drain of the oldest hit result (``check_hicache_events`` :3557
  [3889] -> ``_drain_storage_control_queues_impl``'s hit drain). Model: for a result of
  the prefetch the request holds, ``evict_host`` for SGLang's eviction (DEV-S7),
  ``prefetch_from_storage`` of the pages allocated (DEV-S21) and ``io_prefetch_query``;
  for a result of a prefetch already ended, none.
- ``progress``: the admission poll (``check_prefetch_progress`` :3901 [4241]) under the
  stop policy; one that ends an issued prefetch before its hit drain takes no model step,
  its verdict is the policy's (9.6) on a prefetch whose hit query has not answered.
- ``abort``: ``release_aborted_request`` (:5239 -> :3254 [5697 -> 3545]).
- ``reissue``: the request prefetches again under its handle, for the same tokens: its
  device match shrank (``_prefetch_after_device_hit_loss`` :3921 -> :3190 -> :3162 [4262
  -> 3452 -> 3424]) or from the retry book (:3559 -> :3142 -> :3162 [3891 -> 3404 ->
  3424]).
- ``prefetch``: issue, hit query and hit drain up to its result, in one rule (the round
  trip ``cycle`` uses it).
- ``drain``: the transfers, then ``drain_storage_control_queues``: the hit results first
  (as ``hit_drain``), the acknowledgements matched to ``_OngoingPrefetch`` entries by
  handle and operation.
- ``progress`` under ``timeout``: the deadline runs from the first poll that waits on
  0.5.23 (DEV-S22), from the issue on 0.5.20: the model's prefetch start is moved there;
  a per-token term is not driven (SGLang counts requested pages, uncapped).
- ``writing_check`` and ``serve``: as the HiRadixCache machine's (DEV-S20, DEV-7).
- ``cycle``: a request's round trip, as in that machine.

Steered around (``avoid``): a prefetch issued for a request while a hit query or result
of an ended prefetch of that request is queued (DEV-S29).
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from dataclasses import dataclass
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance import infer
from hiradix.conformance.differential import make_differential, namespaces, tokens
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines.sglang import storage_machine as sglang_storage_machine
from hiradix.engines.sglang.storage import NO_LIMIT
from hiradix.engines.sglang.storage_machine import REQUESTS, settings_strategy
from hiradix.engines.sglang.unified_storage import SglangUnifiedStorageAdapter, factory
from hiradix_model import Key, State, StorageSettings, ops
from hiradix_model.keys import parent_page
from hiradix_model.ops.storage.prefetch import pages_below, worth_prefetching
from hiradix_model.storage import timed_out

# The HiRadixCache storage machine's members that see SGLang through the adapter only.
_SHARED = ("sstep", "storage", "attached", "anchor_and_tokens", "protect", "prefetch_key",
           "host_room", "attach", "query", "pop_loaded", "backup", "drainable",
           "hung_below_device_only", "reset", "mapped", "storage_differences")
# The adapter's name for DEV-S29 (``avoid``), and the count of the situation it avoids.
REPREFETCH = "reprefetch_with_an_ended_result_queued"
RACE = "hit result of an ended prefetch drained while the request's next one awaits its own"


@dataclass(frozen=True)
class Issued:
    """A prefetch SGLang issued whose hit result is not drained: the model has no
    prefetch for it yet (DEV-S14), only its anchor's protection, which SGLang takes at
    the issue (spec/09 9.10). ``key``, ``anchor`` and ``matched`` are the match the
    issue was made from."""

    operation: Any
    key: Key
    anchor: Key | None
    matched: int


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
    refines = hiradix.__dict__["engine_refines_the_model"]
    clear_storage = hiradix.__dict__["clear"]

    class SglangUnifiedStorage(Base):  # type: ignore[misc, valid-type]
        engine: SglangUnifiedStorageAdapter
        model: State

        def __init__(self) -> None:
            super().__init__()  # the differential machine's (self.counts is the tally)
            self.awaiting: dict[str, Issued] = {}
            self.last_issued: dict[str, int] = {}  # request -> index of its key in seen
            # Attached from the start (DEV-S16), best effort, no rate limit (DEV-S14).
            first = StorageSettings(prefetch_threshold=scenario.page_size,
                                    prefetch_token_limit=NO_LIMIT)
            self.attach(first, 0)

        @rule(settings=unified_settings(scenario.page_size), go=st.integers(0, 3))
        def attach_rule(self, settings: StorageSettings, go: int) -> None:
            if go:
                return  # no DEV-S16 here: attach backfills the hashes of cached nodes
            cache = self.engine.cache
            if cache.ongoing_prefetch or cache.ongoing_backup:
                # The server's guard: it attaches (and so changes the prefetch policy)
                # only when is_fully_idle(), which needs no prefetch or backup live
                # (0.5.20 scheduler.py:4886, :4860-4862). A policy changed under a live
                # prefetch is beyond the server.
                counts.ops["attach not issued: prefetches or backups live (server guard)"] += 1
                return
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
            for request in sorted({*self.engine.prefetches(), *self.engine.awaiting_hits()}):
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
            waiting = self.awaiting.pop(request, None)
            release_aborted(self, request)  # the model has no prefetch of an issued one
            if waiting is not None:
                counts.ops["issued prefetch aborted before its hit drain"] += 1
                self.protect(waiting.anchor, -1)

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

        # -- a prefetch's asynchronous part, step by step (spec/09 9.10) ----------------

        def not_issued(self, request: str) -> str | None:
            """Why the scheduler issues no prefetch for ``request`` now, or None. No
            DEV-S19 here (acks are matched by operation): a request whose ended transfer
            is queued may prefetch again."""
            engine = self.engine
            if engine.has_prefetch(request):
                return "one is tracked for the request (DEV-S3)"
            if engine.deadline_expired(request):
                return "the request's deadline expired (DEV-S22)"
            if REPREFETCH in self.steered and request in engine.ended_queries():
                return "a hit query or result of its ended prefetch is queued (DEV-S29)"
            return None

        def issue_for(self, request: str, index: int, dt: int) -> bool:
            """``prefetch_from_storage`` for ``request`` with the key ``seen[index]``,
            after a match; whether a prefetch now awaits its hit drain. One SGLang does
            not issue (a span below the threshold) is declined by the model too; one it
            issues must be one the spec starts (9.1), and its model step waits for the
            hit drain (DEV-S14)."""
            why = self.not_issued(request)
            if why is not None:
                counts.ops["prefetch not issued: " + why] += 1
                return False
            self.tick(dt)
            key = self.seen[index]
            anchor, node, matched = self.anchor_and_tokens(key)
            operation = self.engine.issue_prefetch(key, node, matched, request)
            ps = self.model.config.page_size
            whole = self.prefetch_key(key, anchor, matched, (len(key.tokens) - matched) // ps)
            if operation is None:
                got = self.sstep("prefetch_from_storage", ops.prefetch_from_storage, request,
                                 whole, anchor, self.now)
                assert got == 0, f"prefetch_from_storage: SGLang issued none, model {got}"
                return False
            assert worth_prefetching(self.model, pages_below(self.model, whole, anchor)), \
                f"prefetch_from_storage: SGLang issued {whole}, which the spec does not start"
            counts.ops["prefetch issued"] += 1
            self.awaiting[request] = Issued(operation, key, anchor, matched)
            self.last_issued[request] = index
            self.protect(anchor, +1)  # SGLang host-locks the anchor at the issue
            return True

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63), dt=st.integers(0, 2))
        def issue(self, request: str, index: int, dt: int) -> None:
            """A request queued: its prefetch issued, the hit query and drain to come."""
            self.issue_for(request, index % len(self.seen), dt)

        @precondition(lambda self: self.attached() and bool(self.last_issued))
        @rule(request=st.sampled_from(REQUESTS), dt=st.integers(0, 2))
        def reissue(self, request: str, dt: int) -> None:
            """The request prefetches again under its handle, for the tokens it
            prefetched last (device-hit loss or the retry book); SGLang refuses only a
            handle that has an entry (``unified_radix_cache.py`` :1926 [2106])."""
            index = self.last_issued.get(request)
            if index is not None:
                self.issue_for(request, index, dt)

        @precondition(lambda self: self.engine.queries_queued())
        @rule()
        def hit_query(self) -> None:
            """The prefetch thread's hit queries; an ended operation's answers no hits.
            The model's ``io_prefetch_query`` is taken at the hit drain."""
            self.engine.pump_query()

        @precondition(lambda self: bool(self.engine.results_queued()))
        @rule()
        def hit_drain(self) -> None:
            """A scheduler pass that counted one hit result queued drains it."""
            self.drain_one_hit()

        def drain_one_hit(self) -> None:
            """The hit drain of the oldest result. The result of the prefetch its request
            holds: the model's ``evict_host`` for SGLang's (DEV-S7), then its
            ``prefetch_from_storage`` of the pages allocated (DEV-S21; the start moved to
            where SGLang's deadline counts from) and ``io_prefetch_query``. A result of a
            prefetch already ended: no model step, and nothing may change (spec/09: a
            report of an ended prefetch changes nothing; DEV-S29)."""
            engine = self.engine
            operation = engine.results_queued()[0]
            request = operation.request_id
            waiting = self.awaiting.get(request)
            if waiting is None or waiting.operation is not operation:
                counts.ops["hit result of an ended prefetch drained"] += 1
                counts.ops[RACE] += waiting is not None
                engine.drain_one_hit()
                self.check_issued()
                return
            ps = self.model.config.page_size
            hits = int(operation.storage_hit_count) // ps  # the drain trims it (DEV-S21)
            before = self.observe()
            engine.drain_one_hit()
            del self.awaiting[request]
            self.check_issued()
            self.made_host_room(before, hits * ps)
            entry = engine.entry(request)
            allocated = 0 if entry is None or entry.host_indices is None \
                else len(entry.host_indices)
            if 0 < allocated < hits * ps:
                counts.ops["hit drain allocated part of the hits (DEV-S21)"] += 1
            pages = allocated // ps if allocated else hits
            pkey = self.prefetch_key(waiting.key, waiting.anchor, waiting.matched, pages)
            engine.learn(pkey)
            view = engine.prefetches().get(request)
            self.protect(waiting.anchor, -1)  # the model's prefetch takes it over
            got = self.sstep("prefetch_from_storage", ops.prefetch_from_storage, request,
                             pkey, waiting.anchor, self.now,
                             host_slots=view.reserved if allocated and view else None)
            assert got == allocated, f"prefetch_from_storage: SGLang {allocated}, model {got}"
            if not got:
                return
            origin = engine.deadline_origin(request)
            if origin is not None and origin != self.now:
                self.restart(request, origin)
            assert not self.sstep("io_prefetch_query", ops.io_prefetch_query, request, pages)

        def check_issued(self) -> None:
            """SGLang's prefetches awaiting their hit drain are exactly the suite's
            issued ones, each with its own operation: only a poll, an abort or the drain
            of its own result ends one."""
            got = self.engine.awaiting_hits()
            problems = [f"issued prefetch of {request} revoked by SGLang: no poll, abort or "
                        f"drain of its own hit result ended it"
                        for request, waiting in sorted(self.awaiting.items())
                        if got.get(request) is not waiting.operation]
            problems += [f"prefetch of {request} issued in SGLang, not by the suite"
                         for request in sorted(set(got) - set(self.awaiting))]
            assert not problems, "storage tier: " + "; ".join(problems)

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63), dt=st.integers(0, 2))
        def prefetch(self, request: str, index: int, dt: int) -> None:
            """Issue, the hit query, and the hit drain up to this prefetch's result."""
            if not self.issue_for(request, index % len(self.seen), dt):
                return
            self.engine.pump_query()
            while request in self.awaiting and self.engine.results_queued():
                self.drain_one_hit()

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
            while self.engine.results_queued():
                self.drain_one_hit()  # the pass's hit drain comes first
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
        @rule(dt=st.integers(0, 4), reissue=st.booleans())
        def admission(self, dt: int, reissue: bool) -> None:
            """A pass of the admission loop: every waiting request with a prefetch is
            polled (``scheduler.py`` :3901 [4241]), in request order, each checked. With
            ``reissue``, a request whose issued prefetch the poll ended prefetches again
            at once where the scheduler does: its device match shrank (:3921 [4262]), or
            the ended operation's hit query has not run, so the next pass's hit drain
            meets no result of it before the retry book re-issues (:3557 -> :3559
            [3889 -> 3891])."""
            self.tick(dt)
            ended = []
            for request in sorted(h.rid for h in self.engine.cache.ongoing_prefetch):
                waiting = self.awaiting.get(request)
                self.progress(request, 0)
                self.engine_refines_the_model()
                if waiting is not None and request not in self.awaiting:
                    ended.append((request, waiting))
            for request, waiting in ended if reissue else ():
                if self.reissued_at_once(request, waiting):
                    self.engine_refines_the_model()

        def reissued_at_once(self, request: str, waiting: Issued) -> bool:
            """Re-issue ``request``'s prefetch right after the poll that ended
            ``waiting`` where the scheduler can (``admission``); whether it did."""
            query_pending = self.engine.query_pending(waiting.operation)
            _, _, matched = self.anchor_and_tokens(waiting.key)
            if not (query_pending or matched < waiting.matched):
                return False
            counts.ops["prefetch re-issued after the poll that ended it"] += 1
            return self.issue_for(request, self.last_issued[request], 0)

        @precondition(lambda self: self.attached() and bool(self.engine.cache.ongoing_prefetch))
        @rule(request=st.sampled_from(REQUESTS), dt=st.integers(0, 4))
        def progress(self, request: str, dt: int) -> None:
            self.tick(dt)
            if request in self.awaiting:
                self.poll_issued(request)
                return
            waited = self.engine.waiting_since(request)
            got = self.engine.check_prefetch_progress(request)
            since = self.engine.waiting_since(request)
            if waited is None and since is not None:
                # DEV-S22: the deadline starts at this poll; the model's start moves here.
                counts.ops["timeout started at the first waiting poll (DEV-S22)"] += 1
                self.restart(request, since)
            want = self.end_prefetch(request)
            assert got == want, f"check_prefetch_progress: SGLang {got}, model {want}"

        def poll_issued(self, request: str) -> None:
            """The admission poll of a prefetch whose hit result is not drained. Its
            verdict is the stop policy's (9.6) on a prefetch whose hit query has not
            answered: ``best_effort`` ends it, ``wait_complete`` waits, ``timeout`` ends
            it once timed out (0.5.20: from the issue; 0.5.23: from the first waiting
            poll, which starts the deadline, DEV-S22). Ending it takes no model step:
            the model never began it (DEV-S14); its hit result, still to come, is one of
            an ended prefetch."""
            engine, waiting = self.engine, self.awaiting[request]
            origin = engine.deadline_origin(request)
            settings = self.storage().settings
            want = settings.prefetch_policy == "best_effort" or (
                settings.prefetch_policy == "timeout" and origin is not None
                and timed_out(settings, self.now - origin, 0))
            got = engine.check_prefetch_progress(request)
            if origin is None and engine.deadline_origin(request) is not None:
                counts.ops["timeout started at the first waiting poll (DEV-S22)"] += 1
            assert got == want, (f"check_prefetch_progress of {request}'s issued prefetch: "
                                 f"SGLang {got}, the stop policy {want}")
            if got:
                counts.ops["issued prefetch ended by a poll before its hit drain"] += 1
                del self.awaiting[request]
                self.protect(waiting.anchor, -1)

        def made_host_room(self, before: State, tokens: int) -> None:
            """DEV-S7: the hit drain evicted host pages for all the hits (``tokens``),
            with the anchor protected since the issue (the model carries that
            protection while the prefetch awaits its hit drain): the model evicts the
            same pages."""
            after = self.observe(adopt=False)
            if not infer.left_host(before, after):
                return
            victims = infer.host_victims(self.model, before, after, tokens)
            self.step("evict_host", ops.evict_host, tokens, victims)

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
                    (self.engine.queries_queued, self.hit_query),
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

        @precondition(lambda self: self.attached())
        @rule(go=st.integers(0, 15))
        def clear(self, go: int) -> None:
            """As the HiRadixCache machine's, after the hit results queued are drained:
            the model answers a hit query at the hit drain (DEV-S14), when a clear in
            between would have removed pages SGLang's query found."""
            if go != 15:
                return
            if self.engine.results_queued():
                counts.ops["clear after the queued hit results were drained (DEV-S14)"] += 1
                while self.engine.results_queued():
                    self.drain_one_hit()
                self.engine_refines_the_model()
            clear_storage(self, go)

        def without_issued(self, state: State) -> State:
            """``state`` without the protection of the issued prefetches' anchors,
            which SGLang holds from the issue and the model's prefetch only from the
            hit drain: the holders INV-HOST-PROTECT-HOLDERS counts."""
            held = Counter(w.anchor for w in self.awaiting.values() if w.anchor is not None)
            pages = {k: dataclasses.replace(p, host_protect=p.host_protect - held[k])
                     if held[k] else p for k, p in state.pages.items()}
            return dataclasses.replace(state, pages=pages) if held else state

        def compare(self, seen: State) -> None:
            """The differential comparison and both states' invariants, judged without
            the issued prefetches' anchor protection (on both sides alike)."""
            model = self.model
            self.model = self.without_issued(model)
            try:
                super().compare(self.without_issued(seen))
            finally:
                self.model = model

        @invariant()
        def engine_refines_the_model(self) -> None:
            """The issued prefetches first (a revoked one is named), then the HiRadixCache
            machine's comparison."""
            self.check_issued()
            refines(self)

    for name, member in shared.items():
        setattr(SglangUnifiedStorage, name, member)
    SglangUnifiedStorage.__name__ = f"SglangUnifiedStorage_{scenario.slug()}"
    return SglangUnifiedStorage


__all__ = ["make_machine", "unified_settings"]
