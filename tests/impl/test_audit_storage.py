"""The storage rows of issue 34's audit as a table: each hostile but realistic input to
the storage tier either raises a typed error naming the argument and changes nothing, or
has its documented outcome; each row asserts its outcome class and an unchanged snapshot
(tree, free lists, tier bookkeeping, what the backend holds, what lies outside the root).

The zero-page row is the worst: a backup of pages whose device-to-host copy was still in
flight stored all-zero pages with valid checksums (INV-STORAGE-WRITE-SOURCE).
"""

from __future__ import annotations

import importlib.util
import socket
import sys
import time
import types
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
import torch

from hiradix.cache import HiRadixCache
from hiradix.clock import ManualClock
from hiradix.conformance.scenario import Scenario
from hiradix.keys import RadixKey
from hiradix.storage import (
    ControlledBackend,
    Fault,
    FileBackend,
    MemoryBackend,
    MooncakeClient,
    StorageArgumentError,
    StorageConfig,
    StorageError,
    prefetch_timeout,
)
from hiradix.storage.backend import checksum, encode_page
from hiradix.storage.hashing import page_hashes
from hiradix.storage.tier import PageRun, StorageTier, TierSettings

P = 2
KEY = RadixKey(tuple(range(1, 9)))  # 4 pages
SETTINGS = TierSettings(prefetch_threshold=2, prefetch_token_limit=1000)
EXAMPLE = Path(__file__).resolve().parents[2] / "examples" / "embed.py"


def make(backend: MemoryBackend | ControlledBackend, settings: TierSettings = SETTINGS
         ) -> tuple[HiRadixCache, StorageTier]:
    cache = Scenario(host_pages=8, device_pages=6).build(ManualClock(1), None)
    tier = StorageTier(cache)
    assert tier.attach(backend, "model-a", settings, threaded=False) == "attached"
    return cache, tier


def insert(cache: HiRadixCache, key: RadixKey = KEY) -> torch.Tensor:
    """``key`` inserted with random (non-zero) KV; its host copy stays in flight."""
    slots = cache.device_pool.alloc(len(key.tokens))
    assert slots is not None
    values = torch.rand(cache.device_pool.value_shape(len(key.tokens)),
                        generator=torch.Generator().manual_seed(3)) + 1
    cache.device_pool.write(slots, values.to(cache.device_pool.dtype))
    cache.insert(key, slots)
    return slots


def back_up(cache: HiRadixCache, tier: StorageTier) -> None:
    """``KEY`` inserted, its host copy landed and its storage write run (not drained)."""
    insert(cache)
    cache.engine.complete("d2h", cache.engine.queued("d2h"))  # type: ignore[attr-defined]
    tier.writing_check()
    assert tier.io is not None
    tier.io.run_pending()


def snapshot(cache: HiRadixCache, tier: StorageTier) -> tuple[object, ...]:
    state = tier.state
    return (cache.dump(), sorted(cache.host_pool.free_slots()),
            sorted(cache.device_pool.free_slots()),
            [(n.lock_ref, n.host_ref) for n in cache.nodes()], sorted(state.writes),
            sorted(state.prefetches), state.next_id, len(cache.pending["d2h"]))


# -- the zero-page bug ---------------------------------------------------------------------


@pytest.mark.parametrize("run", [PageRun(KEY, 0, 4), PageRun(KEY, 3, 4), PageRun(KEY, 1, 2)])
def test_a_backup_of_a_host_copy_in_flight_is_refused_and_changes_nothing(run: PageRun) -> None:
    backend = MemoryBackend()
    cache, tier = make(backend)
    insert(cache)
    assert cache.pending["d2h"], "the host copy must still be in flight"
    before = snapshot(cache, tier)
    with pytest.raises(StorageArgumentError) as raised:
        tier.backup_pages(run)
    assert raised.value.argument == "run" and "in flight" in str(raised.value)
    assert snapshot(cache, tier) == before
    assert tier.io is not None
    tier.io.run_pending()
    assert len(backend) == 0, "a page was stored from a host copy that had not landed"
    tier.check()
    cache.check_invariants()


def test_once_the_copy_lands_the_pages_stored_are_the_host_copys_bytes() -> None:
    backend = MemoryBackend()
    cache, tier = make(backend)
    insert(cache)
    cache.engine.complete("d2h", cache.engine.queued("d2h"))  # type: ignore[attr-defined]
    tier.writing_check()  # S-R1 on the acknowledged copy
    assert tier.io is not None
    tier.io.run_pending()
    tier.drain_storage_queues()
    identity = tier.identity
    assert identity is not None
    hashes = page_hashes(list(KEY.tokens), P, identity, None)
    host = torch.cat([n.host for n in cache.nodes() if n.host is not None])
    assert len(backend) == 4
    for index, page_hash in enumerate(hashes):
        read = backend.read_page(page_hash)
        payload = encode_page(cache.host_pool.read(host[index * P:(index + 1) * P]))
        assert read.payload == payload and read.checksum == checksum(payload, page_hash)
        assert any(read.payload), "an all-zero page"
    assert not tier.backup_pages(PageRun(KEY, 0, 4))  # all stored: nothing to write
    cache.check_invariants()


