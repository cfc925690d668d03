"""LMCache 0.5.6 on the CPU: its engine with a CPU and a disk tier, built and observed
(spec/15-lmcache.md; issue 31).

``probe`` says whether LMCache can be driven here. ``build`` makes an ``LMCacheEngine``
with its ``LocalCPUBackend`` and ``LocalDiskBackend`` under a KV pool of our own on the
CPU; ``store`` drives its layerwise store to the end, ``retrieve`` its layerwise retrieve
as far as it goes (spec/15 DEV-L1), ``sglang_load`` LMCache's own SGLang connector as
SGLang drives it; ``balance`` reads what spec/15 checks: the CPU allocator's active
allocations against the objects each tier holds, and the pins.

What had to change for the CPU, all here:

- the KV pool. LMCache's layerwise SGLang connector falls back on the CPU to a torch copy
  (``lmcache/v1/platform/torch_ops/mem_kernels.py:384``) that reads the pool as
  ``[blocks, block_size, heads, head_dim]``; SGLang's pool is ``[slots, heads, head_dim]``,
  so each layer's pool here is ``[slots, 1, heads, head_dim]`` (blocks of one token). No
  connector is patched: the bytes move through LMCache's own code.
- the hash. Without vLLM installed LMCache keys chunks by Python's builtin ``hash``
  (``lmcache/v1/token_database.py:161``), which ``PYTHONHASHSEED`` salts per process: keys
  agree within one process only. Every observation here builds, stores and retrieves in
  one process, and a disk tier is never reopened by another.
- the engine registry. ``LMCacheEngineBuilder`` keeps engines by id in a class-level dict
  (``lmcache/v1/cache_engine.py:2122``); ``Rig.close`` destroys the one ``build`` made,
  so the next ``build`` with that id starts clean.
"""

from __future__ import annotations

import importlib
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from types import ModuleType, SimpleNamespace
from typing import Any, NamedTuple

import torch

from hiradix.engines.protocol import probe_engine

VERSION = "0.5.6"
SETUP = "make lmcache-env, then run .venv-lmcache/bin/python"
CPU_TIER = "LocalCPUBackend"
DISK_TIER = "LocalDiskBackend"
# The id under which LMCache's SGLang connector finds its engine (init_lmcache_engine in
# lmcache/integration/sglang/sglang_adapter.py:96 reuses an engine built under this id).
SGLANG_INSTANCE = "sglang-instance"
LOCK_TIMEOUT_S = 5.0
MODULES = {
    "engine": "lmcache.v1.cache_engine",
    "config": "lmcache.v1.config",
    "metadata": "lmcache.v1.metadata",
    "connectors": "lmcache.v1.gpu_connector.gpu_connectors",
    "utils": "lmcache.utils",
    "cpu": "lmcache.v1.storage_backend.local_cpu_backend",
    "disk": "lmcache.v1.storage_backend.local_disk_backend",
    "sglang_adapter": "lmcache.integration.sglang.sglang_adapter",
}


def _modules() -> dict[str, ModuleType]:
    return {name: importlib.import_module(path) for name, path in MODULES.items()}


def probe(engine: str = "lmcache") -> str:
    """The installed LMCache version if it is 0.5.6 and imports its engine, CPU and disk
    tiers and SGLang connector; ``EngineUnavailable`` naming ``make lmcache-env`` if not."""
    return probe_engine(engine, "lmcache", (VERSION,),
                        "LMCacheEngine with LocalCPUBackend and LocalDiskBackend", SETUP,
                        _modules)


@dataclass(frozen=True, slots=True)
class RigConfig:
    """The shape of one rig: ``layers`` x (K, V) pools of ``slots`` token slots of
    ``heads`` x ``head_dim`` floats; LMCache's chunk of ``chunk_tokens`` tokens; its CPU
    and disk tiers' budgets in GB (LMCache's unit: ``max_local_cpu_size``,
    ``max_local_disk_size``)."""

    layers: int = 2
    heads: int = 1
    head_dim: int = 4
    chunk_tokens: int = 4
    slots: int = 64
    cpu_gb: float = 0.001
    disk_gb: float = 0.01

    def __post_init__(self) -> None:
        for name in ("layers", "heads", "head_dim", "chunk_tokens", "slots"):
            value = getattr(self, name)
            if type(value) is not int or value < 1:
                raise ValueError(f"{name}: must be an int >= 1, got {value!r}")
        for name in ("cpu_gb", "disk_gb"):
            value = getattr(self, name)
            if not isinstance(value, float) or not value > 0:
                raise ValueError(f"{name}: must be a float > 0, got {value!r}")


