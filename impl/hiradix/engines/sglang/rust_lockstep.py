"""SGLang 0.5.23's two tree cores driven in lockstep through ``UnifiedRadixCache``'s own
API (spec/07r, "Checking a finding against the Python core").

The Rust core hides per-node recency and hit counts (spec/07r DEV-R1), so an eviction it
makes that the model rejects cannot be told from DEV-1 (a split stamps the unmatched
suffix, which the Python-core adapter adopts) by reading the engine. What can be done is
to serve the same requests to a Python-core cache and a Rust-core cache, built alike, and
compare what each keeps: if they agree step for step, the Rust core evicts what the
Python core evicts, and the finding is the Python core's behaviour (classified in
spec/07) seen through DEV-R1; if they part, the Rust core differs from its reference.

Requests are served as the differential machine serves them (``differential.serve``):
match, lock the match's device node, evict the shortfall, allocate, insert with the
matched prefix as ``prev_prefix_len`` (DEV-24) and ``inserted_len`` for a chunk
(DEV-25), free the allocation's leftovers, unlock unless the caller keeps the lock.

What is compared after every step, neither of which touches recency: the device slots
the tree owns (``all_values_flatten``: the allocators are identical and deterministic,
so the same tree holds the same slots), the free slots, and the evictable and protected
totals. With ``hicache=True`` (write-through), the host tier is attached and each
node's host slots (``build_storage_backup_spec``) are compared too.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from hiradix.conformance.scenario import Scenario
from hiradix.engines.sglang.rust import _prepare
from hiradix.engines.sglang.unified import build, radix_key
from hiradix_model import Key

CORES = ("python", "rust")


@dataclass(frozen=True)
class Snapshot:
    """What one cache shows without touching recency."""

    owned: tuple[int, ...]  # device slots in the tree, sorted
    free: tuple[int, ...]  # free device slots, sorted
    evictable: int
    protected: int
    host: tuple[int, ...] = ()  # host slots in the tree, sorted (hicache only)


@dataclass
class _Side:
    core: str
    cache: Any
    allocator: Any
    locks: list[Any] = field(default_factory=list)  # receipts the caller keeps
    evicted: int = 0  # tokens evicted so far


class Lockstep:
    """A Python-core and a Rust-core ``UnifiedRadixCache`` for one scenario, served the
    same steps. ``hicache`` attaches the host tier (write-through) to both."""

    def __init__(self, scenario: Scenario, hicache: bool = False) -> None:
        self.env = _prepare()
        self.ps = scenario.page_size
        self.hicache = hicache
        self.sides = [self._build(scenario, core) for core in CORES]
        self.seen: list[Key] = []

    def _build(self, scenario: Scenario, core: str) -> _Side:
        if self.hicache:
            built = build(self.env, scenario, core)
            cache, allocator = built.cache, built.allocator
        else:
            m = self.env.modules
            m["context"].publish(m["args"].ServerArgs(model_path="dummy", device="cpu",
                                                      page_size=self.ps), role="test")
            from hiradix.engines.sglang.radix import device_pools
            _, allocator = device_pools(m, self.ps, scenario.device_pages,
                                        scenario.kv_layout)
            cache = m["urc"].UnifiedRadixCache(m["params"].CacheInitParams(
                disable=False, req_to_token_pool=None, token_to_kv_pool_allocator=allocator,
                page_size=self.ps, eviction_policy=scenario.eviction,
                tree_components=(m["components"].ComponentType.FULL,),
                tree_core_backend=core))
        wanted = {"python": "UnifiedTreeCore", "rust": "RustUnifiedTreeCore"}[core]
        assert type(cache.tree_core).__name__ == wanted, type(cache.tree_core).__name__
        return _Side(core, cache, allocator)

    # -- the steps (the differential machine's rules, at SGLang's level) ---------------

    def request(self, tokens: Sequence[int], namespace: str | None = None, *,
                chunked: bool = False, priority: int = 0, keep_lock: bool = False) -> None:
        key = Key(tuple(tokens), namespace)
        for side in self.sides:
            self._serve(side, key, chunked, priority, keep_lock)
        self.seen.append(key)

    def request_again(self, index: int, evict_first: int = 0) -> None:
        if evict_first:
            self.evict(evict_first)
        key = self.seen[index % len(self.seen)]
        for side in self.sides:
            self._serve(side, key, False, 0, False)

    def unlock(self, index: int) -> None:
        for side in self.sides:
            receipt = side.locks.pop(index % len(side.locks))
            side.cache.dec_lock_ref(receipt.node_id, receipt)

    def evict(self, num_tokens: int) -> None:
        for side in self.sides:
            self._evict(side, num_tokens)

    def _evict(self, side: _Side, num_tokens: int) -> None:
        base = self.env.modules["base"]
        side.evicted += int(side.cache.evict(base.EvictParams(num_tokens=num_tokens))
                            .num_tokens_evicted)

    def evicted(self) -> int:
        """The tokens both caches evicted so far (they must agree)."""
        python, rust = (side.evicted for side in self.sides)
        assert python == rust, f"evicted: python {python}, rust {rust}"
        return python

    def _serve(self, side: _Side, key: Key, chunked: bool, priority: int,
               keep_lock: bool) -> None:
        base = self.env.modules["base"]
        cache, ps = side.cache, self.ps
        got = cache.match_prefix(base.MatchPrefixParams(key=radix_key(self.env, key)))
        matched = got.device_prefix_len
        slots = cache.tree_core.collect_full_device_indices(
            got.last_device_node, cache.tree_core.root_node_handle(key.namespace)
            if side.core == "rust" else cache.tree_core.root_node.id)
        receipt = cache.inc_lock_ref(got.last_device_node).to_dec_params()
        need = len(key.tokens) - matched
        alloc = -(-need // ps) * ps
        short = alloc - int(side.allocator.available_size())
        if short > 0:
            self._evict(side, short)
        new = side.allocator.alloc(alloc) if alloc else None
        if new is not None:
            aligned = len(key.tokens) - len(key.tokens) % ps
            cache.insert(base.InsertParams(
                key=radix_key(self.env, key), value=torch.cat([slots, new[:need]]),
                priority=priority, prev_prefix_len=matched,
                inserted_len=aligned if chunked else 0))
            if self.hicache:
                cache.flush_pending_backups()  # DEV-26, as the scheduler does
            owned = set(cache.tree_core.all_values_flatten().tolist())
            free = set(self._free(side))
            rest = [s for s in new.tolist() if s not in owned and s not in free]
            if rest:
                side.allocator.free(torch.tensor(rest, dtype=torch.int64))
        if keep_lock:
            side.locks.append(receipt)
        else:
            cache.dec_lock_ref(receipt.node_id, receipt)

    # -- what is compared ---------------------------------------------------------------

    def _free(self, side: _Side) -> list[int]:
        allocator = side.allocator
        if self.ps == 1:
            return allocator.free_pages.tolist() + allocator.release_pages.tolist()
        pages = allocator.get_all_free_pages().tolist()
        return [p * self.ps + i for p in pages for i in range(self.ps)]

    def snapshot(self, side: _Side) -> Snapshot:
        cache = side.cache
        return Snapshot(owned=tuple(sorted(cache.tree_core.all_values_flatten().tolist())),
                        free=tuple(sorted(self._free(side))),
                        evictable=int(cache.evictable_size()),
                        protected=int(cache.protected_size()))

    def snapshots(self) -> dict[str, Snapshot]:
        return {side.core: self.snapshot(side) for side in self.sides}

    def agree(self) -> bool:
        python, rust = self.snapshots().values()
        return python == rust

    def close(self) -> None:
        for side in self.sides:
            if self.hicache:
                side.cache.shutdown()
