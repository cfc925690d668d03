"""Adapter for SGLang 0.5.20's storage tier (L3): ``HiRadixCache`` with the ``file``
backend (``HiCacheFile``) attached at run time in a directory of its own.

The two-tier part is the HiRadixCache adapter's (``sglang.py``: its CPU patches, slot
mapping and DEV-5 / DEV-7 corrections). This module adds the storage tier as SGLang's
scheduler drives it -- ``attach_storage_backend`` / ``detach_storage_backend``,
``prefetch_from_storage`` from a match's ``last_host_node``, ``check_prefetch_progress``,
``release_aborted_request``, ``pop_prefetch_loaded_tokens``, the control-queue drain --
and reads back what spec/09 names: the pages on disk (by hash), the prefetches with
their host slots, the host slots the storage path holds, the backups in flight.

Why HiRadixCache and not UnifiedRadixCache: the storage path of HiRadixCache is one
file of scheduler-side bookkeeping over ``HiCacheController``'s four threads; the
UnifiedRadixCache of 0.5.20 and 0.5.23 adds buffer-only host memory, prefetch tickets
and deadlines over the same controller, which would need a mapping of its own.

**Deterministic I/O.** SGLang runs storage I/O on four threads (hit query, page
transfer, completion sync, backup). Here no thread is started: the controller module's
``threading.Thread`` is ``_InlineThread`` (start and join do nothing) and the
controller's stop event is ``_Quiescent``, which reads "stop" as soon as the queue
being pumped is empty. ``pump`` runs one of SGLang's own thread functions on the
calling thread until its input queue is empty, so every I/O step happens exactly where
the suite calls it, and Hypothesis can replay and shrink. Time: ``PrefetchOperation``'s
start time reads the suite's logical clock (DEV-S10), as HiRadixCache's timeout does.

Fixed here: ``tp_rank`` / ``pp_rank`` / ``attn_cp_rank`` 0 while attaching (the file
backend names its files by rank; no parallel state is published on CPU), and SGLang's
prefetch rate limit (``prefetch_capacity_limit``) is lifted: SGLang counts the tokens
requested, the spec the slots reserved (DEV-S14), so the limit is never reached on
either side.
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import tempfile
import threading
from array import array
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from queue import Queue
from types import SimpleNamespace
from typing import Any

from hiradix.conformance.scenario import Scenario
from hiradix.engines.protocol import EngineAdapter, probe_engine
from hiradix.engines.sglang.radix import SETUP, VERSIONS, SglangAdapter, _prepare
from hiradix_model import Key, State, StorageSettings

BACKEND = "file"
MODEL_NAME = "hiradix"
NO_LIMIT = 10 ** 9  # the prefetch rate limit, lifted on both sides (DEV-S14)
# Every spec strategy but ``priority``, which ranks prefetched root-level pages apart (DEV-S17).
STRATEGIES = ("lru", "lfu", "fifo", "mru", "filo", "slru")


class _InlineThread:
    """Stands in for ``threading.Thread`` in SGLang's cache controller: the suite runs
    each thread function itself (``pump``)."""

    def __init__(self, target: Callable[[], None] | None = None, daemon: bool | None = None,
                 **_: Any) -> None:
        self.target = target

    def start(self) -> None:
        pass

    def join(self, timeout: float | None = None) -> None:
        pass

    @staticmethod
    def is_alive() -> bool:
        return False


class _Quiescent:
    """The controller's ``storage_stop_event``: set when SGLang sets it, and also while
    a pumped thread function's input queue is empty, so that the function returns
    instead of waiting for more work."""

    def __init__(self) -> None:
        self.flag = False
        self.watching: Queue[Any] | None = None

    def set(self) -> None:
        self.flag = True

    def clear(self) -> None:
        self.flag = False

    def is_set(self) -> bool:
        return self.flag or (self.watching is not None and self.watching.empty())


_PATCHED = False


def _prepare_storage() -> Any:
    """The HiRadixCache environment with the controller's threads made inline (once)."""
    global _PATCHED
    env = _prepare()
    if not _PATCHED:
        import importlib
        controller = importlib.import_module("sglang.srt.managers.cache_controller")
        controller.threading = SimpleNamespace(Thread=_InlineThread, Event=threading.Event,
                                               Lock=threading.Lock)
        controller.time = env.clock  # PrefetchOperation.start_time (DEV-S10)
        for name, module in (("controller", "sglang.srt.managers.cache_controller"),
                             ("storage", "sglang.srt.mem_cache.hicache_storage"),
                             ("utils", "sglang.srt.mem_cache.utils"),
                             ("handle", "sglang.srt.mem_cache.base_prefix_cache"),
                             ("runtime", "sglang.srt.runtime_context")):
            env.modules[name] = importlib.import_module(module)
        _PATCHED = True
    return env