@dataclass
class Rig:
    """An LMCache engine over a CPU KV pool: ``k_pool[layer]`` and ``v_pool[layer]`` are
    ``[slots, 1, heads, head_dim]``; ``cpu`` and ``disk`` are its two tiers."""

    config: RigConfig
    engine: Any  # lmcache.v1.cache_engine.LMCacheEngine
    k_pool: list[torch.Tensor]
    v_pool: list[torch.Tensor]
    instance_id: str
    closed: bool = field(default=False)

    @property
    def cpu(self) -> Any:
        """The LocalCPUBackend (its objects in ``hot_cache``)."""
        return self.engine.storage_manager.storage_backends[CPU_TIER]

    @property
    def disk(self) -> Any:
        """The LocalDiskBackend (its entries in ``dict``)."""
        return self.engine.storage_manager.storage_backends[DISK_TIER]

    def close(self) -> None:
        """Destroy the engine (its threads and its registry entry); idempotent."""
        if not self.closed:
            _modules()["engine"].LMCacheEngineBuilder.destroy(self.instance_id)
            self.closed = True


def build(config: RigConfig, disk_dir: str, instance_id: str = SGLANG_INSTANCE) -> Rig:
    """A fresh engine with LMCache's CPU tier and a disk tier in ``disk_dir`` (layerwise,
    full chunks only), registered under ``instance_id``. ``ValueError`` if an engine of
    that id exists (close the previous rig first)."""
    mods = _modules()
    builder = mods["engine"].LMCacheEngineBuilder
    if builder.get(instance_id) is not None:
        raise ValueError(f"instance_id: an LMCache engine {instance_id!r} exists already")
    lm_config = mods["config"].LMCacheEngineConfig.from_defaults(
        chunk_size=config.chunk_tokens, local_cpu=True, max_local_cpu_size=config.cpu_gb,
        local_disk=f"file://{disk_dir}/", max_local_disk_size=config.disk_gb,
        use_layerwise=True, save_unfull_chunk=False)
    metadata = mods["metadata"].LMCacheMetadata(
        model_name="hiradix", world_size=1, local_world_size=1, worker_id=0,
        local_worker_id=0, kv_dtype=torch.float32,
        kv_shape=(config.layers, 2, config.chunk_tokens, config.heads, config.head_dim),
        use_mla=False)
    connector = mods["connectors"].SGLangLayerwiseGPUConnector(
        config.heads * config.head_dim, config.layers, use_gpu=False, dtype=torch.float32,
        device="cpu")
    engine = builder.get_or_create(instance_id, lm_config, metadata, connector,
                                   mods["utils"].mock_up_broadcast_fn,
                                   mods["utils"].mock_up_broadcast_object_fn)
    shape = (config.slots, 1, config.heads, config.head_dim)
    k_pool = [torch.zeros(shape) for _ in range(config.layers)]
    v_pool = [torch.zeros(shape) for _ in range(config.layers)]
    engine.post_init(kvcaches=[k_pool, v_pool])
    return Rig(config, engine, k_pool, v_pool, instance_id)


def fill(rig: Rig, slots: torch.Tensor, seed: int) -> None:
    """Write distinct KV into ``slots`` of every layer (K positive, V its negation), so
    that bytes served can be told from bytes stored under another key."""
    for layer in range(rig.config.layers):
        per_slot = rig.config.heads * rig.config.head_dim
        values = torch.arange(len(slots) * per_slot, dtype=torch.float32).view(
            len(slots), 1, rig.config.heads, rig.config.head_dim)
        rig.k_pool[layer][slots] = values + 1 + 1000 * layer + 100000 * seed
        rig.v_pool[layer][slots] = -rig.k_pool[layer][slots]


def store(rig: Rig, tokens: list[int], slots: torch.Tensor) -> None:
    """Store the KV at ``slots`` under ``tokens``, driving ``store_layer`` to its end."""
    for _ in rig.engine.store_layer(torch.tensor(tokens), mask=torch.ones(len(tokens),
                                    dtype=torch.bool), kvcaches=[rig.k_pool, rig.v_pool],
                                    slot_mapping=slots, offset=0, sync=True):
        pass


def retrieve(rig: Rig, tokens: list[int], slots: torch.Tensor) -> int:
    """Load what LMCache holds for ``tokens`` into ``slots`` through ``retrieve_layer``;
    the number of tokens it retrieved (its first step's count).

    It is advanced num_layers + 1 times, as LMCache's SGLang connector does, and then
    closed: that is as far as it goes. Its next step (cache_engine.py:1133) advances the
    connector's batched_to_gpu, which yields num_layers + 1 times (gpu_connectors.py:1801,
    1841), not the + 2 its docstring says, so it raises StopIteration inside the
    generator (a RuntimeError) before the staging buffers' release that follows it
    (spec/15 DEV-L1). ``retrieve_to_end`` takes that step."""
    steps = rig.engine.retrieve_layer(
        torch.tensor(tokens), mask=torch.ones(len(tokens), dtype=torch.bool),
        kvcaches=[rig.k_pool, rig.v_pool], slot_mapping=slots, offset=0, sync=True)
    try:
        first = next(steps)  # the hit's token count, or None where nothing is held
        retrieved = 0 if first is None else int(first)
        for _ in range(rig.config.layers):
            next(steps)
    finally:
        steps.close()
    return retrieved


