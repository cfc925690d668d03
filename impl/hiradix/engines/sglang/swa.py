"""Adapter for SGLang 0.5.23's ``UnifiedRadixCache`` with the (FULL, SWA) components.

This is the cache SGLang's server builds for a hybrid sliding-window model without
``--enable-hierarchical-cache`` (``registry.create_unified_radix_cache``: components
``(FULL, SWA)``, no ``init_hicache``), over the pools ``kv_cache_configurator`` builds for
it: an ``SWAKVPool`` (a full and an SWA ``MHATokenToKVPool``) and an
``SWATokenToKVPoolAllocator`` (a token allocator per pool at page size 1, a paged one per
pool above, and the ``full_to_swa_index_mapping`` tensor that pairs them). The Python tree
core is asked for by name (``CacheInitParams.tree_core_backend``) and checked after
construction, since 0.5.23 picks the Rust core by default.

It speaks ``hiradix.conformance.hybrid.engine.SwaEngine`` (spec/13). What it maps:

- Slot ids are SGLang's shifted down by one page. Each allocator reserves its pool's
  page 0 (slots ``0 .. page_size - 1``) as the padding sink, never allocatable; the model
  numbers a pool's slots from 0, so SGLang's slot ``s`` is the model's ``s - page_size``
  (``_out``; ``_in`` the other way) for both pools, in every call and every view.
- The full->SWA mapping marks "no SWA half" with 0 (``clear_full_to_swa_mapping``); its
  last entry is a -1 sentinel that ``alloc_extend`` reads for ``last_loc = -1``, not a
  slot's entry. ``pairs`` is every other nonzero entry.
- The KV buffers are filled with NaN when built, so that ``full_kv`` / ``swa_kv`` can leave
  out slots nothing was ever written to; codes are stored as float32, exact below 2**24.
- DEV-24 as in ``sglang_unified``: ``insert`` passes as ``prev_prefix_len`` the leading run
  of the caller's slots that are the tree's own, and SGLang frees the caller's duplicates
  past it itself; ``free`` does not free those again.
- ``free`` frees a pair whose SWA half is gone with ``free_full_segment`` and the others
  with ``free_segment``, as the scheduler's ``free_kv_row_segments`` splits a row at the
  request's SWA eviction cursor (``free`` would free the sink slot 0 as an SWA half).

With ``hicache=<write policy>`` the same cache gets SGLang's host tier as
``--enable-hierarchical-cache`` gives it (``init_hicache``: ``_SwaStrategy`` builds a KV and
an SWA host pool and a ``HybridCacheController``), on CPU through ``sglang_unified``'s
patches. The model stays device-tier only (spec/13):

- The view is the device state: a node without a device full value (host-only, backed up
  and evicted) is no page; a page's SWA copy is its device SWA value. A device eviction
  that leaves a node host-only is, seen from the device, a deletion; an insert over a
  host-only node (SGLang re-adopts the caller's slots, ``_unevict_node_on_insert``) is a
  page created from the caller's pairs.
- Backups complete asynchronously: after every call that reaches the tree the adapter
  polls the controller as the scheduler does once per step (``check_hicache_events``:
  flush queued backups, ``writing_check``, ``loading_check``) until no copy is in flight,
  so the lock a write-through holds on its node is gone when the machine looks.
- ``match_prefix`` returns the device part of SGLang's match (``last_device_node``);
  ``load_back`` then acts on its host hit as the scheduler does (``init_load_back``, the
  loads issued and acknowledged before it returns).
- The host tier is checked by SGLang's own means only (``own_check``): ``sanity_check``
  (which covers host leaves, host LRUs and in-flight copies once HiCache is on) and, per
  host pool, that the slots the tree's host values name and the pool's free list
  partition the pool and agree with its ``slot_used`` flags.
"""

from __future__ import annotations

import importlib
import math
from array import array
from collections.abc import Callable, Collection, Iterable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Literal

import torch

from hiradix.conformance.hybrid.engine import (
    LockGranularity,
    SwaHostPageView,
    SwaHostView,
    SwaPageView,
    SwaView,
)
from hiradix.engines.protocol import EngineUnavailable, probe_engine
from hiradix.engines.sglang.unified import (
    UnifiedEnv,
    load_back_as_scheduled,
    node_ending_at,
    prepare,
    radix_key,
)
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig

NAME = "sglang-swa"
VERSIONS = ("0.5.23",)  # the (FULL, SWA) UnifiedRadixCache API adapted here
SETUP = "make sglang23-env"
DTYPE = torch.float32  # codes are small ints: exact in float32
HEADS, HEAD_DIM = 1, 1
FULL_LAYERS, SWA_LAYERS = [0], [1]  # one full-attention and one sliding-window layer
EXACT = 2 ** 24  # float32 holds every integer below this exactly
_SWA_MODULES = {
    "swa_pool": "sglang.srt.mem_cache.swa_memory_pool",
    "swa_alloc": "sglang.srt.mem_cache.allocator.swa",
    "batch": "sglang.srt.managers.schedule_batch",
}
WritePolicy = Literal["write_through", "write_through_selective", "write_back"]
WRITE_POLICIES: tuple[WritePolicy, ...] = ("write_through", "write_through_selective",
                                           "write_back")
# Host pools of about the device pools' size (SGLang adds a page): host eviction, the
# duplicate reclaim and write_back's drop without backup all happen in short runs.
HICACHE_RATIO = 1.0
# Polls of check_hicache_events before a copy still in flight is reported: on CPU a copy
# is done by the first poll after it was issued; a second covers a backup that an ack
# itself queues.
SETTLE_POLLS = 4
# The request rows ``build`` gives every cache for the request-level calls the hybrid
# machine drives (``ScheduledSwaEngine``), and the longest row: the machine keeps at most
# four requests of at most 18 tokens live.
REQ_ROWS, MAX_CONTEXT = 8, 64


def _modules() -> tuple[UnifiedEnv, dict[str, Any]]:
    """The shared UnifiedRadixCache environment (CPU patches, the tree core's clock)
    and the SWA pool and allocator modules."""
    env = prepare()
    return env, {k: importlib.import_module(v) for k, v in _SWA_MODULES.items()}


