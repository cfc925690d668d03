"""Adapter for SGLang 0.5.23's ``UnifiedRadixCache`` with the (FULL, MAMBA) components.

This is the cache SGLang's server builds for a hybrid SSM model (Qwen3-Next, Nemotron-H,
...) without ``--enable-hierarchical-cache`` (``registry.create_unified_radix_cache``:
components ``(FULL, MAMBA)``), over the pools ``kv_cache_configurator`` builds for it:

- a ``HybridReqToTokenPool`` (``_build_hybrid_req_pool``), which owns the ``MambaPool``
  (conv and temporal state per Mamba layer and slot) and its ``MambaSlotAllocator``;
- a ``HybridLinearKVPool`` over that Mamba pool, whose ``full_kv_pool`` is an
  ``MHATokenToKVPool`` for the full-attention layers;
- a ``TokenToKVPoolAllocator`` (page size 1) or ``PagedTokenToKVPoolAllocator`` over it.

One full-attention layer (0) and one Mamba layer (1), each of the smallest shape; the
Python tree core is asked for by name and checked. It speaks
``hiradix.conformance.mamba.engine.MambaEngine`` (spec/13m). What it maps:

- Slot ids: the full allocator reserves page 0 (slots ``0 .. P - 1``) and the Mamba
  allocator slot 0 as padding sinks; the model numbers both pools from 0, so SGLang's full
  slot ``s`` is the model's ``s - P`` and its state slot ``m`` the model's ``m - 1``.
- Contents: KV codes go into every K / V buffer of the full pool, state codes into the
  conv and temporal state of the Mamba layer; ``observe`` reads layer 0's K and the
  temporal state's first element. Both are filled with NaN when built ("never written");
  codes are float32, exact below 2**24.
- Pages (13m.8): a node of ``k`` pages gives ``k`` pages with its full slots page by
  page and its full ``lock_ref`` each; its Mamba value and Mamba ``lock_ref`` sit on its
  last page (the other pages: no state, state lock 0).
- ``insert`` passes ``prev_prefix_len = len(key)``, as SGLang's own prompt re-insert
  does: the tree frees none of the caller's duplicate slots, which stay the caller's as
  13m.3 says. (The scheduler's ``checkpoint`` passes ``cache_protected_len`` and the tree
  frees the duplicates past it itself: DEV-24.)
- ``fork`` is copy on write as the server does it: ``match_prefix`` with ``cow_mamba``
  and a request (``MambaComponent.finalize_match_result_in_cache`` allocates the
  request's slot and records ``mamba_cow_src_index``), then the copy the model runner
  makes before the forward pass (``ModelRunner``: ``copy_mamba_state``). Where the
  Mamba pool is empty it returns None without asking SGLang, which would evict a state
  to make room (the protocol's "no room").
- ``release_state`` is the Mamba-only release SGLang makes in
  ``MambaComponent._alloc_mamba_slot`` (lazy extra buffer): ``dec_lock_ref`` with the
  receipt's every other component skipped, then MAMBA added to the receipt's skipped
  set so that the final release leaves it alone. ``release_swa`` (the other early
  release) does nothing without an SWA component.
- Page size > 1 needs the Mamba extra buffer (``MambaComponent.__init__`` asserts page
  size 1 without it), so above 1 the cache and the pool are built with
  ``enable_mamba_extra_buffer``; the tree's calls the adapter drives do not read it.
- ``own_check``: SGLang's ``sanity_check`` (tree, leaf set, Mamba LRU, per-component
  size counters, full lock >= Mamba lock per node), then the scheduler's pool balance
  (``invariant_checker._check_pool_invariant``, full and Mamba) with the slots callers
  hold added: available + evictable + protected + held = capacity.
"""

from __future__ import annotations

import importlib
import math
from collections import deque
from collections.abc import Iterable, Iterator, Mapping, Sequence
from dataclasses import replace
from types import SimpleNamespace
from typing import Any

import torch

from hiradix.conformance.mamba.engine import MambaHit, MambaPageView, MambaView
from hiradix.engines.protocol import EngineUnavailable, probe_engine
from hiradix.engines.sglang.swa import (
    DTYPE,
    EXACT,
    SETUP,
    VERSIONS,
    SglangRequest,
    advance_request,
    inserts_observed,
    new_request,
    release_row,
)
from hiradix.engines.sglang.unified import prepare, radix_key
from hiradix_model import Key
from hiradix_model.mamba import MambaConfig

