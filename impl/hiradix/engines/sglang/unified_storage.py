"""Adapter for the storage tier (L3) of SGLang's ``UnifiedRadixCache`` (0.5.20, 0.5.23):
the cache the server builds for ``--enable-hierarchical-cache``, with ``init_hicache`` and
the ``file`` backend (``HiCacheFile``) attached at run time in a directory of its own.

The two-tier part is the ``sglang-unified`` adapter's (Python tree core, its CPU
patches, stamps and corrections). The storage calls are those the HiRadixCache storage
adapter makes (``sglang_storage``): this class inherits them (attach, detach, clear, the
thread pumps, page hashes, the files on disk) and overrides where UnifiedRadixCache's
bookkeeping differs (spec/09 9.10):

- prefetches are keyed by ``CacheRequestHandle`` (rid, attempt), not by rid, and their
  entry is ``_OngoingPrefetch`` (anchor node id, key, host slots, operation, the anchor's
  host-lock receipt);
- backups are ``ongoing_backup[op] = (node id, host-lock receipt)``;
- the drain takes per-pool release counts (``extra_release_counts``; none here: FULL
  is the only component);
- the hit drain allocates what fits (at least the threshold, DEV-S21), where
  HiRadixCache allocates all the hits or none;
- 0.5.23 only: the ``timeout`` policy's deadline starts at the first admission poll
  that finds the prefetch unfinished (``_StoragePrefetchWait``, a ``PollTimer``,
  DEV-S22); a host lock covers the upper part of a split node (DEV-S23). 0.5.20 counts
  from the issue and locks one node, as HiRadixCache;
- a request name aborted stands for a new request afterwards: a new handle (the next
  attempt), as the server gives its next request a new rid;
- the prefetch's asynchronous part is reachable call by call (spec/09 9.10): the issue
  (``issue_prefetch``), the hit query (``pump_query``), the hit drain of the oldest
  result (``drain_one_hit``); ``awaiting_hits`` names the prefetches issued whose result is not
  drained, ``prefetches`` those allocated, ``ended_queries`` the requests with a hit
  query or result queued for an operation no entry holds any more (DEV-S29).

**Deterministic I/O**, as in ``sglang_storage``: ``threading.Thread`` in the controller
modules (``cache_controller`` and ``hybrid_cache_controller``) is ``_InlineThread``; the
controller's stop event is ``_Quiescent``; ``pump`` runs one of SGLang's thread
functions on the calling thread. Deadlines read the suite's logical clock (``_TickClock``).

Not driven: pipeline parallelism (prefetch tickets, ``bind_prefetch_ticket``,
``_check_pp_prefetch_progress``: they need a PP process group), ``buffer_only`` host
memory mode (parked hits, anchor caps), the scheduler's retry book
(``storage_prefetch_retries``: when it re-issues; the re-issue itself is driven),
``assume_stored`` prefetches (``storage_hit_end``), sidecar pools (SWA, Mamba).
"""

from __future__ import annotations

import dataclasses
import importlib
import sys
import threading
from array import array
from collections.abc import Callable, Mapping
from types import SimpleNamespace
from typing import Any

from hiradix.conformance.scenario import Scenario
from hiradix.engines.protocol import EngineAdapter, probe_engine
from hiradix.engines.sglang import storage as sglang_storage
from hiradix.engines.sglang import unified as sglang_unified
from hiradix.engines.sglang.storage import (
    NO_LIMIT,
    PrefetchView,
    SglangStorageAdapter,
    _InlineThread,
    _Quiescent,
)
from hiradix.engines.sglang.unified import SETUP, SglangUnifiedAdapter
from hiradix_model import Key, State, StorageSettings

VERSIONS = ("0.5.20", "0.5.23")
# ``priority`` is left out as in sglang-storage (DEV-S17); ``tlru`` is not the model's.
STRATEGIES = sglang_storage.STRATEGIES
_STORAGE_MODULES = {
    "controller": "sglang.srt.managers.cache_controller",
    "hybrid": "sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller",
    "utils": "sglang.srt.mem_cache.utils",
    "handle": "sglang.srt.mem_cache.base_prefix_cache",
    "runtime": "sglang.srt.runtime_context",
    "radix": "sglang.srt.mem_cache.radix_cache",
}


class _TickClock:
    """``time`` where SGLang times a prefetch's deadline: both clocks read the suite's
    logical tick. 0.5.23: ``poll_timer`` (``perf_counter``, ``_StoragePrefetchWait``);
    0.5.20: the operation's start and the check (``monotonic``), and the cache's
    eviction timing (``perf_counter``, statistics only)."""

    def __init__(self, clock: sglang_unified.UnifiedClock) -> None:
        self.clock = clock

    def perf_counter(self) -> float:
        return float(self.clock.now)

    def monotonic(self) -> float:
        return float(self.clock.now)