def probe(engine: str = NAME) -> str:
    """The installed SGLang version if this adapter can drive it; ``EngineUnavailable``
    (missing, wrong version, or an API this adapter does not know) otherwise."""
    def load() -> None:
        env, swa = _modules()
        uni = env.modules["uni"].UnifiedRadixCache
        for name in ("match_prefix", "insert", "lock", "release_swa", "dec_lock_ref",
                     "evict", "sanity_check", "swa_evictable_size", "swa_protected_size"):
            if not callable(getattr(uni, name, None)):
                raise AttributeError(f"UnifiedRadixCache has no {name}")
        allocator = swa["swa_alloc"].SWATokenToKVPoolAllocator
        for name in ("alloc", "alloc_extend", "free_segment", "free_full_segment",
                     "free_swa_segment"):
            if not callable(getattr(allocator, name, None)):
                raise AttributeError(f"SWATokenToKVPoolAllocator has no {name}")
        if not hasattr(swa["swa_pool"], "SWAKVPool"):
            raise AttributeError("sglang.srt.mem_cache.swa_memory_pool has no SWAKVPool")
        if "tree_core_backend" not in env.modules["params"].CacheInitParams.__dataclass_fields__:
            raise AttributeError("CacheInitParams has no tree_core_backend")
    return probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache with an SWA component",
                        SETUP, load)


def probe_hicache(engine: str = f"{NAME}-hicache") -> str:
    """As ``probe``, and the HiCache entry points the ``hicache`` option drives."""
    version = probe(engine)

    def load() -> None:
        env, _ = _modules()
        uni = env.modules["uni"].UnifiedRadixCache
        for name in ("init_hicache", "check_hicache_events", "shutdown"):
            if not callable(getattr(uni, name, None)):
                raise AttributeError(f"UnifiedRadixCache has no {name}")
        importlib.import_module("sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller")
    probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache with HiCache and an SWA "
                 "component", SETUP, load)
    return version


def _buffers(pool: Any) -> list[torch.Tensor]:
    """Every K and V buffer of an ``MHATokenToKVPool``, layer by layer."""
    return [*pool.k_buffer, *pool.v_buffer]


def _free_slots(allocator: Any) -> frozenset[int]:
    """The slots a token or paged sub-allocator could hand out, staged frees included."""
    if allocator.page_size == 1:
        ids = allocator.free_pages.tolist() + allocator.release_pages.tolist()
        return frozenset(ids)
    ps = allocator.page_size
    return frozenset(p * ps + i for p in allocator.get_all_free_pages().tolist()
                     for i in range(ps))


def _codes(buffer: torch.Tensor, slots: range) -> dict[int, int]:
    """slot -> code in layer-0 K for the written slots (NaN: never written)."""
    values = buffer[slots.start:slots.stop, 0, 0].tolist()
    return {slot: int(v) for slot, v in zip(slots, values, strict=True) if not math.isnan(v)}


def host_free_slots(pool: Any) -> frozenset[int]:
    """A host pool's free slots, the frees it has staged included."""
    return frozenset(pool.free_slots.tolist()
                     + [s for part in pool.release_slots for s in part.tolist()])


def _host_codes(pool: Any, slots: set[int]) -> dict[int, int]:
    """host slot -> code in layer-0 K of a ``layer_first`` host pool, for ``slots``."""
    if pool.layout != "layer_first":
        raise AssertionError(f"{NAME}: host KV is read from layer_first pools only, "
                             f"got {pool.layout}")
    values = pool.kv_buffer[0, 0, :, 0, 0].tolist()
    return {slot: int(values[slot]) for slot in sorted(slots)
            if not math.isnan(values[slot])}


