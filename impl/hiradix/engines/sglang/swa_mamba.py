"""Adapter for SGLang 0.5.23's ``UnifiedRadixCache`` with the (FULL, SWA, MAMBA) components.

This is the cache SGLang's server builds for a model with both sliding-window and Mamba
(SSM) layers without ``--enable-hierarchical-cache`` and without
``--enable-unified-memory`` (``registry.create_unified_radix_cache``: FULL, then SWA for
``is_hybrid_swa``, then MAMBA for ``is_hybrid_ssm``), over the pools
``kv_cache_configurator`` builds for such a model:

- ``_build_token_to_kv_pool``: the ``is_hybrid_swa`` branch comes before the mambaish
  one, so the KV pool is an ``SWAKVPool`` (``_build_hybrid_swa_kv_pool``) and the
  allocator an ``SWATokenToKVPoolAllocator`` -- the (FULL, SWA) adapter's ``SwaPoolPair``;
- ``_build_req_to_token_pool``: a mambaish model gets a ``HybridReqToTokenPool``
  (``_build_hybrid_req_pool``), which owns the ``MambaPool`` and its slot allocator --
  built here as the (FULL, MAMBA) adapter builds it.

The model has no three-component spec yet. What this adapter offers instead is the
engine's state projected onto the two views the existing checkers read (``observe``): an
``SwaView`` for (FULL, SWA) (spec/13, 13.8) and a ``MambaView`` for (FULL, MAMBA)
(spec/13m, 13m.8), each of which the model's invariants can judge. Both views share the
full pool and its slots. What it maps, beyond what the two adapters it builds on map:

- Slot ids: the full and SWA pools shifted down one page, the Mamba pool down one slot
  (``SwaPoolPair``, ``SglangMambaAdapter``).
- Locks (``lock``): one ``TreeLock`` takes FULL, SWA and (``with_state``) MAMBA. Two
  early releases, as the scheduler makes them: ``release_swa``
  (``UnifiedRadixCache.release_swa`` -> ``dec_swa_lock_only``, which also drops the
  lower-priority Mamba lock on the node unless the receipt skipped it) and
  ``release_state`` (``MambaComponent._alloc_mamba_slot``, Mamba alone, which SGLang only
  makes while the SWA part is still held: ``not lock.swa_released``).
- Eviction: one call per component (``evict_full``, ``evict_swa``, ``evict_states``),
  and ``evict_for_alloc`` with the three shortfalls. SGLang cascades by
  ``eviction_priority`` (``components/base.py:551``): on an internal node SWA takes the
  Mamba state with it and FULL takes both; a leaf is deleted whole.
- ``insert`` passes ``prev_prefix_len`` as the (FULL, SWA) adapter does (DEV-24: the
  leading run of the caller's slots the tree owns); SGLang frees the caller's duplicates
  past it, and ``free`` does not free those again.
- ``own_check``: SGLang's ``sanity_check``, then the scheduler's pool balance
  (``invariant_checker._check_pool_invariant``) for the full, SWA and Mamba pools.

SGLang internals read here, beyond those the two adapters read: ``TreeLock.swa_released``,
``InsertParams.component_evicted_seqlens`` with ``mamba_value`` together, and the three
counters of ``EvictParams``/``EvictResult``.
"""

from __future__ import annotations

import importlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from hiradix.conformance.hybrid.engine import LockGranularity, SwaPageView, SwaView
from hiradix.conformance.mamba.engine import MambaView
from hiradix.engines.protocol import EngineUnavailable
from hiradix.engines.sglang.mamba import SglangMambaAdapter, state_rows
from hiradix.engines.sglang.mamba import probe as probe_mamba
from hiradix.engines.sglang.swa import SETUP, SwaPoolPair
from hiradix.engines.sglang.swa import probe as probe_swa
from hiradix.engines.sglang.unified import prepare, radix_key
from hiradix_model import Key
from hiradix_model.hybrid import SwaConfig
from hiradix_model.mamba import MambaConfig

NAME = "sglang-swa-mamba"
# SGLang's modules read here beyond the shared UnifiedRadixCache ones (``prepare``): the
# SWA pool and allocator and the Mamba pools, as the two adapters read them.
MODULES = {
    "swa_pool": "sglang.srt.mem_cache.swa_memory_pool",
    "swa_alloc": "sglang.srt.mem_cache.allocator.swa",
    "pool": "sglang.srt.mem_cache.memory_pool",
    "mamba_utils": "sglang.srt.configs.mamba_utils",
    "batch": "sglang.srt.managers.schedule_batch",
}