# The SGLang version, setup command, code dtype and its exact range are the (FULL, SWA)
# adapter's: the same UnifiedRadixCache release, components aside.
NAME = "sglang-mamba"
FULL_LAYERS, MAMBA_LAYERS = [0], [1]  # one full-attention and one Mamba layer
# HybridReqToTokenPool rows and their length: rows for the request-level calls of
# ``SglangMambaScheduledAdapter`` (the machine keeps at most four requests of at most 18
# tokens live); the protocol's own calls use none.
REQ_ROWS, MAX_CONTEXT = 8, 64
_MODULES = {
    "pool": "sglang.srt.mem_cache.memory_pool",
    "mamba_utils": "sglang.srt.configs.mamba_utils",
    "batch": "sglang.srt.managers.schedule_batch",
}
# What the adapter calls or sets, by (module, class): probed before a cache is built.
_CALLED = {
    ("uni", "UnifiedRadixCache"): ("match_prefix", "insert", "lock", "unlock",
                                   "dec_lock_ref", "evict", "sanity_check",
                                   "mamba_evictable_size", "mamba_protected_size"),
    ("pool", "HybridReqToTokenPool"): ("copy_mamba_state", "translate_mamba_indices"),
    ("pool", "HybridLinearKVPool"): (),
    ("batch", "ReqKvInfo"): (),
}
_FIELDS = {
    ("base", "MatchPrefixParams"): "cow_mamba",
    ("base", "InsertParams"): "mamba_value",
    ("base", "EvictParams"): "mamba_num",
    ("params", "CacheInitParams"): "enable_mamba_extra_buffer",
}


def _sglang() -> dict[str, Any]:
    """SGLang's modules this adapter reads: the shared UnifiedRadixCache ones (whose
    CPU patches and tree-core clock ``prepare`` applies once) and the Mamba pools'."""
    return {**prepare().modules, **{k: importlib.import_module(v) for k, v in _MODULES.items()}}


def probe(engine: str = NAME) -> str:
    """The installed SGLang version if this adapter can drive it; ``EngineUnavailable``
    (missing, wrong version, or an API this adapter does not know) otherwise."""
    def load() -> None:
        mods = _sglang()
        for (module, cls), names in _CALLED.items():
            owner = getattr(mods[module], cls)
            missing = [name for name in names if not callable(getattr(owner, name, None))]
            if missing:
                raise AttributeError(f"{cls} has no {', '.join(missing)}")
        for (module, cls), name in _FIELDS.items():
            if name not in getattr(mods[module], cls).__dataclass_fields__:
                raise AttributeError(f"{cls} has no field {name}")
    return probe_engine(engine, "sglang", VERSIONS, "UnifiedRadixCache with a Mamba component",
                        SETUP, load)


def _nan_fill(tensors: Iterable[torch.Tensor]) -> None:
    for tensor in tensors:
        tensor.fill_(float("nan"))  # "never written" (module docstring)


def _require_code(code: int, what: str) -> None:
    if isinstance(code, bool) or not isinstance(code, int) or not 0 <= code < EXACT:
        raise ValueError(f"{NAME}: {what} must be an int in [0, 2**24), got {code!r}")


def state_rows(m: Mapping[str, Any], config: MambaConfig) -> Any:
    """The ``HybridReqToTokenPool`` the server builds for a Mamba model
    (``_build_hybrid_req_pool``), which owns the ``MambaPool`` of ``config.state_slots``
    states of the smallest Mamba2 shape (one head, one channel, a conv window of one);
    with the Mamba extra buffer above page size 1, which ``MambaComponent`` asserts
    without it. ``m``: the adapter's SGLang modules (``_sglang``)."""
    mamba_utils = m["mamba_utils"]
    shape = mamba_utils.Mamba2StateShape.create(
        tp_world_size=1, intermediate_size=1, n_groups=1, num_heads=1, head_dim=1,
        state_size=1, conv_kernel=2)
    params = mamba_utils.Mamba2CacheParams(
        shape=shape, layers=MAMBA_LAYERS,
        dtype=mamba_utils.Mamba2StateDType(conv=DTYPE, temporal=DTYPE))
    return m["pool"].HybridReqToTokenPool(
        size=REQ_ROWS, mamba_size=config.state_slots, mamba_spec_state_size=REQ_ROWS,
        max_context_len=MAX_CONTEXT, device="cpu", enable_memory_saver=False,
        cache_params=params, mamba_layer_ids=MAMBA_LAYERS,
        enable_mamba_extra_buffer=config.page_size > 1, enable_overlap_schedule=False)