_STORAGE_ENV: SimpleNamespace | None = None


def prepare_storage() -> SimpleNamespace:
    """The UnifiedRadixCache environment with the storage threads made inline (once)."""
    global _STORAGE_ENV
    if _STORAGE_ENV is None:
        env = sglang_unified.prepare()
        # Any: module globals SGLang's code reads at call time are replaced below.
        modules: dict[str, Any] = {k: importlib.import_module(v)
                                   for k, v in _STORAGE_MODULES.items()}
        inline = SimpleNamespace(Thread=_InlineThread, Event=threading.Event,
                                 Lock=threading.Lock)
        modules["controller"].threading = inline
        modules["hybrid"].threading = inline
        clock = _TickClock(env.clock)
        if env.version == "0.5.20":
            for name in ("controller", "hybrid"):
                modules[name].time = clock
            env.modules["uni"].time = clock
        else:
            poll_timer: Any = importlib.import_module("sglang.srt.utils.poll_timer")
            poll_timer.time = clock
        _STORAGE_ENV = SimpleNamespace(unified=env, modules=modules)
    return _STORAGE_ENV


# What the adapter calls: the cache's storage API, and the controller's thread functions.
CACHE_CALLS = ("attach_storage_backend", "detach_storage_backend", "clear_storage_backend",
               "prefetch_from_storage", "query_storage_hit_length", "check_prefetch_progress",
               "release_aborted_request", "pop_prefetch_loaded_tokens",
               "_drain_storage_control_queues_impl", "drain_storage_control_queues")
CONTROLLER_CALLS = ("prefetch_thread_func", "prefetch_io_aux_func",
                    "prefetch_sync_thread_func", "backup_thread_func")


def probe(engine: str) -> str:
    """The installed SGLang version, if this adapter can drive its storage tier."""
    def load() -> None:
        senv = prepare_storage()
        for owner, names in ((senv.unified.modules["uni"].UnifiedRadixCache, CACHE_CALLS),
                             (senv.modules["hybrid"].HybridCacheController,
                              CONTROLLER_CALLS)):
            missing = [n for n in names if not callable(getattr(owner, n, None))]
            if missing:
                raise AttributeError(f"{owner.__name__} lacks {', '.join(missing)}")
    return probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache's storage tier",
                        SETUP, load)


