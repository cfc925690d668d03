"""LMCache 0.5.6's CPU and disk tiers as a ``FlatEngine`` (spec/15, 15.5.5; issue 31).

The engine is ``hiradix.engines.lmcache.env``'s rig (``LMCacheEngine``, layerwise, full
chunks only, under LMCache's SGLang layerwise connector on the CPU), built per adapter
in a private disk directory under a fresh engine id. What it maps:

- Capacities. LMCache sizes its tiers in bytes; every object here (one chunk of one
  layer: ``chunk_tokens`` x (K, V) x ``head_dim`` floats, at most 4 KiB) takes one 4 KiB
  block of the CPU allocator (memory_management.py:1338) and is charged its 4 KiB
  physical size on disk (local_disk_backend.py:358). So a tier of ``n`` objects is
  ``n`` x 4 KiB.
- Keys. LMCache names a chunk by a hash chained over its prefix (token_database.py:
  362-365); the adapter remembers, for every key it was handed, which chunk each hash
  names. Hashes are Python's builtin ``hash`` without vLLM (spec/15 15.1): one process.
- Store. ``store_layer`` is stepped as LMCache's connector steps it, and after each
  layer's puts the adapter waits for every disk write (``put_tasks`` empty) and reports
  the disk tier's order: the schedule where writes finish before the next layer is put.
- Retrieve. ``retrieve_layer`` is stepped num_layers + 1 times and closed, as LMCache's
  SGLang connector does (``env.retrieve``; spec/15 DEV-L1).
- Recency. A tier's LRU order is its ``OrderedDict`` order (the LRU policy moves an
  entry to the end on a hit, lru.py:45-51).
- ``own_check``: the disk tier's reserved bytes (``current_cache_size``) equal the
  sizes of its entries, with no write in flight.
"""

from __future__ import annotations

import tempfile
import uuid
from collections.abc import Callable, Mapping, Sequence
from pathlib import Path
from typing import Any

import torch

from hiradix.conformance.flat.engine import FlatView, ObjView
from hiradix.conformance.flat.machine import (
    LOOKUP_AT_A_PARTIAL_CHUNK,
    RETRIEVE_ACROSS_TIERS,
    RETRIEVE_FROM_DISK,
)
from hiradix.engines.lmcache import env
from hiradix_model import Key
from hiradix_model.flat import FlatConfig, Obj, Pin, Tier

NAME = "lmcache"
BLOCK_BYTES = 4096  # one CPU allocator block, and one object's physical size
GB = 1024 ** 3  # LMCache's unit of tier sizes (max_local_cpu_size, max_local_disk_size)
MAX_TOKENS = 32  # device slots [0, 32) hold what is stored, [32, 64) what is loaded
TIER_OF: Mapping[str, Tier] = {env.CPU_TIER: "cpu", env.DISK_TIER: "disk"}


def probe(engine: str = NAME) -> str:
    """The installed LMCache version if this adapter can drive it; ``EngineUnavailable``
    naming ``make lmcache-env`` otherwise."""
    return env.probe(engine)


def build(config: FlatConfig) -> LMCacheFlat:
    """A fresh adapter over a fresh engine for ``config``."""
    return LMCacheFlat(config)


