"""The Mooncake backend (spec/09m) against a real ``mooncake_master`` on loopback: the
backend contract the memory and file backends pass, the storage tier's backup and
prefetch round trips and its conformance machine over it, two processes sharing one
store, and faults: the master killed before and in the middle of a batch, the master
restarted (every page a miss, never wrong data), a put that fails half way (the store is
full). Skipped, with the reason, where the Mooncake wheel cannot be imported."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path

import pytest
import test_storage_tier
import torch
from hypothesis import HealthCheck, settings
from hypothesis.stateful import run_state_machine_as_test
from mooncake_service import STARTED, MooncakeService, alive, mooncake_service
from test_storage_backends import (  # the backend contract, run here over this `backend`
    PAGES,
    fill,
    hashes,
    host_pool,
    source_slots,
    target_slots,
    test_bad_batch_arguments_are_typed_errors_with_no_effect,
    test_clear_forgets_every_page,
    test_counts_are_leading_runs,
    test_empty_batches_do_nothing,
    test_round_trip_is_byte_equal,
    test_set_counts_present_pages_as_done_without_rewriting,
)
from test_storage_tier import KEY, make, settle
from test_storage_tier import fill as tier_fill

from hiradix.cache import HiRadixCache
from hiradix.conformance import storage_machine
from hiradix.conformance.scenario import Scenario
from hiradix.conformance.tally import Tally
from hiradix.device_pool import DeviceKVPool
from hiradix.host_pool import HostKVPool
from hiradix.keys import RadixKey
from hiradix.storage import (
    ControlledBackend,
    Fault,
    PageIdentity,
    StorageArgumentError,
    StorageError,
    page_hashes,
)
from hiradix.storage.mooncake import (
    HEADER,
    INSTALL,
    PACKAGE,
    VERSION,
    MooncakeBackend,
    MooncakeClient,
    MooncakeUnavailable,
)
from hiradix.storage.tier import StorageTier

from stats import SUMMARY

CONTRACT = (test_round_trip_is_byte_equal, test_counts_are_leading_runs,
            test_set_counts_present_pages_as_done_without_rewriting,
            test_clear_forgets_every_page, test_empty_batches_do_nothing,
            test_bad_batch_arguments_are_typed_errors_with_no_effect)
ROOT = Path(__file__).resolve().parents[2]
SEGMENT = 16 << 20
FIGURES: Counter[str] = Counter()  # pages written and read, faults by kind: the summary


@pytest.fixture(scope="module", autouse=True)
def figures() -> Iterator[None]:
    yield
    if FIGURES:
        outlived = sum(alive(pid) for pid in STARTED)
        SUMMARY.append(f"mooncake backend: {len(STARTED)} masters started, {outlived} "
                       f"outlived their test; {dict(sorted(FIGURES.items()))}")


@pytest.fixture(scope="module")
def service() -> Iterator[MooncakeService]:
    with mooncake_service() as running:
        yield running


@pytest.fixture
def fresh_service() -> Iterator[MooncakeService]:
    """A master of this test's own, for faults that kill or restart it."""
    with mooncake_service() as running:
        yield running


def connect(service: MooncakeService, segment_bytes: int = SEGMENT) -> MooncakeBackend:
    """A backend with a client of its own (closing it takes about 2 s)."""
    return MooncakeBackend.connect(service.master, service.metadata,
                                   segment_bytes=segment_bytes)


@pytest.fixture(scope="module")
def client(service: MooncakeService) -> Iterator[MooncakeClient]:
    with MooncakeClient(service.master, service.metadata, segment_bytes=SEGMENT) as made:
        yield made


def tally(backend: MooncakeBackend | ControlledBackend) -> None:
    metrics = backend.metrics
    FIGURES["pages written"] += metrics.pages_backed_up
    FIGURES["pages read"] += metrics.pages_prefetched


@pytest.fixture
def backend(service: MooncakeService, client: MooncakeClient) -> Iterator[MooncakeBackend]:
    """A backend with fresh metrics over the module's client, emptied afterwards."""
    made = MooncakeBackend(client)
    try:
        yield made
    finally:
        tally(made)
        made.clear()
    assert service.metrics()["master_key_count"] == 0


