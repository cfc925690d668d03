"""The differential suite with SGLang's storage tier: HiRadixCache 0.5.20 + ``HiCacheFile``.

It extends the two-tier differential machine (``differential.make_differential``) with
the storage calls SGLang's scheduler makes (``adapters.sglang_storage``) and the model's
storage operations (spec/09), step by step. SGLang's storage threads are pumped inline
by the adapter, so every run is deterministic. How SGLang's calls map onto the model's:

- ``prefetch``: a match, then ``prefetch_from_storage`` from its ``last_host_node``, the
  hit query and the drain that allocates host slots for the hits (one step, DEV-S14).
  Model: ``evict_host`` for what SGLang evicted to make room (DEV-S7: for all the hits,
  not the shortfall), ``prefetch_from_storage`` for the hit pages, ``io_prefetch_query``.
- ``drain``: the page transfers, then ``drain_storage_control_queues``. Model: for each
  prefetch the drain still knows, ``io_prefetch_fetch`` with the pages it reports; for
  each whose transfer finished, ``check_prefetch_progress`` (preceded by
  ``terminate_prefetch`` where the model's policy would still wait, DEV-S15); then
  ``drain_storage_queues``.
- ``backup``: the backup thread. Model: ``io_storage_write`` for each running write.
- ``progress`` / ``abort`` / ``pop_loaded`` / ``query`` / ``clear`` / ``attach`` /
  ``detach``: one SGLang call, one model operation.

After every step: the two-tier comparison (pages, slots, KV bytes, locks, protection
with SGLang's backup protection mapped, DEV-S6), every invariant of the observed state
judged with the model's storage bookkeeping (INV-HOST-POOL-CONSERVATION amended,
INV-HOST-PROTECT-HOLDERS, ...), and the storage view: the pages on disk by hash, each
prefetch's anchor, pages and host slots, the host slots held by the storage path, the
free list without repeats (INV-RELEASE-ONCE), tokens loaded per request, SGLang's own
``prefetch_tokens_occupied`` against what its prefetches request.
"""

from __future__ import annotations

import dataclasses
from collections import Counter
from typing import Any

from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from hiradix.conformance import infer
from hiradix.conformance.differential import make_differential, namespaces, tokens
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.engines.sglang.storage import (
    BACKEND,
    NO_LIMIT,
    SglangStorageAdapter,
    factory,
)
from hiradix_model import Key, State, StorageSettings, ops

REQUESTS = ("r0", "r1", "r2")
IDENTITY = ("hiradix",)


def settings_strategy(page_size: int) -> st.SearchStrategy[StorageSettings]:
    """Settings SGLang and the model read alike: a threshold of at least one page (a
    threshold of 0 starts empty prefetches, DEV-S4) and no rate limit (DEV-S14)."""
    return st.integers(0, 4).flatmap(lambda base: st.builds(
        StorageSettings,
        prefetch_threshold=st.sampled_from([page_size, 2 * page_size]),
        prefetch_policy=st.sampled_from(["best_effort", "wait_complete", "timeout"]),
        timeout_base=st.just(base),
        timeout_per_ki_token=st.sampled_from([0, 512, 4096]),
        timeout_max=st.integers(base, 8),
        prefetch_token_limit=st.just(NO_LIMIT),
    ))