class SwaPoolPair:
    """SGLang's ``SWAKVPool`` and ``SWATokenToKVPoolAllocator`` for one configuration,
    driven as the scheduler drives them and spoken to in the model's slot ids (module
    docstring: SGLang's shifted down one page). Both SGLang adapters, on the Python and
    on the Rust tree core, hold their pools through this.

    ``held``: caller-held SGLang full slot -> whether its pair still has an SWA half."""

    def __init__(self, config: SwaConfig, pool_module: Any, allocator_module: Any) -> None:
        self.config = config
        ps = self.ps = config.page_size
        self.kv = pool_module.SWAKVPool(
            size=config.full_slots, size_swa=config.swa_slots, page_size=ps, dtype=DTYPE,
            head_num=HEADS, head_dim=HEAD_DIM, swa_attention_layer_ids=SWA_LAYERS,
            full_attention_layer_ids=FULL_LAYERS, device="cpu", enable_memory_saver=False)
        for buffer in _buffers(self.kv.full_kv_pool) + _buffers(self.kv.swa_kv_pool):
            buffer.fill_(float("nan"))  # "never written" (module docstring)
        self.allocator = allocator_module.SWATokenToKVPoolAllocator(
            config.full_slots, config.swa_slots, ps, DTYPE, "cpu", self.kv, False)
        # Allocatable slot ids: page 0 of each pool is SGLang's padding sink.
        self.full_ids = range(ps, config.full_slots + ps)
        self.swa_ids = range(ps, config.swa_slots + ps)
        self.held: dict[int, bool] = {}

    def to_model(self, slots: Iterable[int]) -> tuple[int, ...]:
        """SGLang's slot ids as the model's (past the padding page)."""
        return tuple(int(s) - self.ps for s in slots)

    def to_sglang(self, slots: Sequence[int]) -> list[int]:
        """The model's slot ids as SGLang's."""
        return [s + self.ps for s in slots]

    def pages(self, slots: Sequence[int]) -> list[torch.Tensor]:
        """SGLang ``slots`` cut into pages, each the ``page_size`` slots of one pool page
        in order: SGLang's segment frees read one representative per page."""
        ps = self.ps
        if len(slots) % ps:
            raise ValueError(f"{NAME}: {len(slots)} slots are not whole pages of {ps}")
        pages = [list(slots[i:i + ps]) for i in range(0, len(slots), ps)]
        for page in pages:
            if page != list(range(page[0], page[0] + ps)) or page[0] % ps:
                raise ValueError(f"{NAME}: {page} is not one page of {ps} slots")
        return [torch.tensor(page, dtype=torch.int64) for page in pages]

    def mapping(self) -> torch.Tensor:
        """The full->SWA mapping without its trailing -1 sentinel (0: no SWA half)."""
        mapping: torch.Tensor = self.allocator.full_to_swa_index_mapping
        return mapping[:-1]

    def full_free(self) -> frozenset[int]:
        """SGLang's free full slots."""
        return _free_slots(self.allocator.full_attn_allocator)

    def alloc(self, num_tokens: int, freed_by_tree: set[int]) -> tuple[int, ...] | None:
        """``num_tokens`` fresh pairs' full slots (model ids), or None. A slot handed out
        again leaves ``freed_by_tree`` (the duplicates an insert freed, DEV-24; SGLang
        ids): ``free`` would skip it as freed already, and leak it."""
        if num_tokens % self.ps:
            raise ValueError(f"{NAME}: alloc({num_tokens}) is not whole pages of {self.ps}")
        if num_tokens == 0:
            return ()
        if self.ps == 1:
            # The scheduler's alloc_token_slots (allocation.py); page size 1 only.
            got = self.allocator.alloc(num_tokens)
        else:
            # SWATokenToKVPoolAllocator.alloc asserts page size 1; the scheduler's
            # paged path is alloc_extend for a request with no prefix (last_loc -1).
            zero, n = torch.tensor([0]), torch.tensor([num_tokens])
            got = self.allocator.alloc_extend(zero, zero, n, n, torch.tensor([-1]), num_tokens)
        if got is None:
            return None
        slots = tuple(int(s) for s in got.tolist())
        self.held.update(dict.fromkeys(slots, True))
        freed_by_tree.difference_update(slots)
        return self.to_model(slots)

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        """``codes[i]`` into every layer of both halves of pair ``full_slots[i]``."""
        if len(full_slots) != len(codes):
            raise ValueError(f"{NAME}: {len(full_slots)} slots, {len(codes)} codes")
        if any(not 0 <= c < EXACT for c in codes):
            raise ValueError(f"{NAME}: codes must lie in [0, 2**24) to be exact in float32")
        index = torch.tensor(self.to_sglang(full_slots), dtype=torch.int64)
        values = torch.tensor(list(codes), dtype=DTYPE).view(-1, HEADS, HEAD_DIM)
        for buffer in _buffers(self.kv.full_kv_pool):
            buffer[index] = values
        swa = self.mapping()[index]
        live = swa > 0  # 0: the pair has no SWA half
        for buffer in _buffers(self.kv.swa_kv_pool):
            buffer[swa[live]] = values[live]

    def free_swa(self, full_slots: Sequence[int]) -> None:
        """Drop the SWA halves, as the scheduler's ``free_swa_out_of_window_slots``
        frees a row segment."""
        for page in self.pages(self.to_sglang(full_slots)):
            self.allocator.free_swa_segment(page, start_pos=0)
            self.held.update(dict.fromkeys(page.tolist(), False))

    def free(self, full_slots: Sequence[int], freed_by_tree: set[int]) -> None:
        """Return pairs, but not those the tree freed already (DEV-24; SGLang ids, which
        leave ``freed_by_tree``). As ``free_kv_row_segments``: a pair without its SWA half
        frees its full half only (``free_segment`` would free the sink slot 0 as one)."""
        mine = self.to_sglang(full_slots)
        rest = [s for s in mine if s not in freed_by_tree]
        freed_by_tree.difference_update(mine)
        mapping = self.mapping()
        for page in self.pages(rest):
            if int(mapping[int(page[0])]) > 0:
                self.allocator.free_segment(page, start_pos=0)
            else:
                self.allocator.free_full_segment(page, start_pos=0)
            for slot in page.tolist():
                self.held.pop(slot, None)

    def view_fields(self) -> dict[str, Any]:
        """The free sets, the mapping's entries and the KV codes of an ``SwaView``, in
        model ids."""
        ps = self.ps
        full_kv = _codes(self.kv.full_kv_pool.k_buffer[0], self.full_ids)
        swa_kv = _codes(self.kv.swa_kv_pool.k_buffer[0], self.swa_ids)
        return {
            "full_free": frozenset(self.to_model(self.full_free())),
            "swa_free": frozenset(self.to_model(_free_slots(self.allocator.swa_attn_allocator))),
            "pairs": {slot - ps: int(swa) - ps
                      for slot, swa in enumerate(self.mapping().tolist()) if swa != 0},
            "full_kv": {slot - ps: code for slot, code in full_kv.items()},
            "swa_kv": {slot - ps: code for slot, code in swa_kv.items()},
        }

    def balance_problem(self, full: tuple[int, int], swa: tuple[int, int]) -> str | None:
        """The scheduler's pool balance (``invariant_checker._check_pool_invariant``) per
        pool, given each pool's (evictable, protected) as the cache counts them:
        available + evictable + protected + held by callers = capacity."""
        for pool, available, (evictable, protected), held, capacity in [
            ("full", self.allocator.full_available_size(), full, len(self.held),
             self.config.full_slots),
            ("swa", self.allocator.swa_available_size(), swa, sum(self.held.values()),
             self.config.swa_slots),
        ]:
            if available + evictable + protected + held != capacity:
                return (f"{pool} pool balance: available {available} + evictable {evictable} "
                        f"+ protected {protected} + held {held} != {capacity}")
        return None


@dataclass
class SglangRequest:
    """A stand-in for SGLang's ``Req`` with the fields the cache's request-level calls
    read (``checkpoint_into_tree``, ``free_swa_out_of_window_slots``, ``free_kv_row``,
    ``on_release``); ``kv`` is a real ``ReqKvInfo``, so its cursors and lengths follow
    SGLang's own logic. ``tokens`` is the whole sequence the request will have computed
    when it finishes (prompt, then decoded tokens); SGLang never reads it."""

    rid: str
    origin_input_ids: array[int]
    kv: Any
    full_untruncated_fill_ids: array[int]
    extend_end: int = 0
    done: bool = False
    priority: int = 0
    session_id: None = None
    session: None = None
    kv_rotation_base: None = None
    extra_key: None = None
    cache_salt: None = None
    lock: Any = None
    last_node: Any = None
    swa_branching_seqlen: int | None = None
    # What ``match_prefix_and_adopt`` (common.py:245-258) copies off a match with host
    # hits, for ``init_load_back``.
    best_match_node: Any = None
    host_hit_length: int = 0
    swa_host_hit_length: int = 0
    mamba_host_hit_length: int = 0
    finished_reason: None = None
    tokens: tuple[int, ...] = ()

    def finished(self) -> bool:
        return self.done

    def get_fill_ids(self) -> array[int]:
        return self.full_untruncated_fill_ids[: self.extend_end]


