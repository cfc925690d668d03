"""SGLang 0.5.20's ``LMCRadixCache`` in its in-process mode on the CPU: SGLang's
``RadixCache`` as the device tier, LMCache 0.5.6's ``LocalCPUBackend`` as host and its
``LocalDiskBackend`` as storage (spec/15 15.9; issue 31).

Built as SGLang's server builds it (``mem_cache/registry.py:119-130``): a real
``MHATokenToKVPool`` (float32, one head) and token allocator, ``ServerArgs`` published with
``enable_lmcache`` and an LMCache YAML config file (``lmcache_config_file``), from which
LMCache's own SGLang connector builds its engine (``sglang_adapter.py:96-139``, through
``CreateGPUConnector``). Driven as the scheduler drives it:

- ``match``: ``match_prefix`` (``managers/schedule_policy.py:175``), the lock on the
  match (``schedule_policy.py:1094``), then the forward pass's per-layer reads of the KV
  pool (``get_key_buffer``, ``memory_pool.py:2487-2493``), whose hook advances LMCache's
  layerwise load (``lmc_radix_cache.py:79-83``).
- ``finish``: the request's own slots allocated and written, then ``release_kv_cache``
  → ``cache_finished_req`` (``mem_cache/common.py:276-296``, called from
  ``managers/scheduler_components/batch_result_processor.py:128``): insert into the
  tree, store into LMCache, unlock.
- ``evict``: ``evict`` (it first releases the stores' deferred locks,
  ``lmc_radix_cache.py:480-491``).

Two things had to change for the CPU, both scoped to the constructor (``_on_cpu``), no
installed file edited:

1. **Device streams.** ``create_device_stream`` calls ``torch.cpu.Stream(device=...)``,
   which raises ``TypeError`` (``utils/common.py:578-582``). The constructor gets
   ``_NoStream`` objects instead: on CPU every copy is synchronous, so ``synchronize`` and
   ``wait_stream`` have nothing to wait for. ``device_stream_context`` then enters
   ``torch.cpu.stream``, a no-op context that takes any object.
2. **The in-process mode.** SGLang picks it only on XPU (``lmc_radix_cache.py:138-141``);
   elsewhere it builds the multi-process connector, which waits for an LMCache server
   for ever. While ``LMCRadixCache.__init__`` runs past ``RadixCache.__init__``, the
   cache's ``device`` reads ``xpu``; it is ``cpu`` again before the constructor returns.
   In that stretch (``lmc_radix_cache.py:111-171``) nothing allocates on ``self.device``
   (the streams are patch 1's).

One schedule is imposed, as by ``hiradix.engines.lmcache.flat``: LMCache's layerwise
store puts each layer's objects and writes them to disk on a thread pool; the adapter
waits for every disk write after each layer's puts and records the disk tier's order
(``arrivals`` of spec/15 15.5), by wrapping the engine object's ``store_layer``.
"""

from __future__ import annotations

import importlib
import itertools
import tempfile
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import torch

from hiradix.conformance.flat.engine import FlatView, RadixConfig, Served
from hiradix.conformance.flat.machine import (
    LOOKUP_AT_A_PARTIAL_CHUNK,
    RETRIEVE_ACROSS_TIERS,
    RETRIEVE_FROM_DISK,
)
from hiradix.engines.determinism import InsertionOrdered, LogicalTime
from hiradix.engines.lmcache import env
from hiradix.engines.lmcache.flat import (
    BLOCK_BYTES,
    GB,
    read_tiers,
    token_code,
    under_lock,
)
from hiradix.engines.protocol import probe_engine
from hiradix_model import Config, Key, Page, State
from hiradix_model.flat import Obj