def test_the_backend_contract_is_collected_here() -> None:
    """The contract tests imported above run in this module over the Mooncake fixture."""
    assert all(test.__module__ == "test_storage_backends" for test in CONTRACT)


# -- the storage tier over Mooncake -----------------------------------------------------


def prefetch_all(cache: HiRadixCache, tier: StorageTier, key: RadixKey) -> torch.Tensor:
    """Prefetch all of ``key`` from storage into a cache that holds none of it; the
    values that landed in its host slots."""
    tokens = len(key.tokens)
    assert tier.query_storage_hit_length(key) == tokens
    assert tier.prefetch_from_storage("r", key) == tokens
    assert tier.io is not None and tier.io.run_pending() == 1
    assert tier.check_prefetch_progress("r")
    assert tier.pop_prefetch_loaded_tokens("r") == tokens
    (node,) = cache.nodes()
    assert node.device is None and node.host is not None
    values = cache.host_pool.read(node.host)
    tier.drain_storage_queues()
    tier.check()
    cache.check_invariants()
    return values


def test_a_backup_by_one_client_is_prefetched_by_another(service: MooncakeService,
                                                         client: MooncakeClient) -> None:
    with connect(service) as writer, MooncakeBackend(client) as reader:
        first, tier1, _ = make(writer)
        values = tier_fill(first, tier1)
        settle(tier1)
        assert not tier1.state.writes
        tier1.detach()
        second, tier2, _ = make(reader)
        assert torch.equal(prefetch_all(second, tier2, KEY), values)
        tier2.detach()
        tally(writer)
        tally(reader)
        writer.clear()


@pytest.mark.parametrize("file_test", [
    test_storage_tier.test_restart_over_a_file_backend_finds_the_pages_and_the_bytes_match,
    test_storage_tier.test_another_model_identity_finds_nothing,
    test_storage_tier.test_threaded_io_backs_up_and_prefetches,
], ids=lambda test: test.__name__)
def test_the_tiers_file_backend_tests_pass_over_mooncake(
        file_test: Callable[[Path], None], client: MooncakeClient, tmp_path: Path,
        monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage tier's tests written for the file backend (restart round trip, model
    identity, threaded I/O), with every backend they make over one Mooncake client: the
    second "process" finds the first one's pages in the store."""
    made: list[MooncakeBackend] = []

    def over_mooncake(root: Path) -> MooncakeBackend:
        made.append(MooncakeBackend(client))
        return made[-1]

    monkeypatch.setattr(test_storage_tier, "FileBackend", over_mooncake)
    file_test(tmp_path)
    assert made
    for backend in made:
        tally(backend)
    made[0].clear()


