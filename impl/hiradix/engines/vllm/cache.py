"""Adapters for vLLM 0.33.0/0.34.0's prefix cache (spec/10): ``vllm``, the device tier through
``KVCacheManager``, and ``vllm-offload``, the host tier through the CPU ``OffloadingManager``.

vLLM must be importable (``make vllm-env`` builds ``.venv-vllm``); its cache managers run
on CPU without ``vllm._C``. Block hashes use ``sha256_cbor`` with vLLM's fixed seed, so a
run replays (DEV-V6).

vLLM has no radix tree and no cache-level insert: a request asks the manager for its
cached prefix (``get_computed_blocks``), then for slots (``allocate_slots``), which
touches the hit blocks, takes free blocks (evicting cached ones lazily, front of the free
queue first), and registers every full block under its hash chain at once; ``free``
returns the request's blocks, tail first. ``vllm_machine`` maps each such call onto the
model's steps. What this module shows of vLLM's state (``VllmDevice.observe``):

- a page is a block registered under a hash; the hash names the page through a table of
  every prefix the run's requests hashed (prefix + ``cache_salt`` = page + namespace). With
  several blocks under one hash (DEV-V1), the page is the block a lookup returns;
- spec slot = P x (block id - 1) + offset: block 0 is vLLM's null block;
- ``lock`` is the block's ``ref_cnt``: every running request holds its whole block table,
  which is a lock on the root path of its deepest page;
- ``device_free`` is the free queue's blocks that are not a page (uncached blocks and
  free duplicates); ``held`` the referenced blocks that are not a page (partial tails);
- ``last_tick`` / ``insert_tick`` are the ticks at which the adapter saw a block last
  referenced or released / registered, adopted by the model (DEV-V2); ``hits`` is 0,
  adopted (DEV-V3: vLLM counts no hits);
- ``device_kv`` is what the test's forward pass wrote into the blocks vLLM handed out:
  the manager holds block ids, not bytes, so content integrity checks that vLLM registers
  each block under the hash of the tokens written into it.
"""

from __future__ import annotations

import importlib
import importlib.metadata
import math
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from hiradix.conformance.scenario import Scenario
from hiradix.engines.protocol import probe_engine
from hiradix_model import Config, Key, Page, State
from hiradix_model.keys import content_at

VERSIONS = ("0.33.0", "0.34.0")  # the releases whose cache code this adapter drives
SETUP = "make vllm-env, then run .venv-vllm/bin/hiradix"
MODULES = {
    "manager": "vllm.v1.core.kv_cache_manager",
    "utils": "vllm.v1.core.kv_cache_utils",
    "spec": "vllm.v1.kv_cache_interface",
    "request": "vllm.v1.request",
    "sampling": "vllm.sampling_params",
    "hashing": "vllm.utils.hashing",
    "offload": "vllm.v1.kv_offload.cpu.manager",
    "offload_base": "vllm.v1.kv_offload.base",
}
HASH = "sha256_cbor"  # cryptographic: vLLM derives its root hash from a fixed seed (DEV-V6)
DEVICE_OPS = frozenset({"match_prefix", "insert", "inc_lock_ref", "dec_lock_ref", "alloc",
                        "free", "evict", "reset"})

_LOADED: dict[str, Any] = {}


def _modules() -> dict[str, Any]:
    if not _LOADED:
        loaded = {name: importlib.import_module(path) for name, path in MODULES.items()}
        hash_fn = loaded["hashing"].get_hash_fn_by_name(HASH)
        loaded["utils"].init_none_hash(hash_fn)
        loaded["hash_fn"] = hash_fn
        _LOADED.update(loaded)
    return _LOADED


def probe(engine: str) -> str:
    """The installed vLLM version, if this adapter can drive it (spec/10)."""
    return probe_engine(engine, "vllm", VERSIONS, "its v1 KV cache managers", SETUP,
                        _modules)


def scenario_space(engine: str) -> dict[str, tuple[object, ...]]:
    """vLLM's device cache is LRU only; ``vllm`` has no host tier (host_slots = 0) and
    ``vllm-offload`` stores every computed block (write-through, threshold 1). Page size
    1 always re-hits a whole cached key, which DEV-V1 steers around."""
    return {"eviction": ("lru",), "write_policy": ("write_through",), "page_size": (2, 4),
            "host_layout": ("layer_first",), "kv_layout": ("mha",)}


