"""LMCache 0.5.6's CPU and disk tiers, observed on the CPU (spec/15-lmcache.md; issue 31;
skipped without LMCache).

Run from its environment: ``make lmcache-env``, then
``.venv-lmcache/bin/python -m pytest -q -x tests/engines/test_lmcache.py``.

Each test builds a fresh engine (two layers, chunks of 4 tokens, so 8 tokens are 2 chunks
and 4 objects per tier: LMCache's layerwise store keeps one object per chunk and layer)
and reads ``lmcache_env.balance`` with no operation in flight. The three checks are
spec/15's proposed ones (15.4), not yet model invariants with spec IDs:

- LMC-STAGING: the CPU allocator's active allocations equal the CPU tier's resident
  objects (``Balance.staging == 0``);
- LMC-PINS: every pin a lookup or a load took is released (both tiers' pins zero);
- LMC-BYTES: the bytes a retrieve writes into the pool are the bytes stored under
  that key.
"""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from hiradix.engines.lmcache import env as lmcache_env
from hiradix.engines.lmcache.env import Rig, RigConfig

from engine_env import require

CONFIG = RigConfig()
TOKENS = list(range(8))  # 2 chunks of 4
OBJECTS = 2 * CONFIG.layers  # objects per tier for TOKENS: chunks x layers
STORED = torch.arange(0, 8)
LOADED = torch.arange(16, 24)


@pytest.fixture
def rig(tmp_path: Path) -> Iterator[Rig]:
    require("lmcache")
    made = lmcache_env.build(CONFIG, str(tmp_path))
    try:
        yield made
    finally:
        made.close()


def stored(rig: Rig) -> None:
    """TOKENS stored from STORED, the disk puts waited for."""
    lmcache_env.fill(rig, STORED, seed=1)
    lmcache_env.store(rig, TOKENS, STORED)
    lmcache_env.wait_for_disk_puts(rig)


def unload(rig: Rig) -> None:
    """Zero LOADED on every layer, so that a later load must write it."""
    for pool in (rig.k_pool, rig.v_pool):
        for layer in range(CONFIG.layers):
            pool[layer][LOADED] = 0


def bytes_served(rig: Rig) -> bool:
    """LMC-BYTES: LOADED holds, layer by layer, the K and V stored from STORED."""
    return all(torch.equal(pool[layer][LOADED], pool[layer][STORED])
               for pool in (rig.k_pool, rig.v_pool) for layer in range(CONFIG.layers))


def test_store_writes_through_to_both_tiers(rig: Rig) -> None:
    """A store puts every chunk on the CPU tier and (asynchronously) on the disk tier,
    holding no allocation beyond what the CPU tier keeps (spec/15, write-through)."""
    stored(rig)
    assert lmcache_env.balance(rig) == lmcache_env.Balance(
        active_allocations=OBJECTS, cpu_resident=OBJECTS, disk_resident=OBJECTS,
        cpu_pins=0, disk_pins=0)


def test_cpu_hit_round_trip_serves_stored_bytes_and_releases_pins(rig: Rig) -> None:
    """Lookup with pins holds every CPU object once; unpin releases them; a retrieve
    writes the stored bytes into other slots and leaves no staging allocation and no pin;
    dropping the CPU tier then frees every allocation (LMC-STAGING, LMC-PINS,
    LMC-BYTES)."""
    stored(rig)
    assert rig.engine.lookup(torch.tensor(TOKENS), lookup_id="a", pin=True) == len(TOKENS)
    assert lmcache_env.balance(rig).cpu_pins == OBJECTS
    rig.engine.lookup_unpin("a")
    assert lmcache_env.balance(rig).cpu_pins == 0
    assert not bytes_served(rig)
    assert lmcache_env.retrieve(rig, TOKENS, LOADED) == len(TOKENS)
    assert bytes_served(rig)
    after = lmcache_env.balance(rig)
    assert (after.staging, after.cpu_pins, after.disk_pins) == (0, 0, 0)
    assert lmcache_env.evict_cpu_tier(rig) == OBJECTS
    assert lmcache_env.balance(rig).active_allocations == 0


def test_disk_hit_is_served_without_promotion_and_leaks_in_0_5_6(rig: Rig) -> None:
    """DEV-L1 through LMCacheEngine alone. With the CPU copies gone, retrieve_layer
    serves the chunks from disk through staging buffers the CPU allocator lends (one
    per chunk and layer, pinned: local_disk_backend.py:621-645) and does not promote
    them to the CPU tier. Advanced as far as it goes (lmcache_env.retrieve) it never
    reaches their release (cache_engine.py:1131-1136): OBJECTS allocations stay active
    with no tier holding them. Passes while the bug is there."""
    stored(rig)
    assert lmcache_env.evict_cpu_tier(rig) == OBJECTS
    assert lmcache_env.retrieve(rig, TOKENS, LOADED) == len(TOKENS)
    assert bytes_served(rig)
    assert lmcache_env.balance(rig) == lmcache_env.Balance(
        active_allocations=OBJECTS, cpu_resident=0, disk_resident=OBJECTS, cpu_pins=0,
        disk_pins=0)


