"""The cache-side storage tier: prefetch into reserved host slots, backup of host copies.

``StorageTier`` composes with a ``HiRadixCache`` (it does not subclass or edit it), which
it sees only through the ``CachePort`` protocol (``hiradix.storage.cache_port``: it never
imports ``hiradix.cache``), and transcribes spec/09 onto the radix tree:

- ``attach`` / ``detach`` / ``clear`` (9.4): validation is complete before any effect;
- ``query_storage_hit_length`` and ``prefetch_from_storage`` (9.4): host room for the
  shortfall only (DEV-S7), shrunk page aligned to what fits, rate limited, anchor
  host-protected while the prefetch is ongoing (INV-HOST-PROTECT-HOLDERS);
- ``check_prefetch_progress`` under ``best_effort`` / ``wait_complete`` / ``timeout``
  (9.6), the timeout linear and capped on the cache's logical clock, in exact integers
  (DEV-S10); only the landed contiguous prefix is inserted, as host-only pages (S-R4,
  DEV-S5); every other reserved slot is given up exactly once (S-R2, INV-RELEASE-ONCE);
- ``terminate_prefetch``, ``release_aborted_request``, ``pop_prefetch_loaded_tokens``;
- ``writing_check``: the cache's ``writing_check`` followed by S-R1: the pages of each
  acknowledged device-to-host copy that the backend lacks are written to storage, each
  host-protected until the write's acknowledgement is drained (INV-STORAGE-WRITE-PROTECT);
- ``drain_storage_queues``: the I/O's results, then the revoke, ack and release queues.

Many ranks (spec/12): every decision that rests on a rank's own pools, I/O or store (the
hit length, the reservation's room, whether a prefetch may end and what landed, which
prefetches are revoked, which pages are stored, which writes are acknowledged) goes
through the cache's ``RankSync``, so every rank's tier and tree stay alike.

Slots the I/O is still writing into are never freed: a prefetch ended while its I/O
runs hands the slots past its landed pages to the I/O, and they reach the release queue
with the I/O's result (DEV-S12, DEV-S13). Protections are kept per page: a page run is
resolved to nodes (splitting at its ends) when it is protected and again when it is
released, so a split in between cannot misplace a count.

Typed errors (``StorageArgumentError``) are raised before any change.

Threads (spec/09, 9.4 "Threads"): every public method holds ``lock``, one re-entrant lock
(the cache calls back into the tier from inside a tier call), so scheduler threads may
call the tier concurrently; they are served one at a time. The cache itself is not
thread-safe: a caller that also calls the cache from several threads holds ``lock``
around those calls too.

Timeouts (spec/09, 9.1 "Which clock counts what"): the ``timeout`` policy counts ticks of
``timeout_clock``; recency stamps are always the cache's logical clock.
"""

from __future__ import annotations

import functools
import math
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Concatenate, Literal, ParamSpec, TypeVar

import torch

from hiradix._slots import is_int
from hiradix.clock import Clock, ManualClock, MonotonicClock
from hiradix.events import EventKind, KVEvent
from hiradix.keys import RadixKey
from hiradix.storage.backend import StorageBackend
from hiradix.storage.cache_port import CachePort
from hiradix.storage.config import PREFETCH_POLICIES, PrefetchPolicy, StorageConfig
from hiradix.storage.errors import StorageArgumentError
from hiradix.storage.hashing import PageIdentity, page_hashes
from hiradix.storage.io import BackupResult, PrefetchResult, StorageIO
from hiradix.tree import TreeNode, split

Phase = Literal["querying", "fetching", "stopped", "revoked"]
WritePhase = Literal["running", "acked"]
Destination = Literal["free", "queue", "tree", "io"]
Params = ParamSpec("Params")
Returned = TypeVar("Returned")


@dataclass(frozen=True, slots=True)
class TierSettings:
    """The constants of spec/09, 9.1, in logical ticks (``from_config`` converts a
    ``StorageConfig``'s seconds at ``ticks_per_second``)."""

    prefetch_threshold: int = 256
    prefetch_policy: PrefetchPolicy = "best_effort"
    timeout_base: int = 2000
    timeout_per_ki_token: int = 100
    timeout_max: int = 30000
    prefetch_token_limit: int | None = None

    def __post_init__(self) -> None:
        for name in ("prefetch_threshold", "timeout_base", "timeout_per_ki_token",
                     "timeout_max"):
            value = getattr(self, name)
            if not is_int(value) or value < 0:
                raise StorageArgumentError(name, f"must be an int >= 0, got {value!r}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise StorageArgumentError("prefetch_policy", f"must be one of "
                                                          f"{PREFETCH_POLICIES}, got "
                                                          f"{self.prefetch_policy!r}")
        limit = self.prefetch_token_limit
        if limit is not None and (not is_int(limit) or limit < 0):
            raise StorageArgumentError("prefetch_token_limit",
                                       f"must be None or an int >= 0, got {limit!r}")
        if self.timeout_max < self.timeout_base:  # a cap below the base is a typo
            raise StorageArgumentError("timeout_max", f"must be >= timeout_base "
                                                      f"({self.timeout_base}), got "
                                                      f"{self.timeout_max}")

    @classmethod
    def from_config(cls, config: StorageConfig, ticks_per_second: int = 1000) -> TierSettings:
        """The settings of ``config``, its seconds as ticks of a clock that counts
        ``ticks_per_second`` (1000: the tier's default ``MonotonicClock``)."""
        if not isinstance(config, StorageConfig):
            raise StorageArgumentError("config", f"must be a StorageConfig, got "
                                                 f"{type(config).__name__}")
        if not is_int(ticks_per_second) or ticks_per_second < 1:
            raise StorageArgumentError("ticks_per_second", f"must be an int >= 1, got "
                                                           f"{ticks_per_second!r}")
        def ticks(seconds: float) -> int:
            # A finite number of seconds is a finite (perhaps huge) tick count: exact
            # where the float product overflows to inf (timeout_max_s=1e308).
            product = seconds * ticks_per_second
            return (round(product) if math.isfinite(product)
                    else round(Fraction(seconds) * ticks_per_second))
        return cls(prefetch_threshold=config.prefetch_threshold_tokens,
                   prefetch_policy=config.prefetch_policy,
                   timeout_base=ticks(config.timeout_base_s),
                   timeout_per_ki_token=ticks(config.timeout_per_1k_tokens_s),
                   timeout_max=ticks(config.timeout_max_s),
                   prefetch_token_limit=config.max_prefetch_tokens_in_flight)

    def timed_out(self, elapsed: int, tokens: int) -> bool:
        """9.1: ``1024 * elapsed > min(1024 * max, 1024 * base + per_ki * tokens)``."""
        limit = min(1024 * self.timeout_max,
                    1024 * self.timeout_base + self.timeout_per_ki_token * tokens)
        return 1024 * elapsed > limit