# -- backends and settings: typed, or the documented outcome -----------------------------


def test_a_file_root_with_a_nul_is_a_typed_error_and_creates_nothing(tmp_path: Path) -> None:
    before = sorted(tmp_path.iterdir())
    for root in (str(tmp_path / "a\0b"), tmp_path / "c\0d"):
        with pytest.raises(StorageArgumentError) as raised:
            FileBackend(root)
        assert raised.value.argument == "root"
    assert sorted(tmp_path.iterdir()) == before


def test_a_huge_token_count_has_the_capped_timeout() -> None:
    config = StorageConfig(model_identity="m", timeout_base_s=2.0,
                           timeout_per_1k_tokens_s=0.1, timeout_max_s=30.0)
    assert prefetch_timeout(config, 2 ** 4000) == 30.0  # documented: capped at the max
    flat = StorageConfig(model_identity="m", timeout_base_s=2.0, timeout_per_1k_tokens_s=0.0,
                         timeout_max_s=30.0)
    assert prefetch_timeout(flat, 2 ** 4000) == 2.0  # no slope: the base, whatever the count
    tiny = StorageConfig(model_identity="m", timeout_base_s=0.0, timeout_per_1k_tokens_s=5e-324,
                         timeout_max_s=1.0)
    assert 0.0 < prefetch_timeout(tiny, 2 ** 1030) < 1.0  # exact, not "inf, so the cap"
    with pytest.raises(StorageArgumentError) as raised:
        prefetch_timeout(config, -(2 ** 4000))
    assert raised.value.argument == "num_tokens"


def test_a_huge_timeout_in_seconds_is_an_exact_tick_count() -> None:
    config = StorageConfig(model_identity="m", timeout_max_s=1e308)
    settings = TierSettings.from_config(config)
    assert settings.timeout_max == int(1e308) * 1000  # 1e308 is an integer-valued float
    assert settings.timeout_base == 2000
    assert not settings.timed_out(10 ** 9, 10 ** 12)  # usable: nothing overflows
    assert settings.timed_out(10 ** 400, 10 ** 400)  # and the cap still holds
    assert TierSettings.from_config(StorageConfig(model_identity="m")).timeout_max == 30000


@pytest.fixture
def linked_root(tmp_path: Path) -> Iterator[tuple[FileBackend, Path, str]]:
    """A file backend whose fan-out directory for one page is a link to a directory
    outside its root; that page's hash."""
    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    (outside / "keep").write_bytes(b"not the backend's")
    backend = FileBackend(root)
    page_hash = "ab" + "0" * 62
    (root / "ab").symlink_to(outside, target_is_directory=True)
    yield backend, outside, page_hash


def outside_state(outside: Path) -> list[tuple[str, bytes]]:
    return sorted((p.name, p.read_bytes()) for p in outside.iterdir())


def test_a_linked_directory_in_the_root_is_never_followed(
        linked_root: tuple[FileBackend, Path, str]) -> None:
    backend, outside, page_hash = linked_root
    before = outside_state(outside)
    payload = b"\x01" * 8
    calls: list[Callable[[], object]] = [
        lambda: backend.write_page(page_hash, payload, checksum(payload, page_hash)),
        lambda: backend.has_page(page_hash), lambda: backend.read_page(page_hash),
        lambda: backend.discard_page(page_hash)]
    for call in calls:
        with pytest.raises(StorageError):
            call()
        assert outside_state(outside) == before
    backend.clear()  # removes the link itself, not what it points to
    assert not (backend.root / "ab").exists() and outside_state(outside) == before


def test_a_linked_page_file_is_never_read(tmp_path: Path) -> None:
    backend = FileBackend(tmp_path / "root")
    page_hash = "cd" + "1" * 62
    target = tmp_path / "elsewhere.page"
    target.write_bytes(b"secret")
    path = backend.path_of(page_hash)
    path.parent.mkdir()
    path.symlink_to(target)
    for call in (lambda: backend.has_page(page_hash), lambda: backend.read_page(page_hash)):
        with pytest.raises(StorageError):
            call()
    assert target.read_bytes() == b"secret"


def test_a_full_memory_backend_refuses_the_write_and_keeps_what_it_has() -> None:
    payload = b"\x02" * 100
    first, second = "a" * 64, "b" * 64
    backend = MemoryBackend(capacity_bytes=150)
    backend.write_page(first, payload, checksum(payload, first))
    with pytest.raises(StorageError) as raised:
        backend.write_page(second, payload, checksum(payload, second))
    assert raised.value.operation == "set" and "full" in str(raised.value)
    assert len(backend) == 1 and backend.used_bytes == 100 and not backend.has_page(second)
    backend.write_page(first, payload, checksum(payload, first))  # a rewrite fits
    backend.discard_page(first)
    assert backend.used_bytes == 0
    backend.write_page(second, payload, checksum(payload, second))
    for bad in (0, -1, 1.5, True, None):
        with pytest.raises(StorageArgumentError) as typed:
            MemoryBackend(capacity_bytes=bad)  # type: ignore[arg-type]
        assert typed.value.argument == "capacity_bytes"