def probe(engine: str) -> str:
    """The installed SGLang version, if this adapter can drive its storage tier."""
    def load() -> None:
        env = _prepare_storage()
        cache = env.modules["hi"].HiRadixCache
        for name in ("attach_storage_backend", "detach_storage_backend",
                     "prefetch_from_storage", "check_prefetch_progress",
                     "release_aborted_request", "pop_prefetch_loaded_tokens",
                     "drain_storage_control_queues", "_drain_storage_control_queues_impl",
                     "query_storage_hit_length", "clear_storage_backend"):
            if not callable(getattr(cache, name, None)):
                raise AttributeError(f"HiRadixCache has no {name}")
        controller = env.modules["controller"].HiCacheController
        for name in ("prefetch_thread_func", "prefetch_io_aux_func",
                     "prefetch_sync_thread_func", "backup_thread_func"):
            if not callable(getattr(controller, name, None)):
                raise AttributeError(f"HiCacheController has no {name}")
    return probe_engine(engine, "sglang", VERSIONS, "HiRadixCache's storage tier", SETUP, load)


@dataclass(frozen=True)
class PrefetchView:
    """One prefetch SGLang still tracks (``ongoing_prefetch``), in the model's terms."""

    request: str
    anchor: Key | None
    pages: tuple[Key, ...]  # the pages its host slots were allocated for
    reserved: tuple[int, ...] | None  # host slots; None before the hit drain allocated