class LMCacheFlat:
    """LMCache's ``LocalCPUBackend`` over its ``LocalDiskBackend``, spoken to as the flat
    machine's ``FlatEngine``."""

    name = NAME
    avoid: Mapping[str, str] = {
        RETRIEVE_FROM_DISK: "DEV-L1: a disk-tier hit on the layerwise path never frees "
                            "its staging buffers",
        RETRIEVE_ACROSS_TIERS: "DEV-L3: a retrieve whose run spans both tiers raises",
        LOOKUP_AT_A_PARTIAL_CHUNK: "DEV-L4: a lookup pins the layers of a chunk it does "
                                   "not count",
    }

    def __init__(self, config: FlatConfig) -> None:
        self.version = probe()
        self.config = config
        per_object = config.chunk_tokens * 2 * _HEAD_DIM * 4  # float32 K and V
        if per_object > BLOCK_BYTES:
            raise ValueError(f"config: an object of {config.chunk_tokens} tokens is "
                             f"{per_object} bytes, over one {BLOCK_BYTES}-byte block")
        self._folder = tempfile.TemporaryDirectory(prefix="hiradix-lmcache-")
        rig_config = env.RigConfig(
            layers=config.layers, heads=1, head_dim=_HEAD_DIM,
            chunk_tokens=config.chunk_tokens, slots=2 * MAX_TOKENS,
            cpu_gb=config.cpu_objects * BLOCK_BYTES / GB,
            disk_gb=config.disk_objects * BLOCK_BYTES / GB)
        self.rig = env.build(rig_config, self._folder.name, f"hiradix-flat-{uuid.uuid4()}")
        self._chunks: dict[int, Key] = {}  # chunk hash -> the chunk it names

    # -- keys ------------------------------------------------------------------------------
    def _tokens(self, key: Key) -> torch.Tensor:
        if not isinstance(key, Key) or key.namespace is not None:
            raise ValueError(f"key: must be a Key without a namespace, got {key!r}")
        if not 0 < len(key.tokens) <= MAX_TOKENS:
            raise ValueError(f"key: must have 1..{MAX_TOKENS} tokens, got {len(key.tokens)}")
        tokens = torch.tensor(key.tokens, dtype=torch.int64)
        for _, end, chunk_key in self.rig.engine.token_database.process_tokens(tokens=tokens):
            self._chunks[chunk_key.chunk_hash] = Key(key.tokens[:end])
        return tokens

    def _obj(self, engine_key: Any) -> Obj:
        chunk = self._chunks.get(engine_key.chunk_hash)
        if chunk is None:
            raise AssertionError(f"the engine holds {engine_key}, a chunk of no key given")
        return Obj(chunk, int(engine_key.layer_id))

    # -- the operations --------------------------------------------------------------------
    def store(self, key: Key, codes: Sequence[Sequence[int]]) -> tuple[tuple[Obj, ...], ...]:
        tokens = self._tokens(key)
        slots = torch.arange(len(key.tokens))
        for layer in range(self.config.layers):
            if len(codes[layer]) != len(key.tokens):
                raise ValueError(f"codes: layer {layer} needs {len(key.tokens)} codes")
            _write(self.rig.k_pool[layer], self.rig.v_pool[layer], slots, codes[layer])
        steps = self.rig.engine.store_layer(
            tokens, mask=torch.ones(len(tokens), dtype=torch.bool),
            kvcaches=[self.rig.k_pool, self.rig.v_pool], slot_mapping=slots, offset=0,
            sync=True)
        orders = []
        next(steps)  # the allocation phase (cache_engine.py:680-770)
        for _ in range(self.config.layers):
            next(steps)  # one layer's puts (cache_engine.py:772-777)
            env.wait_for_disk_puts(self.rig)
            orders.append(self._disk_order())
        for _ in steps:  # its last step only counts (cache_engine.py:796-797)
            pass
        return tuple(orders)

    def lookup(self, key: Key, pin: bool, lookup_id: str | None) -> int:
        tokens = self._tokens(key)
        return int(self.rig.engine.lookup(tokens, lookup_id=lookup_id, pin=pin))

    def retrieve(self, key: Key) -> tuple[int, tuple[tuple[int | None, ...], ...]]:
        self._tokens(key)
        loaded = torch.arange(MAX_TOKENS, MAX_TOKENS + len(key.tokens))
        for layer in range(self.config.layers):
            self.rig.k_pool[layer][loaded] = 0
            self.rig.v_pool[layer][loaded] = 0
        served = env.retrieve(self.rig, list(key.tokens), loaded)
        return served, tuple(tuple(token_code(self.rig.k_pool[layer][slot],
                                         self.rig.v_pool[layer][slot]) for slot in loaded)
                             for layer in range(self.config.layers))

    def unpin(self, lookup_id: str) -> None:
        self.rig.engine.lookup_unpin(lookup_id)

    def clear(self) -> None:
        self.rig.engine.clear()

    # -- observing -------------------------------------------------------------------------
    def _disk_order(self) -> tuple[Obj, ...]:
        """The disk tier's objects, least recently used first."""
        keys = under_lock(self.rig.disk.disk_lock, lambda: list(self.rig.disk.dict.keys()))
        return tuple(self._obj(k) for k in keys)

    def observe(self) -> FlatView:
        return read_tiers(self.rig, self._obj)

    def close(self) -> None:
        self.rig.close()
        self._folder.cleanup()


