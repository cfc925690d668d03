"""Adapter for SGLang's ``UnifiedRadixCache`` with HiCache, on its Python tree core.

This is the cache SGLang's server builds for ``--enable-hierarchical-cache``
(``registry.create_unified_radix_cache``: the cache with the FULL component, then
``init_hicache``). SGLang 0.5.20 and 0.5.23 are adapted; 0.5.23 picks the Rust tree core
by default, so the Python core is named explicitly (``CacheInitParams.tree_core_backend``
on 0.5.23, ``SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND`` on 0.5.20, which has no per-cache
switch) and checked after construction.

The seam for other tree cores (``sglang_rust``): ``prepare`` (the CPU patches),
``build`` (pools, parameters, the cache), ``radix_key`` / ``to_engine`` /
``from_engine`` (key and slot translation) and ``UnifiedClock`` are module-level and
take the core as an argument; the node walk of ``observe`` and the per-node bookkeeping
live in ``SglangUnifiedAdapter``.

Running on a CPU-only machine takes the HiRadixCache adapter's patches (``sglang.py``:
``pin_memory=False``, an ``index_copy_`` stand-in for ``transfer_kv_direct``, one gloo
process group, published ``ServerArgs``) and two of its own:

1. The tree core's ``get_and_increase_time_counter`` (a process-wide counter SGLang
   bumps on every read) reads ``UnifiedClock``: the suite's logical tick times 2**20 plus
   a sequence number within the tick. The order of SGLang's stamps is kept, and
   ``tick_of`` maps a stamp back to its tick (DEV-21).
2. The tree core's evictable-leaf sets are insertion-ordered after every reset (DEV-20).

On CPU torch streams and events are no-ops: a copy is finished by the next check.
Pools and host layouts as in ``sglang.py``: MHA or MLA, ``layer_first`` or the
scenario's ``page_first`` as SGLang's ``page_first_direct``.
"""

from __future__ import annotations

import importlib
import os
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from types import SimpleNamespace
from typing import Any

import torch

from hiradix.conformance.abstraction import decode_kv
from hiradix.conformance.scenario import Scenario
from hiradix.engines.determinism import InsertionOrdered
from hiradix.engines.protocol import EngineAdapter, EngineUnavailable, probe_engine
from hiradix.engines.sglang.radix import (
    CACHE_SLOT_AFTER_CALLER_SLOT,
    DTYPE,
    HI_OPS,
    HOST_LAYOUTS,
    KV_LAYOUTS,
    LAYERS,
    WRITE_BACK_MAPPED,
    SglangAdapter,
    _Run,
    check_layouts,
    chunked_only,
    device_pools,
    patch_for_cpu,
    read_host_kv,
    token_shape,
)
from hiradix_model import Config, Key, Page, State, Transfer, ops

VERSIONS = ("0.5.20", "0.5.23")
SETUP = "make sglang-env (0.5.20) or make sglang23-env (0.5.23)"
TICK = 2 ** 20  # stamps per logical tick; SGLang's per-level offsets stay below one
# The spec's eviction strategies; SGLang 0.5.23 adds ``tlru``, which the model lacks (DEV-28).
STRATEGIES = ("lru", "lfu", "fifo", "mru", "filo", "priority", "slru")
_MODULES = {
    "uni": "sglang.srt.mem_cache.unified_radix_cache",
    "core": "sglang.srt.mem_cache.unified_cache.unified_tree_core",
    "components": "sglang.srt.mem_cache.unified_cache.components",
    "base": "sglang.srt.mem_cache.base_prefix_cache",
    "params": "sglang.srt.mem_cache.cache_init_params",
    "pool": "sglang.srt.mem_cache.memory_pool",
    "token": "sglang.srt.mem_cache.allocator.token",
    "paged": "sglang.srt.mem_cache.allocator.paged",
    "host": "sglang.srt.mem_cache.pool_host.mha",
    "radix": "sglang.srt.mem_cache.radix_cache",
    "args": "sglang.srt.server_args",
    "context": "sglang.srt.runtime_context",
}