def make_machine(engine: str, scenario: Scenario,
                 tally: Tally | None = None) -> type[RuleBasedStateMachine]:
    """The storage differential machine for one scenario of ``engine``."""
    counts = tally if tally is not None else Tally()
    Base = make_differential(factory(engine, scenario), counts)

    class SglangStorage(Base):  # type: ignore[misc, valid-type]
        engine: SglangStorageAdapter

        def __init__(self) -> None:
            super().__init__()
            self.counts = counts
            self.attach(StorageSettings(prefetch_threshold=scenario.page_size,
                                        prefetch_policy="best_effort",
                                        prefetch_token_limit=NO_LIMIT), 0)

        # -- plumbing -----------------------------------------------------------------

        def sstep(self, name: str, op: Any, *args: object, **kwargs: object) -> object:
            """A model step of the storage tier (its arguments are not traced)."""
            self.model, observation = op(self.model, *args, **kwargs)
            counts.ops[name] += 1
            counts.steps += 1
            return observation

        def storage(self) -> Any:
            assert self.model.storage is not None
            return self.model.storage

        def attached(self) -> bool:
            return self.model.storage is not None and self.model.storage.backend is not None

        def anchor_and_tokens(self, key: Key) -> tuple[Key | None, Any, int]:
            """Match ``key`` as the scheduler does before a prefetch: the model's
            anchor page, SGLang's ``last_host_node`` and the tokens matched."""
            got = self.engine.match_prefix(key)
            want = self.step("match_prefix", ops.match_prefix, key, self.now)
            self.agree(got, want)
            assert isinstance(want, ops.MatchResult)
            node = self.engine._node(want.last_host_page)
            return want.last_host_page, node, len(want.device_slots) + want.host_hit_tokens

        def protect(self, page: Key | None, delta: int) -> None:
            """Add ``delta`` to the host protection of ``page`` (a host page) in the
            model's state, around a step SGLang takes with the page protected."""
            record = None if page is None else self.model.pages.get(page)
            if page is None or record is None or record.host is None:
                return
            self.model = dataclasses.replace(self.model, pages={
                **self.model.pages,
                page: dataclasses.replace(record, host_protect=record.host_protect + delta)})

        def prefetch_key(self, key: Key, anchor: Key | None, matched: int, pages: int) -> Key:
            """The key of the pages a prefetch fetches: below ``anchor``, the request's
            tokens past the match (SGLang hashes them chained onto the anchor's)."""
            base = () if anchor is None else anchor.tokens
            ps = self.model.config.page_size
            return Key(base + key.tokens[matched:matched + pages * ps], key.namespace)

        def serve(self, key: Key, dt: int, chunked: bool, priority: int, keep_lock: bool,
                  counted_from: Key | None = None) -> None:
            """Serve ``key`` unless its backup might find host room for part of its run
            only: SGLang backs up node by node and keeps the nodes that fit, the spec
            backs up the run all or nothing (DEV-7). Storage makes this reachable: the
            slots prefetches hold are neither free nor evictable."""
            pages, ps = self.model.pages, self.model.config.page_size
            path = [Key(key.tokens[:end], key.namespace)
                    for end in range(ps, len(key.tokens) + 1, ps)]
            off_device = sum(k not in pages or pages[k].device is None for k in path)
            off_host = sum(k not in pages or pages[k].host is None for k in path)
            # A key the device cannot hold is not inserted (its alloc fails): no backup.
            if (off_device * ps <= self.model.config.device_slots
                    and self.host_room(path) < off_host * ps):
                counts.ops["request not served: host room short of its backup run "
                           "(DEV-7)"] += 1
                return
            super().serve(key, dt, chunked, priority, keep_lock, counted_from)

        def host_room(self, path: list[Key]) -> int:
            """Host slots free, or freed by evicting every host-only page that can go
            (no lock, no protection, not on ``path``, every child gone too)."""
            pages = self.model.pages
            ps = self.model.config.page_size
            keep = {k for k, p in pages.items() if p.device is not None or p.host is None
                    or p.lock or p.host_protect or k in path}
            for k in sorted(pages, key=lambda k: -len(k.tokens)):  # children first
                if k in keep and len(k.tokens) > ps:
                    keep.add(Key(k.tokens[:-ps], k.namespace))
            return len(self.model.host_free) + ps * sum(k not in keep for k in pages)

        @precondition(lambda self: any(t.direction == "d2h" for t in self.model.pending))
        @rule()
        def writing_check(self) -> None:
            """The acknowledgements; then, where SGLang issued a backup to storage that
            the spec does not (its pages all stored already), the backups run and their
            acknowledgements are drained at once: until then SGLang protects those pages
            on host and its evictions pass them over (DEV-S20)."""
            super().writing_check()
            writes = len(self.model.storage.writes) if self.model.storage is not None else 0
            if not self.attached() or len(self.engine.cache.ongoing_backup) <= writes:
                return
            counts.ops["backups of stored pages run and acknowledged at once "
                       "(DEV-S20)"] += 1
            self.engine_refines_the_model()
            self.backup()
            self.engine_refines_the_model()
            self.engine.cache._drain_storage_control_queues_impl(
                n_storage_hit=0, n_ack_prefetch=0, n_backup=None, n_release=0,
                log_metrics=False)
            self.sstep("drain_storage_queues", ops.drain_storage_queues, revokes=0,
                       releases=0)

        # -- storage rules ------------------------------------------------------------

        @rule(settings=settings_strategy(scenario.page_size), go=st.integers(0, 3))
        def attach_rule(self, settings: StorageSettings, go: int) -> None:
            if go or (not self.attached() and self.model.pages):
                # DEV-S16: pages cached while detached have no storage hash; SGLang
                # would store their children under the wrong names.
                return
            self.attach(settings, 0)

        def attach(self, settings: StorageSettings, go: int) -> None:
            got = self.engine.attach(settings)
            want = self.sstep("attach_storage", ops.attach_storage, BACKEND,
                              identity=IDENTITY, settings=settings, retained=True)
            assert got == want, (got, want)

        @precondition(lambda self: self.attached())
        @rule(go=st.integers(0, 7), drain_first=st.booleans())
        def detach(self, go: int, drain_first: bool) -> None:
            if go:
                return
            if not drain_first and self.engine.ended_transfers_queued():
                counts.ops["detach drained first: an ended prefetch's transfer queued "
                           "(DEV-S18)"] += 1
                drain_first = True
            if drain_first and self.drainable():
                self.drain()
            self.engine.detach()
            self.sstep("detach_storage", ops.detach_storage)

        @precondition(lambda self: self.attached())
        @rule(go=st.integers(0, 15))
        def clear(self, go: int) -> None:
            if go != 15:
                return
            if not self.engine.controller.backup_queue.empty():
                # DEV-S20: a queued SGLang backup rewrites every page of its node that
                # the clear removed; the spec's write holds only the pages lacking at
                # issue. The backups run first.
                counts.ops["clear after the queued backups ran (DEV-S20)"] += 1
                self.backup()
                self.engine_refines_the_model()
            assert self.engine.clear() == self.sstep("clear_storage", ops.clear_storage)

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63), dt=st.integers(0, 2))
        def prefetch(self, request: str, index: int, dt: int) -> None:
            if request in self.engine.cache.ongoing_prefetch:
                counts.ops["second prefetch for a request: not issued (DEV-S3)"] += 1
                return
            if request in self.engine.ended_transfers():
                counts.ops["prefetch not issued: the request's ended transfer is queued "
                           "(DEV-S19)"] += 1
                return
            key = self.seen[index % len(self.seen)]
            self.tick(dt)
            anchor, node, matched = self.anchor_and_tokens(key)
            before = self.observe()
            hits, allocated = self.engine.prefetch(key, node, matched, request)
            after = self.observe(adopt=False)
            ps = self.model.config.page_size
            if infer.left_host(before, after):
                # DEV-S7: SGLang made host room for all the hits, with the anchor already
                # protected (DEV-S14: issue protects it, the hit drain evicts): the model
                # evicts with the anchor's protection counted for that step only.
                self.protect(anchor, +1)
                victims = infer.host_victims(self.model, before, after, hits * ps)
                self.step("evict_host", ops.evict_host, hits * ps, victims)
                self.protect(anchor, -1)
            pkey = self.prefetch_key(key, anchor, matched, hits)
            self.engine.learn(pkey)
            slots = None
            view = self.engine.prefetches().get(request)
            if allocated and view is not None:
                slots = view.reserved
            got = self.sstep("prefetch_from_storage", ops.prefetch_from_storage, request,
                             pkey, anchor, self.now, host_slots=slots)
            assert got == allocated, f"prefetch_from_storage: SGLang {allocated}, model {got}"
            if got:
                revoked = self.sstep("io_prefetch_query", ops.io_prefetch_query, request,
                                     allocated // ps)
                assert not revoked

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(request=st.sampled_from(REQUESTS), index=st.integers(0, 63),
              fresh=st.none() | st.tuples(tokens, namespaces), evict=st.integers(0, 24),
              run=st.booleans(), dt=st.integers(0, 4))
        def cycle(self, request: str, index: int, fresh: tuple[tuple[int, ...], str | None] | None,
                  evict: int, run: bool, dt: int) -> None:
            """A request's round trip through storage, each step checked: served (or
            an earlier one), backed up to host and to storage, evicted from both tiers,
            prefetched back, fetched (``run``) and polled."""
            if fresh is not None:
                self.request(*fresh, dt=0, chunked=False, priority=0, keep_lock=False)
                self.engine_refines_the_model()
                index = len(self.seen) - 1
            for step, ready in ((self.writing_check, lambda: any(
                    t.direction == "d2h" for t in self.model.pending)),
                    (self.backup, lambda: not self.engine.controller.backup_queue.empty()),
                    (self.drain, self.drainable)):
                if ready():
                    step()
                    self.engine_refines_the_model()
            if evict:
                self.evict_both(evict)
                self.evict_host(evict)
                self.engine_refines_the_model()
            if request in self.engine.cache.ongoing_prefetch:
                return
            self.prefetch(request, index, 0)
            if request not in self.engine.cache.ongoing_prefetch:
                return
            self.engine_refines_the_model()
            if run and self.drainable():
                self.drain()
                self.engine_refines_the_model()
            if request in self.engine.cache.ongoing_prefetch:
                self.progress(request, dt)

        @precondition(lambda self: self.attached() and bool(self.seen))
        @rule(index=st.integers(0, 63))
        def query(self, index: int) -> None:
            key = self.seen[index % len(self.seen)]
            anchor, node, matched = self.anchor_and_tokens(key)
            got = self.engine.query_hit_length(key, node, matched)
            ps = self.model.config.page_size
            pkey = self.prefetch_key(key, anchor, matched, (len(key.tokens) - matched) // ps)
            self.engine.learn(pkey)
            want = self.sstep("query_storage_hit_length", ops.query_storage_hit_length,
                              pkey, anchor, got // ps)
            assert got == want, (got, want)

        @precondition(lambda self: self.attached() and bool(self.engine.cache.ongoing_prefetch))
        @rule(request=st.sampled_from(REQUESTS), dt=st.integers(0, 4))
        def progress(self, request: str, dt: int) -> None:
            now = self.tick(dt)
            got = self.engine.check_prefetch_progress(request)
            want = self.sstep("check_prefetch_progress", ops.check_prefetch_progress,
                              request, now)
            assert got == want, f"check_prefetch_progress: SGLang {got}, model {want}"

        @precondition(lambda self: bool(self.engine.cache.ongoing_prefetch)
                      or bool(self.engine.loaded_tokens()))
        @rule(request=st.sampled_from(REQUESTS))
        def abort(self, request: str) -> None:
            self.engine.release_aborted_request(request)
            self.sstep("release_aborted_request", ops.release_aborted_request, request)

        @precondition(lambda self: bool(self.engine.loaded_tokens()))
        @rule(request=st.sampled_from(REQUESTS))
        def pop_loaded(self, request: str) -> None:
            got = self.engine.pop_prefetch_loaded_tokens(request)
            want = self.sstep("pop_prefetch_loaded_tokens", ops.pop_prefetch_loaded_tokens,
                              request)
            assert got == want, (got, want)

        @precondition(lambda self: self.attached()
                      and not self.engine.controller.backup_queue.empty())
        @rule()
        def backup(self) -> None:
            self.engine.pump_backup()
            for write in self.storage().writes:
                if write.phase == "running":
                    self.sstep("io_storage_write", ops.io_storage_write,
                               len(write.pages) - write.done)

        def drainable(self) -> bool:
            c = self.engine.controller
            storage = self.model.storage
            return self.engine.io_queued() or not c.ack_prefetch_queue.empty() or (
                self.attached() and (not c.ack_backup_queue.empty()
                                     or not c.host_mem_release_queue.empty())) or (
                storage is not None and bool(storage.release_queue or storage.writes))

        def hung_below_device_only(self) -> list[str]:
            """The prefetches whose fetched pages would run on below a cached page with
            no host copy: SGLang hangs the rest there, the spec stops (DEV-S5)."""
            requests = []
            for request, view in self.engine.prefetches().items():
                if any(k in self.model.pages and self.model.pages[k].host is None
                       for k in view.pages[:-1]):
                    requests.append(request)
            return requests

        @precondition(lambda self: self.attached() and self.drainable())
        @rule()
        def drain(self) -> None:
            """The transfers run, then the scheduler drains every control queue."""
            for request in self.hung_below_device_only():
                # DEV-S5: the request is aborted before its transfer can land.
                counts.ops["prefetch aborted before the drain: its pages run below a "
                           "device-only page (DEV-S5)"] += 1
                self.abort(request)
                self.engine_refines_the_model()
            engine = self.engine
            engine.pump_fetch()
            cache = engine.cache
            ps = self.model.config.page_size
            landed: dict[str, int] = {}
            finished: list[str] = []
            for ack in list(engine.controller.ack_prefetch_queue.queue):
                entry = cache.ongoing_prefetch.get(ack.rid)
                if entry is None or entry[2] is not ack.operation:
                    continue  # ended before its transfer: nothing the model awaits
                if ack.completed_tokens is not None:
                    landed[ack.rid] = ack.completed_tokens // ps
                if ack.completed_req:
                    finished.append(ack.rid)
            for request, pages in landed.items():
                p = self.storage().prefetch_of(request)
                assert p is not None and p.phase == "fetching", (request, p)
                more = pages - p.landed
                fault = None if pages == p.hit_pages else "short"
                self.sstep("io_prefetch_fetch", ops.io_prefetch_fetch, request, more,
                           fault=fault)
            engine.drain()
            for request in finished:
                if not ops.check_prefetch_progress(self.model, request, self.now)[1]:
                    counts.ops["ended by the drain where the policy waits (DEV-S15)"] += 1
                    self.sstep("terminate_prefetch", ops.terminate_prefetch, request)
                ended = self.sstep("check_prefetch_progress", ops.check_prefetch_progress,
                                   request, self.now)
                assert ended
            self.sstep("drain_storage_queues", ops.drain_storage_queues)

        # DEV-S9: SGLang's reset keeps ongoing_prefetch / ongoing_backup entries.
        @precondition(lambda self: not self.model.pending and not (
            self.model.storage is not None and (self.model.storage.prefetches
                                                or self.model.storage.writes
                                                or self.model.storage.release_queue))
            and not self.engine.cache.ongoing_prefetch and not self.engine.cache.ongoing_backup
            and not self.engine.io_queued())
        @rule(go=st.integers(0, 15))
        def reset(self, go: int) -> None:
            if go == 0:
                self.do_reset()

        # -- after every step -----------------------------------------------------------

        def mapped(self, seen: State) -> State:
            """SGLang's protection in the spec's terms (DEV-S6). SGLang puts one count on
            a node per holder; ``observe`` shows it on each of the node's pages. Each
            live backup's count is replaced by the spec's writes (whose pages must be
            among those the backup was issued for), and an anchor's count is kept on
            the node's last page only (the anchor page)."""
            storage = self.model.storage
            writes = [w.pages for w in storage.writes] if storage is not None else []
            backups = self.engine.backups()
            issued = Counter(k for pages, _ in backups for k in pages)
            wanted = Counter(k for pages in writes for k in pages)
            missing = wanted - issued
            assert not missing, f"pages the spec writes that no SGLang backup covers: " \
                                f"{sorted(missing, key=str)}"
            held = Counter(k for _, pages in backups for k in pages)
            held.update(k for pages in self.engine.anchors() for k in pages[:-1])
            pages = {k: dataclasses.replace(p, host_protect=p.host_protect - held[k]
                                            + wanted[k]) for k, p in seen.pages.items()}
            return dataclasses.replace(seen, pages=pages, storage=storage)

        def storage_differences(self) -> list[str]:
            engine, model = self.engine, self.model
            storage = model.storage
            problems = []
            if engine.attached != self.attached():
                problems.append(f"attached: SGLang {engine.attached}, model {self.attached()}")
            want_stored = frozenset() if storage is None else frozenset(
                sid.page for sid in storage.stores.get(BACKEND, {}))
            for key in [*self.seen, *model.pages]:
                engine.learn(key)
            got_stored = engine.stored_pages()
            if got_stored != want_stored:
                only_sglang = sorted(got_stored - want_stored, key=str)
                only_model = sorted(want_stored - got_stored, key=str)
                problems.append(f"stored pages: only SGLang {only_sglang}, "
                                f"only model {only_model}")
            views = engine.prefetches()
            mine = {} if storage is None else {p.request: p for p in storage.prefetches}
            if set(views) != set(mine):
                problems.append(f"prefetches: SGLang {sorted(views)}, model {sorted(mine)}")
            for request in set(views) & set(mine):
                v, p = views[request], mine[request]
                if (v.anchor, v.pages, v.reserved) != (p.anchor, p.pages, p.reserved):
                    problems.append(f"prefetch {request}: SGLang {v}, model {p}")
            free = engine.host_free_list()
            if len(free) != len(set(free)):
                twice = sorted(s for s, n in Counter(free).items() if n > 1)
                problems.append(f"INV-RELEASE-ONCE: host slots free twice: {twice}")
            tree = {s for p in model.pages.values() for s in p.host or ()}
            held = set(range(model.config.host_slots)) - set(free) - tree
            owned = set() if storage is None else (
                {s for p in storage.prefetches for s in p.slots} | set(storage.release_queue))
            if held != owned:
                problems.append(f"host slots held by the storage path: SGLang {sorted(held)}, "
                                f"model {sorted(owned)}")
            loaded = {} if storage is None else dict(storage.loaded_tokens)
            if engine.loaded_tokens() != loaded:
                problems.append(f"loaded tokens: SGLang {engine.loaded_tokens()}, model {loaded}")
            occupied, requested = engine.occupied()
            if occupied != requested:
                problems.append(f"prefetch_tokens_occupied {occupied} != {requested} "
                                "requested by SGLang's ongoing prefetches")
            return problems

        @invariant()
        def engine_refines_the_model(self) -> None:
            self.compare(self.mapped(self.observe()))
            problems = self.storage_differences()
            assert not problems, "storage tier: " + "; ".join(problems)
            self.tally_step()  # counts coverage states too

    SglangStorage.__name__ = f"SglangStorage_{scenario.slug()}"
    return SglangStorage


__all__ = ["make_machine"]