def test_the_storage_machine_runs_over_mooncake(client: MooncakeClient,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The storage conformance machine with this backend under its controlled wrapper:
    each example starts from an empty store, as its model does."""
    with MooncakeBackend(client) as shared:
        def empty_store() -> MooncakeBackend:
            shared.clear()
            return shared

        monkeypatch.setattr(storage_machine, "MemoryBackend", empty_store)
        faults: Counter[str] = Counter()
        machine_tally = Tally()
        machine = storage_machine.make_storage_machine(Scenario(), machine_tally, faults)
        run_state_machine_as_test(machine, settings=settings(
            max_examples=15, stateful_step_count=30, deadline=None,
            derandomize=True,  # issue 35: what it reaches (asserted below) is not luck
            suppress_health_check=[HealthCheck.too_slow, HealthCheck.filter_too_much]))
        assert machine_tally.examples > 0 and machine_tally.checks > 0
        assert shared.metrics.pages_backed_up + faults["pages written to storage"] > 0
        FIGURES["machine examples"] += machine_tally.examples
        FIGURES["machine steps"] += machine_tally.steps
        FIGURES["pages written"] += faults["pages written to storage"]
        for kind, count in faults.items():
            if kind.split(":")[0] in ("exists", "get", "set") and not kind.endswith("untaken"):
                FIGURES[f"machine fault {kind}"] += count
        shared.clear()


# -- two processes ----------------------------------------------------------------------

OTHER = RadixKey(tuple(range(101, 109)))
CHILD = textwrap.dedent("""
    import sys
    import torch
    from test_storage_mooncake import KEY, OTHER, make, prefetch_all, settle, tier_fill
    from hiradix.storage.mooncake import MooncakeBackend

    with MooncakeBackend.connect(sys.argv[1], sys.argv[2], segment_bytes=16 << 20) as backend:
        cache, tier, _ = make(backend)
        tier_fill(cache, tier, OTHER, seed=5)
        settle(tier)
        print("stored", flush=True)
        assert sys.stdin.readline() == "go\\n"
        other, tier2, _ = make(backend)
        expected = torch.randn(other.device_pool.value_shape(len(KEY.tokens)),
                               generator=torch.Generator().manual_seed(4)
                               ).to(other.device_pool.dtype)
        assert torch.equal(prefetch_all(other, tier2, KEY), expected)
        print("found", flush=True)
        assert sys.stdin.readline() == "bye\\n"
""")


def test_two_processes_sharing_one_store_find_each_others_pages(
        service: MooncakeService, client: MooncakeClient) -> None:
    path = os.pathsep.join([str(ROOT / "tests" / "impl"), str(ROOT / "tests"),
                            str(ROOT / "tests" / "model"), os.environ.get("PYTHONPATH", "")])
    child = subprocess.Popen([sys.executable, "-c", CHILD, service.master, service.metadata],
                             cwd=ROOT, env={**os.environ, "PYTHONPATH": path}, text=True,
                             stdin=subprocess.PIPE, stdout=subprocess.PIPE)
    assert child.stdin is not None and child.stdout is not None
    try:
        assert child.stdout.readline() == "stored\n"
        with MooncakeBackend(client) as backend:
            cache, tier, _ = make(backend)
            values = tier_fill(cache, tier, KEY, seed=4)
            settle(tier)
            other, tier2, _ = make(backend)
            expected = torch.randn(other.device_pool.value_shape(len(OTHER.tokens)),
                                   generator=torch.Generator().manual_seed(5)
                                   ).to(other.device_pool.dtype)
            assert torch.equal(prefetch_all(other, tier2, OTHER), expected)
            child.stdin.write("go\n")
            child.stdin.flush()
            assert child.stdout.readline() == "found\n"  # the child read ours, byte-equal
            child.stdin.write("bye\n")
            child.stdin.flush()
            assert child.wait(timeout=60) == 0
            assert values.numel() > 0
            tally(backend)
            FIGURES["pages read across processes"] += 2 * len(KEY.tokens) // 2  # both ways
            backend.clear()
    finally:
        if child.poll() is None:
            os.kill(child.pid, 9)
            child.wait()


# -- faults -------------------------------------------------------------------------------


def stored(backend: MooncakeBackend) -> tuple[HostKVPool, list[str]]:
    pool = host_pool()
    fill(pool, source_slots())
    names = hashes()
    assert backend.set(names, pool, source_slots()) == PAGES
    return pool, names


@contextmanager
def stored_then(service: MooncakeService, fault: str
                ) -> Iterator[tuple[MooncakeBackend, HostKVPool, list[str]]]:
    """A backend with ``PAGES`` pages stored, then the master ``killed`` or
    ``restarted`` (and the client's segment mounted again)."""
    with connect(service) as backend:
        pool, names = stored(backend)
        if fault == "killed":
            service.kill()
        else:
            service.restart()
            service.wait_capacity(SEGMENT)
        FIGURES[f"fault master {fault}"] += 1
        yield backend, pool, names
        tally(backend)


def test_a_master_killed_before_a_batch_fails_every_call_and_never_hits(
        fresh_service: MooncakeService) -> None:
    with stored_then(fresh_service, "killed") as (backend, pool, names):
        for call in (lambda: backend.exists(names),
                     lambda: backend.get(names, pool, target_slots()),
                     lambda: backend.set(names, pool, source_slots())):
            with pytest.raises(StorageError) as raised:
                call()
            assert raised.value.pages_done == 0
        assert backend.metrics.errors == 3 and backend.metrics.hits == 0


@pytest.mark.parametrize("operation", ["get", "set"])
def test_a_master_killed_mid_batch_keeps_the_leading_pages(
        fresh_service: MooncakeService, operation: str) -> None:
    """The batch is held at page 2 (a ``slow`` fault of the controlled wrapper, whose
    batches use this backend's page primitives), the master is killed, the batch goes
    on: it fails at page 2 with the two pages before it done."""
    with connect(fresh_service) as inner:
        backend = ControlledBackend(inner, name="mooncake")
        pool, names = stored(inner) if operation == "get" else (host_pool(), hashes())
        if operation == "set":
            fill(pool, source_slots())
        backend.inject(operation, Fault("slow", 2))  # type: ignore[arg-type]
        slots = target_slots() if operation == "get" else source_slots()
        outcome: list[BaseException] = []

        def run() -> None:
            try:
                call = backend.get if operation == "get" else backend.set
                call(names, pool, slots)
            except StorageError as error:
                outcome.append(error)

        worker = threading.Thread(target=run)
        worker.start()
        assert backend.wait_held()
        fresh_service.kill()
        FIGURES[f"fault master killed mid-{operation}"] += 1
        backend.release()
        worker.join(timeout=60)
        assert not worker.is_alive()
        (error,) = outcome
        assert isinstance(error, StorageError) and error.pages_done == 2
        if operation == "get":
            assert torch.equal(pool.read(target_slots()[:2 * 2]),
                               pool.read(source_slots()[:2 * 2]))
        else:
            assert backend.metrics.pages_backed_up == 2
        tally(backend)
        tally(inner)


def test_a_restarted_master_has_no_pages_so_every_page_is_a_miss(
        fresh_service: MooncakeService) -> None:
    with stored_then(fresh_service, "restarted") as (backend, pool, names):
        reader = host_pool()
        assert backend.exists(names) == 0
        assert backend.fetch(names, reader, target_slots()).pages_done == 0
        assert backend.metrics.corrupt == 0
        # The store works again: the same pages are written anew and read back equal.
        assert backend.set(names, pool, source_slots()) == PAGES
        assert backend.get(names, reader, target_slots()) == PAGES
        assert torch.equal(reader.read(target_slots()), pool.read(source_slots()))


def test_a_restarted_master_is_a_storage_miss_for_the_tier(
        fresh_service: MooncakeService) -> None:
    with connect(fresh_service) as backend:
        cache, tier, _ = make(backend)
        tier_fill(cache, tier)
        settle(tier)
        tier.detach()
        fresh_service.restart()
        FIGURES["fault master restarted"] += 1
        fresh_service.wait_capacity(SEGMENT)
        second, tier2, _ = make(backend)
        assert tier2.query_storage_hit_length(KEY) == 0
        free = second.host_pool.num_free_slots
        assert tier2.prefetch_from_storage("r", KEY) == len(KEY.tokens)  # reserved
        assert tier2.io is not None and tier2.io.run_pending() == 1
        assert tier2.check_prefetch_progress("r")
        assert tier2.pop_prefetch_loaded_tokens("r") == 0  # every page missed
        assert not second.nodes()
        tier2.drain_storage_queues()
        assert second.host_pool.num_free_slots == free
        tier2.check()
        tally(backend)


def big_pages(pages: int) -> HostKVPool:
    """A host pool of 2 MiB pages (16 tokens of 128 KiB)."""
    device = DeviceKVPool(num_slots=16, page_size=16, layers=8, layout="mha", heads=32,
                          head_dim=64, latent_dim=8, dtype=torch.float32)
    return HostKVPool(device, num_slots=pages * 16, layout="layer_first")


def settled(service: MooncakeService, backend: MooncakeBackend, names: list[str]
            ) -> tuple[list[bool], dict[str, float]]:
    """Which of ``names`` are stored, and the master's metrics, once two readings of the
    metrics around the lookup agree (the master evicts in the background)."""
    for _ in range(100):
        before = service.metrics()
        present = [backend.has_page(name) for name in names]
        after = service.metrics()
        fields = ("master_key_count", "master_allocated_bytes")
        if all(before[field] == after[field] for field in fields):
            return present, after
        time.sleep(0.05)
    raise AssertionError("the master's key count never settled")


def test_a_put_that_fails_half_way_stores_a_prefix_and_leaks_nothing(
        fresh_service: MooncakeService) -> None:
    """A 16 MiB segment (Mooncake's least), the only one in the store, holds 7 pages of
    2 MiB and their headers; a batch of 10 fails at the page that does not fit. No page
    past it is stored, the pages before it that the store kept read back equal (the
    failed allocation makes Mooncake evict some objects: those are misses), and the
    master holds exactly the kept objects' bytes: the failed put leaks no allocation."""
    pages = 10
    pool = big_pages(2 * pages)
    slots = torch.arange(pages * 16)
    fill(pool, slots)
    identity = PageIdentity.for_pool(pool, "m")
    names = page_hashes(list(range(pages * 16)), 16, identity, None)
    object_bytes = HEADER.size + 16 * pool.bytes_per_token
    with connect(fresh_service) as backend:
        with pytest.raises(StorageError) as raised:
            backend.set(names, pool, slots)
        FIGURES["fault put failed half way"] += 1
        done = raised.value.pages_done
        assert done == SEGMENT // object_bytes == 7
        assert backend.metrics.pages_backed_up == done
        present, metrics = settled(fresh_service, backend, names)
        assert not any(present[done:])
        kept = [index for index in range(done) if present[index]]
        FIGURES["pages evicted by the store"] += done - len(kept)
        assert metrics["master_key_count"] == len(kept)
        assert metrics["master_allocated_bytes"] == len(kept) * object_bytes
        for index in kept:
            into = torch.arange((pages + index) * 16, (pages + index + 1) * 16)
            page = slots[index * 16:(index + 1) * 16]
            assert backend.get(names[index:index + 1], pool, into) == 1
            assert torch.equal(pool.read(into), pool.read(page))
        backend.clear()
        after = fresh_service.metrics()
        assert after["master_key_count"] == 0 and after["master_allocated_bytes"] == 0
        tally(backend)


@pytest.mark.parametrize("payload_bytes", [7, 10_000])
def test_a_damaged_object_is_a_corrupt_miss_and_is_stored_again(
        backend: MooncakeBackend, payload_bytes: int) -> None:
    """An object under a page's key that is not that page (shorter, or longer than the
    batch read's slot) is corrupt, discarded, and the next backup stores the page
    again."""
    pool, names = stored(backend)
    backend.discard_page(names[1])
    backend.write_page(names[1], b"\x01" * payload_bytes, b"\x00" * 32)
    reader = host_pool()
    fetched = backend.fetch(names, reader, target_slots())
    assert fetched.pages_done == 1 and fetched.corrupt
    assert backend.exists(names) == 1  # discarded
    assert backend.set(names, pool, source_slots()) == PAGES
    assert backend.get(names, reader, target_slots()) == PAGES
    assert torch.equal(reader.read(target_slots()), pool.read(source_slots()))
    FIGURES["fault corrupt object"] += 1


def test_without_the_wheel_the_error_is_one_line_naming_package_and_command(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "mooncake.store", None)  # import fails as if absent
    with pytest.raises(MooncakeUnavailable) as raised:
        MooncakeClient("127.0.0.1:1", "http://127.0.0.1:2/metadata")
    message = str(raised.value)
    assert "\n" not in message and raised.value.field == "backend"
    assert f"{PACKAGE}=={VERSION}" in message and INSTALL in message
    with pytest.raises(StorageArgumentError) as bad:
        MooncakeBackend("not a client")  # type: ignore[arg-type]
    assert bad.value.argument == "client"