SKIP_RECLAIM = "SGLANG_HICACHE_SKIP_HOST_DUPLICATE_RECLAIM"  # DEV-31



def node_ending_at(root: Any, page: Key | None) -> Any:
    """The node of a UnifiedRadixCache tree (either core's Python side) that ends at
    ``page``, walking down from ``root``; None if no node ends there."""
    node, done = root, 0
    while page is not None and done < len(page.tokens):
        for child in node.children.values():
            width = len(child.key)
            if (child.key.extra_key == page.namespace
                    and tuple(child.key.token_ids) == page.tokens[done:done + width]):
                node, done = child, done + width
                break
        else:
            return None
    return node


class UnifiedClock:
    """Stands in for the tree core's global time counter (DEV-21): every read returns a
    larger stamp, and stamps of one logical tick share ``tick_of``. SGLang subtracts
    1e-5 per level from a match's stamp; the +1 keeps those offsets inside the tick."""

    def __init__(self) -> None:
        self.now = 0
        self._tick = 0
        self._seq = 0

    def counter(self) -> float:
        if self.now != self._tick:
            self._tick, self._seq = self.now, 0
        self._seq += 1
        if self._seq >= TICK - 1:
            raise OverflowError("UnifiedClock: too many stamps in one logical tick")
        return float(self.now * TICK + self._seq)

    @staticmethod
    def tick_of(stamp: float) -> int:
        return int(stamp // TICK)


@dataclass
class UnifiedEnv:
    """The imported SGLang modules and the process-wide state they need."""

    version: str
    clock: UnifiedClock
    modules: dict[str, Any] = field(default_factory=dict)
    group: Any = None
    shipped_counter: Any = None  # the tree core's own time counter, before step 1


_ENV: UnifiedEnv | None = None


def _installed() -> str:
    import importlib.metadata
    try:
        return importlib.metadata.version("sglang")
    except importlib.metadata.PackageNotFoundError:
        raise EngineUnavailable(f"sglang-unified: sglang is not installed here ({SETUP})",
                                "missing") from None


def prepare() -> UnifiedEnv:
    """Import SGLang and apply the CPU patches (module docstring), once per process."""
    global _ENV
    if _ENV is not None:
        return _ENV
    env = UnifiedEnv(_installed(), UnifiedClock(),
                     {k: importlib.import_module(v) for k, v in _MODULES.items()})
    # The tree core imported the counter by name: the name it calls is the one to replace.
    env.shipped_counter = env.modules["core"].get_and_increase_time_counter
    env.modules["core"].get_and_increase_time_counter = env.clock.counter
    env.group = patch_for_cpu(env.modules["host"])
    _ENV = env
    return env


@contextmanager
def as_shipped() -> Iterator[None]:
    """The tree core's own time counter while the block runs (``hiradix bench``, issue
    29): step 1 is for deterministic stamps, which a timing run does not need. Step 2
    belongs to the adapter (``build`` leaves the sets as SGLang makes them)."""
    env = prepare()
    core = env.modules["core"]
    core.get_and_increase_time_counter = env.shipped_counter
    try:
        yield
    finally:
        core.get_and_increase_time_counter = env.clock.counter


def probe(engine: str) -> str:
    """The installed SGLang version, if this adapter can drive it (spec/07 7.1)."""
    def load() -> None:
        uni = prepare().modules["uni"].UnifiedRadixCache
        wanted = ["init_hicache", "match_prefix", "insert", "inc_lock_ref", "dec_lock_ref",
                  "evict", "evict_host", "writing_check", "loading_check", "init_load_back",
                  "ready_to_load_host_cache", "reset"]
        if _installed() != "0.5.20":
            wanted.append("flush_pending_backups")
        for name in wanted:
            if not callable(getattr(uni, name, None)):
                raise AttributeError(f"UnifiedRadixCache has no {name}")
    return probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache", SETUP, load)


@dataclass
class Built:
    """One cache and the pools under it."""

    cache: Any
    kv: Any
    allocator: Any
    host: Any  # the KV host pool (the anchor entry of SGLang's host pool group)


def build(env: UnifiedEnv, scenario: Scenario, core: str) -> Built:
    """A ``UnifiedRadixCache`` with HiCache for ``scenario`` on tree core ``core``
    (``python`` or ``rust``), built as ``create_unified_radix_cache`` builds it."""
    m = env.modules
    ps = scenario.page_size
    kv, allocator = device_pools(m, ps, scenario.device_pages, scenario.kv_layout)
    full = m["components"].ComponentType.FULL
    params_kw: dict[str, Any] = dict(
        disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
        page_size=ps, eviction_policy=scenario.eviction, tp_cache_group=env.group,
        tree_components=(full,))
    if env.version == "0.5.20":
        # No per-cache switch in 0.5.20: the tree core is read from the environment.
        os.environ["SGLANG_UNIFIED_RADIX_TREE_CORE_BACKEND"] = core
    else:
        params_kw["tree_core_backend"] = core
    params = m["params"].CacheInitParams(**params_kw)
    args = m["args"].ServerArgs(
        model_path="dummy", device="cpu", page_size=ps, enable_hierarchical_cache=True,
        hicache_ratio=scenario.host_pages / scenario.device_pages, hicache_size=0,
        hicache_mem_layout=HOST_LAYOUTS[scenario.host_layout],
        hicache_write_policy=scenario.write_policy,
        hicache_io_backend="direct", hicache_storage_backend=None,
        radix_eviction_policy=scenario.eviction)
    m["context"].publish(args, role="test")
    cache = m["uni"].UnifiedRadixCache(params)
    cache.init_hicache(args, params)
    host = cache.cache_controller.mem_pool_host.anchor_entry.host_pool
    return Built(cache, kv, allocator, host)


def load_back_params(env: UnifiedEnv, best: int, last_device: int, host_hit: int,
                     quota: int | None) -> Any:
    """``InitLoadBackParams`` for node ``best`` (either core's node id) as the scheduler
    builds them. What init_load_back reads of the request: the device node its match
    ended at, and no SWA / Mamba host hits (FULL is the only component)."""
    req = SimpleNamespace(rid="hiradix", last_node=last_device, swa_host_hit_length=0,
                          mamba_host_hit_length=0, kv=SimpleNamespace(mamba_pool_idx=None))
    return env.modules["base"].InitLoadBackParams(
        best_match_node=best, host_hit_length=host_hit, mem_quota=quota, req=req)


def load_back_as_scheduled(env: UnifiedEnv, cache: Any, match: Any, req: Any,
                           engine: str) -> tuple[int, int]:
    """Act on ``match`` (a ``MatchResult`` with host hits) as the server's scheduler does
    for a request ``req`` that carries it (``match_prefix_and_adopt``'s fields):
    ``add_one_req`` holds the device match locked (``_lock_node(req.last_node)``,
    schedule_policy.py:1430) and the best match locked on both tiers
    (``_lock_node(best_match_node, lock_host=True)``, :1475) around ``init_load_back``
    (:1517), then the batch issues the loads (``ready_to_load_host_cache``); a later
    step acknowledges them. Returns ``init_load_back``'s answer: the full tokens loaded
    and the node the request's prefix now ends at."""
    device = cache.lock(match.last_device_node)
    host = cache.inc_host_lock_ref(match.best_match_node).to_dec_params()
    best = cache.lock(match.best_match_node)
    try:
        loaded = cache.init_load_back(env.modules["base"].InitLoadBackParams(
            best_match_node=match.best_match_node, host_hit_length=req.host_hit_length,
            req=req))
    finally:
        cache.unlock(best)
        cache.dec_host_lock_ref(match.best_match_node, host)
        cache.unlock(device)
    if loaded is None:
        raise AssertionError(f"{engine}: init_load_back returned None, which only its "
                             "buffer mode may")
    cache.ready_to_load_host_cache()
    tokens, last = loaded
    return int(tokens), last


def radix_key(env: UnifiedEnv, key: Key) -> Any:
    from array import array
    return env.modules["radix"].RadixKey(token_ids=array("q", key.tokens),
                                         extra_key=key.namespace)


def to_engine(slots: Sequence[int], ps: int) -> torch.Tensor:
    """Spec slots as SGLang's: the allocator reserves device page 0 for padding."""
    return torch.tensor([s + ps for s in slots], dtype=torch.int64)


def from_engine(slots: torch.Tensor, ps: int) -> tuple[int, ...]:
    return tuple(s - ps for s in slots.tolist())


def load_host_locks(cache: Any, full: Any, loads: Iterable[int], *,
                    v20: bool) -> dict[int, int]:
    """DEV-22: per node id, the host locks that the loads ``loads`` (their ack ids),
    those still in ``cache.ongoing_load_back``, hold on it. Each holds one on the nodes
    of its segment: its anchor, and on 0.5.23 the nodes up to the receipt's boundary,
    which a split moves up (0.5.20: the anchor only). An adapter takes these off a node's
    ``host_lock_ref`` and protects each page of the load's chain instead (DEV-5)."""
    held: dict[int, int] = {}
    for ack in loads:
        if ack not in cache.ongoing_load_back:
            continue
        node = cache.tree_core.node_by_id(ack)
        covered = {node.id}
        if not v20:
            boundary = cache.ongoing_load_back[ack].host_lock_params.get_lock_uuid(
                full, lock_host=True)
            while node.component_data[full].metadata.get("host_uuid") != boundary:
                node = node.parent
                covered.add(node.id)
        for node_id in covered:
            held[node_id] = held.get(node_id, 0) + 1
    return held


class SglangUnifiedAdapter(SglangAdapter):
    """One ``UnifiedRadixCache`` (HiCache, Python tree core) for one scenario.

    What does not depend on SGLang's nodes -- slots, the allocator, KV bytes, runs of
    backups and loads in flight and their DEV-7 / DEV-5 corrections, the checks -- is the
    HiRadixCache adapter's; the nodes here keep their fields per component."""

    name = "sglang-unified"
    core = "python"

    def __init__(self, scenario: Scenario) -> None:
        check_layouts(scenario, self.name)
        if scenario.eviction not in STRATEGIES:
            raise ValueError(f"scenario: eviction must be one of {STRATEGIES} (DEV-28)")
        self.version = probe(self.name)
        self.uenv = prepare()
        self.uenv.clock.now = 0  # not the previous cache's last tick
        self.m = self.uenv.modules
        self.v20 = self.uenv.version == "0.5.20"
        self.ps = ps = scenario.page_size
        self.kv_layout = scenario.kv_layout
        self.token_shape = token_shape(scenario.kv_layout)
        built = build(self.uenv, scenario, self.core)
        self.cache, self.kv, self.allocator, self.host = (built.cache, built.kv,
                                                          built.allocator, built.host)
        self.tree = self.cache.tree_core
        self._check_core()
        self.full = self.m["components"].ComponentType.FULL
        # A configuration attribute SGLang fixes at 10 tokens (spec/01).
        self.cache.load_back_threshold = scenario.threshold_pages * ps
        self._order_leaf_sets()
        self.operations = HI_OPS
        self.config = Config(page_size=ps, device_slots=scenario.device_pages * ps,
                             host_slots=int(self.host.logical_size),
                             write_policy=scenario.write_policy, eviction=scenario.eviction,
                             load_back_threshold=scenario.threshold_pages * ps)
        self.adopted: Mapping[str, str] = {
            "last_tick": "DEV-1 (a split stamps the unmatched suffix), DEV-21 (stamps from "
                         "a global counter, offset per level)",
            "hits": "DEV-33 (an insert re-adopting a host-only node counts a hit there)",
        }
        if scenario.write_policy == "write_back":
            self.adopted = {**self.adopted,
                            "hits": "DEV-3 (no hits are counted under write_back)"}
        self.mapped: Mapping[str, str] = {
            "slot ids": f"SGLang reserves device page 0 for padding: spec slot = SGLang slot "
                        f"- {ps}",
            "ticks": "DEV-21: the tree core's global counter reads the logical clock; a "
                     "stamp's tick is stamp // 2**20",
            "lock": "DEV-7: one lock per backed-up node is folded into one lock per run",
            "host_protect": "DEV-22: a load's host lock sits on its anchor until the ack; "
                            "the spec protects every page of the chain (DEV-5)",
            "last_host_page": "DEV-23: SGLang's last_host_node is the best match, host copy "
                              "or not; the spec's is its deepest ancestor with a host copy",
            "lock deltas": "inc_lock_ref: SGLang reports the tokens protected, the spec the "
                           "evictable delta (negated); dec_lock_ref: SGLang returns none, "
                           "read off evictable_size()",
            "prev_prefix_len": "DEV-24: insert passes the caller's matched device prefix; the "
                               "tree frees the duplicate slots past it, so the caller's "
                               "free of those slots is already done",
            "insert prefix": "DEV-H4 (spec/13 13.7): SGLang's prefix_len counts the tokens "
                             "of host-only nodes the insert re-adopts; the spec's prefix "
                             "is the part cached on the device before the call",
            "chunked": "DEV-25: inserted_len = counted_from (chunked: the page-aligned "
                       "length); SGLang counts per node, so counted_from inside the key "
                       "only where a node ends there (0.5.20 takes chunked only)",
            "flush backups": "DEV-26: insert queues its backups; flush_pending_backups() "
                             "issues them, as the scheduler does after each batch",
            "start loads": "init_load_back is followed by ready_to_load_host_cache(), which "
                           "starts the queued copy, as the scheduler does before a batch",
        }
        self.guards: Mapping[str, str] = {}  # none verified (spec/07 Reach lines)
        self.avoid: Mapping[str, str] = {}
        # DEV-31: the host eviction's duplicate reclaim is switched off under write_back
        # by SGLang's own switch, read at each host eviction; False gives its default.
        self.skip_duplicate_reclaim = scenario.write_policy == "write_back"
        if scenario.write_policy == "write_back":
            self.mapped = {**self.mapped, **WRITE_BACK_MAPPED, "host duplicate reclaim": (
                f"DEV-31: {SKIP_RECLAIM}=1 around the calls that may evict on host, as a "
                "server may set it: its host eviction then takes host-only pages only")}
        self.inexpressible: Mapping[str, str] = {
            **({"counted_from_inside": "DEV-25: 0.5.20's insert takes only chunked"}
               if self.v20 else {}),
            **CACHE_SLOT_AFTER_CALLER_SLOT,
        }
        self.runs: list[_Run] = []
        self.loads: dict[int, tuple[int, tuple[Key, ...]]] = {}  # ack -> (seq, pages)
        self.issued = 0
        self.receipts: dict[Key | None, list[Any]] = {}  # caller locks, per page (LIFO)
        self.freed_by_tree: set[int] = set()

    def _check_core(self) -> None:
        """The tree core asked for is the one built (SGLang may fall back silently)."""
        if type(self.tree) is not self.m["core"].UnifiedTreeCore:
            raise EngineUnavailable(f"{self.name}: asked for the Python tree core, got "
                                    f"{type(self.tree).__name__} ({SETUP})")

    def _order_leaf_sets(self) -> None:
        """DEV-20: SGLang's leaf sets hash nodes by address; the tree core rebuilds
        them on every reset, so they are ordered again after each one."""
        self.tree.evictable_device_leaves = InsertionOrdered(self.tree.evictable_device_leaves)
        self.tree.evictable_host_leaves = InsertionOrdered(self.tree.evictable_host_leaves)

    # -- plumbing ---------------------------------------------------------------------

    def _data(self, node: Any) -> Any:
        return node.component_data[self.full]

    def _node(self, page: Key | None) -> Any:
        """The node that ends at ``page`` (a match has put a boundary there)."""
        node = node_ending_at(self.tree.root_node, page)
        if node is None:
            raise KeyError(f"{self.name}: no node ends at {page}")
        return node

    def _device_prefix(self, key: Key) -> tuple[int, ...]:
        """The tree's device slots for the leading device-resident part of ``key``
        (read only: no stamp, no split)."""
        node, done, slots = self.tree.root_node, 0, list[int]()
        while done < len(key.tokens):
            for child in node.children.values():
                tokens = tuple(child.key.token_ids)
                value = self._data(child).value
                if (child.key.extra_key == key.namespace and value is not None
                        and tokens[:self.ps] == key.tokens[done:done + self.ps]):
                    break
            else:
                break
            common = 0
            while (common < len(tokens) and done + common < len(key.tokens)
                   and tokens[common] == key.tokens[done + common]):
                common += 1
            common -= common % self.ps
            slots.extend(from_engine(value[:common], self.ps))
            if common < len(tokens):
                break
            node, done = child, done + common
        return tuple(slots)

    def _require_node_end(self, key: Key, length: int) -> None:
        """DEV-25: SGLang counts a hit on every node that ends past ``inserted_len``, and
        does not split there, so ``inserted_len`` means ``counted_from`` only where a node
        of ``key``'s path ends at it. Elsewhere it has no counterpart: refused."""
        end = Key(key.tokens[:length], key.namespace)
        if not any(self._prefix(node) == end for node in self._nodes()):
            raise ValueError(f"{self.name}: no node ends at counted_from={length} on the "
                             "key's path; SGLang would count the node across it (DEV-25)")

    # -- the operations -----------------------------------------------------------------

    def set_time(self, now: int) -> None:
        self.uenv.clock.now = now

    def match_prefix(self, key: Key) -> ops.MatchResult:
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.uenv, key)))
        last_device = self.tree.node_by_id(got.last_device_node)
        if self.v20:
            slots = from_engine(got.device_indices, self.ps)
        else:
            slots = from_engine(self.tree.collect_full_device_indices(
                got.last_device_node, self.tree.root_node.id), self.ps)
        # DEV-23: SGLang's last_host_node is the best match; the spec's is the deepest
        # matched page with a host copy.
        host = self.tree.node_by_id(got.last_host_node)
        while host is not self.tree.root_node and self._data(host).host_value is None:
            host = host.parent
        return ops.MatchResult(slots, self._page_of(last_device), self._page_of(host),
                               int(got.host_hit_length))

    def inc_lock_ref(self, page: Key | None) -> int:
        result = self.cache.inc_lock_ref(self._node(page).id)
        self.receipts.setdefault(page, []).append(result.to_dec_params())
        # SGLang reports the tokens that became protected; the spec the evictable delta.
        return -int(result.delta or 0)

    def dec_lock_ref(self, page: Key | None) -> int:
        receipt = self.receipts[page].pop()
        before = int(self.cache.evictable_size())
        self.cache.dec_lock_ref(receipt.node_id, receipt)
        return int(self.cache.evictable_size()) - before

    def free(self, slots: Sequence[int]) -> None:
        # DEV-24: the duplicates the tree freed in the last insert are not freed twice.
        rest = [s for s in slots if s not in self.freed_by_tree]
        self.freed_by_tree.difference_update(slots)
        if rest:
            self.allocator.free(to_engine(rest, self.ps))

    def insert(self, key: Key, slots: Sequence[int], *, priority: int, chunked: bool,
               counted_from: int = 0) -> int:
        cached = self._device_prefix(key)
        # The scheduler passes the request's protected prefix: the device slots its
        # match found, which it still uses (DEV-24).
        prev = 0
        while prev < len(cached) and slots[prev] == cached[prev]:
            prev += 1
        aligned = len(key.tokens) - len(key.tokens) % self.ps
        pending = dict(self.cache.ongoing_write_through)
        free_before = self._free_device()
        kw: dict[str, Any] = dict(key=radix_key(self.uenv, key), value=to_engine(slots, self.ps),
                                  priority=priority, prev_prefix_len=prev)
        if self.v20:
            kw["chunked"] = chunked_only(key, self.ps, chunked, counted_from, self.name)
        else:
            kw["inserted_len"] = aligned if chunked else counted_from  # DEV-25
            if 0 < kw["inserted_len"] < aligned:
                self._require_node_end(key, counted_from)
        result = self.cache.insert(self.m["base"].InsertParams(**kw))
        if not self.v20:
            self.cache.flush_pending_backups()  # DEV-26
        self.freed_by_tree = set(slots) & (self._free_device() - free_before)
        issued = [i for i, entry in self.cache.ongoing_write_through.items()
                  if pending.get(i) is not entry]
        if issued:
            self._record_run(issued, [self.tree.node_by_id(i) for i in issued])
        # DEV-H4: host-only nodes the walk re-adopted (``_unevict_node_on_insert``, the
        # caller's slots now theirs) count in SGLang's prefix_len; they were not cached
        # on the device, and a host-only node has no device node below it.
        return min(int(result.prefix_len), len(cached))

    @contextmanager
    def _reclaim_switch(self) -> Iterator[None]:
        """SGLang's DEV-31 switch set for one call when ``skip_duplicate_reclaim``."""
        if not self.skip_duplicate_reclaim:
            yield
            return
        was = os.environ.get(SKIP_RECLAIM)
        os.environ[SKIP_RECLAIM] = "1"
        try:
            yield
        finally:
            if was is None:
                del os.environ[SKIP_RECLAIM]
            else:
                os.environ[SKIP_RECLAIM] = was

    def evict(self, num_tokens: int) -> int:
        with self._reclaim_switch():
            result = self.cache.evict(self.m["base"].EvictParams(num_tokens=num_tokens))
        return int(result.num_tokens_evicted)

    def evict_host(self, num_tokens: int) -> int:
        with self._reclaim_switch():
            return int(self.cache.evict_host(num_tokens))

    def init_load_back(self, page: Key | None,
                       quota: int | None) -> tuple[tuple[int, ...], Key | None]:
        node = self._node(page)
        chain: list[Any] = []
        cursor = node
        while cursor is not self.tree.root_node and cursor.evicted:
            chain.insert(0, cursor)
            cursor = cursor.parent
        host_hit = sum(len(self._data(n).host_value) for n in chain)
        with self._reclaim_switch():
            got, last = self.cache.init_load_back(load_back_params(
                self.uenv, node.id, cursor.id, host_hit, quota))
        # 0.5.20 returns the loaded device indices, 0.5.23 their number.
        loaded = from_engine(got, self.ps) if self.v20 else ()
        if node.id in self.cache.ongoing_load_back:
            # SGLang queues a load and starts it when the scheduler says the batch is
            # ready; the spec's load_back issues the copy: both halves, as a scheduler does.
            self.cache.ready_to_load_host_cache()
            self.issued += 1
            self.loads[node.id] = (self.issued,
                                   tuple(k for n in chain for k in self._page_keys(n)))
            if not self.v20:
                loaded = tuple(s for n in chain for s in from_engine(self._data(n).value,
                                                                     self.ps))
                if len(loaded) != got:
                    raise AssertionError(f"{self.name}: init_load_back reported {got} tokens "
                                         f"loaded, the chain holds {len(loaded)}")
        return loaded, self._page_of(self.tree.node_by_id(last))

    def reset(self) -> None:
        self.cache.reset()
        self._order_leaf_sets()
        self.allocator.clear()
        self.runs.clear()
        self.loads.clear()
        self.receipts.clear()
        self.freed_by_tree.clear()

    # -- the abstraction ------------------------------------------------------------------

    def _stale(self, direction: str, nodes: list[Any]) -> Transfer:
        """A copy in flight that no operation of ours issued: reset drops SGLang's
        acknowledgements (DEV-19 does not recur), so none can be left."""
        raise AssertionError(f"{self.name}: a {direction} copy in flight that no operation "
                             f"of the suite issued")

    def _read_host(self, slots: list[int]) -> torch.Tensor:
        return read_host_kv(self.host, slots, self.kv_layout)

    def observe(self, model: State) -> State:
        pages: dict[Key, Page] = {}
        held = load_host_locks(self.cache, self.full, self.loads, v20=self.v20)
        for node in self._nodes():
            data = self._data(node)
            device = None if data.value is None else from_engine(data.value, self.ps)
            host = None if data.host_value is None else tuple(data.host_value.tolist())
            protect = data.host_lock_ref - held.get(node.id, 0)  # DEV-22
            for index, key in enumerate(self._page_keys(node)):
                cut = slice(index * self.ps, (index + 1) * self.ps)
                pages[key] = Page(
                    device=None if device is None else device[cut],
                    host=None if host is None else host[cut],
                    lock=data.lock_ref, host_protect=protect,
                    hits=node.hit_count,
                    last_tick=UnifiedClock.tick_of(node.last_access_time),
                    insert_tick=UnifiedClock.tick_of(node.creation_time),
                    priority=node.priority)
        pages = {k: self._corrected(k, p) for k, p in pages.items()}
        pending = self._in_flight(pages)
        arriving = {d: {s for t in pending if t.direction == d for s in t.dst}
                    for d in ("d2h", "h2d")}
        device_free = self._free_device()
        owned = {s for p in pages.values() for s in p.device or ()}
        held = frozenset(set(range(self.config.device_slots)) - device_free - owned)
        visible_device = sorted((owned | held) - arriving["h2d"])
        device_kv = decode_kv(self._read_device(visible_device), dict(model.device_kv),
                              visible_device, LAYERS, self.token_shape, DTYPE)
        self.host._merge_release_slots()
        host_free = frozenset(self.host.free_slots.tolist())
        visible_host = sorted({s for p in pages.values() for s in p.host or ()}
                              - arriving["d2h"])
        host_kv = decode_kv(self._read_host(visible_host), dict(model.host_kv), visible_host,
                            LAYERS, self.token_shape, DTYPE)
        return State(config=model.config, pages=pages, device_free=device_free,
                     host_free=host_free, held=held, device_kv=device_kv, host_kv=host_kv,
                     pending=pending, clock=model.clock,
                     evictable_tokens=int(self.cache.evictable_size()),
                     protected_tokens=int(self.cache.protected_size()))

    def close(self) -> None:
        self.cache.shutdown()


def factory(engine: str, scenario: Scenario) -> Callable[[], EngineAdapter]:
    if engine != "sglang-unified":
        raise ValueError(f"engine: {engine!r} is not adapted here")
    return lambda: SglangUnifiedAdapter(scenario)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """The scenario values the adapter takes (the suite's CLI uses it)."""
    return {"host_layout": tuple(HOST_LAYOUTS), "kv_layout": KV_LAYOUTS,
            "write_policy": ("write_through", "write_through_selective", "write_back"),
            "eviction": STRATEGIES}