@dataclass
class TierMetrics:
    """Counters of the tier since it was made."""

    prefetches_started: int = 0
    prefetches_revoked: int = 0
    prefetches_ended: int = 0
    prefetches_aborted: int = 0
    prefetch_timeouts: int = 0
    prefetch_tokens_reserved: int = 0
    prefetch_tokens_inserted: int = 0
    prefetch_errors: int = 0
    writes_issued: int = 0
    write_pages_issued: int = 0
    write_errors: int = 0
    hit_query_errors: int = 0  # query_storage_hit_length answered 0 on a backend error
    stored_check_errors: int = 0  # a backup's "already stored?" check failed: written


@dataclass(frozen=True, slots=True)
class PageRun:
    """Pages ``[start, end)`` of ``key`` (page indices)."""

    key: RadixKey
    start: int
    end: int


@dataclass
class TierPrefetch:
    """One ongoing prefetch (spec/09 ``Prefetch``)."""

    id: int
    request: str
    key: RadixKey
    anchor: int  # pages of ``key`` above the fetched ones; 0: the root
    pages: int  # pages reserved for: key pages [anchor, anchor + pages)
    reserved: torch.Tensor
    owned: int  # leading pages whose slots it still owns
    start: int
    phase: Phase = "querying"
    hit_pages: int | None = None
    landed: int = 0
    terminated: bool = False
    io_running: bool = True  # the I/O holds the slots past ``landed`` until its result


@dataclass
class TierWrite:
    """One backup to storage not yet released (spec/09 ``StorageWrite``)."""

    id: int
    pages: list[PageRun]  # one-page runs, root-most first
    done: int = 0
    phase: WritePhase = "running"


@dataclass
class _Attachment:
    backend: StorageBackend
    io: StorageIO
    identity: PageIdentity
    settings: TierSettings


@dataclass
class TierState:
    prefetches: dict[str, TierPrefetch] = field(default_factory=dict)
    writes: dict[int, TierWrite] = field(default_factory=dict)
    revoke_queue: list[int] = field(default_factory=list)
    release_queue: list[int] = field(default_factory=list)
    # Queued slots the I/O of a prefetch (by id) may still be writing: not freed by a
    # drain until that I/O's result has come.
    io_held: dict[int, list[int]] = field(default_factory=dict)
    occupied_tokens: int = 0
    loaded_tokens: dict[str, int] = field(default_factory=dict)
    release_log: list[tuple[int, int]] = field(default_factory=list)
    next_id: int = 0


def _serialised(method: Callable[Concatenate[StorageTier, Params], Returned]
                ) -> Callable[Concatenate[StorageTier, Params], Returned]:
    """``method`` run under the tier's lock (see the module docstring), as one operation
    of the cache's event channel: its KV events reach the sink once it has returned, the
    state whole (spec/11, 11.7)."""
    @functools.wraps(method)
    def locked(self: StorageTier, /, *args: Params.args, **kwargs: Params.kwargs
               ) -> Returned:  # ``self`` positional only, as ``Concatenate`` says
        with self.lock:
            return self.cache.event_channel.run(method, self, *args, **kwargs)
    return locked


def _require_request(request: object) -> str:
    if not isinstance(request, str) or not request:
        raise StorageArgumentError("request", f"must be a non-empty str, got {request!r}")
    return request