def new_request(kv: Any, rid: str, tokens: Sequence[int], prompt_len: int,
                engine: str) -> SglangRequest:
    """A request ``rid`` whose prompt is ``tokens[:prompt_len]`` and which will have
    computed ``tokens`` when it finishes, with ``kv`` (a fresh ``ReqKvInfo``); not yet
    admitted."""
    if not 0 < prompt_len <= len(tokens):
        raise ValueError(f"{engine}: prompt_len must lie in 1..{len(tokens)}, got {prompt_len}")
    prompt = array("q", tokens[:prompt_len])
    return SglangRequest(rid=rid, origin_input_ids=prompt, kv=kv,
                         full_untruncated_fill_ids=array("q", prompt), tokens=tuple(tokens))


@contextmanager
def inserts_observed(cache: Any, record: Callable[[Any, Any], None]) -> Iterator[None]:
    """While open, every ``cache.insert`` is passed to ``record`` with its params and
    its result: what a request-level call inserted, which it reports nowhere."""
    insert = cache.insert

    def observed(params: Any) -> Any:
        result = insert(params)
        record(params, result)
        return result

    cache.insert = observed
    try:
        yield
    finally:
        del cache.insert  # the class's method again


def release_row(cache: Any, rows: Any, req: SglangRequest, owned: int,
                checkpointed: bool) -> None:
    """The rest of ``release_kv_cache`` (common.py:433-443) after its checkpoint, if any:
    the row past the protected prefix freed (``free_kv_row``: a pair behind the request's
    SWA cursor frees its full half only), the lock released, ``on_release`` run (without
    a checkpoint, each component's ``cleanup_after_caching_req(is_finished=True)``), the
    row given back."""
    cache.free_kv_row(req.kv, [(req.kv.cache_protected_len, owned)])
    cache.unlock(req.lock)
    req.lock = None
    cache.on_release(req, checkpointed=checkpointed)
    rows.free(req)


def advance_request(req: SglangRequest, end: int, engine: str) -> None:
    """The forward pass computed ``req`` up to position ``end``: its committed length,
    extend end and fill ids move there (the scheduler's ``prepare_for_extend`` /
    ``prepare_for_decode`` and the result processor). Its row must hold slots that far."""
    last = min(req.kv.kv_allocated_len, len(req.tokens))
    if not req.kv.kv_committed_len <= end <= last:
        raise ValueError(f"{engine}: advance to {end} outside {req.kv.kv_committed_len}..{last}")
    req.kv.kv_committed_len = req.extend_end = end
    req.full_untruncated_fill_ids = array("q", req.tokens[:end])


@dataclass
class _Node:
    """One tree node as ``observe`` reads it."""

    prefix: tuple[int, ...]  # the tokens before this node on its root path
    node: Any