def test_a_backup_to_a_full_backend_is_a_failed_write_and_the_page_a_later_miss() -> None:
    backend = MemoryBackend(capacity_bytes=1)  # smaller than any page
    cache, tier = make(backend)
    back_up(cache, tier)
    assert tier.drain_storage_queues()[1] == 1  # acknowledged, protection released
    assert len(backend) == 0 and backend.used_bytes == 0 and tier.metrics.write_errors == 1
    assert tier.query_storage_hit_length(KEY) == 0
    tier.check()
    cache.check_invariants()


def test_no_mooncake_master_fails_fast_in_one_line(monkeypatch: pytest.MonkeyPatch) -> None:
    """Runs without the wheel: a stand-in ``mooncake.store`` whose store must never be
    made; nothing listens at the master's port."""
    made: list[object] = []
    module = types.ModuleType("mooncake.store")
    module.MooncakeDistributedStore = lambda: made.append(1)  # type: ignore[attr-defined]
    monkeypatch.setitem(sys.modules, "mooncake.store", module)
    with socket.socket() as closed:
        closed.bind(("127.0.0.1", 0))
        port = closed.getsockname()[1]
    start = time.monotonic()
    with pytest.raises(StorageError) as raised:
        MooncakeClient(f"127.0.0.1:{port}", f"http://127.0.0.1:{port}/metadata",
                       connect_timeout_s=1.0)
    assert time.monotonic() - start < 5  # bounded by connect_timeout_s per address
    assert raised.value.operation == "connect" and "\n" not in str(raised.value)
    assert f"127.0.0.1:{port}" in str(raised.value) and not made
    for bad in (0, -1.0, float("inf"), float("nan"), True):
        with pytest.raises(StorageArgumentError) as typed:
            MooncakeClient("127.0.0.1:1", "P2PHANDSHAKE", connect_timeout_s=bad)
        assert typed.value.argument == "connect_timeout_s"
    with pytest.raises(StorageArgumentError) as address:
        MooncakeClient("no-port", "P2PHANDSHAKE")
    assert address.value.argument == "master" and not made


# -- the README's prefetch loop ends on every outcome --------------------------------------


def await_prefetch() -> Callable[..., None]:
    spec = importlib.util.spec_from_file_location("embed_example", EXAMPLE)
    assert spec is not None and spec.loader is not None
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    wait: Callable[..., None] = example.await_prefetch
    return wait


def stored() -> ControlledBackend:
    backend = ControlledBackend(MemoryBackend())
    cache, tier = make(backend)
    back_up(cache, tier)
    tier.detach()
    return backend


# outcome: (fault of the fetch's first batch call, whether the I/O runs)
OUTCOMES = {
    "landed": (None, True),
    "revoked (hit query failed)": (("exists", Fault("raise")), True),
    "fetch failed": (("get", Fault("raise")), True),
    "short fetch": (("get", Fault("short", 0)), True),
    "corrupt page": (("get", Fault("corrupt", 0)), True),
    "I/O never ran": (None, False),
}


@pytest.mark.parametrize("policy", ["best_effort", "wait_complete", "timeout"])
@pytest.mark.parametrize("outcome", sorted(OUTCOMES))
def test_the_documented_prefetch_loop_ends_on_every_outcome(outcome: str, policy: str) -> None:
    fault, runs = OUTCOMES[outcome]
    backend = stored()
    settings = TierSettings(prefetch_threshold=2, prefetch_token_limit=1000,
                            prefetch_policy=policy, timeout_base=10 ** 6,
                            timeout_max=10 ** 6)  # the loop, not the timeout, must end it
    cache, tier = make(backend, settings)
    if fault is not None:
        backend.inject(*fault)  # type: ignore[arg-type]
    assert tier.prefetch_from_storage("r", KEY) == 8
    if runs:
        assert tier.io is not None
        tier.io.run_pending()
    start = time.monotonic()
    await_prefetch()(tier, "r", patience_s=0.05)
    assert time.monotonic() - start < 5
    assert "r" not in tier.state.prefetches
    got = tier.pop_prefetch_loaded_tokens("r")
    assert got == (8 if outcome == "landed" else 0), got
    if tier.io is not None:
        tier.io.run_pending()
    tier.drain_storage_queues()
    tier.check()
    cache.check_invariants()
    assert cache.host_pool.num_free_slots + sum(
        n.host.numel() for n in cache.nodes() if n.host is not None) == 16