def probe(engine: str = NAME) -> str:
    """The installed SGLang version if both the (FULL, SWA) and the (FULL, MAMBA)
    adapters can drive it (this one drives the union of their APIs)."""
    version = probe_swa(engine)
    probe_mamba(engine)
    return version


@dataclass(frozen=True)
class SwaMambaView:
    """The engine's state projected onto each two-component view: (FULL, SWA) and
    (FULL, MAMBA). Both carry the same ``own_check``."""

    swa: SwaView
    mamba: MambaView


class SglangSwaMambaAdapter(SglangMambaAdapter):
    """One (FULL, SWA, MAMBA) ``UnifiedRadixCache``, device tier, Python tree core.

    Built on ``SglangMambaAdapter`` (its Mamba pool, state calls, lock receipts, page walk
    and match) with the full pool replaced by the (FULL, SWA) ``SwaPoolPair``.
    ``swa_config`` / ``config`` are the two projections' configurations: they share the
    page size and the full pool."""

    name = NAME
    lock_granularity: LockGranularity = "node"  # SGLang's SWA lock, spec/13 DEV-H1

    def __init__(self, swa_config: SwaConfig, state_slots: int) -> None:
        # Not SglangMambaAdapter.__init__, which builds the (FULL, MAMBA) server's pools:
        # every attribute the inherited methods read is set here instead.
        if not isinstance(swa_config, SwaConfig):
            raise TypeError(f"{NAME}: swa_config must be a SwaConfig, got {swa_config!r}")
        self.version = probe()
        self.swa_config = swa_config
        self.config = MambaConfig(page_size=swa_config.page_size,
                                  full_slots=swa_config.full_slots, state_slots=state_slots)
        self.env = prepare()
        self.m = {**self.env.modules, **{k: importlib.import_module(v)
                                         for k, v in MODULES.items()}}
        self.env.clock.now = 0  # not the previous cache's last tick
        self.ps = swa_config.page_size
        types = self.m["components"].ComponentType
        self.full_ct, self.swa_ct, self.mamba_ct = types.FULL, types.SWA, types.MAMBA
        self.req_kv = self.m["batch"].ReqKvInfo
        self.rows, self.states = self._state_pool()
        self.pools = SwaPoolPair(swa_config, self.m["swa_pool"], self.m["swa_alloc"])
        self.kv, self.allocator = self.pools.kv, self.pools.allocator
        self._publish_args()  # MambaComponent reads the published ServerArgs
        self.cache = self._build_cache()
        self.tree = self.cache.tree_core
        self.held_states: set[int] = set()
        self._locks: list[Any] = []  # TreeLocks handed out and not yet unlocked
        # DEV-24: SGLang ids of caller duplicates inserts freed, not since handed out
        # again or passed to ``free``.
        self.freed_by_tree: set[int] = set()

    def _build_cache(self) -> Any:
        """The ``UnifiedRadixCache`` ``create_unified_radix_cache`` builds for a model
        both hybrid-SWA and hybrid-SSM, on the Python tree core (checked)."""
        self.params = self.m["params"].CacheInitParams(
            disable=False, req_to_token_pool=self.rows,
            token_to_kv_pool_allocator=self.allocator, page_size=self.ps,
            eviction_policy="lru", tp_cache_group=self.env.group,
            tree_components=(self.full_ct, self.swa_ct, self.mamba_ct),
            sliding_window_size=self.swa_config.window,
            enable_mamba_extra_buffer=self.ps > 1, tree_core_backend="python")
        cache = self.m["uni"].UnifiedRadixCache(self.params)
        if type(cache.tree_core) is not self.m["core"].UnifiedTreeCore:
            raise EngineUnavailable(f"{NAME}: asked for the Python tree core, got "
                                    f"{type(cache.tree_core).__name__} ({SETUP})")
        return cache

    def _state_pool(self) -> tuple[Any, Any]:
        """The (FULL, MAMBA) adapter's ``HybridReqToTokenPool`` and its ``MambaPool``,
        states NaN ("never written")."""
        rows = state_rows(self.m, self.config)
        states = rows.mamba_pool
        for tensor in [states.mamba_cache.temporal, *states.mamba_cache.conv]:
            tensor.fill_(float("nan"))
        return rows, states

    # -- the caller's slots ----------------------------------------------------------------

    @property
    def held_full(self) -> set[int]:  # type: ignore[override]  # derived, never assigned
        """Caller-held full slots (model ids): the pool pair's record, the one truth."""
        return set(self.pools.to_model(self.pools.held))

    def alloc(self, num_tokens: int) -> tuple[int, ...] | None:
        """``num_tokens`` fresh pairs (a full and an SWA slot each); their full slots."""
        self._tick()
        return self.pools.alloc(num_tokens, self.freed_by_tree)

    def write_kv(self, full_slots: Sequence[int], codes: Sequence[int]) -> None:
        """``codes`` into both halves of caller-held pairs."""
        self._require_held(full_slots, "full_slots")
        self.pools.write_kv(full_slots, codes)

    def free_swa(self, full_slots: Sequence[int]) -> None:
        """Drop the SWA halves of caller-held pairs (decode moved past the window)."""
        self._require_held(full_slots, "full_slots")
        self._tick()
        self.pools.free_swa(full_slots)

    def free(self, full_slots: Sequence[int]) -> None:
        """Return caller-held pairs, but not the duplicates an insert freed (DEV-24)."""
        self._tick()
        self.pools.free(full_slots, self.freed_by_tree)

    # -- the tree -----------------------------------------------------------------------

    def insert(self, key: Key, full_slots: Sequence[int], state: int,
               swa_evicted: int = 0) -> tuple[int, bool]:
        """Cache ``key`` from these pairs with ``state`` at its end; the first
        ``swa_evicted`` tokens' pairs have no SWA half. Returns SGLang's prefix length
        and whether the tree took the state (else it stays the caller's)."""
        self._require_page(key, "key")
        if len(full_slots) != len(key.tokens):
            raise ValueError(f"{NAME}: {len(full_slots)} full_slots for {len(key.tokens)} "
                             "tokens")
        index = self._state_index(state, "state")
        self._tick()
        mine = self.pools.to_sglang(full_slots)
        cached = self.pools.to_sglang(self._cached_full(key, self._pages()))
        prev = 0  # DEV-24: the caller's leading run of the tree's own slots
        while prev < len(cached) and mine[prev] == cached[prev]:
            prev += 1
        free_before = self.pools.full_free()
        result = self.cache.insert(self.m["base"].InsertParams(
            key=radix_key(self.env, key), value=torch.tensor(mine, dtype=torch.int64),
            prev_prefix_len=prev, component_evicted_seqlens={self.swa_ct: swa_evicted},
            mamba_value=torch.tensor([index], dtype=torch.int64)))
        # Accumulated, not replaced: a caller may insert again before it frees what an
        # earlier insert left it; ``alloc`` and ``free`` take slots out again.
        freed = set(mine[prev:]) & (self.pools.full_free() - free_before)
        self.freed_by_tree |= freed
        taken = self._tree_full() | freed
        for slot in mine:
            if slot in taken:
                self.pools.held.pop(slot, None)
        took_state = not result.mamba_exist
        if took_state:
            self.held_states.discard(state)
        return int(result.prefix_len), took_state

    def _tree_full(self) -> set[int]:
        """The full slots (SGLang ids) the tree's nodes hold."""
        return {int(s) for _, node in self._walk()
                for s in node.component_data[self.full_ct].value.tolist()}

    def lock(self, page: Key | None, with_state: bool = True) -> object:
        """Lock the path of ``page`` (full), its window (SWA, whole nodes) and, with
        ``with_state``, its state."""
        return super().lock(page, with_state)

    def release_swa(self, receipt: object) -> None:
        """``UnifiedRadixCache.release_swa``: the SWA part of the lock early, with the
        node's Mamba lock where the receipt still holds it (``dec_swa_lock_only``)."""
        lock = self._receipt(receipt)
        if lock.swa_released:
            raise ValueError(f"{NAME}: receipt {receipt!r} released its SWA part already")
        self._tick()
        self.cache.release_swa(lock)

    def release_state(self, receipt: object) -> None:
        """The Mamba-only early release, which SGLang makes only while the SWA part is
        held (``MambaComponent._alloc_mamba_slot``: ``not lock.swa_released``)."""
        if self._receipt(receipt).swa_released:
            raise ValueError(f"{NAME}: receipt {receipt!r} released its SWA part (and its "
                             "state lock with it)")
        super().release_state(receipt)

    def _holds_state(self, lock: Any) -> bool:
        """Whether ``lock`` still holds its Mamba part: gone with ``release_state`` or
        with ``release_swa`` (which drops it too). ``unlock`` checks the caller's
        ``state_released`` against it."""
        return not lock.swa_released and super()._holds_state(lock)

    def evict_swa(self, num_tokens: int) -> int:
        """SWA eviction: tombstones internal nodes (their states cascade), deletes
        leaves. The SWA tokens freed."""
        return int(self._evict(num_tokens, "swa_num_tokens").swa_num_tokens_evicted)

    def evict_for_alloc(self, full_need: int, state_need: int,
                        swa_need: int = 0) -> tuple[int, int]:
        """The server allocators' eviction when pools are short (full and SWA:
        ``allocator/swa.py`` ``evict_to_free_tokens``; states: ``ensure_mamba_capacity``).
        The full tokens and states freed."""
        for count in (full_need, state_need, swa_need):
            if isinstance(count, bool) or not isinstance(count, int) or count < 0:
                raise ValueError(f"{NAME}: a shortfall must be an int >= 0, got {count!r}")
        self._tick()
        got = self.cache.evict_for_alloc(self.m["base"].EvictParams(
            num_tokens=full_need, swa_num_tokens=swa_need, mamba_num=state_need))
        return int(got.num_tokens_evicted), int(got.mamba_num_evicted)

    # -- the views ----------------------------------------------------------------------

    def observe(self) -> SwaMambaView:  # type: ignore[override]
        problem = self._own_check()
        fields = self.pools.view_fields()
        mamba = MambaView(
            pages=self._pages(), full_free=fields["full_free"],
            state_free=frozenset(int(s) - 1 for s in
                                 self.rows.mamba_allocator.free_slots.tolist()),
            full_kv=fields["full_kv"], state_kv=self._state_codes(), own_check=problem)
        return SwaMambaView(swa=SwaView(pages=self._swa_pages(), own_check=problem, **fields),
                            mamba=mamba)

    def _swa_pages(self) -> dict[Key, SwaPageView]:
        """Each node as pages (spec/13 13.8): its full slots and SWA slots (None: a
        tombstone) page by page, its full and SWA ``lock_ref`` on each."""
        pages: dict[Key, SwaPageView] = {}
        for end, node in self._walk():
            full = node.component_data[self.full_ct]
            swa = node.component_data[self.swa_ct]
            start = len(end) - len(node.key.token_ids)
            for at in range(start, len(end), self.ps):
                cut = slice(at - start, at - start + self.ps)
                pages[Key(end[:at + self.ps], None)] = SwaPageView(
                    full=self._full_out(full.value[cut].tolist()),
                    swa=None if swa.value is None else self._full_out(swa.value[cut].tolist()),
                    lock=int(full.lock_ref), swa_lock=int(swa.lock_ref))
        return pages

    def _own_check(self) -> str | None:
        """SGLang's ``sanity_check``, then the pool balance of the full and SWA pools
        (``SwaPoolPair.balance_problem``) and of the Mamba pool: available + evictable +
        protected + held = capacity. The first failure only."""
        try:
            self.cache.sanity_check()
        except AssertionError as failed:
            return f"sanity_check: {failed}"
        balance = self.pools.balance_problem(
            (self.cache.full_evictable_size(), self.cache.full_protected_size()),
            (self.cache.swa_evictable_size(), self.cache.swa_protected_size()))
        if balance is not None:
            return balance
        parts = (self.rows.mamba_allocator.available_size(), self.cache.mamba_evictable_size(),
                 self.cache.mamba_protected_size(), len(self.held_states))
        if sum(parts) != self.config.state_slots:
            return ("mamba pool balance: available {} + evictable {} + protected {} + held {} "
                    f"!= {self.config.state_slots}").format(*parts)
        return None


def build(swa_config: SwaConfig, state_slots: int) -> SglangSwaMambaAdapter:
    """A fresh (FULL, SWA, MAMBA) cache for these pools."""
    return SglangSwaMambaAdapter(swa_config, state_slots)