def test_retrieve_layer_release_step_is_unreachable_in_0_5_6(rig: Rig) -> None:
    """Why no caller can avoid DEV-L1 in 0.5.6: the step of retrieve_layer that would
    release the staging buffers first advances the SGLang layerwise connector past its
    last yield (cache_engine.py:1133; gpu_connectors.py:1801, 1841), so it raises
    instead -- on a CPU hit as on a disk hit. Passes while the bug is there."""
    stored(rig)
    with pytest.raises(RuntimeError, match="generator raised StopIteration"):
        lmcache_env.retrieve_to_end(rig, TOKENS, LOADED)


def test_sglang_connector_disk_hit_leaks_staging_buffers_in_0_5_6(rig: Rig) -> None:
    """DEV-L1 (spec/15), as LMCache 0.5.6 ships: this test passes while the bug is there
    and fails once it is fixed (then turn it into the clean expectation).

    LMCache's SGLang layerwise connector advances retrieve_layer num_layers + 1 times
    (start_load_kv: 2, load_kv_layerwise: one per layer after the first) and then drops
    the generator (sglang_adapter.py:277-295, 333-345). retrieve_layer releases the disk
    load's staging buffers only after its (num_layers + 1)-th yield
    (cache_engine.py:1124-1136), so that code never runs: every disk-tier hit leaves its
    staging buffers allocated and pinned, one per chunk and layer. The bytes are served;
    the CPU allocator loses OBJECTS allocations per load (LMC-STAGING), until
    LMCache's PinMonitor force-unpins them (pin_timeout_sec, 300 s by default)."""
    stored(rig)
    connector = lmcache_env.sglang_connector(rig)
    for load in (1, 2):
        assert lmcache_env.evict_cpu_tier(rig) == (OBJECTS if load == 1 else 0)
        unload(rig)
        assert lmcache_env.sglang_load(rig, connector, TOKENS, LOADED) == len(TOKENS)
        assert bytes_served(rig)
        after = lmcache_env.balance(rig)
        assert (after.cpu_resident, after.disk_pins) == (0, 0)
        assert after.staging == OBJECTS * load  # the leak: 4 more per disk load


def test_sglang_connector_cpu_hit_holds_nothing(rig: Rig) -> None:
    """The same connector on a CPU-tier hit: the objects are the CPU tier's own (not
    staging buffers), so stopping the generator early leaks nothing -- the leak is the
    disk path's alone."""
    stored(rig)
    connector = lmcache_env.sglang_connector(rig)
    assert lmcache_env.sglang_load(rig, connector, TOKENS, LOADED) == len(TOKENS)
    assert bytes_served(rig)
    after = lmcache_env.balance(rig)
    assert (after.staging, after.cpu_pins, after.disk_pins) == (0, 0, 0)


def test_planted_unpin_that_forgets_is_caught(rig: Rig, monkeypatch: pytest.MonkeyPatch
                                              ) -> None:
    """A planted bug in a private copy: this engine's lookup_unpin forgets its pins.
    The pin count of the round-trip test sees it (LMC-PINS)."""
    monkeypatch.setattr(rig.engine, "lookup_unpin", lambda lookup_id: None)
    stored(rig)
    rig.engine.lookup(torch.tensor(TOKENS), lookup_id="a", pin=True)
    rig.engine.lookup_unpin("a")
    assert lmcache_env.balance(rig).cpu_pins == OBJECTS  # the clean test's 0 fails


def test_planted_extra_reference_is_caught(rig: Rig, monkeypatch: pytest.MonkeyPatch
                                           ) -> None:
    """A planted bug in a private copy: this CPU tier's reads take each object's
    reference twice. The round-trip test's last balance sees it: dropping the CPU tier
    leaves the objects allocated."""
    cpu = rig.cpu
    read = cpu.batched_get_non_blocking

    async def read_twice(lookup_id: str, keys: list[Any], transfer_spec: Any = None
                         ) -> list[Any]:
        objects: list[Any] = await read(lookup_id, keys, transfer_spec)
        for memory_obj in objects:
            memory_obj.ref_count_up()
        return objects

    monkeypatch.setattr(cpu, "batched_get_non_blocking", read_twice)
    stored(rig)
    assert lmcache_env.retrieve(rig, TOKENS, LOADED) == len(TOKENS)
    # The round-trip test's last two checks (OBJECTS dropped, 0 active) both fail: the
    # held references make every object unevictable, so all stay allocated.
    assert lmcache_env.evict_cpu_tier(rig) == 0
    assert lmcache_env.balance(rig).active_allocations == OBJECTS


