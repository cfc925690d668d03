"""The storage tier's constants and state (spec/09-storage.md, 9.1 and 9.2).

A page's name in storage is a ``StorageId``: the page key (its whole prefix and its
namespace) plus the cache's identity (model, KV dtype, layout). It is what the chained
page hash of an implementation identifies; spec/09 ("Page identity") says why the pair
refines the hash. Stored content is kept as the KV identities of the page's P slots,
the same abstraction as ``host_kv``.

The state is an optional field of ``State`` (``None``: storage never attached), so the
two-tier model of spec/02 is unchanged when no backend is used.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Literal, get_args

from hiradix_model.config import Config
from hiradix_model.errors import ConfigError
from hiradix_model.keys import Key

PrefetchPolicy = Literal["best_effort", "wait_complete", "timeout"]
PREFETCH_POLICIES: tuple[PrefetchPolicy, ...] = get_args(PrefetchPolicy)

# querying: the hit query is not answered; fetching: the I/O is copying pages;
# stopped: the I/O has finished or given up and released what it will not fill;
# revoked: too few hits, every slot released, waiting in the revoke queue;
# dead: the I/O died without releasing anything.
Phase = Literal["querying", "fetching", "stopped", "revoked", "dead"]
# running: pages still to write; acked: finished, waiting in the ack queue; dead: stuck.
WritePhase = Literal["running", "acked", "dead"]
Content = tuple[Key | None, ...]  # the KV identities of a stored page's P slots


@dataclass(frozen=True)
class StorageSettings:
    """The runtime-configurable storage constants (spec/09, 9.1). Times are in ticks."""

    prefetch_threshold: int = 256  # tokens; a shorter prefetch is not started
    prefetch_policy: PrefetchPolicy = "best_effort"
    timeout_base: int = 2000  # ticks, whatever the length
    timeout_per_ki_token: int = 100  # ticks added per 1024 tokens to fetch
    timeout_max: int = 30000  # ticks, the cap of the linear timeout
    prefetch_token_limit: int | None = None  # None: 0.8 x (host_slots - device_slots)

    def __post_init__(self) -> None:
        for name in ("prefetch_threshold", "timeout_base", "timeout_per_ki_token",
                     "timeout_max"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ConfigError(name, f"must be an int >= 0, got {value!r}")
        if self.timeout_max < self.timeout_base:
            raise ConfigError("timeout_max", f"must be >= timeout_base ({self.timeout_base}), "
                                             f"got {self.timeout_max}")
        if self.prefetch_policy not in PREFETCH_POLICIES:
            raise ConfigError("prefetch_policy", f"must be one of {PREFETCH_POLICIES}, "
                                                 f"got {self.prefetch_policy!r}")
        limit = self.prefetch_token_limit
        if limit is not None and (not isinstance(limit, int) or isinstance(limit, bool)):
            raise ConfigError("prefetch_token_limit", f"must be None or an int, got {limit!r}")


@dataclass(frozen=True)
class StorageId:
    """A page's name in storage: the preimage of its chained hash (spec/09, 9.1)."""

    page: Key
    identity: tuple[str, ...]


@dataclass(frozen=True)
class Prefetch:
    """One ongoing prefetch (SGLang ``ongoing_prefetch[req_id]`` and its operation)."""

    id: int  # the reservation's number: names it in the revoke queue and the release log
    request: str
    anchor: Key | None  # the page the fetched pages hang from; None: the root
    pages: tuple[Key, ...]  # the pages reserved for, root-most first, a chain below anchor
    reserved: tuple[int, ...]  # every host slot reserved at issue, P per page, in order
    slots: tuple[int, ...]  # the reserved slots it still owns: those of pages[:len // P]
    start: int  # the tick it was issued at; the timeout runs from here
    phase: Phase = "querying"
    hit_pages: int | None = None  # the hit query's answer; None until answered
    landed: int = 0  # leading pages whose bytes arrived intact
    terminated: bool = False  # terminate_prefetch asked the I/O to stop


@dataclass(frozen=True)
class StorageWrite:
    """One backup to storage not yet released (SGLang ``ongoing_backup``)."""

    id: int
    pages: tuple[Key, ...]  # root-most first: the pages the backend lacked at issue
    done: int = 0  # leading pages handled (written, or found already present)
    phase: WritePhase = "running"


@dataclass(frozen=True)
class StorageState:
    """Everything the storage tier adds to the state (spec/09, 9.2)."""

    backend: str | None = None  # the attached backend; None: detached
    identity: tuple[str, ...] = ()  # model identity, KV dtype, layout of this cache
    settings: StorageSettings = StorageSettings()
    # What each backend this cache has used holds, by backend name; it outlives a detach.
    stores: Mapping[str, Mapping[StorageId, Content]] = field(default_factory=dict)
    prefetches: tuple[Prefetch, ...] = ()  # ongoing, in issue order
    writes: tuple[StorageWrite, ...] = ()  # issued and not yet released, in issue order
    revoke_queue: tuple[int, ...] = ()  # ids of revoked prefetches, oldest first
    release_queue: tuple[int, ...] = ()  # host slots the I/O gave back, not yet freed
    occupied_tokens: int = 0  # tokens of ongoing prefetches, for the rate limit
    loaded_tokens: Mapping[str, int] = field(default_factory=dict)  # per request
    release_log: tuple[tuple[int, int], ...] = ()  # (prefetch id, slot) per release
    next_id: int = 0  # the id the next prefetch or write gets

    @property
    def stored(self) -> Mapping[StorageId, Content]:
        """The attached backend's pages (empty when detached)."""
        if self.backend is None:
            return {}
        return self.stores.get(self.backend, {})

    def sid(self, page: Key) -> StorageId:
        return StorageId(page, self.identity)

    def prefetch_of(self, request: str) -> Prefetch | None:
        return next((p for p in self.prefetches if p.request == request), None)


def token_limit(config: Config, settings: StorageSettings) -> int:
    """The rate limit in tokens; SGLang's default is 80% of host minus device slots."""
    if settings.prefetch_token_limit is not None:
        return settings.prefetch_token_limit
    return (4 * (config.host_slots - config.device_slots)) // 5


def rate_limited(config: Config, storage: StorageState) -> bool:
    """No new prefetch (or hit query) while ongoing ones occupy the limit (spec/09, 9.1)."""
    return storage.occupied_tokens >= token_limit(config, storage.settings)


def timed_out(settings: StorageSettings, elapsed_ticks: int, tokens: int) -> bool:
    """``elapsed > min(max, base + per_ki_token * tokens / 1024)``, in exact integers."""
    limit_x1024 = min(1024 * settings.timeout_max,
                      1024 * settings.timeout_base + settings.timeout_per_ki_token * tokens)
    return 1024 * elapsed_ticks > limit_x1024


def stored_run(storage: StorageState, pages: tuple[Key, ...]) -> int:
    """How many leading ``pages`` the attached backend holds under this cache's identity."""
    stored = storage.stored
    count = 0
    for page in pages:
        if storage.sid(page) not in stored:
            break
        count += 1
    return count