class SglangStorageAdapter(SglangAdapter):
    """HiRadixCache with a ``file`` storage backend, driven as SGLang's scheduler does."""

    def __init__(self, scenario: Scenario) -> None:
        self.senv = _prepare_storage()
        super().__init__(scenario, hierarchical=True)
        self.name = "sglang-storage"
        self.controller = self.cache.cache_controller
        self.controller.storage_stop_event = _Quiescent()
        self.directory = tempfile.mkdtemp(prefix="hiradix-sglang-l3-")
        self.hashes: dict[str, Key] = {}  # storage hash -> page (every key learned)
        self.handles: dict[str, Any] = {}
        self.backup_issued: dict[int, tuple[Key, ...]] = {}
        self.attempt = 0
        self.mapped = {
            **self.mapped,
            "storage threads": "no thread runs: each of SGLang's four storage thread "
                               "functions is pumped on the calling thread (inline)",
            "prefetch issue": "DEV-S14: SGLang allocates host slots when the scheduler "
                              "drains the hit query; issue, hit query and that drain are "
                              "one step, the model's prefetch_from_storage and "
                              "io_prefetch_query",
            "prefetch completion": "DEV-S15: the drain that meets a finished transfer "
                                   "inserts the fetched pages and ends the prefetch under "
                                   "every policy: the model's io_prefetch_fetch, "
                                   "terminate_prefetch where the policy would wait, then "
                                   "check_prefetch_progress",
            "host protection": "DEV-S6: SGLang protects one node per backup and per "
                               "prefetch anchor (a split leaves the upper part "
                               "unprotected); mapped to the spec's holders: a backup's "
                               "protection is replaced by the spec's write pages, which "
                               "must be among the pages the backup was issued for; an "
                               "anchor's protection counts on the node's last page",
            "priority": "DEV-S17: pages a prefetch hangs under the root inherit the "
                        "root's sentinel priority; read as 0 (the priority eviction "
                        "strategy is left out: the two rank such pages apart)",
            "rate limit": "DEV-S14: lifted on both sides (requested vs reserved tokens)",
        }
        self.avoid = {
            **self.avoid,
            "reset_with_storage_ops": "DEV-S9: reset() keeps ongoing_prefetch and "
                                      "ongoing_backup",
            "detach_with_ended_transfers_queued": "DEV-S18: detach stops the I/O before "
                                                  "the transfer of an ended prefetch "
                                                  "returns its slots; they leak",
            "prefetch_while_an_ended_transfer_of_the_request_is_queued":
                "DEV-S19: the completion ack of the ended prefetch would end the new "
                "one (acks are matched by request id)",
            "attach_with_pages_cached": "DEV-S16: pages inserted while detached carry no "
                                        "storage hash; a child hashed after attach is "
                                        "stored under its own tokens only",
            "clear_with_backups_queued": "DEV-S20: a queued backup rewrites every page of "
                                         "its node the clear removed (the spec's write "
                                         "holds the pages lacking at issue)",
            "backup_of_stored_pages_outstanding": "DEV-S20: SGLang protects the node of a "
                                                  "backup of pages all stored (the spec "
                                                  "issues no write); it runs and is "
                                                  "acknowledged at once",
            "fetch_below_a_device_only_page": "DEV-S5: SGLang hangs fetched pages below a "
                                              "cached page without a host copy; the "
                                              "prefetch is aborted before such a drain",
            "backup_run_partly_fitting_the_host": "DEV-7: SGLang backs up node by node and "
                                                  "keeps the nodes that fit; a request "
                                                  "whose run may not fit is not served",
        }

    # -- the storage calls ------------------------------------------------------------

    def handle(self, request: str) -> Any:
        """SGLang's request handle for ``request`` (one per request name)."""
        if request not in self.handles:
            self.handles[request] = self.senv.modules["handle"].CacheRequestHandle(request, 0)
        return self.handles[request]

    def attach(self, settings: StorageSettings) -> str:
        """``attach_storage_backend("file", ...)``: the model's observation."""
        extra = {"prefetch_threshold": settings.prefetch_threshold,
                 "prefetch_timeout_base": settings.timeout_base,
                 "prefetch_timeout_per_ki_token": settings.timeout_per_ki_token,
                 "prefetch_timeout_max": settings.timeout_max}
        saved = os.environ.get("SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR")
        os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = self.directory
        try:
            with self.senv.modules["runtime"].get_parallel().override(
                    tp_rank=0, pp_rank=0, attn_cp_rank=0):
                ok, message = self.cache.attach_storage_backend(
                    BACKEND, json.dumps(extra), MODEL_NAME, settings.prefetch_policy)
        finally:
            if saved is None:
                del os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"]
            else:
                os.environ["SGLANG_HICACHE_FILE_BACKEND_STORAGE_DIR"] = saved
        if not ok:
            raise AssertionError(f"{self.name}: attach refused: {message}")
        self.controller.prefetch_capacity_limit = NO_LIMIT
        return "policies updated" if "policies updated" in message else "attached"

    @property
    def attached(self) -> bool:
        return bool(self.cache.enable_storage)

    def detach(self) -> None:
        ok, message = self.cache.detach_storage_backend()
        if not ok:
            raise AssertionError(f"{self.name}: detach failed: {message}")

    def clear(self) -> bool:
        return bool(self.cache.clear_storage_backend())

    def pump(self, function: Callable[[], None], source: Queue[Any] | None) -> None:
        """Run one of the controller's thread functions until ``source`` is empty."""
        if source is None or source.empty():
            return
        stop = self.controller.storage_stop_event
        stop.watching = source
        try:
            function()
        finally:
            stop.watching = None

    def pump_query(self) -> None:
        c = self.controller
        self.pump(c.prefetch_thread_func, c.prefetch_queue)

    def pump_fetch(self) -> None:
        """The page transfers, then the completion sync that queues their acks."""
        c = self.controller
        self.pump(c.prefetch_io_aux_func, c.prefetch_buffer)
        self.pump(c.prefetch_sync_thread_func, c.prefetch_sync_queue)

    def pump_backup(self) -> None:
        c = self.controller
        self.pump(c.backup_thread_func, c.backup_queue)

    def io_queued(self) -> bool:
        """Whether any storage thread has input waiting."""
        c = self.controller
        return any(q is not None and not q.empty() for q in (
            c.prefetch_queue if self.attached else None, c.prefetch_buffer,
            c.prefetch_sync_queue, c.backup_queue if self.attached else None))

    def ended_transfers(self) -> list[str]:
        """The requests of transfers waiting in the I/O queue for a prefetch already
        ended (by a poll or an abort): only their completion acks free their slots
        (DEV-S18), and those acks name the request, not the operation (DEV-S19)."""
        buffer = self.controller.prefetch_buffer
        ended = []
        for operation in [] if buffer is None else list(buffer.queue):
            if operation is None:
                continue
            entry = self.cache.ongoing_prefetch.get(operation.request_id)
            if entry is None or entry[2] is not operation:
                ended.append(operation.request_id)
        return ended

    def ended_transfers_queued(self) -> bool:
        return bool(self.ended_transfers())

    def drain_hits(self, count: int) -> None:
        """The scheduler's drain of ``count`` hit-query results (allocation), alone."""
        self.cache._drain_storage_control_queues_impl(
            n_storage_hit=count, n_ack_prefetch=0, n_backup=0, n_release=0,
            log_metrics=False)

    def drain(self) -> None:
        """``drain_storage_control_queues()``: every queue, as ``check_hicache_events``."""
        self.cache.drain_storage_control_queues()

    def prefetch(self, key: Key, node: Any, matched: int, request: str) -> tuple[int, int]:
        """``prefetch_from_storage`` as the scheduler issues it after a match (anchor
        ``node``, ``matched`` tokens on device or host), then the hit query and its
        drain. The hit pages the query found and the host slots allocated."""
        tokens = array("q", key.tokens[matched:])
        last_hash = None if node is self.cache.root_node else node.get_last_hash_value()
        self.cache.prefetch_from_storage(self.handle(request), node, tokens, last_hash,
                                         extra_key=key.namespace)
        entry = self.cache.ongoing_prefetch.get(request)
        if entry is None:
            return 0, 0
        operation = entry[2]
        self.pump_query()
        hits = int(operation.storage_hit_count) // self.ps
        self.drain_hits(1)
        allocated = operation.host_indices
        return hits, 0 if allocated is None or request not in self.cache.ongoing_prefetch \
            else len(allocated)

    def check_prefetch_progress(self, request: str) -> bool:
        return bool(self.cache.check_prefetch_progress(self.handle(request)))

    def release_aborted_request(self, request: str) -> None:
        self.cache.release_aborted_request(self.handle(request))

    def pop_prefetch_loaded_tokens(self, request: str) -> int:
        return int(self.cache.pop_prefetch_loaded_tokens(self.handle(request)))

    def query_hit_length(self, key: Key, node: Any, matched: int) -> int:
        last_hash = None if node is self.cache.root_node else node.get_last_hash_value()
        return int(self.cache.query_storage_hit_length(node, array("q", key.tokens[matched:]),
                                                       last_hash, extra_key=key.namespace))

    # -- what can be seen ---------------------------------------------------------------

    def learn(self, key: Key) -> None:
        """Remember the storage hash of every whole page of ``key`` (spec/09 page
        identity: the hash of page j chains the hashes of the pages before it)."""
        aligned = len(key.tokens) - len(key.tokens) % self.ps
        if not aligned:
            return
        radix = self.senv.modules["radix"].RadixKey(list(key.tokens[:aligned]),
                                                     extra_key=key.namespace)
        hashes = self.senv.modules["utils"].get_storage_hash_str(radix, None,
                                                                  page_size=self.ps)
        for index, page_hash in enumerate(hashes):
            self.hashes[page_hash] = Key(key.tokens[:(index + 1) * self.ps], key.namespace)

    def stored_pages(self) -> frozenset[Key]:
        """The pages whose files are on disk; a hash the suite never computed becomes a
        page no key has (tokens (-1,)), so that it shows in the comparison."""
        found = set()
        for name in os.listdir(self.directory):
            if not name.endswith(".bin"):
                continue  # a write in progress (.tmp)
            page_hash = name.split("_", 1)[0]
            found.add(self.hashes.get(page_hash, Key((-1,), f"<unknown hash {page_hash}>")))
        return frozenset(found)

    def prefetches(self) -> dict[str, PrefetchView]:
        views = {}
        for request, (node, key, operation) in self.cache.ongoing_prefetch.items():
            anchor = self._page_of(node)
            base = () if anchor is None else anchor.tokens
            host = operation.host_indices
            pages = 0 if host is None else len(host) // self.ps
            views[request] = PrefetchView(
                request, anchor,
                tuple(Key(base + tuple(key.token_ids[:(i + 1) * self.ps]), key.extra_key)
                      for i in range(pages)),
                None if host is None else tuple(host.tolist()))
        return views

    def writing_check(self) -> int:
        """As HiRadixCache's, remembering the pages of each backup to storage that the
        acknowledgements issue (its node may be split later, DEV-S6)."""
        before = set(self.cache.ongoing_backup)
        acked = super().writing_check()
        queued = {op.id: op for op in list(self.controller.backup_queue.queue)
                  if op is not None} if self.attached else {}
        for op_id, node in self.cache.ongoing_backup.items():
            if op_id not in before:
                # The backup covers the run acknowledged, which ends at ``node`` and may
                # span nodes a split made since the copy was issued.
                prefix = self._prefix(node)
                start = len(prefix.tokens) - len(queued[op_id].token_ids)
                self.backup_issued[op_id] = tuple(
                    Key(prefix.tokens[:end], prefix.namespace)
                    for end in range(start + self.ps, len(prefix.tokens) + 1, self.ps))
        return acked

    def backups(self) -> list[tuple[tuple[Key, ...], tuple[Key, ...]]]:
        """Each backup SGLang has issued and not released, in issue order: the pages it
        was issued for, and the pages of the node its protection sits on now."""
        return [(self.backup_issued.get(op_id, ()), tuple(self._page_keys(node)))
                for op_id, node in sorted(self.cache.ongoing_backup.items())]

    def anchors(self) -> list[tuple[Key, ...]]:
        """The pages of the node each ongoing prefetch protects (its anchor)."""
        return [tuple(self._page_keys(node)) for node, _, _ in
                self.cache.ongoing_prefetch.values() if node is not self.cache.root_node]

    def host_free_list(self) -> list[int]:
        """The host pool's free slots with repeats (a slot freed twice shows twice)."""
        self.cache.token_to_kv_pool_host._merge_release_slots()
        return [int(s) for s in self.cache.token_to_kv_pool_host.free_slots.tolist()]

    def occupied(self) -> tuple[int, int]:
        """SGLang's ``prefetch_tokens_occupied`` and what its ongoing prefetches request."""
        if not self.attached:
            return 0, 0
        return (int(self.controller.prefetch_tokens_occupied),
                sum(len(key) for _, key, _ in self.cache.ongoing_prefetch.values()))

    def loaded_tokens(self) -> Mapping[str, int]:
        return dict(self.cache.prefetch_loaded_tokens_by_reqid)

    def observe(self, model: State) -> State:
        """The HiRadixCache observation, with the root's sentinel priority that a
        prefetch inserted under the root inherits read as the spec's 0 (DEV-S17)."""
        seen = super().observe(model)
        sentinel = self.cache.root_node.priority
        return dataclasses.replace(seen, pages={
            k: dataclasses.replace(p, priority=0) if p.priority == sentinel else p
            for k, p in seen.pages.items()})

    def close(self) -> None:
        super().close()
        shutil.rmtree(self.directory, ignore_errors=True)


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    if engine != "sglang-storage":
        raise ValueError(f"engine: {engine!r} is not adapted here")
    return lambda: SglangStorageAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the adapter takes (the suite's CLI uses it)."""
    return {"host_layout": ("layer_first",), "kv_layout": ("mha",),
            "write_policy": ("write_through", "write_through_selective"),
            "eviction": STRATEGIES}