class StorageTier:
    """The storage tier of ``cache`` (spec/09). One per cache.

    ``timeout_clock`` counts the ``timeout`` policy's ticks. None: the cache's clock when
    it is a ``ManualClock`` (tests, replay, the conformance layer: logical ticks the
    caller sets, exactly reproducible), else a ``MonotonicClock`` in milliseconds (an
    engine: the cache's default ``CountingClock`` counts operations, not time)."""

    def __init__(self, cache: CachePort, *, timeout_clock: Clock | None = None) -> None:
        if not isinstance(cache, CachePort):
            raise StorageArgumentError("cache", f"must be a cache with the storage port "
                                                f"(hiradix.storage.cache_port.CachePort: a "
                                                f"HiRadixCache), got {type(cache).__name__}")
        if timeout_clock is None:
            timeout_clock = (cache.clock if isinstance(cache.clock, ManualClock)
                             else MonotonicClock())
        elif not isinstance(timeout_clock, Clock):
            raise StorageArgumentError("timeout_clock", f"must be a Clock (a now() -> int), "
                                                        f"got {type(timeout_clock).__name__}")
        self.timeout_clock: Clock = timeout_clock
        self.lock = threading.RLock()
        self.cache = cache
        self.page_size = cache.page_size
        self.metrics = TierMetrics()
        self.state = TierState()
        self._attached: _Attachment | None = None
        self.last_host_victims: list[tuple[str | None, tuple[int, ...]]] = []
        cache.on_reset = self._on_reset

    @_serialised
    def _on_reset(self) -> None:
        """9.4 ``reset``, the storage part (the cache calls it first). The I/O is stopped,
        so no operation moves a page after this (its results are discarded with the tree)
        and is restarted for the same backend; the attachment, the stored pages and the id
        counter are kept, every prefetch, write and queue entry is dropped."""
        attachment = self._attached
        if attachment is not None:
            old = attachment.io
            old.shutdown()
            old.drain_prefetch()
            old.drain_backup()
            attachment.io = StorageIO(attachment.backend, self.cache.host_pool,
                                      threaded=old.threaded, batch_pages=old.batch_pages)
        self.state = TierState(next_id=self.state.next_id)
        self.last_host_victims = []

    # ------------------------------------------------------------------ attach

    @property
    def attached(self) -> bool:
        return self._attached is not None

    @property
    def backend(self) -> StorageBackend | None:
        return None if self._attached is None else self._attached.backend

    @property
    def io(self) -> StorageIO | None:
        return None if self._attached is None else self._attached.io

    @property
    def settings(self) -> TierSettings | None:
        return None if self._attached is None else self._attached.settings

    @property
    def identity(self) -> PageIdentity | None:
        return None if self._attached is None else self._attached.identity

    @_serialised
    def attach(self, backend: StorageBackend, model_identity: str,
               settings: TierSettings | None = None, *, threaded: bool = True,
               batch_pages: int = 1) -> Literal["attached", "policies updated"]:
        """9.4 ``attach_storage``. Re-attaching the attached backend only replaces the
        prefetch policy ("policies updated"); another backend, another model identity,
        or another ``threaded`` or ``batch_pages`` while one is attached is an error
        (detach first): nothing is silently ignored. Everything is validated before
        anything changes."""
        if not isinstance(backend, StorageBackend):
            raise StorageArgumentError("backend", f"must be a StorageBackend, got "
                                                  f"{type(backend).__name__}")
        if not isinstance(model_identity, str) or not model_identity:
            raise StorageArgumentError("model_identity", f"must be a non-empty str, got "
                                                         f"{model_identity!r}")
        checked = TierSettings() if settings is None else settings
        if not isinstance(checked, TierSettings):
            raise StorageArgumentError("settings", f"must be TierSettings, got "
                                                   f"{type(settings).__name__}")
        if self._attached is not None:
            self._check_reattach(backend, model_identity, threaded, batch_pages)
            current = self._attached.settings
            self._attached.settings = TierSettings(
                current.prefetch_threshold, checked.prefetch_policy, current.timeout_base,
                current.timeout_per_ki_token, current.timeout_max,
                current.prefetch_token_limit)
            return "policies updated"
        identity = PageIdentity.for_pool(self.cache.host_pool, model_identity)
        io = StorageIO(backend, self.cache.host_pool, threaded=threaded,
                       batch_pages=batch_pages)  # validates threaded and batch_pages
        self._attached = _Attachment(backend, io, identity, checked)
        self.cache.on_write_back = self._backup_written_back
        return "attached"

    def _check_reattach(self, backend: StorageBackend, model_identity: str, threaded: object,
                        batch_pages: object) -> None:
        """A re-attach may change the prefetch policy only (9.4)."""
        attached = self._attached
        assert attached is not None
        if backend is not attached.backend:
            raise StorageArgumentError("backend", f"{attached.backend.name!r} is "
                                                  "attached; detach it first")
        if model_identity != attached.identity.model:
            raise StorageArgumentError("model_identity", f"{attached.identity.model!r} is "
                                                         f"attached, not {model_identity!r}: "
                                                         "detach before changing the model")
        if threaded != attached.io.threaded:
            raise StorageArgumentError("threaded", f"the attached I/O has threaded="
                                                   f"{attached.io.threaded}; detach first")
        if batch_pages != attached.io.batch_pages:
            raise StorageArgumentError("batch_pages", f"the attached I/O has batch_pages="
                                                      f"{attached.io.batch_pages}; detach "
                                                      "first")

    @_serialised
    def detach(self) -> None:
        """9.4 ``detach_storage``: drain, stop the I/O (every operation gets its result),
        free what each prefetch still owns once (DEV-S1), drop the write protections."""
        if self._attached is None:
            return
        self.drain_storage_queues()
        for prefetch in self.state.prefetches.values():
            if prefetch.io_running:
                self._attached.io.terminate(prefetch.id)
        self._attached.io.shutdown()
        self._poll()
        for prefetch in list(self.state.prefetches.values()):
            self._give_up(prefetch, 0, "free")
            self._end(prefetch)
        self.drain_storage_queues()
        for write in list(self.state.writes.values()):
            self._release_write(write)
        assert not self.state.io_held, self.state.io_held
        self.cache.on_write_back = None
        self._attached = None
        if self.cache.event_channel.enabled:  # no stored page is this cache's to read now
            self.cache.event_channel.emit(KVEvent("cleared", "storage"))

    @_serialised
    def clear(self) -> bool:
        """9.4 ``clear_storage``: forget every stored page; False if detached."""
        if self._attached is None:
            return False
        self._attached.backend.clear()
        if self.cache.event_channel.enabled:
            self.cache.event_channel.emit(KVEvent("cleared", "storage"))
        return True

    # ------------------------------------------------------------------ helpers

    def _require(self) -> _Attachment:
        if self._attached is None:
            raise StorageArgumentError("backend", "no storage backend is attached")
        return self._attached

    def _hashes(self, key: RadixKey, identity: PageIdentity) -> list[str]:
        aligned = key.aligned_length(self.page_size)
        return page_hashes(list(key.tokens[:aligned]), self.page_size, identity,
                           key.namespace)

    def _limit(self, settings: TierSettings) -> int:
        if settings.prefetch_token_limit is not None:
            return settings.prefetch_token_limit
        return 4 * (self.cache.host_pool.num_slots - self.cache.device_pool.num_slots) // 5

    def _worth(self, settings: TierSettings, pages: int) -> bool:
        """9.1 "worth prefetching" (attached is the caller's business)."""
        return (pages > 0 and self.page_size * pages >= settings.prefetch_threshold
                and self.state.occupied_tokens < self._limit(settings))

    def _anchor_depth(self, key: RadixKey, anchor: object) -> int:
        """Pages of ``key`` at and above the anchor node (the root: 0)."""
        if not isinstance(key, RadixKey):
            raise StorageArgumentError("key", f"must be a RadixKey, got {type(key).__name__}")
        if anchor is None or anchor is self.cache.root:
            return 0
        node = self.cache.require_node(anchor, "anchor")
        prefix = node.prefix()
        if node.namespace != key.namespace or key.tokens[:len(prefix)] != prefix \
                or len(prefix) > key.aligned_length(self.page_size):
            raise StorageArgumentError("anchor", f"{node!r} is not a page of the key")
        if node.host is None:
            raise StorageArgumentError("anchor", f"{node!r} has no host copy")
        return len(prefix) // self.page_size

    def _run_nodes(self, run: PageRun) -> list[TreeNode]:
        """The nodes covering exactly ``run`` (split at its ends); all must be cached."""
        size = self.page_size
        nodes = self.cache.descend(run.key, run.end * size)
        covered, position = [], 0
        for node in nodes:
            low, high = position, position + node.length
            position = high
            if high <= run.start * size:
                continue
            if low < run.start * size:
                upper = split(node, run.start * size - low, size)
                self.cache.refresh_leaf_sets_around(upper)
            covered.append(node)
        assert position == run.end * size, f"run {run} is not cached"
        return covered

    def _protect(self, run: PageRun, delta: int) -> None:
        for node in self._run_nodes(run):
            node.host_ref += delta
            assert node.host_ref >= 0, node
            self.cache.refresh_leaf_sets(node)

    def _give_up(self, prefetch: TierPrefetch, keep: int, to: Destination) -> None:
        """S-R2: the slots of pages ``keep`` on leave the prefetch, logged once each."""
        if keep >= prefetch.owned:
            return
        size = self.page_size
        slots = prefetch.reserved[keep * size:prefetch.owned * size]
        listed = slots.tolist()
        prefetch.owned = keep
        self.state.release_log.extend((prefetch.id, slot) for slot in listed)
        if to == "free":
            self.cache.host_pool.release(slots)
        elif to == "queue":
            self.state.release_queue.extend(listed)
        elif to == "io":
            self.state.release_queue.extend(listed)
            self.state.io_held.setdefault(prefetch.id, []).extend(listed)

    def _end(self, prefetch: TierPrefetch) -> None:
        """S-R3."""
        assert prefetch.owned == 0, prefetch
        del self.state.prefetches[prefetch.request]
        if prefetch.anchor > 0:
            self._protect(PageRun(prefetch.key, prefetch.anchor - 1, prefetch.anchor), -1)
        self.state.occupied_tokens -= prefetch.pages * self.page_size

    def _by_id(self, prefetch_id: int) -> TierPrefetch | None:
        return next((p for p in self.state.prefetches.values() if p.id == prefetch_id), None)

    # ------------------------------------------------------------------ prefetch

    @_serialised
    def query_storage_hit_length(self, key: RadixKey, anchor: TreeNode | None = None) -> int:
        """9.4: tokens of the leading pages below ``anchor`` that storage holds; 0 if not
        worth prefetching or detached. A backend error of any ``Exception`` type answers
        0 (counted in ``metrics.hit_query_errors``); an interrupt goes through."""
        depth = self._anchor_depth(key, anchor)
        if self._attached is None:
            return 0
        hashes = self._hashes(key, self._attached.identity)[depth:]
        if not self._worth(self._attached.settings, len(hashes)):
            return 0
        try:
            hits = self._attached.backend.exists(hashes)
        except Exception:  # the docstring's "answers 0": a question, not a failure
            self.metrics.hit_query_errors += 1
            hits = 0
        # Every rank asks, a failed one too: the hit length is the ranks' minimum (12.3).
        return self.page_size * self.cache.sync.min(hits, "storage hit")

    @_serialised
    def prefetch_from_storage(self, request: str, key: RadixKey,
                              anchor: TreeNode | None = None) -> int:
        """9.4: reserve host slots for the pages of ``key`` below ``anchor`` (the deepest
        matched node with a host copy, or None) and start fetching them; return the tokens
        reserved (0: nothing started)."""
        request = _require_request(request)
        depth = self._anchor_depth(key, anchor)
        attachment = self._require()
        if request in self.state.prefetches:
            raise StorageArgumentError("request", f"{request!r} has a prefetch ongoing "
                                                  "(DEV-S3)")
        now = self.cache.now()
        self.last_host_victims = []
        hashes = self._hashes(key, attachment.identity)[depth:]
        settings = attachment.settings
        if not self._worth(settings, len(hashes)):
            return 0
        size = self.page_size
        anchor_run = PageRun(key, depth - 1, depth)
        if depth > 0:
            self._protect(anchor_run, +1)
        # The shortfall only (DEV-S7); the victims are kept for the conformance layer.
        self.last_host_victims = self.cache.make_host_room(size * len(hashes))
        free = self.cache.sync.min(self.cache.host_pool.num_free_slots, "prefetch room")
        fit = min(len(hashes), free // size)
        if fit == 0 or size * fit < settings.prefetch_threshold:
            if depth > 0:
                self._protect(anchor_run, -1)
            return 0
        reserved = self.cache.host_pool.alloc(size * fit)
        assert reserved is not None
        state = self.state
        prefetch = TierPrefetch(state.next_id, request, key, depth, fit, reserved, fit,
                                self._timeout_now(now))
        state.next_id += 1
        state.prefetches[request] = prefetch
        state.occupied_tokens += size * fit
        min_pages = max(1, math.ceil(settings.prefetch_threshold / size))
        attachment.io.submit_prefetch(prefetch.id, hashes[:fit], reserved,
                                      min_pages=min_pages)
        self.metrics.prefetches_started += 1
        self.metrics.prefetch_tokens_reserved += size * fit
        return size * fit

    def _on_prefetch(self, result: PrefetchResult) -> None:
        """The I/O's report on a prefetch (9.5): slots past the hits and past the landed
        pages go to the release queue; too few hits revoke it."""
        assert isinstance(result.op_id, int)
        self.state.io_held.pop(result.op_id, None)  # those queued slots may be freed now
        prefetch = self._by_id(result.op_id)
        if prefetch is not None and result.corrupt and self.cache.event_channel.enabled:
            # The backend discarded the page after the landed ones (DEV-S11; spec/11).
            page = prefetch.anchor + result.pages_done
            self._emit("removed", PageRun(prefetch.key, page, page + 1))
        if prefetch is None or not prefetch.io_running:
            return
        prefetch.io_running = False
        if prefetch.terminated:  # it gave up its slots at terminate_prefetch (DEV-S12)
            return
        if result.error is not None:
            self.metrics.prefetch_errors += 1
        if result.revoked or (result.pages_hit == 0 and not result.terminated):
            self._give_up(prefetch, 0, "queue")
            prefetch.phase = "revoked"
            prefetch.hit_pages = 0
            self.state.revoke_queue.append(prefetch.id)
            self.metrics.prefetches_revoked += 1
            return
        if prefetch.hit_pages is None and not result.terminated:
            prefetch.hit_pages = result.pages_hit
            self._give_up(prefetch, result.pages_hit, "queue")  # past the hits first (9.5)
        prefetch.landed = max(prefetch.landed, result.pages_done)
        self._give_up(prefetch, prefetch.landed, "queue")
        prefetch.phase = "stopped"

    def _on_backup(self, result: BackupResult) -> None:
        assert isinstance(result.op_id, int)
        write = self.state.writes[result.op_id]
        write.done = result.pages_done
        write.phase = "acked"
        if self.cache.event_channel.enabled:  # the pages handled are in storage (spec/11)
            for run in write.pages[:write.done]:
                self._emit("stored", run)
        if result.error is not None:
            self.metrics.write_errors += 1

    def _poll(self) -> None:
        """Take the I/O's results (never blocks)."""
        if self._attached is None:
            return
        self.accept(self._attached.io.drain_prefetch(), self._attached.io.drain_backup())

    @_serialised
    def accept(self, prefetches: list[PrefetchResult], backups: list[BackupResult]) -> None:
        """Apply I/O results the caller drained from ``io`` itself (the conformance layer
        does, to report each to the model first); prefetches first, as ``run_pending``.
        Every result must answer an operation this tier issued and has not yet heard
        from; all are checked before any is applied."""
        self._require_results(prefetches, backups)
        for prefetch_result in prefetches:
            self._on_prefetch(prefetch_result)
        for backup_result in backups:
            self._on_backup(backup_result)

    def _require_results(self, prefetches: object, backups: object) -> None:
        for argument, results, kind in (("prefetches", prefetches, PrefetchResult),
                                        ("backups", backups, BackupResult)):
            if not isinstance(results, list) or not all(isinstance(r, kind) for r in results):
                raise StorageArgumentError(argument, f"must be a list of {kind.__name__}")
            ids = [r.op_id for r in results]
            if len(set(ids)) != len(ids):
                raise StorageArgumentError(argument, f"answers one operation twice: {ids}")
            for result in results:
                count_fields = [result.op_id, result.pages_done]
                if isinstance(result, PrefetchResult):
                    count_fields.append(result.pages_hit)
                if any(not is_int(v) or v < 0 for v in count_fields):
                    raise StorageArgumentError(argument, f"malformed result {result}")
        assert isinstance(prefetches, list) and isinstance(backups, list)
        for result in backups:
            write = self.state.writes.get(result.op_id)
            if write is None or write.phase == "acked":
                raise StorageArgumentError("backups", f"write {result.op_id} is not in "
                                                      "flight")
        # A prefetch's result may arrive after it ended (terminated or detached): that one
        # is dropped; an id this tier never issued is a caller's mistake.
        for result in prefetches:
            if result.op_id >= self.state.next_id:
                raise StorageArgumentError("prefetches", f"operation {result.op_id} was never "
                                                         "issued")

    def _timeout_now(self, cache_now: int) -> int:
        """The timeout clock's tick; the cache's own tick ``cache_now`` when they are one
        clock (read once per operation, so a counting clock is not advanced twice)."""
        return cache_now if self.timeout_clock is self.cache.clock else \
            self.timeout_clock.now()

    def _may_end(self, settings: TierSettings, prefetch: TierPrefetch, now: int) -> bool:
        """9.6; ``now`` and ``prefetch.start`` are ticks of the timeout clock."""
        complete = (prefetch.hit_pages is not None and prefetch.hit_pages > 0
                    and prefetch.landed == prefetch.hit_pages and not prefetch.io_running)
        if prefetch.terminated or settings.prefetch_policy == "best_effort" or complete:
            return True
        if settings.prefetch_policy == "wait_complete":
            return False
        tokens = self.page_size * (prefetch.hit_pages or 0)
        if settings.timed_out(now - prefetch.start, tokens):
            self.metrics.prefetch_timeouts += 1
            return True
        return False

    @_serialised
    def check_prefetch_progress(self, request: str) -> bool:
        """9.4: True if ``request`` need not wait for storage any more. Ending a prefetch
        inserts its landed pages (S-R4) and records the tokens in ``loaded_tokens``."""
        request = _require_request(request)
        now = self.cache.now()
        self._poll()
        prefetch = self.state.prefetches.get(request)
        if prefetch is None:
            return True
        attachment = self._require()
        # The ranks end it together or not at all, and agree on what landed (12.3).
        may_end = self._may_end(attachment.settings, prefetch, self._timeout_now(now))
        if not self.cache.sync.min(int(may_end), "prefetch may end"):
            return False
        tail: Destination = "queue"
        if prefetch.io_running and not prefetch.terminated:
            attachment.io.terminate(prefetch.id)
            progress = attachment.io.prefetch_progress(prefetch.id)
            # Pages counted done are in their slots; the rest stay with the I/O.
            prefetch.landed = max(prefetch.landed, progress or 0)
            tail = "io"
        landed = self.cache.sync.min(min(prefetch.landed, prefetch.owned), "prefetch landed")
        inserted = self._insert_landed(prefetch, now, landed)
        self._give_up(prefetch, landed, tail)
        prefetch.owned = 0
        self._end(prefetch)
        self.state.loaded_tokens[request] = self.page_size * inserted
        self.metrics.prefetches_ended += 1
        self.metrics.prefetch_tokens_inserted += self.page_size * inserted
        return True

    def _insert_landed(self, prefetch: TierPrefetch, now: int, landed: int) -> int:
        """S-R4: walk the landed pages (all the prefetch still owns); stamp the cached
        ones with a host copy, then insert the rest as one host-only node, or free them if
        the walk stops at a cached page without a host copy (DEV-S5). Every landed slot is
        given up once, to the free list or the tree. Returns the pages inserted."""
        size = self.page_size
        key = prefetch.key
        cache = self.cache
        walked, insert = 0, False
        parent: TreeNode = cache.root
        for index in range(landed):
            page = prefetch.anchor + index
            nodes = cache.descend(key, (page + 1) * size)
            depth = sum(n.length for n in nodes)
            if depth < (page + 1) * size:
                assert depth == page * size, (depth, page)
                parent = nodes[-1] if nodes else cache.root
                insert = True
                break
            if nodes[-1].host is None:
                break
            nodes[-1].last_tick = now
            walked += 1
        slots = prefetch.reserved[:landed * size]
        self.state.release_log.extend((prefetch.id, s) for s in slots.tolist())
        keep = slots[walked * size:] if insert else slots[:0]
        freed = slots[:walked * size] if insert else slots
        if freed.numel():
            cache.host_pool.release(freed)
        if not insert:
            return 0
        first, end = (prefetch.anchor + walked) * size, (prefetch.anchor + landed) * size
        node = TreeNode(cache, key.namespace, key.packed_span(first, end), parent, now,
                        parent.priority if parent is not cache.root else 0)
        node.host = keep.clone()
        parent.children[node.child_key(size)] = node
        cache.refresh_leaf_sets_around(node)
        if cache.event_channel.enabled:  # the prefetch insert (spec/11, 11.3)
            cache.event_channel.emit_pages("stored", "host", node.namespace, node.prefix(),
                                           node.length, size)
        return landed - walked

    @_serialised
    def terminate_prefetch(self, request: str) -> None:
        """9.4: ask the I/O to stop; the next ``check_prefetch_progress`` may end it under
        every policy."""
        request = _require_request(request)
        prefetch = self.state.prefetches.get(request)
        if prefetch is None or prefetch.terminated:
            return
        prefetch.terminated = True
        if prefetch.io_running and self._attached is not None:
            self._attached.io.terminate(prefetch.id)
            progress = self._attached.io.prefetch_progress(prefetch.id)
            prefetch.landed = max(prefetch.landed, progress or 0)
            self._give_up(prefetch, prefetch.landed, "io")  # DEV-S12: queued at once
            prefetch.phase = "stopped"

    @_serialised
    def release_aborted_request(self, request: str) -> None:
        """9.4: forget the request; its prefetch gives up every slot (none inserted)."""
        request = _require_request(request)
        self.state.loaded_tokens.pop(request, None)
        prefetch = self.state.prefetches.get(request)
        if prefetch is None:
            return
        if prefetch.io_running:
            assert self._attached is not None
            self._attached.io.terminate(prefetch.id)
            self._give_up(prefetch, 0, "io")
        else:
            self._give_up(prefetch, 0, "queue")
        self._end(prefetch)
        self.metrics.prefetches_aborted += 1

    @_serialised
    def pop_prefetch_loaded_tokens(self, request: str) -> int:
        """9.4: the tokens ``request``'s last ended prefetch inserted (then forgotten)."""
        return self.state.loaded_tokens.pop(_require_request(request), 0)

    # ------------------------------------------------------------------ backup

    @_serialised
    def writing_check(self) -> int:
        """The cache's acknowledgements, then S-R1 for each acknowledged copy's pages.

        ``acknowledge_writes``, not the cache's ``writing_check``: on a cache wired by
        ``attach_storage_backend`` that one backs the same pages up again."""
        copies = list(self.cache.pending["d2h"])
        count = self.cache.acknowledge_writes()
        if self._attached is None:
            return count
        for copy in copies[:count]:
            prefix = copy.lock_node.prefix()
            key = RadixKey(prefix, copy.lock_node.namespace)
            end = len(prefix) // self.page_size
            self.backup_pages(PageRun(key, end - copy.tokens // self.page_size, end))
        return count

    @_serialised
    def _backup_written_back(self, node: TreeNode) -> None:
        """S-R1 for the one page a write_back eviction just copied to host."""
        prefix = node.prefix()
        end = len(prefix) // self.page_size
        self.backup_pages(PageRun(RadixKey(prefix, node.namespace), end - 1, end))

    @_serialised
    def backup_pages(self, run: PageRun) -> bool:
        """S-R1 for ``run``: write the pages the backend lacks, each host-protected until
        the write's ack is drained. False: none lacked.

        Every page of ``run`` must be cached with an *acknowledged* host copy
        (INV-STORAGE-WRITE-SOURCE): a page whose device-to-host copy is still in flight
        has host slots that do not hold its bytes yet, and a write from them would store
        them under the page's name with a valid checksum. Such a run is refused
        (``StorageArgumentError`` on ``run``, nothing changed) rather than waited for:
        waiting would block the scheduler on the copy engine, and the run is backed up
        anyway when ``writing_check`` acknowledges its copy (S-R1)."""
        attachment = self._require()
        self._require_backed_up_run(run)
        hashes = self._hashes(run.key, attachment.identity)
        # A page is stored only if every rank stored its shard (12.3).
        stored = self.cache.sync.min_all(
            [int(self._stored(attachment.backend, hashes[page]))
             for page in range(run.start, run.end)], "stored")
        lacking = [page for page, kept in zip(range(run.start, run.end), stored, strict=True)
                   if not kept]
        if not lacking:
            return False
        runs = [PageRun(run.key, page, page + 1) for page in lacking]
        slots = []
        for page_run in runs:
            (node,) = self._run_nodes(page_run)
            assert node.host is not None, node
            slots.append(node.host)
        for page_run in runs:
            self._protect(page_run, +1)
        write = TierWrite(self.state.next_id, runs)
        self.state.next_id += 1
        self.state.writes[write.id] = write
        attachment.io.submit_backup(write.id, [hashes[p] for p in lacking], torch.cat(slots))
        self.metrics.writes_issued += 1
        self.metrics.write_pages_issued += len(lacking)
        return True

    def _require_backed_up_run(self, run: object) -> None:
        """``run`` names whole pages of its key that are cached with a host copy; checked
        without splitting, so a refused run changes nothing."""
        if not isinstance(run, PageRun):
            raise StorageArgumentError("run", f"must be a PageRun, got {type(run).__name__}")
        if not isinstance(run.key, RadixKey):
            raise StorageArgumentError("run", f"key must be a RadixKey, got "
                                              f"{type(run.key).__name__}")
        pages = len(run.key.tokens) // self.page_size
        for name, value in (("start", run.start), ("end", run.end)):
            if not is_int(value):
                raise StorageArgumentError("run", f"{name} must be an int, got {value!r}")
        if not 0 <= run.start < run.end <= pages:
            raise StorageArgumentError("run", f"pages [{run.start}, {run.end}) are not a "
                                              f"non-empty run of the key's {pages} pages")
        size, position = self.page_size, 0
        arriving = self._host_copies_in_flight()
        for node, matched in self.cache.walk(run.key, run.end * size):
            low, position = position, position + matched
            if position <= run.start * size:
                continue
            if node.host is None:
                raise StorageArgumentError("run", f"tokens [{low}, {position}) have no "
                                                  "host copy to back up")
            if node in arriving:
                raise StorageArgumentError("run", f"tokens [{low}, {position}) have a host "
                                                  "copy still in flight (d2h), not yet "
                                                  "acknowledged: writing_check backs it "
                                                  "up once it lands")
        if position < run.end * size:
            raise StorageArgumentError("run", f"only {position} tokens of the key are cached; "
                                              f"the run ends at {run.end * size}")

    def _host_copies_in_flight(self) -> set[TreeNode]:
        """The nodes whose host copy is the target of a d2h copy not yet acknowledged
        (their host slots do not hold their bytes yet; INV-STORAGE-WRITE-SOURCE)."""
        arriving: set[TreeNode] = set()
        for copy in self.cache.pending["d2h"]:
            nodes = copy.nodes()
            assert nodes is not None, f"copy {copy.ticket} lost its nodes"
            arriving.update(nodes)
        return arriving

    def _emit(self, kind: EventKind, run: PageRun) -> None:
        """The storage event of ``run``'s one page (spec/11)."""
        assert self.cache.event_channel.enabled and run.end == run.start + 1, run
        tokens = run.key.tokens[:run.end * self.page_size]
        self.cache.event_channel.emit(KVEvent(kind, "storage", run.key.namespace, tokens))

    def _stored(self, backend: StorageBackend, page_hash: str) -> bool:
        """Whether ``backend`` has the page; a failing check (any ``Exception``) answers
        no, so the page is written: the I/O's write checks again and reports a failure
        in its result, where the write's protection is released."""
        try:
            return backend.has_page(page_hash)
        except Exception:  # counted; the write that follows reports the failure
            self.metrics.stored_check_errors += 1
            return False

    def _release_write(self, write: TierWrite) -> None:
        for page_run in write.pages:
            self._protect(page_run, -1)
        del self.state.writes[write.id]

    # ------------------------------------------------------------------ queues

    @_serialised
    def drain_storage_queues(self) -> tuple[int, int, int]:
        """The I/O's results, then every revoke, ack and release queued; return the
        counts processed (revokes, acks, releases)."""
        self._poll()
        state = self.state
        revokes = len(state.revoke_queue)
        self._revoke_agreed()  # DEV-S2: an id whose prefetch ended does nothing
        state.revoke_queue.clear()
        acked = self._acked_agreed()
        for write in acked:
            self._release_write(write)
        busy = {slot for slots in state.io_held.values() for slot in slots}
        freed = [slot for slot in state.release_queue if slot not in busy]
        if freed:
            self.cache.host_pool.release(torch.tensor(freed, dtype=torch.int64))
        state.release_queue = [slot for slot in state.release_queue if slot in busy]
        return revokes, len(acked), len(freed)

    def _acked_agreed(self) -> list[TierWrite]:
        """The writes whose acknowledgement every rank has (12.3): a write acked here
        but still running on another rank keeps its protection until a later drain, as
        SGLang takes the ranks' minimum of its queue lengths. One collective over the
        writes, which the ranks agree on; none when there are none."""
        writes = sorted(self.state.writes.values(), key=lambda w: w.id)
        if not writes:
            return []
        acked = self.cache.sync.min_all([int(w.phase == "acked") for w in writes],
                                        "write acked")
        return [write for write, done in zip(writes, acked, strict=True) if done]

    def _revoke_agreed(self) -> None:
        """End the prefetches revoked on any rank, on every rank (12.3: a storage miss on
        one rank is a miss for all). One collective over the ongoing prefetches, which
        the ranks agree on; none when there are none, on every rank alike."""
        ongoing = sorted(self.state.prefetches.values(), key=lambda p: p.id)
        if not ongoing:
            return
        revoked = set(self.state.revoke_queue)
        kept = self.cache.sync.min_all([int(p.id not in revoked) for p in ongoing],
                                       "prefetch kept")
        for prefetch, keep in zip(ongoing, kept, strict=True):
            if keep:
                continue
            if prefetch.id not in revoked:  # revoked elsewhere: give up like an abort
                if prefetch.io_running:
                    self._require().io.terminate(prefetch.id)
                self._give_up(prefetch, 0, "io" if prefetch.io_running else "queue")
            self._end(prefetch)

    # ------------------------------------------------------------------ checks

    @_serialised
    def host_slots_owned(self) -> list[int]:
        """Host slots the tier owns (9.2): those prefetches still own, and those queued
        for release (busy ones included)."""
        size = self.page_size
        owned = [slot for p in self.state.prefetches.values()
                 for slot in p.reserved[:p.owned * size].tolist()]
        return owned + list(self.state.release_queue)

    @_serialised
    def check(self) -> None:
        """Audit the tier's bookkeeping against the cache (INV-RELEASE-ONCE,
        INV-HOST-PROTECT-HOLDERS, rate-limit accounting); raise AssertionError."""
        size = self.page_size
        logged = [(pid, slot) for pid, slot in self.state.release_log]
        assert len(logged) == len(set(logged)), "a reserved slot was released twice"
        occupied = sum(p.pages * size for p in self.state.prefetches.values())
        assert occupied == self.state.occupied_tokens, (occupied, self.state.occupied_tokens)
        for prefetch in self.state.prefetches.values():
            assert prefetch.reserved.numel() >= prefetch.owned * size
        holders: dict[tuple[str | None, tuple[int, ...]], int] = {}
        for prefetch in self.state.prefetches.values():
            if prefetch.anchor > 0:
                page = (prefetch.key.namespace, prefetch.key.tokens[:prefetch.anchor * size])
                holders[page] = holders.get(page, 0) + 1
        for write in self.state.writes.values():
            for run in write.pages:
                page = (run.key.namespace, run.key.tokens[:run.end * size])
                holders[page] = holders.get(page, 0) + 1
        for copy in self.cache.pending["h2d"]:
            nodes = copy.nodes()
            assert nodes is not None
            for node in nodes:
                for ref in self.cache.page_refs(node):
                    holders[ref] = holders.get(ref, 0) + 1
        for node in self.cache.nodes():
            for ref in self.cache.page_refs(node):
                assert node.host_ref == holders.get(ref, 0), (node, holders.get(ref, 0))