class SglangSwaAdapter:
    """One (FULL, SWA) ``UnifiedRadixCache``, device tier only, Python tree core.

    ``lock_granularity`` is ``"node"``: SGLang's SWA lock walks up from the locked node
    adding whole node lengths until the window is covered (spec/13 DEV-H1).

    ``hicache``: None for the device-only cache the server builds without
    ``--enable-hierarchical-cache``; a write policy for the cache with SGLang's host tier
    under that policy (module docstring), still observed on the device tier only."""

    name = NAME
    lock_granularity: LockGranularity = "node"

    def __init__(self, config: SwaConfig, hicache: WritePolicy | None = None,
                 req_rows: int = 0, max_context_len: int = 0,
                 hicache_ratio: float = HICACHE_RATIO) -> None:
        if hicache is not None and hicache not in WRITE_POLICIES:
            raise ValueError(f"{NAME}: hicache must be one of {WRITE_POLICIES}, got {hicache!r}")
        if not (isinstance(hicache_ratio, float) and hicache_ratio >= 1.0):
            raise ValueError(f"{NAME}: hicache_ratio must be a float >= 1.0, got "
                             f"{hicache_ratio!r}")
        self.hicache = hicache
        self._host_match: tuple[Key | None, int] | None = None  # the last match's, HiCache
        self._match: Any = None  # the last match's MatchResult, for ``load_back``
        if hicache is None:
            self.version = probe()
        else:
            self.name = f"{NAME}-hicache-{hicache}"
            self.version = probe_hicache(self.name)
        self.config = config
        self.env, swa = _modules()
        self.m = self.env.modules
        self.env.clock.now = 0  # not the previous cache's last tick
        ps = self.ps = config.page_size
        self.pools = SwaPoolPair(config, swa["swa_pool"], swa["swa_alloc"])
        self.req_kv = swa["batch"].ReqKvInfo
        self.requests = 0  # requests made by ``new_request``, for their ids
        self.kv, self.allocator = self.pools.kv, self.pools.allocator
        self.held = self.pools.held  # caller-held full slot -> has its SWA half
        types = self.m["components"].ComponentType
        self.full_ct, self.swa_ct = types.FULL, types.SWA
        # ``req_rows``: a ReqToTokenPool of that many rows, for the request-level calls
        # (``checkpoint``, ``slide_window``, ``release``) that read a request's row.
        self.rows = None if req_rows == 0 else self.m["pool"].ReqToTokenPool(
            size=req_rows, max_context_len=max_context_len, device="cpu",
            enable_memory_saver=False)
        params = self.m["params"].CacheInitParams(
            disable=False, req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator,
            page_size=ps, eviction_policy="lru", tp_cache_group=self.env.group,
            tree_components=(self.full_ct, self.swa_ct), sliding_window_size=config.window,
            tree_core_backend="python")
        if hicache is not None:
            # What the server publishes before building its caches: HiCache on, host
            # pools sized off the device pools, direct copies (the CPU stand-ins of
            # ``patch_for_cpu``), the layout whose transfers those stand-ins cover.
            args = self.m["args"].ServerArgs(
                model_path="dummy", device="cpu", page_size=ps, enable_hierarchical_cache=True,
                hicache_ratio=hicache_ratio, hicache_size=0, hicache_mem_layout="layer_first",
                hicache_write_policy=hicache, hicache_io_backend="direct",
                hicache_storage_backend=None, radix_eviction_policy="lru")
            self.m["context"].publish(args, role="test")
        self.cache = self.m["uni"].UnifiedRadixCache(params)
        if hicache is not None:
            self.cache.init_hicache(args, params)
            if self.cache.cache_controller.write_policy != hicache:
                raise EngineUnavailable(f"{self.name}: asked for {hicache}, the controller "
                                        f"runs {self.cache.cache_controller.write_policy}")
        self.tree = self.cache.tree_core
        if type(self.tree) is not self.m["core"].UnifiedTreeCore:
            raise EngineUnavailable(f"{NAME}: asked for the Python tree core, got "
                                    f"{type(self.tree).__name__} ({SETUP})")
        self.freed_by_tree: set[int] = set()  # DEV-24: duplicates the last insert freed

    # -- plumbing ---------------------------------------------------------------------

    def _tick(self) -> None:
        """One logical tick per operation: the shared clock numbers at most 2**20 stamps
        per tick (``UnifiedClock``), and stamps stay increasing across ticks."""
        self.env.clock.now += 1

    def _settle(self) -> None:
        """With HiCache: poll the controller as the scheduler does after each step until
        no copy is in flight. A write-through holds a full lock on its node until its ack
        (``_track_write_through_node``), which the device-tier model does not have."""
        if self.hicache is None:
            return
        for _ in range(SETTLE_POLLS):
            self.cache.check_hicache_events()
            if not self.cache.ongoing_write_through and not self.cache.ongoing_load_back:
                return
        raise AssertionError(
            f"{self.name}: copies still in flight after {SETTLE_POLLS} polls: write "
            f"{sorted(self.cache.ongoing_write_through)}, load "
            f"{sorted(self.cache.ongoing_load_back)}")

    def _out(self, slots: Iterable[int]) -> tuple[int, ...]:
        return self.pools.to_model(slots)

    def _in(self, slots: Sequence[int]) -> list[int]:
        return self.pools.to_sglang(slots)

    def _index(self, slots: Sequence[int]) -> torch.Tensor:
        return torch.tensor(list(slots), dtype=torch.int64)

    def _mapping(self) -> torch.Tensor:
        return self.pools.mapping()

    def _nodes(self) -> Iterator[_Node]:
        """Every node but the root, parents first."""
        root = self.tree.root_node
        stack = [_Node((), child) for child in root.children.values()]
        while stack:
            here = stack.pop()
            yield here
            below = here.prefix + tuple(here.node.key.token_ids)
            stack.extend(_Node(below, child) for child in here.node.children.values())

    def _page_of(self, node: Any) -> Key | None:
        """The page that ends where ``node`` ends (None: the root)."""
        parts: list[tuple[int, ...]] = []
        while node is not self.tree.root_node:
            parts.append(tuple(node.key.token_ids))
            node = node.parent
        tokens = tuple(t for part in reversed(parts) for t in part)
        return Key(tokens, None) if tokens else None

    def _cached_full(self, key: Key) -> list[int]:
        """The tree's device full slots along ``key``, page by page, as far as it is
        cached on the device (read only: no stamp, no split). A host-only node ends it:
        below it nothing is on the device (``sanity_check``: "device present but parent
        evicted")."""
        node, done, slots = self.tree.root_node, 0, list[int]()
        while done < len(key.tokens):
            for child in node.children.values():
                tokens = tuple(child.key.token_ids)
                if tokens[:self.ps] == key.tokens[done:done + self.ps]:
                    break
            else:
                break
            value = child.component_data[self.full_ct].value
            if value is None:
                break
            common = 0
            while (common < len(tokens) and done + common < len(key.tokens)
                   and tokens[common] == key.tokens[done + common]):
                common += 1
            common -= common % self.ps
            slots.extend(value[:common].tolist())
            if common < len(tokens):
                break
            node, done = child, done + common
        return slots

    def _tree_full(self) -> set[int]:
        """The device full slots the tree holds (host-only nodes hold none)."""
        values = (n.node.component_data[self.full_ct].value for n in self._nodes())
        return {s for value in values if value is not None for s in value.tolist()}

    # -- the operations -----------------------------------------------------------------

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        self._tick()
        return self.pools.alloc(num_tokens, self.freed_by_tree)

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        self.pools.write_kv(full_slots, codes)

    def free_swa(self, full_slots: Sequence[int]) -> None:
        self._tick()
        self.pools.free_swa(full_slots)

    def free(self, full_slots: Sequence[int]) -> None:
        self._tick()
        self.pools.free(full_slots, self.freed_by_tree)

    def match_prefix(self, key: Key) -> tuple[tuple[int, ...], Key | None]:
        self._tick()
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, key)))
        # With HiCache the match also walks host-only nodes (a host hit, for a load back
        # the machine never asks for); last_device_node is where the device part ends.
        slots = self.tree.collect_full_device_indices(got.last_device_node,
                                                      self.tree.root_node.id)
        # Where the match ends on either tier (best_match_node, the anchor of a load
        # back) and the Full-KV tokens to load up to there (host_hit_length).
        self._host_match = (self._page_of(self.tree.node_by_id(got.best_match_node)),
                            int(got.host_hit_length))
        self._match = got
        self._settle()
        return (self._out(int(s) for s in slots.tolist()),
                self._page_of(self.tree.node_by_id(got.last_device_node)))

    def last_host_match(self) -> tuple[Key | None, int]:
        """Of the last ``match_prefix`` (HostMatchingSwaEngine): SGLang's
        ``best_match_node`` as a page (None: the root) and its ``host_hit_length``."""
        if self.hicache is None or self._host_match is None:
            raise ValueError(f"{self.name}: no match with host hits to report")
        return self._host_match

    def load_back(self) -> tuple[int, Key | None]:
        """Act on the last ``match_prefix``'s host hit as the server's scheduler does
        (HostLoadingSwaEngine, ``sglang_unified.load_back_as_scheduled``), the loads
        acknowledged before it returns. Returns the full tokens loaded and the page the
        request's prefix now ends at (None: the root)."""
        if self.hicache is None or self._match is None:
            raise ValueError(f"{self.name}: no match with host hits to load back")
        self._tick()
        got, self._match = self._match, None  # a match is loaded back once
        req = self.new_request((1,), 1)
        req.last_node = got.last_device_node
        req.best_match_node = got.best_match_node
        req.host_hit_length = int(got.host_hit_length)
        req.swa_host_hit_length = int(got.swa_host_hit_length)
        tokens, last = load_back_as_scheduled(self.env, self.cache, got, req, self.name)
        self._settle()
        return tokens, self._page_of(self.tree.node_by_id(last))

    def insert(self, key: Key, full_slots: Sequence[int], swa_evicted: int) -> int:
        self._tick()
        full_slots = self._in(full_slots)
        cached = self._cached_full(key)
        prev = 0  # DEV-24: the caller's leading run of the tree's own slots
        while prev < len(cached) and full_slots[prev] == cached[prev]:
            prev += 1
        free_before = self.pools.full_free()
        params = self.m["base"].InsertParams(
            key=radix_key(self.env, key), value=self._index(full_slots), prev_prefix_len=prev,
            component_evicted_seqlens={self.swa_ct: swa_evicted}, track_adopted_ranges=True)
        result = self.cache.insert(params)
        freed = self.pools.full_free() - free_before
        self.freed_by_tree = set(full_slots[prev:]) & freed
        taken = self._tree_full()
        for slot in full_slots:
            if slot in taken or slot in self.freed_by_tree:
                self.held.pop(slot, None)
        self._settle()  # the backups this insert queued (write_through, selective)
        # SGLang's prefix_len counts every node the walk passed, host-only ones too: it
        # gave those the caller's slots (``_unevict_node_on_insert``) and recorded them
        # as adopted FULL ranges. On the device tier they were not cached: the spec's
        # prefix is the device part, which ends where the device path along the key
        # ended before the call (a host-only node has no device node below it). A
        # healing insert adopts ranges too (``_recover_from_incoming``), inside it.
        prefix = int(result.prefix_len)
        device = min(prefix, len(cached))
        # An insert shorter than a page returns before its walk, with no ranges at all
        # (``begin_insert``: ``len(key) == 0``); it adopted nothing.
        ranges = {} if result.adopted_ranges is None else result.adopted_ranges
        adopted = {t for start, end in ranges.get(self.full_ct, []) for t in range(start, end)}
        if not set(range(device, prefix)) <= adopted:
            raise AssertionError(
                f"{self.name}: insert counted tokens {device}..{prefix} as cached, but "
                f"they were on no device node and SGLang adopted only {sorted(adopted)}")
        return device

    def lock(self, page: Key | None) -> object:
        self._tick()
        node = node_ending_at(self.tree.root_node, page)
        if node is None and page is not None:
            # The server locks the node its match ended at; a match splits there.
            self.cache.match_prefix(self.m["base"].MatchPrefixParams(
                key=radix_key(self.env, page)))
            node = node_ending_at(self.tree.root_node, page)
        if node is None:
            raise KeyError(f"{NAME}: {page} is not cached")
        # TreeLock: the anchor node's id and the receipt (DecLockRefParams).
        receipt = self.cache.lock(node.id)
        self._settle()
        return receipt

    def release_swa(self, receipt: object) -> None:
        self._tick()
        # UnifiedRadixCache.release_swa: dec_swa_lock_only, then its frees applied.
        self.cache.release_swa(receipt)
        self._settle()

    def unlock(self, receipt: object, swa_released: bool) -> None:
        self._tick()
        if not isinstance(receipt, self.m["base"].TreeLock):
            raise TypeError(f"{NAME}: a receipt is a TreeLock from lock(), got {receipt!r}")
        self.cache.dec_lock_ref(receipt.node, receipt.receipt, skip_swa=swa_released)
        self._settle()

    def evict_full(self, num_tokens: int) -> int:
        self._tick()
        got = self.cache.evict(self.m["base"].EvictParams(num_tokens=num_tokens))
        self._settle()
        return int(got.num_tokens_evicted)

    def evict_swa(self, num_tokens: int) -> int:
        self._tick()
        got = self.cache.evict(self.m["base"].EvictParams(swa_num_tokens=num_tokens))
        self._settle()
        return int(got.swa_num_tokens_evicted)

    def evict_for_alloc(self, full_need: int, swa_need: int) -> int:
        # What the server's allocator calls when a pool is short (allocator/swa.py:208-218
        # evict_to_free_tokens): one walk per component, full first, each to its target.
        self._tick()
        got = self.cache.evict_for_alloc(
            self.m["base"].EvictParams(num_tokens=full_need, swa_num_tokens=swa_need))
        self._settle()
        return int(got.num_tokens_evicted)

    # -- request-level calls (chunked prefill, decode, finish) ----------------------------
    # The server does not call ``insert`` for a request: it publishes the request's row
    # with ``checkpoint`` (common.py ``checkpoint_kv_cache`` per chunk,
    # ``release_kv_cache`` at the end), which also frees out-of-window SWA halves, caps
    # the key at the SWA branching point, rewrites the row and moves the request's lock.
    # ``req`` is a Req (or a stand-in with the fields ``checkpoint_into_tree`` reads)
    # bound to a row of ``rows``; the caller allocates its slots with ``alloc`` and
    # writes them into the row.

    def _resync_held(self) -> None:
        """After a request-level call: slots the tree took or freed leave ``held``, and
        a held pair whose SWA half the call freed is marked so (the call frees both
        inside SGLang, where the adapter cannot hook)."""
        free = self.pools.full_free()
        taken = self._tree_full()
        mapping = self._mapping()
        for slot in list(self.held):
            if slot in taken or slot in free:
                del self.held[slot]
            else:
                self.held[slot] = int(mapping[slot]) > 0

    def new_request(self, tokens: Sequence[int], prompt_len: int) -> SglangRequest:
        """A request whose prompt is ``tokens[:prompt_len]``, not yet admitted."""
        self.requests += 1
        return new_request(self.req_kv(), f"r{self.requests}", tokens, prompt_len, self.name)

    def advance(self, req: SglangRequest, end: int) -> None:
        """The forward pass computed the request up to ``end`` (``advance_request``)."""
        advance_request(req, end, self.name)

    def protected_len(self, req: Any) -> int:
        """The request's ``cache_protected_len``: the row prefix the tree owns."""
        return int(req.kv.cache_protected_len)

    def admit(self, req: Any, prompt: Key) -> tuple[int, ...]:
        """A new request's admission (``PrefillAdder``: ``match_prefix``, then the
        request locks the node its device match ended at): sets the fields
        ``checkpoint_into_tree`` reads from the match, takes a row of ``rows`` and writes
        the matched slots into it. The matched full slots, as the model numbers them."""
        if self.rows is None:
            raise ValueError(f"{NAME}: admit needs an adapter built with req_rows")
        self._tick()
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, prompt)))
        slots = self.tree.collect_full_device_indices(got.last_device_node,
                                                      self.tree.root_node.id)
        req.kv.req_pool_idx = self.rows.alloc_rows(1)[0]
        req.kv.cache_protected_len = len(slots)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = len(slots)
        req.swa_branching_seqlen = got.swa_branching_seqlen
        req.last_node = got.last_device_node
        req.lock = self.cache.lock(got.last_device_node)
        self.rows.write((req.kv.req_pool_idx, slice(0, len(slots))), slots)
        self._settle()
        return self._out(int(s) for s in slots.tolist())

    def write_row(self, req: Any, start: int, full_slots: Sequence[int]) -> None:
        """Put ``full_slots`` (model numbering, from ``alloc``) in the request's row from
        position ``start`` on, as the scheduler's ``alloc_for_extend`` / decode do."""
        if self.rows is None:
            raise ValueError(f"{NAME}: write_row needs an adapter built with req_rows")
        self.rows.write((req.kv.req_pool_idx, slice(start, start + len(full_slots))),
                        torch.tensor(self._in(full_slots), dtype=torch.int32))
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, start + len(full_slots))

    def row(self, req: Any, end: int) -> tuple[int, ...]:
        """The request's row up to ``end``, as the model numbers slots."""
        if self.rows is None:
            raise ValueError(f"{NAME}: row needs an adapter built with req_rows")
        return self._out(int(s) for s in
                         self.rows.req_to_token[req.kv.req_pool_idx, :end].tolist())

    def locked_page(self, req: Any) -> Key | None:
        """The page the request's lock is anchored on (None: the root)."""
        return self._page_of(self.tree.node_by_id(req.lock.node))

    def locked_path(self, req: Any) -> tuple[int, ...]:
        """The tree's device full slots from the root to the request's locked node."""
        slots = self.tree.collect_full_device_indices(req.lock.node, self.tree.root_node.id)
        return self._out(int(s) for s in slots.tolist())

    def checkpoint(self, req: Any, up_to: int) -> list[tuple[int, int]]:
        """``UnifiedRadixCache.checkpoint(req, up_to=up_to)``, as the scheduler calls it.
        Returns ``(key length, swa_evicted)`` of each insert the call made.

        The insert's ``swa_evicted`` is the request's SWA cursor after the call's own
        out-of-window free, which ``checkpoint_into_tree`` reads into its InsertParams and
        reports nowhere; the cursor is not a record of it (a release clears the row), so
        the insert is observed in flight, and only for the length of this call."""
        if self.rows is None:
            raise ValueError(f"{NAME}: checkpoint needs an adapter built with req_rows")
        self._tick()
        inserts: list[tuple[int, int]] = []
        with inserts_observed(self.cache, lambda params, _: inserts.append(
                (len(params.key), int(params.component_evicted_seqlens.get(self.swa_ct, 0))))):
            self.cache.checkpoint(req, up_to=up_to)
        self._resync_held()
        self._settle()
        return inserts

    def slide_window(self, req: Any, pre_len: int) -> None:
        """``evict_sliding_windows(req, pre_len)``: a decode step's out-of-window SWA
        free (``ScheduleBatch.maybe_evict_swa`` passes ``seqlen - 1``)."""
        self._tick()
        self.cache.evict_sliding_windows(req, pre_len)
        self._resync_held()

    def release(self, req: Any, owned: int, checkpoint: bool = True) -> list[tuple[int, int]]:
        """``release_kv_cache(req, checkpoint=checkpoint)`` (common.py:403-443, without the
        speculative-decoding over-allocation step): with ``checkpoint`` a finished
        request's final checkpoint (the tree takes what it can key); without, a request
        the scheduler drops unpublished -- an abort (``scheduler.py:3819``), a retraction
        (``schedule_batch.py:2389`` ``release_req``). Then the row past the protected
        prefix is freed (``free_kv_row``: a pair behind the request's SWA cursor frees its
        full half only), the lock released, ``on_release`` run (without a checkpoint,
        each component's ``cleanup_after_caching_req(is_finished=True)``) and the row
        given back. Returns the final checkpoint's inserts (``checkpoint``; none
        without)."""
        if self.rows is None:
            raise ValueError(f"{NAME}: release needs an adapter built with req_rows")
        if checkpoint:
            req.done = True  # the tree reads finished() to tell the final insert
        inserts = self.checkpoint(req, up_to=owned) if checkpoint else []
        self._tick()
        release_row(self.cache, self.rows, req, owned, checkpoint)
        self._resync_held()
        self._settle()
        return inserts

    def observe(self) -> SwaView:
        pages: dict[Key, SwaPageView] = {}
        stray: list[str] = []  # device SWA values of nodes with no device full value
        for here in self._nodes():
            full_cd = here.node.component_data[self.full_ct]
            swa_cd = here.node.component_data[self.swa_ct]
            tokens = tuple(here.node.key.token_ids)
            if len(tokens) % self.ps:
                raise AssertionError(f"{self.name}: node {here.node.id} is not whole pages")
            if full_cd.value is None:
                # Host-only (HiCache): no device page. An SWA device value left on it
                # has no page to be reported under: it goes to the own check.
                if swa_cd.value is not None:
                    stray.append(f"node {here.node.id} keeps device SWA slots "
                                 f"{self._out(swa_cd.value.tolist())} without a device full "
                                 "value")
                continue
            full = full_cd.value.tolist()
            swa = None if swa_cd.value is None else swa_cd.value.tolist()
            for start in range(0, len(tokens), self.ps):
                cut = slice(start, start + self.ps)
                key = Key(here.prefix + tokens[:start + self.ps], None)
                pages[key] = SwaPageView(
                    full=self._out(full[cut]), swa=None if swa is None else self._out(swa[cut]),
                    lock=int(full_cd.lock_ref), swa_lock=int(swa_cd.lock_ref))
        return SwaView(pages=pages, **self.pools.view_fields(),
                       own_check="; ".join([*stray, *self._own_check()]) or None,
                       host=None if self.hicache is None else self._host_view(pages))

    def _host_view(self, on_device: Collection[Key]) -> SwaHostView:
        """The host tier as 13.8a's state: per page of each node with a host value, its
        host full and SWA slots (a node's host value covers the whole node, DEV-H12),
        each host pool's free slots (``free_slots`` and the staged ``release_slots``),
        and the code layer 0's K holds in each held host slot (``kv_buffer`` of a
        ``layer_first`` host pool: [K/V, layer, slot, head, dim])."""
        pages: dict[Key, SwaHostPageView] = {}
        held: dict[Any, set[int]] = {self.full_ct: set(), self.swa_ct: set()}
        for here in self._nodes():
            full_cd = here.node.component_data[self.full_ct]
            swa_cd = here.node.component_data[self.swa_ct]
            if full_cd.host_value is None and swa_cd.host_value is None:
                continue
            full = [] if full_cd.host_value is None else full_cd.host_value.tolist()
            swa = None if swa_cd.host_value is None else swa_cd.host_value.tolist()
            held[self.full_ct].update(full)
            held[self.swa_ct].update(swa or ())
            tokens = tuple(here.node.key.token_ids)
            for start in range(0, len(tokens), self.ps):
                cut = slice(start, start + self.ps)
                pages[Key(here.prefix + tokens[:start + self.ps], None)] = SwaHostPageView(
                    full=tuple(full[cut]), swa=None if swa is None else tuple(swa[cut]))
        full_pool, swa_pool = self.cache.full_kv_pool_host, self.cache.swa_kv_pool_host
        # DEV-H11: under write_back a node is backed up alone, and host pressure reclaims
        # full host copies while their SWA host copies stay -- on pages whose device full
        # copy is still there. A host-only page without a full host copy is no part of it.
        exempt = {"INV-SWA-HOST-ONLY-WITH-FULL": frozenset(
            key for key, page in pages.items() if not page.full and key in on_device)} \
            if self.hicache == "write_back" else {}
        return SwaHostView(
            pages=pages, full_slots=int(full_pool.logical_size),
            swa_slots=int(swa_pool.logical_size), full_free=host_free_slots(full_pool),
            swa_free=host_free_slots(swa_pool),
            full_kv=_host_codes(full_pool, held[self.full_ct]),
            swa_kv=_host_codes(swa_pool, held[self.swa_ct]),
            exempt={spec_id: keys for spec_id, keys in exempt.items() if keys})

    def _own_check(self) -> list[str]:
        """SGLang's ``sanity_check`` (tree, leaf sets, LRUs, size counters; with HiCache
        also host leaves, host LRUs and copies in flight), then the scheduler's pool
        balance (``invariant_checker._check_pool_invariant``) per device pool: available
        + evictable + protected + held by callers = capacity; with HiCache the host pools
        (``_host_problems``). The first failure only, as the checks build on each other."""
        try:
            self.cache.sanity_check()
        except AssertionError as failed:
            return [f"sanity_check: {failed}"]
        balance = self.pools.balance_problem(
            (self.cache.full_evictable_size(), self.cache.full_protected_size()),
            (self.cache.swa_evictable_size(), self.cache.swa_protected_size()))
        if balance is not None:
            return [balance]
        return self._host_problems() if self.hicache is not None else []

    def _host_problems(self) -> list[str]:
        """Per host pool (FULL: the KV pool, SWA: the SWA pool): the host values of the
        tree's nodes and the pool's free list (``free_slots`` and the frees staged in
        ``release_slots``) partition its slots, and its ``slot_used`` flags mark exactly
        the owned ones. SGLang keeps no host evictable / protected counters to balance
        (``sanity_check`` PART 4 counts device values only); a slot owned twice or both
        owned and free, or one neither owned nor free (a leak), is what this finds."""
        problems: list[str] = []
        for ct, pool in [(self.full_ct, self.cache.full_kv_pool_host),
                         (self.swa_ct, self.cache.swa_kv_pool_host)]:
            owned: dict[int, int] = {}  # host slot -> the node whose host value holds it
            for here in self._nodes():
                value = here.node.component_data[ct].host_value
                for slot in [] if value is None else value.tolist():
                    if slot in owned:
                        problems.append(f"{ct.name} host slot {slot} held by nodes "
                                        f"{owned[slot]} and {here.node.id}")
                    owned[slot] = here.node.id
            free = pool.free_slots.tolist() + [s for part in pool.release_slots
                                               for s in part.tolist()]
            if len(free) != len(set(free)):
                problems.append(f"{ct.name} host free list holds a slot twice")
            if pool.available_size() != len(free):
                problems.append(f"{ct.name} host available_size {pool.available_size()} != "
                                f"{len(free)} free slots")
            both = set(free) & owned.keys()
            lost = set(range(pool.logical_size)) - set(free) - owned.keys()
            if both:
                problems.append(f"{ct.name} host slots both free and held: {sorted(both)}")
            if lost:
                problems.append(f"{ct.name} host slots neither free nor held: {sorted(lost)}")
            used = set(torch.nonzero(pool.slot_used).flatten().tolist())
            if used != owned.keys():
                problems.append(f"{ct.name} host slot_used differs from the held slots: "
                                f"only flagged {sorted(used - owned.keys())}, only held "
                                f"{sorted(owned.keys() - used)}")
        return problems

    def close(self) -> None:
        self.cache.shutdown()


def build(config: SwaConfig) -> SglangSwaAdapter:
    """An ``SglangSwaAdapter`` for ``config``, with request rows for the scheduler's
    request-level calls (``ScheduledSwaEngine``)."""
    return SglangSwaAdapter(config, req_rows=REQ_ROWS, max_context_len=MAX_CONTEXT)


def build_hicache(policy: WritePolicy, hicache_ratio: float = HICACHE_RATIO,
                  ) -> Callable[[SwaConfig], SglangSwaAdapter]:
    """The builder of ``SglangSwaAdapter``s with HiCache under ``policy``, host pools
    ``hicache_ratio`` times the device pools' size."""
    if policy not in WRITE_POLICIES:
        raise ValueError(f"{NAME}: hicache must be one of {WRITE_POLICIES}, got {policy!r}")

    def build_with(config: SwaConfig) -> SglangSwaAdapter:
        return SglangSwaAdapter(config, hicache=policy, req_rows=REQ_ROWS,
                                max_context_len=MAX_CONTEXT, hicache_ratio=hicache_ratio)
    return build_with


# One builder per write policy, for a registry that names a module attribute.
build_write_through = build_hicache("write_through")
build_write_through_selective = build_hicache("write_through_selective")
build_write_back = build_hicache("write_back")