def factory(engine: str, scenario: Scenario) -> Callable[[], VllmDevice]:
    """Fresh adapters: ``vllm`` (device only) or ``vllm-offload`` (with the CPU tier, its
    LRU policy; ``VllmOffload(scenario, "arc")`` for ARC)."""
    if engine == "vllm-offload":
        from hiradix.engines.vllm.offload import VllmOffload
        return lambda: VllmOffload(scenario)
    return lambda: VllmDevice(scenario)


@dataclass
class Running:
    """A request the adapter scheduled and has not freed."""

    request: Any  # vllm.v1.request.Request
    key: Key
    lock_page: Key | None  # the deepest page it holds, in the model's terms
    tail: tuple[int, ...]  # slots of its blocks that are no page (the partial tail)


class VllmDevice:
    """vLLM's ``KVCacheManager`` with one full-attention group, spoken to per request."""

    name = "vllm"
    operations = DEVICE_OPS
    adopted: Mapping[str, str] = {
        "last_tick": "DEV-V2: vLLM ranks by release order (free-queue position), not by "
                     "match time",
        "insert_tick": "DEV-V2: the tick the block was registered under its hash",
        "hits": "DEV-V3: vLLM counts no hits",
    }
    mapped: Mapping[str, str] = {
        "slot ids": "block 0 is vLLM's null block: spec slot = P * (block id - 1) + offset",
        "lock": "ref_cnt: a running request references its whole block table (a lock on "
                "the root path of its deepest page)",
        "match": "DEV-V4: the scheduler matches all but the request's last token",
        "allocate_slots": "DEV-V5: inc_lock_ref (touch), evict (lazy, for the shortfall), "
                          "alloc, insert, and the lock moved to the deepest page, in one call",
        "free": "dec_lock_ref of the deepest page and free of the partial tail",
        "reset": "reset_prefix_cache, which vLLM refuses while a request holds blocks",
    }
    guards: Mapping[str, str] = {}  # none verified (spec/10 Reach lines)
    avoid: Mapping[str, str] = {
        "page_aligned_keys": "DEV-V1: a fully cached page-aligned key re-computes its last "
                             "page into a duplicate block under the same hash",
    }

    def __init__(self, scenario: Scenario) -> None:
        m = _modules()
        self.version = probe(self.name)
        ps = self.ps = scenario.page_size
        spec = m["spec"].FullAttentionSpec(block_size=ps, num_kv_heads=1, head_size=1,
                                           dtype=_float16())
        group = m["spec"].KVCacheGroupSpec(["layer.0"], spec)
        self.num_blocks = scenario.device_pages + 1  # and the null block
        kv_config = m["spec"].KVCacheConfig(num_blocks=self.num_blocks, kv_cache_tensors=[],
                                            kv_cache_groups=[group])
        self.manager = m["manager"].KVCacheManager(kv_config, max_model_len=1024,
                                                   scheduler_block_size=ps,
                                                   hash_block_size=ps, enable_caching=True)
        self.pool = self.manager.block_pool
        self.hasher = m["utils"].get_request_block_hasher(ps, m["hash_fn"])
        self.config = Config(page_size=ps, device_slots=scenario.device_pages * ps,
                             host_slots=0, write_policy="write_through", eviction="lru",
                             load_back_threshold=scenario.threshold_pages * ps)
        self.now = 0
        self.pages_by_hash: dict[bytes, Key] = {}
        self.hash_of: dict[Key, bytes] = {}
        self.kv: dict[int, Key] = {}  # the forward pass's writes: slot -> content identity
        self.stamp: dict[int, int] = {}  # block -> tick last referenced or released
        self.registered: dict[int, tuple[bytes, int]] = {}  # block -> (hash, tick)
        self.running: dict[str, Running] = {}
        self.next_id = 0

    # -- plumbing ---------------------------------------------------------------------

    def slots(self, block_id: int) -> tuple[int, ...]:
        return tuple(range((block_id - 1) * self.ps, block_id * self.ps))

    def page_of(self, block: Any) -> Key:
        """The page a cached block is registered for, by its hash (DEV-V1's table)."""
        digest = bytes(_modules()["utils"].get_block_hash(block.block_hash))
        if digest not in self.pages_by_hash:
            raise AssertionError(f"vllm: block {block.block_id} is cached under a hash no "
                                 f"request of this run produced")
        return self.pages_by_hash[digest]

    def set_time(self, now: int) -> None:
        self.now = now

    # -- what a scheduler does with a request ------------------------------------------

    def new_request(self, key: Key) -> Any:
        """A waiting request for ``key`` (its namespace is vLLM's ``cache_salt``)."""
        m = _modules()
        self.next_id += 1
        request = m["request"].Request(str(self.next_id), list(key.tokens),
                                       m["sampling"].SamplingParams(max_tokens=1), None,
                                       arrival_time=0.0, cache_salt=key.namespace,
                                       block_hasher=self.hasher)
        for index, digest in enumerate(request.block_hashes):
            page = Key(key.tokens[:(index + 1) * self.ps], key.namespace)
            self.pages_by_hash[bytes(digest)] = page
            self.hash_of[page] = bytes(digest)
        return request

    def lookup(self, request: Any) -> tuple[Any, int]:
        """``get_computed_blocks``: the hit blocks and the number of hit tokens."""
        blocks, hit, _ = self.manager.get_computed_blocks(request)
        return blocks, int(hit)

    def hit_slots(self, blocks: Any) -> tuple[int, ...]:
        return tuple(s for b in blocks.blocks[0] for s in self.slots(b.block_id))

    def last_page(self, blocks: Any) -> Key | None:
        found = blocks.blocks[0]
        return self.page_of(found[-1]) if found else None

    def schedule(self, request: Any, key: Key, hit: Any,
                 hit_tokens: int) -> tuple[int, ...] | None:
        """``allocate_slots`` for the rest of the prompt, then the forward pass writes the
        new blocks. The new blocks' slots, in order; None if vLLM found no room."""
        start = request.num_computed_tokens + hit_tokens
        new = self.manager.allocate_slots(request, len(key.tokens) - start, hit_tokens, hit)
        if new is None:
            return None
        self.before_forward([b.block_id for b in
                             self.manager.get_blocks(request.request_id).blocks[0]])
        ids = [b.block_id for b in new.blocks[0]]
        slots = tuple(s for b in ids for s in self.slots(b))
        for offset, slot in enumerate(slots):  # the forward pass
            position = start + offset
            if position < len(key.tokens):
                self.kv[slot] = content_at(key, position)
            else:
                self.kv.pop(slot, None)
        request.num_computed_tokens = len(key.tokens)
        self._stamp(request)
        full = (len(key.tokens) // self.ps) * self.ps
        tail = slots[max(0, full - start):]
        self.running[request.request_id] = Running(request, key, None, tail)
        return slots

    def _stamp(self, request: Any) -> None:
        """The request references its blocks now; new hashes are registered now."""
        for block in self.manager.get_blocks(request.request_id).blocks[0]:
            self.stamp[block.block_id] = self.now
            known = self.registered.get(block.block_id)
            if block.block_hash is not None and (known is None
                                                 or known[0] != bytes(block.block_hash)):
                self.registered[block.block_id] = (bytes(block.block_hash), self.now)

    def finish(self, request_id: str) -> Running:
        """``free``: the request returns its blocks (tail first)."""
        running = self.running.pop(request_id)
        blocks = list(self.manager.get_blocks(request_id).blocks[0])
        self.manager.free(running.request)
        for block in blocks:
            if block.ref_cnt == 0:
                self.stamp[block.block_id] = self.now
        return running

    def abandon(self, request: Any) -> None:
        """``free`` of a request that was never scheduled past its load."""
        blocks = list(self.manager.get_blocks(request.request_id).blocks[0])
        self.manager.free(request)
        for block in blocks:
            if block.ref_cnt == 0:
                self.stamp[block.block_id] = self.now

    # No host tier: no host hit, nothing stored, nothing flushed.

    def before_forward(self, block_ids: Sequence[int]) -> None:
        """The request's block table after ``allocate_slots``, before the forward pass
        writes it: a connector's hook (``vllm-offload`` flushes stores, DEV-V9)."""

    def take_flushes(self) -> int:
        """Stores a connector's flush completed since the last call (DEV-V9)."""
        return 0

    def host_hit(self, request: Any, key: Key, device_pages: int) -> int:
        return 0

    def last_on_host(self, key: Key, pages: int) -> Key | None:
        return None

    def store(self, request: Any, key: Key) -> tuple[Key, ...]:
        return ()

    def reset(self) -> bool:
        """``reset_prefix_cache``; vLLM refuses it while any request holds blocks."""
        done = bool(self.manager.reset_prefix_cache())
        if done:
            self.kv.clear()
            self.stamp.clear()
            self.registered.clear()
        return done

    # -- the abstraction ------------------------------------------------------------------

    def _primaries(self) -> dict[int, Key]:
        """Block id -> page, for the block a lookup returns under each hash."""
        table = self.pool.cached_block_hash_to_block
        found: dict[int, Key] = {}
        for hash_key in list(table._cache):
            block = table.get_one_block(hash_key)
            found[block.block_id] = self.page_of(block)
        return found

    def free_blocks(self) -> list[Any]:
        return list(self.pool.free_block_queue.get_all_free_blocks())

    def free_counter(self) -> int:
        """vLLM's own count of free blocks (its admission counter)."""
        return int(self.pool.get_num_free_blocks())

    def observe(self, model: State) -> State:
        primaries = self._primaries()
        queued = {b.block_id for b in self.free_blocks()}
        pages: dict[Key, Page] = {}
        for block_id, key in primaries.items():
            block = self.pool.blocks[block_id]
            if key in pages:
                raise AssertionError(f"vllm: two hashes name page {key}")
            registered = self.registered.get(block_id)
            if registered is not None and registered[0] != bytes(block.block_hash):
                registered = None  # a stale entry of a block since reused
            pages[key] = Page(device=self.slots(block_id), host=None, lock=block.ref_cnt,
                              host_protect=0, hits=0,
                              last_tick=self.stamp.get(block_id, 0),
                              insert_tick=registered[1] if registered else 0, priority=0)
        device_free: set[int] = set()
        held: set[int] = set()
        for block in self.pool.blocks[1:]:
            if block.block_id in primaries:
                continue
            if block.block_id in queued:
                device_free.update(self.slots(block.block_id))
            if block.ref_cnt > 0:
                held.update(self.slots(block.block_id))
        ps = self.ps
        evictable = ps * sum(p.lock == 0 for p in pages.values())
        return State(config=model.config, pages=pages, device_free=frozenset(device_free),
                     host_free=frozenset(), held=frozenset(held), device_kv=dict(self.kv),
                     host_kv={}, pending=(), clock=model.clock, evictable_tokens=evictable,
                     protected_tokens=ps * len(pages) - evictable)

    def counter_problems(self, seen: State) -> list[str]:
        """INV-ACCOUNTING on vLLM's one counter: its free-block count must be the free
        blocks plus the unreferenced pages (evictable, or pinned only by a store in
        flight), and every queued block must be unreferenced."""
        problems = []
        queued = self.free_blocks()
        # A page the abstraction locks while vLLM holds no reference (the pin of a store
        # in flight, DEV-V9) is queued too: an allocation may take it, flushing the store.
        pinned = sum(p.device is not None and p.lock > 0
                     and self.pool.blocks[p.device[0] // self.ps + 1].ref_cnt == 0
                     for p in seen.pages.values())
        counted = (len(seen.device_free) + seen.evictable_tokens) // self.ps + pinned
        if self.free_counter() != counted or len(queued) != counted:
            problems.append(f"num_free_blocks {self.free_counter()}, queue {len(queued)}, "
                            f"free + unreferenced pages {counted}")
        problems += [f"block {b.block_id} is queued with ref_cnt {b.ref_cnt}"
                     for b in queued if b.ref_cnt]
        return problems

    def close(self) -> None:
        self.running.clear()


def _float16() -> Any:
    import torch
    return torch.float16


def page_aligned(tokens: Sequence[int], page_size: int) -> bool:
    """Whether a key is whole pages (DEV-V1: such keys are steered around)."""
    return len(tokens) % page_size == 0


def ceil_pages(tokens: int, page_size: int) -> int:
    return math.ceil(tokens / page_size) * page_size