NAME = "sglang-lmcache"
SGLANG_VERSIONS = ("0.5.20",)
SETUP = "make sglang-lmcache-env, then run .venv-lmcache/bin/hiradix"
HEAD_DIM = 4  # one head of 4 float32 per token and layer: K its code, V the negation
DTYPE = torch.float32  # codes stay exact
# LMCache's connector stages every load and store through a buffer of one pool layer's
# size (``_lazy_initialize_buffer``, gpu_connectors.py:1709-1733), whose allocations are
# rounded up to whole blocks: a pool of a few dozen slots cannot stage one request. The
# KV pool has POOL_ROWS rows, the allocator hands out ``device_slots`` of them (a server's
# pool holds far more tokens than one request; rows past ``device_slots`` stay unused).
POOL_ROWS = 1024
MODULES = {
    "lmc": "sglang.srt.mem_cache.storage.lmcache.lmc_radix_cache",
    "radix": "sglang.srt.mem_cache.radix_cache",
    "base": "sglang.srt.mem_cache.base_prefix_cache",
    "params": "sglang.srt.mem_cache.cache_init_params",
    "pool": "sglang.srt.mem_cache.memory_pool",
    "token": "sglang.srt.mem_cache.allocator.token",
    "paged": "sglang.srt.mem_cache.allocator.paged",
    "batch": "sglang.srt.managers.schedule_batch",
    "common": "sglang.srt.mem_cache.common",
    "args": "sglang.srt.server_args",
    "context": "sglang.srt.runtime_context",
    "builder": "lmcache.v1.cache_engine",
    "lmc_utils": "lmcache.integration.sglang.utils",
}


def _modules() -> dict[str, ModuleType]:
    return {name: importlib.import_module(path) for name, path in MODULES.items()}


def probe(engine: str = NAME) -> str:
    """``sglang 0.5.20 + lmcache 0.5.6`` if both import what this adapter drives;
    ``EngineUnavailable`` naming ``make sglang-lmcache-env`` otherwise."""
    lmcache = probe_engine(engine, "lmcache", (env.VERSION,), "LMCacheEngine", SETUP,
                           env._modules)
    sglang = probe_engine(engine, "sglang", SGLANG_VERSIONS, "LMCRadixCache", SETUP,
                          _modules)
    return f"sglang {sglang} + lmcache {lmcache}"


_CLOCK = LogicalTime()


def check_limits(config: RadixConfig) -> None:
    """What this rig can build: an object in one CPU block, the device in the KV pool."""
    if config.flat.chunk_tokens * 2 * HEAD_DIM * 4 > BLOCK_BYTES:
        raise ValueError("flat: an object must fit one 4 KiB block")
    if config.device_slots + config.page_size > POOL_ROWS:
        raise ValueError(f"device_pages: at most {POOL_ROWS} slots")


class _NoStream:
    """A device stream on the CPU, where every copy is synchronous (patch 1)."""

    device = torch.device("cpu")

    def synchronize(self) -> None:
        return None

    def wait_stream(self, stream: object) -> None:
        return None


@contextmanager
def _on_cpu(mods: Mapping[str, ModuleType]) -> Iterator[None]:
    """Patches 1 and 2 of the module docstring, undone on exit."""
    lmc, radix = mods["lmc"], mods["radix"]
    shipped_stream, shipped_init = lmc.create_device_stream, radix.RadixCache.__init__

    def radix_init(cache: Any, params: Any) -> None:
        shipped_init(cache, params)
        cache.device = torch.device("xpu")  # lmc_radix_cache.py:141 picks the IP mode

    lmc.create_device_stream = lambda device: _NoStream()
    radix.RadixCache.__init__ = radix_init
    try:
        yield
    finally:
        lmc.create_device_stream = shipped_stream
        radix.RadixCache.__init__ = shipped_init