class SglangUnifiedStorageAdapter(SglangStorageAdapter, SglangUnifiedAdapter):
    """UnifiedRadixCache (Python tree core) with a ``file`` storage backend.

    The method order is: this class, the HiRadixCache storage adapter's calls, then the
    UnifiedRadixCache adapter's tree (``SglangStorageAdapter.__init__`` is not run: it
    builds a HiRadixCache)."""

    def __init__(self, scenario: Scenario) -> None:
        if scenario.eviction not in STRATEGIES:
            raise ValueError(f"scenario: eviction must be one of {STRATEGIES} (DEV-S17)")
        self.senv = prepare_storage()
        SglangUnifiedAdapter.__init__(self, scenario)
        self.version = probe("sglang-unified-storage")
        self.name = "sglang-unified-storage"
        self.controller = self.cache.cache_controller
        self.controller.storage_stop_event = _Quiescent()
        self.setup_storage()
        self.mapped = {
            **self.mapped,
            "storage threads": "no thread runs: SGLang's four storage thread functions "
                               "are pumped on the calling thread (inline)",
            "prefetch issue": "DEV-S14: SGLang allocates at the hit drain; the model's "
                              "prefetch_from_storage and io_prefetch_query are taken "
                              "there, the anchor's protection from the issue on "
                              "(spec/09 9.10)",
            "request names": "a name aborted stands for a new request afterwards: "
                             "SGLang's handle is (name, next attempt), as the server's "
                             "next request has a new rid",
            "prefetch ended before its hit drain": "DEV-S14: a poll or an abort that "
                                                   "ends an issued prefetch whose hit "
                                                   "result is not drained takes no "
                                                   "model step (the model never began "
                                                   "it); the poll's verdict is the "
                                                   "stop policy's (9.6) on a querying "
                                                   "prefetch",
            "partial allocation": "DEV-S21: the hit drain allocates what the host holds "
                                  "after evicting (at least the threshold); mapped to a "
                                  "prefetch of the allocated pages",
            "prefetch completion": "DEV-S15: the drain that meets a finished transfer "
                                   "inserts the fetched pages and ends the prefetch",
            "timeout start": "DEV-S22: the timeout counts from the first admission poll "
                             "that waits (uncapped); the model's prefetch start is moved "
                             "to that poll",
            "host protection": "DEV-S6: one host lock per backup and per prefetch anchor "
                               "(mapped as in sglang-storage)",
            "rate limit": "DEV-S14: lifted on both sides",
        }
        self.avoid = {
            **self.avoid,
            "reset_with_storage_ops": "DEV-S9",
            "detach_with_ended_transfers_queued": "DEV-S18",
            "attach_with_pages_cached": "DEV-S16",
            "clear_with_backups_queued": "DEV-S20",
            "backup_of_stored_pages_outstanding": "DEV-S20",
            "fetch_below_a_device_only_page": "DEV-S5",
            "backup_run_partly_fitting_the_host": "DEV-7",
            "reprefetch_with_an_ended_result_queued":
                "DEV-S29: the hit drain matches a result to its prefetch by request "
                "handle; an ended prefetch's result revokes the request's next one",
        }

    def setup_storage(self) -> None:
        """The state the inherited storage calls keep (``sglang_storage``)."""
        import tempfile
        self.directory = tempfile.mkdtemp(prefix="hiradix-sglang-unified-l3-")
        self.hashes: dict[str, Key] = {}
        self.handles: dict[str, Any] = {}
        self.backup_issued: dict[int, tuple[Key, ...]] = {}
        self.attempt = 0

    # -- the storage calls that differ ------------------------------------------------

    def attach(self, settings: StorageSettings) -> str:
        seen = super().attach(settings)
        self.controller.prefetch_capacity_limit = NO_LIMIT
        return seen

    def drain_hits(self, count: int) -> None:
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=count, n_ack_prefetch=0, n_backup=0, n_release=0,
            extra_release_counts={}, log_metrics=False)

    def drain_backup_acks(self) -> None:
        """Only the backup acknowledgements (what DEV-S20's immediate ack drains)."""
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=0, n_ack_prefetch=0, n_backup=None, n_release=0,
            extra_release_counts={}, log_metrics=False)

    def releases_queued(self) -> bool:
        return not self.controller.host_mem_release_queue.empty()

    def drain_releases(self) -> None:
        """Only the host-slot releases (what the scheduler's next drain frees first)."""
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=0, n_ack_prefetch=0, n_backup=0, n_release=None,
            extra_release_counts={}, log_metrics=False)

    def entry(self, request: str) -> Any:
        """SGLang's ``_OngoingPrefetch`` of ``request``, or None."""
        return self.cache.ongoing_prefetch.get(self.handle(request))

    def has_prefetch(self, request: str) -> bool:
        return self.entry(request) is not None

    def awaiting_hits(self) -> dict[str, Any]:
        """The prefetches issued whose hit result is not drained yet (no host slots):
        request -> the operation its entry holds."""
        return {handle.rid: entry.operation
                for handle, entry in self.cache.ongoing_prefetch.items()
                if entry.host_indices is None}

    def queries_queued(self) -> bool:
        """Whether an operation waits for the prefetch thread's hit query."""
        return self.attached and not self.controller.prefetch_queue.empty()

    def query_pending(self, operation: Any) -> bool:
        """Whether ``operation`` still waits for the prefetch thread's hit query."""
        return self.attached and any(op is operation
                                     for op in list(self.controller.prefetch_queue.queue))

    def results_queued(self) -> list[Any]:
        """The hit results waiting for the scheduler's hit drain, oldest first."""
        if not self.attached:
            return []
        return [op for op in list(self.controller.prefetch_hit_queue.queue) if op is not None]

    def ended_queries(self) -> list[str]:
        """The requests whose current handle has an operation queued for the hit query
        or the hit drain that no prefetch entry holds any more (ended by a poll or a
        revoke): its result is looked up by that handle (DEV-S29)."""
        waiting = [op for op in list(self.controller.prefetch_queue.queue) if op is not None] \
            if self.attached else []
        return [op.request_id for op in waiting + self.results_queued()
                if not self.tracked(op) and op.handle == self.handle(op.request_id)]

    def release_aborted_request(self, request: str) -> None:
        """SGLang's abort; the request name then stands for a new request: a new handle
        (same rid, the next attempt), as the server's next request has a new rid and an
        aborted request never prefetches again."""
        super().release_aborted_request(request)
        old = self.handle(request)
        self.handles[request] = self.senv.modules["handle"].CacheRequestHandle(
            request, old.attempt_id + 1)

    def drain_one_hit(self) -> Any:
        """The scheduler's hit drain of the oldest hit result alone (a pass that counted
        one result queued); the operation drained."""
        operation = self.controller.prefetch_hit_queue.queue[0]
        self.drain_hits(1)
        return operation

    def io_queued(self) -> bool:
        """Whether a storage thread has input waiting, or a hit result the drain."""
        return super().io_queued() or bool(self.results_queued())

    def deadline_origin(self, request: str) -> int | None:
        """Where ``request``'s ``timeout`` deadline counts from: 0.5.20, the issue of its
        operation (``start_time``, as the spec); 0.5.23, the first waiting poll of the
        handle, if one was made (DEV-S22)."""
        if not self.v20:
            return self.waiting_since(request)
        entry = self.entry(request)
        return None if entry is None else int(entry.operation.start_time)

    def issue_prefetch(self, key: Key, node: Any, matched: int, request: str) -> Any:
        """``prefetch_from_storage`` alone, as the scheduler issues it after a match
        (anchor ``node``, ``matched`` tokens on device or host): its hit query and hit
        drain are left to the caller. The operation of the request's entry after the
        call: the one issued, the one already tracked (SGLang then issues none, DEV-S3),
        or None (none issued: the span is below the threshold)."""
        tokens = array("q", key.tokens[matched:])
        root = node is self.cache.root_node
        last_hash = None if root else self.cache.get_last_hash_value(node.id)
        self.cache.prefetch_from_storage(self.handle(request), node.id, tokens, last_hash,
                                         extra_key=key.namespace)
        entry = self.entry(request)
        return None if entry is None else entry.operation

    def prefetch(self, key: Key, node: Any, matched: int, request: str) -> tuple[int, int]:
        """Issue, hit query, hit drain: the hits found and the host slots allocated."""
        operation = self.issue_prefetch(key, node, matched, request)
        if operation is None:
            return 0, 0
        self.pump_query()
        hits = int(operation.storage_hit_count) // self.ps
        self.drain_hits(1)
        entry = self.entry(request)
        allocated = None if entry is None else entry.host_indices
        return hits, 0 if allocated is None else len(allocated)

    def query_hit_length(self, key: Key, node: Any, matched: int) -> int:
        root = node is self.cache.root_node
        last_hash = None if root else self.cache.get_last_hash_value(node.id)
        return int(self.cache.query_storage_hit_length(
            node.id, array("q", key.tokens[matched:]), last_hash, extra_key=key.namespace))

    def tracked(self, operation: Any) -> bool:
        """Whether ``operation`` is the one SGLang's prefetch entry for its handle holds
        (a transfer or an ack may outlive the prefetch that queued it, DEV-S18)."""
        entry = self.cache.ongoing_prefetch.get(operation.handle)
        return entry is not None and entry.operation is operation

    def ended_transfers(self) -> list[str]:
        queue = self.controller.prefetch_buffer
        waiting = [] if queue is None else [op for op in list(queue.queue) if op is not None]
        return [op.request_id for op in waiting if not self.tracked(op)]

    def current_acks(self) -> list[Any]:
        """The prefetch acknowledgements queued for a prefetch SGLang still tracks."""
        return [ack for ack in list(self.controller.ack_prefetch_queue.queue)
                if self.tracked(ack.operation)]

    def waiting_since(self, request: str) -> int | None:
        """The tick of the first admission poll that found ``request``'s prefetch
        unfinished under ``timeout`` (DEV-S22), or None."""
        if self.v20:
            return None  # 0.5.20 counts from the issue, as the spec
        wait = self.cache._storage_prefetch_wait.get(self.handle(request))
        if wait is None or wait.timer.started_at is None:
            return None
        return int(wait.timer.started_at)

    def deadline_expired(self, request: str) -> bool:
        """Whether a ``timeout`` deadline of ``request`` expired: SGLang issues no
        prefetch for that request again (DEV-S22)."""
        if self.v20:
            return False  # no deadline book in 0.5.20
        wait = self.cache._storage_prefetch_wait.get(self.handle(request))
        return wait is not None and bool(wait.expired)

    # -- what can be seen ---------------------------------------------------------------

    def _node_of(self, node_id: int) -> Any:
        return self.tree.node_by_id(node_id)

    def prefetches(self) -> dict[str, PrefetchView]:
        """The prefetches whose hit drain allocated host slots (``awaiting_hits``: the rest)."""
        return {handle.rid: self._view(handle.rid, entry)
                for handle, entry in self.cache.ongoing_prefetch.items()
                if entry.host_indices is not None}

    def _view(self, request: str, entry: Any) -> PrefetchView:
        """One ``_OngoingPrefetch``: its anchor page, and the pages its host slots
        were allocated for (none before the hit drain)."""
        anchor = self._page_of(self._node_of(entry.anchor_node_id))
        prefix = () if anchor is None else anchor.tokens
        slots = None if entry.host_indices is None else tuple(entry.host_indices.tolist())
        tokens = tuple(entry.prefetch_key.token_ids[:len(slots or ())])
        pages = tuple(Key(prefix + tokens[:end], entry.prefetch_key.extra_key)
                      for end in range(self.ps, len(tokens) + 1, self.ps))
        return PrefetchView(request, anchor, pages, slots)

    def writing_check(self) -> int:
        """The acknowledgements; remembers the pages each backup to storage they issue
        was issued for (its node may be split later)."""
        known = set(self.cache.ongoing_backup)
        acked = SglangUnifiedAdapter.writing_check(self)
        if self.attached:
            for op in list(self.controller.backup_queue.queue):
                if op is not None and op.id not in known:
                    self.backup_issued[op.id] = self._issued_pages(op)
        return acked

    def _issued_pages(self, op: Any) -> tuple[Key, ...]:
        """The pages of backup ``op``: the last ``len(op.token_ids)`` tokens of the
        path to the node it was issued on, page by page."""
        path = self._prefix(self._node_of(self.cache.ongoing_backup[op.id][0]))
        first = len(path.tokens) - len(op.token_ids)
        return tuple(Key(path.tokens[:first + end], path.namespace)
                     for end in range(self.ps, len(op.token_ids) + 1, self.ps))

    def backups(self) -> list[tuple[tuple[Key, ...], tuple[Key, ...]]]:
        return [(self.backup_issued.get(op_id, ()), self.locked_pages(node_id, receipt))
                for op_id, (node_id, receipt) in sorted(self.cache.ongoing_backup.items())]

    def anchors(self) -> list[tuple[Key, ...]]:
        root = self.cache.root_node
        return [self.locked_pages(e.anchor_node_id, e.anchor_lock_params)
                for e in self.cache.ongoing_prefetch.values()
                if self._node_of(e.anchor_node_id) is not root]

    def locked_pages(self, node_id: int, receipt: Any) -> tuple[Key, ...]:
        """The pages one host lock holds, root-most first: its node and, up to the
        node the receipt's boundary names, the upper parts splits made since (DEV-S23:
        0.5.23 keeps a split node's upper part locked, HiRadixCache does not, DEV-S6)."""
        node, root = self._node_of(node_id), self.cache.root_node
        nodes = [node]
        if self.v20:  # one node per lock, as HiRadixCache's (DEV-S6)
            return tuple(self._page_keys(node))
        boundary = receipt.get_lock_uuid(self.full, lock_host=True)
        while node.parent is not root and self._data(node).metadata.get(
                "host_uuid") != boundary:
            node = node.parent
            nodes.append(node)
        return tuple(k for n in reversed(nodes) for k in self._page_keys(n))

    def root_priority(self) -> int:
        """The priority a node hung under the root inherits (DEV-S17, UnifiedRadixCache form): the
        largest inserted since the reset, or the reset's sentinel, read as 0."""
        priority = int(self.cache.root_node.priority)
        return 0 if priority == -sys.maxsize else priority

    def observe(self, model: State) -> State:
        """The UnifiedRadixCache observation, with the root's reset sentinel that a
        prefetch hung under the root before any insert inherits read as 0 (DEV-S17)."""
        seen = SglangUnifiedAdapter.observe(self, model)
        return dataclasses.replace(seen, pages={
            k: dataclasses.replace(p, priority=0) if p.priority == -sys.maxsize else p
            for k, p in seen.pages.items()})

    def host_free_list(self) -> list[int]:
        self.host._merge_release_slots()
        return [int(s) for s in self.host.free_slots.tolist()]

    def occupied(self) -> tuple[int, int]:
        if not self.attached:
            return 0, 0
        return (int(self.controller.prefetch_tokens_occupied),
                sum(len(e.prefetch_key) for e in self.cache.ongoing_prefetch.values()))

    def loaded_tokens(self) -> Mapping[str, int]:
        return {h.rid: n for h, n in self.cache.prefetch_loaded_tokens_by_reqid.items()}


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    if engine != "sglang-unified-storage":
        raise ValueError(f"engine: {engine!r} is not adapted here")
    return lambda: SglangUnifiedStorageAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the adapter takes: those of the HiRadixCache storage adapter
    (its function reads no engine name)."""
    return sglang_storage.scenario_space(engine)