class SglangMambaAdapter:
    """One (FULL, MAMBA) ``UnifiedRadixCache``, device tier, Python tree core.

    ``held_full`` / ``held_states``: the slots (model ids) the caller holds (allocated,
    owned by no node), for the argument checks and the pool balance of ``own_check``."""

    name = NAME

    def __init__(self, config: MambaConfig) -> None:
        if not isinstance(config, MambaConfig):
            raise TypeError(f"{NAME}: config must be a MambaConfig, got {config!r}")
        self.version = probe()
        self.config = config
        self.env = prepare()
        self.m = _sglang()
        self.env.clock.now = 0  # not the previous cache's last tick
        ps = self.ps = config.page_size
        types = self.m["components"].ComponentType
        self.full_ct, self.mamba_ct = types.FULL, types.MAMBA
        self.req_kv = self.m["batch"].ReqKvInfo
        extra_buffer = ps > 1  # MambaComponent asserts page size 1 without it
        self.rows = state_rows(self.m, config)
        self.states = self.rows.mamba_pool
        self.kv = self.m["pool"].HybridLinearKVPool(
            size=config.full_slots, dtype=DTYPE, page_size=ps, head_num=1, head_dim=1,
            full_attention_layer_ids=FULL_LAYERS, device="cpu", mamba_pool=self.states,
            enable_memory_saver=False)
        full_pool = self.kv.full_kv_pool
        _nan_fill([*full_pool.k_buffer, *full_pool.v_buffer, self.states.mamba_cache.temporal,
                   *self.states.mamba_cache.conv])
        self.allocator = (
            self.m["token"].TokenToKVPoolAllocator(config.full_slots, DTYPE, "cpu", self.kv,
                                                   False) if ps == 1 else
            self.m["paged"].PagedTokenToKVPoolAllocator(config.full_slots, ps, DTYPE, "cpu",
                                                        self.kv, False))
        self._publish_args()
        params = self.m["params"].CacheInitParams(
            disable=False, req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator, page_size=ps, eviction_policy="lru",
            tp_cache_group=self.env.group, tree_components=(self.full_ct, self.mamba_ct),
            enable_mamba_extra_buffer=extra_buffer, tree_core_backend="python")
        self.params = params  # what a host tier is built from (``init_hicache``)
        self.cache = self.m["uni"].UnifiedRadixCache(params)
        self.tree = self.cache.tree_core
        if type(self.tree) is not self.m["core"].UnifiedTreeCore:
            raise EngineUnavailable(f"{NAME}: asked for the Python tree core, got "
                                    f"{type(self.tree).__name__} ({SETUP})")
        self.held_full: set[int] = set()
        self.held_states: set[int] = set()
        self._locks: list[Any] = []  # TreeLocks handed out and not yet unlocked

    def _publish_args(self) -> None:
        """``MambaComponent`` reads the server's Mamba settings (cache chunk, the
        per-path state cap, the lazy buffer) from the published ``ServerArgs``. A
        dummy model has no HF config to read the chunk size off, so it is pre-seeded
        (as SGLang's own fixtures do) to the page size: it only moves
        ``mamba_branching_seqlen``, which the protocol does not read."""
        args = self.m["args"].ServerArgs(model_path="dummy", device="cpu", page_size=self.ps)
        args._mamba_cache_chunk_size = self.ps
        self.m["context"].publish(args, role="test")

    # -- plumbing ---------------------------------------------------------------------

    def _tick(self) -> None:
        """One logical tick per operation (the shared ``UnifiedClock``)."""
        self.env.clock.now += 1

    def _full_out(self, slots: Iterable[int]) -> tuple[int, ...]:
        return tuple(int(s) - self.ps for s in slots)

    def _full_in(self, slots: Sequence[int]) -> list[int]:
        return [int(s) + self.ps for s in slots]

    def _walk(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """(the tokens from the root to a node's end, the node) for every node but the
        root, breadth first."""
        todo: deque[tuple[tuple[int, ...], Any]] = deque([((), self.tree.root_node)])
        while todo:
            above, node = todo.popleft()
            for child in node.children.values():
                end = above + tuple(child.key.token_ids)
                yield end, child
                todo.append((end, child))

    def _page_of(self, node_id: int) -> Key | None:
        """The page that ends where node ``node_id`` ends (None: the root)."""
        return next((Key(end, None) for end, node in self._walk() if node.id == node_id),
                    None)

    def _node_ending_at(self, page: Key) -> Any:
        """SGLang's node that ends where ``page`` ends, or None."""
        return next((node for end, node in self._walk() if end == page.tokens), None)

    def _cached_full(self, key: Key, pages: Mapping[Key, MambaPageView]) -> list[int]:
        """The full slots of the cached pages along ``key`` (model ids), as far as
        they go."""
        slots: list[int] = []
        for end in range(self.ps, len(key.tokens) + 1, self.ps):
            page = pages.get(Key(key.tokens[:end], None))
            if page is None:
                break
            slots.extend(page.full)
        return slots

    def _require_page(self, page: Key, what: str) -> None:
        if not isinstance(page, Key) or not page.tokens or len(page.tokens) % self.ps:
            raise ValueError(f"{NAME}: {what} must be a non-empty Key of whole pages of "
                             f"{self.ps}, got {page!r}")
        if page.namespace is not None:
            raise ValueError(f"{NAME}: {what} must have no namespace, got {page!r}")

    def _require_pages(self, slots: Sequence[int], what: str) -> None:
        """``slots`` (model ids) are whole pool pages, in order, none twice (the
        allocator frees by page)."""
        ps = self.ps
        if len(slots) % ps or len(set(slots)) != len(slots):
            raise ValueError(f"{NAME}: {what} must be distinct whole pages of {ps} slots")
        for i in range(0, len(slots), ps):
            page = list(slots[i:i + ps])
            if page[0] % ps or page != list(range(page[0], page[0] + ps)):
                raise ValueError(f"{NAME}: {what}: {page} is not one page")

    def _require_held(self, slots: Sequence[int], what: str) -> None:
        if not set(slots) <= self.held_full:
            raise ValueError(f"{NAME}: {what} {tuple(slots)} are not all held by the caller")

    def _state_index(self, slot: int, what: str) -> int:
        """The SGLang id of a caller-held state slot (model id ``slot``)."""
        if isinstance(slot, bool) or not isinstance(slot, int) or slot not in self.held_states:
            raise ValueError(f"{NAME}: {what} {slot!r} is not a state slot the caller holds")
        return slot + 1

    def _receipt(self, receipt: object) -> Any:
        if not any(receipt is held for held in self._locks):
            raise ValueError(f"{NAME}: receipt {receipt!r} is not a live lock from lock()")
        return receipt

    # -- the pools ----------------------------------------------------------------------

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        if isinstance(num_tokens, bool) or not isinstance(num_tokens, int) \
                or num_tokens < 0 or num_tokens % self.ps:
            raise ValueError(f"{NAME}: num_tokens must be a multiple of {self.ps} >= 0, "
                             f"got {num_tokens!r}")
        self._tick()
        if num_tokens == 0:
            return ()
        got = self.allocator.alloc(num_tokens)  # the scheduler's alloc_token_slots
        if got is None:
            return None
        slots = self._full_out(got.tolist())
        self.held_full.update(slots)
        return slots

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        if len(full_slots) != len(codes):
            raise ValueError(f"{NAME}: {len(full_slots)} full_slots, {len(codes)} codes")
        for code in codes:
            _require_code(code, "codes")
        self._require_held(full_slots, "full_slots")
        index = torch.tensor(self._full_in(full_slots), dtype=torch.int64)
        values = torch.tensor(list(codes), dtype=DTYPE).view(-1, 1, 1)
        for buffer in [*self.kv.full_kv_pool.k_buffer, *self.kv.full_kv_pool.v_buffer]:
            buffer[index] = values

    def free(self, full_slots: Sequence[int]) -> None:
        self._require_held(full_slots, "full_slots")
        self._require_pages(full_slots, "full_slots")
        self._tick()
        self.allocator.free(torch.tensor(self._full_in(full_slots), dtype=torch.int64))
        self.held_full.difference_update(full_slots)

    def alloc_state(self) -> int | None:
        self._tick()
        # A request's own slot (HybridReqToTokenPool.alloc: mamba_allocator.alloc(1)).
        got = self.rows.mamba_allocator.alloc(1)
        if got is None:
            return None
        slot = int(got[0]) - 1
        self.held_states.add(slot)
        return slot

    def write_state(self, slot: int, code: int) -> None:
        index = self._state_index(slot, "slot")
        _require_code(code, "code")
        cache = self.states.mamba_cache
        for tensor in [cache.temporal, *cache.conv]:
            tensor[:, index] = float(code)

    def free_state(self, slot: int) -> None:
        index = self._state_index(slot, "slot")
        self._tick()
        self.rows.mamba_allocator.free(torch.tensor([index], dtype=torch.int64))
        self.held_states.discard(slot)

    # -- the tree -----------------------------------------------------------------------

    def match_prefix(self, key: Key) -> MambaHit:
        if not isinstance(key, Key) or key.namespace is not None:
            raise ValueError(f"{NAME}: key must be a Key without namespace, got {key!r}")
        self._tick()
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, key)))
        return self._hit(key, got)

    def _hit(self, key: Key, got: Any) -> MambaHit:
        """SGLang's ``MatchResult`` for ``key`` as the protocol's hit."""
        slots = self.tree.collect_full_device_indices(got.last_device_node,
                                                      self.tree.root_node.id)
        return MambaHit(full=self._full_out(slots.tolist()),
                        page=self._page_of(got.best_match_node),
                        full_hit=int(got.full_kv_hit_length))

    def fork(self, page: Key) -> int | None:
        self._require_page(page, "page")
        node = self._node_ending_at(page)
        if node is None or node.component_data[self.mamba_ct].value is None:
            raise ValueError(f"{NAME}: page {page} holds no cached state to fork")
        if self.rows.mamba_allocator.available_size() == 0:
            return None  # SGLang would evict a state first (module docstring)
        self._tick()
        # A request holding no state yet, in no streaming session (what the match reads).
        req = SimpleNamespace(rid=NAME, session=None, kv=self.req_kv())
        self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, page), cow_mamba=True, req=req))
        if req.kv.mamba_pool_idx is None or req.kv.mamba_cow_src_index is None:
            raise AssertionError(f"{NAME}: match_prefix({page}) with cow_mamba gave the "
                                 "request no slot or no copy source")
        # ScheduleBatch._collect_deferred_mamba_cow_and_clear, then ModelRunner's copy.
        src = req.kv.mamba_cow_src_index
        dst = req.kv.mamba_pool_idx.unsqueeze(0)
        self.rows.copy_mamba_state(self.rows.translate_mamba_indices(src),
                                   self.rows.translate_mamba_indices(dst))
        slot = int(dst[0]) - 1
        self.held_states.add(slot)
        return slot

    def insert(self, key: Key, full_slots: Sequence[int], state: int) -> tuple[int, bool]:
        self._require_page(key, "key")
        if len(full_slots) != len(key.tokens):
            raise ValueError(f"{NAME}: {len(full_slots)} full_slots for a key of "
                             f"{len(key.tokens)} tokens")
        self._require_pages(full_slots, "full_slots")
        cached = self._cached_full(key, self._pages())
        for start in range(0, len(full_slots), self.ps):
            page = list(full_slots[start:start + self.ps])
            if page != cached[start:start + self.ps] and not set(page) <= self.held_full:
                raise ValueError(f"{NAME}: full_slots {page} at {start} are neither held "
                                 "nor that page's own slots")
        index = self._state_index(state, "state")
        self._tick()
        mine = self._full_in(full_slots)
        result = self.cache.insert(self.m["base"].InsertParams(
            key=radix_key(self.env, key), value=torch.tensor(mine, dtype=torch.int64),
            mamba_value=torch.tensor([index], dtype=torch.int64), prev_prefix_len=len(mine)))
        self.held_full.difference_update(s for p in self._pages().values() for s in p.full)
        taken = not result.mamba_exist
        if taken:
            self.held_states.discard(state)
        return int(result.prefix_len), taken

    def lock(self, page: Key | None, with_state: bool) -> object:
        if not isinstance(with_state, bool):
            raise TypeError(f"{NAME}: with_state must be a bool, got {with_state!r}")
        if page is not None:
            self._require_page(page, "page")
            if page not in self._pages():
                raise ValueError(f"{NAME}: page {page} is not cached")
        self._tick()
        node = self.tree.root_node
        if page is not None and self._node_ending_at(page) is None:
            # The server locks the node its match ended at, and a match splits there.
            self.cache.match_prefix(self.m["base"].MatchPrefixParams(
                key=radix_key(self.env, page)))
        if page is not None:
            node = self._node_ending_at(page)
        skip = () if with_state else (self.mamba_ct,)
        receipt = self.cache.lock(node.id, skip_lock_components=skip)
        self._locks.append(receipt)
        return receipt

    def release_state(self, receipt: object) -> None:
        lock = self._receipt(receipt)
        if self.mamba_ct in lock.receipt.skipped_lock_components:
            raise ValueError(f"{NAME}: receipt {receipt!r} holds no state lock")
        self._tick()
        # MambaComponent._alloc_mamba_slot: release the Mamba part alone, then mark it
        # skipped so that the final release does not take it again.
        others = tuple(c for c in self.cache.tree_components if c != self.mamba_ct)
        self.cache.dec_lock_ref(lock.node, replace(lock.receipt,
                                                   skipped_lock_components=others))
        lock.receipt.skipped_lock_components += (self.mamba_ct,)

    def _holds_state(self, lock: Any) -> bool:
        """Whether ``lock`` still holds its Mamba part."""
        return self.mamba_ct not in lock.receipt.skipped_lock_components

    def unlock(self, receipt: object, state_released: bool) -> None:
        lock = self._receipt(receipt)
        holds_state = self._holds_state(lock)
        if state_released is holds_state or not isinstance(state_released, bool):
            raise ValueError(f"{NAME}: state_released={state_released!r}, but the receipt "
                             f"{'holds' if holds_state else 'holds no'} state lock")
        self._tick()
        self.cache.unlock(lock)
        self._locks = [held for held in self._locks if held is not lock]

    def evict_full(self, num_tokens: int) -> int:
        return int(self._evict(num_tokens, "num_tokens").num_tokens_evicted)

    def evict_states(self, num_states: int) -> int:
        return int(self._evict(num_states, "mamba_num").mamba_num_evicted)

    def evict_for_alloc(self, full_need: int, state_need: int) -> tuple[int, int]:
        # What the server's allocators call when a pool is short, one pool per call:
        # allocator/base.py:166-168 evict_to_free_tokens (full KV) and allocation.py:318-323
        # ensure_mamba_capacity (states); each walk stops once its pool has the room.
        for count in (full_need, state_need):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{NAME}: a shortfall must be an int >= 0, got {count!r}")
        self._tick()
        got = self.cache.evict_for_alloc(
            self.m["base"].EvictParams(num_tokens=full_need, mamba_num=state_need))
        return int(got.num_tokens_evicted), int(got.mamba_num_evicted)

    def _evict(self, count: int, field: str) -> Any:
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ValueError(f"{NAME}: the count to evict must be an int >= 0, got {count!r}")
        self._tick()
        return self.cache.evict(self.m["base"].EvictParams(**{field: count}))

    # -- the view -----------------------------------------------------------------------

    def _device_nodes(self) -> Iterator[tuple[tuple[int, ...], Any]]:
        """The nodes that give pages: every node here (a host tier leaves some out)."""
        return self._walk()

    def _pages(self) -> dict[Key, MambaPageView]:
        """SGLang's nodes as pages (13m.8, module docstring)."""
        pages: dict[Key, MambaPageView] = {}
        for end, node in self._device_nodes():
            full_cd = node.component_data[self.full_ct]
            mamba_cd = node.component_data[self.mamba_ct]
            width = len(node.key.token_ids)
            if width % self.ps or full_cd.value is None:
                raise AssertionError(f"{NAME}: node {node.id} is not whole pages with a "
                                     "full value")
            full = self._full_out(full_cd.value.tolist())
            state = None if mamba_cd.value is None else int(mamba_cd.value[0]) - 1
            for offset in range(0, width, self.ps):
                last = offset + self.ps == width
                pages[Key(end[:len(end) - width + offset + self.ps], None)] = MambaPageView(
                    full=full[offset:offset + self.ps], state=state if last else None,
                    lock=int(full_cd.lock_ref),
                    state_lock=int(mamba_cd.lock_ref) if last else 0)
        return pages

    def observe(self) -> MambaView:
        return MambaView(pages=self._pages(), full_free=self._full_free(),
                         state_free=frozenset(int(s) - 1 for s in
                                              self.rows.mamba_allocator.free_slots.tolist()),
                         full_kv=self._full_codes(), state_kv=self._state_codes(),
                         own_check=self._own_check())

    def _full_free(self) -> frozenset[int]:
        pages = self.allocator.get_all_free_pages().tolist()
        return frozenset(self._full_out(p * self.ps + i for p in pages for i in range(self.ps)))

    def _full_codes(self) -> dict[int, int]:
        layer0 = self.kv.full_kv_pool.k_buffer[0]
        values = layer0[self.ps:self.config.full_slots + self.ps, 0, 0].tolist()
        return {slot: int(v) for slot, v in enumerate(values) if not math.isnan(v)}

    def _state_codes(self) -> dict[int, int]:
        temporal = self.states.mamba_cache.temporal[0]  # layer 0 of the Mamba pool
        values = temporal[1:self.config.state_slots + 1].flatten(1)[:, 0].tolist()
        return {slot: int(v) for slot, v in enumerate(values) if not math.isnan(v)}

    def _own_check(self) -> str | None:
        """SGLang's ``sanity_check``, then the pool balance per pool (module docstring).
        The first failure only, as the checks build on each other."""
        try:
            self.cache.sanity_check()
        except AssertionError as failed:
            return f"sanity_check: {failed}"
        for pool, available, evictable, protected, held, capacity in [
            ("full", self.allocator.available_size(), self.cache.full_evictable_size(),
             self.cache.full_protected_size(), len(self.held_full), self.config.full_slots),
            ("mamba", self.rows.mamba_allocator.available_size(),
             self.cache.mamba_evictable_size(), self.cache.mamba_protected_size(),
             len(self.held_states), self.config.state_slots),
        ]:
            if available + evictable + protected + held != capacity:
                return (f"{pool} pool balance: available {available} + evictable {evictable} "
                        f"+ protected {protected} + held {held} != {capacity}")
        return None

    def close(self) -> None:
        """The server's shutdown (it detaches a storage backend; none is attached)."""
        self.cache.shutdown()