@dataclass
class LMCRadix:
    """One ``LMCRadixCache`` (in-process) over a fresh LMCache engine, on the CPU."""

    config: RadixConfig
    mods: dict[str, ModuleType]
    cache: Any
    kv: Any
    allocator: Any
    req_to_token: Any
    folder: tempfile.TemporaryDirectory[str]
    rig: env.Rig
    chunks: dict[int, Key] = field(default_factory=dict)  # chunk hash -> chunk
    disk_orders: list[tuple[Obj, ...]] = field(default_factory=list)  # per layer, last store
    requests: Iterator[int] = field(default_factory=itertools.count)
    loads_started: int = 0  # start_load_kv calls: the loads match_prefix started
    # Known bugs a campaign steers around (spec/15 15.3), by the flat machine's names.
    avoid: Mapping[str, str] = field(default_factory=lambda: {
        RETRIEVE_FROM_DISK: "DEV-L1: a disk-tier hit on the layerwise path never frees "
                            "its staging buffers",
        RETRIEVE_ACROSS_TIERS: "DEV-L3: a retrieve whose run spans both tiers raises",
        LOOKUP_AT_A_PARTIAL_CHUNK: "DEV-L4: a lookup pins the layers of a chunk it does "
                                   "not count",
        "load_evicts_its_match": "DEV-L5: a load's eviction may take the match's own "
                                 "unlocked prefix (lmc_radix_cache.py:346-347)",
    })
    version: str = ""
    closed: bool = False

    # -- the server's calls ---------------------------------------------------------------
    def tick(self) -> None:
        """Advance SGLang's recency clock (its ``time.monotonic``, here logical)."""
        _CLOCK.now += 1

    def radix_key(self, tokens: Sequence[int]) -> Any:
        self.remember(tokens)
        return self.mods["radix"].RadixKey(token_ids=list(tokens), extra_key=None)

    def match_prefix(self, tokens: Sequence[int]) -> tuple[Served, Any]:
        """``match_prefix`` as the scheduler calls it (schedule_policy.py:175), then the
        lock it takes on the match (schedule_policy.py:1094): what the request got, and
        its lock's node. A load it started completes in ``forward``."""
        self.tick()
        device_hit = self.device_hit(tokens)
        result = self.cache.match_prefix(self.mods["base"].MatchPrefixParams(
            key=self.radix_key(tokens)))
        node = result.last_device_node
        self.cache.inc_lock_ref(node)
        slots = tuple(int(s) for s in result.device_indices.tolist())
        return Served(device_hit, len(slots) - device_hit, slots), node

    def match(self, tokens: Sequence[int]) -> tuple[Served, Any]:
        """``match_prefix``, then the forward pass that completes its load."""
        served, node = self.match_prefix(tokens)
        self.forward()
        return served, node

    def device_hit(self, tokens: Sequence[int]) -> int:
        """The tokens of ``tokens`` the device tree holds. It is a match (it touches
        recency and may split a node), the one LMCRadixCache's own starts with, at the
        same tick."""
        aligned = len(tokens) - len(tokens) % self.config.page_size
        # RadixCache.match_prefix: the tree alone (what LMCRadixCache's super() sees).
        got = self.mods["radix"].RadixCache.match_prefix(
            self.cache, self.mods["base"].MatchPrefixParams(
                key=self.mods["radix"].RadixKey(token_ids=list(tokens[:aligned]),
                                                extra_key=None)))
        return len(got.device_indices)

    def forward(self) -> None:
        """The attention backend reads every layer's K buffer; its hook drives LMCache's
        layerwise load (memory_pool.py:2487-2493 → lmc_radix_cache.py:79-83)."""
        for layer in range(self.config.flat.layers):
            self.kv.get_key_buffer(layer)

    def finish(self, tokens: Sequence[int], served: Served, node: Any,
               codes: Sequence[Sequence[int]]) -> bool:
        """The rest of the request: its own slots allocated (evicting if short, as the
        scheduler's ``alloc_token_slots`` does), written with ``codes[layer][position]``,
        then ``cache_finished_req``. False, and everything released, if the device
        cannot hold the request."""
        self.tick()
        fresh_len = len(tokens) - len(served.slots)
        fresh = self._alloc(fresh_len)
        if fresh is None:
            self.cache.dec_lock_ref(node)
            return False
        slots = torch.tensor(list(served.slots) + fresh.tolist(), dtype=torch.int64)
        for layer in range(self.config.flat.layers):
            write(self.kv, layer, fresh, codes[layer][len(served.slots):])
        rows = self.req_to_token.alloc_rows(1)
        if rows is None:
            raise AssertionError("the req_to_token pool has no free row")
        index = int(rows[0])
        self.req_to_token.write((index, slice(0, len(tokens))), slots)
        kv = self.mods["batch"].ReqKvInfo(
            req_pool_idx=index, cache_protected_len=len(served.slots),
            kv_committed_len=len(tokens), kv_allocated_len=len(tokens))
        req = SimpleNamespace(origin_input_ids=list(tokens), output_ids=[], extra_key=None,
                              cache_salt=None, last_node=node, priority=0,
                              rid=f"r{next(self.requests)}", kv=kv)
        self.remember(tokens)
        self.cache.cache_finished_req(req, kv_len_to_handle=len(tokens))
        self.req_to_token.free_rows([index])
        return True

    def _alloc(self, tokens: int) -> torch.Tensor | None:
        """Slots for ``tokens`` fresh tokens: whole pages, as the paged allocator hands
        them out; the prefix is page-aligned, so they start a page, and the unused rest
        of the last page goes back with the request's tail in cache_finished_req
        (radix_cache.py:546-554 frees by page)."""
        if tokens == 0:
            return torch.empty((0,), dtype=torch.int64)
        need = -(-tokens // self.config.page_size) * self.config.page_size
        if self.allocator.available_size() < need:
            self.evict(need)
        slots: torch.Tensor | None = self.allocator.alloc(need)
        return None if slots is None else slots[:tokens]

    def device_available(self) -> int:
        return int(self.allocator.available_size())

    def live_lookups(self) -> frozenset[str]:
        return frozenset(self.rig.engine.lookup_pins)

    def evict(self, tokens: int) -> int:
        self.tick()
        result = self.cache.evict(self.mods["base"].EvictParams(num_tokens=tokens))
        return int(result.num_tokens_evicted)

    # -- keys ------------------------------------------------------------------------------
    def remember(self, tokens: Sequence[int]) -> None:
        """Learn which chunk each of LMCache's chunk hashes of ``tokens`` names."""
        ids = torch.tensor(list(tokens), dtype=torch.int64)
        for _, end, chunk_key in self.rig.engine.token_database.process_tokens(tokens=ids):
            self.chunks[chunk_key.chunk_hash] = Key(tuple(tokens[:end]))

    def obj(self, engine_key: Any) -> Obj:
        chunk = self.chunks.get(engine_key.chunk_hash)
        if chunk is None:
            raise AssertionError(f"LMCache holds {engine_key}, a chunk of no key given")
        return Obj(chunk, int(engine_key.layer_id))

    # -- observing --------------------------------------------------------------------------
    def tiers(self) -> FlatView:
        return read_tiers(self.rig, self.obj)

    def device_state(self, contents: Callable[[int, int], Key | None],
                     arriving: Mapping[int, Key] | None = None) -> State:
        """SGLang's device tree as the model's ``State`` of a device-only cache (no host
        tier): pages with their slots and locks, the free slots, slots callers hold, and
        whose KV each slot holds (``contents(code, layer)``, every layer agreeing). Ticks,
        hits and priorities are not compared (no device transition is), so left 0.
        ``arriving``: SGLang slot -> content of a load still in flight (its later layers
        land in the forward pass), taken as landed."""
        ps = self.config.page_size
        pages: dict[Key, Page] = {}
        stack = [(self.cache.root_node, ())]
        while stack:
            node, prefix = stack.pop()
            for child in node.children.values():
                tokens = prefix + tuple(child.key.token_ids)
                slots = tuple(int(s) - ps for s in child.value.tolist())
                start = len(prefix)
                for i in range(len(child.key) // ps):
                    pages[Key(tokens[:start + (i + 1) * ps])] = Page(
                        device=slots[i * ps:(i + 1) * ps], host=None, lock=child.lock_ref)
                stack.append((child, tokens))
        free = self._free_slots()
        owned = {s for p in pages.values() for s in p.device or ()}
        held = frozenset(set(range(self.config.device_slots)) - free - owned)
        device_kv: dict[int, Key] = {}
        for slot in sorted(owned | held):
            content = (arriving[slot + ps] if arriving and slot + ps in arriving
                       else self._content(slot + ps, contents))
            if content is not None:
                device_kv[slot] = content
        config = Config(page_size=ps, device_slots=self.config.device_slots, host_slots=0)
        return State(config=config, pages=pages, device_free=free, host_free=frozenset(),
                     held=held, device_kv=device_kv, host_kv={}, pending=(), clock=0,
                     evictable_tokens=int(self.cache.evictable_size_),
                     protected_tokens=int(self.cache.protected_size_))

    def _free_slots(self) -> frozenset[int]:
        ps = self.config.page_size
        if ps == 1:
            slots = self.allocator.free_pages.tolist() + self.allocator.release_pages.tolist()
        else:
            slots = [p * ps + i for p in self.allocator.free_pages.tolist()
                     for i in range(ps)]
        return frozenset(int(s) - ps for s in slots)

    def _content(self, slot: int, contents: Callable[[int, int], Key | None]) -> Key | None:
        found = set()
        for layer in range(self.config.flat.layers):
            code = token_code(self.kv.k_buffer[layer][slot], self.kv.v_buffer[layer][slot])
            found.add(None if code is None else contents(code, layer))
        return found.pop() if len(found) == 1 else None

    def read(self, slots: Sequence[int], contents: Callable[[int, int], Key | None]
             ) -> list[Key | None]:
        """Whose KV each of SGLang's device ``slots`` holds, every layer agreeing."""
        return [self._content(s, contents) for s in slots]

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.rig.close()
            self.folder.cleanup()


def write(kv: Any, layer: int, slots: torch.Tensor, codes: Sequence[int]) -> None:
    """Token ``i``'s K at ``slots[i]`` is ``codes[i]`` everywhere, its V the negation
    (the flat machine's codes, which LMCache's objects then carry)."""
    if not len(slots):
        return
    values = torch.tensor([float(c) for c in codes], dtype=DTYPE).view(-1, 1, 1)
    kv.k_buffer[layer][slots] = values.expand(-1, *kv.k_buffer[layer].shape[1:])
    kv.v_buffer[layer][slots] = -kv.k_buffer[layer][slots]


def _lmcache_yaml(config: RadixConfig, disk_dir: str) -> str:
    flat = config.flat
    return "\n".join([
        f"chunk_size: {flat.chunk_tokens}",
        "local_cpu: true",
        f"max_local_cpu_size: {flat.cpu_objects * BLOCK_BYTES / GB!r}",
        f"local_disk: \"file://{disk_dir}/\"",
        f"max_local_disk_size: {flat.disk_objects * BLOCK_BYTES / GB!r}",
        "use_layerwise: true",
        "save_unfull_chunk: false",
    ]) + "\n"


def build(config: RadixConfig) -> LMCRadix:
    """A fresh ``LMCRadixCache`` over a fresh LMCache engine (in a private disk folder)."""
    check_limits(config)
    version = probe()
    mods = _modules()
    builder = mods["builder"].LMCacheEngineBuilder
    engine_name = mods["lmc_utils"].ENGINE_NAME
    if builder.get(engine_name) is not None:
        raise ValueError(f"an LMCache engine {engine_name!r} exists already (close it)")
    mods["radix"].time = _CLOCK  # deterministic recency (DEV-2), as the SGLang adapters
    _CLOCK.now = 0
    folder = tempfile.TemporaryDirectory(prefix="hiradix-sglang-lmcache-")
    yaml_path = Path(folder.name) / "lmcache.yaml"
    (Path(folder.name) / "disk").mkdir()
    yaml_path.write_text(_lmcache_yaml(config, f"{folder.name}/disk"))
    ps, layers = config.page_size, config.flat.layers
    args = mods["args"].ServerArgs(model_path="dummy", device="cpu", page_size=ps,
                                   enable_lmcache=True, lmcache_config_file=str(yaml_path))
    mods["context"].publish(args, role="test")
    kv = mods["pool"].MHATokenToKVPool(POOL_ROWS, ps, DTYPE, 1, HEAD_DIM, layers,
                                       device="cpu", enable_memory_saver=False)
    if ps == 1:
        allocator = mods["token"].TokenToKVPoolAllocator(config.device_slots, DTYPE, "cpu",
                                                         kv, False)
    else:
        allocator = mods["paged"].PagedTokenToKVPoolAllocator(config.device_slots, ps, DTYPE,
                                                              "cpu", kv, False)
    req_to_token = mods["pool"].ReqToTokenPool(4, 64, "cpu", False)
    params = mods["params"].CacheInitParams(
        disable=False, req_to_token_pool=req_to_token, token_to_kv_pool_allocator=allocator,
        page_size=ps, eviction_policy="lru")
    model = SimpleNamespace(num_hidden_layers=layers, head_dim=HEAD_DIM, model_path="hiradix",
                            attention_arch=None, get_num_kv_heads=lambda tp_size: 1)
    with _on_cpu(mods):
        cache = mods["lmc"].LMCRadixCache(params, model_config=model, tp_size=1, rank=0)
    cache.device = torch.device("cpu")
    if cache._mode is not mods["lmc"].LMCacheMode.IP:
        raise AssertionError("LMCRadixCache did not take its in-process mode")
    cache.evictable_leaves = InsertionOrdered(cache.evictable_leaves)
    engine = cache.lmcache_connector.lmcache_engine
    rig_config = env.RigConfig(layers=layers, heads=1, head_dim=HEAD_DIM,
                               chunk_tokens=config.flat.chunk_tokens,
                               slots=config.device_slots + ps,
                               cpu_gb=config.flat.cpu_objects * BLOCK_BYTES / GB,
                               disk_gb=config.flat.disk_objects * BLOCK_BYTES / GB)
    rig = env.Rig(rig_config, engine, list(kv.k_buffer), list(kv.v_buffer), engine_name)
    radix = LMCRadix(config, mods, cache, kv, allocator, req_to_token, folder, rig,
                     version=version)
    _wait_after_each_layer(radix)
    _count_loads(radix)
    return radix


def _count_loads(radix: LMCRadix) -> None:
    """Count the loads match_prefix starts (an allocation that fails starts none,
    lmc_radix_cache.py:305-307): the checks map each onto the flat model's lookup."""
    connector = radix.cache.lmcache_connector
    shipped = connector.start_load_kv

    def start_load_kv(metadata: Any) -> int:
        radix.loads_started += 1
        loaded: int = shipped(metadata)
        return loaded

    connector.start_load_kv = start_load_kv


def _wait_after_each_layer(radix: LMCRadix) -> None:
    """The one write schedule checked (module docstring): after each layer's puts every
    disk write ends, and the disk tier's order is recorded for the model's ``arrivals``."""
    engine = radix.rig.engine
    shipped = engine.store_layer

    def store_layer(*args: Any, **kwargs: Any) -> Iterator[Any]:
        radix.disk_orders.clear()
        for index, step in enumerate(shipped(*args, **kwargs)):
            if index:  # past the allocation phase (cache_engine.py:680-770): a layer's puts
                env.wait_for_disk_puts(radix.rig)
                keys = under_lock(radix.rig.disk.disk_lock,
                              lambda: list(radix.rig.disk.dict.keys()))
                radix.disk_orders.append(tuple(radix.obj(k) for k in keys))
            yield step

    engine.store_layer = store_layer