_HEAD_DIM = 4  # one head of 4 floats per token and layer: K codes, V their negation


def _write(k_pool: torch.Tensor, v_pool: torch.Tensor, slots: torch.Tensor,
           codes: Sequence[int]) -> None:
    """Token ``i``'s K at ``slots[i]`` is ``codes[i]`` everywhere, its V the negation."""
    values = torch.tensor([float(c) for c in codes]).view(-1, 1, 1, 1)
    k_pool[slots] = values.expand(-1, *k_pool.shape[1:])
    v_pool[slots] = -k_pool[slots]


def read_tiers(rig: env.Rig, obj: Callable[[Any], Obj]) -> FlatView:
    """LMCache's two tiers as the flat machine reads them (``obj``: an engine key to the
    model's object), each under its own lock, with the disk tier's own accounting."""
    cpu = under_lock(rig.cpu.cpu_lock, lambda: list(rig.cpu.hot_cache.items()))
    disk = under_lock(rig.disk.disk_lock, lambda: list(rig.disk.dict.items()))
    cpu_views = tuple(ObjView(obj(k), int(o.metadata.pin_count), object_codes(o.tensor))
                      for k, o in cpu)
    disk_views = tuple(ObjView(obj(k), int(m.pin_count),
                               object_codes(read_disk_entry(m.path, m.shape)))
                       for k, m in disk)
    lookups = {lookup_id: tuple(Pin(tier_of(location), obj(k))
                                for location, keys in by_location.items() for k in keys)
               for lookup_id, by_location in rig.engine.lookup_pins.items()}
    reserved = int(rig.disk.current_cache_size)
    charged = sum(int(m.size) for _, m in disk)
    own = (None if reserved == charged else
           f"the disk tier reserves {reserved} bytes, its entries are {charged}")
    return FlatView(cpu=cpu_views, disk=disk_views, lookups=lookups,
                    allocations=env.balance(rig).active_allocations, own_check=own)


def token_code(k: torch.Tensor, v: torch.Tensor) -> int | None:
    """The code one token's K and V spell, or None."""
    first = float(k.flatten()[0])
    if not first.is_integer() or not bool((k == first).all()) or not bool((v == -first).all()):
        return None
    return int(first)


def object_codes(kv: torch.Tensor) -> tuple[int | None, ...]:
    """Per token, the code of one object's bytes (LMCache's KV_T2D layout: [tokens,
    (K, V), hidden], memory_management.py)."""
    return tuple(token_code(kv[t, 0], kv[t, 1]) for t in range(kv.shape[0]))


def read_disk_entry(path: str, shape: Any) -> torch.Tensor:
    """A disk entry's bytes as LMCache wrote them (the object's buffer, raw)."""
    raw = Path(path).read_bytes()
    return torch.frombuffer(bytearray(raw), dtype=torch.float32).view(*shape)


def tier_of(location: str) -> Tier:
    if location not in TIER_OF:
        raise AssertionError(f"a lookup pinned on {location!r}, a tier this rig lacks")
    return TIER_OF[location]


def under_lock(lock: Any, read: Callable[[], list[Any]]) -> list[Any]:
    # A lock an operation never released (spec/15 DEV-L2) would hang the reading: a
    # bounded wait turns that into an error.
    if not lock.acquire(timeout=env.LOCK_TIMEOUT_S):
        raise TimeoutError(f"a tier lock is held after {env.LOCK_TIMEOUT_S} s")
    try:
        return read()
    finally:
        lock.release()