def retrieve_to_end(rig: Rig, tokens: list[int], slots: torch.Tensor) -> int:
    """``retrieve``, then every remaining step of ``retrieve_layer`` (its release of the
    staging buffers and its final mask); the number of tokens its mask marks."""
    retrieved = 0
    for step in rig.engine.retrieve_layer(
            torch.tensor(tokens), mask=torch.ones(len(tokens), dtype=torch.bool),
            kvcaches=[rig.k_pool, rig.v_pool], slot_mapping=slots, offset=0, sync=True):
        if isinstance(step, torch.Tensor) and step.dtype == torch.bool:
            retrieved = int(step.sum())
    return retrieved


def wait_for_disk_puts(rig: Rig, timeout_s: float = 10.0) -> None:
    """Wait until the disk tier has finished every asynchronous put (its worker's
    ``put_tasks`` empty); ``TimeoutError`` after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    worker = rig.disk.disk_worker
    while True:
        with worker.put_lock:
            pending = len(worker.put_tasks)
        if pending == 0:
            return
        if time.monotonic() > deadline:
            raise TimeoutError(f"{pending} disk puts still pending after {timeout_s} s")
        time.sleep(0.01)


class Balance(NamedTuple):
    """One reading of the CPU allocator and the two tiers (spec/15, LMC-STAGING and
    LMC-PINS)."""

    active_allocations: int  # objects the CPU tier's allocator has handed out, not freed
    cpu_resident: int  # objects the CPU tier holds (its hot_cache)
    disk_resident: int  # chunks-per-layer the disk tier holds
    cpu_pins: int  # sum of pin counts over the CPU tier's objects
    disk_pins: int  # sum of pin counts over the disk tier's entries

    @property
    def staging(self) -> int:
        """Allocations no tier holds: staging buffers of live operations, or leaked."""
        return self.active_allocations - self.cpu_resident


def balance(rig: Rig) -> Balance:
    """Read the balance; call it with no operation in flight (disk puts waited for)."""
    allocator = rig.cpu.memory_allocator.pin_allocator
    cpu_objects = _under(rig.cpu.cpu_lock, "CPU", lambda: list(rig.cpu.hot_cache.values()))
    disk_entries = _under(rig.disk.disk_lock, "disk", lambda: list(rig.disk.dict.values()))
    return Balance(
        active_allocations=int(allocator.num_active_allocations),
        cpu_resident=len(cpu_objects),
        disk_resident=len(disk_entries),
        cpu_pins=sum(int(obj.metadata.pin_count) for obj in cpu_objects),
        disk_pins=sum(int(entry.pin_count) for entry in disk_entries))


def _under(lock: Any, tier: str, read: Callable[[], list[Any]]) -> list[Any]:
    # A tier lock an operation never released (a disk load whose staging allocation
    # failed returns holding disk_lock: local_disk_backend.py:607,628) would hang the
    # reading forever; a bounded wait turns that into an error naming the tier.
    if not lock.acquire(timeout=LOCK_TIMEOUT_S):
        raise TimeoutError(f"the {tier} tier's lock is held after {LOCK_TIMEOUT_S} s")
    try:
        return read()
    finally:
        lock.release()


def sglang_connector(rig: Rig) -> Any:
    """LMCache's own SGLang layerwise connector over the rig's engine and pool. It finds
    the engine by its id (so ``rig`` must be built under SGLANG_INSTANCE) and reads only
    ``num_hidden_layers`` of SGLang's model config on this path."""
    if rig.instance_id != SGLANG_INSTANCE:
        raise ValueError(f"rig: must be built under {SGLANG_INSTANCE!r}, "
                         f"got {rig.instance_id!r}")
    adapter = _modules()["sglang_adapter"]
    model_config = SimpleNamespace(num_hidden_layers=rig.config.layers)
    return adapter.LMCacheLayerwiseConnector(model_config, 1, 0, rig.k_pool, rig.v_pool, "")


def sglang_load(rig: Rig, connector: Any, tokens: list[int], slots: torch.Tensor) -> int:
    """One load as SGLang 0.5.20's LMCRadixCache makes it in its in-process mode:
    ``start_load_kv`` from match_prefix (sglang/srt/mem_cache/storage/lmcache/
    lmc_radix_cache.py:269-280, 432-439), then the KV pool's ``wait_until`` for every
    layer of the forward pass (lmc_radix_cache.py:79-83, memory_pool.py:2487-2492), which is
    the connector's ``load_kv_layerwise``. The tokens it reports loaded."""
    adapter = _modules()["sglang_adapter"]
    loaded: int = connector.start_load_kv(adapter.LoadMetadata(
        token_ids=tokens, slot_mapping=slots, offset=0))
    for layer in range(rig.config.layers):
        connector.load_kv_layerwise(layer)
    return loaded


def evict_cpu_tier(rig: Rig) -> int:
    """Drop every object of the CPU tier that may be evicted (LMCache's ``clear`` of that
    location only; it skips pinned and referenced objects), so that the next retrieve of
    what was dropped is a disk-tier hit; the number of objects dropped. (``clear``'s own
    return counts tokens, local_cpu_backend.py:953-973.)"""
    before = balance(rig).cpu_resident
    rig.engine.clear(locations=[CPU_TIER])
    return before - balance(rig).cpu_resident