def test_planted_chunk_swap_is_caught(rig: Rig, monkeypatch: pytest.MonkeyPatch) -> None:
    """A planted bug in a private copy: this CPU tier's reads hand back a layer's chunks
    in reverse order, so each chunk's slots get another chunk's KV. The round-trip
    test's byte comparison sees it (LMC-BYTES)."""
    cpu = rig.cpu
    read = cpu.batched_get_non_blocking

    async def read_swapped(lookup_id: str, keys: list[Any], transfer_spec: Any = None
                           ) -> list[Any]:
        objects: list[Any] = await read(lookup_id, keys, transfer_spec)
        return objects[::-1]

    monkeypatch.setattr(cpu, "batched_get_non_blocking", read_swapped)
    stored(rig)
    assert lmcache_env.retrieve(rig, TOKENS, LOADED) == len(TOKENS)
    assert not bytes_served(rig)  # the clean test's bytes_served fails


def test_rig_config_rejects_bad_values() -> None:
    """Bad shapes are a ValueError naming the argument (no LMCache needed)."""
    with pytest.raises(ValueError, match="chunk_tokens"):
        RigConfig(chunk_tokens=0)
    with pytest.raises(ValueError, match="cpu_gb"):
        RigConfig(cpu_gb=0.0)


def test_build_refuses_a_second_engine_of_one_id(rig: Rig, tmp_path: Path) -> None:
    """LMCache keeps engines by id in a class-level registry: a second build under a live
    id is refused rather than handed the first engine."""
    with pytest.raises(ValueError, match="instance_id"):
        lmcache_env.build(CONFIG, str(tmp_path), rig.instance_id)
    other = lmcache_env.build(CONFIG, str(tmp_path / "other"), f"t-{uuid.uuid4()}")
    other.close()


# DEV-L2's scenario, run in a child process: its deadlock leaves a thread waiting forever
# and a lock held, which no fixture could clean up. The child prints what it saw.
DEV_L2_SCENARIO = """
import sys, tempfile, threading, torch
from hiradix.engines.lmcache import env as lmcache_env
rig = lmcache_env.build(lmcache_env.RigConfig(cpu_gb=2.3e-5), tempfile.mkdtemp())
tokens, stored, loaded = list(range(8)), torch.arange(0, 8), torch.arange(16, 24)
lmcache_env.fill(rig, stored, seed=1)
lmcache_env.store(rig, tokens, stored)
lmcache_env.wait_for_disk_puts(rig)
connector = lmcache_env.sglang_connector(rig)
if len(sys.argv) > 1 and sys.argv[1] == "fixed":
    # A private copy with the fix: a failed staging allocation releases disk_lock.
    cpu_allocate = rig.disk.local_cpu_backend.allocate
    def allocate(*args, **kwargs):
        memory_obj = cpu_allocate(*args, **kwargs)
        if memory_obj is None:
            rig.disk.disk_lock.release()
        return memory_obj
    rig.disk.local_cpu_backend.allocate = allocate
for load in (1, 2):
    lmcache_env.evict_cpu_tier(rig)
    worker = threading.Thread(target=lmcache_env.sglang_load,
                              args=(rig, connector, tokens, loaded), daemon=True)
    worker.start()
    worker.join(timeout=20)
    if worker.is_alive():
        free = rig.disk.disk_lock.acquire(timeout=1)
        print(f"load {load} hangs; disk lock {'free' if free else 'held'}", flush=True)
        sys.stdout.flush()
        import os; os._exit(0)
    print(f"load {load} returned", flush=True)
import os; os._exit(0)  # LMCache's own threads would keep the process alive
"""


def test_a_failed_staging_allocation_keeps_the_disk_lock_in_0_5_6(tmp_path: Path) -> None:
    """DEV-L2 (spec/15), as LMCache 0.5.6 ships; passes while the bug is there. With a
    CPU tier of six 4 KiB blocks, the first disk-tier load leaks its four staging buffers
    (DEV-L1); the second cannot allocate its third, returns from the async disk load
    (local_disk_backend.py:620-635) without releasing disk_lock, taken at :607, and the
    load waits on that lock forever (its next taker). The child process reports the
    first load returned, the second hanging, and the disk tier's lock held."""
    require("lmcache")
    lines, output, logged = dev_l2(tmp_path)
    assert lines == ["load 1 returned", "load 2 hangs; disk lock held"], output
    assert "Memory allocation failed during async disk load" in logged, output


def test_the_dev_l2_reproducer_passes_a_fixed_copy(tmp_path: Path) -> None:
    """The reproducer can tell: in a private copy whose failed staging allocation
    releases disk_lock, the second load returns (with part of the chunks) instead."""
    require("lmcache")
    lines, output, _ = dev_l2(tmp_path, "fixed")
    assert lines == ["load 1 returned", "load 2 returned"], output


def dev_l2(folder: Path, *variant: str) -> tuple[list[str], str, str]:
    """DEV_L2_SCENARIO's report lines, the tail of its output (for a failure message)
    and all it logged (LMCache logs to stderr; how much follows a given line depends
    on its threads' timing, so no check reads only the tail)."""
    import subprocess
    import sys

    done = subprocess.run([sys.executable, "-c", DEV_L2_SCENARIO, *variant],
                          capture_output=True, text=True, timeout=120, cwd=folder,
                          check=False)
    output = done.stdout[-3000:] + done.stderr[-3000:]
    lines = [line for line in done.stdout.splitlines() if line.startswith("load ")]
    return lines, output, done.stderr