class SglangMambaScheduledAdapter(SglangMambaAdapter):
    """An ``SglangMambaAdapter`` that also takes requests as the scheduler hands them over
    (``hiradix.conformance.mamba.machine.ScheduledMambaEngine``): admission with copy on
    write, rows written as the forward pass computes, ``checkpoint`` per prefill chunk,
    ``release_kv_cache`` with or without a last checkpoint. Page size 1 only: above it the
    tree takes states only where the extra buffer's ping-pong tracking says
    (``MambaComponent.prepare_for_caching_req`` reads ``mamba_last_track_seqlen``, which
    the model runner sets; spec/13m 13m.9 leaves that unspecified)."""

    def __init__(self, config: MambaConfig) -> None:
        if isinstance(config, MambaConfig) and config.page_size != 1:
            raise ValueError(f"{NAME}: request-level calls need page size 1, got "
                             f"{config.page_size}")
        super().__init__(config)
        self.requests = 0  # requests made by ``new_request``, for their ids

    def _resync_held(self) -> None:
        """After a request-level call: slots the tree took or the call freed leave the
        caller's (both happen inside SGLang, where the adapter cannot hook). Only
        removals: a slot neither free nor owned stays held, so a leak shows in the pool
        balance."""
        pages = self._pages()
        owned_full = {s for page in pages.values() for s in page.full}
        owned_states = {page.state for page in pages.values() if page.state is not None}
        view = self.observe()
        self.held_full -= owned_full | view.full_free
        self.held_states -= owned_states | view.state_free

    def new_request(self, tokens: Sequence[int], prompt_len: int) -> SglangRequest:
        """A request whose prompt is ``tokens[:prompt_len]``, not yet admitted."""
        self.requests += 1
        return new_request(self.req_kv(), f"r{self.requests}", tokens, prompt_len, NAME)

    def admit(self, req: SglangRequest, prompt: Key) -> tuple[tuple[int, ...], int, bool]:
        """A new request's admission: ``init_next_round_input`` matches with copy on
        write (schedule_batch.py:1733, ``match_kv_cache``: a hit on a state gives the
        request a slot of its own and records the source), the model runner copies the
        state before the forward pass (``copy_mamba_state``), ``alloc_req_slots`` binds a
        row and, where no copy was made, a fresh state (``HybridReqToTokenPool.alloc``),
        and the request locks the node its match ended at. Returns the matched full
        slots, the request's state slot and whether it is a copy of the hit's (model
        ids). The machine sees to a free state slot first: SGLang would evict one inside
        the match (``finalize_match_result_in_cache``, as DEV-M1)."""
        self._tick()
        got = self.cache.match_prefix(self.m["base"].MatchPrefixParams(
            key=radix_key(self.env, prompt), cow_mamba=True, req=req))
        forked = req.kv.mamba_cow_src_index is not None
        if forked:
            dst = req.kv.mamba_pool_idx.unsqueeze(0)
            self.rows.copy_mamba_state(
                self.rows.translate_mamba_indices(req.kv.mamba_cow_src_index),
                self.rows.translate_mamba_indices(dst))
        if self.rows.alloc([req]) is None:
            raise AssertionError(f"{NAME}: no request row left for {req.rid}")
        slots = self.tree.collect_full_device_indices(got.last_device_node,
                                                      self.tree.root_node.id)
        req.kv.cache_protected_len = len(slots)
        req.kv.kv_allocated_len = req.kv.kv_committed_len = req.extend_end = len(slots)
        req.last_node = got.last_device_node
        req.lock = self.cache.lock(got.last_device_node)
        self.rows.write((req.kv.req_pool_idx, slice(0, len(slots))), slots)
        state = int(req.kv.mamba_pool_idx) - 1
        self.held_states.add(state)
        return self._full_out(slots.tolist()), state, forked

    def write_row(self, req: SglangRequest, start: int, full_slots: Sequence[int]) -> None:
        """Put ``full_slots`` (from ``alloc``) in the request's row from ``start`` on."""
        self.rows.write((req.kv.req_pool_idx, slice(start, start + len(full_slots))),
                        torch.tensor(self._full_in(full_slots), dtype=torch.int32))
        req.kv.kv_allocated_len = max(req.kv.kv_allocated_len, start + len(full_slots))

    def advance(self, req: SglangRequest, end: int) -> None:
        """The forward pass computed the request up to ``end`` (``advance_request``); its
        state is the caller's to write (``write_state``)."""
        advance_request(req, end, NAME)

    def request_state(self, req: SglangRequest) -> int | None:
        """The request's own state slot (model id), or None once it has none."""
        index = req.kv.mamba_pool_idx
        return None if index is None else int(index) - 1

    def row(self, req: SglangRequest, end: int) -> tuple[int, ...]:
        return self._full_out(self.rows.req_to_token[req.kv.req_pool_idx, :end].tolist())

    def protected_len(self, req: SglangRequest) -> int:
        return int(req.kv.cache_protected_len)

    def locked_page(self, req: SglangRequest) -> Key | None:
        return self._page_of(req.lock.node)

    def locked_path(self, req: SglangRequest) -> tuple[int, ...]:
        slots = self.tree.collect_full_device_indices(req.lock.node, self.tree.root_node.id)
        return self._full_out(slots.tolist())

    def checkpoint(self, req: SglangRequest, up_to: int) -> list[tuple[int, int | None, bool]]:
        """``UnifiedRadixCache.checkpoint(req, up_to=up_to)``. Each insert it made, as
        (key length, the state slot it offered -- for an unfinished request a fresh
        copy of the request's state, ``prepare_for_caching_req``; for a finished one the
        request's own -- and whether the tree took it). Observed in flight: the call
        frees an offered copy the tree did not take (``cleanup_after_caching_req``).
        The machine sees to a free state slot first (SGLang would evict one,
        ``_alloc_mamba_slot``)."""
        self._tick()
        inserts: list[tuple[int, int | None, bool]] = []

        def record(params: Any, result: Any) -> None:
            value = params.mamba_value
            inserts.append((len(params.key), None if value is None else int(value[0]) - 1,
                            value is not None and not result.mamba_exist))

        with inserts_observed(self.cache, record):
            self.cache.checkpoint(req, up_to=up_to)
        self._resync_held()
        return inserts

    def release(self, req: SglangRequest, owned: int,
                checkpoint: bool) -> list[tuple[int, int | None, bool]]:
        """``release_kv_cache(req, checkpoint=checkpoint)`` (common.py:403-443, without
        the speculative-decoding over-allocation step): with ``checkpoint`` a finished
        request's final checkpoint, which offers the tree the request's own state;
        without, an abort or a retraction, whose ``on_release`` frees the request's
        state (``cleanup_after_caching_req(is_finished=True)``). Then the row past the
        protected prefix is freed, the lock released and the row given back. Returns the
        final checkpoint's inserts (``checkpoint``; none without)."""
        if checkpoint:
            req.done = True  # the tree reads finished() to take the state, not a copy
        inserts = self.checkpoint(req, owned) if checkpoint else []
        self._tick()
        release_row(self.cache, self.rows, req, owned, checkpoint)
        self._resync_held()
        return inserts


def build(config: MambaConfig) -> SglangMambaAdapter:
    """The registry's builder (``hiradix.engines.catalog``): one fresh cache per
    configuration; at page size 1 one that also takes requests (``ScheduledMambaEngine``),
    above it the protocol's calls only (``SglangMambaScheduledAdapter``)."""
    if isinstance(config, MambaConfig) and config.page_size == 1:
        return SglangMambaScheduledAdapter(config)
    return SglangMambaAdapter(config)
